"""math-verify in a worker process, for the accuracy reward off the main thread.

math-verify limits a parse or a verify with ``signal.alarm``, which only works in the main
thread; in another thread (a reward with ``timeout``, which runs in one) an answer such as
``9**(9*9*9*9*9*9*9*9*9)`` has sympy compute the power in C, holding the GIL, and the whole
training process stops. :class:`Verifier` sends each comparison to a worker process
(``python -c "from maxent_grpo.rewards.verify_worker import serve; serve()"``: one JSON
line in, one line out), whose
main thread has the limit, and kills the worker when a comparison outlives it anyway; the
next comparison starts a new one.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
from typing import Any

__all__ = ["MATH_VERIFY_TIMEOUT_S", "VERIFIER", "Verifier", "math_equal", "serve"]

MATH_VERIFY_TIMEOUT_S = 5
"""Per-call time limit of math-verify's parse and verify. math-verify times out with
``signal.alarm``, which only works in the main thread; elsewhere :class:`Verifier` runs
them in the main thread of a worker process."""


def math_equal(gold: str, prediction: str, golds: dict[str, list]) -> bool:
    """Whether math-verify finds ``prediction`` equal to ``gold`` (each parse and the verify
    limited to :data:`MATH_VERIFY_TIMEOUT_S`, in the main thread only); the strings compared
    with runs of whitespace collapsed when it extracts nothing from either. ``golds``
    caches the parsed references."""
    from math_verify import parse, verify  # slow import, only when the reward is used

    if gold not in golds:
        golds[gold] = parse(gold, parsing_timeout=MATH_VERIFY_TIMEOUT_S)
    gold_parsed = golds[gold]
    prediction_parsed = parse(prediction, parsing_timeout=MATH_VERIFY_TIMEOUT_S)
    if gold_parsed and prediction_parsed:
        return bool(verify(gold_parsed, prediction_parsed, timeout_seconds=MATH_VERIFY_TIMEOUT_S))
    return " ".join(gold.split()) == " ".join(prediction.split())


class Verifier:
    """The worker, started on first use (a few seconds: it imports math-verify), one per
    process; calls from several threads take turns.

    Args:
        call_seconds: how long one comparison may take before the worker is killed (the
            worker's own limits end a parse or a verify after
            :data:`~maxent_grpo.rewards.correctness.MATH_VERIFY_TIMEOUT_S` each).
        start_seconds: how long the worker's start may take.
    """

    def __init__(self, call_seconds: float = 15.0, start_seconds: float = 120.0) -> None:
        self.call_seconds, self.start_seconds = call_seconds, start_seconds
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None

    def equal(self, gold: str, prediction: str) -> bool:
        """Whether math-verify finds ``prediction`` equal to ``gold`` (:func:`math_equal`);
        False when the worker gave no
        verdict within ``call_seconds`` (it is killed) or ended."""
        with self._lock:
            if self._process is None:
                self._start()
            process = self._process
            try:
                process.stdin.write(json.dumps([gold, prediction]) + "\n")
                process.stdin.flush()
                line = self._read(self.call_seconds)
            except OSError:  # the worker ended (killed from outside)
                line = None
            if line is None:
                self.close()
                return False
            return line == "1"

    def _read(self, seconds: float) -> str | None:
        """The worker's next line, or None when it wrote none within ``seconds``."""
        out = self._process.stdout
        ready, _, _ = select.select([out], [], [], seconds)
        line = out.readline() if ready else ""
        return line.strip() if line else None

    def _start(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", "from maxent_grpo.rewards.verify_worker import serve; serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        if self._read(self.start_seconds) != "ready":
            self.close()
            raise RuntimeError("the accuracy reward's math-verify worker process "
                               f"(maxent_grpo.rewards.verify_worker) did not start within "
                               f"{self.start_seconds:g} s")

    def close(self) -> None:
        """End the worker (the next comparison starts a new one)."""
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait()
            for pipe in (process.stdin, process.stdout):
                pipe.close()


#: the process's one worker
VERIFIER = Verifier()


def serve(lines: Any = None, out: Any = None) -> None:
    """The worker: ``[gold, prediction]`` JSON lines in (stdin), ``1`` / ``0`` lines out
    (stdout); anything else the libraries print goes to stderr, not into the answers."""
    lines = sys.stdin if lines is None else lines
    if out is None:
        out, sys.stdout = sys.stdout, sys.stderr
    golds: dict[str, list] = {}
    import math_verify  # noqa: F401 - the slow import, before "ready"

    print("ready", file=out, flush=True)
    for line in lines:
        gold, prediction = json.loads(line)
        print("1" if math_equal(gold, prediction, golds) else "0", file=out, flush=True)
