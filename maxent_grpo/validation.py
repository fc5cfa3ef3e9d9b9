"""Option checks shared by every configurable class: one way to refuse a bad value.

Each check raises ``ValueError`` with a message that names the option as the user writes
it in YAML (``model.num_generations``, ``BetaController.kl_target``) and the value given,
so a bad config fails when its object is built, never later in training::

    check_int("model.num_generations", 1, minimum=2)
    # ValueError: model.num_generations must be an int >= 2; got 1
"""

from __future__ import annotations

import errno
import hashlib
import inspect
import math
import os
import socket
import time
from collections.abc import Callable, Collection
from numbers import Real
from typing import Any

__all__ = ["MAX_SECONDS", "UserCodeError", "check_bool", "check_choice", "check_int",
           "check_number", "check_seconds", "check_unused", "defaults_of", "failing_row",
           "is_number", "no_room", "require"]


class UserCodeError(Exception):
    """A user's function or class (a reward, an environment, an objective, an engine) raised
    or broke its contract: the message names it and what it should do; what it raised is
    ``__cause__``. The command line prints the message, not a trace."""


def failing_row(fn: Callable[..., Any], n: int, kwargs: dict[str, Any],
                error: type[BaseException] = Exception, message: str | None = None,
                seconds: float = math.inf, alone: bool = False,
                ) -> tuple[int, BaseException] | None:
    """``(i, err)``: the first of ``n`` rows on which ``fn`` called with that row alone
    raises ``error`` (with ``message``, when given; each keyword argument that is a list of
    ``n`` values cut to its ``i``-th, the rest as given), to name the row a call on all of
    them failed on; None when no row does, or after ``seconds``; with ``alone``, None too
    where no row passes (every row raising: the function's error, not a row's).

    >>> failing_row(lambda xs, k: [10 // x for x in xs], 3, {"xs": [5, 0, 1], "k": 2})[0]
    1
    """
    cut = [key for key, value in kwargs.items() if isinstance(value, (list, tuple))
           and len(value) == n]
    deadline, found, passed = time.monotonic() + seconds, None, False
    for i in range(n):
        try:
            fn(**{**kwargs, **{key: kwargs[key][i:i + 1] for key in cut}})
            passed = True
        except error as err:
            if found is None and (message is None or str(err) == message):
                found = i, err
        except (Exception, SystemExit):
            pass
        if found is not None and (passed or not alone) or time.monotonic() > deadline:
            break
    return found if passed or not alone else None


