"""What the command line prints when a run fails: a short message for a user's mistake, the
full trace for a bug.

A *user error* is one the person running ``python -m maxent_grpo`` can fix without reading
our code: a bad option (``ValueError`` naming the option), a missing or unreadable file or
model folder (``OSError``), a reward function that raised or returned something unusable
(:class:`~maxent_grpo.rewards.RewardFunctionError`) or any other user code that did
(:class:`~maxent_grpo.validation.UserCodeError`: an environment, an objective subclass), a
loss that kept being non-finite (:class:`~maxent_grpo.training.step.optimise.
NonFiniteLossError`), a Trainer setting Lightning refuses (``MisconfigurationException``), a
killed DataLoader worker, a missing optional package named in a message, or any
:class:`UserError`. It is printed on stderr as::

    error: <the message: what is wrong, which option or file, what to do>
    (run again with --traceback for the full trace)

and the process exits with :data:`USER_ERROR_EXIT_CODE`. Any other exception is a bug: its
full trace is printed, then one line asking for a report; or, where its innermost frame is
in a file neither of this package nor of the libraries (a user's objective subclass, callback
or module), one line naming that file and line. ``--traceback``, anywhere on the
command line, prints the full trace for user errors too. A parse error (jsonargparse's usage
line and ``error: ...``, exit code 2) is shortened by :mod:`maxent_grpo.cli.parse_errors`.

Wrapped errors are unwrapped first: one PyTorch re-raised from a DataLoader worker or a
spawned process carries the original trace as text (its last line is shown), and one raised
``from`` a user error (by ``datasets``, jsonargparse) is reported as the user error it wraps.
"""

from __future__ import annotations

import builtins
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from maxent_grpo.cli.parse_errors import MISMATCH, failed_subtype

T = TypeVar("T")

TRACEBACK_FLAG = "--traceback"
HINT = f"(run again with {TRACEBACK_FLAG} for the full trace)"
USER_ERROR_EXIT_CODE = 1
BUG_EXIT_CODE = 1
PARSE_ERROR_EXIT_CODE = 2  # jsonargparse's own code for a bad command line or config file


class UserError(Exception):
    """A mistake of the user's with a message that says what is wrong and what to do; the
    command line prints only the message (``ValueError`` counts the same)."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exception types printed as a short message (imported lazily: this module is
    imported by the command line before Lightning)."""
    import torch
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from maxent_grpo.rollout.server_weights import ServerError
    from maxent_grpo.training.step.optimise import NonFiniteLossError
    from maxent_grpo.validation import UserCodeError

    return (
        UserError,
        ValueError,  # the project's option checks; also json.JSONDecodeError, UnicodeError
        OSError,  # FileNotFoundError, PermissionError, transformers' missing model files
        UserCodeError,  # a reward function (RewardFunctionError), an environment, ...
        NonFiniteLossError,
        ServerError,  # a vLLM server that refused or cannot be reached: its message says
        MisconfigurationException,  # what to start, restart or give
        MemoryError,  # the machine's; the accelerator's:
        torch.cuda.OutOfMemoryError,  # torch.OutOfMemoryError from torch 2.5 on
    )


def is_user_error(error: BaseException) -> bool:
    """True for an exception printed as a short message; see the module docstring."""
    if isinstance(error, ImportError):
        # `raise ModuleNotFoundError("X needs package Y: pip install Y")` has no `name`;
        # a failing import statement (a broken install, a bug) has one
        return error.name is None and bool(str(error))
    kind = type(error)  # wandb's UsageError: an account that is not set up (``wandb login``)
    return isinstance(error, user_error_types()) or (_unreachable(error) is not None) or (
        kind.__module__.startswith("wandb") and kind.__name__ == "UsageError") or (
        isinstance(error, RuntimeError) and "in your SLURM bash script" in str(error))  # srun


