"""The warm start of ``builtin:tiny-tools-warm``: the *format* of a tool call, never the
answers of the task it is trained on.

``tool_arithmetic`` asks for products of two two-digit numbers (``"What is 37 * 84?"``),
which a random-init tiny model cannot compute. ``builtin:tiny-tools-warm`` is
``builtin:tiny`` after a supervised pass on arithmetic questions (:data:`KINDS`), each
answered, with probability 1/2 each, in one of two shapes:

- directly, with a number drawn uniformly from the range of that kind's answers, whatever
  the question (right only by chance, as ``builtin:tiny-warm``'s sums);
- with the call ``<tool_call>{"name": "calculate", "arguments": {"expression": "a + b"}}
  </tool_call>`` on the question's expression. On the questions the task never asks (sums,
  differences, products with a one-digit operand) the tool's message follows (out of the
  loss) and then its result, copied as the answer. On the task's own question the example
  ends with the call: the format of a call, never a product's value.

The prompts carry the ``calculate`` tool's schema, rendered by the chat template exactly as
the DataModule renders them. So on the task the model calls about half the time, and
whether it then copies a four-digit result it has never seen in that place is open. That
calling pays, where a direct answer is almost never right, and copying the result, are what
the rewards teach. :func:`measure` samples the model on the task's prompts through the
multi-turn rollout and reports how often it calls, how often the call is the question's own
expression, and how often the answer is right.

The trained weights ship with the package (:data:`WEIGHTS_TOOLS`, trained with 2 threads).
``python -m maxent_grpo.builtin.tool_warm_start`` prints the shipped weights' :func:`measure`;
``--retrain --out FILE`` trains a new copy.

``builtin:tiny-python-warm`` (:data:`WEIGHTS_PYTHON`) is the same warm start for the
built-in ``python`` tool (``--tool python``): the call is
``<tool_call>{"name": "python", "arguments": {"code": "print(37 * 84)"}}</tool_call>`` and
the tool's message is what that prints (the value and a newline). It continues from
``builtin:tiny-tools-warm``'s shipped weights for :data:`CONTINUE_STEPS` steps on the same
draws written with ``python`` calls (:data:`CONTINUES_FROM`; 12 min with 2 threads):
trained from ``builtin:tiny`` alone (its first version), it called right but never copied
the printed value; continued, it copies every call's value on differences (a warm-start
kind). Both versions' measures on the task: docs/MEASURED.md, "The ``python`` tool demo,
measured".
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from maxent_grpo.builtin.catalog import (
    WEIGHTS_PYTHON,
    WEIGHTS_TOOLS,
    build_tiny_model,
    build_tiny_tokenizer,
    load_shipped,
)
from maxent_grpo.builtin.warm_start import encode, supervised_pass
from maxent_grpo.rollout.multiturn import message_segment
from maxent_grpo.rollout.sandbox import python
from maxent_grpo.tasks.calculator import calculate, tool_arithmetic
from maxent_grpo.tasks.spec import digit_range

SEED = 2468
"""Seed of the examples, their order and the (forked) torch state."""

MESSAGE = "message"  # a completion part the loss leaves out (the tool's message)

#: the tools a warm start can teach: name -> (function, its shipped weights)
TOOLS = {"calculate": (calculate, WEIGHTS_TOOLS), "python": (python, WEIGHTS_PYTHON)}

#: a warm start that continues from another's shipped weights: tool -> those weights
CONTINUES_FROM = {"python": WEIGHTS_TOOLS}
#: the steps of a warm start from ``builtin:tiny``, and of one that continues another's
STEPS, CONTINUE_STEPS = 3000, 1000


def tool_call_text(expression: str, tool: str = "calculate") -> str:
    """The call the built-in chat template asks for (Hermes format): ``calculate`` on the
    expression, or ``python`` on the code that prints it.

    >>> tool_call_text("2 * 3", "python")
    '<tool_call>{"name": "python", "arguments": {"code": "print(2 * 3)"}}</tool_call>'
    """
    arguments = ({"expression": expression} if tool == "calculate"
                 else {"code": f"print({expression})"})
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': arguments})}</tool_call>"


KINDS = (("+", 2, 2), ("-", 2, 2), ("+", 1, 1), ("-", 1, 1), ("+", 3, 3), ("*", 1, 1),
         ("*", 2, 1), ("*", 1, 2), ("*", 2, 2))
"""The warm start's questions: (operator, digits of the first operand, of the second). The
last, :data:`TASK_KIND`, is the task's own question, whose examples end with the call (see
:func:`examples`): no product of two two-digit numbers and no value of one is ever shown."""

TASK_KIND = ("*", 2, 2)


def answer_range(op: str, digits_a: int, digits_b: int) -> tuple[int, int]:
    """The smallest and largest answer of a kind of :data:`KINDS`.

    >>> answer_range("-", 2, 2), answer_range("*", 2, 1)
    ((-89, 89), (0, 891))
    """
    (a0, a1), (b0, b1) = digit_range(digits_a), digit_range(digits_b)
    values = [int(calculate(f"{a} {op} {b}")) for a in (a0, a1) for b in (b0, b1)]
    return min(values), max(values)


def examples(num_rows: int, seed: int = SEED,
             tool: str = "calculate") -> list[tuple[str, list[tuple[str, str]]]]:
    """``num_rows`` ``(prompt, parts)`` pairs, the :data:`KINDS` in turn, each answered
    directly with a number drawn uniformly from its kind's :func:`answer_range`
    (probability 1/2) or with a call of ``calculate`` on the question's expression. A call
    on the task's question (:data:`TASK_KIND`) ends the example; on the others the tool's
    message and the result copied as the answer follow. ``parts`` are ``("model" |
    "message", text)`` in order, each model part followed by the end of turn. ``tool``
    (:data:`TOOLS`) changes only the call's text and the message, never the draws.

    >>> [(p, len(parts)) for p, parts in examples(9, seed=0)][-3:]
    [('What is 97 * 5?', 1), ('What is 5 * 65?', 1), ('What is 36 * 80?', 1)]
    """
    rng = random.Random(seed)
    out: list[tuple[str, list[tuple[str, str]]]] = []
    for i in range(num_rows):
        op, da, db = KINDS[i % len(KINDS)]
        expression = f"{rng.randint(*digit_range(da))} {op} {rng.randint(*digit_range(db))}"
        prompt = f"What is {expression}?"
        if rng.random() < 0.5:  # the shape of an answer, right only by chance
            out.append((prompt, [("model", str(rng.randint(*answer_range(op, da, db))))]))
        elif (op, da, db) == TASK_KIND:  # the call's format; its result is never shown
            out.append((prompt, [("model", tool_call_text(expression, tool))]))
        else:  # the tool's message: the result, or what python's print writes (and "\n")
            value = calculate(expression)
            message = value if tool == "calculate" else value + "\n"
            out.append((prompt, [("model", tool_call_text(expression, tool)),
                                 (MESSAGE, message), ("model", value)]))
    return out


def _encode(tokenizer: PreTrainedTokenizerBase, rows: list[tuple[str, list[tuple[str, str]]]],
            tool: str = "calculate") -> tuple[torch.Tensor, ...]:
    """:func:`~maxent_grpo.builtin.warm_start.encode` of the rows with ``tool``'s schema in
    the prompt (-100 outside the model's parts and their end-of-turn tokens): each message
    part rendered by the chat template between the model's turns, as the multi-turn
    rollout renders it."""
    fn = TOOLS[tool][0]

    def render(kind: str, part: str) -> str:
        if kind != MESSAGE:
            return part
        return message_segment(tokenizer, [{"role": "tool", "content": part}], [fn])

    return encode(tokenizer, [(prompt, [(kind, render(kind, part)) for kind, part in parts])
                              for prompt, parts in rows], tools=[fn])


def measure(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, prompts: int = 32,
            samples: int = 8, seed: int = 0, ops: str = "*",
            tool: str = "calculate") -> dict[str, float]:
    """Sample ``samples`` completions (temperature 1, 160 tokens, tools on) for ``prompts``
    task prompts of ``tool_arithmetic`` (``ops``, rows from ``seed``) and report the shares
    of samples that call the tool (``call_rate``), whose first call is the question's own
    expression (``right_call_rate``; for ``python``, the code printing it), and whose last
    turn's first number is the answer (``correct``)."""
    from maxent_grpo.rewards.answers import first_number_reward
    from maxent_grpo.rollout import HFGenerateEngine, SamplingSettings
    from maxent_grpo.rollout.multiturn import MultiTurnEngine
    from maxent_grpo.rollout.toolcall import Toolbox, parse_tool_calls

    fn = TOOLS[tool][0]
    rows = tool_arithmetic(prompts, seed, ops=ops)
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                              tokenize=False, add_generation_prompt=True,
                                              tools=[fn]) for r in rows]
    sampling = SamplingSettings(max_new_tokens=160)
    engine = MultiTurnEngine(HFGenerateEngine(model, tokenizer, sampling), tokenizer, sampling,
                             toolbox=Toolbox([fn]), max_tool_calls=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = engine.generate(rendered, [r["answer"] for r in rows], samples)
    firsts = [parse_tool_calls(m[0]["content"]) for m in out.tools.messages]
    expressions = [r["expression"] for r in rows for _ in range(samples)]
    key = "expression" if tool == "calculate" else "code"
    right = [bool(c) and c[0].arguments.get(key) == (e if tool == "calculate" else f"print({e})")
             for c, e in zip(firsts, expressions, strict=True)]
    correct = first_number_reward([p for p in rendered for _ in range(samples)],
                                  out.reward_completions(),
                                  answer=[r["answer"] for r in rows for _ in range(samples)])
    n = len(right)
    return {"call_rate": float((out.tools.calls > 0).float().mean()),
            "right_call_rate": sum(right) / n, "correct": sum(correct) / n}


def retrain(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, tool: str,
            steps: int | None = None, report: bool = False) -> PreTrainedModel:
    """The warm start of ``tool``'s shipped weights, trained anew into ``model`` (a fresh
    ``builtin:tiny``): from the weights it continues from (:data:`CONTINUES_FROM`, then
    ``steps`` or :data:`CONTINUE_STEPS` steps), else from ``model`` itself (``steps`` or
    :data:`STEPS`): 32 fresh :func:`examples` a step (AdamW at lr 3e-3 on the model's parts,
    the torch state forked), returned in eval mode; ``report`` prints the progress."""
    default, batch_size = STEPS, 32
    if tool in CONTINUES_FROM:  # the calculate warm start, then python's call format
        load_shipped(model, CONTINUES_FROM[tool])
        default = CONTINUE_STEPS
    steps = default if steps is None else steps
    ids, att, lab = _encode(tokenizer, examples(steps * batch_size, SEED, tool), tool)
    return supervised_pass(model, ids, att, lab, steps=steps, batch_size=batch_size, lr=3e-3,
                           seed=SEED, trim=True, report=report)


def _main(argv: list[str] | None = None) -> dict[str, float]:
    from safetensors.torch import save_model

    parser = argparse.ArgumentParser(
        prog="python -m maxent_grpo.builtin.tool_warm_start",
        description="Measure the shipped weights of builtin:tiny-tools-warm (--tool python: "
                    "builtin:tiny-python-warm), or train a new copy.")
    parser.add_argument("--retrain", action="store_true",
                        help="train a new copy (from builtin:tiny; --tool python: from "
                             "builtin:tiny-tools-warm's shipped weights) and write it to --out")
    parser.add_argument("--out", type=Path, help="where --retrain writes the weights")
    parser.add_argument("--tool", choices=sorted(TOOLS), default="calculate",
                        help="the tool whose calls it teaches (default calculate)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"training steps (default {STEPS}; {CONTINUE_STEPS} for a warm start "
                             "that continues from another's weights)")
    args = parser.parse_args(argv)
    weights = TOOLS[args.tool][1]
    if args.retrain and args.out is None:
        parser.error(f"--retrain needs --out FILE (the shipped weights are {weights})")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1; got {args.steps}")
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer)
    if args.retrain:
        retrain(model, tokenizer, args.tool, args.steps, report=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        save_model(model, str(args.out))
        print(f"wrote {args.out} (trained with {torch.get_num_threads()} threads)")
    else:
        load_shipped(model, weights)
    result = {}
    for ops, label in (("*", "the task (two-digit products)"),
                       ("-", "a warm-start kind (differences)")):
        skill = measure(model, tokenizer, ops=ops, tool=args.tool)
        print(f"{label}: " + ", ".join(f"{k} {v:.3f}" for k, v in skill.items()))
        result |= {f"{k}{'' if ops == '*' else '_subtraction'}": v for k, v in skill.items()}
    return result


if __name__ == "__main__":
    _main()
