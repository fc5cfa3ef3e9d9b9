"""The processes behind :mod:`maxent_grpo.rollout.sandbox`, run as a script
(``python -I [-S] sandbox/worker.py FD``); standard library only, since it runs isolated.

    T  the trainer: starts this script, then talks to it over the control socket FD
    Z  this script's loop (the zygote): reads the config, imports the preloads, then
       forks one S for each socket T passes over the control socket; kills (with every
       process of its call's uid) a spare that is still there when T closes
    S  a spare, later the call's supervisor: its own session, the subreaper of what the
       call leaves behind; makes its namespaces and the call's files
       (:mod:`~maxent_grpo.rollout.sandbox.call`) and forks C and D while it waits; then
       hands D the one request, enforces the wall clock and the output cap, kills what is
       left, removes what the call left where the host would keep it, answers T and exits
    C  the call's init (pid 1 of its own pid namespace when there is one)
    D  the call's process: limits set and uid dropped before the request comes

Messages between T and S are a 4-byte big-endian length and a JSON object.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import tempfile
import time
from importlib import util

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWIPC = 0x00020000, 0x10000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
PR_SET_CHILD_SUBREAPER = 36
WORKDIR = "/tmp/sandbox"
RESULT_CAP = 1 << 20  # bytes of a tool's JSON result
CLOSE_WAIT = 3.0  # seconds Z lets calls in flight end once T closes, before it kills them
#: standard-library modules imported once in the zygote, so a call does not pay for them
PRELOAD = ("collections", "datetime", "decimal", "fractions", "functools", "heapq",
           "itertools", "json", "math", "random", "re", "statistics", "string", "textwrap")

_spec = util.spec_from_file_location(
    "sandbox_call", os.path.join(os.path.dirname(os.path.abspath(__file__)), "call.py"))
CALL = util.module_from_spec(_spec)
_spec.loader.exec_module(CALL)
_sys = CALL._sys


def send(sock: socket.socket, obj: object) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def receive(sock: socket.socket) -> object | None:
    """The next message, or None at end of stream."""
    head = _exactly(sock, 4)
    if head is None:
        return None
    body = _exactly(sock, struct.unpack(">I", head)[0])
    return None if body is None else json.loads(body)


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _open_fds() -> set[int]:
    """The descriptors open now (the listing's own, closed by then, left out)."""
    listed = {int(fd) for fd in os.listdir("/proc/self/fd")}
    for fd in list(listed):
        try:
            os.fstat(fd)
        except OSError:
            listed.discard(fd)
    return listed


def _close_fds_except(*keep: int) -> None:
    """Close every descriptor >= 3 but ``keep``."""
    low = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


class Capture:
    """Output kept within ``cap`` bytes: its head and its last quarter; what lies between is
    counted, not kept, so any amount of output costs ``cap`` bytes of memory."""

    def __init__(self, cap: int) -> None:
        self.cap, self.tail_cap = cap, cap // 4
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.cap - self.tail_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        if len(self.tail) > self.tail_cap:
            del self.tail[:len(self.tail) - self.tail_cap]

    def text(self) -> tuple[str, int]:
        cut = self.total - len(self.head) - len(self.tail)
        if cut <= 0:  # whole: a character across the head's end is one character
            return (self.head + self.tail).decode("utf-8", "replace"), 0
        head, tail = (self.head.decode("utf-8", "replace"), self.tail.decode("utf-8", "replace"))
        return f"{head}\n[... {cut} bytes of output cut ...]\n{tail}", cut


# ---------------------------------------------------------------- Z, the zygote
def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    config = json.loads(control.recv(1 << 22))
    if config["sys_path"] is not None:  # a tool's modules import as they do in the trainer
        sys.path[:] = config["sys_path"] + [p for p in sys.path if p not in config["sys_path"]]
    errors, spare = {}, []  # fds 0-9 taken, so no file a preload opens becomes a call's 0-4
    while (fd := os.open(os.devnull, os.O_RDONLY)) < 10:
        spare.append(fd)
    os.close(fd)
    before = _open_fds()
    for name in list(PRELOAD) + config["preload"]:
        try:
            importlib.import_module(name)
        except BaseException as err:  # noqa: B036 - a preload may fail in any way
            errors[name] = f"{type(err).__name__}: {err}"
    # kept open in a tool's call (a table or a connection opened at import), as in a thread
    config["kept_fds"] = sorted(_open_fds() - before)
    for fd in spare:
        os.close(fd)
    root = os.geteuid() == 0
    fatal = _unmapped(config["uid_base"]) if root else None
    config["syscall_filter"] = CALL.SECCOMP.supported()  # tried once, in a child
    try:  # the parent of the working folders of calls without a private /tmp
        config["base"] = tempfile.mkdtemp(prefix="maxent-sandbox-", dir=config["tmp_root"])
        os.chmod(config["base"], 0o711)  # the calls' uids pass, but cannot rename or list
    except OSError as err:
        fatal = fatal or f"tmp_root {config['tmp_root']!r}: {err}"
    control.send(json.dumps({"pid": os.getpid(), "errors": errors, "fatal": fatal,
                             "base": config.get("base")}).encode())
    spares: dict[int, int | None] = {}  # pid -> the uid its call runs as
    try:
        while fatal is None:
            ready, _, _ = select.select([control], [], [], 0.5)
            _reap(spares, config)
            if not ready:
                continue
            try:
                msg, fds, _, _ = socket.recv_fds(control, 16, 4)
            except OSError:
                msg, fds = b"", []
            if msg != b"S":  # end of stream or b"Q": T is closing
                for fd in fds:
                    os.close(fd)
                break
            for fd in fds:
                pid = _fork_spare(control, fd, config)
                spares[pid] = config["uid_base"] + pid if root else None
    finally:
        deadline = time.monotonic() + CLOSE_WAIT  # spares see T's sockets close and leave
        while spares and time.monotonic() < deadline:
            _reap(spares, config)
            time.sleep(0.01)
        for pid in list(spares):  # a call still in flight: killed, and all it started
            _kill(pid, group=True)
            os.waitpid(pid, 0)
            _after_spare(spares.pop(pid), config)
        if "base" in config:
            CALL.remove_tree(config["base"])


def _unmapped(uid_base: int) -> str | None:
    """Why the calls' uids (``uid_base`` + a pid) cannot be used here, or None."""
    with open("/proc/sys/kernel/pid_max") as f:
        high = uid_base + int(f.read())
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/self/{name}") as f:
            ranges = [tuple(int(n) for n in line.split()[::2]) for line in f]
        if not any(inside <= uid_base and high < inside + count for inside, count in ranges):
            return (f"it runs each call as uid uid_base + a pid, but this user namespace's "
                    f"/proc/self/{name} does not map {uid_base + 1}..{high}; give "
                    f"Sandbox(uid_base=...) the start of a mapped range")
    return None


def _reap(spares: dict[int, int | None], config: dict) -> None:
    for pid in list(spares):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            uid = spares.pop(pid)
            if status != 0:  # it died before its own cleanup
                _after_spare(uid, config)


def _after_spare(uid: int | None, config: dict) -> None:
    """What a spare that did not finish its call leaves: every process of the call's uid
    (a daemon outside a pid namespace), its files in the shared folders, its IPC objects."""
    if uid is not None:
        CALL.kill_uid(uid)
        CALL.leftovers(uid, CALL.SHARED_DIRS + (config["tmp_root"],), ipc=True)


def _kill(pid: int, group: bool = False) -> None:
    with contextlib.suppress(OSError):
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)


