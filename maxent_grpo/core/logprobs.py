"""Token log-probabilities and exact token entropy from logits (docs/ALGORITHM.md §0, §2).

The functions take logits of shape ``(N, T, V)`` (``N = B*G`` rows, ``T`` completion tokens,
``V`` vocabulary) and return one float per token, ``(N, T)``, of ``softmax(logits /
temperature)``: the temperature divides each upcast block, so float16 logits do not overflow
at a low temperature and no divided ``(N, T, V)`` copy is made.

Memory. No full ``(N, T, V)`` float32 tensor is built: the forward pass upcasts one block
of logits at a time (:func:`block_elements` values: several short rows, or a long row in
runs of tokens) and keeps only ``(N, T)`` statistics; the hand-written backward pass
recomputes the softmax block by block from the saved logits. The gradient has the logits'
dtype. Second derivatives are not supported.

Precision. Arithmetic and result in float32 (float64 for float64 logits).

Non-finite logits are not scanned for: a ``-inf`` logit is a token of probability zero
(log-probability ``-inf``, nothing added to the entropy); NaN or ``+inf`` logits, or a row
whose logits are all ``-inf``, give NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

__all__ = ["selective_log_softmax", "selective_log_softmax_with_entropy", "token_entropy"]

BLOCK_ELEMENTS = 1 << 21
"""Logit values upcast at once on the CPU (2 Mi, 8 MiB as float32); chosen with
``benchmarks/scoring_memory.py`` (benchmarks/RESULTS.md §3)."""


def _check_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a torch.Tensor; got {type(logits).__name__}")
    if logits.dim() != 3:
        raise ValueError(
            f"logits must have shape (N, T, V) (3 dimensions); got shape {tuple(logits.shape)}"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor; got dtype {logits.dtype}")
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension V; got V = 0")


def _check_index(index: object, shape: tuple, vocab: int, device: torch.device, like: str) -> None:
    """``index`` must be an integer tensor of token ids in ``[0, vocab)``, of ``shape``
    ``(N, T)`` and on ``device``, those of ``like`` (named in the messages)."""
    if not isinstance(index, torch.Tensor):
        raise ValueError(f"index must be a torch.Tensor; got {type(index).__name__}")
    if index.dtype == torch.bool or index.is_floating_point() or index.is_complex() or (
        tuple(index.shape) != tuple(shape)
    ):
        raise ValueError(
            f"index must be an integer tensor (token ids) of shape (N, T) = {tuple(shape)} to "
            f"match {like}; got dtype {index.dtype}, shape {tuple(index.shape)}"
        )
    if index.device != device:
        raise ValueError(
            f"index must be on the same device as {like} ({device}); got {index.device}"
        )
    # one small reduction (a host sync on GPU) instead of an opaque device-side assert
    if index.numel() > 0:
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= vocab:
            raise ValueError(
                f"index must hold token ids in [0, {vocab - 1}] (V = {vocab}); "
                f"got values in [{low}, {high}]"
            )


CUDA_BLOCK_FRACTION = 32
"""On CUDA a block holds ``1/32`` of the logits (at least ``BLOCK_ELEMENTS`` values): fewer,
larger kernels, with a float32 block at 1/16 of the bf16 logits' bytes."""


