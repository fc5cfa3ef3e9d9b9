"""HFGenerateEngine(generation_dtype=...): generation on a low-precision copy of the weights,
kept outside the model, shared by the engines built over it, refreshed at every call, and
generating what the cast model generates, inside and outside autocast."""

from __future__ import annotations

import copy
import functools
import gc
import weakref

import pytest
import torch

from maxent_grpo.builtin.catalog import builtin_tiny_model_and_tokenizer
from maxent_grpo.rollout import HFGenerateEngine, SamplingSettings, hf
from maxent_grpo.rollout import generation_copy as gcopy
from tests.rollout.test_hf_engine import FixedLM, render

QUESTIONS = ["12+7", "a much longer question 3*4", "hi"]


@pytest.fixture
def tiny():
    """A fresh tiny model (its weights are changed by some tests) and its tokenizer."""
    return builtin_tiny_model_and_tokenizer()


def prompts(tokenizer) -> list[str]:
    return [render(tokenizer, q) for q in QUESTIONS]


def engine(model, tokenizer, dtype: str = "bfloat16", do_sample: bool = True, **kw):
    sampling = SamplingSettings(max_new_tokens=12, do_sample=do_sample)
    return HFGenerateEngine(model, tokenizer, sampling, generation_dtype=dtype, **kw)


def sample(eng: HFGenerateEngine, tokenizer, seed: int = 0, group: int = 4) -> torch.Tensor:
    torch.manual_seed(seed)
    return eng.generate(prompts(tokenizer), [""] * len(QUESTIONS), group).completion_ids


def copy_of(model) -> torch.nn.Module:
    return gcopy._COPIES[model]


def test_copy_is_low_precision_frozen_and_outside_the_model() -> None:
    model, tokenizer = builtin_tiny_model_and_tokenizer()  # no fixture: it must be freed
    keys, ids = list(model.state_dict()), [id(p) for p in model.parameters()]
    modules = len(list(model.modules()))
    assert model not in gcopy._COPIES
    sample(engine(model, tokenizer), tokenizer)
    twin = copy_of(model)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in twin.parameters())
    assert all(b.dtype == torch.bfloat16 for b in twin.buffers() if b.is_floating_point())
    assert twin.lm_head.weight is twin.model.embed_tokens.weight  # ties kept
    assert not twin.training and twin.device == model.device
    # nothing of the copy is reachable from the model (so neither optimizer nor checkpoint)
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == ids
    assert len(list(model.modules())) == modules
    assert all(m is not twin for m in model.modules())
    source = {p.data_ptr() for p in model.parameters()}
    assert not any(p.data_ptr() in source for p in twin.parameters())
    # and it goes with its model
    alive = weakref.ref(twin)
    del model, twin
    gc.collect()
    assert alive() is None


