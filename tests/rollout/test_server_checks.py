"""The server engine's start checks and requests against what a real deployment can hold:
a server whose model's generation config sets penalties (they must not reach the sampler),
a server returning log-probs before temperature (vLLM's default; the probe must catch it),
a policy with dropout (the probe runs it as a rollout does, in eval mode), two servers
serving the model under two names, answers that are not a vLLM server's, a ``transfer_dir``
that does not exist yet or is relative, a URL with a path, and ``maxent_grpo.serve`` on a
port someone else holds. No vLLM is needed: the answers are computed from the policy."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("httpx")

from maxent_grpo.rollout import SamplingSettings  # noqa: E402
from maxent_grpo.rollout.server_checks import PROBE_TEMPERATURE, PROBE_TEXT  # noqa: E402
from maxent_grpo.rollout.server_weights import ServerError  # noqa: E402
from maxent_grpo.rollout.vllm_engine import NEUTRAL_SAMPLING, VLLMEngineBase  # noqa: E402
from maxent_grpo.rollout.vllm_server import VLLMServerEngine  # noqa: E402
from tests.rollout.test_server_requests import _bare_engine, stand_ins  # noqa: E402,F401


@pytest.mark.parametrize("do_sample", [True, False])
def test_every_request_sets_the_penalties_a_server_would_otherwise_default(do_sample):
    engine = SimpleNamespace(_stop_ids=[2], _name="VLLMServerEngine")
    s = SamplingSettings(max_new_tokens=4, do_sample=do_sample, temperature=0.7, top_k=0)
    fields = VLLMEngineBase._request(engine, s, n=3, seed=1)
    assert {k: fields[k] for k in NEUTRAL_SAMPLING} == {
        "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "min_p": 0.0}
    assert fields["temperature"] == (0.7 if do_sample else 0.0)
    s = SamplingSettings(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=5)
    fields = VLLMEngineBase._request(engine, s, n=3, seed=1)
    assert (fields["top_p"], fields["top_k"]) == (0.9, 5)  # the trainer's own, when set


@pytest.fixture(scope="module")
def policy(cache_dir):
    from maxent_grpo.models import load_policy, load_tokenizer

    model = load_policy("builtin:tiny-h64-warm", cache_dir=cache_dir)
    return model, load_tokenizer("builtin:tiny-h64-warm", cache_dir=cache_dir)


def _probe_engine(policy, answer) -> VLLMServerEngine:
    """A bare engine over one server at a fake URL whose ``/v1/completions`` is
    ``answer(body)``."""
    engine = _bare_engine(["http://127.0.0.1:1"], request_timeout=5.0)
    engine.model, engine.tokenizer = policy
    engine.probe_tolerance = 1e-2
    engine.servers[0].model = "served-name"
    bodies = []

    def call(server, method, path, **kw):
        assert path == "/v1/completions"
        bodies.append(kw["json"])
        return answer(kw["json"])

    engine._call = call
    engine.bodies = bodies
    return engine


def _server_answer(model, ids, temperature_applied=True, sample_dropout=False):
    """What vLLM answers the probe: prompt log-probs without temperature; the sampled
    token's log-prob after it (``processed_logprobs``) or before (``raw_logprobs``)."""
    with torch.no_grad():
        logits = model.eval()(input_ids=torch.tensor([ids])).logits[0].float()
    prompt = torch.log_softmax(logits[:-1], -1)
    rows = [None] + [{str(t): {"logprob": float(prompt[i, t])}} for i, t in enumerate(ids[1:])]
    last = logits[-1] / (PROBE_TEMPERATURE if temperature_applied else 1.0)
    token = int(torch.argmin(logits[-1]))  # an unlikely token: the two modes differ most
    sampled = float(torch.log_softmax(last, -1)[token])
    return {"choices": [{"prompt_logprobs": rows, "token_ids": [token],
                         "logprobs": {"token_logprobs": [sampled]}}]}


def test_the_probe_passes_a_server_that_returns_log_probs_after_temperature(policy):
    model, tokenizer = policy
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    answer = _server_answer(model, ids)
    engine = _probe_engine(policy, lambda body: answer)
    model.train()  # as configure_model leaves it
    engine._check_probe()
    assert model.training  # the mode is put back
    body = engine.bodies[0]
    assert body["model"] == "served-name" and body["temperature"] == PROBE_TEMPERATURE
    # a server's default top-p / top-k would renormalise the sampled token's log-prob
    assert all(body[k] == v for k, v in NEUTRAL_SAMPLING.items()) and body["top_p"] == 1.0


def test_the_probe_compares_the_weights_as_they_are_under_mixed_precision(policy):
    """The engine is built inside the first training step, under ``bf16-mixed``'s autocast:
    the probe compared a float32 server with the policy run in bfloat16 (0.056 apart on
    the hunt's model) and refused it, telling the user to start it in the policy's dtype."""
    model, tokenizer = policy
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    answer = _server_answer(model, ids)
    engine = _probe_engine(policy, lambda body: answer)
    engine.probe_tolerance = 1e-4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine._check_probe()


