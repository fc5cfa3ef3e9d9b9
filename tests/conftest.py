"""What the test files share: the tiny module, data and fit helpers, the rewards the tests
name by path (``tests.conftest:alternating``), and the benchmarks' tiny offline workload.

``benchmarks/`` goes on ``sys.path`` here, so the benchmark tests import ``bench_common``,
``gpu_step`` and ``gpu_generate`` like the scripts do.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))


@pytest.fixture(autouse=True)
def _package_logger_as_it_was():
    """The console command (``console()``, run in-process by some tests) gives the package's
    logger a handler and a level; every test starts and ends without them."""
    import logging

    log = logging.getLogger("maxent_grpo")
    handlers, level = list(log.handlers), log.level
    yield
    log.handlers[:], log.level = handlers, level


@pytest.fixture(scope="session")
def bench_folder(tmp_path_factory) -> Path:
    """``qwen-tiny-cpu`` written once: the random Qwen2-shaped model, its byte-level
    tokenizer whose eos is never sampled, and the synthetic prompts."""
    import bench_common as bc

    workload = bc.WORKLOADS["qwen-tiny-cpu"]
    target = tmp_path_factory.mktemp("bench") / workload.name
    bc.prepare_random(workload, target)
    return target


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    """Where the built-in models are materialised, once per test module."""
    return str(tmp_path_factory.mktemp("models"))


def make_data(cache_dir: str, **kw):
    """The tiny offline DataModule: bare ``arithmetic_easy`` prompts, 4 per batch."""
    from maxent_grpo.training.data import PromptDataModule

    opts = dict(
        task="arithmetic_easy", task_options={"bare": True}, train_size=64, val_size=8,
        batch_size=4, max_prompt_length=32, tokenizer="builtin:tiny",
        tokenizer_cache_dir=cache_dir,
    )
    opts.update(kw)
    return PromptDataModule(**opts)


def make_module(cache_dir: str, **kw):
    """``MaxEntGRPOModule`` on ``builtin:tiny`` (G = 4, 4 new tokens, SGD at 0.5)."""
    import torch

    from maxent_grpo.training.module import MaxEntGRPOModule

    opts = dict(
        rewards={"first_number": 1.0}, num_generations=4, max_completion_length=4,
        model_cache_dir=cache_dir,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
    )
    opts.update(kw)
    return MaxEntGRPOModule(**opts)


def fit(module, data, steps: int = 2, tmp_path=None, ckpt_path=None, **trainer_kw):
    """``L.Trainer(...).fit`` on the CPU, quiet, seeded; ``trainer_kw`` override."""
    import lightning as L

    L.seed_everything(0)
    options = dict(
        max_steps=steps, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path,
    )
    trainer = L.Trainer(**(options | trainer_kw))
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer


def params(module) -> dict:
    """A detached copy of the policy's parameters, by name."""
    return {k: v.detach().clone() for k, v in module.policy.named_parameters()}


def always_one(prompts, completions, **kw):
    """A reward that makes every group constant (zero advantages)."""
    return [1.0] * len(completions)


def alternating(prompts, completions, **kw):
    """Rewards 1, 0, 1, 0, ... so every group has a non-zero spread."""
    return [float(i % 2 == 0) for i in range(len(completions))]
