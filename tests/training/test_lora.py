"""LoRA through ``model.peft`` on the tiny offline model: only the adapters train, the
reference is the policy with its adapters off (exactly the base model, no second copy),
gradient checkpointing and bf16-mixed compose, bad configs are refused when the module is
built, and HFExport writes the adapter (naming its ``builtin:`` base) and, on request, the
merged model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

peft = pytest.importorskip("peft")

from maxent_grpo.adapters import AdapterDisabledReference  # noqa: E402
from maxent_grpo.models import load_policy, load_reference, load_tokenizer  # noqa: E402
from maxent_grpo.objectives import GRPO  # noqa: E402
from maxent_grpo.training.callbacks import HFExport  # noqa: E402
from tests.conftest import fit, make_data, make_module, params  # noqa: E402

ALTERNATING = {"tests.conftest:alternating": 1.0}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


def lora(**kw) -> peft.LoraConfig:
    opts = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    opts.update(kw)
    return peft.LoraConfig(**opts)


def lora_module(cache_dir: str, **kw):
    opts = dict(objective=GRPO(beta=0.1), rewards=ALTERNATING, peft=lora())
    opts.update(kw)
    return make_module(cache_dir, **opts)


def adapter_names(module) -> set[str]:
    return {n for n, p in module.policy.named_parameters() if p.requires_grad}


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    return {k for k, v in after.items() if not torch.equal(v, before[k])}


def logps(module, model) -> torch.Tensor:
    """``model``'s token log-probs of the last step's rows (as ``collect`` scores them)."""
    t = module.trajectory
    return module.scorer.frozen_logps(model, t.input_ids, t.attention, t.mask.shape[1], t.chunks)


def test_only_the_adapters_train_and_the_reference_is_the_base_model(cache_dir):
    module = lora_module(cache_dir)
    module.configure_model()
    names = adapter_names(module)
    assert len(names) == 8 and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert [id(p) for p in module.trainable_parameters()] == [
        id(p) for n, p in module.policy.named_parameters() if n in names]
    # the reference is the policy with its adapters off: no weights of its own
    assert isinstance(module.reference, AdapterDisabledReference)
    assert module.reference.policy is module.policy
    assert list(module.reference.parameters()) == [] and module.reference.state_dict() == {}
    assert not any(k.startswith("reference") for k in module.state_dict())
    before = params(module)

    trainer = fit(module, make_data(cache_dir))
    assert trainer.global_step == 2 and "train/kl" in trainer.callback_metrics
    assert changed(before, params(module)) == names  # every adapter moved, nothing else
    assert module.policy.training  # the reference's eval mode did not stick
    # AdamW-like state (none here: SGD) aside, nothing outside the adapters has a gradient
    assert all(p.grad is None for n, p in module.policy.named_parameters() if n not in names)

    # the reference log-probs collect used are the base model's, loaded separately
    base = load_reference("builtin:tiny", cache_dir=cache_dir)
    expected = logps(module, base)
    ref = module.trajectory.ref_logps
    torch.testing.assert_close(ref, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(logps(module, module.reference), expected, rtol=0, atol=1e-6)
    # ... while the trained policy's differ
    mask = module.trajectory.mask
    assert float(((logps(module, module.policy) - expected).abs() * mask).max()) > 1e-4


def test_adamw_keeps_state_for_the_adapters_only(cache_dir):
    module = lora_module(cache_dir, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    trainer = fit(module, make_data(cache_dir), steps=1)
    optimizer = trainer.optimizers[0]
    adapters = {id(p) for p in module.trainable_parameters()}
    assert {id(p) for p in optimizer.state} == adapters


def test_the_optimizer_holds_only_the_adapters(cache_dir):
    module = lora_module(cache_dir)
    trainer = fit(module, make_data(cache_dir), steps=1)
    held = [id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]]
    assert held == [id(p) for p in module.trainable_parameters()]


def test_gradient_checkpointing_gives_the_same_update(cache_dir):
    results = []
    for checkpointing in (False, True):
        module = lora_module(cache_dir, gradient_checkpointing=checkpointing)
        module.configure_model()
        assert any(getattr(m, "gradient_checkpointing", False)  # any transformers 5 version
                   for m in module.policy.get_base_model().modules()) == checkpointing
        before = params(module)
        fit(module, make_data(cache_dir))
        after = params(module)
        assert changed(before, after) == adapter_names(module)
        results.append(after)
    for key, value in results[0].items():
        torch.testing.assert_close(results[1][key], value, rtol=1e-5, atol=1e-6)


def test_bf16_mixed_trains_float32_adapters(cache_dir):
    module = lora_module(cache_dir)
    module.configure_model()
    before = params(module)
    trainer = fit(module, make_data(cache_dir), steps=1, precision="bf16-mixed")
    assert trainer.global_step == 1
    assert changed(before, params(module)) == {
        n for n in adapter_names(module) if ".lora_B." in n}  # A's gradient is 0 while B = 0
    assert all(p.dtype == torch.float32 for p in module.trainable_parameters())


@pytest.mark.parametrize(
    "config, message",
    [
        (lambda: peft.LoraConfig(task_type="SEQ_CLS"), "task_type must be CAUSAL_LM"),
        (lambda: peft.LoraConfig(inference_mode=True), "inference_mode must be false"),
        (lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2),
         "prompt-learning method"),
        (lambda: {"r": 4}, "model.peft must be a peft config"),
        # `model.peft: {}` in YAML builds this (it failed inside peft: "KeyError ... a bug")
        (lambda: peft.PeftConfig(), "PeftConfig names no method"),
        # PiSSA subtracts its adapters' start from the base: the KL's reference (adapters
        # off) was another model (a hunt: KL 5.1 at step 0), the exported adapter too
        (lambda: peft.LoraConfig(init_lora_weights="pissa_niter_4"),
         "init_lora_weights 'pissa_niter_4' rewrites the base weights"),
        (lambda: peft.LoraConfig(init_lora_weights="olora"), "'olora' rewrites the base"),
        # trained as a fixed-rank adapter of init_r without a word (a hunt)
        (lambda: peft.AdaLoraConfig(init_r=6, target_r=2, total_step=4),
         "AdaLoRA needs its rank allocation"),
    ],
    ids=["task_type", "inference_mode", "prompt_tuning", "dict", "bare_peft_config", "pissa",
         "olora", "adalora"],
)
def test_configs_that_cannot_train_are_refused_when_built(cache_dir, config, message):
    with pytest.raises(ValueError, match=message):
        lora_module(cache_dir, peft=config())


def test_a_lora_bias_on_layers_without_one_is_refused_where_it_would_be_merged(
        cache_dir, tmp_path):
    """It trained, then HFExport's merged export at the end crashed ("a bug in maxent_grpo"),
    and its adapter folder could not be loaded as a model (a LoRA hunt): refused before
    training, and where a folder is loaded; an adapter of its own still trains."""
    from maxent_grpo.models import load_policy

    module = lora_module(cache_dir, peft=lora(lora_bias=True))
    export = HFExport(dirpath=str(tmp_path / "hf"), merged=True)
    with pytest.raises(ValueError, match=r"HFExport\(merged=true\): model.peft's lora_bias "
                                         r"trains a bias on layers that have none .*q_proj"):
        fit(module, make_data(cache_dir), callbacks=[export])
    assert module._trainer.global_step == 0 and not (tmp_path / "hf" / "final").exists()
    module = lora_module(cache_dir, peft=lora(lora_bias=True))
    fit(module, make_data(cache_dir), callbacks=[HFExport(dirpath=str(tmp_path / "hf"))])
    with pytest.raises(ValueError, match=r"loading the adapter .*final as a model: .*"
                                         r"PeftModel.from_pretrained"):
        load_policy(str(tmp_path / "hf" / "final"), cache_dir=cache_dir)


def test_a_resume_with_another_bias_or_loha_alpha_is_refused():
    """Another ``bias`` failed in the optimizer's restore, naming no option; LoHa's ``alpha``
    (LoKr's too) was not compared: the resumed run computed with another scale, unsaid."""
    from maxent_grpo.adapters import check_saved_adapters, peft_record

    with pytest.raises(ValueError, match="bias: 'all' in the checkpoint, 'none' now"):
        check_saved_adapters(peft_record(lora(bias="all")), lora(), fitting=True)
    check_saved_adapters(peft_record(lora(bias="all")), lora())  # evaluated: the same weights
    loha = dict(r=4, alpha=8, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="alpha: 8 in the checkpoint, 800 now"):
        check_saved_adapters(peft_record(peft.LoHaConfig(**loha)),
                             peft.LoHaConfig(**{**loha, "alpha": 800}))
    check_saved_adapters(peft_record(peft.LoHaConfig(**loha)), peft.LoHaConfig(**loha))


def test_target_modules_that_match_nothing_are_named(cache_dir):
    module = lora_module(cache_dir, peft=lora(target_modules=["no_such_proj"]))
    with pytest.raises(ValueError, match="no_such_proj"):
        module.configure_model()


def test_hf_export_writes_the_adapter_and_the_merged_model(cache_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    export = HFExport(dirpath=str(tmp_path / "hf"), merged=True)
    module = lora_module(cache_dir)
    fit(module, make_data(cache_dir), callbacks=[export])
    policy_logps = logps(module, module.policy)
    adapter, merged = tmp_path / "hf" / "final", tmp_path / "hf" / "final-merged"
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").is_file()
    assert not (adapter / "model.safetensors").exists()  # the adapter only
    assert (merged / "model.safetensors").is_file() and (merged / "tokenizer.json").is_file()

    # the merged model is the trained policy, and the policy was not merged in place
    plain = AutoModelForCausalLM.from_pretrained(merged)
    assert not any("lora" in n for n, _ in plain.named_parameters())
    torch.testing.assert_close(logps(module, plain), policy_logps, rtol=0, atol=1e-5)
    assert len(adapter_names(module)) == 8
    torch.testing.assert_close(logps(module, module.policy), policy_logps, rtol=0, atol=0)
    # the adapter names its base as the run did (builtin:tiny, not this machine's cache
    # folder, which peft's AutoPeftModelForCausalLM would need) and load_policy merges it
    # into that base (tests/training/test_export.py: on a machine without the cache too)
    import json

    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "builtin:tiny"
    loaded = load_policy(str(adapter), cache_dir=cache_dir)
    torch.testing.assert_close(logps(module, loaded), policy_logps, rtol=0, atol=1e-5)
    # loading the adapter leaves the random stream where loading the merged model does
    # (peft draws an initialisation before loading: predict sampled otherwise, a defect hunt)
    draws = []
    for folder in (adapter, merged):
        torch.manual_seed(0)
        load_policy(str(folder), cache_dir=cache_dir)
        draws.append(torch.rand(1))
    assert torch.equal(draws[0], draws[1])
    # and a merged export leaves the run's stream as it was (it sampled otherwise after)
    from maxent_grpo.adapters import merged_copy

    base = load_policy("builtin:tiny", cache_dir=cache_dir)
    torch.manual_seed(0)
    merged_copy(module.policy, base)
    assert torch.equal(torch.rand(1), draws[0])
    # peft's save_pretrained alone writes no tokenizer: the base's is loaded
    alone = tmp_path / "alone"
    alone.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (alone / name).write_bytes((adapter / name).read_bytes())
    assert load_tokenizer(str(alone), cache_dir=cache_dir)("12+30").input_ids == \
        module.tokenizer("12+30").input_ids


def test_a_peft_bias_that_trains_the_base_is_refused_with_a_reference(cache_dir):
    """With ``bias: all`` the base model's biases train, and the reference (the policy with
    its adapters disabled) moved with them: the KL was to a moving model."""
    with pytest.raises(ValueError, match="model.peft.bias: all trains the base model's biases"):
        lora_module(cache_dir, peft=lora(bias="all")).configure_model()
    lora_module(cache_dir, peft=lora(bias="all"), objective=GRPO(beta=0.0)).configure_model()


def test_merged_is_ignored_without_adapters(cache_dir, tmp_path):
    from maxent_grpo.models import load_tokenizer

    module = SimpleNamespace(runtime=SimpleNamespace(
        model=load_policy("builtin:tiny", cache_dir=cache_dir),
        tokenizer=load_tokenizer("builtin:tiny", cache_dir=cache_dir),
    ))
    trainer = SimpleNamespace(is_global_zero=True)
    out = HFExport(dirpath=str(tmp_path / "hf"), merged=True).export(trainer, module, "final")
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["final"]


def test_a_controller_that_requires_the_reference_gets_the_adapter_free_one(cache_dir):
    module = lora_module(cache_dir, objective=GRPO(beta=0.0))
    module.configure_model()
    assert module.reference is None  # beta = 0: nothing needs it
    module.require_reference()  # what a BetaController does
    assert isinstance(module.reference, AdapterDisabledReference)
    assert len(adapter_names(module)) == 8  # .to() / eval() on it never touch the adapters


def test_the_cli_builds_the_lora_config_from_yaml(monkeypatch, tmp_path, capsys):
    """``configs/tiny_lora.yaml``: jsonargparse builds ``peft.LoraConfig`` from its
    ``class_path``, without peft's loftq warning, and ``--print_config`` reads back."""
    import sys
    import warnings
    from pathlib import Path

    from maxent_grpo.cli import main

    monkeypatch.setattr(sys, "argv", ["maxent_grpo"])
    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny_lora.yaml"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = main(["--config", str(config)], run=False)
    assert not [w for w in caught if "loftq" in str(w.message)]
    lora_config = cli.model.source.peft
    assert isinstance(lora_config, peft.LoraConfig)
    assert (lora_config.r, lora_config.lora_alpha, lora_config.target_modules) == (
        8, 16, "all-linear")
    assert lora_config.loftq_config is None and lora_config.task_type is None
    assert "peft" not in cli.model.hparams  # a config object, kept out of the checkpoint

    def printed(path) -> str:
        with pytest.raises(SystemExit):
            main(["fit", "--config", str(path), "--print_config"])
        return capsys.readouterr().out

    first = printed(config)
    assert "class_path: peft.LoraConfig" in first
    (tmp_path / "printed.yaml").write_text(first)
    assert printed(tmp_path / "printed.yaml") == first


def test_a_peft_bias_run_can_still_be_validated(cache_dir):
    """The refusal is for training: validation computes no KL."""
    import lightning as L

    module = lora_module(cache_dir, peft=lora(bias="all"))
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, limit_val_batches=1,
                        enable_progress_bar=False)
    assert "val/reward/mean" in trainer.validate(module, make_data(cache_dir), verbose=False)[0]


def test_a_rollout_leaves_the_base_models_generation_config(cache_dir):
    """peft's generate copies the wrapper's (emptied) generation_config onto the base model:
    after one rollout the base had lost its eos and pad ids, and a merged model saved after
    the fit wrote an empty generation_config.json."""
    module = lora_module(cache_dir)
    module.configure_model()
    base = module.policy.get_base_model()
    before = base.generation_config.to_dict()
    assert before.get("eos_token_id") is not None
    module.rollout_engine().generate(["1 + 1 ="], ["2"], 2)
    assert base.generation_config.to_dict() == before


@pytest.mark.parametrize("targets", [["q_proj", "lm_head"], ["embed_tokens"],
                                     ["embed_tokens", "lm_head"]])
def test_adapters_on_tied_embeddings_export_and_load_as_the_trained_model(cache_dir, tmp_path,
                                                                          targets):
    """``builtin:tiny`` ties its input embeddings and output layer (one tensor). Merging an
    adapter on one of them wrote its change into the shared tensor, so the other moved too:
    the merged export and an adapter folder loaded by ``load_policy`` were another model than
    the one trained (log-probs off by 0.44 after 3 steps, a defect hunt)."""
    from maxent_grpo.adapters import apply_peft, merged_copy

    policy = apply_peft(load_policy("builtin:tiny", cache_dir=cache_dir),
                        lora(target_modules=targets))
    torch.manual_seed(1)
    with torch.no_grad():  # trained adapters (at the start one factor of each is 0)
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.5)
    ids = torch.tensor([[5, 9, 12, 30, 7, 3]])
    want = policy(ids).logits
    with policy.disable_adapter():
        plain = policy(ids).logits
    assert (want - plain).abs().max() > 0.1  # the adapters change the model
    merged = merged_copy(policy, load_policy("builtin:tiny", cache_dir=cache_dir))
    torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=1e-4)
    merged.save_pretrained(tmp_path / "merged")
    reloaded = load_policy(str(tmp_path / "merged"))
    torch.testing.assert_close(reloaded(ids).logits, want, rtol=0, atol=1e-4)
    policy.save_pretrained(tmp_path / "adapter")
    loaded = load_policy(str(tmp_path / "adapter"), cache_dir=cache_dir)
    torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=1e-4)
    # the policy itself is untouched: still tied, its adapters still on
    base = policy.get_base_model()
    assert base.get_input_embeddings().weight is getattr(
        base.lm_head, "base_layer", base.lm_head).weight
    torch.testing.assert_close(policy(ids).logits, want, rtol=0, atol=0)


