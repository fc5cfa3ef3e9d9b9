"""Prompt rows as a dataset, and the order in which training visits them.

:func:`collate_prompts` stacks B :class:`PromptExample` into the batch dict of
:mod:`~maxent_grpo.training.data.datamodule`; :class:`EpochShuffleSampler` gives each rank its
share of a seeded per-epoch order, resumable mid-epoch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset, DistributedSampler

from maxent_grpo.training.data.workers import SignalSafeLoader
from maxent_grpo.validation import require

__all__ = [
    "EpochShuffleSampler",
    "Prompt",
    "PromptDataset",
    "PromptExample",
    "PromptLoader",
    "RefillStream",
    "collate_prompts",
    "epoch_positions",
    "unfinished_batches",
]

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
    """A list of :class:`PromptExample`, indexed by position; ``where(example.index)``, when
    given, is the file (else the source) and row an example came from, for messages."""

    def __init__(self, examples: Sequence[PromptExample],
                 where: Callable[[int], tuple[str, int]] | None = None) -> None:
        self.examples, self.where = list(examples), where

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, position: int) -> PromptExample:
        return self.examples[position]


def collate_prompts(examples: Sequence[PromptExample]) -> dict[str, Any]:
    """Stack B examples into the batch dict, lists kept as lists (unlike torch's collate)."""
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
    ``shuffle=False``), cut to ``W * floor(N / W)`` positions; rank ``r`` of ``W`` takes
    ``order[r::W]``, exactly as ``DistributedSampler(shuffle=shuffle, drop_last=True)``
    (so Lightning uses it as is under DDP and calls :meth:`set_epoch`).

    Resume: after :meth:`resume_at`, epoch ``epoch`` skips its first ``consumed`` positions
    (all ranks; a multiple of ``W``): rank ``r`` takes ``order[consumed:][r::W]``. ``len()``
    stays the full epoch's count, as Lightning expects.

    ``batch_size`` (the loader's, which drops an incomplete last batch): without shuffling
    the rows that fill no batch, and those past ``limit`` (``trainer.limit_train_batches``,
    Lightning's rule: an int caps the batches, a float is a fraction of them), are the same
    every epoch, never trained on: warned of.
    """

    def __init__(
        self,
        num_rows: int,
        seed: int,
        shuffle: bool = True,
        epoch: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        batch_size: int | None = None,
        limit: int | float | None = None,
    ) -> None:
        super().__init__(
            range(num_rows), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
            drop_last=True,
        )
        batches = self.num_samples // batch_size if batch_size else 0
        limit = 1.0 if limit is None else limit
        kept = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
        batches, cut = kept, kept < batches
        read = num_replicas * batches * (batch_size or 0)
        if batch_size and not shuffle and read < num_rows and rank == 0:
            warnings.warn(
                f"data.shuffle is false: the last {num_rows - read} of the {num_rows} training "
                f"rows fill no batch of data.batch_size {batch_size} (on {num_replicas} "
                "process(es))" + (f" within trainer.limit_train_batches {limit}" if cut else "")
                + " and are in no training batch of any epoch (refill rounds aside); set "
                "data.shuffle: true or fit the row count to the batches", stacklevel=2)
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
        order = list(super().__iter__())
        if self.epoch == self.resume_epoch:
            order = order[self.resume_consumed // self.num_replicas :]
        return iter(order)


class RefillStream:
    """One rank's refill stream (``model.refill_rounds``): the rows in orders of their own,
    pass ``k`` an :class:`EpochShuffleSampler` of seed ``seed`` at epoch ``k``, shuffled
    even when the batches are not (``data.shuffle: false`` made the stream's order the
    batches', so a refill drew the prompts of the step itself or of the next), dealt to the
    ranks as an epoch is; ``drawn`` is its position (a checkpoint's ``refill_drawn``)."""

    def __init__(self, seed: int) -> None:
        self.seed, self.drawn = seed, 0
        self._order: tuple[int, list[int]] = (-1, [])  # (pass, its order), made once a pass

    def take(self, size: int, n: int, world: int, rank: int) -> list[int]:
        """The next ``n`` rows of ``size``."""
        per_pass = size // world
        require(per_pass > 0, f"the refill stream needs at least {world} training prompts")
        rows: list[int] = []
        for position in range(self.drawn, self.drawn + n):
            pass_, i = divmod(position, per_pass)
            if self._order[0] != pass_:
                self._order = (pass_, list(EpochShuffleSampler(
                    size, self.seed, True, epoch=pass_, num_replicas=world, rank=rank)))
            rows.append(self._order[1][i])
        self.drawn += n
        return rows


class PromptLoader(SignalSafeLoader):
    """The training DataLoader, marked resumable so Lightning does not warn on a mid-epoch
    resume; the position itself is the DataModule's ``state_dict``."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore here: the DataModule restored the position."""


#: the keys of ``PromptDataModule.state_dict``
STATE_KEYS = ("epoch", "consumed", "seed", "shuffle", "num_rows", "batch_size", "world_size")


def check_resume_state(
    state: dict[str, Any], *, seed: int, shuffle: bool, num_rows: int | None, batch_size: int,
    world: int,
) -> int:
    """Refuse (ValueError naming the option) a saved position this run cannot continue: a
    missing key, another ``seed``, ``shuffle`` or ``num_rows`` (None: not known yet), or, in
    mid-epoch, another ``batch_size`` or number of ranks. Returns the positions of the saved
    epoch this run skips: the saved ``consumed``, or, when that was the whole epoch (a
    checkpoint at its end), this run's whole epoch (:func:`epoch_positions`), whatever its
    batch size and number of ranks."""
    missing = [k for k in STATE_KEYS if k not in state]
    require(not missing, f"PromptDataModule state in the checkpoint is missing keys {missing}; "
                         f"expected {list(STATE_KEYS)}")
    for key, value in (("seed", seed), ("shuffle", shuffle)):
        saved, option = state[key], f"data.{key}"
        require(saved == value, f"the checkpoint was made with {option}={saved!r}, but this run "
                                f"has {option}={value!r}; set {option}: {saved!r} to resume")
    require(num_rows is None or state["num_rows"] == num_rows,
            f"the checkpoint was made with {state['num_rows']} training prompts, but this run "
            f"has {num_rows}; resume with the same data source (the same files, or task and "
            "data.train_size), data.val_size, holdout_val_prompts and max_prompt_length")
    consumed, saved_rows = int(state["consumed"]), state["num_rows"]
    if saved_rows is not None and consumed >= epoch_positions(
            saved_rows, state["batch_size"], state["world_size"]):
        return consumed if num_rows is None else epoch_positions(num_rows, batch_size, world)
    if consumed:
        require(state["batch_size"] == batch_size,
                f"the checkpoint stopped mid-epoch with data.batch_size={state['batch_size']}, "
                f"but this run has data.batch_size={batch_size}; resume with the same batch size")
        require(state["world_size"] == world,
                f"the checkpoint stopped mid-epoch on {state['world_size']} processes, but this "
                f"run has {world} (trainer.devices x trainer.num_nodes); resume with the same "
                "number")
    return consumed


def epoch_positions(num_rows: int, batch_size: int, world: int) -> int:
    """The positions a whole epoch hands to ``training_step``: each rank's
    ``num_rows // world`` rows in whole batches (the sampler and the loader drop the rest)."""
    return num_rows // world // batch_size * batch_size * world


def unfinished_batches(trainer: Any) -> int:
    """The training batches handed to ``training_step`` that did not finish it: 1 while a
    checkpoint is written on an exception in the middle of a step (Ctrl-C during a rollout,
    ``ModelCheckpoint(save_on_exception=True)``), when Lightning runs that batch again at the
    resume; 0 at a batch's end, in validation, or without a trainer."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    current = getattr(getattr(loop, "batch_progress", None), "current", None)
    ready, processed = getattr(current, "ready", 0), getattr(current, "processed", 0)
    return max(ready - processed, 0) if isinstance(ready, int) and isinstance(
        processed, int) and getattr(trainer, "training", False) else 0