def test_the_next_call_generates_with_the_changed_weights(tiny) -> None:
    model, tokenizer = tiny
    first = sample(engine(model, tokenizer), tokenizer)
    twin = copy_of(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    stale = [not torch.equal(c, p.to(torch.bfloat16))
             for c, p in zip(twin.parameters(), model.parameters(), strict=True)]
    assert all(stale)
    eng = engine(model, tokenizer)
    second = sample(eng, tokenizer)
    assert copy_of(model) is twin  # refreshed in place, not rebuilt
    for c, p in zip(twin.parameters(), model.parameters(), strict=True):
        assert torch.equal(c, p.to(torch.bfloat16))
    assert not torch.equal(first, second)
    expected = sample(engine(copy.deepcopy(model).to(torch.bfloat16), tokenizer, "model"),
                      tokenizer)
    assert torch.equal(second, expected)
    assert eng.refresh_seconds > 0


def test_engines_built_over_one_model_share_one_copy(tiny, monkeypatch) -> None:
    model, tokenizer = tiny
    builds = []
    real_build = gcopy.build_copy
    monkeypatch.setattr(gcopy, "build_copy", lambda m, d: builds.append(d) or real_build(m, d))
    factory = functools.partial(HFGenerateEngine, generation_dtype="bfloat16")
    copies = []
    for _ in range(3):  # the trainer builds one engine per rollout
        factory(model, tokenizer, SamplingSettings(max_new_tokens=2)).generate(["ab"], ["x"], 2)
        copies.append(copy_of(model))
    assert builds == [torch.bfloat16] and all(c is copies[0] for c in copies)
    sample(engine(model, tokenizer, "float16"), tokenizer)  # another dtype: a new copy
    assert builds == [torch.bfloat16, torch.float16]
    assert next(copy_of(model).parameters()).dtype == torch.float16


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
@pytest.mark.parametrize("options", [{}, {"share_prefill": False},
                                     {"cache": "static", "prompt_bucket": 8}],
                         ids=["shared", "plain-prefill", "static"])
def test_the_copy_generates_what_the_cast_model_generates(tiny, options, autocast) -> None:
    """Greedy and sampled completions equal those of ``model.to(bfloat16)`` itself, also
    inside a bf16 autocast region (as under ``bf16-mixed``); the model is never run."""
    model, tokenizer = tiny
    cast = copy.deepcopy(model).to(torch.bfloat16)
    expected = {s: sample(engine(cast, tokenizer, "model", do_sample=s, **options), tokenizer,
                          group=4 if s else 1) for s in (False, True)}
    sample(engine(model, tokenizer), tokenizer)  # build the copy first
    calls = {"model": 0, "copy": 0}
    hooks = [model.register_forward_pre_hook(lambda *a: calls.__setitem__("model", 1)),
             copy_of(model).register_forward_pre_hook(lambda *a: calls.__setitem__("copy", 1))]
    region = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    try:
        with region:
            got = {s: sample(engine(model, tokenizer, do_sample=s, **options), tokenizer,
                             group=4 if s else 1) for s in (False, True)}
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == {"model": 0, "copy": 1}
    assert torch.equal(got[False], expected[False]) and torch.equal(got[True], expected[True])


def test_model_keeps_todays_behaviour(tiny) -> None:
    model, tokenizer = tiny
    default = HFGenerateEngine(model, tokenizer, SamplingSettings(max_new_tokens=12))
    explicit = engine(model, tokenizer, "model")
    assert torch.equal(sample(default, tokenizer), sample(explicit, tokenizer))
    assert model not in gcopy._COPIES and explicit.refresh_seconds == 0.0


def test_a_model_already_in_the_dtype_generates_as_is(tiny) -> None:
    model, tokenizer = tiny
    model.to(torch.bfloat16)  # bf16-true
    expected = sample(engine(model, tokenizer, "model"), tokenizer)
    assert torch.equal(sample(engine(model, tokenizer), tokenizer), expected)
    assert model not in gcopy._COPIES


def test_refused_where_a_copy_cannot_work(tiny, monkeypatch) -> None:
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="generation_dtype must be one of 'model', 'bfloat16', "
                                         "'float16'; got 'fp8'"):
        engine(model, tokenizer, "fp8")
    with pytest.raises(ValueError, match="FixedLM cannot be copied.*generation_dtype: model"):
        engine(FixedLM([[5, 2]]), tokenizer)
    monkeypatch.setattr(model.lm_head.weight, "ds_id", 0, raising=False)  # ZeRO-3, 1 process
    with pytest.raises(ValueError, match="sharded across ranks.*generation_dtype: model"):
        engine(model, tokenizer)
    monkeypatch.delattr(model.lm_head.weight, "ds_id")
    engine(model, tokenizer)
    monkeypatch.setattr(hf, "sharded_across_ranks", lambda m: True)
    engine(model, tokenizer, "model")  # the model itself still works when sharded


