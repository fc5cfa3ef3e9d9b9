"""The server engine's request faults against real HTTP servers on free localhost ports
(stand-ins for ``vllm serve`` that answer only the routes a request uses): a generation
request that takes longer than ``request_timeout`` is given up and sent to another server;
when every server keeps timing out the step stops after ``retry_seconds`` with the
time-out named; a refused request (400) is not retried; a restarted server that several
threads revive at once gets the weights once, and every rank but 0 leaves the
revival to rank 0; a dead server costs the weight transfer no retries and no weights files;
a connection is given up after 10 s whatever the request's time-out; a closed engine sends
nothing more; a failed run exits without waiting for the requests in flight; an answer
that is not the requested rows goes to another server; a server hung in a transfer costs one
time-out; an update an earlier run left open is closed; weights that cannot be written name
the folder. The tests with real vLLM servers are in
``tests/vllm_engine/test_vllm_server.py``."""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

httpx = pytest.importorskip("httpx")

from maxent_grpo.rollout.server_transfer import WeightList  # noqa: E402
from maxent_grpo.rollout.server_weights import ServerError, _Server  # noqa: E402
from maxent_grpo.rollout.vllm_server import VLLMServerEngine  # noqa: E402

TOKENS, LOGPS = [5, 6, 7], [-0.5, -0.25, -1.0]


class StandIn:
    """One stand-in server: ``/health``, ``/weight_info`` (``version``), the weight-update
    routes (``/finish_weight_update`` sets the version, after ``update_seconds``), the start
    checks' (``/v1/models``, ``/tokenize``, ``/server_info``: ``settings``) and
    ``/v1/completions``, which waits ``hold`` seconds (until released) or answers ``status``
    at once."""

    def __init__(self, hold: float = 0.0, status: int = 200, version: str = "0",
                 update_seconds: float = 0.0, answer: Any = None, hang_on: str = "",
                 refuse_starts: int = 0, trickle: float = 0.0, port: int = 0) -> None:
        self.hold, self.status, self.calls = hold, status, []
        self.trickle = trickle  # seconds between the bytes of a completion's answer
        self.answer = answer  # what /v1/completions answers instead (JSON; a str as text)
        self.hang_on = hang_on  # a route that never answers
        self.refuse_starts = refuse_starts  # /start_weight_update refused this often (500)
        self.version, self.update_seconds = version, update_seconds
        self.settings = {"dtype": "torch.float32", "logprobs_mode": "processed_logprobs"}
        self.release = threading.Event()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def answer(self, status: int, body: Any) -> None:
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    if stand_in.trickle and self.path == "/v1/completions":
                        for i in range(len(data)):  # each read of the client gets a byte
                            self.wfile.write(data[i:i + 1])
                            self.wfile.flush()
                            if stand_in.release.wait(stand_in.trickle):
                                return
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up
                    pass

            def do_GET(self) -> None:
                stand_in.calls.append(self.path)
                if self.path == "/weight_info":
                    self.answer(200, {"weight_version": stand_in.version})
                elif self.path == "/v1/models":
                    self.answer(200, {"data": [{"id": "m"}]})
                elif self.path.startswith("/server_info"):
                    self.answer(200, {"vllm_config": {"model_config": stand_in.settings}})
                else:
                    self.answer(200, {})

            def do_POST(self) -> None:
                path = self.path.split("?")[0]
                stand_in.calls.append(path)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0)))
                                  or b"{}")
                if path == stand_in.hang_on:
                    stand_in.release.wait(30.0)
                    return
                if path == "/start_weight_update" and stand_in.refuse_starts:
                    stand_in.refuse_starts -= 1  # as vLLM while an update is still open
                    self.answer(500, {"error": "already active"})
                    return
                if path == "/update_weights":
                    time.sleep(stand_in.update_seconds)  # a transfer takes a while
                if path == "/finish_weight_update" and "weight_version" in body:
                    stand_in.version = body["weight_version"]
                if path == "/tokenize":
                    self.answer(200, {"tokens": [1, 2]})
                    return
                if path != "/v1/completions":
                    self.answer(200, {})
                    return
                if stand_in.hold:
                    stand_in.release.wait(stand_in.hold)
                if stand_in.status != 200:
                    self.answer(stand_in.status, {"error": "bad request"})
                    return
                if stand_in.answer is not None:
                    self.answer(200, stand_in.answer)
                    return
                self.answer(200, {"choices": [{"token_ids": TOKENS, "finish_reason": "length",
                                               "logprobs": {"token_logprobs": LOGPS}}]})

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)  # 0: a free port
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def stand_ins():
    made: list[StandIn] = []

    def make(**kwargs) -> StandIn:
        made.append(StandIn(**kwargs))
        return made[-1]

    yield make
    for stand_in in made:
        stand_in.close()


