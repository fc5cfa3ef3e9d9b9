"""The format warm start of builtin:tiny-warm teaches the shape of the answers, never the
right sums or digit pairs (the rewarded answers): those stay right only by chance."""

from __future__ import annotations

import doctest
import re

import torch

import maxent_grpo.warm_start as warm
from maxent_grpo.models import builtin_tiny_model_and_tokenizer


def test_docstring_examples() -> None:
    result = doctest.testmod(warm)
    assert result.failed == 0 and result.attempted > 0


def test_the_rewarded_answers_are_right_only_by_chance() -> None:
    examples = warm.format_examples(3000, seed=1)
    sums = [(p, c) for p, c in examples if re.fullmatch(r"\d \+ \d =", p)]
    pairs = [(p, c) for p, c in examples if p.startswith("? + ? =")]
    differences = [(p, c) for p, c in examples if " - " in p]
    assert len(sums) == len(pairs) == len(differences) == 1000
    right_sums = sum(int(c) == eval(p[:-2]) for p, c in sums)  # noqa: S307 - digits only
    right_pairs = sum(eval(c) == int(p.split("=")[1]) for p, c in pairs)  # noqa: S307
    # chance: 1/19 of the sums, 1/19 of the pairs on average over targets 0..18
    assert 30 <= right_sums <= 80 and 30 <= right_pairs <= 80
    assert all(0 <= int(c) <= 18 for _, c in sums)
    assert all(re.fullmatch(r"\d \+ \d", c) for _, c in pairs)
    # differences carry their true value: reading two digits is a skill, not the task
    assert all(int(c) == eval(p[:-2]) for p, c in differences)  # noqa: S307


def test_warm_start_trains_in_place_without_touching_the_callers_random_state() -> None:
    model, tokenizer = builtin_tiny_model_and_tokenizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    warm.warm_start(model, tokenizer, steps=2, batch_size=4)
    assert torch.equal(torch.rand(3), expected)
    assert not model.training
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
