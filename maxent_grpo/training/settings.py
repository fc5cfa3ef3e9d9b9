"""The typed groups of the module's flat options (frozen records, built once by
:func:`~maxent_grpo.training.option_groups.build_loop_settings`; they type the fields of the
documented :class:`~maxent_grpo.training.types.LoopSettings`) and the learning-rate
scheduler. This module sits below :mod:`maxent_grpo.training.types` (it never imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from maxent_grpo.adapters import PeftConfig, check_peft
from maxent_grpo.rollout import RolloutEngine, SamplingSettings
from maxent_grpo.rollout.multiturn import MultiTurnEngine
from maxent_grpo.rollout.protocol import ContinuableEngine
from maxent_grpo.rollout.toolcall import Toolbox
from maxent_grpo.validation import check_choice, require

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class ModelSettings:
    """Where the policy (and its frozen reference copy) come from.

    Attributes:
        name_or_path: hub name, local folder or ``builtin:`` model.
        dtype: parameter dtype.
        cache_dir: where built-in models are materialised, or None for the default.
        gradient_checkpointing: recompute activations in the policy's backward pass.
        peft: a ``peft`` config (``peft.LoraConfig``, ...): only its adapters train and the
            reference is the policy with them disabled (:mod:`maxent_grpo.adapters`);
            None = full fine-tuning.
    """

    name_or_path: str
    dtype: Dtype
    cache_dir: str | None
    gradient_checkpointing: bool
    peft: PeftConfig | None = None

    def __post_init__(self) -> None:
        check_choice("model.dtype", self.dtype, get_args(Dtype))  # (it failed at load, unnamed)
        if self.peft is not None:
            check_peft(self.peft)


@dataclass(frozen=True)
class ToolSettings:
    """Multi-turn rollouts (``model.tools`` or ``model.environment``;
    :mod:`maxent_grpo.rollout.multiturn`).

    Attributes:
        toolbox: the tools, or None.
        environment: the zero-argument environment factory, or None.
        max_tool_calls: the most tool calls (or environment steps) per sample.
        timeout: seconds a tool call or environment step may take.
    """

    toolbox: Toolbox | None
    environment: Callable[[], Any] | None
    max_tool_calls: int
    timeout: float

    def engine(self, engine: ContinuableEngine, tokenizer: Any,
               sampling: SamplingSettings) -> RolloutEngine:
        """``engine`` wrapped in the multi-turn loop."""
        return MultiTurnEngine(engine, tokenizer, sampling, self.toolbox, self.environment,
                               self.max_tool_calls, self.timeout)


@dataclass(frozen=True)
class GenerationSettings:
    """How a training rollout is sampled and which of its rows take part in the update.

    Attributes:
        num_generations: ``G``, completions per prompt.
        sampling: the sampling distribution (shared by the engine and the scorer).
        mask_truncated_completions: zero the loss mask of rows without EOS.
        drop_constant_groups: leave groups whose G rewards are equal out of the update.
        sampler_correction: the importance-weight mode for the sampler / trainer gap
            (``core.CORRECTIONS``), or None.
        sampler_correction_cap: its cap ``C``.
        refill_rounds: at most this many extra rollouts of ``B`` new prompts per step while
            fewer than ``B`` groups have rewards that differ (dynamic sampling with refill).
        solved_reward: with ``drop_constant_groups``, a constant group whose rewards are all
            at least this value is *solved* and stays in the update; ``None``: none stays.
        tools: multi-turn rollouts with tools or an environment, or None (one turn).
    """

    num_generations: int
    sampling: SamplingSettings
    mask_truncated_completions: bool
    drop_constant_groups: bool
    sampler_correction: str | None = None
    sampler_correction_cap: float = 2.0
    refill_rounds: int = 0
    solved_reward: float | None = None
    tools: ToolSettings | None = None


@dataclass(frozen=True)
class EvaluationSettings:
    """How validation and test sample and grade (see ``MaxEntGRPOModule``'s ``eval_*``).

    Attributes:
        num_generations: ``n``, samples per prompt.
        reward_index: index in the reward list of the reward that decides correctness.
        correct_threshold: a sample is correct when that reward is >= this.
        k: the ``k`` of the @k metrics.
        greedy: also decode one greedy completion per prompt.
    """

    num_generations: int
    reward_index: int
    correct_threshold: float
    k: tuple[int, ...]
    greedy: bool


@dataclass(frozen=True)
class ScheduleSettings:
    """The optimisation schedule (the ``schedule`` of the documented OptimizationSettings).

    Attributes:
        num_iterations: optimizer steps per rollout.
        gradient_clip_val: global gradient-norm bound, or None.
        lr_warmup_steps: linear warm-up steps before ``model.lr_scheduler`` takes over.
        max_consecutive_nonfinite: stop after this many skipped updates in a row.
    """

    num_iterations: int
    gradient_clip_val: float | None
    lr_warmup_steps: int
    max_consecutive_nonfinite: int


def build_optimizer(factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                    params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``model.optimizer`` over ``params``; a value the optimizer refuses (torch's "Invalid
    learning rate: -0.1") is a ValueError naming ``model.optimizer`` too."""
    try:
        optimizer = factory(params)
    except ValueError as err:
        raise ValueError(f"model.optimizer: {err} (its init_args: lr, betas, ...)") from err
    require(not isinstance(optimizer, torch.optim.LBFGS), "model.optimizer torch.optim.LBFGS "
            "needs a closure that computes the loss again at each of its evaluations, which "
            "a policy-gradient step (one rollout, one loss) cannot give: use AdamW, SGD, ...")
    rates = [float(lr) for g in optimizer.param_groups  # a number, or a one-number tensor
             if isinstance(lr := g.get("lr"), (int, float))
             or torch.is_tensor(lr) and lr.numel() == 1]
    big = [lr for lr in rates if not abs(lr) <= 3.4e38]  # torch's overflow at the first step
    require(not big, f"model.optimizer's lr {big[0] if big else ''!r} is beyond float32's "
            "range (3.4e38), in which the update is computed: lower "
            "model.optimizer.init_args.lr")
    return optimizer


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, schedule: ScheduleSettings,
    factory: Callable[[torch.optim.Optimizer], Any] | None,
) -> torch.optim.lr_scheduler.LRScheduler:
    """The run's learning-rate scheduler, stepped once per optimizer step: ``factory``
    (``model.lr_scheduler``, e.g. ``CosineAnnealingLR``) or a constant rate, preceded with
    ``lr_warmup_steps = W > 1`` by ``LinearLR`` from ``lr / W`` to ``lr`` over W steps
    (step t uses ``lr * (t + 1) / W``; ``SequentialLR``)."""
    sched = torch.optim.lr_scheduler
    W = schedule.lr_warmup_steps
    if factory is not None:
        main = factory(optimizer)
        require(isinstance(main, sched.LRScheduler) and not isinstance(
            main, sched.ReduceLROnPlateau),
            "model.lr_scheduler must build a torch.optim.lr_scheduler.LRScheduler stepped "
            f"once per optimizer step (not ReduceLROnPlateau); got {type(main).__name__}")
        _check_first_step(factory, optimizer)
    else:
        main = sched.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if W <= 1:
        return main
    warmup = sched.LinearLR(optimizer, start_factor=1.0 / W, end_factor=1.0, total_iters=W - 1)
    return sched.SequentialLR(optimizer, [warmup, main], milestones=[W])


