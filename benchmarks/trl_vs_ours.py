"""Side-by-side benchmark: our trainer vs TRL's ``GRPOTrainer`` on identical work.

Run with our environment, after ``bash benchmarks/setup_trl_venv.sh`` made TRL's::

    .venv/bin/python benchmarks/trl_vs_ours.py --workload all --rounds 2

For each workload (``tiny``: ``builtin:tiny``; ``smollm2``: SmolLM2-135M-Instruct; see
``bench_common.WORKLOADS``) the driver prepares the shared model folder and prompts once, then
runs ``rounds`` rounds; each round starts one worker process per side (``_ours.py`` with our
python, ``_trl.py`` with TRL's), which runs ``warmup`` untimed and ``steps`` timed optimizer
steps and prints per-step seconds, completion tokens and its peak RSS.

Interleaving (``--mode``): ``lockstep`` (default) starts both workers together, waits until
both have loaded, then paces them step by step (ours, trl, trl, ours, ours, trl, ...): a worker
blocks before each step until the driver tells it to go, so only one side computes at a time
and the k-th steps of the two sides run seconds apart; load from other processes then hits
both sides alike. ``sequential`` runs whole workers one after the other, order alternating
per round.

Reported per side (pooled over the timed steps of all rounds): median step seconds, median
completion tokens per second (per-step tokens / per-step seconds), peak RSS (max over rounds),
and the ratios TRL / ours (step time, memory) and ours / TRL (tokens/s): above 1 means ours is
faster / leaner. A per-phase breakdown (generate, reward, score, backward + optimizer, other)
follows. Results go to a JSON file (``--out``) and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import bench_common as bc  # noqa: E402

OURS_PYTHON = bc.REPO_DIR / ".venv" / "bin" / "python"
TRL_PYTHON = bc.BENCH_DIR / ".venv-trl" / "bin" / "python"
VLLM_PYTHON = bc.REPO_DIR / ".venv-vllm" / "bin" / "python"  # make setup-vllm
WORKERS = {"ours": (OURS_PYTHON, bc.BENCH_DIR / "_ours.py"),
           "trl": (TRL_PYTHON, bc.BENCH_DIR / "_trl.py")}
PHASES = ("generate_s", "reward_s", "score_s", "backward_s")


def machine_info() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(),
            "date": dt.datetime.now().astimezone().isoformat(timespec="seconds")}


def worker_command(side: str, workload: str, args: argparse.Namespace
                   ) -> tuple[list[str], dict[str, str]]:
    python, script = WORKERS[side]
    cmd = [str(python), str(script), "--workload", workload, "--seed", str(args.seed)]
    if side == "ours" and args.ours_engine == "vllm":
        cmd[0] = str(VLLM_PYTHON)
        cmd += ["--cache", "vllm"]
    if args.warmup is not None:
        cmd += ["--warmup", str(args.warmup)]
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    if args.allow_eos:
        cmd.append("--allow-eos")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    return cmd, env


def run_worker(side: str, workload: str, args: argparse.Namespace, log_dir: Path
               ) -> dict[str, Any]:
    """One worker on its own (sequential mode)."""
    cmd, env = worker_command(side, workload, args)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=bc.REPO_DIR,
                          timeout=args.timeout)
    log = log_dir / f"{workload}-{side}-{int(time.time())}.log"
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-25:])
        raise RuntimeError(f"{side} worker failed on {workload} (exit {proc.returncode}); "
                           f"log: {log}\n{tail}")
    result = bc.parse_result(proc.stdout)
    print(f"  {side:4s} {workload}: median step {bc.median(result['step_s']):.3f} s "
          f"({time.perf_counter() - start:.0f} s incl. start-up)", file=sys.stderr, flush=True)
    return result


def _read_until(proc: subprocess.Popen, mark: str, side: str, log: Path) -> list[str]:
    """Lines of ``proc``'s stdout up to and including ``mark``; error if it exits first."""
    lines = []
    while True:
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            tail = "\n".join(log.read_text().splitlines()[-25:]) if log.exists() else ""
            raise RuntimeError(f"{side} worker ended (exit {proc.returncode}) before "
                               f"{mark}; log: {log}\n{tail}")
        lines.append(line)
        if line.strip() == mark:
            return lines


