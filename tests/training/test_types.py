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

# Written by hand from the types' specification: (field name, default or MISSING), in order.
SPEC: dict[type, list[tuple[str, Any]]] = {
    GenerationBatch: [("prompts", MISSING), ("grouped_completions", MISSING)],
    PromptCompletionBatch: [("prompts", MISSING), ("completions", MISSING)],
    RewardComponentStats: [("mean", MISSING), ("std", MISSING)],
    RewardMoments: [("mean", MISSING), ("std", MISSING)],
    AdvantageStats: [("grouped", MISSING)],
    QDistribution: [("grouped", MISSING)],
    SequenceScores: [
        ("cur_logp_sum", MISSING),
        ("token_logp", MISSING),
        ("token_mask", MISSING),
        ("old_token_logp", None),
    ],
    BatchingSettings: [("logprob_chunk_size", MISSING), ("score_slice", MISSING)],
    TokenUsageStats: [
        ("avg_completion_tokens", MISSING),
        ("num_completion_tokens", MISSING),
        ("num_input_tokens", MISSING),
    ],
    TrainingScalarStats: [
        ("ref_logp_mean", MISSING),
        ("tokens", MISSING),
        ("current_lr", MISSING),
        ("policy_entropy", None),
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
        ("scalars", None),
    ],
    LoggingConfigView: [("weighting", MISSING), ("clipping", MISSING)],
    ControllerPaths: [
        ("state_path", MISSING),
        ("resume_from", MISSING),
        ("overwrite_existing", False),
    ],
    OptimizationSettings: [("schedule", MISSING), ("handles", MISSING)],
    LoopSettings: [
        ("generation", MISSING),
        ("evaluation", MISSING),
        ("optimization", MISSING),
        ("scoring", MISSING),
    ],
    RuntimeHandles: [
        ("model", MISSING),
        ("tokenizer", MISSING),
        ("get_ref_model", MISSING),
        ("reference_model", None),
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
        "grouped_completions": [["c00", "c01", "c02"], ["c10", "c11", "c12"]],
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
    ragged = _batch(grouped_completions=[["x"], ["y", "z"]])
    assert ragged.num_completions == 3 and ragged.flatten().prompts == ["p0", "p1", "p1"]
    with pytest.raises(ValueError, match="grouped_completions"):
        _batch(grouped_completions=[["c"]])


def test_prompt_completion_batch_validation() -> None:
    PromptCompletionBatch(["p"], ["c"])
    with pytest.raises(ValueError, match="completions"):
        PromptCompletionBatch(["p", "p"], ["c"])


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
        "cur_logp_sum": torch.randn(n),
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
        ({"token_logp": torch.zeros(3, 5)}, "token_logp", ValueError),
        ({"token_mask": torch.ones(4, 6, dtype=torch.bool)}, "token_mask", ValueError),
        ({"old_token_logp": [0.0]}, "old_token_logp", TypeError),
    ],
)
def test_sequence_scores_validation(overrides: dict[str, Any], field: str, error: type) -> None:
    with pytest.raises(error, match=field):
        _scores(**overrides)


def test_batching_settings_validation() -> None:
    BatchingSettings(logprob_chunk_size=8, score_slice=None)
    for overrides, field in [({"logprob_chunk_size": 0}, "logprob_chunk_size"),
                             ({"score_slice": 0}, "score_slice")]:
        kwargs: dict[str, Any] = {"logprob_chunk_size": 2, "score_slice": 2} | overrides
        with pytest.raises(ValueError, match=field):
            BatchingSettings(**kwargs)


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
    stats = TrainingScalarStats(ref_logp_mean=float("nan"),
                                tokens=TokenUsageStats(12.5, 50.0, 90.0), current_lr=1e-6)
    assert stats.as_dict() == {
        "lr": 1e-6, "tokens/completion_length/mean": 12.5, "tokens/completion_tokens": 50.0,
        "tokens/input_tokens": 90.0,
    }
    artifacts = LogStepArtifacts(LossScalarBundle(1.0, 1.0, None, 0.0, 0.0), {"kl": 0.1},
                                 None, 0.0, scalars=stats)
    assert artifacts.as_dict()["tokens/input_tokens"] == 90.0
    with pytest.raises(ValueError, match="produced twice"):
        LogStepArtifacts({}, {"lr": 1.0}, None, 0.0, scalars=stats).as_dict()


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
        "loss/total": 1.0,
        "loss/policy": 0.75,
        "loss/clip": 0.125,
        "loss/kl": 2.5,
        "loss/weighted_kl": 0.25,
        "kl/mean": 0.5,
        "clip/low_frac": 0.1,
        "clip/high_frac": 0.0,
        "grad_norm": 3.0,
        "epoch_progress": 0.5,
    }
    assert all(type(v) is float for v in out.values())


def test_log_step_artifacts_drops_none_and_accepts_dict() -> None:
    artifacts = LogStepArtifacts(
        loss_outputs={"total_loss": 2.0, "clip_loss": None, "entropy": -0.5},
        diagnostics={},
        grad_norm_scalar=None,
        epoch_progress=1.0,
    )
    assert artifacts.as_dict() == {"loss/total": 2.0, "loss/entropy": -0.5, "epoch_progress": 1.0}
    no_clip = LogStepArtifacts(LossScalarBundle(1.0, 1.0, None, 0.0, 0.0), {}, None, 0.0)
    assert "loss/clip" not in no_clip.as_dict()


def test_log_step_artifacts_errors() -> None:
    bundle = LossScalarBundle(1.0, 1.0, None, 0.0, 0.0)
    with pytest.raises(ValueError, match="grad_norm"):
        LogStepArtifacts(bundle, {"grad_norm": 1.0}, 2.0, 0.0).as_dict()
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
    assert writer.rows == [(3, {"loss/total": 1.0, "epoch_progress": 0.5})]
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

    handles = RuntimeHandles(model=torch.nn.Linear(2, 2), tokenizer=None, get_ref_model=load)
    assert handles.reference_model is None and calls == []
    assert handles.reference() is ref and handles.reference() is ref
    assert calls == [1] and handles.reference_model is ref
    with pytest.raises(TypeError, match="get_ref_model"):
        RuntimeHandles(None, None, None)  # type: ignore[arg-type]
