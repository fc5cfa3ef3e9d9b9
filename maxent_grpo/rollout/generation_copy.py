"""A low-precision copy of the policy's weights for generation (``generation_dtype``).

Under ``bf16-mixed`` autocast casts every float32 weight at every decode step.
:func:`generation_copy` instead keeps one copy of the model with its floating parameters and
buffers in ``dtype`` (as ``model.to(dtype)``) and refreshes it in place at each call (a
multi-turn rollout's later turns reuse it as the first turn left it).

Copies live in a module-level ``weakref.WeakKeyDictionary`` keyed on the source model, so
nothing is added to the model, the optimizer or a checkpoint, and a copy dies with its
model. Every engine reuses it; it is rebuilt only when it no longer matches the model
(dtype, tensor names, shapes or devices).

Building: ``copy.deepcopy`` with every floating tensor pre-cast in its memo (no float32
duplicate on the way; tied weights stay tied), frozen and in eval mode.
"""

from __future__ import annotations

import copy
import logging
import time
import weakref
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedModel

from maxent_grpo.adapters import has_adapters

logger = logging.getLogger(__name__)

#: source model -> its generation copy
_COPIES: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def sharded(model: nn.Module) -> bool:
    """Sharded parameters: FSDP2 (``fully_shard``) or ZeRO-3 (``ds_id``), even on one process."""
    return isinstance(model, FSDPModule) or any(hasattr(p, "ds_id") for p in model.parameters())


def check_copyable(model: nn.Module) -> None:
    """Refuse (ValueError naming the fix) a model with parameters sharded across ranks
    (:func:`sharded`) or neither a ``PreTrainedModel`` nor a ``peft`` model wrapping one."""
    if sharded(model):
        raise ValueError(
            "HFGenerateEngine.generation_dtype: the model's parameters are sharded across "
            "ranks (FSDP2 / DeepSpeed ZeRO-3), and a copy of one rank's shards cannot "
            "generate; use generation_dtype: model (or a strategy that replicates the weights, "
            "such as DDP)"
        )
    if not isinstance(model, PreTrainedModel) and not has_adapters(model):
        raise ValueError(
            f"HFGenerateEngine.generation_dtype: a {type(model).__name__} cannot be copied "
            "for generation (only a transformers PreTrainedModel or a peft model wrapping one "
            "can); use generation_dtype: model"
        )


def _state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters, then the buffers, by name (each shared tensor once)."""
    yield from model.named_parameters()
    yield from (("buffer:" + name, b) for name, b in model.named_buffers())


def _matches(source: nn.Module, target: nn.Module, dtype: torch.dtype) -> bool:
    """``target`` has ``source``'s tensors (names, shapes, devices), floating ones in dtype."""
    ours, theirs = list(_state(source)), list(_state(target))
    return len(ours) == len(theirs) and all(
        n == m and a.shape == b.shape and a.device == b.device
        and b.dtype == (dtype if a.is_floating_point() else a.dtype)
        for (n, a), (m, b) in zip(ours, theirs, strict=True)
    )


def build_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A deep copy of ``model`` whose floating parameters and buffers are in ``dtype``
    (frozen, eval mode), built without a float32 duplicate."""
    memo: dict[int, object] = {}
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point() and id(tensor) not in memo:
                cast = tensor.detach().to(dtype=dtype, copy=True)
                memo[id(tensor)] = (nn.Parameter(cast, requires_grad=False)
                                    if isinstance(tensor, nn.Parameter) else cast)
    duplicate = copy.deepcopy(model, memo)
    duplicate.requires_grad_(False)
    return duplicate.eval()


def generation_copy(model: nn.Module, dtype: torch.dtype,
                    refresh: bool = True) -> tuple[nn.Module, float]:
    """``model``'s generation copy in ``dtype`` with its current weights (refreshed in place,
    or (re)built when missing or mismatched), and the refresh's seconds (0 when built).
    ``refresh=False`` returns a matching copy as it is (a multi-turn rollout's later turns:
    the weights cannot change inside one rollout)."""
    cached = _COPIES.get(model)
    start = time.perf_counter()
    if cached is not None and not refresh and _matches(model, cached, dtype):
        return cached, 0.0
    if cached is not None and _matches(model, cached, dtype):
        with torch.no_grad():  # the current weights, in place, cast to the copy's dtypes
            for (_, mine), (_, theirs) in zip(_state(cached), _state(model), strict=True):
                mine.copy_(theirs)
        if next(cached.parameters()).device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        logger.debug("generation copy refreshed in %.4f s", seconds)
        return cached, seconds
    _COPIES.pop(model, None)  # free a stale copy before building the new one
    cached = _COPIES[model] = build_copy(model, dtype)
    numel = sum(p.numel() for p in cached.parameters())
    logger.info("generation copy of %s in %s: %.1f M parameters, %.0f MiB, built in %.3f s",
                type(model).__name__, dtype, numel / 1e6,
                numel * torch.finfo(dtype).bits / 8 / 2**20, time.perf_counter() - start)
    return cached, 0.0


def static_cache_holds_two_dtypes() -> bool:
    """Whether the installed transformers' static cache keeps keys and values in their own
    dtypes (5.24 does; 5.17 allocates both in the keys' dtype)."""
    from transformers.cache_utils import StaticLayer

    try:
        layer = StaticLayer(max_cache_len=1)
        layer.lazy_initialization(torch.zeros(1, 1, 1, 1, dtype=torch.float32),
                                  torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16))
        return layer.values.dtype == torch.bfloat16
    except Exception:  # another layout: take the copy, which works on every version
        return False
