"""Token log-probabilities and exact token entropy from logits (docs/ALGORITHM.md §0, §2).

Both functions take logits of shape ``(N, T, V)`` (``N = B*G`` rows, ``T`` completion tokens,
``V`` vocabulary) that the caller has already divided by the sampling temperature, and return
one float per token, ``(N, T)``.

Memory. A language model's logits are large (``N*T*V`` values) and usually bf16. Neither
function builds a full ``(N, T, V)`` float32 tensor: the forward pass walks over blocks of
at most ``BLOCK_ELEMENTS`` logit values on the CPU, a 32nd of the logits on CUDA
(:func:`block_elements`; several short rows at once, a long row in runs of tokens),
upcasting only that block, and keeps just ``(N, T)`` statistics. The backward pass
is written out by hand and recomputes the softmax block by block from the saved logits, so
autograd does not hold float32 copies either. The gradient returned for the logits has the
logits' dtype. Second derivatives are not supported.

Precision. Arithmetic is done in float32 for float16/bfloat16/float32 inputs and in float64
for float64 inputs; the result has that dtype (float32 in practice).

Non-finite logits are not scanned for (that would read the whole tensor again): a ``-inf``
logit is treated as a token of probability zero (its log-probability is ``-inf``, and it adds
nothing to the entropy); NaN or ``+inf`` logits, or a row whose logits are all ``-inf``,
give NaN.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

__all__ = ["selective_log_softmax", "selective_log_softmax_with_entropy", "token_entropy"]

BLOCK_ELEMENTS = 1 << 21
"""Logit values upcast at once (2 Mi, i.e. 8 MiB as float32) per block. Measured with
log-probs + entropy, forward and backward, at N=8, T=256, V=151,936 on the CPU
(benchmarks/scoring_memory.py): blocks of 2^25 values peaked at 1.60x the logits' size and
took 10.4 s, 2^22 at 1.21x and 3.9 s, 2^21 at 1.09x and 3.7 s (the plain formula: 5.0x and
10.8-11.8 s)."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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


def _check_index(index: torch.Tensor, logits: torch.Tensor) -> None:
    if not isinstance(index, torch.Tensor):
        raise ValueError(f"index must be a torch.Tensor; got {type(index).__name__}")
    if index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
        raise ValueError(f"index must be an integer tensor (token ids); got dtype {index.dtype}")
    if index.dim() != 2 or tuple(index.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"index must have shape (N, T) = {tuple(logits.shape[:2])} to match logits; "
            f"got shape {tuple(index.shape)}"
        )
    if index.device != logits.device:
        raise ValueError(
            f"index must be on the same device as logits ({logits.device}); got {index.device}"
        )
    # A range check costs one small reduction over (N, T) ids (and a host sync on GPU), far
    # less than the (N, T, V) logits, and turns an opaque device-side assert into an error.
    if index.numel() > 0:
        low, high = int(index.min()), int(index.max())
        vocab = logits.shape[-1]
        if low < 0 or high >= vocab:
            raise ValueError(
                f"index must hold token ids in [0, V-1] = [0, {vocab - 1}]; "
                f"got values in [{low}, {high}]"
            )


CUDA_BLOCK_FRACTION = 32
"""On CUDA a block holds ``1/32`` of the logits (at least ``BLOCK_ELEMENTS`` values). There
the fixed 2 Mi blocks cost time, not memory: at N=16, T=1024, V=151,936 they make ~1,200
blocks of small kernels (issue 13 measured the fused function at 6x the plain formula's
time on an H200). 32 blocks keep a float32 temporary at 1/16 of bf16 logits' bytes (about
+0.2x with the few temporaries alive at once, within the 1.2x target) while launching 40x
fewer kernels. Chosen from that memory bound; the time is to be measured on a GPU
(``benchmarks/gpu_scoring.py``)."""


