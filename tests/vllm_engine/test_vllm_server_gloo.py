"""``VLLMServerEngine(weight_transfer="gloo")`` against a real ``vllm serve`` started with
this package's ``maxent_gloo`` backend (``make test-vllm``): the weights travel by gloo
broadcast from the trainer to the server's worker, with no file; the protocol is the one
vLLM's NCCL backend speaks on GPUs, driven by the same engine code. One server for the
module, on a free localhost port, stopped however the tests end.
"""

from __future__ import annotations

import functools
import os
import time

import httpx
import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
pytest.importorskip("vllm.entrypoints.llm")

from maxent_grpo.models import resolve_model_path  # noqa: E402
from maxent_grpo.rollout.vllm_server import ServerError  # noqa: E402
from tests.conftest import fit, make_data, make_module  # noqa: E402
from tests.vllm_engine.servers import running  # noqa: E402
from tests.vllm_engine.test_vllm_server import (  # noqa: E402
    KEY,
    MODEL,
    PROMPTS,
    cache,  # noqa: F401 - the module's model folder
    engine_on,
    new_weights_land,
)


@pytest.fixture(scope="module")
def server(cache, tmp_path_factory):  # noqa: F811
    folder = resolve_model_path(MODEL, cache)
    with running(folder, tmp_path_factory.mktemp("logs") / "server.log", KEY,
                 transfer="gloo") as s:
        yield s


def test_weights_broadcast_over_gloo_reach_the_server_with_their_version(server, cache):  # noqa: F811
    engine = engine_on(server, cache, weight_transfer="gloo", probe_tolerance=1e-4)
    assert engine._folder is None  # no file was written
    for _ in range(2):  # the second update goes over the same group
        new_weights_land(engine, server)
    size = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values())
    assert engine.sync_bytes == size
    out = engine.generate(PROMPTS, [None, None], 2)
    assert out.completion_ids.shape[0] == 4
    engine.close()


def test_an_update_that_leaves_out_a_layer_is_refused_and_repaired(server, cache):  # noqa: F811
    engine = engine_on(server, cache, weight_transfer="gloo", probe_tolerance=1e-4)
    real = engine._source.set

    def without_one(weights):
        real([(n, t) for n, t in weights if not n.endswith("layers.0.mlp.down_proj.weight")])

    engine._source.set = without_one
    before = httpx.get(server.url + "/weight_info").json()["weight_version"]
    with pytest.raises(ServerError, match="down_proj"):
        engine.sync(engine.model)
    assert httpx.get(server.url + "/weight_info").json()["weight_version"] == before
    engine._source.set = real
    engine.sync(engine.model)  # a new group, a whole update
    engine._check_probe()
    engine.close()