def _bare_engine(urls: list[str], request_timeout: float, retry_seconds: float = 30.0,
                 max_parallel_requests: int = 8) -> VLLMServerEngine:
    """The engine's request path over ``urls`` (``__init__``'s checks of a real vLLM
    server, its model and its weights left out)."""
    engine = object.__new__(VLLMServerEngine)
    engine.servers = [_Server(url) for url in urls]
    engine.request_timeout, engine.retry_seconds = request_timeout, retry_seconds
    engine.max_parallel_requests = max_parallel_requests
    engine._http = httpx.Client(timeout=httpx.Timeout(request_timeout, connect=5.0))
    engine._lock, engine._round_robin = threading.Lock(), itertools.count()
    engine.version, engine._file, engine._file_info = 0, None, None
    engine.run = ""  # versions "1", "2", ... (a run's own are "1-<run>")
    engine._last_weights, engine._closed, engine.sync_bytes = None, False, 0
    engine._folder, engine._transfer_dir = None, None
    engine.weight_transfer, engine._source = "file", WeightList(torch.device("cpu"))
    engine.tokenizer = lambda text, add_special_tokens: {"input_ids": [1, 2]}  # as /tokenize
    return engine


@pytest.fixture
def engine_on():
    """:func:`_bare_engine` over these stand-ins, closed at the end."""
    made: list[VLLMServerEngine] = []

    def make(servers: list[StandIn], request_timeout: float, retry_seconds: float):
        made.append(_bare_engine([s.url for s in servers], request_timeout, retry_seconds))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


BODY = {"model": "m", "prompt": [1, 2], "n": 1, "max_tokens": 3}


def test_a_request_past_its_time_out_goes_to_another_server(stand_ins, engine_on):
    slow, fast = stand_ins(hold=30.0), stand_ins()
    engine = engine_on([slow, fast], request_timeout=2.0, retry_seconds=30.0)
    start = time.monotonic()
    out = engine._complete(dict(BODY), index=0)  # index 0: the slow server first
    elapsed = time.monotonic() - start
    assert out == [(TOKENS, LOGPS)]
    assert slow.calls == ["/v1/completions"] and fast.calls == ["/v1/completions"]
    assert not engine.servers[0].healthy and engine.servers[1].healthy
    assert elapsed < 15.0  # given up after its time-out, not after the server's 30 s


def test_a_request_that_always_times_out_stops_after_retry_seconds(stand_ins, engine_on):
    slow = stand_ins(hold=30.0)
    engine = engine_on([slow], request_timeout=0.3, retry_seconds=1.0)
    start = time.monotonic()
    with pytest.raises(ServerError) as caught:
        engine._complete(dict(BODY), index=0)
    elapsed = time.monotonic() - start
    message = str(caught.value)
    assert "within retry_seconds (1 s)" in message and slow.url in message
    assert "ReadTimeout" in message  # the cause is named, not only "failed"
    assert "--ckpt_path last" in message
    assert "up but slow: raise model.engine.init_args.request_timeout, now 0.3 s" in message
    # after the first time-out the server answered /health again and was tried again
    assert slow.calls.count("/v1/completions") >= 2 and "/health" in slow.calls
    assert elapsed < 20.0


