"""Dynamic sampling with refill (``model.refill_rounds``; DAPO's dynamic sampling).

With ``model.drop_constant_groups`` a group whose G rewards are all equal is left out of
the update. With ``refill_rounds = R > 0`` a step whose batch has fewer than ``B`` groups
with differing rewards draws ``B`` more prompts from the DataModule's refill stream
(:meth:`~maxent_grpo.training.data.datamodule.PromptDataModule.refill_batch`), rolls them
out and scores them, up to ``R`` times, until it holds ``B`` such groups. The step then
trains on exactly ``B`` groups: the first ``B`` with differing rewards (or solved,
``model.solved_reward``) in the order drawn (the batch's own first), completed with
constant groups (dropped as before) when ``R`` rounds were not enough. Under several ranks
a round runs while *some* rank needs one, so every rank generates as often (FSDP2's
sharded generate needs all of them); a rank that is already full keeps its first ``B``.
The rounds are logged (``train/refill_rounds``) and the stream's position is in the
checkpoint, so a resumed run draws the same prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from maxent_grpo.core import droppable_groups
from maxent_grpo.rollout import GenerationBatch, RolloutOutput
from maxent_grpo.rollout.protocol import ToolUsage
from maxent_grpo.validation import require

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
    require(draw is not None,
            "model.refill_rounds draws new prompts from the PromptDataModule's refill stream, "
            "and this run has no PromptDataModule (pass datamodule=PromptDataModule(...) to "
            "fit); or set model.refill_rounds: 0")
    return draw


def refill(
    first: Scored, draw: Callable[[int], dict[str, Any]],
    roll_out: Callable[[dict[str, Any]], Scored], rounds: int, any_rank: Callable[[bool], bool],
    pad_id: int, solved_reward: float | None = None,
) -> tuple[Scored, int]:
    """``(the step's B groups, rounds run)`` from the scored batch ``first``: while fewer
    than ``B`` groups have differing rewards on some rank (``any_rank``) and fewer than
    ``rounds`` rounds ran, ``roll_out(draw(B))`` another ``B`` prompts (see the module
    docstring); a solved group (``model.solved_reward``) counts as one that varies.
    ``first`` itself is returned when no round runs."""
    B, G = first[2].shape
    pools = [first]
    constant = [droppable_groups(first[2], solved_reward).tolist()]  # per pool, per group
    while len(pools) <= rounds and any_rank(sum(not c for cs in constant for c in cs) < B):
        pools.append(roll_out(draw(B)))
        constant.append(droppable_groups(pools[-1][2], solved_reward).tolist())
    if len(pools) == 1:
        return first, 0
    ranked = sorted((c, k, g) for k, cs in enumerate(constant) for g, c in enumerate(cs))
    chosen = sorted((k, g) for _, k, g in ranked[:B])
    return concat_groups(pools, chosen, G, pad_id), len(pools) - 1


def concat_groups(pools: list[Scored], chosen: list[tuple[int, int]], G: int,
                  pad_id: int) -> Scored:
    """The groups ``chosen`` (``(pool, group)`` pairs, in that order) of several scored
    rollouts as one: prompts re-padded on the left, completions on the right, both cut to
    the columns the chosen rows use."""
    picked: dict[int, list[int]] = {}
    for k, g in chosen:
        picked.setdefault(k, []).append(g)
    parts = [(pools[k], groups, [g * G + j for g in groups for j in range(G)])
             for k, groups in picked.items()]
    rollouts = [scored[1] for scored, _, _ in parts]
    P = max(r.prompt_ids.shape[1] for r in rollouts)
    T = max(r.completion_ids.shape[1] for r in rollouts)

    def rows_of(name: str, width: int | None = None, value: Any = None,
                left: bool = False) -> Tensor:
        return torch.cat([_pad(getattr(scored[1], name)[rows], width, value, left)
                          for scored, _, rows in parts])

    prompt_mask = rows_of("prompt_mask", P, False, left=True)
    completion_mask = rows_of("completion_mask", T, False)
    used_p = prompt_mask.any(0).nonzero()
    used_t = completion_mask.any(0).nonzero()
    p0 = int(used_p[0]) if len(used_p) else P
    t1 = int(used_t[-1]) + 1 if len(used_t) else 1
    sampler = tool_mask = tools = None
    if all(r.sampler_logps is not None for r in rollouts):
        sampler = rows_of("sampler_logps", T, 0.0)[:, :t1]
    if all(r.tools is not None for r in rollouts):  # multi-turn rollouts
        tool_mask = rows_of("tool_mask", T, False)[:, :t1]
        tools = ToolUsage.cat([scored[1].tools.rows(rows) for scored, _, rows in parts])
    texts = GenerationBatch.cat([scored[1].batch.select(groups) for scored, groups, _ in parts])
    rollout = RolloutOutput(
        batch=texts, prompt_ids=rows_of("prompt_ids", P, pad_id, left=True)[:, p0:],
        prompt_mask=prompt_mask[:, p0:],
        completion_ids=rows_of("completion_ids", T, pad_id)[:, :t1],
        completion_mask=completion_mask[:, :t1], truncated=rows_of("truncated"),
        generate_seconds=sum(scored[1].generate_seconds for scored in pools),
        sampler_logps=sampler, tool_mask=tool_mask, tools=tools,
    )
    batch = _take_batch([(scored[0], groups) for scored, groups, _ in parts])
    rewards = torch.cat([scored[2][groups] for scored, groups, _ in parts])
    components = torch.cat([scored[3][:, rows] for scored, _, rows in parts], dim=1)
    return batch, rollout, rewards, components


def _pad(t: Tensor, width: int | None, value: Any, left: bool = False) -> Tensor:
    """``t`` ``(n, w)`` padded with ``value`` to ``width`` columns (None: ``t`` as it is)."""
    if width is None or width == t.shape[1]:
        return t
    missing = width - t.shape[1]
    return torch.nn.functional.pad(t, (missing, 0) if left else (0, missing), value=value)


def _take_batch(parts: list[tuple[dict[str, Any], list[int]]]) -> dict[str, Any]:
    """The groups of each batch dict (``collate_prompts``' keys), concatenated."""
    out: dict[str, Any] = {}
    for key in parts[0][0]:
        if key == "columns":
            names = parts[0][0]["columns"]
            out[key] = {n: [b["columns"][n][g] for b, gs in parts for g in gs] for n in names}
        else:
            out[key] = [b[key][g] for b, gs in parts for g in gs]
    return out
