"""Our full training step vs the sum of its bare parts, measured in the same run.

Run with our environment::

    .venv/bin/python benchmarks/step_overhead.py --workload smollm2

One process runs our real path (Lightning ``Trainer`` + ``MaxEntGRPOModule`` +
``PromptDataModule``, the settings of ``_ours.py``) for ``warmup + steps`` steps. After every
step a callback times, outside the step and on the same model, batch shape and prompts:

- ``generate``: plain ``model.generate`` of the step's B prompts (left-padded), G samples each,
  exactly T new tokens, temperature 1, top_p 1, top_k 0, KV cache on, under ``no_grad``;
- ``fwd_bwd``: a plain policy forward over those (B*G, P+T) sequences with
  ``logits_to_keep=T+1`` (completion logits only), ``log_softmax`` + ``gather``, a
  policy-gradient loss ``-(A * logp).sum() / (B*G*T)`` and ``backward()``; the gradients are then
  dropped (the weights are not touched);
- ``ref_fwd``: the reference model's forward under ``no_grad`` (only when ``--beta > 0``);
- ``optimizer``: the real AdamW ``step()`` inside our step, timed with the optimizer's step
  pre/post hooks (the only part measured inside the step; it is what a bare loop runs too).

Reported: median of our step (callback wall time from ``on_train_batch_start`` to
``on_train_batch_end``, and the module's own ``perf/step_s``) divided by the median bare sum,
with the bare sum as the issue defines it (generate + policy forward/backward + reference
forward) and also with the optimizer step added. Target: within 1.15x.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import bench_common as bc  # noqa: E402


def make_bare_parts(workload: bc.Workload):
    import lightning as L
    import torch
    from transformers import GenerationConfig

    B, G, T = workload.batch_prompts, workload.num_generations, workload.max_completion_length

    class BareParts(L.Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []
            self.opt_s = 0.0
            self._opt_t0 = 0.0

        def on_train_start(self, trainer, pl_module) -> None:
            for opt in trainer.optimizers:
                opt.register_step_pre_hook(self._pre)
                opt.register_step_post_hook(self._post)

        def _pre(self, *_: Any) -> None:
            self._opt_t0 = time.perf_counter()

        def _post(self, *_: Any) -> None:
            self.opt_s += time.perf_counter() - self._opt_t0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.opt_s = 0.0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            policy, tok = pl_module.policy, pl_module.tokenizer
            tok.padding_side = "left"
            enc = tok(batch["prompts"], add_special_tokens=False, padding=True,
                      return_tensors="pt")
            config = GenerationConfig(
                do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=T,
                num_return_sequences=G, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, use_cache=True,
            )
            was_training = policy.training
            policy.eval()
            t0 = time.perf_counter()
            with torch.no_grad():
                seq = policy.generate(input_ids=enc["input_ids"],
                                      attention_mask=enc["attention_mask"],
                                      generation_config=config)
            t_gen = time.perf_counter() - t0
            if seq.shape != (B * G, enc["input_ids"].shape[1] + T):
                raise RuntimeError(f"bare generate returned {tuple(seq.shape)}; expected "
                                   f"({B * G}, P + {T}): the completions were not full length")
            attention = torch.cat([enc["attention_mask"].repeat_interleave(G, 0),
                                   torch.ones(B * G, T, dtype=torch.long)], 1)
            advantages = torch.randn(B * G, 1)

            policy.train()
            t0 = time.perf_counter()
            logits = policy(input_ids=seq, attention_mask=attention, logits_to_keep=T + 1,
                            use_cache=False).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, seq[:, -T:, None])[..., 0]
            loss = -(advantages * logp).sum() / (B * G * T)
            loss.backward()
            t_fb = time.perf_counter() - t0
            policy.zero_grad(set_to_none=True)
            policy.train(was_training)

            t_ref = 0.0
            if pl_module.reference is not None:
                t0 = time.perf_counter()
                with torch.no_grad():
                    ref = pl_module.reference(input_ids=seq, attention_mask=attention,
                                              logits_to_keep=T + 1, use_cache=False)
                    torch.log_softmax(ref.logits[:, :-1].float(), -1).gather(
                        -1, seq[:, -T:, None])
                t_ref = time.perf_counter() - t0
            self.rows.append({"generate_s": t_gen, "fwd_bwd_s": t_fb, "ref_fwd_s": t_ref,
                              "optimizer_s": self.opt_s})

    return BareParts()


def run(workload: bc.Workload, warmup: int, steps: int, beta: float, seed: int
        ) -> dict[str, Any]:
    import _ours

    bc.reset_peak_rss()  # this workload's peak, not an earlier one's (--workload all)
    folder = bc.prepare_workload(workload)
    bare = make_bare_parts(workload)
    result = _ours.run(workload, folder, warmup, steps, seed, beta, [bare])
    rows = bare.rows[warmup:]
    issue_sum = [r["generate_s"] + r["fwd_bwd_s"] + r["ref_fwd_s"] for r in rows]
    with_opt = [s + r["optimizer_s"] for s, r in zip(issue_sum, rows, strict=True)]
    wall, module_step = result["step_s"], result["phases"]["step_s"]
    med = bc.median
    return {
        "workload": workload.name,
        "beta": beta,
        "ours_step_wall_s": wall,
        "ours_step_module_s": module_step,
        "ours_phases": result["phases"],
        "bare": rows,
        "median": {
            "ours_step_wall_s": med(wall),
            "ours_step_module_s": med(module_step),
            **{k: med([r[k] for r in rows]) for k in rows[0]},
            "bare_sum_s": med(issue_sum),
            "bare_sum_with_optimizer_s": med(with_opt),
        },
        "ratio": {
            "wall_over_bare_sum": med(wall) / med(issue_sum),
            "wall_over_bare_sum_with_optimizer": med(wall) / med(with_opt),
            "module_step_over_bare_sum": med(module_step) / med(issue_sum),
            "per_step_wall_over_bare_sum": [w / s for w, s in zip(wall, issue_sum, strict=True)],
        },
        "peak_rss_mib": result["peak_rss_mib"],
        "versions": result["versions"],
        "threads": result["threads"],
    }


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | our step (s) | bare generate | bare fwd+bwd | bare ref fwd | bare sum "
        "| **ours / bare sum** | AdamW step | ours / (bare sum + AdamW) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        m, q = r["median"], r["ratio"]
        lines.append(
            f"| {r['workload']} | {m['ours_step_wall_s']:.3f} | {m['generate_s']:.3f} | "
            f"{m['fwd_bwd_s']:.3f} | {m['ref_fwd_s']:.3f} | {m['bare_sum_s']:.3f} | "
            f"**{q['wall_over_bare_sum']:.2f}x** | {m['optimizer_s']:.3f} | "
            f"{q['wall_over_bare_sum_with_optimizer']:.2f}x |"
        )
    lines += ["", "Our phases (medians, s): " + "; ".join(
        f"{r['workload']}: " + ", ".join(
            f"{k} {bc.median(v):.3f}" for k, v in r["ours_phases"].items() if k != "tokens_per_s")
        for r in results)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=[*bc.CPU_WORKLOADS, "all"], default="all")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--beta", type=float, default=0.0,
                        help="KL weight; > 0 loads a reference model (and times its forward)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=bc.BENCH_DIR / "results" / "step_overhead.json")
    args = parser.parse_args()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    names = bc.CPU_WORKLOADS if args.workload == "all" else [args.workload]
    results = []
    for name in names:
        w = bc.WORKLOADS[name]
        warmup = w.warmup if args.warmup is None else args.warmup
        steps = w.steps if args.steps is None else args.steps
        results.append(run(w, warmup, steps, args.beta, args.seed))
    report = {
        "command": " ".join([".venv/bin/python", "benchmarks/step_overhead.py", *sys.argv[1:]]),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(markdown(results))
    print(f"\nwritten: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
