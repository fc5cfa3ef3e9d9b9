"""Where the prompt rows come from: a built-in task, local files or a ``datasets`` dataset.

Exactly one source is used (:func:`check_source_options` refuses any other choice); each
loader returns :class:`Sources`, the train and validation rows with the row numbers they
have in their source and the source's name for error messages:

- :func:`task_sources`: ``train_size`` rows of a built-in task (:mod:`maxent_grpo.tasks`)
  from seed ``2*seed`` and ``val_size`` separate rows from ``2*seed + 1``; training rows
  whose prompt is also a validation prompt are dropped unless ``holdout_val_prompts`` is
  False.
- :func:`file_sources`: local .jsonl, .json, .csv or .parquet files (:func:`read_rows`).
- :func:`hub_sources`: splits of a ``datasets.load_dataset`` dataset (:func:`load_hub_rows`).

Without a separate validation file or split, ``val_size`` rows chosen by a permutation
seeded with ``seed`` are split off the training source.
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq  # installed with datasets
import torch

from maxent_grpo.tasks import build_task, list_tasks
from maxent_grpo.validation import check_choice, require

__all__ = [
    "FILE_SUFFIXES",
    "Sources",
    "SplitRows",
    "check_source_options",
    "file_sources",
    "hub_sources",
    "load_hub_rows",
    "read_rows",
    "split_off_val",
    "task_sources",
]

log = logging.getLogger(__name__)

FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")

Row = dict[str, Any]


@dataclass(frozen=True)
class SplitRows:
    """The rows of one split.

    Attributes:
        rows: the rows, every column kept.
        indices: each row's number in its source (rows split off or dropped leave gaps).
        source: the source's name, as error messages show it (``"task 'countdown' (val)"``).
    """

    rows: list[Row]
    indices: list[int]
    source: str

    @classmethod
    def whole(cls, rows: list[Row], source: str) -> SplitRows:
        """Every row of ``source``, numbered from 0."""
        return cls(rows, list(range(len(rows))), source)


@dataclass(frozen=True)
class Sources:
    """The training and validation rows."""

    train: SplitRows
    val: SplitRows


def check_source_options(
    task: str | None,
    task_options: dict[str, Any] | None,
    data_files: str | None,
    val_files: str | None,
    dataset_name: str | None,
    dataset_config: str | None,
    val_split: str | None,
) -> None:
    """Refuse a choice of source the loaders cannot honour, naming the ``data.`` option.

    Exactly one of ``task``, ``data_files``, ``dataset_name`` must be set; ``task`` must be
    a built-in task; ``task_options``, ``val_files`` and ``dataset_config`` / ``val_split``
    need their own source; files must have a known suffix (ValueError) and exist
    (FileNotFoundError).
    """
    chosen = {"task": task, "data_files": data_files, "dataset_name": dataset_name}
    set_now = [f"{k}={v!r}" for k, v in chosen.items() if v is not None]
    require(
        len(set_now) == 1,
        "exactly one of data.task, data.data_files, data.dataset_name must be set; got "
        f"{', '.join(set_now) or 'none'} (data.task defaults to 'arithmetic': set "
        "`task: null` to use data_files or dataset_name)",
    )
    if task is not None:
        check_choice("data.task", task, list_tasks())
    require(task_options is None or isinstance(task_options, dict),
            f"data.task_options must be a mapping of option names to values; got {task_options!r}")
    for name, value, owner, needs in (
        ("task_options", task_options, "task", task),
        ("val_files", val_files, "data_files", data_files),
        ("dataset_config", dataset_config, "dataset_name", dataset_name),
        ("val_split", val_split, "dataset_name", dataset_name),
    ):
        require(value is None or needs is not None,
                f"data.{name} needs data.{owner} to be set")
    for name, path in (("data_files", data_files), ("val_files", val_files)):
        if path is not None:
            require(
                Path(path).suffix.lower() in FILE_SUFFIXES,
                f"data.{name} must end in one of {', '.join(FILE_SUFFIXES)}; got {path!r}",
            )
            if not Path(path).is_file():
                raise FileNotFoundError(f"data.{name} file not found: {path!r}")


def read_rows(path: str | Path, option: str = "data_files") -> list[Row]:
    """Read every row (all columns) of a local .jsonl, .json, .csv or .parquet file.

    ``.json`` holds a list of row objects or an object of equal-length column lists; CSV
    values stay strings. ``option`` names the argument in error messages.
    """
    path = Path(path)
    where = f"{option} {str(path)!r}"
    if not path.is_file():
        raise FileNotFoundError(f"{option} file not found: {str(path)!r}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{where} line {line_no} is not valid JSON: {err}") from err
    elif suffix == ".json":
        with path.open(encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{where} is not valid JSON ({err}); one object per line needs the .jsonl "
                    "suffix"
                ) from err
        if isinstance(data, dict) and all(isinstance(v, list) for v in data.values()):
            require(len({len(v) for v in data.values()}) <= 1,
                    f"{where}: column lists differ in length")
            names = list(data)
            rows = [
                dict(zip(names, values, strict=True)) for values in zip(*data.values(), strict=True)
            ]
        elif isinstance(data, list):
            rows = data
        else:
            raise ValueError(
                f"{where} must hold a list of row objects or an object of column lists"
            )
    elif suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
    elif suffix == ".parquet":
        rows = pq.read_table(path).to_pylist()
    else:
        raise ValueError(
            f"{option} must end in one of {', '.join(FILE_SUFFIXES)}; got {str(path)!r}"
        )
    for i, row in enumerate(rows):
        require(isinstance(row, dict), f"{where} row {i} is not an object: {row!r}")
    return rows


def load_hub_rows(
    name: str, config: str | None, split: str, cache_dir: str | None
) -> list[Row]:
    """Every row of split ``split`` of ``datasets.load_dataset(name, config)`` (a hub id or
    a local path; downloaded into ``cache_dir`` on first use)."""
    data = datasets.load_dataset(name, config, split=split, cache_dir=cache_dir)
    return data.to_list()


def task_sources(
    task: str,
    options: dict[str, Any],
    train_size: int,
    val_size: int,
    seed: int,
    prompt_column: str,
    holdout_val_prompts: bool,
) -> Sources:
    """``train_size`` rows of ``task`` from seed ``2*seed``, ``val_size`` from
    ``2*seed + 1``; with ``holdout_val_prompts`` the training rows whose ``prompt_column``
    value is also a validation row's are dropped (logged)."""
    train = build_task(task, train_size, 2 * seed, **options)
    val = build_task(task, val_size, 2 * seed + 1, **options)
    val_prompts = {json.dumps(r.get(prompt_column), sort_keys=True) for r in val}
    keep = [
        i
        for i, r in enumerate(train)
        if not holdout_val_prompts
        or json.dumps(r.get(prompt_column), sort_keys=True) not in val_prompts
    ]
    if len(keep) < len(train):
        log.info("dropped %d training rows that repeat a validation prompt", len(train) - len(keep))
    source = f"task {task!r}"
    return Sources(
        SplitRows([train[i] for i in keep], keep, f"{source} (train)"),
        SplitRows.whole(val, f"{source} (val)"),
    )


