"""The scorer's fused LM head (``model.fused_lm_head``) against its logits path on the tiny
offline model: the same log-probs, entropies and parameter gradients; models it cannot
serve are refused (policy, ``true``) or scored through their logits (frozen models, auto)."""

from __future__ import annotations

import copy

import pytest
import torch

from maxent_grpo.builtin.catalog import builtin_tiny_model_and_tokenizer
from maxent_grpo.training.step.token_logps import Scorer, fused_head_parts
from maxent_grpo.training.types import BatchingSettings
from tests.conftest import fit, make_data, make_module, params

UNBOUNDED = BatchingSettings(logprob_chunk_size=None, score_slice=None)


def fused(scorer: Scorer, model) -> bool:
    """Whether ``scorer`` decided to score ``model`` through the fused head."""
    return isinstance(scorer._heads.get(model), tuple)


@pytest.fixture()
def model():
    torch.manual_seed(0)
    model = builtin_tiny_model_and_tokenizer()[0].train()
    with torch.no_grad():  # a trained-looking head: logits of a few nats, not ~0
        model.lm_head.weight.mul_(20.0)
    return model


def batch(model, n=4, prompt=6, T=5):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (n, prompt + T), generator=gen)
    attention = torch.ones_like(ids)
    attention[0, :3] = 0  # left padding, as the engine writes it
    attention[2, :1] = 0
    mask = torch.ones(n, T, dtype=torch.bool)
    mask[1, 3:] = False
    return ids, attention, mask


def scores_and_grads(scorer, model, ids, attention, mask):
    model.zero_grad(set_to_none=True)
    scores, entropy = scorer.policy_scores(model, ids, attention, mask, None, True)
    weights = torch.linspace(-1.0, 1.0, mask.numel()).view_as(mask)
    (weights * scores.token_logp + 0.3 * entropy).sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return scores.token_logp.detach(), entropy.detach(), grads


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_policy_scores_and_gradients_equal_the_logits_path(model, temperature):
    ids, attention, mask = batch(model)
    scorer = Scorer(temperature, UNBOUNDED, fused_head=True)
    plain = Scorer(temperature, UNBOUNDED, fused_head=False)
    got = scores_and_grads(scorer, model, ids, attention, mask)
    want = scores_and_grads(plain, model, ids, attention, mask)
    assert fused(scorer, model)  # the fused path ran
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert got[2].keys() == want[2].keys() and "model.embed_tokens.weight" in got[2]  # tied
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-6)
    assert want[0].std() > 0.5  # log-probs that vary: the comparison means something


def test_frozen_log_probs_agree_over_micro_batches(model):
    ids, attention, mask = batch(model)
    T = mask.shape[1]
    on, plain = (Scorer(1.0, BatchingSettings(logprob_chunk_size=2, score_slice=None), f)
                 for f in (True, False))
    chunks = on.plan(attention[:, :-T].bool(), mask, 2)
    assert len(chunks) == 2
    torch.testing.assert_close(on.frozen_logps(model, ids, attention, T, chunks),
                               plain.frozen_logps(model, ids, attention, T, chunks),
                               rtol=1e-5, atol=1e-5)


