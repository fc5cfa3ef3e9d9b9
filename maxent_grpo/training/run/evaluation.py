"""Evaluation: sample, grade, and the metric dict of an epoch (docs/ALGORITHM.md §6).

Lightning-free. The :class:`Evaluator` samples ``n`` completions per prompt (plus one
greedy one), grades them with the training rewards and keeps one :class:`PromptRecord` per
prompt; :func:`evaluation_metrics` turns the epoch's records into exact means over its
prompts (:func:`maxent_grpo.core.at_k.aggregate`):

- ``{prefix}/pass@k``, ``{prefix}/mean@k``, ``{prefix}/distinct@k`` for every ``k``;
- ``{prefix}/distinct_correct@k``: distinct correct answers among ``k`` samples;
- ``{prefix}/coverage@k`` over the prompts that have a valid-answer set;
- ``{prefix}/greedy_pass@1``: the mean greedy correctness;
- ``{prefix}/answer_entropy``: the mean over prompts of the entropy (nats) of its ``n``
  answers, canonical as ``train/answer_entropy`` reads them;
- the same keys with ``/{task}`` appended, over the prompts of each task label, when the
  records hold two task labels or more (one would repeat the totals, and a metric name that
  is also a folder of names breaks MLflow's file store: ``val/pass@1`` beside
  ``val/pass@1/arithmetic_easy`` stopped a run at its first validation).

Answers: :func:`sample_answer`; ``distinct@k``, ``distinct_correct@k`` and the entropy
compare them as :func:`~maxent_grpo.rewards.answers.compared_answer` does (the canonical form
under the prompt's ``answer_form``, expressions by default, else the text with whitespace
collapsed); coverage counts only answers that have a canonical form.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from maxent_grpo.core.advantages import answer_entropy
from maxent_grpo.core.at_k import aggregate
from maxent_grpo.rewards import TrainerState, WeightedRewards
from maxent_grpo.rewards.answers import (
    BOLD,
    canonical_answer,
    compared_answer,
    prompt_opens_think,
    sample_answer,
)
from maxent_grpo.rewards.task_rewards import json_cell
from maxent_grpo.rollout import RolloutEngine, SamplingSettings, checked_rollout
from maxent_grpo.training.run.checkpoint import capture_rng_state, restore_rng_state
from maxent_grpo.training.settings import EvaluationSettings
from maxent_grpo.training.step.metrics import (
    RewardComponentsMetric,
    RewardMomentsMetric,
    all_gather_objects,
)
from maxent_grpo.validation import require

__all__ = ["Evaluator", "PromptRecord", "evaluation_metrics", "sample_answer"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptRecord:
    """What the evaluation of one prompt produced.

    Attributes:
        correct: ``n`` values, 1.0 when the sample's eval reward reached the threshold.
        answers: ``n`` answers (:func:`sample_answer`), ``None`` when a sample gave none.
        valid_answers: the prompt's full set of canonical correct answers, or ``None``.
        task: the prompt's task label (the ``task`` column), or ``None``.
        greedy_correct: 1.0 / 0.0 for the greedy completion, ``None`` without greedy.
        answer_form: how answers are compared (the ``answer_form`` column,
            :func:`~maxent_grpo.rewards.answers.canonical_answer`); ``None``: expressions.
        row: the prompt's row in its split (``None`` when unknown): a prompt a padding
            sampler repeats on another rank is counted once.
        rewards: the ``n`` samples' total rewards.
        components: each reward function's ``n`` values (NaN: not applicable).
        ungraded: of its completions (the ``n`` samples and the greedy one), how many the
            eval reward did not grade (counted not correct).
    """

    correct: tuple[float, ...]
    answers: tuple[str | None, ...]
    valid_answers: frozenset[str] | None = None
    task: str | None = None
    greedy_correct: float | None = None
    answer_form: str | None = None
    row: int | None = None
    rewards: tuple[float, ...] = ()
    components: tuple[tuple[float, ...], ...] = ()
    ungraded: int = 0


def _metrics(records: Sequence[PromptRecord], ks: Sequence[int]) -> dict[str, float]:
    correct = [list(r.correct) for r in records]
    # answers compared as everywhere else (train/distinct_correct, answer_entropy): in the
    # canonical form of the row's answer_form ("5 + 4" and "4 + 5" are one), else as text
    compared = [[compared_answer(a, r.answer_form) for a in r.answers] for r in records]
    out = aggregate(correct, ks, answers=compared)
    valid = [r.valid_answers for r in records]
    if any(v is not None for v in valid):
        valid = [  # in the canonical form of the prompt's answer_form, as the answers
            v if v is None else frozenset(c for a in v if (c := canonical_answer(
                a, r.answer_form)) is not None) or None
            for v, r in zip(valid, records, strict=True)]
        canonical = [  # a correct answer the set does not list covers nothing
            [c if ok and v is not None and (c := canonical_answer(
                None if a is None else BOLD.sub(r"\1", a), r.answer_form)) in v  # **72**: 72
             else None for a, ok in zip(r.answers, r.correct, strict=True)]
            for r, v in zip(records, valid, strict=True)
        ]
        coverage = aggregate(correct, ks, answers=canonical, valid_answers=valid)
        out.update({k: v for k, v in coverage.items() if k.startswith("coverage@")})
    out["answer_entropy"] = sum(  # as train/answer_entropy compares them
        answer_entropy([compared_answer(a, r.answer_form) for a in r.answers])
        for r in records) / len(records)
    greedy = [r.greedy_correct for r in records if r.greedy_correct is not None]
    if greedy:
        out["greedy_pass@1"] = sum(greedy) / len(greedy)
    return out


def valid_answer_set(value: Any, form: str | None) -> tuple[frozenset[str], list[Any]]:
    """A row's ``valid_answers`` (a list of answers, or that list as JSON text: a CSV cell)
    in the canonical form of its ``answer_form``, and what has none: the members that are
    no answer of that form, or the whole value when it is no list."""
    members = json_cell(value)
    if not isinstance(members, (list, tuple)):
        return frozenset(), [value]
    pairs = [(m, None if isinstance(m, bool) else canonical_answer(str(m), form))
             for m in members]
    return (frozenset(a for _, a in pairs if a is not None),
            [m for m, a in pairs if a is None])


def evaluation_metrics(
    records: Sequence[PromptRecord], ks: Sequence[int], prefix: str
) -> dict[str, float]:
    """The logged metrics of an evaluation epoch: ``{prefix}/{metric}`` over all records
    and ``{prefix}/{metric}/{task}`` over the records of each task label, two or more (see
    the module docstring). Empty ``records`` give ``{}``.

    >>> r = [PromptRecord((1.0, 0.0), ("8", "9"), task="a"),
    ...      PromptRecord((0.0, 0.0), ("1", "1"), task="b")]
    >>> m = evaluation_metrics(r, [1, 2], "val")
    >>> m["val/pass@2"], m["val/pass@1/a"], m["val/distinct@2"]
    (0.5, 0.5, 1.5)
    """
    if not records:
        return {}
    out = {f"{prefix}/{k}": v for k, v in _metrics(records, ks).items()}
    tasks = sorted({r.task for r in records if r.task is not None})
    for task in tasks if len(tasks) > 1 else []:  # one task: its keys are the totals
        subset = [r for r in records if r.task == task]
        out.update({f"{prefix}/{k}/{task}": v for k, v in _metrics(subset, ks).items()})
    return out


def prediction_row(batch: dict[str, Any], b: int, j: int, completion: Any, total: Tensor,
                   components: Tensor, names: Sequence[str], correct: float | None,
                   truncated: bool) -> dict[str, Any]:
    """One graded completion as ``predict`` writes it: the prompt's source ``row`` index,
    ``sample`` ``j``, the ``prompt`` (text or messages), the reference ``answer``, the
    ``completion`` (text) or, for a multi-turn rollout, its ``messages``, ``rewards`` (each
    reward function's value, ``None`` where it gave none), the weighted ``reward``, the
    parsed ``parsed_answer`` (:func:`sample_answer`), ``compared_answer`` (the form
    ``distinct@k`` and ``answer_entropy`` count: :func:`compared_answer` under the row's
    ``answer_form``), ``correct`` (None where the eval reward gave none: that reward reads
    the completion its own way) and ``truncated`` (cut at
    ``max_completion_length``: no stop token; a multi-turn row's last turn or a tool's reply
    cut there)."""
    def value(x: Tensor) -> float | None:
        return None if bool(torch.isnan(x)) else float(x)

    key = "completion" if isinstance(completion, str) else "messages"
    task = batch["columns"].get("task", [None] * len(batch["prompts"]))[b]
    form = batch["columns"].get("answer_form", [None] * len(batch["prompts"]))[b]
    parsed = sample_answer(completion, prompt_opens_think(batch["prompts"][b]))
    return {
        "row": batch["indices"][b], "sample": j, "prompt": batch["raw_prompts"][b],
        "answer": batch["answers"][b], key: completion,
        "rewards": {name: value(v) for name, v in zip(names, components, strict=True)},
        "reward": value(total),
        "parsed_answer": parsed,
        "compared_answer": compared_answer(parsed, None if form is None else str(form)),
        "correct": None if correct is None else bool(correct), "truncated": bool(truncated),
        **({"task": task} if task is not None else {}),
    }


class Evaluator(torch.nn.Module):
    """Validation and test of the module: per batch :meth:`step`, per epoch :meth:`compute`.

    Args:
        rewards: the training rewards (they grade the samples).
        settings: the module's ``EvaluationSettings`` (n, grading reward and threshold, k,
            greedy).

    Under DDP the records of every rank are gathered (``all_gather_object``), so every rank
    computes the same @k values (a prompt a padding sampler repeats counts once).
    """

    def __init__(self, rewards: WeightedRewards, settings: EvaluationSettings) -> None:
        super().__init__()
        self.rewards = rewards
        self.settings = settings
        self.reward = RewardMomentsMetric()
        self.components = RewardComponentsMetric(rewards.names)
        self.records: list[PromptRecord] = []  # this rank's prompts, this epoch
        self.unread_answers = False  # a row's valid_answers partly unread: warned once
        self.ungraded_warned = False  # some completions' eval_reward None: warned once
        self.timed_out = 0  # this epoch's eval-reward calls that timed out
        self.stream: dict[str, Any] | None = None  # this epoch's random state between batches

    def step(self, batch: dict[str, Any], engine: RolloutEngine,
             greedy_sampling: SamplingSettings | None,
             trainer_state: TrainerState | None = None) -> list[dict[str, Any]]:
        """Sample, grade and record one batch (plus one ``greedy_sampling`` completion per
        prompt when ``settings.greedy`` and ``greedy_sampling`` is given), in a forked random
        state that goes on from the epoch's last batch (each batch began from the training's
        state, so every batch drew the same numbers: one batch's samples repeated), the
        training's left as it was; the rewards get ``trainer_state``. Returns one
        :func:`prediction_row` per completion."""
        lacks = [k for k in ("prompts", "raw_prompts", "answers", "columns", "indices")
                 if k not in batch]
        require(not lacks, f"an evaluation batch has no {', '.join(map(repr, lacks))}: a "
                "DataLoader of yours must yield the batches collate_prompts makes "
                "(maxent_grpo.training.data.collate_prompts over PromptExample rows)")
        n, B = self.settings.num_generations, len(batch["prompts"])
        device = self.reward.total.device
        prompts, answers = batch["prompts"], batch["answers"]
        training = capture_rng_state()  # torch's, the GPUs', python's and numpy's
        try:
            if self.stream is not None:
                restore_rng_state(self.stream)
            rollout = checked_rollout(engine, engine.generate(prompts, answers, n), B, n)
            greedy = (checked_rollout(engine, engine.generate(
                prompts, answers, 1, greedy_sampling), B, 1)
                if self.settings.greedy and greedy_sampling is not None else None)
            # graded in it too: a reward drawing random numbers took them from the
            # training's stream, whose later rollouts then differed with validation on
            timeouts = self._timeouts()
            total, components = self.rewards.score_rollout(
                rollout, batch["raw_prompts"], batch["columns"], trainer_state, device)
            correct = self._correct(components[self.settings.reward_index], timeouts)
            greedy_correct: list[float | None] = [None] * B
            greedy_ungraded = [False] * B
            if greedy is not None:
                timeouts = self._timeouts()
                _, greedy_components = self.rewards.score_rollout(
                    greedy, batch["raw_prompts"], batch["columns"], trainer_state, device)
                judged_greedy = greedy_components[self.settings.reward_index]
                greedy_correct = self._correct(judged_greedy, timeouts)
                greedy_ungraded = torch.isnan(judged_greedy).tolist()
            self.stream = capture_rng_state()
        finally:
            restore_rng_state(training)
        completions = rollout.reward_completions()  # texts, or a multi-turn rollout's messages
        self.reward.update(total.to(device).view(B, n))
        self.components.update(components.to(device))
        self.rewards.take_logged()  # what the functions' log_metric gave: training's only
        columns = batch["columns"]
        rows = []  # the rewards on the host once (not a copy, and a sync, per prompt)
        totals, values = total.view(B, n).tolist(), components.view(-1, B, n).tolist()
        truncated = rollout.truncated.tolist()
        judged = values[self.settings.reward_index]  # (B, n); NaN: not graded
        for b in range(B):
            valid = columns.get("valid_answers", [None] * B)[b]
            task = columns.get("task", [None] * B)[b]
            form = columns.get("answer_form", [None] * B)[b]
            if valid is not None:
                valid, unread = valid_answer_set(valid, form)
                if (unread or not valid) and not self.unread_answers:
                    self.unread_answers = True
                    log.warning(
                        "prompt %s: valid_answers %s have no canonical form under answer_form "
                        "%s (canonical_answer); coverage@k counts only the others (a row "
                        "with none is left out of it); further such rows are not named",
                        batch["indices"][b], repr(unread)[:200], form or "expression")
                valid = valid or None
            self.records.append(PromptRecord(
                correct=tuple(correct[b * n:(b + 1) * n]),
                answers=tuple(sample_answer(c, prompt_opens_think(prompts[b]))
                              for c in completions[b * n:(b + 1) * n]),
                valid_answers=valid,
                task=None if task is None else str(task),
                greedy_correct=greedy_correct[b],
                answer_form=None if form is None else str(form),
                row=batch["indices"][b],
                rewards=tuple(totals[b]),
                components=tuple(tuple(value[b]) for value in values),
                ungraded=sum(v != v for v in judged[b]) + greedy_ungraded[b],
            ))
            rows += [prediction_row(batch, b, j, completions[b * n + j], total.view(-1)[b * n + j],
                                    components[:, b * n + j], self.rewards.names,
                                    None if judged[b][j] != judged[b][j]
                                    else correct[b * n + j], truncated[b * n + j])
                     for j in range(n)]
        return rows

    def _timeouts(self) -> int:
        """The eval reward's time-outs so far (a ``TimedReward``'s count; 0 without one)."""
        return getattr(self.rewards.funcs[self.settings.reward_index], "timeouts", 0)

    def _correct(self, values: Tensor, timeouts_before: int) -> list[float]:
        """0/1 correctness ``eval_reward >= eval_correct_threshold``; an ungraded (NaN)
        value is not correct (the record counts it for :meth:`_check_graded`, with whether
        the reward timed out since ``timeouts_before``)."""
        listed = values.tolist()  # one copy to the host: NaN is ungraded, and not >= anything
        self.timed_out += self._timeouts() > timeouts_before
        threshold = self.settings.correct_threshold
        return [1.0 if v >= threshold else 0.0 for v in listed]

    def _check_graded(self, graded: int, ungraded: int, timed_out: int, rank: int,
                      predicting: bool = False) -> bool:
        """Over the epoch and all ranks: samples the eval reward graded none of (without a
        time-out) raise ValueError (the rows lack the reference it reads), or when
        ``predicting`` (prompts without answers: what predict is for) are warned of and
        True returned (no @k); some ungraded ones are warned of once, counted not correct."""
        name = self.rewards.names[self.settings.reward_index]
        if ungraded and not graded and not timed_out and predicting:
            if rank == 0:
                log.warning("predict: model.eval_reward %r graded none of the %d completions "
                            "(the rows have no reference it reads): their 'correct' is null "
                            "and no @k is reported", name, ungraded)
            return True
        if ungraded and not graded and not timed_out:
            raise ValueError(
                f"model.eval_reward {name!r} returned None (not applicable) for every one of "
                f"the {ungraded} evaluation completions, so their correctness is unknown: the "
                "evaluation rows lack the reference it reads (an empty 'answer' column? set "
                "data.answer_column to the column holding the reference answers), or choose "
                "another model.eval_reward")
        if ungraded and not self.ungraded_warned and rank == 0:
            self.ungraded_warned = True
            log.warning(
                "model.eval_reward %r returned None (not applicable) for %d of %d evaluation "
                "completions (rows it does not grade, or a time-out's fallback: null): they "
                "count as not correct; for rows of several tasks choose an eval_reward that "
                "grades every row", name, ungraded, graded + ungraded)
        return False

    def restart(self) -> None:
        """An evaluation's start: nothing of one a failure cut short (whose :meth:`compute`,
        which resets, never ran) is counted again."""
        self.records, self.timed_out, self.stream = [], 0, None
        with torch.inference_mode(False):  # validate's fresh states, then a fit's updates
            self.reward.reset()
            self.components.reset()

    def compute(self, prefix: str) -> dict[str, float]:
        """``{prefix}/reward/...`` and the @k metrics of the epoch (``{}`` when nothing was
        evaluated), then reset for the next epoch."""
        counts = [self.reward.update_count, self.timed_out]
        dist = torch.distributed
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if distributed:  # decided together: a rank that saw no batch still joins the gathers
            total = torch.tensor(counts, dtype=torch.long, device=self.reward.total.device)
            dist.all_reduce(total)
            counts = total.tolist()
        seen = counts[0]
        if seen == 0:
            return {}
        reward, components, records = self.reward, self.components, self.records
        if distributed:
            records = [r for part in all_gather_objects(records) for r in part]
        rows: set[int] = set()  # a row a padding sampler (or a loader) repeated counts once
        unique = [r for r in records if r.row is None or not (r.row in rows or rows.add(r.row))]
        if distributed or len(unique) < len(records):
            records = unique  # and the moments of those prompts (the metrics count repeats)
            reward = RewardMomentsMetric(sync_on_compute=False)
            components = RewardComponentsMetric(self.rewards.names, sync_on_compute=False)
            for r in records:
                reward.update(torch.tensor([r.rewards], dtype=torch.float64))
                components.update(torch.tensor(r.components, dtype=torch.float64))
        values = {f"{prefix}/reward/{k}": v for k, v in reward.compute().items()}
        values.update({f"{prefix}/reward/{k}": v for k, v in components.compute().items()
                       if not torch.isnan(v)})  # graded nothing: left out, as in training
        values.update(evaluation_metrics(records, self.settings.k, prefix))
        self.restart()
        ungraded = sum(r.ungraded for r in records)  # of the prompts counted (once each)
        graded = sum(len(r.correct) + (r.greedy_correct is not None) for r in records) - ungraded
        if self._check_graded(graded, ungraded, counts[1],
                              rank=dist.get_rank() if distributed else 0,
                              predicting=prefix == "predict"):
            values = {k: v for k, v in values.items() if "@" not in k}  # correctness unknown
        return {k: float(v) for k, v in values.items()}
