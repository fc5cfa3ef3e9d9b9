"""Distributed semantics: a 2-rank step equals a 1-rank step over the same prompts.

Two CPU processes (gloo) run :class:`MaxEntGRPOModule` under Lightning's DDP strategy (and
once under ``ModelParallelStrategy``, i.e. FSDP2 ``fully_shard``), each with ``B`` prompts
per step; one process runs the same configuration with ``2B`` prompts per step. The
DataModule's sampler gives the two ranks disjoint halves of exactly the prompts the single
process sees, and a scripted rollout engine returns the same completions for a prompt in
every run, so the runs must agree on:

- the prompts of every step (disjoint across ranks, their union = the 1-rank batch);
- the gradient at every optimizer step (after DDP's all-reduce / FSDP's reduce-scatter);
- the parameters after the run (plain SGD, so equal gradients give equal parameters);
- every logged ``train/...`` metric (the loss, rewards, KL, clip fractions, weight
  entropy, grad norm, ...), identical on both ranks;
- the controller-driven objective state (tau of a ``TauController``).

Only the timings (``train/perf/...``, ``train/vllm_latency_ms``) may differ.

The ranks are launched the way a cluster launcher would (``torch.multiprocessing`` with
``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``LOCAL_RANK`` set), once for all cases, so
``import lightning`` is paid once per process.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lightning.pytorch as pl  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from maxent_grpo.models import resolve_model_path  # noqa: E402
from maxent_grpo.objectives import GRPO, ListwiseMaxEnt  # noqa: E402
from maxent_grpo.rollout import HFGenerateEngine, SamplingSettings  # noqa: E402
from maxent_grpo.rollout.weights import checkpoint_weights  # noqa: E402
from maxent_grpo.training.callbacks import HFExport, TauController  # noqa: E402
from maxent_grpo.training.data.datamodule import PromptDataModule  # noqa: E402
from maxent_grpo.training.module import MaxEntGRPOModule  # noqa: E402
from maxent_grpo.training.step.optimise import clip_gradients  # noqa: E402
from maxent_grpo.training.step.strategy import fully_shard_models  # noqa: E402

WORLD = 2
B = 2  # prompts per rank and step; the 1-rank run takes WORLD * B
G = 4
T_MAX = 5
STEPS = 2
#: keys whose values are wall-clock measurements, per rank
TIMING_KEYS = ("train/perf/", "train/vllm_latency_ms")


# ---------------------------------------------------------------------- scripted rollout
def scripted_text(prompt: str, answer: str, g: int, max_new_tokens: int) -> tuple[str, bool]:
    """Completion ``g`` of ``prompt``: a function of the prompt text and ``g`` only.

    Returns ``(text, stops)``; ``stops`` False means the row is cut at ``max_new_tokens``.
    Four kinds, picked by a hash of the prompt and ``g``: the right answer, a wrong one,
    the right answer repeated up to the length limit (truncated), and a non-number.
    """
    k = int.from_bytes(hashlib.sha256(f"{prompt}|{g}".encode()).digest()[:4], "little")
    n = int(answer)
    kind = k % 4
    if kind == 0:
        return f" {n}", True
    if kind == 1:
        return f" {n + 1 + k % 3}", True
    if kind == 2:
        return (f"{n}=" * max_new_tokens)[:max_new_tokens], False
    return "?", True


class ScriptedLM(torch.nn.Module):
    """Stands in for the policy inside :class:`HFGenerateEngine`: ``generate`` appends the
    scripted completions (plus EOS, then padding) to the left-padded prompts."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.generation_config = GenerationConfig()
        self.answers: list[str] = []

    def row(self, text: str, b: int, g: int, limit: int) -> list[int]:
        """The ids of sample ``g`` of input row ``b`` (decoded: ``text``)."""
        completion, stops = scripted_text(text, self.answers[b], g, limit)
        ids = self.tokenizer(completion, add_special_tokens=False)["input_ids"]
        return ids + [self.tokenizer.eos_token_id] if stops else ids

    def generate(self, input_ids, attention_mask, generation_config):
        tok = self.tokenizer
        group, limit = generation_config.num_return_sequences, generation_config.max_new_tokens
        rows = [self.row(tok.decode(input_ids[b][attention_mask[b].bool()]), b, g, limit)
                for b in range(input_ids.shape[0]) for g in range(group)]
        assert all(len(r) <= limit for r in rows)
        completions = torch.full((len(rows), max(map(len, rows))), tok.pad_token_id)
        for i, ids in enumerate(rows):
            completions[i, : len(ids)] = torch.tensor(ids)
        return torch.cat([input_ids.repeat_interleave(group, 0), completions], 1)


class ScriptedEngine:
    """The real :class:`HFGenerateEngine` around :class:`ScriptedLM` (masks, truncation
    flags and texts come from the production code); a ``model.engine`` factory, so the
    policy it is given is not used for sampling."""

    def __init__(self, model, tokenizer, sampling: SamplingSettings) -> None:
        self.lm = ScriptedLM(tokenizer)
        self.inner = HFGenerateEngine(self.lm, tokenizer, sampling)

    def generate(self, prompts: list[str], answers: list[str], num_generations: int,
                 sampling: SamplingSettings | None = None):
        self.lm.answers = list(answers)
        return self.inner.generate(prompts, answers, num_generations, sampling)

    def sync(self, model) -> None:
        """The scripted model does not follow the policy's weights."""


