"""The server engine's collective weight transfer (``weight_transfer="gloo"``), on the CPU
without vLLM: a stand-in server whose worker joins the trainer's gloo group in its
``/init_weight_transfer_engine`` and receives the tensors in its ``/update_weights``, as
this package's ``maxent_gloo`` backend does in a real server (``make test-vllm`` runs that).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from maxent_grpo.rollout.server_transfer import (
    TRANSFERS,
    WeightList,
    address_towards,
    check_transfer,
    gloo_group,
    local_address,
)
from maxent_grpo.rollout.server_weights import ServerError, ServerWeights, _Server, server_args


class StandIn(ServerWeights):
    """The weights side of the engine with its HTTP calls answered here, by a server whose
    one worker is a gloo rank of this process (``fail``: the route that answers 500)."""

    def __init__(self, fail: str | None = None, join_seconds: float = 30.0) -> None:
        self.servers = [_Server("http://stand-in:1")]
        self.version, self.sync_bytes, self.weight_transfer = 0, 0, "gloo"
        self._source = WeightList(torch.device("cpu"))
        self._transfer_address, self._join_seconds = "127.0.0.1", join_seconds
        self._file = self._file_info = self._last_weights = None
        self.fail, self.calls, self.received = fail, [], []
        self.group, self.finished, self.restarted = None, None, False
        self.lock = threading.Lock()

    def _call(self, server, method, path, *, json=None, params=None, timeout=None):
        with self.lock:
            self.calls.append(path)
        if path == self.fail:
            raise ServerError(f"{server.url}{path} answered 500: refused", 500)
        if path == "/get_world_size":
            return {"world_size": 1}
        if path == "/weight_info":  # a restarted server holds the weights it started with
            return {"weight_version": None if self.restarted else self.finished}
        if path == "/init_weight_transfer_engine":
            info = json["init_info"]
            assert info["rank_offset"] == 1 and info["world_size"] == 2
            self.group = gloo_group(info["master_address"], info["master_port"], 1, 2,
                                    info["timeout_seconds"])
        if path == "/update_weights":
            info = json["update_info"]
            for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"],
                                          strict=True):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                self.group.broadcast(tensor, 0).wait()
                self.received.append((name, tensor))
        if path == "/finish_weight_update":
            self.finished = json.get("weight_version")
        return {}


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    square = torch.randn(4, 6, generator=g)
    return [("embed.weight", torch.randn(10, 4, generator=g)),
            ("proj.weight", square.t()),  # not contiguous: sent as its values
            ("norm.weight", torch.randn(6, generator=g).to(torch.bfloat16))]


def test_gloo_sends_every_tensor_exactly_and_reuses_its_group():
    engine = StandIn()
    server = engine.servers[0]
    for version, seed in (("1", 0), ("2", 1)):
        engine.received.clear()
        engine._source.set(weights(seed))
        engine._broadcast(server, version)
        sent = weights(seed)
        assert [n for n, _ in engine.received] == [n for n, _ in sent]
        for (_, got), (_, want) in zip(engine.received, sent, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
        assert engine.finished == version and server.version == version and server.healthy
    # one group for both updates (the server still held the last one sent); each update
    # paused the server, then resumed it
    update = ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
              "/reset_prefix_cache", "/resume"]
    join = ["/get_world_size", "/init_weight_transfer_engine"]
    assert engine.calls == [*join, *update, "/weight_info", *update]
    # a server restarted since holds other weights: the old group is left, a new one formed
    engine.calls.clear()
    engine.restarted = True
    engine._source.set(weights(2))
    engine._broadcast(server, "3")
    engine.restarted = False
    assert engine.calls == ["/weight_info", "/shutdown_weight_transfer_engine", *join, *update]
    assert torch.equal(engine.received[-1][1], weights(2)[-1][1]) and server.version == "3"


@pytest.mark.parametrize("route", ["/init_weight_transfer_engine", "/update_weights"])
def test_a_refused_collective_fails_at_once_and_leaves_the_server_out_of_use(route):
    """A server that refuses to join (started with another backend) or refuses the update
    fails the transfer at once, not after the group's time-out (the trainer's half would
    wait for a peer that never comes), and is out of use until a new group forms."""
    engine = StandIn(fail=route, join_seconds=120.0)
    server = engine.servers[0]
    engine._source.set([("big.weight", torch.ones(4096, 4096))])  # 64 MiB: not buffered
    start = time.monotonic()
    with pytest.raises(ServerError, match=r"stand-in:1 over gloo; the server is left paused"):
        engine._broadcast(server, "1")
    assert time.monotonic() - start < 20.0
    assert not server.healthy and server.paused_by_failure and server.sender is None
    assert "/resume" not in engine.calls


def test_the_transfer_names_its_backend_and_refuses_what_it_cannot_do():
    assert TRANSFERS == {"file": "maxent_file", "gloo": "maxent_gloo", "nccl": "nccl"}
    line = " ".join(server_args("FOLDER", 8000, transfer="gloo"))
    assert '--weight-transfer-config {"backend": "maxent_gloo"}' in line
    with pytest.raises(ValueError, match="weight_transfer must be one of"):
        check_transfer("shm", None, sender=True)
    with pytest.raises(ValueError, match="transfer_address must be a host name"):
        check_transfer("gloo", " ", sender=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'nccl' broadcasts from rank 0's GPU"):
            check_transfer("nccl", None, sender=True)
    check_transfer("nccl", "10.0.0.1", sender=False)  # other ranks send nothing
    # servers on this machine, however named (vLLM prints 0.0.0.0), meet on loopback
    assert local_address(["http://127.0.0.1:8000", "http://localhost:8001",
                          "http://0.0.0.0:8002"]) == "127.0.0.1"
    here = local_address([f"http://{socket.gethostname()}:8000"])
    assert here == "127.0.0.1" or not here.startswith("127.")
    with pytest.raises(ValueError, match="no IPv4 route"):
        address_towards("::1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_an_engine_refused_for_its_transfer_fails_through_the_shared_check(cache_dir,
                                                                           monkeypatch):
    """The transfer's checks run inside the start-up checks every rank agrees on (so a
    refusal on rank 0 alone cannot leave the other ranks waiting in a collective), and
    before any server is waited for."""
    from maxent_grpo.models import load_policy, load_tokenizer
    from maxent_grpo.rollout import SamplingSettings, vllm_server

    policy = load_policy("builtin:tiny", cache_dir=cache_dir)
    tokenizer = load_tokenizer("builtin:tiny", cache_dir=cache_dir)
    seen: list[bool] = []
    real = vllm_server._all_ok
    monkeypatch.setattr(vllm_server, "_all_ok", lambda ok, *a: (seen.append(ok), real(ok, *a)))
    start = time.monotonic()
    with pytest.raises(ValueError, match="'nccl' broadcasts from rank 0's GPU"):
        vllm_server.VLLMServerEngine(policy, tokenizer, SamplingSettings(max_new_tokens=2),
                                     urls=["http://127.0.0.1:9"], weight_transfer="nccl",
                                     connect_seconds=60.0)
    assert time.monotonic() - start < 10.0 and seen == [False]


def test_a_retry_past_the_process_groups_time_out_is_warned(tmp_path, monkeypatch, caplog):
    """Under several processes the other ranks wait for rank 0's requests in a collective:
    a request_timeout + retry_seconds that reach the group's time-out is warned at start,
    naming both (the group's time-out read from torch's group, here 60 s)."""
    import datetime

    from maxent_grpo.rollout import vllm_server

    dist = torch.distributed
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
        with caplog.at_level("WARNING", logger=vllm_server.__name__):
            vllm_server._warn_past_group_timeout(59.0, torch.device("cpu"))
            assert not caplog.records
            vllm_server._warn_past_group_timeout(720.0, torch.device("cpu"))
            # a policy on another device than the group's backend (meta, offloaded): found
            vllm_server._warn_past_group_timeout(720.0, torch.device("meta"))
        assert len(caplog.records) == 2
        assert "(720 s) reach the process group's time-out (60 s)" in caplog.text
        monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 1)
        caplog.clear()
        vllm_server._warn_past_group_timeout(720.0, torch.device("cpu"))  # one process: no wait
        assert not caplog.records
    finally:
        dist.destroy_process_group()
