"""The progress bar people read: a smoothed reward, no v_num, steps out of max_steps, and
plain lines instead of a bar when stdout is not a terminal."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.loggers import CSVLogger

import maxent_grpo.cli.parser as cli_module
from maxent_grpo.training.callbacks.progress import ReadableProgressBar, is_terminal, line_interval
from tests.conftest import make_data, make_module

ROOT = Path(__file__).resolve().parents[3]
LINE = re.compile(
    r"^step (\d+)/(\d+)  reward\(avg20\) (-?\d+\.\d{3})  loss \S+  tokens/s \d+  "
    r"eta \d+:\d\d:\d\d$"
)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


def fake_trainer(step: int, max_steps: int = 500, **kw) -> SimpleNamespace:
    opts = dict(global_step=step, max_steps=max_steps, current_epoch=0, loggers=[],
                progress_bar_metrics={}, is_global_zero=True, local_rank=0, max_epochs=None,
                num_training_batches=float("inf"), fit_loop=SimpleNamespace(
                    epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(
                        current=SimpleNamespace(processed=0)))))
    opts.update(kw)
    return SimpleNamespace(**opts)


def fake_step(bar: ReadableProgressBar, trainer, record: dict) -> None:
    """One step whose logged dict holds ``record`` (names without ``train/``)."""
    module = SimpleNamespace(step_metrics_dict={f"train/{k}": v for k, v in record.items()})
    bar.on_train_batch_end(trainer, module, None, None, 0)


def started(bar: ReadableProgressBar, trainer) -> ReadableProgressBar:
    bar.train_progress_bar = Tqdm(disable=True)  # what on_train_start would have drawn
    bar.on_train_start(trainer, None)
    return bar


# ---------------------------------------------------------------------------- what is shown


def test_the_reward_shown_is_the_mean_of_the_last_20_steps_and_v_num_is_dropped():
    bar = started(ReadableProgressBar(mode="lines", stream=io.StringIO()), fake_trainer(0))
    rewards = [i / 100 for i in range(25)]  # 0.00 ... 0.24
    for step, reward in enumerate(rewards, start=1):
        fake_step(bar, fake_trainer(step), {"reward/mean": reward, "loss/total": 0.5})
    assert bar.smoothed_reward == pytest.approx(sum(rewards[-20:]) / 20)  # 0.145, not 0.24

    trainer = fake_trainer(25, loggers=[SimpleNamespace(version=7)],
                           progress_bar_metrics={"reward": 0.24, "loss": 0.5})
    assert TQDMProgressBar().get_metrics(trainer, None)["v_num"] == 7  # what Lightning shows
    shown = bar.get_metrics(trainer, None)
    assert shown == {"reward(avg20)": pytest.approx(0.145), "loss": 0.5}
    assert ReadableProgressBar(window=5).reward_label == "reward(avg5)"


def test_before_the_first_step_the_logged_metrics_are_shown_unchanged():
    bar = ReadableProgressBar()
    trainer = fake_trainer(0, progress_bar_metrics={"reward": 0.1})
    assert bar.get_metrics(trainer, None) == {"reward": 0.1}


def test_a_line_per_n_steps_with_the_step_out_of_max_steps():
    out = io.StringIO()
    bar = started(ReadableProgressBar(mode="lines", every_n_steps=4, every_s=0, stream=out),
                  fake_trainer(0, max_steps=10))
    for step in range(1, 11):
        fake_step(bar, fake_trainer(step, max_steps=10),
                  {"reward/mean": 0.5, "loss/total": 0.031, "perf/tokens_per_s": 1234.4})
    bar.on_train_end(fake_trainer(10, max_steps=10), None)  # 10 is no multiple of 4: a last line
    lines = out.getvalue().splitlines()
    progress, summary = lines[:3], lines[3:]
    assert [LINE.match(line).group(1, 2) for line in progress] == [
        ("4", "10"), ("8", "10"), ("10", "10")]
    assert "reward(avg20) 0.500  loss 0.031  tokens/s 1234  eta 0:00:00" in progress[-1]
    assert summary[0].startswith("fit done: 10 steps in ") and summary[0].endswith(
        "reward first 5 rollouts 0.500, last 5 0.500")  # halves: 10 rollouts


def test_the_eta_is_at_most_what_max_time_leaves():
    """``trainer.max_time`` stops the run before ``max_steps``: the ETA counted the steps
    alone (``eta 0:18:20`` for a run that stopped at once, a hunt)."""
    import time

    from lightning.pytorch.callbacks import Timer

    timer = Timer(duration="00:00:00:30")
    timer.on_train_start(None, None)  # its clock started
    bar = started(ReadableProgressBar(mode="lines"), fake_trainer(0, max_steps=100))
    bar._start_time = time.monotonic() - 1000.0  # 10 steps took 1000 s: 9000 s to go
    trainer = fake_trainer(10, max_steps=100, callbacks=[timer])
    assert bar.progress_line(trainer).endswith("eta 0:00:30")
    assert bar.progress_line(fake_trainer(10, max_steps=100, callbacks=[])).endswith(
        "eta 2:30:00")
    # a Timer of interval "epoch" stops at the end of the epoch its time ends in, not then
    timer = Timer(duration="00:00:00:30", interval="epoch")
    timer.on_train_start(None, None)
    assert bar.progress_line(fake_trainer(10, max_steps=100, callbacks=[timer])).endswith(
        "eta 2:30:00")


def test_with_k_optimizer_steps_a_batch_a_line_comes_at_each_multiple_passed():
    """With ``num_iterations`` 3 the count moves 3 at a time: lines every 4 steps came only
    at 12, 24, ... (the multiples of 12)."""
    out = io.StringIO()
    bar = started(ReadableProgressBar(mode="lines", every_n_steps=4, every_s=0, stream=out),
                  fake_trainer(0, max_steps=30))
    for step in range(3, 31, 3):
        fake_step(bar, fake_trainer(step, max_steps=30), {"reward/mean": 0.5})
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == [
        "6/30", "9/30", "12/30", "18/30", "21/30", "24/30", "30/30"], lines  # 4, 8, ... 28


def test_the_tool_success_rate_is_shown_only_when_the_step_used_tools():
    """With ``tools/success_rate`` in the step's record (a multi-turn rollout) the line shows
    ``tool success`` after the reward and the bar shows it too; without it, neither does."""
    record = {"reward/mean": 0.0, "loss/total": 0.5, "perf/tokens_per_s": 10.0}
    for tools, expected in (({"tools/success_rate": 0.0}, "0%"),
                            ({"tools/success_rate": 0.75}, "75%"), ({}, None)):
        out = io.StringIO()
        bar = started(ReadableProgressBar(mode="lines", every_n_steps=1, every_s=0, stream=out),
                      fake_trainer(0, max_steps=2))
        trainer = fake_trainer(1, max_steps=2, progress_bar_metrics={"reward": 0.0})
        fake_step(bar, trainer, record | tools)
        line = out.getvalue().splitlines()[0]
        shown = bar.get_metrics(trainer, None)
        if expected is None:
            assert "tool" not in line and "tool success" not in shown
            assert LINE.match(line), line  # the line without tools is unchanged
        else:
            assert f"reward(avg20) 0.000  tool success {expected}  loss 0.5" in line, line
            assert shown["tool success"] == expected
            assert LINE.match(line.replace(f"  tool success {expected}", "")), line


def test_an_environments_steps_are_shown_as_env_success():
    """With ``model.environment`` alone the line said ``tool success 100%``: its steps are the
    calls counted, and the run has no tools (a reported defect)."""
    record = {"reward/mean": 0.0, "loss/total": 0.5, "tools/success_rate": 1.0}
    for environment, label in ((object, "env success"), (None, "tool success")):
        out = io.StringIO()
        bar = ReadableProgressBar(mode="lines", every_n_steps=1, every_s=0, stream=out)
        bar.train_progress_bar = Tqdm(disable=True)
        tools = SimpleNamespace(environment=environment)
        bar.on_train_start(fake_trainer(0, max_steps=2),
                           SimpleNamespace(loop=SimpleNamespace(generation=SimpleNamespace(
                               tools=tools))))
        trainer = fake_trainer(1, max_steps=2, progress_bar_metrics={"reward": 0.0})
        fake_step(bar, trainer, record)
        assert f"  {label} 100%  " in out.getvalue(), out.getvalue()
        assert bar.get_metrics(trainer, None)[label] == "100%"


def test_interval_gives_20_to_40_lines_a_run():
    assert [line_interval(n) for n in (1, 7, 100, 200, 500, 1000, 5000)] == [
        1, 1, 5, 5, 20, 50, 200]
    assert line_interval(0) == line_interval(-1) == 10  # length unknown (epoch-based)


# ---------------------------------------------------------------------------- terminal or not


def test_bar_in_a_terminal_and_lines_elsewhere(monkeypatch):
    tty, log = ReadableProgressBar(stream=Terminal()), ReadableProgressBar(stream=io.StringIO())
    assert not tty.plain_lines and tty.is_enabled
    assert log.plain_lines and not log.is_enabled  # no tqdm frames in a log file
    assert ReadableProgressBar(mode="lines", stream=Terminal()).plain_lines
    assert not ReadableProgressBar(mode="bar", stream=io.StringIO()).plain_lines

    monkeypatch.setattr(sys, "stdout", Terminal())  # the default stream is sys.stdout, when used
    assert not ReadableProgressBar().plain_lines
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert ReadableProgressBar().plain_lines

    closed = io.StringIO()
    closed.close()
    assert not is_terminal(closed) and not is_terminal(object())
    with pytest.raises(ValueError, match="mode"):
        ReadableProgressBar(mode="fancy")


def test_other_ranks_write_no_lines():
    out = io.StringIO()
    bar = started(ReadableProgressBar(mode="lines", every_n_steps=1, stream=out), fake_trainer(0))
    bar.disable()  # what ProgressBar.setup does on a rank other than 0
    fake_step(bar, fake_trainer(1), {"reward/mean": 1.0})
    bar.on_train_end(fake_trainer(1), None)
    assert out.getvalue() == ""


# ---------------------------------------------------------------------------- real fits


class Rewards(Callback):
    def __init__(self):
        self.rewards = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.rewards.append(pl_module.step_metrics_dict["train/reward/mean"])


def fit_with(bar, cache_dir, tmp_path, steps: int):
    L.seed_everything(0)
    rewards = Rewards()
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, enable_checkpointing=False,
        logger=CSVLogger(tmp_path), callbacks=[rewards, bar], enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path,
    )
    module = make_module(cache_dir)
    trainer.fit(module, make_data(cache_dir))
    return trainer, module, rewards.rewards


def test_a_fit_in_a_log_file_writes_plain_lines(cache_dir, tmp_path, capsys):
    out = io.StringIO()
    bar = ReadableProgressBar(every_n_steps=4, every_s=0, stream=out)  # auto: not a TTY
    trainer, module, rewards = fit_with(bar, cache_dir, tmp_path, steps=6)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert [LINE.match(line).group(1, 2) for line in lines] == [("4", "6"), ("6", "6")], lines
    assert float(LINE.match(lines[-1]).group(3)) == pytest.approx(sum(rewards) / 6, abs=5e-4)
    assert "%|" not in capsys.readouterr().out  # no tqdm frame either
    shown = bar.get_metrics(trainer, module)
    assert "v_num" not in shown and "reward" not in shown
    assert shown["reward(avg20)"] == pytest.approx(sum(rewards) / 6)


def test_a_fit_that_max_epochs_ends_counts_out_of_its_own_steps(cache_dir, tmp_path):
    """``max_epochs`` ending the fit before ``max_steps``: the lines counted to max_steps
    (``step 10/800 ... eta 0:01:09``, then the fit ended); they count the run's steps."""
    out = io.StringIO()
    bar = ReadableProgressBar(every_n_steps=4, every_s=0, stream=out)
    trainer = L.Trainer(max_steps=800, max_epochs=1, accelerator="cpu", logger=False,
                        enable_checkpointing=False, callbacks=[bar], limit_val_batches=0,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(make_module(cache_dir), make_data(cache_dir, train_size=24, val_size=4))
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert [LINE.match(line).group(1, 2) for line in lines] == [("4", "5"), ("5", "5")], lines


def test_an_asynchronous_fit_counts_out_of_the_steps_it_takes(cache_dir, tmp_path):
    """``max_staleness: 1``: the first batch only starts a rollout, so 5 batches are 4
    optimizer steps; the total (and the rewards' ``max_steps``) said 5 (a hunt)."""
    from tests.training.test_async import async_module

    out = io.StringIO()
    bar = ReadableProgressBar(every_n_steps=2, every_s=0, stream=out)
    trainer = L.Trainer(max_steps=800, max_epochs=1, accelerator="cpu", logger=False,
                        enable_checkpointing=False, callbacks=[bar], limit_val_batches=0,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(async_module(cache_dir, 1), make_data(cache_dir, train_size=24, val_size=4))
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert [LINE.match(line).group(2) for line in lines] == ["4", "4"], lines


def test_a_fit_in_a_terminal_counts_steps_out_of_max_steps(cache_dir, tmp_path, capsys):
    bar = ReadableProgressBar(mode="bar", stream=io.StringIO())
    trainer, module, rewards = fit_with(bar, cache_dir, tmp_path, steps=3)
    drawn = capsys.readouterr().out  # tqdm draws on sys.stdout
    assert "Steps" in drawn and "3/3" in drawn and "reward(avg20)" in drawn
    assert "v_num" not in drawn and "Epoch" not in drawn
    assert bar.train_progress_bar.total == 3 and bar.train_progress_bar.n == 3
    assert bar.get_metrics(trainer, module)["reward(avg20)"] == pytest.approx(sum(rewards) / 3)


def test_validation_lines_and_the_end_summary_say_what_happened(cache_dir, tmp_path):
    """A fit with validation every 2 steps, EarlyStopping on ``val/pass@1`` and a
    checkpoint: each validation prints one line; the end says the steps, the first and
    last rewards, the best ``val/pass@1``, that EarlyStopping stopped it and why, and where
    the logs and checkpoints are."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    out = io.StringIO()
    bar = ReadableProgressBar(mode="lines", every_n_steps=100, stream=out)
    stop = EarlyStopping(monitor="val/pass@1", mode="max", patience=0,
                         stopping_threshold=-1.0)  # any value passes: stops at the first
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    rewards = Rewards()
    L.seed_everything(0)
    trainer = L.Trainer(
        max_steps=6, accelerator="cpu", logger=CSVLogger(tmp_path), enable_model_summary=False,
        callbacks=[rewards, bar, stop, ckpt], val_check_interval=2, check_val_every_n_epoch=None,
        limit_val_batches=1, num_sanity_val_steps=0, default_root_dir=tmp_path,
    )
    trainer.fit(make_module(cache_dir), make_data(cache_dir))
    text = out.getvalue()
    vals = [line for line in text.splitlines() if line.startswith("val @ step")]
    assert vals and vals[0].startswith("val @ step 2: pass@1 ")
    assert trainer.global_step == 2  # stopped at the first validation
    summary = text[text.index("fit done: 2 steps"):]
    first, last = rewards.rewards
    assert f"reward first 1 rollout {first:.3f}, last 1 {last:.3f}" in summary
    pass1 = float(trainer.callback_metrics["val/pass@1"])
    assert f"best val/pass@1 {pass1:.3f} at step 2" in summary
    assert "stopped by EarlyStopping: " in summary and "val/pass@1" in summary
    assert "logs: " in summary and f"checkpoints: {tmp_path / 'ckpt'}" in summary


def test_the_summary_names_the_checkpoint_folder_when_only_last_is_saved_at_the_end(
        cache_dir, tmp_path):
    """``save_last`` with no save during the fit: ModelCheckpoint writes last.ckpt in its own
    on_train_end, after the bar's; the summary still says where it went."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    out = io.StringIO()
    bar = ReadableProgressBar(mode="lines", every_n_steps=100, stream=out)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=100)
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", logger=CSVLogger(tmp_path), enable_model_summary=False,
        callbacks=[bar, ckpt], limit_val_batches=0, num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(make_module(cache_dir), make_data(cache_dir))
    assert (tmp_path / "ckpt" / "last.ckpt").is_file()
    assert f"checkpoints: {tmp_path / 'ckpt'}" in out.getvalue()


def test_a_resumed_fit_with_nothing_left_to_train_says_which_limit_it_reached(
        cache_dir, tmp_path):
    """A resume of a run that had used its ``max_time`` ended at once with Lightning's "Time
    limit reached" only (its Timer counts the time before the resume): the summary says that
    no step trained, why, and what to raise; the same for ``max_steps``."""
    import datetime

    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(steps: int, max_time, ckpt_path=None) -> str:
        out = io.StringIO()
        trainer = L.Trainer(
            max_steps=steps, max_time=max_time, accelerator="cpu", logger=False,
            enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
            callbacks=[ReadableProgressBar(mode="lines", stream=out),
                       ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
        trainer.fit(make_module(cache_dir), make_data(cache_dir), ckpt_path=ckpt_path)
        return out.getvalue()

    assert "fit done: 2 steps" in fit(2, datetime.timedelta(days=1))
    last = str(tmp_path / "ckpt" / "last.ckpt")
    text = fit(4, datetime.timedelta(milliseconds=1), last)
    assert "fit done: no step trained: the run had already trained for " in text
    assert "past trainer.max_time=0:00:00 (the time before the resume counts)" in text
    text = fit(2, datetime.timedelta(days=1), last)
    assert ("fit done: no step trained: the global step, 2, had already reached "
            "trainer.max_steps=2; raise it to train on") in text
    assert f"checkpoints: {tmp_path / 'ckpt'}" in text
    out = io.StringIO()  # no batches: raising a limit would not help, and is not advised
    L.Trainer(max_steps=2, limit_train_batches=0, accelerator="cpu", logger=False,
              enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
              default_root_dir=tmp_path,
              callbacks=[ReadableProgressBar(mode="lines", stream=out)]).fit(
        make_module(cache_dir), make_data(cache_dir))
    assert ("fit done: no step trained: there were no training batches: "
            "trainer.limit_train_batches, or empty data\n") in out.getvalue()


def test_the_report_lines_read_as_documented():
    from maxent_grpo.training.callbacks.run_report import (
        RewardRecord,
        fit_summary,
        validation_line,
    )

    assert validation_line(50, {"train/x": 1.0}) is None
    line = validation_line(50, {"val/reward/mean": 0.28, "val/zeta": 2.0, "val/pass@4": 0.5625,
                                "val/pass@1": 0.3125, "val/bad": float("nan"),
                                "val/pass@1/sums": 0.5})
    assert line == "val @ step 50: pass@1 0.312  pass@4 0.562  reward/mean 0.28  zeta 2"
    line = validation_line(5, {"val/pass@16": 0.9, "val/pass@2": 0.5, "val/pass@1": 0.25})
    assert line == "val @ step 5: pass@1 0.25  pass@2 0.5  pass@16 0.9"  # k as numbers
    # with two k the coverage of a multi-answer task made the line too: mean@k is shown once
    # (it does not depend on k), coverage@k and greedy pass@1 come right after pass@k
    ks = {f"val/{m}@{k}": 0.5 for m in ("pass", "mean", "distinct", "distinct_correct",
                                        "coverage") for k in (1, 4)}
    line = validation_line(5, {**ks, "val/greedy_pass@1": 1.0, "val/reward/mean": 0.5})
    assert line == ("val @ step 5: pass@1 0.5  pass@4 0.5  coverage@1 0.5  coverage@4 0.5  "
                    "greedy_pass@1 1  mean@1 0.5  distinct@1 0.5  distinct@4 0.5  "
                    "distinct_correct@1 0.5  distinct_correct@4 0.5")
    record = RewardRecord(n=2)
    for r in (0.0, 0.1, 0.5, 0.9):
        record.add_reward(r)
    for step, v in ((10, 0.2), (20, 0.6), (30, 0.4)):
        record.add_validation(step, {"val/pass@1": v})
    assert fit_summary(4, 125.0, record, "logs/x", ["ckpt"]) == [
        "fit done: 4 steps in 0:02:05 (31.25 s/step); reward first 2 rollouts 0.050, last 2 "
        "0.700",
        "  best val/pass@1 0.600 at step 20",
        "  logs: logs/x  checkpoints: ckpt",
    ]
    record = RewardRecord(n=1)  # the last 1 reward, not every reward since the first
    for r in (0.0, 0.1, 0.5):
        record.add_reward(r)
    assert fit_summary(3, 3.0, record, None, [])[0] == (
        "fit done: 3 steps in 0:00:03 (1.00 s/step); reward first 1 rollout 0.000, last 1 0.500")
    halves = RewardRecord()  # fewer than 40 rollouts: the halves, never one window twice
    for r in range(5):
        halves.add_reward(float(r))
    assert halves.windows() == ([0.0, 1.0], [3.0, 4.0])
    one = RewardRecord()
    one.add_reward(0.25)
    assert fit_summary(1, 1.0, one, None, [])[0].endswith("reward 0.250 (one rollout)")
    # a resumed fit says its figures are its own (the best val/pass@1 of the run before the
    # resume, which an EarlyStopping reported, is not among them)
    record.add_validation(6, {"val/pass@1": 0.0})
    assert fit_summary(2, 2.0, record, None, [], resumed_at=4)[:2] == [
        "fit done: 2 steps after resuming at step 4 in 0:00:02 (1.00 s/step); reward first 1 "
        "rollout 0.000, last 1 0.500", "  best val/pass@1 0.000 at step 6 (since the resume)"]


# ---------------------------------------------------------------------------- the CLI default


@pytest.mark.parametrize("extra, expected", [
    ([], ReadableProgressBar),
    (["--trainer.enable_progress_bar=false"], type(None)),
    (["--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar"], TQDMProgressBar),
    (["--trainer.callbacks+=maxent_grpo.training.callbacks.ReadableProgressBar",
      "--trainer.callbacks.mode=lines", "--trainer.callbacks.every_n_steps=10"],
     ReadableProgressBar),
])
def test_the_cli_adds_the_readable_bar_unless_one_is_configured_or_bars_are_off(
        extra, expected, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["maxent_grpo"])
    cli = cli_module.main(
        ["--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.logger=false",
         *extra], run=False)
    assert type(cli.trainer.progress_bar_callback) is expected
    progress_bars = [c for c in cli.trainer.callbacks if isinstance(c, TQDMProgressBar)]
    assert len(progress_bars) == (expected is not type(None))
    assert cli.trainer.checkpoint_callback.dirpath.endswith("checkpoints")  # config kept
    if "--trainer.callbacks.mode=lines" in extra:  # configured: used as given, not added twice
        assert (progress_bars[0].mode, progress_bars[0].every_n_steps) == ("lines", 10)


def test_a_plain_trainer_gets_the_readable_bar_and_a_bar_of_ones_own_stays(cache_dir, tmp_path):
    from maxent_grpo.training.callbacks.progress import LIGHTNING_DEFAULT_BAR

    class Own(LIGHTNING_DEFAULT_BAR):
        """A bar the user chose (a subclass of Lightning's default)."""

    def bar_of(callbacks: list) -> type:
        trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, callbacks=callbacks,
                            enable_checkpointing=False, enable_model_summary=False,
                            limit_val_batches=0, default_root_dir=tmp_path)
        trainer.fit(make_module(cache_dir), make_data(cache_dir))
        return type(trainer.progress_bar_callback)

    assert bar_of([]) is ReadableProgressBar  # Lightning's own default gave way
    assert bar_of([Own()]) is Own


def test_a_fast_dev_run_names_no_log_folder(cache_dir, tmp_path):
    """Its DummyLogger logs nothing: the summary said ``logs: .``."""
    out = io.StringIO()
    bar = ReadableProgressBar(mode="lines", every_n_steps=100, stream=out)
    trainer = L.Trainer(fast_dev_run=1, accelerator="cpu", callbacks=[bar],
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(make_module(cache_dir), make_data(cache_dir))
    assert "fit done: " in out.getvalue()
    assert "logs:" not in out.getvalue()