class SamplerScriptedEngine(ScriptedEngine):
    """:class:`ScriptedEngine` that also reports the sampler's log-probs (as vLLM does): a
    function of the completion's tokens only, so every run agrees on them; the step then
    logs ``rollout/logp_gap/...`` and can correct for the gap (``sampler_correction``)."""

    def generate(self, prompts, answers, num_generations, sampling=None):
        import dataclasses

        out = super().generate(prompts, answers, num_generations, sampling)
        logps = -0.1 - (out.completion_ids % 7).float() * 0.3
        return dataclasses.replace(out, sampler_logps=logps.masked_fill(~out.completion_mask, 0))


def tool_turn(text: str) -> str:
    """A turn of the ``tools`` case as a function of the text so far (prompt and earlier
    turns): after a tool message, its result copied (or "?", by a hash); otherwise a call
    of ``calculate`` on the prompt's sum, a call of a tool that does not exist, or a wrong
    direct answer."""
    k = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
    if "<tool_response>" in text:
        result = text.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0]
        return result if k % 3 else "?"
    a, b = re.search(r"(\d+) \+ (\d+) =", text).groups()
    kind = k % 3
    if kind == 2:
        return str(int(a) + int(b) + 1)
    name = "calculate" if kind == 0 else "search"
    call = {"name": name, "arguments": {"expression": f"{a} + {b}"}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


class ToolScriptedLM(ScriptedLM):
    """:class:`ScriptedLM` for the ``tools`` case: every row's turn is :func:`tool_turn` of
    its text so far (sample ``g`` of a prompt adds ``g`` to the text hashed), plus EOS."""

    def row(self, text: str, b: int, g: int, limit: int) -> list[int]:
        ids = self.tokenizer(tool_turn(text + "|" * g), add_special_tokens=False)["input_ids"]
        return (ids + [self.tokenizer.eos_token_id])[:limit]


class ToolScriptedEngine(ScriptedEngine):
    """:class:`ScriptedEngine` on :class:`ToolScriptedLM`, able to continue (multi-turn)."""

    def __init__(self, model, tokenizer, sampling: SamplingSettings) -> None:
        self.lm = ToolScriptedLM(tokenizer)
        self.inner = HFGenerateEngine(self.lm, tokenizer, sampling)

    def continue_ids(self, sequences, budgets, sampling):
        return self.inner.continue_ids(sequences, budgets, sampling)


def odd_sums_score_zero(prompts, completions, answer, **columns):
    """``first_number``, except that prompts with an odd sum score 0 (a constant group)."""
    from maxent_grpo.rewards import first_number_reward

    scores = first_number_reward(prompts, completions, answer=answer)
    return [0.0 if int(a) % 2 else s for s, a in zip(scores, answer, strict=True)]


# ---------------------------------------------------------------------- one run
def full(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU copy (FSDP2 parameters and gradients are DTensor shards)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu().clone()


#: gradient all-reduce calls of this process (one per DDP bucket reduced)
ALLREDUCES = [0]


def counting_allreduce(state, bucket):
    """DDP's default all-reduce hook, counted."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ALLREDUCES[0] += 1
    return allreduce_hook(state, bucket)


class Probe(pl.Callback):
    """Records each step's prompt indices, gradients, logged stats and objective state."""

    def __init__(self) -> None:
        self.indices: list[list[int]] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.stats: list[dict[str, float]] = []
        self.state: list[dict[str, float]] = []
        self.kept: list[int] = []
        self.allreduces: list[int] = []  # per optimizer step
        self.passes: list[tuple[int, int]] = []  # (micro-batches, of which padding) per step
        self._seen = 0

    def on_train_start(self, trainer, pl_module) -> None:
        # Lightning registers ddp_comm_hook on CUDA only; the DDP model takes it on gloo too
        if isinstance(trainer.strategy.model, torch.nn.parallel.DistributedDataParallel):
            trainer.strategy.model.register_comm_hook(None, counting_allreduce)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.indices.append(list(batch["indices"]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append({n: full(p.grad) for n, p in pl_module.policy.named_parameters()
                           if p.grad is not None})  # frozen weights (LoRA) have none
        self.allreduces.append(ALLREDUCES[0] - self._seen)
        self._seen = ALLREDUCES[0]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.stats.append(dict(pl_module.step_metrics_dict))  # the step's logged dict
        targets = pl_module.trajectory.targets  # this rank's groups that took part
        kept = 0 if pl_module.trajectory.ghost else int(pl_module.trajectory.keep.sum())
        self.kept.append(kept if targets.weights is not None or targets.advantages is not None
                         else 0)
        chunks = pl_module.trajectory.chunks
        self.passes.append((len(chunks), sum(getattr(c, "padding", False) for c in chunks)))
        self.state.append(dict(pl_module.objective.state()))


#: the LoRA of the ``*lora*`` cases (``peft.LoraConfig`` arguments)
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "lora_dropout": 0.0}

CASES: dict[str, dict[str, Any]] = {
    # several micro-batches (one group each) -> several backward passes per step
    "dr_grpo": {"objective": ("grpo", {"loss_type": "dr_grpo", "scale_rewards": "group"}),
                "micro_batch_groups": 1},
    # dapo's all-rank token count, the KL to the reference, the whole-batch reward std,
    # two optimizer steps per rollout (importance ratios != 1) and active clipping
    "dapo_kl": {"objective": ("grpo", {"loss_type": "dapo", "scale_rewards": "batch",
                                       "beta": 0.1, "epsilon_high": 0.28}),
                "num_iterations": 2, "gradient_clip_val": 0.05},
    # listwise weights with the reference, and a controller moving tau between steps
    "listwise": {"objective": ("listwise", {"tau": 0.5, "beta": 0.05}),
                 "micro_batch_groups": 1, "tau_controller": True},
    # constant groups dropped: the ranks keep different numbers of groups (one may keep
    # none and only join the gradient reduction), and the losses are normalised over the
    # groups kept on all ranks
    "listwise_drop": {"objective": ("listwise", {"tau": 0.5, "length_normalize": True}),
                      "drop_constant_groups": True,
                      "rewards": {"tests.test_distributed:odd_sums_score_zero": 1.0}},
    # FSDP2 (fully_shard through ModelParallelStrategy): compared with the 1-rank dr_grpo
    "fsdp_dr_grpo": {"objective": ("grpo", {"loss_type": "dr_grpo", "scale_rewards": "group"}),
                     "micro_batch_groups": 1, "strategy": "fsdp", "reference": "dr_grpo"},
    # LoRA adapters (model.peft) with the KL to the reference, i.e. to the policy with its
    # adapters disabled: under DDP, and under FSDP2 compared with the same 1-rank run
    "lora_kl": {"objective": ("grpo", {"loss_type": "dapo", "beta": 0.1}),
                "micro_batch_groups": 1, "peft": LORA},
    "fsdp_lora_kl": {"objective": ("grpo", {"loss_type": "dapo", "beta": 0.1}),
                     "micro_batch_groups": 1, "peft": LORA, "strategy": "fsdp",
                     "reference": "lora_kl"},
    # issue 36: a rank that keeps no group (a ghost) while the sampler reports log-probs:
    # every rank must hold and reduce the same metrics (rollout/logp_gap/..., the sampler
    # correction) in the same order; one group per micro-batch, so the ranks plan different
    # numbers of passes, and FSDP2 (a collective in every forward and backward) must pad
    "ghost_gap": {"objective": ("grpo", {"loss_type": "dr_grpo", "scale_rewards": "group"}),
                  "drop_constant_groups": True, "micro_batch_groups": 1, "sampler": True,
                  "sampler_correction": "token_tis",
                  "rewards": {"tests.test_distributed:odd_sums_score_zero": 1.0}},
    "fsdp_ghost_gap": {"objective": ("grpo", {"loss_type": "dr_grpo",
                                              "scale_rewards": "group"}),
                       "drop_constant_groups": True, "micro_batch_groups": 1, "sampler": True,
                       "sampler_correction": "token_tis", "strategy": "fsdp",
                       "rewards": {"tests.test_distributed:odd_sums_score_zero": 1.0},
                       "reference": "ghost_gap"},
    # multi-turn rollouts with a tool (model.tools): the tool's messages out of the loss and
    # of dapo's all-rank token count, the train/tools/... statistics reduced over the ranks
    "tools": {"objective": ("grpo", {"loss_type": "dapo", "beta": 0.1}),
              "micro_batch_groups": 1, "tools": True},
    # the same under FSDP2: the ranks' multi-turn loops continue together (a rank with
    # nothing left runs a placeholder token so the sharded forwards stay paired)
    "fsdp_tools": {"objective": ("grpo", {"loss_type": "dapo", "beta": 0.1}),
                   "micro_batch_groups": 1, "tools": True, "strategy": "fsdp",
                   "reference": "tools"},
}


def run_case(name: str, world: int, cache_dir: str, root: str) -> dict[str, Any]:
    """Fit ``CASES[name]`` for ``STEPS`` steps on ``world`` processes (this is one of them)."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    case = CASES[name]
    kind, kwargs = case["objective"]
    objective = GRPO(**kwargs) if kind == "grpo" else ListwiseMaxEnt(**kwargs)
    module = MaxEntGRPOModule(
        model_name_or_path="builtin:tiny",
        engine=(ToolScriptedEngine if case.get("tools") else
                SamplerScriptedEngine if case.get("sampler") else ScriptedEngine),
        sampler_correction=case.get("sampler_correction"),
        tools=["calculate"] if case.get("tools") else None,
        objective=objective,
        rewards=case.get("rewards", {"first_number": 1.0}),
        drop_constant_groups=case.get("drop_constant_groups", False),
        num_generations=G,
        max_completion_length=160 if case.get("tools") else T_MAX,
        max_prompt_length=None if case.get("tools") else 32,
        num_iterations=case.get("num_iterations", 1),
        micro_batch_groups=case.get("micro_batch_groups"),
        gradient_clip_val=case.get("gradient_clip_val"),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        model_cache_dir=cache_dir,
        peft=LoraConfig(**case["peft"]) if "peft" in case else None,
    )
    data = PromptDataModule(
        task="arithmetic_easy", task_options={"bare": True}, train_size=48, val_size=4,
        seed=3, tokenizer="builtin:tiny", tokenizer_cache_dir=cache_dir,
        max_prompt_length=None if case.get("tools") else 32, batch_size=B * (WORLD // world),
        tools=["calculate"] if case.get("tools") else None,
    )
    probe = Probe()
    callbacks: list[pl.Callback] = []
    if case.get("tau_controller"):
        callbacks.append(TauController(target_entropy=1.0, lr=0.5, tau_min=0.05, tau_max=5.0))
    callbacks.append(probe)
    export = Path(root) / "hf" / name
    if case.get("strategy") == "fsdp":  # every rank gathers the shards, rank 0 writes
        callbacks.append(HFExport(dirpath=str(export), merged="peft" in case))
    if world == 1:
        strategy: Any = "auto"
    elif case.get("strategy") == "fsdp":
        # a hang (a collective one rank never joins) fails after a minute instead
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                         timeout=timedelta(seconds=60))
    else:
        strategy = DDPStrategy(process_group_backend="gloo")
    trainer = pl.Trainer(
        # max_steps counts optimizer steps: num_iterations per training step
        accelerator="cpu", devices=world, strategy=strategy,
        max_steps=STEPS * case.get("num_iterations", 1),
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=callbacks, default_root_dir=root,
    )
    trainer.fit(module, datamodule=data)
    out = {
        "indices": probe.indices, "grads": probe.grads, "stats": probe.stats,
        "state": probe.state, "kept": probe.kept, "allreduces": probe.allreduces,
        "passes": probe.passes,
        "params": {n: full(p) for n, p in module.policy.named_parameters()},
        # what the vLLM engine would load: FSDP2 shards gathered, adapters merged
        "checkpoint": {n: t.clone() for n, t in checkpoint_weights(module.policy)},
        "export": export if trainer.is_global_zero and case.get("strategy") == "fsdp" else None,
    }
    if case.get("strategy") == "fsdp":
        # the real engine generates with the sharded policy (both ranks take part); rank 0's
        # completions all stop at their first token (every id is a stop token there) while
        # rank 1's go on: rank 0 must keep joining the forward passes (synced_gpus)
        stop = list(range(len(module.tokenizer))) if trainer.global_rank == 0 else None
        engine = HFGenerateEngine(module.policy, module.tokenizer, module.loop.generation.sampling,
                                  stop_token_ids=stop)
        calls = []
        lm = module.policy.get_base_model() if "peft" in case else module.policy
        hook = lm.register_forward_pre_hook(lambda *_: calls.append(1))
        rollout = engine.generate(["1 + 2 =", "3 + 4 ="], ["3", "7"], 2)
        hook.remove()
        out["generated_rows"] = int(rollout.completion_ids.shape[0])
        out["generated_tokens"] = rollout.completion_mask.sum(-1).tolist()
        out["generate_forwards"] = len(calls)  # collectives this rank joined
    return out


def predict_unequal(cache_dir: str, root: str) -> dict[str, Any]:
    """``trainer.predict`` on a plain DataLoader of 5 prompts, one a batch: Lightning's
    predict sampler gives rank 0 three batches and rank 1 two. The per-batch SIGTERM check
    (an ``all_reduce``) must not run there: rank 0's third one met rank 1's count of the
    @k summary, read a 2 as "signalled" and stopped, rank 1 failing after it."""
    from torch.utils.data import DataLoader

    from maxent_grpo.training.data import collate_prompts

    module = MaxEntGRPOModule(model_name_or_path="builtin:tiny", engine=ScriptedEngine,
                              rewards={"first_number": 1.0}, num_generations=2,
                              max_completion_length=T_MAX, max_prompt_length=32,
                              model_cache_dir=cache_dir)
    data = PromptDataModule(task="arithmetic_easy", task_options={"bare": True},
                            train_size=8, val_size=5, tokenizer="builtin:tiny",
                            tokenizer_cache_dir=cache_dir, max_prompt_length=32)
    data.setup("validate")
    seen: list[int] = []

    class Count(pl.Callback):
        def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx,
                                 dataloader_idx=0):
            seen.append(batch_idx)

    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=root, callbacks=[Count()])
    loader = DataLoader(data.val_dataset, batch_size=1, collate_fn=collate_prompts)
    trainer.predict(module, dataloaders=loader, return_predictions=False)
    return {"batches": seen, "stopped": trainer.received_sigterm}


def _worker(rank: int, port: int, out_dir: str, cache_dir: str) -> None:
    """One of the ``WORLD`` ranks: every case in turn, results to ``out_dir/rank{r}.pt``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD),
        NODE_RANK="0", LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
    )
    torch.set_num_threads(1)
    results = {
        name: run_case(name, WORLD, cache_dir, str(Path(out_dir) / f"root{rank}"))
        for name in CASES
    }
    results["predict_unequal"] = predict_unequal(cache_dir, str(Path(out_dir) / f"p{rank}"))
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- comparisons
def close(a: float, b: float, rel: float = 1e-5, abs_: float = 1e-6) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def untimed(stats: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in stats.items() if not k.startswith(TIMING_KEYS)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    """``{"one": {case: result}, "ranks": [{case: result}, {case: result}]}``."""
    tmp = tmp_path_factory.mktemp("distributed")
    cache = str(tmp / "models")
    resolve_model_path("builtin:tiny", cache)  # materialised once, before any rank loads it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = {
            name: run_case(name, 1, cache, str(tmp / "one"))
            for name in CASES if "reference" not in CASES[name]
        }
    finally:
        torch.set_num_threads(threads)
    torch.multiprocessing.start_processes(
        _worker, args=(free_port(), str(tmp), cache), nprocs=WORLD, join=True,
        start_method="spawn",
    )
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return {"one": one, "ranks": ranks}


@pytest.mark.slow  # two spawned ranks (18 s): .ci/run's slow set
def test_ddp_reduces_gradients_once_per_optimizer_step(runs):
    """Micro-batches accumulate without synchronisation: a step of one backward pass per
    group (``dr_grpo``: 2 per rank) all-reduces as often as a step of one backward pass
    (``dapo_kl``), i.e. once per gradient bucket (DDP has more, smaller buckets until it
    rebuilds them after the first step)."""
    for rank in runs["ranks"]:
        many, single = rank["dr_grpo"]["allreduces"], rank["dapo_kl"]["allreduces"]
        assert min(single) >= 1 and len(many) >= 2, (many, single)
        # measured: [1, 1] vs [5, 1, 1, 1]; with a reduction per backward pass, [2, 2]
        assert many[0] <= single[0] and many[1:] == single[1 : len(many)], (many, single)


@pytest.mark.slow  # two spawned ranks (18 s): .ci/run's slow set
def test_predict_with_more_batches_on_one_rank_runs_to_its_end(runs):
    """No SIGTERM check between batches where the ranks have different counts."""
    assert [rank["predict_unequal"] for rank in runs["ranks"]] == [
        {"batches": [0, 1, 2], "stopped": False}, {"batches": [0, 1], "stopped": False}]


@pytest.mark.slow  # two spawned ranks (18 s): .ci/run's slow set
@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_rank(runs, name):
    r0, r1 = (runs["ranks"][r][name] for r in range(WORLD))
    one = runs["one"][CASES[name].get("reference", name)]

    # prompts: each rank B distinct prompts per step, together exactly the 1-rank batch
    for step in range(STEPS):
        a, b, both = r0["indices"][step], r1["indices"][step], one["indices"][step]
        assert len(a) == len(b) == B and not set(a) & set(b)
        assert sorted(a + b) == sorted(both)

    # gradients at every optimizer step: identical on the ranks, equal to the 1-rank ones
    assert len(r0["grads"]) == len(one["grads"]) == STEPS * CASES[name].get("num_iterations", 1)
    for g0, g1, g in zip(r0["grads"], r1["grads"], one["grads"], strict=True):
        assert max(float(v.abs().max()) for v in g.values()) > 1e-4  # a real signal
        for key, value in g.items():
            assert torch.equal(g0[key], g1[key]), key
            torch.testing.assert_close(
                g0[key], value, rtol=1e-4, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}"
            )

    # parameters after the run
    for key, value in one["params"].items():
        assert torch.equal(r0["params"][key], r1["params"][key]), key
        torch.testing.assert_close(
            # each rank pads and trims its own micro-batches, so matmul shapes (and float
            # rounding) differ from the 1-rank run's: a few 1e-6 after the SGD steps
            r0["params"][key], value, rtol=1e-5, atol=5e-6, msg=lambda m, k=key: f"{k}: {m}"
        )

    # the weights a vLLM engine on each rank would load: whole (gathered under FSDP2), the
    # plain model's names, adapters merged; the same on both ranks and as on one rank
    assert list(r0["checkpoint"]) == list(one["checkpoint"])
    assert not any("lora_" in key or "base_layer" in key for key in one["checkpoint"])
    for key, value in one["checkpoint"].items():
        assert r0["checkpoint"][key].shape == value.shape, key
        assert torch.equal(r0["checkpoint"][key], r1["checkpoint"][key]), key
        torch.testing.assert_close(r0["checkpoint"][key], value, rtol=1e-5, atol=5e-6,
                                   msg=lambda m, k=key: f"{k}: {m}")

    # every logged metric, and the objective state the controllers moved
    for step in range(STEPS):
        s0, s1, s = (untimed(x["stats"][step]) for x in (r0, r1, one))
        assert s0 == s1
        assert set(s0) == set(s), set(s0) ^ set(s)
        bad = {k: (s0[k], s[k]) for k in s if not close(s0[k], s[k])}
        assert not bad, bad
        assert r0["state"][step] == r1["state"][step]
        assert all(close(r0["state"][step][k], v) for k, v in one["state"][step].items())
    if CASES[name].get("tau_controller"):
        assert one["state"][0]["tau"] != 0.5  # the controller did move tau
    if CASES[name].get("drop_constant_groups"):  # the ranks kept different numbers of groups
        assert [a + b for a, b in zip(r0["kept"], r1["kept"], strict=True)] == one["kept"]
        assert r0["kept"] != r1["kept"], (r0["kept"], r1["kept"])
        # one rank kept no group at some step: it scored a ghost group at weight zero
        assert 0 in r0["kept"] + r1["kept"], (r0["kept"], r1["kept"])
    if CASES[name].get("sampler"):  # the gap and the correction are logged on both ranks
        for step in range(STEPS):
            assert {"train/rollout/logp_gap/mean", "train/rollout/logp_gap/max",
                    "train/rollout/correction/mean"} <= set(r0["stats"][step])
    if CASES[name].get("drop_constant_groups") and CASES[name].get("micro_batch_groups"):
        # one micro-batch per kept group: the ranks planned different numbers of passes at
        # some step, and the one with fewer ran padding passes up to the other's count
        p0, p1 = r0["passes"], r1["passes"]
        assert [a[0] for a in p0] == [b[0] for b in p1], (p0, p1)
        assert any(a[1] != b[1] for a, b in zip(p0, p1, strict=True)), (p0, p1)
    if CASES[name].get("tools"):  # calls ran, some failed, and the tools' counts agree
        for step in range(STEPS):
            s0, s = r0["stats"][step], one["stats"][step]
            assert 0 < s["train/tools/calls_per_sample"] < 1
            assert 0 < s["train/tools/failures/unknown_tool"] < 1
            assert close(s0["train/tools/calls_per_sample"], s["train/tools/calls_per_sample"])
    if CASES[name].get("strategy") == "fsdp":
        assert r0["generated_rows"] == r1["generated_rows"] == 4
        assert r0["generated_tokens"] == [1] * 4 and max(r1["generated_tokens"]) > 1
        # rank 0 kept joining rank 1's forward passes (without synced_gpus it stops after
        # its first token and rank 1's all-gathers are left unmatched)
        assert r0["generate_forwards"] == r1["generate_forwards"] > 2
        # HFExport wrote the whole trained weights (rank 0 alone gathered the shards: the
        # peer closed its connection and the folder had no weights), merged for LoRA
        from safetensors.torch import load_file

        final = r0["export"] / ("final-merged" if "peft" in CASES[name] else "final")
        written = load_file(final / "model.safetensors")
        assert set(written) <= set(r0["checkpoint"]) and len(written) >= len(r0["checkpoint"]) - 1
        for key, value in written.items():
            torch.testing.assert_close(value, r0["checkpoint"][key], rtol=1e-6, atol=1e-7)
        if "peft" in CASES[name]:
            assert (r0["export"] / "final" / "adapter_model.safetensors").is_file()


