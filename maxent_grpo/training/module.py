"""The LightningModule: ``training_step`` = rollout -> rewards -> objective -> loss.

Read top to bottom, one optimizer step does (ALGORITHM §0-§4)::

    rollout   = engine.generate(prompts, G)                # no grad, eval mode
    rewards   = sum_k w_k R_k(prompt, completion)          # (B, G)
    ref       = log pi_ref(completion)  if needed          # (B*G, T), no grad
    old       = log pi_old(completion)  if num_iterations>1 # (B*G, T), no grad
    targets   = objective.prepare(rewards, lengths, rho)   # advantages / weights
    repeat num_iterations times:
        for each micro-batch of whole groups:
            logps = log pi_theta(completion)               # (n, T), with grad
            manual_backward(objective.loss(micro-batch))   # parts sum to the batch loss
        clip gradients; optimizer.step(); scheduler.step()

Optimisation is manual (``automatic_optimization = False``) because one rollout may feed
several optimizer steps and the loss is accumulated over micro-batches that never split
a prompt group.

Checkpoints: besides what Lightning saves (weights, optimizer, scheduler, loops, callback
and DataModule states), ``on_save_checkpoint`` adds the objective's mutable state (tau,
beta, the entropy gate's multiplier), the non-finite counters and every rank's random
state, so ``fit --ckpt_path last`` continues exactly as if the run had never stopped.
"""

from __future__ import annotations

import logging
import math
import random
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from maxent_grpo.core import (
    constant_groups,
    distinct_candidates,
    selective_log_softmax,
    selective_log_softmax_with_entropy,
)
from maxent_grpo.models import load_policy, load_reference, load_tokenizer, resolve_model_path
from maxent_grpo.objectives import GRPO, MicroBatch, Objective, Targets, sequence_ref_loglik
from maxent_grpo.rewards import get_reward, score_completions
from maxent_grpo.rollout import HFGenerateEngine, RolloutOutput
from maxent_grpo.training.batching import MicroBatchPlan, plan_micro_batches
from maxent_grpo.training.evaluation import PromptRecord, evaluation_metrics, sample_answer
from maxent_grpo.training.metrics import RewardComponents, RewardMoments, TokenMean, TokenUsage
from maxent_grpo.training.timing import StepTimer
from maxent_grpo.training.types import (
    LogStepArtifacts,
    LossScalarBundle,
    SequenceScores,
    TrainingScalarStats,
)

log = logging.getLogger(__name__)

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


