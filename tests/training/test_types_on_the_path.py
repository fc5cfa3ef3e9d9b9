"""The documented types carry the data of a real step: each of the 18 is built (or, for the
``MetricWriter`` protocol, written through) while ``fit`` runs one training step."""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter

import pytest

from maxent_grpo.objectives import GRPO, ListwiseMaxEnt
from maxent_grpo.training import types as documented
from maxent_grpo.training.step.step_log import LightningWriter
from tests.conftest import fit, make_data, make_module

DATACLASSES = [name for name in documented.__all__
               if dataclasses.is_dataclass(getattr(documented, name))]


def test_the_documented_api_has_18_types_and_17_are_dataclasses() -> None:
    listed = set(documented.__all__)
    assert len(listed) == 18
    assert set(listed) - set(DATACLASSES) == {"MetricWriter"}  # the one Protocol


@pytest.fixture
def constructed(monkeypatch) -> Counter:
    """Counts, by name, every documented dataclass built and every MetricWriter.log call."""
    counts: Counter = Counter()
    for name in DATACLASSES:
        cls = getattr(documented, name)
        original = cls.__init__

        def counting(self, *args, __name=name, __original=original, **kwargs):
            counts[__name] += 1
            __original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", counting)
    log = LightningWriter.log

    def writing(self, metrics, step):
        assert isinstance(self, documented.MetricWriter)
        counts["MetricWriter"] += 1
        log(self, metrics, step)

    monkeypatch.setattr(LightningWriter, "log", writing)
    return counts


@pytest.mark.parametrize(
    ("objective", "own"),
    [(GRPO(loss_type="dr_grpo"), "AdvantageStats"), (ListwiseMaxEnt(tau=0.5), "QDistribution")],
    ids=["grpo", "listwise"],
)
def test_one_fit_step_builds_every_documented_type(cache_dir, constructed, objective, own):
    module = make_module(cache_dir, objective=objective,
                         rewards={"tests.conftest:alternating": 1.0})
    from maxent_grpo.training.callbacks import TauController

    # the controllers own their ControllerPaths: a run without one builds none
    controllers = [TauController(1.0)] if own == "QDistribution" else []
    fit(module, make_data(cache_dir), steps=1, callbacks=controllers)
    other = {"AdvantageStats", "QDistribution"} - {own}  # GRPO has no q, listwise no advantages
    other |= set() if controllers else {"ControllerPaths"}
    expected = set(documented.__all__) - other
    assert expected <= set(constructed), sorted(expected - set(constructed))
    assert constructed[own] >= 1
    # the step's values travel in them, e.g. the samples' targets and the logged record
    samples = module.trajectory.samples
    assert (samples.advantages if own == "AdvantageStats" else samples.q) is not None
    assert module.step_metrics_dict["train/reward/mean"] == pytest.approx(0.5)  # alternating 1, 0


#: functions whose reads of a field are no use of it: the type's own checks and
#: representation, and ``dataclasses.replace``, which copies every field
COPIES = ("__post_init__", "__repr__", "__eq__", "replace", "_replace")


@pytest.fixture
def field_reads(monkeypatch) -> set[tuple[str, str]]:
    """``(type, field)`` of every documented dataclass field read while the test runs,
    outside :data:`COPIES`."""
    reads: set[tuple[str, str]] = set()
    for name in DATACLASSES:
        cls = getattr(documented, name)
        names = {f.name for f in dataclasses.fields(cls)}

        def getattribute(self, attr, __names=names, __name=name):
            if attr in __names and sys._getframe(1).f_code.co_name not in COPIES:
                reads.add((__name, attr))
            return object.__getattribute__(self, attr)

        monkeypatch.setattr(cls, "__getattribute__", getattribute)
    return reads


#: Documented fields with no source in this trainer, always None: no objective reads
#: hidden states (scoring computes none), and the engines tokenize each rollout's prompts
#: (no prompt cache). Their docstrings say so.
NO_SOURCE = {("SequenceScores", "pooled_hidden"), ("RuntimeHandles", "prompt_cache_get")}


def test_no_documented_field_is_write_only(cache_dir, field_reads, tmp_path):
    """Two real fits (GRPO; listwise MaxEnt with beta > 0, the tau / beta controllers
    writing their state file, two optimizer steps per rollout and a checkpoint), with the
    samples and export callbacks: every field of every documented dataclass is read by the
    trainer, except the two that have no source here (NO_SOURCE)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from maxent_grpo.training.callbacks import (
        BetaController,
        CompletionSamples,
        HFExport,
        TauController,
    )

    def callbacks(name: str) -> list:
        return [CompletionSamples(every_n_steps=1, jsonl_path=str(tmp_path / f"{name}.jsonl")),
                HFExport(dirpath=str(tmp_path / name))]

    rewards = {"tests.conftest:alternating": 1.0}
    fit(make_module(cache_dir, objective=GRPO(), rewards=rewards, gradient_clip_val=1.0),
        make_data(cache_dir), steps=1, callbacks=callbacks("grpo"))
    state = str(tmp_path / "controller_state.json")
    fit(make_module(cache_dir, objective=ListwiseMaxEnt(tau=0.5, beta=0.1), rewards=rewards,
                    num_iterations=2, micro_batch_groups=1),
        make_data(cache_dir), steps=2, enable_checkpointing=True,
        callbacks=[*callbacks("listwise"), TauController(1.0, state_path=state),
                   BetaController(0.01, state_path=state),
                   ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2)])
    every = {(name, f.name) for name in DATACLASSES
             for f in dataclasses.fields(getattr(documented, name))}
    assert sorted(every - field_reads) == sorted(NO_SOURCE)
