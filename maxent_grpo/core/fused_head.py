"""Token log-probs (and exact entropy) from the last hidden states: the LM head fused with
the log-softmax, so the ``(N, T, V)`` logits never exist (docs/ALGORITHM.md §0).

For hidden states ``h`` ``(N, T, H)``, the head's weight ``W`` ``(V, H)`` and the sampled
tokens ``y`` ``(N, T)``::

    z       = h W^T / temperature                  # one block of tokens at a time
    logp    = z[y] - logsumexp_v z                 # (N, T)
    entropy = -sum_v p_v log p_v,  p = softmax(z)  # (N, T), optional

Forward keeps only ``(N, T)`` statistics per block of tokens (maximum, log-sum-exp,
entropy), as :mod:`maxent_grpo.core.logprobs` does. Backward recomputes each block's logits
(one more matmul), forms their gradient (:func:`~maxent_grpo.core.logprobs.block_grad`)
and folds it into the gradients of the hidden states (``dz W / temperature``) and of the
weight (``dz^T h / temperature``, accumulated in float32). Nothing of size ``N * T * V``
is stored: the peak above the inputs is the float32 weight gradient plus block temporaries.

Precision. The matmul runs in the autocast dtype when autocast is on for the device (as
``nn.Linear`` would), else in the weight's dtype; the softmax in float32 (float64 for
float64 weights). The temperature scales the float32 logits (times ``1/T``; the unfused
path divides, an ulp apart), so under bf16 the two differ by little more than the matmul's
rounding. Second derivatives
are not supported.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from maxent_grpo.core.logprobs import _block_log_probs, _check_index, block_forward, block_grad

__all__ = ["fused_head_log_softmax", "head_block_tokens"]

HEAD_BLOCK_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 26}
"""Logit values formed at once (block tokens x V), by device type (others use the CPU's).
Each block reads the whole weight four times, so small blocks are bound by memory traffic."""


def head_block_tokens(vocab: int, device_type: str) -> int:
    """Tokens per block for a vocabulary of ``vocab`` on ``device_type``: at least one."""
    return max(1, HEAD_BLOCK_ELEMENTS.get(device_type, HEAD_BLOCK_ELEMENTS["cpu"]) // vocab)


def _matmul_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype ``nn.Linear`` would multiply in: the autocast dtype when autocast is on
    (for a weight that is not float64), else the weight's."""
    device = weight.device.type
    if torch.is_autocast_enabled(device) and weight.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _block_logits(h: torch.Tensor, w: torch.Tensor, dtype: torch.dtype,
                  scale: float) -> torch.Tensor:
    """``(h W^T) * scale`` for one block: the matmul in ``w``'s dtype, the result in ``dtype``."""
    z = (h.to(w.dtype) @ w.T).to(dtype)
    return z.mul_(scale) if scale != 1.0 else z


class _FusedHead(torch.autograd.Function):
    """``logp, H`` of ``z = h W^T * scale`` block by block; see the module docstring."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, hidden: torch.Tensor, weight: torch.Tensor, index: torch.Tensor,
        scale: float, with_entropy: bool, block: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        mm = _matmul_dtype(weight)
        dtype = torch.float64 if mm == torch.float64 else torch.float32
        n_rows, n_tok, width = hidden.shape
        h = hidden.reshape(n_rows * n_tok, width)
        y = index.reshape(-1)
        w = weight.to(mm)  # one cast of the weight per pass, as autocast would make
        out = torch.empty(h.shape[0], dtype=dtype, device=h.device)
        shift, lse = torch.empty_like(out), torch.empty_like(out)
        ent = torch.empty_like(out) if with_entropy else None
        with torch.autocast(h.device.type, enabled=False):
            for start in range(0, h.shape[0], block):
                s = slice(start, start + block)
                z = _block_logits(h[s], w, dtype, scale)
                block_forward(z, y[s], out[s], shift[s], lse[s], None if ent is None else ent[s])
        ctx.save_for_backward(h, weight, y, shift, lse, ent)
        ctx.mm, ctx.scale, ctx.block, ctx.shape = mm, scale, block, hidden.shape
        ent_out = None if ent is None else ent.view(n_rows, n_tok)
        return out.view(n_rows, n_tok), ent_out

    @staticmethod
    @once_differentiable
    def backward(
        ctx: FunctionCtx, grad_out: torch.Tensor, grad_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None]:
        h, weight, y, shift, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]  # one at least
        mm, scale, block = ctx.mm, ctx.scale, ctx.block
        g_out = grad_out.reshape(-1)
        g_ent = None if grad_ent is None or ent is None else grad_ent.reshape(-1)
        w = weight.to(mm)
        grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=shift.dtype, device=h.device) if need_w else None
        with torch.autocast(h.device.type, enabled=False):
            for start in range(0, h.shape[0], block):
                s = slice(start, start + block)
                hb = h[s].to(mm)
                logp = _block_log_probs(_block_logits(hb, w, shift.dtype, scale), shift[s], lse[s])
                dz = block_grad(logp, y[s], g_out[s], None if g_ent is None else g_ent[s],
                                None if g_ent is None else ent[s])
                if scale != 1.0:
                    dz.mul_(scale)  # through z = (h W^T) * scale
                dz = dz.to(mm)
                if grad_h is not None:
                    grad_h[s] = dz @ w
                if grad_w is None:
                    continue
                if dz.dtype == grad_w.dtype:  # float32/float64: in place, no (V, H) temporary
                    grad_w.addmm_(dz.T, hb)
                else:  # a bf16/fp16 (V, H) product, summed into the float32 accumulator
                    grad_w += dz.T @ hb
        grad_hidden = None if grad_h is None else grad_h.view(ctx.shape)
        grad_weight = None if grad_w is None else grad_w.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def fused_head_log_softmax(
    hidden: torch.Tensor, weight: torch.Tensor, index: torch.Tensor,
    temperature: float = 1.0, with_entropy: bool = False, block_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``index`` (and the exact entropy) under ``softmax(hidden @ weight.T /
    temperature)``, without building the logits.

    Args:
        hidden: ``(N, T, H)`` floating: the hidden states the LM head would read, one per
            scored token.
        weight: ``(V, H)``: the LM head's weight (a bias-free ``nn.Linear``).
        index: ``(N, T)`` integer token ids in ``[0, V)``, on the same device.
        temperature: the sampling temperature (> 0).
        with_entropy: also return the exact token entropy.
        block_tokens: tokens per block (>= 1); default :func:`head_block_tokens`.

    Returns:
        ``(logp, entropy)``: ``(N, T)`` float32 (float64 for a float64 weight), ``entropy``
        None unless asked for; differentiable with respect to ``hidden`` and ``weight``.
    """
    for name, tensor in (("hidden", hidden), ("weight", weight)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor; got {type(tensor).__name__}")
    if hidden.dim() != 3 or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a floating (N, T, H) tensor; got {hidden.dtype} "
                         f"of shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2] or weight.shape[0] == 0:
        raise ValueError(f"weight must have shape (V, H) with H = {hidden.shape[2]}; got "
                         f"shape {tuple(weight.shape)}")
    if hidden.device != weight.device:
        raise ValueError(f"hidden and weight must share one device; got {hidden.device}, "
                         f"{weight.device}")
    _check_index(index, hidden.shape[:2], weight.shape[0], hidden.device, "hidden")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature!r}")
    block = head_block_tokens(weight.shape[0], weight.device.type) if block_tokens is None \
        else block_tokens
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block_tokens must be an int >= 1; got {block_tokens!r}")
    return _FusedHead.apply(hidden, weight, index.long(), 1.0 / float(temperature),
                            bool(with_entropy), block)