def test_a_lora_model_generates_on_a_copy_with_its_adapters(tiny) -> None:
    peft = pytest.importorskip("peft")
    from maxent_grpo.adapters import apply_peft

    base, tokenizer = tiny
    without = sample(engine(copy.deepcopy(base).to(torch.bfloat16), tokenizer, "model"),
                     tokenizer)
    model = apply_peft(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                             target_modules=["q_proj", "v_proj"]))
    sample(engine(model, tokenizer), tokenizer)
    twin = copy_of(model)
    assert type(twin) is type(model)
    torch.manual_seed(2)
    with torch.no_grad():  # the adapters move (B starts at zero); the copy must follow
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 1.0)
    got = sample(engine(model, tokenizer), tokenizer)
    assert copy_of(model) is twin
    trainable = dict(model.named_parameters())
    for name, p in twin.named_parameters():
        assert torch.equal(p, trainable[name].to(torch.bfloat16)) and not p.requires_grad
    expected = sample(engine(copy.deepcopy(model).to(torch.bfloat16), tokenizer, "model"),
                      tokenizer)
    assert torch.equal(got, expected)
    assert not torch.equal(got, without)  # the adapters are in use


def test_bf16_mixed_training_generates_on_the_copy(tmp_path) -> None:
    """Under Lightning's ``bf16-mixed`` (generation inside autocast), two steps with a bf16
    generation copy: the copy is built once and refreshed at each rollout, the policy stays
    float32, and nothing of the copy reaches the module's state or its checkpoint."""
    from tests.conftest import fit, make_data, make_module

    cache_dir = str(tmp_path / "models")
    builds: list[torch.dtype] = []
    real_build = gcopy.build_copy
    factory = functools.partial(HFGenerateEngine, generation_dtype="bfloat16")
    module = make_module(cache_dir, engine=factory,
                         rewards={"tests.conftest:alternating": 1.0})
    module.configure_model()
    keys = list(module.state_dict())
    refreshed: list[float] = []
    real_generate = HFGenerateEngine.generate

    def generate(self, *args):
        out = real_generate(self, *args)
        refreshed.append(self.refresh_seconds)
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gcopy, "build_copy", lambda m, d: builds.append(d) or real_build(m, d))
        patch.setattr(HFGenerateEngine, "generate", generate)
        trainer = fit(module, make_data(cache_dir), steps=2, precision="bf16-mixed",
                      tmp_path=tmp_path)
    assert trainer.global_step == 2 and builds == [torch.bfloat16]
    assert len(refreshed) == 2 and refreshed[0] == 0.0 and refreshed[1] > 0  # built, refreshed
    twin = copy_of(module.policy)
    assert next(twin.parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in module.policy.parameters())
    assert list(module.state_dict()) == keys
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    assert list(saved) == keys


