"""Where a fit resumed from its last checkpoint goes on: the prompts of every later step
and the final weights equal an uninterrupted fit's, wherever the first fit stopped (in
mid-epoch, at an epoch's end, with the checkpoint of that end) and when the resumed fit
has more batches per epoch."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from maxent_grpo.training.data import PromptDataModule
from tests.conftest import fit, make_data, make_module, params


class Prompts(L.Callback):
    """The prompt rows of every training batch."""

    def __init__(self) -> None:
        self.rows: list[list[int]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.rows.append(list(batch["indices"]))


@pytest.mark.parametrize("stop", ["max_steps mid-epoch", "max_steps at the epoch's end",
                                  "epoch-end checkpoint"])
def test_a_fit_continued_from_its_last_checkpoint_goes_on_where_it_stopped(
        cache_dir, tmp_path, stop):
    """A checkpoint written once Lightning counted the epoch as ended resumed inexactly: a
    fit that max_steps stopped in mid-epoch, continued with a higher max_steps, began the
    next epoch's order (the rest of this one never trained); stopped at the epoch's last
    batch, it began the next epoch at that batch's index (that epoch ended after one batch);
    a checkpoint of the epoch's end ran the ended epoch again from its last batch."""
    def data():
        return make_data(cache_dir, train_size=24, val_size=4)  # 5 batches of 4 an epoch

    whole, seen = make_module(cache_dir), Prompts()
    fit(whole, data(), steps=8, callbacks=[seen])
    first, before = make_module(cache_dir), Prompts()
    if stop == "epoch-end checkpoint":  # ModelCheckpoint's default: at each epoch's end
        fit(first, data(), steps=-1, max_epochs=1, tmp_path=tmp_path, enable_checkpointing=True,
            callbacks=[ModelCheckpoint(dirpath=tmp_path), before])
        (ckpt,) = tmp_path.glob("*.ckpt")
    else:
        saver = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1000)
        fit(first, data(), steps=2 if stop == "max_steps mid-epoch" else 5, tmp_path=tmp_path,
            enable_checkpointing=True, callbacks=[saver, before])
        ckpt = tmp_path / "last.ckpt"
    assert len(seen.rows[0]) == 4 and len(before.rows) in (2, 5) and (
        seen.rows[5] != seen.rows[0])  # the second epoch starts at step 5, in another order
    resumed, after = make_module(cache_dir), Prompts()
    fit(resumed, data(), steps=8, ckpt_path=str(ckpt), callbacks=[after])
    assert before.rows + after.rows == seen.rows
    a, b = params(whole), params(resumed)
    assert all(torch.equal(a[key], b[key]) for key in a)


def test_an_epoch_that_limit_train_batches_ended_is_not_reopened(cache_dir, tmp_path):
    """With ``limit_train_batches`` the epoch ends before its rows do: its end checkpoint
    was taken for a mid-epoch stop and the resumed fit trained that epoch again, on rows an
    uninterrupted fit never sees there."""
    def data():
        return make_data(cache_dir, train_size=24, val_size=4)  # 5 batches, 3 of them taken

    whole = Prompts()
    fit(make_module(cache_dir), data(), steps=-1, max_epochs=2, limit_train_batches=3,
        callbacks=[whole])
    fit(make_module(cache_dir), data(), steps=-1, max_epochs=1, limit_train_batches=3,
        tmp_path=tmp_path, enable_checkpointing=True, callbacks=[ModelCheckpoint(tmp_path)])
    (ckpt,) = tmp_path.glob("*.ckpt")
    resumed = Prompts()
    fit(make_module(cache_dir), data(), steps=-1, max_epochs=2, limit_train_batches=3,
        ckpt_path=str(ckpt), callbacks=[resumed])
    assert len(whole.rows) == 6 and resumed.rows == whole.rows[3:]


def test_an_epoch_end_checkpoint_resumed_with_more_batches_an_epoch_trains_the_whole_next_one(
        cache_dir, tmp_path):
    """An epoch-end checkpoint of batches of 4, resumed with batches of 2: Lightning kept the
    saved epoch's batches as done in the next epoch, which began at its batch 5 of 11 (the
    rest of its rows never trained)."""
    def data(batch_size: int):
        return make_data(cache_dir, train_size=24, val_size=4, batch_size=batch_size)

    whole = Prompts()  # batches of 2 from the start: 11 an epoch (22 training rows)
    fit(make_module(cache_dir), data(2), steps=22, callbacks=[whole])
    assert whole.rows[11] != whole.rows[0]
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=5)
    fit(make_module(cache_dir), data(4), steps=5, tmp_path=tmp_path, enable_checkpointing=True,
        callbacks=[saver])  # one epoch: 5 batches of 4
    resumed = Prompts()
    fit(make_module(cache_dir), data(2), steps=16, ckpt_path=str(tmp_path / "last.ckpt"),
        callbacks=[resumed])
    assert resumed.rows == whole.rows[11:]  # the whole second epoch, from its first batch