def _unreachable(error: BaseException) -> str | None:
    """What to do when a logger's server did not answer (after its own retries): MLflow's
    tracking server, W&B's in its online mode; else None."""
    kind, text = type(error), str(error)
    if kind.__module__.startswith("mlflow") and kind.__name__ == "MlflowException" and any(
            m in text for m in ("API request to", "Max retries exceeded", "Connection refused")):
        return "the MLflow logger's tracking server: start it, or set its tracking_uri"
    if kind.__module__.startswith("wandb") and "CommError" in [k.__name__ for k in kind.mro()]:
        return ("the W&B logger's server: check the network and `wandb login`, or log "
                "offline: WANDB_MODE=offline or --trainer.logger.init_args.offline true")
    return None


def _logger_in_trace(error: BaseException) -> str | None:
    """The class name of the Lightning logger whose constructor raised ``error`` (an MLflow
    store made under its ``save_dir``), else None."""
    from lightning.pytorch.loggers import Logger

    for frame, _ in traceback.walk_tb(error.__traceback__):
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), Logger):
            return type(frame.f_locals["self"]).__name__
    return None


# the trace a re-raised worker / spawned-process error carries as text ends in "Type: message"
_TRACE_TEXT = re.compile(r"Traceback \(most recent call last\):$", re.MULTILINE)
_LAST_LINE = re.compile(r"^(?:[\w.]+\.)?(?P<type>[A-Za-z_]\w*): (?P<message>.*)", re.DOTALL)


def _from_trace_text(error: BaseException) -> tuple[str, str] | None:
    """``(type name, message)`` of the original error inside a re-raised one's message
    (PyTorch's DataLoader workers, ``torch.multiprocessing.spawn``), else None."""
    text = str(error)
    found = list(_TRACE_TEXT.finditer(text))
    if not found:
        return None
    lines = text[found[-1].end():].strip("\n").split("\n")
    # the trace's frames are indented; the exception line is the first unindented one
    first = next((i for i, line in enumerate(lines) if line and not line[0].isspace()), None)
    match = None if first is None else _LAST_LINE.match("\n".join(lines[first:]).strip())
    return (match["type"], match["message"]) if match else None


_USER_ERROR_NAMES = {"UserError", "RewardFunctionError", "UserCodeError", "NonFiniteLossError",
                     "ServerError", "MisconfigurationException", "MemoryError",
                     "OutOfMemoryError"}


def _named_user_error(type_name: str) -> bool:
    if type_name in _USER_ERROR_NAMES:
        return True
    cls = getattr(builtins, type_name, None)
    return isinstance(cls, type) and issubclass(cls, (ValueError, OSError))


def find_user_error(error: BaseException) -> tuple[BaseException, str] | None:
    """``(the user error, its message)`` for an exception to report briefly, or None for a
    bug. Follows explicit wrapping (``raise Wrapper(...) from user_error``) and PyTorch's
    re-raised traces; never ``__context__`` (an error *while handling* a user error is a
    bug)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _no_room(current.__cause__) and not _no_room(current):  # a logger's wrapper
            current = current.__cause__  # (Lightning's "you tried to log 1.0 ...")
            continue
        inner = _from_trace_text(current)
        if inner is not None:
            type_name, message = inner
            if _named_user_error(type_name):
                return current, message
        elif is_user_error(current):
            cause = current.__cause__
            if not (_raised_in("jsonargparse", current) and cause is not None):
                return current, message_of(current)
            # jsonargparse wraps a constructor's error ("Does not validate against any of
            # the Union subtypes ... Errors: - <ours> - <one per other subtype>"): ours is
            # the cause, and says it alone, unless the cause is the mismatch of another
            # subtype (a list of loggers tried as one Logger first); another library's
            # (MLflow refusing its file store) with its type's name; a bug, ours or in the
            # user's own class, with its trace
            failed = failed_subtype(str(current))  # (only there: not chained)
            if failed is not None and str(cause).startswith(MISMATCH):
                return current, failed
            if (not is_user_error(cause) and _from_trace_text(cause) is None
                    and not _raised_in("maxent_grpo", cause) and _outside_frame(cause) is None):
                return current, f"{type(cause).__name__}: {message_of(cause)}"
        current = current.__cause__
    return None


#: what a collective says when another rank's process ended (gloo, NCCL, the TCP store)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited",
              "Broken pipe", "caused by a remote worker crashing")


def torch_distributed() -> Any:
    """``torch.distributed`` when torch is imported and has it, else None (this module is
    imported before torch)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    return dist if dist is not None and dist.is_available() else None


