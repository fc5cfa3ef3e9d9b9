"""Shared pieces of the objectives' tests: no model; every ``MicroBatch`` is built from
small float64 tensors, and each loss is compared with a naive formula written out in plain
Python floats (docs/ALGORITHM.md §3-4)."""

from __future__ import annotations

import math
import statistics

import torch

from maxent_grpo.objectives import (
    MicroBatch,
)

F64 = torch.float64
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")

# GRPO fixture: B = 3 prompts, G = 2, T = 4 padded tokens, T_max = 5 (> T, so dr_grpo's
# normaliser is visibly T_max, not T). Row 4 is fully masked (a truncated completion).
G2 = 2
T4 = 4
T_MAX5 = 5
LENGTHS = [4, 2, 3, 1, 0, 3]
REWARDS = [[1.0, 0.0], [0.5, 2.0], [3.0, -1.0]]


# ------------------------------------------------------------------ helpers


def _mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def _logps(seed: int, n: int, T: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return -3.0 * torch.rand(n, T, generator=gen, dtype=F64) - 0.05


def _mb(
    logps: torch.Tensor,
    mask: torch.Tensor,
    *,
    G: int,
    num_rows: int,
    t_max: int,
    advantages: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    old: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    num_micro_batches: int = 1,
    num_global_tokens: torch.Tensor | None = None,
    correction: torch.Tensor | None = None,
) -> MicroBatch:
    return MicroBatch(
        token_logps=logps,
        old_token_logps=old,
        ref_token_logps=ref,
        mask=mask,
        entropy=entropy,
        advantages=advantages,
        weights=weights,
        group_size=G,
        num_rows=num_rows,
        num_micro_batches=num_micro_batches,
        max_completion_length=t_max,
        num_global_tokens=num_global_tokens,
        correction=correction,
    )


def _naive_adv(rewards: list[list[float]], scale: str) -> list[float]:
    """Flattened group advantages: r - mean, divided by (ddof-1 std + 1e-4) for 'group'."""
    flat = [r for group in rewards for r in group]
    out = []
    for group in rewards:
        mean = sum(group) / len(group)
        for r in group:
            a = r - mean
            if scale == "group":
                a /= statistics.stdev(group) + 1e-4
            elif scale == "batch":
                a /= statistics.stdev(flat) + 1e-4
            out.append(a)
    return out


def _row_weight(loss_type: str, lengths: list[int], n_rows: int, t_max: int) -> list[float]:
    """Factor each masked token of row i gets in the reduction (docs/ALGORITHM.md §3)."""
    total = sum(lengths)
    if loss_type == "grpo":
        return [1.0 / (n_rows * max(n, 1)) for n in lengths]
    if loss_type == "bnpo":
        return [1.0 / max(total, 1)] * len(lengths)
    if loss_type == "dr_grpo":
        return [1.0 / (n_rows * t_max)] * len(lengths)
    return [1.0 / total] * len(lengths)  # dapo, one micro-batch = the whole step


def _softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    e = [math.exp(x - top) for x in xs]
    return [v / sum(e) for v in e]


def _k3(logp: float, ref: float) -> float:
    d = ref - logp
    return math.exp(d) - d - 1.0


def _grpo_setup(beta: float, seed: int = 0):
    n = len(LENGTHS)
    logps = _logps(seed, n, T4)
    ref = _logps(seed + 1, n, T4) if beta > 0 else None
    mask = _mask(LENGTHS, T4)
    adv = torch.tensor(_naive_adv(REWARDS, "group"), dtype=F64)
    return logps, ref, mask, adv


def _old_or_none(kind: str, logps: torch.Tensor) -> torch.Tensor | None:
    if kind == "none":
        return None
    gen = torch.Generator().manual_seed(11)
    return logps + 0.4 * torch.randn(logps.shape, generator=gen, dtype=F64)
