"""GPU scoring: time and peak memory of token log-probs (and exact entropy) with gradient.

The issue-13 shape by default: logits ``(16, 1024, 151936)`` bf16 that require grad (what
the policy's LM head hands to scoring). Variants, each forward + backward of
``sum(a * logp) [+ sum(b * H)]``:

- ``plain``: ``L = log_softmax(z.float())``, ``logp = L.gather(y)``, ``H = -(exp(L) * L).sum``;
- ``ours``: :func:`maxent_grpo.core.selective_log_softmax` (``..._with_entropy``) with the
  device's block size (:func:`maxent_grpo.core.logprobs.block_elements`: a 32nd of the
  logits on CUDA);
- ``ours-2Mi``: the same with the CPU's 2 Mi-value blocks (what issue 13 measured at 6x the
  plain time).

Per variant: median seconds over ``--repeats`` runs after one warm-up, and on CUDA the peak
``max_memory_allocated`` above the inputs, as a multiple of the logits' bytes (targets: time
within 1.2x plain, memory at most 1.2x the logits)::

    python benchmarks/gpu_scoring.py                        # on a GPU, about a minute
    python benchmarks/gpu_scoring.py --n 2 --t 16 --v 1000  # every stage on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from maxent_grpo.core import logprobs  # noqa: E402


def plain(z: torch.Tensor, y: torch.Tensor, entropy: bool) -> tuple[torch.Tensor, Any]:
    log_p = torch.log_softmax(z.float(), dim=-1)
    logp = log_p.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return logp, (-(log_p.exp() * log_p).sum(-1) if entropy else None)


def ours(z: torch.Tensor, y: torch.Tensor, entropy: bool) -> tuple[torch.Tensor, Any]:
    if entropy:
        return logprobs.selective_log_softmax_with_entropy(z, y)
    return logprobs.selective_log_softmax(z, y), None


def measure(fn, z, y, a, b, entropy: bool, repeats: int) -> dict[str, float | None]:
    cuda = z.device.type == "cuda"

    def once() -> float:
        z.grad = None
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        logp, h = fn(z, y, entropy)
        loss = (a * logp).sum() + ((b * h).sum() if h is not None else 0)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    once()  # warm-up (allocator, kernels)
    z.grad = None
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds = [once() for _ in range(repeats)]
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else None
    logits_bytes = z.numel() * z.element_size()
    return {"seconds": statistics.median(seconds),
            "peak_over_logits": None if peak is None else peak / logits_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--t", type=int, default=1024)
    parser.add_argument("--v", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "gpu_scoring.json")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    z = torch.randn(args.n, args.t, args.v, device=device, dtype=dtype, requires_grad=True)
    y = torch.randint(0, args.v, (args.n, args.t), device=device)
    a = torch.randn(args.n, args.t, device=device)
    b = torch.randn(args.n, args.t, device=device)
    results: dict[str, Any] = {}
    for entropy in (False, True):
        for name, fn in (("plain", plain), ("ours", ours), ("ours-2Mi", ours)):
            if name == "ours-2Mi":  # the CPU's block size, for comparison
                original = logprobs.block_elements
                logprobs.block_elements = lambda numel, device_type: logprobs.BLOCK_ELEMENTS
            try:
                key = f"{name}{' +entropy' if entropy else ''}"
                results[key] = measure(fn, z, y, a, b, entropy, args.repeats)
            finally:
                if name == "ours-2Mi":
                    logprobs.block_elements = original
    report = {"shape": [args.n, args.t, args.v], "device": device, "dtype": str(dtype),
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
              "torch": torch.__version__, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"| variant | seconds | x plain | peak / logits bytes |  ({device}, {dtype})")
    print("|---|---:|---:|---:|")
    for key, r in results.items():
        base = results["plain +entropy" if "entropy" in key else "plain"]["seconds"]
        peak = "n/a" if r["peak_over_logits"] is None else f"{r['peak_over_logits']:.2f}"
        print(f"| {key} | {r['seconds']:.4f} | {r['seconds'] / base:.2f} | {peak} |")


if __name__ == "__main__":
    main()
