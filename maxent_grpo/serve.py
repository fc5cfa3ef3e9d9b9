"""Start a local ``vllm serve`` for :class:`~maxent_grpo.rollout.VLLMServerEngine` and,
optionally, run a training command against it, stopping the server afterwards.

    python -m maxent_grpo.serve --model builtin:tiny-h64-warm
        serves until Ctrl-C (printing the URL and the key to give the trainer);
    python -m maxent_grpo.serve --model builtin:tiny-h64-warm -- fit --config CONFIG
        starts the server on a free localhost port, runs ``python -m maxent_grpo fit ...``
        with ``--model.engine.init_args.urls`` set to it and the key in ``VLLM_API_KEY``,
        then stops the server (also when the training fails or is interrupted).

Run it with the Python of an environment that has vLLM (``make setup-vllm`` on a CPU:
``.venv-vllm/bin/python``). The server listens on 127.0.0.1 only and requires a fresh random
API key on its ``/v1`` routes; its weight-update routes have no key in vLLM, so the port
must not be reachable from other machines (docs/VLLM.md, "vLLM servers").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class _Stopped(KeyboardInterrupt):
    """A SIGTERM or SIGHUP, raised as Ctrl-C is, with the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _shell_code(code: int) -> int:
    """A child's return code as a shell reports it (killed by signal N: 128 + N)."""
    return 128 - code if code < 0 else code


def _interrupt(signum: int, frame: object) -> None:
    raise _Stopped(signum)


STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _ignore_stops() -> dict[int, Any]:
    """Ignore Ctrl-C, SIGTERM and SIGHUP while stopping; returns the handlers to put back."""
    return {stop: signal.signal(stop, signal.SIG_IGN) for stop in STOPS}


def _server_child(cpus: set[int] | None) -> Callable[[], None]:
    """What a child (the server, the training) runs before it starts: SIGTERM when this
    process dies (a SIGKILL or the out-of-memory kill skip the ``finally`` that stops the
    server), and its CPUs.
    ``prctl`` is looked up here, in the parent: a child forked from threads loads nothing."""
    import ctypes

    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def child() -> None:
        prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before that
            os._exit(1)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    return child


def _cpus(spec: str) -> set[int]:
    """``"1"``, ``"2-3"``, ``"0,2"`` -> the CPU numbers."""
    out: set[int] = set()
    for part in spec.split(","):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