class CutAt(L.Callback):
    """Ctrl-C at optimizer step ``step``: inside its training step (before its backward),
    or ``early`` in its batch's start hooks (Lightning has not counted it as started)."""

    def __init__(self, step: int, early: bool = False) -> None:
        self.step, self.early = step, early

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self.early and trainer.global_step == self.step:
            raise KeyboardInterrupt

    def on_before_backward(self, trainer, module, loss) -> None:
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


class Validations(L.Callback):
    def __init__(self) -> None:
        self.at: list[int] = []

    def on_validation_start(self, trainer, module) -> None:
        self.at.append(trainer.global_step)


@pytest.mark.parametrize("early", [False, True])
def test_validation_keeps_its_steps_after_a_resume_from_a_batch_cut_short(
        cache_dir, tmp_path, early):
    """Lightning counted the cut batch twice in its run totals, which place validation when
    ``check_val_every_n_epoch`` is None: after the resume, validation ran a step early for
    the rest of the run (here at 5 instead of 6)."""
    import signal

    def run(callbacks, ckpt_path=None):
        seen = Validations()
        fit(make_module(cache_dir), make_data(cache_dir), steps=8, tmp_path=tmp_path,
            ckpt_path=ckpt_path, enable_checkpointing=True, num_sanity_val_steps=0,
            limit_val_batches=1, val_check_interval=3, check_val_every_n_epoch=None,
            callbacks=[seen, *callbacks])
        return seen.at

    assert run([]) == [3, 6]
    saver = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True, save_on_exception=True)
    handler = signal.getsignal(signal.SIGINT)  # Lightning ignores SIGINT after a Ctrl-C
    try:
        with pytest.raises(SystemExit):  # Lightning's exit after a KeyboardInterrupt
            run([saver, CutAt(4, early)])
    finally:
        signal.signal(signal.SIGINT, handler)
    saved = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 4  # the cut batch is run again
    assert run([ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)],
               ckpt_path=str(tmp_path / "ck" / "last.ckpt")) == [6]
    # the run's counts agree again (a later resume reads them): every batch finished
    later = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=False)
    total = later["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    assert later["global_step"] == 8  # saved at the fit's end
    assert total == {"ready": 8, "started": 8, "processed": 8, "completed": 8}


def test_last_ckpt_holds_the_step_the_fit_ended_at(cache_dir, tmp_path):
    """Lightning writes ``last.ckpt`` at the fit's end only when nothing was saved before:
    a fit of 5 steps saving every 3 left ``last.ckpt`` at step 3, and ``--ckpt_path last``
    trained steps 4 and 5 again. Continued from it, the fit equals an uninterrupted one."""
    def data():
        return make_data(cache_dir, train_size=24, val_size=4)

    whole, seen = make_module(cache_dir), Prompts()
    fit(whole, data(), steps=8, callbacks=[seen])
    first, before = make_module(cache_dir), Prompts()
    fit(first, data(), steps=5, tmp_path=tmp_path, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=3),
                   before])
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 5
    resumed, after = make_module(cache_dir), Prompts()
    fit(resumed, data(), steps=8, ckpt_path=str(tmp_path / "last.ckpt"), callbacks=[after])
    assert before.rows + after.rows == seen.rows
    a, b = params(whole), params(resumed)
    assert all(torch.equal(a[key], b[key]) for key in a)


