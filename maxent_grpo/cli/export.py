"""Export a training checkpoint as a Hugging Face folder, without a fit::

    python -m maxent_grpo.cli.export lightning_logs/tiny/checkpoints/last.ckpt \\
        [--output FOLDER] [--merged] [--config RUN_CONFIG.yaml] [--traceback]

The checkpoint is a ``.ckpt`` file written by a fit of
:class:`~maxent_grpo.training.module.MaxEntGRPOModule`, or the folder FSDP2
(``ModelParallelStrategy``) writes, consolidated here on the CPU. The policy is rebuilt
from what the checkpoint saved: the model's name, ``dtype`` and ``model_cache_dir`` from its
hyper-parameters, the ``model.peft`` config from its ``maxent_grpo`` entry, then its weights
(the ``policy.*`` tensors of the state dict). Only the policy is rebuilt, not the whole
module: the rewards, the objective and the engine play no part in an export, and a reward
function or reward model missing where the export runs does not stop it.

The folder is written like :class:`~maxent_grpo.training.callbacks.HFExport` writes one
(:func:`~maxent_grpo.training.callbacks.export.export_policy`): the model (or, with
``model.peft``, the adapter, whose base is named as the run named it, e.g.
``builtin:tiny-warm``) and the tokenizer; ``--merged`` adds ``<output>-merged`` with the
adapters folded into the base. ``--output`` defaults to ``<checkpoint folder>/../hf/<checkpoint
name>``: ``lightning_logs/tiny/checkpoints/last.ckpt`` -> ``lightning_logs/tiny/hf/last``
(a metric's subfolder joined by ``-``: ``checkpoints/step=4-val/pass@1=0.5.ckpt`` ->
``hf/step=4-val-pass@1=0.5``).
Output folders must be new or empty.

A checkpoint written before the ``model.peft`` config was recorded in it needs the run's
config file (``--config``: the ``config.yaml`` the command line saves in the version folder,
or the YAML the run was started with), whose ``model.peft`` is read. A model folder that
moved since the run (or is mounted elsewhere) is given with ``--model``; it must have the
files the checkpoint recorded (:func:`~maxent_grpo.models.same_model`).

A mistake (a missing or unreadable checkpoint, one not written by this trainer, an output
folder that is not empty or cannot be written) prints ``error: ...`` naming what to fix
and returns 1 (:mod:`maxent_grpo.cli.errors`); a bad command line prints the usage and
returns 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any

from maxent_grpo.cli import errors
from maxent_grpo.cli import help as cli_help
from maxent_grpo.cli.errors import UserError
from maxent_grpo.validation import unwritable

#: the state dict's prefix of the policy's tensors, and of a ``peft`` policy's
POLICY_PREFIX, PEFT_PREFIX = "policy.", "policy.base_model.model."


class _Terminated(KeyboardInterrupt):
    """SIGTERM during an export: its folder being written is removed, as on Ctrl-C."""


def _terminate(signum: int, frame: Any) -> None:
    raise _Terminated


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the command on ``argv`` (default ``sys.argv[1:]``); return the exit code: 0 done,
    1 a user's mistake or a bug (printed), 2 a bad command line (``--help``: 0), 130 Ctrl-C,
    143 SIGTERM (either: the folder being written removed).
    ``prog``: the command as typed (default ``<the CLI's command> export``)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(
        prog=prog or f"{cli_help.PROG} export", description="Write the policy (or its peft "
        "adapter) and tokenizer of a training checkpoint as a Hugging Face folder "
        "(save_pretrained).", allow_abbrev=False)  # as the other commands: no --outp
    parser.add_argument("checkpoint", help="a .ckpt file written by a maxent-grpo fit")
    parser.add_argument("--output", default=None, help="the folder to write (new or empty); "
                        "default: <checkpoint folder>/../hf/<checkpoint name>")
    parser.add_argument("--merged", action="store_true", help="with peft adapters, also "
                        "write the merged model to <output>-merged")
    parser.add_argument("--config", default=None, help="the run's config.yaml, read for "
                        "model.peft when the checkpoint does not record it (older checkpoints)")
    parser.add_argument("--model", default=None, help="the run's model at another place (its "
                        "folder moved, or another machine's path); default: where it trained")
    parser.add_argument(errors.TRACEBACK_FLAG, action="store_true",
                        help="print the full trace of an error")
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exit_:  # --help, or argparse's usage error (already printed)
        return exit_.code if isinstance(exit_.code, int) else 2
    package = logging.getLogger("maxent_grpo")  # its INFO lines say what "exported" says
    level = package.level
    package.setLevel(max(level, logging.WARNING))  # (and the adapter's trainable count)
    main_thread = threading.current_thread() is threading.main_thread()
    taken = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        written = export_checkpoint(args.checkpoint, args.output, merged=args.merged,
                                    config=args.config, model=args.model)
    except KeyboardInterrupt as stop:  # a SIGTERM too (a scheduler's, kill's): it left a
        term = isinstance(stop, _Terminated)  # model-sized hidden folder beside it (a hunt)
        if args.traceback and not term:
            raise
        print(f"error: {'stopped by SIGTERM' if term else 'interrupted (Ctrl-C)'}: the folder "
              "being written was not kept", file=sys.stderr)
        return 143 if term else 130
    except Exception as error:  # noqa: BLE001 - the command's last stop (errors.report)
        code = errors.report(error, args.traceback)
        sys.stderr.flush()
        return code
    finally:
        package.setLevel(level)
        if main_thread:  # (None: a handler set outside Python, not restorable: the default)
            signal.signal(signal.SIGTERM, signal.SIG_DFL if taken is None else taken)
    for folder in written:
        print(f"exported {folder}")
    return 0


def export_checkpoint(checkpoint: str | os.PathLike[str], output: str | None = None,
                      merged: bool = False, config: str | None = None,
                      model: str | None = None) -> list[Path]:
    """Export ``checkpoint`` (see the module docstring) into ``output``; returns the folders
    written. :class:`~maxent_grpo.cli.errors.UserError` for the mistakes the docstring names."""
    path = Path(checkpoint).expanduser()
    if config is not None and not (file := Path(config).expanduser()).is_file():  # given: read
        raise UserError(f"--config {str(file)!r} " + ("is a folder" if file.is_dir() else
                        "does not exist") + ": give the run's config.yaml")
    saved = _read_checkpoint(path)
    out = Path(output).expanduser() if output else _default_output(path, saved)
    weights = {k[len(POLICY_PREFIX):]: v for k, v in saved["state_dict"].items()
               if k.startswith(POLICY_PREFIX)}
    peft = _peft_config(saved, path, config) if any(
        k.startswith(PEFT_PREFIX) for k in saved["state_dict"]) else None
    targets = [out] + ([out.with_name(f"{out.name}-merged")] if merged and peft else [])
    if merged and peft is None:
        print("note: --merged ignored: the checkpoint holds the whole model (no adapters)",
              file=sys.stderr)
    for target in targets:
        _check_output(target)

    from maxent_grpo.models import load_policy, load_tokenizer, same_model
    from maxent_grpo.training.callbacks.export import export_policy
    from maxent_grpo.training.settings import ModelSettings

    hparams = saved.get("hyper_parameters") or {}
    record = saved["maxent_grpo"]
    name, folder = record["model_name_or_path"], record.get("model_folder")  # the folder
    if model is not None:  # trained from, not one of that name here
        if same_model(record, model) is None:
            raise UserError(f"--model {model} is not the model {path} was trained from "
                            f"({folder or name}): " + ("its config or weights files differ"
                                                       if record.get("model_fingerprint")
                                                       else "another name or folder")
                            + ("" if record.get("model_fingerprint") or folder is None else
                               " (this checkpoint predates the record of a folder's files, "
                               "by which a folder that moved is known: put a link to the new "
                               f"place at {folder})"))
        name = model
    elif folder is not None and os.path.isdir(folder):
        name = folder
    elif folder is not None and not os.path.isdir(os.path.expanduser(name)):
        raise UserError(f"the model {path} was trained from, the folder {folder}, is not there "
                        "now (moved, or another machine): pass --model with its place" + (
                            "" if record.get("model_fingerprint") else ", or, for this "
                            "checkpoint (older than the record of a folder's files), put a "
                            f"link to the new place at {folder}"))
    source = ModelSettings(name_or_path=name,
                           dtype=hparams.get("dtype", "float32"),
                           cache_dir=hparams.get("model_cache_dir"),
                           gradient_checkpointing=False, peft=peft)
    model = load_policy(source.name_or_path, dtype=source.dtype, cache_dir=source.cache_dir,
                        peft=peft)
    ours = model.state_dict()
    shapes = [f"{k}: {tuple(v.shape)} in the checkpoint, {tuple(ours[k].shape)} in the model"
              for k, v in weights.items() if k in ours and v.shape != ours[k].shape]
    if shapes:  # load_state_dict raises on them even when not strict
        raise UserError(
            f"the weights in {path} do not fit the model {source.name_or_path!r} it names: "
            f"{len(shapes)} of other shapes (e.g. {shapes[0]}); was the model folder changed "
            "since the run, or (--config) is model.peft not the run's?")
    for key, tensor in [*model.named_parameters(), *model.named_buffers()]:  # bf16-true,
        saved_as = weights.get(key)  # 64-true, a bf16 adapter: written as trained (HFExport)
        if saved_as is not None and saved_as.is_floating_point() and tensor.is_floating_point():
            tensor.data = tensor.data.to(saved_as.dtype)
    result = model.load_state_dict(weights, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise UserError(
            f"the weights in {path} do not fit the model {source.name_or_path!r} it names: "
            f"{len(result.missing_keys)} missing (e.g. {result.missing_keys[:3]}), "
            f"{len(result.unexpected_keys)} unexpected (e.g. {result.unexpected_keys[:3]}); "
            "was the model folder changed since the run?")
    tokenizer = load_tokenizer(source.name_or_path, cache_dir=source.cache_dir)
    return export_policy(model, tokenizer, out, source=source, merged=merged)


def _default_output(path: Path, saved: dict[str, Any]) -> Path:
    """``<checkpoint folder>/../hf/<name>``, however the path is written (``mine.ckpt``,
    ``./x/``, ``/abs/x``). A file its ``ModelCheckpoint`` wrote in the subfolder a metric
    in ``filename`` makes (``step=4-val/pass@1=0.125.ckpt``, as the saver recorded it
    relative to its ``dirpath``) keeps its whole name (``hf/step=4-val-pass@1=0.125``) beside
    the saver's folder, wherever the run folder moved; else the file's own folder."""
    path = path.absolute()
    for state in (saved.get("callbacks") or {}).values():
        if not isinstance(state, dict) or not state.get("dirpath"):
            continue
        recorded = [state.get("last_model_path"), state.get("best_model_path"),
                    *(state.get("best_k_models") or {})]
        for file in filter(None, recorded):
            try:
                parts = Path(file).relative_to(state["dirpath"]).with_suffix("").parts
            except ValueError:
                continue
            if len(parts) > 1 and Path(*parts).parts == path.with_suffix("").parts[-len(parts):]:
                return path.parents[len(parts) - 1].parent / "hf" / "-".join(parts)
    return path.parent.parent / "hf" / path.stem


def _read_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's contents (memory-mapped; an FSDP2 checkpoint's folder consolidated:
    :func:`_read_sharded`); UserError when it is missing, another folder, unreadable, or not
    written by a fit of MaxEntGRPOModule."""

    from maxent_grpo.training.run.checkpoint import CHECKPOINT_KEY

    if path.is_dir() and (path / ".metadata").is_file() and (path / "meta.pt").is_file():
        saved = _read_sharded(path)
    elif path.is_dir():
        found = sorted(p.name for p in path.glob("*.ckpt"))
        raise UserError(
            f"checkpoint {str(path)!r} is a folder: " + (
                f"give one of its .ckpt files ({', '.join(found[:3])})" if found else
                "not a checkpoint of a fit (nor FSDP2's folder, with .metadata and meta.pt)"))
    else:
        saved = _read_file(path)
    entry = saved.get(CHECKPOINT_KEY) if isinstance(saved, dict) else None
    state = saved.get("state_dict") if isinstance(saved, dict) else None
    if not (isinstance(entry, dict) and "model_name_or_path" in entry and isinstance(state, dict)
            and any(k.startswith(POLICY_PREFIX) for k in state)):
        raise UserError(
            f"{str(path)!r} is not a checkpoint of a maxent-grpo fit (it lacks the "
            f"{CHECKPOINT_KEY!r} entry or the policy's weights): give a .ckpt file that "
            "MaxEntGRPOModule's fit wrote (a ModelCheckpoint's, e.g. last.ckpt)")
    return saved


