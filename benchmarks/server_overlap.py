"""Step time of a run on a local vLLM server, synchronous (max_staleness 0) against
asynchronous (1), with the server pinned to one core and the training to the other, and
unpinned; optionally the colocated engine (``VLLMEngine``, in the trainer's process) at the
same shape. Writes the per-step means over the last ``--window`` steps.

    .venv-vllm/bin/python benchmarks/server_overlap.py --steps 40 \
        --out benchmarks/results/server_overlap.json
    .venv-vllm/bin/python benchmarks/server_overlap.py --model builtin:smollm2-135m-instruct \
        --steps 5 --window 3 --pinning pinned --colocated \
        --set data.batch_size=8 model.num_generations=4 model.max_completion_length=64 \
              data.max_prompt_length=128 \
        --out benchmarks/results/server_overlap_smollm2.json

The shape is ``configs/tiny_vllm_server.yaml``'s unless ``--set`` changes it (each
``KEY=VALUE`` becomes ``--KEY=VALUE`` on the ``fit`` command line; the colocated run uses
``configs/tiny_vllm.yaml``, which differs in its engine and has no ``max_staleness`` or
``sampler_correction``). ``train`` is a synchronous step's time less its generation and
weight sync: what the trainer computes. The ideal asynchronous step is
``max(generate, train + sync)``. ``sync_s`` is the weight sync of each step
(``train/perf/sync_seconds``) and ``sync_bytes`` what it sent (server runs).
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
        "sync_s": "train/perf/sync_seconds", "tokens_per_s": "train/perf/tokens_per_s",
        "sync_bytes": "train/perf/sync_bytes"}


def run(k: int | None, steps: int, pin: bool, window: int, model: str,
        overrides: list[str]) -> dict:
    """One run: on the server with staleness ``k`` (pinned or not), or colocated
    (``k`` None, unpinned: the engine lives in the trainer's process)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    common = ["--trainer.enable_progress_bar=false", f"--trainer.max_steps={steps}",
              "--trainer.limit_val_batches=0", f"--model.model_name_or_path={model}",
              *(f"--{item}" for item in overrides)]
    if k is None:
        cmd = [sys.executable, "-m", "maxent_grpo", "fit", "--config",
               str(ROOT / "configs/tiny_vllm.yaml"), *common]
    else:
        cmd = [sys.executable, "-m", "maxent_grpo.serve", "--model", model,
               *(["--server-cpus", "1"] if pin else []), "--", "fit", "--config",
               str(ROOT / "configs/tiny_vllm_server.yaml"), *common,
               f"--model.max_staleness={k}"]
    with tempfile.TemporaryDirectory() as work:
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        acc = EventAccumulator(str(next(Path(work).glob("lightning_logs/*/version_0"))))
        acc.Reload()
        out = {}
        for name, tag in TAGS.items():
            if tag in acc.Tags()["scalars"]:
                values = [e.value for e in acc.Scalars(tag)][-window:]
                out[name] = sum(values) / len(values)
    out.update(engine="colocated" if k is None else "server", max_staleness=k or 0,
               pinned=pin, steps=steps, seconds=time.perf_counter() - start)
    return {key: round(v, 4) if isinstance(v, float) else v for key, v in out.items()}


def summarise(runs: list[dict], pin: bool) -> dict:
    sync, asyn = (next(r for r in runs if r["engine"] == "server" and r["pinned"] == pin
                       and r["max_staleness"] == k) for k in (0, 1))
    train = sync["step_s"] - sync["generate_s"] - sync["sync_s"]
    ideal = max(sync["generate_s"], train + sync["sync_s"])
    return {"sync_step_s": sync["step_s"], "async_step_s": asyn["step_s"],
            "generate_s": sync["generate_s"], "train_s": round(train, 4),
            "ideal_async_step_s": round(ideal, 4),
            "async_over_ideal": round(asyn["step_s"] / ideal, 3),
            "speedup": round(sync["step_s"] / asyn["step_s"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--window", type=int, default=30)
    parser.add_argument("--model", default="builtin:tiny-h64-warm")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="fit options for every run, e.g. data.batch_size=8")
    parser.add_argument("--pinning", nargs="+", choices=["pinned", "unpinned"],
                        default=["pinned", "unpinned"])
    parser.add_argument("--colocated", action="store_true",
                        help="also run the colocated engine (first, unpinned)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    if subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                      capture_output=True, text=True).stdout.strip():
        commit += " (with uncommitted changes)"
    runs = []
    plan = [(None, False)] if args.colocated else []
    plan += [(k, pin == "pinned") for pin in args.pinning for k in (0, 1)]  # alternated
    for k, pin in plan:
        runs.append(run(k, args.steps, pin, args.window, args.model, args.set))
        print(json.dumps(runs[-1]), flush=True)
    summary = {pin: summarise(runs, pin == "pinned") for pin in args.pinning}
    args.out.write_text(json.dumps({"commit": commit, "model": args.model, "set": args.set,
                                    "runs": runs, "summary": summary}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
