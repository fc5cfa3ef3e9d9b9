"""Where the prompt rows come from: a built-in task, local files or a ``datasets`` dataset.

Exactly one source is used (:func:`check_source_options`); each loader returns
:class:`Sources`, the train and validation rows with their row numbers in the source:
:func:`task_sources` (:mod:`maxent_grpo.tasks`), :func:`file_sources` (local .jsonl, .json,
.csv, .parquet: :mod:`maxent_grpo.training.data.files`) and :func:`hub_sources`
(:func:`load_hub_rows`). Without a separate validation file or split, ``val_size`` rows are
split off the training source (:func:`split_off_val`). Errors say which flag to type.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only

from maxent_grpo.tasks import build_task, list_tasks
from maxent_grpo.tasks import task_options as task_option_names
from maxent_grpo.training.data.files import FileParts, dataset_rows, expand_files, read_files
from maxent_grpo.validation import check_choice, require

__all__ = [
    "Sources",
    "SplitRows",
    "check_source_options",
    "file_sources",
    "hub_sources",
    "load_hub_rows",
    "split_off_val",
    "task_sources",
    "val_file_rows",
]

log = logging.getLogger(__name__)

Row = dict[str, Any]


@dataclass(frozen=True)
class SplitRows:
    """The rows of one split.

    Attributes:
        rows: the rows, every column kept.
        indices: each row's number in its source (rows split off or dropped leave gaps).
        source: the source's name, as error messages show it (``"task 'countdown' (val)"``).
        files: for rows read from files, the file each row number comes from.
    """

    rows: list[Row]
    indices: list[int]
    source: str
    files: FileParts | None = None

    @classmethod
    def whole(cls, rows: list[Row], source: str, files: FileParts | None = None) -> SplitRows:
        """Every row of ``source``, numbered from 0."""
        return cls(rows, list(range(len(rows))), source, files)

    def where(self, index: int) -> tuple[str, int]:
        """For error messages: the file (else the source) row number ``index`` comes from,
        and the row's number there."""
        return (self.source, index) if self.files is None else self.files.where(index)


@dataclass(frozen=True)
class Sources:
    """The training and validation rows, and how many training rows were left out for
    repeating a validation prompt (``data.holdout_val_prompts``)."""

    train: SplitRows
    val: SplitRows
    heldout: int = 0


# each source-specific option and the source it belongs to
OPTION_OWNERS = {
    "task_options": "task",
    "dataset_config": "dataset_name",
    "val_split": "dataset_name",
    "train_split": "dataset_name",  # these two given when set away from their defaults
    "train_size": "task",  # (a file or dataset gives all its rows)
}


