"""``VLLMServerEngine`` against real ``vllm serve`` processes (``make test-vllm``).

One server for the module (a free localhost port, an API key, the file weight-transfer
backend), started once and stopped however the tests end; the fault tests that kill a server
start their own. Skipped where vLLM is not installed (the main suite's environment).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
pytest.importorskip("vllm.entrypoints.llm")

from maxent_grpo.models import load_policy, load_tokenizer, resolve_model_path  # noqa: E402
from maxent_grpo.rollout import SamplingSettings  # noqa: E402
from maxent_grpo.rollout.vllm_server import ServerError, VLLMServerEngine  # noqa: E402
from tests.conftest import fit, make_data, make_module  # noqa: E402
from tests.vllm_engine.servers import Server, free_port, running  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = "builtin:tiny-h64"
KEY = "test-key"
PROMPTS = ["<|im_start|>user\n3 + 5 =<|im_end|>\n<|im_start|>assistant\n", "hello there"]
SAMPLING = SamplingSettings(max_new_tokens=8, max_prompt_length=64)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def server(cache, tmp_path_factory):
    folder = resolve_model_path(MODEL, cache)
    with running(folder, tmp_path_factory.mktemp("logs") / "server.log", KEY) as s:
        yield s


def policy_and_tokenizer(cache):
    return (load_policy(MODEL, cache_dir=cache), load_tokenizer(MODEL, cache_dir=cache))


def engine_on(server, cache, **kw):
    policy, tokenizer = policy_and_tokenizer(cache)
    return VLLMServerEngine(policy, tokenizer, SAMPLING, urls=[server.url], api_key=KEY, **kw)


def test_a_rollout_follows_the_contract_with_the_policys_logps(server, cache):
    from maxent_grpo.training.step.token_logps import Scorer
    from maxent_grpo.training.types import BatchingSettings

    engine = engine_on(server, cache, probe_tolerance=1e-4)
    G = 4
    out = engine.generate(PROMPTS, ["", ""], G)
    B, T = len(PROMPTS), out.completion_ids.shape[1]
    assert out.completion_ids.shape == (B * G, T) and T <= 8
    assert out.prompt_ids.shape[0] == B * G
    assert len({tuple(r) for r in out.completion_ids[:G].tolist()}) > 1  # G samples differ
    scorer = Scorer(1.0, BatchingSettings(None, None), False)
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    attention = torch.cat([out.prompt_mask, out.completion_mask], 1).long()
    with torch.no_grad():
        ours, _ = scorer.token_logps(engine.model, ids, attention, T, with_entropy=False)
    assert float((ours - out.sampler_logps).abs()[out.completion_mask].max()) < 1e-4
    engine.close()


@pytest.fixture(scope="module")
def twin(server, cache, tmp_path_factory):
    """The colocated engine's side of the comparisons, from a fresh interpreter
    (``tests/vllm_engine/colocated_twin.py``)."""
    out = tmp_path_factory.mktemp("twin") / "twin.json"
    proc = subprocess.run([sys.executable, "-m", "tests.vllm_engine.colocated_twin", server.url,
                           KEY, cache, str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_the_same_seed_samples_what_the_colocated_engine_samples(twin):
    server, colocated = twin["samples"]["server"], twin["samples"]["colocated"]
    assert server["ids"] == colocated["ids"]
    torch.testing.assert_close(torch.tensor(server["logps"]), torch.tensor(colocated["logps"]),
                               atol=1e-4, rtol=0)
    assert server["continued"] == colocated["continued"]
    assert len(server["continued"][1]) <= 3


def test_a_synchronous_fit_on_the_server_equals_the_colocated_fit(twin):
    """``max_staleness = 0``: the same seed gives the same prompts and samples, hence the
    same loss and update, as the colocated engine (float32 on the CPU: the weights agree to
    rounding). One step: the colocated engine's in-process vLLM draws from the trainer's
    torch random stream while it generates (the server's runs in its own process), so the
    next step's request seeds differ between the two."""
    a, b = twin["step"]["server"], twin["step"]["colocated"]
    assert a["ids"] == b["ids"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    for key in a["params"]:
        torch.testing.assert_close(torch.tensor(a["params"][key]), torch.tensor(b["params"][key]),
                                   rtol=1e-4, atol=1e-5)


def new_weights_land(engine, server) -> None:
    """Change the policy's weights: the server differs from it until a sync, then holds
    exactly them (the probe within 1e-4) under the new version."""
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    with pytest.raises(ServerError, match="probe log-probabilities"):
        engine._check_probe()  # the server still holds the old weights
    engine.sync(engine.model)
    engine._check_probe()
    held = httpx.get(server.url + "/weight_info").json()["weight_version"]
    assert held == engine.current == f"{engine.version}-{engine.run}" and engine.sync_bytes > 0


def test_new_weights_reach_the_server_with_their_version(server, cache):
    engine = engine_on(server, cache, probe_tolerance=1e-4)
    new_weights_land(engine, server)
    engine.close()


def test_a_transfer_cut_short_is_repeated_whole_or_leaves_the_server_paused(server, cache):
    engine = engine_on(server, cache, probe_tolerance=1e-4)
    real = engine._write_weights
    cuts = {"left": 1}

    def cut_short(weights):
        path, info = real(weights)
        if cuts["left"] > 0:
            cuts["left"] -= 1
            with open(path, "r+b") as f:
                f.truncate(info["num_bytes"] // 2)
        return path, info

    engine._write_weights = cut_short
    with torch.no_grad():
        for p in engine.model.parameters():
            p.mul_(1.01)
    engine.sync(engine.model)  # the first file is cut; the second attempt lands
    engine._check_probe()
    before = httpx.get(server.url + "/weight_info").json()["weight_version"]
    cuts["left"] = 99
    with pytest.raises(ServerError, match="left paused"):
        engine.sync(engine.model)
    assert httpx.get(server.url + "/is_paused").json()["is_paused"] is True
    assert httpx.get(server.url + "/weight_info").json()["weight_version"] == before
    httpx.post(server.url + "/resume")  # leave the shared server usable
    engine.close()


def test_a_weights_file_that_leaves_out_a_layer_is_refused(server, cache):
    """A file whose names do not cover the served model (here one MLP weight left out, the
    count and size consistent) fails the update naming the parameter, instead of the model
    silently keeping that layer's old weights."""
    engine = engine_on(server, cache, probe_tolerance=1e-4)
    real = engine._write_weights

    def without_one(weights):
        kept = [(n, t) for n, t in weights if not n.endswith("layers.0.mlp.down_proj.weight")]
        assert len(kept) == len(weights) - 1
        return real(kept)

    engine._write_weights = without_one
    before = httpx.get(server.url + "/weight_info").json()["weight_version"]
    with pytest.raises(ServerError, match="down_proj"):
        engine.sync(engine.model)
    assert httpx.get(server.url + "/weight_info").json()["weight_version"] == before
    engine._write_weights = real
    engine.sync(engine.model)  # a whole file repairs the server
    engine._check_probe()
    engine.close()


def test_a_request_without_the_key_is_refused(server, cache):
    body = {"model": "x", "prompt": [1, 2], "max_tokens": 1}
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 401
    policy, tokenizer = policy_and_tokenizer(cache)
    with pytest.raises(ServerError, match="api_key or VLLM_API_KEY"):
        VLLMServerEngine(policy, tokenizer, SAMPLING, urls=[server.url], api_key="wrong")


def test_no_server_names_the_url_and_the_command(cache):
    policy, tokenizer = policy_and_tokenizer(cache)
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match="no vLLM server answers at " + url) as err:
        VLLMServerEngine(policy, tokenizer, SAMPLING, urls=[url], connect_seconds=0)
    assert "vllm.entrypoints.openai.api_server" in str(err.value)


def test_a_fit_trains_on_the_server(server, cache, tmp_path):
    from maxent_grpo.rollout.vllm_server import VLLMServerEngine as Engine

    module = make_module(
        cache, model_name_or_path=MODEL, max_completion_length=8,
        engine=functools.partial(Engine, urls=[server.url], api_key=KEY),
        rewards={"tests.conftest:alternating": 1.0})
    trainer = fit(module, make_data(cache, tokenizer=MODEL), steps=3, tmp_path=tmp_path)
    assert trainer.global_step == 3
    logged = trainer.callback_metrics
    assert float(logged["train/perf/sync_seconds"]) > 0
    assert 0 <= float(logged["train/rollout/logp_gap/mean"]) < 1e-5  # the server has our weights
    # sent at the start and after steps 1 and 2; the engine is closed when the fit ends
    assert httpx.get(server.url + "/weight_info").json()["weight_version"].startswith("3-")
    assert module._engine is None


def test_a_server_that_dies_is_replaced_then_revived_with_the_current_weights(cache, tmp_path):
    """Two servers; one is killed: the other takes the load; restarted on its port (with the
    weights it started with), it gets the current weights before it is used again. With
    both gone the rollout fails after ``retry_seconds``, naming the servers and the resume."""
    folder = resolve_model_path(MODEL, cache)
    a, b = Server(folder, KEY, tmp_path / "a.log"), Server(folder, KEY, tmp_path / "b.log")
    try:
        a.start(wait=False)  # both start at once
        b.start(wait=False)
        a.wait_healthy()
        b.wait_healthy()
        engine = VLLMServerEngine(*policy_and_tokenizer(cache), SAMPLING, urls=[a.url, b.url],
                                  api_key=KEY, retry_seconds=20)
        with torch.no_grad():
            for p in engine.model.parameters():
                p.mul_(0.99)
        engine.sync(engine.model)
        a.kill()
        out = engine.generate(PROMPTS * 2, [""] * 4, 2)
        assert out.completion_ids.shape[0] == 8
        assert not engine.servers[0].healthy
        a.start()  # holds the weights it started with: version "default"
        assert httpx.get(a.url + "/weight_info").json()["weight_version"] != engine.current
        assert engine._revive(engine.servers[0])
        assert httpx.get(a.url + "/weight_info").json()["weight_version"] == engine.current
        engine._check_probe()
        a.kill()
        b.kill()
        engine.retry_seconds = 2
        with pytest.raises(ServerError, match="--ckpt_path last"):
            engine.generate(PROMPTS, ["", ""], 2)
        engine.close()
    finally:
        a.kill()
        b.kill()


def test_an_asynchronous_fit_trains_one_step_behind(server, cache, tmp_path):
    """``max_staleness = 1``: the first step only starts a rollout; every later step trains
    on the rollout made from the weights one optimizer step old, which the sampler
    correction sees as a gap between the sampler's and the trainer's log-probs."""
    from maxent_grpo.rollout.vllm_server import VLLMServerEngine as Engine

    module = make_module(
        cache, model_name_or_path=MODEL, max_completion_length=8, max_staleness=1,
        sampler_correction="token_tis",
        engine=functools.partial(Engine, urls=[server.url], api_key=KEY),
        rewards={"tests.conftest:alternating": 1.0})
    trainer = fit(module, make_data(cache, tokenizer=MODEL), steps=3, tmp_path=tmp_path)
    assert trainer.global_step == 3
    logged = trainer.callback_metrics
    assert float(logged["train/rollout/staleness"]) == 1.0
    assert float(logged["train/rollout/logp_gap/mean"]) > 1e-4  # sampled by older weights
    assert float(logged["train/rollout/correction/mean"]) != 1.0