class Steps(L.Callback):
    """The optimizer-step count after each training batch."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.seen.append(trainer.global_step)


def test_a_resume_off_the_multiples_of_num_iterations_meets_them_again(cache_dir, tmp_path):
    """A checkpoint of step 3 continued with ``num_iterations`` 2 counted 5, 7 and ran past
    ``max_steps`` 6 (first without a word, then warned); so did a Ctrl-C between a rollout's
    two updates (step 5 of k 2, a hunt), and ``every_n_train_steps`` never saved again. The
    first rollout takes the updates left to the next multiple (warned)."""
    fit(make_module(cache_dir), make_data(cache_dir), steps=3, tmp_path=tmp_path,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    steps = Steps()
    saver = ModelCheckpoint(dirpath=tmp_path / "every", every_n_train_steps=2, save_top_k=-1)
    with pytest.warns(UserWarning, match=r"goes on from optimizer step 3, not a multiple of "
                      r"model.num_iterations 2 .*its first rollout takes 1 update\(s\)"):
        trainer = fit(make_module(cache_dir, num_iterations=2), make_data(cache_dir), steps=8,
                      ckpt_path=str(tmp_path / "last.ckpt"), callbacks=[steps, saver],
                      enable_checkpointing=True)
    assert steps.seen == [4, 6, 8] and trainer.global_step == 8
    assert sorted(p.name for p in (tmp_path / "every").iterdir()) == [
        "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"]


class StopInValidation(L.Callback):
    """Ctrl-C, or the stop a SIGTERM makes, after the first batch of the validation at
    optimizer step ``step``."""

    def __init__(self, step: int, how: str) -> None:
        self.step, self.how = step, how

    def on_validation_batch_end(self, trainer, *_) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if not trainer.sanity_checking and trainer.global_step == self.step:
            raise KeyboardInterrupt if self.how == "ctrl-c" else SIGTERMException


class Validated(L.Callback):
    """The steps of the fit's validations that ended, with the completions they sampled."""

    def __init__(self) -> None:
        self.at: list[tuple[int, list[str]]] = []
        self.texts: list[str] = []

    def setup(self, trainer, module, stage) -> None:
        evaluate = module._evaluate

        def recorded(batch, greedy=True):
            rows = evaluate(batch, greedy)
            self.texts += [row["completion"] for row in rows]
            return rows

        module._evaluate = recorded

    def on_validation_end(self, trainer, module) -> None:
        if not trainer.sanity_checking:
            self.at.append((trainer.global_step, self.texts))
        self.texts = []


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_validation_a_stop_cut_short_runs_when_the_fit_resumes(cache_dir, tmp_path, how):
    """``save_on_exception`` saved the step in the middle of its validation, which the resume
    skipped (or finished from its second batch): that validation's values were lost. It
    runs whole, first, with the values of a fit that never stopped (a reader)."""
    import signal

    def run(callbacks, steps=6, ckpt_path=None):
        seen = Validated()
        fit(make_module(cache_dir, eval_num_generations=2), make_data(cache_dir), steps=steps,
            tmp_path=tmp_path, ckpt_path=ckpt_path, enable_checkpointing=True,
            num_sanity_val_steps=0, limit_val_batches=2, val_check_interval=3,
            check_val_every_n_epoch=None, callbacks=[seen, *callbacks])
        return seen.at

    whole = run([])
    assert [step for step, _ in whole] == [3, 6]
    def saver():
        return ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True, every_n_train_steps=4,
                               save_on_exception=True)

    handler = signal.getsignal(signal.SIGINT)  # Lightning ignores SIGINT after a Ctrl-C
    try:
        with pytest.raises((SystemExit, Exception)):
            run([saver(), StopInValidation(3, how)])
    finally:
        signal.signal(signal.SIGINT, handler)
    assert torch.load(tmp_path / "ck" / "last.ckpt", weights_only=False)["global_step"] == 3
    assert run([saver()], ckpt_path=str(tmp_path / "ck" / "last.ckpt")) == whole
    # stopped in the final validation, whose step was saved before it: a fit with no step
    # left does not run it, and says so; one with more steps runs it first
    final = ModelCheckpoint(dirpath=tmp_path / "end", save_last=True, every_n_train_steps=3,
                            save_on_exception=True)
    try:
        with pytest.raises((SystemExit, Exception)):
            run([final, StopInValidation(6, how)])
    finally:
        signal.signal(signal.SIGINT, handler)
    last = str(tmp_path / "end" / "last.ckpt")
    with pytest.warns(UserWarning, match="the validation of step 6 did not end before the run "
                                         "stopped, and this fit had no step left to train"):
        assert run([], ckpt_path=last) == []
    assert [step for step, _ in run([], steps=9, ckpt_path=last)] == [6, 9]
    # the validate the warning names records the checkpoint: no warning, nor a second
    # point at step 6, in a later resume (it ran again: a second reader)
    L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, limit_val_batches=2,
              enable_model_summary=False, default_root_dir=tmp_path).validate(
        make_module(cache_dir, eval_num_generations=2), make_data(cache_dir), ckpt_path=last)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run([], ckpt_path=last) == []
    assert not [w for w in caught if "did not end" in str(w.message)]
    assert [step for step, _ in run([], steps=9, ckpt_path=last)] == [9]


