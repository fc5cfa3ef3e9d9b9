"""The policy's weights as a plain checkpoint: what a second copy of the model (the vLLM
engine) loads after every optimizer step.

:func:`checkpoint_weights` returns ``(name, tensor)`` pairs under the names of the plain
``transformers`` model, whole on every rank, with ``peft`` adapters merged in, and leaves the
training model exactly as it was:

- **FSDP2** (``fully_shard``): each sharded tensor (a ``DTensor``) is all-gathered with
  ``full_tensor()``; every rank must call this at the same point, as the trainer does (before
  the rollout that follows an optimizer step).
- **LoRA** (``peft`` LoRA on linear layers): the merged weight ``W + s · B A`` (``s`` the
  adapter's scaling, transposed for ``fan_in_fan_out``) is computed from the tensors, for
  every active adapter, and with ``LoraConfig(lora_bias=True)`` the bias ``b + s · b_B``
  (``b_B`` the bias of ``lora_B``); the ``lora_*`` tensors are dropped and the
  ``base_model.model.`` and ``.base_layer`` parts of the names removed. The model itself is never
  merged: peft's
  ``merge_adapter`` / ``unmerge_adapter`` round trip moves the frozen base weights (the
  reference model) by rounding, a little on every call.
- **other peft tuners** (IA3, LoHa, DoRA, ...) on a model that is not sharded: merged with
  ``merge_adapter``, read, and unmerged, after which the base weights are restored from a
  copy, bit for bit. Sharded, they are refused (:func:`check_mergeable`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from maxent_grpo.adapters import check_lora_bias, has_adapters
from maxent_grpo.validation import require

__all__ = ["check_mergeable", "checkpoint_weights", "sharded_state_dict"]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a ``DTensor`` shard all-gathered (a collective), else itself."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if callable(full) else tensor).detach()


def sharded_state_dict(model: nn.Module, keep: bool = True) -> dict[str, torch.Tensor] | None:
    """An FSDP2-sharded model's whole ``state_dict`` (adapters unmerged) on the CPU, for a
    ``save_pretrained`` on one rank: a collective every rank calls at the same point; only
    the rank told to ``keep`` it holds the copy (each tensor is let go once gathered
    elsewhere). None for a model that is not sharded (no collective) and on the others."""
    state = model.state_dict(keep_vars=True)  # tied weights: one parameter, two names
    if not any(callable(getattr(t, "full_tensor", None)) for t in state.values()):
        return None
    whole: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    for name, tensor in state.items():
        if id(tensor) in first:  # the one gathered tensor under both names (gathered twice,
            if keep:  # save_pretrained wrote the embedding again as the head)
                whole[name] = whole[first[id(tensor)]]
            continue
        first[id(tensor)] = name
        full = _full(tensor)
        if keep:
            whole[name] = full.cpu()
    return whole if keep else None


def _lora_linear_layers(model: nn.Module) -> dict[str, Any] | None:
    """``{module name: layer}`` of the peft model's tuner layers when all are LoRA on linear
    layers without DoRA (None otherwise: another tuner, DoRA, LoRA on embeddings or convs)."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = model.get_base_model()
    layers = {}
    for name, module in base.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if type(module) is not LoraLinear or any(module.use_dora.values()):
            return None
        layers[name] = module
    return layers


