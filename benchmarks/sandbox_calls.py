"""Calls per second of the sandbox pool (``maxent_grpo.rollout.sandbox``) against a fresh
interpreter per call.

Run with our environment::

    .venv/bin/python benchmarks/sandbox_calls.py --calls 200

Four ways to run ``print(1)`` ``--calls`` times, one after another, in this order:

- ``pool``: ``Sandbox.run`` on a started pool (its start, and a first call, are timed
  apart as ``start_ms``): back to back, so the spares are replaced while calls run;
- ``pool_paced``: the same with a pause between calls (``--pause`` seconds), so a ready
  spare is always waiting: the latency a rollout sees when calls come one at a time;
- ``python_c``: ``subprocess.run([sys.executable, "-c", code])``, a fresh interpreter with
  its site packages, what a plain subprocess tool does (no limits, no isolation);
- ``python_isolated``: the same with ``-I -S``, the cheapest interpreter start.

Each gets calls per second and the median and 90th percentile milliseconds per call. One
JSON line is printed, with the machine's CPU count and load average and the protections
in force (as root: own uid, network, pid and mount namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CODE = "print(1)"


def summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"calls_per_s": round(len(seconds) / sum(seconds), 1),
            "ms_median": round(1000 * statistics.median(ordered), 2),
            "ms_p90": round(1000 * ordered[int(0.9 * (len(ordered) - 1))], 2)}


def timed(fn, calls: int, pause: float = 0.0) -> list[float]:
    seconds = []
    for _ in range(calls):
        if pause:
            time.sleep(pause)
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--spares", type=int, default=2)
    parser.add_argument("--pause", type=float, default=0.05)
    args = parser.parse_args()
    from maxent_grpo.rollout.sandbox import Sandbox

    def fresh(*flags: str):
        def run() -> None:
            done = subprocess.run([sys.executable, *flags, "-c", CODE], capture_output=True,
                                  text=True, check=True)
            assert done.stdout == "1\n"
        return run

    report: dict = {"calls": args.calls, "spares": args.spares, "cpus": os.cpu_count(),
                    "load_average": [round(x, 2) for x in os.getloadavg()],
                    "python": sys.version.split()[0]}
    with Sandbox(timeout=30.0, spares=args.spares) as pool:
        start = time.perf_counter()
        first = pool.run(CODE)
        report["start_ms"] = round(1000 * (time.perf_counter() - start), 1)
        report["protections"] = pool.protections

        def call() -> None:
            result = pool.run(CODE)
            assert result.failure is None and result.output == "1\n", result

        assert first.output == "1\n", first
        report["pool"] = summary(timed(call, args.calls))
        report["pool_paced"] = summary(timed(call, args.calls, args.pause))
    report["python_c"] = summary(timed(fresh(), args.calls))
    report["python_isolated"] = summary(timed(fresh("-I", "-S"), args.calls))
    report["speedup_vs_python_c"] = round(
        report["pool"]["calls_per_s"] / report["python_c"]["calls_per_s"], 2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
