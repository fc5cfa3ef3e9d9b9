"""Dynamic sampling with refill (``model.refill_rounds``; DAPO's dynamic sampling).

With ``model.drop_constant_groups`` a group whose G rewards are all equal is left out of
the update. With ``refill_rounds = R > 0`` a step whose batch has fewer than ``B`` groups
with differing rewards draws ``B`` more prompts from the DataModule's refill stream
(:meth:`~maxent_grpo.training.data.datamodule.PromptDataModule.refill_batch`), rolls them
out and scores them, up to ``R`` times, until it holds ``B`` such groups. The step then
trains on exactly ``B`` groups: the first ``B`` with differing rewards in the order drawn
(the batch's own first), completed with constant groups (dropped as before) when ``R``
rounds were not enough. Under several ranks a round runs while *some* rank needs one, so
every rank generates as often (FSDP2's sharded generate needs all of them); a rank that is
already full keeps its first ``B``. The rounds are logged (``train/refill_rounds``) and the
stream's position is in the checkpoint, so a resumed run draws the same prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from maxent_grpo.core import constant_groups
from maxent_grpo.rollout import GenerationBatch, RolloutOutput

#: one scored rollout: (batch dict, rollout, rewards (B, G), components (K, B*G))
Scored = tuple[dict[str, Any], RolloutOutput, Tensor, Tensor]


def pad_id(rollout: RolloutOutput, engine: Any) -> int:
    """The pad id a rollout already uses (a masked completion or prompt position), else the
    engine's tokenizer's, else 0."""
    for ids, mask in ((rollout.completion_ids, rollout.completion_mask),
                      (rollout.prompt_ids, rollout.prompt_mask)):
        padded = ids[~mask]
        if padded.numel():
            return int(padded[0])
    pad = getattr(getattr(engine, "tokenizer", None), "pad_token_id", None)
    return int(pad) if pad is not None else 0


def refill_source(trainer: Any) -> Callable[[int], dict[str, Any]]:
    """The trainer's DataModule's ``refill_batch``; a ValueError naming the fix without one."""
    draw = getattr(getattr(trainer, "datamodule", None), "refill_batch", None)
    if draw is None:
        raise ValueError(
            "model.refill_rounds draws new prompts from the PromptDataModule's refill stream, "
            "and this run has no PromptDataModule (pass datamodule=PromptDataModule(...) to "
            "fit); or set model.refill_rounds: 0")
    return draw


def refill(
    first: Scored, draw: Callable[[int], dict[str, Any]],
    roll_out: Callable[[dict[str, Any]], Scored], rounds: int, any_rank: Callable[[bool], bool],
    pad_id: int,
) -> tuple[Scored, int]:
    """``(the step's B groups, rounds run)`` from the scored batch ``first``: while fewer
    than ``B`` groups have differing rewards on some rank (``any_rank``) and fewer than
    ``rounds`` rounds ran, ``roll_out(draw(B))`` another ``B`` prompts (see the module
    docstring). ``first`` itself is returned when no round runs."""
    B, G = first[2].shape
    pools, ran = [first], 0
    varied = int((~constant_groups(first[2])).sum())
    while ran < rounds and any_rank(varied < B):
        scored = roll_out(draw(B))
        pools.append(scored)
        varied += int((~constant_groups(scored[2])).sum())
        ran += 1
    if ran == 0:
        return first, 0
    ranked = sorted(
        ((bool(constant_groups(p[2])[g]), k, g) for k, p in enumerate(pools) for g in range(B)))
    chosen = sorted((k, g) for _, k, g in ranked[:B])
    return concat_groups(pools, chosen, G, pad_id), ran


def concat_groups(pools: list[Scored], chosen: list[tuple[int, int]], G: int,
                  pad_id: int) -> Scored:
    """The groups ``chosen`` (``(pool, group)`` pairs, in that order) of several scored
    rollouts as one: prompts re-padded on the left, completions on the right, both cut to
    the columns the chosen rows use."""
    rows: dict[int, list[int]] = {}
    for k, g in chosen:
        rows.setdefault(k, []).extend(range(g * G, (g + 1) * G))
    parts = [(pools[k], idx) for k, idx in rows.items()]
    batch = _take_batch([(p[0], sorted({i // G for i in idx})) for p, idx in parts])
    rollouts = [p[1] for p, _ in parts]
    P = max(r.prompt_ids.shape[1] for r in rollouts)
    T = max(r.completion_ids.shape[1] for r in rollouts)
    prompt_ids = torch.cat([_pad(r.prompt_ids[i], P, pad_id, left=True) for (_, i), r in
                            zip(parts, rollouts, strict=True)])
    prompt_mask = torch.cat([_pad(r.prompt_mask[i], P, False, left=True) for (_, i), r in
                             zip(parts, rollouts, strict=True)])
    completion_ids = torch.cat([_pad(r.completion_ids[i], T, pad_id) for (_, i), r in
                                zip(parts, rollouts, strict=True)])
    completion_mask = torch.cat([_pad(r.completion_mask[i], T, False) for (_, i), r in
                                 zip(parts, rollouts, strict=True)])
    sampler = None
    if all(r.sampler_logps is not None for r in rollouts):
        sampler = torch.cat([_pad(r.sampler_logps[i], T, 0.0) for (_, i), r in
                             zip(parts, rollouts, strict=True)])
    keep_p = prompt_mask.any(0).nonzero()
    keep_t = completion_mask.any(0).nonzero()
    p0 = int(keep_p[0]) if len(keep_p) else P
    t1 = int(keep_t[-1]) + 1 if len(keep_t) else 1
    texts = GenerationBatch(
        prompts=[t for r, (_, i) in zip(rollouts, parts, strict=True)
                 for t in _groups(r.batch.prompts, i, G)],
        grouped_completions=[c for r, (_, i) in zip(rollouts, parts, strict=True)
                             for c in _groups(r.batch.grouped_completions, i, G)])
    rollout = RolloutOutput(
        batch=texts, prompt_ids=prompt_ids[:, p0:], prompt_mask=prompt_mask[:, p0:],
        completion_ids=completion_ids[:, :t1], completion_mask=completion_mask[:, :t1],
        truncated=torch.cat([r.truncated[i] for (_, i), r in zip(parts, rollouts,
                                                                  strict=True)]),
        generate_seconds=sum(p[1].generate_seconds for p in pools),
        sampler_logps=None if sampler is None else sampler[:, :t1],
    )
    rewards = torch.cat([p[2][sorted({j // G for j in i})] for p, i in parts])
    components = torch.cat([p[3][:, i] for p, i in parts], dim=1)
    return batch, rollout, rewards, components


def _groups(items: list, rows: list[int], G: int) -> list:
    return [items[g] for g in sorted({i // G for i in rows})]


def _pad(t: Tensor, width: int, value: Any, left: bool = False) -> Tensor:
    missing = width - t.shape[1]
    if missing == 0:
        return t
    fill = torch.full((t.shape[0], missing), value, dtype=t.dtype, device=t.device)
    return torch.cat([fill, t] if left else [t, fill], dim=1)


def _take_batch(parts: list[tuple[dict[str, Any], list[int]]]) -> dict[str, Any]:
    """The rows ``groups`` of each batch dict (``collate_prompts``' keys), concatenated."""
    out: dict[str, Any] = {}
    for key in parts[0][0]:
        if key == "columns":
            names = parts[0][0]["columns"]
            out[key] = {n: [b["columns"][n][g] for b, gs in parts for g in gs] for n in names}
        else:
            out[key] = [b[key][g] for b, gs in parts for g in gs]
    return out