def check_resumed_schedule(saved: dict[str, Any], schedule: ScheduleSettings,
                           factory: Callable[[torch.optim.Optimizer], Any] | None) -> None:
    """Refuse a resume whose learning-rate schedule (``model.lr_scheduler`` and
    ``model.lr_warmup_steps``) is built of other schedulers than the checkpoint's state
    ``saved``: loaded into another class, that state crashed (``KeyError: '_schedulers'``)
    or held the rate where it was for the rest of the run, without a word; and one whose
    warm-up has another length (the checkpoint's went on, the config's was logged)."""
    def shape(state: dict[str, Any]) -> tuple[Any, ...]:  # the public keys name the class
        return (tuple(sorted(k for k in state if not k.startswith("_") and k != "verbose")),
                tuple(shape(s) for s in state.get("_schedulers", ())))  # (torch adds others)

    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        built = build_lr_scheduler(probe, schedule, factory).state_dict()
    except Exception:  # noqa: BLE001 -- a factory for the real optimizer only: not checked
        return
    if shape(built) != shape(saved):
        raise ValueError(
            "the checkpoint's learning-rate schedule is built of other schedulers than this "
            f"run's (model.lr_scheduler {type(factory(probe)).__name__ if factory else None}, "
            f"model.lr_warmup_steps {schedule.lr_warmup_steps}): a resume continues the "
            "checkpoint's schedule, and this one cannot take its state; resume with the "
            "model.lr_scheduler and lr_warmup_steps the checkpoint was trained with (its "
            "config.yaml), or start afresh")
    saved_w, built_w = ((state.get("_milestones") or [None])[0] for state in (saved, built))
    if schedule.lr_warmup_steps > 1 and saved_w != built_w:  # (not a SequentialLR's own)
        # loaded, the checkpoint's length went on, while the config's
        raise ValueError(  # was logged (train/lr_warmup) and saved (config.yaml)
            f"the checkpoint's learning-rate warm-up is {saved_w} steps, this run's "
            f"model.lr_warmup_steps {schedule.lr_warmup_steps}: a resume continues the "
            f"checkpoint's schedule; resume with model.lr_warmup_steps {saved_w}, or start "
            "afresh")