def test_a_server_that_trickles_its_answer_is_given_up_after_request_timeout(
        stand_ins, engine_on):
    """httpx's time-out bounds each read; a server that sends a byte every 0.2 s would hold
    a request for as long as its answer lasts (about 20 s here) without the engine's own
    deadline on the whole answer."""
    trickling, fast = stand_ins(trickle=0.2), stand_ins()
    engine = engine_on([trickling, fast], request_timeout=1.0, retry_seconds=30.0)
    start = time.monotonic()
    out = engine._complete(dict(BODY), index=0)  # index 0: the trickling server first
    elapsed = time.monotonic() - start
    assert out == [(TOKENS, LOGPS)] and fast.calls == ["/v1/completions"]
    assert not engine.servers[0].healthy
    assert elapsed < 10.0  # given up after about 1 s, not after the answer's 20 s
    with pytest.raises(ServerError, match="took longer than 1 s") as caught:
        engine._call(engine.servers[0], "POST", "/v1/completions", json=dict(BODY))
    assert caught.value.timed_out


def test_a_refused_request_is_not_sent_again(stand_ins, engine_on):
    refusing, fast = stand_ins(status=400), stand_ins()
    engine = engine_on([refusing, fast], request_timeout=5.0, retry_seconds=30.0)
    with pytest.raises(ServerError, match="answered 400") as caught:
        engine._complete(dict(BODY), index=0)
    assert caught.value.status == 400
    assert fast.calls == []  # retrying a bad request elsewhere cannot help


def test_a_restarted_server_revived_by_several_threads_gets_the_weights_once(
    stand_ins, engine_on, tmp_path,
):
    """Rank 0's request threads find the same restarted server (it holds the weights it
    started with) and revive it at once: one transfer, and every thread sees it live."""
    restarted = stand_ins(version="default", update_seconds=0.5)
    engine = engine_on([restarted], request_timeout=10.0, retry_seconds=30.0)
    engine.version = 3
    engine._file = str(tmp_path / "v3.safetensors")
    open(engine._file, "wb").close()
    engine._file_info = {"num_tensors": 1, "num_bytes": 0}
    engine.servers[0].healthy, engine.servers[0].version = False, "3"  # as it died
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(
        engine._revive(engine.servers[0]))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == [True] * 4
    assert restarted.calls.count("/update_weights") == 1
    assert restarted.version == "3" and engine.servers[0].healthy


def test_a_server_restarted_with_other_settings_is_out_of_use_until_it_has_the_starts(
    stand_ins, engine_on, tmp_path, caplog,
):
    """The probe that checks a server's log-probs and dtype is a collective, so it runs at
    start only; a server restarted without ``--logprobs-mode processed_logprobs`` got the
    weights and served (its sampler log-probs before temperature). A server that comes
    back, found before a rollout or by a sync, is checked again: its served name and
    settings must be the start's, or it is out of use, with a warning, until a sync finds
    them again; one that does not answer the checks is only not back yet."""
    server = stand_ins(version="3")
    engine = engine_on([server], request_timeout=10.0, retry_seconds=30.0)
    engine._check_server(engine.servers[0])  # as at start: its settings recorded
    engine.version = 3
    engine._file = str(tmp_path / "v3.safetensors")
    open(engine._file, "wb").close()
    engine._file_info = {"num_tensors": 1, "num_bytes": 0}
    engine.servers[0].version = "3"  # as after the last sync
    raw = {**server.settings, "logprobs_mode": "raw_logprobs"}
    server.version, server.settings = "default", raw  # restarted between steps
    with caplog.at_level("WARNING"):
        engine._refresh()  # found before the rollout
    assert engine.servers[0].paused_by_failure and "/update_weights" not in server.calls
    assert "returns raw_logprobs" in caplog.text and "processed_logprobs" in caplog.text
    server.settings = {**raw, "logprobs_mode": "processed_logprobs", "dtype": "torch.bfloat16"}
    with pytest.raises(ServerError, match=r"came back with .*bfloat16.*, not the start's"):
        engine._send_to_all("4", [False])
    server.settings["dtype"] = "torch.float32"  # restarted as it started: in use again
    sent = [False]
    engine._send_to_all("4", sent)
    assert sent == [True] and server.version == "4" and not engine.servers[0].paused_by_failure
    engine.version = 4
    server.version, server.settings = "default", raw  # restarted again, unnoticed: the sync
    with pytest.raises(ServerError, match="returns raw_logprobs"):
        engine._send_to_all("5", [False])
    server.settings = {**raw, "logprobs_mode": "processed_logprobs"}
    engine._send_to_all("5", sent)
    real = engine._call

    def unanswered(srv, method, path, **kw):  # a restart still loading its model
        if path == "/v1/models":
            raise ServerError("connection refused")
        return real(srv, method, path, **kw)

    engine.version, server.version, engine.servers[0].healthy = 5, "default", False
    engine._call = unanswered
    assert not engine._revive(engine.servers[0]) and not engine.servers[0].paused_by_failure
    engine._call = real
    assert engine._revive(engine.servers[0]) and server.version == "5"
    engine.servers[0].model = "another-name"  # as if it had been started serving this one
    server.version, engine.servers[0].healthy = "default", False
    assert not engine._revive(engine.servers[0]) and engine.servers[0].paused_by_failure
    assert "came back serving 'm', not 'another-name'" in caplog.text