# ---------------------------------------------------------------------- strategy guards
def test_fsdp1_is_refused_with_the_alternative_named():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    module = MaxEntGRPOModule()
    module._trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(ValueError, match="ModelParallelStrategy"):
        module.setup("fit")


def test_deepspeed_clips_with_the_module_value():
    """DeepSpeed itself is not installed here: a bare strategy object stands in for it."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DeepSpeedStrategy

    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    strategy.config = {}
    module = MaxEntGRPOModule(gradient_clip_val=0.5)
    module._trainer = SimpleNamespace(strategy=strategy)
    module.setup("fit")
    assert strategy.config["gradient_clipping"] == 0.5
    assert clip_gradients(strategy, [], 0.5) is None  # the engine clips inside its step
    strategy.config = {"gradient_clipping": 2.0}
    with pytest.raises(ValueError, match="gradient_clipping"):
        module.setup("fit")


@pytest.mark.parametrize("limit", [{"micro_batch_groups": 1}, {"micro_batch_tokens": 4096}])
def test_deepspeed_refuses_micro_batch_limits_when_the_run_starts(limit):
    """A step of several backward passes would keep only the last one's gradient under
    ZeRO-2: refused at setup, naming both options, not at the first step that splits."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DeepSpeedStrategy

    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    strategy.config = {}
    module = MaxEntGRPOModule(**limit)
    module._trainer = SimpleNamespace(strategy=strategy)
    with pytest.raises(ValueError, match="micro_batch_groups / model.micro_batch_tokens"):
        module.setup("fit")
    module.setup("validate")  # evaluation takes no backward pass
    module = MaxEntGRPOModule()  # neither set: one backward pass per step
    module._trainer = SimpleNamespace(strategy=strategy)
    module.setup("fit")


