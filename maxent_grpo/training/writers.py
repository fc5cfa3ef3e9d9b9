"""Metric writers satisfying :class:`maxent_grpo.training.types.MetricWriter`.

Inside ``fit`` the LightningModule logs through Lightning's logger. Outside it (evaluation
scripts, benchmarks, notebooks) these writers take the same flat ``name -> scalar`` dicts,
for example :meth:`LogStepArtifacts.as_dict`.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

import torch


class TensorBoardWriter:
    """Writes scalar metrics as TensorBoard events under ``log_dir``.

    Non-scalar values are rejected with ``ValueError`` naming the key; ``None`` and NaN
    values are skipped (they mean "not measured").

    Args:
        log_dir: folder of the event files (created if missing).
    """

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=log_dir)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0; got {step!r}")
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(f"metric {key!r} must be a scalar; got shape "
                                     f"{tuple(value.shape)}")
                value = value.item()
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, Real):
                raise ValueError(f"metric {key!r} must be a number; got {type(value).__name__}")
            if math.isnan(value):
                continue
            self._writer.add_scalar(key, float(value), global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
