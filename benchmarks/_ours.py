"""Worker: our trainer (Lightning ``Trainer`` + ``MaxEntGRPOModule`` + ``PromptDataModule``).

Run with our environment (``.venv/bin/python``) on a workload prepared by
``bench_common.prepare_workload``; prints one ``BENCH_RESULT {json}`` line::

    python benchmarks/_ours.py --workload smollm2 --warmup 2 --steps 5

One step is one ``training_step`` (rollout, rewards, scoring, backward, clip, AdamW): its wall
time is taken by a callback from ``on_train_batch_start`` to ``on_train_batch_end`` (the
module's own ``train/perf/*`` phases are recorded too). Settings mirror ``_trl.py``: GRPO with
``loss_type="dr_grpo"``, ``scale_rewards="none"``, ``beta=0`` (no reference model),
``num_iterations=1``, one micro-batch, temperature 1 / top_p 1 / top_k 0, AdamW (weight decay
0) at a constant learning rate, gradient clipping at 1.0, float32. ``--cache`` and
``--generation-dtype`` set the rollout engine's key/value cache and generation copy
(``--cache vllm``: ``VLLMEngine`` instead, run with the vLLM environment's python); with a
copy, each step's ``refresh_s`` (the copy's refresh, part of ``generate_s``) is recorded.
Peak memory per phase (``bench_common.PhaseMemory``: the engine's ``generate``, the
scorer's ``policy_scores``, ``manual_backward``, the optimizer's ``step``) is recorded on
CUDA, and on the CPU with ``--memory``.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import bench_common as bc  # noqa: E402

PERF_KEYS = ("generate_s", "reward_s", "score_s", "backward_s", "step_s", "tokens_per_s")


class RecordingEngines:
    """The run's engine factory: ``HFGenerateEngine(model, tokenizer, sampling, **options)``,
    keeping the last engine built so that the step clock can read its ``refresh_seconds``."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.last: Any = None

        self.memory: bc.PhaseMemory | None = None

    def __call__(self, model: Any, tokenizer: Any, sampling: Any) -> Any:
        from maxent_grpo.rollout import HFGenerateEngine

        if self.options.get("cache") == "vllm":
            from maxent_grpo.rollout.vllm_engine import VLLMEngine

            self.last = VLLMEngine(model, tokenizer, sampling, gpu_memory_utilization=0.2,
                                   dtype=self.options.get("dtype", "auto"))
        else:
            self.last = HFGenerateEngine(model, tokenizer, sampling, **self.options)
        if self.memory is not None:
            self.memory.wrap(self.last, "generate", "generate")
        return self.last


def allow_bench_eos() -> None:
    """Let the module load a fixed-length workload's model: its eos ``<|bench_no_eos|>`` is
    past the embeddings on purpose (never sampled, so every completion is T tokens), which
    ``maxent_grpo.models.check_token_ids`` refuses for a user's model (a model that never
    stops). Only that token is let through; every other check runs as for a user."""
    from maxent_grpo.training.run import policy_models

    check = policy_models.check_token_ids
    if getattr(check, "bench_eos_allowed", False):
        return

    def checked(tokenizer: Any, model: Any, name_or_path: str) -> None:
        if tokenizer.eos_token != bc.NO_EOS_TOKEN:
            return check(tokenizer, model, name_or_path)
        eos = tokenizer.eos_token_id
        try:
            tokenizer.eos_token_id = tokenizer.pad_token_id  # checked as the pad token is
            return check(tokenizer, model, name_or_path)
        finally:
            tokenizer.eos_token_id = eos

    checked.bench_eos_allowed = True
    policy_models.check_token_ids = checked


def build(workload: bc.Workload, folder: Path, total_steps: int, seed: int = 0,
          beta: float = 0.0, callbacks: list | None = None, cache: str = "dynamic",
          generation_dtype: str = "model", fused_lm_head: bool | None = None):
    """The Lightning Trainer, module and DataModule of one run of ``total_steps`` steps;
    ``cache`` is the rollout engine's key/value cache (``static``: prompts bucketed by 64),
    ``generation_dtype`` its generation copy (``model``: none), ``fused_lm_head`` the
    scorer's (None: fused on CUDA)."""
    import lightning as L
    import torch

    from maxent_grpo.objectives import GRPO
    from maxent_grpo.training.data.datamodule import PromptDataModule
    from maxent_grpo.training.module import MaxEntGRPOModule

    allow_bench_eos()
    L.seed_everything(seed, verbose=False)
    model_dir = str(folder / "model")
    prompts = str(folder / "prompts.jsonl")
    module = MaxEntGRPOModule(
        model_name_or_path=model_dir,
        objective=GRPO(loss_type="dr_grpo", scale_rewards="none", beta=beta),
        rewards={"bench_common:digit_fraction": 1.0},
        # vLLM generates in bfloat16 under bf16-mixed, as the autocast forward passes compute
        engine=RecordingEngines(cache="vllm", dtype="bfloat16" if workload.precision ==
                                "bf16-mixed" else "auto") if cache == "vllm" else
        RecordingEngines(cache=cache, prompt_bucket=64 if cache == "static" else 1,
                         generation_dtype=generation_dtype),
        num_generations=workload.num_generations,
        max_completion_length=workload.max_completion_length,
        max_prompt_length=1024,
        temperature=1.0, top_p=1.0, top_k=0,
        num_iterations=1,
        micro_batch_groups=workload.micro_batch_groups,
        gradient_clip_val=1.0,
        optimizer=functools.partial(torch.optim.AdamW, lr=workload.learning_rate,
                                    weight_decay=0.0),
        lr_warmup_steps=0,
        dtype="float32",
        fused_lm_head=fused_lm_head,
    )
    data = PromptDataModule(
        task=None, data_files=prompts, val_files=prompts, answer_column="answer",
        tokenizer=model_dir, max_prompt_length=1024, batch_size=workload.batch_prompts,
        shuffle=False, apply_chat_template=False,
    )
    trainer = L.Trainer(
        accelerator=workload.device, devices=1, precision=workload.precision,
        max_steps=total_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks or [],
    )
    return trainer, module, data


