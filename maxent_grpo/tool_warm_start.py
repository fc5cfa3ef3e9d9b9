"""The warm start of ``builtin:tiny-tools-warm``: the *format* of a tool call, never the
answers of the task it is trained on.

``tool_arithmetic`` asks for products of two-digit numbers (``"What is 37 * 84?"``), which
a random-init tiny model cannot compute. ``builtin:tiny-tools-warm`` is ``builtin:tiny``
after a supervised pass on questions the task never asks (:data:`KINDS`: two-digit sums and
differences, one-digit products), each answered, with probability 1/2 each, in one of two
shapes:

- directly, with a number drawn uniformly from the range of that kind's answers, whatever
  the question (right only by chance, as ``builtin:tiny-warm``'s sums);
- as a tool exchange: the call ``<tool_call>{"name": "calculate", "arguments":
  {"expression": "a + b"}}</tool_call>``, the tool's message (out of the loss), then its
  result copied as the answer.

The prompts carry the ``calculate`` tool's schema, rendered by the chat template exactly as
the DataModule renders them. The model never sees a two-digit product or its value: it
learns what a call looks like and how to copy into and out of one, and it calls about half
the time, whatever the question. That calling pays on the task's products, where a direct
answer is almost never right, is what the rewards teach. :func:`measure` samples the model
on the task's prompts through the multi-turn rollout and reports how often it calls, how
often the call is the question's own expression, and how often the answer is right.

The trained weights ship with the package (:data:`WEIGHTS_TOOLS`, trained with 2 threads).
``python -m maxent_grpo.tool_warm_start`` prints the shipped weights' :func:`measure`;
``--retrain --out FILE`` trains a new copy.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from maxent_grpo.models import WEIGHTS_TOOLS, build_tiny_model, build_tiny_tokenizer, load_shipped
from maxent_grpo.tasks.calculator import calculate, tool_arithmetic

SEED = 2468
"""Seed of the examples, their order and the (forked) torch state."""

MESSAGE = "message"  # a completion part the loss leaves out (the tool's message)


def tool_call_text(expression: str) -> str:
    """The call the built-in chat template asks for (Hermes format)."""
    call = {"name": "calculate", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


KINDS = (("+", 2, (20, 198)), ("-", 2, (-89, 89)), ("*", 1, (0, 81)))
"""The warm start's questions: (operator, operand digits, the range of their answers). The
task asks two-digit products; these are two-digit sums and differences and one-digit
products."""


def examples(num_rows: int, seed: int = SEED) -> list[tuple[str, list[tuple[str, str]]]]:
    """``num_rows`` ``(prompt, parts)`` pairs, the :data:`KINDS` in turn, each answered
    directly with a random number of its kind's range (probability 1/2) or as a tool
    exchange; ``parts`` are ``("model" | "message", text)`` in order, each model part
    followed by the end of turn.

    >>> [(p, len(parts)) for p, parts in examples(3, seed=0)]
    [('What is 59 + 63?', 3), ('What is 27 - 82?', 3), ('What is 0 * 1?', 1)]
    """
    rng = random.Random(seed)
    per_kind = (num_rows + len(KINDS) - 1) // len(KINDS)
    rows = [tool_arithmetic(per_kind, seed + k, digits=d, ops=op)
            for k, (op, d, _) in enumerate(KINDS)]
    out: list[tuple[str, list[tuple[str, str]]]] = []
    for i in range(num_rows):
        kind = i % len(KINDS)
        row = rows[kind][i // len(KINDS)]
        if rng.random() < 0.5:  # the shape of an answer, right only by chance
            out.append((row["prompt"], [("model", str(rng.randint(*KINDS[kind][2])))]))
            continue
        result = calculate(row["expression"])
        out.append((row["prompt"], [("model", tool_call_text(row["expression"])),
                                    (MESSAGE, result), ("model", result)]))
    return out


def _encode(tokenizer: PreTrainedTokenizerBase,
            rows: list[tuple[str, list[tuple[str, str]]]]) -> tuple[torch.Tensor, ...]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 outside the
    model's parts and their end-of-turn tokens): each message part rendered by the chat
    template between the model's turns, as the multi-turn rollout renders it."""
    schema = [calculate]
    eos = tokenizer.eos_token
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "\x00"}]
    before = tokenizer.apply_chat_template(base, tokenize=False, tools=schema)
    ids_rows, label_rows = [], []
    for prompt, parts in rows:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             tokenize=False, add_generation_prompt=True,
                                             tools=schema)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        labels = [-100] * len(ids)
        for kind, part in parts:
            if kind == MESSAGE:
                after = tokenizer.apply_chat_template(
                    base + [{"role": "tool", "content": part}], tokenize=False,
                    add_generation_prompt=True, tools=schema)
                tail = before[before.rindex("\x00") + 1:].removeprefix(eos)
                piece = tokenizer(tail + after[len(before):], add_special_tokens=False)
                ids += piece["input_ids"]
                labels += [-100] * len(piece["input_ids"])
            else:
                piece = tokenizer(part, add_special_tokens=False)["input_ids"]
                piece += [tokenizer.eos_token_id]
                ids += piece
                labels += piece
        ids_rows.append(ids)
        label_rows.append(labels)
    width, pad = max(len(r) for r in ids_rows), tokenizer.pad_token_id
    return (torch.tensor([r + [pad] * (width - len(r)) for r in ids_rows]),
            torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids_rows]),
            torch.tensor([r + [-100] * (width - len(r)) for r in label_rows]))


