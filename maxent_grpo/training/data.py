"""Prompts for GRPO training: the :class:`PromptDataModule`.

One batch is B prompts (``batch_size`` per rank and optimizer step); the module samples G
completions for each. A batch is a plain dict of lists (no tensors)::

    {
        "prompts":     list[str],        # (B,) rendered text fed to generation
        "raw_prompts": list[str | list[dict]],  # (B,) the source prompt values, for rewards
        "answers":     list[str],        # (B,) reference answers ("" when answer_column=None)
        "columns":     dict[str, list],  # every non-prompt column, each a (B,) list,
                                         #   always including "answer" (== answers)
        "indices":     list[int],        # (B,) row number in the source the row came from
    }

Sources, exactly one of: a built-in ``task`` (:mod:`maxent_grpo.tasks`), local
``data_files`` (.jsonl, .json, .csv, .parquet) or a ``datasets`` ``dataset_name``.

Order: epoch ``e`` visits the training rows in ``torch.randperm(N, generator=seed + e)``
order, so a run is reproducible from ``seed`` alone. Under DDP each of the W ranks takes
positions r, r + W, ... of that global order (:class:`EpochShuffleSampler` is a
``DistributedSampler``, so Lightning uses it as is and forwards ``set_epoch``).

Resume: the module's :meth:`PromptDataModule.state_dict` travels in Lightning's checkpoint;
``fit --ckpt_path`` continues mid-epoch with exactly the prompts the interrupted run had
not reached yet, in the same order.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = [
    "EpochShuffleSampler",
    "PromptDataModule",
    "PromptDataset",
    "PromptExample",
    "PromptLoader",
    "collate_prompts",
    "read_rows",
]

log = logging.getLogger(__name__)

SOURCE_OPTIONS = ("task", "data_files", "dataset_name")
FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")

Prompt = str | list[dict[str, str]]


@dataclass(frozen=True)
class PromptExample:
    """One prompt row, ready for generation.

    Attributes:
        index: row number in the source the row came from (before length filtering).
        prompt: the rendered text fed to generation.
        raw_prompt: the source prompt value (a string or a list of chat messages).
        answer: the reference answer as a string ("" without an answer column).
        columns: every column except the prompt column; ``columns["answer"] == answer``.
    """

    index: int
    prompt: str
    raw_prompt: Prompt
    answer: str
    columns: dict[str, Any]


class PromptDataset(Dataset):
    """A list of :class:`PromptExample`, indexed by position."""

    def __init__(self, examples: Sequence[PromptExample]) -> None:
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, position: int) -> PromptExample:
        return self.examples[position]


def collate_prompts(examples: Sequence[PromptExample]) -> dict[str, Any]:
    """Stack B examples into the batch dict described in the module docstring.

    Lists stay lists (torch's default collate would transpose or tensorize them).
    """
    names = list(examples[0].columns) if examples else []
    return {
        "prompts": [ex.prompt for ex in examples],
        "raw_prompts": [ex.raw_prompt for ex in examples],
        "answers": [ex.answer for ex in examples],
        "columns": {name: [ex.columns[name] for ex in examples] for name in names},
        "indices": [ex.index for ex in examples],
    }


class EpochShuffleSampler(DistributedSampler):
    """This rank's share of epoch ``e``'s order, optionally resuming mid-epoch.

    Order of epoch ``e``: ``order = torch.randperm(N, generator=seed + e)`` (``0..N-1`` with
    ``shuffle=False``), cut to ``W * floor(N / W)`` positions so every rank gets the same
    count; rank ``r`` of ``W`` takes ``order[r::W]``. This is exactly
    ``torch.utils.data.DistributedSampler(shuffle=shuffle, drop_last=True)``; being one,
    Lightning uses it as is under DDP instead of wrapping it, and calls :meth:`set_epoch`
    before every training epoch.

    Resume: :meth:`resume_at` makes epoch ``epoch`` skip its first ``consumed`` positions
    (all ranks together; a multiple of ``W``), which is where the interrupted run stopped:
    rank ``r`` then takes ``order[consumed:][r::W]``, the rest of what it would have taken.
    Other epochs are untouched. ``len()`` stays the full epoch's count, as Lightning expects
    (it counts the batches already done itself).
    """

    def __init__(
        self,
        num_rows: int,
        seed: int,
        shuffle: bool = True,
        epoch: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__(
            range(num_rows), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
            drop_last=True,
        )
        self.num_rows = num_rows
        self.epoch = epoch
        self.resume_epoch: int | None = None
        self.resume_consumed = 0

    def resume_at(self, epoch: int, consumed: int) -> None:
        """Skip the first ``consumed`` positions of epoch ``epoch`` (all ranks together)."""
        if consumed % self.num_replicas:
            raise ValueError(
                f"consumed ({consumed}) must be a multiple of the number of ranks "
                f"({self.num_replicas})"
            )
        self.resume_epoch, self.resume_consumed = epoch, consumed

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_rows, generator=generator).tolist()
        else:
            order = list(range(self.num_rows))
        order = order[: self.total_size]
        if self.epoch == self.resume_epoch:
            order = order[self.resume_consumed :]
        return iter(order[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class PromptLoader(DataLoader):
    """The training DataLoader, marked resumable for Lightning.

    The position in the order is saved and restored by :meth:`PromptDataModule.state_dict`
    / :meth:`PromptDataModule.load_state_dict` (the sampler then skips what was consumed).
    These two methods only declare the loader resumable, so that Lightning does not warn on
    a mid-epoch resume that the data order "can cause unreliable results"; they carry
    nothing.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore here: the DataModule restored the position."""


def read_rows(path: str | Path, option: str = "data_files") -> list[dict[str, Any]]:
    """Read every row (all columns) of a local .jsonl, .json, .csv or .parquet file.

    ``.json`` holds a list of row objects or an object of equal-length column lists; CSV
    values stay strings. ``option`` names the argument in error messages.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"`{option}` file not found: {str(path)!r}")
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
                    raise ValueError(
                        f"`{option}` {str(path)!r} line {line_no} is not valid JSON: {err}"
                    ) from err
    elif suffix == ".json":
        with path.open(encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"`{option}` {str(path)!r} is not valid JSON ({err}); "
                    "one object per line needs the .jsonl suffix"
                ) from err
        if isinstance(data, dict) and all(isinstance(v, list) for v in data.values()):
            lengths = {len(v) for v in data.values()}
            if len(lengths) > 1:
                raise ValueError(f"`{option}` {str(path)!r}: column lists differ in length")
            names = list(data)
            rows = [
                dict(zip(names, values, strict=True)) for values in zip(*data.values(), strict=True)
            ]
        elif isinstance(data, list):
            rows = data
        else:
            raise ValueError(
                f"`{option}` {str(path)!r} must hold a list of row objects or an object "
                "of column lists"
            )
    elif suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ImportError("reading .parquet `data_files` needs pyarrow") from err
        rows = pq.read_table(path).to_pylist()
    else:
        raise ValueError(
            f"`{option}` must end in one of {', '.join(FILE_SUFFIXES)}; got {str(path)!r}"
        )
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"`{option}` {str(path)!r} row {i} is not an object: {row!r}")
    return rows