def _fork_spare(control: socket.socket, fd: int, config: dict) -> int:
    pid = os.fork()
    if pid:
        os.close(fd)
        return pid
    status, sock = 1, None
    try:
        control.detach()
        _close_fds_except(fd, *config["kept_fds"])  # and the files the tools opened
        sock = socket.socket(fileno=fd)
        spare(sock, config)
        status = 0
    except BaseException as err:  # noqa: B036 - a spare reports and leaves, whatever happened
        try:
            send(sock, {"failed": f"its supervisor failed: {type(err).__name__}: {err}"})
        except BaseException:  # noqa: B036
            pass
    finally:
        os._exit(status)


# ---------------------------------------------------------------- S, spare and supervisor
def spare(sock: socket.socket, config: dict) -> None:
    os.setsid()
    os.umask(0o022)  # what it creates for the call must be enterable by the call's uid
    _sys("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    root = os.geteuid() == 0
    uid = config["uid_base"] + os.getpid() if root else None
    guard = {"fresh_process": True, "rlimits": True, "own_uid": uid is not None,
             "user_namespace": False, "no_network": False, "pid_namespace": False,
             "private_tmp": False, "own_ipc": False, "read_only": False, "own_proc": False}
    disk_mb = config["limits"]["disk_mb"]
    if config["namespaces"]:
        _namespaces(root, guard, disk_mb)
    if guard["private_tmp"]:
        CALL.layout(disk_mb, uid, guard)
    workdir = (WORKDIR if guard["private_tmp"] else
               os.path.join(config["base"], str(os.getpid())))
    os.mkdir(workdir, 0o700)
    if uid is not None:
        os.chown(workdir, uid, uid)
    guard["nproc_limit"] = uid is not None or guard["user_namespace"]
    guard["syscall_filter"] = config["syscall_filter"]
    pipes = {name: os.pipe() for name in ("request", "out", "result", "status")}
    init = CALL.start(config, uid, workdir, guard, pipes)  # C and D, ready for the request
    os.close(pipes["request"][0])
    for name in ("out", "result", "status"):
        os.close(pipes[name][1])
    guard["own_proc"] = os.read(pipes["status"][0], 1) == b"P"
    try:
        send(sock, {"pid": os.getpid(), "uid": uid, "protections": guard})
        request = receive(sock)
    except OSError:  # T closed its end
        request = None
    fds = {name: pipes[name][0] for name in ("out", "result", "status")}
    fds["request"] = pipes["request"][1]
    reply = supervise(init, fds, request, config, uid, guard)
    if not guard["private_tmp"]:  # a private /tmp goes with the mount namespace
        CALL.remove_tree(workdir)
    if uid is not None:  # before the answer: what the call did is undone when T reads it
        tops = () if guard["read_only"] else [
            t for t in CALL.SHARED_DIRS + (config["tmp_root"],)
            if not (guard["private_tmp"] and CALL._under(os.path.realpath(t), CALL.PRIVATE_DIRS))]
        CALL.leftovers(uid, tops, ipc=not guard["own_ipc"])
    if request is not None:
        with contextlib.suppress(OSError):
            send(sock, reply)
    sock.close()


def _namespaces(root: bool, guard: dict, disk_mb: int) -> None:
    """Unshare what this machine allows; ``guard`` records what holds."""
    flags = {"private_tmp": CLONE_NEWNS, "no_network": CLONE_NEWNET,
             "pid_namespace": CLONE_NEWPID, "own_ipc": CLONE_NEWIPC}
    if not root:  # a plain user needs a user namespace for any other
        uid, gid = os.getuid(), os.getgid()
        if not _sys("unshare", CLONE_NEWUSER | sum(flags.values())):
            return
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        guard.update(dict.fromkeys(flags, True), user_namespace=True)
    elif _sys("unshare", sum(flags.values())):
        guard.update(dict.fromkeys(flags, True))
    else:
        for name, flag in flags.items():
            guard[name] = _sys("unshare", flag)
    if guard["own_ipc"]:  # SysV memory of the call's IPC namespace: at most disk_mb in all
        page = os.sysconf("SC_PAGE_SIZE")
        for name, value in (("shmmax", disk_mb << 20), ("shmall", (disk_mb << 20) // page),
                            ("msgmni", 16)):
            with contextlib.suppress(OSError), open(f"/proc/sys/kernel/{name}", "w") as f:
                f.write(str(value))


def supervise(init: int, fds: dict[str, int], request: dict | None, config: dict,
              uid: int | None, guard: dict) -> dict:
    """Hand D the request, read what it writes until C reports or the wall clock ends,
    then kill what is left; the reply T reads (None request: only the cleanup)."""
    start = time.monotonic()
    data = json.dumps(request).encode() if request is not None else b""
    try:
        while data:
            data = data[os.write(fds["request"], data):]
    except OSError:  # D is gone; its status tells why
        pass
    os.close(fds["request"])
    out_r, status_r, result_r = fds["out"], fds["status"], fds["result"]
    if request is None:
        request = {"timeout": 0.0, "cpu_seconds": 1}
    capture, result, status = Capture(config["limits"]["output_bytes"]), bytearray(), bytearray()
    streams = {out_r, status_r, result_r}

    def drain(ready: list[int], wait: float) -> None:
        """Read what the ready ones of ``ready`` hold (waiting ``wait`` s at most)."""
        for fd in select.select(ready, [], [], wait)[0]:
            data = os.read(fd, 1 << 16)
            if not data:
                streams.discard(fd)
            elif fd == out_r:
                capture.add(data)
            elif fd == result_r:
                result.extend(data[:RESULT_CAP + 1 - len(result)])
            else:
                status.extend(data)

    deadline, timed_out = start + request["timeout"], False
    while status_r in streams:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        drain(list(streams), left)
    seconds = time.monotonic() - start
    _kill(init)  # the namespace's init: the kernel then kills the namespace
    _kill(init, group=True)
    os.waitpid(init, 0)
    clean = _sweep(uid, guard["pid_namespace"])
    end = time.monotonic() + 1.0  # what the killed processes had written
    while streams - {status_r} and time.monotonic() < end:
        drain(list(streams - {status_r}), 0.1)
    output, cut = capture.text()
    reply = {"output": output, "cut": cut, "seconds": seconds, "session": init, "uid": uid,
             "clean": clean, "status": "timeout" if timed_out else "lost"}
    if not timed_out and len(status) == 12:
        reply.update(ending(*struct.unpack("<id", status), request["cpu_seconds"]))
    if result:
        try:
            value = json.loads(result) if len(result) <= RESULT_CAP else None
        except ValueError:
            value = None
        reply["value"] = value if isinstance(value, dict) else {
            "error": f"the tool's answer is not JSON or is over {RESULT_CAP} bytes"}
    return reply


def ending(wait: int, cpu: float, limit: int) -> dict:
    """How D ended, from its wait status and the CPU seconds of it and the children it
    waited for: ``cpu`` only when its CPU limit killed it (SIGXCPU at the soft limit, SIGKILL
    at the hard one), not when it exited after its children used that much."""
    if os.WIFSIGNALED(wait):
        number = os.WTERMSIG(wait)
        if number in (signal.SIGXCPU, signal.SIGKILL) and cpu >= limit - 0.25:
            return {"status": "cpu"}
        return {"status": "signal", "signal": number}
    return {"status": "exit", "code": os.WEXITSTATUS(wait)}


def _sweep(uid: int | None, pid_namespace: bool) -> bool:
    """Kill what the call left: every process of its uid (without a pid namespace, whose
    end already did), then every child of this subreaper; True when none is left."""
    if uid is not None and not pid_namespace:
        CALL.kill_uid(uid)
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG)[0]:
                continue
        except ChildProcessError:
            return True
        for pid in _children(os.getpid()):
            _kill(pid)
        time.sleep(0.002)
    return False


def _children(parent: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:
            found.append(int(name))
    return found


if __name__ == "__main__":
    main()