def warm_start(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
               steps: int = 3000, batch_size: int = 32, lr: float = 3e-3,
               seed: int = SEED) -> PreTrainedModel:
    """Train ``model`` in place on :func:`examples` (``steps x batch_size`` fresh examples,
    AdamW, cross-entropy on the model's parts) and return it in eval mode; the torch random
    state is forked."""
    ids, att, lab = _encode(tokenizer, examples(steps * batch_size, seed))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        for step in range(steps):
            rows = slice(step * batch_size, (step + 1) * batch_size)
            used = int(att[rows].sum(-1).max())
            loss = model(input_ids=ids[rows, :used], attention_mask=att[rows, :used],
                         labels=lab[rows, :used]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return model.eval()


def measure(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, prompts: int = 32,
            samples: int = 8, seed: int = 0, ops: str = "*") -> dict[str, float]:
    """Sample ``samples`` completions (temperature 1, 160 tokens, tools on) for ``prompts``
    task prompts of ``tool_arithmetic`` (``ops``, rows from ``seed``) and report the shares
    of samples that call the tool (``call_rate``), whose first call is the question's own
    expression (``right_call_rate``), and whose last turn's first number is the answer
    (``correct``)."""
    from maxent_grpo.rewards.correctness import first_number_reward
    from maxent_grpo.rollout import HFGenerateEngine, SamplingSettings
    from maxent_grpo.rollout.multiturn import MultiTurnEngine
    from maxent_grpo.rollout.toolcall import Toolbox, parse_tool_calls

    rows = tool_arithmetic(prompts, seed, ops=ops)
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                              tokenize=False, add_generation_prompt=True,
                                              tools=[calculate]) for r in rows]
    sampling = SamplingSettings(max_new_tokens=160)
    engine = MultiTurnEngine(HFGenerateEngine(model, tokenizer, sampling), tokenizer, sampling,
                             toolbox=Toolbox([calculate]), max_tool_calls=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = engine.generate(rendered, [r["answer"] for r in rows], samples)
    firsts = [parse_tool_calls(m[0]["content"]) for m in out.tools.messages]
    expressions = [r["expression"] for r in rows for _ in range(samples)]
    right = [bool(c) and c[0].arguments.get("expression") == e
             for c, e in zip(firsts, expressions, strict=True)]
    correct = first_number_reward(rendered, out.reward_completions(),
                                  answer=[r["answer"] for r in rows for _ in range(samples)])
    n = len(right)
    return {"call_rate": float((out.tools.calls > 0).float().mean()),
            "right_call_rate": sum(right) / n, "correct": sum(correct) / n}


def _main(argv: list[str] | None = None) -> dict[str, float]:
    from safetensors.torch import save_model

    parser = argparse.ArgumentParser(
        prog="python -m maxent_grpo.tool_warm_start",
        description="Measure builtin:tiny-tools-warm's shipped weights, or train a new copy.")
    parser.add_argument("--retrain", action="store_true",
                        help="train a new copy from builtin:tiny and write it to --out")
    parser.add_argument("--out", type=Path, help="where --retrain writes the weights")
    args = parser.parse_args(argv)
    if args.retrain and args.out is None:
        parser.error(f"--retrain needs --out FILE (the shipped weights are {WEIGHTS_TOOLS})")
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer)
    if args.retrain:
        warm_start(model, tokenizer)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        save_model(model, str(args.out))
        print(f"wrote {args.out} (trained with {torch.get_num_threads()} threads)")
    else:
        load_shipped(model, WEIGHTS_TOOLS)
    result = {}
    for ops, label in (("*", "the task (two-digit products)"),
                       ("-", "a warm-start kind (differences)")):
        skill = measure(model, tokenizer, ops=ops)
        print(f"{label}: " + ", ".join(f"{k} {v:.3f}" for k, v in skill.items()))
        result |= {f"{k}{'' if ops == '*' else '_subtraction'}": v for k, v in skill.items()}
    return result


if __name__ == "__main__":
    _main()
