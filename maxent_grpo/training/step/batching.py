"""Micro-batches of whole groups, packed by length under a token budget.

The step's ``B*G`` rows (prompt-major: group ``b`` is rows ``b*G .. b*G + G-1``) are
``[prompt (left-padded to P) | completion (right-padded to T)]``. A micro-batch takes whole
groups only (the per-group targets and the loss reductions rely on it) and keeps only the
columns some of its rows use: from its first real prompt column to its longest completion.
The loss is the same for any partition: every reduction counts rows and tokens of the
whole batch (``num_rows``, ``num_global_tokens``, ``max_completion_length``), and padding
columns are masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class MicroBatchPlan:
    """One micro-batch: ``groups`` (group indices), ``rows`` ``(n,)`` (their rows, group by
    group), both on the masks' device, and the kept columns: prompt columns from
    ``prompt_start`` and the first ``completion_len`` completion columns. A ``padding``
    micro-batch is a pass that only keeps the ranks in step (:func:`equal_passes`): it runs
    its forward and backward at weight zero and counts nowhere."""

    groups: Tensor
    rows: Tensor
    prompt_start: int
    completion_len: int
    padding: bool = False

    def columns(self, prompt_len: int) -> slice:
        """The kept columns of a ``[prompt | completion]`` row of prompt length ``P``."""
        return slice(self.prompt_start, prompt_len + self.completion_len)


def plan_micro_batches(
    prompt_mask: Tensor,
    completion_mask: Tensor,
    group_size: int,
    max_groups: int | None = None,
    max_tokens: int | None = None,
) -> list[MicroBatchPlan]:
    """Partition the groups into micro-batches: sorted by length (longest prompt plus
    longest completion of the group, longest first), groups are added in that order while
    the micro-batch holds at most ``max_groups`` groups and its padded size,
    ``rows * (prompt columns + completion columns)``, is at most ``max_tokens`` (each >= 1,
    or None: no limit). A group larger than ``max_tokens`` alone forms a micro-batch.

    ``prompt_mask`` is ``(B*G, P)`` bool (left-padded prompts), ``completion_mask``
    ``(B*G, T)`` bool, each row True up to its last token (a prefix).
    """
    N, P = prompt_mask.shape
    if completion_mask.shape[0] != N:
        raise ValueError(
            f"prompt_mask and completion_mask must have the same rows; got {N} and "
            f"{completion_mask.shape[0]}"
        )
    if group_size < 1 or N % group_size:
        raise ValueError(f"group_size must divide the {N} rows; got {group_size}")
    if max_groups is not None and max_groups < 1:
        raise ValueError(f"max_groups must be None or >= 1; got {max_groups}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be None or >= 1; got {max_tokens}")
    B, G = N // group_size, group_size
    prompt_len = prompt_mask.sum(-1).view(B, G).amax(-1)  # (B,)
    completion_len = completion_mask.sum(-1).view(B, G).amax(-1)  # (B,)
    prompt_len_list, completion_len_list = prompt_len.tolist(), completion_len.tolist()
    order = sorted(range(B), key=lambda b: -(prompt_len_list[b] + completion_len_list[b]))

    def size(groups: list[int]) -> int:
        width = max(prompt_len_list[b] for b in groups) + max(
            completion_len_list[b] for b in groups
        )
        return len(groups) * G * width

    chunks: list[list[int]] = []
    current: list[int] = []
    for b in order:
        grown = current + [b]
        fits = (max_groups is None or len(grown) <= max_groups) and (
            max_tokens is None or size(grown) <= max_tokens
        )
        if current and not fits:
            chunks.append(current)
            grown = [b]
        current = grown
    chunks.append(current)

    plans = []
    for groups in chunks:
        groups.sort()  # prompt-major inside the micro-batch
        g = torch.tensor(groups, dtype=torch.long, device=prompt_mask.device)
        rows = (g[:, None] * G + torch.arange(G, device=prompt_mask.device)).reshape(-1)
        plans.append(MicroBatchPlan(
            groups=g, rows=rows,
            prompt_start=P - max(prompt_len_list[b] for b in groups),
            completion_len=max(completion_len_list[b] for b in groups),
        ))
    return plans


def equal_passes(plans: list[MicroBatchPlan], passes: int) -> list[MicroBatchPlan]:
    """``plans`` followed by padding micro-batches up to ``passes`` in all: each the first
    group of the last plan with one completion column, marked ``padding``.

    Every rank must run as many forward and backward passes as the others: under FSDP2 each
    forward all-gathers the parameters and each backward reduce-scatters the gradients, so
    a rank that planned fewer micro-batches (``drop_constant_groups``, a token budget) would
    leave the others waiting in a collective. ``passes`` is the most any rank planned."""
    if len(plans) >= passes:
        return plans
    if not plans:
        raise ValueError("equal_passes needs at least one micro-batch to pad with")
    last = plans[-1]
    G = last.rows.numel() // last.groups.numel()
    pad = MicroBatchPlan(groups=last.groups[:1], rows=last.rows[:G],
                         prompt_start=last.prompt_start, completion_len=1, padding=True)
    return plans + [pad] * (passes - len(plans))