def warmup_cosine(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine/linear/constant decay
    to ``min_ratio`` at ``total`` steps."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def resolve_reward(name: str) -> Callable[..., list]:
    """A registered reward name or an import path ``package.module:function``."""
    try:
        return get_reward(name)
    except ValueError as err:
        raise ValueError(f"model.rewards: {err}") from err


#: Key of this module's own entry in a Lightning checkpoint.
CHECKPOINT_KEY = "maxent_grpo"


def capture_rng_state() -> dict[str, Any]:
    """This process's random state: torch CPU (and CUDA when initialised), python, numpy.

    Lightning restores none of these by default. Only plain types and tensors, so the
    checkpoint still loads with ``torch.load(weights_only=True)``.
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        pass
    else:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached))
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


class NonFiniteLossError(RuntimeError):
    """Raised after ``max_consecutive_nonfinite`` skipped updates in a row."""


class MaxEntGRPOModule(L.LightningModule):
    """GRPO / MaxEnt-GRPO fine-tuning of a causal language model.

    Args:
        model_name_or_path: a Hugging Face hub name (``Qwen/Qwen2.5-0.5B-Instruct``), a
            local folder, or a built-in offline model (``builtin:tiny``,
            ``builtin:smollm2-135m-instruct``).
        objective: the training objective, chosen with ``class_path``
            (``maxent_grpo.objectives.GRPO``, ``EntropyMaxEnt``, ``ListwiseMaxEnt``,
            ``GroupMaxEnt``); ``None`` means ``GRPO()`` with its defaults.
        rewards: reward function name (registry) or dotted import path -> weight.
        num_generations: ``G``, completions sampled per prompt (>= 2).
        max_completion_length: ``T_max``, maximum new tokens per completion.
        max_prompt_length: prompts are left-truncated to this many tokens (linked from
            ``data.max_prompt_length``).
        temperature: sampling temperature; log-probs are computed at the same temperature.
        top_p: nucleus sampling threshold in (0, 1].
        top_k: top-k sampling (0 = off).
        num_iterations: optimizer steps taken on each rollout (>= 1); behaviour log-probs
            are computed only when > 1.
        micro_batch_groups: at most this many prompt groups per micro-batch (``None`` = no
            limit).
        micro_batch_tokens: at most this many padded tokens (rows x columns) per
            micro-batch (``None`` = no limit). Micro-batches hold whole groups, packed by
            length and trimmed to the columns they use (:mod:`maxent_grpo.training.batching`);
            the update does not depend on the partition.
        mask_truncated_completions: zero the mask of completions that hit
            ``max_completion_length`` without EOS.
        drop_constant_groups: leave out of the update the prompt groups whose G rewards
            are all equal (DAPO's dynamic sampling, without refilling): they are neither
            scored nor part of the targets, and every loss is normalised over the groups
            kept, on all ranks (``train/dropped_groups`` counts them). GRPO gives such
            groups zero advantage, so for GRPO only the normaliser changes; the listwise
            objective would otherwise pull their completions towards equal probability
            (uniform weights). A step where every group is constant changes no weight but
            still counts as a step (``train/empty_steps`` counts them).
        gradient_clip_val: maximum global gradient norm (``None`` = no clipping).
        optimizer: optimizer factory (``class_path`` + ``init_args``); AdamW by default.
        lr_warmup_steps: linear warm-up steps of the learning rate.
        lr_schedule: decay after warm-up: ``cosine``, ``linear`` or ``constant``.
        min_lr_ratio: final learning rate as a fraction of the initial one.
        dtype: parameter dtype of the policy and reference.
        gradient_checkpointing: trade compute for memory in the policy forward.
        share_prefill: in generation, run each prompt's prefill once for its G samples
            (:class:`~maxent_grpo.rollout.HFGenerateEngine`); same samples, less work.
        model_cache_dir: where built-in models are materialised (default
            ``~/.cache/maxent_grpo/models``).
        max_consecutive_nonfinite: stop the run after this many skipped (non-finite)
            updates in a row.
        eval_num_generations: ``n``, samples per prompt in validation and test.
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
        rewards: dict[str, float] | None = None,
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
        gradient_clip_val: float | None = 1.0,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_warmup_steps: int = 0,
        lr_schedule: Literal["cosine", "linear", "constant"] = "cosine",
        min_lr_ratio: float = 0.0,
        dtype: Dtype = "float32",
        gradient_checkpointing: bool = False,
        share_prefill: bool = True,
        model_cache_dir: str | None = None,
        max_consecutive_nonfinite: int = 3,
        eval_num_generations: int = 4,
        eval_reward: str | None = None,
        eval_correct_threshold: float = 1.0,
        eval_k: list[int] | None = None,
        eval_greedy: bool = True,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        rewards = {"accuracy": 1.0} if rewards is None else dict(rewards)
        objective = GRPO() if objective is None else objective
        eval_k = [1] if eval_k is None else list(eval_k)
        self._validate(
            num_generations=num_generations,
            max_completion_length=max_completion_length,
            num_iterations=num_iterations,
            drop_constant_groups=drop_constant_groups,
            micro_batch_groups=micro_batch_groups,
            micro_batch_tokens=micro_batch_tokens,
            gradient_clip_val=gradient_clip_val,
            lr_warmup_steps=lr_warmup_steps,
            min_lr_ratio=min_lr_ratio,
            max_consecutive_nonfinite=max_consecutive_nonfinite,
            eval_num_generations=eval_num_generations,
            eval_reward=eval_reward,
            eval_correct_threshold=eval_correct_threshold,
            eval_k=eval_k,
            rewards=rewards,
            objective=objective,
        )
        # max_prompt_length belongs to the DataModule's hparams (the CLI links it here);
        # saving it twice makes Lightning refuse differing values in plain-Trainer use
        self.save_hyperparameters(ignore=["objective", "optimizer", "max_prompt_length"])
        self.max_prompt_length = max_prompt_length
        self.objective = objective
        self.optimizer_factory = optimizer
        self.reward_names = list(rewards)
        self.reward_weights = [float(w) for w in rewards.values()]
        self.reward_funcs = [resolve_reward(name) for name in self.reward_names]
        self.policy: torch.nn.Module | None = None
        self.tokenizer = None
        self._frozen: dict[str, Any] = {}  # the reference model, kept out of state_dict
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self.empty_steps = 0  # steps whose every group was dropped (drop_constant_groups)
        self.dropped_groups = 0  # groups dropped in the last step, all ranks
        # per-step metrics, exact across micro-batches and ranks
        self.reward_metric = RewardMoments()
        self.component_metric = RewardComponents(self.reward_names)
        self.token_metric = TokenUsage()
        self.eval_reward = RewardMoments()
        self.eval_components = RewardComponents(self.reward_names)
        #: index in ``reward_names`` of the reward that decides evaluation correctness
        self.eval_reward_index = (
            0 if eval_reward is None else self.reward_names.index(eval_reward)
        )
        self.eval_k = eval_k  # the resolved list (hparams keep the argument as given)
        self.eval_records: list[PromptRecord] = []  # this rank's prompts, this eval epoch
        self.mean_metrics = torch.nn.ModuleDict()
        self._updated: set[str] = set()  # names of mean_metrics updated this step
        #: the last training step's logged record, identical on every rank
        self.step_log: LogStepArtifacts | None = None
        self._lr_used = float("nan")  # learning rate of the last optimizer step
        #: the last training step's rollout and its scores (see ``_rollout_record``)
        self.last_rollout: dict[str, Any] | None = None
        self._rng_to_restore: dict[str, Any] | None = None  # set by on_load_checkpoint

    @staticmethod
    def _validate(**kw: Any) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        G = kw["num_generations"]
        need(G >= 2, f"model.num_generations must be >= 2 (a group needs two samples); got {G}")
        need(kw["max_completion_length"] >= 1,
             f"model.max_completion_length must be >= 1; got {kw['max_completion_length']}")
        need(kw["num_iterations"] >= 1,
             f"model.num_iterations must be >= 1; got {kw['num_iterations']}")
        drop = kw["drop_constant_groups"]
        need(isinstance(drop, bool),
             f"model.drop_constant_groups must be true or false; got {drop!r}")
        mbg = kw["micro_batch_groups"]
        need(mbg is None or mbg >= 1, f"model.micro_batch_groups must be >= 1; got {mbg}")
        mbt = kw["micro_batch_tokens"]
        need(mbt is None or mbt >= 1, f"model.micro_batch_tokens must be >= 1; got {mbt}")
        clip = kw["gradient_clip_val"]
        need(clip is None or clip > 0, f"model.gradient_clip_val must be > 0; got {clip}")
        need(kw["lr_warmup_steps"] >= 0,
             f"model.lr_warmup_steps must be >= 0; got {kw['lr_warmup_steps']}")
        need(0.0 <= kw["min_lr_ratio"] <= 1.0,
             f"model.min_lr_ratio must be in [0, 1]; got {kw['min_lr_ratio']}")
        need(kw["max_consecutive_nonfinite"] >= 1,
             "model.max_consecutive_nonfinite must be >= 1; "
             f"got {kw['max_consecutive_nonfinite']}")
        need(kw["eval_num_generations"] >= 1,
             f"model.eval_num_generations must be >= 1; got {kw['eval_num_generations']}")
        need(len(kw["rewards"]) > 0, "model.rewards must name at least one reward function")
        er = kw["eval_reward"]
        need(er is None or er in kw["rewards"],
             f"model.eval_reward must be None or one of model.rewards {sorted(kw['rewards'])}; "
             f"got {er!r}")
        thr = kw["eval_correct_threshold"]
        need(isinstance(thr, (int, float)) and math.isfinite(thr),
             f"model.eval_correct_threshold must be a finite number; got {thr!r}")
        n = kw["eval_num_generations"]
        ks = kw["eval_k"]
        need(len(ks) > 0 and all(
            isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= n for k in ks
        ), f"model.eval_k must hold ints k with 1 <= k <= model.eval_num_generations ({n}); "
           f"got {ks!r}")
        for name, weight in kw["rewards"].items():
            need(math.isfinite(float(weight)),
                 f"model.rewards: the weight of {name!r} must be finite; got {weight}")
        need(isinstance(kw["objective"], Objective),
             "model.objective must be an Objective (class_path "
             f"maxent_grpo.objectives.GRPO, ...); got {type(kw['objective']).__name__}")

    # ------------------------------------------------------------------ model set-up
    def prepare_data(self) -> None:
        """Materialise a ``builtin:`` model once, on local rank 0, before any rank loads it.

        Under DDP, transformers' ``save_pretrained`` writes weights only on global rank 0,
        so a built-in model first materialised by another rank would lack them.
        """
        resolve_model_path(self.hparams.model_name_or_path, self.hparams.model_cache_dir)

    def setup(self, stage: str) -> None:
        """Refuse strategies this module cannot run exactly (docs/SCALING.md).

        - ``FSDPStrategy`` (FSDP1) runs ``training_step`` inside the root FSDP module's
          forward, and FSDP1 does not support the backward passes this module makes there
          (Lightning issue #19626): use ``ModelParallelStrategy`` (FSDP2), which
          :meth:`configure_model` shards with ``fully_shard``.
        - ``DeepSpeedStrategy`` clips inside the engine (gradients are partitioned):
          ``model.gradient_clip_val`` becomes the DeepSpeed config's ``gradient_clipping``
          (a different value already in that config raises).
        """
        strategy = self.trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, FSDPStrategy):
            raise ValueError(
                "trainer.strategy FSDPStrategy (FSDP1) cannot run MaxEntGRPOModule: its manual "
                "backward passes run inside the root FSDP forward, which FSDP1 does not "
                "support; use class_path lightning.pytorch.strategies.ModelParallelStrategy "
                "with init_args {data_parallel_size: <number of processes>, "
                "tensor_parallel_size: 1} (FSDP2, see configs/scaling/node8_fsdp_*.yaml)"
            )
        if isinstance(strategy, DeepSpeedStrategy):
            clip = float(self.hparams.gradient_clip_val or 0.0)
            config = strategy.config
            if float(config.get("gradient_clipping", clip)) != clip:
                raise ValueError(
                    f"model.gradient_clip_val ({clip}) differs from the DeepSpeed config's "
                    f"gradient_clipping ({config['gradient_clipping']}); set one of them"
                )
            config["gradient_clipping"] = clip

    def configure_model(self) -> None:
        """Load the policy (and the reference when the objective needs it) once.

        Under ``ModelParallelStrategy`` (FSDP2) both are then sharded over the data-parallel
        mesh with ``fully_shard``: each transformer block (the classes in the model's
        ``_no_split_modules``) is one unit, the rest (embeddings, final norm, head) the root
        unit. Tensor parallelism is not supported (``tensor_parallel_size`` must be 1).
        """
        if self.policy is not None:
            return
        hp = self.hparams
        kwargs = dict(dtype=hp.dtype, cache_dir=hp.model_cache_dir)
        self.tokenizer = load_tokenizer(hp.model_name_or_path, cache_dir=hp.model_cache_dir)
        self.policy = load_policy(
            hp.model_name_or_path, gradient_checkpointing=hp.gradient_checkpointing, **kwargs
        )
        self.policy.train()  # from_pretrained returns eval mode; the engine toggles it
        if self.needs_reference:
            self._frozen["ref"] = load_reference(hp.model_name_or_path, **kwargs)
        if self.device_mesh is not None:
            self._fully_shard(self.device_mesh)

    def _fully_shard(self, mesh: Any) -> None:
        """FSDP2-shard the policy and the reference over ``mesh["data_parallel"]``."""
        from torch.distributed.fsdp import fully_shard

        if mesh["tensor_parallel"].size() != 1:
            raise ValueError(
                "ModelParallelStrategy: tensor_parallel_size must be 1 (MaxEntGRPOModule "
                f"shards with FSDP2 only); got {mesh['tensor_parallel'].size()}"
            )
        data_parallel = mesh["data_parallel"]
        for model in (self.policy, self.reference):
            if model is None:
                continue
            blocks = set(getattr(model, "_no_split_modules", None) or ())
            for module in model.modules():
                if type(module).__name__ in blocks:
                    fully_shard(module, mesh=data_parallel)
            fully_shard(model, mesh=data_parallel)

    @property
    def needs_reference(self) -> bool:
        """Whether the objective (or a controller that may raise beta) needs the reference."""
        return bool(self.objective.needs_reference or self._frozen.get("force_reference"))

    def require_reference(self) -> None:
        """Called by controllers that can make beta > 0: load the reference from the start."""
        self._frozen["force_reference"] = True
        if self.policy is not None and "ref" not in self._frozen:
            hp = self.hparams
            self._frozen["ref"] = load_reference(
                hp.model_name_or_path, dtype=hp.dtype, cache_dir=hp.model_cache_dir
            ).to(self.device)

    @property
    def reference(self) -> torch.nn.Module | None:
        return self._frozen.get("ref")

    def on_fit_start(self) -> None:
        if self.reference is not None:
            self.reference.to(self.device)

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add what Lightning does not save itself (under ``checkpoint["maxent_grpo"]``).

        - ``model_name_or_path`` and ``objective_class``: checked on load;
        - ``objective_state``: the objective's mutable attributes
          (:data:`MUTABLE_OBJECTIVE_STATE`: tau, beta, the entropy gate's multiplier);
        - the non-finite update counters;
        - ``rng``: every rank's random state (:func:`capture_rng_state`), one entry per
          rank. Lightning calls this hook on every rank, so the states are gathered here.
        """
        rng = [capture_rng_state()]
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            rng = [None] * dist.get_world_size()
            dist.all_gather_object(rng, capture_rng_state())
        checkpoint[CHECKPOINT_KEY] = {
            "model_name_or_path": self.hparams.model_name_or_path,
            "objective_class": type(self.objective).__name__,
            "objective_state": self.objective.state_dict(),
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "nonfinite_total": self.nonfinite_total,
            "empty_steps": self.empty_steps,
            "rng": rng,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Check the checkpoint fits this run, then restore :meth:`on_save_checkpoint`'s state.

        Raises ValueError naming the option when the checkpoint was made with another
        ``model.model_name_or_path`` or another objective class. The objective's tau / beta /
        gate multiplier and the counters are restored at once (the checkpoint's values win
        over the config's); the random state is restored just before the first training
        batch, so nothing that runs in between (set-up, the sanity check) shifts it.
        """
        saved = checkpoint.get(CHECKPOINT_KEY)
        if not isinstance(saved, dict):
            raise ValueError(
                f"the checkpoint has no {CHECKPOINT_KEY!r} entry: it was not written by "
                "MaxEntGRPOModule.on_save_checkpoint, so the objective's state and the random "
                "state cannot be restored; resume from a checkpoint of this trainer"
            )
        hp = self.hparams
        if saved["model_name_or_path"] != hp.model_name_or_path:
            raise ValueError(
                "the checkpoint was made with model.model_name_or_path="
                f"{saved['model_name_or_path']!r}, but this run has {hp.model_name_or_path!r}"
            )
        name = type(self.objective).__name__
        if saved["objective_class"] != name:
            raise ValueError(
                f"the checkpoint was made with model.objective {saved['objective_class']}, "
                f"but this run has {name}; resume with the same objective class_path"
            )
        self.objective.load_state_dict(saved["objective_state"])
        self.nonfinite_in_a_row = int(saved["nonfinite_in_a_row"])
        self.nonfinite_total = int(saved["nonfinite_total"])
        self.empty_steps = int(saved.get("empty_steps", 0))
        states = saved["rng"]
        dist = torch.distributed
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        rank = dist.get_rank() if distributed else 0
        if len(states) != world:
            rank_zero_warn(
                f"the checkpoint holds the random state of {len(states)} processes, this run "
                f"has {world}: every process continues from process 0's state, so sampling "
                "will not repeat the interrupted run exactly"
            )
            rank = 0
        self._rng_to_restore = states[rank]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.step_log = None
        if self._rng_to_restore is not None:
            restore_rng_state(self._rng_to_restore)
            self._rng_to_restore = None

    def engine(self, do_sample: bool = True) -> HFGenerateEngine:
        """The rollout engine; ``do_sample=False`` decodes greedily (evaluation only)."""
        hp = self.hparams
        return HFGenerateEngine(
            self.policy,
            self.tokenizer,
            max_new_tokens=hp.max_completion_length,
            temperature=hp.temperature,
            top_p=hp.top_p,
            top_k=hp.top_k,
            max_prompt_length=self.max_prompt_length,
            do_sample=do_sample,
            share_prefill=self.hparams.share_prefill,
        )

    def configure_optimizers(self):
        assert self.policy is not None, "configure_model() must run before the optimizer"
        optimizer = self.optimizer_factory(self.policy.parameters())
        hp = self.hparams
        total = int(self.trainer.estimated_stepping_batches) * hp.num_iterations
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: warmup_cosine(
                step, warmup=hp.lr_warmup_steps, total=total,
                schedule=hp.lr_schedule, min_ratio=hp.min_lr_ratio,
            ),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler}}

    # ------------------------------------------------------------------ scoring
    def _forward_logps(
        self, model: torch.nn.Module, input_ids: Tensor, attention: Tensor, T: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Token log-probs ``(n, T)`` of the last ``T`` tokens, and their entropy.

        Only the completion logits are materialised (``logits_to_keep=T+1``); position ids
        follow the left padding exactly as in generation.
        """
        positions = (attention.long().cumsum(-1) - 1).clamp(min=0)
        out = model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions,
            logits_to_keep=T + 1, use_cache=False,
        )
        logits = out.logits[:, :-1, :]  # (n, T, V), a view
        if self.hparams.temperature != 1.0:  # a full (n, T, V) copy: only when it matters
            logits = logits / self.hparams.temperature
        index = input_ids[:, -T:]
        if with_entropy:  # one pass, one (n, T, V) gradient
            return selective_log_softmax_with_entropy(logits, index)
        return selective_log_softmax(logits, index), None  # (n, T)

    def _score(
        self, input_ids: Tensor, attention: Tensor, mask: Tensor, old_logps: Tensor | None
    ) -> tuple[SequenceScores, Tensor | None]:
        """Policy scores of one micro-batch, with gradient: the documented
        :class:`SequenceScores` plus the token entropy when the objective needs it."""
        T = mask.shape[1]
        logps, entropy = self._forward_logps(
            self.policy, input_ids, attention, T, self.objective.needs_entropy
        )
        m = mask.to(logps.dtype)
        cur = (logps.detach() * m).sum(-1)  # (n,)
        behaviour = cur if old_logps is None else (old_logps * m).sum(-1)
        scores = SequenceScores(
            cur_logp_sum=cur,
            behavior_logp_sum=behaviour,
            log_ratio_train=cur - behaviour,
            denom_tok_tensor=m.sum(-1),
            policy_entropy_sum=None if entropy is None else (entropy.detach() * m).sum(-1),
            token_logp=logps,
            token_mask=mask,
            old_token_logp=old_logps,
        )
        return scores, entropy

    @torch.no_grad()
    def _frozen_logps(
        self, model, input_ids: Tensor, attention: Tensor, T: int, chunks: list[MicroBatchPlan]
    ) -> Tensor:
        """Token log-probs ``(B*G, T)`` of a frozen model, micro-batch by micro-batch
        (columns a micro-batch does not keep are padding and hold 0)."""
        P = input_ids.shape[1] - T
        out: Tensor | None = None
        for chunk in chunks:
            rows, cols = chunk.rows, chunk.columns(P)
            logps = self._forward_logps(
                model, input_ids[rows][:, cols], attention[rows][:, cols], chunk.completion_len,
                False,
            )[0]
            if out is None:
                out = logps.new_zeros((input_ids.shape[0], T))
            out[rows, : chunk.completion_len] = logps
        assert out is not None
        return out

    # ------------------------------------------------------------------ the step
    def _rewards(self, batch: dict, rollout: RolloutOutput) -> tuple[Tensor, Tensor]:
        completions = [c for group in rollout.batch.grouped_completions for c in group]
        total, components = self._score_completions(
            batch, completions, self.hparams.num_generations
        )
        return total.to(self.device), components.to(self.device)

    def _prepare_targets(
        self, rewards: Tensor, lengths: Tensor, T_max: int, rho: Tensor | None, keep: Tensor,
        candidates: Tensor | None = None,
    ) -> tuple[Targets, int]:
        """``objective.prepare`` over the kept groups of the optimizer step's whole batch, all
        ranks together; returns this rank's kept groups' targets and the number of groups
        kept on all ranks.

        ``rewards`` and ``lengths`` are this rank's ``(B, G)``; ``keep`` ``(B,)`` marks the
        groups that take part (all of them unless ``drop_constant_groups``) and ``rho`` is
        ``(kept, G)`` or None. With W > 1 ranks every rank's tensors are gathered (every
        rank has the same B: the sampler drops the last partial batch), the kept groups of
        all ``W*B`` are prepared at once and each rank keeps the targets of its own (rank
        ``r``'s kept groups follow those of ranks ``0..r-1``). Per-group advantages and
        weights do not change; ``scale_rewards="batch"`` then divides by the std of all
        kept rewards, and ``targets.stats`` (e.g. ``weight_entropy_min``) describe all kept
        groups, exactly as one process given the same prompts would. ``candidates`` (``(B, G)``
        bool, for objectives that ask for them) travel with the rewards.
        """
        world = self.trainer.world_size
        every = {"rewards": rewards, "lengths": lengths, "keep": keep}
        if candidates is not None:
            every["candidates"] = candidates
        if rho is not None:
            every["rho"] = rho.new_zeros(rewards.shape).index_copy_(0, keep.nonzero()[:, 0], rho)
        start = 0
        if world > 1:
            B = rewards.shape[0]
            every = {k: v.reshape(world * B, -1) for k, v in self.all_gather(every).items()}
            every["keep"] = every["keep"].reshape(-1)
            start = int(every["keep"][: self.trainer.global_rank * B].sum())
        sel = every["keep"]
        kept_total = int(sel.sum()) if self.hparams.drop_constant_groups else sel.numel()
        if kept_total == 0:
            return Targets(), 0
        if kept_total < sel.numel():
            every = {k: v[sel] for k, v in every.items()}
        targets = self.objective.prepare(
            every["rewards"], every["lengths"], T_max, every.get("rho"), every.get("candidates")
        )
        if world == 1:
            return targets, kept_total
        mine = slice(start, start + int(keep.sum()))
        adv, w, cand = targets.advantages, targets.weights, targets.candidates
        G = rewards.shape[1]
        return Targets(
            advantages=None if adv is None else adv.view(kept_total, G)[mine].reshape(-1),
            weights=None if w is None else w[mine],
            stats=targets.stats,
            candidates=None if cand is None else cand[mine],
        ), kept_total

    def _clip_grad_norm(self, max_norm: float) -> Tensor | None:
        """Clip the policy's gradients to global norm ``max_norm``; return that norm (the
        same on every rank), or ``None`` where the strategy clips by itself (DeepSpeed: the
        engine applies its config's ``gradient_clipping`` inside ``step``).

        DDP: after the all-reduce every rank holds the full gradient. FSDP2: gradients are
        DTensor shards, and ``clip_grad_norm_`` reduces their norms over the mesh.
        """
        if isinstance(self.trainer.strategy, DeepSpeedStrategy):
            return None
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def training_step(self, batch: dict, batch_idx: int) -> None:
        hp = self.hparams
        G, T_max = hp.num_generations, hp.max_completion_length
        opt = self.optimizers()
        sched = self.lr_schedulers()

        # 1. rollout (no grad, eval mode; the engine restores train mode)
        timer = StepTimer(self.device)
        rollout = self.engine().generate(batch["prompts"], batch["answers"], G)
        B = len(batch["prompts"])
        full_mask = rollout.completion_mask.clone()  # (B*G, T) bool
        if hp.mask_truncated_completions:
            full_mask &= ~rollout.truncated[:, None]

        # 2. rewards
        timer.start()
        rewards, components = self._rewards(batch, rollout)  # (B*G,), (K, B*G)
        timer.stop("reward")
        rewards = rewards.view(B, G)
        lengths = full_mask.sum(-1).view(B, G).to(rewards.dtype)

        # 3. the groups that take part (drop_constant_groups) and their rows
        keep = torch.ones(B, dtype=torch.bool, device=rewards.device)
        rows: Tensor | slice = slice(None)  # all rows, as views
        # a rank that keeps no group scores its first group at weight zero ("ghost"), so
        # that every rank makes the same backward passes and logs the same metrics
        ghost = False
        if hp.drop_constant_groups:
            keep = ~constant_groups(rewards)  # (B,) some reward differs
            ghost = self.trainer.world_size > 1 and not bool(keep.any())
            scored = keep.clone()
            scored[0] |= ghost
            rows = scored.repeat_interleave(G)  # (B*G,)
        prompt_ids, prompt_mask = rollout.prompt_ids[rows], rollout.prompt_mask[rows]
        completion_ids, mask = rollout.completion_ids[rows], full_mask[rows]
        input_ids = torch.cat([prompt_ids, completion_ids], 1)
        attention = torch.cat([prompt_mask, rollout.completion_mask[rows]], 1).long()
        T, P = completion_ids.shape[1], prompt_ids.shape[1]
        n_rows = 0 if ghost else input_ids.shape[0]  # this rank's kept rows

        # 4. frozen log-probs: reference only when needed, behaviour only when reused
        chunks = plan_micro_batches(
            prompt_mask, rollout.completion_mask[rows], G,
            hp.micro_batch_groups, hp.micro_batch_tokens,
        ) if input_ids.shape[0] else []
        if len(chunks) > 1 and isinstance(self.trainer.strategy, DeepSpeedStrategy):
            # ZeRO-2 with gradient_accumulation_steps=1 keeps only the last backward's
            # gradient when several backward passes precede one engine step
            raise ValueError(
                f"model.micro_batch_groups ({hp.micro_batch_groups}) / "
                f"model.micro_batch_tokens ({hp.micro_batch_tokens}) split the batch of {B} "
                "prompts into several backward passes, which DeepSpeed does not accumulate "
                "here; set both to null under DeepSpeedStrategy"
            )
        ref_logps = old_logps = rho = None
        timer.start()
        if self.needs_reference and chunks:
            ref_logps = self._frozen_logps(self.reference, input_ids, attention, T, chunks)
            rho = sequence_ref_loglik(ref_logps, mask, G)[: n_rows // G]  # (kept, G)
            self._mean_metric("logp/ref_token").update(
                ref_logps, torch.zeros_like(mask) if ghost else mask
            )
        if hp.num_iterations > 1 and chunks:
            old_logps = self._frozen_logps(self.policy, input_ids, attention, T, chunks)
        timer.stop("frozen")

        # 5. advantages / weights (constants), over the kept groups of all ranks
        candidates = None
        if self.objective.needs_candidates:  # the first occurrence of each distinct completion
            candidates = torch.ones_like(rewards, dtype=torch.bool)  # (B, G)
            candidates[keep] = distinct_candidates(completion_ids, mask, G)[: n_rows // G]
        targets, kept_groups = self._prepare_targets(
            rewards, lengths, T_max, rho, keep, candidates
        )
        self.last_rollout = self._rollout_record(
            batch, rollout, rewards, components, targets, keep
        )
        if ghost:  # neutral targets for the ghost group (its loss is multiplied by 0)
            targets = Targets(
                advantages=rewards.new_zeros(G), weights=rewards.new_full((1, G), 1.0 / G),
                stats=targets.stats, candidates=torch.ones(1, G, dtype=torch.bool,
                                                           device=rewards.device),
            )
        world = self.trainer.world_size
        self.dropped_groups = world * B - kept_groups

        # 6. optimise
        num_tokens = mask.sum() * (not ghost)
        global_tokens = self.all_gather(num_tokens).sum() if world > 1 else num_tokens
        loss_scale = 0.0 if ghost else self.objective.loss_scale(world, n_rows, kept_groups * G)
        # statistics stay on the device; one host sync per optimizer step (the finite check)
        zero = torch.zeros((), device=self.device)
        sums: dict[str, list[Tensor]] = defaultdict(lambda: [zero, zero])
        grad_norm = None
        self.empty_steps += kept_groups == 0
        for _ in range(hp.num_iterations):
            if kept_groups == 0:  # every group of every rank is constant: no gradient at all,
                opt.step()  # but the step counts (parameters without a gradient stay put)
                sched.step()
                continue
            losses_finite = torch.ones((), dtype=torch.bool, device=self.device)
            for chunk in chunks:
                timer.start()
                rows, cols, Tc = chunk.rows, chunk.columns(P), chunk.completion_len
                scores, entropy = self._score(
                    input_ids[rows][:, cols], attention[rows][:, cols], mask[rows][:, :Tc],
                    None if old_logps is None else old_logps[rows][:, :Tc],
                )
                w = targets.weights
                mb = MicroBatch(
                    token_logps=scores.token_logp,
                    old_token_logps=scores.old_token_logp,
                    ref_token_logps=None if ref_logps is None else ref_logps[rows][:, :Tc],
                    mask=scores.token_mask,
                    entropy=entropy,
                    advantages=None if targets.advantages is None else targets.advantages[rows],
                    weights=None if w is None else w[chunk.groups],
                    candidates=None if targets.candidates is None
                    else targets.candidates[chunk.groups],
                    group_size=G,
                    num_rows=input_ids.shape[0],
                    num_micro_batches=len(chunks),
                    max_completion_length=T_max,
                    num_global_tokens=global_tokens,
                )
                out = self.objective.loss(mb)
                losses_finite &= torch.isfinite(out.loss)
                timer.stop("forward")
                self.manual_backward(out.loss * loss_scale)
                timer.stop("backward")
                # parts sum to the step's loss: count 1/len(chunks) each -> mean over passes
                # and ranks (parts are scaled like their gradient: their mean over the ranks
                # is then the loss of the whole batch)
                out.sums["loss/total"] = (
                    out.loss.detach() * loss_scale, torch.tensor(1.0 / len(chunks))
                )
                out.sums["logp/sequence"] = (
                    scores.cur_logp_sum.detach().sum(), torch.tensor(float(scores.num_sequences))
                )
                for key, (value, count) in out.sums.items():
                    part = 0.0 if ghost and key != "loss/total" else 1.0  # keys, not values
                    sums[key][0] = sums[key][0] + part * value.detach().float().to(self.device)
                    sums[key][1] = sums[key][1] + part * torch.as_tensor(count).float().to(
                        self.device)
            timer.start()
            grad_norm = self._clip_grad_norm(hp.gradient_clip_val or float("inf"))
            finite = losses_finite if grad_norm is None else losses_finite & torch.isfinite(
                grad_norm
            )
            # a non-finite loss or gradient on any rank skips the whole update on every rank
            # (grads are zeroed), so the replicas never diverge
            if not self.trainer.strategy.reduce_boolean_decision(bool(finite), all=True):
                grad_norm = None
                self._skip_update(opt)
                continue
            self.nonfinite_in_a_row = 0
            self._lr_used = opt.param_groups[0]["lr"]  # the rate of this update (logged)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            timer.stop("optimizer")

        # 7. metrics, through the documented types
        self.reward_metric.update(rewards)
        self.component_metric.update(components)
        self.token_metric.update(rollout.prompt_mask, full_mask, rollout.truncated)
        for key, (value, count) in sums.items():
            self._mean_metric(key).update_sum(value.to(self.device), count.to(self.device))
        for key, value in targets.stats.items():
            self._mean_metric(key).update_sum(value.detach(), torch.ones((), device=self.device))
        timings = timer.summary(rollout.generate_seconds, int(rollout.completion_mask.sum()))
        self._log_step(rollout, grad_norm, timings, batch_idx)
        self.objective.observe(self.step_log.as_dict())  # e.g. the entropy gate reads "kl"

    def _rollout_record(
        self, batch, rollout, rewards, components, targets, keep
    ) -> dict[str, Any]:
        """What the step sampled and how it was scored, on the CPU, for callbacks that show
        samples (``last_rollout``): prompts ``B``, completions ``B x G``, rewards, each
        reward component, advantages and MaxEnt weights as ``(B, G)`` tensors (or None;
        NaN in the groups that ``drop_constant_groups`` left out)."""
        B, G = rewards.shape

        def full(values: Tensor | None) -> Tensor | None:
            if values is None:
                return None
            out = rewards.new_full((B, G), float("nan"))
            out[keep] = values.detach().view(-1, G).to(out.dtype)
            return out.cpu()

        adv, weights = full(targets.advantages), full(targets.weights)  # None: empty step
        return {
            "step": self.global_step,
            "prompts": list(batch["raw_prompts"]),
            "completions": [list(group) for group in rollout.batch.grouped_completions],
            "rewards": rewards.detach().cpu(),
            "components": {
                name: components[k].detach().cpu().view(B, G)
                for k, name in enumerate(self.reward_names)
            },
            "advantages": adv,
            "weights": weights,
        }

    # ------------------------------------------------------------------ evaluation
    def _eval_step(self, batch: dict) -> None:
        """Sample ``n = eval_num_generations`` completions per prompt (and one greedy one
        when ``eval_greedy``), score them with the training rewards, and keep one
        :class:`~maxent_grpo.training.evaluation.PromptRecord` per prompt; the metrics are
        computed over the whole evaluation epoch in :meth:`_eval_epoch_end`."""
        hp = self.hparams
        G = hp.eval_num_generations
        B = len(batch["prompts"])
        # a forked random state: evaluation never shifts the training's random stream
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            rollout = self.engine().generate(batch["prompts"], batch["answers"], G)
            greedy = (
                self.engine(do_sample=False).generate(batch["prompts"], batch["answers"], 1)
                if hp.eval_greedy else None
            )
        completions = [c for group in rollout.batch.grouped_completions for c in group]
        total, components = self._score_completions(batch, completions, G)
        self.eval_reward.update(total.to(self.device).view(B, G))
        self.eval_components.update(components.to(self.device))
        correct = self._eval_correct(components[self.eval_reward_index], completions)
        greedy_correct: list[float | None] = [None] * B
        if greedy is not None:
            texts = [group[0] for group in greedy.batch.grouped_completions]
            _, greedy_components = self._score_completions(batch, texts, 1)
            greedy_correct = self._eval_correct(greedy_components[self.eval_reward_index], texts)
        columns = batch["columns"]
        for b in range(B):
            valid = columns.get("valid_answers", [None] * B)[b]
            task = columns.get("task", [None] * B)[b]
            self.eval_records.append(PromptRecord(
                correct=tuple(correct[b * G:(b + 1) * G]),
                answers=tuple(sample_answer(c) for c in completions[b * G:(b + 1) * G]),
                valid_answers=None if valid is None else frozenset(valid),
                task=None if task is None else str(task),
                greedy_correct=greedy_correct[b],
            ))

    def _score_completions(
        self, batch: dict, completions: list, G: int
    ) -> tuple[Tensor, Tensor]:
        """``(total (B*G,), components (K, B*G))`` of ``G`` completions per prompt, the
        prompts and the dataset's other columns repeated per completion."""
        prompts = [p for p in batch["raw_prompts"] for _ in range(G)]
        columns = {k: [v for v in vals for _ in range(G)] for k, vals in batch["columns"].items()}
        funcs = list(zip(self.reward_names, self.reward_funcs, self.reward_weights, strict=True))
        return score_completions(funcs, prompts, completions, columns)

    def _eval_correct(self, values: Tensor, completions: list) -> list[float]:
        """0/1 correctness ``eval_reward >= eval_correct_threshold``; a ``None`` (NaN) value
        means the reward could not grade the sample, which raises ValueError."""
        missing = torch.isnan(values)
        if bool(missing.any()):
            name = self.reward_names[self.eval_reward_index]
            raise ValueError(
                f"model.eval_reward {name!r} returned None (not applicable) for "
                f"{int(missing.sum())} of {len(completions)} evaluation completions, so their "
                "correctness is unknown: the evaluation rows lack the reference it reads (an "
                "empty 'answer' column? set data.answer_column to the column holding the "
                "reference answers), or choose another model.eval_reward"
            )
        threshold = float(self.hparams.eval_correct_threshold)
        return [1.0 if v >= threshold else 0.0 for v in values.tolist()]

    def _eval_epoch_end(self, prefix: str) -> None:
        """Log ``{prefix}/reward/...`` and the @k metrics of the epoch.

        The @k metrics are exact means over the epoch's prompts: under DDP every rank's
        records are gathered with ``torch.distributed.all_gather_object`` and every rank
        computes the same values (a DistributedSampler that pads the last batch repeats a
        few prompts, which then count twice).
        """
        if self.eval_reward.update_count == 0:
            return
        values = {f"{prefix}/reward/{k}": v for k, v in self.eval_reward.compute().items()}
        values.update(
            {f"{prefix}/reward/{k}": v for k, v in self.eval_components.compute().items()}
        )
        records = self.eval_records
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, records)
            records = [r for part in gathered for r in part]
        values.update(evaluation_metrics(records, self.eval_k, prefix))
        self.log_dict({k: float(v) for k, v in values.items()}, sync_dist=False)
        self.eval_reward.reset()
        self.eval_components.reset()
        self.eval_records = []

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch)

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch)

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def _mean_metric(self, key: str) -> TokenMean:
        name = key.replace("/", "__")
        self._updated.add(name)
        if name not in self.mean_metrics:
            self.mean_metrics[name] = TokenMean().to(self.device)
        return self.mean_metrics[name]

    def _skip_update(self, opt) -> None:
        opt.zero_grad(set_to_none=True)
        self.nonfinite_in_a_row += 1
        self.nonfinite_total += 1
        log.warning(
            "non-finite loss or gradient at step %d: update skipped (%d in a row, %d in all)",
            self.global_step, self.nonfinite_in_a_row, self.nonfinite_total,
        )
        if self.nonfinite_in_a_row >= self.hparams.max_consecutive_nonfinite:
            raise NonFiniteLossError(
                f"{self.nonfinite_in_a_row} non-finite updates in a row; stopping. Lower the "
                "learning rate or check the rewards, or raise model.max_consecutive_nonfinite."
            )

    def _log_step(self, rollout: RolloutOutput, grad_norm, timings: dict, batch_idx):
        reward = self.reward_metric.compute()
        tokens = self.token_metric.summary()
        means = {
            k.replace("__", "/"): m.compute() for k, m in self.mean_metrics.items()
            if k in self._updated
        }

        def value(key: str) -> float:
            return float(means[key]) if key in means else float("nan")

        losses = LossScalarBundle(
            total_loss=value("loss/total"),
            policy_loss=value("loss/policy"),
            clip_loss=means.get("loss/clip") and float(means["loss/clip"]),
            kl_loss=value("kl"),
            weighted_kl_loss=value("kl") * self.objective.state().get("beta", 0.0),
        )
        scalars = TrainingScalarStats(
            ref_logp_mean=value("logp/ref_token"),
            tokens=tokens,
            current_lr=self._lr_used,
            grad_norm_scalar=None if grad_norm is None else float(grad_norm),
            epoch_progress=batch_idx / max(1, self.trainer.num_training_batches),
            vllm_latency_ms=rollout.generate_seconds * 1000.0,
            policy_entropy=value("entropy") if "entropy" in means else None,
        )
        moments = self.reward_metric.summary()  # the documented RewardMoments
        diagnostics = {f"reward/{k}": float(v) for k, v in reward.items()}
        diagnostics.update({"reward/mean": moments.mean, "reward/std": moments.std})
        for name, stats in self.component_metric.summaries().items():
            diagnostics[f"reward/{name}/mean"] = stats.mean
            diagnostics[f"reward/{name}/std"] = stats.std
        diagnostics.update({k: float(v) for k, v in means.items() if not k.startswith("loss/")})
        diagnostics.update({
            "tokens/" + k: float(v) for k, v in self.token_metric.compute().items()
        })
        diagnostics.update(self.objective.state())
        diagnostics["lr"] = scalars.current_lr
        diagnostics.update({f"perf/{k}": v for k, v in timings.items()})
        diagnostics["nonfinite_skips"] = float(self.nonfinite_total)
        if self.hparams.drop_constant_groups:
            diagnostics["dropped_groups"] = float(self.dropped_groups)
            diagnostics["empty_steps"] = float(self.empty_steps)
        artifacts = LogStepArtifacts(
            loss_outputs=losses,
            diagnostics=diagnostics,
            grad_norm_scalar=scalars.grad_norm_scalar,
            epoch_progress=scalars.epoch_progress,
        )
        # NaN marks "not measured this step" (e.g. KL without a reference): not logged
        metrics = {
            f"train/{k}": v for k, v in artifacts.as_dict().items()
            if isinstance(v, (int, float)) and not math.isnan(v)
        }
        #: the step's logged record, reduced over micro-batches and ranks (read by callbacks)
        self.step_log = artifacts
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        self.log("reward", metrics["train/reward/mean"], prog_bar=True, logger=False)
        if "train/loss/total" in metrics:
            self.log("loss", metrics["train/loss/total"], prog_bar=True, logger=False)
        self.reward_metric.reset()
        self.component_metric.reset()
        self.token_metric.reset()
        for m in self.mean_metrics.values():
            m.reset()
        self._updated.clear()
