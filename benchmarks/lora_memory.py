"""Peak memory of a LoRA run against full fine-tuning with a reference model (CPU).

Run with our environment::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lora_memory.py            # tiny + SmolLM2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lora_memory.py --models builtin:tiny

Each (model, variant) is one ``trainer.fit`` of ``--steps`` steps in a fresh process
(``MaxEntGRPOModule`` + ``PromptDataModule``, GRPO with AdamW, float32 weights, 1 CPU):

- ``full_ref``: full fine-tuning with beta > 0: policy, its gradients, AdamW's two moments
  for every weight, and a second, frozen copy of the model as the reference;
- ``lora_ref``: ``model.peft = LoraConfig(r=16, lora_alpha=32, target_modules=all-linear)``
  with the same beta: frozen base, gradients and AdamW moments for the adapters only, and
  the reference is the policy with its adapters disabled (no second copy);
- ``full``: full fine-tuning with beta = 0 (no reference at all), for scale.

The worker records its resident set size after the imports (``baseline``), then fits and
reads its peak RSS (``VmHWM``); ``peak - baseline`` is what the run added (weights,
gradients, optimizer state, activations, the allocator's slack). It also counts the policy's
parameters, those that train, those holding AdamW state, and the reference's own.
Prompts: ``arithmetic_easy`` (bare, no chat template), ``B`` prompts x ``G`` completions of
``T`` new tokens per step; the results go to ``benchmarks/results/lora_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
VARIANTS = ("full_ref", "lora_ref", "full")
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
RESULT_MARK = "LORA_MEMORY_RESULT "


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_common

    return bench_common.peak_rss_mib()  # VmHWM: ru_maxrss is the launching process's too


def worker(model: str, variant: str, steps: int, B: int, G: int, T: int) -> dict[str, Any]:
    import lightning as L
    import peft
    import torch

    from maxent_grpo.objectives import GRPO
    from maxent_grpo.training.data.datamodule import PromptDataModule
    from maxent_grpo.training.module import MaxEntGRPOModule

    torch.set_num_threads(1)
    baseline = rss_mib()
    step_times: list[float] = []

    class Timer(L.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            step_times.append(time.perf_counter() - self.start)

    module = MaxEntGRPOModule(
        model_name_or_path=model,
        objective=GRPO(loss_type="dr_grpo", beta=0.0 if variant == "full" else 0.04),
        rewards={"first_number": 1.0}, num_generations=G, max_completion_length=T,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0),
        peft=peft.LoraConfig(**LORA) if variant.startswith("lora") else None,
        eval_greedy=False,
    )
    data = PromptDataModule(
        task="arithmetic_easy", task_options={"bare": True}, apply_chat_template=False,
        train_size=B * steps, val_size=2, batch_size=B, max_prompt_length=16, tokenizer=model,
    )
    L.seed_everything(0)
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Timer()],
        default_root_dir=str(BENCH_DIR / ".cache" / "lora_memory"),
    )
    trainer.fit(module, data)
    peak = peak_rss_mib()
    policy = module.policy
    optimizer = trainer.optimizers[0]
    reference = module.reference
    with_state = [p for p in optimizer.state if optimizer.state[p]]
    return {
        "model": model, "variant": variant, "steps": steps, "B": B, "G": G, "T": T,
        "baseline_rss_mib": baseline, "peak_rss_mib": peak, "peak_delta_mib": peak - baseline,
        "policy_params": sum(p.numel() for p in policy.parameters()),
        "trainable_params": sum(p.numel() for p in policy.parameters() if p.requires_grad),
        "optimizer_params": sum(p.numel() for g in optimizer.param_groups for p in g["params"]),
        "adamw_state_params": sum(p.numel() for p in with_state),
        "reference_params": 0 if reference is None else sum(
            p.numel() for p in reference.parameters()),
        "reference": None if reference is None else type(reference).__name__,
        "step_s": step_times,
        "kl_last": float(module.step_metrics_dict.get("train/kl", float("nan"))),
    }


def run(model: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", variant, "--models", model,
           "--steps", str(args.steps), "--B", str(args.B), "--G", str(args.G), "--T", str(args.T)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_DIR)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_DIR)
    if proc.returncode != 0:
        raise RuntimeError(f"{model} {variant} failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}")
    line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith(RESULT_MARK))
    return json.loads(line[len(RESULT_MARK):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+",
                        default=["builtin:tiny", "builtin:smollm2-135m-instruct"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--B", type=int, default=4, help="prompts per step")
    parser.add_argument("--G", type=int, default=4, help="completions per prompt")
    parser.add_argument("--T", type=int, default=8, help="new tokens per completion")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "lora_memory.json")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = worker(args.models[0], args.worker, args.steps, args.B, args.G, args.T)
        sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
        return
    import torch

    runs = []
    for model in args.models:
        for variant in VARIANTS:  # one after the other: never two measurements at once
            result = run(model, variant, args)
            runs.append(result)
            print(f"{model:32s} {variant:9s} peak {result['peak_rss_mib']:8.0f} MiB  "
                  f"added {result['peak_delta_mib']:8.0f} MiB  trainable "
                  f"{result['trainable_params']:>11,d}", flush=True)
    report = {
        "command": " ".join(["OMP_NUM_THREADS=1", ".venv/bin/python",
                             "benchmarks/lora_memory.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "torch": torch.__version__, "peft": __import__("peft").__version__},
        "lora": LORA,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
