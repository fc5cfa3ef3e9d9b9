"""The module's flat options checked once and grouped into the documented
:class:`~maxent_grpo.training.types.LoopSettings` (:func:`build_loop_settings`), from the
records of :mod:`maxent_grpo.training.settings`. A bad value raises ValueError naming
``model.<option>`` (:mod:`maxent_grpo.validation`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from maxent_grpo.core import CORRECTIONS
from maxent_grpo.objectives import ListwiseMaxEnt
from maxent_grpo.rollout import SamplingSettings
from maxent_grpo.rollout.multiturn import environment_factory
from maxent_grpo.rollout.toolcall import ISOLATIONS, Toolbox, tool_list
from maxent_grpo.training.settings import (
    EvaluationSettings,
    GenerationSettings,
    ScheduleSettings,
    ToolSettings,
)
from maxent_grpo.training.types import (
    BatchingSettings,
    ControllerPaths,
    LoopSettings,
    OptimizationSettings,
)
from maxent_grpo.validation import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_seconds,
    check_unused,
    require,
)


def build_tool_settings(o: dict[str, Any]) -> ToolSettings | None:
    """The checked ``model.tools`` / ``model.environment`` options (tools imported, their
    schemas built), or None when neither is set."""
    tools, env = o.get("tools"), o.get("environment")
    calls, timeout = o.get("max_tool_calls", 4), o.get("tool_timeout", 10.0)
    isolation = o.get("tool_isolation", "thread")
    check_int("model.max_tool_calls", calls, minimum=1)
    check_seconds("model.tool_timeout", timeout)
    check_choice("model.tool_isolation", isolation, ISOLATIONS)
    if not tools and env is None:  # a config's options with --model.tools null: dropped
        unused = [f"model.{name}={value!r}" for name, value, default in (
            ("max_tool_calls", calls, 4), ("tool_timeout", timeout, 10.0),
            ("tool_isolation", isolation, "thread")) if value != default]
        if unused:
            rank_zero_warn(f"dropped {', '.join(unused)}: only with model.tools or "
                           "model.environment, which are null")
        return None
    require(not (tools and env is not None),
            "model.tools and model.environment are two kinds of multi-turn rollout; set one "
            "of them (an environment can call tools itself)")
    require(tools or isolation == "thread",
            "model.tool_isolation: process runs model.tools in a sandbox; an environment's "
            "step runs in the trainer (with model.tool_timeout), so it has no effect there: "
            "leave it at thread, and isolate inside the environment what needs it")
    return ToolSettings(
        toolbox=Toolbox(tool_list(tools), timeout, isolation) if tools else None,
        environment=environment_factory(env) if env is not None else None,
        max_tool_calls=calls, timeout=float(timeout))


def build_loop_settings(o: dict[str, Any], reward_names: list[str]) -> LoopSettings:
    """Check the module's constructor options ``o`` and group them (see the module
    docstring); ``reward_names`` are ``WeightedRewards.names`` (checked: never empty)."""
    if o.get("rewards") is None:  # a task whose answers are bare would score 0 throughout
        rank_zero_warn("model.rewards is not set: scoring with the accuracy reward alone (the "
                       "completion's <answer> block or \\boxed{} equal to the row's answer); "
                       "set model.rewards to choose (docs/REWARDS.md)")
    check_int("model.num_generations", o["num_generations"], minimum=2)
    check_int("model.max_completion_length", o["max_completion_length"], minimum=1)
    overlong = (o.get("rewards") or {}).get("overlong")
    buffer = overlong.get("buffer") if isinstance(overlong, dict) else None
    require(not isinstance(buffer, int) or buffer <= o["max_completion_length"],
            f"model.rewards.overlong.buffer ({buffer}) must be at most "
            f"model.max_completion_length ({o['max_completion_length']}): the penalty ramps "
            "over the last buffer tokens of the budget")
    check_int("model.num_iterations", o["num_iterations"], minimum=1)
    check_bool("model.drop_constant_groups", o["drop_constant_groups"])
    check_int("model.refill_rounds", o["refill_rounds"], minimum=0)
    require(o["refill_rounds"] == 0 or o["drop_constant_groups"],
            "model.refill_rounds refills the groups that model.drop_constant_groups drops; "
            "set model.drop_constant_groups: true with it (or model.refill_rounds: 0)")
    require(not (o["drop_constant_groups"]
                 and getattr(o.get("objective"), "advantage", None) == "wreinforce"),
            "objective.advantage: wreinforce trains on groups whose rewards are all equal (an "
            "all-wrong group is pushed down by -1, an all-right one up by positive_weight), "
            "which model.drop_constant_groups drops; set model.drop_constant_groups: false")
    solved = o.get("solved_reward")
    check_number("model.solved_reward", solved, allow_none=True)
    require(not (o["mask_truncated_completions"] and isinstance(o.get("objective"),
                                                                 ListwiseMaxEnt)),
            "model.mask_truncated_completions hides whole rows from the loss, and "
            "ListwiseMaxEnt's softmax over a group's sequence log-probs would count a hidden "
            "row as log-prob 0, the likeliest (and objective.answer_level compares the "
            "policy's mass over every sampled completion); set "
            "model.mask_truncated_completions: false (or give the completions room to end: "
            "model.max_completion_length)")
    require(solved is None or o["drop_constant_groups"],
            "model.solved_reward keeps some of the groups that model.drop_constant_groups "
            "drops; set model.drop_constant_groups: true with it (or leave it None)")
    check_bool("model.mask_truncated_completions", o["mask_truncated_completions"])
    check_int("model.micro_batch_groups", o["micro_batch_groups"], minimum=1, allow_none=True)
    check_int("model.micro_batch_tokens", o["micro_batch_tokens"], minimum=1, allow_none=True)
    check_number("model.gradient_clip_val", o["gradient_clip_val"], minimum=0, strict=True,
                 allow_none=True)
    check_int("model.lr_warmup_steps", o["lr_warmup_steps"], minimum=0)
    if o["fused_lm_head"] is not None:
        check_bool("model.fused_lm_head", o["fused_lm_head"])
    check_int("model.max_consecutive_nonfinite", o["max_consecutive_nonfinite"], minimum=1)
    if o["sampler_correction"] is not None:
        check_choice("model.sampler_correction", o["sampler_correction"], CORRECTIONS)
    check_number("model.sampler_correction_cap", o["sampler_correction_cap"], minimum=0,
                 strict=True)
    check_unused({"model.sampler_correction_cap": (o["sampler_correction_cap"], 2.0)},
                 o["sampler_correction"] is not None, "model.sampler_correction set")
    n = o["eval_num_generations"]
    check_int("model.eval_num_generations", n, minimum=1)
    reward = o["eval_reward"]
    require(reward is None or reward in reward_names,
            f"model.eval_reward must be None or one of model.rewards {sorted(reward_names)}; "
            f"got {reward!r}")
    check_number("model.eval_correct_threshold", o["eval_correct_threshold"])
    ks = [1] if o["eval_k"] is None else o["eval_k"]  # any sequence, not one int
    ks = list(ks) if isinstance(ks, Iterable) and not isinstance(ks, str) else ks
    require(isinstance(ks, list) and len(ks) > 0 and all(
        isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= n for k in ks
    ), f"model.eval_k must hold ints k with 1 <= k <= model.eval_num_generations ({n}); "
       f"got {ks!r}")
    check_bool("model.eval_greedy", o["eval_greedy"])
    name = o.get("model_name_or_path", "builtin:tiny")  # (tests build the settings alone)
    require(isinstance(name, str) and bool(name.strip()), "model.model_name_or_path must be a "
            f"hub name, a folder or builtin:NAME, as a string; got {name!r}")
    for key, example in (("optimizer", "AdamW"), ("lr_scheduler", "lr_scheduler.LinearLR")):
        require(key not in o or callable(o[key]) or (key == "lr_scheduler" and o[key] is None),
                f"model.{key} must be a callable that builds it (a class such as torch.optim."
                f"{example}; in a config, class_path and init_args); got {o.get(key)!r}")
    try:
        sampling = SamplingSettings(
            max_new_tokens=o["max_completion_length"], temperature=o["temperature"],
            top_p=o["top_p"], top_k=o["top_k"], max_prompt_length=o["max_prompt_length"],
        )
    except ValueError as err:  # max_prompt_length: the command line's data.max_prompt_length
        where = " (data.max_prompt_length sets it)" if "max_prompt_length" in str(err) else ""
        raise ValueError(f"model.{err}{where}") from err
    if sampling.top_k == 1:  # (it was the advice for greedy completions)
        rank_zero_warn("model.top_k: 1 samples a prompt's likeliest completion each time: a "
                       "group's completions are equal (unless an environment answers at "
                       "random), their advantages 0, and nothing trains; greedy evaluation "
                       "is model.eval_greedy")
    G = o["num_generations"]
    groups = o["micro_batch_groups"]
    return LoopSettings(
        generation=GenerationSettings(
            num_generations=G, sampling=sampling,
            mask_truncated_completions=o["mask_truncated_completions"],
            drop_constant_groups=o["drop_constant_groups"],
            sampler_correction=o["sampler_correction"],
            sampler_correction_cap=float(o["sampler_correction_cap"]),
            refill_rounds=o["refill_rounds"],
            solved_reward=None if solved is None else float(solved),
            tools=build_tool_settings(o),
        ),
        evaluation=EvaluationSettings(
            num_generations=n,
            reward_index=0 if reward is None else reward_names.index(reward),
            correct_threshold=float(o["eval_correct_threshold"]), k=tuple(ks),
            greedy=o["eval_greedy"],
        ),
        optimization=OptimizationSettings(
            schedule=ScheduleSettings(
                num_iterations=o["num_iterations"], gradient_clip_val=o["gradient_clip_val"],
                lr_warmup_steps=o["lr_warmup_steps"],
                max_consecutive_nonfinite=o["max_consecutive_nonfinite"],
            ),
            handles=None,  # Lightning's optimizer and scheduler: rebuilt when training starts
        ),
        scoring=BatchingSettings(
            logprob_chunk_size=None if groups is None else groups * G,
            score_slice=o["micro_batch_tokens"],
        ),
        controller=ControllerPaths(None, None),  # the controllers attach at setup
    )