def test_tensor_parallelism_is_refused():
    from types import SimpleNamespace

    mesh = {"tensor_parallel": SimpleNamespace(size=lambda: 2)}
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        fully_shard_models(mesh, [])


# ---------------------------------------------------------------------- scaling configs
ROOT = Path(__file__).resolve().parents[1]
SCALING = sorted((ROOT / "configs" / "scaling").glob("*.yaml"))


def read(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(path.read_text())


def test_scaling_configs_exist():
    names = {p.name for p in SCALING}
    assert {"ddp_cpu_tiny.yaml", "gpu1_qwen2.5-0.5b_listwise.yaml",
            "node8_ddp_qwen2.5-0.5b_listwise.yaml", "node8_fsdp_qwen2.5-7b_listwise.yaml",
            "node8_deepspeed2_qwen2.5-1.5b_listwise.yaml",
            "node8_deepspeed3_qwen2.5-7b_listwise.yaml",
            "nodes4_fsdp_qwen2.5-7b_listwise.yaml"} <= names


@pytest.mark.parametrize("path", SCALING, ids=lambda p: p.name)
def test_scaling_config_parses_and_is_consistent(path, monkeypatch, tmp_path):
    import sys

    import maxent_grpo.cli.parser as cli_module

    class ParseOnly(cli_module.MaxEntGRPOCLI):
        def instantiate_classes(self) -> None:
            pass

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["maxent_grpo"])
    monkeypatch.setattr(cli_module, "MaxEntGRPOCLI", ParseOnly)
    cfg = cli_module.main(["--config", str(path)], run=False).config  # fit, parsed
    raw = read(path)
    trainer = raw["trainer"]
    strategy = trainer.get("strategy")
    processes = trainer["devices"] * trainer.get("num_nodes", 1)
    assert cfg.trainer.devices == trainer["devices"]
    if trainer["accelerator"] == "gpu":
        assert trainer["precision"] == "bf16-mixed" and raw["model"]["dtype"] == "float32"
    if isinstance(strategy, dict) and strategy["class_path"].endswith("ModelParallelStrategy"):
        assert strategy["init_args"] == {"data_parallel_size": processes,
                                         "tensor_parallel_size": 1}
    if isinstance(strategy, dict) and strategy["class_path"].endswith("DeepSpeedStrategy"):
        assert raw["model"]["micro_batch_groups"] is None  # one backward per engine step
    if path.name == "node8_ddp_qwen2.5-0.5b_listwise.yaml":  # the gpu1 run, split 8 ways
        one = read(path.with_name("gpu1_qwen2.5-0.5b_listwise.yaml"))
        assert raw["data"]["batch_size"] * processes == one["data"]["batch_size"]
        assert raw["model"] | {"micro_batch_groups": None} == one["model"] | {
            "micro_batch_groups": None}
    if path.name == "ddp_cpu_tiny.yaml":  # tiny.yaml's global batch on two processes
        tiny = read(ROOT / "configs" / "tiny.yaml")
        assert raw["data"]["batch_size"] * processes == tiny["data"]["batch_size"]
        assert raw["model"] == tiny["model"]


