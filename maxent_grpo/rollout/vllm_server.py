"""Rollout on ``vllm serve`` processes: generation on separate inference servers.

``model.engine: {class_path: maxent_grpo.rollout.VLLMServerEngine, init_args: {urls: [...]}}``.
The trainer sends its prompts as token ids to one or more stock vLLM OpenAI servers
(``/v1/completions``, one request per prompt with ``n = G``, spread over the servers) and
gets back each sampled token's id and log-probability, so the result is exactly the
colocated engine's :class:`~maxent_grpo.rollout.RolloutOutput`, multi-turn continuations
(``continue_ids``) included: tools and environments work on it unchanged.

Weights. After every optimizer step the trainer calls :meth:`VLLMServerEngine.sync`; rank 0
alone sends (every rank gathers an FSDP2 policy's shards, since the gather is a collective),
through vLLM's weight-transfer protocol: ``/pause`` (requests in flight finish on the old
weights), ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update`` with the
new version, the prefix cache reset, ``/resume``. The transport is the ``maxent_file``
backend (:mod:`maxent_grpo.vllm_plugin`): the trainer writes one safetensors file where the
server can read it (``transfer_dir``: ``/dev/shm`` by default) and the server checks it is
complete before loading it. ``weight_transfer="nccl"`` broadcasts the tensors instead,
through vLLM's own NCCL backend (GPU servers), and ``"gloo"`` through this package's
``maxent_gloo`` (CPU servers without a shared file system): :mod:`.server_transfer`. The
server stays paused from before the transfer until it has finished, so it never samples
from a mix of two versions (failures and revival: :mod:`.server_weights`).

At start every server is waited for (``connect_seconds``) and checked
(:mod:`.server_checks`). A request that fails to connect, times out (``request_timeout``),
comes back aborted or is not the rows it asked for is sent again, to another server when
there is one, and with back-off once none is left, for at most ``retry_seconds`` after the
first failure (:meth:`VLLMServerEngine._complete`). docs/VLLM.md, "vLLM servers", tells
the whole story: weights, start checks, faults.

Security. The update routes change what the server computes, and vLLM's ``--api-key``
guards only the ``/v1`` routes (not ``/pause``, the weight routes or ``/collective_rpc``):
keep the servers' ports on a private network or on localhost (docs/VLLM.md, "vLLM
servers"). The engine sends ``api_key`` (or ``VLLM_API_KEY``) on every request.
"""

from __future__ import annotations

import contextlib
import itertools
import json as json_module
import logging
import os
import shutil
import threading
import time
import uuid
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from maxent_grpo.rollout.protocol import SamplingSettings
from maxent_grpo.rollout.server_checks import ServerChecks, _all_ok
from maxent_grpo.rollout.server_transfer import (
    WeightList,
    check_transfer,
    local_address,
)
from maxent_grpo.rollout.server_weights import (
    RETRYABLE,
    ServerError,
    ServerWeights,
    _Server,
    server_args,
    server_command,
)
from maxent_grpo.rollout.vllm_engine import VLLMEngineBase, _rank
from maxent_grpo.validation import check_int, check_number, check_seconds, require

__all__ = ["ServerError", "VLLMServerEngine", "server_args", "server_command"]

log = logging.getLogger(__name__)