def test_another_trainers_weights_on_the_server_are_refused(stand_ins, engine_on):
    """Two runs against one server each counted versions from 1, so each took the other's
    "1" for its own and sampled from the other's weights without a word (a hunt). A
    server this run saw holding its weights that holds another run's is refused, before a
    rollout and before a sync; one that never held this run's (left by an earlier run, or
    missed by its first sync) is not: it gets this run's weights."""
    server = stand_ins(version="7-earlier")
    engine = engine_on([server], request_timeout=10.0, retry_seconds=30.0)
    engine.version, engine.run = 1, "mine"
    engine._refresh()  # never held ours: revived (no weights file here: left out of use)
    assert not engine.servers[0].healthy
    server.version = engine.servers[0].version = "1-mine"  # as after this run's sync
    engine._refresh()
    assert engine.servers[0].healthy
    server.version = "1-theirs"  # another trainer's sync since
    with pytest.raises(ValueError, match=r"holds weights version 1-theirs of another trainer "
                                         r"\(this run's: 1-mine\)"):
        engine._refresh()
    with pytest.raises(ValueError, match="of another trainer"):
        engine._send_to_all("2-mine", [False])  # the next sync's look first
    server.version = "default"  # restarted, holding the weights it started with: revived
    engine._refresh()


def test_servers_out_of_use_after_failed_transfers_fail_the_request_at_once(
        stand_ins, engine_on):
    """A server that came back as another model refused the weights and was left out of use
    for good; a request then waited all of retry_seconds and said "last error: None"."""
    server = stand_ins()
    engine = engine_on([server], request_timeout=10.0, retry_seconds=30.0)
    engine.servers[0].healthy, engine.servers[0].paused_by_failure = False, True
    start = time.monotonic()
    with pytest.raises(ServerError, match="every vLLM server is out of use after weight "
                                          "transfers that kept failing"):
        engine._complete(dict(BODY), index=0)
    assert time.monotonic() - start < 5.0


def test_a_rank_other_than_0_leaves_the_revival_to_rank_0(stand_ins, engine_on, tmp_path,
                                                          monkeypatch):
    """Every rank knows rank 0's weights file (a shared /dev/shm), but only rank 0 sends:
    two processes updating one server at once would collide."""
    from maxent_grpo.rollout import server_weights

    restarted = stand_ins(version="default")
    engine = engine_on([restarted], request_timeout=10.0, retry_seconds=30.0)
    engine.version = 3
    engine._file = str(tmp_path / "v3.safetensors")
    open(engine._file, "wb").close()
    engine._file_info = {"num_tensors": 1, "num_bytes": 0}
    engine.servers[0].healthy = False
    monkeypatch.setattr(server_weights, "_rank", lambda: 1)
    assert not engine._revive(engine.servers[0])
    assert not {"/pause", "/update_weights"} & set(restarted.calls)
    assert not engine.servers[0].healthy
    restarted.version = "3"  # rank 0 sent them meanwhile
    assert engine._revive(engine.servers[0]) and engine.servers[0].healthy


