"""Prompts for GRPO training: the :class:`PromptDataModule`.

A batch is B prompts (``batch_size`` per rank and optimizer step), a dict of lists::

    {
        "prompts":     list[str],        # (B,) rendered text fed to generation
        "raw_prompts": list[str | list[dict]],  # (B,) the source prompt values, for rewards
        "answers":     list[str],        # (B,) reference answers ("" when answer_column=None)
        "columns":     dict[str, list],  # every non-prompt column, each a (B,) list,
                                         #   always including "answer" (== answers)
        "indices":     list[int],        # (B,) row number in the source the row came from
    }

Sources: :mod:`~maxent_grpo.training.data.sources`; row checks and rendering:
:mod:`~maxent_grpo.training.data.prompts`; the order: :mod:`~maxent_grpo.training.data.sampler`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DistributedSampler

from maxent_grpo.models import load_tokenizer
from maxent_grpo.rollout.toolcall import resolve_tools
from maxent_grpo.training.data.prompts import PromptFormat
from maxent_grpo.training.data.sampler import (
    EpochShuffleSampler,
    PromptDataset,
    PromptLoader,
    RefillStream,
    check_resume_state,
    collate_prompts,
    unfinished_batches,
)
from maxent_grpo.training.data.sources import (
    Sources,
    SplitRows,
    check_source_options,
    file_sources,
    hub_sources,
    load_hub_rows,
    task_sources,
    too_few_train_prompts,
    val_file_rows,
)
from maxent_grpo.training.data.workers import SignalSafeLoader
from maxent_grpo.validation import check_bool, check_int, defaults_of, require

__all__ = [  # the names other than PromptDataModule are re-exported
    "EpochShuffleSampler", "PromptDataModule", "PromptDataset", "PromptLoader", "collate_prompts",
]

log = logging.getLogger(__name__)

#: the refill stream's seed offset from ``data.seed`` (:meth:`PromptDataModule.refill_batch`)
REFILL_SEED = 7919


class PromptDataModule(pl.LightningDataModule):
    """Prompt rows for GRPO: loads, renders, length-filters and batches them.

    Exactly one source must be set, ``task``, ``data_files`` or ``dataset_name`` (``task``
    defaults to ``"arithmetic"``: set ``task: null`` for another); two raise ValueError. The
    options of a source not set are dropped with a warning (None in ``hparams``).

    :meth:`setup` renders (:class:`~maxent_grpo.training.data.prompts.PromptFormat`) and
    tokenises each prompt once and drops those over ``max_prompt_length`` (``dropped``,
    warned; ``longest``: the longest kept, in tokens); no prompt tokens, an emptied split
    or, when fitting, fewer training rows than a batch per process raise ValueError naming
    the ``--data.`` flags to fix.
    :meth:`state_dict` records the position in the seeded order (a resume continues it).

    Args:
        task: built-in task name (see ``maxent_grpo.tasks.list_tasks()``), or None.
        task_options: keyword options for the built-in task (e.g. ``{"digits": 3}``).
        train_size: number of training rows generated for ``task``.
        val_size: validation rows generated for ``task``, or split off the training rows
            when no ``val_files`` / ``val_split`` is given.
        seed: seed of task generation, the train/val split and the shuffle order.
        holdout_val_prompts: drop training rows repeating a validation prompt (of ``task``,
            or of ``val_size`` rows split off); False keeps them (a closed ``digit_pairs``).
        data_files: local .jsonl, .json, .csv or .parquet training files: a path, a glob
            pattern (``**`` crosses folders) or a list of them; or None.
        val_files: validation rows given like ``data_files``, with any training source.
        dataset_name: name or local path passed to ``datasets.load_dataset``, or None.
        dataset_config: configuration name passed to ``datasets.load_dataset``.
        train_split: split of ``dataset_name`` used for training.
        val_split: split of ``dataset_name`` used for validation (only with ``dataset_name``).
        dataset_cache_dir: ``cache_dir`` of ``datasets.load_dataset`` (also for files), or None.
        prompt_column: column holding the prompt text, or a list of chat messages.
        answer_column: column holding the reference answer; None gives "" answers.
        system_prompt: system message placed before every prompt, or None.
        tokenizer: tokenizer name or path, loaded with ``maxent_grpo.models.load_tokenizer``.
        tokenizer_cache_dir: cache directory for the tokenizer download.
        max_prompt_length: drop rows whose rendered prompt exceeds this many tokens; or None.
        batch_size: prompts per optimizer step per rank (B).
        val_batch_size: prompts per validation/test batch; None uses ``batch_size``.
        num_workers: DataLoader worker processes.
        shuffle: shuffle the training rows each epoch (deterministically from ``seed``).
        apply_chat_template: render prompts with the tokenizer's chat template.
        tools: the tools whose schemas the chat template shows (``tools=``), linked from
            ``model.tools`` on the command line; None: none.
    """

    def __init__(
        self,
        task: str | None = "arithmetic",
        task_options: dict[str, Any] | None = None,
        train_size: int = 2000,
        val_size: int = 64,
        seed: int = 0,
        holdout_val_prompts: bool = True,
        data_files: str | list[str] | None = None,
        val_files: str | list[str] | None = None,
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
        tools: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        default = defaults_of(PromptDataModule.__init__)  # what a dropped option becomes
        moved = {k: v for k, v in (("train_split", train_split), ("train_size", train_size))
                 if v != default[k]}
        self.unused_options = check_source_options(task, task_options, data_files, val_files,
                                                   dataset_name, dataset_config, val_split, **moved)
        for name in self.unused_options:
            self.hparams[name] = default[name]
        task_options, dataset_config, val_split, train_split = (
            default[name] if name in self.unused_options else value for name, value in (
                ("task_options", task_options), ("dataset_config", dataset_config),
                ("val_split", val_split), ("train_split", train_split)))
        check_int("data.seed", seed, 0, maximum=2**32 - 1)  # the tasks seed with 2 * seed + 1
        check_int("data.train_size", train_size, 1)
        check_int("data.val_size", val_size, 0)
        check_int("data.batch_size", batch_size, 1)
        check_int("data.num_workers", num_workers, 0)
        check_int("data.val_batch_size", val_batch_size, 1, allow_none=True)
        check_int("data.max_prompt_length", max_prompt_length, 1, allow_none=True)
        require(isinstance(prompt_column, str) and bool(prompt_column),
                f"data.prompt_column must be a non-empty column name; got {prompt_column!r}")
        for name, value in (("answer_column", answer_column), ("system_prompt", system_prompt),
                            ("tokenizer", tokenizer)):  # a loaded one: set_tokenizer()
            require(value is None or (isinstance(value, str) and bool(value)),
                    f"data.{name} must be a non-empty string or null; got {value!r:.80}")
        for name, flag in (("holdout_val_prompts", holdout_val_prompts), ("shuffle", shuffle),
                           ("apply_chat_template", apply_chat_template)):
            check_bool(f"data.{name}", flag)
        require(not tools or apply_chat_template,
                "data.tools (model.tools) are shown to the model by the chat template; set "
                "data.apply_chat_template: true")

        self.task, self.task_options = task, dict(task_options or {})
        self.train_size, self.val_size, self.seed = train_size, val_size, seed
        self.holdout_val_prompts, self.dataset_cache_dir = holdout_val_prompts, dataset_cache_dir
        self.data_files, self.val_files = data_files, val_files
        self.dataset_name, self.dataset_config = dataset_name, dataset_config
        self.train_split, self.val_split = train_split, val_split
        self.prompt_column, self.answer_column = prompt_column, answer_column
        self.system_prompt, self.max_prompt_length = system_prompt, max_prompt_length
        self.tokenizer_name, self.tokenizer_cache_dir = tokenizer, tokenizer_cache_dir
        self.batch_size, self.num_workers, self.shuffle = batch_size, num_workers, shuffle
        self.val_batch_size = val_batch_size if val_batch_size is not None else batch_size
        self.apply_chat_template, self.tools = apply_chat_template, resolve_tools(tools)

        self.tokenizer: Any = None  # loaded in setup() unless given to set_tokenizer()
        self.tokenizer_given = False
        self.train_dataset: PromptDataset | None = None
        self.val_dataset: PromptDataset | None = None
        self.dropped, self.longest = {}, {}  # per split: prompts dropped, the longest kept
        self._train_sampler: EpochShuffleSampler | None = None
        self._epoch = self._consumed = 0  # the position in the training order (state_dict)
        self._resume_consumed = 0  # prompts of `_epoch` the sampler skips (load_state_dict)
        # prompts this rank drew from the refill stream (refill_batch), and before this step
        self._refill, self._refill_before_step = RefillStream(seed + REFILL_SEED), 0

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Use an already-loaded tokenizer instead of loading ``tokenizer`` in :meth:`setup`."""
        self.tokenizer, self.tokenizer_given = tokenizer, True

    def prepare_data(self) -> None:
        """Download ``dataset_name`` once (rank 0); :meth:`setup` reads it from the cache."""
        if self.dataset_name is not None:
            for split in filter(None, (self.train_split, self.val_split)):
                load_hub_rows(self.dataset_name, self.dataset_config, split, self.dataset_cache_dir)

    def _load_sources(self, fitting: bool) -> Sources:
        """The rows of the source that is set (when ``fitting``, a split-off ``val_size`` must
        leave a batch of training rows)."""
        batch_size = self.batch_size if fitting else None
        holdout = self.prompt_column if self.holdout_val_prompts else None  # split-off rows
        if self.data_files is not None:
            return file_sources(self.data_files, self.val_files, self.val_size, self.seed,
                                self.dataset_cache_dir, batch_size, holdout)
        val = val_file_rows(self.val_files, self.dataset_cache_dir) if self.val_files else None
        if self.task is not None:
            return task_sources(
                self.task, self.task_options, self.train_size, self.val_size, self.seed,
                self.prompt_column, self.holdout_val_prompts, val)
        return hub_sources(
            self.dataset_name, self.dataset_config, self.train_split, self.val_split,
            self.dataset_cache_dir, self.val_size, self.seed, batch_size, val, holdout)

    def _get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(
                self.tokenizer_name,
                cache_dir=self.tokenizer_cache_dir,
                padding_side="left",
                require_chat_template=self.apply_chat_template,
            )
        return self.tokenizer

    def _build(self, fmt: PromptFormat, split: SplitRows, name: str) -> PromptDataset:
        """Render ``split``, refuse a prompt of no tokens, drop those over ``max_prompt_length``."""
        examples = fmt.examples(split)
        if not examples:
            return PromptDataset(examples, split.where)
        texts, tok = [ex.prompt for ex in examples], self._get_tokenizer()
        lengths = [len(ids) for at in range(0, len(texts), 1024)  # whole: 100x the data's memory
                   for ids in tok(texts[at:at + 1024], add_special_tokens=False)["input_ids"]]
        empty = [ex for ex, n in zip(examples, lengths, strict=True) if n == 0]
        if empty:
            part, number = split.where(empty[0].index)
            tokenizer = getattr(self.tokenizer, "name_or_path", None) or self.tokenizer_name
            raise ValueError(
                f"the tokenizer {tokenizer!r} (data.tokenizer, linked to "
                f"model.model_name_or_path) turns {len(empty)} of the {len(examples)} "
                f"{name} prompts into no tokens, first {part} row {number} (column "
                f"{self.prompt_column!r}, data.prompt_column), rendered as "
                f"{empty[0].prompt[:200]!r}; generation needs at least one prompt token: use "
                "the tokenizer the model was trained with (its vocabulary must cover the "
                "prompts' text), or render the prompts with its chat template, if it has one "
                "(--data.apply_chat_template true)"
            )
        fits = [self.max_prompt_length is None or n <= self.max_prompt_length for n in lengths]
        kept = [ex for ex, fit in zip(examples, fits, strict=True) if fit]
        self.dropped[name] = len(examples) - len(kept)
        self.longest[name] = max(n for n, fit in zip(lengths, fits, strict=True) if fit) \
            if kept else 0
        if self.dropped[name] and kept:  # the rows a user gave: said, not only logged
            part, number = split.where(examples[fits.index(False)].index)
            rank_zero_warn(
                f"{self.dropped[name]} of {len(examples)} {name} prompts are longer than "
                f"data.max_prompt_length ({self.max_prompt_length} tokens; the longest has "
                f"{max(lengths)}) and are left out, the first {part} row {number}; raise "
                "--data.max_prompt_length (or set it null) to keep them")
        limit = getattr(tok, "model_max_length", None)
        if self.max_prompt_length is None and isinstance(limit, int) and \
                self.longest[name] > limit:
            rank_zero_warn(f"the longest {name} prompt has {self.longest[name]} tokens, more "
                           f"than the tokenizer's model_max_length ({limit}); set "
                           "--data.max_prompt_length to leave such prompts out")
        require(
            bool(kept),
            f"every {name} prompt of {split.source} is longer than data.max_prompt_length "
            f"({self.max_prompt_length} tokens; the shortest has {min(lengths)}); set "
            f"--data.max_prompt_length {min(lengths)} or more (every prompt fits "
            f"{max(lengths)}), or --data.max_prompt_length null to keep every row",
        )
        return PromptDataset(kept, split.where)

    def setup(self, stage: str | None = None) -> None:
        """Load, check, render and length-filter the rows (once); under a trainer's ``fit``
        the consumed count restarts at zero (:meth:`load_state_dict` restores it later)."""
        if self.train_dataset is None:
            fmt = PromptFormat(
                self.prompt_column, self.answer_column, self.system_prompt,
                self.apply_chat_template, self._get_tokenizer, self.tools,
            )
            sources = self._load_sources(fitting=stage in (None, "fit"))
            self.train_dataset = self._build(fmt, sources.train, "train")
            self.val_dataset = self._build(fmt, sources.val, "val")
            self._train_counts = {
                "kept": len(self.train_dataset), "long": self.dropped.get("train", 0),
                "heldout": sources.heldout, "val_kept": len(self.val_dataset),
                "split_off": len(sources.val.rows) if self.task is None and self.val_files is None
                and self.val_split is None else 0,
            }
        if stage in (None, "fit"):
            world = int(getattr(self.trainer, "world_size", 1) or 1)  # each rank a share
            require(len(self.train_dataset) // world >= self.batch_size, too_few_train_prompts(
                self._train_counts, task=self.task, train_size=self.train_size,
                val_size=self.val_size, batch_size=self.batch_size,
                max_prompt_length=self.max_prompt_length, world=world,
                val_files=self.val_files is not None,
            ))
            if self.trainer is not None:  # a fit's start (a resume's position comes later)
                self._consumed = 0
                if not getattr(self.trainer, "global_step", 0):  # all, unless a fit goes on
                    self._epoch = self._resume_consumed = self._refill_before_step = 0
                    self._refill = RefillStream(self.seed + REFILL_SEED)

    def _require(self, dataset: PromptDataset | None) -> PromptDataset:
        if dataset is None:
            raise RuntimeError("PromptDataModule.setup() must run before its dataloaders")
        return dataset

    def train_dataloader(self) -> PromptLoader:
        """``batch_size`` prompts per batch and rank, ``drop_last=True``, ordered by
        :class:`EpochShuffleSampler`. Its own seeded generator keeps the global RNG untouched."""
        dataset = self._require(self.train_dataset)
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        limit = None if getattr(trainer, "fast_dev_run", 0) else getattr(  # (a smoke run's 1)
            trainer, "limit_train_batches", None)
        self._train_sampler = EpochShuffleSampler(
            len(dataset), self.seed, self.shuffle, self._epoch, num_replicas=world, rank=rank,
            batch_size=self.batch_size, limit=limit)
        if self._resume_consumed:
            self._train_sampler.resume_at(self._epoch, self._resume_consumed)
        return PromptLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=self._train_sampler,
            drop_last=True,
            num_workers=self.num_workers,
            collate_fn=collate_prompts,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def refill_batch(self, n: int) -> dict[str, Any]:
        """The next ``n`` prompts of this rank's refill stream, collated as a training batch
        (``model.refill_rounds``: dynamic sampling draws them when too few groups of a step
        have rewards that differ).

        The stream is the training rows in orders of their own, independent of the
        batches: pass ``k`` is ``torch.randperm(N)`` seeded ``data.seed + REFILL_SEED +
        k`` (with ``shuffle: false`` too), cut and dealt to the ranks as an epoch is
        (:class:`RefillStream`). Its position (``refill_drawn``) is in :meth:`state_dict`,
        so a resumed run draws the same prompts."""
        dataset = self._require(self.train_dataset)
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        rows = self._refill.take(len(dataset), n, world, rank)
        return collate_prompts([dataset[i] for i in rows])

    def val_dataloader(self) -> SignalSafeLoader:
        """Validation rows in source order, ``val_batch_size`` per batch (own generator)."""
        return SignalSafeLoader(self._require(self.val_dataset),  # (Lightning rebuilds a
                                batch_size=self.val_batch_size,  # predict loader by keyword)
                                shuffle=False, num_workers=self.num_workers,
                                collate_fn=collate_prompts,
                                generator=torch.Generator().manual_seed(self.seed))

    def test_dataloader(self) -> SignalSafeLoader:
        """The validation rows again."""
        return self.val_dataloader()

    def predict_dataloader(self) -> SignalSafeLoader:
        """The validation rows again (``predict`` samples them; another file to sample:
        ``data.val_files``). On several processes every rank gets as many batches (a padded
        ``DistributedSampler``; Lightning's predict sampler would give some ranks one batch
        fewer, and a sharded model's ``generate`` is a collective); the writer keeps one copy
        of a repeated prompt."""
        trainer = self.trainer
        if trainer is None or trainer.world_size == 1:
            return self.val_dataloader()
        dataset = self._require(self.val_dataset)
        sampler = DistributedSampler(dataset, num_replicas=trainer.world_size,
                                     rank=trainer.global_rank, shuffle=False, drop_last=False)
        return SignalSafeLoader(dataset, batch_size=self.val_batch_size, sampler=sampler,
                                num_workers=self.num_workers, collate_fn=collate_prompts)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Count a training batch about to reach ``training_step`` (other stages are not
        counted); the count restarts at the first batch of a new sampler epoch."""
        trainer = self.trainer
        if trainer is not None and trainer.training and self._train_sampler is not None:
            if self._train_sampler.epoch != self._epoch:
                self._epoch, self._consumed = self._train_sampler.epoch, 0
            self._consumed += self.batch_size * trainer.world_size
            self._refill_before_step = self._refill.drawn
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position in the training order: ``consumed`` = batches of ``epoch`` handed to
        ``training_step`` (not pre-fetched ones, nor one whose step an exception stopped:
        ``unfinished_batches``) x ``batch_size * world_size``; an end-of-epoch checkpoint
        records the whole epoch. ``seed``, ``shuffle``, ``num_rows``, ``batch_size``,
        ``world_size`` let :meth:`load_state_dict` refuse a mismatched run."""
        trainer, unfinished = self.trainer, unfinished_batches(self.trainer)
        world = trainer.world_size if trainer is not None else 1
        return {
            "epoch": self._epoch,
            "consumed": self._consumed - unfinished * self.batch_size * world,
            "seed": self.seed, "shuffle": self.shuffle,
            "num_rows": None if self.train_dataset is None else len(self.train_dataset),
            "batch_size": self.batch_size,
            "world_size": world,
            "refill_drawn": self._refill_before_step if unfinished else self._refill.drawn,
            "rows_digest": self._rows_digest(),
        }

    def _rows_digest(self) -> str:
        """The training rows' prompts and answers, in order, digested (edited data)."""
        digest = hashlib.sha256()  # of the source prompts: a rendered one may hold a date
        for example in [] if self.train_dataset is None else self.train_dataset.examples:
            raw = json.dumps(example.raw_prompt, sort_keys=True, default=str)
            digest.update(f"{raw}\0{example.answer}\0".encode("utf-8", "replace"))
        return digest.hexdigest()[:16]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at :meth:`state_dict`'s position (epoch ``epoch`` skips ``consumed`` prompts).

        Raises ValueError when the order cannot be continued
        (:func:`~maxent_grpo.training.data.sampler.check_resume_state`); outside ``fit``
        nothing is checked or restored."""
        trainer = self.trainer
        stage = getattr(getattr(trainer, "state", None), "fn", None)
        if stage is not None and stage != "fit":
            return
        consumed = check_resume_state(
            state_dict, seed=self.seed, shuffle=self.shuffle,
            num_rows=None if self.train_dataset is None else len(self.train_dataset),
            batch_size=self.batch_size, world=trainer.world_size if trainer is not None else 1,
        )
        saved = state_dict.get("rows_digest")  # absent in checkpoints before it
        if saved is not None and saved != self._rows_digest():
            log.warning("the training rows differ from the checkpoint's in their prompts or "
                        "answers (as many rows: a data file edited?): the run goes on in the "
                        "saved order over the rows as they are now")
        self._epoch = int(state_dict["epoch"])
        self._consumed = self._resume_consumed = consumed
        self._refill.drawn = int(state_dict.get("refill_drawn", 0))  # absent before refill
        if self._train_sampler is not None:
            self._train_sampler.set_epoch(self._epoch)
            self._train_sampler.resume_at(self._epoch, self._resume_consumed)
