"""The colocated engine beside the server engine, in a fresh interpreter: vLLM's in-process
engine cannot be built again in a process where an earlier one was torn down (its parallel
groups stay gone), which the earlier test modules of ``make test-vllm`` do.

    python -m tests.vllm_engine.colocated_twin URL KEY CACHE_DIR OUT.json

writes what ``test_vllm_server.py`` compares: the samples and continuations of both engines
from the same seed, and one training step on each.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from maxent_grpo.models import load_policy, load_tokenizer  # noqa: E402
from maxent_grpo.rollout import SamplingSettings  # noqa: E402
from maxent_grpo.rollout.vllm_engine import VLLMEngine  # noqa: E402
from maxent_grpo.rollout.vllm_server import VLLMServerEngine  # noqa: E402
from tests.conftest import fit, make_data, make_module, params  # noqa: E402

MODEL = "builtin:tiny-h64"
PROMPTS = ["<|im_start|>user\n3 + 5 =<|im_end|>\n<|im_start|>assistant\n", "hello there"]
SAMPLING = SamplingSettings(max_new_tokens=8, max_prompt_length=64)


def samples(url: str, key: str, cache: str) -> dict:
    policy, tokenizer = load_policy(MODEL, cache_dir=cache), load_tokenizer(MODEL, cache_dir=cache)
    server = VLLMServerEngine(policy, tokenizer, SAMPLING, urls=[url], api_key=key)
    colocated = VLLMEngine(policy, tokenizer, SAMPLING, gpu_memory_utilization=0.1)
    out = {}
    for name, engine in (("server", server), ("colocated", colocated)):
        torch.manual_seed(3)
        a = engine.generate(PROMPTS, ["", ""], 4)
        torch.manual_seed(3)
        c = engine.continue_ids([[5, 6, 7], [8, 9]], [4, 3], SAMPLING)
        out[name] = {"ids": a.completion_ids.tolist(), "logps": a.sampler_logps.tolist(),
                     "continued": [x.ids for x in c]}
    server.close()
    return out


def one_step(url: str, key: str, cache: str) -> dict:
    out = {}
    for name, engine in (("server", functools.partial(VLLMServerEngine, urls=[url], api_key=key)),
                         ("colocated", functools.partial(VLLMEngine, gpu_memory_utilization=0.1))):
        module = make_module(cache, model_name_or_path=MODEL, max_completion_length=8,
                             engine=engine, rewards={"tests.conftest:alternating": 1.0})
        trainer = fit(module, make_data(cache, tokenizer=MODEL), steps=1,
                      tmp_path=tempfile.mkdtemp())
        out[name] = {"loss": float(trainer.callback_metrics["train/loss/total"]),
                     "ids": module.trajectory.rollout.completion_ids.tolist(),
                     "params": {k: v.tolist() for k, v in params(module).items()}}
    return out


if __name__ == "__main__":
    url, key, cache, path = sys.argv[1:5]
    with open(path, "w") as f:
        json.dump({"samples": samples(url, key, cache), "step": one_step(url, key, cache)}, f)