class PromptDataModule(pl.LightningDataModule):
    """Prompt rows for GRPO: loads, renders, length-filters and batches them.

    Exactly one source must be set: ``task``, ``data_files`` or ``dataset_name``. ``task``
    defaults to ``"arithmetic"``, so a config that uses ``data_files`` or ``dataset_name``
    sets ``task: null``.

    Validation rows: ``task`` generates ``val_size`` separate rows (train from seed
    ``2*seed``, val from ``2*seed + 1``; training rows whose prompt also appears in the
    validation rows are dropped, so the two never overlap, unless
    ``holdout_val_prompts`` is False: a task with a small closed set of prompts, such as
    ``digit_pairs``, then trains on the prompts it is evaluated on). ``data_files`` /
    ``dataset_name`` use ``val_files`` / ``val_split`` when given, else ``val_size`` rows
    chosen by a permutation seeded with ``seed`` are split off the training source.

    Rendering: with ``apply_chat_template`` the prompt becomes
    ``[system?] + [{"role": "user", "content": prompt}]`` (a list-of-messages prompt is used
    as is, with the system message prepended unless its first message is a system one) and
    is rendered with ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``.
    Without it the text is the raw prompt, preceded by ``system_prompt + "\\n\\n"`` when set;
    list-of-messages prompts then raise ValueError.

    Length: rows whose rendered prompt is longer than ``max_prompt_length`` tokens (counted
    with ``add_special_tokens=False``; the chat template already writes them) are dropped in
    :meth:`setup`, the count is logged and kept in ``dropped``; dropping every row of a split
    raises ValueError.

    Resume: :meth:`state_dict` records ``epoch`` and the number of training prompts
    ``consumed`` in that epoch (over all ranks). The order depends only on seed and epoch, so
    after :meth:`load_state_dict` the sampler skips the consumed prompts of that epoch and the
    run continues exactly where it stopped, mid-epoch or at an epoch's end.

    Args:
        task: built-in task name (see ``maxent_grpo.tasks.list_tasks()``), or None.
        task_options: keyword options for the built-in task (e.g. ``{"digits": 3}``).
        train_size: number of training rows generated for ``task``.
        val_size: number of validation rows generated for ``task``, or split off
            ``data_files`` / ``dataset_name`` when no ``val_files`` / ``val_split`` is given.
        seed: seed of task generation, the train/val split and the shuffle order.
        holdout_val_prompts: with ``task``, drop the training rows whose prompt is also a
            validation prompt (validation measures unseen prompts); False keeps them
            (validation measures the prompts trained on).
        data_files: local .jsonl, .json, .csv or .parquet file of training rows, or None.
        val_files: local file of validation rows (only with ``data_files``).
        dataset_name: name or local path passed to ``datasets.load_dataset``, or None.
        dataset_config: configuration name passed to ``datasets.load_dataset``.
        train_split: split of ``dataset_name`` used for training.
        val_split: split of ``dataset_name`` used for validation (only with ``dataset_name``).
        dataset_cache_dir: ``cache_dir`` passed to ``datasets.load_dataset``.
        prompt_column: column holding the prompt text, or a list of chat messages.
        answer_column: column holding the reference answer; None gives "" answers.
        system_prompt: system message placed before every prompt, or None.
        tokenizer: tokenizer name or path, loaded with ``maxent_grpo.models.load_tokenizer``.
        tokenizer_cache_dir: cache directory for the tokenizer download.
        max_prompt_length: rows whose rendered prompt exceeds this many tokens are dropped;
            None keeps every row.
        batch_size: prompts per optimizer step per rank (B).
        val_batch_size: prompts per validation/test batch; None uses ``batch_size``.
        num_workers: DataLoader worker processes.
        shuffle: shuffle the training rows each epoch (deterministically from ``seed``).
        apply_chat_template: render prompts with the tokenizer's chat template.
    """

    def __init__(
        self,
        task: str | None = "arithmetic",
        task_options: dict[str, Any] | None = None,
        train_size: int = 2000,
        val_size: int = 64,
        seed: int = 0,
        holdout_val_prompts: bool = True,
        data_files: str | None = None,
        val_files: str | None = None,
        dataset_name: str | None = None,
        dataset_config: str | None = None,
        train_split: str = "train",
        val_split: str | None = None,
        dataset_cache_dir: str | None = None,
        prompt_column: str = "prompt",
        answer_column: str | None = "answer",
        system_prompt: str | None = None,
        tokenizer: str = "builtin:tiny",
        tokenizer_cache_dir: str | None = None,
        max_prompt_length: int | None = 256,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        shuffle: bool = True,
        apply_chat_template: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        chosen = {"task": task, "data_files": data_files, "dataset_name": dataset_name}
        set_now = [f"{k}={v!r}" for k, v in chosen.items() if v is not None]
        if len(set_now) != 1:
            raise ValueError(
                "exactly one of `task`, `data_files`, `dataset_name` must be set; got "
                f"{', '.join(set_now) or 'none'} (task defaults to 'arithmetic': set "
                "`task: null` to use data_files or dataset_name)"
            )
        if task is not None:
            from maxent_grpo.tasks import list_tasks

            if task not in list_tasks():
                raise ValueError(
                    f"task must be one of {', '.join(map(repr, list_tasks()))}; got {task!r}"
                )
        for name, value, needs in (
            ("task_options", task_options, task),
            ("val_files", val_files, data_files),
            ("dataset_config", dataset_config, dataset_name),
            ("val_split", val_split, dataset_name),
        ):
            if value is not None and needs is None:
                owner = {"task_options": "task", "val_files": "data_files"}.get(name)
                raise ValueError(f"`{name}` needs `{owner or 'dataset_name'}` to be set")
        for name, path in (("data_files", data_files), ("val_files", val_files)):
            if path is not None:
                if Path(path).suffix.lower() not in FILE_SUFFIXES:
                    raise ValueError(
                        f"`{name}` must end in one of {', '.join(FILE_SUFFIXES)}; got {path!r}"
                    )
                if not Path(path).is_file():
                    raise FileNotFoundError(f"`{name}` file not found: {path!r}")
        for name, value, low in (
            ("train_size", train_size, 1),
            ("val_size", val_size, 0),
            ("batch_size", batch_size, 1),
            ("val_batch_size", val_batch_size, 1),
            ("num_workers", num_workers, 0),
            ("max_prompt_length", max_prompt_length, 1),
        ):
            if value is not None and value < low:
                raise ValueError(f"`{name}` must be >= {low}; got {value}")
        if not prompt_column:
            raise ValueError("`prompt_column` must be a non-empty column name")
        if answer_column == "":
            raise ValueError("`answer_column` must be a column name or null; got ''")
        if system_prompt == "":
            raise ValueError("`system_prompt` must be a non-empty string or null; got ''")

        self.task, self.task_options = task, dict(task_options or {})
        self.train_size, self.val_size, self.seed = train_size, val_size, seed
        if not isinstance(holdout_val_prompts, bool):
            raise ValueError(
                f"`holdout_val_prompts` must be true or false; got {holdout_val_prompts!r}"
            )
        self.holdout_val_prompts = holdout_val_prompts
        self.data_files, self.val_files = data_files, val_files
        self.dataset_name, self.dataset_config = dataset_name, dataset_config
        self.train_split, self.val_split = train_split, val_split
        self.dataset_cache_dir = dataset_cache_dir
        self.prompt_column, self.answer_column = prompt_column, answer_column
        self.system_prompt = system_prompt
        self.tokenizer_name, self.tokenizer_cache_dir = tokenizer, tokenizer_cache_dir
        self.max_prompt_length = max_prompt_length
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size if val_batch_size is not None else batch_size
        self.num_workers, self.shuffle = num_workers, shuffle
        self.apply_chat_template = apply_chat_template

        self.tokenizer: Any = None  # loaded in setup() unless given to set_tokenizer()
        self.train_dataset: PromptDataset | None = None
        self.val_dataset: PromptDataset | None = None
        self.dropped: dict[str, int] = {}
        self._epoch = 0
        self._consumed = 0
        self._train_sampler: EpochShuffleSampler | None = None

    # ------------------------------------------------------------------ loading

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Use an already-loaded tokenizer instead of loading ``tokenizer`` in :meth:`setup`.

        It needs ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``
        and ``__call__(texts, add_special_tokens=False)["input_ids"]``.
        """
        self.tokenizer = tokenizer

    def prepare_data(self) -> None:
        """Download ``dataset_name`` once (rank 0); :meth:`setup` reads it from the cache."""
        if self.dataset_name is not None:
            self._load_hf(self.train_split)
            if self.val_split is not None:
                self._load_hf(self.val_split)

    def _load_hf(self, split: str) -> list[dict[str, Any]]:
        import datasets

        data = datasets.load_dataset(
            self.dataset_name, self.dataset_config, split=split, cache_dir=self.dataset_cache_dir
        )
        return data.to_list()

    def _load_sources(self) -> tuple[list[dict], list[dict], list[int], list[int], str, str]:
        """Return train rows, val rows, their source row numbers and the sources' names."""
        if self.task is not None:
            from maxent_grpo.tasks import build_task

            train = build_task(self.task, self.train_size, 2 * self.seed, **self.task_options)
            val = build_task(self.task, self.val_size, 2 * self.seed + 1, **self.task_options)
            val_prompts = {json.dumps(r.get(self.prompt_column), sort_keys=True) for r in val}
            keep = [
                i
                for i, r in enumerate(train)
                if not self.holdout_val_prompts
                or json.dumps(r.get(self.prompt_column), sort_keys=True) not in val_prompts
            ]
            if len(keep) < len(train):
                log.info(
                    "dropped %d training rows that repeat a validation prompt",
                    len(train) - len(keep),
                )
            source = f"task {self.task!r}"
            return (
                [train[i] for i in keep],
                val,
                keep,
                list(range(len(val))),
                f"{source} (train)",
                f"{source} (val)",
            )
        if self.data_files is not None:
            rows, name = read_rows(self.data_files, "data_files"), f"data_files {self.data_files!r}"
            if self.val_files is not None:
                val = read_rows(self.val_files, "val_files")
                return (
                    rows,
                    val,
                    list(range(len(rows))),
                    list(range(len(val))),
                    name,
                    f"val_files {self.val_files!r}",
                )
        else:
            rows = self._load_hf(self.train_split)
            name = f"dataset_name {self.dataset_name!r} split {self.train_split!r}"
            if self.val_split is not None:
                val = self._load_hf(self.val_split)
                return (
                    rows,
                    val,
                    list(range(len(rows))),
                    list(range(len(val))),
                    name,
                    f"dataset_name {self.dataset_name!r} split {self.val_split!r}",
                )
        if self.val_size >= len(rows):
            raise ValueError(
                f"`val_size` ({self.val_size}) must be smaller than the number of rows in "
                f"{name} ({len(rows)})"
            )
        perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(self.seed))
        val_idx = sorted(perm[: self.val_size].tolist())
        train_idx = sorted(perm[self.val_size :].tolist())
        return (
            [rows[i] for i in train_idx],
            [rows[i] for i in val_idx],
            train_idx,
            val_idx,
            name,
            name,
        )

    def _get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            from maxent_grpo.models import load_tokenizer

            self.tokenizer = load_tokenizer(
                self.tokenizer_name,
                cache_dir=self.tokenizer_cache_dir,
                padding_side="left",
                require_chat_template=self.apply_chat_template,
            )
        return self.tokenizer

    def _check_prompt(self, value: Any, row: int, source: str) -> Prompt:
        where = f"{source} row {row} column {self.prompt_column!r} (`prompt_column`)"
        if isinstance(value, str):
            if not value.strip():
                raise ValueError(f"{where} is an empty prompt")
            return value
        if isinstance(value, list) and value:
            for msg in value:
                if not (
                    isinstance(msg, dict)
                    and isinstance(msg.get("role"), str)
                    and isinstance(msg.get("content"), str)
                ):
                    raise ValueError(
                        f"{where}: chat messages must be dicts with str 'role' and 'content'; "
                        f"got {msg!r}"
                    )
            if not self.apply_chat_template:
                raise ValueError(
                    f"{where} holds chat messages, which need `apply_chat_template: true`"
                )
            return value
        raise ValueError(
            f"{where} must be a non-empty string or list of chat messages; got {value!r}"
        )

    def _answer(self, row: dict[str, Any], index: int, source: str) -> str:
        if self.answer_column is None:
            return ""
        value = row.get(self.answer_column)
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            if math.isfinite(value):
                return str(value)
        raise ValueError(
            f"{source} row {index} column {self.answer_column!r} (`answer_column`) must be a "
            f"string or a finite number; got {value!r}"
        )

    def _render(self, prompt: Prompt) -> str:
        if isinstance(prompt, str):
            if not self.apply_chat_template:
                if self.system_prompt is None:
                    return prompt
                return f"{self.system_prompt}\n\n{prompt}"
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = list(prompt)
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self._get_tokenizer().apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def _build(
        self, rows: list[dict], indices: list[int], source: str, split: str
    ) -> PromptDataset:
        names: dict[str, None] = {}
        for row in rows:
            names.update(dict.fromkeys(row))
        if rows and self.prompt_column not in names:
            raise ValueError(
                f"{source} has no prompt column {self.prompt_column!r} (`prompt_column`); "
                f"columns: {sorted(names)}"
            )
        if rows and self.answer_column is not None and self.answer_column not in names:
            raise ValueError(
                f"{source} has no answer column {self.answer_column!r} (`answer_column`, "
                f"null allowed); columns: {sorted(names)}"
            )
        others = [n for n in names if n != self.prompt_column]
        examples = []
        for row, index in zip(rows, indices, strict=True):
            raw = self._check_prompt(row.get(self.prompt_column), index, source)
            answer = self._answer(row, index, source)
            columns = {n: row.get(n) for n in others}
            columns["answer"] = answer
            examples.append(PromptExample(index, self._render(raw), raw, answer, columns))
        if self.max_prompt_length is not None and examples:
            out = self._get_tokenizer()([ex.prompt for ex in examples], add_special_tokens=False)[
                "input_ids"
            ]
            kept = [
                ex
                for ex, ids in zip(examples, out, strict=True)
                if len(ids) <= self.max_prompt_length
            ]
            self.dropped[split] = len(examples) - len(kept)
            if self.dropped[split]:
                log.info(
                    "dropped %d of %d %s prompts longer than max_prompt_length=%d tokens",
                    self.dropped[split],
                    len(examples),
                    split,
                    self.max_prompt_length,
                )
            if not kept:
                raise ValueError(
                    f"every {split} prompt of {source} is longer than `max_prompt_length` "
                    f"({self.max_prompt_length} tokens); raise it or set it to null"
                )
            examples = kept
        return PromptDataset(examples)

    def setup(self, stage: str | None = None) -> None:
        """Load, check, render and length-filter the train and validation rows (once)."""
        if self.train_dataset is None:
            train, val, train_idx, val_idx, train_src, val_src = self._load_sources()
            self.train_dataset = self._build(train, train_idx, train_src, "train")
            self.val_dataset = self._build(val, val_idx, val_src, "val")
        if stage in (None, "fit") and len(self.train_dataset) < self.batch_size:
            raise ValueError(
                f"`batch_size` ({self.batch_size}) exceeds the number of training prompts "
                f"({len(self.train_dataset)}); lower it or add rows"
            )

    # ------------------------------------------------------------------ loaders

    def _require(self, dataset: PromptDataset | None) -> PromptDataset:
        if dataset is None:
            raise RuntimeError("PromptDataModule.setup() must run before its dataloaders")
        return dataset

    def train_dataloader(self) -> PromptLoader:
        """B = ``batch_size`` prompts per batch and rank, ``drop_last=True``, order from seed +
        epoch (:class:`EpochShuffleSampler`), resuming mid-epoch after :meth:`load_state_dict`.

        The loader draws its worker base seed from its own generator (seeded with ``seed``),
        never from the global torch RNG, so building it does not shift the training's random
        stream (which a resumed run restores exactly).
        """
        dataset = self._require(self.train_dataset)
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        self._train_sampler = EpochShuffleSampler(
            len(dataset), self.seed, self.shuffle, self._epoch, num_replicas=world, rank=rank
        )
        if self._consumed:
            self._train_sampler.resume_at(self._epoch, self._consumed)
        return PromptLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=self._train_sampler,
            drop_last=True,
            num_workers=self.num_workers,
            collate_fn=collate_prompts,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def val_dataloader(self) -> DataLoader:
        """Validation rows in source order, ``val_batch_size`` per batch (its own generator,
        like the training loader: validating never shifts the training's random stream)."""
        return DataLoader(
            self._require(self.val_dataset),
            batch_size=self.val_batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            collate_fn=collate_prompts,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def test_dataloader(self) -> DataLoader:
        """The validation rows again."""
        return self.val_dataloader()

    # ------------------------------------------------------------------ state

    STATE_KEYS = ("epoch", "consumed", "seed", "shuffle", "num_rows", "batch_size", "world_size")

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Remember the epoch whose order the training batches come from (see state_dict)."""
        trainer = self.trainer
        if trainer is not None and trainer.training and self._train_sampler is not None:
            self._epoch = self._train_sampler.epoch
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position in the training order (see the class docstring, "Resume").

        ``consumed`` (prompts of ``epoch`` already trained on, all ranks) is Lightning's own
        count of the epoch's batches handed to ``training_step`` (its batch progress
        ``ready``; a batch the loader merely pre-fetched is not counted) times
        ``batch_size * world_size``. ``epoch`` is the sampler's epoch when the last training
        batch arrived (Lightning's epoch counters move on at an epoch's end before that count
        is reset, and differ after some restarts). The other keys
        (``seed``, ``shuffle``, ``num_rows``, ``batch_size``, ``world_size``) let
        :meth:`load_state_dict` refuse a checkpoint whose order does not match this run.
        """
        trainer = self.trainer
        if trainer is not None:
            world = trainer.world_size
            epoch = self._epoch
            ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready
            consumed = ready * self.batch_size * world
        else:
            world, epoch, consumed = 1, self._epoch, self._consumed
        return {
            "epoch": epoch,
            "consumed": consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": None if self.train_dataset is None else len(self.train_dataset),
            "batch_size": self.batch_size,
            "world_size": world,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at :meth:`state_dict`'s position: epoch ``epoch`` skips its first
        ``consumed`` prompts.

        Raises ValueError when a key is missing or when the checkpoint's order cannot be
        continued: another ``seed``, ``shuffle`` or number of training prompts; or, for a
        mid-epoch checkpoint, another ``batch_size`` or number of ranks. ``validate`` and
        ``test`` use no training order, so there nothing is checked or restored (a checkpoint
        may be evaluated on any data).
        """
        trainer = self.trainer
        stage = getattr(getattr(trainer, "state", None), "fn", None)
        if stage is not None and stage != "fit":
            return
        missing = [k for k in self.STATE_KEYS if k not in state_dict]
        if missing:
            raise ValueError(
                f"PromptDataModule state in the checkpoint is missing keys {missing}; "
                f"expected {list(self.STATE_KEYS)}"
            )
        for key, option in (("seed", "data.seed"), ("shuffle", "data.shuffle")):
            if state_dict[key] != getattr(self, key):
                raise ValueError(
                    f"the checkpoint was made with {option}={state_dict[key]!r}, but this run "
                    f"has {option}={getattr(self, key)!r}; set {option}: {state_dict[key]!r} "
                    "to resume"
                )
        if self.train_dataset is not None and state_dict["num_rows"] != len(self.train_dataset):
            raise ValueError(
                f"the checkpoint was made with {state_dict['num_rows']} training prompts, but "
                f"this run has {len(self.train_dataset)}; resume with the same data source "
                "and data.train_size / data.max_prompt_length"
            )
        consumed = int(state_dict["consumed"])
        if consumed:
            world = trainer.world_size if trainer is not None else 1
            if state_dict["batch_size"] != self.batch_size:
                raise ValueError(
                    f"the checkpoint stopped mid-epoch with data.batch_size="
                    f"{state_dict['batch_size']}, but this run has data.batch_size="
                    f"{self.batch_size}; resume with the same batch size"
                )
            if state_dict["world_size"] != world:
                raise ValueError(
                    f"the checkpoint stopped mid-epoch on {state_dict['world_size']} "
                    f"processes, but this run has {world} (trainer.devices x "
                    "trainer.num_nodes); resume with the same number"
                )
        self._epoch, self._consumed = int(state_dict["epoch"]), consumed
        if self._train_sampler is not None:
            self._train_sampler.set_epoch(self._epoch)
            self._train_sampler.resume_at(self._epoch, self._consumed)
