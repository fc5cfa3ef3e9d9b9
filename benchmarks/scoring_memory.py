"""Peak memory of token log-probs + exact entropy, with gradient, at V = 151,936.

Run with our environment::

    .venv/bin/python benchmarks/scoring_memory.py            # N=8, T=256, V=151936

Formulation: the input is a float32 logits tensor ``z`` of shape ``(N, T, V)`` that requires
grad (what the policy's LM head hands to scoring), token ids ``y`` ``(N, T)`` and two fixed
weight tensors ``a, b`` ``(N, T)``. Each variant computes

    logp[n, t] = log softmax(z[n, t])[y[n, t]]        H[n, t] = -sum_v p_v log p_v

then ``loss = sum(a * logp) + sum(b * H)`` and ``loss.backward()``:

- ``ours``: ``maxent_grpo.core.selective_log_softmax_with_entropy(z, y)``, one autograd
  Function with one ``(N, T, V)`` gradient (what the training module calls when the objective
  needs the entropy);
- ``ours_separate``: ``selective_log_softmax(z, y)`` and ``token_entropy(z)``, two Functions
  whose gradients autograd adds;
- ``plain``: ``L = torch.log_softmax(z.float(), -1)``, ``logp = L.gather(-1, y)``,
  ``H = -(L.exp() * L).sum(-1)``.

Method: every variant runs in a fresh subprocess. The process first builds the inputs (and
imports everything), then records its resident set size (``/proc/self/statm``) as the
baseline, runs forward + backward once, and reads its peak RSS (``VmHWM``). The reported
peak is ``VmHWM - baseline``: the extra memory the computation needed on top of its inputs,
including the ``(N, T, V)`` gradient of ``z`` that backward must return (that gradient alone is
``N*T*V*4`` bytes, listed separately). glibc serves these large blocks with ``mmap`` and gives
them back on free, and PyTorch's CPU allocator does not cache, so RSS follows the live tensors.

Agreement: each variant process also saves ``logp``, ``H`` and the gradient of the first two
tokens of row 0 (all V entries); the driver compares them between the variants (max absolute
difference, target <= 1e-5). A smaller case (N=2, T=64, same V, whole gradient) compares each
variant with the same formulas evaluated in float64: at V = 151,936 the float32 *plain* formula
is itself off by more than 1e-5 (its sums run over 151,936 terms), so "ours vs plain" alone
cannot tell which side is wrong.

The logits are ``scale * randn`` (``--scale``, default 1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

VARIANTS = ("ours", "ours_separate", "plain")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def make_inputs(n: int, t: int, v: int, seed: int, scale: float):
    import torch

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, t, v, generator=g).mul_(scale).requires_grad_(True)
    index = torch.randint(0, v, (n, t), generator=g)
    a = torch.randn(n, t, generator=g)
    b = torch.randn(n, t, generator=g)
    return logits, index, a, b


def compute(variant: str, logits, index):
    import torch

    if variant == "ours":
        from maxent_grpo.core import selective_log_softmax_with_entropy

        return selective_log_softmax_with_entropy(logits, index)
    if variant == "ours_separate":
        from maxent_grpo.core import selective_log_softmax, token_entropy

        return selective_log_softmax(logits, index), token_entropy(logits)
    if variant == "plain":
        full = torch.log_softmax(logits.float(), -1)
        logp = full.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        entropy = -(full.exp() * full).sum(-1)
        return logp, entropy
    raise ValueError(f"variant must be one of {', '.join(map(repr, VARIANTS))}; got {variant!r}")


def worker(variant: str, n: int, t: int, v: int, seed: int, scale: float, save: Path,
           full_grad: bool) -> dict[str, Any]:
    import torch

    if variant.startswith("ours"):
        import maxent_grpo.core  # noqa: F401  (imported before the baseline)
    logits, index, a, b = make_inputs(n, t, v, seed, scale)
    baseline = _rss_mib()
    peak_before = bc.peak_rss_mib()
    start = time.perf_counter()
    logp, entropy = compute(variant, logits, index)
    loss = (a * logp).sum() + (b * entropy).sum()
    forward_s = time.perf_counter() - start
    loss.backward()
    total_s = time.perf_counter() - start
    peak = bc.peak_rss_mib()
    grad = logits.grad
    torch.save({"logp": logp.detach(), "entropy": entropy.detach(),
                "grad": grad if full_grad else grad[0, :2].clone()}, save)
    return {"variant": variant, "baseline_rss_mib": baseline, "peak_rss_before_mib": peak_before,
            "peak_rss_mib": peak, "peak_delta_mib": peak - baseline,
            "forward_s": forward_s, "forward_backward_s": total_s,
            "logits_mib": logits.numel() * logits.element_size() / 2**20}


def run_variant(variant: str, n: int, t: int, v: int, seed: int, scale: float, save: Path,
                full_grad: bool, threads: int | None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", variant, "--n", str(n), "--t", str(t),
           "--v", str(v), "--seed", str(seed), "--scale", str(scale), "--save", str(save)]
    if full_grad:
        cmd.append("--full-grad")
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=bc.REPO_DIR)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} worker failed (exit {proc.returncode}):\n{proc.stderr}")
    return bc.parse_result(proc.stdout)


def max_abs_diff(x: dict[str, Any], y: dict[str, Any]) -> dict[str, float]:
    return {k: float((x[k].double() - y[k].double()).abs().max()) for k in x}


def float64_reference(n: int, t: int, v: int, seed: int, scale: float) -> dict[str, Any]:
    """The plain formulas in float64 on the inputs of ``make_inputs`` (whole gradient)."""
    import torch

    logits, index, a, b = make_inputs(n, t, v, seed, scale)
    z = logits.detach().double().requires_grad_(True)
    full = torch.log_softmax(z, -1)  # float64 throughout (compute("plain") would cast to f32)
    logp = full.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    entropy = -(full.exp() * full).sum(-1)
    ((a.double() * logp).sum() + (b.double() * entropy).sum()).backward()
    return {"logp": logp.detach(), "entropy": entropy.detach(), "grad": z.grad}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=8, help="rows N (= B*G)")
    parser.add_argument("--t", type=int, default=256, help="completion tokens T")
    parser.add_argument("--v", type=int, default=151936, help="vocabulary size V")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=1.0, help="logits = scale * randn")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path,
                        default=bc.BENCH_DIR / "results" / "scoring_memory.json")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--save", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--full-grad", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        bc.emit_result(worker(args.worker, args.n, args.t, args.v, args.seed, args.scale,
                              args.save, args.full_grad))
        return
    import torch

    small_shape = (2, 64, args.v)
    with tempfile.TemporaryDirectory(prefix="scoring-mem-") as tmp:
        files = {v: Path(tmp) / f"{v}.pt" for v in VARIANTS}
        runs = {v: run_variant(v, args.n, args.t, args.v, args.seed, args.scale, files[v], False,
                               args.threads) for v in VARIANTS}
        out = {v: torch.load(files[v]) for v in VARIANTS}
        diffs = max_abs_diff(out["ours"], out["plain"])
        small = {v: Path(tmp) / f"{v}-small.pt" for v in VARIANTS}
        for v in VARIANTS:
            run_variant(v, *small_shape, args.seed + 1, args.scale, small[v], True, args.threads)
        out = {v: torch.load(small[v]) for v in VARIANTS}
    reference = float64_reference(*small_shape, args.seed + 1, args.scale)
    small_diffs = {"ours_vs_plain": max_abs_diff(out["ours"], out["plain"]),
                   **{f"{v}_vs_float64": max_abs_diff(out[v], reference) for v in VARIANTS}}
    grad_mib = args.n * args.t * args.v * 4 / 2**20
    ours, plain = runs["ours"], runs["plain"]
    ratio = ours["peak_delta_mib"] / plain["peak_delta_mib"]
    ratio_wo_grad = (ours["peak_delta_mib"] - grad_mib) / (plain["peak_delta_mib"] - grad_mib)
    ratio_separate = runs["ours_separate"]["peak_delta_mib"] / plain["peak_delta_mib"]
    report = {
        "command": " ".join([".venv/bin/python", "benchmarks/scoring_memory.py", *sys.argv[1:]]),
        "shape": {"N": args.n, "T": args.t, "V": args.v},
        "logits_mib": ours["logits_mib"],
        "grad_mib": grad_mib,
        "runs": runs,
        "ratio_ours_over_plain": ratio,
        "ratio_ours_over_plain_excluding_returned_grad": ratio_wo_grad,
        "ratio_ours_separate_over_plain": ratio_separate,
        "scale": args.scale,
        "max_abs_diff_ours_vs_plain": diffs,
        "small_case": {"shape": small_shape, "max_abs_diff": small_diffs},
        "ours_vs_plain_within_1e-5": all(x <= 1e-5 for x in diffs.values()),
        "ours_vs_float64_within_1e-5": all(
            x <= 1e-5 for x in small_diffs["ours_vs_float64"].values()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"N={args.n} T={args.t} V={args.v}: logits {ours['logits_mib']:.0f} MiB "
          f"(their gradient: another {grad_mib:.0f} MiB)\n")
    print("| variant | peak over inputs (MiB) | in units of one (N,T,V) f32 | fwd+bwd (s) |")
    print("|---|---:|---:|---:|")
    for v in VARIANTS:
        r = runs[v]
        print(f"| {v} | {r['peak_delta_mib']:.0f} | {r['peak_delta_mib'] / grad_mib:.2f} | "
              f"{r['forward_backward_s']:.2f} |")
    print(f"\nours / plain peak: **{ratio:.3f}** (target <= 0.25); excluding the returned "
          f"gradient: {ratio_wo_grad:.3f}; ours_separate / plain: {ratio_separate:.3f}")
    print(f"\nmax |difference| (logits = {args.scale} * randn):\n")
    print("| comparison | logp | entropy | gradient |\n|---|---:|---:|---:|")
    rows = {f"ours vs plain, N={args.n} T={args.t} (gradient: 2 tokens)": diffs}
    rows.update({f"{k.replace('_vs_', ' vs ')}, N=2 T=64 (whole gradient)": d
                 for k, d in small_diffs.items()})
    for name, d in rows.items():
        print(f"| {name} | {d['logp']:.1e} | {d['entropy']:.1e} | {d['grad']:.1e} |")
    print(f"\nwritten: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
