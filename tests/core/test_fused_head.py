"""Tests for maxent_grpo.core.fused_head: log-probs and entropy straight from hidden states,
against the plain formula on materialised logits (values and gradients of both inputs)."""

from __future__ import annotations

import pytest
import torch

from maxent_grpo.core.fused_head import fused_head_log_softmax, head_block_tokens


def plain(h, w, y, temperature=1.0):
    log_p = torch.log_softmax((h @ w.T) / temperature, dim=-1)
    return log_p.gather(-1, y.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def inputs(dtype=torch.float64, n=3, t=5, width=16, vocab=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, t, width, generator=gen, dtype=torch.float64).to(dtype)
    w = (0.5 * torch.randn(vocab, width, generator=gen, dtype=torch.float64)).to(dtype)
    y = torch.randint(0, vocab, (n, t), generator=gen)
    a = torch.randn(n, t, generator=gen, dtype=torch.float64)
    b = torch.randn(n, t, generator=gen, dtype=torch.float64)
    return h.requires_grad_(), w.requires_grad_(), y, a, b


def grads(fn, h, w, y, a, b, with_entropy):
    h.grad = w.grad = None
    logp, ent = fn(h, w, y)
    loss = (a.to(logp.dtype) * logp).sum()
    if with_entropy:
        loss = loss + (b.to(ent.dtype) * ent).sum()
    loss.backward()
    return logp.detach(), None if ent is None else ent.detach(), h.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("block", [1, 4, 1000])
def test_values_and_gradients_match_the_plain_formula(with_entropy, temperature, block):
    h, w, y, a, b = inputs()
    ours = grads(lambda h, w, y: fused_head_log_softmax(h, w, y, temperature, with_entropy,
                                                        block),
                 h, w, y, a, b, with_entropy)
    ref = grads(lambda h, w, y: plain(h, w, y, temperature), h, w, y, a, b, with_entropy)
    assert ours[0].dtype == torch.float64
    for index, (got, want) in enumerate(zip(ours, ref, strict=True)):
        if index == 1 and not with_entropy:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    h, w, y, _, _ = inputs(n=2, t=3, width=4, vocab=7)
    assert torch.autograd.gradcheck(
        lambda h, w: fused_head_log_softmax(h, w, y, 0.8, True, block_tokens=2), (h, w))


def test_only_the_inputs_that_require_grad_get_one():
    h, w, y, a, _ = inputs()
    w.requires_grad_(False)  # frozen head (a LoRA policy): only the hidden states
    logp, _ = fused_head_log_softmax(h, w, y)
    (a * logp).sum().backward()
    assert h.grad is not None and w.grad is None
    ref_h = h.detach().clone().requires_grad_()
    (a * plain(ref_h, w, y)[0]).sum().backward()
    torch.testing.assert_close(h.grad, ref_h.grad)


def test_float32_is_float32_and_close_to_float64():
    h, w, y, a, b = inputs(torch.float32, vocab=300)
    logp, ent = fused_head_log_softmax(h, w, y, 1.0, True, 7)
    assert logp.dtype == ent.dtype == torch.float32
    ref = plain(h.double(), w.double(), y)
    torch.testing.assert_close(logp.double(), ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref[1], rtol=1e-5, atol=1e-5)


def test_under_bf16_autocast_the_matmul_runs_as_linear_does():
    """Under autocast the head's matmul is bf16, as ``nn.Linear`` makes it: the result
    matches the plain formula on autocast's bf16 logits to float32 rounding, while the
    float32 formula differs by bf16 rounding (so the test sees the dtype)."""
    h, w, y, a, b = inputs(torch.float32, vocab=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent = fused_head_log_softmax(h, w, y, 1.0, True)
        logits = torch.nn.functional.linear(h, w)
    assert logits.dtype == torch.bfloat16
    log_p = torch.log_softmax(logits.float(), -1)
    torch.testing.assert_close(logp, log_p.gather(-1, y.unsqueeze(-1)).squeeze(-1),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, -(log_p.exp() * log_p).sum(-1), rtol=1e-5, atol=1e-5)
    assert (logp - plain(h, w, y)[0]).abs().max() > 1e-4
    (a.float() * logp + b.float() * ent).sum().backward()  # gradients come back float32
    assert h.grad.dtype == w.grad.dtype == torch.float32
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


def test_no_tensor_of_the_logits_size_is_saved_for_backward():
    """Autograd keeps the inputs and (N, T) statistics only, never (N, T, V) logits."""
    h, w, y, a, _ = inputs(torch.float32, n=4, t=8, width=8, vocab=512)
    saved: list[int] = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logp, _ = fused_head_log_softmax(h, w, y, 1.0, True, block_tokens=4)
    assert saved and max(saved) == w.numel() < 4 * 8 * 512
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        plain(h, w, y)  # the unfused formula keeps (N, T, V) tensors
    assert max(saved) == 4 * 8 * 512


def test_block_size_defaults():
    assert head_block_tokens(151_936, "cuda") == (1 << 26) // 151_936
    assert head_block_tokens(151_936, "cpu") == (1 << 24) // 151_936
    assert head_block_tokens(1 << 30, "cpu") == 1
    assert head_block_tokens(1000, "mps") == head_block_tokens(1000, "cpu")


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda h, w, y: (h[0], w, y), "hidden must be a floating"),
        (lambda h, w, y: (h, w[:, :3], y), "weight must have shape"),
        (lambda h, w, y: (h, w, y.float()), "index must be an integer"),
        (lambda h, w, y: (h, w, y[:, :2]), "index must be an integer"),
        (lambda h, w, y: (h, w, y + 1000), r"token ids in \[0, 49\]"),
    ],
)
def test_bad_inputs_are_named(change, match):
    h, w, y, _, _ = inputs()
    with pytest.raises(ValueError, match=match):
        fused_head_log_softmax(*change(h, w, y))


def test_bad_options_are_named():
    h, w, y, _, _ = inputs()
    with pytest.raises(ValueError, match="temperature must be > 0"):
        fused_head_log_softmax(h, w, y, temperature=0.0)
    with pytest.raises(ValueError, match="block_tokens must be an int >= 1"):
        fused_head_log_softmax(h, w, y, block_tokens=0)
