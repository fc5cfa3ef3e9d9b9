"""Evaluation records and the metric dict of an evaluation epoch (ALGORITHM.md section 6).

Lightning-free. For every evaluation prompt the module keeps one :class:`PromptRecord`:
the 0/1 correctness of its ``n`` samples (``eval_reward >= eval_correct_threshold``), their
answers, its valid-answer set (tasks such as ``countdown_multi``), its task label and the
correctness of its greedy completion. :func:`evaluation_metrics` turns the epoch's records
into the logged dict through :func:`maxent_grpo.core.evaluation.aggregate`, so every value
is an exact mean over the epoch's prompts (not a mean of per-batch means):

- ``{prefix}/pass@k``, ``{prefix}/mean@k``, ``{prefix}/distinct@k`` for every ``k``;
- ``{prefix}/distinct_correct@k``: distinct correct answers among ``k`` samples (in the
  canonical form where the prompts have a valid-answer set);
- ``{prefix}/coverage@k`` over the prompts that have a valid-answer set;
- ``{prefix}/greedy_pass@1``: the mean greedy correctness;
- the same keys with ``/{task}`` appended, over the prompts of each task label.

Answers. A sample's answer is :func:`~maxent_grpo.rewards.parsing.extract_answer` of the
completion (``<answer>`` block, else ``\\boxed{}``), falling back to the stripped completion
for bare prompts; ``distinct@k`` compares answers with whitespace collapsed. For coverage a
correct answer is put in the task's canonical form (:func:`coverage_answer`: the left side
of ``expr = target``, ``×``/``÷`` read as ``*``/``/``, then
:func:`~maxent_grpo.tasks.multi_answer.canonical_expression`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from maxent_grpo.core.evaluation import aggregate
from maxent_grpo.rewards.parsing import completion_text, extract_answer
from maxent_grpo.tasks.multi_answer import canonical_expression

__all__ = ["PromptRecord", "coverage_answer", "evaluation_metrics", "sample_answer"]

_SYMBOLS = {"×": "*", "÷": "/", "\\times": "*", "\\div": "/", "\\cdot": "*"}


def sample_answer(completion: str | list[dict]) -> str | None:
    """The answer of one sample: :func:`extract_answer`, else the stripped completion
    (``None`` when that is empty).

    >>> sample_answer("<answer> 8 </answer>"), sample_answer(" 8 because "), sample_answer(" ")
    ('8', '8 because', None)
    """
    text = completion_text(completion)
    answer = extract_answer(text)
    if answer is None:
        answer = text.strip()
    return answer or None


def coverage_answer(answer: str | None) -> str | None:
    """The canonical form of an expression answer, for coverage@k: ``×``, ``÷``,
    ``\\times``, ``\\div``, ``\\cdot`` read as ``*`` and ``/``, the left side of one
    ``=`` kept, then :func:`canonical_expression` (``None`` when it is not an expression).

    >>> coverage_answer("5 × 3 + 1 = 16"), coverage_answer("hello") is None
    ('1 + 3 * 5', True)
    """
    if answer is None:
        return None
    for symbol, op in _SYMBOLS.items():
        answer = answer.replace(symbol, op)
    if answer.count("=") == 1:
        answer = answer.split("=")[0]
    return canonical_expression(answer)


@dataclass(frozen=True)
class PromptRecord:
    """What the evaluation of one prompt produced.

    Attributes:
        correct: ``n`` values, 1.0 when the sample's eval reward reached the threshold.
        answers: ``n`` answers (:func:`sample_answer`), ``None`` when a sample gave none.
        valid_answers: the prompt's full set of canonical correct answers, or ``None``.
        task: the prompt's task label (the ``task`` column), or ``None``.
        greedy_correct: 1.0 / 0.0 for the greedy completion, ``None`` without greedy.
    """

    correct: tuple[float, ...]
    answers: tuple[str | None, ...]
    valid_answers: frozenset[str] | None = None
    task: str | None = None
    greedy_correct: float | None = None


def _metrics(records: Sequence[PromptRecord], ks: Sequence[int]) -> dict[str, float]:
    correct = [list(r.correct) for r in records]
    out = aggregate(correct, ks, answers=[list(r.answers) for r in records])
    valid = [r.valid_answers for r in records]
    if any(v is not None for v in valid):
        # coverage compares the canonical forms of the correct answers with the valid set
        canonical = [
            [coverage_answer(a) if ok else None for a, ok in zip(r.answers, r.correct, strict=True)]
            for r in records
        ]
        coverage = aggregate(correct, ks, answers=canonical, valid_answers=valid)
        # canonical forms: "5 + 4" and "4 + 5" are one correct answer
        out.update({
            k: v for k, v in coverage.items() if k.startswith(("coverage@", "distinct_correct@"))
        })
    greedy = [r.greedy_correct for r in records if r.greedy_correct is not None]
    if greedy:
        out["greedy_pass@1"] = sum(greedy) / len(greedy)
    return out


def evaluation_metrics(
    records: Sequence[PromptRecord], ks: Sequence[int], prefix: str
) -> dict[str, float]:
    """The logged metrics of an evaluation epoch: ``{prefix}/{metric}`` over all records
    and ``{prefix}/{metric}/{task}`` over the records of each task label (see the module
    docstring). Empty ``records`` give ``{}``.

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
    for task in tasks:
        subset = [r for r in records if r.task == task]
        out.update({f"{prefix}/{k}/{task}": v for k, v in _metrics(subset, ks).items()})
    return out
