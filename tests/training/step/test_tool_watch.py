"""The warning when most tool calls fail (``step_log.ToolFailureWatch``): one per failure
kind, naming it, on multi-turn rollouts whose calls all time out (the component)
and in a fit whose calls are all malformed (the whole step path)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from maxent_grpo.rollout import SamplingSettings
from maxent_grpo.rollout.multiturn import MultiTurnEngine
from maxent_grpo.rollout.protocol import ToolUsage
from maxent_grpo.rollout.toolcall import FAILURE_KINDS, Toolbox
from maxent_grpo.training.step.step_log import ToolFailureWatch
from tests.conftest import fit, make_data, make_module
from tests.rollout.test_multiturn import TOK, Scripted

WATCH = "maxent_grpo.training.step.step_log"
SLOW_CALL = '<tool_call>{"name": "slow", "arguments": {"x": 1}}</tool_call>'
MALFORMED = "<tool_call>calculate 6 * 7</tool_call>"


def slow(x: int) -> str:
    """Answer after a while.

    Args:
        x: anything.
    """
    time.sleep(1.0)
    return str(x)


def usage(calls: list[int], **failures: list[int]) -> ToolUsage:
    """A rollout's tool record with these per-row calls and failures (other kinds 0)."""
    n = len(calls)
    return ToolUsage(
        messages=[[] for _ in range(n)], turns=torch.ones(n, dtype=torch.long),
        calls=torch.tensor(calls), failures={k: torch.tensor(failures.get(k, [0] * n))
                                             for k in FAILURE_KINDS})


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == WATCH and r.levelno == logging.WARNING]


def test_calls_that_all_time_out_warn_once_naming_the_time_out(caplog):
    """Multi-turn rollouts whose every call runs past the time limit: the watch fed three
    steps of them warns once, at the first step, naming the time-out and its setting."""
    box = Toolbox([slow], timeout=0.05)
    engine = MultiTurnEngine(Scripted([SLOW_CALL, "1"]), TOK,
                             SamplingSettings(max_new_tokens=200), toolbox=box,
                             max_tool_calls=1)
    watch = ToolFailureWatch()
    caplog.set_level(logging.WARNING, logger=WATCH)
    texts = []
    for step in (1, 2, 3):
        out = engine.generate(["q"], ["1"], 4)
        assert out.tools.calls.tolist() == [1] * 4
        assert out.tools.failures["timeout"].tolist() == [1] * 4  # every call timed out
        watch.add(out.tools)
        texts.append(watch.end_step(step))
    assert texts[1:] == [None, None]
    (warning,) = warnings_of(caplog)
    assert warning == texts[0]
    assert "4 of the 4 calls of the last 1 step(s) up to step 1 failed" in warning
    assert "most by time-out (train/tools/failures/timeout; time-out 100%)" in warning
    assert "model.tool_timeout" in warning


def test_when_it_warns_and_when_not(caplog):
    caplog.set_level(logging.WARNING, logger=WATCH)
    watch = ToolFailureWatch(window=2, min_calls=4)
    watch.add(usage([1, 1, 1], malformed=[1, 1, 1]))  # 3 calls: under min_calls
    assert watch.end_step(1) is None
    watch.add(usage([1, 1], error=[0, 0]))  # 5 calls over the window, 3 failed: 60 %
    text = watch.end_step(2)
    assert text is not None and "3 of the 5 calls of the last 2 step(s)" in text
    assert "most by malformed call" in text and "malformed call 60%" in text
    watch.add(usage([2, 2], malformed=[2, 2]))  # malformed again: said already
    assert watch.end_step(3) is None
    watch.add(usage([4], error=[2], timeout=[1]))  # the window: steps 3 and 4
    text = watch.end_step(4)  # 7 of 8 failed, malformed still the most: nothing new
    assert text is None
    for step in (5, 6):  # the model learnt the format; now the tool raises
        watch.add(usage([2, 2], error=[2, 1]))
        text = watch.end_step(step)
        assert (text is None) == (step == 6)  # steps 4-5: 6 of 8 failed, 5 by error
    assert ("6 of the 8 calls of the last 2 step(s) up to step 5 failed, most by tool error "
            "(train/tools/failures/error; tool error 62%, time-out 12%)") in warnings_of(
        caplog)[-1]
    assert len(warnings_of(caplog)) == 2  # malformed, then error: once each

    quiet = ToolFailureWatch(window=1)
    for step, tools in enumerate([usage([0] * 8), usage([4, 4], timeout=[2, 2])], start=1):
        quiet.add(tools)  # no calls at all; then exactly half failed: not "most"
        assert quiet.end_step(step) is None
    assert quiet.end_step(3) is None  # a step without tools: no calls
    assert quiet.end_step(4, rank_zero=False) is None
    with pytest.raises(ValueError, match="window"):
        ToolFailureWatch(window=0)

    other_rank = ToolFailureWatch()
    other_rank.add(usage([4], timeout=[4]))
    assert "time-out" in other_rank.end_step(1, rank_zero=False)  # decided, not logged
    assert len(warnings_of(caplog)) == 2


class AlwaysMalformed(Scripted):
    """Every turn is a malformed call (an engine factory: ``(model, tokenizer, sampling)``)."""

    def __init__(self, model, tokenizer, sampling):
        super().__init__([MALFORMED])


def test_a_fit_whose_calls_are_all_malformed_warns_once_naming_it(cache_dir, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=WATCH)
    module = make_module(cache_dir, tools=["calculate"], engine=AlwaysMalformed,
                         max_completion_length=120, max_tool_calls=2, max_prompt_length=None)
    data = make_data(cache_dir, task="tool_arithmetic", task_options=None, tools=["calculate"],
                     max_prompt_length=None)
    trainer = fit(module, data, steps=3, tmp_path=tmp_path)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert logged["train/tools/failures/malformed"] == 1.0
    assert logged["train/tools/success_rate"] == 0.0
    (warning,) = warnings_of(caplog)
    assert "up to step 1 failed, most by malformed call (train/tools/failures/malformed" in warning
    assert "<tool_call>" in warning  # what to change
