"""Load the policy, the frozen reference and the tokenizer, including offline built-in models.

Every model goes through one code path::

    name_or_path ──resolve_model_path──▶ path or hub id ──from_pretrained──▶ model / tokenizer

``resolve_model_path`` accepts three kinds of names:

- a **built-in** name, ``"builtin:<name>"`` (the names are the keys of
  :data:`maxent_grpo.builtin.catalog.BUILTIN_MODELS`; :mod:`maxent_grpo.builtin.catalog`
  describes them), materialised on first use into
  ``<cache_dir>/<name>-v<version>`` (default ``~/.cache/maxent_grpo/models``); it is built
  in a temporary sibling and renamed into place under a lock file, so neither an
  interrupted conversion nor concurrent first calls leave a half-written model.
- a **local folder**: names starting with ``/``, ``./``, ``../`` or ``~`` must exist, and so
  must any other name that is an existing directory. An *adapter folder* (one with
  ``adapter_config.json``, e.g. ``HFExport``'s output of a ``model.peft`` run) loads as its
  base model (``base_model_name_or_path``, any kind of name here) with the adapter merged in;
- anything else is a **Hugging Face Hub id**. With ``HF_HUB_OFFLINE=1`` and the model not
  cached, the error names the model and says that the hub is offline.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from huggingface_hub import is_offline_mode
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from maxent_grpo.adapters import PeftConfig, adapter_base, apply_peft, merge_adapter
from maxent_grpo.builtin.catalog import is_builtin, materialise
from maxent_grpo.validation import check_choice

logger = logging.getLogger(__name__)

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
_DTYPES: dict[str, torch.dtype | str] = {"auto": "auto", "float32": torch.float32,
                                         "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        return str(materialise(name_or_path, cache_dir))
    looks_local = name_or_path.startswith(("/", "./", "../", "~"))
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if looks_local:
        raise ValueError(f"model path {name_or_path!r} does not exist (or is not a directory)")
    return name_or_path


def model_chain(name_or_path: str, cache_dir: str | os.PathLike[str] | None = None
                ) -> list[str]:
    """:func:`resolve_model_path` of the model, then of the base its adapter folder names
    (:func:`~maxent_grpo.adapters.adapter_base`), and so on to a model that is no adapter;
    a base that leads back to an adapter of the chain is refused (loading never ended)."""
    chain = [resolve_model_path(name_or_path, cache_dir)]
    while (base := adapter_base(chain[-1])) is not None:
        chain.append(resolve_model_path(base, cache_dir))
        if os.path.realpath(chain[-1]) in {os.path.realpath(p) for p in chain[:-1]}:
            raise ValueError(
                f"the adapter folders {' -> '.join(chain)} lead back to themselves: set "
                f"base_model_name_or_path in {chain[-2]}/adapter_config.json to the model "
                "the adapter was trained on")
    return chain


def disable_dropout(model: torch.nn.Module) -> int:
    """Set the dropout of ``model`` to 0: its dropout modules (``nn.Dropout`` and kin) and
    the rates that modules keep and read while training (``attention_dropout``, OPT's
    ``dropout``, peft's per-adapter dicts of rates); returns how many were above 0. The
    policy samples in eval mode: scored in training mode with dropout, its log-probs are
    neither the sampler's nor comparable to the reference's (a KL above 0 at step 0, noise
    in every ratio). Not covered: a rate a model reads from its config in the forward pass
    (a few architectures) and other training-mode noise (a router's jitter)."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p, changed = 0.0, changed + 1
        for name, value in list(vars(module).items()):
            if "dropout" not in name:
                continue
            if isinstance(value, float) and value > 0:
                setattr(module, name, 0.0)
                changed += 1
            elif isinstance(value, dict) and any(isinstance(v, float) and v > 0
                                                 for v in value.values()):
                value.update({k: 0.0 for k, v in value.items() if isinstance(v, float)})
                changed += 1
    return changed


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
    """Call ``loader(path, **kwargs)``; name the model and the offline hub if it fails, and
    a folder's files that cannot be read (:func:`_unreadable`)."""
    import pickle

    from safetensors import SafetensorError  # a weights file cut short, or not one

    try:
        with _quiet_load(path):
            return loader(path, **kwargs)
    except Exception as error:  # noqa: BLE001 - the tokenizers library raises plain Exception
        known = (OSError, ValueError, SafetensorError, pickle.UnpicklingError, EOFError)
        folder = Path(path).is_dir()
        if is_offline_mode() and not folder and isinstance(error, OSError):
            raise OSError(
                f"could not load model {name_or_path!r}: the Hugging Face Hub is offline "
                "(HF_HUB_OFFLINE=1) and the model is not in the local hub cache; download it "
                "while online, pass a local folder, or use a 'builtin:' model"
            ) from error
        bad = _unreadable(path) if folder else []
        if folder and (bad or isinstance(error, known)):  # transformers names no folder
            raise OSError(
                f"could not load model.model_name_or_path {name_or_path!r} from the folder "
                f"{str(path)!r}: " + (f"{', '.join(bad)} cannot be read (damaged?): " if bad
                                      else "" if isinstance(error, (OSError, ValueError)) else
                                      f"{type(error).__name__} (a damaged weights file?): ")
                + f"{error}; " + ("it is the built-in model's copy: delete the folder and "
                                  "the next run makes it again" if name_or_path.startswith(
                                      "builtin:") and (bad or not isinstance(error, ValueError))
                                  else "the folder must hold a Hugging Face "
                                  "model (config.json, the weights and the tokenizer files)")
            ) from error
        raise


#: the JSON files of a model folder that loading it reads
_LOADED_JSON = ("config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "adapter_config.json",
                "model.safetensors.index.json", "pytorch_model.bin.index.json", "vocab.json",
                "added_tokens.json", "chat_template.json")


def _unreadable(folder: str) -> list[str]:
    """The JSON files of ``folder`` that loading reads (:data:`_LOADED_JSON`) that do not
    parse, and a ``tokenizer.json`` the tokenizers library cannot read (its error names no
    file)."""
    import json

    from tokenizers import Tokenizer

    bad = []
    for file in (Path(folder, name) for name in _LOADED_JSON):
        if not file.is_file():
            continue
        try:
            json.loads(file.read_text(encoding="utf-8"))
            if file.name == "tokenizer.json":
                Tokenizer.from_file(str(file))
        except Exception:  # noqa: BLE001 - any failure: the file is named
            bad.append(file.name)
    return bad


def load_tokenizer(
    name_or_path: str, *, cache_dir: str | os.PathLike[str] | None = None,
    padding_side: Literal["left", "right"] = "left", require_chat_template: bool = False,
    trust_remote_code: bool = False,
) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a model (built-in, local folder or hub id).

    An adapter folder without tokenizer files (peft's ``save_pretrained`` alone) gives its
    base's tokenizer. ``padding_side`` defaults to ``"left"`` (what batched generation
    needs). A tokenizer without a pad token gets its eos token as pad (logged); one with
    neither raises ``ValueError``. With ``require_chat_template=True`` a tokenizer without a
    chat template raises ``ValueError`` (otherwise the error comes later, from
    ``apply_chat_template``).
    """
    check_choice("padding_side", padding_side, ("left", "right"))
    *adapters, base = model_chain(name_or_path, cache_dir)
    path = next((p for p in adapters if Path(p, "tokenizer_config.json").is_file()), base)
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
            "set --data.apply_chat_template false (plain-text prompts)"
        )
    return tokenizer


def check_token_ids(tokenizer: Any, model: torch.nn.Module, name_or_path: str) -> None:
    """ValueError when the tokenizer's pad, eos or bos token, or a token its chat template
    writes, has an id past the model's input embeddings (a token added to the tokenizer,
    the embeddings not resized): the first batch holding it would fail deep inside the
    model (an index error, a device assert). Other special tokens are not checked: Gemma 3's
    text models list an image token they have no row for and never write."""
    try:
        embeddings = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):  # a model that does not say: not checked
        return
    rows = getattr(getattr(embeddings, "get_base_layer", lambda: embeddings)(),
                   "num_embeddings", None)
    if rows is None:
        return
    ids = [(getattr(tokenizer, f"{role}_token_id", None), f"{role} token")
           for role in ("pad", "eos", "bos")]
    ids += [(i, "token its chat template writes") for i in _template_ids(tokenizer)]
    for token_id, role in ids:
        if isinstance(token_id, int) and token_id >= rows:
            raise ValueError(
                f"the tokenizer of {name_or_path!r} has the {role} "
                f"{tokenizer.convert_ids_to_tokens(token_id)!r} with id {token_id}, past the "
                f"model's {rows} input embeddings (a token added to the tokenizer without "
                "resizing the model's embeddings): resize them (model.resize_token_embeddings"
                "(len(tokenizer)), then save the model) or give the tokenizer a token the "
                "model has" + (" (e.g. pad_token: its eos token, in tokenizer_config.json)"
                               if role == "pad token" else ""))


def _template_ids(tokenizer: Any) -> list[int]:
    """The ids of a one-message conversation as the tokenizer's chat template writes it
    (none without a template, or one that refuses it)."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "1"}],
                                             tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    except Exception:  # noqa: BLE001 - no template, or its own refusal (named elsewhere)
        return []


#: the names of the modules holding learned absolute positions (GPT-2's, OPT's, BERT's)
_POSITIONS = ("wpe", "embed_positions", "position_embeddings")


def position_limit(model: torch.nn.Module) -> int | None:
    """How many positions a model with learned absolute positions has (``n_positions`` or
    ``max_position_embeddings`` of its config; a longer sequence fails inside it: an index
    error, a device assert); None for rotary or relative positions, which have no such
    limit."""
    config = getattr(model, "config", None)
    limit = getattr(config, "n_positions", None) or getattr(
        config, "max_position_embeddings", None)
    learned = any(isinstance(m, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITIONS
                  for name, m in model.named_modules())
    return int(limit) if learned and isinstance(limit, int) else None


def trained_positions(model: torch.nn.Module) -> int | None:
    """``max_position_embeddings`` of a model whose rotary positions are unscaled (the
    context it was trained on, past which it runs untrained); None with ``rope_scaling``
    (linear, dynamic, YaRN, Llama 3's: its own longer limit) or no such number."""
    config = getattr(model, "config", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else None
    limit = getattr(config, "max_position_embeddings", None)
    return limit if kind in (None, "default") and isinstance(limit, int) else None


def model_folder(name_or_path: str) -> str | None:
    """The real path of ``name_or_path`` (``~`` expanded, as the model loader does) when it
    is a local folder, else None."""
    path = os.path.expanduser(name_or_path)
    return os.path.realpath(path) if os.path.isdir(path) else None


#: what a model folder's fingerprint reads: its configs whole, samples of its weights
_CONFIGS = ("config.json", "adapter_config.json")
_WEIGHTS = re.compile(r".*\.(safetensors|gguf)|(pytorch_model|adapter_model|model).*\.(bin|pt|pth)")
#: the weights are read in blocks of 4 KiB: their first and last MiB, and 1,024 spread over
#: the file (about 6 MiB a file, milliseconds; a full read of a 7B model takes minutes)
_BLOCK, _SPREAD = 4096, 1024


def model_fingerprint(folder: str | None) -> str | None:
    """A digest of a local model folder: its ``config.json`` (or an adapter's config) whole
    and, of each weights file, its name, size, first and last MiB and 1,024 blocks spread
    over it; a folder moved, copied or mounted elsewhere keeps it, other weights change it
    (unless they differ only between the blocks read). None for None or a folder without
    a config."""
    try:
        files = [] if folder is None else sorted(
            p for p in Path(folder).iterdir()
            if p.name in _CONFIGS or _WEIGHTS.fullmatch(p.name))
        if not any(p.name in _CONFIGS for p in files):
            return None
        digest, mib = hashlib.sha256(), 1 << 20
        for path in files:
            size = path.stat().st_size
            digest.update(f"{path.name}:{size}:".encode())
            with open(path, "rb") as file:
                if path.name in _CONFIGS or size <= 2 * mib:
                    digest.update(file.read())
                    continue
                starts = [0, size - mib, *(k * (size - _BLOCK) // _SPREAD
                                           for k in range(1, _SPREAD))]
                for start in starts:
                    file.seek(start)
                    digest.update(file.read(mib if start in (0, size - mib) else _BLOCK))
    except OSError:  # a folder that cannot be read now: not known by its files
        return None
    return digest.hexdigest()[:32]


def same_model(saved: Mapping[str, Any], name_or_path: str) -> str | None:
    """Whether ``name_or_path`` is the model a checkpoint's record names (``saved``: its
    ``model_name_or_path``, ``model_folder``, ``model_fingerprint``): ``"same"`` for the same
    name or real folder, ``"moved"`` for another folder with the same fingerprint (moved,
    copied, another machine's mount point), None for another model."""
    folder = model_folder(name_or_path)
    if saved["model_name_or_path"] == name_or_path or (
            folder is not None and saved.get("model_folder") == folder):
        return "same"
    recorded = saved.get("model_fingerprint")  # (checkpoints from before it have none)
    return "moved" if recorded and recorded == model_fingerprint(folder) else None


def _load_causal_lm(name_or_path: str, cache_dir: Any, dtype: str,
                    attn_implementation: str | None, trust_remote_code: bool) -> Any:
    """``from_pretrained`` of the causal LM ``name_or_path`` names; an adapter folder loads as
    its base with the adapter merged (:func:`~maxent_grpo.adapters.merge_adapter`)."""
    check_choice("dtype", dtype, _DTYPES)
    kwargs: dict[str, Any] = {"dtype": _DTYPES[dtype], "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    *adapters, path = model_chain(name_or_path, cache_dir)
    model = _from_pretrained(AutoModelForCausalLM.from_pretrained,
                             path if adapters else name_or_path, path, **kwargs)
    for folder in reversed(adapters):
        model = merge_adapter(model, folder)
    return model


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
    model = _load_causal_lm(name_or_path, cache_dir, dtype, attn_implementation,
                            trust_remote_code)
    if gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # transformers before 5.23 has only the older name
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
                "use_reentrant": False})
    if peft is not None:
        model = apply_peft(model, peft)
    return model


def load_reference(
    name_or_path: str, *, dtype: DTypeName = "float32", attn_implementation: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None, trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load the frozen reference model: ``eval()`` mode and ``requires_grad_(False)``.

    Same arguments as :func:`load_policy` except ``gradient_checkpointing`` and ``peft``
    (nothing is back-propagated through the reference, and nothing in it trains).
    """
    model = _load_causal_lm(name_or_path, cache_dir, dtype, attn_implementation,
                            trust_remote_code)
    return model.eval().requires_grad_(False)