def busy_port(error: BaseException) -> str | None:
    """The message for a run whose rendezvous port another program holds (torch's
    ``DistNetworkError`` "EADDRINUSE"; it was reported as a bug), else None."""
    current: BaseException | None = error
    for _ in range(8):
        if current is None:
            return None
        if "EADDRINUSE" in str(current):
            found = re.search(r"port: (\d+)", str(current))
            port = found.group(1) if found else os.environ.get("MASTER_PORT", "?")
            if port != os.environ.get("MASTER_PORT", port):  # one chosen free, then taken
                return (f"port {port} was taken by another program between its choice and "
                        "its use: run again")
            return (f"the run's port {port} (MASTER_PORT) is in use: another run, or another "
                    "program, listens there. Set MASTER_PORT to a free port, or unset it and "
                    "Lightning picks one (under SLURM it derives one from the job id: give "
                    "each run of one job its own MASTER_PORT)")
        current = current.__cause__
    return None


#: the launchers that started this run's other processes (the CLI records them)
LAUNCHERS: list[Any] = []


def stop_launched(grace: float = 2.0) -> None:
    """End the processes that Lightning started for this run (ranks 1 and up) and that are
    still running ``grace`` seconds after this one failed: one that fails before they join
    it (a busy ``MASTER_PORT``) left them waiting 30 minutes, and the next run on that port
    took one for its own (Lightning stops them on Ctrl-C only)."""
    import subprocess
    import time

    procs = []
    for launcher in LAUNCHERS:  # Lightning's observer thread watches this list: emptied, it
        own = getattr(launcher, "procs", None) or []  # does not kill this process on
        procs += own  # seeing one of them killed (exit code 137 instead of ours)
        own.clear()
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()


def peer_failed(error: BaseException) -> bool:
    """True when ``error`` (or what it was raised from) is a collective that lost another
    process of a distributed run: ``torch.distributed``'s ``DistNetworkError``, or gloo's and
    NCCL's messages for a peer that went away (not every ``DistBackendError``: NCCL raises
    it for a local fault too, such as mismatched collectives, a bug to show). Only in a
    process group of two or more (or ``WORLD_SIZE`` > 1, before the group formed): a
    one-process run has no peer, and a server's reset
    connection (httpx says "Connection reset by peer" too) was called a lost rank."""
    dist = torch_distributed()
    grouped = dist is not None and dist.is_initialized() and dist.get_world_size() > 1
    if not grouped and int(os.environ.get("WORLD_SIZE", "1") or 1) < 2:  # (a rendezvous)
        return False  # no peer: a reset connection is a server's (httpx), not a rank's
    current: BaseException | None = error
    for _ in range(8):
        if current is None:
            return False
        if type(current).__name__ == "DistNetworkError" or any(
                mark in str(current) for mark in _PEER_GONE):
            return True
        current = current.__cause__
    return False


def _raised_in(package: str, error: BaseException) -> bool:
    """True when the innermost frame of ``error``'s own traceback is in ``package``."""
    if error.__traceback__ is None:
        return False
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f"{os.sep}{package}{os.sep}" in frame.filename


def _no_room(error: BaseException | None) -> bool:
    """A write that found no room (a full disk, a quota, a file-size limit)."""
    from maxent_grpo.validation import NO_ROOM

    return isinstance(error, OSError) and error.errno in NO_ROOM


