"""Scoring: token log-probs of sampled completions under the policy, reference and behaviour.

A teacher-forced forward pass over ``[prompt | completion]`` rows gives the log-probability
of each completion token at the sampling temperature (docs/ALGORITHM.md §0)::

    logits  = model(ids, attention, position_ids)[:, -T-1:-1] / temperature   # (n, T, V)
    logps   = log_softmax(logits)[completion ids]                              # (n, T)
    entropy = -sum_v p_v log p_v                                               # (n, T), optional

Only the completion logits are materialised (``logits_to_keep = T + 1``), and the fused
:func:`~maxent_grpo.core.selective_log_softmax` never builds a float32 ``(n, T, V)`` copy.

Fused LM head (``model.fused_lm_head``): the scorer runs the model's decoder
(``get_decoder()``) for the hidden states and
:func:`~maxent_grpo.core.fused_head.fused_head_log_softmax` forms the logits block by block
from the head's weight, forward and backward, so the ``(n, T, V)`` logits and their
gradient never exist. ``None`` (the default) uses it on CUDA only, ``True`` requires it for
the policy (an error says why a model cannot), ``False`` never uses it; frozen models use it
where they qualify (:func:`fused_head_parts`). The first time a model is scored, one row's
logits are formed both ways and a disagreement beyond bf16 rounding switches that model
back to the logits path with a warning.

Position ids follow the left padding exactly as in generation. The policy is scored with
gradient (:class:`~maxent_grpo.training.types.SequenceScores`), frozen models (reference,
behaviour) without, micro-batch by micro-batch.

Micro-batches (:func:`plan_micro_batches`, at the end of the module) hold whole groups
(the per-group targets and the loss reductions rely on it) of the step's prompt-major
``[prompt (left-padded) | completion (right-padded)]`` rows, packed by length under a row
and a token budget, each cut to the columns its rows use (:class:`MicroBatchPlan`). The
loss is the same for any partition: every reduction counts rows and tokens of the whole
batch (``num_rows``, ``num_global_tokens``, ``max_completion_length``), and padding columns
are masked.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from maxent_grpo.core import selective_log_softmax, selective_log_softmax_with_entropy
from maxent_grpo.core.fused_head import fused_head_log_softmax
from maxent_grpo.rollout.hf import sharded_across_ranks
from maxent_grpo.training.types import BatchingSettings, SequenceScores

LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config fields that change the logits after the LM head (Gemma 2's soft-capping, Cohere's
and Granite's scales): a model that sets one (not None or 1) is never fused."""

HEAD_CHECK_TOLERANCE = 0.02
"""Largest relative difference ``|decoder(x) W^T - logits| / |logits|`` over one row for a
model to keep the fused head: above bf16 rounding, below a missed logit transform."""


def fused_head_parts(model: nn.Module) -> tuple[nn.Module, Tensor] | str:
    """``(decoder, head weight)`` of a causal LM whose logits are ``decoder(...) @ W^T``
    (a bias-free ``nn.Linear`` head, no :data:`LOGIT_TRANSFORMS`, parameters not sharded
    across ranks), or the reason the LM head cannot be fused for ``model``."""
    if sharded_across_ranks(model):
        return "its parameters are sharded across ranks (FSDP2 / DeepSpeed ZeRO-3)"
    get_head = getattr(model, "get_output_embeddings", None)
    get_decoder = getattr(model, "get_decoder", None)
    if not (callable(get_head) and callable(get_decoder)):
        return (f"{type(model).__name__} has no get_output_embeddings/get_decoder (not a "
                f"transformers causal LM)")
    head = get_head()
    if type(head) is not nn.Linear or head.bias is not None:
        return (f"its LM head is a {type(head).__module__}.{type(head).__qualname__}"
                f"{' with a bias' if getattr(head, 'bias', None) is not None else ''}, not a "
                f"bias-free torch.nn.Linear (a LoRA adapter on lm_head, quantisation, ...)")
    config = getattr(model, "config", None)
    for name in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and value != 1:
            return f"its config sets {name} = {value!r}: the logits change after the head"
    decoder = get_decoder()
    if decoder is model or not isinstance(decoder, nn.Module):
        return "get_decoder() does not return the decoder under the LM head"
    return decoder, head.weight


