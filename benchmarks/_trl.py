"""Worker: TRL's ``GRPOTrainer`` on the same work as ``_ours.py``.

Run with TRL's environment (``benchmarks/.venv-trl/bin/python``, made by
``setup_trl_venv.sh``) on a workload prepared by ``bench_common.prepare_workload``; prints one
``BENCH_RESULT {json}`` line::

    benchmarks/.venv-trl/bin/python benchmarks/_trl.py --workload smollm2 --warmup 2 --steps 5

One step = one optimizer step: ``per_device_train_batch_size = B*G`` completions,
``gradient_accumulation_steps = 1`` and ``steps_per_generation = 1`` (so
``generation_batch_size = B*G``: B prompts, each repeated G times by TRL's sampler, generated
once per step), ``num_iterations = 1`` (no old-policy forward). It is timed by a
``TrainerCallback`` from ``on_step_begin`` to ``on_step_end`` (the Trainer fetches the batch
before ``on_step_begin`` and logs after ``on_step_end``; generation, rewards, scoring, backward,
clipping and the AdamW step fall inside).

Settings chosen to match ours (TRL's default in brackets where it differs): ``loss_type=
"dr_grpo"`` ["dapo"], ``scale_rewards="none"`` ["group"], ``beta=0.0`` (TRL then creates no
reference model), ``bf16`` as the workload's precision (False on the CPU workloads)
[True], ``gradient_checkpointing=False`` [True], ``lr_scheduler_type="constant"``
["linear"], ``optim="adamw_torch"``, ``weight_decay=0``, ``max_grad_norm=1.0``,
``temperature=1``, ``top_p=1``, ``top_k=0``, ``shuffle_dataset=False`` [True],
``logging_steps`` large (no per-step log line), ``report_to="none"``, no saving.

Phase breakdown (for the profile table): the worker wraps, without changing them,
``_generate_single_turn`` (generation), ``_calculate_rewards`` (rewards),
``_get_per_token_logps_and_entropies`` (scoring forwards) and ``_prepare_inputs`` (the whole
rollout-and-score stage); backward + optimizer = step - ``_prepare_inputs`` - scoring inside
``compute_loss``. Peak memory per phase (``bench_common.PhaseMemory``: generation, the
scoring forwards, ``accelerator.backward``, the optimizer's ``step``) is recorded on CUDA,
and on the CPU with ``--memory``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import bench_common as bc  # noqa: E402


def run(workload: bc.Workload, folder: Path, warmup: int, steps: int, seed: int = 0,
        lockstep: bool = False, memory: bool = False) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    start = time.perf_counter()
    model_dir = folder / "model"
    rows = bc.read_prompts(folder / "prompts.jsonl")
    B, G, T = workload.batch_prompts, workload.num_generations, workload.max_completion_length
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    out_dir = tempfile.mkdtemp(prefix="bench-trl-")
    config = GRPOConfig(
        output_dir=out_dir,
        use_cpu=workload.device == "cpu",
        seed=seed,
        max_steps=warmup + steps,
        # one generation of B x G per optimizer step, in B / k forward/backward passes of k
        # groups with micro_batch_groups = k (ours: model.micro_batch_groups = k)
        per_device_train_batch_size=(workload.micro_batch_groups or B) * G,
        gradient_accumulation_steps=B // (workload.micro_batch_groups or B),
        steps_per_generation=B // (workload.micro_batch_groups or B),
        num_generations=G,
        num_iterations=1,
        max_completion_length=T,
        temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0,
        loss_type="dr_grpo",
        scale_rewards="none",
        mask_truncated_completions=False,
        learning_rate=workload.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=1.0,
        bf16=workload.precision.startswith("bf16"), fp16=False,
        gradient_checkpointing=False,
        shuffle_dataset=False,
        remove_unused_columns=False,
        logging_steps=10**6,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )

    gate = bc.LockstepGate(lockstep)
    phases = bc.PhaseMemory(workload.device, memory)

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = 0.0
            self.steps: list[dict[str, float]] = []
            self.trainer: Any = None
            self.phase: dict[str, float] = defaultdict(float)

        def on_train_begin(self, args, state, control, **kwargs):
            phases.wrap(kwargs["optimizer"], "step", "optimizer")

        def on_step_begin(self, args, state, control, **kwargs):
            gate.wait()
            self.phase.clear()
            phases.recording = len(self.steps) >= warmup
            phases.start_step()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            wall = time.perf_counter() - self.t0
            phases.end_step()
            metrics = self.trainer._metrics["train"]
            mean_len = float(metrics["completions/mean_length"][-1])
            prepare = self.phase["prepare_inputs"]
            score_in_loss = self.phase["score"] - self.phase["score_in_prepare"]
            self.steps.append({
                "wall_s": wall,
                "completion_tokens": round(mean_len * B * G),
                "generate_s": self.phase["generate"],
                "reward_s": self.phase["reward"],
                "score_s": self.phase["score"],
                "backward_s": wall - prepare - score_in_loss,
                "prepare_inputs_s": prepare,
            })
            gate.done()

    clock = StepClock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[bc.digit_fraction],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[clock],
    )
    clock.trainer = trainer
    _wrap_phases(trainer, clock.phase)
    phases.wrap(trainer, "_generate_single_turn", "generate")
    phases.wrap(trainer, "_get_per_token_logps_and_entropies", "score")
    phases.wrap(trainer.accelerator, "backward", "backward")
    trainer.train()

    timed = clock.steps[warmup:]
    if len(timed) != steps:
        raise RuntimeError(f"expected {steps} timed steps, got {len(timed)}")
    keys = ("generate_s", "reward_s", "score_s", "backward_s", "prepare_inputs_s")
    return {
        "side": "trl",
        "workload": workload.name,
        "step_s": [s["wall_s"] for s in timed],
        "completion_tokens": [s["completion_tokens"] for s in timed],
        "phases": {k: [s[k] for s in timed] for k in keys},
        "peak_rss_mib": bc.peak_rss_mib(),
        "peak_cuda_mib": bc.peak_cuda_mib(),
        "phase_peak_mib": phases.result(),
        "total_s": time.perf_counter() - start,
        "threads": torch.get_num_threads(),
        "versions": bc.versions("torch", "transformers", "trl"),
    }


def _wrap_phases(trainer: Any, phase: dict[str, float]) -> None:
    """Accumulate the time spent in a few GRPOTrainer methods into ``phase`` (same behaviour)."""
    state = {"in_prepare": False}

    def timed(name: str, method_name: str):
        original = getattr(trainer, method_name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            if name == "prepare_inputs":
                state["in_prepare"] = True
            try:
                return original(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                phase[name] += dt
                if name == "prepare_inputs":
                    state["in_prepare"] = False
                elif name == "score" and state["in_prepare"]:
                    phase["score_in_prepare"] += dt

        setattr(trainer, method_name, wrapper)

    timed("generate", "_generate_single_turn")
    timed("reward", "_calculate_rewards")
    timed("score", "_get_per_token_logps_and_entropies")
    timed("prepare_inputs", "_prepare_inputs")


if __name__ == "__main__":
    bc.worker_main(run, __doc__.split("\n")[0])