# ---------------------------------------------------------------------- the CLI on 2 processes
@pytest.mark.slow
def test_cli_fits_tiny_on_two_cpu_processes(tmp_path):
    """Issue 7's "done when": tiny.yaml with --trainer.devices=2 --trainer.strategy=ddp.

    Lightning launches the second process itself; relative log/checkpoint folders land in
    ``tmp_path``. About 20 s on 2 cores.
    """
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    command = [
        sys.executable, "-m", "maxent_grpo", "fit", "--config", str(ROOT / "configs/tiny.yaml"),
        "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.accelerator=cpu",
        "--trainer.max_steps=3", f"--model.model_cache_dir={tmp_path / 'models'}",
        "--trainer.enable_progress_bar=false",
    ]
    def run(cmd: list[str]) -> str:
        # its own process group, so that a hung run (a collective reached by one rank only)
        # is killed with the process Lightning launched for rank 1
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            output, _ = proc.communicate()
            pytest.fail(f"the 2-process {cmd[3]} hung (a collective reached by one rank "
                        "only?):\n" + output[-3000:])
        assert proc.returncode == 0, output[-3000:]
        return output

    output = run(command)
    assert "`max_steps=3` reached" in output
    assert (tmp_path / "lightning_logs/tiny/checkpoints/last.ckpt").is_file()
    saved = torch.load(tmp_path / "lightning_logs/tiny/checkpoints/last.ckpt",
                       weights_only=True, map_location="cpu")
    assert len(saved["maxent_grpo"]["rng"]) == 2  # both ranks' random states
    assert saved["global_step"] == 3

    # predict on the 2 processes: each rank samples its share, one file in prompt order
    predict = [*command[:3], "predict", *command[4:], "--ckpt_path",
               "lightning_logs/tiny/checkpoints/last.ckpt", "--data.val_size=5",
               "--data.val_batch_size=1", "--output=out/predictions.jsonl"]
    predict = [a for a in predict if not a.startswith("--trainer.max_steps")]
    output = run(predict)
    rows = [json.loads(line)
            for line in (tmp_path / "out/predictions.jsonl").read_text().splitlines()]
    keys = [(r["row"], r["sample"]) for r in rows]
    # 5 prompts on 2 ranks: 3 batches each (one prompt repeated to pad), written once
    assert keys == sorted(keys) and len(set(keys)) == len(keys) == 5 * 4
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["predictions.jsonl"]
    assert "predict: 20 completions of 5 prompts written to" in output


