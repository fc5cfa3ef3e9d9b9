"""Whole training steps on the Hugging Face engine against the in-process vLLM engine, same
config, same seed, run one after the other in the vLLM environment (``make setup-vllm``).

    .venv-vllm/bin/python benchmarks/engine_step_speed.py --config configs/smollm2_sets.yaml \
        --steps 40 --cpus 1 --out benchmarks/results/engine_step_speed.json

Each engine trains ``--steps`` steps without validation or checkpoints, pinned to the CPU
ids in ``--cpus`` (``taskset``; vLLM's OpenMP threads are bound to the same ids), one
thread each. The step's own timers (``train/perf/*``, read from its TensorBoard log) are
summarised as the median over the steps after ``--skip`` (the first steps include the
engines' start). ``--logs hf=DIR vllm=DIR`` summarises runs made before instead of training.
The question it answers: which engine makes a study's runs faster on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VLLM_ENGINE = {"class_path": "maxent_grpo.rollout.VLLMEngine",
               # on the CPU the share counts the whole training process's memory too
               "init_args": {"gpu_memory_utilization": 0.25}}


def fit_command(config: str, steps: int, engine: str, log_dir: Path) -> list[str]:
    command = [sys.executable, "-m", "maxent_grpo", "fit", "--config", config,
               "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",
               "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
               "--trainer.logger.init_args.save_dir", str(log_dir)]
    if engine == "vllm":
        command += ["--model.engine", json.dumps(VLLM_ENGINE)]
    return command


def cpu_ids(cpus: str) -> list[int]:
    """The CPU ids of a ``taskset`` list: ``"1"``, ``"0,2"``, ``"0-3"``."""
    ids: list[int] = []
    for part in cpus.split(","):
        first, _, last = part.partition("-")
        ids += range(int(first), int(last or first) + 1)
    return ids


def summarise(log_dir: Path, skip: int) -> dict[str, float]:
    from maxent_grpo.analysis import find_runs, load_run

    runs = find_runs(log_dir)
    if len(runs) != 1:
        raise SystemExit(f"{log_dir}: expected one run, found {len(runs)}")
    run = load_run(runs[0])
    out = {}
    for name, series in sorted(run.scalars.items()):
        if name.startswith("train/perf/"):
            values = list(series.values[skip:])
            if values:
                out[name.removeprefix("train/perf/")] = statistics.median(values)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/smollm2_sets.yaml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5)
    parser.add_argument("--cpus", default="1", help="taskset CPU list, e.g. 1 or 0,1")
    parser.add_argument("--engines", nargs="+", default=["vllm", "hf"], choices=["hf", "vllm"])
    parser.add_argument("--logs", nargs="+", metavar="ENGINE=DIR",
                        help="summarise these runs instead of training")
    parser.add_argument("--work-dir", default="engine_step_speed_logs",
                        help="training logs, relative to the repository root")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    parser.add_argument("--note", default="", help="how the runs were made, kept in --out")
    args = parser.parse_args()

    results: dict[str, dict] = {}
    if args.logs:
        for item in args.logs:
            engine, sep, folder = item.partition("=")
            if not sep or not engine or not folder:
                parser.error(f"--logs takes ENGINE=DIR items; got {item!r}")
            results[engine] = {"log_dir": folder, "perf": summarise(Path(folder), args.skip)}
    else:
        threads = len(cpu_ids(args.cpus))
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=args.cpus)
        for engine in args.engines:
            log_dir = (ROOT / args.work_dir / engine).resolve()
            if log_dir.exists():
                raise SystemExit(f"{log_dir} exists: name a fresh --work-dir")
            command = ["taskset", "-c", args.cpus,
                       *fit_command(args.config, args.steps, engine, log_dir)]
            print("$", " ".join(command), flush=True)
            start = time.perf_counter()
            subprocess.run(command, cwd=ROOT, env=env, check=True)
            results[engine] = {"log_dir": str(log_dir), "wall_s": time.perf_counter() - start,
                               "perf": summarise(log_dir, args.skip)}
    parts = sorted({part for r in results.values() for part in r["perf"]})
    print(f"\nmedian seconds per step after step {args.skip}\n")
    print("| part | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for part in parts:
        print(f"| {part} | " + " | ".join(f"{r['perf'].get(part, float('nan')):.3f}"
                                          for r in results.values()) + " |")
    if args.out:
        record = {"command": shlex.join(sys.argv), "config": args.config, "steps": args.steps,
                  "skip": args.skip, "cpus": args.cpus, "machine": platform.machine(),
                  "cores": os.cpu_count(), "note": args.note, "results": results}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
