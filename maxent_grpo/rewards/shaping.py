"""Shaping rewards: the layout ``<think>...</think><answer>...</answer>`` and the length
penalty ``overlong``.

Reasoning models' chat templates often end the prompt with ``<think>`` so the completion
starts inside the reasoning block. Here, when the text the model continued ends with
``<think>`` (trailing whitespace aside), the completion is read as if it began with
``<think>``, and when it ends with a whole block (``<think>\\n\\n</think>``, a template's
no-thinking mode), as if it began with that block or as written, the higher score: the
trainer gives it as ``rendered_prompts`` (the prompt after the chat template); called
without it, a plain-string prompt is that text, and conversational prompts (lists of
messages) never open the block.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from maxent_grpo.rewards.answers import answer_blocks, completion_text, prompt_opens_think
from maxent_grpo.rewards.registry import register_reward

#: a block's text holds no tag (a tempered group: linear, where a lazy one backtracked over
#: every later tag, 2 s on 100k characters of repeated blocks)
_PLAIN = r"((?:(?!</?(?:think|answer)>).)*)"
_LAYOUT = re.compile(rf"\s*<think>{_PLAIN}</think>\s*<answer>{_PLAIN}</answer>\s*", re.DOTALL)
TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def _texts(prompts: list, completions: list, rendered: list | None = None
           ) -> list[tuple[str, ...]]:
    """Per completion the readings of its layout (:func:`_opened`): with the prompt's closed
    block before it, and as written (a model may write its own block after it)."""
    if len(prompts) != len(completions):
        raise ValueError(
            f"prompts and completions must have the same length; got {len(prompts)} and "
            f"{len(completions)}"
        )
    rendered = prompts if rendered is None else rendered
    readings = []
    for r, c in zip(rendered, completions, strict=True):
        opened, text = _opened(r), completion_text(c)
        readings.append((opened + text, text) if opened.endswith("</think>") else (opened + text,))
    return readings


def _opened(prompt: object) -> str:
    """What the prompt began of the layout: ``<think>`` when it opens the block, its whole
    trailing block when it closes one (a template's ``<think>\\n\\n</think>``: no thinking)."""
    if prompt_opens_think(prompt):
        return "<think>"
    text = prompt.rstrip() if isinstance(prompt, str) else ""
    closed = text.endswith("</think>") and "<think>" in text
    return text[text.rindex("<think>"):] if closed else ""


@register_reward("format")
def format_reward(prompts: list, completions: list, rendered_prompts: list | None = None,
                  **kwargs: object) -> list[float]:
    """1.0 when the completion is exactly ``<think>…</think>`` then ``<answer>…</answer>``,
    with only whitespace before, between and after, no other tag inside either block and a
    non-blank answer; else 0.0. The reasoning may be empty.

    >>> format_reward(["Q"], ["<think>3+4=7</think>\\n<answer>7</answer>"])
    [1.0]
    >>> format_reward(["Q"], ["<answer>7</answer> because 3+4=7"])
    [0.0]
    """
    def layout(text: str) -> bool:
        match = _LAYOUT.fullmatch(text)
        return match is not None and match.group(2).strip() != ""

    return [1.0 if any(map(layout, texts)) else 0.0
            for texts in _texts(prompts, completions, rendered_prompts)]


@register_reward("tag_count")
def tag_count_reward(prompts: list, completions: list, rendered_prompts: list | None = None,
                     **kwargs: object) -> list[float]:
    """0.25 for each of ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` that occurs
    exactly once (order not checked), so 0.0 to 1.0 in steps of 0.25.

    >>> tag_count_reward(["Q"], ["<think>7</think><answer>7</answer>"])
    [1.0]
    >>> tag_count_reward(["Q"], ["<think>7</think><think>7</think> 7"])
    [0.0]
    """
    return [max(0.25 * sum(text.count(tag) == 1 for tag in TAGS) for text in texts)
            for texts in _texts(prompts, completions, rendered_prompts)]


@register_reward("answer_format")
def answer_format_reward(prompts: list, completions: list, **kwargs: object) -> list[float]:
    """1.0 when the completion contains an ``<answer>...</answer>`` block anywhere, else
    0.0: a gentle first signal for tiny models that never emit the tags.

    >>> answer_format_reward(["Q"], ["it is <answer>7</answer>"])
    [1.0]
    >>> answer_format_reward(["Q"], ["it is 7"])
    [0.0]
    """
    return [1.0 if answer_blocks(completion_text(c)) else 0.0 for c in completions]


@register_reward("overlong")
def overlong_reward(
    prompts: list, completions: list, completion_ids: list[list[int]] | None = None,
    max_completion_length: int | None = None, overlong_buffer: int | None = None,
    exchange_lengths: list[int] | None = None, **kwargs: object,
) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) as a reward in ``[-1, 0]``.

    With ``L = len(completion_ids[i])`` (the generated tokens, stop token included; for a
    multi-turn row ``exchange_lengths[i]``, the whole exchange's tokens, tool messages
    included, since that is what the budget bounds and where a row is cut),
    ``L_max = max_completion_length`` and ``L_c = overlong_buffer``::

        0                          if L <= L_max - L_c
        ((L_max - L_c) - L) / L_c  if L_max - L_c < L <= L_max
        -1                         if L > L_max

    so a completion is pushed down linearly over the last ``L_c`` tokens of the budget and a
    truncated one (``L = L_max``) gets -1. In ``model.rewards`` the trainer passes
    ``max_completion_length`` and ``buffer`` (default a quarter of it)::

        rewards: {accuracy: 1.0, overlong: {weight: 1.0, buffer: 64}}

    >>> overlong_reward(["Q"], ["a"], completion_ids=[[1] * 4], max_completion_length=8,
    ...                 overlong_buffer=4)
    [0.0]
    >>> overlong_reward(["Q"], ["b"], completion_ids=[[1] * 7], max_completion_length=8,
    ...                 overlong_buffer=4)
    [-0.75]
    >>> overlong_reward(["Q"], ["c"], completion_ids=[[1] * 8], max_completion_length=8,
    ...                 overlong_buffer=4)
    [-1.0]
    """
    if completion_ids is None or max_completion_length is None:
        raise ValueError("the overlong reward needs completion_ids and max_completion_length "
                         "(the trainer passes both; call it with them)")
    buffer = overlong_buffer if overlong_buffer is not None else max(1, max_completion_length // 4)
    if not 1 <= buffer <= max_completion_length:
        raise ValueError(f"overlong buffer must be in [1, max_completion_length="
                         f"{max_completion_length}]; got {buffer}")
    if len(completion_ids) != len(completions):
        raise ValueError(f"completion_ids must have one entry per completion "
                         f"({len(completions)}); got {len(completion_ids)}")
    lengths = ([len(ids) for ids in completion_ids] if exchange_lengths is None
               else [int(n) for n in exchange_lengths])
    if len(lengths) != len(completions):
        raise ValueError(f"exchange_lengths must have one entry per completion "
                         f"({len(completions)}); got {len(lengths)}")
    start = max_completion_length - buffer
    return [0.0 if n <= start else -1.0 if n > max_completion_length else (start - n) / buffer
            for n in lengths]


class Overlong:
    """The ``overlong`` reward of ``model.rewards``: :func:`overlong_reward` with the
    trainer's ``max_completion_length`` (``rewards.max_completion_length()``, read at each
    call) and the entry's ``buffer``."""

    def __init__(self, fn: Callable, buffer: int | None, rewards: Any) -> None:
        self.fn, self.buffer, self.rewards = fn, buffer, rewards
        self.__name__ = getattr(fn, "__name__", "overlong")

    def __call__(self, *args: Any, **kwargs: Any) -> list:
        return self.fn(*args, max_completion_length=self.rewards.max_completion_length(),
                       overlong_buffer=self.buffer, **kwargs)
