"""LoRA with vLLM, measured both ways: merge-and-push (what ``VLLMEngine`` does) against
vLLM's own LoRA (``enable_lora`` and a ``LoRARequest`` per sync), in the vLLM environment.

    .venv-vllm/bin/python benchmarks/vllm_lora.py --model builtin:smollm2-135m-instruct \
        --prompts 8 --generations 8 --new-tokens 128

A ``peft`` LoRA policy (rank ``--rank`` on every attention and MLP projection, its B
matrices set to small random values so that the adapters count). Each way does ``--syncs``
rounds of "the weights changed: hand them to vLLM, then one rollout" after one untimed
round:

- **merged**: ``VLLMEngine.sync`` (the merged weights ``W + s·BA`` reloaded in place), then
  ``generate`` on the plain model;
- **vLLM LoRA**: the adapter saved with ``save_pretrained`` into a fresh folder, then
  ``generate`` with a new ``LoRARequest`` for it (vLLM loads the adapter on that call), on
  an engine started with ``enable_lora`` and ``max_lora_rank = --rank``.

Printed per way: median seconds to hand the weights over (merged: the sync; LoRA: the
save), median rollout seconds (LoRA: including vLLM's adapter load), completion tokens per
second over the rollout, and the sum. Appended to ``benchmarks/results/vllm_lora.jsonl``.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB each: two engines, one after the other
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from vllm_generate import prompts_for, shape_arguments  # noqa: E402

from maxent_grpo.models import load_policy, load_tokenizer, resolve_model_path  # noqa: E402
from maxent_grpo.rollout import SamplingSettings  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def moved(policy: torch.nn.Module, step: int) -> None:
    """A new value for every adapter tensor, as after an optimizer step."""
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def merged(policy, tokenizer, sampling, prompts, G, syncs) -> dict[str, float]:
    from maxent_grpo.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(policy, tokenizer, sampling, gpu_memory_utilization=0.3)
    hand, roll, tokens = [], [], []
    for step in range(syncs + 1):
        moved(policy, step)
        start = time.perf_counter()
        engine.sync(policy)
        handed = time.perf_counter() - start
        start = time.perf_counter()
        out = engine.generate(prompts, [""] * len(prompts), G)
        if step:  # the first round is untimed (first-call kernels)
            hand.append(handed)
            roll.append(time.perf_counter() - start)
            tokens.append(int(out.completion_mask.sum()))
    del engine
    gc.collect()
    return summary(hand, roll, tokens)


def vllm_lora(policy, tokenizer, sampling, prompts, G, syncs, rank, base_dir) -> dict[str, float]:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=base_dir, dtype="float32", enforce_eager=True, seed=0,
              gpu_memory_utilization=0.3, enable_lora=True, max_lora_rank=rank, max_loras=1,
              enable_chunked_prefill=False, max_num_batched_tokens=8192)
    params = SamplingParams(n=G, max_tokens=sampling.max_new_tokens, temperature=1.0,
                            ignore_eos=True, stop_token_ids=[tokenizer.eos_token_id], seed=0)
    requests = [{"prompt_token_ids": tokenizer(p, add_special_tokens=False).input_ids}
                for p in prompts]
    hand, roll, tokens = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for step in range(syncs + 1):
            moved(policy, step)
            folder = os.path.join(tmp, f"adapter{step}")
            start = time.perf_counter()
            policy.save_pretrained(folder)
            handed = time.perf_counter() - start
            start = time.perf_counter()
            outs = llm.generate(requests, params, use_tqdm=False,
                                lora_request=LoRARequest(f"step{step}", step + 1, folder))
            if step:
                hand.append(handed)
                roll.append(time.perf_counter() - start)
                tokens.append(sum(len(c.token_ids) for o in outs for c in o.outputs))
    del llm
    return summary(hand, roll, tokens)


def summary(hand: list[float], roll: list[float], tokens: list[int]) -> dict[str, float]:
    h, r = statistics.median(hand), statistics.median(roll)
    return {"hand_over_s": h, "rollout_s": r, "tokens": statistics.median(tokens),
            "tokens_per_s": statistics.median(tokens) / r, "total_s": h + r}


def main(argv: list[str] | None = None) -> None:
    from peft import LoraConfig, get_peft_model

    parser = shape_arguments(" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--syncs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" /
                        "vllm_lora.jsonl")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.model, cache_dir=args.model_cache_dir)
    base_dir = str(resolve_model_path(args.model, args.model_cache_dir))
    policy = get_peft_model(load_policy(args.model, cache_dir=args.model_cache_dir),
                            LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                       target_modules=TARGETS)).eval()
    sampling = SamplingSettings(max_new_tokens=args.new_tokens, temperature=1.0,
                                max_prompt_length=512)
    prompts = prompts_for(tokenizer, args.prompts)
    G = args.generations
    results = {
        "merged": merged(policy, tokenizer, sampling, prompts, G, args.syncs),
        "vllm_lora": vllm_lora(policy, tokenizer, sampling, prompts, G, args.syncs,
                               args.rank, base_dir),
    }
    print(f"\n{args.model}, LoRA rank {args.rank} on {len(TARGETS)} projections: "
          f"{args.prompts} prompts x G {G} x {args.new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads, median of {args.syncs} rounds\n")
    print("| way | hand-over (s) | rollout (s) | tokens | tokens/s | hand-over + rollout (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['hand_over_s']:.3f} | {r['rollout_s']:.2f} | {r['tokens']:.0f} | "
              f"{r['tokens_per_s']:.0f} | {r['total_s']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join(sys.argv), "model": args.model, "rank": args.rank,
              "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "shape": [args.prompts, G, args.new_tokens], "results": results}
    with args.out.open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
