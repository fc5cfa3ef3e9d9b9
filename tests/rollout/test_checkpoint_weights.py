"""``rollout.weights.checkpoint_weights``: what the vLLM engine loads after every optimizer
step. No vLLM needed: the tensors are compared with peft's own merge of a copy, and the
training model must come out bit for bit as it went in (peft's merge / unmerge round trip
does not: it moves the frozen base weights, which are the reference model)."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import IA3Config, LoraConfig, VeraConfig, get_peft_model

from maxent_grpo.builtin.catalog import build_tiny_model
from maxent_grpo.rollout.weights import check_mergeable, checkpoint_weights


def _moved(model: torch.nn.Module) -> torch.nn.Module:
    """The adapters' trainable tensors set to random values (LoRA's B starts at zero)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def test_a_plain_model_is_its_state_dict():
    model = build_tiny_model()
    weights = checkpoint_weights(model)
    state = model.state_dict()
    assert [n for n, _ in weights] == list(state)
    assert all(torch.equal(t, state[n]) for n, t in weights)


@pytest.mark.parametrize("config", [
    LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
    LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_rslora=True),
    IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
    VeraConfig(r=8, target_modules=["q_proj", "o_proj"]),  # its shared vera_A/B were handed
], ids=["lora", "rslora", "ia3", "vera"])
def test_adapters_are_merged_as_peft_merges_them_and_the_model_is_left_untouched(config):
    policy = _moved(get_peft_model(build_tiny_model(), config))
    before = _state(policy)
    expected = copy.deepcopy(policy).merge_and_unload().state_dict()
    for _ in range(5):  # as after five optimizer steps
        weights = dict(checkpoint_weights(policy))
    assert list(weights) == list(expected)  # the plain model's names, no adapter tensors
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-6, atol=1e-6, msg=name)
    # the merged weights differ from the base: the adapters count
    assert any(not torch.equal(weights[n], t) for n, t in build_tiny_model().state_dict().items())
    after = policy.state_dict()
    changed = [n for n, t in before.items() if not torch.equal(t, after[n])]
    assert changed == [], changed  # bit for bit, base weights included
    assert not any(getattr(m, "merged", False) for m in policy.modules())


def test_the_merge_and_unmerge_round_trip_would_have_moved_the_base():
    """Why checkpoint_weights does not call merge_adapter / unmerge_adapter on LoRA."""
    policy = _moved(get_peft_model(
        build_tiny_model(), LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj"])))
    before = _state(policy)
    for _ in range(5):
        policy.merge_adapter()
        policy.unmerge_adapter()
    after = policy.state_dict()
    assert any(not torch.equal(t, after[n]) for n, t in before.items() if "base_layer" in n)


def test_what_cannot_be_merged_is_refused_naming_model_peft():
    saved = get_peft_model(build_tiny_model(), LoraConfig(
        r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match="model.peft: modules_to_save"):
        check_mergeable(saved, sharded=False)
    tokens = get_peft_model(build_tiny_model(), LoraConfig(
        r=4, target_modules=["q_proj"], trainable_token_indices=[5, 6]))
    with pytest.raises(ValueError, match="model.peft: trainable_token_indices"):
        check_mergeable(tokens, sharded=False)  # vLLM was handed token_adapter tensors
    ia3 = get_peft_model(build_tiny_model(), IA3Config(target_modules=["k_proj"],
                                                       feedforward_modules=[]))
    check_mergeable(ia3, sharded=False)  # merged by peft, the base restored
    with pytest.raises(ValueError, match="model.peft: with the vLLM engine and a sharded"):
        check_mergeable(ia3, sharded=True)
    lora = get_peft_model(build_tiny_model(), LoraConfig(r=4, target_modules=["q_proj"]))
    check_mergeable(lora, sharded=True)


def _biased_model() -> torch.nn.Module:
    """The tiny model with biases on its attention projections (as Qwen2 has)."""
    from transformers import LlamaForCausalLM

    tiny = build_tiny_model()
    config = copy.deepcopy(tiny.config)
    config.attention_bias = True
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_a_lora_bias_is_folded_into_the_base_bias():
    """``LoraConfig(lora_bias=True)`` trains a bias on ``lora_B``: the plain model loaded
    with the checkpoint gives the policy's logits (dropping it measured a gap of 10.6)."""
    from transformers import LlamaForCausalLM

    policy = _moved(get_peft_model(_biased_model(), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_bias=True)))
    assert any("lora_B" in n and n.endswith(".bias") for n, _ in policy.named_parameters())
    weights = dict(checkpoint_weights(policy))
    plain = LlamaForCausalLM(policy.get_base_model().config).eval()
    missing, unexpected = plain.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    ids = torch.tensor([[5, 9, 14, 3, 7, 11]])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, policy(ids).logits, rtol=1e-4, atol=1e-4)
        expected = copy.deepcopy(policy).merge_and_unload().state_dict()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-6, atol=1e-6, msg=name)


def test_a_lora_bias_on_layers_without_a_bias_is_refused():
    """With no base bias to fold it into, ``lora_B``'s bias was dropped from the weights
    vLLM loads (a hunt measured a log-prob gap of 1.07 nats a token after two steps): refused;
    where the layers have biases it is folded in (the test above)."""
    policy = get_peft_model(build_tiny_model(), LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], lora_bias=True))
    with pytest.raises(ValueError, match="the weights vLLM loads: model.peft's lora_bias trains "
                                         "a bias on layers that have none .*q_proj"):
        check_mergeable(policy, sharded=False)
    check_mergeable(get_peft_model(_biased_model(), LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], lora_bias=True)), sharded=False)


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_adapters_on_tied_embeddings_are_refused(target):
    policy = get_peft_model(build_tiny_model(), LoraConfig(r=4, target_modules=[target]))
    with pytest.raises(ValueError, match="model.peft: adapters on the tied embeddings"):
        check_mergeable(policy, sharded=False)


def test_a_sharded_models_tied_embeddings_are_saved_once(tmp_path):
    """FSDP2's gathered state dict held the tied embeddings and head as two tensors, so
    ``HFExport`` under FSDP2 wrote ``lm_head.weight`` beside ``embed_tokens`` (one process
    writes the embedding once): the head's name now holds the embedding's one tensor, as a
    model on one process gives ``save_pretrained``."""
    import datetime

    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from maxent_grpo.rollout.weights import sharded_state_dict

    dist = torch.distributed
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        model = build_tiny_model()
        assert model.lm_head.weight is model.get_input_embeddings().weight
        plain = _state(model)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        whole = sharded_state_dict(model)
    finally:
        dist.destroy_process_group()
    assert whole.keys() == plain.keys()
    assert all(torch.equal(whole[n], plain[n]) for n in plain)
    assert whole["lm_head.weight"] is whole["model.embed_tokens.weight"]
    build_tiny_model().save_pretrained(tmp_path / "out", state_dict=whole)
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