def _warn_past_group_timeout(seconds: float, device: torch.device) -> None:
    """Warn when a request retried for its longest (``seconds``: ``request_timeout`` +
    ``retry_seconds``) outlasts the process group's time-out: the other ranks wait for it in
    a collective, which then fails on them with the group's time-out, not the servers'."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    group, limit = dist.distributed_c10d._get_default_group(), None
    for where in (device, torch.device("cuda"), torch.device("cpu")):  # the group's backend
        try:  # torch keeps the group's time-out on its backend's options only
            limit = group._get_backend(where).options._timeout.total_seconds()
            break
        except (AttributeError, RuntimeError, ValueError):
            continue
    if limit is not None and seconds >= limit and _rank() == 0:
        log.warning(
            "VLLMServerEngine: request_timeout + retry_seconds (%g s) reach the process "
            "group's time-out (%g s): while rank 0 waits for a server, the other ranks wait "
            "in a collective and fail with the group's time-out. Lower retry_seconds or "
            "request_timeout, or raise the timeout init arg of trainer.strategy (DDPStrategy's "
            "and ModelParallelStrategy's: init_args: {timeout: '2:00:00'})", seconds, limit)


class VLLMServerEngine(ServerWeights, ServerChecks, VLLMEngineBase):
    """Rollout engine on ``vllm serve`` processes (see the module docstring).

    Args:
        model: the policy (a ``transformers`` causal LM or a ``peft`` one; FSDP2-sharded
            or whole).
        tokenizer: its tokenizer (a pad token set).
        sampling: what to sample; the trainer passes the settings it scores with.
        urls: the servers' base URLs (``http://host:port``), or one URL.
        api_key: sent as a bearer token on every request; None: ``VLLM_API_KEY`` if set.
        transfer_dir: where the weights file is written for the servers to read (a folder
            the servers see at the same path); None: ``/dev/shm`` when there is one.
        weight_transfer: how the weights travel: ``"file"`` (a file in ``transfer_dir``,
            servers started with the ``maxent_file`` backend), ``"nccl"`` (broadcast from
            rank 0's GPU, servers started with vLLM's ``nccl`` backend; needs ``vllm`` in the
            training environment) or ``"gloo"`` (broadcast over TCP from the CPU, servers
            started with ``maxent_gloo``).
        transfer_address: for ``nccl`` and ``gloo``, the address of rank 0's machine that
            the servers reach (each server's group meets at a free port of it); None: this
            machine's IPv4 address on the route to the first server on another machine
            (``127.0.0.1`` when every server is on this one).
        request_timeout: seconds one generation request may take, its whole answer read,
            before it is sent again.
        retry_seconds: how long failing requests and unreachable servers are retried, with
            back-off, before the step fails.
        connect_seconds: how long a server that does not answer yet is waited for at start.
        probe_tolerance: the largest difference allowed between the server's and the
            policy's log-probability of a probe token at start (float32 on the CPU agrees to
            about 1e-5; raise it for bfloat16 servers).
        max_parallel_requests: requests in flight at once, over all servers.
        stop_token_ids: extra ids that end a completion, besides the tokenizer's and the
            model's eos ids (:func:`~maxent_grpo.rollout.protocol.stop_ids`).
    """

    #: generation runs in the servers' processes: ``model.max_staleness >= 1`` overlaps it
    #: with training
    generates_elsewhere = True

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingSettings,
        urls: list[str] | str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        transfer_dir: str | None = None,
        weight_transfer: str = "file",
        transfer_address: str | None = None,
        request_timeout: float = 600.0,
        retry_seconds: float = 120.0,
        connect_seconds: float = 60.0,
        probe_tolerance: float = 1e-2,
        max_parallel_requests: int = 64,
        stop_token_ids: list[int] | None = None,
    ) -> None:
        import httpx

        if not isinstance(sampling, SamplingSettings):
            raise TypeError(f"sampling must be a SamplingSettings; got {type(sampling).__name__}")
        urls = [urls] if isinstance(urls, str) else list(urls)
        require(len(urls) > 0 and all(isinstance(u, str) and u.startswith(("http://", "https://"))
                                      for u in urls),
                f"VLLMServerEngine.urls must be http(s) URLs; got {urls!r}")
        require(len(set(urls)) == len(urls), f"VLLMServerEngine.urls repeats a URL: {urls!r}")
        for name, value in (("request_timeout", request_timeout), ("retry_seconds", retry_seconds),
                            ("connect_seconds", connect_seconds)):
            check_seconds(f"VLLMServerEngine.{name}", value, allow_zero=name == "connect_seconds")
        check_number("VLLMServerEngine.probe_tolerance", probe_tolerance, minimum=0, strict=True)
        check_int("VLLMServerEngine.max_parallel_requests", max_parallel_requests, minimum=1)
        super().__init__("VLLMServerEngine", model, tokenizer, sampling, stop_token_ids)
        self.api_key = api_key if api_key is not None else os.environ.get("VLLM_API_KEY")
        self.request_timeout, self.retry_seconds = float(request_timeout), float(retry_seconds)
        self.probe_tolerance = float(probe_tolerance)
        _warn_past_group_timeout(self.request_timeout + self.retry_seconds,
                                 next(model.parameters()).device)
        self.max_parallel_requests = max_parallel_requests
        self.servers = [_Server(u.rstrip("/")) for u in urls]
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._http = httpx.Client(headers=headers, timeout=httpx.Timeout(
            self.request_timeout, connect=10.0), limits=httpx.Limits(
                max_connections=max_parallel_requests + 8))
        self._lock = threading.Lock()
        self._closed = False  # after close(): no request is sent or retried
        self._round_robin = itertools.count()
        self.version = 0  # the weight version the servers should hold (``current``)
        self.run = uuid.uuid4().hex[:12]  # rank 0's, every rank's from the first sync on
        self.sync_bytes = 0
        self._folder = None
        self._file: str | None = None
        self._file_info: dict[str, int] | None = None
        self._last_weights: list[tuple[str, torch.Tensor]] | None = None
        self._transfer_dir = transfer_dir
        self.weight_transfer = weight_transfer
        self._transfer_address = transfer_address
        self._join_seconds = max(15.0, float(connect_seconds))
        self._source = WeightList(torch.device("cpu"))
        error = None
        try:  # every rank checks; all fail together, so none waits in a collective
            sender = _rank() == 0  # only rank 0 needs a GPU for nccl and an address
            check_transfer(weight_transfer, transfer_address, sender)
            if sender and weight_transfer != "file":
                self._transfer_address = transfer_address or local_address(urls)
                # the broadcast reads the tensors from the CPU for gloo, rank 0's GPU for NCCL
                self._source = WeightList(torch.device("cpu") if weight_transfer == "gloo"
                                          else torch.device("cuda", torch.cuda.current_device()))
            for server in self.servers:
                self._wait_until_up(server, float(connect_seconds))
                self._check_server(server)
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            error = err
        try:
            _all_ok(error is None, next(model.parameters()).device, error,
                    "another rank could not reach the vLLM servers (its error is in its log)")
        except BaseException:
            self._http.close()
            raise
        try:  # the weights file, the servers' groups: left now, or by nobody
            self.sync(model)
            self._check_probe()
        except BaseException:
            with contextlib.suppress(Exception):  # the start's own error is the one to report
                self.close()
            raise

    # ------------------------------------------------------------------ HTTP
    def _call(self, server: _Server, method: str, path: str, *, json: Any = None,
              params: dict | None = None, timeout: float | None = None) -> Any:
        """One request; ServerError naming the server and route on any failure."""
        import httpx

        if self._closed:
            raise ServerError(f"{server.url}{path}: the engine is closed")
        seconds = timeout or self.request_timeout  # a dead host is found in 10 s at most
        deadline = time.monotonic() + seconds  # httpx's time-out is per read, not per answer
        try:
            with self._http.stream(method, server.url + path, json=json, params=params,
                                   timeout=httpx.Timeout(seconds,
                                                         connect=min(seconds, 10.0))) as response:
                chunks = []  # joined once: += would copy the answer so far at every chunk
                for chunk in response.iter_bytes():
                    chunks.append(chunk)
                    if time.monotonic() > deadline:  # a server that trickles its answer
                        raise ServerError(f"{server.url}{path}: its answer took longer than "
                                          f"{seconds:g} s", timed_out=True)
                content = b"".join(chunks)
        except httpx.HTTPError as err:
            raise ServerError(f"{server.url}{path}: {type(err).__name__}: {err}",
                              timed_out=isinstance(err, httpx.TimeoutException)) from err
        except RuntimeError as err:  # closed by another thread since the check above
            if not self._closed:
                raise
            raise ServerError(f"{server.url}{path}: the engine is closed") from err
        if response.status_code == 401:
            raise ServerError(
                f"{server.url}{path} refused the request (401): the server was started with "
                "--api-key; give the same key as model.engine.init_args.api_key or "
                "VLLM_API_KEY", 401)
        text = content.decode(response.encoding or "utf-8", errors="replace")
        if response.status_code >= 400:
            raise ServerError(f"{server.url}{path} answered {response.status_code}: "
                              f"{text[:2000]}", response.status_code)
        try:
            return json_module.loads(content) if content else None
        except ValueError:
            return text

    def _wait_until_up(self, server: _Server, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            try:
                self._call(server, "GET", "/health", timeout=10.0)
                return
            except ServerError as err:
                if err.status == 404:  # something answers, but not a vLLM server's root
                    raise ServerError(
                        f"model.engine VLLMServerEngine: {server.url}/health answered 404: give "
                        "each server's root URL, http://HOST:PORT (no /v1 or other path)"
                    ) from None
                if time.monotonic() >= deadline:
                    port = server.url.rsplit(':', 1)[-1].split('/')[0]
                    raise ServerError(
                        f"model.engine VLLMServerEngine: no vLLM server answers at {server.url} "
                        f"({err}). Start one, for example:\n  "
                        f"{server_command(port=port, transfer=self.weight_transfer)}\n"
                        "(docs/VLLM.md, 'vLLM servers'; `make demo-vllm-server` starts one for the "
                        "demo)") from None
                time.sleep(1.0)

    # ------------------------------------------------------------------ sampling
    def _pick(self, index: int) -> _Server:
        with self._lock:
            live = [s for s in self.servers if s.healthy and not s.paused_by_failure]
            if not live:
                raise ServerError("no live server")
            return live[index % len(live)]

    def _complete(self, body: dict, index: int) -> list[tuple[list[int], list[float] | None]]:
        """One completion request, sent again (another server first) after a failure until
        it succeeds or ``retry_seconds`` have passed since the first failure."""
        deadline, delay, last = None, 0.5, None
        attempt = index
        while True:
            try:
                server = self._pick(attempt)
            except ServerError:
                server = None
            if self._closed:
                raise ServerError("the engine was closed while a request was pending")
            if all(s.paused_by_failure for s in self.servers):  # none can come back
                raise ServerError(
                    "every vLLM server is out of use after weight transfers that kept failing "
                    "or a restart with other settings (the warnings above say why); restart "
                    "them as they first started and resume with --ckpt_path last")
            if server is not None:
                try:
                    return _choices(self._call(server, "POST", "/v1/completions",
                                               json={**body, "model": server.model}),
                                    body["n"], server.url)
                except ServerError as err:
                    last = err
                    if err.status is not None and err.status not in RETRYABLE:
                        raise  # a refused request (bad argument, key): retrying cannot help
                    server.healthy = False
            deadline = deadline or time.monotonic() + self.retry_seconds
            if time.monotonic() >= deadline:
                urls = ", ".join(s.url for s in self.servers)
                slow = getattr(last, "timed_out", False) and "ConnectTimeout" not in str(last)
                raise ServerError(
                    f"no vLLM server completed the request within retry_seconds "
                    f"({self.retry_seconds:g} s); servers: {urls}; last error: {last}. The "
                    "last checkpoint is kept: restart the servers and resume with "
                    "--ckpt_path last" + (f" (servers that are up but slow: raise model.engine."
                                          f"init_args.request_timeout, now {self.request_timeout:g}"
                                          " s)" if slow else ""))
            attempt += 1
            with self._lock:
                live = any(s.healthy and not s.paused_by_failure for s in self.servers)
            if not live:  # wait, then try to bring the servers back
                time.sleep(delay)
                delay = min(delay * 2, 10.0)
                for s in self.servers:
                    if not s.healthy:
                        self._revive(s)

    def _run_all(self, bodies: list[dict]) -> list[list[tuple[list[int], list[float] | None]]]:
        """Every request, ``max_parallel_requests`` at a time, on daemon threads: a run that
        fails while a request waits on a server exits at once (an executor's threads are
        joined at exit, up to ``request_timeout``). After a failure no new request starts."""
        start = next(self._round_robin)
        results: list[Any] = [None] * len(bodies)
        errors: list[BaseException] = []
        todo, lock = iter(range(len(bodies))), threading.Lock()

        def work() -> None:
            while True:
                with lock:
                    i = None if errors else next(todo, None)
                if i is None:
                    return
                try:
                    results[i] = self._complete(bodies[i], start + i)
                except BaseException as err:  # noqa: BLE001 - raised by the caller below
                    with lock:
                        errors.append(err)
                    return

        threads = [threading.Thread(target=work, daemon=True, name=f"vllm-request-{k}")
                   for k in range(min(self.max_parallel_requests, len(bodies)))]
        for thread in threads:
            thread.start()
        try:  # closing the client does not wake a read: a closed engine is looked at here
            for thread in threads:
                while thread.is_alive() and not self._closed:
                    thread.join(0.2)
            if self._closed:
                raise ServerError("the engine was closed while its requests ran")
        except BaseException as err:  # Ctrl-C, or closed: start no more requests
            with lock:
                errors.append(err)
            raise
        if errors:
            raise errors[0]
        return results

    def _sample(self, sequences: list[list[int]], requests: list[dict[str, Any]]
                ) -> list[list[tuple[list[int], list[float] | None]]]:
        return self._run_all([{"prompt": list(q), **r, "return_token_ids": True}
                              for q, r in zip(sequences, requests, strict=True)])

    def close(self) -> None:
        """Close the connections and remove the weights file; a request still pending in
        another thread is not sent again, and its rollout fails (after <= 3 s a group left)."""
        for server in self.servers:
            if server.sender is not None:  # a collective transfer's group
                self._leave(server)
        self._closed = True
        self._http.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def __del__(self) -> None:  # the weights file must not outlive the run in /dev/shm
        with contextlib.suppress(Exception):  # interpreter shutdown
            if self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)


def _choices(out: Any, n: int, url: str) -> list[tuple[list[int], list[float] | None]]:
    """The ``n`` rows (token ids, sampler log-probs or None) of a completion's answer;
    ServerError (the request goes to another server) for an aborted request or an answer
    that is not ``n`` choices with their token ids (and as many log-probs, when given): a
    row too many or too few would pair completions with the wrong prompts."""
    choices = out.get("choices") if isinstance(out, dict) else None
    if not (isinstance(choices, list) and len(choices) == n and all(
            isinstance(c, dict) and isinstance(c.get("token_ids"), list)
            and isinstance(c.get("logprobs") or {}, dict) and (
                (lp := (c.get("logprobs") or {}).get("token_logprobs")) is None
                or (isinstance(lp, list) and len(lp) == len(c["token_ids"])))
            for c in choices)):
        raise ServerError(f"{url}/v1/completions did not answer {n} completions with their "
                          f"token ids: {str(out)[:300]}")
    if any(c.get("finish_reason") == "abort" for c in choices):
        raise ServerError(f"{url}: the request was aborted")
    return [(list(c["token_ids"]), (c.get("logprobs") or {}).get("token_logprobs"))
            for c in choices]
