"""Errors for people, traces for developers (:mod:`maxent_grpo.cli.errors`).

Every bad input of the table below goes through the real command line in this process
(``main(args, exit_on_error=True)``, what ``python -m maxent_grpo`` runs): it must exit
non-zero with a short ``error: ...`` message naming the problem and no trace; with
``--traceback`` (anywhere on the line) the trace appears. A bug of ours (an unexpected
exception type) always prints its trace. Runs that get as far as training use the random
``builtin:tiny`` model (materialised once per module) for one step, on 8 prompts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger

import maxent_grpo.cli.parser as cli_module
from maxent_grpo.cli import errors
from maxent_grpo.rewards import RewardFunctionError
from maxent_grpo.training.data.datamodule import PromptDataModule
from maxent_grpo.training.module import MaxEntGRPOModule

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")

# one quick step of configs/tiny.yaml: random tiny model, no logger, checkpoint or validation
QUICK = [
    "--model.model_name_or_path", "builtin:tiny", "--trainer.max_steps", "1",
    "--trainer.logger", "false", "--trainer.callbacks", "[]",
    "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false", "--trainer.limit_val_batches", "0",
    "--data.train_size", "16", "--data.val_size", "4", "--data.batch_size", "4",
]

REWARDS_MODULE = "maxent_grpo_test_bad_rewards"
REWARDS_SOURCE = '''
def raises(prompts, completions, **kwargs):
    return [1.0 / 0 for _ in completions]

def wrong_count(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)

def nan(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)
'''

TAU_CONTROLLER = "maxent_grpo.training.callbacks.TauController"

# (id, extra arguments after `fit --config tiny.yaml <QUICK>`, exit code, substrings of
# stderr); {tmp} is a folder with the bad files, {models} the shared model cache
CASES = [
    # parse errors: jsonargparse prints the usage line and exits 2
    ("unknown key", ["--model.bogus", "1"], 2, ["unrecognized arguments", "--model.bogus"]),
    ("unknown key in a config file", ["--config", "{tmp}/bogus.yaml"], 2, ["bogus"]),
    ("wrong type", ["--model.num_generations", "abc"], 2, ["model.num_generations", "abc"]),
    ("unknown choice", ["--model.objective.loss_type", "foo"], 2, ["loss_type", "foo", "dr_grpo"]),
    ("unknown objective class", ["--model.objective", "NoSuchObjective"], 2,
     ["model.objective", "NoSuchObjective"]),
    ("missing config file", ["--config", "{tmp}/missing.yaml"], 2,
     ["config", "does not exist", "missing.yaml"]),
    # option checks when the classes are built: exit 1, a short message
    ("out-of-range option", ["--model.num_generations", "1"], 1, ["model.num_generations", ">= 2"]),
    ("unknown reward name", ["--model.rewards", "{nope: 1.0}"], 1,
     ["model.rewards", "'nope'", "'accuracy'"]),
    ("reward that cannot be imported", ["--model.rewards", "{no_such_module:fn: 1.0}"], 1,
     ["cannot import reward", "no_such_module"]),
    ("bad eval_k", ["--model.eval_k", "[1, 99]"], 1, ["model.eval_k", "99"]),
    ("tau=0 without beta", ["--model.objective", "ListwiseMaxEnt",
                            "--model.objective.tau", "0.0", "--model.objective.beta", "0.0"], 1,
     ["error: objective.tau must be > 0 when objective.beta = 0"]),
    ("unknown task", ["--data.task", "sudoku"], 1, ["'sudoku'", "'countdown'"]),
    ("missing data file", ["--data.task", "null", "--data.data_files", "{tmp}/nope.jsonl"], 1,
     ["data.data_files", "nope.jsonl"]),
    ("bad controller option",
     ["--trainer.callbacks", f"[{{class_path: {TAU_CONTROLLER}, init_args: "
      "{target_entropy: 1.0, tau_min: 0.0}}]"], 1,
     ["error: TauController.tau_min must be a finite number > 0; got 0.0"]),
    ("accelerator not available", ["--trainer.accelerator", "mps"], 1,
     ["MPSAccelerator", "can not run on your system", "['cpu']"]),
    ("optional package missing", ["--trainer.accelerator", "tpu"], 1,
     ["torch_xla", "pip install"]),
    # found while the run starts or trains, raised inside trainer.fit: exit 1, short message
    ("empty data file", ["--data.task", "null", "--data.data_files", "{tmp}/empty.jsonl"], 1,
     ["data.data_files", "empty.jsonl", "no rows"]),
    ("broken data file", ["--data.task", "null", "--data.data_files", "{tmp}/broken.jsonl"], 1,
     ["data.data_files", "broken.jsonl", "not valid JSON"]),
    ("missing model folder", ["--model.model_name_or_path", "{tmp}/no_model"], 1,
     ["model path", "no_model", "does not exist"]),
    ("model folder without a model", ["--model.model_name_or_path", "{tmp}/empty_model"], 1,
     ["tokenizer"]),
    ("missing checkpoint", ["--ckpt_path", "{tmp}/nope.ckpt"], 1, ["nope.ckpt"]),
    ("bad engine option", ["--model.engine", "maxent_grpo.rollout.HFGenerateEngine",
                           "--model.engine.prompt_bucket", "0"], 1,
     ["HFGenerateEngine.prompt_bucket"]),
    ("the objectives' base class", ["--model.objective", "maxent_grpo.objectives.Objective"], 1,
     ["model.objective: Objective does not define prepare or loss", "GRPO"]),
    ("an engine interface", ["--model.engine", "maxent_grpo.rollout.RolloutEngine"], 1,
     ["model.engine: RolloutEngine is an interface", "HFGenerateEngine"]),
    ("controller on the wrong objective",
     ["--trainer.callbacks", f"[{{class_path: {TAU_CONTROLLER}, init_args: "
      "{target_entropy: 1.0}}]"], 1, ["TauController"]),
    ("an optimizer value torch refuses", ["--model.optimizer.init_args.lr", "-0.1"], 1,
     ["model.optimizer: Invalid learning rate: -0.1"]),
    ("reward function raises", ["--model.rewards", f"{{{REWARDS_MODULE}:raises: 1.0}}"], 1,
     ["raises", "raised ZeroDivisionError", "division by zero", f"{REWARDS_MODULE}.py:2"]),
    ("reward returns the wrong count",
     ["--model.rewards", f"{{{REWARDS_MODULE}:wrong_count: 1.0}}"], 1,
     ["wrong_count", "returned 31 values; expected 32"]),
    ("reward returns NaN", ["--model.rewards", f"{{{REWARDS_MODULE}:nan: 1.0}}"], 1,
     ["nan", "non-finite value", "use None for 'not applicable'"]),
]
IDS = [case[0] for case in CASES]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture
def bad_inputs(tmp_path, monkeypatch) -> Path:
    """A folder with the table's bad files; the bad reward functions importable."""
    (tmp_path / "bogus.yaml").write_text("model:\n  num_generations: 4\n  bogus: 1\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\nnot json\n')
    (tmp_path / "empty_model").mkdir()
    (tmp_path / f"{REWARDS_MODULE}.py").write_text(REWARDS_SOURCE.lstrip("\n"))
    monkeypatch.syspath_prepend(str(tmp_path))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # whatever a run would write lands here
    monkeypatch.setattr(sys, "argv", ["maxent_grpo"])  # LightningCLI: args xor sys.argv
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def run_cli(capsys, args: list[str]) -> tuple[int, str]:
    """``main(args, exit_on_error=True)``; its exit code and stderr."""
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(args, exit_on_error=True)
    return exit_info.value.code, capsys.readouterr().err


def case_args(extra: list[str], tmp: Path, models: str) -> list[str]:
    extra = [a.format(tmp=tmp) if "{tmp}" in a else a for a in extra]
    return ["fit", "--config", TINY, *QUICK, f"--model.model_cache_dir={models}", *extra]


@pytest.mark.parametrize(("name", "extra", "code", "expected"), CASES, ids=IDS)
def test_a_users_mistake_is_one_short_message(name, extra, code, expected, bad_inputs,
                                              models, capsys):
    exit_code, err = run_cli(capsys, case_args(extra, bad_inputs, models))
    print(f"--- {name}: exit {exit_code}\n{err}", file=sys.__stdout__)  # for the docs
    assert exit_code == code, err
    assert "Traceback" not in err, err
    assert "\nerror: " in f"\n{err}", err
    for text in expected:
        assert text in err, (text, err)
    if code == 2:  # a parse error: one usage line and the --help tip, not every option
        assert err[: err.index("error: ")].count("\n") <= 2, err
        assert "python -m maxent_grpo fit --help" in err, err
    if code == 1:
        lines = err.rstrip("\n").split("\n")
        assert lines[-1] == errors.HINT
        message = err[err.rindex("error: "):]
        assert len(message) < 1500, message  # a message, not a dump


@pytest.mark.parametrize(("name", "extra", "code", "expected"), CASES, ids=IDS)
def test_traceback_flag_shows_the_trace(name, extra, code, expected, bad_inputs, models, capsys):
    args = case_args(extra, bad_inputs, models)
    # anywhere on the command line: first, last, or between the subcommand's options
    position = [0, len(args), 3][IDS.index(name) % 3]
    args.insert(position, "--traceback")
    exit_code, err = run_cli(capsys, args)
    assert exit_code == code, err
    assert "Traceback (most recent call last):" in err, err
    assert errors.HINT not in err
    for text in expected:
        assert text in err, (text, err)


# ---------------------------------------------------------------------------- bugs


def test_a_bug_at_set_up_prints_its_trace(bad_inputs, models, capsys, monkeypatch):
    def broken(self, stage):
        return 1 / 0

    monkeypatch.setattr(PromptDataModule, "setup", broken)
    monkeypatch.setattr(errors, "_outside_frame", lambda error: None)  # `broken` is ours here
    exit_code, err = run_cli(capsys, case_args([], bad_inputs, models))
    assert exit_code == 1
    assert "Traceback (most recent call last):" in err and "ZeroDivisionError" in err
    assert "in broken" in err  # the frame that raised
    assert "unexpected ZeroDivisionError" in err and "bug" in err
    assert errors.HINT not in err


def test_a_bug_in_a_training_step_prints_its_trace(bad_inputs, models, capsys, monkeypatch):
    def broken(self, batch, batch_idx):
        return {}["missing"]

    monkeypatch.setattr(MaxEntGRPOModule, "training_step", broken)
    monkeypatch.setattr(errors, "_outside_frame", lambda error: None)  # `broken` is ours here
    exit_code, err = run_cli(capsys, case_args([], bad_inputs, models))
    assert exit_code == 1
    assert "Traceback (most recent call last):" in err and "KeyError: 'missing'" in err
    assert "unexpected KeyError" in err


def test_an_error_raised_in_the_users_own_file_is_not_called_our_bug(capsys, tmp_path,
                                                                    monkeypatch):
    """A custom objective's ``loss`` raising KeyError, a callback raising: "a bug in
    maxent_grpo, please report it" (a hunt of the extension points). An error whose
    innermost frame is in a file outside the package and the libraries names that file."""
    (tmp_path / "my_objective.py").write_text("def loss(targets):\n    return targets['adv']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_objective

    try:
        my_objective.loss({})
    except KeyError as error:
        assert errors.report(error, show_trace=False) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "this is a bug" not in err
    assert (f"error: KeyError raised outside maxent_grpo and its libraries, at "
            f"{tmp_path / 'my_objective.py'}:2 (your code?)") in err
    import textwrap

    try:
        textwrap.dedent(None)  # a TypeError whose innermost frame is the standard library's
    except TypeError as error:
        assert errors.report(error, show_trace=False) == 1
    assert "this is a bug" in capsys.readouterr().err


def test_library_calls_still_raise(bad_inputs, models):
    """``main(list)`` without exit_on_error (tests, scripts) gets the exception itself."""
    with pytest.raises(ValueError, match="model.num_generations"):
        cli_module.main(case_args(["--model.num_generations", "1", "--traceback"],
                                  bad_inputs, models)[1:], run=False)  # no subcommand


def test_sys_argv_is_read_and_keeps_the_flag(bad_inputs, models, capsys, monkeypatch):
    """``main()`` reads sys.argv (less ``--traceback``) and exits on a user error; sys.argv
    keeps the flag (Lightning's DDP launcher restarts the script with it)."""
    argv = ["maxent_grpo", *case_args(["--model.num_generations", "1"], bad_inputs, models)]
    monkeypatch.setattr(sys, "argv", list(argv))
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err and errors.HINT in err
    monkeypatch.setattr(sys, "argv", [*argv, "--traceback"])
    with pytest.raises(SystemExit):
        cli_module.main()
    assert "Traceback (most recent call last):" in capsys.readouterr().err
    assert sys.argv[-1] == "--traceback"


def test_python_dash_m(bad_inputs, models):
    """The real entry point, once: a user error is short, exit code 1."""
    cmd = [sys.executable, "-m", "maxent_grpo",
           *case_args(["--model.num_generations", "1"], bad_inputs, models)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.rstrip("\n").endswith(
        "\nerror: model.num_generations must be an int >= 2; got 1\n" + errors.HINT
    ), proc.stderr


# ---------------------------------------------------------------------------- classification


def test_lightnings_refusal_of_srun_without_tasks_per_node_is_a_users_mistake(monkeypatch):
    """``srun -n 8`` without ``--ntasks-per-node``: Lightning's RuntimeError, which names the
    fix, was printed as a bug of ours with its trace (a hunt)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    with pytest.raises(RuntimeError) as caught:
        SLURMEnvironment._validate_srun_variables()
    assert errors.is_user_error(caught.value)
    assert "--ntasks-per-node=8" in errors.message_of(caught.value)


def test_user_error_classes():
    for error in (ValueError("x"), FileNotFoundError(2, "No such file", "a.txt"),
                  errors.UserError("x"), RewardFunctionError("x"),
                  ModuleNotFoundError("feature X needs package y: pip install y")):
        assert errors.is_user_error(error), error
    for error in (ZeroDivisionError(), KeyError("k"), TypeError("t"), RuntimeError("r"),
                  AttributeError("a"), ModuleNotFoundError("No module named 'y'", name="y")):
        assert not errors.is_user_error(error), error
    from maxent_grpo.training.step.optimise import NonFiniteLossError

    assert errors.is_user_error(NonFiniteLossError("loss was NaN 3 times"))
    # running out of memory, or a logger's account not set up, is no bug of ours
    import torch

    usage = type("UsageError", (Exception,), {"__module__": "wandb.errors"})
    for error in (MemoryError(), torch.OutOfMemoryError("CUDA out of memory"), usage("login")):
        assert errors.is_user_error(error), error
    assert "lower data.batch_size" in errors.message_of(MemoryError())
    assert errors.find_user_error(RuntimeError(  # a worker's re-raised trace
        "Caught OutOfMemoryError.\nTraceback (most recent call last):\n  x\n"
        "torch.OutOfMemoryError: CUDA out of memory")) is not None


def test_a_killed_dataloader_worker_is_named_with_what_to_do(capsys):
    """torch's "DataLoader worker (pid N) is killed by signal: Killed." (the OOM killer, a
    kill) was called a bug in maxent_grpo (a hunt)."""
    killed = RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. ")
    try:  # the form the main thread sees waiting on the loader (readers)
        raise RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly") from killed
    except RuntimeError as exited:
        waiting = exited
    for error, said in ((killed, "(pid 4242) is killed by signal: Killed."),
                        (waiting, "(pid(s) 4242) exited unexpectedly")):
        assert errors.report(error, show_trace=False) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: DataLoader worker {said}"), err
        assert "lower data.num_workers" in err and "bug" not in err
    # a SIGTERM sent to a worker alone (one sent to the group, the workers ignore): not memory
    terminated = RuntimeError("DataLoader worker (pid 4242) is killed by signal: Terminated. ")
    assert errors.report(terminated, show_trace=False) == 1
    err = capsys.readouterr().err
    assert "a SIGTERM reached it" in err and "memory" not in err


def test_a_process_whose_peer_failed_points_to_the_peers_error(capsys, monkeypatch):
    """Rank 0 of a run whose rank 1 raised (a reward function) printed gloo's trace and
    called it a bug in maxent_grpo; the peer had printed the real error."""
    import torch

    group = type("Group", (), {"is_initialized": staticmethod(lambda: True),
                               "get_world_size": staticmethod(lambda: 2)})
    monkeypatch.setattr(errors, "torch_distributed", lambda: group)

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:50905. This is typically caused by a remote worker crashing.")
    nccl = torch.distributed.DistBackendError("NCCL error: remote process exited or there was "
                                              "a network error")
    for error in (gloo, nccl):
        assert errors.report(error, show_trace=False) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: this process lost its connection to another process")
        assert "bug" not in err and "Traceback" not in err
    for bug in (RuntimeError("an index out of range"),  # a local NCCL fault is shown whole
                torch.distributed.DistBackendError("NCCL error: invalid usage")):
        assert errors.report(bug, show_trace=False) == 1
        assert "this is a bug" in capsys.readouterr().err


def test_a_busy_port_is_named_and_the_launched_processes_are_stopped(capsys, monkeypatch):
    """A DDP launch whose MASTER_PORT another program held printed torch's trace as "a bug in
    maxent_grpo", and left the process Lightning had started waiting 30 minutes, where the
    next run on that port took it for its own (a hunt of DDP on the CPU)."""
    import subprocess
    import types

    import torch

    monkeypatch.setenv("WORLD_SIZE", "2")  # as in the launching process, after Lightning's
    monkeypatch.setenv("MASTER_PORT", "29558")
    busy = torch.distributed.DistNetworkError(
        "The server socket has failed to listen on any local network address. port: 29558, "
        "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
    assert errors.report(busy, show_trace=False) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the run's port 29558 (MASTER_PORT) is in use") and (
        "Set MASTER_PORT to a free port, or unset it" in err)
    assert "bug" not in err and "lost its connection" not in err
    monkeypatch.setenv("MASTER_PORT", "29500")  # another port: one chosen free, then taken
    assert errors.report(busy, show_trace=False) == 1
    assert capsys.readouterr().err.startswith("error: port 29558 was taken by another program")
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    launched = [done, waiting]  # the list Lightning's observer thread watches too
    monkeypatch.setattr(errors, "LAUNCHERS", [types.SimpleNamespace(procs=launched), None])
    try:
        with pytest.raises(SystemExit) as stop:
            errors.exit_on_error(lambda: (_ for _ in ()).throw(busy), show_trace=False)
        assert stop.value.code == 1
        assert waiting.wait(timeout=10) == -9 and done.returncode == 0
        assert launched == []  # emptied: the observer does not kill this process for it
    finally:
        waiting.kill()


def test_a_server_error_is_its_message_not_a_lost_process_or_a_bug(capsys):
    """A vLLM server that refused the key or reset the connection: the ServerError's own
    message (it says what to start or give), not "a bug in maxent_grpo" with a trace, and
    not a lost process of the run (a one-process run has none; httpx's "Connection reset by
    peer" matched)."""
    import httpx

    from maxent_grpo.rollout.server_weights import ServerError

    refused = ServerError("http://127.0.0.1:1 refused the request (401): give the same key "
                          "as the server's --api-key (VLLM_API_KEY)", status=401)
    try:
        raise httpx.ReadError("[Errno 104] Connection reset by peer")
    except httpx.ReadError as cause:
        try:
            raise ServerError("no vLLM server answers at http://127.0.0.1:1 (ReadError: "
                              "[Errno 104] Connection reset by peer). Start one") from cause
        except ServerError as error:
            reset = error
    for error, said in ((refused, "give the same key"), (reset, "no vLLM server answers")):
        assert errors.report(error, show_trace=False) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {str(error)[:40]}") and said in err
        assert "bug" not in err and "Traceback" not in err and "lost its connection" not in err
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection reset by peer")
    assert not errors.peer_failed(gloo)  # no process group here: no peer to have lost


def test_an_mlflow_server_that_does_not_answer_is_named_not_called_a_bug(capsys):
    """An unreachable tracking_uri: mlflow retries, then raises MlflowException, which was
    printed as a bug in maxent_grpo with its trace."""
    mlflow = pytest.importorskip("mlflow.exceptions")
    error = mlflow.MlflowException(
        "API request to http://127.0.0.1:9/api/2.0/mlflow/experiments/get-by-name failed "
        "with exception HTTPConnectionPool(host='127.0.0.1', port=9): Max retries exceeded")
    assert errors.report(error, show_trace=False) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: API request to http://127.0.0.1:9") and "tracking_uri" in err
    assert "bug" not in err and "Traceback" not in err
    assert not errors.is_user_error(mlflow.MlflowException("an internal index error"))


def test_a_wandb_server_out_of_reach_is_named_with_the_offline_mode(capsys):
    """W&B's online mode without a network: after its retries, ``CommError`` was printed
    as a bug in maxent_grpo with its trace (a hunt of logging backends)."""
    wandb_errors = pytest.importorskip("wandb.errors")
    error = wandb_errors.CommError('Timed out while retrying: Post "https://api.x/graphql"')
    assert errors.report(error, show_trace=False) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: Timed out while retrying") and "WANDB_MODE=offline" in err
    assert "bug" not in err and "Traceback" not in err
    refused = wandb_errors.AuthenticationError("API key not valid")  # a CommError's kind
    assert errors.is_user_error(refused) and "wandb login" in errors.message_of(refused)


def test_a_logger_that_cannot_make_its_folder_is_named(tmp_path, monkeypatch, capsys):
    """MLflow's file store under a ``save_dir`` that cannot be made failed while the logger
    was built: ``[Errno 20] Not a directory`` alone, without the logger."""
    loggers = pytest.importorskip("lightning.pytorch.loggers")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OSError) as raised:
        loggers.MLFlowLogger(save_dir=str(tmp_path / "a_file" / "mlruns"))
    assert errors.report(raised.value, show_trace=False) == 1
    err = capsys.readouterr().err
    assert "Not a directory" in err and "trainer.logger MLFlowLogger: give a save_dir" in err


@pytest.mark.parametrize("logger, written", [
    ("TensorBoardLogger", "the TensorBoard events under {folder}"),
    ("CSVLogger", "the CSV log {folder}/metrics.csv")])  # Lightning's writer: no file named
def test_a_full_disk_under_a_loggers_writer_names_what_it_wrote(tmp_path, logger, written):
    """TensorBoard writes its events in a thread; a write there that finds no room is raised
    again at the next scalar with no file named: the run stopped with ``[Errno 27] File too
    large`` alone (the CSV log's too: a hunt). Measured with a real file-size limit in a
    subprocess."""
    script = """
import resource, signal, sys
from lightning.pytorch import loggers
from maxent_grpo.cli import errors
logger = getattr(loggers, sys.argv[2])(sys.argv[1], name="", version="version_0")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
try:
    for step in range(100_000):  # as Lightning's logger connector writes them
        logger.log_metrics({f"train/m{i}": 1.0 for i in range(60)}, step)
        logger.save()
except Exception as err:  # Lightning wraps it: "you tried to log 1.0 which is ..."
    print(errors.find_user_error(err)[1])
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path), logger], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    said = written.format(folder=tmp_path / "version_0")
    assert run.stdout.startswith(f"[Errno 27] File too large (writing {said}: free space "
                                 "there"), run.stdout
    assert errors.message_of(OSError(27, "File too large")) == "[Errno 27] File too large"


def test_messages():
    assert errors.message_of(FileNotFoundError(2, "No such file or directory", "a.txt")) == (
        "[Errno 2] No such file or directory: 'a.txt'")
    assert errors.message_of(ValueError()) == "ValueError"


def test_explicit_wrapping_is_unwrapped_but_not_an_error_while_handling():
    class LibraryError(Exception):
        pass

    cause = ValueError("data.data_files 'x' is not valid JSON")
    wrapped = LibraryError("could not generate the dataset")
    wrapped.__cause__ = cause
    assert errors.find_user_error(wrapped) == (cause, str(cause))

    during = RuntimeError("teardown failed")
    during.__context__ = cause  # a bug while handling a user error is still a bug
    assert errors.find_user_error(during) is None


def test_errors_re_raised_from_a_worker_show_the_original_message():
    from torch._utils import ExceptionWrapper

    def worker():
        raise ValueError("data.data_files file 'a.jsonl' line 3 has no 'prompt'")

    try:
        worker()
    except ValueError:
        wrapper = ExceptionWrapper(sys.exc_info(), where="in DataLoader worker process 0")
    re_raised = raised_by(wrapper.reraise)
    assert "Traceback" in str(re_raised)
    found = errors.find_user_error(re_raised)
    assert found is not None
    assert found[1] == "data.data_files file 'a.jsonl' line 3 has no 'prompt'"

    try:
        {}["x"]
    except KeyError:
        bug = raised_by(ExceptionWrapper(sys.exc_info(), where="in worker").reraise)
    assert errors.find_user_error(bug) is None


def raised_by(fn) -> BaseException:
    try:
        fn()
    except BaseException as caught:  # noqa: BLE001
        return caught
    raise AssertionError("did not raise")


def test_the_flag_works_before_export_too(monkeypatch, capsys, tmp_path):
    """``--traceback export ...`` was refused as an invalid command (exit 2)."""
    from maxent_grpo.__main__ import console
    from maxent_grpo.cli import help as cli_help

    monkeypatch.setattr(cli_help, "PROG", cli_help.PROG)  # console() sets it: put back after
    monkeypatch.setattr(sys, "argv", ["maxent-grpo", "--traceback", "export",
                                      str(tmp_path / "none.ckpt")])
    with pytest.raises(SystemExit) as stop:
        console()
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "Traceback (most recent call last)" in err, err


@pytest.mark.parametrize("first", ["--help", "-h"])
def test_help_before_a_command_is_that_commands_help(monkeypatch, capsys, first):
    """``--help fit`` took 6 s to print Lightning's generic page, without ``export`` (a hunt)."""
    from maxent_grpo.__main__ import console
    from maxent_grpo.cli import help as cli_help

    monkeypatch.setattr(cli_help, "PROG", cli_help.PROG)
    monkeypatch.setattr(sys, "argv", ["maxent-grpo", first, "export"])
    with pytest.raises(SystemExit) as stop:
        console()
    out = capsys.readouterr().out
    assert stop.value.code == 0 and "usage: maxent-grpo export" in out and "--merged" in out
    import maxent_grpo.cli as cli_package

    seen = []
    monkeypatch.setattr(cli_package, "main", lambda **kw: seen.append(sys.argv[1:]))
    monkeypatch.setattr(sys, "argv", ["maxent-grpo", first, "fit"])
    console()  # the parser is handed `fit --help`
    assert seen == [["fit", first]]


@pytest.mark.parametrize("command", [["fit", "--config", "tiny"], ["export", "x.ckpt"]])
def test_ctrl_c_while_the_libraries_load_is_the_short_message(monkeypatch, capsys, command):
    """A Ctrl-C in the first seconds (torch, Lightning, transformers importing) printed a
    70-line trace through their import code (a hunt); ``--traceback`` still shows it."""
    import types

    from maxent_grpo.__main__ import console
    from maxent_grpo.cli import help as cli_help

    class Loading(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt

    name = "maxent_grpo.cli.export" if command[0] == "export" else "maxent_grpo.cli"
    monkeypatch.setitem(sys.modules, name, Loading(name))
    monkeypatch.setattr(cli_help, "PROG", cli_help.PROG)
    monkeypatch.setattr(sys, "argv", ["maxent-grpo", *command])
    with pytest.raises(SystemExit) as stop:
        console()
    assert stop.value.code == 130
    assert capsys.readouterr().err == "error: interrupted (Ctrl-C)\n"
    monkeypatch.setattr(sys, "argv", ["maxent-grpo", *command, "--traceback"])
    with pytest.raises(KeyboardInterrupt):
        console()


def test_the_flag_is_removed_anywhere():
    assert errors.pop_traceback_flag(["--traceback", "fit", "--a", "1", "--traceback"]) == (
        ["fit", "--a", "1"], True)
    assert errors.pop_traceback_flag(["fit"]) == (["fit"], False)


def test_the_docs_document_the_flag_and_the_messages():
    page = (ROOT / "docs" / "TROUBLESHOOTING.md").read_text()
    assert "--traceback" in page
    assert page.count("error: ") >= 10


def test_import_class_gives_none_for_what_names_no_class():
    """``export --config``'s peft class check: a relative or unknown path is no class (its
    error names the option), not an ``Empty module name`` raised from importlib."""
    import torch

    assert errors.import_class("torch.nn.Linear") is torch.nn.Linear
    for path in (".LoraConfig", "..peft.LoraConfig", "no_such_module.X", "torch.nn.NoSuch",
                 "LoraConfig", None, 3):
        assert errors.import_class(path) is None, path


class StoreRefused(Exception):
    """Another library's own exception type (MLflow's ``MlflowException``)."""


class RefusingLogger(CSVLogger):
    """A logger whose library refuses its setting, as MLflow 3 refuses a ``file:`` store."""

    def __init__(self, save_dir: str = "logs") -> None:
        raise StoreRefused("the file store is in maintenance mode: set MLFLOW_ALLOW_FILE_STORE")


@pytest.mark.parametrize("form", ["replaced", "added"])
def test_a_librarys_refusal_when_its_class_is_built_is_its_message_alone(
        bad_inputs, models, capsys, monkeypatch, form):
    """jsonargparse wraps the error of a class it builds for an option of several types
    (``trainer.logger``) in "Does not validate against any of the Union subtypes" and a line
    per type; a cause of ours or a ValueError was said alone, another library's (MLflow
    refusing its file store) came inside that list, and for a logger added to the list
    (``--trainer.logger+=``) only the mismatch of the list with a single Logger was said."""
    args = case_args([], bad_inputs, models)
    at = args.index("--trainer.logger")
    if form == "replaced":
        args[at + 1] = f"{__name__}.RefusingLogger"
    else:
        del args[at:at + 2]
        args.append(f"--trainer.logger+={__name__}.RefusingLogger")
    monkeypatch.setattr(errors, "_outside_frame", lambda error: None)  # a library's, here
    exit_code, err = run_cli(capsys, args)
    assert exit_code == 1 and "Union subtypes" not in err and "Traceback" not in err, err
    assert "the file store is in maintenance mode: set MLFLOW_ALLOW_FILE_STORE\n" in err, err
    assert err.startswith("error: "), err


class ManyLinesLogger(CSVLogger):
    def __init__(self, save_dir: str = "logs") -> None:
        raise RuntimeError("shape mismatch\n  expected (2, 3), got (3, 2)")


def test_a_librarys_error_of_several_lines_keeps_its_type(bad_inputs, models, capsys,
                                                          monkeypatch):
    """The entry of jsonargparse's list is taken only where the cause is a mismatch of the
    value with another type: a RuntimeError of two lines was said as its lines joined, with
    no type, as if a user's mistake (a second reader)."""
    args = case_args([], bad_inputs, models)
    args[args.index("--trainer.logger") + 1] = f"{__name__}.ManyLinesLogger"
    monkeypatch.setattr(errors, "_outside_frame", lambda error: None)  # a library's, here
    exit_code, err = run_cli(capsys, args)
    assert exit_code == 1 and err.startswith("error: RuntimeError: shape mismatch"), err


def test_a_bug_in_a_users_own_class_built_for_an_option_shows_its_trace(bad_inputs, models,
                                                                        capsys):
    """Not one line without a location: the trace, and the user's file named."""
    args = case_args([], bad_inputs, models)
    args[args.index("--trainer.logger") + 1] = f"{__name__}.RefusingLogger"
    exit_code, err = run_cli(capsys, args)
    assert exit_code == 1 and "Traceback" in err and "StoreRefused" in err, err
    assert f"error: StoreRefused raised outside maxent_grpo and its libraries, at {__file__}:" \
        in err, err


def test_an_asynchronous_fit_with_an_engine_that_samples_here_leaves_no_log_folder(
        bad_inputs, models, capsys):
    """``model.max_staleness 1`` with the ``generate`` engine was refused once the
    TensorBoard logger had made its version folder (its config.yaml and an empty event
    file): a run's folder for a run that never trained."""
    args = ["fit", "--config", TINY, "--trainer.max_steps", "1", "--model.model_cache_dir",
            models, "--model.max_staleness", "1", "--model.sampler_correction", "token_tis"]
    for given in (args, args[:-2]):  # without a correction: it asked for one first (a hunt)
        exit_code, err = run_cli(capsys, given)
        assert exit_code == 1 and "model.max_staleness >= 1 needs an engine that generates " \
            "outside the trainer's process" in err, err
        assert not (bad_inputs / "work" / "lightning_logs").exists()
