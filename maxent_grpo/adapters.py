"""PEFT adapters (LoRA and the other ``peft`` tuners) on the policy: ``model.peft``.

With ``model.peft`` set to a ``peft`` config (``class_path: peft.LoraConfig``), the policy is
the base model wrapped by ``peft.get_peft_model``::

    policy    = get_peft_model(base, config)     # base weights frozen, adapters trainable
    optimizer = optimizer(adapter parameters)    # module.trainable_parameters()
    reference = policy with its adapters off     # AdapterDisabledReference: the same
                                                 #   network under policy.disable_adapter()
    export    = the adapter (save_pretrained)    # and, on request, merged_copy(...)
    load      = base + adapter folder, merged    # merge_adapter: what load_policy does
                                                 #   with a folder that holds an adapter

so the frozen reference costs no second copy of the weights: the base *is* the reference,
and turning the adapters off gives its log-probs exactly. The ``peft`` package is an
optional extra (``pip install maxent-grpo[peft]``); without it :data:`PeftConfig` is a
stand-in and ``model.peft`` cannot be set.

An exported adapter's ``adapter_config.json`` names its base as the user gave it
(``base_model_name_or_path: builtin:tiny-warm``, :func:`name_base`), not this machine's
cache folder of the built-in model, so it loads anywhere this package is installed; peft's
``AutoPeftModelForCausalLM`` knows no ``builtin:`` names, ``load_policy`` does. A checkpoint
records the config (:func:`peft_record`), so an adapter can be exported from it later.

``loftq_config: null`` in the YAML's ``init_args`` only keeps a spurious warning away:
jsonargparse fills LoraConfig's ``Union[LoftQConfig, dict]`` default (``{}``) with a default
``LoftQConfig``, which peft then discards with the warning that it ignores ``loftq_config``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from maxent_grpo.validation import require

try:  # the optional ``peft`` extra
    from peft import PeftConfig
except ImportError:  # pragma: no cover - only without the extra

    class PeftConfig:  # type: ignore[no-redef]
        """Stand-in for ``peft.PeftConfig`` without ``peft``: nothing is an instance of it."""


__all__ = ["ADAPTER_CONFIG", "AdapterDisabledReference", "PeftConfig", "adapter_base",
           "apply_peft", "check_peft", "check_saved_adapters", "has_adapters", "merge_adapter",
           "merged_copy", "name_base", "peft_from_record", "peft_record",
           "register_sharded_generate"]

logger = logging.getLogger(__name__)
#: the seed of the adapters' initialisation (see :func:`apply_peft`)
PEFT_INIT_SEED = 0
#: ``init_lora_weights`` that move the base weights (peft's pissa, corda, olora, loftq, lora_ga)
REWRITING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")
#: the file that makes a folder an adapter folder (``save_pretrained`` of a ``peft`` model)
ADAPTER_CONFIG = "adapter_config.json"


def has_adapters(model: Any) -> bool:
    """Whether ``model`` is a ``peft`` model (it has ``disable_adapter`` and ``peft_config``)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def check_peft(config: Any) -> None:
    """Refuse (ValueError naming ``model.peft``) what cannot train here: a non-``peft``
    object, a task type other than ``CAUSAL_LM`` (or None), prompt-learning methods (prefix /
    prompt tuning: they change the sequence the scorer reads), ``inference_mode`` (the
    adapters would be frozen), AdaLoRA (its rank allocation needs its own loop) and an
    ``init_lora_weights`` that rewrites the base weights (:data:`REWRITING_INITS`: the
    reference and the exported adapter assume the base as loaded)."""
    name = type(config).__name__
    require(isinstance(config, PeftConfig),
            f"model.peft must be a peft config (class_path peft.LoraConfig, ...); got {name}")
    require(config.peft_type is not None, f"model.peft: {name} names no method (what "
            "`model.peft: {}` builds); give a tuner's config, e.g. class_path: peft.LoraConfig")
    task = config.task_type
    require(task is None or str(getattr(task, "value", task)) == "CAUSAL_LM",
            f"model.peft.task_type must be CAUSAL_LM (or null); got {task!r}")
    require(not config.is_prompt_learning,
            f"model.peft: {name} is a prompt-learning method, which changes the sequence the "
            "scorer reads; use an adapter method such as peft.LoraConfig")
    require(not config.inference_mode, "model.peft.inference_mode must be false: with it "
            "the adapters are frozen and nothing trains")
    require(str(getattr(config.peft_type, "value", config.peft_type)) != "ADALORA",
            "model.peft: AdaLoRA needs its rank allocation called after every backward "
            "(update_and_allocate) and its regulariser added to a loss with labels, neither of "
            "which this trainer does (it would train a fixed-rank adapter of init_r): use "
            "peft.LoraConfig")
    init = getattr(config, "init_lora_weights", True)
    require(not (isinstance(init, str) and init.lower().startswith(REWRITING_INITS)),
            f"model.peft.init_lora_weights {init!r} rewrites the base weights (base - the "
            "adapters' start), so the base is no longer the model loaded: the reference "
            "(the adapters disabled) and an exported adapter (loaded on the base as named) "
            "would be other models; use true (the default) or 'gaussian'")