def test_a_broadcast_cut_short_leaves_no_half_layer_behind(server, cache):  # noqa: F811
    """The trainer stops half-way through an update: the step fails at once, the server's
    worker gives up at the group's time-out and closes its reload, and the next update
    (a new group) leaves it serving exactly the policy's weights, with no layer half-loaded
    from the cut one."""
    engine = engine_on(server, cache, weight_transfer="gloo", probe_tolerance=1e-4,
                       connect_seconds=15.0)
    source, real = engine._source, engine._source.set

    class Cut(list):  # stops inside a layer: after q_proj, before k_proj and v_proj
        def __iter__(self):
            names = [n for n, _ in list.__iter__(self)]
            stop = next(i for i, n in enumerate(names)
                        if i >= len(names) // 2 and n.endswith("q_proj.weight"))
            yield from list.__iter__(self[: stop + 1])
            raise RuntimeError("the trainer stopped half-way")

    source.set = lambda weights: (real(weights), setattr(source, "weights",
                                                         Cut(source.weights)))
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    start = time.monotonic()
    with pytest.raises(ServerError, match="half-way"):
        engine.sync(engine.model)
    assert time.monotonic() - start < 10.0
    source.set = real
    time.sleep(engine._join_seconds + 5.0)  # the worker's broadcast times out meanwhile
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.sync(engine.model)
    engine._check_probe()
    engine.close()


def test_an_asynchronous_fit_sends_its_weights_over_gloo(server, cache, tmp_path):  # noqa: F811
    """A whole fit, one step behind, with the weights broadcast after every step while the
    next rollout waits (the rollout thread asks the server for its version meanwhile)."""
    from maxent_grpo.rollout.vllm_server import VLLMServerEngine as Engine

    module = make_module(
        cache, model_name_or_path=MODEL, max_completion_length=8, max_staleness=1,
        sampler_correction="token_tis",
        engine=functools.partial(Engine, urls=[server.url], api_key=KEY,
                                 weight_transfer="gloo"),
        rewards={"tests.conftest:alternating": 1.0})
    trainer = fit(module, make_data(cache, tokenizer=MODEL), steps=3, tmp_path=tmp_path)
    assert trainer.global_step == 3
    logged = trainer.callback_metrics
    assert float(logged["train/rollout/staleness"]) == 1.0
    assert float(logged["train/perf/sync_bytes"]) > 0
    # a new engine starts at version 1: sent at the start and after steps 1 and 2
    assert httpx.get(server.url + "/weight_info").json()["weight_version"].startswith("3-")
    assert module._engine is None


def test_a_file_engine_on_a_gloo_server_names_the_backend(server, cache):  # noqa: F811
    with pytest.raises(ServerError, match="maxent_file"):
        engine_on(server, cache)


def test_the_nccl_transfer_drives_vllms_own_trainer_engine(monkeypatch):
    """``weight_transfer="nccl"`` runs the installed vLLM's ``NCCLTrainerWeightTransferEngine``
    through the engine's control calls: what it sends the server (the rendezvous, the
    tensors' names, dtypes and shapes, the version) and what it broadcasts are checked here
    with the NCCL communicator replaced (no GPU on this machine; the broadcast itself is
    vLLM's)."""
    from vllm.distributed.weight_transfer import nccl_engine

    from maxent_grpo.rollout.server_transfer import WeightList, open_sender
    from maxent_grpo.rollout.server_weights import _Server

    calls, broadcast = [], []

    class Engine:
        def _call(self, server, method, path, *, json=None, params=None, timeout=None):
            calls.append((path, json))
            return {"world_size": 2} if path == "/get_world_size" else {}

    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda info: "group")
    monkeypatch.setattr(nccl_engine, "packed_nccl_broadcast_producer",
                        lambda iterator, group, src, post_iter_func, **kw: broadcast.extend(
                            (name, post_iter_func((name, t)), group) for name, t in iterator))
    source = WeightList(torch.device("cpu"))
    sender, client = open_sender("nccl", Engine(), _Server("http://gpu-node:8000"), source,
                                 "10.0.0.1", 30.0)
    assert isinstance(sender, nccl_engine.NCCLTrainerWeightTransferEngine)
    path, body = calls[-1]
    init = body["init_info"]
    assert path == "/init_weight_transfer_engine"
    assert (init["master_address"], init["rank_offset"], init["world_size"]) == ("10.0.0.1", 1, 3)
    weights = [("a.weight", torch.randn(3, 2)), ("b.bias", torch.zeros(4, dtype=torch.bfloat16))]
    source.set(weights)
    calls.clear()
    client.version = "7"
    sender.send_weights()
    assert [p for p, _ in calls] == ["/start_weight_update", "/update_weights",
                                     "/finish_weight_update"]
    assert calls[1][1]["update_info"] == {"names": ["a.weight", "b.bias"],
                                          "dtype_names": ["float32", "bfloat16"],
                                          "shapes": [[3, 2], [4]]}
    assert calls[2][1] == {"weight_version": "7"}
    assert [(n, g) for n, _, g in broadcast] == [("a.weight", "group"), ("b.bias", "group")]
    assert all(torch.equal(t, w) for (_, t, _), (_, w) in zip(broadcast, weights, strict=True))