def block_elements(numel: int, device_type: str) -> int:
    """Logit values upcast at once for logits of ``numel`` values on ``device_type``:
    ``BLOCK_ELEMENTS`` on the CPU (measured there), ``max(BLOCK_ELEMENTS, numel //
    CUDA_BLOCK_FRACTION)`` on CUDA."""
    if device_type == "cuda":
        return max(BLOCK_ELEMENTS, numel // CUDA_BLOCK_FRACTION)
    return BLOCK_ELEMENTS


def _blocks(logits: torch.Tensor) -> Iterator[tuple[slice, slice]]:
    """Yield ``(row_slice, token_slice)`` blocks covering ``(N, T)`` with at most about
    ``E = block_elements(...)`` logit values each: several whole rows at once when a row is
    small, otherwise one row in runs of at most ``E // V`` tokens (at least one). The blocks
    are views (no copy even of non-contiguous logits), and a float32 temporary of one block
    stays near ``E * 4`` bytes."""
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


def _shift_block(z: torch.Tensor, shift_out: torch.Tensor, lse_out: torch.Tensor) -> torch.Tensor:
    """For one ``(tokens, V)`` block: ``shifted = z - max_v z``; store max and lse(shifted).

    ``log p = shifted - logsumexp(shifted)`` never adds the (possibly large) maximum back, which
    keeps float32 log-probabilities accurate for logits with a large common offset.
    """
    peak = z.amax(dim=-1)
    shifted = z - peak.unsqueeze(-1)
    shift_out.copy_(peak)
    lse_out.copy_(torch.logsumexp(shifted, dim=-1))
    return shifted


def _block_log_probs(z: torch.Tensor, shift: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``log softmax`` of one ``(tokens, V)`` block from the statistics of ``_shift_block``."""
    return (z - shift.unsqueeze(-1)) - lse.unsqueeze(-1)


def block_forward(
    z: torch.Tensor, index: torch.Tensor, out: torch.Tensor, shift: torch.Tensor,
    lse: torch.Tensor, ent: torch.Tensor | None,
) -> None:
    """For one ``(tokens, V)`` block of logits ``z`` in the compute dtype: write the chosen
    tokens' log-probs into ``out``, ``max_v z`` and ``logsumexp(z - max)`` into ``shift``
    and ``lse``, and the exact entropy into ``ent`` unless it is None (all ``(tokens,)``)."""
    shifted = _shift_block(z, shift, lse)
    logp = shifted - lse.unsqueeze(-1)
    out.copy_(logp.gather(-1, index.unsqueeze(-1)).squeeze(-1))
    if ent is not None:
        plogp = (torch.exp(logp) * logp).masked_fill_(torch.isneginf(logp), 0.0)
        ent.copy_(-plogp.sum(dim=-1))


def block_grad(
    logp: torch.Tensor, index: torch.Tensor, grad_out: torch.Tensor,
    grad_ent: torch.Tensor | None = None, ent: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient ``(tokens, V)`` with respect to one block's logits of
    ``sum g * logp[y]`` (+ ``sum h * H`` when ``grad_ent`` is given), from the block's
    log-probabilities ``logp`` (compute dtype) and, for the entropy, its ``H``::

        d/dz_v = g ([v == y] - p_v) - h p_v (log p_v + H)
    """
    g = grad_out.to(logp.dtype).unsqueeze(-1)  # (tokens, 1)
    p = torch.exp(logp)
    if grad_ent is None:
        row = p.mul_(-g)  # -g p
    else:
        h = grad_ent.to(logp.dtype).unsqueeze(-1)
        entropy_part = (logp + ent.unsqueeze(-1)).mul_(p)
        entropy_part.masked_fill_(torch.isneginf(logp), 0.0)
        row = entropy_part.mul_(-h).sub_(p.mul_(g))  # -h p (log p + H) - g p
    return row.scatter_add_(-1, index.unsqueeze(-1), g)  # + g at the chosen token


class _SelectiveLogSoftmax(torch.autograd.Function):
    """``out[n, t] = z[n, t, y] - logsumexp_v z[n, t, v]`` with ``y = index[n, t]``.

    Forward keeps ``max_v z`` and ``logsumexp(z - max)`` per token, ``(N, T)`` each.

    Backward: ``d out / d z_v = [v == y] - p_v`` with ``p = softmax(z)``.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(logits.dtype)
        n_rows, n_tok, _ = logits.shape
        out = torch.empty(n_rows, n_tok, dtype=dtype, device=logits.device)
        shift = torch.empty_like(out)
        lse = torch.empty_like(out)
        for n, t in _blocks(logits):
            z = logits[n, t].to(dtype)  # (block, V): the only upcast copy alive at a time
            shifted = _shift_block(z, shift[n, t], lse[n, t])
            out[n, t] = shifted.gather(-1, index[n, t].unsqueeze(-1)).squeeze(-1) - lse[n, t]
        ctx.save_for_backward(logits, index, shift, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        logits, index, shift, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for n, t in _blocks(logits):
            logp = _block_log_probs(logits[n, t].to(lse.dtype), shift[n, t], lse[n, t])
            grad[n, t] = block_grad(logp, index[n, t], grad_out[n, t])
        return grad, None


class _TokenEntropy(torch.autograd.Function):
    """``H[n, t] = -sum_v p_v log p_v`` with ``p = softmax(z)``, ``log p = z - logsumexp(z)``.

    Forward keeps ``max_v z``, ``logsumexp(z - max)`` and ``H`` per token, ``(N, T)`` each.

    Backward: ``d H / d z_v = -p_v (log p_v + H)``.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, logits: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(logits.dtype)
        n_rows, n_tok, _ = logits.shape
        ent = torch.empty(n_rows, n_tok, dtype=dtype, device=logits.device)
        shift = torch.empty_like(ent)
        lse = torch.empty_like(ent)
        for n, t in _blocks(logits):
            shifted = _shift_block(logits[n, t].to(dtype), shift[n, t], lse[n, t])
            logp = shifted - lse[n, t].unsqueeze(-1)
            # p = 0 with log p = -inf (a -inf logit) contributes 0, not NaN.
            plogp = (torch.exp(logp) * logp).masked_fill_(torch.isneginf(logp), 0.0)
            # -sum p log p from shifted log-probabilities; the textbook lse(z) - sum p z
            # subtracts two large numbers when the logits carry a large common offset.
            ent[n, t] = -plogp.sum(dim=-1)
        ctx.save_for_backward(logits, shift, lse, ent)
        return ent

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor) -> torch.Tensor | None:
        logits, shift, lse, ent = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for n, t in _blocks(logits):
            logp = _block_log_probs(logits[n, t].to(lse.dtype), shift[n, t], lse[n, t])
            row = torch.exp(logp).mul_(logp + ent[n, t].unsqueeze(-1))
            row.masked_fill_(torch.isneginf(logp), 0.0)
            grad[n, t] = row.mul_(-grad_out[n, t].to(lse.dtype).unsqueeze(-1))
        return grad


class _LogProbsAndEntropy(torch.autograd.Function):
    """Both of the above in one pass over the logits, with one gradient tensor.

    Separately, each backward returns its own ``(N, T, V)`` gradient and autograd adds them
    (three full-size tensors at the peak); here the two contributions are summed block by
    block into a single one: ``d/dz_v = g_out ([v == y] - p_v) - g_ent p_v (log p_v + H)``.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx, logits: torch.Tensor, index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _compute_dtype(logits.dtype)
        n_rows, n_tok, _ = logits.shape
        out = torch.empty(n_rows, n_tok, dtype=dtype, device=logits.device)
        ent, shift, lse = torch.empty_like(out), torch.empty_like(out), torch.empty_like(out)
        for n, t in _blocks(logits):
            block_forward(logits[n, t].to(dtype), index[n, t], out[n, t], shift[n, t],
                          lse[n, t], ent[n, t])
        ctx.save_for_backward(logits, index, shift, lse, ent)
        return out, ent

    @staticmethod
    @once_differentiable
    def backward(
        ctx: FunctionCtx, grad_out: torch.Tensor, grad_ent: torch.Tensor
    ) -> tuple[torch.Tensor | None, None]:
        logits, index, shift, lse, ent = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for n, t in _blocks(logits):
            logp = _block_log_probs(logits[n, t].to(lse.dtype), shift[n, t], lse[n, t])
            grad[n, t] = block_grad(logp, index[n, t], grad_out[n, t], grad_ent[n, t], ent[n, t])
        return grad, None


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Log-probability of the chosen tokens: ``log_softmax(logits, -1)`` gathered at ``index``.

    ``out[n, t] = logits[n, t, index[n, t]] - logsumexp_v logits[n, t, v]``.

    Args:
        logits: ``(N, T, V)`` floating, already divided by the sampling temperature.
        index: ``(N, T)`` integer token ids in ``[0, V)``, on the same device. Their range is
            checked (one small reduction over ``(N, T)``, a host sync on GPU).

    Returns:
        ``(N, T)`` float32 (float64 for float64 logits), differentiable with respect to
        ``logits``. Computed block by block; see the module docstring for memory,
        precision and non-finite values.
    """
    _check_logits(logits)
    _check_index(index, logits)
    return _SelectiveLogSoftmax.apply(logits, index)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Exact entropy of each token's distribution, ``H = -sum_v p_v log p_v``, ``p = softmax``.

    Example: logits ``[2, 1, 0]`` give ``H = 0.8323955818399389`` nats.

    Args:
        logits: ``(N, T, V)`` floating, already divided by the sampling temperature.

    Returns:
        ``(N, T)`` float32 (float64 for float64 logits), differentiable with respect to
        ``logits`` (``dH/dz_v = -p_v (log p_v + H)``). Computed block by block; see
        the module docstring for memory, precision and non-finite values.
    """
    _check_logits(logits)
    return _TokenEntropy.apply(logits)


def selective_log_softmax_with_entropy(
    logits: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(selective_log_softmax(logits, index), token_entropy(logits))`` in one pass.

    Same values and gradients as the two calls, but the logits are read once per pass and
    the backward pass returns a single ``(N, T, V)`` gradient (the two separate backward
    passes return one each, which autograd then adds: three full-size tensors at the peak).

    Args:
        logits: ``(N, T, V)`` floating, already divided by the sampling temperature.
        index: ``(N, T)`` integer token ids in ``[0, V)``, on the same device.

    Returns:
        ``(logp, entropy)``, both ``(N, T)`` float32 (float64 for float64 logits) and
        differentiable with respect to ``logits``.
    """
    _check_logits(logits)
    _check_index(index, logits)
    return _LogProbsAndEntropy.apply(logits, index)