class Scorer:
    """Log-probs of completions at ``temperature``, micro-batched per ``batching``;
    ``fused_head`` as ``model.fused_lm_head`` (see the module docstring)."""

    def __init__(
        self, temperature: float, batching: BatchingSettings, fused_head: bool | None = None
    ) -> None:
        unsupported = batching.unsupported()
        if unsupported:
            raise ValueError(f"BatchingSettings {unsupported}: this trainer has no prompt cache, "
                             "scored tail or prefetching; leave them at their defaults")
        self.temperature = float(temperature)
        self.batching = batching
        self.fused_head = fused_head
        # model -> (decoder, weight), or the reason it is scored through its logits, or None
        # (not wanted): decided once per model
        self._heads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __getstate__(self) -> dict[str, object]:
        """Picklable (``torch.save(module)``, a process pool): the per-model cache left out."""
        return {**self.__dict__, "_heads": None}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state, _heads=weakref.WeakKeyDictionary())

    def _head(
        self, model: nn.Module, input_ids: Tensor, attention: Tensor, positions: Tensor,
        T: int, required: bool,
    ) -> tuple[nn.Module, Tensor] | None:
        """The fused head's parts for ``model`` (decided on its first call), or None for
        the logits path, which ``required`` refuses with a ValueError naming the reason."""
        if model not in self._heads:
            self._heads[model] = self._decide(model, input_ids, attention, positions, T)
        decision = self._heads[model]
        if not isinstance(decision, str):
            return decision
        if required:
            raise ValueError(f"model.fused_lm_head is true but the policy's LM head cannot be "
                             f"fused: {decision}; set model.fused_lm_head: null (or false)")
        return None

    def _decide(
        self, model: nn.Module, input_ids: Tensor, attention: Tensor, positions: Tensor, T: int,
    ) -> tuple[nn.Module, Tensor] | str | None:
        """See :meth:`_head`: the parts, the reason against them, or None (not wanted)."""
        wanted = self.fused_head or input_ids.device.type == "cuda"
        if not wanted:
            return None
        parts = fused_head_parts(model)
        if isinstance(parts, str):
            return parts
        try:
            gap = self._head_gap(model, parts, input_ids[:1], attention[:1], positions[:1], T)
            reason = (f"decoder(...) @ W^T differs from {type(model).__name__}'s logits by "
                      f"{gap:.3g} of their norm (more than {HEAD_CHECK_TOLERANCE}): the model "
                      f"transforms its logits after the head")
        except Exception as error:  # a decoder that cannot be called on its own
            gap = float("inf")
            reason = (f"{type(model).__name__}'s decoder could not be run on its own "
                      f"({type(error).__name__}: {error})")
        if gap <= HEAD_CHECK_TOLERANCE:
            return parts
        warnings.warn(f"{reason}; scoring this model through its logits", stacklevel=3)
        return reason

    @torch.no_grad()
    def _head_gap(
        self, model: nn.Module, parts: tuple[nn.Module, Tensor], input_ids: Tensor,
        attention: Tensor, positions: Tensor, T: int,
    ) -> float:
        """``|decoder(x) W^T - logits| / |logits|`` over one row's last ``T`` logits."""
        decoder, weight = parts
        hidden = decoder(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                         use_cache=False).last_hidden_state[:, -T - 1 : -1]
        ours = torch.nn.functional.linear(hidden, weight).float()  # (1, T, V): one row
        logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                       logits_to_keep=T + 1, use_cache=False).logits[:, :-1].float()
        if ours.shape != logits.shape:
            return float("inf")
        return float((ours - logits).norm() / logits.norm().clamp(min=1e-12))

    def _fused_logps(
        self, parts: tuple[nn.Module, Tensor], input_ids: Tensor, attention: Tensor,
        positions: Tensor, T: int, with_entropy: bool,
    ) -> tuple[Tensor, Tensor | None]:
        decoder, weight = parts
        hidden = decoder(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                         use_cache=False).last_hidden_state  # (n, P+T, H)
        return fused_head_log_softmax(hidden[:, -T - 1 : -1], weight, input_ids[:, -T:],
                                      self.temperature, with_entropy)

    def _logits_logps(
        self, model: nn.Module, input_ids: Tensor, attention: Tensor, positions: Tensor,
        T: int, with_entropy: bool,
    ) -> tuple[Tensor, Tensor | None]:
        out = model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions,
            logits_to_keep=T + 1, use_cache=False,
        )
        logits = out.logits[:, :-1, :]  # (n, T, V), a view; divided block by block in float32
        index = input_ids[:, -T:]
        if with_entropy:  # one pass, one (n, T, V) gradient
            return selective_log_softmax_with_entropy(logits, index, self.temperature)
        return selective_log_softmax(logits, index, self.temperature), None

    def plan(self, prompt_mask: Tensor, completion_mask: Tensor, G: int) -> list[MicroBatchPlan]:
        """The micro-batches of whole groups of a ``(N, P)`` / ``(N, T)`` batch within the
        row and token bounds of :attr:`batching` (none for an empty batch)."""
        if prompt_mask.shape[0] == 0:
            return []
        return plan_micro_batches(prompt_mask, completion_mask, G,
                                  max_rows=self.batching.logprob_chunk_size,
                                  max_tokens=self.batching.score_slice)

    def token_logps(
        self, model: torch.nn.Module, input_ids: Tensor, attention: Tensor, T: int,
        with_entropy: bool, policy: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Token log-probs ``(n, T)`` of the last ``T`` tokens of ``input_ids`` ``(n, P+T)``,
        and their exact entropy ``(n, T)`` when ``with_entropy`` (else None); ``policy``:
        ``model`` is the policy (``fused_lm_head: true`` then requires the fused head)."""
        positions = (attention.long().cumsum(-1) - 1).clamp(min=0)
        parts = None if self.fused_head is False else self._head(
            model, input_ids, attention, positions, T, policy and self.fused_head is True)
        if parts is not None:
            return self._fused_logps(parts, input_ids, attention, positions, T, with_entropy)
        return self._logits_logps(model, input_ids, attention, positions, T, with_entropy)

    def policy_scores(
        self, model: torch.nn.Module, input_ids: Tensor, attention: Tensor, mask: Tensor,
        old_logps: Tensor | None, with_entropy: bool, sampler_logps: Tensor | None = None,
    ) -> tuple[SequenceScores, Tensor | None]:
        """The policy's scores of one micro-batch, with gradient: :class:`SequenceScores`
        (``token_logp`` carries the gradient) and the token entropy ``(n, T)`` or None;
        ``mask`` ``(n, T)`` is the loss mask; ``old_logps`` the log-probs before the
        rollout's first update (None when ``num_iterations = 1``), ``sampler_logps`` the
        engine's own (None when it reports none)."""
        logps, entropy = self.token_logps(model, input_ids, attention, mask.shape[1],
                                          with_entropy, policy=True)
        return SequenceScores.of(logps, mask, old_logps, sampler_logps, entropy), entropy

    @torch.no_grad()
    def frozen_logps(
        self, model: torch.nn.Module, input_ids: Tensor, attention: Tensor, T: int,
        chunks: list[MicroBatchPlan],
    ) -> Tensor:
        """Token log-probs ``(N, T)`` of a frozen model over all rows, micro-batch by
        micro-batch (columns a micro-batch does not keep are padding and hold 0)."""
        P = input_ids.shape[1] - T
        out: Tensor | None = None
        for chunk in chunks:
            rows, cols = chunk.rows, chunk.columns(P)
            logps = self.token_logps(
                model, input_ids[rows][:, cols], attention[rows][:, cols], chunk.completion_len,
                False,
            )[0]
            if out is None:
                out = logps.new_zeros((input_ids.shape[0], T))
            if not chunk.padding:  # a padding pass only keeps the ranks in step
                out[rows, : chunk.completion_len] = logps
        assert out is not None, "frozen_logps needs at least one micro-batch"
        return out


# ---------------------------------------------------------------- micro-batches
@dataclass(frozen=True)
class MicroBatchPlan:
    """One micro-batch: ``groups`` (group indices), ``rows`` ``(n,)`` (their rows, group by
    group), both on the masks' device, and the kept columns: prompt columns from
    ``prompt_start`` and the first ``completion_len`` completion columns. A ``padding``
    micro-batch is a pass that only keeps the ranks in step (:func:`equal_passes`): it runs
    its forward and backward at weight zero and counts nowhere."""

    groups: Tensor
    rows: Tensor
    prompt_start: int
    completion_len: int
    padding: bool = False

    def columns(self, prompt_len: int) -> slice:
        """The kept columns of a ``[prompt | completion]`` row of prompt length ``P``."""
        return slice(self.prompt_start, prompt_len + self.completion_len)


_SAID_OVER: set[int] = set()  # the micro_batch_tokens below a group's size warned of


def plan_micro_batches(
    prompt_mask: Tensor,
    completion_mask: Tensor,
    group_size: int,
    max_rows: int | None = None,
    max_tokens: int | None = None,
) -> list[MicroBatchPlan]:
    """Partition the groups into micro-batches: sorted by length (longest prompt plus
    longest completion of the group, longest first), groups are added in that order while
    the micro-batch holds at most ``max_rows`` sequences (``logprob_chunk_size``) and its
    padded size, ``rows * (prompt columns + completion columns)``, is at most ``max_tokens``
    (each >= 1, or None: no limit). A group larger than either bound alone forms a
    micro-batch (a token bound below a group's size is warned of, once for each value).

    ``prompt_mask`` is ``(B*G, P)`` bool (left-padded prompts), ``completion_mask``
    ``(B*G, T)`` bool, each row True up to its last token (a prefix).
    """
    N, P = prompt_mask.shape
    if completion_mask.shape[0] != N:
        raise ValueError(
            f"prompt_mask and completion_mask must have the same rows; got {N} and "
            f"{completion_mask.shape[0]}"
        )
    if group_size < 1 or N % group_size:
        raise ValueError(f"group_size must divide the {N} rows; got {group_size}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be None or >= 1; got {max_rows}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be None or >= 1; got {max_tokens}")
    B, G = N // group_size, group_size
    prompt_len = prompt_mask.sum(-1).view(B, G).amax(-1)  # (B,)
    completion_len = completion_mask.sum(-1).view(B, G).amax(-1)  # (B,)
    prompt_len_list, completion_len_list = prompt_len.tolist(), completion_len.tolist()
    order = sorted(range(B), key=lambda b: -(prompt_len_list[b] + completion_len_list[b]))

    def size(groups: list[int]) -> int:
        width = max(prompt_len_list[b] for b in groups) + max(
            completion_len_list[b] for b in groups
        )
        return len(groups) * G * width

    chunks: list[list[int]] = []
    current: list[int] = []
    for b in order:
        grown = current + [b]
        fits = (max_rows is None or len(grown) * G <= max_rows) and (
            max_tokens is None or size(grown) <= max_tokens
        )
        if current and not fits:
            chunks.append(current)
            grown = [b]
        current = grown
    chunks.append(current)
    largest = None if max_tokens is None else max(size(c) for c in chunks)
    if largest is not None and largest > max_tokens and max_tokens not in _SAID_OVER:
        _SAID_OVER.add(max_tokens)
        warnings.warn(f"model.micro_batch_tokens {max_tokens} is less than one prompt group's "
                      f"padded size ({largest} tokens, {G} sequences), and a group is never "
                      "split: such a micro-batch holds the whole group; raise it to bound the "
                      "memory it sets (said once for this value)", stacklevel=2)

    plans = []
    for groups in chunks:
        groups.sort()  # prompt-major inside the micro-batch
        g = torch.tensor(groups, dtype=torch.long, device=prompt_mask.device)
        rows = (g[:, None] * G + torch.arange(G, device=prompt_mask.device)).reshape(-1)
        plans.append(MicroBatchPlan(
            groups=g, rows=rows,
            prompt_start=P - max(prompt_len_list[b] for b in groups),
            completion_len=max(completion_len_list[b] for b in groups),
        ))
    return plans


def equal_passes(plans: list[MicroBatchPlan], passes: int) -> list[MicroBatchPlan]:
    """``plans`` followed by padding micro-batches up to ``passes`` in all: each the first
    group of the last plan with one completion column, marked ``padding``.

    Every rank must run as many forward and backward passes as the others: under FSDP2 each
    forward all-gathers the parameters and each backward reduce-scatters the gradients, so
    a rank that planned fewer micro-batches (``drop_constant_groups``, a token budget) would
    leave the others waiting in a collective. ``passes`` is the most any rank planned."""
    if len(plans) >= passes:
        return plans
    if not plans:
        raise ValueError("equal_passes needs at least one micro-batch to pad with")
    last = plans[-1]
    G = last.rows.numel() // last.groups.numel()
    pad = MicroBatchPlan(groups=last.groups[:1], rows=last.rows[:G],
                         prompt_start=last.prompt_start, completion_len=1, padding=True)
    return plans + [pad] * (passes - len(plans))
