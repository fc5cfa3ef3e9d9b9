"""Combining reward functions into one reward per completion (docs/ALGORITHM.md §1).

With ``K`` weighted reward functions and ``N`` completions (``N = B*G``, prompt-major):

    components[k, i] = R_k(i)                  (NaN where R_k returned None)
    total[i]         = Σ_k w_k · R_k(i)        over the k with R_k(i) not None

A row where every component is ``None`` gets ``total = 0.0`` (as TRL's ``nansum``); its
components stay NaN. Every function is called as TRL's ``GRPOTrainer`` calls it (each
argument: docs/REWARDS.md, "The contract")::

    fn(prompts=prompts, completions=completions, completion_ids=completion_ids,
       trainer_state=trainer_state, **columns)

A multi-turn rollout's (``model.tools``) completions are their messages, the model's turns
and the tool messages, the last always the model's, with the keywords ``tool_calls``,
``tool_failures``, ``exchange_lengths`` (and ``environments``) added; its
``completion_ids`` are the model's own tokens only.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from maxent_grpo.rewards.options import OVERLONG, RewardOptions, parse_reward_options
from maxent_grpo.rewards.registry import get_reward
from maxent_grpo.rewards.reward_model import RewardModel
from maxent_grpo.rewards.shaping import Overlong
from maxent_grpo.rewards.timeout import RewardTimeout, TimedReward, awaited
from maxent_grpo.rollout.batch import PromptCompletionBatch
from maxent_grpo.validation import UserCodeError, failing_row, is_number

if TYPE_CHECKING:
    from maxent_grpo.rollout.batch import RolloutOutput

#: reward arguments a dataset column may not be named after
RESERVED = ("prompts", "completions", "completion_ids", "trainer_state", "rendered_prompts",
            "log_metric", "log_extra")


def _not_logged(kind: str) -> Callable[..., None]:
    """TRL's ``log_extra`` (and ``log_metric`` outside :class:`WeightedRewards`), accepted
    so that a TRL reward runs unchanged; what it is given is dropped (warned once)."""
    def log(*args: Any, **kwargs: Any) -> None:
        warnings.warn(f"a reward function called {kind}: what it is given is dropped here",
                      stacklevel=2)
    return log


@dataclass(frozen=True)
class TrainerState:
    """Read-only training progress.

    Attributes:
        global_step: optimizer steps taken so far (``trainer.global_step``; 0 at the first
            rollout).
        max_steps: the optimizer steps the run will take (``trainer.max_steps``, or the
            epochs' batches times ``num_iterations``, whichever is smaller); -1 when unknown
            (no trainer, an endless loader).
        epoch: epochs done, with the fraction of the current one (``2.25`` = a quarter into
            the third epoch), as TRL's ``state.epoch``.
        num_train_epochs: epochs the run goes through (-1 when unknown).
        is_world_process_zero: this process is global rank 0.
        is_local_process_zero: this process is rank 0 of its node.

    >>> state = TrainerState(global_step=30, max_steps=100)
    >>> state.global_step / state.max_steps
    0.3
    """

    global_step: int = 0
    max_steps: int = -1
    epoch: float = 0.0
    num_train_epochs: int = -1
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True

    @classmethod
    def from_trainer(cls, trainer: Any, num_iterations: int = 1,
                     idle_batches: int = 0) -> TrainerState:
        """The progress of a Lightning ``trainer`` (``TrainerState()``, step 0 and unknown
        length, without one); ``num_iterations`` optimizer steps are taken per batch, none
        in the run's first ``idle_batches`` (an asynchronous run's ``max_staleness``, which
        only start rollouts). A checkpoint's ``validate``, ``test`` or ``predict`` is at
        the checkpoint's step and epoch."""
        if trainer is None:
            return cls()
        evaluated = getattr(trainer.fit_loop.epoch_loop, "evaluated", None)  # load_state's
        batches = trainer.num_training_batches  # per epoch, this rank; inf before fit
        batches = batches if isinstance(batches, int) and batches > 0 else None
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # (saves: + this)
        begun = getattr(getattr(trainer.fit_loop, "epoch_progress", None), "current", None)
        begun = getattr(begun, "ready", 0)  # the epochs begun (after a fit current_epoch is on)
        epoch = (begun - 1 if isinstance(begun, int) and begun > 0 else trainer.current_epoch) \
            + (min(done, batches) / batches if batches else 0.0)
        step, epoch = (trainer.global_step, epoch) if evaluated is None else evaluated
        caps = [trainer.max_steps] if trainer.max_steps > 0 else []
        if batches and (max_epochs := trainer.max_epochs or -1) > 0:
            caps.append(max(0, batches * max_epochs - idle_batches) * num_iterations)
        max_steps = min(caps) if caps else -1
        epochs = math.ceil((math.ceil(max_steps / num_iterations) + idle_batches) / batches) \
            if batches and max_steps > 0 else -1
        return cls(
            global_step=int(step or 0), max_steps=int(max_steps), epoch=float(epoch or 0.0),
            num_train_epochs=int(epochs), is_world_process_zero=bool(trainer.is_global_zero),
            is_local_process_zero=trainer.local_rank == 0,
        )


