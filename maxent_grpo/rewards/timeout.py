"""A time limit on a reward function (``model.rewards.<name>.timeout``).

The function runs in a daemon thread and the step waits at most ``timeout`` seconds. Then
the step either stops with :class:`RewardTimeout`, or, with a ``fallback``, every row of
that call gets the fallback value and a warning is logged. Python cannot stop a thread: a
call that never returns keeps its thread until the process ends (run untrusted code in a
subprocess that can be killed); the accuracy reward's math-verify comparisons of a call
that timed out end (the worker's comparison in flight killed, the rest not made), so later
calls do not wait for them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from maxent_grpo.rewards.verify_worker import VERIFIER
from maxent_grpo.rollout.toolcall import timed_call

__all__ = ["RewardTimeout", "TimedReward", "awaited", "rewards_loop"]

log = logging.getLogger(__name__)


class RewardTimeout(TimeoutError):
    """A reward function gave no result within its ``timeout``."""


_LOOP: tuple[int, asyncio.AbstractEventLoop] | None = None  # (the process, its loop)
_LOOP_LOCK = threading.Lock()


def rewards_loop() -> asyncio.AbstractEventLoop:
    """The event loop of this process's ``async def`` rewards, run by a daemon thread and
    kept for the run (as TRL keeps one): a client or semaphore a reward module creates once
    stays usable on the next step (a loop per call closed it)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP[0] != os.getpid():  # a forked child has no such thread
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="maxent-grpo-async-rewards",
                             daemon=True).start()
            _LOOP = (os.getpid(), loop)
        return _LOOP[1]


def awaited(value: Any, timeout: float | None = None) -> Any:
    """``value``, or when a reward returned an awaitable (an ``async def`` reward) its
    result, run on :func:`rewards_loop`; after ``timeout`` seconds it is cancelled and
    :class:`RewardTimeout` raised."""
    if not inspect.isawaitable(value):
        return value

    async def result() -> Any:
        return await value

    future = asyncio.run_coroutine_threadsafe(result(), rewards_loop())
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise RewardTimeout(f"no result within {timeout:g} s") from None


class TimedReward:
    """``fn`` with a time limit; called like ``fn``.

    Args:
        name: the reward's key in ``model.rewards`` (for messages).
        fn: the reward function.
        timeout: seconds to wait for one call.
        fallback: the value of every row when a call times out (None = not applicable).
        has_fallback: use ``fallback`` on a time-out; otherwise raise :class:`RewardTimeout`.

    Attributes:
        timeouts: how many calls timed out so far.

    >>> import time
    >>> slow = TimedReward("slow", lambda prompts, completions, **kw: time.sleep(1),
    ...                    timeout=0.05, fallback=0.0, has_fallback=True)
    >>> slow(prompts=["p", "p"], completions=["a", "b"]), slow.timeouts
    ([0.0, 0.0], 1)
    """

    def __init__(
        self, name: str, fn: Callable[..., Any], timeout: float,
        fallback: float | None = None, has_fallback: bool = False,
    ) -> None:
        self.name, self.fn, self.timeout = name, fn, timeout
        self.fallback, self.has_fallback = fallback, has_fallback
        self.timeouts = 0
        self.__name__ = getattr(fn, "__name__", name)

    def __call__(self, **kwargs: Any) -> Any:
        finished, values, error = timed_call(  # an async reward's result inside the limit
            lambda: awaited(self.fn(**kwargs), self.timeout), self.timeout, f"reward:{self.name}")
        if not finished or isinstance(error, RewardTimeout):  # the call, or its awaiting
            self.timeouts += 1
            VERIFIER.release_abandoned()  # its math-verify comparison: later calls' turn
            option = f"model.rewards.{self.name}"
            if not self.has_fallback:
                raise RewardTimeout(
                    f"no result within {option}.timeout = {self.timeout:g} s (set "
                    f"{option}.fallback to score such calls instead)"
                )
            log.warning("reward %r gave no result within %g s; its %d values are the "
                        "fallback %r (%d time-outs so far)", self.name, self.timeout,
                        len(kwargs.get("completions", ())), self.fallback, self.timeouts)
            return [self.fallback] * len(kwargs.get("completions", ()))
        if error is not None:  # re-raised in the caller's thread
            raise error
        return values
