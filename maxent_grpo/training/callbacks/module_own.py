"""The callbacks the module adds itself (``MaxEntGRPOModule.configure_callbacks``).

- :class:`ModuleHooks`, before the user's callbacks: a fit's start, a resumed fit's first batch;
- :class:`CleanUp`, after them: a failed run calls no module teardown in Lightning; this does it.
- :class:`CompletionWriter`: ``predict`` writes one JSON line per sampled completion
  (:func:`~maxent_grpo.training.run.evaluation.prediction_row`: the prompt, the completion
  or messages, each reward's value, the parsed answer, right or not) and prints the @k
  summary at the end; rank 0 writes every rank's rows, in the order of the prompts' rows.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import zipfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from maxent_grpo.rewards import TrainerState
from maxent_grpo.rewards.verify_worker import VERIFIER
from maxent_grpo.training.data.checks import check_prompt_bound, check_prompt_format
from maxent_grpo.training.run import checkpoint_io as ckpt_io
from maxent_grpo.training.run.checkpoint import (
    EPOCH_KEY,
    count_cut_batch_once,
    resume_where_stopped,
)
from maxent_grpo.training.run.folders import remove_empty_name_folders, run_dir, unused_path
from maxent_grpo.training.run.savers import follow_savers, whole_sharded_saves
from maxent_grpo.training.run.signals import (
    INTERRUPTED,
    answer_requeue,
    give_back_sigterm,
    same_batches,
    share_sigterm,
    take_sigterm,
)
from maxent_grpo.training.run.validated import (
    VALIDATION_DUE,
    identity,
    note_validated,
    saved_before_validation,
    unvalidated,
    validate_first,
)
from maxent_grpo.training.settings import (
    warn_changed_options,
    warn_epoch_bound_validation,
    warn_unended_cosine,
)
from maxent_grpo.training.step.strategy import check_on_rank_zero
from maxent_grpo.training.types.runtime import detached_controllers
from maxent_grpo.validation import temporary_name

__all__ = ["CleanUp", "CompletionWriter", "DEFAULT_PREDICTIONS", "ModuleHooks"]

log = logging.getLogger(__name__)

#: the file name ``predict`` writes into the run's folder when no ``output`` is given
DEFAULT_PREDICTIONS = "predictions.jsonl"


class ModuleHooks(L.Callback):
    """Before the user's callbacks: a fit starts without an earlier fit's controllers (they
    attach at their ``setup``), and a resumed fit's random state and logging step are set
    before their hooks of its first batch (a ``LearningRateMonitor`` logs there). A SIGTERM
    stops every rank after the same batch (:mod:`~maxent_grpo.training.run.signals`)."""

    def __init__(self) -> None:
        # a resumed fit's checkpoint came before a validation's end (run first, on_train_start);
        # no validation is under way (a save during one comes before its end)
        self.validation_due, self.validation_ended = False, True
        self.loaded: list[int] | None = None  # a validate's checkpoint, due: its identity

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        take_sigterm(trainer)
        whole_sharded_saves(getattr(trainer, "strategy", None))
        check_on_rank_zero(trainer, stage)  # the folders, with several processes
        for saver in trainer.checkpoint_callbacks:  # as the user set them (on_exception)
            if getattr(saver, "unsaved_error", False):
                saver.save_on_exception, saver.unsaved_error = True, False
        _own_logging_step(trainer)  # an evaluation that failed left its checkpoint's step
        if stage == "fit":  # the loop settings of a MaxEntGRPOModule
            pl_module.loop = detached_controllers(pl_module.loop)
        check_prompt_bound(pl_module.loop.generation.sampling.max_prompt_length,
                           getattr(trainer, "datamodule", None))
        check_prompt_format(pl_module, getattr(trainer, "datamodule", None))

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """The Trainer's step its own again after a validate/test (:func:`_evaluated_at`);
        one that evaluated no batch says so (it printed nothing and ended well)."""
        _own_logging_step(trainer)
        give_back_sigterm(trainer)
        VERIFIER.stop()  # the accuracy reward's worker process: nothing left running
        stage = str(getattr(stage, "value", stage))  # a TrainerFn
        for saver in trainer.checkpoint_callbacks if trainer.is_global_zero else []:
            remove_empty_name_folders(getattr(saver, "dirpath", None),  # a dropped top-k's
                                      getattr(saver, "filename", None),
                                      getattr(saver, "auto_insert_metric_name", True))
        evaluated = {"validate": "val", "test": "test"}.get(stage)
        if evaluated and trainer.state.status == "running" and not sum(
                trainer.validate_loop.max_batches if stage == "validate"
                else trainer.test_loop.max_batches):
            rank_zero_warn(f"{stage} ran no batch (trainer.limit_{evaluated}_batches, or no "
                           "validation rows): nothing was evaluated")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        """Before the checkpoint callbacks: with several processes, an error may be this
        process's alone, and a checkpoint save would wait in a collective the others never
        join (gloo aborted the run, NCCL would hang): ``save_on_exception`` skips it, and
        the error is reported. Not for SIGTERM (shared, :mod:`~maxent_grpo.training.run.
        signals`), Ctrl-C before the run's handlers are set (a terminal's reaches every
        process; a second Ctrl-C during the run is this process's alone) or an error marked
        ``every_rank`` (``NonFiniteLossError``)."""
        if trainer.world_size == 1 or getattr(exception, "every_rank", False) or isinstance(
                exception, SIGTERMException) or (isinstance(exception, KeyboardInterrupt)
                                                 and "again" not in INTERRUPTED):
            return
        savers = [s for s in trainer.checkpoint_callbacks if getattr(s, "save_on_exception",
                                                                    False)]
        would = [s for s in savers if s._should_save_on_exception(trainer)]  # (Lightning's)
        for saver in savers:
            saver.save_on_exception, saver.unsaved_error = False, True
        if would:
            log.warning("[rank %d] no checkpoint is saved on this error (save_on_exception): "
                        "with several processes the others cannot join the save; resume "
                        "from the last checkpoint saved", trainer.global_rank)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Before Lightning restores its loops: a checkpoint written after a fit's last batch
        goes on where that fit stopped (:func:`resume_where_stopped`); one written in
        mid-batch counts that batch once (:func:`count_cut_batch_once`); one written before
        a validation that did not end runs it first (:func:`validate_first`); changed
        options are warned of (:func:`warn_changed_options`)."""
        if trainer.state.fn == "fit":
            follow_savers(trainer, checkpoint)
            warn_changed_options(checkpoint, trainer)
            self.validation_due = checkpoint.get(VALIDATION_DUE) is True
            resume_where_stopped(checkpoint, trainer)
            count_cut_batch_once(checkpoint)
        elif trainer.state.fn == "validate":  # its validation, if due, is recorded at the end
            self.loaded = identity(str(trainer.ckpt_path)) if checkpoint.get(
                VALIDATION_DUE) is True else None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        checkpoint[VALIDATION_DUE] = saved_before_validation(
            trainer, self.validation_ended)  # and the rewards' epoch in its evaluations:
        checkpoint[EPOCH_KEY] = TrainerState.from_trainer(trainer, *pl_module._progress).epoch

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Before the sanity check's validation: every row the rewards cannot grade."""
        pl_module.check_reward_rows()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After a checkpoint's restore: a step count off the multiples of
        ``model.num_iterations`` (trained with another k, or stopped between a rollout's
        updates), whose first rollout takes fewer; a cosine schedule that does not end with
        the run (``settings.warn_unended_cosine``); validation points that shift at each
        epoch (``warn_epoch_bound_validation``)."""
        self.validation_ended = False  # from here a validation may begin (a save inside)
        if trainer.ckpt_path is not None:  # collective: every rank resumes
            validate_first(trainer, self.validation_due,
                           getattr(pl_module, "_rng_to_restore", None))
        self.validation_due = False
        steps = TrainerState.from_trainer(trainer, *pl_module._progress).max_steps
        warn_unended_cosine(trainer, steps)
        k, step = pl_module.loop.optimization.schedule.num_iterations, trainer.global_step
        warn_epoch_bound_validation(  # the rollouts: an asynchronous run's idle ones too
            trainer, steps // k + pl_module._progress[1] if steps > 0 else -1)
        if k > 1 and step % k and trainer.max_steps > step:
            rank_zero_warn(f"the fit goes on from optimizer step {step}, not a multiple of "
                           f"model.num_iterations {k} (a stop between a rollout's updates, or "
                           f"a checkpoint trained with another one): its first rollout takes "
                           f"{k - step % k} update(s), so the count meets the multiples of "
                           "trainer.max_steps and every_n_train_steps again")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        pl_module.at_batch_start()

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        self.validation_ended = False  # Lightning marks a validation begun before its hooks
        share_sigterm(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """``last.ckpt`` at the step the fit ended (``max_steps`` between two saves,
        ``max_time``, early stopping): Lightning writes it at the end only when no
        checkpoint was saved before, so it held the last interval's step and ``--ckpt_path
        last`` trained the steps after it again. On every rank (the save is collective).
        Not ``save_last="link"``, whose last file links to the last checkpoint saved."""
        for saver in trainer.checkpoint_callbacks:
            if (getattr(saver, "save_last", False) is True and getattr(
                    saver, "_last_global_step_saved", trainer.global_step) != trainer.global_step):
                saver._save_last_checkpoint(trainer, saver._monitor_candidates(trainer))

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.validation_ended = False
        pl_module.evaluator.restart()  # (also at test and predict's start)
        if trainer.state.fn == "validate":  # a fit checks its rows at its start
            pl_module.check_reward_rows(splits=("val",))
            _evaluated_at(trainer)
        same_batches(trainer, trainer.num_sanity_val_batches if trainer.sanity_checking
                     else trainer.num_val_batches)

    def on_validation_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        share_sigterm(trainer, training=False)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Before the savers' own saves at a validation's end: it ended."""
        self.validation_ended = True
        if trainer.state.fn in ("fit", "validate"):
            note_validated(trainer, self.loaded)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A resumed fit that trained no step (its ``max_steps`` reached at the checkpoint)
        does not run the validation a stop cut short: named."""
        if self.validation_due and trainer.is_global_zero and unvalidated(
                trainer):
            rank_zero_warn(f"the validation of step {trainer.global_step} did not end before "
                           "the run stopped, and this fit had no step left to train: validate "
                           f"with the run's config and --ckpt_path {trainer.ckpt_path} runs it")
        self.validation_due = False

    on_test_batch_end = on_validation_batch_end

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.evaluator.restart()
        pl_module.check_reward_rows(splits=("val",))  # test and predict sample the val rows
        same_batches(trainer, trainer.num_test_batches)
        _evaluated_at(trainer)

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.evaluator.restart()
        pl_module.check_reward_rows(splits=("val",))
        same_batches(trainer, trainer.num_predict_batches)

    def on_predict_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
        """Lightning's predict loop never looks at the signal: stopped before the next
        batch, after every callback had the last one."""
        if share_sigterm(trainer, training=False):
            raise SIGTERMException


def _evaluated_at(trainer: L.Trainer) -> None:
    """A validate/test logs at the last training scalars' step of the fit that gave its
    weights, as its own validation there: its checkpoint's (``load_state``) or this
    Trainer's fit's; :func:`_own_logging_step` puts the Trainer's back."""
    loop = trainer.fit_loop.epoch_loop
    step = getattr(loop, "evaluated_at", None)
    step = loop._batches_that_stepped - 1 if step is None else step
    if step >= 0 and getattr(loop, "own_logging_step", None) is None:
        loop.own_logging_step, loop._batches_that_stepped = loop._batches_that_stepped, step


