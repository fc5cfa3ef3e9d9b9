"""Dynamic sampling with refill (``model.refill_rounds``, training/step/refill.py)."""

from __future__ import annotations

import pytest
import torch

from maxent_grpo.rollout import GenerationBatch, RolloutOutput
from maxent_grpo.training.step.refill import concat_groups, refill
from tests.conftest import fit, make_data, make_module

G = 2


def _scored(tag: str, rewards: list[list[float]], prompt_len: int, completion_len: int):
    """A scored rollout of len(rewards) groups: prompt tokens 1.., completion tokens 50..;
    the last row of every group is one token shorter (so widths must be re-cut)."""
    B = len(rewards)
    rows = B * G
    prompt_ids = torch.arange(1, prompt_len + 1).repeat(rows, 1)
    prompt_mask = torch.ones(rows, prompt_len, dtype=torch.bool)
    completion_ids = torch.full((rows, completion_len), 50)
    completion_mask = torch.ones(rows, completion_len, dtype=torch.bool)
    completion_mask[1::G, -1] = False
    completion_ids[~completion_mask] = 0
    batch = {"prompts": [f"{tag}{b}" for b in range(B)], "answers": ["a"] * B,
             "raw_prompts": [f"{tag}{b}" for b in range(B)], "indices": list(range(B)),
             "columns": {"answer": [f"{tag}{b}" for b in range(B)]}}
    rollout = RolloutOutput(
        batch=GenerationBatch(prompts=batch["prompts"], answers=batch["answers"],
                              grouped_completions=[[f"{tag}{b}c{g}" for g in range(G)]
                                                   for b in range(B)], grouped_ref_meta=None),
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=completion_mask, truncated=~completion_mask[:, -1],
        generate_seconds=1.0)
    r = torch.tensor(rewards)
    return batch, rollout, r, r.reshape(1, -1)


