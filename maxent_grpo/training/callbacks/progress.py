"""Progress people can read: a smoothed reward and a step count, as a bar or as plain lines.

:class:`ReadableProgressBar` is the command line's default progress bar (added unless
``trainer.callbacks`` holds one or ``trainer.enable_progress_bar`` is false). It is
:class:`~lightning.pytorch.callbacks.TQDMProgressBar`, except that:

- the reward shown, ``reward(avg20)``, is the mean of the last ``window`` steps'
  ``train/reward/mean`` (one step's is too noisy); ``v_num`` is not shown;
- a run of known length shows one bar ``Steps: 120/500`` over the whole run (from the
  resumed step on a resume) instead of a bar per epoch: its optimizer steps, the fewest of
  ``max_steps`` and what ``max_epochs`` allows (``TrainerState.max_steps``);
- during ``fit`` each validation prints one line of its ``val/`` metrics, and the end of the
  fit a short summary: steps, wall time, first and last 20 rewards, the best
  ``val/pass@1``, what stopped it early, where the logs and checkpoints are
  (:mod:`~maxent_grpo.training.callbacks.run_report`);
- where the stream is not a terminal (a log file, a batch job), plain lines are written
  every ``every_n_steps`` steps, or once ``every_s`` seconds have passed, and at the end::

    step 120/500  reward(avg20) 0.412  loss 0.0312  tokens/s 1234  eta 0:01:10

``tokens/s`` is the last step's ``train/perf/tokens_per_s``; ``eta`` is the remaining steps
times this run's mean time per step, at most what ``trainer.max_time`` leaves. With tools or
an environment (multi-turn rollouts) the line, and the bar, also show ``tool success 75%``:
the last step's ``train/tools/success_rate`` (the share of samples with at least one call
that returned; ``env success``, of an environment's steps, with ``model.environment``), so
that calls that all fail show at once (``step_log.ToolFailureWatch`` warns, naming how they
fail);
without tools it is not shown. Values come from ``pl_module.step_metrics_dict`` (the step's
logged dict, ``step_log.as_dict()``, built once per step). Only global rank 0 shows anything.
A plain ``L.Trainer`` gets it too, in place of Lightning's own default bar
(``MaxEntGRPOModule.configure_callbacks``). To configure it: docs/LOGGING.md, its progress
bar (under "TensorBoard").
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import time
from collections import deque
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers.logger import DummyLogger
from lightning_utilities.core.imports import RequirementCache

from maxent_grpo.rewards import TrainerState
from maxent_grpo.training.callbacks.run_report import (
    RewardRecord,
    fit_summary,
    max_time_left,
    validation_line,
    why_no_training,
)
from maxent_grpo.training.run.folders import run_dir
from maxent_grpo.validation import check_choice, check_int

MODES = ("auto", "bar", "lines")
#: the bar a plain ``L.Trainer`` adds by itself (Rich's where rich is installed, as Lightning
#: decides it); the module replaces it with this one (a bar of another type, or a subclass,
#: given to the Trainer stays)
LIGHTNING_DEFAULT_BAR = RichProgressBar if RequirementCache("rich>=10.2.2") else TQDMProgressBar
_NICE_STEPS = (1, 2, 5)


def line_interval(max_steps: int, max_lines: int = 40) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... giving at most ``max_lines`` lines over
    ``max_steps`` steps (10 when ``max_steps <= 0``)."""
    if max_steps <= 0:
        return 10
    scale = 1
    while True:
        for nice in _NICE_STEPS:
            if math.ceil(max_steps / (nice * scale)) <= max_lines:
                return nice * scale
        scale *= 10


def _shown(path: str | None) -> str | None:
    """``path`` relative to the working folder when it lies inside it."""
    if not path:
        return path
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is an interactive terminal (False for files, pipes, closed streams)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (ValueError, OSError):  # a closed or detached stream
        return False


