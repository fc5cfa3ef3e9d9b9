"""The two processes of one sandboxed call (:mod:`maxent_grpo.rollout.sandbox_worker`
forks them while its spare waits, so a call only pays for running its code):

    C  the call's init: its own session (pid 1 of the spare's pid namespace when there is
       one); forks D, waits for it and writes D's wait status and CPU seconds to S; when C
       exits, the kernel kills whatever is left in the namespace
    D  sets its limits, drops to the call's uid, then blocks reading its one request;
       runs the code (``python -c`` semantics) or the tool, and exits

Standard library only: the zygote loads this file from its own folder.
"""

from __future__ import annotations

import ctypes
import fcntl
import importlib
import json
import os
import resource
import signal
import struct
import sys
import traceback
import types

PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
_libc = ctypes.CDLL(None, use_errno=True)


def start(config: dict, uid: int | None, workdir: str, guard: dict,
          pipes: dict[str, tuple[int, int]]) -> int:
    """Fork C (which forks D); C's pid. ``pipes``: ``request`` (S to D), ``out`` (D's
    stdout and stderr), ``result`` (a tool's answer), ``status`` (C to S)."""
    init = os.fork()
    if init:
        return init
    try:
        os.setsid()
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
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
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # fd 0 /dev/null, 1 and 2 the output, 3 the result, 4 the request; nothing else
    sources = [os.open("/dev/null", os.O_RDONLY), pipes["out"][1], pipes["out"][1],
               pipes["result"][1], pipes["request"][0]]
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in sources]
    for target, fd in enumerate(high):
        os.dup2(fd, target)
    os.closerange(5, os.sysconf("SC_OPEN_MAX"))
    limits, mb = config["limits"], 1 << 20
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    processes = limits["max_processes"]
    if not guard["nproc_limit"]:  # counted with the user's own processes
        processes += _tasks_of(os.getuid())
    for which, value in ((resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_AS, mapped + limits["memory_mb"] * mb),
                         (resource.RLIMIT_FSIZE, limits["file_size_mb"] * mb),
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
    chunks = []
    while chunk := os.read(4, 1 << 16):
        chunks.append(chunk)
    os.close(4)
    request = json.loads(b"".join(chunks))
    cpu = request["cpu_seconds"]  # lowering a limit needs no privilege
    _limit(resource.RLIMIT_CPU, cpu, cpu + 1)
    sys.dont_write_bytecode = True
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False,
                      buffering=1)
    if "tool" in request:
        _run_tool(request)
    os.close(3)
    _run_code(request["code"])


def _limit(which: int, soft: int, hard: int) -> None:
    """Set a limit, never above the hard limit the trainer already had."""
    ceiling = resource.getrlimit(which)[1]
    if ceiling != resource.RLIM_INFINITY:
        soft, hard = min(soft, ceiling), min(hard, ceiling)
    resource.setrlimit(which, (soft, hard))


def _tasks_of(uid: int) -> int:
    """Processes and threads of ``uid`` now (what RLIMIT_NPROC counts for it)."""
    count = 0
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return count


def _drop_capabilities() -> None:
    """No capability left in the user namespace (version-3 header, every set empty)."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    _libc.capset(header, (ctypes.c_uint32 * 6)())


def _run_code(source: str) -> None:
    import linecache

    sys.argv = ["-c"]
    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")
    status = 0
    try:
        exec(compile(source, "<code>", "exec"), main_module.__dict__)
    except SystemExit as stop:
        status = _exit_status(stop.code)
    except BaseException as err:  # noqa: B036 - the code's error, reported as Python does
        sys.stdout.flush()
        inner = err.__traceback__.tb_next if err.__traceback__ else None
        traceback.print_exception(type(err), err, inner)
        status = 1
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()  # join the code's threads, as at exit
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(status)


def _exit_status(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives, printing a non-integer code as Python does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
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
                value = json.dumps(value)
            except (TypeError, ValueError, RecursionError):
                value = str(value)
        reply = {"text": value}
    except BaseException as err:  # noqa: B036 - a tool's fault, even SystemExit
        reply = {"error": f"{type(err).__name__}: {err}"}
    data = json.dumps(reply).encode()
    try:
        while data:
            data = data[os.write(3, data):]
        sys.stdout.flush()
    finally:
        os._exit(0)
