"""From source rows to :class:`~maxent_grpo.training.data.sampler.PromptExample`: checks and
rendering.

A prompt is a non-empty string or list of chat messages (dicts with str ``role`` and
``content``); an answer is a string or a finite number, kept as a string ("" without an answer
column; an integral float without its ".0", as Arrow reads 3 as 3.0). Errors name the source
(or file), the row and the ``data.`` option to fix.

Rendering: with ``apply_chat_template``, ``[system?] + [{"role": "user", "content": prompt}]``
(a message list as is, the system message prepended unless it starts with one) through
``tokenizer.apply_chat_template(..., add_generation_prompt=True)``; without it the raw prompt,
preceded by ``system_prompt + "\\n\\n"`` when set (message lists then raise ValueError).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from numbers import Integral
from typing import Any

from maxent_grpo.training.data.sampler import Prompt, PromptExample
from maxent_grpo.training.data.sources import SplitRows
from maxent_grpo.validation import is_number, require

__all__ = ["PromptFormat"]


def _message_list_text(text: str) -> bool:
    """Whether ``text`` is a list of chat messages written out as JSON or as Python's repr
    (what pandas writes into a CSV cell for a list of dicts)."""
    import ast
    import json

    for parse in (json.loads, ast.literal_eval):
        try:
            value = parse(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        return isinstance(value, list) and bool(value) and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in value)
    return False


def _check_unicode(text: str, where: str) -> None:
    """Refuse a lone surrogate (half of an emoji cut by a JavaScript or scraping tool), which
    no tokenizer can encode: it stopped the setup with a TypeError from deep inside one."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{where} is not valid Unicode: {text[err.start:err.end]!r} at "
                         f"character {err.start} (half of a character cut in two?): "
                         f"{text[max(0, err.start - 40):err.end + 10]!r}") from None