def test_under_bf16_autocast_the_check_keeps_the_fused_head(model):
    """bf16 rounding of the logits is well within the first-call check's tolerance."""
    ids, attention, mask = batch(model)
    on, plain = Scorer(0.7, UNBOUNDED, True), Scorer(0.7, UNBOUNDED, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = on.token_logps(model, ids, attention, mask.shape[1], True, policy=True)
        want = plain.token_logps(model, ids, attention, mask.shape[1], True, policy=True)
    assert fused(on, model)
    assert (got[0] - want[0]).abs().mean() < 0.1  # bf16 rounding of logits of ~10 nats
    assert (got[1] - want[1]).abs().mean() < 0.1


def test_auto_fuses_on_cuda_only(model):
    ids, attention, mask = batch(model)
    scorer = Scorer(1.0, UNBOUNDED)  # model.fused_lm_head: null
    scorer.token_logps(model, ids, attention, mask.shape[1], False, policy=True)
    assert scorer._heads[model] is None  # the CPU keeps the logits path
    off = Scorer(1.0, UNBOUNDED, fused_head=False)
    off.token_logps(model, ids, attention, mask.shape[1], False, policy=True)
    assert model not in off._heads  # never even considered


def test_a_logit_transform_in_the_config_is_never_fused(model):
    model.config.final_logit_softcapping = 30.0
    reason = fused_head_parts(model)
    assert isinstance(reason, str) and "final_logit_softcapping" in reason
    ids, attention, mask = batch(model)
    with pytest.raises(ValueError, match="model.fused_lm_head is true.*final_logit_softcapping"):
        Scorer(1.0, UNBOUNDED, True).policy_scores(model, ids, attention, mask, None, False)
    scorer = Scorer(1.0, UNBOUNDED, True)  # a frozen model falls back quietly
    scorer.token_logps(model, ids, attention, mask.shape[1], False)
    assert not fused(scorer, model)
    # scored first as a frozen model (behaviour log-probs), the policy is still refused
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        scorer.policy_scores(model, ids, attention, mask, None, False)


def test_a_model_whose_logits_change_after_the_head_is_caught_by_the_check(model):
    """No config field announces this transform; one row's logits formed both ways show
    it."""
    def triple(module, args, kwargs, output):
        output.logits = output.logits * 3.0
        return output

    model.register_forward_hook(triple, with_kwargs=True)
    ids, attention, mask = batch(model)
    assert not isinstance(fused_head_parts(model), str)  # structurally it looks fusable
    with pytest.raises(ValueError, match="differs from LlamaForCausalLM's logits"):
        Scorer(1.0, UNBOUNDED, True).policy_scores(model, ids, attention, mask, None, False)
    scorer = Scorer(1.0, UNBOUNDED, True)
    with pytest.warns(UserWarning, match="scoring this model through its logits"):
        got = scorer.token_logps(model, ids, attention, mask.shape[1], False)[0]
    want = Scorer(1.0, UNBOUNDED, False).token_logps(model, ids, attention, mask.shape[1],
                                                      False)[0]
    torch.testing.assert_close(got, want)  # scored through the (tripled) logits


def test_a_decoder_that_cannot_run_alone_is_named(model):
    def refuse(*args, **kwargs):
        raise TypeError("unexpected keyword argument 'position_ids'")

    model.model.forward = refuse  # calling the decoder fails
    ids, attention, mask = batch(model)
    with pytest.raises(ValueError, match="decoder could not be run on its own.*position_ids"):
        Scorer(1.0, UNBOUNDED, True).policy_scores(model, ids, attention, mask, None, False)


def test_heads_that_are_not_a_plain_linear_are_not_fused(model):
    other = copy.deepcopy(model)
    other.lm_head = torch.nn.Linear(64, model.config.vocab_size, bias=True)
    assert "with a bias" in fused_head_parts(other)
    assert "not a transformers causal LM" in fused_head_parts(torch.nn.Linear(2, 2))


def test_lora_policy_fuses_and_its_reference_uses_the_logits(model):
    peft = pytest.importorskip("peft")
    from maxent_grpo.adapters import AdapterDisabledReference

    policy = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that change the output
    ids, attention, mask = batch(model)
    got = scores_and_grads(Scorer(0.7, UNBOUNDED, True), policy, ids, attention, mask)
    want = scores_and_grads(Scorer(0.7, UNBOUNDED, False), policy, ids, attention, mask)
    assert got[2].keys() == want[2].keys() and all("lora_" in k for k in got[2])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-6)
    reference = AdapterDisabledReference(policy)
    assert "no get_output_embeddings/get_decoder" in fused_head_parts(reference)
    scorer = Scorer(0.7, UNBOUNDED, True)
    scorer.frozen_logps(reference, ids, attention, mask.shape[1],
                        scorer.plan(attention[:, :-mask.shape[1]].bool(), mask, 4))
    assert not fused(scorer, reference) and "get_decoder" in scorer._heads[reference]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


def test_a_training_step_with_the_fused_head_equals_one_without(cache_dir):
    from maxent_grpo.objectives import GRPO

    results = []
    for on in (True, False):
        module = make_module(cache_dir, fused_lm_head=on, objective=GRPO(beta=0.1),
                             rewards={"tests.conftest:alternating": 1.0})
        fit(module, make_data(cache_dir), steps=1)
        results.append(params(module))
        assert fused(module.scorer, module.policy) == on
        # the reference (a separate frozen copy) was scored through the fused head too
        assert fused(module.scorer, module.reference) == on
    for key in results[0]:
        torch.testing.assert_close(results[0][key], results[1][key], atol=1e-6, rtol=1e-5)
    fresh = make_module(cache_dir)
    fresh.configure_model()  # the weights before the step, to see that the step moved them
    start = params(fresh)
    assert max((results[0][k] - start[k]).abs().max() for k in start) > 1e-3


def test_the_option_is_checked(cache_dir):
    with pytest.raises(ValueError, match="model.fused_lm_head must be true or false"):
        make_module(cache_dir, fused_lm_head="yes")