def make_step_clock(gate: bc.LockstepGate | None = None,
                    memory: bc.PhaseMemory | None = None, warmup: int = 0):
    """A callback that records each step's wall time, tokens and ``train/perf/*`` values
    (and, with a lockstep ``gate``, waits for the driver before each step); with
    ``memory``, each phase's peak memory after ``warmup`` steps."""
    import lightning as L

    gate = gate or bc.LockstepGate(False)
    memory = memory or bc.PhaseMemory("cpu", False)

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self._t0 = 0.0

        def on_train_start(self, trainer, pl_module) -> None:
            memory.wrap(pl_module.scorer, "policy_scores", "score")
            memory.wrap(pl_module, "manual_backward", "backward")
            memory.wrap(trainer.optimizers[0], "step", "optimizer")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            gate.wait()
            memory.recording = len(self.steps) >= warmup
            memory.start_step()
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            wall = time.perf_counter() - self._t0
            memory.end_step()
            stats = pl_module.step_metrics_dict
            perf = {k: float(stats[f"train/perf/{k}"]) for k in PERF_KEYS}
            engine = getattr(pl_module.engine_factory, "last", None)
            if getattr(engine, "generation_dtype", "model") != "model":
                perf["refresh_s"] = engine.refresh_seconds
            if "train/perf/sync_seconds" in stats:  # VLLMEngine: the weight reload first
                perf["sync_s"] = float(stats["train/perf/sync_seconds"])
            tokens = round(perf["tokens_per_s"] * perf["step_s"])  # completion tokens
            self.steps.append({"wall_s": wall, "completion_tokens": tokens, **perf})
            gate.done()

    return StepClock()


def run(workload: bc.Workload, folder: Path, warmup: int, steps: int, seed: int = 0,
        beta: float = 0.0, extra_callbacks: list | None = None, lockstep: bool = False,
        cache: str = "dynamic", generation_dtype: str = "model",
        memory: bool = False, fused_lm_head: bool | None = None) -> dict[str, Any]:
    import torch

    phases = bc.PhaseMemory(workload.device, memory)
    clock = make_step_clock(bc.LockstepGate(lockstep), phases, warmup)
    start = time.perf_counter()
    trainer, module, data = build(workload, folder, warmup + steps, seed, beta,
                                  [clock, *(extra_callbacks or [])], cache=cache,
                                  generation_dtype=generation_dtype,
                                  fused_lm_head=fused_lm_head)
    module.engine_factory.memory = phases
    trainer.fit(module, data)
    timed = clock.steps[warmup:]
    if len(timed) != steps:
        raise RuntimeError(f"expected {steps} timed steps, got {len(timed)}")
    samples = None if module.trajectory is None else module.trajectory.samples
    return {
        "side": "ours",
        "workload": workload.name,
        "step_s": [s["wall_s"] for s in timed],
        "completion_tokens": [s["completion_tokens"] for s in timed],
        "phases": {k: [s[k] for s in timed] for k in (*PERF_KEYS, "refresh_s", "sync_s")
                   if k in timed[0]},
        "peak_rss_mib": bc.peak_rss_mib(),
        "peak_cuda_mib": bc.peak_cuda_mib(),
        "phase_peak_mib": phases.result(),
        "cache": cache,
        "generation_dtype": generation_dtype,
        "fused_lm_head": fused_lm_head,
        "total_s": time.perf_counter() - start,
        "threads": torch.get_num_threads(),
        "versions": bc.versions("torch", "transformers", "lightning"),
        "sample_completion": samples.generation.grouped_completions[0][0] if samples else None,
    }


if __name__ == "__main__":
    bc.worker_main(run, __doc__.split("\n")[0])
