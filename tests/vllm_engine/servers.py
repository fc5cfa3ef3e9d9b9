"""Real ``vllm serve`` processes for the server engine's tests: each on a free localhost port,
in its own process group, stopped (the whole group) however the test ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from maxent_grpo.rollout.server_transfer import free_port
from maxent_grpo.rollout.vllm_server import server_args

__all__ = ["Server", "free_port", "running"]


class Server:
    """One server process; ``url``; :meth:`kill` and :meth:`start` (again, same port).

    It runs in the log's folder, not the repository's: a stale ``*.egg-info`` in the
    current folder would hide the installed package's entry points, and with them the
    ``maxent_file`` weight-transfer backend."""

    def __init__(self, model: str | Path, api_key: str | None, log: Path,
                 transfer: str = "file") -> None:
        self.model, self.api_key, self.log, self.transfer = model, api_key, log, transfer
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> None:
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine apart
        out = open(self.log, "ab")  # noqa: SIM115 - the process writes it while it runs
        args = server_args(self.model, self.port, self.api_key, python=sys.executable,
                           transfer=self.transfer)
        self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=self.log.parent)
        out.close()
        if wait:
            self.wait_healthy()

    def wait_healthy(self, seconds: float = 300.0) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}):\n"
                                   + self.log.read_text()[-4000:])
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vllm serve not healthy after {seconds} s:\n"
                           + self.log.read_text()[-4000:])

    def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        self.proc = None


@contextlib.contextmanager
def running(model: str | Path, log: Path, api_key: str | None = "test-key",
            transfer: str = "file") -> Iterator[Server]:
    server = Server(model, api_key, log, transfer)
    try:
        server.start()
        yield server
    finally:
        server.kill()