class RewardFunctionError(UserCodeError):
    """A reward function raised, or returned something other than one finite number or None
    per completion. The message names the function; the original error is ``__cause__``."""


def _check_funcs(funcs: Sequence[tuple[str, Callable, float]]) -> None:
    if not funcs:
        raise ValueError("funcs must hold at least one (name, function, weight) triple")
    for entry in funcs:
        if not (isinstance(entry, tuple) and len(entry) == 3):
            raise ValueError(f"funcs must hold (name, function, weight) triples; got {entry!r}")
        name, fn, weight = entry
        if not callable(fn):
            raise ValueError(f"reward {name!r}: function must be callable; got {fn!r}")
        if not is_number(weight):
            raise ValueError(f"reward {name!r}: weight must be a finite number; got {weight!r}")


def _check_inputs(prompts: list, completions: list, columns: dict[str, list]) -> None:
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"prompts must have one entry per completion ({n}); got {len(prompts)}")
    for key, values in columns.items():
        if key in RESERVED:
            raise ValueError(f"column {key!r} clashes with the reward argument of that name; "
                             "rename the dataset column")
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise ValueError(
                f"column {key!r} must be a list with one value per completion ({n}); got {got}"
            )


def is_conversational(prompt: Any) -> bool:
    """A prompt given as chat messages (TRL's test: a list whose first item is a dict with a
    ``"role"``).

    >>> is_conversational([{"role": "user", "content": "hi"}]), is_conversational("hi")
    (True, False)
    """
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and (
        "role" in prompt[0])


def trl_completions(prompts: list, completions: list) -> list:
    """Completions in the form of their prompts: a text completion of a conversational
    prompt becomes ``[{"role": "assistant", "content": text}]``; the rest are unchanged.

    >>> trl_completions([[{"role": "user", "content": "2+2?"}], "2+2="], ["4", "4"])
    [[{'role': 'assistant', 'content': '4'}], '4']
    """
    return [[{"role": "assistant", "content": c}] if isinstance(c, str) and is_conversational(p)
            else c for p, c in zip(prompts, completions, strict=True)]


#: seconds a failed reward call and its search for the row it failed on may take together
ROW_SEARCH_S = 2.0


def _alone(fn: Callable, call: dict[str, Any], err: BaseException, seconds: float) -> str:
    """`` (it raises on completion i alone: ...)``, the first row that raises ``err`` again
    (its type and message) where another row passes, with its prompt, completion and columns;
    "" when none does (one that needs whole groups fails otherwise on one row) or every row
    does (a missing key or setting: not a row's), or for a reward that times out or runs a
    model (the search is theirs to pay), or without ``seconds`` left."""
    n = len(call["completions"])
    if seconds <= 0 or isinstance(fn, (TimedReward, RewardModel)) or any(
            map(inspect.iscoroutinefunction, (fn, type(fn).__call__))):
        return ""
    quiet = dict.fromkeys(("log_metric", "log_extra"), lambda *args, **kwargs: None)
    found = failing_row(fn, n, {**call, **quiet}, type(err), str(err), seconds, alone=True)
    if found is None:
        return ""
    i = found[0]
    shown = "".join(f", {key} {value[i]!r:.60}" for key, value in call.items()
                    if key not in RESERVED and len(value) == n)
    return (f" (it raises on completion {i} alone: prompt {call['prompts'][i]!r:.80}, "
            f"completion {call['completions'][i]!r:.80}{shown})")