def check_source_options(
    task: str | None,
    task_options: dict[str, Any] | None,
    data_files: str | list[str] | None,
    val_files: str | list[str] | None,
    dataset_name: str | None,
    dataset_config: str | None,
    val_split: str | None,
    train_split: str | None = None,
    train_size: int | None = None,
) -> dict[str, Any]:
    """Refuse a choice of source the loaders cannot honour, naming the flag that fixes it;
    return ``{name: value}`` of the options whose source (:data:`OPTION_OWNERS`) is not set,
    which the caller drops (one warning names them; an empty ``task_options`` is unset;
    ``train_split`` and ``train_size`` are given only when set away from their defaults).

    Raises ValueError unless exactly one of ``task``, ``data_files``, ``dataset_name`` is set,
    ``task`` is a built-in task taking ``task_options`` and files have a known suffix;
    FileNotFoundError for a missing file (:func:`~maxent_grpo.training.data.files.expand_files`).
    """
    chosen = {"task": task, "data_files": data_files, "dataset_name": dataset_name}
    set_now = [k for k, v in chosen.items() if v is not None]
    if len(set_now) != 1:
        got = ", ".join(f"data.{k}={chosen[k]!r}" for k in set_now) or "none"
        if set_now:
            keep = " or ".join(
                f"add {' '.join(f'--data.{o} null' for o in set_now if o != k)} to use data.{k}"
                for k in set_now
            )
        else:
            keep = "set one, e.g. --data.task arithmetic or --data.data_files train.jsonl"
        raise ValueError(
            "exactly one of data.task, data.data_files, data.dataset_name must be set; got "
            f"{got}: {keep} (data.task defaults to 'arithmetic': set `task: null` to use "
            "data_files or dataset_name)"
        )
    if task is not None:
        check_choice("data.task", task, list_tasks())
    require(task_options is None or isinstance(task_options, dict),
            f"data.task_options must be a mapping of option names to values; got {task_options!r}")
    if task is not None and task_options:
        allowed = task_option_names(task)
        unknown = [k for k in task_options if k not in allowed]
        if allowed:
            name, default = next(iter(allowed.items()))
            own = (f"or pass only options of task {task!r} ({', '.join(map(repr, allowed))}), e.g. "
                   f"--data.task_options '{{{name}: {default!r}}}'")
        else:
            own = f"task {task!r} takes no options"
        require(
            not unknown,
            f"data.task_options {task_options!r} has {', '.join(map(repr, unknown))}, which "
            f"task {task!r} does not take: drop them with --data.task_options null, {own}",
        )
    values = {"task_options": task_options or None, "dataset_config": dataset_config,
              "val_split": val_split, "train_split": train_split, "train_size": train_size}
    dropped = {name: value for name, value in values.items()
               if value is not None and chosen[OPTION_OWNERS[name]] is None}
    if dropped:
        owners = sorted({f"data.{OPTION_OWNERS[name]}" for name in dropped})
        log.warning(
            "dropped %s: %s only to %s, which %s null (the source is data.%s=%r)",
            ", ".join(f"data.{name}={value!r}" for name, value in dropped.items()),
            "it applies" if len(dropped) == 1 else "they apply",
            " and ".join(owners), "is" if len(owners) == 1 else "are",
            set_now[0], chosen[set_now[0]],
        )
    require(val_files is None or val_split is None or "val_split" in dropped,
            f"data.val_files {val_files!r} and data.val_split {val_split!r} both name the "
            "validation rows: set one of them to null")
    for name, files in (("data_files", data_files), ("val_files", val_files)):
        if files is not None:
            expand_files(f"data.{name}", files)
    return dropped


def load_hub_rows(name: str, config: str | None, split: str, cache_dir: str | None) -> list[Row]:
    """Every row of split ``split`` of ``datasets.load_dataset(name, config)`` (hub id or path)."""
    import datasets  # only for a hub dataset: a built-in task never loads it

    require(not os.path.isfile(name) or name.endswith(".py"), f"data.dataset_name {name!r} is "
            "a file: give it as --data.data_files (and --data.dataset_name null)")
    if os.path.isfile(os.path.join(name, "state.json")):  # one Dataset.save_to_disk: no splits
        require(split == "train", f"data.dataset_name {name!r} is one saved Dataset "
                f"(save_to_disk), with no split {split!r}: it is the training split "
                "(data.train_split: train); data.val_size splits validation rows off it")
        return dataset_rows(datasets.load_from_disk(name))
    if os.path.isfile(os.path.join(name, "dataset_dict.json")):  # its own split names, not
        splits = datasets.load_from_disk(name)  # the guesses load_dataset makes from files
        try:  # a split, a slice of one, a sum ("train_sft[:100]+test_sft")
            parts = datasets.ReadInstruction.from_spec(split).to_absolute(
                {key: len(value) for key, value in splits.items()})
        except (ValueError, KeyError, AssertionError) as err:
            raise ValueError(f"data.dataset_name {name!r} (a saved DatasetDict): split "
                             f"{split!r}: {err}; its splits: {', '.join(splits)}") from None
        return [row for part in parts for row in dataset_rows(
            splits[part.splitname].select(range(part.from_, part.to)))]
    try:
        data = datasets.load_dataset(name, config, split=split, cache_dir=cache_dir)
    except ConnectionError as err:  # offline (HF_HUB_OFFLINE) or no network: not cached
        raise ConnectionError(
            f"data.dataset_name {name!r}: {err}: the Hugging Face Hub cannot be reached and "
            "the dataset is not in the local cache; download it once while online (with the "
            "same data.dataset_name, or datasets' save_to_disk to a folder), or give files as "
            "--data.data_files") from err
    except RuntimeError as err:  # datasets 4 refuses a loading script ("a bug" here)
        if "scripts are no longer supported" not in str(err):
            raise
        raise ValueError(f"data.dataset_name {name!r}: {err}; give its files as "
                         "--data.data_files, or a Dataset.save_to_disk folder") from err
    return dataset_rows(data)


