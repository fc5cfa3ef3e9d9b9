"""Hugging Face export: ``HFExport`` when a fit trains nothing, the export command
(``maxent-grpo export``, :mod:`maxent_grpo.cli.export`) on real checkpoints of the tiny
model and on every kind of bad input, and exported adapters that name their ``builtin:``
base and load back through the project's loaders on a machine without that base's cache."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from maxent_grpo.adapters import peft_from_record, peft_record
from maxent_grpo.cli.export import main
from maxent_grpo.models import load_policy, load_reference, load_tokenizer
from maxent_grpo.objectives import GRPO
from maxent_grpo.training.callbacks import HFExport
from tests.conftest import fit, make_data, make_module, params
from tests.training.run.test_checkpoint_io import damage

try:  # the optional extra: the adapter tests need it
    import peft
except ImportError:  # pragma: no cover - only without the extra
    peft = None
needs_peft = pytest.mark.skipif(peft is None, reason="needs the peft extra")
EXPORT_LOG = "maxent_grpo.training.callbacks.export"
PROMPT = "12+30=4"


def checkpointed_fit(run: Path, module, cache_dir: str, **kw):
    """Two steps of ``module``; ``last.ckpt`` in ``run/checkpoints``."""
    callbacks = [ModelCheckpoint(dirpath=str(run / "checkpoints"), save_last=True),
                 *kw.pop("callbacks", [])]
    fit(module, make_data(cache_dir), steps=2, enable_checkpointing=True, callbacks=callbacks,
        **kw)
    return run / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, cache_dir):
    """A full fine-tuning run's checkpoint and its trained weights."""
    module = make_module(cache_dir)
    ckpt = checkpointed_fit(tmp_path_factory.mktemp("full"), module, cache_dir)
    return ckpt, params(module)


def same_weights(model, expected: dict[str, torch.Tensor]) -> None:
    got = dict(model.named_parameters())
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name].detach(), value), name


def logits(model, tokenizer) -> torch.Tensor:
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


# ------------------------------------------------------------------ HFExport, nothing trained


def test_a_resumed_finished_run_exports_the_loaded_weights_and_says_so(
        full_run, cache_dir, tmp_path, caplog):
    """Lightning skips on_train_start/on_train_end when the checkpoint already reached
    max_steps: HFExport exports at the fit's end instead, with a warning."""
    ckpt, trained = full_run
    module = make_module(cache_dir)
    with caplog.at_level(logging.WARNING, logger=EXPORT_LOG):
        trainer = fit(module, make_data(cache_dir), steps=2, ckpt_path=str(ckpt),
                      callbacks=[HFExport(dirpath=str(tmp_path / "hf"))])
    assert trainer.global_step == 2  # nothing trained
    [message] = [r.getMessage() for r in caplog.records if r.name == EXPORT_LOG]
    assert "ran no training step" in message and "trainer.max_steps=2" in message
    assert f"loaded from {ckpt}" in message and "python -m maxent_grpo.cli.export" in message

    from transformers import AutoModelForCausalLM

    same_weights(AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "final"), trained)


def test_a_fit_without_batches_or_checkpoint_exports_nothing_and_says_so(
        cache_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=EXPORT_LOG):
        fit(make_module(cache_dir), make_data(cache_dir), limit_train_batches=0,
            callbacks=[HFExport(dirpath=str(tmp_path / "hf"))])
    [message] = [r.getMessage() for r in caplog.records if r.name == EXPORT_LOG]
    assert "no training batches" in message and "nothing was exported" in message
    assert not (tmp_path / "hf").exists()


def test_a_fit_that_trains_exports_once_without_a_warning(cache_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=EXPORT_LOG):
        fit(make_module(cache_dir), make_data(cache_dir), steps=1,
            callbacks=[HFExport(dirpath=str(tmp_path / "hf"))])
    assert not [r for r in caplog.records if r.name == EXPORT_LOG]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["final"]