def apply_peft(model: torch.nn.Module, config: PeftConfig) -> torch.nn.Module:
    """``peft.get_peft_model(model, config)``: the base weights frozen, the adapters trainable.

    ``config`` is checked (:func:`check_peft`); ``task_type`` None becomes ``CAUSAL_LM`` and
    ``loftq_config`` None ``{}`` (on a copy: the caller's config is never changed), so the
    result is a ``PeftModelForCausalLM`` whose ``generate`` uses the adapters. The adapters are
    initialised from ``torch.manual_seed(PEFT_INIT_SEED)`` inside a forked random state: every
    rank and every run starts from the same adapters (FSDP2 shards each rank's own copy), and
    the caller's random stream is neither read nor advanced.
    """
    check_peft(config)
    name = type(config).__name__
    if config.task_type is None:
        config = copy.deepcopy(config)
        config.task_type = "CAUSAL_LM"
    if hasattr(config, "loftq_config") and config.loftq_config is None:  # the shipped YAML's
        config = copy.deepcopy(config)  # null: peft 0.18 reads it as a dict ({}: no LoftQ)
        config.loftq_config = {}
    with torch.random.fork_rng(devices=[]):  # the model is on the CPU here
        torch.manual_seed(PEFT_INIT_SEED)
        peft_model = _get_peft_model(model, config)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    require(trainable > 0, f"model.peft: {name} left no parameter trainable (check "
            "target_modules against the model's module names)")
    logger.info("peft %s: %d of %d parameters train (%.3f%%)", name, trainable, total,
                100.0 * trainable / total)
    return peft_model


def check_lora_bias(model: torch.nn.Module, merge: str, fix: str) -> None:
    """Refuse (ValueError) to ``merge`` (what would merge, named) adapters with a LoRA bias on
    layers that have no bias of their own (it trains, but a merge has no place for it: peft
    refuses it, or it is lost); ``fix`` says what to do instead."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    unbiased = [name for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)
                and any(getattr(m, "lora_bias", {}).values())
                and getattr(m.get_base_layer(), "bias", None) is None]
    require(not unbiased, f"{merge}: model.peft's lora_bias trains a bias on layers that have "
            f"none ({', '.join(unbiased[:3])}{', ...' if len(unbiased) > 3 else ''}), which "
            f"merged weights have no place for; {fix}")


def register_sharded_generate(policy: torch.nn.Module) -> None:
    """After FSDP2 ``fully_shard`` of a ``peft`` policy: make ``policy.generate`` gather the
    root unit's parameters, which ``PeftModel.generate`` would skip by calling the inner
    model past the root's forward hooks (a no-op when unsharded)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    register_fsdp_forward_method(policy, "generate")


def _get_peft_model(model: torch.nn.Module, config: PeftConfig) -> torch.nn.Module:
    from peft import get_peft_model

    with warnings.catch_warnings():  # peft reads transformers' deprecated property name
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        return get_peft_model(model, config)


