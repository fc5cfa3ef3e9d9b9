"""Per-step wall-clock timings (``perf/...`` metrics).

A :class:`StepTimer` splits one training step into phases and reports seconds per phase
(the rollout's own time, measured by the engine, is logged as ``perf/generate_s`` through
:attr:`~maxent_grpo.training.types.TrainingScalarStats.vllm_latency_ms`):

- ``reward_s``: the reward functions,
- ``score_s``: forward passes that produce log-probs (reference, behaviour and policy),
- ``backward_s``: backward passes plus gradient clipping and the optimizer step,
- ``step_s``: the whole step, and ``tokens_per_s``: completion tokens of this rank divided
  by ``step_s``.

On CUDA each boundary synchronises the device so that asynchronous kernels are charged to
the phase that launched them; on the CPU the clock is read directly.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class StepTimer:
    """Seconds per named phase: ``stop(name)`` charges the time since the last ``start()``
    or ``stop()`` to ``name`` (consecutive phases: one ``start``, several ``stop`` calls)."""

    def __init__(self, device: torch.device | str | None = None, clock=time.perf_counter) -> None:
        self._cuda = torch.device(device or "cpu").type == "cuda"
        self._clock = clock  # seconds; injectable so that tests need no real sleeps
        self._begin = self._now()
        self._last = self._begin
        self.seconds: dict[str, float] = defaultdict(float)

    def _now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return self._clock()

    def start(self) -> None:
        self._last = self._now()

    def stop(self, phase: str) -> None:
        now = self._now()
        self.seconds[phase] += now - self._last
        self._last = now

    def summary(self, completion_tokens: int) -> dict[str, float]:
        """The ``perf/...`` values of the step (keys without the prefix)."""
        step = self._now() - self._begin
        s = self.seconds
        return {
            "reward_s": s["reward"],
            "score_s": s["frozen"] + s["forward"],
            "backward_s": s["backward"] + s["optimizer"],
            "step_s": step,
            "tokens_per_s": completion_tokens / step if step > 0 else float("nan"),
        }
