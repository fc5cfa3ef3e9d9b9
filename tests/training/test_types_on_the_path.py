"""The documented types carry the data of a real step: each of the 18 is built (or, for the
``MetricWriter`` protocol, written through) while ``fit`` runs one training step."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from maxent_grpo.objectives import GRPO, ListwiseMaxEnt
from maxent_grpo.training import types as documented
from maxent_grpo.training.step.step_log import LightningWriter
from tests.training.test_module import alternating, cache_dir, fit, make_data, make_module  # noqa: F401

DATACLASSES = [name for name in documented.__all__
               if dataclasses.is_dataclass(getattr(documented, name))]


def test_the_documented_api_has_18_types_and_17_are_dataclasses() -> None:
    listed = set(documented.__all__) - {"PromptCacheEntry"}  # a field type, not a step type
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
def test_one_fit_step_builds_every_documented_type(cache_dir, constructed, objective, own):  # noqa: F811
    module = make_module(cache_dir, objective=objective,
                         rewards={"tests.training.test_module:alternating": 1.0})
    fit(module, make_data(cache_dir), steps=1)
    other = {"AdvantageStats", "QDistribution"} - {own}  # GRPO has no q, listwise no advantages
    expected = set(documented.__all__) - {"PromptCacheEntry"} - other
    assert expected <= set(constructed), sorted(expected - set(constructed))
    assert constructed[own] >= 1
    # the step's values travel in them, e.g. the samples' targets and the logged record
    samples = module.trajectory.samples
    assert (samples.advantages if own == "AdvantageStats" else samples.q) is not None
    assert module.step_log.as_dict()["reward/mean"] == pytest.approx(0.5)  # alternating 1, 0
