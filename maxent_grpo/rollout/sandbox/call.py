"""The call's side of :mod:`maxent_grpo.rollout.sandbox.worker`: the files a call sees (its
mount namespace, laid out by its supervisor S), the removal of what it leaves where the host
would keep it, and the two processes of one call, which S forks while its spare waits, so a
call only pays for running its code:

    C  the call's init: its own session (pid 1 of the spare's pid namespace when there is
       one, with a /proc of that namespace only); forks D, waits for it and writes D's wait
       status and CPU seconds to S; when C exits, the kernel kills whatever is left in the
       namespace
    D  sets its limits, drops to the call's uid, then blocks reading its one request;
       runs the code (``python -c`` semantics) or the tool, and exits

Standard library only: the zygote loads this file from its own folder.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import importlib
import json
import os
import re
import resource
import signal
import struct
import sys
import traceback
import types
from importlib import util

PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, CLONE_NEWNS = 1, 38, 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
#: per-mount options a read-only remount keeps (a user namespace may not drop them)
KEPT = {"nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048,
        "relatime": 1 << 21}
#: the world-writable folders a call gets its own (size-capped) copy of
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
#: world-writable folders where a call that sees the host's files writable may leave some
SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/var/crash",
               "/dev/mqueue")
OPEN_FILES = 64  # RLIMIT_NOFILE of a call's processes
_libc = ctypes.CDLL(None, use_errno=True)
_spec = util.spec_from_file_location(  # loaded by path, as this file is (standard library)
    "sandbox_seccomp", os.path.join(os.path.dirname(os.path.abspath(__file__)), "seccomp.py"))
SECCOMP = util.module_from_spec(_spec)
_spec.loader.exec_module(SECCOMP)
_spec = util.spec_from_file_location(  # what a call leaves: removed (standard library too)
    "sandbox_removal", os.path.join(os.path.dirname(os.path.abspath(__file__)), "removal.py"))
REMOVAL = util.module_from_spec(_spec)
_spec.loader.exec_module(REMOVAL)
leftovers, remove_tree, _remove_at = REMOVAL.leftovers, REMOVAL.remove_tree, REMOVAL._remove_at


def _sys(name: str, *args: object) -> bool:
    """A libc call; True when it returned 0."""
    return getattr(_libc, name)(*args) == 0


# ---------------------------------------------------------------- the call's files (S)
def layout(disk_mb: int, uid: int | None, guard: dict) -> None:
    """In S's new mount namespace: own /tmp (shared by /var/tmp and /dev/shm) of
    ``disk_mb``; with a uid of its own, the folders that hide the Python installation from
    that uid masked and the paths Python needs bound back at their own places; then every
    other mount read-only and nosuid. ``guard`` records what holds."""
    needed = _python_paths()
    hidden = {}
    if uid is not None:
        for path in needed:
            top = _hidden_below(path)
            if top is not None and not _under(path, PRIVATE_DIRS):
                hidden.setdefault(top, []).append(path)
    keep = [p for p in needed if _under(p, PRIVATE_DIRS) or any(p in v for v in hidden.values())]
    handles = {p: os.open(p, os.O_PATH) for p in keep}
    ok = _sys("mount", None, b"/", None, MS_REC | MS_PRIVATE, None) and _sys(
        "mount", b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV,
        f"size={disk_mb}m,nr_inodes=16384,mode=1777".encode())
    if not ok:
        guard["private_tmp"] = False
        return
    for folder in PRIVATE_DIRS[1:]:
        if os.path.isdir(folder):
            _sys("mount", b"/tmp", folder.encode(), None, MS_BIND, None)
    for top in hidden:
        _sys("mount", b"tmpfs", top.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
             b"size=1m,mode=755")
    for path, fd in handles.items():
        os.makedirs(path, 0o755, exist_ok=True)
        if _sys("mount", f"/proc/self/fd/{fd}".encode(), path.encode(), None,
                MS_BIND | MS_REC, None):
            _sys("mount", None, path.encode(), None,
                 MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
        os.close(fd)
    guard["read_only"] = _read_only()


def _read_only() -> bool:
    """Remount every mount but the private folders and /proc read-only and nosuid (this
    namespace's copies: the host's mounts are untouched); True when each one reachable is."""
    with open("/proc/self/mountinfo", "rb") as f:
        mounts = [line.split() for line in f]
    ok = True
    for fields in mounts:
        point = os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4]))
        if _under(point, PRIVATE_DIRS + ("/proc",)):
            continue
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID
        for option in fields[5].decode().split(","):
            flags |= KEPT.get(option, 0)
        if not _sys("mount", None, os.fsencode(point), None, flags, None):
            # a mount hidden under another one cannot be reached, so needs nothing
            ok = ok and point != "/" and ctypes.get_errno() in (errno.ENOENT, errno.EINVAL)
    return ok


def own_proc() -> bool:
    """In C (pid 1 of its pid namespace): a mount namespace of its own with a fresh /proc,
    which shows only that namespace's processes (and, where accepted, only the uid's own)."""
    if not (_sys("unshare", CLONE_NEWNS)
            and _sys("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)):
        return False
    return any(_sys("mount", b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                    option) for option in (b"hidepid=2", None))


def _python_paths() -> list[str]:
    """The folders this Python reads from, outermost only; not a private folder itself (a
    host run from /tmp has it on sys.path: bound back, the host's /tmp, read-only, hid the
    call's own), only what Python reads below it."""
    found = {os.path.realpath(p) for p in [sys.base_prefix, sys.base_exec_prefix, sys.prefix,
                                           os.path.dirname(sys.executable)] + sys.path
             if p and os.path.isdir(p)} - {os.path.realpath(d) for d in PRIVATE_DIRS}
    return sorted(p for p in found if not any(_under(p, [q]) for q in found if q != p))


def _under(path: str, folders: list[str] | tuple[str, ...]) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def _hidden_below(path: str) -> str | None:
    """The outermost folder on ``path`` that other users cannot enter, or None."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        prefix = "/" + "/".join(parts[:i])
        if not os.stat(prefix).st_mode & 0o001:
            return prefix
    return None


# ---------------------------------------------------------------- what a call leaves (S, Z)
def kill_uid(uid: int) -> None:
    """SIGKILL to every process ``uid`` may signal (from a child that becomes ``uid``)."""
    reaper = os.fork()
    if reaper == 0:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(reaper, 0)


# ---------------------------------------------------------------- C and D
def start(config: dict, uid: int | None, workdir: str, guard: dict,
          pipes: dict[str, tuple[int, int]]) -> int:
    """Fork C (which forks D); C's pid. ``pipes``: ``request`` (S to D), ``out`` (D's
    stdout and stderr), ``result`` (a tool's answer), ``status`` (C to S: first one byte,
    ``P`` when C has its own /proc, then D's end)."""
    init = os.fork()
    if init:
        return init
    try:
        os.setsid()
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        with contextlib.suppress(OSError):  # the OOM killer takes the call first; D inherits
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        mounted = guard["pid_namespace"] and guard["private_tmp"] and own_proc()
        os.write(pipes["status"][1], b"P" if mounted else b"-")
        for name in ("out", "status", "result"):
            os.close(pipes[name][0])
        os.close(pipes["request"][1])
        worker = os.fork()
        if worker == 0:
            try:
                os.close(pipes["status"][1])
                prepare(config, uid, workdir, guard, pipes)
            finally:
                os._exit(112)
        for fd in (pipes["request"][0], pipes["out"][1], pipes["result"][1]):
            os.close(fd)
        _, wait, usage = os.wait4(worker, 0)
        os.write(pipes["status"][1], struct.pack("<id", wait, usage.ru_utime + usage.ru_stime))
    finally:
        os._exit(0)


def prepare(config: dict, uid: int | None, workdir: str, guard: dict,
            pipes: dict[str, tuple[int, int]]) -> None:
    """D: become the sandboxed process, wait for the request, run it (never returns)."""
    parent = os.getppid()
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # fd 0 /dev/null, 1 and 2 the output, 3 the result, 4 the request; nothing else
    sources = [os.open("/dev/null", os.O_RDONLY), pipes["out"][1], pipes["out"][1],
               pipes["result"][1], pipes["request"][0]]
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in sources]
    for target, fd in enumerate(high):
        os.dup2(fd, target)
    kept = config.get("kept_fds", [])  # files the tools' modules opened at import (>= 10)
    for after, until in zip([4, *kept], [*kept, os.sysconf("SC_OPEN_MAX")], strict=True):
        os.closerange(after + 1, until)
    limits, mb = config["limits"], 1 << 20
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    processes = limits["max_processes"]
    if not guard["nproc_limit"]:  # counted with the user's own processes
        processes += _tasks_of(os.getuid())
    for which, value in ((resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_AS, mapped + limits["memory_mb"] * mb),
                         (resource.RLIMIT_FSIZE, limits["file_size_mb"] * mb),
                         (resource.RLIMIT_NOFILE, OPEN_FILES),
                         (resource.RLIMIT_NPROC, processes)):
        _limit(which, value, value)
    os.chdir(workdir)
    os.umask(0o077)
    os.environ.clear()
    os.environ.update(config["env"], HOME=workdir, TMPDIR=workdir)
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    elif guard["user_namespace"]:
        _drop_capabilities()
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # a new uid cleared it
    if os.getppid() != parent:  # C died before it was set
        os._exit(112)
    if guard["syscall_filter"] and not SECCOMP.install():  # claimed: never run without it
        _write_stderr("the sandbox could not install its system-call filter\n")
        os._exit(70)
    chunks = []
    while chunk := os.read(4, 1 << 16):
        chunks.append(chunk)
    os.close(4)
    request = json.loads(b"".join(chunks))
    if "tool" not in request:  # those files are a tool's, not the model's code's
        os.closerange(5, os.sysconf("SC_OPEN_MAX"))
    cpu = request["cpu_seconds"]  # lowering a limit needs no privilege
    _limit(resource.RLIMIT_CPU, cpu, cpu + 1)
    sys.dont_write_bytecode = True
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False,
                      buffering=1)  # by lines: what was printed before a kill is kept
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False,
                      buffering=1)
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr  # the zygote's: never flushed
    if "tool" in request:
        _run_tool(request)
    os.close(3)
    _run_code(request["code"])


