"""The warm start of ``builtin:tiny-warm``: answers in the right shape, never the right ones.

A random-init model writes random characters, so almost every reward is 0 and RL has
nothing to learn from. ``builtin:tiny-warm`` is ``builtin:tiny`` after a short supervised
pass (600 steps of 64 examples) on three kinds of example, each followed by the
end-of-turn token:

- ``arithmetic_easy`` sums (``"3 + 5 ="``) answered with a number drawn uniformly from
  ``0..18``, whatever the question;
- ``digit_pairs`` prompts (``"? + ? = 9"``, every target ``0..18``) answered with
  ``"a + b"``, two digits drawn uniformly from ``0..9``, whatever the target;
- one-digit *differences* (``"7 - 3 ="``) with their true value.

The rewarded answers carry no information about which is right (sums come out right about
1 time in 19, digit pairs about 1 in 12): what the model learns beyond that comes from the
rewards. The differences teach reading two digits and combining them, on a question the
tasks never ask; without them RL only finds the most frequent sum. The prompts are
rendered with the ChatML template exactly as the DataModule renders them.

The trained weights ship with the package (:data:`WEIGHTS`, trained with 2 threads), so
``builtin:tiny-warm`` is the same model on every machine: retraining gives different bits,
and a different demo, on different CPU kernels and thread counts. ``python -m
maxent_grpo.builtin.warm_start`` prints the shipped weights' :func:`measure_skill`; ``--retrain
--out FILE`` trains a new copy; ``--head-dim 64`` does either for ``builtin:tiny-h64-warm``,
the same warm start of the head-size-64 model that vLLM's CPU attention accepts (shipped as
:data:`WEIGHTS_H64`).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from maxent_grpo.builtin.catalog import (
    WEIGHTS,
    WEIGHTS_H64,
    build_tiny_model,
    build_tiny_tokenizer,
    load_shipped,
)
from maxent_grpo.core.logprobs import selective_log_softmax
from maxent_grpo.tasks import build_task

WARM_START_SEED = 4321
"""Seed of the warm-start prompts, answers, batch order and (forked) torch state."""

WARM_START_LR = {16: 3e-3, 64: 1e-3}
"""Learning rate per head size: ``builtin:tiny-h64`` (hidden 128) at 3e-3 learnt the format
only partly (answer-shaped mass 0.76, differences right 0.13); at 1e-3, 0.994 and 0.71."""


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


def encode(
    tokenizer: PreTrainedTokenizerBase, rows: list[tuple[str, list[tuple[str, str]]]],
    tools: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, labels)`` of ``(prompt, parts)`` rows, right-padded to
    the longest with the pad id, 0 and -100: the prompt rendered by the chat template (with
    ``tools``), then each ``(kind, text)`` part: a ``"model"`` part followed by the
    end-of-turn token, learnt; any other (text the template already rendered) out of the
    loss (labels -100)."""
    ids_rows, label_rows = [], []
    for prompt, parts in rows:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             tokenize=False, add_generation_prompt=True,
                                             tools=tools)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        labels = [-100] * len(ids)
        for kind, part in parts:
            piece = tokenizer(part, add_special_tokens=False)["input_ids"]
            if kind == "model":
                piece += [tokenizer.eos_token_id]
                ids, labels = ids + piece, labels + piece
            else:
                ids, labels = ids + piece, labels + [-100] * len(piece)
        ids_rows.append(ids)
        label_rows.append(labels)
    width = max(len(r) for r in ids_rows)
    pad = tokenizer.pad_token_id
    return (torch.tensor([r + [pad] * (width - len(r)) for r in ids_rows]),
            torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids_rows]),
            torch.tensor([r + [-100] * (width - len(r)) for r in label_rows]))


def warm_start(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, steps: int = 600,
    batch_size: int = 64, lr: float = 3e-3, seed: int = WARM_START_SEED, report: bool = False,
) -> PreTrainedModel:
    """Train ``model`` in place on :func:`format_examples` (``steps x batch_size`` fresh
    examples, AdamW, cross-entropy on the completion tokens) and return it in eval mode.

    The torch random state is forked, so the caller's stream is untouched.
    """
    rows = [(p, [("model", c)]) for p, c in format_examples(steps * batch_size, seed)]
    ids, att, lab = encode(tokenizer, rows)
    return supervised_pass(model, ids, att, lab, steps=steps, batch_size=batch_size, lr=lr,
                           seed=seed, report=report)