def _call(k: int, name: str, fn: Callable, prompts: list, completions: list,
          kwargs: dict[str, Any], dtype: Any = torch.float32) -> list[float]:
    """Values of reward ``k`` as floats (NaN for None), checked (finite in ``dtype``)."""
    label, started = f"reward function {name!r} (#{k})", time.monotonic()
    try:
        values = fn(prompts=prompts, completions=completions, **kwargs)
        # async def; checked here so that a sync reward's step runs nothing of timeout.py
        values = awaited(values) if inspect.isawaitable(values) else values
    except (Exception, SystemExit) as err:  # sys.exit in a reward ended the fit, exit 0
        if isinstance(err, RewardTimeout):  # nothing the function raised: no row search, no
            raise RewardFunctionError(f"{label} gave {err}") from None  # "at" timeout.py
        alone = _alone(fn, {"prompts": prompts, "completions": completions, **kwargs}, err,
                       ROW_SEARCH_S - (time.monotonic() - started))
        raise RewardFunctionError(f"{label} raised {type(err).__name__}: {err}{alone}") from err
    n = len(completions)
    if isinstance(values, (torch.Tensor, np.ndarray)) and values.ndim == 1:
        values = values.tolist()  # TRL reads any sequence torch.tensor takes
    if not isinstance(values, (list, tuple)):
        raise RewardFunctionError(
            f"{label} must return a list of {n} values; got {type(values).__name__}"
        )
    if len(values) != n:
        raise RewardFunctionError(f"{label} returned {len(values)} values; expected {n}")
    out: list[float] = []
    for i, value in enumerate(values):
        if value is None:
            out.append(math.nan)
            continue
        if isinstance(value, (torch.Tensor, np.ndarray, np.generic)) and value.ndim == 0:
            value = value.item()  # 0-d tensors, NumPy's scalars (np.isclose's bools)
        if not isinstance(value, numbers.Real):
            raise RewardFunctionError(
                f"{label} returned a non-numeric value at row {i}: {value!r:.80} "
                "(use a float, or None for 'not applicable')"
            )
        if not abs(value) <= torch.finfo(dtype).max:  # NaN, inf, past float32's range
            raise RewardFunctionError(f"{label} returned a non-finite value at row {i}: "
                                      f"{value!r:.80} (use None for 'not applicable'; the step "
                                      f"keeps rewards in {dtype}: ±{torch.finfo(dtype).max:.3g})")
        out.append(float(value))
    return out


