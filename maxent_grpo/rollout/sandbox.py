"""Run model-written Python (the built-in ``python`` tool), or any tool, in a fresh
process per call, with limits, and kill everything the call started when it ends.

It is not a container: a best-effort sandbox of rlimits, an unprivileged uid and Linux
namespaces, with no seccomp filter and no cgroup; the host's files stay readable wherever
their modes let the call's uid read them. Linux only.

How a call runs. A :class:`Sandbox` starts on first use one zygote, ``python -I -S``
(isolated: no ``PYTHON*`` variables, no user or site packages; for tools ``-I`` with the
trainer's ``sys.path``), under a minimal environment (``PATH``, ``LANG``, ``LC_ALL``,
``PYTHONHASHSEED``, ...: none of the trainer's variables) and imports common standard-library
modules once. It keeps ``spares`` supervisors ready, each in its own session and namespaces
with the call's process already forked, limited, unprivileged and waiting for its one
request: a call pays for its code, not for an interpreter (milliseconds). The call's
process runs that one call, then exits: stdin ``/dev/null``, stdout and stderr one pipe, no
other inherited descriptor, ``no_new_privs``, an empty working folder of its own (also
``HOME`` and ``TMPDIR``). Its supervisor reads the output as it comes (the head and the last
quarter of ``output_bytes`` kept, the rest counted and marked ``[... N bytes of output cut
...]``: 100 MB of output neither blocks nor fills memory), kills the call at the wall clock,
then every process it left (a daemon never outlives its call: the pid namespace ends with
the call, else its uid's processes and the supervisor's orphans are killed), and removes
its folder, whatever modes the code left on it.

What holds (``Sandbox.protections`` reports it for this machine; a protection that could
not be set up is False there, never claimed):

============================  ==================================  ============================
protection                    as root (this trainer's case)       as a plain user
============================  ==================================  ============================
fresh process; the call and   yes                                 yes
all it started killed at the
limit and after it returns
rlimits: CPU seconds, address yes                                 yes
space, file size, no core
``max_processes`` (NPROC)     yes, counted for the call's own uid with a user namespace; else
                                                                  added to the user's count
own uid: cannot signal or     yes: uid = gid = ``uid_base`` + the no: the trainer's uid
trace the trainer, nor read   supervisor's pid, no groups
its /proc or root's files
no network (own network       yes                                 with a user namespace
namespace, loopback down)
own pid namespace (the        yes                                 with a user namespace
trainer cannot be named)
own /tmp, /var/tmp, /dev/shm  yes                                 with a user namespace
(one ``disk_mb`` tmpfs)
============================  ==================================  ============================

As root, a folder other users cannot enter (``/root``) on the way to the Python
installation is masked in the call's mount namespace by an empty tmpfs, and the folders
Python needs are bound back read-only at their own paths. Root without namespaces keeps the
uid, NPROC and the rlimits, but then the call imports only the zygote's preloaded modules if
the installation lies in such a folder. A plain user without user namespaces gets the
rlimits, the fresh process, the minimal environment and the cleanup only: the code can
signal the user's processes (``os.kill(-1, 9)`` too), read their ``/proc`` and the user's
files, and use the network. Without a private /tmp the world-writable folders stay shared
and the working folder is ``maxent-sandbox-<pid>`` in ``tmp_root``.

Faults (:attr:`SandboxResult.failure`, kinds of
:data:`~maxent_grpo.rollout.toolcall.FAILURE_KINDS`):

====================================  ========================================  =========
what happened                         what the model reads                      kind
====================================  ========================================  =========
exit status 0                         the output                                (none)
more output than ``output_bytes``     head, ``[... N bytes of output cut ...]``, (none)
                                      tail
an exception, ``sys.exit(3)``         ``Error: python exited with status 1``,   error
                                      then the output (the traceback)
a signal (a segfault, ...)            ``Error: python was killed by signal      error
                                      SIGSEGV (Segmentation fault)``, output
past the wall clock                   ``Error: python gave no result within     timeout
                                      2 s``, then the output so far
past the CPU time (threads add up)    ``Error: python used up its 3 s of CPU    timeout
                                      time``, output
the sandbox itself failed             ``Error: the sandbox could not run        error
                                      python (<why>)``
====================================  ========================================  =========

A tool run here (``model.tool_isolation: process``) is named by module and name, imported
by the zygote, called in the call's process with the same limits; its answer comes back as
text (a string, else JSON, else ``str``), never pickled; what it raises reads
``Error: <ExceptionType>: <message>``, as in a thread.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from maxent_grpo.rollout.sandbox_pool import WORKER, Pool, killpg
from maxent_grpo.validation import check_int, check_number, require

__all__ = ["UID_BASE", "Sandbox", "SandboxError", "SandboxResult", "close_shared_sandbox",
           "python", "shared_sandbox", "tool_reference"]

#: as root, a call runs as uid (and gid) ``UID_BASE`` + its supervisor's pid: its own
UID_BASE = 1_000_000_000
#: seconds the trainer waits past a call's limit for its supervisor before killing it
GRACE = 10.0
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
       "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1",
       "PYTHONNOUSERSITE": "1", "USER": "sandbox", "LOGNAME": "sandbox"}


@dataclass(frozen=True)
class SandboxResult:
    """How one call ended.

    Attributes:
        status: ``exit``, ``signal``, ``timeout`` (wall clock), ``cpu`` (CPU time) or
            ``failed`` (the sandbox could not run it).
        output: stdout and stderr, interleaved as written, cut to ``output_bytes``.
        code: the exit status (``exit``); signal: the signal's number (``signal``).
        value: a tool's answer, ``{"text": ...}`` or ``{"error": ...}``; None for code.
        cut: output bytes left out; seconds: wall time; timeout: the limit it ran under.
        uid: the uid it ran as (None: the trainer's); session: the host pid of its session
            leader; reason: why the sandbox failed (or that a process may be left).
    """

    status: str
    output: str = ""
    code: int | None = None
    signal: int | None = None
    value: dict[str, str] | None = None
    tool: bool = False
    cut: int = 0
    seconds: float = 0.0
    timeout: float = 0.0
    uid: int | None = None
    session: int | None = None
    reason: str = ""

    @property
    def failure(self) -> str | None:
        """None, ``"timeout"`` or ``"error"`` (the module docstring's table)."""
        if self.status in ("timeout", "cpu"):
            return "timeout"
        if self.status != "exit" or self.code != 0:
            return "error"
        if self.tool and (self.value is None or "error" in self.value):
            return "error"
        return None

    def message(self, name: str) -> str:
        """What the model reads for tool ``name``."""
        if self.failure is None:
            return str(self.value.get("text", "")) if self.tool else self.output
        if self.tool and self.status == "exit" and self.value and "error" in self.value:
            return f"Error: {self.value['error']}"
        if self.status == "timeout":
            head = f"{name} gave no result within {self.timeout:g} s"
        elif self.status == "cpu":
            head = f"{name} used up its {cpu_seconds(self.timeout)} s of CPU time"
        elif self.status == "signal":
            head = f"{name} was killed by signal {_signal_name(self.signal)}"
        elif self.status == "failed":
            head = f"the sandbox could not run {name} ({self.reason})"
        else:
            head = f"{name} exited with status {self.code}"
        more = f"\n{self.output}" if self.output and not self.tool else ""
        return f"Error: {head}{more}"


class SandboxError(RuntimeError):
    """A call of :func:`python` failed; ``result`` says how."""

    def __init__(self, result: SandboxResult) -> None:
        super().__init__(result.message("python"))
        self.result = result


def cpu_seconds(timeout: float) -> int:
    """The CPU-time limit of a call with wall-clock limit ``timeout``."""
    return math.ceil(timeout) + 1


def _signal_name(number: int | None) -> str:
    try:
        sig = signal.Signals(number)
    except (TypeError, ValueError):
        return str(number)
    return f"{sig.name} ({signal.strsignal(sig)})"


def tool_reference(fn: Callable[..., Any]) -> tuple[str, str]:
    """``(module, qualified name)`` that a fresh process imports ``fn`` by; ValueError
    naming ``model.tool_isolation`` when it cannot (a lambda, a closure, ``__main__``)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    target = sys.modules.get(module) if module and module != "__main__" else None
    for part in qualname.split(".") if target is not None and "<" not in qualname else ():
        target = getattr(target, part, None)
    require(target is fn and target is not None,
            f"model.tool_isolation: 'process' imports each tool in a fresh process, so "
            f"{qualname or fn!r} must be a module-level function of an importable module "
            f"(got module {module!r}); use 'thread' for it")
    return module, qualname


class Sandbox:
    """A pool of ready sandboxed processes (the module docstring); started on first use,
    closed by :meth:`close`, ``with`` or at exit.

    Args:
        timeout: default wall-clock seconds per call (> 0); the CPU limit is its ceiling + 1.
        memory_mb: address space a call may map beyond what it starts with.
        file_size_mb: the largest file it may write; disk_mb: its /tmp (a tmpfs).
        max_processes: processes and threads of its uid (RLIMIT_NPROC).
        output_bytes: stdout + stderr kept per call.
        spares: processes kept ready.
        namespaces: use the namespaces this machine allows (False: rlimits, uid and
            cleanup only).
        tools: functions :meth:`call` may run (imported once by the zygote, with the
            trainer's ``sys.path``).
        uid_base: as root, calls run as ``uid_base + pid`` of their supervisor.
        tmp_root: where working folders go without a private /tmp (default: the
            system's temporary folder).
    """

    def __init__(self, timeout: float = 10.0, *, memory_mb: int = 512, file_size_mb: int = 16,
                 disk_mb: int = 64, max_processes: int = 32, output_bytes: int = 16384,
                 spares: int = 2, namespaces: bool = True,
                 tools: Sequence[Callable[..., Any]] = (), uid_base: int = UID_BASE,
                 tmp_root: str | None = None) -> None:
        check_number("sandbox timeout", timeout, minimum=0, strict=True)
        for name, value in (("memory_mb", memory_mb), ("file_size_mb", file_size_mb),
                            ("disk_mb", disk_mb), ("max_processes", max_processes),
                            ("output_bytes", output_bytes), ("spares", spares)):
            check_int(f"sandbox {name}", value, minimum=0 if name == "spares" else 1)
        self.timeout = float(timeout)
        self.references = {fn: tool_reference(fn) for fn in tools}
        limits = {"memory_mb": memory_mb, "file_size_mb": file_size_mb, "disk_mb": disk_mb,
                  "max_processes": max_processes, "output_bytes": output_bytes}
        config = {"limits": limits, "uid_base": uid_base, "namespaces": bool(namespaces),
                  "tmp_root": tmp_root or tempfile.gettempdir(), "env": ENV,
                  "sys_path": [os.path.abspath(p or ".") for p in sys.path] if tools else None,
                  "preload": sorted({m for m, _ in self.references.values()})}
        command = [sys.executable, "-I"] + ([] if tools else ["-S"]) + [WORKER]
        self._pool = Pool(command, config, spares)
        self._finalizer = weakref.finalize(self, self._pool.close)

    @property
    def protections(self) -> dict[str, bool]:
        """Which protections hold for a call (starts the pool)."""
        return dict(self._pool.peek()["protections"])

    @property
    def pid(self) -> int | None:
        """The zygote's pid, None while not started."""
        proc = self._pool.proc
        return None if proc is None or proc.poll() is not None else proc.pid

    def run(self, code: str, timeout: float | None = None) -> SandboxResult:
        """Run ``code`` as a script (``python -c``) within ``timeout`` seconds (default:
        the pool's); never raises for anything the code does."""
        return self._call({"code": str(code)}, timeout, tool=False)

    def call(self, fn: Callable[..., Any], arguments: dict[str, Any],
             timeout: float | None = None) -> SandboxResult:
        """Call tool ``fn`` (one of ``tools``) with JSON ``arguments`` in a sandboxed process;
        its answer is :attr:`SandboxResult.value`."""
        require(fn in self.references, f"{fn!r} is not one of this sandbox's tools")
        request = {"tool": list(self.references[fn]), "arguments": arguments}
        return self._call(request, timeout, tool=True)

    def _call(self, request: dict[str, Any], timeout: float | None, tool: bool) -> SandboxResult:
        timeout = self.timeout if timeout is None else float(timeout)
        check_number("sandbox timeout", timeout, minimum=0, strict=True)
        request.update(timeout=timeout, cpu_seconds=cpu_seconds(timeout))
        try:
            spare = self._pool.take()
            ready = spare.ready()
        except (OSError, ValueError) as err:
            return SandboxResult("failed", tool=tool, timeout=timeout, reason=str(err))
        from maxent_grpo.rollout import sandbox_worker as wire

        reply: Any = None
        try:
            wire.send(spare.sock, request)
            spare.sock.settimeout(timeout + GRACE)
            reply = wire.receive(spare.sock)
        except (OSError, ValueError):
            pass
        finally:
            spare.sock.close()
            try:
                self._pool.refill()
            except OSError:
                pass  # the next call starts the pool again
        if not isinstance(reply, dict):
            killpg(ready["pid"])  # its supervisor is stuck or gone; the call dies with it
            return SandboxResult("failed", tool=tool, timeout=timeout, uid=ready["uid"],
                                 reason="no answer from its supervisor")
        return SandboxResult(
            reply["status"], reply["output"], reply.get("code"), reply.get("signal"),
            reply.get("value"), tool, reply["cut"], reply["seconds"], timeout, reply["uid"],
            reply["session"], "" if reply.get("clean") else "processes may be left")

    def close(self) -> None:
        """Stop the zygote and its spares (a call in flight ends first); idempotent, and
        a later call starts them again."""
        self._pool.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_shared: Sandbox | None = None
_shared_lock = threading.Lock()


def shared_sandbox() -> Sandbox:
    """The process-wide sandbox of the built-in ``python`` tool (created on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Sandbox()
        return _shared


def close_shared_sandbox() -> None:
    """Stop the shared sandbox (a later call starts a new one)."""
    global _shared
    with _shared_lock:
        sandbox, _shared = _shared, None
    if sandbox is not None:
        sandbox.close()


def python(code: str) -> str:
    """Run Python code in a fresh sandboxed process and return what it prints.

    The code runs as a script, with the standard library only, in an empty folder of its
    own, and is stopped at a time limit; print the values you want to see. An error returns
    its traceback.

    Args:
        code: the Python source to run, e.g. "print(37 * 84)".
    """
    result = shared_sandbox().run(code)
    if result.failure is not None:
        raise SandboxError(result)
    return result.output