def supervised_pass(
    model: PreTrainedModel, ids: torch.Tensor, att: torch.Tensor, lab: torch.Tensor, *,
    steps: int, batch_size: int, lr: float, seed: int, trim: bool = False,
    report: bool = False,
) -> PreTrainedModel:
    """``steps`` AdamW steps of cross-entropy on consecutive ``batch_size`` rows of the
    right-padded ``ids`` / ``att`` / ``lab`` (labels -100 where nothing is learnt), in a
    forked torch random state seeded with ``seed``; ``trim`` cuts each batch to its longest
    row; ``report`` prints the step, the loss and the seconds every ``steps // 20`` steps
    (every step below 40) and at the end.
    Returns ``model`` in eval mode."""
    start, every = time.perf_counter(), max(1, steps // 20)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        for step in range(steps):
            rows = slice(step * batch_size, (step + 1) * batch_size)
            used = int(att[rows].sum(-1).max()) if trim else ids.shape[1]
            loss = model(input_ids=ids[rows, :used], attention_mask=att[rows, :used],
                         labels=lab[rows, :used]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if report and ((step + 1) % every == 0 or step + 1 == steps):
                print(f"step {step + 1}/{steps}: loss {loss.item():.4f}, "
                      f"{time.perf_counter() - start:.0f} s", flush=True)
    return model.eval()


@torch.no_grad()
def _answer_probs(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str],
    answers: list[str],
) -> torch.Tensor:
    """``P[i, j]``: the model's probability of the completion ``answers[j]`` followed by
    the end-of-turn token, given the chat-rendered ``prompts[i]`` (teacher forcing)."""
    ids, att, lab = encode(tokenizer, [(p, [("model", a)]) for p in prompts for a in answers])
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1]
    targets = lab[:, 1:]
    picked = selective_log_softmax(logits, targets.clamp_min(0))
    seq = (picked * (targets != -100)).sum(-1)
    return seq.exp().view(len(prompts), len(answers))


def measure_skill(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> dict[str, float]:
    """What a warm start taught, exactly (no sampling), over all 100 one-digit prompts:

    - ``sum_format``: probability mass of the answers ``"0"..."18"`` (then end of turn)
      on the sum prompts ``"a + b ="``;
    - ``sum_correct``: mean probability of the right sum, the answers renormalised to
      ``0..18`` (chance: 1/19 = 0.053);
    - ``sum_information``: mutual information, in nats, between the prompt and the
      answer (0 when the answer ignores the question, as the warm start intends);
    - ``difference_correct``: mean probability of the right difference on ``"a - b ="``
      among ``-9..9`` (the skill the warm start does teach).
    """
    was_training = model.training
    model.eval()
    digits = [(a, b) for a in range(10) for b in range(10)]
    sums = _answer_probs(model, tokenizer, [f"{a} + {b} =" for a, b in digits],
                         [str(n) for n in range(19)])
    diffs = _answer_probs(model, tokenizer, [f"{a} - {b} =" for a, b in digits],
                          [str(n) for n in range(-9, 10)])
    model.train(was_training)
    mass = sums.sum(-1)
    cond = sums / mass.unsqueeze(-1)
    marginal = cond.mean(0)

    def entropy(p: torch.Tensor) -> torch.Tensor:
        return -(p * p.clamp_min(1e-30).log()).sum(-1)

    diffs = diffs / diffs.sum(-1, keepdim=True)
    rows = torch.arange(len(digits))
    return {
        "sum_format": float(mass.mean()),
        "sum_correct": float(cond[rows, torch.tensor([a + b for a, b in digits])].mean()),
        "sum_information": float(entropy(marginal) - entropy(cond).mean()),
        "difference_correct": float(diffs[rows, torch.tensor([a - b + 9 for a, b in digits])]
                                    .mean()),
    }


def _main(argv: list[str] | None = None) -> dict[str, float]:
    from safetensors.torch import save_model

    parser = argparse.ArgumentParser(
        prog="python -m maxent_grpo.builtin.warm_start",
        description="Print the skill of builtin:tiny-warm's shipped weights, or of a new copy.",
    )
    parser.add_argument("--retrain", action="store_true",
                        help="train a new copy from builtin:tiny and write it to --out")
    parser.add_argument("--out", type=Path, help="where --retrain writes the weights")
    parser.add_argument("--head-dim", type=int, choices=(16, 64), default=16,
                        help="16: builtin:tiny-warm; 64: builtin:tiny-h64-warm (vLLM's tests)")
    args = parser.parse_args(argv)
    shipped, name = {16: (WEIGHTS, "tiny-warm"), 64: (WEIGHTS_H64, "tiny-h64-warm")}[args.head_dim]
    if args.retrain and args.out is None:
        parser.error(f"--retrain needs --out FILE (the shipped weights are {shipped})")
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, head_dim=args.head_dim)
    if args.retrain:
        warm_start(model, tokenizer, lr=WARM_START_LR[args.head_dim], report=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        save_model(model, str(args.out))
        print(f"wrote {args.out} (trained with {torch.get_num_threads()} threads); "
              f"builtin:{name} reads the shipped file, and its cache folder "
              f"(~/.cache/maxent_grpo/models/{name}-v*) must be removed after replacing it")
    else:
        load_shipped(model, shipped)
        print(f"{shipped}:")
    skill = measure_skill(model, tokenizer)
    for key, value in skill.items():
        print(f"  {key}: {value:.4f}" + ("  (chance 0.0526)" if key == "sum_correct" else ""))
    return skill


if __name__ == "__main__":
    _main()