def _check_first_step(factory: Callable[[torch.optim.Optimizer], Any],
                      optimizer: torch.optim.Optimizer) -> None:
    """Step a copy of ``model.lr_scheduler`` once on a throwaway optimizer, so that options
    it cannot step with (``T_max: 0``, ``step_size: 0``) fail before training, naming the
    option, not inside torch after the first update."""
    group = optimizer.param_groups[0]
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)],
                            lr=group.get("initial_lr", group["lr"]))
    scheduler = factory(probe)
    try:
        probe.step()
        scheduler.step()
    except Exception as err:  # noqa: BLE001 - any failure is the option's
        raise ValueError(f"model.lr_scheduler ({type(scheduler).__name__}) cannot take its "
                         f"first step: {type(err).__name__}: {err}") from err


def warn_unended_cosine(trainer: Any, steps: int) -> None:
    """Warn when the fit's cosine learning-rate schedule (after its warm-up) does not end
    with the run's ``steps`` optimizer steps (``trainer.max_steps``, or fewer when
    ``max_epochs`` ends it first; -1: unknown), naming the ``T_max`` that does: the shipped
    configs write it for their own ``max_steps``, which ``--trainer.max_steps`` alone leaves
    as it was. Called when training starts, after a resume has restored the checkpoint's
    schedule (which it keeps: the advice is then to start afresh). A run that ends in its
    warm-up is quiet."""
    configs = getattr(trainer, "lr_scheduler_configs", None) or []
    sched = torch.optim.lr_scheduler
    main, warm = (configs[0].scheduler if configs else None), 0
    if isinstance(main, sched.SequentialLR):  # build_lr_scheduler's warm-up, then the rest
        main, warm = main._schedulers[-1], main._milestones[-1]
    if not isinstance(main, sched.CosineAnnealingLR) or steps <= warm or (
            main.T_max == steps - warm):
        return
    from lightning.pytorch.utilities import rank_zero_warn

    shape = ("rises again after its low" if warm + main.T_max < steps
             else "stops short of eta_min")
    advice = ("a resume keeps the checkpoint's schedule (start afresh to change it)"
              if trainer.ckpt_path else
              f"set --model.lr_scheduler.init_args.T_max {steps - warm} to end with the run")
    length = (f"trainer.max_steps is {steps}" if steps == trainer.max_steps else
              f"the run is {steps} steps (trainer.max_epochs {trainer.max_epochs})")
    rank_zero_warn(f"model.lr_scheduler: the cosine ends after {warm} + {main.T_max} steps "
                   f"(lr_warmup_steps + T_max) while {length}, so the "
                   f"learning rate {shape}; {advice}")



