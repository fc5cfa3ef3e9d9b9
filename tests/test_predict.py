"""``predict``: graded completions of a checkpoint in a JSONL file; config names; errors.

One in-process fit of the demo config (2 small steps) writes a checkpoint; ``predict`` on it
must write ``val_size x eval_num_generations`` rows whose reward values are what the reward
functions give for those completions, in prompt order, and print the @k summary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import maxent_grpo.cli.parser as cli_module
from maxent_grpo.cli import help as cli_help
from maxent_grpo.rewards.answers import compared_answer
from maxent_grpo.rewards.registry import get_reward

SMALL = ["--config", "tiny", "--data.train_size", "64", "--data.val_size", "4",
         "--data.batch_size", "4", "--model.num_generations", "4",
         "--trainer.enable_progress_bar=false"]


@pytest.fixture
def demo_checkpoint(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cli_module.main(["fit", *SMALL, "--trainer.max_steps", "2",
                     f"--model.model_cache_dir={tmp_path / 'models'}"])
    path = tmp_path / "lightning_logs/tiny/checkpoints/last.ckpt"
    assert path.is_file()
    return path


def test_predict_writes_the_checkpoints_completions_graded_as_the_rewards_grade(
        demo_checkpoint, tmp_path, caplog, capsys):
    caplog.clear()
    caplog.set_level("INFO")
    cli_module.main(["predict", *SMALL, "--ckpt_path", str(demo_checkpoint),
                     f"--model.model_cache_dir={tmp_path / 'models'}",
                     "--model.rewards", "{first_number: 0.5}", "--model.eval_num_generations", "3",
                     "--model.eval_k", "[1, 3]"])
    assert "Loaded model weights from the checkpoint" in caplog.text
    # the run's folder: fit wrote version_0, predict is version_1
    path = tmp_path / "lightning_logs/tiny/version_1/predictions.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 4 * 3  # val_size prompts x eval_num_generations
    assert [(r["row"], r["sample"]) for r in rows] == sorted((r["row"], r["sample"]) for r in rows)
    assert len({r["row"] for r in rows}) == 4
    reward = get_reward("first_number")
    for row in rows:
        expected = reward([row["prompt"]], [row["completion"]], answer=[row["answer"]])[0]
        assert row["rewards"] == {"first_number": expected}
        assert row["reward"] == pytest.approx(0.5 * expected)
        assert row["correct"] == (expected >= 1.0)
        assert row["parsed_answer"] == row["completion"].strip()
        assert row["compared_answer"] == compared_answer(row["parsed_answer"])
    passed = [any(r["correct"] for r in rows if r["row"] == i) for i in {r["row"] for r in rows}]
    summary = caplog.text
    assert f"predict: 12 completions of 4 prompts written to {path}" in summary
    assert f"pass@3 {sum(passed) / 4:.3g}" in summary
    assert sorted(p.name for p in path.parent.glob(".predictions*")) == []  # no leftovers

    # --output: a named file, or a folder to write predictions.jsonl into
    out_dir = tmp_path / "out"  # a path ending in / is a folder, made when missing
    capsys.readouterr()
    shown = [a for a in SMALL if a != "--trainer.enable_progress_bar=false"]  # plain lines
    cli_module.main(["predict", *shown, "--ckpt_path", str(demo_checkpoint),
                     f"--model.model_cache_dir={tmp_path / 'models'}", "--output", f"{out_dir}/",
                     "--trainer.logger=false", "--data.val_batch_size", "2"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("predict:")]
    assert lines == ["predict: batch 1/2", "predict: batch 2/2"]
    again = [json.loads(line) for line in (out_dir / "predictions.jsonl").read_text().splitlines()]
    assert len(again) == 4 * 4  # the default eval_num_generations


def test_predict_replaces_only_what_it_was_asked_to(demo_checkpoint, tmp_path):
    """``--output`` naming the checkpoint it reads replaced the checkpoint with JSON lines;
    without ``--output`` and a logger, a second predict replaced the first one's file (now
    it writes predictions-1.jsonl beside it)."""
    import shutil

    models = f"--model.model_cache_dir={tmp_path / 'models'}"
    copy, other = tmp_path / "copy.ckpt", tmp_path / "other.ckpt"
    shutil.copy(demo_checkpoint, copy)
    shutil.copy(demo_checkpoint, other)
    for output in (copy, other):  # the checkpoint it reads, another one
        with pytest.raises(ValueError, match=r"is a zip archive \(a checkpoint\?\)"):
            cli_module.main(["predict", *SMALL, models, "--ckpt_path", str(copy), "--output",
                             str(output), "--trainer.logger=false"])
        assert output.read_bytes() == demo_checkpoint.read_bytes()
    # a data file it reads (a hunt of the evaluation commands: replaced, without a word)
    rows = tmp_path / "val.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n"
                            for i in range(4)))
    before = rows.read_text()
    with pytest.raises(ValueError, match="is one of the run's data files"):
        cli_module.main(["predict", *SMALL, models, "--ckpt_path", str(copy), "--output",
                         str(rows), "--data.val_files", str(rows), "--trainer.logger=false"])
    assert rows.read_text() == before
    # a CompletionWriter in the config: --output decides its file (it was left unused)
    writer = ["--trainer.callbacks+=maxent_grpo.training.callbacks.CompletionWriter",
              f"--trainer.callbacks.output={tmp_path / 'configured.jsonl'}"]
    cli_module.main(["predict", *SMALL, models, "--ckpt_path", str(copy), *writer,
                     "--output", str(tmp_path / "asked.jsonl"), "--trainer.logger=false"])
    assert (tmp_path / "asked.jsonl").is_file() and not (tmp_path / "configured.jsonl").exists()
    runs = tmp_path / "runs"
    plain = ["predict", *SMALL, models, "--ckpt_path", str(copy), "--trainer.logger=false",
             f"--trainer.default_root_dir={runs}"]
    cli_module.main(plain)
    first = (runs / "predictions.jsonl").read_text()
    cli_module.main(plain)  # the second writes beside the first
    assert (runs / "predictions.jsonl").read_text() == first
    assert len((runs / "predictions-1.jsonl").read_text().splitlines()) == 4 * 4
    # so does --output naming a folder (the second predict replaced the first's file: a hunt)
    cli_module.main([*plain, "--output", f"{runs}/"])
    assert (runs / "predictions.jsonl").read_text() == first
    assert len((runs / "predictions-2.jsonl").read_text().splitlines()) == 4 * 4


@pytest.mark.parametrize(("args", "message"), [
    (["--ckpt_path", "nosuch.ckpt"], r"--ckpt_path nosuch\.ckpt: no such file, from the folder"),
    (["--output", "/proc/no/such/predictions.jsonl"],
     r"predict cannot write /proc/no/such/predictions\.jsonl .*pass --output"),
    (["--output", "{tmp}/a_file/predictions.jsonl"],
     r"predict cannot write .*/a_file/predictions\.jsonl \(a folder on its path is a file\)"),
    # found at the end, after every prompt was sampled (the probe's name was shorter)
    (["--output", "{tmp}/" + "p" * 250 + ".jsonl"],
     r"predict cannot write .*/p+\.jsonl \(a file name of over 255 bytes\)"),
])
def test_predict_errors_name_what_to_fix(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    with pytest.raises(SystemExit) as stop:
        cli_module.main(["predict", *SMALL, f"--model.model_cache_dir={tmp_path / 'models'}",
                         "--trainer.logger=false", *args], exit_on_error=True)
    assert stop.value.code == 1
    import re

    assert re.search("error: " + message, capsys.readouterr().err)


def test_a_config_is_found_by_name_and_an_unknown_name_lists_the_shipped_ones(tmp_path,
                                                                              monkeypatch,
                                                                              capsys):
    monkeypatch.chdir(tmp_path)
    names = cli_help.shipped_configs()
    assert {"tiny", "tiny_vllm", "scaling/ddp_cpu_tiny"} <= set(names)
    packaged = str(cli_help.configs_folder() / "tiny.yaml")
    assert cli_help.resolve_config_names(["fit", "--config", "tiny"])[2] == packaged
    assert capsys.readouterr().err == ""  # a name: read as documented, without a word
    assert cli_help.resolve_config_names(["fit", "--config=tiny.yaml"])[1] == f"--config={packaged}"
    assert cli_help.resolve_config_names(["fit", "-c=tiny"])[1] == f"-c={packaged}"  # was not
    # a file name that is not here (perhaps a typo of the user's file): says what it reads
    assert cli_help.resolve_config_names(["fit", "--config", "tiny.yml"])[2] == packaged
    err = capsys.readouterr().err
    assert "--config tiny.yaml: no such file" in err and f"shipped config tiny ({packaged})" in err
    assert "--config tiny.yml: no such file" in err
    inline = ["--config", "trainer: {max_steps: 2}"]  # inline YAML, as jsonargparse reads it
    assert cli_help.resolve_config_names(inline) == inline
    (tmp_path / "tiny").write_text("trainer: {}\n")  # an existing file wins over a name
    assert cli_help.resolve_config_names(["--config", "tiny"]) == ["--config", "tiny"]
    with pytest.raises(ValueError, match=r"--config tinyy: there is no such file .* the shipped "
                                         r"configs are: .*tiny, tiny_controllers"):
        cli_help.resolve_config_names(["fit", "--config", "tinyy"])
    (tmp_path / "tiny").unlink()
    (tmp_path / "tiny").mkdir()  # a folder is no config file: the name is read
    assert cli_help.resolve_config_names(["-c", "tiny"]) == ["-c", packaged]  # -c: --config
    scaling = str(cli_help.configs_folder() / "scaling" / "ddp_cpu_tiny.yaml")  # a name in a
    assert cli_help.resolve_config_names(["--config", "scaling/ddp_cpu_tiny"])[1] == scaling
    # the docs' paths, away from a clone (a wheel's user): the shipped file, said (a hunt)
    assert cli_help.resolve_config_names(["--config", "configs/tiny.yaml"])[1] == packaged
    assert cli_help.resolve_config_names(
        ["--config", "configs/scaling/ddp_cpu_tiny.yaml"])[1] == scaling
    assert "--config configs/tiny.yaml: no such file" in capsys.readouterr().err
    missing = ["--config", "elsewhere/my.yaml"]  # a path that is not there: the parser says so
    assert cli_help.resolve_config_names(missing) == missing
    # a path with another extension than the shipped file's is a typo of one's own file: it
    # ran the shipped demo's 800 steps (TROUBLESHOOTING's own example; a docs hunt)
    typo = ["--config", "configs/tiny.yml"]
    assert cli_help.resolve_config_names(typo) == typo
    cli = cli_module.main(["--config", "tiny", "--trainer.logger=false",
                           f"--model.model_cache_dir={tmp_path / 'models'}"], run=False)
    assert cli.config["model"]["model_name_or_path"] == "builtin:tiny-warm"


def test_version_and_the_top_level_page_are_answered_without_lightning():
    from maxent_grpo import __version__

    assert cli_help.quick_help(["--version"]) == (f"maxent-grpo {__version__}\n", 0)
    page, code = cli_help.quick_help(["--help"])
    assert code == 0 and "predict" in page and "export" in page and "tiny_vllm" in page


def test_predict_that_runs_no_batch_says_nothing_was_written(tmp_path, monkeypatch, recwarn):
    monkeypatch.chdir(tmp_path)
    cli_module.main(["predict", *SMALL, f"--model.model_cache_dir={tmp_path / 'models'}",
                     "--trainer.logger=false", "--trainer.limit_predict_batches=0",
                     "--output", "p.jsonl"])
    assert not (tmp_path / "p.jsonl").exists()
    assert any("predict ran no batch" in str(w.message) for w in recwarn)


@pytest.mark.parametrize("stage, limit", [("validate", "val"), ("test", "test")])
def test_validate_or_test_that_runs_no_batch_says_nothing_was_evaluated(
        stage, limit, tmp_path, monkeypatch, recwarn):
    """Before, it printed no metric and no word, and exited 0 (a fit config that turns its
    validation off, given to validate)."""
    monkeypatch.chdir(tmp_path)
    cli_module.main([stage, *SMALL, f"--model.model_cache_dir={tmp_path / 'models'}",
                     "--trainer.logger=false", f"--trainer.limit_{limit}_batches=0"])
    assert [str(w.message) for w in recwarn if "ran no batch" in str(w.message)] == [
        f"{stage} ran no batch (trainer.limit_{limit}_batches, or no validation rows): nothing "
        "was evaluated"]


class SigtermAtFirstBatch(__import__("lightning").pytorch.Callback):
    """SIGTERM this process at the start of the first predict batch."""

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        import os
        import signal

        if batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_sigterm_stops_predict_after_the_batch(demo_checkpoint, tmp_path, capsys):
    """Lightning's predict loop never looks at the SIGTERM its handler keeps from ending
    the process: ``kill`` did not stop a predict. It stops after the batch, exit 143."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    with pytest.raises(SIGTERMException):
        cli_module.main(["predict", *SMALL, "--ckpt_path", str(demo_checkpoint),
                         f"--model.model_cache_dir={tmp_path / 'models'}",
                         "--trainer.logger=false", "--data.val_batch_size", "1",
                         "--output", str(tmp_path / "p.jsonl"),
                         "--trainer.callbacks+=test_predict.SigtermAtFirstBatch"])
    assert not (tmp_path / "p.jsonl").exists()
    with pytest.raises(SystemExit) as stop:
        cli_module.main(["predict", *SMALL, "--ckpt_path", str(demo_checkpoint),
                         f"--model.model_cache_dir={tmp_path / 'models'}",
                         "--trainer.logger=false", "--data.val_batch_size", "1",
                         "--trainer.callbacks+=test_predict.SigtermAtFirstBatch"],
                        exit_on_error=True)
    assert stop.value.code == 143
    assert "error: stopped by SIGTERM" in capsys.readouterr().err