def _dead_url() -> str:
    """A localhost URL nothing listens on (a free port, closed again): refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _recording(engine) -> list[tuple[str, str]]:
    """Record every request of ``engine`` as (url, route)."""
    calls: list[tuple[str, str]] = []
    real = engine._call

    def call(server, method, path, **kwargs):
        calls.append((server.url, path))
        return real(server, method, path, **kwargs)

    engine._call = call
    return calls


def test_a_dead_server_costs_the_transfer_no_retries_and_no_weights_files(
    stand_ins, engine_on, tmp_path,
):
    """One of two servers dies: every sync only asks its /health (no transfer attempt). The
    live server gets every version, and one weights file is kept, not one more per sync."""
    from maxent_grpo.rollout.server_weights import _Server

    live = stand_ins()
    engine = engine_on([live], request_timeout=5.0, retry_seconds=5.0)
    dead = _Server(_dead_url())
    engine.servers.append(dead)
    engine._transfer_dir = str(tmp_path)
    calls = _recording(engine)
    model = torch.nn.Linear(3, 2)
    engine.sync(model)  # the live server takes the load; the dead one is left out
    assert live.version == "1" and not dead.healthy and not dead.paused_by_failure
    assert [p for u, p in calls if u == dead.url] == ["/health"]
    calls.clear()
    for version in ("2", "3"):
        engine.sync(model)
        assert live.version == version
    assert [p for u, p in calls if u == dead.url] == ["/health", "/health"]
    assert os.listdir(engine._folder) == [os.path.basename(engine._file)]


def test_a_sync_waits_retry_seconds_for_its_only_server_to_come_back(
    stand_ins, engine_on, tmp_path,
):
    """The only server restarts during a sync: the sync waits for it (it stopped the run
    at once, though the docs promise retry_seconds) and joins the new process before
    sending; a server that stays away stops the sync after retry_seconds, naming it and the
    resume."""
    url = _dead_url()
    engine = _bare_engine([url], request_timeout=5.0, retry_seconds=20.0)
    engine._transfer_dir = str(tmp_path)
    calls = _recording(engine)
    restarted: list[StandIn] = []
    timer = threading.Timer(1.5, lambda: restarted.append(
        stand_ins(port=int(url.rsplit(":", 1)[1]))))
    timer.start()
    try:
        engine.sync(torch.nn.Linear(3, 2))
    finally:
        timer.join()
        engine.close()
    assert restarted and restarted[0].version == "1" and engine.servers[0].healthy
    routes = [p for _, p in calls]
    assert routes.count("/health") >= 2  # asked again until it answered
    assert routes.index("/init_weight_transfer_engine") < routes.index("/start_weight_update")

    gone = _bare_engine([_dead_url()], request_timeout=5.0, retry_seconds=1.0)
    gone._transfer_dir = str(tmp_path / "gone")
    started = time.monotonic()
    try:
        with pytest.raises(ServerError, match=r"no vLLM server answered within retry_seconds "
                           r"\(1 s\).*Restart them .*resume with --ckpt_path last"):
            gone.sync(torch.nn.Linear(3, 2))
    finally:
        gone.close()
    assert 1.0 <= time.monotonic() - started < 10.0


def test_a_failed_read_of_the_weights_file_writes_a_fresh_one_in_its_place(
    stand_ins, engine_on, tmp_path,
):
    """The server fails while reading the file (it may be cut): the next attempt reads a
    new file, which replaces the old one (no copy left behind), and later servers and
    revivals use it."""
    server = stand_ins()
    engine = engine_on([server], request_timeout=5.0, retry_seconds=5.0)
    engine._transfer_dir = str(tmp_path)
    real, sent = engine._call, []

    def call(srv, method, path, **kwargs):
        if path == "/update_weights":
            sent.append(kwargs["json"]["update_info"]["path"])
            if len(sent) == 1:
                raise ServerError(f"{srv.url}{path} answered 500: cut", 500)
        return real(srv, method, path, **kwargs)

    engine._call = call
    engine.sync(torch.nn.Linear(3, 2))
    assert len(sent) == 2 and sent[0] != sent[1] and server.version == "1"
    assert engine._file == sent[1] and os.listdir(engine._folder) == [os.path.basename(sent[1])]


def test_a_connection_is_given_up_after_10_s_and_a_closed_engine_sends_nothing(
    stand_ins, engine_on,
):
    """The request's time-out bounds the reply; the connection itself is bounded by 10 s
    (a powered-off host would otherwise hold every route for ``request_timeout``)."""
    server = stand_ins()
    engine = engine_on([server], request_timeout=600.0, retry_seconds=5.0)
    seen = []
    real = engine._http.stream

    def stream(*args, **kwargs):
        seen.append(kwargs["timeout"])
        return real(*args, **kwargs)

    engine._http.stream = stream
    engine._call(engine.servers[0], "GET", "/health")
    engine._call(engine.servers[0], "GET", "/health", timeout=5.0)
    assert [(t.read, t.connect) for t in seen] == [(600.0, 10.0), (5.0, 5.0)]
    engine.close()
    with pytest.raises(ServerError, match="closed"):
        engine._complete(dict(BODY), index=0)
    assert server.calls == ["/health", "/health"]


EXIT_SCRIPT = """
import sys, threading, time
from tests.rollout.test_server_requests import BODY, StandIn, _bare_engine
held = StandIn(hold=float(sys.argv[1]))
engine = _bare_engine([held.url], request_timeout=120.0)
threading.Thread(target=engine._run_all, args=([dict(BODY)] * 2,), daemon=True).start()
while len(held.calls) < 2:
    time.sleep(0.05)
