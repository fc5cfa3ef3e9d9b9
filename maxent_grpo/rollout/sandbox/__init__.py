"""Run model-written Python (the built-in ``python`` tool), or any tool, in a fresh
process per call, with limits, and kill everything the call started when it ends.

It is not a container: a best-effort sandbox of rlimits, an unprivileged uid, Linux
namespaces and a seccomp filter, with no cgroup (what that leaves open is listed below).
Linux only.

How a call runs. A :class:`Sandbox` starts on first use one zygote, ``python -I -S``
(isolated: no ``PYTHON*`` variables, no user or site packages; for tools ``-I`` with the
trainer's ``sys.path``), under a minimal environment (``PATH``, ``LANG``, ``LC_ALL``,
``PYTHONHASHSEED``, ...: none of the trainer's variables; ``-I`` ignores the hash seed for the
zygote itself, so a call's string hashes and set order follow its zygote's random secret,
while a Python the call starts uses seed 0), its output discarded, and imports
common standard-library modules once. It keeps ``spares`` supervisors ready, each in its own
session and namespaces with the call's process already forked, limited, unprivileged and
waiting for its one request: a call pays for its code and its isolation's set-up and
tear-down, not for an interpreter with site packages (about 15 ms for ``print(1)``). The call's
process runs that one call, then exits: stdin ``/dev/null``,
stdout and stderr one pipe, no other inherited descriptor, ``no_new_privs``, the parent-death
signal (set after the uid change, which clears it), an empty working folder of its own (also
``HOME`` and ``TMPDIR``). Its supervisor reads the output as it comes (the head and the last
quarter of ``output_bytes`` kept, the rest counted and marked ``[... N bytes of output cut
...]``: 100 MB of output neither blocks nor fills memory), kills the call at the wall clock,
then every process it left (a daemon never outlives its call: the pid namespace ends with
the call, else its uid's processes and the supervisor's orphans are killed), removes its
folder, whatever modes the code left on it, never following a link, and, where the call
could write the host's shared folders, what its uid left there, all before it answers.
:meth:`Sandbox.close` (also at exit) lets a call in flight end for 3 s, then kills it, its
supervisor and (as root) every process of its uid. Every wait of the trainer is bounded.

What holds (``Sandbox.protections`` reports it for this machine; a protection that could
not be set up is False there, never claimed):

==============================  =================================  ========================
protection                      as root (this trainer's case)      as a plain user
==============================  =================================  ========================
fresh process; the call and     yes                                yes
all it started killed at the
limit and after it returns
rlimits per process: CPU        yes                                yes
seconds, address space, file
size, 64 open files, no core
``max_processes`` (NPROC)       yes, counted for the call's own    with a user namespace;
                                uid                                else added to the user's
                                                                   count
the OOM killer takes the call   yes (``oom_score_adj`` 1000)       yes
first, never the trainer
own uid: cannot signal or       yes: uid = gid = ``uid_base`` +    no: the trainer's uid
trace the trainer, nor read     the supervisor's pid, no groups
root's files that are not
world-readable
no network (own network         yes                                with a user namespace
namespace, loopback down)
own pid namespace (the          yes; and a /proc of its own        with a user namespace
trainer cannot be named)        (``hidepid=2`` where the kernel
                                accepts it): ``own_proc``
own IPC namespace: SysV and     yes; SysV memory at most           with a user namespace
POSIX queues die with the call  ``disk_mb``: ``own_ipc``           (not capped: only root
                                                                   sets the namespace's
                                                                   limits)
own /tmp, /var/tmp, /dev/shm    yes                                with a user namespace
(one ``disk_mb`` tmpfs)
every other mount read-only     yes: ``read_only``                 with a user namespace
and nosuid (nothing it writes
outlives it)
without those namespaces: what  yes                                no
its uid left in the shared
world-writable folders and its
SysV objects removed
system-call filter (seccomp,    yes: ``syscall_filter``            yes
:mod:`.seccomp`): no new        (x86-64, AArch64)                  (x86-64, AArch64)
namespaces, mounts, ptrace,
bpf, io_uring, keyring
==============================  =================================  ========================

Memory. The address-space limit is per process: ``memory_mb`` beyond what the process starts
with, times ``max_processes`` processes: 512 MB x 8, about 4 GB by default, plus its tmpfs
(``disk_mb``, 64 MB) and SysV memory (at most ``disk_mb``). Memory the kernel holds outside
every address space is not capped: ``memfd`` files (each up to ``file_size_mb``, one per open
descriptor), pipe and socket buffers; the OOM killer then takes the call first.

As root, a folder other users cannot enter (``/root``) on the way to the Python
installation is masked in the call's mount namespace by an empty tmpfs, and the folders
Python needs are bound back read-only at their own paths. Root without namespaces keeps the
uid, NPROC and the rlimits, but then the call imports only the zygote's preloaded modules if
the installation lies in such a folder; its working folder is ``<tmp_root>/maxent-sandbox-
XXXX/<pid>`` (the zygote's folder, root's, mode 0711: the call cannot rename or replace its
own folder); it may write any world-writable folder, and the cleanup removes what its uid
owns in ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``, ``/var/lock``, ``/var/crash``,
``/dev/mqueue`` and ``tmp_root``, not in a world-writable folder elsewhere. As root in a
user namespace that does not map ``uid_base`` + every pid, each call fails at once with
``the sandbox cannot run on this machine`` naming ``uid_base`` (the zygote is not started
again). A plain user without user namespaces gets the rlimits, the fresh process, the
minimal environment and the cleanup of its process tree and folder only: the code can
signal the user's processes (``os.kill(-1, 9)`` too), read their ``/proc`` and the user's
files, write wherever the user may, and use the network.

What does not hold, anywhere: the filter refuses only the calls :mod:`.seccomp` lists; the
rest of the system-call interface is reachable (a kernel bug there is an escape). Without
the filter (another architecture, or a kernel that refuses it: ``syscall_filter`` False) a
call may also create nested user namespaces and be root in them, reaching kernel code an
unprivileged process otherwise cannot, and mount a tmpfs there of a size it chooses. The
host's files stay readable wherever their modes let the call's uid read them, and a Unix
socket on the host whose mode lets any uid connect stays reachable (a read-only mount does
not stop ``connect``). The CPU limit is per process (the wall clock bounds the sum). A zygote
killed with SIGKILL does not sweep its calls in flight (their supervisors still do, when
their calls end).

Faults (:attr:`SandboxResult.failure`, kinds of
:data:`~maxent_grpo.rollout.toolcall.FAILURE_KINDS`):

====================================  ========================================  =========
what happened                         what the model reads                      kind
====================================  ========================================  =========
exit status 0                         the output                                (none)
more output than ``output_bytes``     its head, ``[... N bytes of output        (none)
                                      cut ...]``, its tail
an exception, ``sys.exit(3)``         ``Error: python exited with status 1``    error
                                      (``3``), then the output (the traceback, also
                                      when the code closed ``sys.stderr``)
a signal (a segfault, ...)            ``Error: python was killed by signal      error
                                      SIGSEGV (Segmentation fault)``, output
past the wall clock                   ``Error: python gave no result within     timeout
                                      2 s``, then the output so far
killed at its CPU limit (threads      ``Error: python used up its 3 s of CPU    timeout
add up)                               time``, output
its init killed before it reported    ``Error: python ended without its status  error
                                      reaching the sandbox``, output
the sandbox itself failed             ``Error: the sandbox could not run        error
                                      python (<why>)``
====================================  ========================================  =========

A tool run here (``model.tool_isolation: process``) is named by module and name, imported
by the zygote, called in the call's process with the same limits; its answer comes back as
text (a string, else JSON, else ``str``), never pickled; what it raises reads
``Error: <ExceptionType>: <message>``, as in a thread. A tool whose module the zygote cannot
import is named in a warning when the pool starts, and each of its calls fails with
``model.tool_isolation: process: it could not import <module.tool> (<why>)``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from maxent_grpo.rollout.sandbox.pool import WORKER, Pool, killpg
from maxent_grpo.validation import check_int, check_seconds, require

__all__ = ["UID_BASE", "Sandbox", "SandboxError", "SandboxResult", "close_shared_sandbox",
           "python", "shared_sandbox", "tool_reference"]

#: as root, a call runs as uid (and gid) ``UID_BASE`` + its supervisor's pid: its own
UID_BASE = 1_000_000_000
#: seconds the trainer waits past a call's limit for its supervisor before killing it
GRACE = 10.0
NAMESPACED = {"no_network": "reach the network", "pid_namespace": "see the host's processes",
              "private_tmp": "share the host's /tmp (what it leaves there is removed)",
              "read_only": "write the host's world-writable folders", "own_ipc": "use SysV IPC"}
log = logging.getLogger(__name__)  # NAMESPACED: said when refused (Sandbox._say_missing)
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
       "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1",
       "PYTHONNOUSERSITE": "1", "USER": "sandbox", "LOGNAME": "sandbox"}


@dataclass(frozen=True)
class SandboxResult:
    """How one call ended.

    Attributes:
        status: ``exit``, ``signal``, ``timeout`` (wall clock), ``cpu`` (killed by its CPU
            limit), ``lost`` (no status came back: its init was killed) or ``failed`` (the
            sandbox could not run it).
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
        bad = self.status != "exit" or self.code != 0 or self.tool and (
            self.value is None or "error" in self.value)
        return "error" if bad else None

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
        elif self.status == "lost":
            head = f"{name} ended without its status reaching the sandbox"
        else:
            head = f"{name} exited with status {self.code}" + (
                " before giving its answer" if self.tool and self.code == 0 else "")
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
        memory_mb: address space each process of a call may map beyond what it starts with.
        file_size_mb: the largest file it may write; disk_mb: its /tmp (a tmpfs), and the
            cap of its SysV shared memory.
        max_processes: processes and threads of its uid (RLIMIT_NPROC); the call's memory
            is up to ``memory_mb`` times this.
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
                 disk_mb: int = 64, max_processes: int = 8, output_bytes: int = 16384,
                 spares: int = 2, namespaces: bool = True,
                 tools: Sequence[Callable[..., Any]] = (), uid_base: int = UID_BASE,
                 tmp_root: str | None = None) -> None:
        check_seconds("sandbox timeout", timeout)
        limits = {"memory_mb": memory_mb, "file_size_mb": file_size_mb, "disk_mb": disk_mb,
                  "max_processes": max_processes, "output_bytes": output_bytes}
        for name, value in {**limits, "spares": spares, "uid_base": uid_base}.items():
            check_int(f"sandbox {name}", value, minimum=0 if name == "spares" else 1)
        self.timeout = float(timeout)
        self.references = {fn: tool_reference(fn) for fn in tools}
        config = {"limits": limits, "uid_base": uid_base, "namespaces": bool(namespaces),
                  "tmp_root": tmp_root or tempfile.gettempdir(), "env": ENV,
                  "sys_path": [os.path.abspath(p or ".") for p in sys.path] if tools else None,
                  "preload": sorted({m for m, _ in self.references.values()})}
        command = [sys.executable, "-I"] + ([] if tools else ["-S"]) + [WORKER]
        names: dict[str, list[str]] = {}
        for module, qualname in self.references.values():
            names.setdefault(module, []).append(qualname)
        self._pool = Pool(command, config, spares, names)
        self.namespaces, self._said = bool(namespaces), False  # missing ones: said once
        self._finalizer = weakref.finalize(self, self._pool.close)

    @property
    def protections(self) -> dict[str, bool]:
        """Which protections hold for a call (starts the pool)."""
        return dict(self._pool.peek()["protections"])

    @property
    def pid(self) -> int | None:
        """The zygote's pid, None while not started."""
        return None if (p := self._pool.proc) is None or p.poll() is not None else p.pid

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
        check_seconds("sandbox timeout", timeout)
        request.update(timeout=timeout, cpu_seconds=cpu_seconds(timeout))
        deadline = time.monotonic() + timeout + GRACE  # the waits for a spare end by then
        failed = functools.partial(SandboxResult, "failed", tool=tool, timeout=timeout)
        try:
            spare = self._pool.take(deadline)
        except (OSError, ValueError) as err:
            return failed(reason=str(err))
        from maxent_grpo.rollout.sandbox import worker as wire

        reply: Any = None
        try:
            broken = self._pool.errors.get(request["tool"][0]) if tool else None
            if broken is not None:
                return failed(reason=f"model.tool_isolation: process: it could not import "
                                     f"{'.'.join(request['tool'])} ({broken})")
            ready = spare.ready(max(deadline - time.monotonic(), 1.0))
            self._say_missing(ready.get("protections") or {})
            wire.send(spare.sock, request)
            spare.sock.settimeout(timeout + GRACE)
            reply = wire.receive(spare.sock)
        except (OSError, ValueError, RecursionError) as err:  # (arguments json cannot encode)
            if spare.info is None or isinstance(err, RecursionError):
                return failed(reason="its arguments are nested too deeply to send" if isinstance(
                    err, RecursionError) else str(err))
        finally:
            spare.sock.close()
            with contextlib.suppress(OSError):  # the next call starts the pool again
                self._pool.refill()
        if not isinstance(reply, dict) or "status" not in reply:
            killpg(ready["pid"])  # its supervisor is stuck or gone; the call dies with it
            return failed(uid=ready["uid"], reason=reply.get("failed") if isinstance(
                reply, dict) else "no answer from its supervisor")
        return SandboxResult(
            reply["status"], reply["output"], reply.get("code"), reply.get("signal"),
            reply.get("value"), tool, reply["cut"], reply["seconds"], timeout, reply["uid"],
            reply["session"], "" if reply.get("clean") else "processes may be left")

    def _say_missing(self, protections: dict[str, bool]) -> None:
        """Warn once when namespaces were asked for and this machine refused them (the
        code then has what the table says of a machine without them)."""
        missing = [name for name in NAMESPACED if protections.get(name) is False]
        if missing and self.namespaces and not self._said:
            self._said = True
            log.warning(
                "the sandbox runs without %s: this machine refused new namespaces or the mounts "
                "in them (a container without CAP_SYS_ADMIN, a seccomp or AppArmor profile, no "
                "user namespaces), so a call's code may %s; run the trainer where they are "
                "allowed for those (Sandbox.protections)", ", ".join(missing), ", ".join(
                    NAMESPACED[name] for name in missing))

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


def _new_lock_after_fork() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()  # a forked child never waits on its parent's threads


os.register_at_fork(after_in_child=_new_lock_after_fork)


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
