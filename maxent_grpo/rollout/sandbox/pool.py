"""The trainer's side of :mod:`maxent_grpo.rollout.sandbox`: the zygote process
(:mod:`~maxent_grpo.rollout.sandbox.worker`, started on first use) and the sockets of its
ready spares. Everything here is what :meth:`Pool.close` (also the sandbox's finaliser, at
exit) stops; a pool inherited by a forked child is never stopped from the child: right
after the fork the child forgets it (its lock new, its sockets closed) and starts its own on
first use. Every wait here is bounded.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

from maxent_grpo.rollout.sandbox.removal import remove_tree

__all__ = ["START_WAIT", "WORKER", "Pool", "Spare", "killpg"]

START_WAIT = 120.0  # seconds for the zygote (and its preloads) or a spare to be ready
CONTROL_WAIT = 30.0  # seconds a message to the zygote may wait
#: the zygote's script
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


def killpg(pid: int) -> None:
    """SIGKILL to process group ``pid``, if it is still there."""
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


class Spare:
    """A ready (or getting ready) supervisor, reached through ``sock``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.info = sock, None

    def ready(self, wait: float = START_WAIT) -> dict[str, Any]:
        """What the spare reports once ready (OSError when it is not within ``wait`` s)."""
        if self.info is None:
            from maxent_grpo.rollout.sandbox import worker as wire

            self.sock.settimeout(wait)
            try:
                info = wire.receive(self.sock)
            except OSError as err:
                self.sock.close()
                raise OSError(f"no sandbox process was ready within {wait:.3g} s") from err
            if not isinstance(info, dict) or "failed" in info:
                self.sock.close()
                raise OSError(info["failed"] if isinstance(info, dict) else
                              "a sandbox process exited before it was ready")
            self.info = info
        return self.info


class Pool:
    """The zygote and its spares; everything :meth:`close` (the finaliser) must stop."""

    def __init__(self, command: list[str], config: dict[str, Any], spares: int,
                 tools: dict[str, list[str]] | None = None) -> None:
        self.command, self.config, self.wanted = command, config, spares
        self.tools = tools or {}  # module -> the tools it holds, for the warning
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.control: socket.socket | None = None
        self.spares: collections.deque[Spare] = collections.deque()
        self.owner = os.getpid()
        self.errors: dict[str, str] = {}  # preloads the zygote could not import -> why
        self.fatal: str | None = None  # why the sandbox cannot run here at all
        self.base: str | None = None  # the zygote's folder of working folders
        _POOLS.add(self)

    def _start(self) -> None:
        if self.proc is not None and self.owner == os.getpid() and self.proc.poll() is None:
            return
        self._drop()
        if self.fatal is not None:  # said once; never a new zygote per call
            raise OSError(self.fatal)
        if not sys.platform.startswith("linux"):
            raise OSError("the sandbox needs Linux")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                self.command + [str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, env=self.config["env"], cwd="/",
                start_new_session=True)
        finally:
            theirs.close()
        self.owner, self.control = os.getpid(), ours
        try:
            ours.settimeout(START_WAIT)
            ours.send(json.dumps(self.config).encode())
            hello = ours.recv(1 << 20)
            if not hello:
                raise OSError("the sandbox's zygote exited while starting")
            ours.settimeout(CONTROL_WAIT)
            hello = json.loads(hello)
            if hello["fatal"]:
                self.fatal = f"the sandbox cannot run on this machine: {hello['fatal']}"
                raise OSError(self.fatal)
            self.errors, self.base = hello["errors"], hello["base"]
            for module in sorted(set(self.errors) & set(self.tools)):
                logging.getLogger(__name__).warning(
                    "model.tool_isolation: process: the sandbox could not import %s, so every "
                    "call of %s fails (%s); it imports it with none of the trainer's "
                    "environment variables (tool_isolation: thread has them)", module,
                    ", ".join(self.tools[module]), self.errors[module])
            for _ in range(self.wanted):
                self._spawn()
        except BaseException:
            self._drop()
            raise

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            socket.send_fds(self.control, [b"S"], [theirs.fileno()])
        finally:
            theirs.close()
        self.spares.append(Spare(ours))

    def take(self, deadline: float) -> Spare:
        """A spare for one call (call :meth:`refill` when it is done); OSError when the pool
        is busy (another thread starting it) until ``deadline`` (``time.monotonic``)."""
        if not self.lock.acquire(timeout=max(deadline - time.monotonic(), 0.01)):
            raise OSError("the sandbox was busy (starting) past the call's time limit")
        try:
            self._start()
            if not self.spares:
                self._spawn()
            return self.spares.popleft()
        finally:
            self.lock.release()

    def refill(self) -> None:
        """Spawn spares up to ``spares`` (after a call, so they never slow it down); skipped
        while another thread holds the pool (the next call spawns one)."""
        if not self.lock.acquire(timeout=1.0):
            return
        try:
            while self.proc is not None and len(self.spares) < self.wanted:
                self._spawn()
        finally:
            self.lock.release()

    def peek(self) -> dict[str, Any]:
        with self.lock:
            self._start()
            if not self.spares:
                self._spawn()
            return self.spares[0].ready()

    def _drop(self) -> None:
        """Forget the processes: stop them when they are this process's, else (inherited
        by a fork) only close this copy of their sockets."""
        mine = self.owner == os.getpid()
        for spare in self.spares:
            spare.sock.close()
        self.spares.clear()
        if self.control is not None:
            if mine:
                with contextlib.suppress(OSError):
                    self.control.send(b"Q")
            self.control.close()
        proc, self.proc, self.control = self.proc, None, None
        if proc is not None and mine:
            try:
                proc.wait(timeout=8.0)
            except subprocess.TimeoutExpired:
                killpg(proc.pid)
                proc.wait()
            if self.base is not None:  # left only when the zygote was killed
                remove_tree(self.base)  # (however deep: never a RecursionError)

    def close(self) -> None:
        with self.lock:
            self._drop()

    def forget(self) -> None:
        """In a forked child: a new lock, and this copy of the parent's pool dropped."""
        self.lock = threading.Lock()
        self._drop()


_POOLS: weakref.WeakSet[Pool] = weakref.WeakSet()


def _forget_after_fork() -> None:
    for pool in list(_POOLS):
        pool.forget()


os.register_at_fork(after_in_child=_forget_after_fork)