@dataclass(frozen=True)
class PromptFormat:
    """Which columns hold the prompt and answer, and how the prompt is rendered (the first
    four as the ``PromptDataModule`` options of the same names; ``tokenizer`` returns the
    tokenizer, called to apply a chat template or to check that plain prompts lose no bos;
    ``tools``: the functions whose schemas the template shows, ``data.tools``)."""

    prompt_column: str
    answer_column: str | None
    system_prompt: str | None
    apply_chat_template: bool
    tokenizer: Callable[[], Any]
    tools: tuple[Callable[..., Any], ...] = ()

    def examples(self, split: SplitRows) -> list[PromptExample]:
        """Check and render every row of ``split``, in order; each example keeps every column
        but the prompt, plus ``"answer"``. Raises ValueError for a missing column or a
        malformed prompt or answer."""
        columns_of: dict[str, dict[str, None]] = {}  # the column names of each file (source)
        for row, index in zip(split.rows, split.indices, strict=True):
            columns_of.setdefault(split.where(index)[0], {}).update(dict.fromkeys(row))
        for part, names in columns_of.items():
            require(
                self.prompt_column in names,
                f"{part} has no prompt column {self.prompt_column!r} (data.prompt_column); "
                f"columns: {sorted(names)}",
            )
            require(
                self.answer_column is None or self.answer_column in names,
                f"{part} has no answer column {self.answer_column!r} (data.answer_column, "
                f"null allowed); columns: {sorted(names)}",
            )
            if self.answer_column not in (None, "answer") and "answer" in names:
                warnings.warn(  # the rewards' answer keyword holds the reference's values
                    f"{part} has a column 'answer' that the rewards do not see: their answer "
                    f"keyword holds data.answer_column {self.answer_column!r}'s values; "
                    "rename that column to pass it on (or set data.answer_column: answer)",
                    stacklevel=2)
        others = list({n: None for names in columns_of.values() for n in names
                       if n != self.prompt_column})
        examples, blank, dropped = [], [], {}
        for row, index in zip(split.rows, split.indices, strict=True):
            part, number = split.where(index)
            at = f"{part} row {number}"
            raw = self._prompt(row.get(self.prompt_column), at)
            answer = self._answer(row, at)
            if self.answer_column is not None and not answer.strip():
                blank.append(at)
            columns = {n: row.get(n) for n in others}
            columns["answer"] = answer
            try:
                text = self.render(raw)
            except ValueError as err:
                raise ValueError(f"{at}: {err}") from err
            eos = None if isinstance(raw, str) or raw[-1].get("role") != "assistant" else (
                getattr(self.tokenizer(), "eos_token", None))
            require(not eos or not text.rstrip().endswith(eos),
                    f"{at}: the prompt ends with an assistant message, and the chat template "
                    f"closes it with the end of text {eos!r} and opens no new assistant turn "
                    "(it has no generation prompt, as Mistral's): the model would write on "
                    "after its own end; leave the trailing assistant message out of the "
                    "prompt, or use a template that opens a new turn")
            for role in _dropped_roles(self.messages(raw) if self.apply_chat_template else raw,
                                       text):
                dropped.setdefault(role, at)
            examples.append(PromptExample(index, text, raw, answer, columns))
        if dropped:  # the model never sees what the template leaves out
            warnings.warn(
                "the tokenizer's chat template leaves out the content of prompt messages with "
                "role(s) " + ", ".join(f"{r!r} (first: {at})" for r, at in dropped.items())
                + ": the model does not see them; use the roles the template renders"
                + (" (data.system_prompt adds a 'system' message)" if "system" in dropped
                   and self.system_prompt is not None else ""), stacklevel=2)
        tokenizer = None if self.apply_chat_template else self.tokenizer()
        bos = None if tokenizer is None else _leading_special(tokenizer)
        said = (bos, getattr(tokenizer, "name_or_path", None))  # once, not for each split
        if bos is not None and said not in _SAID and any(  # (one written by hand: given)
                isinstance(e.raw_prompt, str) and not e.prompt.startswith(bos) for e in examples):
            _SAID.add(said)
            warnings.warn(  # (as TRL encodes them: the text as written)
                f"the tokenizer starts a text with {bos!r}, and plain prompts "
                "(data.apply_chat_template false) are encoded without the tokens it adds: a "
                "model trained with it (Llama-2, Mistral, Gemma base models) samples worse "
                "without it; write it at the start of each prompt to give it", stacklevel=2)
        if blank:  # an empty CSV cell, a missing last cell, "": graded None by the rewards
            warnings.warn(
                f"{len(blank)} of {len(examples)} rows have a blank answer in column "
                f"{self.answer_column!r} (data.answer_column; the first: {blank[0]}): a reward "
                "that reads the answer grades their completions None, so unless another "
                "reward grades them (a column it reads) they train on a reward of 0; fill "
                "those answers or leave the rows out", stacklevel=2)
        return examples

    def messages(self, prompt: Prompt) -> list[dict[str, Any]]:
        """The messages the chat template renders for ``prompt`` (a text is one user
        message), after a ``system_prompt`` message unless the prompt starts with its own."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(
            prompt)
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    def render(self, prompt: Prompt) -> str:
        """The text fed to generation for ``prompt`` (see the module docstring)."""
        if isinstance(prompt, str) and not self.apply_chat_template:
            return prompt if self.system_prompt is None else f"{self.system_prompt}\n\n{prompt}"
        messages = self.messages(prompt)
        added = len(messages) > (1 if isinstance(prompt, str) else len(prompt))
        tools = {"tools": list(self.tools)} if self.tools else {}
        import jinja2  # transformers' chat templates are jinja2's

        tokenizer = self.tokenizer()
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **tools)
        except jinja2.exceptions.TemplateError as err:  # the template's own refusal
            system = " (data.system_prompt adds the system message)" if added else ""
            raise ValueError(
                f"the tokenizer's chat template refuses the messages with roles "
                f"{[m.get('role') for m in messages]}{system}: {type(err).__name__}: {err}"
            ) from err
        names = [getattr(fn, "__name__", "") for fn in self.tools]
        require(all(name in text for name in names),
                f"the tokenizer's chat template does not show the tools {names} (data.tools) "
                "to the model; use a model whose template renders tools=")
        return text

    def _prompt(self, value: Any, at: str) -> Prompt:
        where = f"{at} column {self.prompt_column!r} (data.prompt_column)"
        if isinstance(value, str):
            if not value.strip():
                raise ValueError(f"{where} is an empty prompt")
            _check_unicode(value, where)
            if value.lstrip().startswith("[") and _message_list_text(value):
                raise ValueError(
                    f"{where} is a list of chat messages written out as text (a CSV cell "
                    f"holds only text): {value[:80]!r}; keep message lists in JSONL or "
                    "Parquet, where they stay lists")
            return value
        if not (isinstance(value, list) and value):
            raise ValueError(
                f"{where} must be a non-empty string or list of chat messages; got {value!r:.200}"
            )
        for msg in value:
            if not (
                isinstance(msg, dict)
                and isinstance(msg.get("role"), str)
                and isinstance(msg.get("content"), str)
            ):
                raise ValueError(
                    f"{where}: chat messages must be dicts with str 'role' and 'content'; "
                    f"got {msg!r}"
                )
        for msg in value:
            _check_unicode(msg["content"], where)
        if not any(msg["content"].strip() for msg in value):
            raise ValueError(f"{where}: every chat message is empty; got {value!r:.200}")
        if not self.apply_chat_template:
            raise ValueError(
                f"{where} holds chat messages, which need data.apply_chat_template: true"
            )
        return value

    def _answer(self, row: dict[str, Any], at: str) -> str:
        if self.answer_column is None:
            return ""
        value = row.get(self.answer_column)
        if isinstance(value, str):
            _check_unicode(value, f"{at} column {self.answer_column!r} (data.answer_column)")
            return value
        if value is None:  # a Parquet null, a JSON row without it: blank, as an empty cell
            return ""
        if isinstance(value, Decimal) and value.is_finite():  # a Parquet decimal column
            return format(value, "f")
        if not is_number(value):
            raise ValueError(
                f"{at} column {self.answer_column!r} (data.answer_column) must be a string "
                f"or a finite number; got {value!r}"
            )
        if isinstance(value, Integral):
            return str(int(value))
        value = float(value)  # written out: 1e-05 is 0.00001, 3.0 is 3
        return str(int(value)) if value.is_integer() else format(Decimal(repr(value)), "f")


def _dropped_roles(prompt: Prompt, text: str) -> list[str]:
    """The roles of ``prompt``'s messages whose text is not in ``text``, the prompt the chat
    template rendered (a template that knows no such role leaves it out); assistant turns
    are not looked at (templates rewrite them, dropping their reasoning), and a message
    counts as shown when the first line of its text is."""
    if isinstance(prompt, str):
        return []
    return [str(m.get("role")) for m in prompt
            if m.get("role") != "assistant" and isinstance(m.get("content"), str)
            and m["content"].strip() and m["content"].strip().splitlines()[0] not in text]


#: the tokenizers whose leading token plain prompts leave out that were warned about
_SAID: set[tuple[str, str | None]] = set()


def _leading_special(tokenizer: Any) -> str | None:
    """The token a tokenizer adds before a text (a bos: ``<s>``, ``<bos>``), else None."""
    ids, plain = (tokenizer("1", add_special_tokens=added)["input_ids"] for added in (True, False))
    return tokenizer.convert_ids_to_tokens(ids[0]) if ids[:1] != plain[:1] else None
