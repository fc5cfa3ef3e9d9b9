"""Show what the policy samples: a table of rollouts in every logger, histograms, a JSONL dump.

After every training step ``pl_module.trajectory.samples`` (a
:class:`~maxent_grpo.training.step.trajectory.RolloutSamples`) holds the step's prompts,
completions, rewards and, where the objective has them, advantages, weights and target q.
:class:`CompletionSamples` writes the first ``max_prompts`` prompts, one row per completion,
through every logger: what TensorBoard, W&B, MLflow and any other logger get, and where
(:func:`~maxent_grpo.training.run.folders.logger_folder`), is in docs/LOGGING.md, "Seeing
samples"; with no logger (``--trainer.logger=false``) nothing, unless ``jsonl_path`` asks
for a file.

Samples are keyed on the rollout's ``step``, its first optimizer step (with
``num_iterations`` k > 1, k times the step Lightning logs the ``train/...`` scalars at), and
written when a multiple of ``every_n_steps`` falls in the rollout's optimizer steps. At fit
start the run's ``config.yaml`` (holding ``model.objective`` and ``model.optimizer``, which
Lightning's hparams lack) becomes the TensorBoard text ``hparams/config``. Only global rank
0 writes (its share of each step's prompts).
"""

from __future__ import annotations

import glob
import html
import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import MLFlowLogger, WandbLogger
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.tensorboard import SummaryWriter

from maxent_grpo.training.run.checkpoint_io import remove_stale_temporaries
from maxent_grpo.training.run.folders import logger_folder, run_dir
from maxent_grpo.training.step.trajectory import RolloutSamples
from maxent_grpo.training.types import AdvantageStats, QDistribution
from maxent_grpo.validation import check_bool, check_int, no_room, require, temporary_name

__all__ = [
    "MAX_CELL_CHARS",
    "CompletionSamples",
    "append_jsonl",
    "escape_cell",
    "flat_table",
    "rollout_rows",
    "samples_table",
]

#: Texts longer than this are cut in the table (not in the JSONL dump) and end with "…".
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


def as_text(value: Any) -> str:
    """A prompt or completion as text for a table cell: a chat's messages (a list of
    ``{"role", "content"}`` dicts) one ``role: content`` line each, anything else ``str``."""
    if isinstance(value, list):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, dict)
                         else str(m) for m in value)
    return value if isinstance(value, str) else str(value)


def _number(value: float) -> float | None:
    """A float for JSON; non-finite values (which strict JSON cannot hold) become None."""
    value = float(value)
    return value if math.isfinite(value) else None


def _grouped(samples: RolloutSamples) -> dict[str, Tensor | None]:
    """The optional per-completion columns as ``(B, G)`` tensors (None when absent)."""
    B = samples.rewards.shape[0]

    def table(stats: AdvantageStats | QDistribution | None) -> Tensor | None:
        if stats is None:
            return None
        if len(stats.grouped) != B:
            raise ValueError(f"trajectory samples: {len(stats.grouped)} groups of "
                             f"{type(stats).__name__} for {B} prompts")
        return torch.tensor(stats.samples, dtype=torch.float64).view(B, -1)

    return {"advantage": table(samples.advantages), "weight": samples.weights,
            "q": table(samples.q)}


def rollout_rows(samples: RolloutSamples, max_prompts: int | None = None) -> list[dict[str, Any]]:
    """One dict per completion of the first ``max_prompts`` prompts, prompt-major:
    ``{"step", "prompt_index", "prompt", "answer", "completion", "reward", "components":
    {name: value}, "advantage", "weight", "q"}`` (the last three None when the objective has
    none; non-finite numbers become None), and ``"sampler_logp"``, the completion's log-prob
    under the sampler, where the engine reports it (``grouped_ref_meta``)."""
    prompts = samples.prompts
    generation = samples.generation
    completions, sampler = generation.grouped_completions, generation.grouped_ref_meta
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
                "answer": generation.answers[i],
                "completion": completions[i][j],
                "reward": _number(rewards[i, j]),
                "components": {n: _number(v[i, j]) for n, v in samples.components.items()},
            }
            row.update({k: None if v is None else _number(v[i, j]) for k, v in extra.items()})
            if sampler is not None:
                row["sampler_logp"] = _number(sampler[i][j])
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
            escape_cell(as_text(row["prompt"])) if first else "",
            escape_cell(as_text(row["completion"])),
            _fmt(row["reward"]),
            *(_fmt(row["components"][n]) for n in names),
            *(_fmt(row[k]) for k in extra),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def flat_table(samples: RolloutSamples, max_prompts: int) -> tuple[list[str], list[list]]:
    """The rows of :func:`rollout_rows` as ``(columns, data)``: ``step, prompt_index, prompt,
    completion, reward``, one ``reward/<component>`` each, then ``advantage, weight, q``
    (None where absent). Texts are whole (not cut as in the markdown table); a chat's messages are
    one ``role: content`` line each (:func:`as_text`)."""
    names = list(samples.components)
    columns = ["step", "prompt_index", "prompt", "completion", "reward",
               *(f"reward/{n}" for n in names), "advantage", "weight", "q"]
    data = [
        [r["step"], r["prompt_index"], as_text(r["prompt"]), as_text(r["completion"]), r["reward"],
         *(r["components"][n] for n in names), r["advantage"], r["weight"], r["q"]]
        for r in rollout_rows(samples, max_prompts)
    ]
    return columns, data


