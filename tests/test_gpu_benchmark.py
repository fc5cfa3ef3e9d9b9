"""The GPU benchmark's offline workload (benchmarks/gpu_step.py), at its tiny CPU shape: the
random Qwen2-shaped model, the byte-level tokenizer whose eos is never sampled, the exact
prompt lengths, and the report. (The workers themselves run in
``python benchmarks/gpu_step.py --shape tiny-cpu``; the GPU figures are taken on a GPU.)"""

from __future__ import annotations

import sys
from pathlib import Path

import bench_common as bc  # benchmarks/ is on sys.path (tests/conftest.py)
import pytest


def test_random_workload_is_byte_level_with_an_unreachable_eos(bench_folder: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    workload = bc.WORKLOADS["qwen-tiny-cpu"]
    tokenizer = AutoTokenizer.from_pretrained(bench_folder / "model")
    config = AutoConfig.from_pretrained(bench_folder / "model")
    assert config.model_type == "qwen2" and config.vocab_size == 151936
    assert tokenizer.eos_token_id >= config.vocab_size  # outside the embedding table
    assert tokenizer.pad_token_id < config.vocab_size
    rows = bc.read_prompts(bench_folder / "prompts.jsonl")
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
    # on CUDA the peak counter is reset at each phase mark: the step's peak is the largest
    phased = gpu_step.summary({**result, "phase_peak_mib": {"score": 4096.0, "other": 1024.0}})
    assert phased["peak_cuda_gib"] == 4.0
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
    assert "fused_lm_head" not in seen and "memory" not in seen
    for flag, value in (("true", True), ("false", False)):
        monkeypatch.setattr(sys, "argv", ["_ours.py", "--workload", "qwen-tiny-cpu",
                                          "--fused-lm-head", flag, "--memory"])
        bc.worker_main(lambda *args, **kw: kw, "test")
        assert seen["fused_lm_head"] is value and seen["memory"] is True


def test_gpu_step_can_compare_the_fused_head_with_the_logits_path() -> None:
    import gpu_step

    sides = gpu_step.sides("trl-python", "both")
    assert list(sides)[:2] == ["ours (dynamic cache, fused head)", "ours (dynamic cache, logits)"]
    assert sides["ours (dynamic cache, fused head)"][-2:] == ["--fused-lm-head", "true"]
    assert sides["ours (dynamic cache, logits)"][-2:] == ["--fused-lm-head", "false"]
    assert list(sides)[2:] == list(gpu_step.sides("trl-python"))
    static = gpu_step.sides("trl-python", "static-both")
    assert static["ours (static cache, bf16 copy, logits)"] == [
        *static["ours (static cache, bf16 copy)"], "--fused-lm-head", "false"]
    assert list(static)[-1] == "trl"


def test_ours_engine_factory_keeps_the_last_engine() -> None:
    import _ours

    from maxent_grpo.builtin.catalog import builtin_tiny_model_and_tokenizer
    from maxent_grpo.rollout import SamplingSettings

    model, tokenizer = builtin_tiny_model_and_tokenizer()
    factory = _ours.RecordingEngines(cache="static", prompt_bucket=64,
                                     generation_dtype="bfloat16")
    engine = factory(model, tokenizer, SamplingSettings(max_new_tokens=2))
    assert factory.last is engine
    assert (engine.cache, engine.prompt_bucket, engine.generation_dtype) == (
        "static", 64, "bfloat16")


def test_phase_memory_counts_each_phases_peak_on_the_cpu() -> None:
    """PhaseMemory on the CPU: the peak of bytes that ops create, per marked phase, from
    the step's start (weights made before it are not counted), only while recording."""
    import torch

    class Work:
        def make(self, n):
            return torch.ones(n, dtype=torch.float32)  # n * 4 bytes

        def transient(self, n):
            return float(torch.ones(n).sum())  # n * 4 bytes, freed before the return

    weights = torch.zeros(1 << 20)  # made before the step: never counted
    memory = bc.PhaseMemory("cpu", enabled=True)
    work = Work()
    memory.wrap(work, "make", "generate")
    memory.wrap(work, "transient", "score")
    memory.start_step()
    kept = work.make(1000)  # 4,000 bytes live from here on
    work.transient(250_000)  # 1,000,000 bytes at its peak, on top of `kept`
    memory.end_step()  # not recording yet: a warm-up step
    assert memory.result() is None
    memory.recording = True
    memory.start_step()
    kept2 = work.make(1000)
    work.transient(250_000)
    memory.end_step()
    peaks = memory.result()
    MiB = 2**20
    assert peaks["generate"] == pytest.approx(4_000 / MiB, rel=0.01)
    assert peaks["score"] == pytest.approx(1_004_000 / MiB, rel=0.01)  # `kept2` + transient
    assert peaks["other"] < peaks["score"]
    assert weights.numel() and kept.numel() and kept2.numel()
    assert bc.PhaseMemory("cpu", enabled=False).result() is None


def test_phase_table_lists_every_side() -> None:
    import gpu_step

    report = {"results": {"ours": {"phase_peak_mib": {"generate": 10.0, "score": 30.4}},
                          "trl": {"phase_peak_mib": {"backward": 50.0}}}}
    table = "\n".join(gpu_step.phase_markdown(report))
    assert "| phase | ours | trl |" in table and "above the weights" in table
    assert "| score | 30 | - |" in table and "| backward | - | 50 |" in table
    assert gpu_step.phase_markdown({"results": {"trl": {"phase_peak_mib": None}}}) == []


def test_our_side_loads_a_fixed_length_workload(bench_folder: Path) -> None:
    """The step benchmarks (step_overhead, trl_vs_ours, gpu_step) stopped before their first
    step once the module refused an eos past the embeddings (a hunt): the workload's eos is
    past them on purpose. Our side lets that token through, and only that one."""
    import _ours
    import pytest

    from maxent_grpo.models import check_token_ids

    _, module, _ = _ours.build(bc.WORKLOADS["qwen-tiny-cpu"], bench_folder, total_steps=1)
    module.configure_model()
    assert module.tokenizer.eos_token == bc.NO_EOS_TOKEN
    assert module.tokenizer.eos_token_id >= module.policy.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match="eos token"):  # a user's model is still refused
        check_token_ids(module.tokenizer, module.policy, "a user's")