def block_elements(numel: int, device_type: str) -> int:
    """Logit values upcast at once: ``BLOCK_ELEMENTS``, or on CUDA
    ``max(BLOCK_ELEMENTS, numel // CUDA_BLOCK_FRACTION)``."""
    if device_type == "cuda":
        return max(BLOCK_ELEMENTS, numel // CUDA_BLOCK_FRACTION)
    return BLOCK_ELEMENTS


def _blocks(logits: torch.Tensor) -> Iterator[tuple[slice, slice]]:
    """Yield ``(row_slice, token_slice)`` views covering ``(N, T)``, each of at most about
    ``E = block_elements(...)`` logits: several whole rows when a row fits, otherwise one
    row in runs of ``max(1, E // V)`` tokens."""
    n_rows, n_tok, vocab = logits.shape
    per_row = n_tok * vocab
    elements = block_elements(logits.numel(), logits.device.type)
    if 0 < per_row <= elements:
        rows = elements // per_row
        for start in range(0, n_rows, rows):
            yield slice(start, min(start + rows, n_rows)), slice(0, n_tok)
        return
    step = max(1, elements // vocab)
    for n in range(n_rows):
        for start in range(0, n_tok, step):
            yield slice(n, n + 1), slice(start, min(start + step, n_tok))


def _block_log_probs(z: torch.Tensor, shift: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``log softmax`` of one ``(tokens, V)`` block from the statistics of :func:`block_forward`."""
    return (z - shift.unsqueeze(-1)) - lse.unsqueeze(-1)


def block_forward(
    z: torch.Tensor, index: torch.Tensor | None, out: torch.Tensor | None, shift: torch.Tensor,
    lse: torch.Tensor, ent: torch.Tensor | None,
) -> None:
    """For one ``(tokens, V)`` block of logits ``z`` in the compute dtype: write the chosen
    tokens' log-probs into ``out`` (unless ``index`` is None), ``max_v z`` and
    ``logsumexp(z - max)`` into ``shift`` and ``lse``, and the exact entropy into ``ent``
    unless it is None (all ``(tokens,)``). ``log p = shifted - lse`` never adds the maximum
    back (accurate under a large offset)."""
    peak = z.amax(dim=-1)
    shifted = z - peak.unsqueeze(-1)
    shift.copy_(peak)
    lse.copy_(torch.logsumexp(shifted, dim=-1))
    if ent is None:
        out.copy_(shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) - lse)
        return
    logp = shifted - lse.unsqueeze(-1)
    if index is not None:
        out.copy_(logp.gather(-1, index.unsqueeze(-1)).squeeze(-1))
    # a -inf logit (p = 0) adds 0, not NaN; -sum p log p avoids lse(z) - sum p z, which
    # cancels two large numbers under a large common offset
    plogp = (torch.exp(logp) * logp).masked_fill_(torch.isneginf(logp), 0.0)
    ent.copy_(-plogp.sum(dim=-1))


def block_grad(
    logp: torch.Tensor, index: torch.Tensor | None, grad_out: torch.Tensor | None,
    grad_ent: torch.Tensor | None = None, ent: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient ``(tokens, V)`` with respect to one block's logits of
    ``sum g * logp[y]`` (unless ``index`` is None) + ``sum h * H`` (when ``grad_ent`` is
    given), from the block's log-probabilities ``logp`` (compute dtype) and, for the
    entropy, its ``H``::

        d/dz_v = g ([v == y] - p_v) - h p_v (log p_v + H)
    """
    p = torch.exp(logp)
    if grad_ent is None:
        g = grad_out.to(logp.dtype).unsqueeze(-1)  # (tokens, 1)
        row = p.mul_(-g)  # -g p
    else:
        h = grad_ent.to(logp.dtype).unsqueeze(-1)
        entropy_part = (logp + ent.unsqueeze(-1)).mul_(p)
        entropy_part.masked_fill_(torch.isneginf(logp), 0.0)
        row = entropy_part.mul_(-h)  # -h p (log p + H)
        if index is None:
            return row
        g = grad_out.to(logp.dtype).unsqueeze(-1)
        row = row.sub_(p.mul_(g))  # - g p
    return row.scatter_add_(-1, index.unsqueeze(-1), g)  # + g at the chosen token


def _scaled(logits: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    """One block of logits upcast to ``dtype``, then divided by ``temperature`` (in place
    when the upcast made a copy: one block temporary, the same bits)."""
    z = logits.to(dtype)
    if temperature == 1.0:
        return z
    return z / temperature if z is logits else z.div_(temperature)


def _check_scalar(name: str, value: float, *, positive: bool = False) -> float:
    """``value`` as a float when it is a finite number ``>= 0`` (``> 0`` when ``positive``),
    else ValueError naming ``name``."""
    bound = "> 0" if positive else ">= 0"
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or value < 0 or (positive and value == 0)):
        raise ValueError(f"{name} must be a finite number {bound}; got {value!r}")
    return float(value)


class _LogSoftmaxStats(torch.autograd.Function):
    """``logp[n, t] = z[n, t, y] - logsumexp_v z[n, t, v]`` with ``y = index[n, t]`` (None
    when ``index`` is None) and ``H[n, t] = -sum_v p_v log p_v`` (None unless
    ``with_entropy``), ``p = softmax(z)``.

    Forward keeps ``max_v z``, ``logsumexp(z - max)`` and ``H`` per token, ``(N, T)`` each.
    Backward sums both terms block by block into one ``(N, T, V)`` gradient:
    ``d/dz_v = g_out ([v == y] - p_v) - g_ent p_v (log p_v + H)``.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx, logits: torch.Tensor, index: torch.Tensor | None, with_entropy: bool,
        temperature: float,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        shift = torch.empty(logits.shape[:2], dtype=dtype, device=logits.device)
        lse = torch.empty_like(shift)
        out = None if index is None else torch.empty_like(shift)
        ent = torch.empty_like(shift) if with_entropy else None
        for n, t in _blocks(logits):
            block_forward(  # the only upcast copy alive at a time
                _scaled(logits[n, t], dtype, temperature), None if index is None else index[n, t],
                None if out is None else out[n, t], shift[n, t], lse[n, t],
                None if ent is None else ent[n, t],
            )
        ctx.save_for_backward(logits, index, shift, lse, ent)
        ctx.temperature = temperature
        return out, ent

    @staticmethod
    @once_differentiable
    def backward(
        ctx: FunctionCtx, grad_out: torch.Tensor | None, grad_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None]:
        logits, index, shift, lse, ent = ctx.saved_tensors  # only the logits need a grad
        temperature = ctx.temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for n, t in _blocks(logits):
            z = _scaled(logits[n, t], lse.dtype, temperature)
            dz = block_grad(
                _block_log_probs(z, shift[n, t], lse[n, t]), None if index is None else index[n, t],
                None if index is None else grad_out[n, t],
                None if ent is None else grad_ent[n, t], None if ent is None else ent[n, t],
            )
            grad[n, t] = dz if temperature == 1.0 else dz.div_(temperature)  # z = x / T
        return grad, None, None, None


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of the chosen tokens: ``log_softmax(z, -1)`` gathered at ``index``,
    ``z = logits / temperature``.

    ``out[n, t] = z[n, t, index[n, t]] - logsumexp_v z[n, t, v]``.

    Args:
        logits: ``(N, T, V)`` floating.
        index: ``(N, T)`` integer token ids in ``[0, V)``, on the same device (range
            checked).
        temperature: the sampling temperature (> 0), applied in float32 (float64 for
            float64 logits).

    Returns:
        ``(N, T)`` float32 (float64 for float64 logits), differentiable with respect to
        ``logits``.
    """
    _check_logits(logits)
    _check_index(index, logits.shape[:2], logits.shape[-1], logits.device, "logits")
    temperature = _check_scalar("temperature", temperature, positive=True)
    return _LogSoftmaxStats.apply(logits, index, False, temperature)[0]


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Exact entropy of each token's distribution, ``H = -sum_v p_v log p_v``, ``p = softmax``.

    ``(N, T, V)`` floating logits (already divided by the sampling temperature) give
    ``(N, T)`` float32 (float64 for float64 logits), with ``dH/dz_v = -p_v (log p_v + H)``.
    """
    _check_logits(logits)
    return _LogSoftmaxStats.apply(logits, None, True, 1.0)[1]


def selective_log_softmax_with_entropy(
    logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(selective_log_softmax(logits, index, T), token_entropy(logits / T))`` in one pass.

    Same values and gradients as the two calls, but the logits are read once per pass and
    backward returns one ``(N, T, V)`` gradient instead of two that autograd adds.
    Arguments as :func:`selective_log_softmax`; both results ``(N, T)``.
    """
    _check_logits(logits)
    _check_index(index, logits.shape[:2], logits.shape[-1], logits.device, "logits")
    temperature = _check_scalar("temperature", temperature, positive=True)
    return _LogSoftmaxStats.apply(logits, index, True, temperature)