def test_the_probe_refuses_a_server_that_returns_log_probs_before_temperature(policy):
    model, tokenizer = policy
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    answer = _server_answer(model, ids, temperature_applied=False)
    engine = _probe_engine(policy, lambda body: answer)
    with pytest.raises(ServerError, match="--logprobs-mode processed_logprobs"):
        engine._check_probe()


def test_the_probe_runs_a_policy_with_dropout_as_a_rollout_does(cache_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    from maxent_grpo.models import load_policy, load_tokenizer

    base = load_policy("builtin:tiny-h64-warm", cache_dir=cache_dir)
    config = AutoConfig.from_pretrained(base.config._name_or_path, attention_dropout=0.5)
    model = AutoModelForCausalLM.from_pretrained(base.config._name_or_path, config=config)
    tokenizer = load_tokenizer("builtin:tiny-h64-warm", cache_dir=cache_dir)
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    answer = _server_answer(model, ids)
    engine = _probe_engine((model, tokenizer), lambda body: answer)
    torch.manual_seed(0)
    model.train()
    engine._check_probe()  # in train mode the dropout put the probe 0.1 or more away
    assert model.training


@pytest.mark.parametrize("answer", ["<html>", {"error": "x"}, {"choices": [{}]},
                                    {"choices": [{"prompt_logprobs": None}]}])
def test_a_probe_answer_that_is_not_vllms_names_the_server(policy, answer):
    engine = _probe_engine(policy, lambda body: answer)
    with pytest.raises(ServerError, match=r"http://127.0.0.1:1/v1/completions answered the "
                                          "probe without its log-probabilities"):
        engine._check_probe()


@pytest.mark.parametrize("route, answer, message", [
    ("/v1/models", "<html>", "did not answer a model list"),
    ("/tokenize", {"error": "no"}, "/tokenize answered no tokens"),
])
def test_start_check_answers_that_are_not_vllms_name_the_server(policy, route, answer, message):
    engine = _bare_engine(["http://127.0.0.1:1"], request_timeout=5.0)
    engine.model, engine.tokenizer = policy
    ids = engine.tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    answers = {"/v1/models": {"data": [{"id": "m"}]}, "/weight_info": {"weight_version": "0"},
               "/init_weight_transfer_engine": {}, "/tokenize": {"tokens": ids}, route: answer}
    engine._call = lambda server, method, path, **kw: answers[path]
    with pytest.raises(ServerError, match=message):
        engine._check_server(engine.servers[0])


def test_each_server_is_asked_under_the_name_it_serves(stand_ins):  # noqa: F811
    a, b = stand_ins(), stand_ins()
    engine = _bare_engine([a.url, b.url], request_timeout=5.0)
    sent = []
    real = engine._call

    def call(server, method, path, **kw):
        sent.append((server.url, kw["json"]["model"]))
        return real(server, method, path, **kw)

    engine._call = call
    engine.servers[0].model, engine.servers[1].model = "/models/qwen", "Qwen/Qwen2.5-0.5B"
    try:
        engine._run_all([{"prompt": [1, 2], "n": 1, "max_tokens": 3}] * 4)
    finally:
        engine.close()
    assert set(sent) == {(a.url, "/models/qwen"), (b.url, "Qwen/Qwen2.5-0.5B")}


@pytest.mark.parametrize("relative", [False, True])
def test_the_weights_go_to_a_transfer_dir_made_if_missing_under_an_absolute_path(
        tmp_path, monkeypatch, relative):
    monkeypatch.chdir(tmp_path)
    engine = _bare_engine(["http://127.0.0.1:1"], request_timeout=5.0)
    engine._transfer_dir = "scratch/job1" if relative else str(tmp_path / "scratch" / "job1")
    try:
        path, info = engine._write_weights([("w", torch.ones(3))])
        assert os.path.isabs(path) and os.path.isfile(path)
        assert path.startswith(str(tmp_path / "scratch" / "job1"))
        assert info["num_tensors"] == 1
    finally:
        engine.close()


def test_a_url_with_a_path_is_refused_at_once_naming_the_root():
    engine = _bare_engine(["http://127.0.0.1:1/v1"], request_timeout=5.0)

    def call(server, method, path, **kw):  # what a server answers for /v1/health
        raise ServerError(f"{server.url}{path} answered 404: not found", 404)

    engine._call = call
    try:
        with pytest.raises(ServerError, match=r"answered 404: give each server's root URL"):
            engine._wait_until_up(engine.servers[0], 60.0)  # at once, not after 60 s
    finally:
        engine.close()


def test_the_start_command_suggested_names_the_engines_transfer(monkeypatch):
    engine = _bare_engine(["http://127.0.0.1:1"], request_timeout=5.0)
    engine.weight_transfer = "gloo"
    monkeypatch.setattr("time.sleep", lambda s: None)
    engine._call = lambda s, method, path, **kw: (_ for _ in ()).throw(ServerError("refused"))
    try:
        with pytest.raises(ServerError, match="maxent_gloo"):
            engine._wait_until_up(engine.servers[0], 0.0)
    finally:
        engine.close()


def test_serve_refuses_a_port_another_process_holds():
    from maxent_grpo.serve import main

    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM's server binds
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SystemExit, match=f"port {port} on 127.0.0.1 is taken"):
            main(["--model", "builtin:tiny-h64-warm", "--port", str(port)])
        # a server just stopped, whose connection to a trainer waits to close (TIME_WAIT):
        # free for a restart there (vLLM binds with SO_REUSEADDR), as it was not for 60 s
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = held.accept()
        accepted.close()  # the server's side closes first: its end lingers
        client.close()
    from maxent_grpo.serve import _port_taken

    assert not _port_taken(port)



