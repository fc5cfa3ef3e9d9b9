"""``VLLMEngine`` on two CPU processes (gloo), one engine per rank, under Lightning's DDP and
under FSDP2 (``ModelParallelStrategy``: each engine gets the all-gathered weights).

Both ranks are launched once, as a cluster launcher would (``torch.multiprocessing`` with
``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``LOCAL_RANK``); each fits two steps of each
case on ``builtin:tiny-h64`` with rollouts from its own vLLM engine, then reports:

- its parameters (DDP: identical on the ranks after the all-reduced steps; FSDP2: gathered);
- greedy completions from its engine and from the Hugging Face engine on the same policy
  (the sync test, per rank and per strategy);
- samples for the same prompts under the same torch seed (the ranks' engines draw different
  samples: their request seeds include the rank).
"""

from __future__ import annotations

import functools
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
pytest.importorskip("vllm.entrypoints.llm")

WORLD = 2
MODEL = "builtin:tiny-h64"
PROMPTS = ["3 + 5 =", "7 + 1 =", "hello there"]
CASES = ("ddp", "fsdp")


def run_case(name: str, cache: str, root: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from maxent_grpo.rollout import HFGenerateEngine, SamplingSettings
    from maxent_grpo.rollout.vllm_engine import VLLMEngine
    from maxent_grpo.rollout.weights import checkpoint_weights
    from tests.conftest import make_data, make_module

    module = make_module(
        cache, model_name_or_path=MODEL, max_completion_length=8,
        engine=functools.partial(VLLMEngine, gpu_memory_utilization=0.2),
        rewards={"tests.conftest:alternating": 1.0},
    )
    strategy = (DDPStrategy(process_group_backend="gloo") if name == "ddp" else
                ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1,
                                      timeout=timedelta(seconds=120)))
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=root,
    )
    trainer.fit(module, datamodule=make_data(cache, tokenizer=MODEL))
    engine = module.rollout_engine()
    greedy = SamplingSettings(max_new_tokens=8, max_prompt_length=32, do_sample=False)
    answers = [""] * len(PROMPTS)
    torch.manual_seed(0)
    sampled = engine.generate(PROMPTS, answers, 4).completion_ids
    return {
        "engine": type(engine).__name__,
        "weights": {n: t.clone() for n, t in checkpoint_weights(module.policy)},
        "vllm_greedy": engine.generate(PROMPTS, answers, 1, greedy).completion_ids,
        "hf_greedy": HFGenerateEngine(module.policy, module.tokenizer, greedy)
        .generate(PROMPTS, answers, 1).completion_ids,
        "sampled": sampled,
        "sync_seconds": float(trainer.callback_metrics["train/perf/sync_seconds"]),
    }


def _worker(rank: int, port: int, out_dir: str, cache: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD),
        NODE_RANK="0", LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
    )
    torch.set_num_threads(1)
    results = {name: run_case(name, cache, str(Path(out_dir) / f"root{rank}"))
               for name in CASES}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    from maxent_grpo.models import resolve_model_path

    tmp = tmp_path_factory.mktemp("vllm_distributed")
    cache = str(tmp / "models")
    resolve_model_path(MODEL, cache)  # materialised once, before the ranks load it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(_worker, args=(port, str(tmp), cache),
                                          nprocs=WORLD, join=True, start_method="spawn")
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("name", CASES)
def test_each_rank_has_its_engine_in_step_with_the_shared_policy(ranks, name):
    r0, r1 = (r[name] for r in ranks)
    assert r0["engine"] == r1["engine"] == "VLLMEngine"
    assert r0["sync_seconds"] > 0 and r1["sync_seconds"] > 0  # synced after the first step
    for key, value in r0["weights"].items():  # one policy, whole on each rank
        assert torch.equal(value, r1["weights"][key]), key
    for r in (r0, r1):  # each engine samples from exactly that policy
        assert torch.equal(r["vllm_greedy"], r["hf_greedy"])
    assert not torch.equal(r0["sampled"], r1["sampled"])  # per-rank request seeds


def test_ddp_and_fsdp2_trained_the_same_policy(ranks):
    """Same seed, prompts and SGD: FSDP2's reduce-scatter and DDP's all-reduce give the same
    weights up to float rounding; only the rollouts could differ, and they do not: the
    engines start from, and are synced to, the same weights."""
    ddp, fsdp = ranks[0]["ddp"]["weights"], ranks[0]["fsdp"]["weights"]
    assert list(ddp) == list(fsdp)
    for key, value in ddp.items():
        torch.testing.assert_close(fsdp[key], value, rtol=1e-5, atol=5e-6,
                                   msg=lambda m, k=key: f"{k}: {m}")
