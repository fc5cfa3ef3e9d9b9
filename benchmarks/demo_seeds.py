"""The default demo (``configs/tiny.yaml``) over many seeds and CPU-kernel settings.

    python benchmarks/demo_seeds.py --seeds 0 1 2 3 4 5 6 7 8 9
    python benchmarks/demo_seeds.py --seeds 0 1 2 --env ATEN_CPU_CAPABILITY=avx2
    python benchmarks/demo_seeds.py --seeds 0 --set model.objective=... --label my-variant
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python benchmarks/demo_seeds.py \
        --config configs/tiny_vllm.yaml --seeds 0 1 2 --workers 1 --threads 2 --label vllm

Each run is ``python -m maxent_grpo fit --config configs/tiny.yaml --seed_everything N``
(``--config`` picks another; the interpreter is the one running this script)
with the given ``--set`` overrides (``key=value``, passed as ``--key value``), in its own
process with the given ``--env`` variables (the kernel choices: ``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``, thread counts, ...). It records the mean
``train/reward/mean`` of the first and of the last 20 steps, the validation pass@1 at the
end and the wall time, and appends one JSON line per run to ``--out`` (default
``benchmarks/results/demo_seeds.jsonl``) with the machine, the commit and the settings.
``--workers`` runs that many processes at once (``--threads`` torch threads each; thread
count is itself a float behaviour, so it is recorded). ``--report`` prints the table of the
JSON lines, grouped by label and environment.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_common import git_commit, median, versions  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks/results/demo_seeds.jsonl"


def _cpu() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("model name")), platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "no-avx2"
    return f"{name} ({isa}, {os.cpu_count()} cores)"


def read_rewards(log_dir: Path) -> tuple[list[float], dict[str, float], dict[str, list]]:
    """``train/reward/mean`` per step, the last value of every ``val/`` scalar, and each
    reward component's first-20 and last-20 means (``train/reward/<name>/mean``)."""
    from maxent_grpo.analysis import load_run

    run = load_run(next(log_dir.glob("**/version_0")))
    rewards = list(run.scalars["train/reward/mean"].values)
    val = {tag: float(s.values[-1]) for tag, s in run.scalars.items()
           if tag.startswith("val/") and len(s.values)}
    parts = {}
    for tag, series in run.scalars.items():
        name = tag[len("train/reward/"):-len("/mean")]
        if tag.startswith("train/reward/") and tag.endswith("/mean") and name and len(
                series.values):
            values = list(series.values)
            parts[name] = [round(sum(values[:20]) / len(values[:20]), 4),
                           round(sum(values[-20:]) / len(values[-20:]), 4)]
    return rewards, val, parts


def run_one(seed: int, sets: list[str], env: dict[str, str], threads: int,
            cache_dir: str | None, config: str = "configs/tiny.yaml") -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as work:
        cmd = [sys.executable, "-m", "maxent_grpo", "fit", "--config",
               str(ROOT / config), "--seed_everything", str(seed),
               "--trainer.enable_progress_bar", "false",
               "--trainer.enable_model_summary", "false",
               "--trainer.enable_checkpointing", "false",
               "--trainer.callbacks", "[]",
               "--trainer.logger.init_args.save_dir", str(Path(work) / "logs")]
        if cache_dir:
            cmd += ["--model.model_cache_dir", cache_dir]
        for item in sets:
            key, _, value = item.partition("=")
            cmd += [f"--{key}", value]
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **env}
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=work, env=full_env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            return {"seed": seed, "error": proc.stderr[-2000:], "seconds": seconds}
        rewards, val, components = read_rewards(Path(work) / "logs")
    return {
        "seed": seed, "first20": sum(rewards[:20]) / len(rewards[:20]),
        "last20": sum(rewards[-20:]) / len(rewards[-20:]),
        "steps": len(rewards), "val": val, "seconds": round(seconds, 1),
        "components": components,
        "curve50": [round(sum(rewards[i:i + 50]) / len(rewards[i:i + 50]), 4)
                    for i in range(0, len(rewards), 50)],
    }


DEFAULT_CONFIG = "configs/tiny.yaml"


def report(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        key = (r["label"], json.dumps(r["env"], sort_keys=True), r["threads"], r["machine"],
               json.dumps(r["sets"]), r.get("config", DEFAULT_CONFIG))  # one group a config
        groups.setdefault(key, []).append(r)
    out = []
    for (label, env, threads, machine, sets, config), runs in groups.items():
        ok = [r for r in runs if "error" not in r]
        commits = ", ".join(dict.fromkeys(r["commit"] for r in runs))
        named = "" if config == DEFAULT_CONFIG else f" | config {config}"
        out.append(f"\n{label} | env {env} | {threads} thread(s) | sets {sets}{named} | "
                   f"commit {commits} | {machine}")
        for r in sorted(ok, key=lambda r: r["seed"]):
            out.append(f"  seed {r['seed']:3d}: {r['first20']:.3f} -> {r['last20']:.3f} "
                       f"(val pass@1 {r['val'].get('val/pass@1', float('nan')):.3f}, "
                       f"{r['seconds']:.0f} s)")
        if ok:
            last = sorted(r["last20"] for r in ok)
            out.append(f"  {len(ok)} runs: last-20 min {last[0]:.3f}, median "
                       f"{median(last):.3f}, max {last[-1]:.3f}; "
                       f">= 0.6: {sum(v >= 0.6 for v in last)}/{len(last)}")
        for r in runs:
            if "error" in r:
                out.append(f"  seed {r['seed']}: FAILED {r['error'][-300:]}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="a config override, e.g. model.num_generations=16")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--label", default="demo")
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help="the config to run, relative to the repository")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-cache-dir",
                        help="where builtin models are built (default: the user cache)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args(argv)
    if args.report:
        print(report(args.out))
        return
    if args.workers < 1 or args.threads < 1:
        parser.error("--workers and --threads must be >= 1")
    for flag, items in (("--set", args.sets), ("--env", args.env)):
        bad = [item for item in items if "=" not in item or not item.partition("=")[0]]
        if bad:
            parser.error(f"{flag} takes NAME=VALUE; got {bad[0]!r}")
    env = dict(item.split("=", 1) for item in args.env)
    meta = {"label": args.label, "config": args.config, "sets": args.sets, "env": env,
            "threads": args.threads,
            "commit": git_commit(ROOT), "machine": _cpu(), "date": time.strftime("%Y-%m-%d"),
            "torch": versions("torch")["torch"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def job(seed: int) -> dict[str, Any]:
        record = {**meta, **run_one(seed, args.sets, env, args.threads, args.model_cache_dir,
                                    args.config)}
        with args.out.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        if "error" in record:
            print(f"[{args.label}] seed {seed}: FAILED\n{record['error']}", flush=True)
        else:
            print(f"[{args.label}] seed {seed}: {record['first20']:.3f} -> {record['last20']:.3f}"
                  f"  curve {record['curve50']}  ({record['seconds']:.0f} s)", flush=True)
        return record

    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        list(pool.map(job, args.seeds))


if __name__ == "__main__":
    main()