class InterruptAtSecondBatch(__import__("lightning").pytorch.Callback):
    """Ctrl-C (a KeyboardInterrupt) at the start of the second training batch."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            raise KeyboardInterrupt


def test_ctrl_c_of_a_fit_exits_130(tmp_path, monkeypatch, capsys):
    """Lightning catches the KeyboardInterrupt and exits 1, the exit code of a mistake or a
    bug: a script could not tell a stop from a failure (the documented code is 130)."""
    import signal

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    handler = signal.getsignal(signal.SIGINT)  # Lightning ignores SIGINT after a Ctrl-C
    try:
        with pytest.raises(SystemExit) as stop:
            cli_module.main(["fit", *SMALL, "--trainer.max_steps", "3",
                             f"--model.model_cache_dir={tmp_path / 'models'}",
                             "--trainer.callbacks+=test_predict.InterruptAtSecondBatch"],
                            exit_on_error=True)
    finally:
        signal.signal(signal.SIGINT, handler)
    assert stop.value.code == 130
    assert "error: interrupted (Ctrl-C)" in capsys.readouterr().err
    # in Python: the KeyboardInterrupt (it was SystemExit(1), a mistake's), and Ctrl-C works
    # again afterwards (Lightning left it ignored: a notebook's next run could not be stopped)
    assert signal.getsignal(signal.SIGINT) is handler
    with pytest.raises(KeyboardInterrupt):
        cli_module.main(["fit", *SMALL, "--trainer.max_steps", "3",
                         f"--model.model_cache_dir={tmp_path / 'models'}",
                         "--trainer.callbacks+=test_predict.InterruptAtSecondBatch"])
    assert signal.getsignal(signal.SIGINT) is handler


def test_predict_keeps_one_writer_per_file(tmp_path):
    """Two ``CompletionWriter``s configured for one file each wrote it whole (the summary
    printed twice); ``--output`` is every writer's file, so with it one writer is left."""
    from maxent_grpo.training.callbacks import CompletionWriter

    bar = object()
    a, b, c = (CompletionWriter(tmp_path / n) for n in ("a.jsonl", "a.jsonl", "c.jsonl"))
    assert CompletionWriter.configured([a, bar, b, c], None) == [a, bar, c]
    kept = CompletionWriter.configured([a, b, c], str(tmp_path / "asked.jsonl"))
    assert kept == [a] and a.output == str(tmp_path / "asked.jsonl")
    added = CompletionWriter.configured([bar], None)
    assert added[0] is bar and isinstance(added[1], CompletionWriter) and len(added) == 2
    with pytest.raises(ValueError, match="predict output must be a file path"):
        CompletionWriter.configured([a], " ")