class AdapterDisabledReference(torch.nn.Module):
    """The frozen reference of a ``peft`` policy: the policy itself, called in eval mode,
    without gradient and under ``policy.disable_adapter()``, i.e. the base model. It holds
    no weights: the policy is kept outside the module tree, so ``parameters()``,
    ``state_dict()``, ``.to()``, ``.eval()`` and ``requires_grad_()`` never touch it.
    """

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        require(has_adapters(policy), "AdapterDisabledReference needs a peft model")
        object.__setattr__(self, "policy", policy)  # not a submodule (see above)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        policy = self.policy
        was_training = policy.training
        policy.eval()  # the reference runs in eval mode, as a loaded one does
        try:
            with torch.no_grad(), policy.disable_adapter():
                return policy(*args, **kwargs)
        finally:
            policy.train(was_training)

    def extra_repr(self) -> str:
        return f"policy={type(self.policy).__name__} with its adapters disabled"


def merged_copy(policy: torch.nn.Module, base: torch.nn.Module,
                state_dict: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """``base`` (a fresh plain ``transformers`` model with the policy's base weights, e.g.
    from :func:`~maxent_grpo.models.load_policy`) with ``policy``'s adapters merged into its
    weights; ``policy`` is left untouched: no second copy of the model on the accelerator
    and no in-place merge of the training model. ``state_dict``: the policy's whole one, when
    its own tensors are shards."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    require(has_adapters(policy), "merged_copy needs a peft model")
    check_lora_bias(policy, "the merged model", "export the adapter alone (not merged)")
    adapter = policy.active_adapter
    with torch.random.fork_rng(devices=[]):  # peft draws an init: the run's stream is kept
        fresh = _get_peft_model(base, copy.deepcopy(policy.peft_config[adapter]))
    weights = {k: v.detach().cpu() for k, v in get_peft_model_state_dict(
        policy, state_dict=state_dict).items()}
    result = set_peft_model_state_dict(fresh, weights)
    unexpected = list(getattr(result, "unexpected_keys", []))
    require(not unexpected, f"merged_copy: adapter weights without a place: {unexpected[:5]}")
    return _untie_tuned(fresh).merge_and_unload()


def _untie_tuned(model: Any) -> Any:
    """``model`` (a peft model about to be merged) with each adapted layer of its tied
    embeddings given its own copy of the one tensor they share, and the config untied:
    merged into the shared tensor, an adapter on the output layer would move the input
    embeddings too (and one on each would count twice), another model than the one trained,
    where the adapter changes one layer only."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = model.get_base_model()
    embeddings = base.get_input_embeddings()
    tied = getattr(getattr(embeddings, "get_base_layer", lambda: embeddings)(), "weight", None)
    layers = [m.get_base_layer() for m in base.modules() if isinstance(m, BaseTunerLayer)
              and getattr(m.get_base_layer(), "weight", None) is tied]
    if tied is None or not getattr(base.config, "tie_word_embeddings", False) or not layers:
        return model
    for layer in layers:
        layer.weight = torch.nn.Parameter(tied.detach().clone(), tied.requires_grad)
    text = base.config.get_text_config(decoder=True)
    for config in {id(c): c for c in (base.config, text)}.values():
        config.tie_word_embeddings = False
    return model


def name_base(folder: str | os.PathLike[str], name: str) -> None:
    """Make the adapter saved in ``folder`` name its base ``name``: ``adapter_config.json``'s
    ``base_model_name_or_path``, and the base's folder wherever peft's model card
    (``README.md``) names it. Done after ``save_pretrained``, whose own checks read the base
    folder it recorded."""
    file = Path(folder) / ADAPTER_CONFIG
    config = json.loads(file.read_text("utf-8"))
    before = config.get("base_model_name_or_path")
    config["base_model_name_or_path"] = name
    file.write_text(json.dumps(config, indent=2, sort_keys=True), "utf-8")
    card = Path(folder) / "README.md"
    if before and card.is_file():
        card.write_text(card.read_text("utf-8").replace(before, name), "utf-8")


def adapter_base(folder: str | os.PathLike[str]) -> str | None:
    """The base model an adapter folder names (its ``adapter_config.json``'s
    ``base_model_name_or_path``: a ``builtin:`` name, hub id or folder); None when
    ``folder`` holds no ``adapter_config.json``. ValueError when the file names none."""
    file = Path(folder) / ADAPTER_CONFIG
    if not file.is_file():
        return None
    data = json.loads(file.read_text("utf-8"))
    base = data.get("base_model_name_or_path") if isinstance(data, dict) else None
    require(isinstance(base, str) and bool(base.strip()),
            f"{file} names no base model: set its base_model_name_or_path to the base's "
            "'builtin:' name, hub id or folder")
    return base


def merge_adapter(model: torch.nn.Module, folder: str | os.PathLike[str]) -> torch.nn.Module:
    """``model`` (the adapter's base, loaded) with the adapter saved in ``folder`` merged
    into its weights: a plain ``transformers`` model whose ``name_or_path`` is ``folder``
    (so an adapter trained on top of it names ``folder`` as its base), its parameters as
    trainable as the base's were (peft freezes the base, and merging leaves it frozen: a
    policy loaded from an exported adapter had nothing to train)."""
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    try:
        from peft import PeftModel
    except ImportError as error:  # pragma: no cover - only without the extra
        raise ModuleNotFoundError(
            f"{folder} holds a peft adapter; loading it needs the peft package: "
            "pip install 'maxent-grpo[peft]'") from error
    with warnings.catch_warnings():  # peft reads transformers' deprecated property name
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        with torch.random.fork_rng(devices=[]):  # peft draws its init before loading
            tuned = PeftModel.from_pretrained(model, str(folder))
    check_lora_bias(tuned, f"loading the adapter {folder} as a model", "load it with peft's "
                    "PeftModel.from_pretrained over its base (not merged)")
    merged = _untie_tuned(tuned).merge_and_unload()
    merged.name_or_path = merged.config._name_or_path = str(folder)
    for name, p in merged.named_parameters():
        p.requires_grad_(trainable.get(name, True))
    return merged


def peft_record(config: PeftConfig | None) -> dict[str, Any] | None:
    """``config`` as plain JSON values (sets as sorted lists), for a checkpoint; without
    ``base_model_name_or_path`` (set again by whoever applies it). None for None."""
    if config is None:
        return None
    record = json.loads(json.dumps(config.to_dict(), default=_sorted_set))
    record.pop("base_model_name_or_path", None)
    return record


def _sorted_set(value: Any) -> list[Any]:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    raise TypeError(f"a peft config value that JSON cannot hold: {value!r}")


def describe_peft(record: dict[str, Any], keys: tuple[str, ...]) -> str:
    """A recorded ``model.peft`` as the YAML that gives it: its class and its ``keys`` that
    are set, e.g. ``{class_path: peft.LoraConfig, init_args: {r: 4, lora_alpha: 8}}``."""
    try:
        name = f"peft.{type(peft_from_record(record)).__name__}"
    except Exception:  # noqa: BLE001 - a record peft cannot read: its type, as written
        name = f"peft_type {record.get('peft_type')!r}"
    shown = ", ".join(f"{k}: {json.dumps(record[k])}" for k in keys  # 0 is set, False not
                      if k != "peft_type" and record.get(k) is not None
                      and record[k] is not False and record[k] not in ([], {}))
    return f"{{class_path: {name}, init_args: {{{shown}}}}}"


def peft_from_record(record: dict[str, Any]) -> PeftConfig:
    """The ``peft`` config :func:`peft_record` wrote (its ``peft_type`` picks the class)."""
    require(isinstance(record, dict) and "peft_type" in record,
            f"not a recorded peft config (no peft_type): {record!r}")
    return PeftConfig.from_peft_type(**record)


def check_older_adapters(state_dict: dict[str, Any], config: PeftConfig | None) -> None:
    """For a checkpoint from before ``model.peft`` was recorded, what its weights show:
    ValueError for adapters in them and none in this run (or the reverse), or LoRA weights
    of another rank than ``config.r`` (Lightning's strict load failed on each as "a bug");
    a warning that the adapters' scale (``lora_alpha``, ``use_rslora``) cannot be compared.
    Nothing without weights to read (a DeepSpeed or sharded checkpoint keeps its own)."""
    if not state_dict:
        return
    wrapped = any(key.startswith("policy.base_model.model.") for key in state_dict)
    fix = "use the model.peft it was trained with (the run's config.yaml)"
    if wrapped != (config is not None):
        made, run = ("with", "without") if wrapped else ("without", "with")
        raise ValueError(f"the checkpoint was made {made} model.peft adapters and this run is "
                         f"{run} them, so its weights do not fit the model; {fix}")
    if config is None:
        return
    ranks = {int(value.shape[0]) for key, value in state_dict.items()
             if ".lora_A." in key and isinstance(value, torch.Tensor) and value.dim() == 2}
    r = getattr(config, "r", None)  # plain LoRA's rows are r (AdaLoRA's init_r; LoRA of
    plain = type(config).__name__ == "LoraConfig" and not any(  # 3-D expert weights': r x E)
        getattr(config, name, None) for name in ("rank_pattern", "target_parameters"))
    require(not (plain and ranks and r is not None) or ranks == {r},
            f"the checkpoint's LoRA adapters have rank {sorted(ranks)} and this run's "
            f"model.peft r {r}; {fix}")
    from lightning.pytorch.utilities import rank_zero_warn

    rank_zero_warn("the checkpoint predates its record of model.peft, so its adapters' scale "
                   "(lora_alpha, use_rslora, alpha_pattern) cannot be compared with this run's: "
                   "make sure model.peft is the one it was trained with")


#: the ``model.peft`` fields that decide which adapter weights a checkpoint holds (the
#: lists compared as sets; a ``target_modules`` that one side leaves to peft is not compared)
ADAPTER_SHAPE = ("peft_type", "r", "target_modules", "modules_to_save", "use_dora", "lora_bias",
                 "rank_pattern", "layers_to_transform", "layers_pattern", "exclude_modules",
                 "target_parameters")
#: the fields that decide what the same weights compute (the scale s = alpha / r, or
#: alpha / sqrt(r); LoHa's and LoKr's ``alpha``): compared where both records hold them
ADAPTER_MATH = ("lora_alpha", "alpha_pattern", "use_rslora", "fan_in_fan_out", "alpha")
#: what decides which weights train (the optimizer's state): compared for a resume
ADAPTER_TRAINED = ("bias",)


def check_saved_adapters(saved: dict[str, Any] | None, config: PeftConfig | None,
                         fitting: bool = False) -> None:
    """ValueError naming what differs unless a checkpoint's record of ``model.peft``
    (:func:`peft_record`; None: none) fits this run's ``config``: adapters in one and not
    the other, or another :data:`ADAPTER_SHAPE` or :data:`ADAPTER_MATH` (when ``fitting``,
    :data:`ADAPTER_TRAINED`)."""
    now = peft_record(config)
    if (saved is None) != (now is None):
        made, run = ("with", "without") if now is None else ("without", "with")
        fields = ADAPTER_SHAPE + ADAPTER_MATH + ADAPTER_TRAINED
        given = "" if saved is None else f": {describe_peft(saved, fields)}"
        raise ValueError(
            f"the checkpoint was made {made} model.peft adapters and this run is {run} them, "
            f"so its weights do not fit the model; use the model.peft it was trained with{given}")
    if saved is None or now is None:
        return

    def value(record: dict[str, Any], key: str) -> Any:
        found = record.get(key)
        return sorted(map(str, found)) if isinstance(found, list) else found

    differ = [k for k in ADAPTER_SHAPE if value(saved, k) != value(now, k)
              and not (k == "target_modules" and None in (saved.get(k), now.get(k)))]
    differ += [k for k in ADAPTER_MATH + ADAPTER_TRAINED * fitting
               if k in saved and k in now and saved[k] != now[k]]
    shown = ", ".join(f"{k}: {saved.get(k)!r} in the checkpoint, {now.get(k)!r} now"
                      for k in differ)
    require(not differ, f"the checkpoint's adapters do not fit this run's model.peft ({shown}): "
                        "use the model.peft it was trained with")