def test_an_export_over_the_folder_the_model_loads_from_is_refused(
        cache_dir, tmp_path, monkeypatch):
    """A config reused to keep training an exported model exported over it: the model was
    lost, and a resumed run took its KL to the trained policy."""
    from maxent_grpo.training.callbacks.export import export_policy

    module = make_module(cache_dir)
    module.configure_model()
    export_policy(module.policy, module.tokenizer, tmp_path / "hf" / "final")
    again = make_module(cache_dir, model_name_or_path=str(tmp_path / "hf" / "final"))
    before = (tmp_path / "hf" / "final" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"holds the folder the model loads from"):
        fit(again, make_data(cache_dir), steps=1,
            callbacks=[HFExport(dirpath=str(tmp_path / "hf"))])
    with pytest.raises(ValueError, match=r"would replace the folder the model loads from"):
        export_policy(module.policy, module.tokenizer, tmp_path / "hf" / "final",
                      source=again.source)
    assert (tmp_path / "hf" / "final" / "model.safetensors").read_bytes() == before
    # a dirpath beginning with ~ is the home folder's, as for Lightning's own callbacks
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert HFExport(dirpath="~/hf").dirpath == str(tmp_path / "home" / "hf")


# ------------------------------------------------------------------ the export command


def test_the_command_exports_a_checkpoint_that_loads(full_run, cache_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt, trained = full_run
    out = tmp_path / "out"
    assert main([str(ckpt), "--output", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"exported {out}"
    same_weights(AutoModelForCausalLM.from_pretrained(out), trained)
    tokenizer = load_tokenizer("builtin:tiny", cache_dir=cache_dir)
    assert AutoTokenizer.from_pretrained(out)(PROMPT) == tokenizer(PROMPT)


def test_an_exports_weights_are_as_readable_as_its_other_files(full_run, tmp_path):
    """safetensors wrote the weights owner-only (0600) beside a config readable by all: a
    vLLM server run by another account read the config but not the weights (a hunt)."""
    import os

    old = os.umask(0o022)
    try:
        assert main([str(full_run[0]), "--output", str(tmp_path / "out")]) == 0
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644, modes
    assert ".mode-probe" not in modes


def test_a_model_folder_that_moved_is_given_with_model(cache_dir, tmp_path, capsys):
    """The run's model folder moved: the export took the recorded name for a hub id ("the
    Hugging Face Hub is offline") and had no option for the new place; ``--model`` gives
    it, checked against the files the checkpoint recorded."""
    import json
    import shutil

    from maxent_grpo.training.callbacks.export import export_policy

    module = make_module(cache_dir)
    module.configure_model()
    export_policy(module.policy, module.tokenizer, tmp_path / "a")
    trained = make_module(cache_dir, model_name_or_path=str(tmp_path / "a"))
    ckpt = checkpointed_fit(tmp_path / "run", trained, cache_dir)
    shutil.move(tmp_path / "a", tmp_path / "b")
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    (tmp_path / "c" / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    capsys.readouterr()
    assert main([str(ckpt), "--output", str(tmp_path / "out")]) == 1
    assert (f"the folder {tmp_path / 'a'}, is not there now (moved, or another machine): "
            "pass --model") in capsys.readouterr().err
    assert main([str(ckpt), "--output", str(tmp_path / "out"), "--model",
                 str(tmp_path / "c")]) == 1
    assert "its config or weights files differ" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # a failed export made an empty one (a hunt)
    assert main([str(ckpt), "--output", str(tmp_path / "out"), "--model",
                 str(tmp_path / "b")]) == 0
    from transformers import AutoModelForCausalLM

    same_weights(AutoModelForCausalLM.from_pretrained(tmp_path / "out"), params(trained))
    # a checkpoint older than the files' record: --model is refused, and both messages said
    # to use it (an upgrade hunt); they name the link that finds it
    saved = torch.load(ckpt, weights_only=True)
    saved["maxent_grpo"].pop("model_fingerprint")
    torch.save(saved, tmp_path / "older.ckpt")
    for extra in ([], ["--model", str(tmp_path / "b")]):
        capsys.readouterr()
        assert main([str(tmp_path / "older.ckpt"), "--output", str(tmp_path / "o2"),
                     *extra]) == 1
        assert f"link to the new place at {tmp_path / 'a'}" in capsys.readouterr().err


def test_an_export_keeps_the_padding_side_of_the_tokenizer_files(cache_dir, tmp_path):
    """The trainer pads on the left (generation); an export wrote ``padding_side: left``
    into the files of a model whose tokenizer padded on the right."""
    from transformers import AutoTokenizer

    from maxent_grpo.training.callbacks.export import export_policy

    module = make_module(cache_dir)
    module.configure_model()
    export_policy(module.policy, module.tokenizer, tmp_path / "a")
    config = tmp_path / "a" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "padding_side": "right"}))
    tokenizer = load_tokenizer(str(tmp_path / "a"))
    assert tokenizer.padding_side == "left"
    export_policy(load_policy(str(tmp_path / "a")), tokenizer, tmp_path / "b")
    assert AutoTokenizer.from_pretrained(tmp_path / "b").padding_side == "right"
    assert tokenizer.padding_side == "left"  # the trainer's, kept
    # nor a pad token where the files had none (the trainer pads with eos: an export wrote
    # pad = eos, and collators masking pad labels mask every eos; a templates hunt)
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items()
                                  if k != "pad_token"}))
    tokenizer = load_tokenizer(str(tmp_path / "a"))
    assert tokenizer.pad_token == tokenizer.eos_token  # (for the trainer)
    export_policy(load_policy(str(tmp_path / "a")), tokenizer, tmp_path / "c")
    assert AutoTokenizer.from_pretrained(tmp_path / "c").pad_token is None
    assert tokenizer.pad_token == tokenizer.eos_token  # kept
    export_policy(load_policy(str(tmp_path / "b")), load_tokenizer(str(tmp_path / "b")),
                  tmp_path / "d")  # its own pad written as it was
    assert AutoTokenizer.from_pretrained(tmp_path / "d").pad_token == module.tokenizer.pad_token


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_the_command_writes_the_weights_in_the_dtype_they_trained_in(full_run, tmp_path,
                                                                     dtype):
    """A ``bf16-true`` or ``64-true`` checkpoint was exported as float32 (``model.dtype``):
    twice the size, or float64 weights rounded, unlike HFExport's folder of the same run
    and against CHECKPOINTS.md (a hunt of lower precisions)."""
    from safetensors.torch import load_file

    ckpt, trained = full_run
    saved = torch.load(ckpt, weights_only=True)
    saved["state_dict"] = {k: v.to(dtype) if v.is_floating_point() else v
                           for k, v in saved["state_dict"].items()}
    torch.save(saved, tmp_path / "low.ckpt")
    assert main([str(tmp_path / "low.ckpt"), "--output", str(tmp_path / "out")]) == 0
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert {v.dtype for v in written.values()} == {dtype}
    policy = {k.removeprefix("policy."): v for k, v in saved["state_dict"].items()
              if k.startswith("policy.")}
    assert set(written) <= set(policy) and written  # as trained, bit for bit
    assert all(torch.equal(value, policy[name]) for name, value in written.items())