def _read_sharded(path: Path) -> dict[str, Any]:
    """An FSDP2 checkpoint's folder as one checkpoint: ``meta.pt``'s entries and the shards'
    ``state_dict``, gathered by ``torch.distributed.checkpoint`` through a temporary file
    (the optimizer's state too, then dropped: it needs that much free disk and memory)."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    try:
        with tempfile.TemporaryDirectory(prefix="maxent_grpo_export_") as tmp:
            dcp_to_torch_save(str(path), os.path.join(tmp, "whole.pt"))
            shards = torch.load(os.path.join(tmp, "whole.pt"), map_location="cpu",
                                weights_only=True)
        meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any failure to read it is the folder's
        raise UserError(f"cannot read the sharded checkpoint {str(path)!r} ({type(error).__name__}"
                        f": {str(error).strip()[:300]}): export an intact one") from error
    return {**meta, "state_dict": shards.get("state_dict")}


def _read_file(path: Path) -> Any:
    """A checkpoint file's contents, memory-mapped (UserError naming what is wrong)."""
    import torch

    if not path.is_file():
        raise UserError(f"checkpoint {str(path)!r} does not exist: give the path of a .ckpt file "
                        "written by a fit, e.g. lightning_logs/tiny/checkpoints/last.ckpt")
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:  # a zip's start without its end: cut short
            cut = f.read(4) == b"PK\x03\x04"
        raise UserError(f"checkpoint {str(path)!r} is truncated (a zip archive without its end: "
                        "a copy or a save that did not finish): export an intact one" if cut
                        else f"{str(path)!r} is not a PyTorch checkpoint (not the zip archive "
                        "torch.save writes): give a .ckpt file written by a maxent-grpo fit")
    from maxent_grpo.training.run.checkpoint_io import checkpoint_problem

    if (problem := checkpoint_problem(path)) is not None:  # damaged bytes load as weights
        raise UserError(f"checkpoint {str(path)!r} is {problem}: export an intact one")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # noqa: BLE001 - any failure to read it is the file's
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"cannot read checkpoint {str(path)!r} ({reason}): give a .ckpt file "
                        "written by a maxent-grpo fit") from error


