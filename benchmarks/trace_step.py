"""Which package files one demo training step runs: the figure docs/ARCHITECTURE.md quotes.

Runs ``configs/tiny.yaml`` (the README's demo, offline) for four steps with a profile hook
live only inside ``MaxEntGRPOModule.training_step`` on steps 2-4 (the first step also
builds the engine and loads what is loaded once), and prints every file of the
``maxent_grpo`` package a Python function of was called from, with the number of calls::

    .venv/bin/python benchmarks/trace_step.py            # the table
    .venv/bin/python benchmarks/trace_step.py --json     # {"files": {path: calls}, "count": n}

``tests/test_trace_step.py`` runs it and fails when the count exceeds its budget.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACED_STEPS = (1, 2, 3)  # batch indices: steps 2-4


def trace(config: str = "configs/tiny.yaml", steps: tuple[int, ...] = TRACED_STEPS
          ) -> Counter:
    """``{package file (relative to the repository): calls}`` inside the traced steps."""
    import maxent_grpo  # where the package is imported from, as its files are named
    from maxent_grpo.cli import main
    from maxent_grpo.training.module import MaxEntGRPOModule

    calls: Counter = Counter()
    imported = os.path.dirname(maxent_grpo.__file__)
    real = os.path.realpath(imported)

    def profile(frame, event, arg):  # noqa: ARG001 (sys.setprofile's signature)
        if event == "call":
            name = frame.f_code.co_filename
            if not os.path.isabs(name):  # made by exec (a dataclass's __init__): its module's
                name = frame.f_globals.get("__file__") or name
            if name.startswith(imported + os.sep) or name.startswith(real + os.sep):
                calls["maxent_grpo/" + os.path.relpath(os.path.realpath(name), real)] += 1

    original = MaxEntGRPOModule.training_step

    def training_step(self, batch, batch_idx):
        if batch_idx not in steps:
            return original(self, batch, batch_idx)
        sys.setprofile(profile)
        threading.setprofile(profile)  # threads the step starts (reward time-outs, ...)
        try:
            return original(self, batch, batch_idx)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)

    MaxEntGRPOModule.training_step = training_step
    try:
        with tempfile.TemporaryDirectory() as out:
            main(["fit", "--config", str(ROOT / config), f"--trainer.max_steps={max(steps) + 1}",
                  "--trainer.logger=false", "--trainer.enable_checkpointing=false",
                  "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0",
                  f"--trainer.default_root_dir={out}", "--trainer.callbacks=[]"],
                 exit_on_error=False)
    finally:
        MaxEntGRPOModule.training_step = original
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    calls = trace(args.config)
    if args.json:
        print(json.dumps({"count": len(calls), "files": dict(sorted(calls.items()))}))
        return
    for name, n in sorted(calls.items()):
        print(f"{n:8d}  {name}")
    print(f"{len(calls)} package files run by one demo training step (steps 2-4 of "
          f"{args.config})")


if __name__ == "__main__":
    main()
