"""The GPU benchmark's offline workload (benchmarks/gpu_step.py), at its tiny CPU shape: the
random Qwen2-shaped model, the byte-level tokenizer whose eos is never sampled, the exact
prompt lengths, and the report. (The workers themselves run in
``python benchmarks/gpu_step.py --shape tiny-cpu``; the GPU figures are taken on a GPU.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_common as bc  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    workload = bc.WORKLOADS["qwen-tiny-cpu"]
    target = tmp_path_factory.mktemp("bench") / workload.name
    bc.prepare_random(workload, target)
    return target


def test_random_workload_is_byte_level_with_an_unreachable_eos(folder: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    workload = bc.WORKLOADS["qwen-tiny-cpu"]
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    config = AutoConfig.from_pretrained(folder / "model")
    assert config.model_type == "qwen2" and config.vocab_size == 151936
    assert tokenizer.eos_token_id >= config.vocab_size  # outside the embedding table
    assert tokenizer.pad_token_id < config.vocab_size
    rows = bc.read_prompts(folder / "prompts.jsonl")
    assert len(rows) == bc.NUM_PROMPTS
    lengths = {len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rows}
    assert lengths == {workload.prompt_tokens}
    text = "héllo 12 <x>"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # byte-level round trip
    # the GPU shape is Qwen2.5-0.5B's
    assert bc.RANDOM_MODELS["qwen2.5-0.5b"]["hidden_size"] == 896
    assert bc.WORKLOADS["qwen0.5b-gpu"].max_completion_length == 256


def test_gpu_step_summary_and_table() -> None:
    import gpu_step

    result = {"step_s": [2.0, 1.0, 3.0], "completion_tokens": [100, 100, 100],
              "phases": {"generate_s": [1.5, 0.5, 2.0]}, "peak_cuda_mib": 2048.0}
    s = gpu_step.summary(result)
    assert (s["step_s"], s["generate_s"], s["other_s"], s["peak_cuda_gib"]) == (2.0, 1.5, 0.5, 2.0)
    assert s["tokens_per_s"] == 50.0
    table = gpu_step.markdown({"summary": {"ours (static cache)": s, "trl": {**s, "step_s": 6.0}}})
    assert "| ours (static cache) | 2.000 | 1.500 | 0.500 | 50 | 2.0 |" in table
    assert "TRL step / ours (static cache) step: 3.00x" in table


def test_gpu_step_sides_and_the_bf16_copy_refresh() -> None:
    """Every side's worker command, the bf16-copy side passing its engine option, and its
    refresh seconds reported beside the table."""
    import gpu_step

    sides = gpu_step.sides("trl-python")
    assert list(sides) == ["ours (dynamic cache)", "ours (static cache)",
                           "ours (static cache, bf16 copy)", "trl"]
    assert sides["ours (static cache, bf16 copy)"][-4:] == [
        "--cache", "static", "--generation-dtype", "bfloat16"]
    assert "--generation-dtype" not in sides["ours (static cache)"]
    assert sides["trl"][0] == "trl-python"
    phases = {"generate_s": [1.5, 0.5, 2.0], "refresh_s": [0.02, 0.01, 0.03]}
    result = {"step_s": [2.0, 1.0, 3.0], "completion_tokens": [100] * 3, "phases": phases,
              "peak_cuda_mib": None}
    copy = gpu_step.summary(result)
    assert copy["refresh_s"] == 0.02 and copy["peak_cuda_gib"] is None
    plain = gpu_step.summary({**result, "phases": {"generate_s": phases["generate_s"]}})
    assert plain["refresh_s"] is None
    table = gpu_step.markdown({"summary": {"ours (static cache)": plain,
                                           "ours (static cache, bf16 copy)": copy}})
    assert "| ours (static cache, bf16 copy) | 2.000 | 1.500 | 0.500 | 50 | n/a |" in table
    assert "ours (static cache, bf16 copy): weight-copy refresh 0.0200 s per rollout" in table
    assert "ours (static cache): weight-copy" not in table


def test_ours_worker_takes_the_generation_dtype(monkeypatch) -> None:
    """``_ours.py --generation-dtype bfloat16`` reaches ``run`` (and so the engine)."""
    seen = {}
    monkeypatch.setattr(sys, "argv", ["_ours.py", "--workload", "qwen-tiny-cpu", "--cache",
                                      "static", "--generation-dtype", "bfloat16"])
    monkeypatch.setattr(bc, "emit_result", lambda result: seen.update(result))
    bc.worker_main(lambda *args, **kw: {"args": args[2:], **kw}, "test")
    assert seen["cache"] == "static" and seen["generation_dtype"] == "bfloat16"


def test_ours_engine_factory_keeps_the_last_engine() -> None:
    import _ours

    from maxent_grpo.models import builtin_tiny_model_and_tokenizer
    from maxent_grpo.rollout import SamplingSettings

    model, tokenizer = builtin_tiny_model_and_tokenizer()
    factory = _ours.RecordingEngines(cache="static", prompt_bucket=64,
                                     generation_dtype="bfloat16")
    engine = factory(model, tokenizer, SamplingSettings(max_new_tokens=2))
    assert factory.last is engine
    assert (engine.cache, engine.prompt_bucket, engine.generation_dtype) == (
        "static", 64, "bfloat16")