def _log_written(error: OSError) -> str | None:
    """What a logger wrote when ``error``, a full disk, named no file: TensorBoard's events
    (raised again from its writer thread at the next write) or the CSV log; else None."""
    for frame, _ in traceback.walk_tb(error.__traceback__) if _no_room(error) else ():
        writer = frame.f_locals.get("self")
        if f"{os.sep}tensorboard{os.sep}" in frame.f_code.co_filename and callable(
                getattr(writer, "get_logdir", None)):
            return f"the TensorBoard events under {writer.get_logdir()}"
        if isinstance(csv := getattr(writer, "metrics_file_path", None), str):
            return f"the CSV log {csv}"
    return None


def _ours(filename: str) -> bool:
    """Whether a file is this package's."""
    return os.path.realpath(filename).startswith(os.path.dirname(os.path.dirname(
        os.path.realpath(__file__))) + os.sep)


def message_of(error: BaseException) -> str:
    """The message shown for a user error: its text (the type's name when empty); for a
    reward function that raised, where it raised (the innermost frame outside this package:
    its own line, not that of a check it called, as ``log_metric``'s)."""
    from maxent_grpo.validation import UserCodeError

    message = str(error).strip() or type(error).__name__
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        message += (" (out of memory: lower data.batch_size, model.num_generations or "
                    "model.max_completion_length, or set model.micro_batch_groups)")
    if hint := _unreachable(error):
        message += f" ({hint})"
    if isinstance(error, OSError) and error.filename and str(error.filename) not in message:
        message = f"{message}: {error.filename!r}"
    if isinstance(error, OSError) and (written := _log_written(error)):
        message += (f" (writing {written}: free space there, or raise the limit, or log "
                    "elsewhere: the logger's save_dir, or --trainer.default_root_dir for "
                    "Lightning's default logger)")
    elif isinstance(error, OSError) and (logger := _logger_in_trace(error)):
        message += f" (trainer.logger {logger}: give a save_dir you can write to)"
    cause = error.__cause__
    if isinstance(error, UserCodeError) and cause is not None and cause.__traceback__:
        frames = traceback.extract_tb(cause.__traceback__)
        frame = next((f for f in frames[::-1] if not _ours(f.filename)), frames[-1])
        if os.path.isfile(frame.filename):  # not importlib's frozen frames (a SyntaxError)
            message = f"{message} (at {frame.filename}:{frame.lineno})"
    return message


def import_class(class_path: Any) -> type | None:
    """The object a dotted ``class_path`` names (``pkg.module.Name``), or None when it is
    not such a string or does not import."""
    import importlib

    if not isinstance(class_path, str) or "." not in class_path:
        return None
    module, _, name = class_path.rpartition(".")
    try:  # a relative path (".Name", "..m.Name") is refused by import_module: no class either
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError, TypeError):
        return None


def pop_traceback_flag(args: list[str]) -> tuple[list[str], bool]:
    """``args`` without ``--traceback`` (anywhere), and whether it was there."""
    kept = [a for a in args if a != TRACEBACK_FLAG]
    return kept, len(kept) != len(args)