def task_sources(
    task: str,
    options: dict[str, Any],
    train_size: int,
    val_size: int,
    seed: int,
    prompt_column: str,
    holdout_val_prompts: bool,
    val_files: SplitRows | None = None,
) -> Sources:
    """``train_size`` rows of ``task`` from seed ``2*seed``, ``val_size`` (maybe 0) from
    ``2*seed + 1`` (or the rows of ``val_files``: :func:`val_file_rows`); with
    ``holdout_val_prompts`` the training rows whose ``prompt_column`` value is also a
    validation row's are dropped (logged), and so are those with a validation row's
    ``numbers`` (in any order) and ``target`` (a countdown problem shown in another order):
    :func:`hold_out`."""
    train = build_task(task, train_size, 2 * seed, **options)
    val = (val_files.rows if val_files is not None
           else build_task(task, val_size, 2 * seed + 1, **options) if val_size else [])
    source = f"task {task!r}"
    kept = SplitRows.whole(train, f"{source} (train)")
    if holdout_val_prompts:
        kept = hold_out(kept, val, prompt_column, countdown=True)
    if len(kept.rows) < len(train):
        log.info("dropped %d training rows that repeat a validation prompt (or problem)",
                 len(train) - len(kept.rows))
    return Sources(kept, val_files or SplitRows.whole(val, f"{source} (val)"),
                   len(train) - len(kept.rows))


def _problem(row: dict[str, Any], prompt_column: str, countdown: bool) -> set[str]:
    """A row's prompt, and with ``countdown`` a countdown problem whatever the order its
    numbers are shown in (read from text too: a CSV cell of ``val_files``)."""
    prompt = row.get(prompt_column)  # a row without it has no prompt to compare
    keys = set() if prompt is None else {json.dumps(prompt, sort_keys=True, default=str)}
    numbers, target = (_cell(row.get(key)) for key in ("numbers", "target"))
    if countdown and isinstance(numbers, list) and all(_whole(n) for n in [*numbers, target]):
        keys.add(json.dumps([sorted(int(n) for n in numbers), int(target)]))
    return keys


def hold_out(train: SplitRows, val_rows: list[Row], prompt_column: str,
             countdown: bool = False) -> SplitRows:
    """``train`` less the rows whose ``prompt_column`` value (with ``countdown``, a task's,
    or countdown problem) is also one of ``val_rows``'."""
    held = set().union(*(_problem(row, prompt_column, countdown) for row in val_rows))
    keep = [i for i, row in enumerate(train.rows)
            if not _problem(row, prompt_column, countdown) & held]
    if len(keep) == len(train.rows):
        return train
    return replace(train, rows=[train.rows[i] for i in keep],
                   indices=[train.indices[i] for i in keep])