@pytest.mark.slow
def test_a_rollback_on_two_processes_is_a_branch_on_every_rank(tmp_path):
    """Resuming step 10 of a run that reached step 20 on two processes hung at its first
    save: only rank 0 knew the run had later checkpoints, so rank 1 kept the run's
    ``last.ckpt`` as its saver's and the ranks waited in different collectives (a hunt)."""
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "maxent_grpo", "fit", "--config",
               str(ROOT / "configs/scaling/ddp_cpu_tiny.yaml"), "--trainer.max_steps=20",
               "--trainer.val_check_interval=10", "--trainer.enable_progress_bar=false",
               "--trainer.callbacks.init_args.every_n_train_steps=5",
               "--trainer.callbacks.init_args.save_top_k=-1",
               f"--model.model_cache_dir={tmp_path / 'models'}"]
    folder = tmp_path / "lightning_logs/ddp_cpu_tiny/checkpoints"
    for extra in ([], ["--ckpt_path", str(folder / "epoch=0-step=10.ckpt")]):
        code, output = run_two_processes([*command, *extra], tmp_path, env)
        assert code == 0, output[-3000:]
    run_id = torch.load(folder / "last.ckpt", weights_only=True)["maxent_grpo_run"]
    branch = torch.load(folder / "last-v1.ckpt", weights_only=True)
    assert (branch["global_step"], branch["maxent_grpo_run"]) == (20, f"{run_id}@10")