def teacher_forced(model, out, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """``(N, T)`` log-probs of ``out``'s completions under ``model`` in one forward pass,
    after temperature, top-k and top-p (transformers' own warpers)."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    attention = torch.cat([out.prompt_mask, out.completion_mask], 1).long()
    T = out.completion_ids.shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention,
                       position_ids=(attention.cumsum(-1) - 1).clamp(min=0)).logits
    flat = (logits[:, -T - 1 : -1].float() / temperature).reshape(-1, logits.shape[-1])
    if top_k:
        flat = TopKLogitsWarper(top_k)(None, flat)
    if top_p < 1.0:
        flat = TopPLogitsWarper(top_p)(None, flat)
    logps = torch.log_softmax(flat, -1).reshape(*out.completion_ids.shape, -1)
    return logps.gather(-1, out.completion_ids[..., None]).squeeze(-1)


@pytest.mark.parametrize("warpers", [{}, {"top_k": 20, "top_p": 0.9}], ids=["T", "T-k-p"])
def test_the_copy_reports_the_log_probs_it_sampled_with(tiny, warpers) -> None:
    """Sampling from a copy, the engine reports the copy's log-prob of each drawn token
    after temperature, top-k and top-p (as the vLLM engines do): the draws are those of the
    cast model itself, and the values its teacher-forced ones to bf16 rounding (a token
    near the nucleus edge moves more). The model itself, and greedy decoding, report none."""
    model, tokenizer = tiny
    sampling = SamplingSettings(max_new_tokens=12, temperature=0.7, **warpers)
    cast = copy.deepcopy(model).to(torch.bfloat16)

    def draw(m, dtype):
        torch.manual_seed(0)
        return HFGenerateEngine(m, tokenizer, sampling, generation_dtype=dtype).generate(
            prompts(tokenizer), [""] * len(QUESTIONS), 4)

    out, itself = draw(model, "bfloat16"), draw(cast, "model")
    assert torch.equal(out.completion_ids, itself.completion_ids)
    assert itself.sampler_logps is None and itself.batch.grouped_ref_meta is None
    mask = out.completion_mask
    assert out.sampler_logps.shape == mask.shape and (out.sampler_logps[~mask] == 0).all()
    gap = (out.sampler_logps - teacher_forced(cast, out, 0.7, **warpers))[mask].abs()
    assert gap.max() < (0.01 if not warpers else 0.2) and gap.mean() < 0.01
    assert torch.isfinite(out.sampler_logps).all()
    sums = [v for group in out.batch.grouped_ref_meta for v in group]
    torch.testing.assert_close(torch.tensor(sums), out.sampler_logps.sum(-1))
    greedy = engine(model, tokenizer, do_sample=False)
    assert greedy.generate(prompts(tokenizer), [""] * 3, 1).sampler_logps is None


def test_a_continuation_from_the_copy_reports_its_log_probs(tiny) -> None:
    """The next turn of a multi-turn rollout: each continuation's log-probs, cut where it
    is (at its budget or its stop token)."""
    model, tokenizer = tiny
    sampling = SamplingSettings(max_new_tokens=12, temperature=0.7)
    eng = HFGenerateEngine(model, tokenizer, sampling, generation_dtype="bfloat16")
    sequences = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts(tokenizer)]
    torch.manual_seed(0)
    got = eng.continue_ids(sequences, [12, 5, 9], sampling)
    for turn, budget in zip(got, [12, 5, 9], strict=True):
        assert len(turn.logps) == len(turn.ids) <= budget
        assert all(v <= 0 and v == v for v in turn.logps)
    own = HFGenerateEngine(model, tokenizer, sampling).continue_ids(sequences, [4] * 3, sampling)
    assert all(turn.logps is None for turn in own)


def test_a_rollouts_later_turns_reuse_the_copy_its_first_turn_refreshed(tiny) -> None:
    """A multi-turn rollout copied every weight into the bf16 copy at every turn; the
    weights cannot change inside one rollout, so only ``generate`` (its first turn)
    refreshes it."""
    model, tokenizer = tiny
    eng = engine(model, tokenizer)
    sample(eng, tokenizer)
    twin = copy_of(model)
    before = [p.clone() for p in twin.parameters()]
    with torch.no_grad():  # a change the next turn must not copy (none happens in a rollout)
        for p in model.parameters():
            p.add_(1.0)
    sequences = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts(tokenizer)]
    refreshed = eng.refresh_seconds  # the rollout's refresh, kept through its turns
    eng.continue_ids(sequences, [3] * 3, eng.sampling)
    assert copy_of(model) is twin and eng.refresh_seconds == refreshed
    assert all(torch.equal(a, b) for a, b in zip(before, twin.parameters(), strict=True))
    sample(eng, tokenizer)  # the next rollout's first turn
    assert all(torch.equal(c, p.to(torch.bfloat16))
               for c, p in zip(twin.parameters(), model.parameters(), strict=True))
    with torch.no_grad():  # weights changed and the engine told (sync): a turn refreshes
        for p in model.parameters():
            p.add_(1.0)
    eng.sync(model)
    eng.continue_ids(sequences, [3] * 3, eng.sampling)
    assert all(torch.equal(c, p.to(torch.bfloat16))
               for c, p in zip(twin.parameters(), model.parameters(), strict=True))
