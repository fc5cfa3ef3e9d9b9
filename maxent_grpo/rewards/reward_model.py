"""A sequence-classification model as a reward function (``model:<name_or_path>`` in
``model.rewards``), scored as TRL's ``GRPOTrainer`` scores a reward model.

The text of a row is ``prompt + completion`` for a text prompt and a text completion that
the policy saw as such, and otherwise (a conversational prompt; a text prompt the policy saw
through its chat template, ``data.apply_chat_template``; a multi-turn rollout's messages
after a text prompt: the prompt becomes the user's turn) the whole conversation rendered
with the reward model's own chat template (a ``data.system_prompt`` is not in it). Texts are
tokenised with its tokenizer (right-padded, no added special tokens; a special token's
text written by the policy is read as text, not as the token) and scored
``batch_size`` rows at a time on the policy's device under ``torch.inference_mode``; the
reward is the single logit (``num_labels=1``) at the last non-pad token. The model is
loaded on the first call and never trained or checkpointed; one whose classification head
is not in its weights (a base or chat model: the head would be random), or a text longer
than its positions, is a ValueError naming the reward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["RewardModel"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: the tool-call tags a multi-turn rollout puts back in the model's turns: read as the tokens
CALL_TAGS = frozenset({"<tool_call>", "</tool_call>"})


class RewardModel:
    """Scores ``(prompt, completion)`` pairs with ``AutoModelForSequenceClassification``.

    Args:
        name_or_path: a hub name or a local folder holding the model and its tokenizer.
        label: the reward's key in ``model.rewards`` (for messages).
        batch_size: rows per forward pass.
        dtype: parameter dtype (``float32``, ``bfloat16``, ``float16``).
        device: returns the device to score on (the policy's), asked at every call.

    Called as a reward function, ``rm(prompts=..., completions=..., **ignored)``, it returns
    one float per row; a model that cannot be loaded raises ``ValueError`` naming the
    reward::

        rm = RewardModel("/models/rm", label="model:/models/rm")
        rm(prompts=["2+2="], completions=["4"])          # [0.73]: its logit
    """

    def __init__(
        self, name_or_path: str, label: str, batch_size: int = 32, dtype: str = "float32",
        device: Callable[[], torch.device] = lambda: torch.device("cpu"),
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"{label}: dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
        from maxent_grpo.models import resolve_model_path

        if not str(name_or_path).startswith("builtin:"):  # a mistyped folder: now, not at
            try:  # the first step, after the policy loaded
                resolve_model_path(name_or_path)
            except ValueError as err:
                raise ValueError(f"reward {label!r}: {err}") from None
        self.name_or_path, self.label = name_or_path, label
        self.batch_size, self.dtype, self.device = batch_size, dtype, device
        self.model: Any = None
        self.tokenizer: Any = None
        self._shown: dict[tuple[str, str], bool] = {}  # (template, role): its messages shown
        self._limit: int | None = None  # its learned positions (0: no such table), once read
        self._specials: list[str] | None = None  # its special tokens' texts, once read
        self.__name__ = label

    def load(self) -> None:
        """Load the model and tokenizer (once); ValueError naming the reward if that fails."""
        if self.model is not None:
            return
        # imported here so that importing maxent_grpo.rewards stays light
        from transformers import AutoModelForSequenceClassification

        from maxent_grpo.models import check_token_ids, load_tokenizer, resolve_model_path

        try:
            path = resolve_model_path(self.name_or_path)
            tokenizer = load_tokenizer(self.name_or_path, padding_side="right")
            model, info = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, dtype=DTYPES[self.dtype], output_loading_info=True)
        except (OSError, ValueError, RuntimeError) as err:
            why = ("a weight's size differs from a one-output classifier's (its "
                   "classification head has other outputs?)" if "ignore_mismatched_sizes" in
                   str(err) else str(err))
            raise ValueError(
                f"reward {self.label!r}: cannot load {self.name_or_path!r} as a "
                f"sequence-classification model with one output (num_labels=1): {why}"
            ) from err
        if missing := list(info.get("missing_keys") or []):
            raise ValueError(
                f"reward {self.label!r}: {self.name_or_path!r} has no trained classification "
                f"head ({', '.join(sorted(missing)[:3])} not in its weights: its scores would be "
                "random); name a trained reward model (a sequence-classification model with "
                "one output)")
        try:  # a pad token added without resizing: an index error at the first padded batch
            check_token_ids(tokenizer, model, self.name_or_path)
        except ValueError as err:
            raise ValueError(f"reward {self.label!r}: {err}") from None
        # the score is read at the last token that is not padding, found by the pad id
        model.config.pad_token_id = tokenizer.pad_token_id
        self.model, self.tokenizer = model.eval().requires_grad_(False), tokenizer

    def texts(self, prompts: list, completions: list,
              rendered: list[str] | None = None) -> list[str]:
        """The text scored for each row (see the module docstring); ``rendered``: the
        prompts as the policy continued them (where one does not end with its text prompt,
        the policy saw it through a chat template)."""
        self.load()
        out = []
        chat = bool(getattr(self.tokenizer, "chat_template", None))
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            if isinstance(prompt, str):
                # the policy saw it through a chat template (a system prompt without one
                # comes before the prompt: the text still ends with it)
                templated = rendered is not None and not rendered[i].endswith(prompt) and chat
                if isinstance(completion, str) and not templated:
                    out.append(prompt + self._as_text(completion))
                    continue
                prompt = [{"role": "user", "content": prompt}]  # a multi-turn exchange
            if isinstance(completion, str):
                completion = [{"role": "assistant", "content": self._as_text(completion)}]
            else:
                completion = [{**m, "content": self._as_text(m["content"])} if isinstance(
                    m, dict) and isinstance(m.get("content"), str) else m for m in completion]
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(
                    f"reward {self.label!r}: the prompts are conversations but the tokenizer "
                    f"of {self.name_or_path!r} has no chat template to render them"
                )
            out.append(self._render(list(prompt) + list(completion)))
        return out

    def _as_text(self, written: str) -> str:
        """Model-written ``written`` with each special token's text (``<|im_end|>``,
        ``<|endoftext|>``) broken by a word joiner (U+2060) after its first character: read
        as text, not as the token (the policy spelling its pad token had its end taken for
        padding; spelling a turn's end and a user's turn gave the reward model a turn); not
        the :data:`CALL_TAGS`, which a multi-turn rollout writes as the tokens."""
        specials = self._specials
        if specials is None:
            decoder = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
            named = [*self.tokenizer.all_special_tokens,
                     *(t.content for t in decoder.values() if getattr(t, "special", False))]
            specials = self._specials = sorted({t for t in named if len(t) > 1} - CALL_TAGS,
                                               key=len, reverse=True)
        for token in specials:
            if token in written:
                written = written.replace(token, f"{token[0]}\u2060{token[1:]}")
        return written

    def _render(self, conversation: list[dict[str, Any]]) -> str:
        """``conversation`` through the reward model's chat template; ValueError when the
        template refuses a role, or leaves out a tool's or an environment's message."""
        import jinja2

        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False)
            lost = [role for role in dict.fromkeys(str(m.get("role")) for m in conversation)
                    if role not in ("user", "assistant", "system") and not self._shows(role)]
        except jinja2.exceptions.TemplateError as err:
            text, lost, why = None, [], f"refuses them ({err})"
        if text is None or lost:
            roles = sorted({str(m.get("role")) for m in conversation})
            raise ValueError(
                f"reward {self.label!r}: the chat template of {self.name_or_path!r} cannot "
                f"render this exchange's messages (roles {roles}): it "
                + (why if text is None else f"leaves out the {lost[0]!r} message")
                + "; use a reward model whose template renders tool messages, or a function "
                "reward")
        return text

    def _shows(self, role: str) -> bool:
        """Whether the chat template shows a message of ``role`` (rendered once per template
        and role, with a text no message holds)."""
        key = (str(self.tokenizer.chat_template), role)
        if key not in self._shown:
            probe = "\u2063probe\u2063"
            self._shown[key] = probe in self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                 {"role": role, "content": probe}], tokenize=False)
        return self._shown[key]

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        texts = self.texts(prompts, completions, kwargs.get("rendered_prompts"))
        device = self.device()
        if self.model.device != device:
            self.model.to(device)
        scores: list[float] = []
        # in its own dtype: not the step's mixed precision (bf16-mixed rounded float32 scores)
        with torch.inference_mode(), torch.autocast(torch.device(device).type, enabled=False):
            for start in range(0, len(texts), self.batch_size):
                inputs = self.tokenizer(
                    texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                    add_special_tokens=False,
                ).to(device)
                self._fits(inputs["input_ids"].shape[1])
                logits = self.model(**inputs).logits  # (rows, 1)
                scores.extend(logits[:, 0].float().tolist())
        return scores

    def _fits(self, tokens: int) -> None:
        """ValueError naming the reward where a text of ``tokens`` tokens passes the model's
        table of learned absolute positions (an index error, or a device assert on a GPU,
        inside its embedding; BERT's, GPT-2's, RoBERTa's less its padding offset); a model
        without one (rotary or relative positions) has no such bound. OPT's and BART's
        (``embed_positions``) hold an offset of their own: the config's length bounds them."""
        if self._limit is None:
            from maxent_grpo.models import _POSITIONS, position_limit

            tables = [m for name, m in self.model.named_modules() if isinstance(
                m, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITIONS]
            pad = tables[0].padding_idx if tables else None
            self._limit = min(tables[0].num_embeddings - (0 if pad is None else pad + 1),
                              position_limit(self.model) or 1 << 62) if tables else 0
        if self._limit and tokens > self._limit:
            raise ValueError(
                f"reward {self.label!r}: a text of {tokens} tokens (prompt and completion) is "
                f"longer than the {self._limit} positions of {self.name_or_path!r}: lower "
                "data.max_prompt_length or model.max_completion_length, or use a reward "
                "model with a longer context")