def _port_taken(port: int) -> bool:
    """Whether a server listens on ``port`` (bound as vLLM binds, ``SO_REUSEADDR``: the
    closed connections of a server just stopped do not count, vLLM starts there at once)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, seconds: float,
                  key: str) -> None:
    """Until the server started here answers: its ``/health``, then its ``/v1/models`` with
    this run's key (a server of someone else's on the port would refuse it)."""
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if proc.poll() is not None:
            raise SystemExit(f"vllm serve exited with {proc.returncode} before it answered; "
                             f"its log ({log}) ends:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                models = httpx.get(url + "/v1/models", timeout=10,
                                   headers={"Authorization": f"Bearer {key}"})
                if proc.poll() is None and models.status_code == 200:
                    return
                if models.status_code == 401:
                    raise SystemExit(f"another server answers at {url} (it refuses this run's "
                                     "key): choose another --port, or leave it out")
        print(f"\rwaiting for vllm serve at {url} ... {time.monotonic() - start:.0f} s",
              end="", file=sys.stderr, flush=True)
        time.sleep(1)
    raise SystemExit(f"vllm serve did not answer at {url} within {seconds:g} s; log: {log}")


def main(argv: list[str] | None = None) -> int:
    from maxent_grpo.models import model_chain
    from maxent_grpo.rollout.server_transfer import free_port
    from maxent_grpo.rollout.vllm_server import server_args

    argv = sys.argv[1:] if argv is None else argv
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="python -m maxent_grpo.serve",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="the model to serve: a builtin: name, a folder or a hub name")
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weight-transfer", choices=["file", "gloo"], default="file",
                        help="the server's weight-transfer backend (maxent_file or "
                             "maxent_gloo); a training command gets the same "
                             "model.engine.init_args.weight_transfer")
    parser.add_argument("--model-cache-dir", default=None,
                        help="where builtin: models are written (default: the trainer's)")
    parser.add_argument("--start-seconds", type=float, default=600.0,
                        help="how long to wait for the server to answer")
    parser.add_argument("--server-cpus", default=None,
                        help="pin the server to these CPUs (e.g. 1 or 2-3), and the training "
                             "to the others: on a small machine the two sides then do not "
                             "fight over cores")
    args = parser.parse_args(argv)
    server_cpus = _cpus(args.server_cpus) if args.server_cpus else None
    trainer_cpus = (sorted(os.sched_getaffinity(0) - server_cpus) if server_cpus else None)
    if server_cpus is not None and not trainer_cpus:
        raise SystemExit(f"--server-cpus {args.server_cpus} leaves no CPU for the training")
    if args.port is not None and _port_taken(args.port):
        raise SystemExit(f"port {args.port} on 127.0.0.1 is taken (another server?): choose "
                         "another --port, or leave it out for a free one")
    # an adapter folder (HFExport's final): its base, the end of the chain; the engine
    # sends the policy's merged weights before the first rollout
    folder = model_chain(args.model, args.model_cache_dir)[-1]
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    key = os.environ.get("VLLM_API_KEY") or secrets.token_hex(16)
    work = Path(tempfile.mkdtemp(prefix="maxent_grpo_serve_"))
    log = work / "vllm_serve.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    if len(str(work)) <= 64:  # its sockets' files (ipc paths up to 107 bytes) and others
        env["TMPDIR"] = str(work)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if server_cpus is not None:
        cpus = ",".join(map(str, sorted(server_cpus)))
        env.update(VLLM_CPU_OMP_THREADS_BIND=cpus, OMP_NUM_THREADS=str(len(server_cpus)))
    with open(log, "wb") as out:
        # started outside the current folder: a stale *.egg-info there would hide the
        # installed package's entry points (the maxent_file backend)
        proc = subprocess.Popen(server_args(folder, port, key, args.dtype, sys.executable,
                                            args.weight_transfer),
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work,
                                start_new_session=True,
                                preexec_fn=_server_child(server_cpus))
    training: subprocess.Popen | None = None
    stops: dict[int, Any] = {}  # the handlers while stopping: ignored
    # a SIGTERM (a scheduler's stop, `kill`: the training stops after its batch, as it would
    # alone) or a SIGHUP (the terminal closed: as Ctrl-C) stops the server too
    callers = {stop: signal.signal(stop, _interrupt) for stop in (signal.SIGTERM, signal.SIGHUP)}
    clean = False  # a training that finished: the server's log goes with its folder
    try:
        _wait_healthy(url, proc, log, args.start_seconds, key)
        print(f"\rvllm serve is up at {url} (log: {log})", file=sys.stderr, flush=True)
        if not command:
            print(f"give the trainer: --model.engine.init_args.urls=[{url}] with "
                  f"VLLM_API_KEY={key}; Ctrl-C stops the server", file=sys.stderr, flush=True)
            return _shell_code(proc.wait())
        train = [sys.executable, "-m", "maxent_grpo", *command,
                 f"--model.engine.init_args.urls=[{url}]",
                 f"--model.engine.init_args.weight_transfer={args.weight_transfer}"]
        train_env = {**os.environ, "VLLM_API_KEY": key}
        if trainer_cpus is not None:
            train_env["OMP_NUM_THREADS"] = str(len(trainer_cpus))
        training = subprocess.Popen(train, env=train_env,  # SIGTERM too if serve is killed
                                    preexec_fn=_server_child(trainer_cpus))
        code = training.wait()
        clean = code == 0
        return _shell_code(code)
    except KeyboardInterrupt as stop:
        stops = _ignore_stops()  # a second signal must not leave the training behind
        signum = getattr(stop, "signum", signal.SIGINT)
        signum = signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT
        if training is None:
            return 128 + signum
        if training.poll() is None:
            training.send_signal(signum)  # Lightning stops it, as that signal alone does
            try:
                training.wait(timeout=120)
            except subprocess.TimeoutExpired:
                training.kill()
        return _shell_code(training.wait()) or 128 + signum
    finally:
        stops = stops or _ignore_stops()  # a second signal would skip the SIGKILL below
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if clean:
            shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(OSError):  # a terminal closed (SIGHUP) cannot be written to
            print("vllm serve stopped" + ("" if clean else f" (its log: {log})"),
                  file=sys.stderr)
        signal.signal(signal.SIGINT, stops[signal.SIGINT])  # main() run inside a process:
        for stop, handler in callers.items():  # the caller's handlers, as they were
            signal.signal(stop, handler)


if __name__ == "__main__":
    raise SystemExit(main())