def _own_logging_step(trainer: L.Trainer) -> None:
    loop = trainer.fit_loop.epoch_loop
    loop.evaluated = loop.evaluated_at = None
    if getattr(loop, "own_logging_step", None) is not None:
        loop._batches_that_stepped, loop.own_logging_step = loop.own_logging_step, None


class CleanUp(L.Callback):
    """After the user's callbacks: a failed run calls no module teardown in Lightning; this
    does it. A SLURM requeue signal is answered here, after the user's callbacks' end of
    the batch (:func:`~maxent_grpo.training.run.signals.answer_requeue`)."""

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        answer_requeue(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        give_back_sigterm(trainer)
        VERIFIER.stop()  # (ModuleHooks.teardown's, which a failed run does not reach)
        try:
            pl_module.teardown("fit")
        except Exception as err:  # noqa: BLE001 - the run's own error is the one to report
            log.warning("cleaning up after the failed run failed too: %s: %s",
                        type(err).__name__, err)


class CompletionWriter(L.Callback):
    """Write ``predict``'s graded completions to a JSONL file, one line per completion.

    Args:
        output: the file to write (replaced when it exists), or a folder (an existing one,
            or a path ending in ``/``) to write ``predictions.jsonl`` into; ``None``:
            ``predictions.jsonl`` in the run's folder (the logger's version folder, else
            ``trainer.default_root_dir``).

    Every rank keeps the rows of its share; at the end rank 0 gathers them
    (``gather_object``), keeps one copy of each ``(row, sample)`` (a padding sampler repeats
    prompts to give every rank as many batches) and writes them atomically in the order of
    the prompts' source rows, so the file does not depend on the number of processes or on
    a file system they share. The ``predict/...`` @k metrics (``Evaluator.compute``, over
    the same unique prompts) are printed and kept in :attr:`metrics`. A path that cannot be
    written stops ``predict`` on every rank before any sampling, naming it; a ``predict``
    that ran no batch says that nothing was written.
    """

    def __init__(self, output: str | None = None) -> None:
        if output is not None and not str(output).strip():
            raise ValueError(f"the predict output must be a file path; got {output!r}")
        self.output = output
        self.path: Path | None = None
        self.metrics: dict[str, float] = {}
        self.rows: list[dict[str, Any]] = []
        self.written: bool | None = False

    @classmethod
    def configured(cls, callbacks: list, output: str | None) -> list:
        """``predict``'s callbacks: ``output`` (``--output``; checked here) is every
        configured writer's file when given, a writer is added when none is configured, and
        of several writing one file the first is kept (each wrote it whole)."""
        fresh, kept = cls(output), []
        for callback in callbacks:
            if isinstance(callback, CompletionWriter):
                callback.output = callback.output if output is None else fresh.output
                if any(type(callback) is type(k) and callback.output == k.output
                       for k in kept if isinstance(k, CompletionWriter)):
                    continue
            kept.append(callback)
        return kept if any(isinstance(c, CompletionWriter) for c in kept) else [*kept, fresh]

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "predict":
            return
        if self.output is None:  # a new file: an earlier predict's is kept
            path = unused_path(Path(run_dir(trainer)) / DEFAULT_PREDICTIONS)
        else:
            path = Path(self.output).expanduser()
            folder = os.path.isdir(path) or str(self.output).endswith(("/", os.sep))
            path = unused_path(path / DEFAULT_PREDICTIONS) if folder else path  # as the default
        self.path = path.absolute()
        problem = refusal = None
        if trainer.is_global_zero:  # the one writer checks, before any sampling
            # refused: replacing a zip archive (a checkpoint, the one being read perhaps)
            # rather than JSON lines
            if os.path.isfile(self.path) and zipfile.is_zipfile(self.path):
                refusal = (f"predict --output {self.path} is a zip archive (a checkpoint?), not "
                           "an earlier predictions file; choose another file")
            elif os.path.isfile(self.path) and os.path.realpath(self.path) in _data_files(
                    trainer):
                refusal = (f"predict --output {self.path} is one of the run's data files "
                           "(data.data_files, data.val_files), which it would replace; choose "
                           "another file")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                if len(os.fsencode(self.path.name)) > 255:  # found at the end, after sampling
                    raise OSError(errno.ENAMETOOLONG, "a file name of over 255 bytes")
                with open(probe := self.path.with_name(temporary_name(self.path.name,
                                                                      ".check")), "w"):
                    pass
                os.remove(probe)
            except OSError as err:  # (mkdir's "File exists" for a file among the folders)
                problem = ("a folder on its path is a file" if isinstance(err, FileExistsError)
                           else err.strerror or str(err))
        ok = problem is None and refusal is None
        if not trainer.strategy.reduce_boolean_decision(ok, all=True):
            raise ValueError(refusal or (  # on every rank, so that none waits for the others
                f"predict cannot write {self.path} ({problem or 'see global rank 0'}); pass "
                "--output with a file in a folder you can write to"))
        self.rows, self.metrics, self.written = [], {}, False

    def on_predict_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        self.rows.extend(outputs or [])

    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.metrics = pl_module.evaluator.compute("predict")  # every rank: it gathers
        rows = self.rows
        # a (row, sample) twice in one rank's rows: the loader repeated the prompt (a padding
        # sampler repeats across ranks only); one copy is written, as the @k values count one
        repeated = len(rows) - len({(r["row"], r["sample"]) for r in rows})
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            parts: list[Any] = [None] * dist.get_world_size() if trainer.is_global_zero else []
            dist.gather_object((repeated, rows), parts if trainer.is_global_zero else None, dst=0)
            repeated = sum(part[0] for part in parts or [])
            rows = [row for part in parts or [] for row in part[1]]
        if not trainer.is_global_zero:
            return
        if repeated:
            rank_zero_warn(f"predict: {repeated} completions were left out: the predict loader "
                           "gave a prompt's row twice (its batches' 'indices' repeat), and one "
                           "(row, sample) is written once; to sample a prompt more often raise "
                           "model.eval_num_generations")
        unique = {(r["row"], r["sample"]): r for r in reversed(rows)}  # the first copy
        rows = [unique[k] for k in sorted(unique)]
        assert self.path is not None
        ckpt_io.atomic_write(self.path, lambda f: f.writelines(  # a lone surrogate: its JSON escape
            (json.dumps(r, ensure_ascii=False, default=str) + "\n").encode(
                "utf-8", "backslashreplace") for r in rows))
        self.written = True
        prompts = len({r["row"] for r in rows})
        at_k = "  ".join(f"{k.removeprefix('predict/')} {v:.3g}"
                         for k, v in self.metrics.items() if "@" in k and k.count("/") == 1)
        rank_zero_info(f"predict: {len(rows)} completions of {prompts} prompts written to "
                       f"{self.path}" + (f"\n  {at_k}" if at_k else ""))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        self.written = None  # failed: the error says why, not teardown

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "predict" and trainer.is_global_zero and self.written is False:
            rank_zero_warn(f"predict ran no batch (trainer.limit_predict_batches, or no "
                           f"validation rows): nothing was written to {self.path}")
        self.rows = []


def _data_files(trainer: L.Trainer) -> set[str]:
    """The resolved paths of the files the trainer's data module reads (``data_files``,
    ``val_files``; none that cannot be listed)."""
    from maxent_grpo.training.data.files import expand_files

    found: set[str] = set()
    for option in ("data_files", "val_files"):
        value = getattr(getattr(trainer, "datamodule", None), option, None)
        for entry in value if isinstance(value, (list, tuple)) else [value]:
            try:
                found |= {os.path.realpath(f) for f in expand_files(f"data.{option}", entry)}
            except (OSError, ValueError):  # none given, or a pattern that matches none now
                continue
    return found
