"""The tool demo (``configs/tiny_tools.yaml``) with and without its tool, same steps and seed.

    python benchmarks/tools_demo.py                 # seed 0, both runs
    python benchmarks/tools_demo.py --seeds 0 1 2
    python benchmarks/tools_demo.py --config configs/tiny_python.yaml --only tool \
        --seeds 0 1 2 --out benchmarks/results/python_demo.json   # the python tool

Each run is ``python -m maxent_grpo fit --config configs/tiny_tools.yaml
--seed_everything N`` in its own process; the run without the tool adds ``--model.tools
null`` (``data.tools`` follows it, so the prompts carry no tool schema and nothing answers a
call). For each run it records the first-20 and last-20 step means of
``train/reward/mean`` and of every ``train/tools/...`` scalar, the last validation values
and the wall time, and writes them to ``--out`` (default
``benchmarks/results/tools_demo.json``) with the machine and the commit; ``--report``
prints the table of that file.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_common import git_commit, versions  # noqa: E402
from demo_seeds import _cpu  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks/results/tools_demo.json"


def _window(values: list[float], first: bool) -> float | None:
    part = values[:20] if first else values[-20:]
    return round(sum(part) / len(part), 4) if part else None


def run_one(seed: int, tool: bool, cache_dir: str | None,
            config: Path = ROOT / "configs/tiny_tools.yaml") -> dict[str, Any]:
    from maxent_grpo.analysis import load_run

    with tempfile.TemporaryDirectory() as work:
        cmd = [sys.executable, "-m", "maxent_grpo", "fit", "--config",
               str(config), "--seed_everything", str(seed),
               "--trainer.enable_progress_bar", "false"]
        if not tool:
            cmd += ["--model.tools", "null"]
        if cache_dir:
            cmd += ["--model.model_cache_dir", cache_dir]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"run failed (seed {seed}, tool {tool}):\n{proc.stderr[-3000:]}")
        run = load_run(next(Path(work).glob("lightning_logs/*/version_0")))
    series = {tag: list(s.values) for tag, s in run.scalars.items()}
    train = {tag.removeprefix("train/"): [_window(v, True), _window(v, False)]
             for tag, v in series.items()
             if tag == "train/reward/mean" or tag.startswith("train/tools/")}
    val = {tag: round(float(v[-1]), 4) for tag, v in series.items()
           if tag.startswith("val/") and v}
    return {"seed": seed, "tool": tool, "steps": len(series["train/reward/mean"]),
            "seconds": round(seconds, 1), "first20_last20": train, "val_last": val}


def report(path: Path) -> str:
    data = json.loads(path.read_text())
    lines = [f"commit {data['commit']}, {data['machine']}", "",
             "| run | seed | reward first 20 → last 20 | tool success first 20 → last 20 "
             "| calls per sample | val pass@1 | minutes |", "|---|---:|---|---|---|---:|---:|"]
    for r in data["runs"]:
        t = r["first20_last20"]
        reward = t["reward/mean"]
        success = t.get("tools/success_rate", [None, None])
        calls = t.get("tools/calls_per_sample", [None, None])

        def pair(p: list) -> str:
            return "—" if p[0] is None else f"{p[0]:.3f} → {p[1]:.3f}"

        lines.append(f"| {'with the tool' if r['tool'] else 'without the tool'} | {r['seed']} "
                     f"| {pair(reward)} | {pair(success)} | {pair(calls)} "
                     f"| {r['val_last'].get('val/pass@1', float('nan')):.3f} "
                     f"| {r['seconds'] / 60:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--cache-dir", default=None, help="model.model_cache_dir of the runs")
    parser.add_argument("--only", choices=("tool", "no-tool"), default=None)
    parser.add_argument("--config", type=Path, default=ROOT / "configs/tiny_tools.yaml",
                        help="the demo's config (configs/tiny_python.yaml: the python tool)")
    parser.add_argument("--report", action="store_true", help="print the table of --out")
    args = parser.parse_args(argv)
    args.config = args.config.resolve()  # the runs start in a folder of their own
    if args.report:
        print(report(args.out))
        return
    runs: list[dict[str, Any]] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"commit": git_commit(ROOT), "machine": _cpu(),
              "versions": versions("torch", "transformers"),
              "config": (str(args.config.relative_to(ROOT)) if args.config.is_relative_to(ROOT)
                         else str(args.config)), "runs": runs}
    for seed in args.seeds:
        for tool in (True, False):
            if args.only and args.only != ("tool" if tool else "no-tool"):
                continue
            runs.append(run_one(seed, tool, args.cache_dir, args.config))
            print(json.dumps(runs[-1]), flush=True)
            args.out.write_text(json.dumps(record, indent=1) + "\n")  # kept run by run
    print(report(args.out))


if __name__ == "__main__":
    main()