raise RuntimeError("the training step failed")
"""


def test_a_failed_run_exits_without_waiting_for_its_requests(tmp_path):
    """The run fails while its background rollout waits on a server: the process exits at
    once instead of joining the request threads (up to ``request_timeout``)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, "90"], cwd=root, timeout=180,
                          capture_output=True, text=True)
    assert "the training step failed" in done.stderr and done.returncode == 1
    assert time.monotonic() - start < 60  # the server holds the requests for 90 s


def test_an_engine_whose_start_fails_after_its_first_update_closes_itself(
        monkeypatch, cache_dir, tmp_path):
    """The probe check comes after the first weight update: a refusal there must not leave
    the weights folder (in /dev/shm) or the servers' groups to the garbage collector."""
    from maxent_grpo.models import load_policy, load_tokenizer
    from maxent_grpo.rollout import SamplingSettings

    model = load_policy("builtin:tiny-h64-warm", cache_dir=cache_dir)
    tokenizer = load_tokenizer("builtin:tiny-h64-warm", cache_dir=cache_dir)
    folder = tmp_path / "weights"

    def first_update(self, policy):
        folder.mkdir()
        self._folder = str(folder)

    def probe(self):
        raise ServerError("http://127.0.0.1:1: the probe's log-probs differ")

    monkeypatch.setattr(VLLMServerEngine, "_wait_until_up", lambda self, server, seconds: None)
    monkeypatch.setattr(VLLMServerEngine, "_check_server", lambda self, server: "m")
    monkeypatch.setattr(VLLMServerEngine, "sync", first_update)
    monkeypatch.setattr(VLLMServerEngine, "_check_probe", probe)
    closed = []
    original = VLLMServerEngine.close
    monkeypatch.setattr(VLLMServerEngine, "close",
                        lambda self: (closed.append(True), original(self)))
    with pytest.raises(ServerError, match="the probe's log-probs differ"):
        VLLMServerEngine(model, tokenizer, SamplingSettings(max_new_tokens=4),
                         urls=["http://127.0.0.1:1"])
    assert closed == [True] and not folder.exists()


