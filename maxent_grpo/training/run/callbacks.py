"""The callbacks the module adds itself (``MaxEntGRPOModule.configure_callbacks``).

- :class:`CleanUp`: a failed run calls no module teardown in Lightning; this does it.
- :class:`CompletionWriter`: ``predict`` writes one JSON line per sampled completion
  (:func:`~maxent_grpo.training.run.evaluation.prediction_row`: the prompt, the completion or
  a multi-turn rollout's messages, each reward function's value, the parsed answer, right
  or not) and prints the @k summary at the end. Every rank writes its share to a part file
  beside the output; rank 0 joins them, in the order of the rows, into the one file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from maxent_grpo.training.run.checkpoint_io import atomic_write

__all__ = ["CleanUp", "CompletionWriter", "DEFAULT_PREDICTIONS"]

#: the file name ``predict`` writes into the run's folder when no ``output`` is given
DEFAULT_PREDICTIONS = "predictions.jsonl"


class CleanUp(L.Callback):
    """A failed run calls no module teardown in Lightning: this does it."""

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        pl_module.teardown("fit")


class CompletionWriter(L.Callback):
    """Write ``predict``'s graded completions to a JSONL file, one line per completion.

    Args:
        output: the file to write (replaced when it exists), or an existing folder to write
            ``predictions.jsonl`` into; ``None``: ``predictions.jsonl`` in the run's folder
            (the logger's version folder, else ``trainer.default_root_dir``).

    The rows of one prompt are consecutive and the prompts are in the order of their source
    rows (the ``row`` field), on any number of processes. At the end the ``predict/...``
    @k metrics of all ranks (``Evaluator.compute``) are printed and kept in :attr:`metrics`.
    A path that cannot be written stops ``predict`` before any sampling, naming it.
    """

    def __init__(self, output: str | None = None) -> None:
        if output is not None and not str(output).strip():
            raise ValueError(f"the predict output must be a file path; got {output!r}")
        self.output = output
        self.path: Path | None = None
        self.metrics: dict[str, float] = {}
        self.rows = 0
        self._part: Any = None

    def _part_path(self, rank: int) -> Path:
        assert self.path is not None
        return self.path.with_name(f".{self.path.name}.rank{rank}.part")

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "predict":
            return
        if self.output is None:
            path = Path(trainer.log_dir or trainer.default_root_dir) / DEFAULT_PREDICTIONS
        else:
            path = Path(self.output).expanduser()
            path = path / DEFAULT_PREDICTIONS if path.is_dir() else path
        self.path = path.absolute()
        try:  # every rank checks its own part file: fail before sampling, not after
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._part = open(self._part_path(trainer.global_rank), "w", encoding="utf-8")
        except OSError as err:
            raise ValueError(
                f"predict cannot write {self.path} ({err.strerror or err}); pass --output with "
                "a file in a folder you can write to") from err
        self.rows, self.metrics = 0, {}

    def on_predict_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        for row in outputs or []:
            self._part.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        self._part.flush()
        self.rows += len(outputs or [])

    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.metrics = pl_module.evaluator.compute("predict")  # every rank: it gathers

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._part.close()
        trainer.strategy.barrier()  # every part is whole before rank 0 reads it
        if trainer.is_global_zero:
            parts = [self._part_path(r) for r in range(trainer.world_size)]
            rows = [json.loads(line) for part in parts
                    for line in part.read_text(encoding="utf-8").splitlines()]
            rows.sort(key=lambda r: (r["row"], r["sample"]))
            atomic_write(self.path, lambda f: f.writelines(
                (json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8") for r in rows))
            for part in parts:
                part.unlink()
            prompts = len({r["row"] for r in rows})
            at_k = "  ".join(f"{k.removeprefix('predict/')} {v:.3g}"
                             for k, v in self.metrics.items() if "@" in k and k.count("/") == 1)
            rank_zero_info(f"predict: {len(rows)} completions of {prompts} prompts written to "
                           f"{self.path}\n  {at_k}")
        trainer.strategy.barrier()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        if self._part is not None and not self._part.closed:
            self._part.close()
        if self.path is not None:
            with_suffix = self._part_path(trainer.global_rank)
            if with_suffix.exists():
                os.remove(with_suffix)
