"""The demo on a local vLLM server (``make demo-vllm-server``: server pinned to core 1),
run to the end on the given seeds and staleness, one JSON line per run: first 20 and last
20 steps' mean reward, the seconds, the step time.

    .venv-vllm/bin/python benchmarks/server_demo.py --seeds 0 1 2 --staleness 1 \
        --out benchmarks/results/server_demo.jsonl
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


def main() -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--staleness", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, default=None, help="default: the config's 800")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    for seed in args.seeds:
        for k in args.staleness:
            with tempfile.TemporaryDirectory() as work:
                cmd = [sys.executable, "-m", "maxent_grpo.serve", "--model",
                       "builtin:tiny-h64-warm", "--server-cpus", "1", "--", "fit", "--config",
                       str(ROOT / "configs/tiny_vllm_server.yaml"),
                       "--trainer.enable_progress_bar=false", f"--seed_everything={seed}",
                       f"--model.max_staleness={k}",
                       *([f"--trainer.max_steps={args.steps}"] if args.steps else [])]
                start = time.perf_counter()
                proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True,
                                      env={**os.environ, "HF_HUB_OFFLINE": "1"})
                seconds = time.perf_counter() - start
                if proc.returncode != 0:
                    raise SystemExit(proc.stderr[-3000:])
                acc = EventAccumulator(
                    str(Path(work) / "lightning_logs/tiny_vllm_server/version_0"))
                acc.Reload()
                reward = [e.value for e in acc.Scalars("train/reward/mean")]
                step = [e.value for e in acc.Scalars("train/perf/step_s")]
            row = {"commit": commit, "seed": seed, "max_staleness": k, "steps": len(reward),
                   "first20": round(sum(reward[:20]) / len(reward[:20]), 4),
                   "last20": round(sum(reward[-20:]) / len(reward[-20:]), 4),
                   "step_s": round(sum(step) / len(step), 4), "seconds": round(seconds, 1)}
            print(json.dumps(row), flush=True)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