def check_mergeable(model: nn.Module, sharded: bool) -> None:
    """Refuse (ValueError naming ``model.peft``) adapters that :func:`checkpoint_weights`
    cannot hand to vLLM: ``lora_bias`` on layers without a bias of their own,
    ``modules_to_save`` (trained copies of whole modules), ``trainable_token_indices``
    (trained embedding rows kept beside the embeddings), adapters on
    the output layer of a model with tied embeddings (vLLM loads only the input
    embeddings then, so the head's adapter would be lost), and a tuner other than LoRA on
    linear layers on a sharded model."""
    if not has_adapters(model):
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = model.get_base_model()
    check_lora_bias(model, "the weights vLLM loads", "set lora_bias: false, or use "
                    "HFGenerateEngine")
    if getattr(getattr(base, "config", None), "tie_word_embeddings", False):
        embeddings = base.get_input_embeddings()
        tied = getattr(getattr(embeddings, "get_base_layer", lambda: embeddings)(), "weight",
                       None)  # the one tensor behind both embeddings
        tuned = [name for name, m in base.named_modules() if isinstance(m, BaseTunerLayer)
                 and getattr(m.get_base_layer(), "weight", None) is tied]
        require(not tuned, f"model.peft: adapters on the tied embeddings ({', '.join(tuned)}) "
                "cannot be handed to vLLM: it loads one tensor for both the input embeddings "
                "and the output layer, while the adapter changes only one of them; leave "
                "lm_head and embed_tokens out of target_modules, or use HFGenerateEngine")
    for name, config in model.peft_config.items():
        require(not getattr(config, "modules_to_save", None),
                f"model.peft: modules_to_save ({config.modules_to_save}, adapter {name!r}) "
                "cannot be handed to the vLLM engine; leave it unset, or use HFGenerateEngine")
        require(not getattr(config, "trainable_token_indices", None),
                f"model.peft: trainable_token_indices (adapter {name!r}) trains rows of the "
                "embeddings beside them, which the vLLM engine is not handed; leave it unset, "
                "or use HFGenerateEngine")
    if sharded:
        require(_lora_linear_layers(model) is not None,
                "model.peft: with the vLLM engine and a sharded policy (FSDP2), only LoRA "
                "on linear layers (no DoRA) can be merged for vLLM; use DDP, or LoRA")


def _merged_lora(model: nn.Module, layers: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    state = {name: _full(t) for name, t in model.get_base_model().state_dict().items()}
    out = []
    for name, tensor in state.items():
        if "lora_" in name:
            continue
        if ".base_layer." in name:
            prefix, leaf = name.split(".base_layer.", 1)
            layer = layers[prefix]
            if leaf in ("weight", "bias"):
                tensor = tensor.clone()
                for adapter in layer.active_adapters:
                    if adapter not in layer.lora_A or adapter in layer.merged_adapters:
                        continue
                    b_name = f"{prefix}.lora_B.{adapter}.{leaf}"
                    if leaf == "bias":  # LoraConfig(lora_bias=True): B's bias, scaled
                        if b_name in state:
                            tensor += (state[b_name].float()
                                       * layer.scaling[adapter]).to(tensor.dtype)
                        continue
                    a = state[f"{prefix}.lora_A.{adapter}.weight"]
                    delta = (state[b_name].float() @ a.float()) * layer.scaling[adapter]
                    if layer.fan_in_fan_out:
                        delta = delta.T
                    tensor += delta.to(tensor.dtype)
            name = f"{prefix}.{leaf}"
        out.append((name, tensor))
    return out


def _merged_by_peft(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = model.get_base_model()
    adapter_names = {f".{part}." for m in base.modules() if isinstance(m, BaseTunerLayer)
                     for part in (*m.adapter_layer_names, *m.other_param_names)
                     if isinstance(getattr(m, part, None), nn.Module)}  # VeRA's shared vera_A
    frozen = {n: p.detach().clone() for n, p in base.named_parameters() if not p.requires_grad}
    with warnings.catch_warnings():  # "unmerge can be inaccurate": the base is restored
        warnings.simplefilter("ignore", UserWarning)
        model.merge_adapter()
        try:
            return [(name.replace(".base_layer.", "."), t.detach().clone())
                    for name, t in base.state_dict().items()
                    if not any(part in name for part in adapter_names)]
        finally:
            model.unmerge_adapter()
            with torch.no_grad():  # undo the rounding of the merge / unmerge round trip
                for n, p in base.named_parameters():
                    if n in frozen:
                        p.copy_(frozen[n])


def checkpoint_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``model``'s weights under the plain model's names (see the module docstring); tied
    tensors appear under each of their names, as in ``state_dict``."""
    if not has_adapters(model):
        return [(name, _full(t)) for name, t in model.state_dict().items()]
    layers = _lora_linear_layers(model)
    if layers is not None:
        return _merged_lora(model, layers)
    return _merged_by_peft(model)