def test_ctrl_c_of_the_command_leaves_no_folder_and_exits_130(full_run, tmp_path, capsys,
                                                              monkeypatch):
    """Ctrl-C while the tokenizer was written printed a traceback and left a folder with the
    weights and no tokenizer (it loaded as a broken model); now the folder is written beside
    and moved in whole, and the command says it was interrupted."""
    from transformers import PreTrainedTokenizerBase

    def interrupted(self, *_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", interrupted)
    ckpt, _ = full_run
    assert main([str(ckpt), "--output", str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: interrupted (Ctrl-C): the folder being written was not kept")
    assert [p for p in tmp_path.rglob("*") if not p.is_dir()] == []  # --output is left empty


def test_sigterm_to_the_command_leaves_no_folder_and_exits_143(full_run, tmp_path, capsys,
                                                              monkeypatch):
    """SIGTERM (a scheduler's stop, ``kill``) ended the command at once, silent, and left the
    model-sized hidden folder it was writing beside the output (a hunt): it is taken as
    Ctrl-C is, and the handler before it is back afterwards."""
    import os
    import signal

    from transformers import PreTrainedTokenizerBase

    class Unhandled(Exception):
        pass

    def before(*_):  # this test's own: the command must take SIGTERM over from it
        raise Unhandled

    def terminated(self, *_, **__):
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", terminated)
    previous = signal.signal(signal.SIGTERM, before)
    try:
        ckpt, _ = full_run
        assert main([str(ckpt), "--output", str(tmp_path / "out")]) == 143
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: stopped by SIGTERM: the folder being written was not kept")
    assert [p for p in tmp_path.rglob("*") if not p.is_dir()] == []  # nothing left, hidden too


def test_the_default_output_is_hf_beside_the_checkpoint_folder(full_run, tmp_path, monkeypatch):
    ckpt, trained = full_run
    copy = tmp_path / "run" / "checkpoints" / "last.ckpt"
    copy.parent.mkdir(parents=True)
    shutil.copy(ckpt, copy)
    assert main([str(copy)]) == 0
    assert (tmp_path / "run" / "hf" / "last" / "model.safetensors").is_file()
    relative = tmp_path / "run2" / "checkpoints" / "mine.ckpt"  # written from its folder
    relative.parent.mkdir(parents=True)
    shutil.copy(ckpt, relative)
    monkeypatch.chdir(relative.parent)
    assert main(["mine.ckpt"]) == 0
    assert (tmp_path / "run2" / "hf" / "mine" / "model.safetensors").is_file()


def test_a_checkpoint_in_a_metric_subfolder_keeps_its_whole_name(full_run, tmp_path):
    """``filename="{step}-{val/pass@1}"`` writes ``step=4-val/pass@1=0.5.ckpt``: the default
    output was ``checkpoints/hf/pass@1=0.5`` (the step lost: two checkpoints of one score
    collided). The saver's folder is found by the name the checkpoint records."""
    ckpt, _ = full_run
    saved = torch.load(ckpt, weights_only=False)
    (state,) = (v for v in saved["callbacks"].values() if "dirpath" in v)
    state["last_model_path"] = str(Path(state["dirpath"]) / "step=4-val" / "pass@1=0.5.ckpt")
    copy = tmp_path / "mnt" / "checkpoints" / "moved" / "step=4-val" / "pass@1=0.5.ckpt"
    copy.parent.mkdir(parents=True)
    torch.save(saved, copy)
    assert main([str(copy)]) == 0
    got = tmp_path / "mnt" / "checkpoints" / "hf" / "step=4-val-pass@1=0.5"
    assert (got / "model.safetensors").is_file()  # beside the saver's folder, wherever it is


def test_the_command_exports_an_fsdp2_checkpoint_folder(full_run, tmp_path):
    """FSDP2 (ModelParallelStrategy) writes a folder: the shards by
    ``torch.distributed.checkpoint`` and ``meta.pt``. The command refused it, pointing to
    a Lightning tool that cannot read that format."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    ckpt, trained = full_run
    saved = torch.load(ckpt, weights_only=True)
    folder = tmp_path / "last.ckpt"  # as the strategy lays it out
    dcp.save({"state_dict": saved.pop("state_dict"), "optimizer_0": saved.pop(
        "optimizer_states")[0]}, checkpoint_id=str(folder))
    torch.save(saved, folder / "meta.pt")
    assert (folder / ".metadata").is_file()
    assert main([str(folder), "--output", str(tmp_path / "out")]) == 0
    same_weights(AutoModelForCausalLM.from_pretrained(tmp_path / "out"), trained)


def test_rewards_and_objective_play_no_part_in_an_export(full_run, tmp_path):
    """Only the policy is rebuilt: a reward that cannot be imported here and another
    objective class (which load_from_checkpoint's GRPO default would refuse) do not matter."""
    from transformers import AutoModelForCausalLM

    ckpt, trained = full_run
    saved = torch.load(ckpt, weights_only=True)
    saved["hyper_parameters"]["rewards"] = {"no_such_package.rewards:score": 1.0}
    saved["maxent_grpo"]["objective_class"] = "ListwiseMaxEnt"
    torch.save(saved, tmp_path / "other.ckpt")
    assert main([str(tmp_path / "other.ckpt"), "--output", str(tmp_path / "out")]) == 0
    same_weights(AutoModelForCausalLM.from_pretrained(tmp_path / "out"), trained)


def _bad_inputs(tmp: Path, ckpt: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "folder").mkdir()
    shutil.copy(ckpt, tmp / "folder" / "last.ckpt")
    (tmp / "garbage.ckpt").write_text("not a checkpoint")
    torch.save({"state_dict": {"w": torch.zeros(2)}}, tmp / "foreign.ckpt")
    (tmp / "full").mkdir()
    (tmp / "full" / "x.txt").write_text("taken")
    (tmp / "a_file").write_text("")
    shutil.copy(ckpt, tmp / "damaged.ckpt")
    damage(tmp / "damaged.ckpt")
    (tmp / "cut.ckpt").write_bytes(ckpt.read_bytes()[:4000])  # said "not a PyTorch checkpoint"
    return {
        "truncated": ([str(tmp / "cut.ckpt")], "is truncated (a zip archive without its end"),
        "damaged": ([str(tmp / "damaged.ckpt")], "does not match its checksum"),
        "missing": ([str(tmp / "nope.ckpt")], "does not exist"),
        "folder": ([str(tmp / "folder")], "is a folder: give one of its .ckpt files (last.ckpt)"),
        "garbage": ([str(tmp / "garbage.ckpt")], "is not a PyTorch checkpoint"),
        "foreign": ([str(tmp / "foreign.ckpt")], "is not a checkpoint of a maxent-grpo fit"),
        "not_empty": ([str(ckpt), "--output", str(tmp / "full")], "is not empty"),
        "is_a_file": ([str(ckpt), "--output", str(tmp / "a_file")], "is a file"),
        "unwritable": ([str(ckpt), "--output", str(tmp / "a_file" / "out")],
                       "cannot write --output"),
        # exported with exit 0, the file never looked for (a hunt): a full model's
        # checkpoint reads no config, but one given is the user's
        "no_config": ([str(ckpt), "--output", str(tmp / "c"), "--config", str(tmp / "no.yaml")],
                      "no.yaml' does not exist: give the run's config.yaml"),
    }


@pytest.mark.parametrize("case", ["missing", "folder", "garbage", "foreign", "not_empty",
                                  "is_a_file", "unwritable", "damaged", "truncated", "no_config"])
def test_a_mistake_prints_one_error_line_and_returns_1(full_run, tmp_path, capsys, case):
    argv, expected = _bad_inputs(tmp_path, full_run[0])[case]
    assert main(argv) == 1
    captured = capsys.readouterr()
    first = captured.err.splitlines()[0]
    assert first.startswith("error: ") and expected in first, captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_a_bad_command_line_returns_2(capsys, monkeypatch):
    """The usage names the command as typed (``python -m maxent_grpo export`` said
    ``maxent-grpo export``)."""
    from maxent_grpo.cli import help as cli_help

    monkeypatch.setattr(cli_help, "PROG", "python -m maxent_grpo")  # python -m's
    assert main([]) == 2
    assert "usage: python -m maxent_grpo export" in capsys.readouterr().err
    monkeypatch.setattr(cli_help, "PROG", "maxent-grpo")  # the console script's
    assert main([]) == 2
    assert "usage: maxent-grpo export" in capsys.readouterr().err
    assert main(["x.ckpt", "--outp", "out"]) == 2  # as the other commands: no abbreviation
    assert "unrecognized arguments: --outp out" in capsys.readouterr().err


# ------------------------------------------------------------------ adapters


def lora() -> peft.LoraConfig:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           lora_dropout=0.0)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, cache_dir):
    """A LoRA run (beta > 0) with HFExport: the module, its checkpoint and run folder."""
    run = tmp_path_factory.mktemp("lora")
    module = make_module(cache_dir, objective=GRPO(beta=0.1), peft=lora(),
                         rewards={"tests.conftest:alternating": 1.0})
    ckpt = checkpointed_fit(run, module, cache_dir, callbacks=[HFExport(str(run / "hf"))])
    return module, ckpt, run


def same_adapter(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    ours, theirs = (load_file(f / "adapter_model.safetensors") for f in (a, b))
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def base_name(folder: Path) -> str:
    return json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]


@needs_peft
def test_an_exported_adapter_names_its_builtin_base_and_loads_anywhere(
        lora_run, tmp_path, cache_dir):
    """``builtin:tiny``, not this machine's cache folder: with a fresh cache (as on another
    machine) load_policy, load_reference and a module built on the folder resolve it and
    merge the adapter into it."""
    module, _, run = lora_run
    adapter = run / "hf" / "final"
    assert base_name(adapter) == "builtin:tiny"
    card = (adapter / "README.md").read_text()  # peft's model card
    assert "base_model: builtin:tiny" in card and "base_model:adapter:builtin:tiny" in card
    assert cache_dir not in card and cache_dir not in (adapter / "adapter_config.json").read_text()

    elsewhere = str(tmp_path / "fresh-cache")
    tokenizer = load_tokenizer(str(adapter), cache_dir=elsewhere)
    expected = logits(module.policy, tokenizer)
    for loader in (load_policy, load_reference):
        loaded = loader(str(adapter), cache_dir=elsewhere)
        assert not any("lora" in n for n, _ in loaded.named_parameters())  # merged
        torch.testing.assert_close(logits(loaded, tokenizer), expected, rtol=0, atol=1e-5)
        # a policy trains every weight (peft froze the base, and merging left it frozen)
        trains = {p.requires_grad for p in loaded.parameters()}
        assert trains == ({True} if loader is load_policy else {False})
    assert sorted(p.name for p in Path(elsewhere).iterdir() if not p.name.startswith(".")) == [
        "tiny-v2"]

    # as model.model_name_or_path (e.g. validate --model.model_name_or_path <folder>)
    other = str(tmp_path / "other-cache")
    started = make_module(other, model_name_or_path=str(adapter))
    started.prepare_data()
    assert (Path(other) / "tiny-v2" / "model.safetensors").is_file()
    started.configure_model()
    torch.testing.assert_close(logits(started.policy, tokenizer), expected, rtol=0, atol=1e-5)


@needs_peft
def test_the_peft_record_survives_a_weights_only_checkpoint(tmp_path):
    torch.save({"peft": peft_record(lora())}, tmp_path / "x.pt")
    record = torch.load(tmp_path / "x.pt", weights_only=True)["peft"]
    config = peft_from_record(record)
    assert isinstance(config, peft.LoraConfig)
    assert (config.r, config.lora_alpha, config.target_modules) == (4, 8, {"q_proj", "v_proj"})
    assert peft_record(None) is None


@needs_peft
def test_a_lora_fit_records_its_peft_config_in_the_checkpoint(lora_run):
    module, ckpt, _ = lora_run
    saved = torch.load(ckpt, weights_only=True)
    assert saved["maxent_grpo"]["peft"] == peft_record(module.source.peft)


def _lora_checkpoint(ckpt: Path, target: Path, record) -> Path:
    """``ckpt`` with the ``model.peft`` record replaced (None: an older checkpoint)."""
    saved = torch.load(ckpt, weights_only=True)
    saved["maxent_grpo"]["peft"] = record
    torch.save(saved, target)
    return target


@needs_peft
def test_the_command_exports_the_adapter_and_the_merged_model(lora_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    module, ckpt, run = lora_run
    ckpt = _lora_checkpoint(ckpt, tmp_path / "lora.ckpt", peft_record(lora()))
    out = tmp_path / "adapter"
    assert main([str(ckpt), "--output", str(out), "--merged"]) == 0
    assert capsys.readouterr().out.split() == ["exported", str(out), "exported",
                                               f"{out}-merged"]
    assert base_name(out) == "builtin:tiny"
    # the same adapter HFExport wrote at the end of the run
    assert same_adapter(out, run / "hf" / "final")
    tokenizer = load_tokenizer(str(out))
    merged = AutoModelForCausalLM.from_pretrained(f"{out}-merged")
    torch.testing.assert_close(logits(merged, tokenizer), logits(module.policy, tokenizer),
                               rtol=0, atol=1e-5)


@needs_peft
def test_the_adapter_is_written_in_the_dtype_it_trained_in(lora_run, tmp_path):
    """peft makes the adapters float32 whatever the base's dtype: a bf16-true run's adapter
    was exported as float32 (HFExport of the same run: bfloat16)."""
    from safetensors.torch import load_file

    _, ckpt, _ = lora_run
    saved = torch.load(ckpt, weights_only=True)
    saved["state_dict"] = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
                           for k, v in saved["state_dict"].items()}
    saved["hyper_parameters"]["dtype"] = "bfloat16"  # model.dtype: the base loads as bf16
    torch.save(saved, tmp_path / "bf16.ckpt")
    assert main([str(tmp_path / "bf16.ckpt"), "--output", str(tmp_path / "out")]) == 0
    written = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert written and {v.dtype for v in written.values()} == {torch.bfloat16}


@needs_peft
def test_an_older_lora_checkpoint_needs_the_run_config(lora_run, tmp_path, capsys):
    import yaml

    _, ckpt, run = lora_run
    older = _lora_checkpoint(ckpt, tmp_path / "older.ckpt", None)
    assert main([str(older), "--output", str(tmp_path / "a")]) == 1
    assert "pass the run's config file, --config" in capsys.readouterr().err
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model": {"peft": {  # as a run's config.yaml holds it:
        "class_path": "peft.LoraConfig", "init_args": {  # a dataclass field as a mapping
            "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
            "lora_dropout": 0.0, "loftq_config": None,
            "runtime_config": {"ephemeral_gpu_offload": False}}}}}))
    assert main([str(older), "--output", str(tmp_path / "a"), "--config", str(config)]) == 0
    assert same_adapter(tmp_path / "a", run / "hf" / "final")


