"""Rollout with ``transformers``' ``model.generate``: plain sampling, rows prompt-major.

For B prompts and G generations: tokenise without special tokens, keep the last
``max_prompt_length`` tokens, left-pad to ``P``; ``generate(num_return_sequences=G)`` under
``no_grad`` in eval mode (restored after); cut the ``(B*G, T)`` completion off, its mask
``m[i,t]`` True up to and including the first stop token (eos plus ``stop_token_ids``; all
True when truncated), ids outside it set to the pad id.

Sampling: ``softmax(logits / temperature)`` restricted by ``top_k`` (0 = off) and ``top_p``
(1 = off) only (the model's ``generation_config`` is set aside), the distribution the trainer
scores. ``do_sample=False`` decodes greedily (evaluation's greedy pass@1, G = 1).

Shared prefill (``share_prefill=True``): the first ``P - 1`` tokens of the B prompts run
once, their cache is repeated G times (``Cache.batch_repeat_interleave``) and ``generate``
continues from it: prefill work falls from ``B*G*P`` to ``B*(P-1) + B*G`` tokens, with the
same random draws. Caches that cannot be repeated, models not a ``PreTrainedModel`` (a
``peft`` one wrapping one is), one-token prompts and G = 1 use the plain path.

Static cache (``cache="static"``): preallocated for ``P + T_max`` tokens, so every decode step has
the same shapes and, on CUDA, is compiled once per shape (``prompt_bucket`` keeps the shapes few,
in the turns of a multi-turn rollout too; padding is masked). On the CPU samples match the dynamic
cache's to rounding. Under mixed precision (``bf16-mixed``: autocast over float32 embeddings) keys
come out in float32 and values in bfloat16, which the static cache of some transformers versions
(5.17, not 5.24: :func:`static_cache_holds_two_dtypes`) cannot hold (``index_copy_`` dtype error,
seen on an H200): with those, a static-cache engine with ``generation_dtype: model`` generates on a
copy in the autocast dtype (as ``bfloat16`` would; a warning says so once), except for sharded
parameters, which cannot be copied.

Generation copy (``generation_dtype`` ``"bfloat16"`` / ``"float16"``): generate, autocast off, on a
copy in that dtype (:mod:`maxent_grpo.rollout.generation_copy`; 2 bytes per parameter), refreshed
at every rollout (:attr:`HFGenerateEngine.refresh_seconds`, in ``generate_seconds``); a model
already in that dtype generates as is. Refused (ValueError) for sharded parameters (FSDP2, ZeRO-3)
or a model neither ``PreTrainedModel`` nor ``peft``. A sampled rollout from a copy reports the
copy's log-probs of its tokens (``sampler_logps``, :mod:`~maxent_grpo.rollout.sampled_logps`), so
the trainer can measure and correct the gap (``model.sampler_correction``); from the model itself
it reports none.

Wrapped models: ``model`` must have ``.generate`` (a ``PreTrainedModel``, also FSDP2
``fully_shard``-ed; for DDP pass ``ddp.module``). Sharded parameters
(:func:`sharded_across_ranks`, which also sees ZeRO-3) make generation use ``synced_gpus``.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
from torch import nn
from transformers import (
    Cache,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StaticCache,
)

from maxent_grpo.adapters import has_adapters
from maxent_grpo.rollout.batch import GenerationBatch
from maxent_grpo.rollout.generation_copy import (
    DTYPES,
    check_copyable,
    generation_copy,
    sharded,
    static_cache_holds_two_dtypes,
)
from maxent_grpo.rollout.protocol import (
    Continuation,
    RolloutEngine,
    RolloutOutput,
    SamplingSettings,
    check_request,
    decode_texts,
    read_tags,
    stop_ids,
)
from maxent_grpo.rollout.sampled_logps import recorder
from maxent_grpo.validation import check_bool, check_choice, check_int, require


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], limit: int | None, bucket: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(B, P)`` prompt ids and bool mask: each prompt tokenised without special
    tokens, its last ``limit`` tokens kept, ``P`` rounded up to a multiple of ``bucket``. Warned:
    cut prompts (a PromptDataModule drops them) and text read as an unknown token (the built-in
    tiny models spell ASCII only). ValueError names a prompt empty after tokenisation."""
    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    unk = tokenizer.unk_token_id  # not eos or bos (a prompt may hold those); pad: unpadded
    if unk not in (None, tokenizer.eos_token_id, tokenizer.bos_token_id) and any(  # its name
            n.count(unk) > prompts[i].count(tokenizer.unk_token) for i, n in enumerate(encoded)):
        warnings.warn(f"prompts hold text the tokenizer cannot spell: the model sees its unknown "
                      f"token {tokenizer.unk_token!r} there (the built-in tiny models spell "
                      "printable ASCII and newlines only)", stacklevel=2)
    if limit is not None and any(len(ids) > limit for ids in encoded):
        warnings.warn(f"prompts over the module's max_prompt_length {limit} tokens are cut to "
                      f"their last {limit}: the model does not see their start (a system "
                      "prompt, the question); raise model.max_prompt_length or give shorter "
                      "prompts", stacklevel=2)
        encoded = [ids[-limit:] for ids in encoded]
    for index, ids in enumerate(encoded):
        if len(ids) == 0:
            raise ValueError(f"prompts[{index}] is empty after tokenisation")
    length = max(len(ids) for ids in encoded)
    length = -(-length // bucket) * bucket  # round up to a bucket
    prompt_ids = torch.full((len(encoded), length), tokenizer.pad_token_id)
    prompt_mask = torch.zeros((len(encoded), length), dtype=torch.bool)
    for row, ids in enumerate(encoded):
        prompt_ids[row, length - len(ids) :] = torch.tensor(ids)
        prompt_mask[row, length - len(ids) :] = True
    return prompt_ids, prompt_mask


def completion_mask_from_ids(
    completion_ids: torch.Tensor, stop_token_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Completion mask and truncation flags from sampled ``(N, T)`` ids.

    Returns ``mask`` ``(N, T)`` bool, ``mask[i, t] = t <= first_stop(i)`` (``first_stop = T``
    without a stop token), and ``truncated`` ``(N,)`` bool, True for rows with no stop token.

    Example: stop id 2, row ``[5, 2, 7, 2]`` → mask ``[1, 1, 0, 0]``, not truncated."""
    if completion_ids.dim() != 2:
        raise ValueError(f"completion_ids must be 2-D (N, T); got {tuple(completion_ids.shape)}")
    if len(stop_token_ids) == 0:
        raise ValueError("stop_token_ids must name at least one token id")
    stops = torch.tensor(list(stop_token_ids), device=completion_ids.device)
    is_stop = torch.isin(completion_ids, stops)  # (N, T)
    has_stop = is_stop.any(dim=1)  # (N,)
    num_tokens = completion_ids.shape[1]
    # argmax returns the first maximal index, i.e. the first stop token.
    first_stop = torch.where(has_stop, is_stop.int().argmax(dim=1), num_tokens)  # (N,)
    positions = torch.arange(num_tokens, device=completion_ids.device)
    mask = positions.unsqueeze(0) <= first_stop.unsqueeze(1)  # (N, T)
    return mask, ~has_stop


def rollout_from_ids(
    tokenizer: PreTrainedTokenizerBase, stop_token_ids: Sequence[int], prompts: list[str],
    answers: list[str], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor, G: int, seconds: float, logps: torch.Tensor | None = None,
    device: torch.device | None = None, tags: dict[int, str] | None = None,
) -> RolloutOutput:
    """The :class:`RolloutOutput` of ``(B*G, T)`` sampled ids (prompt-major): cut after the
    first stop id, padded, decoded (``tags``: the :func:`read_tags` kept, None: looked up);
    the sampler's ``logps`` (or None) zeroed past the cut, each row's sum its
    ``grouped_ref_meta``; tensors to ``device``."""
    completion_mask, truncated = completion_mask_from_ids(completion_ids, stop_token_ids)
    completion_ids = completion_ids.masked_fill(~completion_mask, tokenizer.pad_token_id)
    num_tokens = completion_mask.sum(dim=1).tolist()
    rows = [ids[:n] for ids, n in zip(completion_ids.tolist(), num_tokens, strict=True)]
    tags = read_tags(tokenizer) if tags is None else tags
    texts = decode_texts(tokenizer, rows, tags) if tags else tokenizer.batch_decode(
        rows, skip_special_tokens=True)  # the usual case, no tag special: decoded here
    if logps is not None:
        logps = logps.masked_fill(~completion_mask, 0.0)
    return RolloutOutput(
        batch=GenerationBatch.of_rows(prompts, answers, texts,
                                      None if logps is None else logps.sum(-1).tolist()),
        prompt_ids=prompt_ids.repeat_interleave(G, dim=0).to(device),
        prompt_mask=prompt_mask.repeat_interleave(G, dim=0).to(device),
        completion_ids=completion_ids.to(device),
        completion_mask=completion_mask.to(device),
        truncated=truncated.to(device),
        generate_seconds=seconds,
        sampler_logps=None if logps is None else logps.to(device),
    )


def _model_device(model: nn.Module | None) -> torch.device:
    """The device of ``model``'s first parameter (the CPU without one, or without a model)."""
    for parameter in model.parameters() if model is not None else ():
        return parameter.device
    return torch.device("cpu")


def sharded_across_ranks(model: nn.Module) -> bool:
    """Whether every forward pass is a collective: parameters :func:`sharded` over ranks."""
    dist = torch.distributed
    return (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            and sharded(model))


@contextlib.contextmanager
def _isolated_generation(model: nn.Module) -> Iterator[None]:
    """Eval mode and an empty ``generation_config`` for the call; both restored after (a
    ``peft`` model's base's too: peft's ``generate`` copies its own onto it)."""
    was_training = model.training
    base = model.get_base_model() if hasattr(model, "get_base_model") else None
    saved = [(m, m.generation_config) for m in (model, base)
             if getattr(m, "generation_config", None) is not None]
    model.eval()
    for holder, _ in saved:
        holder.generation_config = GenerationConfig()
    try:
        yield
    finally:
        for holder, config in saved:
            holder.generation_config = config
        model.train(was_training)


class HFGenerateEngine(RolloutEngine):  # a subclass: `model.engine` takes its short name
    """Rollout engine on ``model.generate`` (see the module docstring).

    Args:
        model: a causal LM with ``.generate`` (see "Wrapped models" above).
        tokenizer: its tokenizer, with a pad token (see ``load_tokenizer``).
        sampling: what to sample (:class:`~maxent_grpo.rollout.SamplingSettings`: ``T_max``,
            temperature, top-p, top-k, prompt truncation, greedy or not).
        share_prefill: run each prompt's prefill once for its G samples ("Shared prefill").
        stop_token_ids: extra ids that end a completion, besides the tokenizer's eos and
            the model's ``generation_config`` eos ids and the chat template's end of turn
            (:func:`~maxent_grpo.rollout.protocol.stop_ids`).
        cache: ``dynamic`` (grows per step) or ``static`` (see "Static cache" above).
        prompt_bucket: left-pad prompts to a multiple of this many tokens (1 = off).
        generation_dtype: ``model`` (generate on the model itself) or ``bfloat16`` /
            ``float16``: generate on a copy in that dtype, refreshed at each call (see
            "Generation copy" above; the last refresh's seconds: :attr:`refresh_seconds`).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingSettings,
        share_prefill: bool = True,
        stop_token_ids: list[int] | None = None,
        cache: Literal["dynamic", "static"] = "dynamic",
        prompt_bucket: int = 1,
        generation_dtype: Literal["model", "bfloat16", "float16"] = "model",
    ) -> None:
        if not callable(getattr(model, "generate", None)):
            raise TypeError(f"model must have a .generate method (a transformers causal LM); "
                            f"got {type(model).__name__} (for DDP pass ddp.module)")
        if not isinstance(sampling, SamplingSettings):
            raise TypeError(f"sampling must be a SamplingSettings; got {type(sampling).__name__}")
        require(tokenizer.pad_token_id is not None,
                "tokenizer has no pad token; load it with maxent_grpo.models.load_tokenizer")
        check_bool("HFGenerateEngine.share_prefill", share_prefill)
        check_choice("HFGenerateEngine.cache", cache, ("dynamic", "static"))
        check_int("HFGenerateEngine.prompt_bucket", prompt_bucket, minimum=1)
        check_choice("HFGenerateEngine.generation_dtype", generation_dtype, ("model", *DTYPES))
        if generation_dtype != "model":
            check_copyable(model)
        self.generation_dtype = generation_dtype
        # the last refresh of the generation copy; whether it holds the weights (no sync since)
        self.refresh_seconds, self._copy_current = 0.0, False
        self._warned_autocast = False
        self._two_dtypes: bool | None = None  # static_cache_holds_two_dtypes(), when needed
        self.cache = cache
        self.prompt_bucket = prompt_bucket
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling
        self._tags = read_tags(tokenizer)  # the answer and call tags a tokenizer made special
        self.share_prefill = share_prefill
        self.stop_token_ids = stop_ids("HFGenerateEngine", model, tokenizer, stop_token_ids)

    def sync(self, model: nn.Module) -> None:
        """Samples come from the model itself; a generation copy is refreshed next call."""
        self._copy_current = False

    @property
    def collective(self) -> bool:
        """Whether every ``generate`` is a collective over the ranks (sharded parameters):
        then every rank must call it as often (multi-turn rollouts see to it)."""
        return sharded_across_ranks(self.model)

    def _config(self, s: SamplingSettings, max_new_tokens: int, group: int) -> GenerationConfig:
        sampling = (dict(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
                    if s.do_sample else dict(do_sample=False, num_beams=1))
        return GenerationConfig(
            **sampling, max_new_tokens=max_new_tokens, num_return_sequences=group,
            eos_token_id=list(self.stop_token_ids), pad_token_id=self.tokenizer.pad_token_id,
            use_cache=True)

    def continue_ids(
        self, sequences: list[list[int]], budgets: list[int], sampling: SamplingSettings,
    ) -> list[Continuation]:
        """One continuation of each token sequence (left-padded into one batch, sampled
        from ``sampling`` for ``max(budgets)`` tokens, row ``i`` cut at ``budgets[i]``):
        the next turn of a multi-turn rollout, on the generation copy as ``generate``
        left it (the rollout's weights). No shared prefill; the static cache when the
        engine uses it and generation is not a collective, its length (the padded width +
        ``max(budgets)``) a multiple of ``prompt_bucket``."""
        require(len(sequences) == len(budgets) and len(sequences) > 0,
                "continue_ids needs one budget per sequence and at least one sequence")
        require(all(len(q) > 0 for q in sequences) and all(b >= 1 for b in budgets),
                "continue_ids needs non-empty sequences and budgets >= 1")
        device = _model_device(self.model)
        width, pad = max(len(q) for q in sequences), self.tokenizer.pad_token_id
        config = self._config(sampling, max(budgets), 1)
        synced = {"synced_gpus": True} if self.collective else {}
        # a static cache holds width + max(budgets) tokens, which differ between ranks: a
        # rank that is done keeps stepping (synced_gpus) and would run past its end
        if self.cache == "static" and not synced:  # length a multiple of the bucket: few shapes
            width = -(-(width + max(budgets)) // self.prompt_bucket) * self.prompt_bucket \
                - max(budgets)
            config.cache_implementation = "static"
        ids = torch.tensor([[pad] * (width - len(q)) + list(q) for q in sequences],
                           device=device)
        mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in sequences],
                            device=device)
        model, autocast = self._generation_model(device, refresh=False)  # generate's copy
        copy = model is not self.model and config.do_sample  # it reports the copy's log-probs
        record, extra = recorder(config) if copy else (None, {})
        with torch.no_grad(), autocast, _isolated_generation(model):
            output = model.generate(input_ids=ids, attention_mask=mask,
                                    generation_config=config, **synced, **extra)
        logps = None if record is None else record.of(output[:, width:])
        return [Continuation.cut(row[:budget], self.stop_token_ids,
                                 None if logps is None else logps[i, :budget].tolist())
                for i, (row, budget) in enumerate(zip(output[:, width:].tolist(), budgets,
                                                      strict=True))]

    def _shared_prefill(self, model: nn.Module, prompt_ids: torch.Tensor,
                        prompt_mask: torch.Tensor, group: int, max_new_tokens: int):
        """The cache of the first ``P - 1`` tokens of the B prompts repeated ``group`` times
        (prompt-major), as ``generate``'s keyword argument; None when it cannot be repeated."""
        attention = prompt_mask.long()
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=prompt_ids[:, :-1], attention_mask=attention[:, :-1],
                    position_ids=positions[:, :-1], use_cache=True, logits_to_keep=1)
        # "cache" in transformers >= 5.2x, "past_key_values" before; generate takes either
        for key in ("cache", "past_key_values"):
            cache = out.get(key, None) if hasattr(out, "get") else None
            if cache is not None:
                break
        if cache is None or not callable(getattr(cache, "batch_repeat_interleave", None)):
            return None
        cache.batch_repeat_interleave(group)
        if self.cache == "static":  # copy the repeated prefix into a preallocated cache
            cache = self._static_cache(prompt_ids.shape[1] + max_new_tokens, prefix=cache)
        return {key: cache}

    def _static_cache(self, length: int, prefix: Cache) -> StaticCache:
        """A static cache for ``length = P + T_max`` tokens, holding ``prefix``'s keys and
        values (the shared prefill, ``(B*G, heads, P - 1, dim)`` per layer)."""
        cache = StaticCache(config=self.model.config, max_cache_len=length)
        P = prefix.layers[0].keys.shape[-2]
        positions = torch.arange(P, device=prefix.layers[0].keys.device)
        for index, layer in enumerate(prefix.layers):
            cache.update(layer.keys, layer.values, index, {"cache_position": positions})
        return cache

    def _generation_model(self, device: torch.device,
                          refresh: bool = True) -> tuple[nn.Module, Any]:
        """The module to generate with and its autocast context: the model as is, or the
        generation copy (the model when already in that dtype) with autocast off, refreshed
        unless ``refresh`` is False and no ``sync`` came since (:func:`generation_copy`)."""
        self.refresh_seconds = 0.0 if refresh else self.refresh_seconds  # this rollout's
        refresh = refresh or not self._copy_current
        name = self.generation_dtype
        if name == "model" and self.cache == "static":
            name = self._autocast_copy(device)
        if name == "model":
            return self.model, contextlib.nullcontext()
        dtype, model = DTYPES[name], self.model
        if any(p.dtype != dtype for p in model.parameters() if p.is_floating_point()):
            model, seconds = generation_copy(model, dtype, refresh)
            self.refresh_seconds, self._copy_current = self.refresh_seconds + seconds, True
        return model, torch.autocast(device.type, enabled=False)

    def _autocast_copy(self, device: torch.device) -> str:
        """``model``, or the autocast dtype's name where the static cache would be handed keys
        and values in two dtypes that it cannot hold (module docstring)."""
        if not torch.is_autocast_enabled(device.type):
            return "model"
        amp = torch.get_autocast_dtype(device.type)
        name = next((key for key, value in DTYPES.items() if value == amp), "model")
        # the hidden states keep the embedding's dtype; the rotary keys follow them
        embed = getattr(self.model, "get_input_embeddings", lambda: None)()
        hidden = getattr(embed, "weight", None)
        hidden = hidden.dtype if isinstance(hidden, torch.Tensor) else amp
        if name == "model" or hidden == amp or self.collective:
            return "model"
        if self._two_dtypes is None:
            self._two_dtypes = static_cache_holds_two_dtypes()
        if self._two_dtypes:
            return "model"
        try:
            check_copyable(self.model)
        except ValueError:
            return "model"
        if not self._warned_autocast:
            self._warned_autocast = True
            warnings.warn(
                f"HFGenerateEngine(cache=static) under {name} autocast over "
                f"{str(hidden).removeprefix('torch.')} embeddings: this transformers' static "
                f"cache holds keys and values in one dtype (autocast gives "
                f"{str(hidden).removeprefix('torch.')} keys and {name} values), so generation "
                f"runs on a {name} copy of the weights; set generation_dtype: {name} to say so "
                f"(or cache: dynamic)", stacklevel=3)
        return name

    def generate(
        self, prompts: list[str], answers: list[str], num_generations: int,
        sampling: SamplingSettings | None = None,
    ) -> RolloutOutput:
        """Sample G = ``num_generations`` completions per prompt from ``sampling`` (None:
        the engine's own settings); see :class:`RolloutOutput`."""
        s = check_request(prompts, answers, num_generations, sampling, self.sampling)
        group = num_generations
        device = _model_device(self.model)
        prompt_ids, prompt_mask = encode_prompts(  # (B, P)
            self.tokenizer, prompts, s.max_prompt_length, self.prompt_bucket)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        config = self._config(s, s.max_new_tokens, group)
        # collectives: a rank whose completions all stopped steps on until every rank's have
        synced = {"synced_gpus": True} if self.collective else {}
        start = time.perf_counter()
        model, autocast = self._generation_model(device)
        copy = model is not self.model and config.do_sample  # it reports the copy's log-probs
        record, extra = recorder(config) if copy else (None, {})
        with torch.no_grad(), autocast, _isolated_generation(model):
            cache = None
            if (
                self.share_prefill and group > 1 and prompt_ids.shape[1] > 1
                and (isinstance(model, PreTrainedModel) or has_adapters(model))
            ):
                cache = self._shared_prefill(model, prompt_ids, prompt_mask, group,
                                             s.max_new_tokens)
            if cache is None:
                if self.cache == "static":
                    config.cache_implementation = "static"
                inputs = dict(input_ids=prompt_ids, attention_mask=prompt_mask.long())
            else:
                config.num_return_sequences = 1
                inputs = dict(input_ids=prompt_ids.repeat_interleave(group, dim=0),
                              attention_mask=prompt_mask.long().repeat_interleave(group, dim=0),
                              **cache)
            output = model.generate(**inputs, generation_config=config, **synced, **extra)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start

        rows, length = len(prompts) * group, prompt_ids.shape[1]
        if output.dim() != 2 or output.shape[0] != rows or output.shape[1] <= length:
            raise RuntimeError(f"model.generate returned shape {tuple(output.shape)}; "
                               f"expected ({rows}, > {length})")
        completions = output[:, length:].long()  # (B*G, T)
        return rollout_from_ids(self.tokenizer, self.stop_token_ids, prompts, answers,
                                prompt_ids, prompt_mask, completions, group, seconds,
                                None if record is None else record.of(completions),
                                tags=self._tags)
