"""Format rewards: shaping signals about the layout ``<think>...</think><answer>...</answer>``.

Reasoning models' chat templates often end the prompt with ``<think>`` so the completion
starts inside the reasoning block. Here, when a plain-string prompt ends with ``<think>``
(trailing whitespace aside), the completion is read as if it began with ``<think>``;
conversational prompts (lists of messages) never open the block.
"""

from __future__ import annotations

import re

from maxent_grpo.rewards.parsing import completion_text, prompt_opens_think
from maxent_grpo.rewards.registry import register_reward

_LAYOUT = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_TAG = re.compile(r"</?(?:think|answer)>")
_ANSWER_BLOCK = re.compile(r"<answer>.*?</answer>", re.DOTALL)
TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def _texts(prompts: list, completions: list) -> list[str]:
    if len(prompts) != len(completions):
        raise ValueError(
            f"prompts and completions must have the same length; got {len(prompts)} and "
            f"{len(completions)}"
        )
    return [
        ("<think>" if prompt_opens_think(p) else "") + completion_text(c)
        for p, c in zip(prompts, completions, strict=True)
    ]


@register_reward("format")
def format_reward(prompts: list, completions: list, **kwargs: object) -> list[float]:
    """1.0 when the completion is exactly ``<think>…</think>`` then ``<answer>…</answer>``,
    with only whitespace before, between and after, no other tag inside either block and a
    non-blank answer; else 0.0. The reasoning may be empty.

    >>> format_reward(["Q"], ["<think>3+4=7</think>\\n<answer>7</answer>"])
    [1.0]
    >>> format_reward(["Q"], ["<answer>7</answer> because 3+4=7"])
    [0.0]
    """
    scores = []
    for text in _texts(prompts, completions):
        match = _LAYOUT.fullmatch(text)
        ok = (
            match is not None
            and not _TAG.search(match.group(1))
            and not _TAG.search(match.group(2))
            and match.group(2).strip() != ""
        )
        scores.append(1.0 if ok else 0.0)
    return scores


@register_reward("tag_count")
def tag_count_reward(prompts: list, completions: list, **kwargs: object) -> list[float]:
    """0.25 for each of ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` that occurs
    exactly once (order not checked), so 0.0 to 1.0 in steps of 0.25.

    >>> tag_count_reward(["Q"], ["<think>7</think><answer>7</answer>"])
    [1.0]
    >>> tag_count_reward(["Q"], ["<think>7</think><think>7</think> 7"])
    [0.0]
    """
    return [
        0.25 * sum(text.count(tag) == 1 for tag in TAGS) for text in _texts(prompts, completions)
    ]


@register_reward("answer_format")
def answer_format_reward(prompts: list, completions: list, **kwargs: object) -> list[float]:
    """1.0 when the completion contains an ``<answer>...</answer>`` block anywhere, else
    0.0: a gentle first signal for tiny models that never emit the tags.

    >>> answer_format_reward(["Q"], ["it is <answer>7</answer>"])
    [1.0]
    >>> answer_format_reward(["Q"], ["it is 7"])
    [0.0]
    """
    return [1.0 if _ANSWER_BLOCK.search(completion_text(c)) else 0.0 for c in completions]
