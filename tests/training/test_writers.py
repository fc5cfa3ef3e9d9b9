from __future__ import annotations

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from maxent_grpo.training.types import LogStepArtifacts, LossScalarBundle, MetricWriter
from maxent_grpo.training.writers import TensorBoardWriter


def test_tensorboard_writer_satisfies_the_protocol_and_writes_events(tmp_path):
    writer = TensorBoardWriter(str(tmp_path))
    assert isinstance(writer, MetricWriter)
    artifacts = LogStepArtifacts(
        loss_outputs=LossScalarBundle(1.5, 1.0, None, 0.25, 0.01),
        diagnostics={"reward/mean": 0.75, "kl": float("nan")},
        grad_norm_scalar=2.0,
        epoch_progress=0.5,
    )
    writer.log(artifacts.as_dict(), step=3)
    writer.log({"reward/mean": torch.tensor(0.5)}, step=4)
    writer.flush()
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "loss/total" in tags and "grad_norm" in tags and "kl" not in tags
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(3, 0.75), (4, 0.5)]


def test_tensorboard_writer_rejects_non_scalars(tmp_path):
    writer = TensorBoardWriter(str(tmp_path))
    with pytest.raises(ValueError, match="'hist' must be a scalar"):
        writer.log({"hist": torch.ones(3)}, step=0)
    with pytest.raises(ValueError, match="'name' must be a number"):
        writer.log({"name": "abc"}, step=0)
    with pytest.raises(ValueError, match="step"):
        writer.log({"x": 1.0}, step=-1)
    writer.close()