class SignalAt(pl.Callback):
    """Send ``name`` (SIGTERM, SIGINT) to this process at the start of batch ``step`` on rank
    ``rank`` only (a job scheduler or a user stopping one process of a run)."""

    def __init__(self, rank: int, step: int, name: str = "SIGTERM") -> None:
        self.rank, self.step, self.name = rank, step, name

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import signal

        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), getattr(signal, self.name))


def fit_two_processes(tmp_path: Path, callback: dict[str, Any], dirpath: Path | None = None,
                      **trainer: Any) -> tuple[int, str]:
    """``fit`` of configs/tiny.yaml (50 steps) on 2 CPU processes with ``callback`` and a
    ``ModelCheckpoint(save_on_exception=True)`` into ``tmp_path/ckpt``: (exit code, output);
    a hang (4 min) fails the test, its processes killed."""
    import sys

    import yaml

    cfg = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    cfg["trainer"].update(
        devices=2, strategy="ddp", max_steps=50, enable_progress_bar=False, logger=False,
        callbacks=[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(dirpath or tmp_path / "ckpt"), "save_last": True,
                                  "every_n_train_steps": 100, "save_on_exception": True}},
                   callback])
    cfg["trainer"].update(trainer)
    cfg["model"]["model_cache_dir"] = str(tmp_path / "models")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH")])))
    return run_two_processes(
        [sys.executable, "-m", "maxent_grpo", "fit", "--config", str(tmp_path / "config.yaml")],
        tmp_path, env)