def _cell(value: Any) -> Any:
    """``value``, or the JSON a text holds (a CSV cell)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _whole(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and float(
        value).is_integer()


def val_file_rows(val_files: str | list[str], cache_dir: str | None,
                  train_files: Any = None) -> SplitRows:
    """The validation rows of ``data.val_files`` (with any training source), warned about
    when some of them are ``train_files``' (the training files' parts)."""
    rows, parts = read_files("data.val_files", val_files, cache_dir)
    if train_files is None:
        log.info("data.val_files %r: %d validation rows, in place of the source's own",
                 val_files, len(rows))
    shared = set(train_files.paths) & set(parts.paths) if train_files is not None else set()
    if shared:  # allowed (a check of what was learnt), but mostly a pattern that went wide
        log.warning("data.val_files file %r is in data.data_files too: the validation scores "
                    "are on rows the run trains on", sorted(shared)[0])
    return SplitRows.whole(rows, f"data.val_files {val_files!r}", parts)


def file_sources(
    data_files: str | list[str],
    val_files: str | list[str] | None,
    val_size: int,
    seed: int,
    cache_dir: str | None,
    batch_size: int | None = None,
    holdout_column: str | None = None,
) -> Sources:
    """The rows of ``data_files``; validation rows from ``val_files``, else ``val_size``
    rows split off (:func:`split_off_val`, which gets ``batch_size`` and ``holdout_column``)."""
    rows, files = read_files("data.data_files", data_files, cache_dir)
    train = SplitRows.whole(rows, f"data.data_files {data_files!r}", files)
    if val_files is None:
        return split_off_val(train, val_size, seed, batch_size, "data.val_files", holdout_column)
    return Sources(train, val_file_rows(val_files, cache_dir, files))


def hub_sources(
    name: str,
    config: str | None,
    train_split: str,
    val_split: str | None,
    cache_dir: str | None,
    val_size: int,
    seed: int,
    batch_size: int | None = None,
    val_files: SplitRows | None = None,
    holdout_column: str | None = None,
) -> Sources:
    """Split ``train_split`` of dataset ``name``; validation rows from ``val_split`` (or
    ``val_files``: :func:`val_file_rows`), else ``val_size`` rows split off (see
    :func:`split_off_val`, which gets ``batch_size`` and ``holdout_column``)."""
    train = SplitRows.whole(
        load_hub_rows(name, config, train_split, cache_dir),
        f"dataset_name {name!r} split {train_split!r}",
    )
    if val_files is not None:
        return Sources(train, val_files)
    if val_split is None:
        return split_off_val(train, val_size, seed, batch_size, "data.val_split", holdout_column)
    val = load_hub_rows(name, config, val_split, cache_dir)
    return Sources(train, SplitRows.whole(val, f"dataset_name {name!r} split {val_split!r}"))


def split_off_val(
    whole: SplitRows,
    val_size: int,
    seed: int,
    batch_size: int | None = None,
    val_option: str | None = None,
    holdout_column: str | None = None,
) -> Sources:
    """``val_size`` rows of ``whole`` chosen by ``torch.randperm(len(rows), generator=seed)``
    become the validation rows, the rest the training rows, both in source order; with
    ``holdout_column`` (``data.holdout_val_prompts``) less those repeating a validation
    row's prompt (:func:`hold_out`; a warning says how many).

    Raises ValueError naming the ``--data.`` flags to type (and ``val_option``, the option
    giving separate validation rows) unless at least ``batch_size`` (or 1) training rows remain.
    """
    rows = whole.rows
    total, need = len(rows), batch_size or 1
    require(total - val_size >= need,
            _too_few_rows(whole.source, total, val_size, batch_size, val_option))
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    val_idx = sorted(perm[:val_size].tolist())
    train_idx = sorted(perm[val_size:].tolist())
    val = replace(whole, rows=[rows[i] for i in val_idx], indices=val_idx)
    train = replace(whole, rows=[rows[i] for i in train_idx], indices=train_idx)
    kept = train if holdout_column is None else hold_out(train, val.rows, holdout_column)
    heldout = len(train.rows) - len(kept.rows)
    if heldout and rank_zero_only.rank == 0:  # (every process splits the same rows)
        log.warning("%s: %d of the %d training rows repeat the prompt of one of the %d rows "
                    "split off for validation and are left out of training (set "
                    "data.holdout_val_prompts: false to train on them)", whole.source, heldout,
                    len(train.rows), val_size)
    return Sources(kept, val, heldout)


def _too_few_rows(
    source: str, total: int, val_size: int, batch_size: int | None, val_option: str | None
) -> str:
    """Why ``total`` rows cannot hold ``val_size`` and a batch, and the flags that fix it."""
    other = f", or give {val_option} for the validation rows" if val_option else ""
    if total == 0:
        return f"{source} holds no rows"
    left = max(total - val_size, 0)
    leaves = f"leaves only {left} training rows" if left else "leaves no training rows"
    if batch_size is None:
        return (f"data.val_size ({val_size}) {leaves} from the {total} rows of {source}; "
                f"set --data.val_size {total - 1} or less{other}")
    if total - batch_size >= 1:
        return (
            f"data.val_size ({val_size}) {leaves} from the {total} rows of {source}, fewer "
            f"than one batch (data.batch_size {batch_size}); set --data.val_size "
            f"{total - batch_size} or less{other}"
        )
    # val_size and batch_size must both come down: keep about a quarter for validation
    val = min(val_size, max(1, total // 4)) if total >= 2 else 0
    return (
        f"the {total} rows of {source} cannot hold data.val_size ({val_size}) validation rows "
        f"and a batch of data.batch_size ({batch_size}) training rows; set "
        f"--data.val_size {val} --data.batch_size {total - val} (any val_size + batch_size "
        f"up to {total}, batch_size at least 1){other}"
    )


def too_few_train_prompts(
    counts: dict[str, int], *, task: str | None, train_size: int, val_size: int,
    batch_size: int, max_prompt_length: int | None, world: int = 1, val_files: bool = False,
) -> str:
    """Why the training prompts are fewer than ``batch_size`` (each of ``world`` processes
    draws ``batch_size`` of its share), and the flags that fix it, from ``counts`` of where
    the rows went: ``kept``, ``long`` (over ``max_prompt_length``), ``heldout`` (rows
    repeating a validation prompt), ``split_off`` (file rows split off for validation, of
    which ``val_kept`` fit ``max_prompt_length``)."""
    kept = counts["kept"]
    why, fixes = [], []
    if kept // world:
        fixes.append(f"set --data.batch_size {kept // world} or less")
    if task is not None:
        why.append(f"{train_size} generated (data.train_size)")
        if counts["heldout"]:
            why.append(f"{counts['heldout']} of them repeat a validation prompt "
                       "(data.holdout_val_prompts)")
            fixes += ["set --data.holdout_val_prompts false",
                      "give other data.val_files" if val_files
                      else f"lower --data.val_size (now {val_size})"]
        if not counts["heldout"] and not counts["long"]:
            fixes.append(f"set --data.train_size {batch_size * world} or more")
        elif kept:
            fixes.append(f"raise --data.train_size (now {train_size})")
    elif counts["split_off"]:
        why.append(f"{counts['split_off']} rows split off for validation (data.val_size)")
        if counts["heldout"]:
            why.append(f"{counts['heldout']} repeat the prompt of one of them "
                       "(data.holdout_val_prompts)")
            fixes.append("set --data.holdout_val_prompts false")
        back = min(counts["split_off"], counts.get("val_kept", counts["split_off"]))
        if kept + back + counts["heldout"] >= batch_size * world:  # (not the long ones)
            fixes.append(f"lower --data.val_size (now {val_size})")
    if counts["long"]:
        why.append(f"{counts['long']} dropped as longer than data.max_prompt_length "
                   f"({max_prompt_length} tokens)")
        fixes.append(f"raise --data.max_prompt_length (now {max_prompt_length})")
    if task is None:
        fixes.append("add rows")
    if world > 1:
        fixes.append(f"use fewer processes (each of the {world} draws its batches from "
                     f"{kept // world} of them)")
    share = f"{batch_size} x {world} processes" if world > 1 else f"{batch_size}"
    return (
        f"data.batch_size ({share}) exceeds the number of training prompts "
        f"({kept}{': ' + '; '.join(why) if why else ''}); {', or '.join(fixes)}"
    )

