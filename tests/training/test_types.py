"""Tests for maxent_grpo.training.types: the documented field contract, helpers, validation."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from typing import Any

import pytest
import torch

import maxent_grpo.training.types as training_types
from maxent_grpo.rollout import RolloutOutput
from maxent_grpo.rollout.batch import ToolUsage
from maxent_grpo.training.types import (
    AdvantageStats,
    BatchingSettings,
    ControllerPaths,
    GenerationBatch,
    LoggingConfigView,
    LogStepArtifacts,
    LoopSettings,
    LossScalarBundle,
    MetricWriter,
    OptimizationSettings,
    PromptCompletionBatch,
    QDistribution,
    RewardComponentStats,
    RewardMoments,
    RuntimeHandles,
    SequenceScores,
    TokenUsageStats,
    TrainingScalarStats,
)

MISSING = dataclasses.MISSING

# The documented contract, written by hand from the project's starting document: (field
# name, default or MISSING), in order; nothing more and nothing less.
SPEC: dict[type, list[tuple[str, Any]]] = {
    GenerationBatch: [("prompts", MISSING), ("answers", MISSING),
                      ("grouped_completions", MISSING), ("grouped_ref_meta", MISSING),
                      ("grouped_completion_info", None)],
    PromptCompletionBatch: [("prompts", MISSING), ("completions", MISSING), ("metadata", None)],
    RewardComponentStats: [("mean", MISSING), ("std", MISSING)],
    RewardMoments: [("mean", MISSING), ("std", MISSING)],
    AdvantageStats: [("grouped", MISSING), ("samples", MISSING)],
    QDistribution: [("grouped", MISSING), ("samples", MISSING)],
    SequenceScores: [
        ("cur_logp_sum", MISSING), ("behavior_logp_sum", MISSING),
        ("log_ratio_train", MISSING), ("denom_tok_tensor", MISSING), ("pooled_hidden", None),
        ("policy_entropy_sum", None), ("token_logp", None), ("token_mask", None),
        ("old_token_logp", None),
    ],
    BatchingSettings: [("logprob_chunk_size", MISSING), ("score_slice", MISSING),
                       ("prompt_length_cache_get", None), ("score_tail_tokens", None),
                       ("slice_prefetch", 0), ("prompt_cache_size", 0)],
    TokenUsageStats: [
        ("avg_completion_tokens", MISSING),
        ("num_completion_tokens", MISSING),
        ("num_input_tokens", MISSING),
    ],
    TrainingScalarStats: [
        ("ref_logp_mean", MISSING), ("tokens", MISSING), ("current_lr", MISSING),
        ("grad_norm_scalar", MISSING), ("epoch_progress", MISSING),
        ("vllm_latency_ms", MISSING), ("policy_entropy", None),
        ("entropy_bonus_coef", None), ("entropy_bonus_reward_std", None),
    ],
    LossScalarBundle: [
        ("total_loss", MISSING),
        ("policy_loss", MISSING),
        ("clip_loss", MISSING),
        ("kl_loss", MISSING),
        ("weighted_kl_loss", MISSING),
    ],
    LogStepArtifacts: [
        ("loss_outputs", MISSING),
        ("diagnostics", MISSING),
        ("grad_norm_scalar", MISSING),
        ("epoch_progress", MISSING),
    ],
    LoggingConfigView: [("weighting", MISSING), ("clipping", MISSING), ("schedule", MISSING)],
    ControllerPaths: [
        ("state_path", MISSING),
        ("resume_from", MISSING),
        ("overwrite_existing", False),
    ],
    OptimizationSettings: [("schedule", MISSING), ("handles", MISSING)],
    LoopSettings: [
        ("generation", MISSING), ("evaluation", MISSING), ("optimization", MISSING),
        ("scoring", MISSING), ("controller", MISSING), ("controller_objective", None),
        ("controller_meta_manager", None),
    ],
    RuntimeHandles: [
        ("accelerator", MISSING), ("model", MISSING), ("tokenizer", MISSING),
        ("train_loader", MISSING), ("train_sampler", MISSING), ("device", MISSING),
        ("get_ref_model", MISSING), ("reference_model", None), ("prompt_cache_get", None),
    ],
}


@pytest.mark.parametrize("cls", list(SPEC), ids=lambda c: c.__name__)
def test_fields_and_defaults_match_spec(cls: type) -> None:
    got = [(f.name, f.default) for f in dataclasses.fields(cls)]
    assert got == SPEC[cls]
    assert all(f.default_factory is MISSING for f in dataclasses.fields(cls))
    assert cls.__doc__ and len(cls.__doc__.strip()) > 40


def test_submodule_placement_and_all() -> None:
    placement = {
        "rewards": {
            "GenerationBatch",
            "PromptCompletionBatch",
            "RewardComponentStats",
            "RewardMoments",
            "AdvantageStats",
            "QDistribution",
            "SequenceScores",
            "BatchingSettings",
        },
        "logging": {
            "TokenUsageStats",
            "TrainingScalarStats",
            "LossScalarBundle",
            "LogStepArtifacts",
            "LoggingConfigView",
            "MetricWriter",
        },
        "runtime": {"ControllerPaths", "OptimizationSettings", "LoopSettings", "RuntimeHandles"},
    }
    # the rollout's own types are defined in the rollout layer (which must not import
    # training) and re-exported by the documented submodule
    defined_in_rollout = {"GenerationBatch", "PromptCompletionBatch"}
    for module, names in placement.items():
        submodule = getattr(training_types, module)
        for name in names:
            cls = getattr(training_types, name)
            assert getattr(submodule, name) is cls
            home = "maxent_grpo.rollout.batch" if name in defined_in_rollout else (
                f"maxent_grpo.training.types.{module}")
            assert cls.__module__ == home
    assert set(training_types.__all__) == set().union(*placement.values())


def test_import_loads_neither_lightning_nor_transformers() -> None:
    code = (
        "import sys, maxent_grpo.training.types\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('lightning', 'pytorch_lightning', 'transformers')]\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == ""


# ------------------------------------------------------------------------ GenerationBatch


def _batch(**overrides: Any) -> GenerationBatch:
    kwargs: dict[str, Any] = {
        "prompts": ["p0", "p1"],
        "answers": ["a0", "a1"],
        "grouped_completions": [["c00", "c01", "c02"], ["c10", "c11", "c12"]],
        "grouped_ref_meta": None,
    }
    kwargs.update(overrides)
    return GenerationBatch(**kwargs)


def test_generation_batch_counts_and_flatten() -> None:
    batch = _batch()
    assert batch.num_completions == 6
    flat = batch.flatten()
    assert isinstance(flat, PromptCompletionBatch)
    assert flat.prompts == ["p0", "p0", "p0", "p1", "p1", "p1"]
    assert flat.completions == ["c00", "c01", "c02", "c10", "c11", "c12"]
    assert flat.metadata is None and flat.reward_columns() == {}
    ragged = _batch(grouped_completions=[["x"], ["y", "z"]])
    assert ragged.num_completions == 3 and ragged.flatten().prompts == ["p0", "p1", "p1"]
    with pytest.raises(ValueError, match="grouped_completions"):
        _batch(grouped_completions=[["c"]])
    with pytest.raises(ValueError, match="answers"):
        _batch(answers=["a0"])


def test_generation_batch_per_completion_fields_follow_their_completions() -> None:
    info = [{"tool_calls": 10 * b + g} for b in range(2) for g in range(3)]
    batch = GenerationBatch.of_rows(["p0", "p1"], ["a0", "a1"],
                                    ["c00", "c01", "c02", "c10", "c11", "c12"],
                                    ref_meta=[-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], info=info)
    assert batch.grouped_ref_meta == [[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]]
    flat = batch.flatten()
    assert flat.metadata == info
    assert flat.reward_columns() == {"tool_calls": [0, 1, 2, 10, 11, 12]}
    picked = GenerationBatch.cat([batch.select([1]), batch.select([0])])
    assert picked.prompts == ["p1", "p0"] and picked.answers == ["a1", "a0"]
    assert picked.grouped_ref_meta == [[-4.0, -5.0, -6.0], [-1.0, -2.0, -3.0]]
    assert picked.grouped_completion_info[0][2] == {"tool_calls": 12}
    # a part without sampler log-probs: the joined batch has none
    assert GenerationBatch.cat([batch, _batch()]).grouped_ref_meta is None
    with pytest.raises(ValueError, match=r"grouped_ref_meta\[1\]"):
        _batch(grouped_ref_meta=[[0.0] * 3, [0.0] * 2])
    with pytest.raises(ValueError, match="grouped_completion_info"):
        _batch(grouped_completion_info=[[{}] * 3])
    with pytest.raises(ValueError, match="equal groups"):
        GenerationBatch.of_rows(["p0", "p1"], ["a0", "a1"], ["c"] * 5)


def test_prompt_completion_batch_validation() -> None:
    PromptCompletionBatch(["p"], ["c"])
    with pytest.raises(ValueError, match="completions"):
        PromptCompletionBatch(["p", "p"], ["c"])
    with pytest.raises(ValueError, match="metadata"):
        PromptCompletionBatch(["p"], ["c"], metadata=[{}, {}])
    with pytest.raises(ValueError, match=r"metadata\[1\]"):
        PromptCompletionBatch(["p", "p"], ["c", "d"], [{"a": 1}, {"b": 2}]).reward_columns()


# ------------------------------------------------------------------ rewards and targets


@pytest.mark.parametrize("cls", [RewardComponentStats, RewardMoments])
def test_reward_stats_std(cls: type) -> None:
    assert cls(mean=0.5, std=0.0).std == 0.0
    assert math.isnan(cls(mean=float("nan"), std=float("nan")).std)  # undefined spread is ok
    with pytest.raises(ValueError, match="std"):
        cls(mean=0.5, std=-0.1)


# ---------------------------------------------------------------------------- scoring


def _scores(n: int = 4, t: int = 5, **overrides: Any) -> SequenceScores:
    kwargs: dict[str, Any] = {
        "cur_logp_sum": torch.randn(n), "behavior_logp_sum": torch.randn(n),
        "log_ratio_train": torch.zeros(n), "denom_tok_tensor": torch.full((n,), float(t)),
        "token_logp": torch.zeros(n, t),
        "token_mask": torch.ones(n, t, dtype=torch.bool),
    }
    kwargs.update(overrides)
    return SequenceScores(**kwargs)


def test_sequence_scores_shapes() -> None:
    assert _scores(old_token_logp=torch.zeros(4, 5)).num_sequences == 4
    assert _scores().old_token_logp is None


@pytest.mark.parametrize(
    ("overrides", "field", "error"),
    [
        ({"cur_logp_sum": [0.0] * 4}, "cur_logp_sum", ValueError),
        ({"behavior_logp_sum": torch.zeros(3)}, "behavior_logp_sum", ValueError),
        ({"denom_tok_tensor": None}, "denom_tok_tensor", ValueError),
        ({"policy_entropy_sum": torch.zeros(4, 1)}, "policy_entropy_sum", ValueError),
        ({"token_logp": torch.zeros(3, 5)}, "token_logp", ValueError),
        ({"token_mask": torch.ones(4, 6, dtype=torch.bool)}, "token_mask", ValueError),
        ({"old_token_logp": [0.0]}, "old_token_logp", TypeError),
    ],
)
def test_sequence_scores_validation(overrides: dict[str, Any], field: str, error: type) -> None:
    with pytest.raises(error, match=field):
        _scores(**overrides)


def test_sequence_scores_of_sums_over_the_mask_against_the_sampling_policy() -> None:
    current = torch.tensor([[-1.0, -2.0, -4.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    old = torch.full((2, 3), -1.0)
    sampler = torch.full((2, 3), -2.0)
    entropy = torch.tensor([[1.0, 2.0, 9.0], [0.5, 0.5, 0.5]])
    plain = SequenceScores.of(current, mask)  # the current policy sampled: ratio 1
    assert plain.cur_logp_sum.tolist() == [-3.0, -1.5] and not plain.cur_logp_sum.requires_grad
    assert plain.behavior_logp_sum.tolist() == [-3.0, -1.5]
    assert plain.log_ratio_train.tolist() == [0.0, 0.0]
    assert plain.denom_tok_tensor.tolist() == [2.0, 3.0] and plain.policy_entropy_sum is None
    assert plain.token_logp is current and plain.pooled_hidden is None
    later = SequenceScores.of(current, mask, old_token_logp=old, entropy=entropy)
    assert later.behavior_logp_sum.tolist() == [-2.0, -3.0]
    assert later.log_ratio_train.tolist() == [-1.0, 1.5]
    assert later.policy_entropy_sum.tolist() == [3.0, 1.5]
    # an engine's own log-probs are the behaviour policy's, before the old policy's
    sampled = SequenceScores.of(current, mask, old_token_logp=old, sampler_token_logp=sampler)
    assert sampled.behavior_logp_sum.tolist() == [-4.0, -6.0]
    assert sampled.old_token_logp is old


def test_batching_settings_validation() -> None:
    settings = BatchingSettings(logprob_chunk_size=8, score_slice=None)
    assert settings.unsupported() == []
    for overrides, field in [({"logprob_chunk_size": 0}, "logprob_chunk_size"),
                             ({"score_slice": 0}, "score_slice"),
                             ({"score_tail_tokens": 0}, "score_tail_tokens"),
                             ({"slice_prefetch": -1}, "slice_prefetch"),
                             ({"prompt_cache_size": -1}, "prompt_cache_size")]:
        kwargs: dict[str, Any] = {"logprob_chunk_size": 2, "score_slice": 2} | overrides
        with pytest.raises(ValueError, match=field):
            BatchingSettings(**kwargs)
    with pytest.raises(TypeError, match="prompt_length_cache_get"):
        BatchingSettings(2, 2, prompt_length_cache_get="cache")  # type: ignore[arg-type]


def test_the_scorer_refuses_the_batching_it_does_not_have() -> None:
    from maxent_grpo.training.step.token_logps import Scorer

    Scorer(1.0, BatchingSettings(None, None))
    for overrides in ({"slice_prefetch": 2}, {"prompt_cache_size": 8},
                      {"score_tail_tokens": 4}, {"prompt_length_cache_get": len}):
        with pytest.raises(ValueError, match=next(iter(overrides))):
            Scorer(1.0, BatchingSettings(None, None, **overrides))


# ---------------------------------------------------------------------------- logging


def test_token_usage_as_dict_and_validation() -> None:
    tokens = TokenUsageStats(12.5, 50.0, 90.0)
    assert tokens.as_dict() == {
        "completion_length/mean": 12.5,
        "completion_tokens": 50.0,
        "input_tokens": 90.0,
    }
    names = ["avg_completion_tokens", "num_completion_tokens", "num_input_tokens"]
    for i, name in enumerate(names):
        values = [1.0, 1.0, 1.0]
        values[i] = -1.0
        with pytest.raises(ValueError, match=name):
            TokenUsageStats(*values)


def test_training_scalar_stats_as_dict_leaves_out_what_was_not_measured() -> None:
    tokens = TokenUsageStats(12.5, 50.0, 90.0)
    stats = TrainingScalarStats(ref_logp_mean=float("nan"), tokens=tokens, current_lr=1e-6,
                                grad_norm_scalar=None, epoch_progress=0.25,
                                vllm_latency_ms=None)
    assert stats.as_dict() == {
        "lr": 1e-6, "tokens/completion_length/mean": 12.5, "tokens/completion_tokens": 50.0,
        "tokens/input_tokens": 90.0,
    }
    assert (stats.avg_completion_tokens, stats.num_completion_tokens,
            stats.num_input_tokens) == (12.5, 50.0, 90.0)
    measured = TrainingScalarStats(-1.5, tokens, 1e-6, 2.0, 0.25, 1250.0, policy_entropy=0.7,
                                   entropy_bonus_coef=0.01, entropy_bonus_reward_std=0.002)
    out = measured.as_dict()
    assert out["perf/generate_s"] == 1.25 and out["logp/ref_token"] == -1.5
    assert out["entropy_bonus/coef"] == 0.01 and out["entropy_bonus/reward_std"] == 0.002
    assert "grad_norm" not in out and "epoch_progress" not in out  # LogStepArtifacts' own
    artifacts = LogStepArtifacts(LossScalarBundle(1.0, 1.0, None, 0.0, 0.0),
                                 {"kl": 0.1, **out}, measured.grad_norm_scalar,
                                 measured.epoch_progress)
    flat = artifacts.as_dict()
    assert flat["train/tokens/input_tokens"] == 90.0
    assert flat["train/grad_norm"] == 2.0 and flat["train/epoch_progress"] == 0.25


def test_loss_bundle_as_dict() -> None:
    bundle = LossScalarBundle(1.0, 0.75, None, 2.5, 0.25)
    assert bundle.as_dict() == {
        "total_loss": 1.0,
        "policy_loss": 0.75,
        "clip_loss": None,
        "kl_loss": 2.5,
        "weighted_kl_loss": 0.25,
    }
    assert list(bundle.as_dict()) == [f.name for f in dataclasses.fields(LossScalarBundle)]


def test_log_step_artifacts_as_dict_from_bundle() -> None:
    artifacts = LogStepArtifacts(
        loss_outputs=LossScalarBundle(1.0, 0.75, 0.125, 2.5, 0.25),
        diagnostics={"kl/mean": torch.tensor(0.5), "clip": {"low_frac": 0.1, "high_frac": 0}},
        grad_norm_scalar=3.0,
        epoch_progress=0.5,
    )
    out = artifacts.as_dict()
    assert out == {
        "train/loss/total": 1.0,
        "train/loss/policy": 0.75,
        "train/loss/clip": 0.125,
        "train/loss/kl": 2.5,
        "train/loss/weighted_kl": 0.25,
        "train/kl/mean": 0.5,
        "train/clip/low_frac": 0.1,
        "train/clip/high_frac": 0.0,
        "train/grad_norm": 3.0,
        "train/epoch_progress": 0.5,
    }
    assert all(type(v) is float for v in out.values())


def test_log_step_artifacts_drops_none_and_nan_and_accepts_dict() -> None:
    artifacts = LogStepArtifacts(
        loss_outputs={"total_loss": 2.0, "clip_loss": None, "entropy": -0.5},
        diagnostics={"kl": float("nan"), "reward": {"std": torch.tensor(float("nan"))}},
        grad_norm_scalar=None,
        epoch_progress=1.0,
    )  # None and NaN: not measured this step, so not logged
    assert artifacts.as_dict() == {"train/loss/total": 2.0, "train/loss/entropy": -0.5,
                                   "train/epoch_progress": 1.0}
    no_clip = LogStepArtifacts(LossScalarBundle(1.0, 1.0, None, 0.0, 0.0), {}, None, 0.0)
    assert "train/loss/clip" not in no_clip.as_dict()


def test_log_step_artifacts_errors() -> None:
    bundle = LossScalarBundle(1.0, 1.0, None, 0.0, 0.0)
    with pytest.raises(ValueError, match="grad_norm"):
        LogStepArtifacts(bundle, {"grad_norm": 1.0}, 2.0, 0.0).as_dict()
    with pytest.raises(ValueError, match="loss/kl.*twice"):  # a NaN value is a name too
        LogStepArtifacts(LossScalarBundle(1.0, 1.0, None, float("nan"), 0.0),
                         {"loss": {"kl": 0.5}}, None, 0.0).as_dict()
    with pytest.raises(ValueError, match="kl/per_token"):
        LogStepArtifacts(bundle, {"kl": {"per_token": torch.zeros(3)}}, None, 0.0).as_dict()
    with pytest.raises(ValueError, match="note"):
        LogStepArtifacts(bundle, {"note": "text"}, None, 0.0).as_dict()
    with pytest.raises(TypeError, match="loss_outputs"):
        LogStepArtifacts([1.0], {}, None, 0.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="diagnostics"):
        LogStepArtifacts(bundle, [("a", 1.0)], None, 0.0)  # type: ignore[arg-type]


class _ListWriter:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, Any]]] = []
        self.flushed = 0

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.rows.append((step, dict(metrics)))

    def flush(self) -> None:
        self.flushed += 1


class _NoFlush:
    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass


def test_metric_writer_protocol() -> None:
    writer = _ListWriter()
    assert isinstance(writer, MetricWriter)
    assert not isinstance(_NoFlush(), MetricWriter)
    assert not isinstance(object(), MetricWriter)
    writer.log(LogStepArtifacts({"total_loss": 1.0}, {}, None, 0.5).as_dict(), step=3)
    writer.flush()
    assert writer.rows == [(3, {"train/loss/total": 1.0, "train/epoch_progress": 0.5})]
    assert writer.flushed == 1


# ---------------------------------------------------------------------------- runtime


def test_controller_paths() -> None:
    paths = ControllerPaths(state_path="out/controller_state.json", resume_from=None)
    assert paths.overwrite_existing is False
    ControllerPaths(None, None)
    with pytest.raises(ValueError, match="state_path"):
        ControllerPaths(state_path="", resume_from=None)
    with pytest.raises(ValueError, match="resume_from"):
        ControllerPaths(state_path=None, resume_from="  ")


def test_runtime_handles_lazy_reference() -> None:
    calls: list[int] = []
    ref = torch.nn.Linear(2, 2)

    def load() -> torch.nn.Module:
        calls.append(1)
        return ref

    handles = RuntimeHandles(None, torch.nn.Linear(2, 2), None, None, None,
                             torch.device("cpu"), load)
    assert handles.reference_model is None and calls == []
    loaded = handles.with_reference()
    assert loaded.with_reference() is loaded and loaded.reference_model is ref
    assert calls == [1] and handles.reference_model is None  # new handles, never changed
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.reference_model = None  # type: ignore[misc]
    assert handles.prompt_cache_get is None
    with pytest.raises(TypeError, match="get_ref_model"):
        RuntimeHandles(None, None, None, None, None, None, None)  # type: ignore[arg-type]


def test_loop_settings_take_each_controller_without_being_mutated() -> None:
    loop = LoopSettings(None, None, OptimizationSettings(None, None),
                        BatchingSettings(None, None), ControllerPaths(None, None))
    objective, meta = object(), object()
    first = loop.with_controller(ControllerPaths(None, "old.json"), objective)
    assert loop.controller == ControllerPaths(None, None) and loop.controller_objective is None
    both = first.with_controller(ControllerPaths("state.json", "other.json", True), objective,
                                 meta)
    assert both.controller == ControllerPaths("state.json", "old.json", True)
    assert both.controller_objective is objective and both.controller_meta_manager is meta
    assert first.controller_meta_manager is None


def _rollout(batch: GenerationBatch, tools: ToolUsage | None = None) -> RolloutOutput:
    rows = batch.num_completions
    ones = torch.ones(rows, 2, dtype=torch.bool)
    return RolloutOutput(batch=batch, prompt_ids=torch.ones(rows, 2, dtype=torch.long),
                         prompt_mask=ones, completion_ids=torch.ones(rows, 2, dtype=torch.long),
                         completion_mask=ones, truncated=torch.zeros(rows, dtype=torch.bool),
                         generate_seconds=0.0, tools=tools)


def test_the_rollout_record_gives_its_group_size_texts_and_reward_pairs_once() -> None:
    info = [{"tool_calls": i} for i in range(6)]
    batch = GenerationBatch.of_rows(["p0", "p1"], ["a0", "a1"],
                                    ["c00", "c01", "c02", "c10", "c11", "c12"], info=info)
    rollout = _rollout(batch)
    assert rollout.group_size == 3
    assert rollout.texts == ["c00", "c01", "c02", "c10", "c11", "c12"]
    raw = [[{"role": "user", "content": "q0"}], "q1"]  # the dataset's prompts, any form
    pairs = rollout.pairs(raw)
    assert pairs.prompts == [raw[0]] * 3 + ["q1"] * 3
    assert pairs.completions == rollout.texts and pairs.metadata == info
    assert rollout.pairs().prompts == ["p0"] * 3 + ["p1"] * 3  # the rendered ones
    with pytest.raises(ValueError, match="one entry per prompt of the batch"):
        rollout.pairs(["only one"])
    # a multi-turn rollout's rewards read its messages, the texts stay the decoded rows
    messages = [[{"role": "assistant", "content": f"m{i}"}] for i in range(6)]
    zeros = torch.zeros(6, dtype=torch.long)
    tools = ToolUsage(messages=messages, turns=zeros, calls=zeros, failures={})
    turns = _rollout(batch, tools)
    assert turns.pairs(raw).completions == messages and turns.texts == rollout.texts
    with pytest.raises(ValueError, match="G completions for every prompt"):
        _rollout(GenerationBatch(["p0", "p1"], ["a", "a"], [["x"], ["y", "z"]], None))


def test_the_rewards_read_a_think_block_the_chat_template_opened() -> None:
    """A reasoning model's template ends the rendered prompt with ``<think>``; the rewards
    got only the dataset's prompt, so ``format`` scored every completion 0."""
    from maxent_grpo.rewards import WeightedRewards

    rewards = WeightedRewards({"format": 1.0, "tag_count": 1.0})
    rendered = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    batch = GenerationBatch.of_rows([rendered], ["4"], ["2+2=4</think>\n<answer>4</answer>"])
    _, parts = rewards.score_rollout(_rollout(batch), ["What is 2+2?"], {"answer": ["4"]})
    assert parts[:, 0].tolist() == [1.0, 1.0]
    plain = GenerationBatch.of_rows(["What is 2+2?"], ["4"], ["2+2=4</think><answer>4</answer>"])
    _, parts = rewards.score_rollout(_rollout(plain), ["What is 2+2?"], {"answer": ["4"]})
    assert parts[:, 0].tolist() == [0.0, 0.75]
    with pytest.raises(ValueError, match="'rendered_prompts' clashes with the reward argument"):
        rewards.score_rollout(_rollout(plain), ["q"], {"rendered_prompts": ["x"]})


def test_score_rollout_runs_reward_models_on_the_steps_device() -> None:
    from maxent_grpo.rewards import WeightedRewards

    rewards = WeightedRewards({"format": 1.0})
    assert rewards.device() == torch.device("cpu")
    batch = GenerationBatch.of_rows(["p"], ["a"], ["<think>x</think><answer>1</answer>", "y"])
    total, parts = rewards.score_rollout(_rollout(batch), ["p"], {}, device=torch.device("meta"))
    assert total.shape == (2,) and parts.shape == (1, 2) and total[0] > total[1]
    assert rewards.device() == torch.device("meta")  # what a reward model asks at its call
    with pytest.raises(TypeError, match="a callable is no longer taken"):
        WeightedRewards({"format": 1.0}, device=lambda: torch.device("cpu"))
