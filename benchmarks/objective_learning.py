"""Records the digit task of ``tests/objective_learning.py`` for every objective on several
seeds: the runs from which ``tests/training/test_objectives_learn.py`` takes its bounds.

    python benchmarks/objective_learning.py --seeds 0 1 2 3 4 \
        --out benchmarks/results/objective_learning.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.objective_learning import OBJECTIVES, STEPS, WINDOW, first_and_last, learning_curve  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    runs = []
    with tempfile.TemporaryDirectory() as cache:
        for name in OBJECTIVES:
            for seed in args.seeds:
                start = time.perf_counter()
                curve = learning_curve(name, seed, cache)
                first, last = first_and_last(curve)
                seconds = round(time.perf_counter() - start, 1)
                runs.append({"objective": name, "seed": seed, "first": round(first, 4),
                             "last": round(last, 4), "seconds": seconds,
                             "curve": [round(v, 4) for v in curve]})
                print(f"{name:15s} seed {seed}: first {WINDOW} {first:.3f} -> last {WINDOW} "
                      f"{last:.3f} ({runs[-1]['seconds']} s)", flush=True)
    args.out.write_text(json.dumps({"steps": STEPS, "window": WINDOW, "commit": commit,
                                    "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
