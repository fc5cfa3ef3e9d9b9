"""Step time of the demo on a local vLLM server, synchronous (max_staleness 0) against
asynchronous (1), with the server pinned to one core and the training to the other, and
unpinned; writes the per-step means over the last ``--window`` steps.

    .venv-vllm/bin/python benchmarks/server_overlap.py --steps 40 \
        --out benchmarks/results/server_overlap.json

``train`` is a synchronous step's time less its generation and weight sync: what the
trainer computes. The ideal asynchronous step is ``max(generate, train + sync)``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAGS = {"step_s": "train/perf/step_s", "generate_s": "train/perf/generate_s",
        "sync_s": "train/perf/sync_seconds", "tokens_per_s": "train/perf/tokens_per_s"}


def run(k: int, steps: int, pin: bool, window: int) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory() as work:
        cmd = [sys.executable, "-m", "maxent_grpo.serve", "--model", "builtin:tiny-h64-warm",
               *(["--server-cpus", "1"] if pin else []), "--", "fit", "--config",
               str(ROOT / "configs/tiny_vllm_server.yaml"), "--trainer.enable_progress_bar=false",
               f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
               f"--model.max_staleness={k}"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        acc = EventAccumulator(str(Path(work) / "lightning_logs/tiny_vllm_server/version_0"))
        acc.Reload()
        out = {name: sum(v := [e.value for e in acc.Scalars(tag)][-window:]) / len(v)
               for name, tag in TAGS.items()}
    out.update(max_staleness=k, pinned=pin, steps=steps, seconds=time.perf_counter() - start)
    return {key: round(v, 4) if isinstance(v, float) else v for key, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--window", type=int, default=30)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = []
    for pin in (True, False):
        for k in (0, 1):  # alternated, one run each
            runs.append(run(k, args.steps, pin, args.window))
            print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for pin in (True, False):
        sync, asyn = (next(r for r in runs if r["pinned"] == pin and r["max_staleness"] == k)
                      for k in (0, 1))
        train = sync["step_s"] - sync["generate_s"] - sync["sync_s"]
        ideal = max(sync["generate_s"], train + sync["sync_s"])
        summary["pinned" if pin else "unpinned"] = {
            "sync_step_s": sync["step_s"], "async_step_s": asyn["step_s"],
            "generate_s": sync["generate_s"], "train_s": round(train, 4),
            "ideal_async_step_s": round(ideal, 4),
            "async_over_ideal": round(asyn["step_s"] / ideal, 3),
            "speedup": round(sync["step_s"] / asyn["step_s"], 3)}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    args.out.write_text(json.dumps({"commit": commit, "runs": runs, "summary": summary},
                                   indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
