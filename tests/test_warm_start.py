"""The format warm start of builtin:tiny-warm teaches the shape of the answers, never the
right sums or digit pairs (the rewarded answers): those stay right only by chance."""

from __future__ import annotations

import doctest
import re

import pytest
import torch

import maxent_grpo.builtin.warm_start as warm
from maxent_grpo.builtin.catalog import builtin_tiny_model_and_tokenizer


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


@pytest.mark.parametrize("name, weights", [
    ("tiny-warm", warm.WEIGHTS), ("tiny-h64-warm", warm.WEIGHTS_H64),
])
def test_the_shipped_weights_are_the_builtin_and_have_the_taught_skill(
    tmp_path, name, weights,
) -> None:
    from maxent_grpo.models import load_policy, load_tokenizer

    model = load_policy(f"builtin:{name}", cache_dir=tmp_path)
    from safetensors.torch import load_file

    raw = load_file(str(weights))  # the file's own tensors, read without load_shipped
    state = model.state_dict()
    assert raw and all(torch.equal(state[key], value) for key, value in raw.items())
    skill = warm.measure_skill(model, load_tokenizer(f"builtin:{name}", cache_dir=tmp_path))
    assert skill["sum_format"] > 0.95  # answers a sum prompt with a number in 0..18
    assert 0.04 < skill["sum_correct"] < 0.07  # right by chance only (1/19 = 0.053)
    assert skill["sum_information"] < 0.02  # the answer ignores the question
    assert skill["difference_correct"] > 0.5  # but it reads two digits


def test_measure_skill_tells_a_random_model_from_a_warm_one() -> None:
    model, tokenizer = builtin_tiny_model_and_tokenizer()
    skill = warm.measure_skill(model, tokenizer)
    assert skill["sum_format"] < 0.01 and skill["difference_correct"] < 0.2


@pytest.mark.parametrize("file, expected", [
    ("tiny_warm.safetensors", r"builtin:tiny-warm .*warm_start --retrain --out"),
    ("tiny_h64_warm.safetensors", r"builtin:tiny-h64-warm .*warm_start --head-dim 64 --retrain"),
    ("tiny_tools_warm.safetensors", r"builtin:tiny-tools-warm .*tool_warm_start --retrain"),
    # the python tool's weights: the sums model's command would have overwritten them
    ("tiny_python_warm.safetensors",
     r"builtin:tiny-python-warm .*tool_warm_start --tool python --retrain"),
    ("nope.safetensors", r"a built-in model are missing .*nope\.safetensors\); reinstall"),
])
def test_missing_shipped_weights_name_the_model_and_the_fix(tmp_path, file, expected) -> None:
    model, _ = builtin_tiny_model_and_tokenizer()
    with pytest.raises(FileNotFoundError, match=expected):
        warm.load_shipped(model, tmp_path / file)


def test_the_command_prints_the_shipped_skill_and_refuses_to_retrain_over_nothing(capsys) -> None:
    skill = warm._main([])
    assert skill["sum_format"] > 0.95 and str(warm.WEIGHTS) in capsys.readouterr().out
    with pytest.raises(SystemExit):
        warm._main(["--retrain"])  # no --out: the shipped file is never overwritten by default
    assert "--retrain needs --out" in capsys.readouterr().err
    skill = warm._main(["--head-dim", "64"])
    assert skill["sum_format"] > 0.95 and str(warm.WEIGHTS_H64) in capsys.readouterr().out


@pytest.mark.slow
def test_retraining_the_warm_start_reproduces_its_skill(tmp_path) -> None:
    """``python -m maxent_grpo.builtin.warm_start --retrain`` builds a model of the same kind (not
    the same bits: the float rounding of 600 steps differs between CPU kernels)."""
    out = tmp_path / "w.safetensors"
    warm._main(["--retrain", "--out", str(out)])
    model, tokenizer = builtin_tiny_model_and_tokenizer()
    skill = warm.measure_skill(warm.load_shipped(model, out), tokenizer)
    assert skill["sum_format"] > 0.95 and skill["sum_information"] < 0.05
    assert 0.03 < skill["sum_correct"] < 0.08 and skill["difference_correct"] > 0.3
