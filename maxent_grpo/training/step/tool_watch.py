"""A console warning when most tool calls fail, naming how they fail.

Without it, a run whose tool calls all time out, or whose model writes no readable call,
shows nothing but a reward near 0 (``train/tools/failures/<kind>`` holds the counts, but
nobody looks there before knowing to). :class:`ToolFailureWatch` adds up the tool calls
(or environment steps) of the last ``window`` steps (5 by default; fewer at the start of a
run) and, at the end of a step, when those steps ran at least ``min_calls`` calls and more
than ``threshold`` of them (half by default) failed, logs one warning (logger
``maxent_grpo.training.step.tool_watch``) that names the failure kind with the most
failures over the window (:data:`~maxent_grpo.rollout.toolcall.FAILURE_KINDS`: a
time-out, a malformed call, an unknown tool, bad arguments, an error the tool raised), the
share of every kind that failed, and what to change. A run of steps without any call is
not failing (the progress line's ``tool success`` shows it) and never warns.

Once per kind: a kind already named in this run is not named again, so a run that keeps
failing the same way warns once instead of every step (which would bury the progress
lines), while a run that fixes one fault and meets another (time-outs gone, the calls now
malformed) hears about the second: each kind has its own remedy. The counts are this
process's own rollouts (on several ranks, rank 0's calls are a sample of all of them);
only global rank 0 warns. :class:`~maxent_grpo.training.step.step_log.StepMetrics` feeds
it each step's :class:`~maxent_grpo.rollout.protocol.ToolUsage` and ends its steps.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from maxent_grpo.rollout.toolcall import FAILURE_KINDS
from maxent_grpo.validation import check_int, check_number

if TYPE_CHECKING:
    from maxent_grpo.rollout.protocol import ToolUsage

__all__ = ["FAILURE_HINTS", "FAILURE_NAMES", "ToolFailureWatch"]

log = logging.getLogger(__name__)

#: failure kind -> the words the warning uses for it
FAILURE_NAMES = {"malformed": "malformed call", "unknown_tool": "unknown tool",
                 "bad_arguments": "bad arguments", "error": "tool error",
                 "timeout": "time-out"}

#: failure kind -> what the warning suggests
FAILURE_HINTS = {
    "malformed": "The model's <tool_call> blocks are not JSON objects with a \"name\" (the "
                 "call format is in maxent_grpo/rollout/toolcall.py); a model never taught "
                 "that format writes such calls: start from one that was (the tiny tool demos "
                 "start from builtin:tiny-tools-warm)",
    "unknown_tool": "The model calls tools that model.tools does not hold; check the names "
                    "in model.tools against the ones the prompts show",
    "bad_arguments": "The calls' arguments do not match the tools' signatures (missing, "
                     "extra or mistyped arguments)",
    "error": "The tools (or the environment's step) raise, or their sandbox fails; the "
             "logged samples (CompletionSamples) show the error messages the model reads",
    "timeout": "The calls (or environment steps) run past model.tool_timeout seconds: raise "
               "it, or make the tool faster",
}


class ToolFailureWatch:
    """Warns once per failure kind when most recent tool calls fail (module docstring).

    Args:
        window: the steps whose calls are added up (>= 1).
        threshold: warn when more than this share of those calls failed (0 to 1).
        min_calls: fewer calls over the window never warn (>= 1), so that a step with
            one failed call of one does not.
    """

    def __init__(self, window: int = 5, threshold: float = 0.5, min_calls: int = 4) -> None:
        check_int("window", window, minimum=1)
        check_number("threshold", threshold, minimum=0, maximum=1)
        check_int("min_calls", min_calls, minimum=1)
        self.window, self.threshold, self.min_calls = window, threshold, min_calls
        self.steps: deque[tuple[int, dict[str, int]]] = deque(maxlen=window)
        self.warned: set[str] = set()  # the kinds already named in this run
        self._calls, self._failures = 0, dict.fromkeys(FAILURE_KINDS, 0)

    def add(self, tools: ToolUsage) -> None:
        """Count a rollout's calls and failures into the current step."""
        self._calls += int(tools.calls.sum())
        for kind, counts in tools.failures.items():
            self._failures[kind] = self._failures.get(kind, 0) + int(counts.sum())

    def end_step(self, step: int, rank_zero: bool = True) -> str | None:
        """Close the current step (its counts join the window) and return the warning's text
        when it warns (logged when ``rank_zero``), else None."""
        self.steps.append((self._calls, self._failures))
        self._calls, self._failures = 0, dict.fromkeys(FAILURE_KINDS, 0)
        calls = sum(c for c, _ in self.steps)
        failures = dict.fromkeys(FAILURE_KINDS, 0)
        for _, counts in self.steps:
            for kind, n in counts.items():
                failures[kind] = failures.get(kind, 0) + n
        failed = sum(failures.values())
        if calls < self.min_calls or failed <= self.threshold * calls:
            return None
        kind = max(failures, key=failures.__getitem__)  # ties: the first in FAILURE_KINDS
        if kind in self.warned:
            return None
        self.warned.add(kind)
        shares = ", ".join(f"{FAILURE_NAMES.get(k, k)} {n / calls:.0%}"
                           for k, n in failures.items() if n)
        text = (f"most tool calls fail: {failed} of the {calls} calls of the last "
                f"{len(self.steps)} step(s) up to step {step} failed, most by "
                f"{FAILURE_NAMES.get(kind, kind)} (train/tools/failures/{kind}; {shares}). "
                f"{FAILURE_HINTS.get(kind, '')}. This warning is not repeated for this kind.")
        if rank_zero:
            log.warning("%s", text)
        return text