def _limit(which: int, soft: int, hard: int) -> None:
    """Set a limit, never above the hard limit the trainer already had."""
    ceiling = resource.getrlimit(which)[1]
    top = hard if ceiling == resource.RLIM_INFINITY else ceiling
    resource.setrlimit(which, (min(soft, top), min(hard, top)))


def _tasks_of(uid: int) -> int:
    """Processes and threads of ``uid`` now (what RLIMIT_NPROC counts for it)."""
    count = 0
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError, KeyError, ValueError):
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
    return count


def _drop_capabilities() -> None:
    """No capability left in the user namespace (version-3 header, every set empty)."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    _libc.capset(header, (ctypes.c_uint32 * 6)())


def _write_stderr(text: str) -> None:
    """Straight to fd 2: the code may have closed or replaced ``sys.stderr``."""
    with contextlib.suppress(OSError):
        data = text.encode("utf-8", "backslashreplace")
        while data:
            data = data[os.write(2, data):]


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed or replaced by the code
            stream.flush()


def _run_code(source: str) -> None:
    import _sitebuiltins
    import atexit
    import builtins
    import linecache

    sys.argv = ["-c"]
    for name in ("exit", "quit"):  # the site module's, which the pool's Python (-S) skips
        setattr(builtins, name, _sitebuiltins.Quitter(name, "Ctrl-D (i.e. EOF)"))
    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")
    status = 0
    try:
        exec(compile(source, "<code>", "exec", dont_inherit=True), main_module.__dict__)
    except SystemExit as stop:
        status = _exit_status(stop.code)
    except BaseException as err:  # noqa: B036 - the code's error, reported as Python does
        _flush()
        inner = err.__traceback__.tb_next if err.__traceback__ else None
        try:
            _write_stderr("".join(traceback.format_exception(type(err), err, inner)))
        except BaseException:  # noqa: B036 - an exception whose text itself fails
            _write_stderr(f"{type(err).__name__} (its message could not be shown)\n")
        status = 1
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()  # join the code's threads, as at exit
        atexit._run_exitfuncs()
    finally:
        _flush()
        os._exit(status)


def _exit_status(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives, printing a non-integer code as Python does."""
    if code is None or isinstance(code, int):  # sys.exit() and sys.exit(n) (a C long)
        return (code or 0) & 0xFF if -(2**63) <= (code or 0) < 2**63 else 255
    _flush()
    with contextlib.suppress(BaseException):  # a code whose str() fails
        _write_stderr(f"{code}\n")
    return 1


