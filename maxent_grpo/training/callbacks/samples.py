"""Show what the policy samples: a table of rollouts in every logger, histograms, a JSONL dump.

After every training step the module leaves the step's typed trajectory in
``pl_module.trajectory``; its ``samples`` (a
:class:`~maxent_grpo.training.step.trajectory.RolloutSamples`, on the CPU) hold the step, the B
prompts, the B x G completions, the (B, G) rewards and reward components, and the
advantages (:class:`~maxent_grpo.training.types.AdvantageStats`), MaxEnt weights and
target q (:class:`~maxent_grpo.training.types.QDistribution`) where the objective has them.
:class:`CompletionSamples` writes the first ``max_prompts`` prompts, one row per completion,
through every logger of the run:

- TensorBoard (any logger whose ``experiment`` is a ``SummaryWriter``): a markdown table
  under the text tag ``samples/completions`` (total reward, each reward component and the
  advantage, MaxEnt weight and target q, whichever the objective has) and histograms
  ``samples/reward``, ``samples/weight``, ``samples/advantage``, ``samples/q`` of the whole
  (B, G) batch;
- W&B (``WandbLogger``): a ``wandb.Table`` under ``samples/completions`` per written step,
  with the columns of :func:`flat_table`;
- MLflow (``MLFlowLogger``): the same table as the JSON artifact ``samples/step_<n>.json``
  (``{"columns": [...], "data": [...]}``, the layout ``MlflowClient.log_table`` writes; one
  file per step, as appending to one table would make MLflow re-read and re-type it);
- any other logger (``CSVLogger``, a custom one), or none: the rows of
  :func:`rollout_rows` appended to ``<log_dir>/samples/completions.jsonl``, ``log_dir``
  being the logger's ``log_dir`` (else its ``save_dir``, else the run's folder).

Optionally, every step, one JSON line per completion of the whole batch is appended to
``jsonl_path``, whatever the loggers.

Steps: samples are keyed on the rollout's ``step`` (``trainer.global_step`` when the
rollout was sampled, before its optimizer steps), which is the step at which the same
training step's ``train/...`` scalars are logged. The tables and histograms are written
when that step is a multiple of ``every_n_steps`` (0, n, 2n, ...; with
``num_iterations = k > 1`` a rollout covers k optimizer steps and is written when those
contain a multiple of n).

Hyper-parameters: Lightning already logs the module's and the DataModule's
``save_hyperparameters`` (``hparams.yaml`` and TensorBoard's HPARAMS tab) at fit start; those
leave out ``model.objective`` and ``model.optimizer``. So this callback also adds, once at
fit start, the run's full ``config.yaml`` (written by ``LightningCLI`` into the run's folder)
as the TensorBoard text tag ``hparams/config``, when that file exists (other loggers have the
file itself).

Only global rank 0 writes.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger, MLFlowLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.tensorboard import SummaryWriter

from maxent_grpo.training.step.trajectory import RolloutSamples
from maxent_grpo.validation import check_bool, check_int, require

__all__ = [
    "MAX_CELL_CHARS",
    "CompletionSamples",
    "append_jsonl",
    "escape_cell",
    "flat_table",
    "rollout_rows",
    "samples_table",
]

#: Texts longer than this many characters are cut in the table (not in the JSONL dump) and
#: end with "…".
MAX_CELL_CHARS = 400

#: Characters that would otherwise be read as markdown (or end a table cell).
_MARKDOWN_SPECIAL = "\\`*_[]|"


def escape_cell(text: str, max_chars: int = MAX_CELL_CHARS) -> str:
    """``text`` as the content of one markdown table cell, rendered literally.

    Cut to ``max_chars`` characters (plus "…"), then markdown specials (backslash, backtick,
    ``*``, ``_``, brackets, ``|``) are backslash-escaped, ``& < >`` become HTML entities and
    line breaks become ``<br>``, so the cell never splits the row.
    """
    if len(text) > max_chars:
        text = text[:max_chars] + "…"
    text = "".join("\\" + c if c in _MARKDOWN_SPECIAL else c for c in text)
    text = html.escape(text, quote=False)
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "<br>")


def _number(value: float) -> float | None:
    """A float for JSON; non-finite values (which strict JSON cannot hold) become None."""
    value = float(value)
    return value if math.isfinite(value) else None


def _grouped(samples: RolloutSamples) -> dict[str, Tensor | None]:
    """The optional per-completion columns as ``(B, G)`` tensors (None when absent)."""
    adv, q = samples.advantages, samples.q
    return {
        "advantage": None if adv is None else torch.tensor(adv.grouped, dtype=torch.float64),
        "weight": samples.weights,
        "q": None if q is None else torch.tensor(q.grouped, dtype=torch.float64),
    }


def rollout_rows(samples: RolloutSamples, max_prompts: int | None = None) -> list[dict[str, Any]]:
    """One dict per completion, prompt-major: ``{"step", "prompt_index", "prompt",
    "completion", "reward", "components": {name: value}, "advantage", "weight", "q"}`` (the
    last three None when the objective has none; non-finite numbers become None).

    ``max_prompts`` keeps the first prompts only.
    """
    prompts = samples.prompts
    completions = samples.generation.grouped_completions
    rewards = samples.rewards
    B, G = rewards.shape
    if len(prompts) != B or len(completions) != B or any(len(g) != G for g in completions):
        raise ValueError(
            f"trajectory samples: prompts ({len(prompts)}) and completions "
            f"({[len(g) for g in completions]}) must match rewards of shape (B, G) = ({B}, {G})"
        )
    extra = _grouped(samples)
    rows = []
    for i in range(B if max_prompts is None else min(B, max_prompts)):
        for j in range(G):
            row = {
                "step": int(samples.step),
                "prompt_index": i,
                "prompt": prompts[i],
                "completion": completions[i][j],
                "reward": _number(rewards[i, j]),
                "components": {n: _number(v[i, j]) for n, v in samples.components.items()},
            }
            row.update({k: None if v is None else _number(v[i, j]) for k, v in extra.items()})
            rows.append(row)
    return rows


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def samples_table(samples: RolloutSamples, max_prompts: int) -> str:
    """The markdown table of the first ``max_prompts`` prompts x G completions.

    Columns: prompt (shown on the first row of its group), completion, reward, one column
    per reward component, then ``advantage``, ``weight`` and ``q`` where the objective has
    them. Numbers have 4 significant digits; texts go through :func:`escape_cell`.
    """
    rows = rollout_rows(samples, max_prompts)
    names = list(samples.components)
    extra = [k for k, v in _grouped(samples).items() if v is not None]
    header = ["prompt", "completion", "reward", *names, *extra]
    lines = [
        "| " + " | ".join(escape_cell(h) for h in header) + " |",
        "|" + "---|" * len(header),
    ]
    previous = None
    for row in rows:
        first, previous = row["prompt_index"] != previous, row["prompt_index"]
        cells = [
            escape_cell(row["prompt"]) if first else "",
            escape_cell(row["completion"]),
            _fmt(row["reward"]),
            *(_fmt(row["components"][n]) for n in names),
            *(_fmt(row[k]) for k in extra),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def flat_table(samples: RolloutSamples, max_prompts: int) -> tuple[list[str], list[list]]:
    """The rows of :func:`rollout_rows` (first ``max_prompts`` prompts) as a flat table:
    ``(columns, data)`` with columns ``step, prompt_index, prompt, completion, reward``, one
    ``reward/<component>`` per reward component, then ``advantage, weight, q`` (None where the
    objective has none). Texts are whole (not cut as in the markdown table)."""
    names = list(samples.components)
    columns = ["step", "prompt_index", "prompt", "completion", "reward",
               *(f"reward/{n}" for n in names), "advantage", "weight", "q"]
    data = [
        [r["step"], r["prompt_index"], r["prompt"], r["completion"], r["reward"],
         *(r["components"][n] for n in names), r["advantage"], r["weight"], r["q"]]
        for r in rollout_rows(samples, max_prompts)
    ]
    return columns, data


def _finite(values: Tensor) -> Tensor:
    flat = values.detach().float().flatten()
    return flat[torch.isfinite(flat)]


def append_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append one JSON line per row to ``path`` and flush."""
    with open(path, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")
        f.flush()


class CompletionSamples(Callback):
    """Write sampled completions through every logger of the run (and optionally to JSONL)
    during ``fit``: TensorBoard text and histograms, a W&B table, an MLflow artifact, or a
    JSONL file in the log folder of any other logger (see the module docstring).

    YAML::

        trainer:
          callbacks:
            - class_path: maxent_grpo.training.callbacks.samples.CompletionSamples
              init_args: {every_n_steps: 50, jsonl_path: "{log_dir}/rollouts.jsonl"}

    Args:
        every_n_steps: write the tables and histograms for rollouts sampled at multiples of
            this step (>= 1).
        max_prompts: prompts in the tables (>= 1), each with all its G completions.
        jsonl_path: when set, append every step's rollout here, one JSON object per
            completion (see :func:`rollout_rows`), flushed after each step; ``{log_dir}``
            expands to the logger's version folder. Parent folders are created. An
            existing file is appended to (a resumed run continues it).
        histograms: also write (TensorBoard) histograms of rewards, weights and advantages.

    With several processes (DDP, FSDP) only global rank 0 writes, so the tables, the
    histograms and the JSONL hold rank 0's share of each step's prompts.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        max_prompts: int = 4,
        jsonl_path: str | None = None,
        histograms: bool = True,
    ) -> None:
        check_int("CompletionSamples.every_n_steps", every_n_steps, minimum=1)
        check_int("CompletionSamples.max_prompts", max_prompts, minimum=1)
        require(
            jsonl_path is None or bool(str(jsonl_path).strip()),
            f"CompletionSamples.jsonl_path must be None or a non-empty path; got {jsonl_path!r}",
        )
        check_bool("CompletionSamples.histograms", histograms)
        self.every_n_steps = every_n_steps
        self.max_prompts = max_prompts
        self.jsonl_path = jsonl_path
        self.histograms = histograms
        self._run_dir: str | None = None
        self._jsonl_file: Path | None = None
        self._prev_step: int | None = None  # step of the last rollout seen
        self._last_record: RolloutSamples | None = None

    # ------------------------------------------------------------------ helpers
    def _log_dir(self, trainer: pl.Trainer) -> str:
        """The run's folder: ``trainer.log_dir`` (else ``default_root_dir``), read once."""
        if self._run_dir is None:
            self._run_dir = str(trainer.log_dir or trainer.default_root_dir)
        return self._run_dir

    def _resolve_jsonl(self, trainer: pl.Trainer) -> Path:
        if self._jsonl_file is None:
            assert self.jsonl_path is not None
            self._jsonl_file = Path(self.jsonl_path.replace("{log_dir}", self._log_dir(trainer)))
            self._jsonl_file.parent.mkdir(parents=True, exist_ok=True)
        return self._jsonl_file

    def _table_file(self, trainer: pl.Trainer, logger: Logger | None) -> Path:
        """``<log_dir>/samples/completions.jsonl`` for a logger without a table of its own."""
        log_dir = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
        return Path(log_dir or self._log_dir(trainer)) / "samples" / "completions.jsonl"

    # ------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log the CLI's ``config.yaml`` (if any) as TensorBoard text: the hparams Lightning
        logs lack the objective and the optimizer.

        ``trainer.log_dir`` is a broadcast from rank 0 under DDP, so every rank reads it
        here (and resolves the JSONL path, which reads it too); reading it on rank 0 only
        would leave rank 0 waiting for the others forever."""
        config = Path(self._log_dir(trainer)) / "config.yaml"
        if self.jsonl_path is not None:
            self._resolve_jsonl(trainer)
        if not trainer.is_global_zero or not config.is_file():
            return
        text = "\n".join("    " + line for line in config.read_text("utf-8").splitlines())
        for logger in getattr(trainer, "loggers", None) or []:
            writer = getattr(logger, "experiment", None)
            if isinstance(writer, SummaryWriter):
                writer.add_text("hparams/config", text, trainer.global_step)
                writer.flush()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._prev_step = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:
        trajectory = getattr(pl_module, "trajectory", None)
        record = None if trajectory is None else trajectory.samples
        if not trainer.is_global_zero or record is None or record is self._last_record:
            return
        self._last_record = record
        step = int(record.step)
        prev = step - 1 if self._prev_step is None else self._prev_step
        self._prev_step = step
        if self.jsonl_path is not None:
            append_jsonl(self._resolve_jsonl(trainer), rollout_rows(record))
        if step // self.every_n_steps > prev // self.every_n_steps:
            self.write_loggers(trainer, record, step)

    # ------------------------------------------------------------------ writers
    def write_loggers(self, trainer: pl.Trainer, record: RolloutSamples, step: int) -> None:
        """The table (and TensorBoard histograms) of ``record`` through every logger; loggers
        without a table of their own (and a run without loggers) get the rows as JSONL in
        their log folder, once per folder, unless that file is ``jsonl_path`` (which
        already holds every row)."""
        loggers = list(getattr(trainer, "loggers", None) or [])
        files: dict[Path, None] = {}  # ordered, each file once
        for logger in loggers:
            if isinstance(logger, WandbLogger):
                self.write_wandb(logger, record, step)
            elif isinstance(logger, MLFlowLogger):
                self.write_mlflow(logger, record, step)
            elif isinstance(getattr(logger, "experiment", None), SummaryWriter):
                self.write_tensorboard(logger.experiment, record, step)
            else:
                files[self._table_file(trainer, logger)] = None
        if not loggers:
            files[self._table_file(trainer, None)] = None
        dump = None if self._jsonl_file is None else self._jsonl_file.resolve()
        for path in files:
            if path.resolve() == dump:
                continue
            if not path.exists():
                rank_zero_info(f"CompletionSamples: the samples table goes to {path}")
                path.parent.mkdir(parents=True, exist_ok=True)
            append_jsonl(path, rollout_rows(record, self.max_prompts))

    def write_tensorboard(self, writer: Any, record: RolloutSamples, step: int) -> None:
        """The table (``samples/completions``) and, with ``histograms``, the histograms."""
        writer.add_text("samples/completions", samples_table(record, self.max_prompts), step)
        if self.histograms:
            for tag, values in {"reward": record.rewards, **_grouped(record)}.items():
                if values is None:
                    continue
                values = _finite(values)
                if values.numel():
                    writer.add_histogram(f"samples/{tag}", values, step)
        writer.flush()

    def write_wandb(self, logger: WandbLogger, record: RolloutSamples, step: int) -> None:
        """The table as a ``wandb.Table`` under ``samples/completions`` (x-axis
        ``trainer/global_step``, as Lightning logs the scalars)."""
        columns, data = flat_table(record, self.max_prompts)
        logger.log_table("samples/completions", columns=columns, data=data, step=step)

    def write_mlflow(self, logger: MLFlowLogger, record: RolloutSamples, step: int) -> None:
        """The table as the run's JSON artifact ``samples/step_<step>.json``."""
        columns, data = flat_table(record, self.max_prompts)
        logger.experiment.log_dict(
            logger.run_id, {"columns": columns, "data": data}, f"samples/step_{step}.json"
        )