def run_lockstep(workload: bc.Workload, args: argparse.Namespace, log_dir: Path
                 ) -> dict[str, dict[str, Any]]:
    """Both workers at once, their steps alternating: ours, trl, trl, ours, ours, trl, ...

    Each worker waits for a line on stdin before every step, so only one side computes at a
    time, and the two sides' k-th steps run seconds apart (load drift hits both alike).
    """
    warmup = workload.warmup if args.warmup is None else args.warmup
    steps = workload.steps if args.steps is None else args.steps
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    stamp = int(time.time())
    try:
        for side in ("ours", "trl"):
            cmd, env = worker_command(side, workload.name, args)
            logs[side] = log_dir / f"{workload.name}-{side}-{stamp}.log"
            procs[side] = subprocess.Popen(
                [*cmd, "--lockstep"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=logs[side].open("w"), text=True, env=env, cwd=bc.REPO_DIR, bufsize=1,
            )
        for side, proc in procs.items():  # start-up (model loading) done on both sides
            _read_until(proc, bc.READY_MARK, side, logs[side])
        for k in range(warmup + steps):
            order = ("ours", "trl") if k % 2 == 0 else ("trl", "ours")
            for side in order:
                procs[side].stdin.write("go\n")
                procs[side].stdin.flush()
                _read_until(procs[side], bc.DONE_MARK, side, logs[side])
            print(f"  step {k + 1}/{warmup + steps} done", file=sys.stderr, flush=True)
        results = {}
        for side, proc in procs.items():
            proc.stdin.close()
            out = proc.stdout.read()
            if proc.wait(timeout=args.timeout) != 0:
                raise RuntimeError(f"{side} worker failed (exit {proc.returncode}); "
                                   f"log: {logs[side]}")
            results[side] = bc.parse_result(out)
            print(f"  {side:4s} {workload.name}: median step "
                  f"{bc.median(results[side]['step_s']):.3f} s", file=sys.stderr, flush=True)
        return results
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the timed steps of one side's rounds."""
    steps = [s for r in results for s in r["step_s"]]
    tokens = [t for r in results for t in r["completion_tokens"]]
    phases = {k: [v for r in results for v in r["phases"].get(k, [])] for k in PHASES}
    other = [s - sum(phases[k][i] for k in PHASES) for i, s in enumerate(steps)]
    return {
        "median_step_s": bc.median(steps),
        "min_step_s": min(steps),
        "max_step_s": max(steps),
        "median_tokens_per_s": bc.median([t / s for t, s in zip(tokens, steps, strict=True)]),
        "mean_completion_tokens": sum(tokens) / len(tokens),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in results),
        "phases_median_s": {**{k: bc.median(v) for k, v in phases.items()},
                            "other_s": bc.median(other)},
        "per_round_median_step_s": [bc.median(r["step_s"]) for r in results],
        "step_s": steps,
        "num_steps": len(steps),
    }


