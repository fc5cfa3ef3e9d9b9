"""The LightningModule: ``training_step`` = collect a trajectory, then optimise over it.

One training step (docs/ALGORITHM.md §0-§4), file by file::

    ctx = the step's parts                         # training/step/trajectory.py
    trajectory = collect(ctx, batch)               # training/step/trajectory.py
        rollout   = engine.generate(prompts, G)    #   rollout/ (model.engine)
        rewards   = sum_k w_k R_k(completions)     #   rewards/  -> (B, G)
        ref, old  = frozen log-probs if needed     #   training/step/token_logps.py
        targets   = objective.prepare(inputs)      #   objectives/ (advantages / weights)
    repeat num_iterations times:                   # training/step/optimise.py
        for each micro-batch of whole groups:
            logps = log pi_theta(completion)       #   SequenceScores, with grad
            manual_backward(objective.loss(...))   #   parts sum to the batch loss
        clip gradients; optimizer.step(); scheduler.step()
    log the step                                   # training/step/step_log.py

Optimisation is manual: one rollout may feed several optimizer steps, and the loss is accumulated
over micro-batches that never split a prompt group. ``collect`` and ``optimizer_step`` get a
:class:`~maxent_grpo.training.step.trajectory.StepContext` and never call back into the module. The
engine is built once per run and synced after the weights changed. Elsewhere: evaluation
(``run/evaluation.py``), checkpoints (``run/checkpoint.py``), strategies (``step/strategy.py``),
the typed options (``settings.py``, ``option_groups.py``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from maxent_grpo.adapters import PeftConfig
from maxent_grpo.objectives import GRPO, Objective, check_objective
from maxent_grpo.rewards import TrainerState, WeightedRewards
from maxent_grpo.rollout import EngineFactory, HFGenerateEngine, RolloutEngine
from maxent_grpo.rollout.protocol import check_built_engine, check_engine_factory
from maxent_grpo.training.callbacks.module_own import CleanUp, CompletionWriter, ModuleHooks
from maxent_grpo.training.callbacks.progress import LIGHTNING_DEFAULT_BAR, ReadableProgressBar
from maxent_grpo.training.data.sampler import unfinished_batches
from maxent_grpo.training.option_groups import build_loop_settings
from maxent_grpo.training.run.checkpoint import load_state, save_state, step_start
from maxent_grpo.training.run.evaluation import Evaluator
from maxent_grpo.training.run.policy_models import PolicyModels
from maxent_grpo.training.settings import Dtype, ModelSettings, build_lr_scheduler, build_optimizer
from maxent_grpo.training.step.optimise import (
    NonFiniteLossError,
    StepCounters,
    Update,
    check_low_precision_weights,
    count_update,
    optimizer_step,
)
from maxent_grpo.training.step.pipeline import RolloutPipeline, check_staleness, restore_rollouts
from maxent_grpo.training.step.refill import refill_source
from maxent_grpo.training.step.step_log import LightningWriter, StepMetrics
from maxent_grpo.training.step.strategy import attach_for_fit, check_strategy
from maxent_grpo.training.step.token_logps import Scorer
from maxent_grpo.training.step.trajectory import StepContext, StepTimer, Trajectory, collect
from maxent_grpo.training.types import LoggingConfigView, LogStepArtifacts, RuntimeHandles

__all__ = ["MaxEntGRPOModule", "NonFiniteLossError"]


class MaxEntGRPOModule(PolicyModels, L.LightningModule):
    """GRPO / MaxEnt-GRPO fine-tuning of a causal language model.

    Args:
        model_name_or_path: a hub name (``Qwen/Qwen2.5-0.5B-Instruct``), a local folder,
            or a built-in offline model (``builtin:tiny``, ``builtin:smollm2-135m-instruct``).
        objective: the training objective, chosen with ``class_path``
            (``maxent_grpo.objectives.GRPO``, ``EntropyMaxEnt``, ``ListwiseMaxEnt``,
            ``GroupMaxEnt``); ``None`` means ``GRPO()`` with its defaults.
        rewards: reward -> weight, or -> options ``{weight, timeout, fallback}`` (plus
            ``batch_size``, ``dtype`` for reward models). A reward is a registered name, a
            ``package.module:function`` path (called as TRL's ``GRPOTrainer`` calls reward
            functions) or ``model:<hub name or folder>``, a reward model (docs/REWARDS.md).
            ``None``: ``{accuracy: 1.0}`` (an ``<answer>`` or ``\\boxed{}``; warned).
        engine: the rollout engine, chosen with ``class_path`` and built once per run as
            ``engine(policy, tokenizer, sampling)`` (:mod:`maxent_grpo.rollout`); default
            :class:`~maxent_grpo.rollout.HFGenerateEngine` (``init_args: {share_prefill:
            true}`` runs each prompt's prefill once for its G samples).
        num_generations: ``G``, completions sampled per prompt (>= 2).
        max_completion_length: ``T_max``, maximum new tokens per completion.
        max_prompt_length: prompts are left-truncated to this many tokens (linked from
            ``data.max_prompt_length``).
        temperature: sampling temperature (1e-5 to 3.4e38); log-probs are computed at it.
        top_p: nucleus sampling threshold in (0, 1].
        top_k: top-k sampling (0 = off).
        num_iterations: optimizer steps on each rollout (>= 1; behaviour log-probs if > 1).
        micro_batch_groups: at most this many prompt groups per micro-batch (``None`` = no
            limit); micro-batches hold whole groups
            (:func:`~maxent_grpo.training.step.token_logps.plan_micro_batches`).
        micro_batch_tokens: at most this many padded tokens per micro-batch (``None`` = no
            limit); the update depends on neither (but see docs/ALGORITHM.md §7).
        mask_truncated_completions: zero the mask of completions that hit
            ``max_completion_length`` without EOS.
        drop_constant_groups: leave the prompt groups whose G rewards are all equal out of
            the update. DAPO's dynamic sampling (docs/ALGORITHM.md §7); losses normalised
            over the groups kept on all ranks; ``train/dropped_groups``.
        refill_rounds: with ``drop_constant_groups``, draw ``data.batch_size`` new prompts
            up to this many times per step while fewer than that many groups have rewards
            that differ. DAPO's dynamic sampling with refill (``train/refill_rounds``;
            :mod:`~maxent_grpo.training.step.refill`); needs the PromptDataModule.
        solved_reward: with ``drop_constant_groups``, keep the constant groups whose G
            rewards are all at least this value (solved; ALGORITHM §7). ``None``: none.
        sampler_correction: correct the clipped surrogate for an engine that samples from a
            slightly different distribution than the trainer scores (vLLM in bf16, other
            kernels): per-token (``token_*``) or per-sequence (``sequence_*``) importance
            weights ``pi / pi_sampler``, truncated at the cap (``*_tis``) or masked above it
            (``*_mis``; docs/ALGORITHM.md §2). Needs an engine that reports its log-probs
            (the vLLM engines, ``HFGenerateEngine`` on a ``generation_dtype`` copy) and an
            objective with the clipped surrogate (GRPO, EntropyMaxEnt, GroupMaxEnt).
            ``None`` = off.
        sampler_correction_cap: the cap ``C`` of those weights (> 0).
        max_staleness: how many optimizer steps old the rollout's weights may be (``k``).
            0 = each step trains on the rollout of its own batch; ``k >= 1`` = asynchronous:
            step ``t`` trains on the rollout of batch ``t - k``, generated meanwhile
            (:mod:`~maxent_grpo.training.step.pipeline`; ``train/rollout/staleness``). Needs an
            engine that generates elsewhere (``VLLMServerEngine``) and
            ``sampler_correction`` (docs/ALGORITHM.md §2, "Stale rollouts").
        tools: tools the model may call (``package.module:function``, ``calculate``, ``python``):
            multi-turn rollouts, tool messages out of the loss
            (:mod:`maxent_grpo.rollout.multiturn`; linked to ``data.tools``). ``None``: off.
        environment: instead, ``{class_path, init_args}`` (or the class path) of an
            environment: ``reset(prompt, answer)``, ``step(action) -> (observation, done)``.
        max_tool_calls: the most tool calls (or environment steps) per sample.
        tool_timeout: the seconds one tool call (or environment step) may take.
        tool_isolation: ``thread`` or ``process`` (each tool call in a fresh sandboxed
            process, killed at the limit: :mod:`~maxent_grpo.rollout.sandbox`; tools only).
        gradient_clip_val: maximum global gradient norm (``None`` = no clipping).
        optimizer: optimizer factory (``class_path`` + ``init_args``); AdamW by default.
        lr_scheduler: learning-rate scheduler factory (any ``torch.optim.lr_scheduler``
            class, e.g. ``CosineAnnealingLR``), stepped once per optimizer step and
            checkpointed; it takes over after the warm-up. ``None`` = constant after it.
        lr_warmup_steps: linear warm-up steps of the learning rate (step t of the warm-up
            uses ``lr * (t + 1) / lr_warmup_steps``).
        dtype: parameter dtype of the policy and reference.
        gradient_checkpointing: trade compute for memory in the policy forward.
        fused_lm_head: the LM head fused into the log-softmax, so the ``(n, T, V)`` logits
            never exist (:mod:`maxent_grpo.training.step.token_logps`). ``None``: on CUDA for
            models that qualify; ``true``: required; ``false``: never.
        peft: train ``peft`` adapters instead of all weights (``class_path: peft.LoraConfig``
            with ``r``, ``lora_alpha``, ``target_modules``; :mod:`maxent_grpo.adapters`):
            the base weights are frozen and the reference is the policy with its adapters
            disabled (no second copy). ``None`` = full fine-tuning.
        model_cache_dir: where built-in models are materialised (None: the default).
        max_consecutive_nonfinite: stop after this many skipped (non-finite) updates in a row.
        eval_num_generations: ``n``, samples per prompt in validation, test and predict.
        eval_reward: the reward (a key of ``rewards``) whose value decides whether an
            evaluation sample is correct; ``None`` = the first of ``rewards``.
        eval_correct_threshold: a sample is correct when its ``eval_reward`` is >= this.
        eval_k: the ``k`` of pass@k / mean@k / distinct@k / coverage@k, each in
            ``[1, eval_num_generations]``; ``None`` = ``[1]``.
        eval_greedy: also decode one greedy completion per prompt (``greedy_pass@1``).
    """

    def __init__(
        self,
        model_name_or_path: str = "builtin:tiny",
        objective: Objective | None = None,
        rewards: dict[str, float | dict[str, Any]] | None = None,
        engine: EngineFactory = HFGenerateEngine,
        num_generations: int = 8,
        max_completion_length: int = 16,
        max_prompt_length: int | None = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        num_iterations: int = 1,
        micro_batch_groups: int | None = None,
        micro_batch_tokens: int | None = None,
        mask_truncated_completions: bool = False,
        drop_constant_groups: bool = False,
        refill_rounds: int = 0,
        solved_reward: float | None = None,
        sampler_correction: Literal["token_tis", "token_mis", "sequence_tis",
                                    "sequence_mis"] | None = None,
        sampler_correction_cap: float = 2.0,
        max_staleness: int = 0,
        tools: list[str] | None = None,
        environment: dict[str, Any] | str | None = None,
        max_tool_calls: int = 4,
        tool_timeout: float = 10.0,
        tool_isolation: Literal["thread", "process"] = "thread",
        gradient_clip_val: float | None = 1.0,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = None,
        lr_warmup_steps: int = 0,
        dtype: Dtype = "float32",
        gradient_checkpointing: bool = False,
        fused_lm_head: bool | None = None,
        peft: PeftConfig | None = None,
        model_cache_dir: str | None = None,
        max_consecutive_nonfinite: int = 3,
        eval_num_generations: int = 4,
        eval_reward: str | None = None,
        eval_correct_threshold: float = 1.0,
        eval_k: list[int] | None = None,
        eval_greedy: bool = True,
    ) -> None:
        options = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__()
        self.automatic_optimization = False
        objective = GRPO() if objective is None else objective
        check_objective(objective)
        check_engine_factory(engine)
        check_staleness(max_staleness, sampler_correction, environment, objective, engine)
        self.rewards = WeightedRewards(  # reward models run on the step's device
            {"accuracy": 1.0} if rewards is None else rewards, max_completion_length)
        self.loop = build_loop_settings(options, self.rewards.names)
        objective.check_group_size(self.loop.generation.num_generations)
        # max_prompt_length: saved by the DataModule (the CLI links it), not twice (Lightning
        # refuses two differing values)
        self.save_hyperparameters(ignore=["objective", "optimizer", "lr_scheduler", "engine",
                                          "max_prompt_length", "peft"])
        self.source = ModelSettings(model_name_or_path, dtype, model_cache_dir,
                                    gradient_checkpointing, peft)
        self.objective, self.engine_factory = objective, engine
        self._objective_start = objective.state_dict()  # as the config set it (checkpoints)
        self.optimizer_factory, self.lr_scheduler_factory = optimizer, lr_scheduler
        self.scorer = Scorer(temperature, self.loop.scoring, fused_lm_head)
        self.step_metrics = StepMetrics(self.rewards.names, self.loop.evaluation)
        self.evaluator = Evaluator(self.rewards, self.loop.evaluation)
        self.logging_view = LoggingConfigView(weighting=objective, clipping=gradient_clip_val,
                                              schedule=self.loop.optimization.schedule)
        self.writer, self.counters = LightningWriter(self), StepCounters()
        self.policy: torch.nn.Module | None = None
        self.tokenizer: Any = None
        self.runtime: RuntimeHandles | None = None  # the job-long handles: configure_model
        self._reference_required = False  # a controller may raise beta (require_reference)
        #: the last step's trajectory, its record and the logged dict the callbacks read
        self.trajectory: Trajectory | None = None
        self.step_log: LogStepArtifacts | None = None
        self.step_metrics_dict: dict[str, float] = {}
        self._engine: RolloutEngine | None = None  # built once, on the first rollout
        # +1 at every change of the policy's weights; the weights the engine last synced with
        self._weights_version = self._engine_version = 0
        self.sync_seconds = 0.0  # engine.sync since the last step logged (perf/sync_seconds)
        self._rng_to_restore = self._step_start = None  # on_load_checkpoint's, this step's
        self.pipeline = (RolloutPipeline(max_staleness, self.loop.generation)  # the rollouts in
                         if max_staleness else None)  # flight (model.max_staleness >= 1)
        self.staleness = 0  # optimizer steps between the rollout's weights and the update
        self._progress = (self.loop.optimization.schedule.num_iterations, max_staleness)  # k, s

    # ------------------------------------------------------------------ the step
    def training_step(self, batch: dict, batch_idx: int) -> None:
        """One rollout, then ``num_iterations`` optimizer steps on it (the module docstring;
        after a stop between them, those left to its next multiple); logged; observed."""
        timer = StepTimer(self.runtime.device)
        if self.pipeline is not None:  # asynchronous: train on the rollout of batch t - k
            step = self.pipeline.next(self.step_context, batch, self.global_step,
                                      self.runtime.device)
            if step is None:  # the first k steps only start rollouts
                return
            ctx, batch, self.staleness = step
        else:
            ctx = self.step_context()
        self.trajectory = trajectory = collect(ctx, batch, timer)
        schedule, updates = self.loop.optimization.schedule, []
        for i in range(schedule.num_iterations - self.global_step % schedule.num_iterations):
            updates.append(update := optimizer_step(ctx, trajectory, self.step_metrics, timer,
                                                    first=i == 0))
            count_update(self.counters, update, self._trainer,
                         schedule.max_consecutive_nonfinite)
            self._weights_version += not update.skipped
        self._log_step(trajectory, updates, timer, batch_idx)
        if trajectory.kept_groups:  # the entropy gate reads train/kl, which an empty step lacks
            self.objective.observe(self.step_metrics_dict)

    @property
    def needs_reference(self) -> bool:
        """Whether the objective (or a controller that may raise beta) needs the reference."""
        return self.objective.needs_reference or self._reference_required

    def step_context(self) -> StepContext:
        """The parts of this step (:class:`~maxent_grpo.training.step.trajectory.StepContext`)."""
        optimizer, scheduler = self.loop.optimization.handles
        schedule = self.loop.optimization.schedule
        return StepContext(
            engine=self.rollout_engine(), rewards=self.rewards, scorer=self.scorer,
            objective=self.objective, policy=self.policy,
            reference=self.runtime.reference_model if self.needs_reference else None,
            generation=self.loop.generation, schedule=schedule,
            strategy=self.runtime.accelerator, backward=self.manual_backward,
            optimizer=optimizer, scheduler=scheduler, step=self.global_step,
            refill=refill_source(self.trainer) if self.loop.generation.refill_rounds else None,
            trainer_state=TrainerState.from_trainer(self._trainer, *self._progress))

    def _log_step(self, trajectory: Trajectory, updates: list[Update], timer: StepTimer,
                  batch_idx: int) -> None:
        """Count, record (``step_log``) and log the step (``train/...``, progress bar)."""
        self.counters.empty_steps += trajectory.kept_groups == 0
        self.step_metrics.observe(trajectory, self.objective)
        rollout = trajectory.rollout
        extra = {f"perf/{k}": v for k, v in timer.summary(int(rollout.model_mask.sum())).items()}
        extra["perf/sync_seconds"], self.sync_seconds = self.sync_seconds, 0.0
        if self.pipeline is not None:
            extra["rollout/staleness"] = float(self.staleness)
        if (sent := getattr(self._engine, "sync_bytes", None)) is not None:  # server engine
            extra["perf/sync_bytes"] = float(sent)
        extra["nonfinite_skips"] = float(self.counters.nonfinite_total)
        if self.loop.generation.drop_constant_groups:
            extra["dropped_groups"] = float(trajectory.dropped_groups)
            extra["empty_steps"] = float(self.counters.empty_steps)
            extra["refill_rounds"] = float(trajectory.refill_rounds)
        self.step_log = self.step_metrics.artifacts(
            self.logging_view, updates=updates,
            epoch_progress=batch_idx / max(1, self.trainer.num_training_batches),
            latency_ms=1000.0 * rollout.generate_seconds, step=self.global_step, extra=extra)
        self.step_metrics_dict = metrics = self.step_log.as_dict()
        self.writer.log(metrics, self.global_step)
        self.log("reward", metrics["train/reward/mean"], prog_bar=True, logger=False)
        if "train/loss/total" in metrics:
            self.log("loss", metrics["train/loss/total"], prog_bar=True, logger=False)

    def rollout_engine(self) -> RolloutEngine:
        """The run's rollout engine (``model.engine``), built on the first call and synced
        (``engine.sync(policy)``) after the policy's weights changed (a step, a checkpoint)."""
        if self._engine is None:
            gen = self.loop.generation
            self._engine = check_built_engine(self.engine_factory(self.policy, self.tokenizer,
                                                                  gen.sampling))
            if gen.tools is not None:  # multi-turn rollouts (model.tools / environment)
                self._engine = gen.tools.engine(self._engine, self.tokenizer, gen.sampling)
            self._engine_version = self._weights_version
        if self._engine_version != self._weights_version:
            start = time.perf_counter()
            self._engine.sync(self.policy)
            self.sync_seconds += time.perf_counter() - start  # a validation's: the next step's
            self._engine_version = self._weights_version
        return self._engine

    def _evaluate(self, batch: dict, greedy: bool = True) -> list[dict]:
        sampling = dataclasses.replace(self.loop.generation.sampling, do_sample=False)
        return self.evaluator.step(batch, self.rollout_engine(), sampling if greedy else None,
                                   TrainerState.from_trainer(self._trainer, *self._progress))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.step_log, self.trajectory, self.step_metrics_dict = None, None, {}  # freed first
        self.check_reference()  # after the callbacks' hooks: one may have raised beta

    def at_batch_start(self) -> None:
        """At a training batch's start (``ModuleHooks``): :func:`step_start`."""
        self._step_start, self._rng_to_restore = step_start(self._rng_to_restore,
                                                            self._trainer), None
        if self.pipeline is not None:  # a step cut short before its rollout saves the queue
            self.pipeline.at_step_start = None

    def on_validation_start(self) -> None:
        if self.pipeline is not None:  # no weight update while a rollout is in flight
            self.pipeline.wait(raise_failure=False)  # the next step raises a failure

    def teardown(self, stage: str) -> None:
        """After any stage (a failed run too: ``CleanUp``): server engine, rollout in flight and
        tools' sandbox closed, a fit's optimizer handles dropped (unpicklable); controllers stay."""
        self.loop = self.loop.with_handles(None, None) if stage == "fit" else self.loop
        engine, toolbox = self._engine, getattr(self._engine, "toolbox", None)
        close = getattr(getattr(engine, "engine", engine), "close", None)
        try:
            if close is not None:
                self._engine = None  # the next run builds a new one
                close()
        finally:
            if self.pipeline is not None:
                self.pipeline.close()
            if toolbox is not None:
                toolbox.close()

    # ------------------------------------------------------------------ evaluation
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._evaluate(batch)

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.evaluator.compute("test" if getattr(self._trainer, "testing", False)
                                             else "val"))

    test_step, on_test_epoch_end = validation_step, on_validation_epoch_end

    def predict_step(self, batch: dict, batch_idx: int) -> list[dict]:
        """One graded row per completion (``CompletionWriter`` writes and sums them up)."""
        return self._evaluate(batch, greedy=False)

    def _attach(self, trainer: L.Trainer | None) -> None:
        """``fit`` attaches the trainer before Lightning checks its flags: ours come first
        (:func:`~maxent_grpo.training.step.strategy.attach_for_fit`)."""
        attach_for_fit(trainer, self.loop.optimization.schedule)
        L.LightningModule.trainer.fset(self, trainer)

    trainer = property(L.LightningModule.trainer.fget, _attach)

    def setup(self, stage: str) -> None:
        """Check the strategy, and an asynchronous fit's engine (it must generate elsewhere)."""
        check_strategy(self.trainer.strategy, self.loop.optimization.schedule.gradient_clip_val,
                       self.scorer.batching if stage == "fit" else None)
        check_engine_factory(self.engine_factory, self.pipeline and stage == "fit")

    def on_train_start(self) -> None:
        """Loop settings with Lightning's optimizer and scheduler; the loader to the handles."""
        self.loop = self.loop.with_handles(self.optimizers(), self.lr_schedulers())
        self.attach_training_data()

    def configure_callbacks(self) -> list[L.Callback]:
        """:class:`ModuleHooks` before the user's callbacks, :class:`CleanUp` after them;
        Lightning's default progress bar gives way to the command line's, for L.Trainer;
        ``predict`` gets a :class:`CompletionWriter` unless the trainer has one."""
        callbacks = self.trainer.callbacks
        bars = [c for c in callbacks if type(c) is LIGHTNING_DEFAULT_BAR]
        callbacks[:] = [ModuleHooks(), *(c for c in callbacks if c not in bars  # an earlier
                                         and not isinstance(c, (ModuleHooks, CleanUp)))]  # run's
        writer = not any(isinstance(c, CompletionWriter) for c in callbacks)
        return [CleanUp(), *([ReadableProgressBar()] if bars else []),
                *([CompletionWriter()] if writer and self.trainer.predicting else [])]

    def configure_optimizers(self) -> dict[str, Any]:
        """``model.optimizer`` over the policy's trainable parameters (only the adapters with
        ``model.peft``; low-precision ones checked), and the learning-rate scheduler (stepped once
        per optimizer step: ``"step"`` for ``LearningRateMonitor``; ``build_lr_scheduler``)."""
        assert self.policy is not None, "configure_model() must run before the optimizer"
        optimizer = build_optimizer(self.optimizer_factory, params := self.trainable_parameters())
        check_low_precision_weights(params, optimizer, self.trainer.strategy)
        scheduler = build_lr_scheduler(optimizer, self.loop.optimization.schedule,
                                       self.lr_scheduler_factory)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler,
                                                         "interval": "step"}}

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add the objective's state, the counters and every rank's random state
        (:mod:`maxent_grpo.training.run.checkpoint`)."""
        cut = unfinished_batches(self._trainer) > 0  # a step cut short runs again at the resume
        save_state(checkpoint, self.source.name_or_path, self.objective, self.counters,
                   self.loop, peft=self.source.peft, cut_short=self._step_start if cut else None,
                   start=self._objective_start)
        if self.pipeline is not None:  # every rank's rollouts in flight, for the resume
            self.pipeline.save(checkpoint, step_cut_short=cut)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Check and restore :meth:`on_save_checkpoint`'s state (random state: 1st batch)."""
        self._rng_to_restore = load_state(
            checkpoint, self.source.name_or_path, self.objective, self.counters, self.loop,
            peft=self.source.peft, trainer=self._trainer, optimizer=self.optimizer_factory,
            reference=self.needs_reference, scheduler=self.lr_scheduler_factory)
        self._weights_version += 1  # the engine syncs with the loaded weights
        if self._trainer is not None:
            restore_rollouts(self.pipeline, checkpoint, self.trainer.state.fn == "fit",
                             self.global_rank, self.trainer.world_size)