def score_completions(
    funcs: Sequence[tuple[str, Callable, float]], prompts: list, completions: list,
    columns: dict[str, list], completion_ids: list[list[int]] | None = None,
    trainer_state: TrainerState | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score ``N`` completions with ``K`` weighted reward functions.

    ``funcs`` holds ``(name, function, weight)``; each function is called the TRL way (see
    the module docstring) on :func:`trl_completions`, with ``completion_ids`` and
    ``trainer_state`` as given (None when the caller has none) and ``columns`` mapping each
    dataset column to its ``N`` per-completion values.

    Returns ``(total, components)``, float32 ``(N,)`` and ``(K, N)``, as the module
    docstring defines them (``None``: skipped in ``total``, NaN in ``components``).

    >>> total, comps = score_completions(
    ...     [("a", lambda prompts, completions, **kw: [1.0, None], 2.0),
    ...      ("b", lambda prompts, completions, **kw: [0.5, 1.0], 1.0)],
    ...     ["p", "p"], ["x", "y"], {})
    >>> total.tolist()
    [2.5, 1.0]
    """
    _check_funcs(funcs)  # WeightedRewards checks its own once, when it is built
    return _score(funcs, prompts, completions, columns, completion_ids, trainer_state)


def _score(
    funcs: Sequence[tuple[str, Callable, float]], prompts: list, completions: list,
    columns: dict[str, list], completion_ids: list[list[int]] | None,
    trainer_state: TrainerState | None, rendered_prompts: list[str] | None = None,
    call_log: Callable[[], Callable[[str, float], None]] | None = None, dtype: Any = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs(prompts, completions, columns)
    if completion_ids is not None and len(completion_ids) != len(completions):
        raise ValueError(f"completion_ids must have one entry per completion "
                         f"({len(completions)}); got {len(completion_ids)}")
    completions = trl_completions(prompts, completions)
    kwargs = {"completion_ids": completion_ids, "trainer_state": trainer_state,
              "log_extra": _not_logged("log_extra"), **columns}
    if rendered_prompts is not None:
        kwargs["rendered_prompts"] = rendered_prompts
    rows, opened = [], call_log or (lambda: _not_logged("log_metric"))
    for k, (name, fn, _) in enumerate(funcs):
        kwargs["log_metric"] = opened()  # each call its own log_metric, closed by the next
        rows.append(_call(k, name, fn, prompts, completions, kwargs, dtype))
    opened()  # the last one closed too
    components = torch.tensor(rows, dtype=torch.float64).reshape(len(funcs), len(completions))
    weights = torch.tensor([float(w) for _, _, w in funcs], dtype=torch.float64)  # (K,)
    total = torch.nansum(weights[:, None] * components, dim=0)  # (N,); NaN·w stays NaN
    if not bool((total.abs() <= torch.finfo(dtype).max).all()):  # past float32's range
        raise RewardFunctionError(f"the weighted sum of the rewards {[f[0] for f in funcs]} is "
                                  f"beyond {dtype}'s range; lower their weights or values")
    return total.to(dtype), components.to(dtype)  # summed in float64 either way


def unpadded_ids(completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[list[int]]:
    """Each row's ids where ``completion_mask`` is True (``(N, T)``): TRL's ``completion_ids``.

    >>> unpadded_ids(torch.tensor([[5, 2, 0], [7, 8, 9]]),
    ...              torch.tensor([[True, True, False], [True, True, True]]))
    [[5, 2], [7, 8, 9]]
    """
    if completion_ids.shape != completion_mask.shape or completion_ids.dim() != 2:
        raise ValueError(
            "completion_ids and completion_mask must be (N, T) tensors of one shape; got "
            f"{tuple(completion_ids.shape)} and {tuple(completion_mask.shape)}"
        )
    # one transfer and plain lists: far faster than indexing the rows one by one
    ids, mask = completion_ids.cpu().tolist(), completion_mask.cpu().bool().tolist()
    return [list(compress(row, keep)) for row, keep in zip(ids, mask, strict=True)]


class WeightedRewards:
    """The trainer's reward: ``model.rewards`` resolved once (:mod:`~maxent_grpo.rewards.options`).

    Keys are registered rewards, ``package.module:function`` paths or ``model:<name_or_path>``
    reward models (loaded at their first call). Called on the flat prompt/completion pairs
    of ``B`` prompts x ``G`` completions, with the dataset's other columns once per prompt
    (repeated per completion here) and the rollout's completion ids and mask.

    Args:
        rewards: ``model.rewards``.
        max_completion_length: the trainer's ``T_max``, what the ``overlong`` reward
            measures against (None: that reward is refused at its first call).
        device: where reward models run (None: the CPU); the step's device replaces it at
            each :meth:`score_rollout` (the trainer places the module after building it).

    >>> WeightedRewards({"format": 1.0, "tag_count": {"weight": 0.5, "timeout": 2}}).weights
    [1.0, 0.5]
    """

    def __init__(self, rewards: Mapping[str, Any], max_completion_length: int | None = None,
                 device: torch.device | None = None) -> None:
        self.options: list[RewardOptions] = parse_reward_options(rewards)
        self.names = [o.name for o in self.options]
        self.weights = [o.weight for o in self.options]
        self._max_completion_length = max_completion_length
        if device is not None and not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a torch.device, a device name or None; got "
                            f"{type(device).__name__} (a callable is no longer taken: the "
                            "step's device reaches the rewards through score_rollout)")
        self._device = device
        self.funcs = [self._function(o) for o in self.options]
        _check_funcs(list(zip(self.names, self.funcs, self.weights, strict=True)))
        self._logged: deque[tuple[str, float]] = deque()
        self._calls = 0  # the reward call whose log_metric is open

    def _call_log(self) -> Callable[[str, float], None]:
        """One reward call's ``log_metric``, open until the next call's."""
        self._calls += 1
        return functools.partial(self.log_metric, call=self._calls)

    def log_metric(self, name: str, value: float, call: int | None = None) -> None:
        """TRL's ``log_metric``, given to every reward function: a finite number of its own,
        logged by the training step as ``train/reward_log/<name>`` (the mean of its calls
        over every rank); a bad one is the calling function's error. From a ``call`` that
        has ended (it timed out, and logs from its thread), dropped with a warning."""
        if call is not None and call != self._calls:
            return warnings.warn(f"a reward function called log_metric({name!r}, ...) after "
                                 "its call had ended (it timed out): dropped", stacklevel=2)
        if isinstance(value, (torch.Tensor, np.ndarray, np.generic)) and value.ndim == 0:
            value = value.item()
        if not (isinstance(name, str) and name.strip() and is_number(value)):
            raise ValueError("log_metric(name, value) needs a name and a finite number; got "
                             f"({name!r:.80}, {value!r:.80})")
        self._logged.append((name, float(value)))

    def take_logged(self) -> list[tuple[str, float]]:
        """What :meth:`log_metric` recorded since the last call, emptied."""
        return [self._logged.popleft() for _ in range(len(self._logged))]

    def _function(self, options: RewardOptions) -> Callable:
        if options.model is not None:
            fn: Callable = RewardModel(options.model, options.name, options.batch_size,
                                       options.dtype, device=self.device)
        else:
            try:
                fn = get_reward(options.name)
            except ValueError as err:
                raise ValueError(f"model.rewards: {err}") from err
        if options.name == OVERLONG:
            fn = Overlong(fn, options.buffer, self)
        if options.timeout is not None:
            fn = TimedReward(options.name, fn, options.timeout, options.fallback,
                             options.has_fallback)
        return fn

    def max_completion_length(self) -> int:
        """The trainer's ``max_completion_length`` (what the ``overlong`` reward measures
        against)."""
        if self._max_completion_length is None:
            raise ValueError("model.rewards.overlong needs the trainer's max_completion_length;"
                             " it is only available inside MaxEntGRPOModule")
        return int(self._max_completion_length)

    def device(self) -> torch.device:
        """Where reward models run (the CPU unless given)."""
        return torch.device("cpu") if self._device is None else torch.device(self._device)

    def __call__(
        self, pairs: PromptCompletionBatch, columns: dict[str, list], group_size: int,
        completion_ids: torch.Tensor | None = None, completion_mask: torch.Tensor | None = None,
        per_completion: dict[str, list] | None = None, trainer_state: TrainerState | None = None,
        rendered_prompts: list[str] | None = None, dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(total (B*G,), components (K, B*G))`` of :func:`score_completions`, in ``dtype``;
        ``columns`` hold one value per prompt; ``completion_ids`` and ``completion_mask``
        are the rollout's ``(B*G, T)`` tensors (without them ``completion_ids=None``);
        ``per_completion`` adds keyword columns with one value per completion (a multi-turn
        rollout's ``tool_calls``, ``tool_failures``, ``exchange_lengths``, ``environments``);
        ``trainer_state`` is what the step gives (None: ``TrainerState()``);
        ``rendered_prompts``, one per completion, the text the model continued (given to
        the functions as that argument when not None)."""
        per_row = {k: [v for v in vals for _ in range(group_size)] for k, vals in columns.items()}
        for key, values in (per_completion or {}).items():
            if key in per_row:
                raise ValueError(f"the dataset column {key!r} clashes with the multi-turn "
                                 "rollout's reward argument of that name; rename the column")
            per_row[key] = values
        funcs = list(zip(self.names, self.funcs, self.weights, strict=True))
        ids = None
        if completion_ids is not None:
            if completion_mask is None:
                raise ValueError("completion_ids need their completion_mask")
            ids = unpadded_ids(completion_ids, completion_mask)
        return _score(funcs, pairs.prompts, pairs.completions, per_row, ids,
                      trainer_state or TrainerState(), rendered_prompts, self._call_log, dtype)

    def score_rollout(
        self, rollout: RolloutOutput, raw_prompts: list[Any], columns: dict[str, list],
        trainer_state: TrainerState | None = None, device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(total (B*G,), components (K, B*G))`` of one rollout of ``B`` prompts, as
        training and evaluation score it: the rollout's :meth:`~RolloutOutput.pairs` with
        each dataset prompt (``raw_prompts``: a string or chat messages, as the dataset gave
        it), the prompts as the model continued them (``rendered_prompts``), its
        per-completion columns, and its ids and model mask. ``device`` is where
        the step runs: reward models run there from now on (None: unchanged)."""
        if device is not None:
            self._device = device
        pairs = rollout.pairs(raw_prompts)
        rendered = [p for p in rollout.batch.prompts for _ in range(rollout.group_size)]
        return self(pairs, columns, rollout.group_size, rollout.completion_ids,
                    rollout.model_mask, pairs.reward_columns(), trainer_state, rendered, dtype)