def file_sources(data_files: str, val_files: str | None, val_size: int, seed: int) -> Sources:
    """The rows of ``data_files``; validation rows from ``val_files``, else ``val_size``
    rows split off (see :func:`split_off_val`)."""
    rows, name = read_rows(data_files, "data.data_files"), f"data_files {data_files!r}"
    if val_files is None:
        return split_off_val(rows, name, val_size, seed)
    val = read_rows(val_files, "data.val_files")
    return Sources(SplitRows.whole(rows, name), SplitRows.whole(val, f"val_files {val_files!r}"))


def hub_sources(
    name: str,
    config: str | None,
    train_split: str,
    val_split: str | None,
    cache_dir: str | None,
    val_size: int,
    seed: int,
) -> Sources:
    """Split ``train_split`` of dataset ``name``; validation rows from ``val_split``, else
    ``val_size`` rows split off (see :func:`split_off_val`)."""
    rows = load_hub_rows(name, config, train_split, cache_dir)
    source = f"dataset_name {name!r} split {train_split!r}"
    if val_split is None:
        return split_off_val(rows, source, val_size, seed)
    val = load_hub_rows(name, config, val_split, cache_dir)
    return Sources(
        SplitRows.whole(rows, source),
        SplitRows.whole(val, f"dataset_name {name!r} split {val_split!r}"),
    )


def split_off_val(rows: list[Row], source: str, val_size: int, seed: int) -> Sources:
    """``val_size`` rows chosen by ``torch.randperm(len(rows), generator=seed)`` become the
    validation rows, the rest the training rows, both in source order."""
    require(
        val_size < len(rows),
        f"data.val_size ({val_size}) must be smaller than the number of rows in {source} "
        f"({len(rows)})",
    )
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    val_idx = sorted(perm[:val_size].tolist())
    train_idx = sorted(perm[val_size:].tolist())
    return Sources(
        SplitRows([rows[i] for i in train_idx], train_idx, source),
        SplitRows([rows[i] for i in val_idx], val_idx, source),
    )