#: Options whose change at a resume changes nothing the run computes (paths to caches), or
#: which are checked apart (the model, whose path the CLI gives the data's tokenizer too).
UNCHECKED_OPTIONS = frozenset({"_instantiator", "model_name_or_path", "model_cache_dir",
                               "dataset_cache_dir", "tokenizer_cache_dir", "num_workers",
                               "tokenizer"})


def _plain(value: Any) -> bool:
    """Whether ``value`` is plain data (compared by value; an object given in Python is
    another object once loaded from the checkpoint)."""
    if isinstance(value, (list, tuple)):
        return all(map(_plain, value))
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return value is None or isinstance(value, (bool, int, float, str))


def warn_changed_options(checkpoint: dict[str, Any], trainer: Any) -> None:
    """Warn when a resumed fit's ``model.`` or ``data.`` options differ from the
    checkpoint's saved hyper-parameters (another ``num_generations``, ``temperature``,
    ``system_prompt``, ...): it goes on with this run's, which the interrupted run did not
    have. Called once the data module took its state (Lightning restores callbacks after
    it): a change it refuses (another ``data.seed``) is not said to go on. The objective,
    optimizer and schedule, which the hyper-parameters leave out, and the model's path are
    checked by :func:`~maxent_grpo.training.run.checkpoint.load_state`."""
    changed = []
    for group, key, owner in (("model", "hyper_parameters", "lightning_module"),
                              ("data", "datamodule_hyper_parameters", "datamodule")):
        owner = getattr(trainer, owner, None)
        saved, now = checkpoint.get(key) or {}, dict(getattr(owner, "hparams", None) or {})
        unused = getattr(owner, "unused_options", ())  # the data source's: at their default
        changed += [f"{group}.{name} {saved[name]!r} -> {now[name]!r}" for name in sorted(now)
                    if name not in UNCHECKED_OPTIONS and name in saved and saved[name] != now[name]
                    and _plain(saved[name]) and _plain(now[name]) and name not in unused]
    if changed:
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(f"the resumed fit's options differ from the checkpoint's "
                       f"({', '.join(changed)}): it goes on with this run's")


def warn_epoch_bound_validation(trainer: Any, rollouts: int) -> None:
    """Warn when an int ``trainer.val_check_interval`` counts the rollouts of each epoch
    (``check_val_every_n_epoch`` set: Lightning's default 1) in a run of ``rollouts`` (-1:
    unknown) longer than one epoch whose length is not a multiple of it: the count restarts
    at every epoch, so the validation points shift and the run's last steps may see none
    (a 500-step run of 493-step epochs validated at 50..450 only)."""
    every, epochs = trainer.val_check_interval, trainer.check_val_every_n_epoch
    batches = trainer.num_training_batches
    if not isinstance(every, int) or epochs is None or not 0 < batches < float("inf") or (
            batches % every == 0 or 0 <= rollouts <= batches or not trainer.limit_val_batches):
        return
    from lightning.pytorch.utilities import rank_zero_warn

    rank_zero_warn(f"trainer.val_check_interval {every} counts the rollouts of each epoch "
                   f"(trainer.check_val_every_n_epoch {epochs}), and an epoch has {batches}: "
                   "the count restarts every epoch, so the validation points shift and the "
                   "last steps may go unvalidated; set trainer.check_val_every_n_epoch: null "
                   "to count over the whole run")