def test_serve_starts_vllm_on_the_base_of_an_adapter_folder(tmp_path, monkeypatch):
    """``--model`` an exported adapter (as the trainer takes it): vLLM refused the folder,
    which has no config.json (a hunt); the server runs its base, and the engine sends the
    merged weights."""
    import json

    import maxent_grpo.rollout.vllm_server as vllm_server
    from maxent_grpo.builtin.catalog import build_tiny_model
    from maxent_grpo.serve import main

    build_tiny_model().save_pretrained(tmp_path / "base")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "base_model_name_or_path": str(tmp_path / "base")}))
    served = []

    def server_args(folder, *_):
        served.append(folder)
        raise SystemExit("stand-in")

    monkeypatch.setattr(vllm_server, "server_args", server_args)
    with pytest.raises(SystemExit, match="stand-in"):
        main(["--model", str(tmp_path / "adapter")])
    assert [os.path.realpath(f) for f in served] == [os.path.realpath(tmp_path / "base")]


DRIVER = """
import os, signal, sys, time
import maxent_grpo.models as models
import maxent_grpo.rollout.vllm_server as vllm_server
import maxent_grpo.serve as serve

out, python, handled = sys.argv[1], sys.executable, sys.argv[2] == "handled"
# as from a terminal: a suite started in the background inherits Ctrl-C ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
server = "import os, time; open(os.path.join(os.environ['TMPDIR'], 'socket'), 'w'); time.sleep(60)"
vllm_server.server_args = lambda *a: [python, "-c", server]
models.model_chain = lambda model, cache: [model]
serve._wait_healthy = lambda *a: None
training = f'''
import signal, sys, time
def stop(signum, frame):
    open({out!r} + "/got", "w").write(signal.Signals(signum).name)
    sys.exit(128 + signum)
if {handled!r}:
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
open({out!r} + "/ready", "w").close()
time.sleep(60)
'''
with open(os.path.join(out, "training.py"), "w") as f:
    f.write(training)
wrapper = os.path.join(out, "python")
with open(wrapper, "w") as f:  # the training command: this stand-in, whatever its arguments
    f.write(f"#!/bin/sh\\nexec {python} {out}/training.py\\n")
os.chmod(wrapper, 0o755)
serve.sys.executable = wrapper
sys.exit(serve.main(["--model", "builtin:tiny-h64-warm", "--", "fit"]))
"""


@pytest.mark.parametrize("signum, handled", [("SIGTERM", True), ("SIGINT", True),
                                             ("SIGTERM", False)])
def test_serve_passes_a_stop_on_as_it_came_and_keeps_the_servers_files(tmp_path, signum,
                                                                      handled):
    """A SIGTERM to ``maxent_grpo.serve -- fit`` (a scheduler's stop) reached the training
    as Ctrl-C (stopped mid-step, exit 130, not after its batch with 143), and the server's
    sockets and files were left in the system's temporary folder after every run (a hunt):
    the training gets the same signal and its code is returned; the server's temporary
    files go into its own folder, removed with it. A training the signal ended (before
    Lightning's handler) gives the shell's code (readers: a negative code exited 241)."""
    import shutil
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    temporary = Path(tempfile.mkdtemp(dir="/tmp"))  # short: a socket's path has 107 bytes
    env = {**os.environ, "TMPDIR": str(temporary)}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path),
                               "handled" if handled else "not"], env=env,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (list(temporary.glob("*/socket")) and (tmp_path / "ready").exists()
                   ) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "ready").exists(), driver.stderr.read() if driver.poll() else ""
        driver.send_signal(getattr(signal, signum))
        _, err = driver.communicate(timeout=60)
    finally:
        driver.kill()
        work = [p.name for p in temporary.iterdir()]
        shutil.rmtree(temporary)
    assert (tmp_path / "got").read_text() == signum if handled else not (
        tmp_path / "got").exists(), err
    assert driver.returncode == 128 + getattr(signal, signum), err
    assert len(work) == 1 and work[0].startswith("maxent_grpo_serve_"), work  # kept: the log