def require(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok``."""
    if not ok:
        raise ValueError(message)


def check_unused(given: dict[str, tuple[Any, Any]], applies: bool, needs: str) -> None:
    """ValueError naming the options of ``given`` (``name: (value, default)``) set away from
    their default where they would do nothing (``applies`` false): they act only with
    ``needs``. An option ignored without a word is a run that is not the one configured."""
    if applies:
        return
    moved = [f"{name}={value!r}" for name, (value, default) in given.items()
             if (tuple(value) if isinstance(value, list) else value) != default]
    carried = ("; if --model.objective switched to another class, the config's value of "
               "the first was kept" if all(m.startswith("objective.") for m in moved) else "")
    require(not moved, f"{', '.join(moved)} would do nothing: only with {needs}; set that, "
            f"or leave {'it' if len(moved) == 1 else 'them'} at the default{carried}")


def defaults_of(function: Callable[..., Any]) -> dict[str, Any]:
    """The default of each parameter of ``function`` that has one (what :func:`check_unused`
    compares with: a default changed there is the default here too)."""
    return {name: p.default for name, p in inspect.signature(function).parameters.items()
            if p.default is not inspect.Parameter.empty}


def is_number(value: Any) -> bool:
    """A finite real number (``bool`` is not a number here)."""
    try:  # an int beyond a float's range is no number here either (isfinite overflows)
        return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:
        return False


def check_int(name: str, value: Any, minimum: int | None = None, allow_none: bool = False,
              maximum: int | None = None) -> None:
    """``value`` is an int (not a bool) in ``[minimum, maximum]`` (either bound optional);
    ``None`` passes with ``allow_none``."""
    if value is None and allow_none:
        return
    bound = "" if minimum is None else f" >= {minimum}"
    if maximum is not None:
        bound += f"{' and' if bound else ''} <= {maximum}"
    none = " (or null)" if allow_none else ""
    require(
        isinstance(value, int) and not isinstance(value, bool)
        and (minimum is None or value >= minimum) and (maximum is None or value <= maximum),
        f"{name} must be an int{bound}{none}; got {value!r}",
    )


def check_number(
    name: str, value: Any, minimum: float | None = None, maximum: float | None = None,
    strict: bool = False, allow_none: bool = False,
) -> None:
    """``value`` is a finite number in ``[minimum, maximum]`` (``(minimum, maximum]`` with
    ``strict``; either bound may be None); ``None`` passes with ``allow_none``."""
    if value is None and allow_none:
        return
    ok = is_number(value)
    if ok and minimum is not None:
        ok = value > minimum if strict else value >= minimum
    if ok and maximum is not None:
        ok = value <= maximum
    if minimum is not None and maximum is not None:
        bound = f" in {'(' if strict else '['}{minimum}, {maximum}]"
    elif minimum is not None:
        bound = f" {'>' if strict else '>='} {minimum}"
    elif maximum is not None:
        bound = f" <= {maximum}"
    else:
        bound = ""
    none = " (or null)" if allow_none else ""
    require(ok, f"{name} must be a finite number{bound}{none}; got {value!r}")


#: the longest time limit an option may set (10 million seconds, 115 days): beyond any use,
#: and well inside what Python's waits accept (``threading.TIMEOUT_MAX``, about 292 years,
#: less the grace a sandboxed call adds; a longer one failed inside the wait)
MAX_SECONDS = 10**7


def check_seconds(name: str, value: Any, allow_zero: bool = False,
                  allow_none: bool = False) -> None:
    """``value`` is a time limit: a finite number of seconds > 0 (>= 0 with ``allow_zero``)
    and at most :data:`MAX_SECONDS`; ``None`` passes with ``allow_none``."""
    check_number(name, value, minimum=0, maximum=MAX_SECONDS, strict=not allow_zero,
                 allow_none=allow_none)


def check_bool(name: str, value: Any) -> None:
    """``value`` is ``True`` or ``False``."""
    require(isinstance(value, bool), f"{name} must be true or false; got {value!r}")


def check_choice(name: str, value: Any, choices: Collection[Any]) -> None:
    """``value`` is one of ``choices``."""
    require(value in choices,
            f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")


#: this machine, in a temporary file's name (no dot: the name is split at its dots)
HOST = socket.gethostname().replace(".", "_")


def temporary_name(name: str, mark: str = ".tmp") -> str:
    """``.<name>.<host>-<pid><mark>``: the temporary a write of ``name`` fills beside it (a
    killed write's is found by its host and process). Where that would pass 255 bytes, the
    file systems' bound, ``name`` is a hash of it with its extension (``.ckpt``, which the
    sweep looks for): a legal checkpoint name of 243 characters failed at its first save."""
    tail = f".{HOST}-{os.getpid()}{mark}"
    if len(os.fsencode(f".{name}{tail}")) > 255:  # (a name of undecodable bytes: escaped)
        name = hashlib.sha256(os.fsencode(name)).hexdigest()[:32] + os.path.splitext(name)[1][:32]
    return f".{name}{tail}"


def unwritable(path: str | os.PathLike, folder: bool = False) -> str | None:
    """Why ``path`` (a file, or with ``folder`` a folder) cannot be written, None when it
    can: the part of it that exists must be a writable folder (the rest gets made), and a
    file's path may not be a folder. For options checked before a run, whose writes come
    after it (an export, a state file)."""
    path = os.path.abspath(path)
    if not folder and os.path.isdir(path):
        return "it is a folder"
    there = path if folder else os.path.dirname(path)
    while not os.path.exists(there):
        there = os.path.dirname(there)
    if not os.path.isdir(there):
        return f"{there!r} is not a folder"
    if not os.access(there, os.W_OK):
        return f"{there!r} is not writable"
    return None


#: the errors of a write that found no room: the device full, a file-size limit, a quota
NO_ROOM = {errno.ENOSPC: "no space left on device", errno.EFBIG: "file too large",
           errno.EDQUOT: "disk quota exceeded"}


def no_room(error: BaseException | None, what: str, keep: str) -> OSError | None:
    """An ``OSError`` naming ``what`` failed to be written and why, when ``error`` is a
    write that found no room (:data:`NO_ROOM`), or an error other than an ``OSError``
    raised while one was handled (torch's zip writer and safetensors wrap the system's
    error); None otherwise. ``keep`` says what is not lost."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        code = getattr(error, "errno", None)
        if code not in NO_ROOM:  # safetensors' words: "... (os error 28)"
            code = next((c for c in NO_ROOM if f"os error {c})" in str(error)), None)
        if code is not None:
            return OSError(code, f"writing {what} failed: {NO_ROOM[code]}: free space there "
                                 f"(or raise the limit, or write elsewhere); {keep}")
        if isinstance(error, OSError):  # another system error: itself, not an earlier one
            return None
        error = error.__cause__ or error.__context__
    return None
