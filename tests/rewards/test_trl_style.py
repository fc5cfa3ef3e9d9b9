"""Reward functions written as TRL's GRPOTrainer documents them drop in unchanged: run through
the real ``collect`` path (a short fit) and through validation, they receive completions in
the form of their prompts, the sampled ``completion_ids``, ``trainer_state`` and the
dataset's columns, and their values are the step's rewards."""

from __future__ import annotations

import importlib
import json
import math
import re

import lightning as L
import pytest
import torch

from maxent_grpo.builtin.catalog import build_tiny_tokenizer
from maxent_grpo.rewards import TrainerState
from tests.conftest import fit, make_data, make_module

HERE = "tests.rewards.test_trl_style"
# the trainer imports the functions as HERE, pytest this file under its own name: both
# record into the dict of the module the trainer imported
CALLS: dict[str, list[dict]] = importlib.import_module(HERE).__dict__.setdefault("CALLS", {})


def record(name: str, **received) -> None:
    CALLS.setdefault(name, []).append(received)


# ------------------------------------------------------------- TRL documentation style


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    record("format", completions=completions, kwargs=kwargs)
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_num_tokens(completion_ids, **kwargs):
    """Reward longer completions (in tokens)."""
    record("tokens", completion_ids=completion_ids)
    return [float(len(ids)) for ids in completion_ids]


def curriculum_reward(completions, trainer_state, **kwargs):
    """A schedule: the reward grows with training progress."""
    record("state", trainer_state=trainer_state)
    progress = trainer_state.global_step / trainer_state.max_steps
    return [progress] * len(completions)


def reference_reward(prompts, completions, ground_truth, **kwargs):
    """Multi-task: None (not applicable) where the row has no reference."""
    record("reference", prompts=prompts, ground_truth=ground_truth)
    return [
        None if gt is None else float(gt in c[0]["content"])
        for c, gt in zip(completions, ground_truth, strict=True)
    ]


def reward_len(completions, **kwargs):
    """TRL's quick-start reward (text prompts): completions near 20 characters."""
    record("len", completions=completions)
    return [-abs(20 - len(completion)) for completion in completions]


# ------------------------------------------------------------- the fits

