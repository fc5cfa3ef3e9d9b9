"""A value a step does not measure is not written for it: Lightning writes every per-step
value logged earlier in the epoch again at each later step with its last value (until the
epoch ends), so an empty step's KL, or a controller's ``delta_tau`` on a step it did not
act, showed the last measured value as if it were that step's."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from maxent_grpo.objectives import GRPO
from maxent_grpo.training.step import step_log
from tests.conftest import fit, make_data, make_module


class EveryOther(L.Callback):
    """Logs ``callback/acted`` after every second optimizer step only (global steps 2 and
    4), as a controller that acts every second step does."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % 2 == 0:
            pl_module.log("callback/acted", float(trainer.global_step), on_step=True,
                          on_epoch=False, batch_size=1)


def test_values_not_measured_at_a_step_are_not_written_for_it(cache_dir, tmp_path, monkeypatch):
    real = step_log.LightningWriter.log

    def kl_at_odd_steps_only(self, metrics, step):  # an empty step measures no KL
        if step % 2 == 0:  # global steps 2 and 4 (the step after its optimizer step)
            metrics = {k: v for k, v in metrics.items() if k != "train/kl"}
        real(self, metrics, step)

    monkeypatch.setattr(step_log.LightningWriter, "log", kl_at_odd_steps_only)
    logger = TensorBoardLogger(str(tmp_path), name="t", version=0)
    module = make_module(cache_dir, objective=GRPO(beta=0.04))
    fit(module, make_data(cache_dir, train_size=64), steps=5, logger=logger,
        log_every_n_steps=1, callbacks=[EveryOther()])
    events = EventAccumulator(str(tmp_path / "t" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    steps = {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert steps["train/reward/mean"] == [0, 1, 2, 3, 4]
    # TensorBoard's step is the batch's index: global step s after the batch's optimizer
    # step is written at s - 1
    assert steps["train/kl"] == [0, 2, 4]
    assert steps["callback/acted"] == [1, 3]


class FirstOnly(L.Callback):
    """Logs ``callback/first`` after the first batch only."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            pl_module.log("callback/first", 1.0, on_step=True, on_epoch=False, batch_size=1)


def test_with_sparse_writes_a_value_is_written_once_since_its_measure(cache_dir, tmp_path):
    """With ``log_every_n_steps: 2`` a value measured once was written at every later
    written step; a resumed fit, which starts without it, did not write it: the two runs'
    logs differed (``train/lr_warmup`` after the warm-up; an observers hunt)."""
    logger = TensorBoardLogger(str(tmp_path), name="t", version=0)
    fit(make_module(cache_dir), make_data(cache_dir, train_size=64), steps=6, logger=logger,
        log_every_n_steps=2, callbacks=[FirstOnly()])
    events = EventAccumulator(str(tmp_path / "t" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    steps = {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert steps["train/reward/mean"] == [1, 3, 5]
    assert steps["callback/first"] == [1]


class StopsAtFirst(FirstOnly):
    """``callback/first`` after the first batch, and a stop at every batch, which Lightning
    defers (``min_steps`` makes its ``min_epochs`` 1: the first epoch's end)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        trainer.should_stop = True


def test_a_deferred_stop_writes_each_value_once(cache_dir, tmp_path):
    """A deferred stop (``min_epochs``, ``min_steps``) has Lightning write every step: a
    value measured once was written again at each (readers)."""
    logger = TensorBoardLogger(str(tmp_path), name="t", version=0)
    fit(make_module(cache_dir), make_data(cache_dir, train_size=64), steps=6, logger=logger,
        log_every_n_steps=3, min_steps=2, callbacks=[StopsAtFirst()])
    events = EventAccumulator(str(tmp_path / "t" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    steps = {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert steps["train/reward/mean"] == [0, 1, 2, 3, 4, 5]
    assert steps["callback/first"] == [0]
