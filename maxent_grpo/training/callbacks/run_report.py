"""What the console says besides progress: one line after each validation during ``fit`` and
a short summary when the fit ends (:class:`~maxent_grpo.training.callbacks.ReadableProgressBar`
prints both)::

    val @ step 50: pass@1 0.312  pass@4 0.562  mean@4 0.281  distinct@4 2.41  reward/mean 0.28
    fit done: 800 steps in 0:02:25 (0.18 s/step); reward first 20 rollouts 0.078, last 20 0.920;
      best val/pass@1 0.812 at step 750
      stopped by EarlyStopping: Monitored metric val/pass@1 did not improve in the last 3 ...
      logs: lightning_logs/tiny/version_0  checkpoints: lightning_logs/tiny/checkpoints

and, for a fit that trained no step (a resume with nothing left), in place of the first::

    fit done: no step trained: the global step, 800, had already reached
    trainer.max_steps=800; raise it to train on

(one line on the console).
"""

from __future__ import annotations

import datetime
import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from lightning.pytorch.callbacks import Timer

__all__ = ["RewardRecord", "fit_summary", "max_time_left", "validation_line",
           "why_no_training"]

#: the validation metrics that lead the line, in this order; the others follow by name
_FIRST = ("pass@", "coverage@", "greedy_pass@", "mean@", "distinct@", "distinct_correct@",
          "reward/mean")
_MAX_ITEMS = 10


def _float(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError, RuntimeError):  # a tensor of several values, a string
        return None
    return out if math.isfinite(out) else None


def validation_line(step: int, metrics: Mapping[str, Any]) -> str | None:
    """``val @ step 50: pass@1 0.312 ...`` from the run-wide ``val/...`` scalars of
    ``metrics`` (at most 10, pass@k, coverage@k, greedy pass@1, mean@k (once: it is the
    same for every k), distinct@k and the reward first; no per-task breakdown); None when
    there are none."""
    values = {k.removeprefix("val/"): v for k, v in metrics.items() if k.startswith("val/")}
    # the run-wide figures: a per-task or per-reward breakdown (pass@1/<task>) stays in the logs
    values = {k: v for k, v in values.items() if "/" not in k or k == "reward/mean"}
    values = {k: f for k, v in values.items() if (f := _float(v)) is not None}
    if not values:
        return None

    def order(name: str) -> tuple[int, str, int, str]:  # pass@2 before pass@16
        rank = next((i for i, p in enumerate(_FIRST) if name.startswith(p)), len(_FIRST))
        stem, _, k = name.partition("@")
        return rank, stem, int(k) if k.isdigit() else -1, k

    names = sorted(values, key=order)
    means = [n for n in names if n.startswith("mean@")]  # one is enough: equal for every k
    names = [n for n in names if n not in means[1:]][:_MAX_ITEMS]
    return f"val @ step {step}: " + "  ".join(f"{n} {values[n]:.3g}" for n in names)


