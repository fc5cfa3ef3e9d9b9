"""Generation only: ``VLLMEngine`` against ``HFGenerateEngine`` (dynamic and static cache) on
the same policy, prompts and sampling settings, in the vLLM environment (``make setup-vllm``).

    .venv-vllm/bin/python benchmarks/vllm_generate.py --model builtin:tiny-h64
    .venv-vllm/bin/python benchmarks/vllm_generate.py --model builtin:smollm2-135m-instruct \
        --prompts 8 --generations 8 --new-tokens 128

Every engine generates ``--calls`` times after one warm-up call (the first call of each
engine is reported on its own: vLLM's start and first-call kernels); the median seconds of
the timed calls, the completion tokens they produced and tokens/s are printed as a
markdown table and appended as a JSON line (``--out``). Completions stop at EOS as in
training, so each engine's tokens are counted, not assumed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from maxent_grpo.models import load_policy, load_tokenizer  # noqa: E402
from maxent_grpo.rollout import HFGenerateEngine, SamplingSettings  # noqa: E402
from maxent_grpo.tasks import build_task  # noqa: E402


def prompts_for(tokenizer, n: int) -> list[str]:
    rows = build_task("countdown", n, seed=0)
    return [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                          tokenize=False, add_generation_prompt=True)
            for r in rows]


def run(engine, prompts: list[str], G: int, calls: int) -> dict[str, float]:
    torch.manual_seed(0)
    start = time.perf_counter()
    first = engine.generate(prompts, [""] * len(prompts), G)
    first_s = time.perf_counter() - start
    seconds, tokens = [], []
    for _ in range(calls):
        start = time.perf_counter()
        out = engine.generate(prompts, [""] * len(prompts), G)
        seconds.append(time.perf_counter() - start)
        tokens.append(int(out.completion_mask.sum()))
    median = statistics.median(seconds)
    return {"first_call_s": first_s, "median_s": median,
            "tokens": statistics.median(tokens), "tokens_per_s": statistics.median(tokens) / median,
            "first_tokens": int(first.completion_mask.sum())}


def shape_arguments(description: str) -> argparse.ArgumentParser:
    """The options the vLLM benchmarks share: the model and the rollout's shape."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="builtin:tiny-h64")
    parser.add_argument("--model-cache-dir", default=None)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = shape_arguments(" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--engines", default="hf-dynamic,hf-static,vllm")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" /
                        "vllm_generate.jsonl")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.model, cache_dir=args.model_cache_dir)
    policy = load_policy(args.model, cache_dir=args.model_cache_dir).eval()
    sampling = SamplingSettings(max_new_tokens=args.new_tokens, temperature=1.0,
                                max_prompt_length=512)
    prompts = prompts_for(tokenizer, args.prompts)
    results: dict[str, dict[str, float]] = {}
    for name in args.engines.split(","):
        start = time.perf_counter()
        if name == "vllm":
            from maxent_grpo.rollout.vllm_engine import VLLMEngine

            engine = VLLMEngine(policy, tokenizer, sampling, gpu_memory_utilization=0.3)
        else:
            engine = HFGenerateEngine(policy, tokenizer, sampling,
                                      cache=name.removeprefix("hf-"))
        build_s = time.perf_counter() - start
        results[name] = {"build_s": build_s, **run(engine, prompts, args.generations, args.calls)}
        print(name, {k: round(v, 3) for k, v in results[name].items()}, flush=True)
        del engine
    base = results.get("hf-dynamic")
    print(f"\n{args.model}: {args.prompts} prompts x G {args.generations} x {args.new_tokens} "
          f"new tokens, {torch.get_num_threads()} threads\n")
    print("| engine | build (s) | first call (s) | median call (s) | tokens | tokens/s "
          "| vs HF dynamic |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        ratio = "" if base is None else f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x"
        print(f"| {name} | {r['build_s']:.1f} | {r['first_call_s']:.1f} | {r['median_s']:.2f} | "
              f"{r['tokens']:.0f} | {r['tokens_per_s']:.0f} | {ratio} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join(sys.argv), "model": args.model, "machine": platform.processor()
              or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
              "shape": [args.prompts, args.generations, args.new_tokens],
              "results": results}
    with args.out.open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
