"""Each run's own folder with W&B and MLflow: ``config.yaml`` and ``{log_dir}`` files are
not shared by the runs of one ``save_dir``, and the loggers get the whole config."""

from __future__ import annotations

import json
import logging
import socket
import sys
from pathlib import Path

import pytest
import torch
import yaml

from maxent_grpo.cli import main

ROOT = Path(__file__).resolve().parents[3]


def fit(tmp_path: Path, logger: list[str], command: str = "fit"):
    """Two steps of the tiny config with ``logger`` and every completion in ``{log_dir}``
    (``command`` validate: one validation batch)."""
    args = [command, "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_steps=2",
            f"--trainer.limit_val_batches={0 if command == 'fit' else 1}",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--trainer.callbacks=[]",
            f"--model.model_cache_dir={tmp_path / 'models'}", *logger]
    if command == "fit":
        args += ["--trainer.callbacks+=maxent_grpo.training.callbacks.CompletionSamples",
                 "--trainer.callbacks.jsonl_path={log_dir}/r.jsonl"]
    return main(args, run=True)


def check_own_folder(cli, save_dir: Path, seen: list[Path]) -> Path:
    """The run's ``config.yaml`` and JSONL are in a folder of its own under ``save_dir``."""
    logger = cli.trainer.logger
    folder = save_dir / str(logger.name) / str(logger.version)
    assert folder not in seen
    config = yaml.safe_load((folder / "config.yaml").read_text())
    assert config["model"]["objective"]["class_path"] == "maxent_grpo.objectives.GRPO"
    rows = [json.loads(line) for line in (folder / "r.jsonl").read_text().splitlines()]
    batch = config["data"]["batch_size"]
    assert [r["step"] for r in rows] == [0] * batch * 8 + [1] * batch * 8  # this run's only
    assert not (save_dir / "config.yaml").exists() and not (save_dir / "r.jsonl").exists()
    seen.append(folder)
    return folder


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["maxent_grpo"])
    return tmp_path