class ReadableProgressBar(TQDMProgressBar):
    """TQDM bar with a smoothed reward and a step count, or plain lines when not in a terminal.

    Args:
        refresh_rate: redraw the bar every this many steps (0 shows nothing, bar or lines).
        process_position, leave: as in :class:`TQDMProgressBar`.
        mode: ``"auto"`` (bar in a terminal, lines otherwise), ``"bar"`` or ``"lines"``.
        window: the shown reward is the mean of the last ``window`` steps' ``train/reward/mean``.
        every_n_steps: a line every this many steps; ``None``: :func:`line_interval`.
        every_s: also write a line after this many seconds without one; 0 or less: off.
        stream: where lines go and what ``"auto"`` asks ``isatty()``; default ``sys.stdout``.
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False,
                 mode: Literal["auto", "bar", "lines"] = "auto", window: int = 20,
                 every_n_steps: int | None = None, every_s: float = 30.0,
                 stream: Any = None) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position,
                         leave=leave)
        check_choice("ReadableProgressBar.mode", mode, MODES)
        check_int("ReadableProgressBar.window", window, minimum=1)
        check_int("ReadableProgressBar.every_n_steps", every_n_steps, minimum=1, allow_none=True)
        self.mode = mode
        self.window = window
        self.every_n_steps = every_n_steps
        self.every_s = every_s
        self.stream = stream
        self.rewards: deque[float] = deque(maxlen=window)
        self.last_record: dict[str, float] = {}
        self.tool_label = "tool success"  # "env success" for a run with an environment
        self.report = RewardRecord()
        self._start_step = 0
        self._start_time = 0.0
        self._trained = False
        self._last_line_step = -1
        self._last_line_time = 0.0
        self.total = -1  # the run's optimizer steps (-1: unknown), from its start

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["stream"] = None  # a stream cannot be pickled (spawned processes, deepcopy)
        return state

    @property
    def plain_lines(self) -> bool:
        """True when progress is written as plain lines (``mode``, else the stream's TTY)."""
        if self.mode != "auto":
            return self.mode == "lines"
        return not is_terminal(self._out())

    @property
    def is_enabled(self) -> bool:
        """Whether the tqdm bars draw: enabled (rank 0, ``refresh_rate > 0``) and not lines."""
        return super().is_enabled and not self.plain_lines

    @property
    def reward_label(self) -> str:
        return f"reward(avg{self.window})"

    @property
    def smoothed_reward(self) -> float | None:
        """Mean ``train/reward/mean`` of the last ``window`` steps; None before the first step."""
        return sum(self.rewards) / len(self.rewards) if self.rewards else None

    @property
    def tool_success(self) -> float | None:
        """The last step's ``train/tools/success_rate``; None without tools (or before a step)."""
        rate = self.last_record.get("train/tools/success_rate")
        return rate if rate is not None and math.isfinite(rate) else None

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The ``prog_bar`` metrics without ``v_num``, ``reward`` replaced by the smoothed one,
        then ``tool success`` with tools."""
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        smoothed = self.smoothed_reward
        if smoothed is not None:
            items.pop("reward", None)
            items = {self.reward_label: smoothed, **items}
        if self.tool_success is not None:
            items[self.tool_label] = f"{self.tool_success:.0%}"
        return items

    def progress_line(self, trainer: pl.Trainer) -> str:
        """``step 120/500  reward(avg20) 0.412  loss 0.0312  tokens/s 1234  eta 0:01:10``,
        with ``tool success 75%`` after the reward when the step used tools."""
        step, total = trainer.global_step, self.total
        parts = [f"step {step}/{total}" if total > 0
                 else f"epoch {trainer.current_epoch}  step {step}"]
        if self.smoothed_reward is not None:
            parts.append(f"{self.reward_label} {self.smoothed_reward:.3f}")
        if self.tool_success is not None:
            parts.append(f"{self.tool_label} {self.tool_success:.0%}")
        loss = self.last_record.get("train/loss/total")
        if loss is not None and math.isfinite(loss):
            parts.append(f"loss {loss:.3g}")
        tokens_per_s = self.last_record.get("train/perf/tokens_per_s")
        if tokens_per_s is not None and math.isfinite(tokens_per_s):
            parts.append(f"tokens/s {tokens_per_s:.0f}")
        done = step - self._start_step
        if total > 0 and done > 0:
            per_step = (time.monotonic() - self._start_time) / done
            left = per_step * max(0, total - step)
            if (limit := max_time_left(trainer, mid_epoch=True)) is not None:
                left = min(left, max(0.0, limit))  # max_time stops it first
            parts.append(f"eta {datetime.timedelta(seconds=round(left))}")
        return "  ".join(parts)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A new run's summary (from here: a resumed fit's first validation, that of the step
        a stop cut short, runs before the training starts)."""
        super().on_fit_start(trainer, pl_module)
        self.report = RewardRecord()
        self._trained = False  # on_train_end ran in this fit

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.rewards.clear()
        self.last_record = {}
        tools = getattr(getattr(getattr(pl_module, "loop", None), "generation", None), "tools",
                        None)  # an environment's steps are its calls
        self.tool_label = ("env success" if getattr(tools, "environment", None) is not None
                           else "tool success")
        self._start_step = self._last_line_step = trainer.global_step
        self._start_time = self._last_line_time = time.monotonic()
        # MaxEntGRPOModule: k optimizer steps a batch, none in its first max_staleness ones
        self.total = TrainerState.from_trainer(
            trainer, *getattr(pl_module, "_progress", (1, 0))).max_steps
        if self.total > 0:  # one bar over the run's steps, not one per epoch
            bar = self.train_progress_bar
            bar.reset(total=self.total)
            bar.initial = bar.n = trainer.global_step  # resumed: count on, rate from here
            bar.set_description("Steps")

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.total <= 0:
            super().on_train_epoch_start(trainer, *args)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        record = getattr(pl_module, "step_metrics_dict", None)
        if record:
            self.last_record = record
            reward = self.last_record.get("train/reward/mean")
            if reward is not None and math.isfinite(reward):
                self.rewards.append(reward)
                self.report.add_reward(reward)
        if self.total <= 0:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        else:
            step, bar = trainer.global_step, self.train_progress_bar
            if self.is_enabled and not bar.disable and (
                    step % self.refresh_rate == 0 or step >= self.total):
                bar.n = step
                bar.set_postfix(self.get_metrics(trainer, pl_module))  # redraws
        if self._writes_lines():
            now, step = time.monotonic(), trainer.global_step
            every = self.every_n_steps or line_interval(self.total)
            slow = self.every_s > 0 and now - self._last_line_time >= self.every_s
            # a multiple of every passed (num_iterations k > 1 counts k at a time)
            if step != self._last_line_step and (
                    step // every > max(self._last_line_step, 0) // every or slow):
                self._write_line(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """During ``fit``: one line of the ``val/`` metrics (``run_report.validation_line``)."""
        super().on_validation_end(trainer, pl_module)
        if trainer.sanity_checking or getattr(trainer.state, "fn", None) != "fit":
            return
        self.report.add_validation(trainer.global_step, trainer.callback_metrics)
        line = validation_line(trainer.global_step, trainer.callback_metrics)
        if line is not None:
            self._print(line)

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        """``predict`` as plain lines: ``predict: batch 3/10`` at each tenth, at the end and
        after ``every_s`` seconds without a line (the bar mode has tqdm's predict bar)."""
        super().on_predict_batch_end(trainer, pl_module, outputs, batch, batch_idx,
                                     dataloader_idx)
        if not self._writes_lines():
            return
        done, total = batch_idx + 1, trainer.num_predict_batches[dataloader_idx]
        now = time.monotonic()
        slow = self.every_s > 0 and now - self._last_line_time >= self.every_s
        tenth = max(1, int(total) // 10) if math.isfinite(total) else 10
        if done == total or done % tenth == 0 or slow:
            print(f"predict: batch {done}/{total}", file=self._out(), flush=True)
            self._last_line_time = now

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if self._writes_lines() and trainer.global_step != self._last_line_step:
            self._write_line(trainer)
        self._trained = True
        stopped = [f"EarlyStopping: {cb.stopping_reason_message}"
                   for cb in getattr(trainer, "early_stopping_callbacks", [])
                   if getattr(cb, "stopping_reason_message", None)]
        lines = fit_summary(
            trainer.global_step - self._start_step, time.monotonic() - self._start_time,
            self.report, *_folders(trainer), stopped, resumed_at=self._start_step)
        for line in lines:
            self._print(line)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A fit whose training loop Lightning skipped (a resume of a run that had reached
        its ``max_steps``, ``max_epochs`` or ``max_time``) says so and why, where Lightning
        said at most "Time limit reached"."""
        super().on_fit_end(trainer, pl_module)
        if self._trained:
            return
        lines = fit_summary(0, 0.0, self.report, *_folders(trainer),
                            resumed_at=trainer.global_step)
        lines[0] = f"fit done: no step trained: {why_no_training(trainer)}"
        for line in lines:
            self._print(line)

    def _print(self, text: str) -> None:
        """A line on the console (rank 0, unless ``refresh_rate`` is 0), above a live bar."""
        if not TQDMProgressBar.is_enabled.fget(self):
            return
        if self.plain_lines:
            print(text, file=self._out(), flush=True)
        else:
            from tqdm import tqdm

            tqdm.write(text, file=self._out())

    def _out(self) -> Any:
        return self.stream if self.stream is not None else sys.stdout

    def _writes_lines(self) -> bool:
        # TQDMProgressBar.is_enabled: not disabled (other ranks are) and refresh_rate > 0
        return super().is_enabled and self.plain_lines

    def _write_line(self, trainer: pl.Trainer) -> None:
        out = self._out()
        print(self.progress_line(trainer), file=out, flush=True)
        self._last_line_step = trainer.global_step
        self._last_line_time = time.monotonic()


def _folders(trainer: pl.Trainer) -> tuple[str | None, list[str]]:
    """The run's log folder (None without a logger) and its savers' folders, as shown."""
    # save_last: ModelCheckpoint writes last.ckpt in its own on_train_end, after the summary
    saved = [_shown(cb.dirpath) for cb in getattr(trainer, "checkpoint_callbacks", [])
             if getattr(cb, "dirpath", None)  # any Checkpoint, not only ModelCheckpoint
             and (getattr(cb, "last_model_path", None) or getattr(cb, "best_model_path", None)
                  or getattr(cb, "save_last", None))]
    loggers = getattr(trainer, "loggers", None)
    log_dir = run_dir(trainer) if loggers and not isinstance(loggers[0], DummyLogger) else None
    return _shown(log_dir), list(dict.fromkeys(saved))