def run_two_processes(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run ``command`` (a fit on 2 processes) in its own process group: (exit code, output);
    a hang (4 min: a collective reached by one rank only) fails the test, every process of
    the group killed."""
    import subprocess

    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        pytest.fail("the 2-process run hung:\n" + output[-3000:])
    return proc.returncode, output


@pytest.mark.slow
@pytest.mark.parametrize("name,rank,code,said", [
    ("SIGTERM", 1, 143, "stopped by SIGTERM"),
    ("SIGINT", 0, 130, "interrupted (Ctrl-C) after a batch")])
def test_a_signal_to_one_process_stops_every_rank_at_the_same_step(tmp_path, name, rank, code,
                                                                  said):
    """Lightning's own SIGTERM handler broadcasts from inside the signal handler, while the
    other rank is in one of the step's collectives: the run hung until the process group's
    time-out (30 min), or went on. Now the signal is shared between ranks at the end of the
    step (every rank stops there, ``save_on_exception`` saves that step) and the command
    exits 143 (it exited 0, as if the run had finished). A SIGINT to the launching process
    alone (``kill -INT``, ``timeout -s INT``) stopped it in mid-step: the other rank failed
    in its collective, "a bug in maxent_grpo", and nothing was saved. It is shared the same
    way; the command exits 130."""
    code_, output = fit_two_processes(tmp_path, {"class_path": "test_distributed.SignalAt",
                                                 "init_args": {"rank": rank, "step": 2,
                                                               "name": name}})
    assert code_ == code, output[-3000:]
    assert said in output and "bug in maxent_grpo" not in output
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True, map_location="cpu")
    assert saved["global_step"] == 3  # the step the rank was signalled at, on both ranks
    assert len(saved["maxent_grpo"]["rng"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["checkpoint", "log"])
def test_a_folder_that_cannot_be_written_stops_two_processes_before_training(tmp_path, folder):
    """Checked on one process only: on two a checkpoint folder failed at the first save,
    after its steps, and a log folder with the file system's error alone."""
    (tmp_path / "a_file").write_text("")
    bad = tmp_path / "a_file" / "x"
    code, output = fit_two_processes(
        tmp_path, {"class_path": "test_distributed.SignalAt", "init_args": {"rank": 0,
                                                                            "step": 10 ** 6}},
        **({"dirpath": bad} if folder == "checkpoint" else {"logger": {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(bad)}}}))
    assert code == 1, output[-3000:]
    said = {"checkpoint": r"error: ModelCheckpoint\(dirpath='.*a_file/x'\) cannot be written",
            "log": r"error: trainer.logger CSVLogger\(save_dir='.*a_file/x'"}[folder]
    assert re.search(said, output), output[-3000:]
    assert "no checkpoint is saved" not in output  # nothing was trained: nothing to save


class FailOn(pl.Callback):
    """A ValueError on rank ``rank`` only, at the start of batch ``step`` (a reward server
    that one process cannot reach)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise ValueError("the reward server is down")


@pytest.mark.slow
def test_an_error_on_one_process_is_reported_with_save_on_exception(tmp_path):
    """With ``save_on_exception``, the failing rank's save waited in a collective the other
    rank never joined: gloo aborted both (exit -6, a minute later, no checkpoint) and the
    failing rank reported "unexpected UnpicklingError; this is a bug in maxent_grpo"
    instead of its error. The save is skipped (warned) and the error reported."""
    code, output = fit_two_processes(tmp_path, {"class_path": "test_distributed.FailOn",
                                                "init_args": {"rank": 1, "step": 2}})
    assert code == 1, output[-3000:]
    assert "error: the reward server is down" in output
    assert "no checkpoint is saved on this error" in output
    assert "bug in maxent_grpo" not in output