class RewardRecord:
    """The first 20 rollouts' ``reward/mean``, the last 20, and the best ``val/pass@1``."""

    def __init__(self, n: int = 20) -> None:
        self.n, self.count = n, 0
        self.first: list[float] = []
        self.last: deque[float] = deque(maxlen=n)
        self.best: tuple[float, int] | None = None

    def add_reward(self, reward: float) -> None:
        if len(self.first) < self.n:
            self.first.append(reward)
        self.last.append(reward)
        self.count += 1

    def windows(self) -> tuple[list[float], list[float]]:
        """The first and the last ``min(n, count // 2)`` rewards: two that never overlap
        (a run of fewer than 2n rollouts compares its halves; of one, none)."""
        k = min(self.n, self.count // 2)
        return self.first[:k], list(self.last)[len(self.last) - k:]

    def add_validation(self, step: int, metrics: Mapping[str, Any]) -> None:
        value = _float(metrics.get("val/pass@1"))
        if value is not None and (self.best is None or value > self.best[0]):
            self.best = (value, step)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def fit_summary(steps: int, seconds: float, record: RewardRecord, log_dir: str | None,
                checkpoint_dirs: Sequence[str], stopped_by: Sequence[str] = (),
                resumed_at: int = 0) -> list[str]:
    """The lines printed when a fit ends (see the module docstring); a fit resumed at step
    ``resumed_at`` > 0 says so: its figures are its own steps' and validations'."""
    wall = datetime.timedelta(seconds=round(seconds))
    head = f"fit done: {steps} steps" + (f" after resuming at step {resumed_at}"
                                         if resumed_at else "") + f" in {wall}"
    if steps > 0:
        head += f" ({seconds / steps:.2f} s/step)"
    first, last = record.windows()
    if first:
        head += (f"; reward first {len(first)} rollout{'s' * (len(first) > 1)} "
                 f"{_mean(first):.3f}, "
                 f"last {len(last)} {_mean(last):.3f}")
    elif record.count:
        head += f"; reward {record.first[0]:.3f} (one rollout)"
    lines = [head]
    if record.best is not None:
        lines.append(f"  best val/pass@1 {record.best[0]:.3f} at step {record.best[1]}"
                     + (" (since the resume)" if resumed_at else ""))
    lines.extend(f"  stopped by {why}" for why in stopped_by)
    where = []
    if log_dir:
        where.append(f"logs: {log_dir}")
    if checkpoint_dirs:
        where.append("checkpoints: " + ", ".join(checkpoint_dirs))
    if where:
        lines.append("  " + "  ".join(where))
    return lines


def why_no_training(trainer: Any) -> str:
    """Why Lightning's training loop ended before its first step, and what to change, in
    words (a resume of a run that had reached its ``max_steps``, ``max_epochs`` or
    ``max_time``; no training batches)."""
    step, max_steps = trainer.global_step, trainer.max_steps
    if getattr(trainer, "fast_dev_run", False):
        return (f"trainer.fast_dev_run runs {max_steps} step(s), and the checkpoint's step is "
                f"{step}; leave fast_dev_run out to train on")
    if max_steps is not None and max_steps != -1 and step >= max_steps:
        return (f"the global step, {step}, had already reached trainer.max_steps={max_steps}; "
                "raise it to train on")
    epoch, max_epochs = trainer.current_epoch, trainer.max_epochs
    if max_epochs is not None and max_epochs != -1 and epoch >= max_epochs:
        return (f"the epoch, {epoch}, had already reached trainer.max_epochs={max_epochs}; "
                "raise it to train on")
    if (left := max_time_left(trainer)) is not None and left <= 0:
        spent = next(t for t in trainer.callbacks if isinstance(t, Timer)).time_elapsed()
        return (f"the run had already trained for {datetime.timedelta(seconds=round(spent))}, "
                f"past trainer.max_time={datetime.timedelta(seconds=round(spent + left))} "
                "(the time before the resume counts); raise it to train on")
    if 0 in (getattr(trainer, "limit_train_batches", None),
             getattr(trainer, "num_training_batches", None)):
        return "there were no training batches: trainer.limit_train_batches, or empty data"
    return "the trainer was told to stop before its first step (trainer.should_stop)"


def max_time_left(trainer: Any, mid_epoch: bool = False) -> float | None:
    """Seconds ``trainer.max_time`` leaves (Lightning's Timer, which counts the time before a
    resume; <= 0: spent), None without one; with ``mid_epoch``, None also for a Timer of
    ``interval: epoch`` (it stops the run at the end of the epoch in which its time ends, not
    then)."""
    timers = [t for t in getattr(trainer, "callbacks", []) if isinstance(t, Timer)]
    if not timers or (mid_epoch and getattr(timers[0], "_interval", "step") != "step"):
        return None
    return timers[0].time_remaining()
