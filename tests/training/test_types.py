"""Tests for maxent_grpo.training.types: the documented field contract, helpers, validation."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from types import SimpleNamespace
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
    PromptCacheEntry,
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
    GenerationBatch: [
        ("prompts", MISSING),
        ("answers", MISSING),
        ("grouped_completions", MISSING),
        ("grouped_ref_meta", MISSING),
        ("grouped_completion_info", None),
    ],
    PromptCompletionBatch: [("prompts", MISSING), ("completions", MISSING), ("metadata", None)],
    RewardComponentStats: [("mean", MISSING), ("std", MISSING)],
    RewardMoments: [("mean", MISSING), ("std", MISSING)],
    AdvantageStats: [("grouped", MISSING), ("samples", MISSING)],
    QDistribution: [("grouped", MISSING), ("samples", MISSING)],
    SequenceScores: [
        ("cur_logp_sum", MISSING),
        ("behavior_logp_sum", MISSING),
        ("log_ratio_train", MISSING),
        ("denom_tok_tensor", MISSING),
        ("pooled_hidden", None),
        ("policy_entropy_sum", None),
        ("token_logp", None),
        ("token_mask", None),
        ("old_token_logp", None),
    ],
    BatchingSettings: [
        ("logprob_chunk_size", MISSING),
        ("score_slice", MISSING),
        ("prompt_length_cache_get", None),
        ("score_tail_tokens", None),
        ("slice_prefetch", 0),
        ("prompt_cache_size", 0),
    ],
    TokenUsageStats: [
        ("avg_completion_tokens", MISSING),
        ("num_completion_tokens", MISSING),
        ("num_input_tokens", MISSING),
    ],
    TrainingScalarStats: [
        ("ref_logp_mean", MISSING),
        ("tokens", MISSING),
        ("current_lr", MISSING),
        ("grad_norm_scalar", MISSING),
        ("epoch_progress", MISSING),
        ("vllm_latency_ms", MISSING),
        ("policy_entropy", None),
        ("entropy_bonus_coef", None),
        ("entropy_bonus_reward_std", None),
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
        ("generation", MISSING),
        ("evaluation", MISSING),
        ("optimization", MISSING),
        ("scoring", MISSING),
        ("controller", MISSING),
        ("controller_objective", None),
        ("controller_meta_manager", None),
    ],
    RuntimeHandles: [
        ("accelerator", MISSING),
        ("model", MISSING),
        ("tokenizer", MISSING),
        ("train_loader", MISSING),
        ("train_sampler", MISSING),
        ("device", MISSING),
        ("get_ref_model", MISSING),
        ("reference_model", None),
        ("prompt_cache_get", None),
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
            "PromptCacheEntry",
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
    info = [[{"n": 0}, {"n": 1}, {"n": 2}], [{"n": 3}, {"n": 4}, {"n": 5}]]
    batch = _batch(grouped_completion_info=info)
    assert (batch.num_groups, batch.group_size, batch.num_completions) == (2, 3, 6)
    flat = batch.flatten()
    assert isinstance(flat, PromptCompletionBatch)
    assert flat.prompts == ["p0", "p0", "p0", "p1", "p1", "p1"]
    assert flat.completions == ["c00", "c01", "c02", "c10", "c11", "c12"]
    assert flat.metadata is not None and [m["n"] for m in flat.metadata] == [0, 1, 2, 3, 4, 5]
    assert _batch().flatten().metadata is None


def test_generation_batch_ragged_groups() -> None:
    batch = _batch(grouped_completions=[["x"], ["y", "z"]])
    assert batch.num_completions == 3
    assert batch.flatten().prompts == ["p0", "p1", "p1"]
    with pytest.raises(ValueError, match="group_size.*ragged"):
        _ = batch.group_size
    empty = GenerationBatch([], [], [], None)
    with pytest.raises(ValueError, match="group_size"):
        _ = empty.group_size


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"answers": ["a0"]}, "answers"),
        ({"grouped_completions": [["c"]]}, "grouped_completions"),
        ({"grouped_ref_meta": [[None, None, None]]}, "grouped_ref_meta"),
        ({"grouped_ref_meta": [[None] * 3, [None] * 2]}, r"grouped_ref_meta\[1\]"),
        ({"grouped_completion_info": [[{}] * 3, [{}] * 4]}, r"grouped_completion_info\[1\]"),
    ],
)
def test_generation_batch_validation(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        _batch(**overrides)


def test_prompt_completion_batch_validation() -> None:
    PromptCompletionBatch(["p"], ["c"], [{"k": 1}])
    with pytest.raises(ValueError, match="metadata"):
        PromptCompletionBatch(["p", "p"], ["c", "d"], [{}])
    with pytest.raises(ValueError, match="completions"):
        PromptCompletionBatch(["p", "p"], ["c"])


# ------------------------------------------------------------------ rewards and targets


@pytest.mark.parametrize("cls", [RewardComponentStats, RewardMoments])
def test_reward_stats_std(cls: type) -> None:
    assert cls(mean=0.5, std=0.0).std == 0.0
    assert math.isnan(cls(mean=float("nan"), std=float("nan")).std)  # undefined spread is ok
    with pytest.raises(ValueError, match="std"):
        cls(mean=0.5, std=-0.1)


@pytest.mark.parametrize("cls", [AdvantageStats, QDistribution])
def test_grouped_and_samples(cls: type) -> None:
    stats = cls.from_grouped([[0.5, -0.5], [0.25, 0.75, 0.0]])
    assert stats.samples == [0.5, -0.5, 0.25, 0.75, 0.0]
    with pytest.raises(ValueError, match="samples"):
        cls(grouped=[[1.0, 2.0]], samples=[1.0])


# ---------------------------------------------------------------------------- scoring


def _scores(n: int = 4, t: int = 5, **overrides: Any) -> SequenceScores:
    cur, old = torch.randn(n), torch.randn(n)
    kwargs: dict[str, Any] = {
        "cur_logp_sum": cur,
        "behavior_logp_sum": old,
        "log_ratio_train": cur - old,
        "denom_tok_tensor": torch.full((n,), float(t)),
    }
    kwargs.update(overrides)
    return SequenceScores(**kwargs)


def test_sequence_scores_shapes() -> None:
    scores = _scores(
        pooled_hidden=torch.zeros(4, 8),
        policy_entropy_sum=torch.zeros(4),
        token_logp=torch.zeros(4, 5),
        token_mask=torch.ones(4, 5, dtype=torch.bool),
        old_token_logp=torch.zeros(4, 5),
    )
    assert scores.num_sequences == 4
    assert _scores().token_logp is None


@pytest.mark.parametrize(
    ("overrides", "field", "error"),
    [
        ({"behavior_logp_sum": torch.zeros(3)}, "behavior_logp_sum", ValueError),
        ({"denom_tok_tensor": torch.zeros(4, 1)}, "denom_tok_tensor", ValueError),
        ({"cur_logp_sum": [0.0] * 4}, "cur_logp_sum", TypeError),
        ({"pooled_hidden": torch.zeros(4)}, "pooled_hidden", ValueError),
        ({"policy_entropy_sum": torch.zeros(5)}, "policy_entropy_sum", ValueError),
        ({"token_logp": torch.zeros(3, 5)}, "token_logp", ValueError),
        (
            {"token_logp": torch.zeros(4, 5), "token_mask": torch.ones(4, 6, dtype=torch.bool)},
            "token_mask",
            ValueError,
        ),
    ],
)
def test_sequence_scores_validation(overrides: dict[str, Any], field: str, error: type) -> None:
    with pytest.raises(error, match=field):
        _scores(**overrides)


def test_prompt_cache_entry() -> None:
    entry = PromptCacheEntry(input_ids=[5, 6, 7], attention_mask=[1, 1, 1])
    assert entry.length == 3
    with pytest.raises(ValueError, match="attention_mask"):
        PromptCacheEntry(input_ids=[5, 6], attention_mask=[1])


def test_batching_settings_defaults_and_validation() -> None:
    settings = BatchingSettings(logprob_chunk_size=8, score_slice=4)
    assert (settings.slice_prefetch, settings.prompt_cache_size) == (0, 0)
    assert settings.score_tail_tokens is None and settings.prompt_length_cache_get is None
    BatchingSettings(1, 1, prompt_length_cache_get=lambda p: PromptCacheEntry([1], [1]))
    bad = [
        ({"logprob_chunk_size": 0}, "logprob_chunk_size"),
        ({"score_slice": 0}, "score_slice"),
        ({"score_tail_tokens": 0}, "score_tail_tokens"),
        ({"slice_prefetch": -1}, "slice_prefetch"),
        ({"prompt_cache_size": -1}, "prompt_cache_size"),
    ]
    for overrides, field in bad:
        kwargs: dict[str, Any] = {"logprob_chunk_size": 2, "score_slice": 2} | overrides
        with pytest.raises(ValueError, match=field):
            BatchingSettings(**kwargs)
    with pytest.raises(TypeError, match="prompt_length_cache_get"):
        BatchingSettings(1, 1, prompt_length_cache_get="not callable")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- logging


def test_token_usage_as_dict_and_validation() -> None:
    tokens = TokenUsageStats(12.5, 50.0, 90.0)
    assert tokens.as_dict() == {
        "avg_completion_tokens": 12.5,
        "num_completion_tokens": 50.0,
        "num_input_tokens": 90.0,
    }
    names = ["avg_completion_tokens", "num_completion_tokens", "num_input_tokens"]
    for i, name in enumerate(names):
        values = [1.0, 1.0, 1.0]
        values[i] = -1.0
        with pytest.raises(ValueError, match=name):
            TokenUsageStats(*values)


def test_training_scalar_stats_forwards_tokens() -> None:
    stats = TrainingScalarStats(
        ref_logp_mean=-1.5,
        tokens=TokenUsageStats(12.5, 50.0, 90.0),
        current_lr=1e-6,
        grad_norm_scalar=None,
        epoch_progress=0.25,
        vllm_latency_ms=None,
    )
    assert stats.avg_completion_tokens == 12.5
    assert stats.num_completion_tokens == 50.0
    assert stats.num_input_tokens == 90.0
    with pytest.raises(AttributeError):
        stats.num_input_tokens = 1.0  # type: ignore[misc]
    assert (stats.policy_entropy, stats.entropy_bonus_coef, stats.entropy_bonus_reward_std) == (
        None,
        None,
        None,
    )


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


def test_loop_settings() -> None:
    loop = LoopSettings(
        generation={"G": 4},
        evaluation=None,
        optimization=OptimizationSettings(schedule={"lr": 1e-6}, handles=None),
        scoring=BatchingSettings(4, 4),
        controller=ControllerPaths(None, None),
    )
    assert loop.controller_objective is None and loop.controller_meta_manager is None
    with pytest.raises(TypeError, match="controller"):
        LoopSettings(None, None, loop.optimization, loop.scoring, controller="path.json")


def test_runtime_handles_lazy_reference() -> None:
    calls: list[int] = []
    ref = torch.nn.Linear(2, 2)

    def load() -> torch.nn.Module:
        calls.append(1)
        return ref

    handles = RuntimeHandles(
        accelerator=None,
        model=torch.nn.Linear(2, 2),
        tokenizer=None,
        train_loader=None,
        train_sampler=None,
        device=torch.device("cpu"),
        get_ref_model=load,
    )
    assert handles.reference_model is None and calls == []
    assert handles.reference() is ref and handles.reference() is ref
    assert calls == [1] and handles.reference_model is ref
    with pytest.raises(TypeError, match="get_ref_model"):
        RuntimeHandles(None, None, None, None, None, torch.device("cpu"), None)  # type: ignore[arg-type]


def test_runtime_handles_from_trainer() -> None:
    # A stand-in with the Trainer attributes read (trainer.accelerator, .train_dataloader,
    # .strategy.root_device); a real Trainer is not built here because importing Lightning
    # alone takes seconds.
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2, shuffle=True)
    trainer = SimpleNamespace(
        accelerator=object(),
        train_dataloader=loader,
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
    )
    model = torch.nn.Linear(2, 2)
    handles = RuntimeHandles.from_trainer(
        trainer,
        model,
        tokenizer=None,
        get_ref_model=lambda: model,  # type: ignore[arg-type]
    )
    assert handles.accelerator is trainer.accelerator
    assert handles.device == torch.device("cpu")
    assert handles.train_loader is loader and handles.train_sampler is loader.sampler
    assert handles.model is model and handles.reference_model is None
    trainer.train_dataloader = None
    before_fit = RuntimeHandles.from_trainer(trainer, model, None, lambda: model)  # type: ignore[arg-type]
    assert before_fit.train_loader is None and before_fit.train_sampler is None
