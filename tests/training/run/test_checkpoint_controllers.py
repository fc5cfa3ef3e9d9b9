"""A checkpoint records the tau/beta controllers that moved its objective
(``LoopSettings.controller`` and ``controller_meta_manager``), and a fit resumed without
them is warned about; validating or testing the checkpoint is not."""

from __future__ import annotations

import warnings

import pytest

from maxent_grpo.objectives import ListwiseMaxEnt
from maxent_grpo.training.callbacks import MetaController
from maxent_grpo.training.run.checkpoint import load_state, save_state
from maxent_grpo.training.step.optimise import StepCounters
from maxent_grpo.training.types import (
    BatchingSettings,
    ControllerPaths,
    LoopSettings,
    OptimizationSettings,
)

BARE = LoopSettings(None, None, OptimizationSettings(None, None), BatchingSettings(None, None),
                    ControllerPaths(None, None))


def saved(loop: LoopSettings) -> dict:
    checkpoint: dict = {}
    save_state(checkpoint, "builtin:tiny", ListwiseMaxEnt(tau=0.5, beta=0.1), StepCounters(),
               loop)
    return checkpoint


def resumed(checkpoint: dict, loop: LoopSettings, fitting: bool) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_state(checkpoint, "builtin:tiny", ListwiseMaxEnt(tau=0.5, beta=0.1),
                   StepCounters(), loop, fitting=fitting)
    return [str(w.message) for w in caught if "controllers" in str(w.message)]


def test_a_fit_resumed_without_the_controllers_is_warned():
    objective = ListwiseMaxEnt(tau=0.5, beta=0.1)
    meta = MetaController(target_entropy=1.0, kl_target=0.05, state_path="c.json")
    loop = BARE.with_controller(meta.paths, objective, meta)
    checkpoint = saved(loop)
    assert checkpoint["maxent_grpo"]["controllers"] == {
        "state_path": "c.json", "attached": True, "meta_manager": "MetaController"}
    (message,) = resumed(checkpoint, BARE, fitting=True)
    assert "MetaController" in message and "'c.json'" in message
    assert resumed(checkpoint, loop, fitting=True) == []  # the same controllers: quiet
    assert resumed(checkpoint, BARE, fitting=False) == []  # validate / test: quiet


@pytest.mark.parametrize("loop", [BARE, None])
def test_a_checkpoint_without_controllers_resumes_quietly(loop):
    checkpoint = saved(BARE)
    assert checkpoint["maxent_grpo"]["controllers"]["attached"] is False
    assert resumed(checkpoint, loop, fitting=True) == []
