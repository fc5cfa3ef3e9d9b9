"""Ctrl-C during a run on several processes (:mod:`maxent_grpo.training.run.signals`); the
two-process runs are in tests/test_distributed.py."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.utilities.exceptions import SIGTERMException

from maxent_grpo.cli.errors import exit_on_error
from maxent_grpo.training.run import signals


def trainer_of(world_size: int) -> SimpleNamespace:
    """What Lightning's signal connector and :func:`signals.take_sigterm` read of a Trainer."""
    trainer = SimpleNamespace(
        world_size=world_size, global_rank=0, strategy=SimpleNamespace(launcher=None),
        _accelerator_connector=SimpleNamespace(cluster_environment=LightningEnvironment()))
    trainer._signal_connector = _SignalConnector(trainer)
    return trainer


@pytest.fixture
def registered():
    """Lightning's handlers with ours, as a fit registers them; put back after the test."""
    before = signal.getsignal(signal.SIGINT)
    made = []

    def register(world_size: int) -> SimpleNamespace:
        trainer = trainer_of(world_size)
        signals.take_sigterm(trainer)
        trainer._signal_connector.register_signal_handlers()
        made.append(trainer)
        return trainer

    yield register
    for trainer in made:
        trainer._signal_connector.teardown()
        signals.give_back_sigterm(trainer)
    signals.INTERRUPTED.clear()
    assert signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_on_several_processes_stops_after_the_batch_and_again_at_once(registered,
                                                                              monkeypatch):
    """The first Ctrl-C is noted, as a SIGTERM (every rank stops after the same batch): a
    KeyboardInterrupt in mid-step on one rank left the others in a collective. One soon
    after it is that Ctrl-C passed on (``maxent_grpo.serve`` forwards the terminal's, which
    reached the training too: it stopped at once, unsaved); a later one stops at once."""
    connector = registered(2)._signal_connector
    os.kill(os.getpid(), signal.SIGINT)
    assert connector.sigterm_pending and not connector.received_sigterm
    os.kill(os.getpid(), signal.SIGINT)  # passed on
    assert signals.INTERRUPTED == ["once"]
    monkeypatch.setattr(signals, "SAME_CTRL_C_S", 0.0)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    assert signals.INTERRUPTED == ["once", "again"]


def test_a_run_started_with_ctrl_c_ignored_keeps_ignoring_it():
    """``cmd &`` in a script starts it with SIGINT ignored: a run on several processes took
    it as a stop."""
    trainer = trainer_of(2)
    signals.take_sigterm(trainer)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        trainer._signal_connector.register_signal_handlers()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        trainer._signal_connector.teardown()
    finally:
        signals.give_back_sigterm(trainer)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_a_ctrl_c_of_another_process_is_shared_so_every_one_exits_130(registered):
    """The processes that did not get the SIGINT (``kill -INT`` of the launching one) said
    "stopped by SIGTERM" and exited 143."""
    trainer = registered(2)
    trainer.strategy = SimpleNamespace(root_device="cpu", reduce=lambda flags, reduce_op: (
        flags + torch.tensor([1, 0, 1], dtype=flags.dtype)))  # the other rank's Ctrl-C
    assert signals.share_sigterm(trainer) and trainer._signal_connector.received_sigterm
    assert signals.INTERRUPTED == ["shared"]


def test_ctrl_c_on_one_process_is_lightnings_keyboard_interrupt(registered):
    """One process has no other to wait for: Ctrl-C stops it in mid-step, and
    ``save_on_exception`` saves the step it cut, which a resume runs again."""
    connector = registered(1)._signal_connector
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    assert not getattr(connector, "sigterm_pending", False) and not signals.INTERRUPTED


def test_the_command_exits_130_after_a_ctrl_c_shared_with_every_process(registered, capsys):
    registered(2)
    os.kill(os.getpid(), signal.SIGINT)

    def stopped() -> None:
        raise SIGTERMException  # Lightning's, after the batch

    with pytest.raises(SystemExit) as stop:
        exit_on_error(stopped, show_trace=False)
    assert stop.value.code == 130
    assert "interrupted (Ctrl-C) after a batch" in capsys.readouterr().err


def test_main_in_python_raises_a_shared_ctrl_c_as_keyboard_interrupt(registered, monkeypatch):
    """``maxent_grpo.cli.main(args)`` raises a Ctrl-C as ``KeyboardInterrupt``; with several
    processes it ended as Lightning's ``SIGTERMException``, a ``SystemExit`` of code None: a
    script that did not catch it exited 0."""
    from maxent_grpo.cli import parser

    def stopped_after_a_batch(*args, **kwargs):
        raise SIGTERMException

    registered(2)
    os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(parser, "_build", stopped_after_a_batch)
    with pytest.raises(KeyboardInterrupt):
        parser.main(["fit", "--config", "tiny"])
    signals.INTERRUPTED.clear()  # a SIGTERM's stop stays a SystemExit
    with pytest.raises(SIGTERMException):
        parser.main(["fit", "--config", "tiny"])


def test_a_second_sigterm_says_the_batch_is_still_running(registered, monkeypatch, caplog):
    """A hung reward without a timeout blocks the stop: repeated SIGTERMs printed the same
    line. One passed on at once (Lightning's launcher forwards it to the processes that
    also got the group's) is the same signal (readers)."""
    registered(1)
    with caplog.at_level("INFO", logger="maxent_grpo.training.run.signals"):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # passed on
        assert "still running" not in caplog.text
        monkeypatch.setattr(signals, "SAME_CTRL_C_S", 0.0)
        os.kill(os.getpid(), signal.SIGTERM)
    assert caplog.text.count("SIGTERM: the run stops after this batch") == 3
    assert "still running: a batch that never ends" in caplog.text
