"""The processes behind :mod:`maxent_grpo.rollout.sandbox`, run as a script
(``python -I [-S] sandbox_worker.py FD``); standard library only, since it runs isolated.

    T  the trainer: starts this script, then talks to it over the control socket FD
    Z  this script's loop (the zygote): reads the config, imports the preloads, then
       forks one S for each socket T passes over the control socket
    S  a spare, later the call's supervisor: its own session, the subreaper of what the
       call leaves behind; makes its namespaces and private /tmp and forks C and D
       (:mod:`~maxent_grpo.rollout.sandbox_call`) while it waits; then hands D the one
       request, enforces the wall clock and the output cap, kills what is left, answers
       T and exits
    C  the call's init (pid 1 of its own pid namespace when there is one)
    D  the call's process: limits set and uid dropped before the request comes

Messages between T and S are a 4-byte big-endian length and a JSON object.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import time
import traceback
from importlib import util

CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT = 1, 2, 4, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_CHILD_SUBREAPER = 36
#: the world-writable folders a call gets its own (size-capped) copy of
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
WORKDIR = "/tmp/sandbox"
RESULT_CAP = 1 << 20  # bytes of a tool's JSON result
#: standard-library modules imported once in the zygote, so a call does not pay for them
PRELOAD = ("collections", "datetime", "decimal", "fractions", "functools", "heapq",
           "itertools", "json", "math", "random", "re", "statistics", "string", "textwrap")

_libc = ctypes.CDLL(None, use_errno=True)
_spec = util.spec_from_file_location(
    "sandbox_call", os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_call.py"))
CALL = util.module_from_spec(_spec)
_spec.loader.exec_module(CALL)


def _sys(name: str, *args: object) -> bool:
    """A libc call; True when it returned 0."""
    return getattr(_libc, name)(*args) == 0


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
        head, tail = (self.head.decode("utf-8", "replace"), self.tail.decode("utf-8", "replace"))
        if cut <= 0:
            return head + tail, 0
        return f"{head}\n[... {cut} bytes of output cut ...]\n{tail}", cut


# ---------------------------------------------------------------- Z, the zygote
def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    config = json.loads(control.recv(1 << 22))
    if config["sys_path"] is not None:  # a tool's modules import as they do in the trainer
        sys.path[:] = config["sys_path"] + [p for p in sys.path if p not in config["sys_path"]]
    errors = []
    for name in list(PRELOAD) + config["preload"]:
        try:
            importlib.import_module(name)
        except BaseException as err:  # noqa: B036 - a preload may fail in any way
            errors.append(f"{name}: {type(err).__name__}: {err}")
    control.send(json.dumps({"pid": os.getpid(), "errors": errors}).encode())
    spares: set[int] = set()
    while True:
        ready, _, _ = select.select([control], [], [], 0.5)
        _reap(spares)
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
            spares.add(_fork_spare(control, fd, config))
    deadline = time.monotonic() + 5.0  # spares see T's sockets close and leave
    while spares and time.monotonic() < deadline:
        _reap(spares)
        time.sleep(0.01)
    for pid in spares:
        _kill(pid, group=True)
        os.waitpid(pid, 0)


def _reap(children: set[int]) -> None:
    for pid in list(children):
        if os.waitpid(pid, os.WNOHANG)[0]:
            children.discard(pid)


def _kill(pid: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except OSError:
        pass


def _fork_spare(control: socket.socket, fd: int, config: dict) -> int:
    pid = os.fork()
    if pid:
        os.close(fd)
        return pid
    status = 1
    try:
        control.detach()
        _close_fds_except(fd)
        spare(socket.socket(fileno=fd), config)
        status = 0
    except BaseException:  # noqa: B036 - a spare reports and leaves, whatever happened
        traceback.print_exc()
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
             "private_tmp": False}
    if config["namespaces"]:
        _namespaces(root, guard)
    if guard["private_tmp"]:
        _private_dirs(config["limits"]["disk_mb"], uid, guard)
    workdir = (WORKDIR if guard["private_tmp"] else
               os.path.join(config["tmp_root"], f"maxent-sandbox-{os.getpid()}"))
    os.mkdir(workdir, 0o700)
    if uid is not None:
        os.chown(workdir, uid, uid)
    guard["nproc_limit"] = uid is not None or guard["user_namespace"]
    pipes = {name: os.pipe() for name in ("request", "out", "result", "status")}
    init = CALL.start(config, uid, workdir, guard, pipes)  # C and D, ready for the request
    os.close(pipes["request"][0])
    for name in ("out", "result", "status"):
        os.close(pipes[name][1])
    try:
        send(sock, {"pid": os.getpid(), "uid": uid, "protections": guard})
        request = receive(sock)
    except OSError:  # T closed its end
        request = None
    fds = {name: pipes[name][0] for name in ("out", "result", "status")}
    fds["request"] = pipes["request"][1]
    reply = supervise(init, fds, request, config, uid, guard)
    if request is not None:
        try:
            send(sock, reply)
        except OSError:
            pass
    sock.close()
    if not guard["private_tmp"]:  # a private /tmp goes with the mount namespace
        _remove_tree(workdir)


def _namespaces(root: bool, guard: dict) -> None:
    """Unshare what this machine allows; ``guard`` records what holds."""
    flags = {"private_tmp": CLONE_NEWNS, "no_network": CLONE_NEWNET,
             "pid_namespace": CLONE_NEWPID}
    if not root:  # a plain user needs a user namespace for any other
        uid, gid = os.getuid(), os.getgid()
        if not _sys("unshare", CLONE_NEWUSER | sum(flags.values())):
            return
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        guard.update(dict.fromkeys(flags, True), user_namespace=True)
        return
    if _sys("unshare", sum(flags.values())):
        guard.update(dict.fromkeys(flags, True))
        return
    for name, flag in flags.items():
        guard[name] = _sys("unshare", flag)


def _private_dirs(disk_mb: int, uid: int | None, guard: dict) -> None:
    """Own /tmp (shared by /var/tmp and /dev/shm) of ``disk_mb``; with a uid of its own,
    the folders that hide the Python installation from that uid are masked and the paths
    Python needs are bound back, read-only, at their own places."""
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
        target = path.encode()
        if _sys("mount", f"/proc/self/fd/{fd}".encode(), target, None, MS_BIND | MS_REC, None):
            _sys("mount", None, target, None,
                 MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
        os.close(fd)


def _python_paths() -> list[str]:
    """The folders this Python reads from, outermost only."""
    found = {os.path.realpath(p) for p in [sys.base_prefix, sys.base_exec_prefix, sys.prefix,
                                           os.path.dirname(sys.executable)] + sys.path
             if p and os.path.isdir(p)}
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
    capture, result, status = Capture(config["limits"]["output_bytes"]), bytearray(), b""
    streams = {out_r, status_r, result_r}
    deadline, timed_out = start + request["timeout"], False
    while status_r in streams:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for fd in select.select(list(streams), [], [], left)[0]:
            data = os.read(fd, 1 << 16)
            if not data:
                streams.discard(fd)
            elif fd == out_r:
                capture.add(data)
            elif fd == result_r:
                result += data[:RESULT_CAP + 1 - len(result)]
            else:
                status += data
    seconds = time.monotonic() - start
    _kill(init)  # the namespace's init: the kernel then kills the namespace
    _kill(init, group=True)
    os.waitpid(init, 0)
    clean = _sweep(uid, guard["pid_namespace"])
    end = time.monotonic() + 1.0  # what the killed processes had written
    while streams - {status_r} and time.monotonic() < end:
        for fd in select.select(list(streams - {status_r}), [], [], 0.1)[0]:
            data = os.read(fd, 1 << 16)
            if not data:
                streams.discard(fd)
            elif fd == out_r:
                capture.add(data)
            else:
                result += data[:RESULT_CAP + 1 - len(result)]
    output, cut = capture.text()
    reply = {"output": output, "cut": cut, "seconds": seconds, "session": init, "uid": uid,
             "clean": clean, "status": "timeout" if timed_out else "lost"}
    if not timed_out and len(status) == 12:
        wait, cpu = struct.unpack("<id", status)
        if cpu >= request["cpu_seconds"]:
            reply["status"] = "cpu"
        elif os.WIFSIGNALED(wait):
            reply.update(status="signal", signal=os.WTERMSIG(wait))
        else:
            reply.update(status="exit", code=os.WEXITSTATUS(wait))
    if result:
        try:
            value = json.loads(result) if len(result) <= RESULT_CAP else None
        except ValueError:
            value = None
        reply["value"] = value if isinstance(value, dict) else {
            "error": f"the tool's answer is not JSON or is over {RESULT_CAP} bytes"}
    return reply


def _sweep(uid: int | None, pid_namespace: bool) -> bool:
    """Kill what the call left: every process of its uid (without a pid namespace, whose
    end already did), then every child of this subreaper; True when none is left."""
    if uid is not None and not pid_namespace:
        reaper = os.fork()
        if reaper == 0:
            try:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)  # every process this uid may signal
            finally:
                os._exit(0)
        os.waitpid(reaper, 0)
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


def _remove_tree(path: str) -> None:
    """Remove ``path`` whatever modes the call left on it."""
    for folder, dirs, _ in os.walk(path):
        for d in dirs:
            try:
                os.chmod(os.path.join(folder, d), 0o700, follow_symlinks=False)
            except OSError:
                pass
    import shutil

    os.chmod(path, 0o700)
    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