def test_closing_the_engine_ends_a_rollout_waiting_on_a_server_at_once(stand_ins, engine_on):
    """Closing the client does not wake a thread blocked reading its socket: the rollout
    must not wait for the server's answer (``request_timeout``) after the engine closed."""
    held = stand_ins(hold=60.0)
    engine = engine_on([held], request_timeout=120.0, retry_seconds=30.0)
    outcome: list[BaseException] = []

    def rollout() -> None:
        try:
            engine._run_all([dict(BODY)])
        except BaseException as err:  # noqa: BLE001 - what the test looks at
            outcome.append(err)

    thread = threading.Thread(target=rollout, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10.0
    while not held.calls and time.monotonic() < deadline:
        time.sleep(0.02)
    assert held.calls == ["/v1/completions"]
    began = time.monotonic()
    engine.close()
    thread.join(5.0)
    assert not thread.is_alive() and time.monotonic() - began < 5.0
    assert isinstance(outcome[0], ServerError) and "closed" in str(outcome[0])
    held.release.set()


@pytest.mark.parametrize("answer", [
    {"choices": [{"token_ids": TOKENS}] * 2},  # one row too many: it would pair wrongly
    {"choices": []},
    {"choices": [{"text": "no ids"}]},
    {"error": "overloaded"},
    "<html>bad gateway</html>",
    # a log-prob short: the sampler's log-probs would sit beside the wrong tokens
    {"choices": [{"token_ids": TOKENS, "logprobs": {"token_logprobs": LOGPS[:-1]}}]},
], ids=["two-rows", "no-rows", "no-ids", "error-object", "html", "logprob-short"])
def test_an_answer_that_is_not_the_requested_rows_goes_to_another_server(
    stand_ins, engine_on, answer,
):
    """Before, these raised TypeError/KeyError with no server named, or (a row too many or
    too few per request) paired completions with the wrong prompts in silence."""
    bad, good = stand_ins(answer=answer), stand_ins()
    engine = engine_on([bad, good], request_timeout=5.0, retry_seconds=30.0)
    assert engine._complete(dict(BODY), index=0) == [(TOKENS, LOGPS)]
    assert bad.calls == ["/v1/completions"] and not engine.servers[0].healthy
    engine = engine_on([bad], request_timeout=5.0, retry_seconds=0.5)
    with pytest.raises(ServerError, match=f"{bad.url}/v1/completions did not answer 1 "):
        engine._complete(dict(BODY), index=0)


def test_a_server_that_hangs_in_a_transfer_costs_one_time_out_not_three(
    stand_ins, engine_on, tmp_path,
):
    """A server that takes /pause and never answers: one request_timeout, then the next
    server gets the weights (before: three time-outs, one server after the other)."""
    hung, live = stand_ins(hang_on="/pause"), stand_ins()
    engine = engine_on([hung, live], request_timeout=1.0, retry_seconds=5.0)
    engine._transfer_dir = str(tmp_path)
    calls = _recording(engine)
    engine.sync(torch.nn.Linear(3, 2))
    assert live.version == "1" and engine.servers[0].paused_by_failure
    assert [p for u, p in calls if u == hung.url] == ["/health", "/weight_info", "/pause"]


def test_an_update_left_open_is_closed_and_the_transfer_goes_on(stand_ins, engine_on, tmp_path):
    """An earlier run stopped between /start_weight_update and /finish_weight_update: vLLM
    refuses a new start until that update is finished, so the engine finishes it and
    starts again (before, three refused starts left the server out of use)."""
    server = stand_ins(refuse_starts=1)
    engine = engine_on([server], request_timeout=5.0, retry_seconds=5.0)
    engine._transfer_dir = str(tmp_path)
    calls = _recording(engine)
    engine.sync(torch.nn.Linear(3, 2))
    assert server.version == "1" and engine.servers[0].healthy
    routes = [p for _, p in calls]
    assert routes[:5] == ["/health", "/weight_info", "/pause", "/start_weight_update",
                          "/finish_weight_update"]
    assert routes.count("/start_weight_update") == 2


def test_weights_that_cannot_be_written_name_the_folder_and_the_option(
    stand_ins, engine_on, tmp_path, monkeypatch,
):
    import safetensors.torch

    def full(tensors, path):
        open(path, "wb").close()  # a part written before the disk filled
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    engine = engine_on([stand_ins()], request_timeout=5.0, retry_seconds=5.0)
    engine._transfer_dir = str(tmp_path)
    with pytest.raises(ServerError, match="could not be written to .*transfer_dir") as caught:
        engine.sync(torch.nn.Linear(3, 2))
    assert str(tmp_path) in str(caught.value) and "No space left" in str(caught.value)
    assert os.listdir(engine._folder) == []  # the part file is removed


def test_a_weight_info_without_a_version_marks_the_server_out_of_use(stand_ins, engine_on):
    server = stand_ins()
    engine = engine_on([server], request_timeout=5.0, retry_seconds=5.0)
    real = engine._call
    engine._call = lambda srv, method, path, **kw: (
        "<html>" if path == "/weight_info" else real(srv, method, path, **kw))
    engine._refresh()  # before a rollout: it raised TypeError out of generate
    assert not engine.servers[0].healthy