def test_refill_keeps_the_first_b_varied_groups_in_draw_order():
    first = _scored("x", [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]], 2, 3)  # 1 varied of 3
    later = iter([_scored("y", [[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]], 4, 2),  # 1 more
                  _scored("z", [[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]], 3, 3)])  # 3 more
    drawn = []
    (batch, rollout, rewards, components), rounds = refill(
        first, draw=lambda n: drawn.append(n) or {},
        roll_out=lambda _: next(later), rounds=5, any_rank=lambda need: need, pad_id=0)
    assert rounds == 2 and drawn == [3, 3]  # stopped once 3 groups varied
    assert batch["prompts"] == ["x1", "y1", "z0"]
    assert rewards.tolist() == [[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]
    assert components.tolist() == [[0.0, 1.0, 1.0, 0.0, 0.0, 1.0]]
    assert batch["columns"]["answer"] == ["x1", "y1", "z0"]
    assert rollout.batch.grouped_completions == [["x1c0", "x1c1"], ["y1c0", "y1c1"],
                                                 ["z0c0", "z0c1"]]
    # prompts left-padded to the widest (4), completions right-padded to the longest (3)
    assert rollout.prompt_ids.shape == (6, 4) and rollout.completion_ids.shape == (6, 3)
    assert rollout.prompt_mask[:2].tolist() == [[False, False, True, True]] * 2
    assert rollout.prompt_ids[0].tolist() == [0, 0, 1, 2]
    assert rollout.completion_mask[2:4].tolist() == [[True, True, False], [True, False, False]]
    assert rollout.generate_seconds == 3.0


def test_too_few_after_the_bound_fills_up_with_constant_groups():
    first = _scored("x", [[1.0, 1.0], [0.0, 1.0]], 2, 2)
    later = _scored("y", [[0.0, 0.0], [0.0, 0.0]], 2, 2)
    (batch, _, rewards, _), rounds = refill(first, lambda n: {}, lambda _: later, rounds=1,
                                            any_rank=lambda need: need, pad_id=0)
    assert rounds == 1 and batch["prompts"] == ["x0", "x1"]  # the first constant one kept
    assert rewards.tolist() == [[1.0, 1.0], [0.0, 1.0]]


def test_a_full_rank_still_rolls_out_while_another_rank_needs_more():
    """Every rank runs as many rounds (FSDP2's generate is a collective); a full one keeps
    its own first groups."""
    first = _scored("x", [[0.0, 1.0], [1.0, 0.0]], 2, 2)  # full already
    calls = []
    scored, rounds = refill(first, lambda n: {}, lambda _: calls.append(1) or first,
                            rounds=2, any_rank=lambda need: True, pad_id=0)
    assert rounds == 2 and len(calls) == 2 and scored[0]["prompts"] == ["x0", "x1"]
    untouched, none = refill(first, lambda n: {}, lambda _: first, rounds=2,
                             any_rank=lambda need: need, pad_id=0)
    assert none == 0 and untouched is first


def test_concat_cuts_unused_columns():
    a = _scored("x", [[0.0, 1.0]], 5, 4)
    b = _scored("y", [[0.0, 1.0]], 2, 2)
    _, rollout, _, _ = concat_groups([a, b], [(1, 0)], G, pad_id=0)
    assert rollout.prompt_ids.shape == (2, 2) and rollout.completion_ids.shape == (2, 2)


def test_refill_needs_drop_constant_groups():
    with pytest.raises(ValueError, match="model.refill_rounds refills the groups"):
        make_module("/nonexistent", refill_rounds=2)


def test_a_run_with_refill_resumes_exactly(cache_dir, tmp_path):
    """4 steps at once against 2 steps, a checkpoint, and 2 more: the same weights and the
    same refill position; the warm start is right by chance, so some groups vary."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def module():
        return make_module(cache_dir, model_name_or_path="builtin:tiny-warm",
                           drop_constant_groups=True, refill_rounds=2)

    whole_module, whole_data = module(), make_data(cache_dir)
    fit(whole_module, whole_data, steps=4, tmp_path=tmp_path)
    assert whole_data._refill.drawn > 0  # some step refilled

    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    fit(module(), make_data(cache_dir), steps=2, tmp_path=tmp_path, callbacks=[ckpt],
        enable_checkpointing=True)
    resumed_module, resumed_data = module(), make_data(cache_dir)
    fit(resumed_module, resumed_data, steps=4, tmp_path=tmp_path,
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed_data._refill.drawn == whole_data._refill.drawn
    for (name, a), (_, b) in zip(whole_module.policy.state_dict().items(),
                                 resumed_module.policy.state_dict().items(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_the_refill_stream_is_seeded_and_saved(cache_dir):
    def stream():
        data = make_data(cache_dir)
        data.setup("fit")
        return data, data.refill_batch(3)["indices"] + data.refill_batch(3)["indices"]

    data, first = stream()
    _, again = stream()
    assert first == again and len(set(first)) == 6  # one pass: no repeats
    assert data.state_dict()["refill_drawn"] == 6
    other = make_data(cache_dir, seed=1)
    other.setup("fit")
    assert other.refill_batch(6)["indices"] != first


def test_the_refill_stream_is_its_own_order_without_shuffle_too(cache_dir):
    """Without ``shuffle`` the stream's order was the batches' (``0..N-1``): the first step's
    first round re-drew its own four prompts, trained twice (a hunt: 4 of 40 steps), and
    passing over them only moved the double onto the next step's batch (a reader)."""
    data = make_data(cache_dir, shuffle=False)
    data.setup("fit")
    batches = [b["indices"] for b, _ in zip(data.train_dataloader(), range(2), strict=False)]
    drawn = data.refill_batch(8)["indices"]
    shuffled = make_data(cache_dir, shuffle=True)
    shuffled.setup("fit")
    assert drawn == shuffled.refill_batch(8)["indices"]  # the stream does not follow shuffle
    assert drawn[:4] != batches[0] and drawn[4:] != batches[1]


def test_refill_without_the_datamodule_says_what_to_pass():
    from types import SimpleNamespace

    from maxent_grpo.training.step.refill import refill_source

    with pytest.raises(ValueError, match="pass datamodule=PromptDataModule"):
        refill_source(SimpleNamespace(datamodule=None))


def test_the_pad_id_is_the_one_the_rollout_uses():
    from types import SimpleNamespace

    from maxent_grpo.training.step.refill import pad_id

    _, rollout, _, _ = _scored("x", [[0.0, 1.0]], 2, 3)  # masked completion cells hold 0
    rollout.completion_ids[~rollout.completion_mask] = 7
    assert pad_id(rollout, None) == 7
    _, full, _, _ = _scored("x", [[0.0, 1.0]], 2, 3)
    full.completion_mask[:] = True
    assert pad_id(full, SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=3))) == 3