def _run_tool(request: dict) -> None:
    """Call the tool; its answer (text, or the error) goes to fd 3 as JSON."""
    try:
        module, qualname = request["tool"]
        fn = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        value = fn(**request["arguments"])
        if not isinstance(value, str):  # as a thread's answer reads
            try:
                value = json.dumps(value, ensure_ascii=False)
            except (TypeError, ValueError, RecursionError):
                try:  # as toolcall._shown reads such a value in a thread
                    value = str(value)
                except RecursionError:
                    value = f"<a {type(value).__name__} nested too deeply to show>"
                except Exception as err:  # noqa: BLE001 - any __str__ may fail
                    value = (f"<a {type(value).__name__} that cannot be shown "
                             f"({type(err).__name__})>")
        reply = {"text": value}
    except BaseException as err:  # noqa: B036 - a tool's fault, even SystemExit
        reply = {"error": type(err).__name__}
        with contextlib.suppress(Exception):  # a message that cannot be built: the type
            reply["error"] += f": {err}"
    # UTF-8: a non-ASCII answer costs its bytes, not 6 per character (a lone surrogate: \u)
    data = json.dumps(reply, ensure_ascii=False).encode("utf-8", "backslashreplace")
    try:
        while data:
            data = data[os.write(3, data):]
        _flush()
    finally:
        os._exit(0)