def test_a_bad_run_config_or_one_the_weights_do_not_fit_is_one_error_line(
        lora_run, tmp_path, capsys):
    """A YAML error, init_args peft refuses, and adapters of another rank each printed a
    traceback labelled as a bug in maxent_grpo."""
    import yaml

    _, ckpt, _ = lora_run
    older = _lora_checkpoint(ckpt, tmp_path / "older.ckpt", None)
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    (tmp_path / "folder.yaml").mkdir()
    assert main([str(older), "--output", str(tmp_path / "f"), "--config",
                 str(tmp_path / "folder.yaml")]) == 1
    assert "is a folder: give the run's config.yaml" in capsys.readouterr().err
    configs = {"yaml": ("model: {peft: {", "is not readable YAML"),
               "args": (yaml.safe_dump({"model": {"peft": {
                   "class_path": "peft.LoraConfig", "init_args": {"rank": 8}}}}),
                   "init_args do not build LoraConfig"),
               "rank": (yaml.safe_dump({"model": {"peft": {
                   "class_path": "peft.LoraConfig", "init_args": {**lora, "r": 8}}}}),
                   "of other shapes")}
    for name, (text, expected) in configs.items():
        config = tmp_path / f"{name}.yaml"
        config.write_text(text)
        capsys.readouterr()
        assert main([str(older), "--output", str(tmp_path / name), "--config", str(config)]) == 1
        err = capsys.readouterr().err
        assert err.splitlines()[0].startswith("error: ") and expected in err, err
        assert "Traceback" not in err and "bug" not in err


def test_a_smoke_run_exports_and_writes_no_samples(cache_dir, tmp_path, monkeypatch, caplog):
    """``fast_dev_run`` writes no checkpoint; it replaced ``./hf/final`` (another folder's
    files deleted) and wrote ``./rollouts.jsonl`` in the working folder, saying no samples
    were kept although ``jsonl_path`` was set."""
    from maxent_grpo.training.callbacks import CompletionSamples

    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf" / "final").mkdir(parents=True)
    (tmp_path / "hf" / "final" / "mine.txt").write_text("precious")
    callbacks = [HFExport(every_n_train_steps=1),
                 CompletionSamples(jsonl_path="{log_dir}/rollouts.jsonl")]
    with caplog.at_level(logging.INFO):
        fit(make_module(cache_dir), make_data(cache_dir), tmp_path=tmp_path,
            fast_dev_run=True, callbacks=callbacks)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["final"]
    assert (tmp_path / "hf" / "final" / "mine.txt").read_text() == "precious"
    assert not list(tmp_path.rglob("rollouts.jsonl"))
    assert "set CompletionSamples.jsonl_path" not in caplog.text