CHAT_ROWS = [
    {"prompt": [{"role": "user", "content": "Say 7"}], "ground_truth": "7"},
    {"prompt": [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say 8"}], "ground_truth": "8"},
    {"prompt": [{"role": "user", "content": "Say 9"},
                {"role": "assistant", "content": "Sure:"}], "ground_truth": None},
    {"prompt": [{"role": "user", "content": "Say a"}], "ground_truth": "a"},
]


@pytest.fixture
def chat_data(cache_dir, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CHAT_ROWS))
    return make_data(
        cache_dir, task=None, task_options=None, data_files=str(path), val_files=str(path),
        answer_column=None, max_prompt_length=96,
    )


def test_trl_reward_module_drops_in_with_chat_prompts(cache_dir, chat_data):
    CALLS.clear()
    names = [f"{HERE}:{f}" for f in (
        "format_reward_func", "reward_num_tokens", "curriculum_reward", "reference_reward")]
    module = make_module(cache_dir, rewards={
        names[0]: 1.0, names[1]: 0.5, names[2]: 2.0, names[3]: 1.0, "format": 1.0,
    })
    fit(module, chat_data, steps=2)  # 4 rows, batch 4: one batch per epoch, two epochs
    G, B = 4, 4
    assert all(len(CALLS[k]) == 2 for k in ("format", "tokens", "state", "reference"))

    # trainer_state: TRL's fields, the progress of each rollout
    states = [c["trainer_state"] for c in CALLS["state"]]
    assert all(isinstance(s, TrainerState) for s in states)
    assert [s.global_step for s in states] == [0, 1]
    assert [s.epoch for s in states] == [0.0, 1.0]
    assert {(s.max_steps, s.num_train_epochs, s.is_world_process_zero) for s in states} == {
        (2, 2, True)}
    with pytest.raises(AttributeError):
        states[0].global_step = 5  # read-only

    # prompts: the dataset's message lists (a trailing assistant message kept), G times each;
    # columns: one value per completion, in the prompt's row
    ref = CALLS["reference"][-1]
    assert len(ref["prompts"]) == B * G
    rows = {json.dumps(r["prompt"]): r["ground_truth"] for r in CHAT_ROWS}
    for b in range(B):
        group = ref["prompts"][b * G:(b + 1) * G]
        assert all(p == group[0] for p in group) and json.dumps(group[0]) in rows
        assert ref["ground_truth"][b * G:(b + 1) * G] == [rows[json.dumps(group[0])]] * G

    # completions: one assistant message each, holding the sampled text; ids: the sampled
    # tokens without padding, which decode to that text
    rollout = module.trajectory.rollout
    texts = [c for group in rollout.batch.grouped_completions for c in group]
    completions = CALLS["format"][-1]["completions"]
    assert completions == [[{"role": "assistant", "content": t}] for t in texts]
    ids = CALLS["tokens"][-1]["completion_ids"]
    mask = rollout.completion_mask
    assert ids == [row[m].tolist() for row, m in zip(rollout.completion_ids, mask, strict=True)]
    assert [len(i) for i in ids] == mask.sum(-1).tolist() and all(len(i) >= 1 for i in ids)
    tok = build_tiny_tokenizer()
    assert [tok.decode(i, skip_special_tokens=True) for i in ids] == texts
    eos_rows = [i for i in ids if tok.eos_token_id in i]
    assert all(i[-1] == tok.eos_token_id for i in eos_rows)  # up to and including the stop

    # the step's rewards are the functions' values, weighted (None skipped)
    comps = module.trajectory.samples.components
    expected_tokens = torch.tensor([float(len(i)) for i in ids]).view(B, G)
    assert torch.equal(comps[names[1]], expected_tokens)
    assert torch.equal(comps[names[2]], torch.full((B, G), 0.5))  # global_step 1 of 2
    none_rows = torch.tensor([gt is None for gt in ref["ground_truth"]]).view(B, G)
    assert none_rows.sum() == G and torch.isnan(comps[names[3]][none_rows]).all()
    total = (comps[names[0]] + 0.5 * expected_tokens + 2.0 * 0.5 + comps["format"]
             + torch.nan_to_num(comps[names[3]]))
    assert torch.allclose(module.trajectory.samples.rewards, total)
    # the built-in format reward reads the same messages (completion_text)
    assert torch.equal(comps["format"], comps[names[0]])


def test_trl_rewards_on_text_prompts_get_strings_and_run_in_validation(cache_dir):
    CALLS.clear()
    module = make_module(cache_dir, eval_num_generations=2, rewards={
        f"{HERE}:reward_len": 1.0, f"{HERE}:reward_num_tokens": 1.0, "first_number": 1.0,
    })
    fit(module, make_data(cache_dir), steps=1)
    completions = CALLS["len"][0]["completions"]
    assert len(completions) == 16 and all(isinstance(c, str) for c in completions)
    ids = CALLS["tokens"][0]["completion_ids"]
    assert [len(i) for i in ids] == module.trajectory.rollout.completion_mask.sum(-1).tolist()
    comps = module.trajectory.samples.components
    assert comps[f"{HERE}:reward_len"].flatten().tolist() == [
        -abs(20 - len(c)) for c in completions]

    # validation scores with the same convention: n samples, then the greedy one
    CALLS.clear()
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=1)
    out = trainer.validate(module, make_data(cache_dir), verbose=False)[0]
    sampled, greedy = CALLS["tokens"]
    assert len(sampled["completion_ids"]) == 4 * 2 and len(greedy["completion_ids"]) == 4
    assert all(isinstance(i, list) and all(isinstance(t, int) for t in i)
               for i in sampled["completion_ids"])
    mean_len = sum(-abs(20 - len(c)) for c in CALLS["len"][0]["completions"]) / 8
    assert out["val/reward/tests.rewards.test_trl_style:reward_len/mean"] == pytest.approx(
        mean_len)
    assert not math.isnan(out["val/reward/mean"])
