"""The module's models: the policy and tokenizer loaded once, the reference when something
needs it (the objective, or a controller that may raise beta), FSDP2 sharding, and the
parameters the optimizer trains. A mixin of :class:`~maxent_grpo.training.module.MaxEntGRPOModule`,
which holds ``source`` (:class:`~maxent_grpo.training.settings.ModelSettings`), ``objective``,
``runtime``, ``_reference_required`` and ``needs_reference``."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from maxent_grpo.adapters import (
    AdapterDisabledReference,
    register_sharded_generate,
)
from maxent_grpo.models import (
    check_token_ids,
    disable_dropout,
    load_policy,
    load_reference,
    load_tokenizer,
    model_chain,
    position_limit,
    trained_positions,
)
from maxent_grpo.objectives import GRPO
from maxent_grpo.rewards.answers import ANSWER_FORMS
from maxent_grpo.rewards.combine import RESERVED
from maxent_grpo.rewards.registry import REWARDS, get_reward
from maxent_grpo.rewards.timeout import TimedReward
from maxent_grpo.training.step.strategy import fully_shard_models
from maxent_grpo.training.types import RuntimeHandles
from maxent_grpo.validation import check_unused, defaults_of, failing_row, require

__all__ = ["PolicyModels"]


class PolicyModels:
    """Loading and holding the policy, its tokenizer and the reference (hooks of a
    ``LightningModule``)."""

    def prepare_data(self) -> None:
        """Materialise a ``builtin:`` model once, on local rank 0, before any rank loads it
        (also one that an adapter folder names as its base).

        Under DDP, transformers' ``save_pretrained`` writes weights only on global rank 0,
        so a built-in model first materialised by another rank would lack them.
        """
        model_chain(self.source.name_or_path, self.source.cache_dir)  # adapters' bases too

    def configure_model(self) -> None:
        """Load the policy (and the reference when needed) once; under
        ``ModelParallelStrategy`` (FSDP2) shard both over the data-parallel mesh. With
        ``model.peft`` the policy carries the adapters and the reference is the policy with
        them disabled (nothing more is loaded or sharded)."""
        if self.policy is not None:
            return
        if self.dtype not in (torch.float32, torch.get_default_dtype()):  # not a -true's
            rank_zero_warn(f"the module was cast to {self.dtype} before its policy loaded "
                           "(module.half() or .to(dtype) before a fit reaches no weights): "
                           f"the policy loads as model.dtype says ({self.source.dtype}); set "
                           "model.dtype or trainer.precision (bf16-true) instead")
        src = self.source
        self.tokenizer = load_tokenizer(src.name_or_path, cache_dir=src.cache_dir)
        self.policy = load_policy(src.name_or_path, dtype=src.dtype, cache_dir=src.cache_dir,
                                  gradient_checkpointing=src.gradient_checkpointing,
                                  peft=src.peft)
        check_token_ids(self.tokenizer, self.policy, src.name_or_path)
        self._check_positions(position_limit(self.policy), trained_positions(self.policy))
        self.policy.train()  # from_pretrained returns eval mode; the engine toggles it
        if disable_dropout(self.policy):  # scored as sampled (eval mode: no dropout)
            rank_zero_warn("the policy's dropout is set to 0 (adapters' too): it samples "
                           "without dropout, and is scored and trained as it samples")
        trainer = self._trainer  # None outside a trainer (a module used on its own)
        self.runtime = RuntimeHandles(
            accelerator=None if trainer is None else trainer.strategy, model=self.policy,
            tokenizer=self.tokenizer, train_loader=None, train_sampler=None,
            device=self.device, get_ref_model=self._load_reference)
        if self.needs_reference:
            self.runtime = self.runtime.with_reference()
        obj = self.objective  # the KL's options, where no KL; defaults: its class's own
        d = {**defaults_of(GRPO.__init__), **{k: v for k, v in defaults_of(
            type(obj).__init__).items() if v is not None}}  # None: "GRPO's", as a rule
        kl = {k: (getattr(obj, k, d[k]), d[k]) for k in ("kl_estimator", "kl_bias_correction")}
        check_unused({"objective.kl_estimator": kl["kl_estimator"]}, self.needs_reference,
                     "objective.beta > 0 (EntropyMaxEnt: or objective.kl_gate_threshold)")
        check_unused({"objective.kl_bias_correction": kl["kl_bias_correction"]},  # weighted
                     getattr(obj, "beta", 0) > 0 or self._reference_required, "objective.beta > 0")
        if self.device_mesh is not None:
            own = self.source.peft is None  # with adapters the reference has no weights
            fully_shard_models(self.device_mesh, [self.policy, self.reference if own else None])
            if not own:
                register_sharded_generate(self.policy)

    def _check_positions(self, limit: int | None, trained: int | None = None) -> None:
        """ValueError when a prompt and its completion may be longer than the ``limit``
        learned positions of the policy (GPT-2's 1,024): it would fail inside the model at
        the first long sample, perhaps hours into a run. A warning when they may be longer
        than the ``trained`` positions of a rotary model, which runs on past them untrained
        (the vLLM engine refuses such a run)."""
        sampling = self.loop.generation.sampling
        prompt, completion = sampling.max_prompt_length, sampling.max_new_tokens
        if limit is None and trained is not None and (prompt or 0) + completion > trained:
            rank_zero_warn(
                f"{self.source.name_or_path!r} was trained on {trained} positions "
                f"(max_position_embeddings), and a prompt with its completion may be "
                f"{(prompt or 0) + completion} tokens (data.max_prompt_length {prompt} + "
                f"model.max_completion_length {completion}): the positions past it are "
                "untrained, and the vLLM engine refuses this; lower the two to add up to at "
                f"most {trained}")
        if limit is None or (prompt is not None and prompt + completion <= limit):
            return
        longest = "prompts of any length" if prompt is None else f"{prompt + completion} tokens"
        raise ValueError(
            f"{self.source.name_or_path!r} has {limit} learned positions, and a prompt with its "
            f"completion may be {longest} (data.max_prompt_length {prompt} + "
            f"model.max_completion_length {completion}): a longer sequence fails inside the "
            f"model; lower data.max_prompt_length (or model.max_completion_length) so that "
            f"the two add up to at most {limit}")

    def _load_reference(self) -> torch.nn.Module:
        src = self.source
        if src.peft is not None:
            bias = getattr(src.peft, "bias", "none")  # (only a fit computes the KL)
            fitting = self._trainer is None or self.trainer.state.fn == "fit"
            require(bias == "none" or not fitting,
                    f"model.peft.bias: {bias} trains the base model's biases, which the "
                    "reference (the policy with its adapters disabled) shares: the KL would "
                    "be to a model that moves; use bias: none while "
                    f"{type(self.objective).__name__} needs the reference (a beta or kl_coef > "
                    "0, a KL gate, GroupMaxEnt's lam > 0, or a controller of beta)")
            return AdapterDisabledReference(self.policy)
        return load_reference(src.name_or_path, dtype=src.dtype, cache_dir=src.cache_dir)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The policy's parameters that train (``requires_grad``), what the optimizer gets:
        all of them, or only the adapters' with ``model.peft``."""
        assert self.policy is not None, "configure_model() must run first"
        return [p for p in self.policy.parameters() if p.requires_grad]

    def require_reference(self) -> None:
        """Called by controllers that can make beta > 0: load the reference from the start."""
        self._reference_required = True
        if self.runtime is not None and self.runtime.reference_model is None:
            self.runtime = self.runtime.with_reference()
            self._place_reference()

    def check_reference(self) -> None:
        """At a training batch's start: an objective that needs the reference (a beta raised
        from 0 by a user's callback) where the run loaded none is a ValueError (the step
        trained without the KL term, logging the new beta)."""
        require(self.reference is not None or not self.objective.needs_reference,
                f"model.objective ({type(self.objective).__name__}, now "
                f"{self.objective.state()}) needs the reference model at step "
                f"{self.global_step}, but this run loaded none (it needed none when the fit "
                "started): a callback that raises beta (or the KL's weight) from 0 calls "
                "pl_module.require_reference() in its setup (as BetaController does), or "
                "start the fit with it above 0")

    @property
    def reference(self) -> torch.nn.Module | None:
        """The frozen reference model once loaded (kept out of ``state_dict``), else None.
        With ``model.peft`` it is an :class:`~maxent_grpo.adapters.AdapterDisabledReference`:
        called like a model, it runs the policy with its adapters disabled."""
        return None if self.runtime is None else self.runtime.reference_model

    def on_fit_start(self) -> None:
        if self.reference is not None:
            self._place_reference()

    def _place_reference(self) -> None:
        """The reference on the policy's device, and in the policy's dtype under a ``-true``
        precision, which Lightning applies to the policy alone (a bf16 policy against a
        float32 reference had a KL of 3e-5 at the start, and twice the memory)."""
        self.reference.to(self.device)
        own = not isinstance(self.reference, AdapterDisabledReference)  # else the policy
        if own and self._trainer is not None:  # sharded too (as Lightning converts the policy)
            self.trainer.precision_plugin.convert_module(self.reference)

    def check_reward_rows(self, splits: tuple[str, ...] = ("train", "val")) -> None:
        """At the start of a fit (a validate, test or predict: ``splits=("val",)``), before
        any batch: the rewards read every row's references (:func:`check_references`),
        and each row's ``answer_form`` is one of
        :data:`~maxent_grpo.rewards.answers.ANSWER_FORMS` (or blank)."""
        datamodule = getattr(self.trainer, "datamodule", None)
        for split in splits:
            data = getattr(datamodule, f"{split}_dataset", None)
            rows, source = getattr(data, "examples", None), getattr(data, "where", None)
            if rows:
                def where(i: int, s: str = split, r: list = rows, w: Any = source) -> str:
                    part, number = (s, r[i].index) if w is None else w(r[i].index)  # its file
                    return f"{part} row {number} ({s} prompt {str(r[i].raw_prompt)[:60]!r})"

                columns = [ex.columns for ex in rows]
                check_references(self.rewards.names, columns, where)
                check_arguments(self.rewards, columns, split, self.loop.generation.tools)
                for i, example in enumerate(rows):
                    if (form := example.columns.get("answer_form")) not in (None, "",
                                                                           *ANSWER_FORMS):
                        raise ValueError(f"the answer_form of {where(i)} must be one of "
                                         f"{ANSWER_FORMS} or blank; got {form!r}")

    def attach_training_data(self) -> None:
        """At the start of training: the handles take the trainer's strategy, loader and
        sampler (:class:`~maxent_grpo.training.types.RuntimeHandles`); a sampler whose order
        a checkpoint cannot continue is warned about once."""
        runtime = dataclasses.replace(
            self.runtime, accelerator=self.trainer.strategy,
            train_loader=self.trainer.train_dataloader, device=self.device)
        sampler = getattr(runtime.train_loader, "sampler", None)
        self.runtime = dataclasses.replace(runtime, train_sampler=sampler)
        if self.runtime.train_sampler is not None and not hasattr(
                self.runtime.train_sampler, "resume_at"):
            rank_zero_warn(
                f"the training loader's sampler ({type(sampler).__name__}) is not the "
                "PromptDataModule's EpochShuffleSampler: a run resumed from a checkpoint "
                "will not continue with the prompts the interrupted run would have drawn")


#: built-in rewards that refuse a reference they cannot read (:func:`check_references`)
READS_REFERENCES = ("first_number", "digit_pair", "in_set", "countdown")


def check_references(names: list[str], rows: Sequence[Mapping[str, Any]],
                     where: Callable[[int], str]) -> None:
    """The references of every row (its columns, as the rewards get them) read by the
    rewards of ``names`` that refuse one they cannot read (:data:`READS_REFERENCES`), at the
    start of a fit: a row they cannot grade is a ValueError naming it (``where(i)``) and the
    reward now, not when it is first sampled. A column named after a reward argument
    (:data:`~maxent_grpo.rewards.combine.RESERVED`) is refused here, for every reward."""
    columns = dict.fromkeys(key for c in rows for key in c)
    if clash := [key for key in columns if key in RESERVED]:
        i = next(i for i, row in enumerate(rows) if clash[0] in row)
        raise ValueError(f"the column {clash[0]!r} of {where(i)} clashes with the reward "
                         "argument of that name; rename the dataset column")
    for name in dict.fromkeys(n for n in names if n in READS_REFERENCES):
        fn, n = get_reward(name), len(rows)
        call = {"prompts": [""] * n, "completions": [""] * n,
                **{key: [c.get(key) for c in rows] for key in columns}}
        try:  # all rows at once; row by row only to find the one that failed
            fn(**call)
        except ValueError:
            if (found := failing_row(fn, n, call, ValueError)) is not None:
                reason = re.sub(r" given with completion \d+ of the step", "", str(found[1]))
                raise ValueError(f"model.rewards.{name} cannot grade {where(found[0])}: "
                                 f"{reason}") from None


#: what a multi-turn rollout adds to the reward arguments (:mod:`~maxent_grpo.rollout.multiturn`)
MULTI_TURN = ("tool_calls", "tool_failures", "exchange_lengths", "environments")


def check_arguments(rewards: Any, rows: Sequence[Mapping[str, Any]], split: str,
                    tools: Any = None) -> None:
    """Each reward function's named arguments against the ``split`` rows' columns and what
    the run's multi-turn rollouts (``tools``: its ToolSettings, or None) give, at the start
    of a fit: one without a default that nothing gives is a ValueError naming it (it was
    a TypeError at the first step); one that defaults to None that no row gives a value,
    a column of the rows or a built-in reward's (``first_number``'s ``answer`` with
    ``data.answer_column: null``), is warned about: it grades nothing there (a function's
    optional argument no row has may be a setting of its own: not warned about)."""
    columns = dict.fromkeys(key for c in rows for key in c)
    given_by_run = () if tools is None else MULTI_TURN if tools.environment else MULTI_TURN[:3]
    if clash := [key for key in columns if key in given_by_run]:  # was an error at step 1
        raise ValueError(f"the {split} column {clash[0]!r} clashes with the multi-turn "
                         "rollout's reward argument of that name; rename the column")
    for name, fn in zip(rewards.names, rewards.funcs, strict=True):
        fn = fn.fn if isinstance(fn, TimedReward) else fn
        require(not inspect.isclass(fn), f"model.rewards.{name} is a class: name a function, "
                "or an instance whose __call__ is the reward ('module:INSTANCE')")
        try:  # what is called: a decorator's wrapper, not the function it wraps
            parameters = inspect.signature(fn, follow_wrapped=False)
        except (TypeError, ValueError):  # no signature to read (a builtin)
            continue
        given = [key for key in (*RESERVED, *columns) if key not in parameters.parameters]
        if given and not any(p.kind == p.VAR_KEYWORD for p in parameters.parameters.values()):
            raise ValueError(
                f"model.rewards.{name} does not take the argument {given[0]!r} (nor **kwargs): "
                f"every reward is called with {', '.join(RESERVED)} and each data column "
                f"({', '.join(columns) or 'none'}); take the ones you need by name and the rest "
                "with **kwargs")
        for p in parameters.parameters.values():
            if p.name in RESERVED or p.name in given_by_run or p.kind not in (
                    p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                continue
            require(p.name not in MULTI_TURN or p.name in columns or (
                p.default is not inspect.Parameter.empty),
                    f"model.rewards.{name} takes the argument {p.name!r}, which only "
                    + ("model.environment" if p.name == "environments" else
                       "model.tools or model.environment") + " rollouts give: set it, or "
                    "give the argument a default")
            if p.default is inspect.Parameter.empty and p.name not in columns:
                raise ValueError(
                    f"model.rewards.{name} takes the argument {p.name!r}, which no {split} row "
                    f"has (their columns: {', '.join(columns) or 'none'}; the prompt reaches a "
                    "reward as 'prompts'): name a column, give it a default, or take the rest "
                    "with **kwargs")
            if p.default is None and (p.name in columns or name in REWARDS) and all(
                    c.get(p.name) in (None, "") for c in rows):  # a column, left empty
                rank_zero_warn(f"model.rewards.{name} reads the column {p.name!r}, which no "
                               f"{split} row fills: it gets None there, and grades nothing ("
                               + ("set data.answer_column, or " if p.name == "answer" else "")
                               + "give the rows that column)")
