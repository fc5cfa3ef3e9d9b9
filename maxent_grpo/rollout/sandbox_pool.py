"""The trainer's side of :mod:`maxent_grpo.rollout.sandbox`: the zygote process
(:mod:`~maxent_grpo.rollout.sandbox_worker`, started on first use) and the sockets of its
ready spares. Everything here is what :meth:`Pool.close` (also the sandbox's finaliser, at
exit) stops; a pool inherited by a forked child is never stopped from the child, which
starts its own.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

__all__ = ["START_WAIT", "WORKER", "Pool", "Spare", "killpg"]

START_WAIT = 120.0  # seconds for the zygote (and its preloads) or a spare to be ready
#: the zygote's script
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_worker.py")


def killpg(pid: int) -> None:
    """SIGKILL to process group ``pid``, if it is still there."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


class Spare:
    """A ready (or getting ready) supervisor, reached through ``sock``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.info = sock, None

    def ready(self) -> dict[str, Any]:
        if self.info is None:
            from maxent_grpo.rollout import sandbox_worker as wire

            self.sock.settimeout(START_WAIT)
            info = wire.receive(self.sock)
            if not isinstance(info, dict):
                self.sock.close()
                raise OSError("a sandbox process exited before it was ready")
            self.info = info
        return self.info


class Pool:
    """The zygote and its spares; everything :meth:`close` (the finaliser) must stop."""

    def __init__(self, command: list[str], config: dict[str, Any], spares: int) -> None:
        self.command, self.config, self.wanted = command, config, spares
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.control: socket.socket | None = None
        self.spares: collections.deque[Spare] = collections.deque()
        self.owner = os.getpid()
        self.errors: list[str] = []

    def _start(self) -> None:
        if self.proc is not None and self.owner == os.getpid() and self.proc.poll() is None:
            return
        self._drop()
        if not sys.platform.startswith("linux"):
            raise OSError("the sandbox needs Linux")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                self.command + [str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=self.config["env"],
                cwd="/", start_new_session=True)
        finally:
            theirs.close()
        self.owner, self.control = os.getpid(), ours
        try:
            ours.send(json.dumps(self.config).encode())
            ours.settimeout(START_WAIT)
            hello = ours.recv(1 << 20)
            if not hello:
                raise OSError("the sandbox's zygote exited while starting")
            ours.settimeout(None)
            self.errors = json.loads(hello)["errors"]  # preloads that failed to import
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

    def take(self) -> Spare:
        """A spare for one call (call :meth:`refill` when it is done)."""
        with self.lock:
            self._start()
            if not self.spares:
                self._spawn()
            return self.spares.popleft()

    def refill(self) -> None:
        """Spawn spares up to ``spares`` (after a call, so they never slow it down)."""
        with self.lock:
            while self.proc is not None and len(self.spares) < self.wanted:
                self._spawn()

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
                try:
                    self.control.send(b"Q")
                except OSError:
                    pass
            self.control.close()
        proc, self.proc, self.control = self.proc, None, None
        if proc is not None and mine:
            try:
                proc.wait(timeout=8.0)
            except subprocess.TimeoutExpired:
                killpg(proc.pid)
                proc.wait()

    def close(self) -> None:
        with self.lock:
            self._drop()