def test_an_older_lora_checkpoint_is_checked_by_its_weights(cache_dir, tmp_path):
    """A checkpoint from before ``model.peft`` was recorded skipped every adapter check:
    resumed without adapters, or with another rank, Lightning's strict load failed as "a bug"
    (missing keys, a size mismatch), and another ``lora_alpha`` trained at a new scale
    without a word (a hunt of upgrades). Its weights now say what they hold."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    fit(lora_module(cache_dir), make_data(cache_dir), steps=1, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=str(tmp_path), save_last=True)])
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    del saved["maxent_grpo"]["peft"]  # as written before the record
    torch.save(saved, tmp_path / "older.ckpt")
    older = str(tmp_path / "older.ckpt")
    for module, message in (
            (make_module(cache_dir, objective=GRPO(beta=0.1), rewards=ALTERNATING),
             "the checkpoint was made with model.peft adapters and this run is without them"),
            (lora_module(cache_dir, peft=lora(r=8)),
             r"the checkpoint's LoRA adapters have rank \[4\] and this run's model.peft r 8")):
        with pytest.raises(ValueError, match=message):
            fit(module, make_data(cache_dir), steps=2, ckpt_path=older)
    with pytest.warns(UserWarning, match="predates its record of model.peft, so its adapters' "
                                         "scale .* cannot be compared"):
        trainer = fit(lora_module(cache_dir, peft=lora(lora_alpha=32)), make_data(cache_dir),
                      steps=2, ckpt_path=older)
    assert trainer.global_step == 2


def test_the_older_checkpoints_rank_check_is_for_plain_lora_only():
    """AdaLoRA's ``lora_A`` holds ``init_r`` rows and LoRA of 3-D expert weights ``r`` x the
    experts: neither is another rank (a reader)."""
    from maxent_grpo.adapters import check_older_adapters

    weights = {"policy.base_model.model.layer.q_proj.lora_A.default.weight": torch.zeros(12, 4)}
    with pytest.raises(ValueError, match=r"rank \[12\] and this run's model.peft r 8"):
        check_older_adapters(weights, lora(r=8))
    for config in (peft.AdaLoraConfig(init_r=12, target_r=4, total_step=10,
                                      target_modules=["q_proj"]),
                   lora(r=3, target_modules=None, target_parameters=["experts.w"])):
        with pytest.warns(UserWarning, match="cannot be compared"):
            check_older_adapters(weights, config)
    check_older_adapters({"policy.model.layer.weight": torch.zeros(2)}, None)  # full: quiet
