"""The warm start of ``builtin:tiny-warm``: answers in the right shape, never the right ones.

A random-init model writes random characters, so almost every reward is 0 and RL has
nothing to learn from. ``builtin:tiny-warm`` is ``builtin:tiny`` after a short supervised
pass (600 steps of 64 examples, about 15 s on 2 cores, once) on three kinds of example:

- ``arithmetic_easy`` sums (``"3 + 5 ="``) answered with a number drawn uniformly from
  ``0..18``, whatever the question;
- ``digit_pairs`` prompts (``"? + ? = 9"``, every target ``0..18``) answered with
  ``"a + b"``, two digits drawn uniformly from ``0..9``, whatever the target;
- one-digit *differences* (``"7 - 3 ="``) with their true value,

each followed by the end-of-turn token. The answers to the two rewarded tasks are drawn
independently of the question, so the warm start carries no information about which of
them is right: the model answers sums right about 1 time in 19 and digit pairs about 1 in
12 (chance), and what it learns beyond that comes from the rewards. The differences teach
a skill a pretrained model would bring, reading two digits and combining them, on a
question the tasks never ask; without them the tiny model learns to ignore the question
and RL only finds the most frequent sum. The prompts are rendered with the ChatML template
exactly as the DataModule renders them, from a seed of their own.
"""

from __future__ import annotations

import random

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from maxent_grpo.tasks import build_task

WARM_START_SEED = 4321
"""Seed of the warm-start prompts, answers, batch order and (forked) torch state."""


def format_examples(num_rows: int, seed: int = WARM_START_SEED) -> list[tuple[str, str]]:
    """``num_rows`` ``(prompt, completion)`` pairs, the three kinds in turn: a sum prompt
    with a random number, a digit-pair prompt with a random pair, a difference with its
    true value.

    >>> [p for p, _ in format_examples(3, seed=0)]
    ['6 + 6 =', '? + ? = 9', '2 - 9 =']
    """
    rng = random.Random(seed)
    per_kind = (num_rows + 2) // 3
    sums = build_task("arithmetic_easy", per_kind, seed, bare=True)
    pairs = build_task("digit_pairs", per_kind, seed, bare=True, min_target=0, max_target=18)
    differences = build_task("arithmetic_easy", per_kind, seed + 1, bare=True, ops="-")
    out: list[tuple[str, str]] = []
    for i in range(num_rows):
        kind, j = i % 3, i // 3
        if kind == 0:
            out.append((sums[j]["prompt"], str(rng.randint(0, 18))))
        elif kind == 1:
            out.append((pairs[j]["prompt"], f"{rng.randint(0, 9)} + {rng.randint(0, 9)}"))
        else:
            out.append((differences[j]["prompt"], differences[j]["answer"]))
    return out


def _encode(
    tokenizer: PreTrainedTokenizerBase, examples: list[tuple[str, str]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 outside the
    completion and its end-of-turn token)."""
    rows, labels = [], []
    for prompt, completion in examples:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        p_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        c_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        c_ids = c_ids + [tokenizer.eos_token_id]
        rows.append(p_ids + c_ids)
        labels.append([-100] * len(p_ids) + c_ids)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    att = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, att, lab


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    steps: int = 600,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = WARM_START_SEED,
) -> PreTrainedModel:
    """Train ``model`` in place on :func:`format_examples` (``steps x batch_size`` fresh
    examples, AdamW, cross-entropy on the completion tokens) and return it in eval mode.

    The torch random state is forked, so the caller's stream is untouched.
    """
    examples = format_examples(steps * batch_size, seed)
    ids, att, lab = _encode(tokenizer, examples)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        for step in range(steps):
            rows = slice(step * batch_size, (step + 1) * batch_size)
            loss = model(input_ids=ids[rows], attention_mask=att[rows], labels=lab[rows]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return model.eval()
