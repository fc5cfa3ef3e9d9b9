"""GPU benchmark: one training step of ours (dynamic / static key/value cache, bf16 copy) vs TRL.

The workload of issue 13, built offline (``bench_common.WORKLOADS["qwen0.5b-gpu"]``): a
randomly initialised model shaped exactly like Qwen2.5-0.5B-Instruct (hidden 896, 24 layers,
14 heads, 2 KV heads, intermediate 4864, V = 151,936, tied embeddings), a byte-level
tokenizer whose eos id lies outside the vocabulary (every completion is exactly T tokens on
both sides), 8 prompts of 128 tokens x G = 8 x T = 256, bf16-mixed with float32 weights,
GRPO ``dr_grpo``, beta = 0, one optimizer step per rollout, AdamW, clip 1.0. One command::

    python benchmarks/gpu_step.py                    # on a GPU machine, about 5 minutes
    python benchmarks/gpu_step.py --shape tiny-cpu   # every stage at a tiny shape, on CPU
    python benchmarks/gpu_step.py --shape 0.5b-cpu --memory --skip static  # where memory goes
    python benchmarks/gpu_step.py --scoring both     # + ours with the fused head on and off
    python benchmarks/gpu_step.py --scoring static-both --skip dynamic --skip trl  # static too

Each side runs in its own process, one after the other (``_ours.py --cache dynamic``,
``_ours.py --cache static``, ``_ours.py --cache static --generation-dtype bfloat16``: the
rollout on a bf16 copy of the float32 weights, refreshed before each rollout, and
``_trl.py``; and ``_ours.py --cache vllm``, the rollout on ``VLLMEngine``, where ``vllm``
is installed): 2 warm-up and 6 timed steps. Printed per side: median step seconds, median
generation seconds, everything else (step - generation), completion tokens per second and
peak ``torch.cuda.max_memory_allocated``; then TRL's median step over each of ours, and the
median refresh of the bf16 copy (part of its generation seconds); then each side's peak
memory by phase (generate, score, backward, optimizer, other: ``bench_common.PhaseMemory``),
always on CUDA and with ``--memory`` on the CPU. ``--shape 0.5b-cpu`` runs the issue's model
and precision at a step small enough for the CPU (2 prompts of 32 tokens x 4 x 16), to see
where each side's memory goes without a GPU. Results: ``benchmarks/results/gpu_step.json``
(``--out``).

TRL runs with ``--trl-python`` (default ``benchmarks/.venv-trl/bin/python`` when it exists,
else this interpreter, as on a GPU machine where trl is installed beside our dependencies).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
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

SHAPES = {"gpu": "qwen0.5b-gpu", "tiny-cpu": "qwen-tiny-cpu", "0.5b-cpu": "qwen0.5b-cpu"}
DEFAULT_TRL_PYTHON = bc.BENCH_DIR / ".venv-trl" / "bin" / "python"


def sides(trl_python: str, scoring: str = "auto") -> dict[str, list[str]]:
    """Side name -> worker command (without the workload arguments); ``scoring`` is our
    sides' ``model.fused_lm_head`` (``auto``: fused on CUDA), ``both`` adds a dynamic-cache
    side for each of ``true`` and ``false``."""
    ours = [sys.executable, str(bc.BENCH_DIR / "_ours.py")]
    if scoring == "both":
        return {
            "ours (dynamic cache, fused head)": [*ours, "--cache", "dynamic",
                                                 "--fused-lm-head", "true"],
            "ours (dynamic cache, logits)": [*ours, "--cache", "dynamic",
                                             "--fused-lm-head", "false"],
            **sides(trl_python),
        }
    found = {
        "ours (dynamic cache)": [*ours, "--cache", "dynamic"],
        "ours (static cache)": [*ours, "--cache", "static"],
        "ours (static cache, bf16 copy)": [*ours, "--cache", "static",
                                           "--generation-dtype", "bfloat16"],
    }
    if scoring == "static-both":  # the fastest side with the fused head off too
        found["ours (static cache, bf16 copy, logits)"] = [
            *found["ours (static cache, bf16 copy)"], "--fused-lm-head", "false"]
    if importlib.util.find_spec("vllm") is not None:  # pip install vllm on the GPU machine
        found["ours (vLLM)"] = [*ours, "--cache", "vllm"]
    else:
        print("vllm is not installed here: the VLLMEngine side is left out", flush=True)
    return {**found, "trl": [trl_python, str(bc.BENCH_DIR / "_trl.py")]}


def run_worker(command: list[str], workload: str, timeout: float, log: Path,
               memory: bool = False) -> dict[str, Any]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    try:
        proc = subprocess.run([*command, "--workload", workload,
                               *(["--memory"] if memory else [])],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as error:  # keep what the worker printed
        out, err = (t.decode(errors="replace") if isinstance(t, bytes) else t or ""
                    for t in (error.stdout, error.stderr))
        log.write_text(out + "\n--- stderr ---\n" + err)
        raise RuntimeError(f"{command[1]} ran past {timeout:.0f} s; see {log}") from None
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{command[1]} failed (exit {proc.returncode}); see {log}")
    result = bc.parse_result(proc.stdout)
    result["process_s"] = time.perf_counter() - start
    return result


def summary(result: dict[str, Any]) -> dict[str, float | None]:
    steps, gen = result["step_s"], result["phases"]["generate_s"]
    tokens = [t / s for t, s in zip(result["completion_tokens"], steps, strict=True)]
    peak = result.get("peak_cuda_mib")
    if peak is not None and result.get("phase_peak_mib"):
        # the counter is reset at each phase mark: the run's peak is the largest phase's
        peak = max(peak, *result["phase_peak_mib"].values())
    return {
        "step_s": bc.median(steps),
        "generate_s": bc.median(gen),
        "other_s": bc.median([s - g for s, g in zip(steps, gen, strict=True)]),
        "tokens_per_s": bc.median(tokens),
        "peak_cuda_gib": None if peak is None else peak / 1024,
        "refresh_s": bc.median(result["phases"]["refresh_s"])
        if "refresh_s" in result["phases"] else None,
    }


def markdown(report: dict[str, Any]) -> str:
    rows = ["| side | median step (s) | generate (s) | everything else (s) | completion tok/s "
            "| peak max_memory_allocated (GiB) |", "|---|---:|---:|---:|---:|---:|"]
    for side, s in report["summary"].items():
        peak = "n/a" if s["peak_cuda_gib"] is None else f"{s['peak_cuda_gib']:.1f}"
        rows.append(f"| {side} | {s['step_s']:.3f} | {s['generate_s']:.3f} | "
                    f"{s['other_s']:.3f} | {s['tokens_per_s']:.0f} | {peak} |")
    trl = report["summary"].get("trl")
    if trl:
        rows.append("")
        for side, s in report["summary"].items():
            if side != "trl":
                rows.append(f"TRL step / {side} step: {trl['step_s'] / s['step_s']:.2f}x")
    refreshes = [(side, s["refresh_s"]) for side, s in report["summary"].items()
                 if s.get("refresh_s") is not None]
    if refreshes:
        rows.append("")
    for side, seconds in refreshes:
        rows.append(f"{side}: weight-copy refresh {seconds:.4f} s per rollout (in generate)")
    rows.extend(phase_markdown(report))
    rows.extend(f"{side}: FAILED, {why}" for side, why in report.get("failed", {}).items())
    return "\n".join(rows)


PHASES = ("generate", "score", "backward", "optimizer", "other")


def phase_markdown(report: dict[str, Any]) -> list[str]:
    """The phase-peak table (MiB) when the sides recorded one (CUDA, or ``--memory``)."""
    results = report.get("results", {})
    peaks = {side: r.get("phase_peak_mib") for side, r in results.items()}
    peaks = {side: p for side, p in peaks.items() if p}
    if not peaks:
        return []
    cuda = any(r.get("peak_cuda_mib") for r in results.values())
    what = ("max_memory_allocated while the phase ran" if cuda else
            "peak bytes of tensors created during the step, above the weights and "
            "optimizer state")
    rows = ["", f"Peak memory by phase (MiB; {what}):", "",
            "| phase | " + " | ".join(peaks) + " |",
            "|---|" + "---:|" * len(peaks)]
    for phase in PHASES:
        cells = [f"{p[phase]:.0f}" if phase in p else "-" for p in peaks.values()]
        rows.append(f"| {phase} | " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpu")
    parser.add_argument("--trl-python", default=str(DEFAULT_TRL_PYTHON)
                        if DEFAULT_TRL_PYTHON.exists() else sys.executable)
    parser.add_argument("--skip", action="append", default=[],
                        help="a side to leave out, e.g. --skip trl (repeatable)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per worker")
    parser.add_argument("--scoring", choices=("auto", "both", "static-both"), default="auto",
                        help="both: also run ours with the fused LM head forced on and off "
                        "(model.fused_lm_head true / false), to compare their time and memory; "
                        "static-both: also the static cache with the bf16 copy and the head off")
    parser.add_argument("--memory", action="store_true",
                        help="CPU: record each phase's peak tensor bytes (slower; on CUDA "
                        "the phase peaks are always recorded)")
    parser.add_argument("--out", type=Path, default=bc.BENCH_DIR / "results" / "gpu_step.json")
    parser.add_argument("--trl-second", action="store_true",
                        help="run TRL right after the first side (before the compiled ones)")
    parser.add_argument("--log-dir", type=Path, default=bc.CACHE_DIR / "logs",
                        help="where each side's stdout and stderr go")
    args = parser.parse_args()

    workload = bc.WORKLOADS[SHAPES[args.shape]]
    started = time.perf_counter()
    print(f"preparing {workload.name} ...", flush=True)
    bc.prepare_workload(workload)
    log_dir = args.log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    failed: dict[str, str] = {}
    report = write_report(args.out, workload.name, results, failed, started)
    chosen = sides(args.trl_python, args.scoring)
    if args.trl_second and "trl" in chosen:  # a short lease measures TRL before the compiles
        names = list(chosen)
        names.insert(1, names.pop(names.index("trl")))
        chosen = {name: chosen[name] for name in names}
    for number, (side, command) in enumerate(chosen.items()):
        if any(skip in side for skip in args.skip):
            continue
        print(f"running {side} ...", flush=True)
        log = log_dir / f"gpu_step-{workload.name}-{side.split()[0]}-{number}.log"
        try:
            results[side] = run_worker(command, workload.name, args.timeout, log, args.memory)
        except RuntimeError as error:
            # one side's failure or time-out is recorded, and the other sides still run
            failed[side] = str(error).splitlines()[0]
            print(f"{side} FAILED: {failed[side]}", flush=True)
            if log.exists():
                print(log.read_text()[-3000:], flush=True)
        report = write_report(args.out, workload.name, results, failed, started)
    print(markdown(report))
    print(f"\n{report['total_s']:.0f} s in all; JSON: {args.out}")


def write_report(out: Path, workload: str, results: dict[str, Any], failed: dict[str, str],
                 started: float) -> dict[str, Any]:
    """The report so far, written after every side (a run stopped from outside keeps it)."""
    report = {
        "workload": workload,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                    "gpu": gpu_name()},
        "results": results,
        "failed": failed,
        "summary": {side: summary(r) for side, r in results.items()},
        "total_s": time.perf_counter() - started,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return report


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