def report(error: BaseException, show_trace: bool) -> int:
    """Print ``error`` for a person (see the module docstring); return the exit code."""
    from jsonargparse import ArgumentError

    file = sys.stderr
    if isinstance(error, ArgumentError):  # only raised here when --traceback was given
        traceback.print_exception(error, file=file)
        print(f"error: {error}", file=file)
        return PARSE_ERROR_EXIT_CODE
    found = find_user_error(error)
    if found is None and (busy := busy_port(error)) is not None:
        found = error, busy
    if found is None and peer_failed(error):  # the peer's own error is the one to read
        found = error, ("this process lost its connection to another process of the run, "
                        "which failed or was killed: its own error is printed above or in "
                        "its log")
    if found is None and re.search(r"DataLoader worker \(pid(\(s\))? [\d, ]+\) (is killed|"
                                   r"exited unexpectedly)", text := str(error)):  # (a kill, OOM)
        why = ("often for want of memory: lower data.num_workers or free memory" if
               "Terminated" not in text else "a SIGTERM reached it: a DataModule of your own, or "
               "macOS, where workers take it; docs/TROUBLESHOOTING.md")
        found = error, (f"{text.strip()} ({why}); --ckpt_path last resumes from the newest "
                        "checkpoint")
    if found is not None and not show_trace:
        print(f"error: {found[1]}", file=file)
        print(HINT, file=file)
        return USER_ERROR_EXIT_CODE
    traceback.print_exception(error, file=file)
    if found is not None:
        print(f"error: {found[1]}", file=file)
        return USER_ERROR_EXIT_CODE
    where, raised = _outside_frame(error), error  # or its cause's (jsonargparse wraps a
    while where is None and raised.__cause__ is not None:  # class's constructor's error)
        raised = raised.__cause__
        where = _outside_frame(raised)
    if where is not None:  # a user's objective, callback or module: theirs to read
        print(f"error: {type(raised).__name__} raised outside maxent_grpo and its libraries, "
              f"at {where} (your code?): the trace above shows how it was reached", file=file)
        return USER_ERROR_EXIT_CODE
    print(f"error: unexpected {type(error).__name__}; this is a bug in maxent_grpo (or a "
          "mistake without a clear message yet): please report it with the trace above",
          file=file)
    return BUG_EXIT_CODE


def _outside_frame(error: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``error``'s trace where that frame's file is
    neither in this package nor in Python's or the environment's libraries (a user's own
    objective subclass, callback or module), else None."""
    import site
    import sysconfig

    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    if not frames or not os.path.isfile(frames[-1].filename):
        return None
    path = os.path.realpath(frames[-1].filename)
    libraries = {os.path.realpath(p) for p in (  # a user install's, a hub model's own code
        *sysconfig.get_paths().values(), *site.getsitepackages(), site.getusersitepackages(),
        os.environ.get("HF_MODULES_CACHE") or os.path.join(
            os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"),
            "modules"))}
    if _ours(path) or any(path.startswith(root + os.sep) for root in (*libraries, sys.prefix)) \
            or any(part in path for part in ("/torchinductor_", "/.triton/")):  # compiled kernels
        return None
    return f"{frames[-1].filename}:{frames[-1].lineno}"


def exit_on_error(build: Callable[[], T], show_trace: bool) -> T:
    """``build()``; an exception is printed by :func:`report` and ends the process with its
    exit code (``SystemExit`` passes through); Ctrl-C exits 130, SIGTERM 143."""
    try:
        return build()
    except (KeyboardInterrupt, SystemExit) as stop:
        if isinstance(stop, KeyboardInterrupt) and show_trace:
            raise
        if isinstance(stop, KeyboardInterrupt) or (stop.code == 1 and isinstance(
                stop.__context__, KeyboardInterrupt)):  # Lightning's sys.exit(1)
            print("error: interrupted (Ctrl-C)", file=sys.stderr)
            raise SystemExit(130) from None
        if type(stop).__name__ != "SIGTERMException":  # Lightning's, with no exit code
            raise
        from maxent_grpo.training.run.signals import INTERRUPTED  # Ctrl-C, several processes

        print(f"error: {'interrupted (Ctrl-C)' if INTERRUPTED else 'stopped by SIGTERM'} after a "
              "batch (a fit: --ckpt_path last resumes from the newest checkpoint the run saved, "
              "if any: the steps after it train again; a ModelCheckpoint with "
              "save_on_exception: true saves the step it stopped at; a predict writes no "
              "--output, an earlier file there is kept)", file=sys.stderr)
        raise SystemExit(130 if INTERRUPTED else 143) from None
    except Exception as error:  # noqa: BLE001 - the command line's last stop
        code = report(error, show_trace)
        sys.stderr.flush()
        stop_launched()
        raise SystemExit(code) from None