def append_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append one JSON line per row to ``path`` (closed, so flushed); half a character (a
    data column's lone surrogate) is written as its JSON escape, not a crash. A full disk
    names the file (it was the system's error alone)."""
    try:
        with open(path, "a", encoding="utf-8", errors="backslashreplace") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")
    except OSError as err:
        if (full := no_room(err, str(path), "its earlier rows are kept (a line cut short is "
                            "dropped when the fit resumes)")) is not None:
            raise full from err
        raise


def _kept(line: bytes, step: int) -> bool:
    try:
        return line.endswith(b"\n") and int(json.loads(line)["step"]) < step
    except (ValueError, TypeError, KeyError):
        return False


def drop_steps_from(path: Path, step: int) -> int:
    """Rewrite the JSONL file ``path`` without its rows of ``step`` and later (a resumed
    fit writes them again) and without a line cut short (a run killed mid-write); returns
    how many lines went. A missing file, or one with nothing to drop, is left alone (it was
    copied whole, and a disk without room for the copy failed the resume); a failed rewrite
    leaves no temporary, and a killed one's is removed here."""
    remove_stale_temporaries([str(path.parent)], resuming=False,
                             names=f".{glob.escape(path.name)}.*")  # a rewrite killed
    if not path.is_file():
        return 0
    # line by line, in bytes: a text may hold U+2028 or U+0085, which str.splitlines splits
    with open(path, "rb") as src:
        dropped = sum(not _kept(line, step) for line in src)
    if not dropped:
        return 0
    tmp = path.with_name(temporary_name(path.name))
    try:
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            dst.writelines(line for line in src if _kept(line, step))
        tmp.replace(path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if (full := no_room(err, str(path), "it is left as it was")) is not None:
            raise full from err
        raise
    return dropped


class CompletionSamples(Callback):
    """Write sampled completions through every logger during ``fit`` (see the module docstring).

    YAML::

        - class_path: maxent_grpo.training.callbacks.CompletionSamples
          init_args: {every_n_steps: 50, jsonl_path: "{log_dir}/rollouts.jsonl"}

    Args:
        every_n_steps: write tables and histograms for rollouts at multiples of this step.
        max_prompts: prompts in the tables (>= 1), each with all its G completions.
        jsonl_path: when set, append every step's rollout here, one JSON object per
            completion (:func:`rollout_rows`); ``{log_dir}`` is the logger's version folder.
        histograms: also write (TensorBoard) histograms of rewards, weights and advantages.
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
        self._last_record: RolloutSamples | None = None
        self._told_no_logger = False

    def _log_dir(self, trainer: pl.Trainer) -> str:
        """The run's folder (:func:`~maxent_grpo.training.run.folders.run_dir`), read once."""
        if self._run_dir is None:
            self._run_dir = run_dir(trainer)
        return self._run_dir

    def _resolve_jsonl(self, trainer: pl.Trainer) -> Path:
        if self._jsonl_file is None:
            assert self.jsonl_path is not None
            self._jsonl_file = Path(self.jsonl_path.replace(  # ~: a folder named ~ was made
                "{log_dir}", self._log_dir(trainer))).expanduser()
            require(not self._jsonl_file.is_dir(), f"CompletionSamples.jsonl_path "
                    f"{str(self._jsonl_file)!r} is a folder; name a file to append to")
            try:
                self._jsonl_file.parent.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ValueError(f"CompletionSamples.jsonl_path {str(self._jsonl_file)!r}: its "
                                 f"folder cannot be made ({err.strerror or err}); name a file "
                                 "in a folder you can write to") from err
        return self._jsonl_file

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Find the CLI's ``config.yaml`` (if any) and the ``jsonl_path``.

        Every rank reads the run's folder here (a broadcast from rank 0 under DDP, which
        would hang if only rank 0 read it)."""
        self._config = Path(self._log_dir(trainer)) / "config.yaml"
        if self.jsonl_path is not None:
            self._resolve_jsonl(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log the CLI's ``config.yaml`` as TensorBoard text at the logging step the fit
        starts from (a resumed fit's beside the first's: at 0 it replaced it). A resumed
        fit: the JSONL rows of its checkpoint's step and later go (they come again) from the
        loggers' ``samples/completions.jsonl`` and from a ``jsonl_path`` in the run's folder
        (``{log_dir}``); a ``jsonl_path`` elsewhere may be another run's too, and keeps its
        rows."""
        config = getattr(self, "_config", None)
        if trainer.is_global_zero and config is not None and config.is_file():
            text = "\n".join("    " + line for line in config.read_text("utf-8").splitlines())
            at = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None),
                         "_batches_that_stepped", trainer.global_step)  # the scalars' step
            for logger in getattr(trainer, "loggers", None) or []:
                writer = getattr(logger, "experiment", None)
                if isinstance(writer, SummaryWriter):
                    writer.add_text("hparams/config", text, at)
                    writer.flush()
        if not trainer.is_global_zero or not trainer.global_step:
            return
        files = self._logger_files(trainer)
        if self._jsonl_file is not None and "{log_dir}" in str(self.jsonl_path):
            files.append(self._jsonl_file)
        for path in dict.fromkeys(files):
            if dropped := drop_steps_from(path, trainer.global_step):
                rank_zero_info(f"CompletionSamples: {dropped} row(s) of step "
                               f"{trainer.global_step} and later left {path} (they come again)")

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
        # the rollout's optimizer steps: its own, up to the one the trainer is at now
        end = max(int(trainer.global_step), step + 1)
        if self.jsonl_path is not None and not getattr(trainer, "fast_dev_run", False):
            append_jsonl(self._resolve_jsonl(trainer), rollout_rows(record))
        if (end - 1) // self.every_n_steps > (step - 1) // self.every_n_steps:
            self.write_loggers(trainer, record, step)

    def write_loggers(self, trainer: pl.Trainer, record: RolloutSamples, step: int) -> None:
        """The table (and histograms) of ``record`` through every logger; the others get
        JSONL rows in their log folder, once per folder, unless it is ``jsonl_path``; without
        a logger nothing is written here (``jsonl_path`` is written by the caller)."""
        # a fast_dev_run's DummyLogger is no logger: a smoke run leaves no samples file behind
        loggers = [lg for lg in getattr(trainer, "loggers", None) or []
                   if not isinstance(lg, DummyLogger)]
        for logger in loggers:
            if isinstance(logger, WandbLogger):
                self.write_wandb(logger, record, step)
            elif isinstance(logger, MLFlowLogger):
                self.write_mlflow(logger, record, step)
            elif isinstance(getattr(logger, "experiment", None), SummaryWriter):
                self.write_tensorboard(logger.experiment, record, step)
        files = dict.fromkeys(self._logger_files(trainer))  # ordered, each file once
        if not loggers and not self._told_no_logger and self.jsonl_path is None:
            # nothing is written where nothing was asked for (no logger: not the cwd)
            self._told_no_logger = True
            rank_zero_info("CompletionSamples: the run has no logger, so no samples table is "
                           "written; set CompletionSamples.jsonl_path to keep the rollouts")
        dump = None if self._jsonl_file is None else self._jsonl_file.resolve()
        for path in files:
            if path.resolve() == dump:
                continue
            if not path.exists():
                rank_zero_info(f"CompletionSamples: the samples table goes to {path}")
                path.parent.mkdir(parents=True, exist_ok=True)
            append_jsonl(path, rollout_rows(record, self.max_prompts))

    def _logger_files(self, trainer: pl.Trainer) -> list[Path]:
        """``<log_dir>/samples/completions.jsonl`` of each logger without a table."""
        files = []
        for logger in getattr(trainer, "loggers", None) or []:
            if isinstance(logger, (WandbLogger, MLFlowLogger, DummyLogger)) or isinstance(
                    getattr(logger, "experiment", None), SummaryWriter):
                continue
            folder = logger_folder(logger, trainer.default_root_dir)
            files.append(Path(folder) / "samples" / "completions.jsonl")
        return files

    def write_tensorboard(self, writer: Any, record: RolloutSamples, step: int) -> None:
        """The table (``samples/completions``) and, with ``histograms``, the histograms."""
        writer.add_text("samples/completions", samples_table(record, self.max_prompts), step)
        if self.histograms:
            for tag, values in {"reward": record.rewards, **_grouped(record)}.items():
                if values is None:
                    continue
                values = values.detach().float().flatten()
                values = values[torch.isfinite(values)]
                if values.numel():
                    writer.add_histogram(f"samples/{tag}", values, step)
        writer.flush()

    def write_wandb(self, logger: WandbLogger, record: RolloutSamples, step: int) -> None:
        """The table as a ``wandb.Table`` under ``samples/completions``."""
        columns, data = flat_table(record, self.max_prompts)
        logger.log_table("samples/completions", columns=columns, data=data, step=step)

    def write_mlflow(self, logger: MLFlowLogger, record: RolloutSamples, step: int) -> None:
        """The table as the run's JSON artifact ``samples/step_<step>.json``."""
        columns, data = flat_table(record, self.max_prompts)
        logger.experiment.log_dict(
            logger.run_id, {"columns": columns, "data": data}, f"samples/step_{step}.json"
        )