def _peft_config(saved: dict[str, Any], path: Path, config: str | None) -> Any:
    """The ``model.peft`` config of a checkpoint whose policy has adapters: its record, else
    the ``--config`` file's ``model.peft``."""
    from maxent_grpo.adapters import peft_from_record

    if importlib.util.find_spec("peft") is None:
        raise ModuleNotFoundError(f"{str(path)!r} holds peft adapters: exporting them needs "
                                  "the peft package: pip install 'maxent-grpo[peft]'")
    record = saved["maxent_grpo"].get("peft")
    if record is not None:
        return peft_from_record(record)
    if config is None:
        raise UserError(
            f"{str(path)!r} holds peft adapters but not their config (it predates "
            "checkpoints recording model.peft): pass the run's config file, --config "
            "<version folder>/config.yaml (or the YAML the run was started with)")
    return _peft_from_config_file(Path(config).expanduser())


def _peft_from_config_file(file: Path) -> Any:
    """``model.peft`` (``class_path``, ``init_args``) of a run's YAML config, built."""
    import yaml

    from maxent_grpo.adapters import PeftConfig

    try:
        data = yaml.safe_load(file.read_text("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise UserError(f"--config {str(file)!r} is not readable YAML: "
                        f"{str(error).splitlines()[0]}") from None
    model = data.get("model") if isinstance(data, dict) else None
    peft = model.get("peft") if isinstance(model, dict) else None
    if not (isinstance(peft, dict) and isinstance(peft.get("class_path"), str)):
        raise UserError(f"--config {str(file)!r} has no model.peft with a class_path: give "
                        "the config of the run that wrote the checkpoint")
    cls = errors.import_class(peft["class_path"])
    if not (isinstance(cls, type) and issubclass(cls, PeftConfig)):
        raise UserError(f"--config {str(file)!r}: model.peft.class_path "
                        f"{peft['class_path']!r} is not a peft config class")
    from jsonargparse import ArgumentError, ArgumentParser

    parser = ArgumentParser(exit_on_error=False)  # as the CLI builds it: a saved config.yaml
    parser.add_argument("--peft", type=PeftConfig)  # writes nested dataclasses as mappings
    try:  # (LoraConfig's runtime_config), which the class itself does not take
        config = parser.parse_object({"peft": peft})
        build = getattr(parser, "instantiate", None) or parser.instantiate_classes
        return build(config).peft
    except (ArgumentError, TypeError, ValueError) as error:
        problem = [line.strip() for line in str(error).strip().splitlines()[1:]  # below the
                   if line.strip() and not line.strip().startswith(("Given value", "Subtypes"))]
        raise UserError(f"--config {str(file)!r}: model.peft.init_args do not build "  # key
                        f"{cls.__name__}: {' '.join(problem) or error}") from None


def _check_output(folder: Path) -> None:
    """UserError when ``folder`` is a file, holds anything, or cannot be created or written
    (made by the export's write only: a failed export leaves no empty folder behind)."""
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output {str(folder)!r} is a file: give a new or empty folder")
    if folder.is_dir() and any(folder.iterdir()):
        raise UserError(f"--output {str(folder)!r} is not empty: give a new or empty folder "
                        "(or delete this one)")
    if (why := unwritable(folder, folder=True)) is not None or (
            folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK)):
        raise UserError(f"cannot write --output {str(folder)!r} ({why or 'not writable'}): "
                        "give a folder you can write to")


if __name__ == "__main__":
    sys.exit(main(prog="python -m maxent_grpo.cli.export"))
