"""Scoring: time and peak memory of token log-probs (and exact entropy) with gradient, from
the last hidden states through the LM head.

The issue-13 shape by default: hidden states ``(16, 1024, 896)`` that require grad and the
LM head's weight ``(151936, 896)``, float32 under bf16 autocast on CUDA (``bf16-mixed``,
whose logits ``(16, 1024, 151936)`` bf16 are what the unfused paths hand to scoring);
float32 without autocast on the CPU. Variants, each forward + backward of
``sum(a * logp) [+ sum(b * H)]``, gradients to the hidden states and the weight:

- ``plain``: ``z = h W^T``, ``L = log_softmax(z.float())``, ``logp = L.gather(y)``,
  ``H = -(exp(L) * L).sum``;
- ``blocks``: ``z = h W^T``, then :func:`maxent_grpo.core.selective_log_softmax`
  (``..._with_entropy``) with the device's block size
  (:func:`maxent_grpo.core.logprobs.block_elements`: a 32nd of the logits on CUDA);
- ``blocks-2Mi``: the same with the CPU's 2 Mi-value blocks (what issue 13 measured at 6x
  the plain time on the GPU);
- ``fused-head``: :func:`maxent_grpo.core.fused_head.fused_head_log_softmax`, the head's
  matmul inside the blocks: the logits never exist (``model.fused_lm_head``).

Per variant: median seconds over ``--repeats`` runs after one warm-up, and the peak memory
above the inputs (``max_memory_allocated`` on CUDA; on the CPU the largest sum of live
tensors, counted by ``bench_common.PhaseMemory``), as a multiple of the bf16 logits' bytes
(targets: time within 1.2x plain, memory at most 1.2x the logits)::

    python benchmarks/gpu_scoring.py                             # on a GPU, about a minute
    python benchmarks/gpu_scoring.py --n 2 --t 16 --v 1000 --h 64  # every stage on the CPU
    python benchmarks/gpu_scoring.py --head-block-log2 27 28   # + the fused head's block sizes
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

from maxent_grpo.core import logprobs  # noqa: E402
from maxent_grpo.core.fused_head import fused_head_log_softmax  # noqa: E402


def plain(h, w, y, entropy: bool):
    log_p = torch.log_softmax(torch.nn.functional.linear(h, w).float(), dim=-1)
    logp = log_p.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return logp, (-(log_p.exp() * log_p).sum(-1) if entropy else None)


def blocks(h, w, y, entropy: bool):
    z = torch.nn.functional.linear(h, w)
    if entropy:
        return logprobs.selective_log_softmax_with_entropy(z, y)
    return logprobs.selective_log_softmax(z, y), None


def fused(h, w, y, entropy: bool, block_tokens: int | None = None):
    return fused_head_log_softmax(h, w, y, 1.0, entropy, block_tokens)


def measure(fn, h, w, y, a, b, entropy: bool, repeats: int, autocast: bool) -> dict[str, Any]:
    cuda = h.device.type == "cuda"
    amp = torch.autocast(h.device.type, dtype=torch.bfloat16) if autocast \
        else contextlib.nullcontext()

    outputs: dict[str, torch.Tensor] = {}

    def once() -> float:
        h.grad = w.grad = None
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with amp:
            logp, ent = fn(h, w, y, entropy)
            loss = (a * logp).sum() + ((b * ent).sum() if ent is not None else 0)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        outputs.update(logp=logp.detach().float(), h_grad=h.grad, w_grad=w.grad)
        if ent is not None:
            outputs["entropy"] = ent.detach().float()
        return seconds

    once()  # warm-up (allocator, kernels)
    h.grad = w.grad = None
    seconds = [once() for _ in range(repeats)]
    h.grad = w.grad = None
    if cuda:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        once()
        peak = torch.cuda.max_memory_allocated() - base
    else:  # storages can be shared with the inputs' views; count what ops allocate
        counter = bc.PhaseMemory("cpu", enabled=True)
        counter.recording = True
        counter.start_step()
        once()
        counter.end_step()
        peak = counter.result()["other"] * 2**20
    logits_bytes = y.numel() * w.shape[0] * 2  # the bf16 logits the unfused paths build
    return {"seconds": statistics.median(seconds), "peak_over_logits": peak / logits_bytes,
            "outputs": outputs}


def agreement(outputs: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
              ) -> dict[str, float]:
    """Largest absolute difference of each output from the plain formula's, and of each
    gradient relative to the plain gradient's largest entry."""
    found = {}
    for key, value in outputs.items():
        gap = (value.float() - reference[key].float()).abs().max().item()
        if key.endswith("_grad"):
            gap /= max(reference[key].float().abs().max().item(), 1e-30)
        found[f"max_{'rel_' if key.endswith('_grad') else ''}diff_{key}"] = gap
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--t", type=int, default=1024)
    parser.add_argument("--v", type=int, default=151936)
    parser.add_argument("--h", type=int, default=896, help="hidden size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--head-block-log2", type=int, nargs="*", default=[],
                        help="also run the fused head with 2^K logit values per block (each K)")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "gpu_scoring.json")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    autocast = device == "cuda"  # bf16-mixed on the GPU; float32 on the CPU
    torch.manual_seed(0)
    h = torch.randn(args.n, args.t, args.h, device=device, requires_grad=True)
    w = (torch.randn(args.v, args.h, device=device) / args.h**0.5).requires_grad_()
    y = torch.randint(0, args.v, (args.n, args.t), device=device)
    a = torch.randn(args.n, args.t, device=device)
    b = torch.randn(args.n, args.t, device=device)
    results: dict[str, Any] = {}
    variants = (("plain", plain), ("blocks", blocks), ("blocks-2Mi", blocks),
                ("fused-head", fused),
                *((f"fused-head-2^{k}", functools.partial(fused, block_tokens=max(
                    1, 2**k // args.v))) for k in args.head_block_log2))
    for entropy in (False, True):
        for name, fn in variants:
            original = logprobs.block_elements
            if name == "blocks-2Mi":  # the CPU's block size, for comparison
                logprobs.block_elements = lambda numel, device_type: logprobs.BLOCK_ELEMENTS
            try:
                key = f"{name}{' +entropy' if entropy else ''}"
                results[key] = measure(fn, h, w, y, a, b, entropy, args.repeats, autocast)
            finally:
                logprobs.block_elements = original
        reference = results["plain +entropy" if entropy else "plain"]["outputs"]
        for name, _ in variants:
            key = f"{name}{' +entropy' if entropy else ''}"
            results[key]["agreement"] = agreement(results[key]["outputs"], reference)
        for name, _ in variants:
            del results[f"{name}{' +entropy' if entropy else ''}"]["outputs"]
    report = {"shape": {"n": args.n, "t": args.t, "v": args.v, "h": args.h}, "device": device,
              "autocast_bf16": autocast,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
              "torch": torch.__version__, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"| variant | seconds | x plain | peak / bf16 logits bytes | max diff logp | "
          f"max diff entropy | max rel diff grad h, W |  ({device}, "
          f"{'bf16 autocast' if autocast else 'float32'})")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key, r in results.items():
        base = results["plain +entropy" if "entropy" in key else "plain"]["seconds"]
        agree = r["agreement"]
        entropy_gap = agree.get("max_diff_entropy")
        print(f"| {key} | {r['seconds']:.4f} | {r['seconds'] / base:.2f} | "
              f"{r['peak_over_logits']:.2f} | {agree['max_diff_logp']:.2e} | "
              f"{'-' if entropy_gap is None else f'{entropy_gap:.2e}'} | "
              f"{agree['max_rel_diff_h_grad']:.2e}, {agree['max_rel_diff_w_grad']:.2e} |")


if __name__ == "__main__":
    main()