def test_the_validated_checkpoints_are_found_in_a_savers_folder_and_never_remote(tmp_path):
    """A metric in ``filename`` puts a checkpoint in a subfolder of the saver's ``dirpath``,
    where ``validated.json`` is: it was looked for beside the file only, and the validation
    ran twice; a remote checkpoint has no such file and its validation ran on every resume;
    ``fast_dev_run``'s one batch recorded the checkpoints as validated (a reader)."""
    import json

    from maxent_grpo.training.run.validated import note_validated, unvalidated

    folder = tmp_path / "ck"
    (folder / "run").mkdir(parents=True)
    ckpt = folder / "run" / "step=4.ckpt"
    ckpt.write_bytes(b"x")
    saver = SimpleNamespace(dirpath=str(folder), best_k_models={str(ckpt): 0.5},
                            best_model_path="", last_model_path="", _last_checkpoint_saved="")
    trainer = SimpleNamespace(is_global_zero=True, sanity_checking=False, fast_dev_run=1,
                              checkpoint_callbacks=[saver], ckpt_path=str(ckpt),
                              state=SimpleNamespace(fn="fit"))
    note_validated(trainer)
    assert not (folder / "validated.json").exists() and unvalidated(trainer)
    trainer.fast_dev_run = 0
    note_validated(trainer)
    assert list(json.loads((folder / "validated.json").read_text())) == ["run/step=4.ckpt"]
    assert not unvalidated(trainer)
    ckpt.write_bytes(b"another")  # replaced since: not the checkpoint that was validated
    assert unvalidated(trainer)
    trainer.ckpt_path = "s3://bucket/run/last.ckpt"
    assert not unvalidated(trainer)


def test_a_fit_resumed_with_other_options_is_warned_of_them(cache_dir, tmp_path):
    """Resuming with another ``num_generations``, ``temperature`` or ``val_size`` went on
    without a word (the objective's and optimizer's changes were warned of); the same
    options and a moved cache folder resume quietly."""
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1000)
    fit(make_module(cache_dir), make_data(cache_dir), steps=2, tmp_path=tmp_path,
        enable_checkpointing=True, callbacks=[saver])

    def resume(module, data) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(module, data, steps=3, ckpt_path=str(tmp_path / "last.ckpt"))
        return [str(w.message) for w in caught if "options differ" in str(w.message)]

    assert resume(make_module(cache_dir), make_data(cache_dir, dataset_cache_dir="x")) == []
    (message,) = resume(make_module(cache_dir, num_generations=2, temperature=0.7),
                        make_data(cache_dir, val_size=4, val_batch_size=2))
    assert ("(model.num_generations 4 -> 2, model.temperature 1.0 -> 0.7, data.val_batch_size "
            "None -> 2, data.val_size 8 -> 4): it goes on with this run's") in message
    # said once the data module took its state: a change it refuses is not said to go on
    with warnings.catch_warnings(record=True) as caught, pytest.raises(
            ValueError, match="set data.seed: 0 to resume"):
        warnings.simplefilter("always")
        fit(make_module(cache_dir), make_data(cache_dir, seed=1), steps=3,
            ckpt_path=str(tmp_path / "last.ckpt"))
    assert not [w for w in caught if "options differ" in str(w.message)]


def test_an_option_the_data_source_does_not_use_is_not_said_to_have_changed(tmp_path):
    """The DataModule drops an option its source does not use to the default (train_size
    with files); a checkpoint of an older version kept the value given, so resuming it with
    the very same command warned `data.train_size 4000 -> 2000` (an upgrade hunt)."""
    from maxent_grpo.training.settings import warn_changed_options

    def warned(data: PromptDataModule) -> list[str]:
        trainer = SimpleNamespace(lightning_module=None, datamodule=data)
        checkpoint = {"datamodule_hyper_parameters": {**data.hparams, "train_size": 4000}}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_changed_options(checkpoint, trainer)
        return [str(w.message) for w in caught if "options differ" in str(w.message)]

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "q", "answer": "1"}\n')
    assert warned(PromptDataModule(task=None, data_files=str(rows), train_size=4000)) == []
    (message,) = warned(PromptDataModule(task="countdown", train_size=2000))
    assert "data.train_size 4000 -> 2000" in message