def test_wandb_runs_of_one_save_dir_have_their_own_folder_and_the_whole_config(
        cwd, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(cwd / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    save_dir = cwd / "wb"
    logger = ["--trainer.logger=lightning.pytorch.loggers.WandbLogger",
              "--trainer.logger.init_args.offline=true",
              f"--trainer.logger.init_args.save_dir={save_dir}"]
    seen: list[Path] = []
    try:
        for _ in range(2):
            cli = fit(cwd, logger)
            check_own_folder(cli, save_dir, seen)
            config = dict(cli.trainer.logger.experiment.config)["config"]
            assert config["model"]["objective"]["init_args"]["beta"] == 0.04
            assert config["model"]["optimizer"]["class_path"] == "torch.optim.AdamW"
            assert config["trainer"]["max_steps"] == 2
            wandb.finish()
    finally:
        wandb.finish()


def test_mlflow_runs_have_their_own_folder_and_the_whole_config(cwd, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = cwd / "mlruns"
    logger = ["--trainer.logger=lightning.pytorch.loggers.MLFlowLogger",
              f"--trainer.logger.init_args.tracking_uri=file:{store}"]
    seen: list[Path] = []
    for _ in range(2):
        cli = fit(cwd, logger)
        folder = check_own_folder(cli, store, seen)
        params = cli.trainer.logger.experiment.get_run(cli.trainer.logger.run_id).data.params
        assert params["config/model/objective/class_path"] == "maxent_grpo.objectives.GRPO"
        assert json.loads(params["config/model/optimizer/init_args/lr"]) == 0.001
        assert params["max_completion_length"] == "4"  # the module's own, as before
        assert (folder / "meta.yaml").is_file()  # MLflow's own run folder
    # the same run continued with another module option: MLflow keeps the first value
    # (it refuses to change one, which stopped the run as "a bug in maxent_grpo")
    run_id = cli.trainer.logger.run_id
    again = [*logger, f"--trainer.logger.init_args.run_id={run_id}"]
    with pytest.warns(UserWarning, match=f"run {run_id} keeps the values .*: temperature"):
        cli = fit(cwd, [*again, "--model.temperature=0.9"])
    params = cli.trainer.logger.experiment.get_run(run_id).data.params
    assert params["temperature"] == "1.0" and params["config/model/temperature"] == "1.0"
    written = (folder / "config.yaml").read_text()
    assert "temperature: 0.9" in written  # this run's own values
    # the earlier fit's, which it replaced, kept beside it
    assert yaml.safe_load((folder / "config-1.yaml").read_text())["model"]["temperature"] == 1.0
    # validating in the fit's run leaves its config.yaml and logs beside it
    cli = fit(cwd, again, "validate")
    assert (folder / "config.yaml").read_text() == written
    assert not (folder / "config-2.yaml").exists()
    assert "ckpt_path" in yaml.safe_load((folder / "validate_config.yaml").read_text())
    assert cli.trainer.logger.run_id == run_id


def test_every_logger_of_a_run_has_its_config_yaml(cwd, monkeypatch):
    """MLflow first, then a CSVLogger: the CSV version folder has the file too."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = cwd / "mlruns"
    loggers = (f"--trainer.logger=[{{class_path: lightning.pytorch.loggers.MLFlowLogger, "
               f"init_args: {{tracking_uri: 'file:{store}'}}}}, {{class_path: "
               f"lightning.pytorch.loggers.CSVLogger, init_args: {{save_dir: {cwd / 'csv'}}}}}]")
    cli = fit(cwd, [loggers])
    mlflow, csv = cli.trainer.loggers
    check_own_folder(cli, store, [])
    assert yaml.safe_load((Path(csv.log_dir) / "config.yaml").read_text())["model"][
        "objective"]["class_path"] == "maxent_grpo.objectives.GRPO"


def test_a_fresh_fit_into_an_earlier_runs_version_keeps_its_config_and_says_so(cwd, caplog):
    """Two fits that resume nothing with one explicit logger ``version``: the second
    replaced the first's config.yaml (its seed lost) and mixed its curves into the folder
    without a word (a hunt); vanilla LightningCLI refuses an existing config.yaml."""
    logger = ["--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger",
              f"--trainer.logger.save_dir={cwd / 'logs'}", "--trainer.logger.version=fixed",
              "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
              f"--trainer.callbacks.dirpath={cwd / 'ck'}", "--trainer.callbacks.save_last=true"]
    (cwd / "ck").mkdir()
    from maxent_grpo.training.run.checkpoint_io import _HOST

    killed = cwd / "ck" / f".last.ckpt.{_HOST}-{2**22 + 1}.tmp"  # a write a kill cut short (no
    killed.write_bytes(b"half")  # such process): a fit that resumes nothing removes it (a hunt)
    fit(cwd, [*logger, "--seed_everything=1"])
    assert not killed.exists()
    with caplog.at_level(logging.WARNING):
        cli = fit(cwd, [*logger, "--seed_everything=2"])
    folder = Path(cli.trainer.logger.log_dir)
    assert yaml.safe_load((folder / "config-1.yaml").read_text())["seed_everything"] == 1
    assert yaml.safe_load((folder / "config.yaml").read_text())["seed_everything"] == 2
    assert "holds an earlier run's config.yaml (a logger version given" in caplog.text
    caplog.clear()  # a resume of it (--ckpt_path) keeps none and says nothing
    with caplog.at_level(logging.WARNING):
        fit(cwd, [*logger, "--seed_everything=2",
                  f"--ckpt_path={cwd / 'ck' / 'last.ckpt'}"])
    assert "holds an earlier run's" not in caplog.text
    assert sorted(p.name for p in folder.glob("config*.yaml")) == ["config-1.yaml",
                                                                   "config.yaml"]
    import fsspec  # a remote checkpoint's resume is no fresh fit either (readers)

    fsspec.filesystem("memory").pipe("/bucket/last.ckpt", (cwd / "ck" / "last.ckpt").read_bytes())
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        fit(cwd, [*logger, "--seed_everything=2", "--ckpt_path=memory://bucket/last.ckpt"])
    assert "holds an earlier run's" not in caplog.text
    assert sorted(p.name for p in folder.glob("config*.yaml")) == ["config-1.yaml",
                                                                   "config.yaml"]


def test_an_mlflow_server_that_refuses_connections_is_named_at_once(caplog, monkeypatch,
                                                                   tmp_path):
    """mlflow retried for minutes before saying anything (4 min 17 s measured)."""
    pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import MLFlowLogger

    from maxent_grpo.training.run.folders import warn_unreachable_trackers

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        answering = MLFlowLogger(tracking_uri=f"http://127.0.0.1:{port}")
        with caplog.at_level(logging.WARNING):
            warn_unreachable_trackers([answering])
        assert "does not answer" not in caplog.text
    closed = MLFlowLogger(tracking_uri=f"http://127.0.0.1:{port}")  # no one listens now
    with caplog.at_level(logging.WARNING):
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        warn_unreachable_trackers([closed, MLFlowLogger(tracking_uri=f"file:{tmp_path}")])
    assert caplog.text.count("does not answer") == 1 and f"127.0.0.1:{port}" in caplog.text


def test_mlflow_parameter_names_and_a_tracking_servers_refusal(tmp_path, monkeypatch):
    """A reward key such as ``model:/models/rm/`` is no MLflow parameter name (it stopped
    the run); a tracking server refuses a changed value with ``RestException``, a subclass
    the file store's check missed (a continued run stopped as "a bug")."""
    pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.exceptions import RestException

    from maxent_grpo.training.run.folders import keep_first_values

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    logger = MLFlowLogger(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    keep_first_values(logger)
    logger.log_hyperparams({"rewards": {"model:/models/rm/": 1.0, "a b": 2}})
    params = logger.experiment.get_run(logger.run_id).data.params
    assert params == {"rewards/model:/models/rm": "1.0", "rewards/a b": "2"}
    file_store = MLFlowLogger.log_hyperparams.__get__(logger)
    calls = []

    def server(params):  # refuses the batch as a tracking server does, then logs
        calls.append(params)
        if len(calls) == 1:
            raise RestException({"error_code": "INVALID_PARAMETER_VALUE", "message":
                                 "Changing param values is not allowed. Param with key="
                                 "'rewards/model:/models/rm' was already logged"})
        file_store(params)

    logger.log_hyperparams = server
    keep_first_values(logger)
    with pytest.warns(UserWarning, match=r"keeps the values .* 1 parameter\(s\).*: "
                                         r"rewards/model:/models/rm$"):
        logger.log_hyperparams({"rewards": {"model:/models/rm/": 5.0, "new": 1}})
    params = logger.experiment.get_run(logger.run_id).data.params
    assert params["rewards/model:/models/rm"] == "1.0" and params["rewards/new"] == "1"


@pytest.mark.parametrize("fsdp2", [False, True])
def test_a_refused_resume_leaves_the_runs_config(cwd, fsdp2, request):
    """A resume that the checkpoint's checks refuse (another data.seed) had already replaced
    the version's config.yaml with its own options and moved hparams.yaml aside (a DDP
    hunt): the export's ``--config <version folder>/config.yaml`` then read them. FSDP2
    restores the checkpoint after the fit's start, where the logger writes hparams.yaml."""
    strategy = ["--trainer.strategy=lightning.pytorch.strategies.ModelParallelStrategy",
                "--trainer.strategy.data_parallel_size=1",
                "--trainer.strategy.tensor_parallel_size=1"] if fsdp2 else []
    dist = torch.distributed  # FSDP2's process group outlived the test (a later one's check)
    request.addfinalizer(lambda: dist.is_initialized() and dist.destroy_process_group())
    logger = [*strategy, "--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger",
              "--trainer.logger.init_args.save_dir=logs", "--trainer.logger.init_args.version=0",
              "--trainer.enable_checkpointing=true", "--trainer.callbacks+=ModelCheckpoint",
              f"--trainer.callbacks.dirpath={cwd / 'ckpt'}",
              "--trainer.callbacks.every_n_train_steps=1"]
    fit(cwd, logger)
    folder = cwd / "logs" / "tiny" / "version_0"  # the config names the logger tiny
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()  # CompletionSamples logs the config.yaml it finds at the fit's start
    assert "hparams/config/text_summary" in events.Tags()["tensors"]
    before = {p.name: p.read_bytes() for p in folder.glob("*.yaml")}
    assert set(before) == {"config.yaml", "hparams.yaml"}
    with pytest.raises(ValueError, match="the checkpoint was made with data.seed=0"):
        fit(cwd, [*logger, "--ckpt_path=last", "--data.seed=5"])
    assert {p.name: p.read_bytes() for p in folder.glob("*.yaml")} == before


def test_a_resume_with_other_objective_options_says_so(cwd):
    """``--model.objective.init_args.epsilon`` changed at a resume was used without a word,
    where every other changed option is named (the objective is not among the module's
    saved hyper-parameters); beta and tau have their own warning."""
    import warnings

    import torch

    args = ["--trainer.logger=false", "--trainer.enable_checkpointing=true",
            "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={cwd / 'ck'}",
            "--trainer.callbacks.every_n_train_steps=1", "--trainer.default_root_dir=."]
    fit(cwd, args)
    saved = torch.load(cwd / "ck" / "epoch=0-step=2.ckpt", weights_only=True)
    assert saved["maxent_grpo_objective"]["init_args"]["epsilon"] == 0.2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(cwd, [*args, f"--ckpt_path={cwd / 'ck' / 'epoch=0-step=2.ckpt'}",
                  "--trainer.max_steps=3", "--model.objective.init_args.epsilon=0.3"])
    messages = [str(w.message) for w in caught if "model.objective's options" in str(w.message)]
    assert messages == ["model.objective's options differ from the checkpoint's (epsilon 0.2 "
                        "-> 0.3): it goes on with this run's"]
    with warnings.catch_warnings(record=True) as caught:  # the class by its module's path
        warnings.simplefilter("always")
        fit(cwd, [*args, f"--ckpt_path={cwd / 'ck' / 'epoch=0-step=2.ckpt'}",
                  "--trainer.max_steps=3", "--model.objective=maxent_grpo.objectives.grpo.GRPO",
                  "--model.objective.init_args.epsilon=0.25"])
    assert any("(epsilon 0.2 -> 0.25)" in str(w.message) for w in caught)

def test_a_resume_keeps_the_earlier_config_only_when_it_trains_otherwise(tmp_path):
    """``seed_everything: true`` draws a new seed into every run's config, and a resume may
    name its logger's run or ``weights_only``: none of them is a changed option (the
    checkpoint restores the random state), so no ``config-1.yaml`` for them."""
    from maxent_grpo.training.run.folders import keep_earlier

    path = tmp_path / "config.yaml"

    def resume(before: dict, after: dict) -> list[str]:
        path.write_text(yaml.safe_dump(after))
        keep_earlier(str(path), yaml.safe_dump(before).encode())
        return sorted(p.name for p in tmp_path.glob("config-*.yaml"))

    first = {"seed_everything": 123, "ckpt_path": None, "model": {"temperature": 1.0},
             "trainer": {"max_steps": 10, "logger": {"class_path": "CSVLogger"}}}
    same = {**first, "seed_everything": 77, "ckpt_path": "last", "weights_only": False,
            "trainer": {"max_steps": 10, "logger": {"init_args": {"version": 0}}}}
    assert resume(first, same) == []
    assert resume(first, {**same, "trainer": {"max_steps": 20}}) == ["config-1.yaml"]
    assert yaml.safe_load((tmp_path / "config-1.yaml").read_text()) == first
    assert resume(first, {**same, "model": {"temperature": 0.9}}) == ["config-1.yaml",
                                                                         "config-2.yaml"]


def test_a_resume_under_changed_options_keeps_the_earlier_hparams_too(tmp_path):
    """TensorBoard writes ``hparams.yaml`` only where none is: a resume into the same
    version under another temperature kept the first fit's values there (config.yaml had
    the new ones). The earlier file is kept as ``hparams-1.yaml``, so the logger writes
    this fit's; an unchanged resume leaves it."""
    from maxent_grpo.training.run.folders import keep_earlier

    path, hparams = tmp_path / "config.yaml", tmp_path / "hparams.yaml"
    first = {"model": {"temperature": 1.0}}
    hparams.write_text("temperature: 1.0\n")
    path.write_text(yaml.safe_dump(first))
    keep_earlier(str(path), yaml.safe_dump(first).encode())
    assert hparams.read_text() == "temperature: 1.0\n"
    assert not (tmp_path / "hparams-1.yaml").exists()
    path.write_text(yaml.safe_dump({"model": {"temperature": 0.7}}))
    keep_earlier(str(path), yaml.safe_dump(first).encode())
    assert not hparams.exists() and (tmp_path / "hparams-1.yaml").read_text() == (
        "temperature: 1.0\n")