def compare(ours: dict[str, Any], trl: dict[str, Any]) -> dict[str, float]:
    pairs = zip(ours["per_round_median_step_s"], trl["per_round_median_step_s"], strict=True)
    return {
        "step_time_trl_over_ours": trl["median_step_s"] / ours["median_step_s"],
        "tokens_per_s_ours_over_trl": ours["median_tokens_per_s"] / trl["median_tokens_per_s"],
        "peak_rss_trl_over_ours": trl["peak_rss_mib"] / ours["peak_rss_mib"],
        "per_round_step_time_trl_over_ours": [t / o for o, t in pairs],
        "median_paired_step_ratio_trl_over_ours": bc.median(
            [t / o for o, t in zip(ours["step_s"], trl["step_s"], strict=True)]),
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| workload | side | median step (s) | completion tokens/s | mean tokens/step "
        "| peak RSS (MiB) | TRL / ours step time | ours / TRL tokens/s | TRL / ours peak RSS |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, entry in report["workloads"].items():
        c = entry["comparison"]
        for side in ("ours", "trl"):
            s = entry[side]
            ratio = (f"**{c['step_time_trl_over_ours']:.2f}x**",
                     f"{c['tokens_per_s_ours_over_trl']:.2f}x",
                     f"{c['peak_rss_trl_over_ours']:.2f}x") if side == "ours" else ("", "", "")
            lines.append(
                f"| {name} | {side} | {s['median_step_s']:.3f} | {s['median_tokens_per_s']:.1f} "
                f"| {s['mean_completion_tokens']:.0f} | {s['peak_rss_mib']:.0f} | "
                + " | ".join(ratio) + " |"
            )
    lines += ["", "Phase medians (s): generate / reward / score (forward) / backward+optimizer / "
              "other (step minus the four)", "",
              "| workload | side | generate | reward | score | backward+opt | other |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for name, entry in report["workloads"].items():
        for side in ("ours", "trl"):
            p = entry[side]["phases_median_s"]
            lines.append(f"| {name} | {side} | {p['generate_s']:.3f} | {p['reward_s']:.4f} | "
                         f"{p['score_s']:.3f} | {p['backward_s']:.3f} | {p['other_s']:.3f} |")
    lines += ["", "TRL / ours step time, median of the per-step pairs (k-th step of each side): "
              + "; ".join(f"{name}: {e['comparison']['median_paired_step_ratio_trl_over_ours']:.2f}"
                          for name, e in report["workloads"].items())
              + ". Per round (medians): " + "; ".join(
                  f"{name}: " + ", ".join(
                      f"{x:.2f}" for x in e["comparison"]["per_round_step_time_trl_over_ours"])
                  for name, e in report["workloads"].items())]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=[*bc.CPU_CHOICES, "all"], default="all")
    parser.add_argument("--ours-engine", choices=("hf", "vllm"), default="hf",
                        help="our rollout engine: HFGenerateEngine (our environment) or "
                        "VLLMEngine (the vLLM environment, make setup-vllm)")
    parser.add_argument("--mode", choices=("lockstep", "sequential"), default="lockstep",
                        help="lockstep: both workers live, steps alternate one by one; "
                             "sequential: one worker after the other, order alternating")
    parser.add_argument("--rounds", type=int, default=1, help="worker pairs per workload")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per worker (default: the workload's)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps per worker (default: the workload's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS for both sides (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--allow-eos", action="store_true",
                        help="keep the model's eos: completion lengths then vary per side")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker")
    parser.add_argument("--out", type=Path, default=bc.BENCH_DIR / "results" / "trl_vs_ours.json")
    args = parser.parse_args()
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1; got {args.rounds}")
    for side, (python, _) in WORKERS.items():
        if not python.exists():
            hint = "bash benchmarks/setup_trl_venv.sh" if side == "trl" else "make setup"
            raise FileNotFoundError(f"{side}: {python} not found; run {hint}")

    names = bc.CPU_WORKLOADS if args.workload == "all" else [args.workload]
    log_dir = bc.CACHE_DIR / "logs"  # worker stdout/stderr (git-ignored)
    log_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", "benchmarks/trl_vs_ours.py", *sys.argv[1:]]),
        "machine": machine_info(),
        "fixed_length": not args.allow_eos,
        "threads": args.threads,
        "mode": args.mode,
        "workloads": {},
    }
    for name in names:
        workload = bc.WORKLOADS[name]
        bc.prepare_workload(workload, fixed_length=not args.allow_eos)
        print(f"{name}: B={workload.batch_prompts} G={workload.num_generations} "
              f"T={workload.max_completion_length}, {args.rounds} rounds", file=sys.stderr)
        runs: dict[str, list] = {"ours": [], "trl": []}
        for r in range(args.rounds):
            if args.mode == "lockstep":
                pair = run_lockstep(workload, args, log_dir)
                for side in ("ours", "trl"):
                    runs[side].append(pair[side])
                continue
            order = ("ours", "trl") if r % 2 == 0 else ("trl", "ours")
            for side in order:
                runs[side].append(run_worker(side, name, args, log_dir))
        ours, trl = summarise(runs["ours"]), summarise(runs["trl"])
        report["workloads"][name] = {
            "workload": {k: v for k, v in vars(workload).items()},
            "ours": ours, "trl": trl, "comparison": compare(ours, trl),
            "versions": {"ours": runs["ours"][0]["versions"], "trl": runs["trl"][0]["versions"]},
            "raw": runs,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    print(markdown(report))
    print(f"\nwritten: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
