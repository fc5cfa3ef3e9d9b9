"""Runs that stay whole: atomic checkpoint writes, a broken last.ckpt skipped on resume, the
resumed run logging into the same TensorBoard/CSV version folders, and no config.yaml in
the current directory without a log folder.

The unit tests build small checkpoints by hand; one test runs the CLI twice in subprocesses:
a run SIGKILLed while writing last.ckpt (half of the temporary file on disk) and its resume.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

import pytest
import torch
import yaml

from maxent_grpo.training.run import checkpoint_io as ckpt_io

ROOT = Path(__file__).resolve().parents[3]


def save(path: Path, step: int, mtime: float | None = None) -> Path:
    torch.save({"global_step": step, "state_dict": {"w": torch.ones(64) * step},
                "optimizer_states": [{}], ckpt_io.LOGGERS_KEY: []}, path)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def damage(path: Path) -> None:
    """Overwrite bytes inside the largest stored tensor (the file keeps its size and index)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        tensors = [i for i in archive.infolist() if "/data/" in i.filename]
        info = max(tensors, key=lambda i: i.compress_size)
    start = info.header_offset + len(info.FileHeader()) + info.compress_size // 4
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\x7f" * min(64, info.compress_size // 2))


# ---------------------------------------------------------------------------- unit tests


def test_a_checkpoint_with_damaged_tensor_bytes_is_not_usable(tmp_path):
    """Bytes changed inside a tensor kept the archive's index intact: it loaded, with
    garbage weights, and was resumed from (or exported) as good."""
    good = save(tmp_path / "epoch=0-step=2.ckpt", 2, time.time() - 10)
    bad = save(tmp_path / "last.ckpt", 4)
    damage(bad)
    assert ckpt_io.checkpoint_problem(good) is None
    assert "does not match its checksum" in ckpt_io.checkpoint_problem(bad)
    with pytest.warns(UserWarning, match="last.ckpt: corrupt"):
        assert ckpt_io.resolve_checkpoint("last", [str(tmp_path)]).path == str(good)
    # a file torch wrote without checksums has none to fail
    torch.serialization.set_crc32_options(False)
    try:
        plain = save(tmp_path / "plain.ckpt", 6)
    finally:
        torch.serialization.set_crc32_options(True)
    assert ckpt_io.checkpoint_problem(plain) is None


def test_a_folder_is_a_checkpoint_only_when_sharded(tmp_path):
    """``--ckpt_path`` given the checkpoints folder (or an exported model folder) was taken
    as a sharded checkpoint and failed later with a bare 'Is a directory'."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    save(folder / "last.ckpt", 2)
    with pytest.raises(ValueError, match=r"a folder, not a checkpoint \(it holds last\.ckpt: "
                                         r"give one of them\)"):
        ckpt_io.resolve_checkpoint(str(folder), [])
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert "--model.model_name_or_path" in ckpt_io.checkpoint_problem(tmp_path / "hf")
    for mark in ("meta.pt", "latest"):  # FSDP2's and DeepSpeed's sharded checkpoints
        sharded = tmp_path / f"{mark}.ckpt"
        sharded.mkdir()
        (sharded / mark).write_bytes(b"")
        assert ckpt_io.checkpoint_problem(sharded) is None


def test_an_fsdp2_save_is_whole_or_not_there(tmp_path, monkeypatch):
    """FSDP2's save wrote the shards and then meta.pt into the folder in place: killed in
    between, ``last.ckpt`` held the new shards beside the old meta.pt (its step, counters and
    random state) and a resume took it without a word, training a step twice (a hunt on two
    CPU processes). Each save now goes to a temporary folder that takes the name whole; a
    folder of shards without meta.pt (an older version's cut save) is refused."""
    from maxent_grpo.training.run.savers import whole_sharded_saves

    def write(checkpoint, filepath, storage_options=None):  # Lightning's order, in place
        path = Path(filepath)
        path.mkdir(exist_ok=True)
        (path / ".metadata").write_text(str(checkpoint["global_step"]))
        if checkpoint.get("killed"):  # stopped in the save: Ctrl-C, or a full disk
            raise KeyboardInterrupt if checkpoint["global_step"] == 5 else OSError("disk full")
        (path / "meta.pt").write_text(str(checkpoint["global_step"]))

    strategy = SimpleNamespace(_save_distributed_checkpoint=True, save_checkpoint=write,
                               broadcast=lambda value: value, barrier=lambda *args: None,
                               is_global_zero=True)
    whole_sharded_saves(strategy)
    last = tmp_path / "last.ckpt"
    strategy.save_checkpoint({"global_step": 3}, last)
    names, synced, real_open, real_fsync = {}, [], os.open, os.fsync

    def opened(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        names[fd] = Path(path).name
        return fd

    monkeypatch.setattr(os, "open", opened)  # the shards, meta.pt and the folders on disk
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(names.get(fd)), real_fsync(fd)))
    strategy.save_checkpoint({"global_step": 4}, last)
    monkeypatch.undo()
    assert {".metadata", "meta.pt", tmp_path.name} <= set(synced)  # a node losing power
    assert synced.index("meta.pt") < synced.index(tmp_path.name)  # written before its name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    for step, stop in ((5, KeyboardInterrupt), (6, OSError)):  # Ctrl-C, a full disk
        with pytest.raises(stop):
            strategy.save_checkpoint({"global_step": step, "killed": True}, last)
        assert {p.name: p.read_text() for p in last.iterdir()} == {
            ".metadata": "4", "meta.pt": "4"}
        assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # none left
    from maxent_grpo.training.run import savers

    real_rename = os.rename

    def refused(source, target):  # the new folder cannot take the name: the old one stays
        if str(source).endswith(ckpt_io.TMP_SUFFIX):
            raise PermissionError("refused")
        real_rename(source, target)

    savers.os.rename = refused
    try:
        with pytest.raises(PermissionError):
            strategy.save_checkpoint({"global_step": 8}, last)
    finally:
        savers.os.rename = real_rename
    assert (last / "meta.pt").read_text() == "4" and not (tmp_path / "last.ckpt.replaced").exists()
    for leftover in tmp_path.glob(f".*{ckpt_io.TMP_SUFFIX}"):
        shutil.rmtree(leftover)
    cut = tmp_path / f".last.ckpt.elsewhere-12{ckpt_io.TMP_SUFFIX}"  # a SIGKILL-ed save's
    cut.mkdir()
    (cut / ".metadata").write_text("7")
    assert ckpt_io.checkpoint_problem(last) is None
    assert ckpt_io.checkpoint_problem(cut) == (
        "FSDP2 shards without Lightning's meta.pt (a save cut short)")
    assert ckpt_io.remove_stale_temporaries([str(tmp_path)]) == [str(cut)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    (tmp_path / "mine").mkdir()  # a folder that is no checkpoint is not replaced (readers)
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    with pytest.raises(IsADirectoryError, match="a folder that is not a checkpoint"):
        strategy.save_checkpoint({"global_step": 6}, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "kept"


def sharded(path: Path, step: int, run: str, mtime: float) -> Path:
    """An FSDP2 checkpoint's folder: the shards, and Lightning's ``meta.pt`` with the rest."""
    path.mkdir()
    (path / ".metadata").write_bytes(b"shards' index")
    torch.save({"global_step": step, ckpt_io.RUN_KEY: run, ckpt_io.LOGGERS_KEY: []},
               path / "meta.pt")
    os.utime(path, (mtime, mtime))
    return path


def test_last_reads_the_step_and_run_of_sharded_checkpoints(tmp_path):
    """A folder's step and run were unknown (-1, any run): ``last`` took a step-4 file over
    the step-6 folder of the same run, and never saw two runs in one folder."""
    now = time.time()
    torch.save({"global_step": 4, "state_dict": {}, "optimizer_states": [{}],
                ckpt_io.RUN_KEY: "a"}, tmp_path / "epoch=0-step=4.ckpt")
    os.utime(tmp_path / "epoch=0-step=4.ckpt", (now, now))
    sharded(tmp_path / "epoch=0-step=6.ckpt", 6, "a", now - 10)
    found = ckpt_io.resolve_checkpoint("last", [str(tmp_path)])
    assert found.path == str(tmp_path / "epoch=0-step=6.ckpt") and found.global_step == 6
    assert found.run == "a"
    sharded(tmp_path / "last-v1.ckpt", 2, "b", now - 20)  # a second run into the folder
    with pytest.raises(ValueError, match="2 different runs"):
        ckpt_io.resolve_checkpoint("last", [str(tmp_path)])


def test_a_truncated_last_ckpt_is_skipped_for_the_newest_good_one(tmp_path):
    now = time.time()
    save(tmp_path / "epoch=0-step=2.ckpt", 2, now - 20)
    save(tmp_path / "epoch=0-step=4.ckpt", 4, now - 10)
    last = save(tmp_path / "last.ckpt", 6, now)
    truncate(last)
    assert ckpt_io.checkpoint_problem(last) is not None
    with pytest.warns(UserWarning, match=r"skipped unusable checkpoint\(s\) \(.*last\.ckpt: trunc"):
        found = ckpt_io.resolve_checkpoint("last", [str(tmp_path)])
    assert found.path == str(tmp_path / "epoch=0-step=4.ckpt") and found.global_step == 4
    assert found.skipped[0][0] == str(last)


def test_a_last_ckpt_symlink_to_a_broken_file_is_skipped(tmp_path):
    now = time.time()
    save(tmp_path / "epoch=0-step=2.ckpt", 2, now - 20)
    target = save(tmp_path / "epoch=0-step=4.ckpt", 4, now - 10)
    truncate(target)
    os.utime(target, (now - 10, now - 10))
    (tmp_path / "last.ckpt").symlink_to(target.name)  # save_last="link"
    with pytest.warns(UserWarning, match="last.ckpt"):
        found = ckpt_io.resolve_checkpoint("last", [str(tmp_path)])
    assert found.global_step == 2
    # a good symlink is followed; a dangling one is skipped
    (tmp_path / "last.ckpt").unlink()
    (tmp_path / "last.ckpt").symlink_to("missing.ckpt")
    with pytest.warns(UserWarning, match="missing file"):
        assert ckpt_io.resolve_checkpoint("last", [str(tmp_path)]).global_step == 2


def test_last_prefers_the_newest_complete_checkpoint_and_a_last_name_on_a_tie(tmp_path):
    now = time.time()
    save(tmp_path / "epoch=0-step=3.ckpt", 3, now)
    save(tmp_path / "last.ckpt", 3, now)
    assert ckpt_io.resolve_checkpoint("last", [str(tmp_path)]).path.endswith("last.ckpt")
    assert ckpt_io.resolve_checkpoint("last", [str(tmp_path / "none")]) is None  # first run


def test_best_is_the_best_checkpoint_the_newest_one_recorded(tmp_path):
    """``--ckpt_path best`` for validate, test and predict said the ModelCheckpoint was "not
    configured" to save the best model (Lightning knows it only in the fit's process); the
    newest checkpoint's monitored ModelCheckpoint records it (a hunt of the evaluation)."""
    now = time.time()
    best = save(tmp_path / "epoch=0-step=2.ckpt", 2, now - 5)

    def record(**state):
        torch.save({**torch.load(save(tmp_path / "last.ckpt", 4), weights_only=True),
                    "callbacks": {"ModelCheckpoint{'monitor': None}": {"monitor": None},
                                  "ModelCheckpoint{'monitor': 'val/pass@1'}": {
                                      "monitor": "val/pass@1", "dirpath": str(tmp_path),
                                      "best_model_path": str(best), **state}}},
                   tmp_path / "last.ckpt")

    record()
    found = ckpt_io.resolve_checkpoint("best", [str(tmp_path)], False)
    assert (found.path, found.global_step) == (str(best), 2)
    assert ckpt_io.resolve_checkpoint("best", [str(tmp_path)], True) is None  # fit: Lightning's
    for state, problem in (
            ({"monitor": None}, "no best checkpoint"),  # no monitor
            # a monitor without a dirpath: its files are in the logger's folder, and the
            # record in these is one validation old (a second reader)
            ({"dirpath": str(tmp_path / "lightning_logs")}, "no best checkpoint"),
            ({"best_model_path": str(tmp_path / "gone.ckpt")}, "a best checkpoint that is "
                                                                "gone")):
        record(**state)
        with pytest.raises(ValueError, match=rf"--ckpt_path best: .*last.ckpt records "
                                             rf"{problem}.*pass the checkpoint's file, or last"):
            ckpt_io.resolve_checkpoint("best", [str(tmp_path)], False)
    with pytest.raises(ValueError, match=r"--ckpt_path best: no checkpoint in"):
        ckpt_io.resolve_checkpoint("best", [str(tmp_path / "empty")], False)


def test_last_finds_the_checkpoints_a_metric_in_the_file_name_put_in_subfolders(tmp_path):
    """``filename: "{step}-{val/pass@1:.3f}"`` writes ``step=4-val/pass@1=0.125.ckpt``: a
    subfolder per file, which ``last`` did not look in, so the run started afresh."""
    (tmp_path / "step=2-val").mkdir()
    (tmp_path / "step=4-val").mkdir()
    now = time.time()
    save(tmp_path / "step=2-val" / "pass@1=0.250.ckpt", 2, now - 10)
    newest = save(tmp_path / "step=4-val" / "pass@1=0.125.ckpt", 4, now)
    found = ckpt_io.resolve_checkpoint("last", [str(tmp_path)])
    assert (found.path, found.global_step) == (str(newest), 4)
    gone = subprocess.Popen(["true"])
    gone.wait()
    host = ckpt_io._HOST

    def temporary(name: str, tag: str, folder: Path = tmp_path) -> Path:
        path = folder / f".{name}.{tag}{ckpt_io.TMP_SUFFIX}"
        path.write_bytes(b"half")
        return path

    stale = temporary("pass@1=0.5.ckpt", f"{host}-{gone.pid}", tmp_path / "step=4-val")
    elsewhere = temporary("a.ckpt", f"node7-{gone.pid}")  # another node's, maybe writing
    older = temporary("b.ckpt", "node7_0")  # no writer named here: a resume's to remove
    with subprocess.Popen(["sleep", "30"]) as alive:  # not one whose writer runs (readers)
        writing = temporary("last.ckpt", f"{host}-{alive.pid}")
        writing_older = temporary("c.ckpt", str(alive.pid))  # an older version's, running
        try:  # a fit that resumes nothing: this machine's killed writes only
            assert ckpt_io.remove_stale_temporaries([str(tmp_path)], False) == [str(stale)]
            assert sorted(ckpt_io.remove_stale_temporaries([str(tmp_path)])) == sorted(
                [str(elsewhere), str(older)])  # a resume: all but a live writer's
        finally:
            alive.kill()
    assert writing.exists() and writing_older.exists()


def test_a_named_broken_checkpoint_stops_the_run_naming_it_and_a_good_one(tmp_path):
    good = save(tmp_path / "epoch=0-step=2.ckpt", 2, time.time() - 10)
    bad = save(tmp_path / "last.ckpt", 4)
    truncate(bad)
    with pytest.raises(ValueError, match=rf"--ckpt_path {bad} is not usable: trunc.*{good}"):
        ckpt_io.resolve_checkpoint(str(bad), [])
    bad.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        ckpt_io.resolve_checkpoint(str(bad), [])
    assert ckpt_io.resolve_checkpoint(str(good), []).global_step == 2


def test_the_hints_for_a_named_checkpoint_look_in_its_own_folder_only(tmp_path):
    """A missing or broken ``--ckpt_path`` listed the checkpoints of its folder and every
    folder below it: ``/typo.ckpt`` walked the whole disk (minutes, silently), and the hint
    named another run's file in a subfolder as "next to it"."""
    other = tmp_path / "other_run" / "checkpoints"
    other.mkdir(parents=True)
    save(other / "last.ckpt", 9)
    with pytest.raises(ValueError, match=r"no such file, from the folder [^(]*; pass"):
        ckpt_io.resolve_checkpoint(str(tmp_path / "typo.ckpt"), [])
    bad = save(tmp_path / "last.ckpt", 4)
    truncate(bad)
    with pytest.raises(ValueError, match=r"is not usable: (?!.*next to it)"):
        ckpt_io.resolve_checkpoint(str(bad), [])
    near = save(tmp_path / "epoch=0-step=2.ckpt", 2, time.time() - 10)
    with pytest.raises(ValueError, match=rf"the newest usable checkpoint next to it is {near}"):
        ckpt_io.resolve_checkpoint(str(bad), [])
    with pytest.raises(ValueError, match=rf"checkpoints in that folder: .*{near.name}"):
        ckpt_io.resolve_checkpoint(str(tmp_path / "typo.ckpt"), [])
    # --ckpt_path last still finds a metric's subfolders (test above)


def test_nothing_usable_is_an_error_not_a_fresh_start(tmp_path):
    truncate(save(tmp_path / "last.ckpt", 4))
    with pytest.raises(ValueError, match="no usable checkpoint"):
        ckpt_io.resolve_checkpoint("last", [str(tmp_path)])


class FailingWrite(ckpt_io.AtomicCheckpointIO):
    def write(self, checkpoint: dict[str, Any], f: IO[bytes]) -> None:
        f.write(b"PK partial")
        raise OSError(28, "No space left on device")


def test_an_interrupted_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "last.ckpt"
    ckpt_io.AtomicCheckpointIO().save_checkpoint({"global_step": 1}, path)
    assert torch.load(path)["global_step"] == 1
    with pytest.raises(OSError, match="(?i)no space left"):
        FailingWrite().save_checkpoint({"global_step": 2}, path)
    assert torch.load(path)["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    # a symlinked last.ckpt is replaced by the file, its target untouched
    target = save(tmp_path / "epoch=0-step=1.ckpt", 1)
    path.unlink()
    path.symlink_to(target.name)
    ckpt_io.AtomicCheckpointIO().save_checkpoint({"global_step": 5}, path)
    assert not path.is_symlink() and torch.load(path)["global_step"] == 5
    assert torch.load(target)["global_step"] == 1


def test_no_config_yaml_in_the_current_directory_without_a_log_folder(tmp_path, monkeypatch):
    from lightning.pytorch.cli import SaveConfigCallback

    from maxent_grpo.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["maxent_grpo"])
    base = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.callbacks=[]",
            f"--model.model_cache_dir={tmp_path / 'models'}"]
    cli = main([*base, "--trainer.logger=false"], run=False)
    assert not any(isinstance(cb, SaveConfigCallback) for cb in cli.trainer.callbacks)
    assert isinstance(cli.trainer.strategy.checkpoint_io, ckpt_io.AtomicCheckpointIO)
    assert any(isinstance(cb, ckpt_io.LoggerVersions) for cb in cli.trainer.callbacks)
    cli = main([*base, "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path / 'r'}"],
               run=False)
    assert any(isinstance(cb, SaveConfigCallback) for cb in cli.trainer.callbacks)
    assert list(tmp_path.iterdir()) == []  # nothing written here
    # no logger given is Lightning's own, with a version folder: the config is saved there
    cli = main([*base, "--trainer.logger=null"], run=False)
    assert type(cli.trainer.logger).__name__ == "TensorBoardLogger"
    assert any(isinstance(cb, SaveConfigCallback) for cb in cli.trainer.callbacks)


class Touch:
    """A pickle that runs code when loaded: it creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_a_checkpoint_is_never_loaded_in_a_way_that_runs_its_code(tmp_path, zipped):
    """A file holding code was unpickled (weights_only=False) by the resume check, which
    ran the code before Lightning's own safe load refused the file."""
    ran = tmp_path / "ran"
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "optimizer_states": [{}], "x": Touch(ran)}, evil,
               _use_new_zipfile_serialization=zipped)
    for need in (True, False):
        with pytest.raises(ValueError, match=r"weights_only=True.*--weights_only false"):
            ckpt_io.resolve_checkpoint(str(evil), [], need)
    assert not ran.exists()
    ckpt_io.resolve_checkpoint(str(evil), [], True, trusted=True)  # the user's choice
    assert ran.exists()


def test_files_that_are_no_checkpoint_of_a_fit_say_what_they_are(tmp_path):
    """A model's weights given as --ckpt_path to an evaluation passed the check and failed
    in Lightning, reported as a bug in maxent_grpo."""
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    for name, says in (("model.safetensors", "a safetensors weights file"),
                       ("pytorch_model.bin", "not a checkpoint written by fit")):
        with pytest.raises(ValueError, match=f"{says}.*--model.model_name_or_path"):
            ckpt_io.resolve_checkpoint(str(tmp_path / name), [], False)
    # an evaluation of "last" that finds nothing is refused; a fit starts afresh
    (tmp_path / "empty").mkdir()
    assert ckpt_io.resolve_checkpoint("last", [str(tmp_path / "empty")], True) is None
    with pytest.raises(ValueError, match=r"--ckpt_path last: no checkpoint in \["):
        ckpt_io.resolve_checkpoint("last", [str(tmp_path / "empty")], False)
    with pytest.raises(ValueError, match=r"no folder \(no ModelCheckpoint has a dirpath\)"):
        ckpt_io.resolve_checkpoint("last", [], False)  # Lightning's own fresh folder: none
    assert ckpt_io.resolve_checkpoint("last", ["s3://bucket/ckpts"], False) is None  # its
    # and a file:// folder is the local folder (it was not searched)
    save(tmp_path / "empty" / "last.ckpt", 3)
    found = ckpt_io.resolve_checkpoint("last", [f"file://{tmp_path / 'empty'}"], False)
    assert found is not None and found.global_step == 3


# ---------------------------------------------------------------- killed mid-write and resumed

KILL_STEP, STEPS = 3, 5


class KillMidWrite(ckpt_io.AtomicCheckpointIO):
    """Writes half of last.ckpt's temporary file at step ``step``, then SIGKILLs itself."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step
        self.target = ""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.target = os.path.basename(str(path))
        super().save_checkpoint(checkpoint, path, storage_options)

    def write(self, checkpoint: dict[str, Any], f: IO[bytes]) -> None:
        if self.target == "last.ckpt" and checkpoint["global_step"] == self.step:
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            f.write(buffer.getvalue()[: buffer.tell() // 2])
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        super().write(checkpoint, f)


def fit_config(run: Path, steps: int, kill: bool) -> dict[str, Any]:
    logs = str(run / "logs")
    trainer: dict[str, Any] = {
        "accelerator": "cpu", "devices": 1, "max_steps": steps, "log_every_n_steps": 1,
        "enable_progress_bar": False, "enable_model_summary": False,
        "num_sanity_val_steps": 0, "limit_val_batches": 0,
        "logger": [
            {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
             "init_args": {"save_dir": logs, "name": "tb", "default_hp_metric": False}},
            {"class_path": "lightning.pytorch.loggers.CSVLogger",
             "init_args": {"save_dir": logs, "name": "csv", "flush_logs_every_n_steps": 1}},
        ],
        "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                       "init_args": {"dirpath": str(run / "ckpt"), "save_last": True,
                                     "every_n_train_steps": 1, "save_top_k": 1}}],
    }
    if kill:
        trainer["plugins"] = [{"class_path": "test_checkpoint_io.KillMidWrite",
                               "init_args": {"step": KILL_STEP}}]
    return {
        "seed_everything": 0,
        "trainer": trainer,
        "model": {"model_name_or_path": "builtin:tiny", "model_cache_dir": str(run / "models"),
                  "rewards": {"first_number": 1.0}, "num_generations": 4,
                  "max_completion_length": 4,
                  "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}}},
        "data": {"task": "arithmetic_easy", "task_options": {"bare": True}, "train_size": 13,
                 "val_size": 2, "batch_size": 4, "max_prompt_length": 32},
    }


def fit(run: Path, steps: int, kill: bool, *extra: str) -> subprocess.CompletedProcess:
    path = run / f"config_{steps}.yaml"
    path.write_text(yaml.safe_dump(fit_config(run, steps, kill), sort_keys=False))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(ROOT)])}
    cmd = [sys.executable, "-m", "maxent_grpo", "fit", "--config", str(path), *extra]
    return subprocess.run(cmd, cwd=run, env=env, capture_output=True, text=True, timeout=300)


def tensorboard_steps(folder: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


@pytest.mark.slow  # fits in subprocesses: .ci/run's slow set
def test_a_run_killed_while_writing_a_checkpoint_resumes_in_its_log_folders(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    killed = fit(run, STEPS, True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpt = run / "ckpt"
    # killed in last.ckpt's write: last.ckpt is still the whole step-2 file, step 3's top-k
    # file is complete, the half-written temporary is not a *.ckpt
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == [f".last.ckpt.{names[0].split('.')[3]}.tmp", "epoch=0-step=3.ckpt",
                     "last.ckpt"], names
    assert torch.load(ckpt / "last.ckpt", weights_only=True)["global_step"] == KILL_STEP - 1

    resumed = fit(run, STEPS, False, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Restored all states from the checkpoint at {ckpt / 'epoch=0-step=3.ckpt'}" in (
        resumed.stderr)
    assert not any(p.name.endswith(".tmp") for p in ckpt.iterdir())
    assert "will be deleted" not in resumed.stderr  # Lightning's, where the rows are kept
    before = torch.load(ckpt / "epoch=0-step=3.ckpt", weights_only=True)[ckpt_io.RUN_KEY]
    last = torch.load(ckpt / "last.ckpt", weights_only=True)
    assert last["global_step"] == STEPS
    assert last[ckpt_io.RUN_KEY] == before  # the resumed run is the same run
    assert [r["version"] for r in last[ckpt_io.LOGGERS_KEY]] == [0, 0]

    # one version folder per logger; the curves continue in place, each step once
    assert sorted(p.name for p in (run / "logs" / "tb").iterdir()) == ["version_0"]
    assert sorted(p.name for p in (run / "logs" / "csv").iterdir()) == ["version_0"]
    folder = run / "logs" / "tb" / "version_0"
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2
    # Lightning logs a step's metrics (at step - 1) after its checkpoint is saved, so the
    # step killed in its checkpoint write (logged as 2) has no point; nothing is doubled
    expected = [s for s in range(STEPS) if s != KILL_STEP - 1]
    assert tensorboard_steps(folder, "train/reward/mean") == expected
    with open(run / "logs" / "csv" / "version_0" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/reward/mean")]
    assert [int(r["step"]) for r in rows] == expected
    assert not (run / "config.yaml").exists()  # the config went to the log folder
    saved = yaml.safe_load((folder / "config.yaml").read_text())
    assert saved["ckpt_path"] == "last"  # the options as given, not the version found
    assert saved["trainer"]["logger"][0]["init_args"]["version"] is None
    assert saved["trainer"]["logger"][0]["init_args"].get("purge_step") is None


def test_last_is_the_highest_step_of_the_run_and_two_runs_are_named_not_guessed(tmp_path):
    now = time.time()

    def save_run(name: str, step: int, run: str | None, mtime: float) -> Path:
        path = save(tmp_path / name, step, mtime)
        if run is not None:
            data = torch.load(path)
            data[ckpt_io.RUN_KEY] = run
            torch.save(data, path)
            os.utime(path, (mtime, mtime))
        return path

    # one run: its highest step wins, even when a file of a lower step is newer
    save_run("last.ckpt", 9, "aaa", now - 30)
    save_run("epoch=0-step=5.ckpt", 5, "aaa", now)
    assert ckpt_io.resolve_checkpoint("last", [str(tmp_path)]).global_step == 9
    # a second run beside it (a smoke test's last-v1.ckpt at step 1): stop, naming both
    save_run("last-v1.ckpt", 1, "bbb", now + 10)
    with pytest.raises(ValueError, match=r"2 different runs.*last-v1\.ckpt \(run bbb, step 1, "
                       r"written .*last\.ckpt \(run aaa, step 9.*--ckpt_path <file>"):
        ckpt_io.resolve_checkpoint("last", [str(tmp_path)])
    # the file named explicitly is taken as it is
    assert ckpt_io.resolve_checkpoint(str(tmp_path / "last-v1.ckpt"), []).run == "bbb"
    (tmp_path / "last-v1.ckpt").unlink()
    # a checkpoint from before runs were recorded belongs to any one run: no false ambiguity
    save_run("epoch=0-step=3.ckpt", 3, None, now + 20)
    assert ckpt_io.resolve_checkpoint("last", [str(tmp_path)]).global_step == 9

    # resuming step 5 while step 9 of the same run is there: a rollback, a branch of its own
    resumed = ckpt_io.resolve_checkpoint(str(tmp_path / "epoch=0-step=5.ckpt"), [])
    assert ckpt_io.later_steps_of_run([str(tmp_path)], resumed) == [str(tmp_path / "last.ckpt")]
    assert ckpt_io.later_steps_of_run(
        [str(tmp_path)], ckpt_io.resolve_checkpoint(str(tmp_path / "last.ckpt"), [])) == []
    versions = ckpt_io.LoggerVersions()
    fitting = SimpleNamespace(state=SimpleNamespace(fn="fit"),
                              strategy=SimpleNamespace(broadcast=lambda obj: obj))
    versions.on_load_checkpoint(fitting, None, {ckpt_io.RUN_KEY: "aaa", "global_step": 5})
    assert versions.run == "aaa"
    versions.fork = True
    versions.on_load_checkpoint(fitting, None, {ckpt_io.RUN_KEY: "aaa", "global_step": 5})
    assert versions.run == "aaa@5"
    # another rank: only rank 0 looks for the later files; its finding is broadcast, so that
    # every rank's savers start afresh (FSDP2's ranks each write their shards; readers)
    other = ckpt_io.LoggerVersions()
    rank_one = SimpleNamespace(state=fitting.state,
                               strategy=SimpleNamespace(broadcast=lambda obj: True))
    saved = {ckpt_io.RUN_KEY: "aaa", "global_step": 5,
             "callbacks": {"ModelCheckpoint{x}": {"last_model_path": "last.ckpt"}}}
    other.on_load_checkpoint(rank_one, None, saved)
    assert other.run == "aaa@5"
    assert saved["callbacks"]["ModelCheckpoint{x}"]["last_model_path"] == ""


@pytest.mark.slow  # fits in subprocesses: .ci/run's slow set
def test_a_smoke_run_leaves_no_checkpoint_and_a_second_run_makes_last_ask(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    smoke = fit(run, 2, False, "--trainer.fast_dev_run", "true")
    assert smoke.returncode == 0, smoke.stderr[-3000:]
    assert not list((run / "ckpt").glob("*.ckpt")) if (run / "ckpt").exists() else True
    first = fit(run, 2, False)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "holds an earlier run's" not in first.stderr  # the smoke test left nothing
    second = fit(run, 1, False)  # a fresh run into the same folder
    assert second.returncode == 0, second.stderr[-3000:]
    assert "holds an earlier run's: this run's are written beside them" in second.stderr
    names = sorted(p.name for p in (run / "ckpt").glob("last*.ckpt"))
    assert names == ["last-v1.ckpt", "last.ckpt"], names
    runs = {torch.load(run / "ckpt" / n, weights_only=True)[ckpt_io.RUN_KEY] for n in names}
    assert len(runs) == 2
    resumed = fit(run, 3, False, "--ckpt_path", "last")
    assert resumed.returncode == 1
    assert "2 different runs" in resumed.stderr and "last-v1.ckpt (run" in resumed.stderr


def test_a_resume_from_another_folder_does_not_take_over_that_folders_logs(tmp_path,
                                                                          monkeypatch):
    """The loggers' save_dir is recorded absolute: resumed from another working folder, a
    checkpoint whose logs went to ``A/lightning_logs`` does not continue (and purge) the
    version of the same name in ``B/lightning_logs``; resumed from ``A`` it does."""
    from types import SimpleNamespace

    from jsonargparse import Namespace
    from lightning.pytorch.loggers import TensorBoardLogger

    from maxent_grpo.cli.parser import MaxEntGRPOCLI

    first, other = tmp_path / "A", tmp_path / "B"
    first.mkdir(), other.mkdir()
    monkeypatch.chdir(first)
    logger = TensorBoardLogger("lightning_logs", name="tiny", version=0)
    checkpoint: dict[str, Any] = {}
    ckpt_io.LoggerVersions().on_save_checkpoint(
        SimpleNamespace(loggers=[logger]), None, checkpoint)
    resume = ckpt_io.ResolvedCheckpoint("last.ckpt", 7, checkpoint[ckpt_io.LOGGERS_KEY])

    def continued(folder: Path, version: Any = None) -> list:
        monkeypatch.chdir(folder)
        cli = SimpleNamespace(_continued=[], _checkpoint_dirpaths=lambda: [])
        config = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger",
                           init_args=Namespace(save_dir="lightning_logs", name="tiny",
                                               version=version, purge_step=None))
        MaxEntGRPOCLI._continue_logger_versions(cli, [config], resume)
        return [(args.version, args.purge_step) for args, *_ in cli._continued]

    assert continued(other) == []  # B's own run 0 is left alone: a new version
    assert continued(first) == [(0, 7)]
    # an explicit version, the checkpoint's: purged too (a rollback kept the abandoned
    # branch's points, a hunt); another version is a run of its own
    assert continued(first, version=0) == [(0, 7)]
    assert continued(first, version="version_0") == [("version_0", 7)]  # the same folder
    assert continued(first, version="other") == []
    # TensorBoard's steps count batches: with num_iterations 2, 6 optimizer steps are 3 of
    # them, and the points past 3 of a longer run that went on from here are purged
    index = {"global_step": 6, "loops": {"fit_loop": {"epoch_loop.batch_progress": {
        "total": {"ready": 3, "started": 3, "processed": 3, "completed": 2}}}}}
    resume = ckpt_io._resolved("last.ckpt", {**index, ckpt_io.LOGGERS_KEY: resume.loggers}, [])
    assert (resume.global_step, resume.log_step) == (6, 3)
    assert continued(first) == [(0, 3)]
    monkeypatch.setenv("HOME", str(tmp_path))  # ~ as Lightning expands it, from anywhere
    checkpoint = {}
    ckpt_io.LoggerVersions().on_save_checkpoint(
        SimpleNamespace(loggers=[TensorBoardLogger("~/A", name="tiny", version=0)]), None,
        checkpoint)
    assert checkpoint[ckpt_io.LOGGERS_KEY][0]["save_dir"] == str(first)


def test_a_resume_of_a_run_folder_moved_whole_continues_its_log_version(tmp_path, monkeypatch):
    """The checkpoints of a run folder moved (or copied) whole went on in place, but its
    loggers' recorded save_dir was the old place, so the resume logged into a new version
    (one run shown as two, a hunt). Not another project's run, whose checkpoint was copied
    into this folder (readers: its version was continued and purged), nor a run whose
    checkpoints alone moved (its logs are where they were)."""
    import shutil
    from types import SimpleNamespace

    from jsonargparse import Namespace
    from lightning.pytorch.loggers import TensorBoardLogger

    from maxent_grpo.cli.parser import MaxEntGRPOCLI

    def project(root: Path) -> dict[str, Any]:
        (root / "lightning_logs" / "tiny" / "version_0").mkdir(parents=True)
        saved = root / "lightning_logs" / "tiny" / "checkpoints"
        saved.mkdir()
        (saved / "last.ckpt").write_bytes(b"")
        checkpoint: dict[str, Any] = {"global_step": 7, "callbacks": {"ModelCheckpoint{}": {
            "dirpath": str(saved), "last_model_path": str(saved / "last.ckpt")}}}
        ckpt_io.LoggerVersions().on_save_checkpoint(SimpleNamespace(loggers=[TensorBoardLogger(
            root / "lightning_logs", name="tiny", version=0)]), None, checkpoint)
        return checkpoint

    def continued(checkpoint: dict, path: Path, saver: Path) -> list:
        resume = ckpt_io._resolved(str(path), checkpoint, [])
        cli = SimpleNamespace(_continued=[], _checkpoint_dirpaths=lambda: [str(saver)])
        config = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger",
                           init_args=Namespace(save_dir="lightning_logs", name="tiny",
                                               version=None, purge_step=None))
        MaxEntGRPOCLI._continue_logger_versions(cli, [config], resume)
        return [(args.version, args.purge_step) for args, *_ in cli._continued]

    old, new, other = tmp_path / "A", tmp_path / "B", tmp_path / "C"
    checkpoint = project(old)
    shutil.move(old, new)
    monkeypatch.chdir(new)
    saver = new / "lightning_logs" / "tiny" / "checkpoints"
    assert continued(checkpoint, saver / "last.ckpt", saver) == [(0, 7)]
    assert continued(checkpoint, tmp_path / "elsewhere" / "last.ckpt", saver) == []
    # save_last: link, one save: last.ckpt links to the file its saver named (readers)
    (saver / "epoch=0-step=7.ckpt").write_bytes(b"")
    (saver / "last.ckpt").unlink()
    (saver / "last.ckpt").symlink_to("epoch=0-step=7.ckpt")
    linked = {**checkpoint, "callbacks": {"ModelCheckpoint{}": {
        "dirpath": str(old / "lightning_logs" / "tiny" / "checkpoints"), "last_model_path": "",
        "best_k_models": {str(old / "lightning_logs/tiny/checkpoints/epoch=0-step=7.ckpt"): 1}}}}
    assert continued(linked, saver / "last.ckpt", saver) == [(0, 7)]
    (tmp_path / "via").symlink_to(new)  # the run folder reached through a link (readers)
    monkeypatch.chdir(tmp_path / "via")
    via = tmp_path / "via" / "lightning_logs" / "tiny" / "checkpoints"
    assert continued(linked, via / "last.ckpt", via) == [(0, 7)]
    project(other)  # another project, given new's checkpoint under another name
    monkeypatch.chdir(other)
    saver = other / "lightning_logs" / "tiny" / "checkpoints"
    shutil.copy(new / "lightning_logs" / "tiny" / "checkpoints" / "last.ckpt", saver / "B.ckpt")
    assert continued(checkpoint, saver / "B.ckpt", saver) == []
    checkpoint = project(old)  # the checkpoints alone moved: the logs go on where they are
    saver = old / "elsewhere" / "lightning_logs" / "tiny" / "checkpoints"
    saver.parent.mkdir(parents=True)
    shutil.move(old / "lightning_logs" / "tiny" / "checkpoints", saver)
    monkeypatch.chdir(old)
    assert continued(checkpoint, saver / "last.ckpt", saver) == [(0, 7)]
    # a copy of the whole folder, the first still there, files and names the same: a run of
    # its own (readers: another project's version was continued and purged)
    shutil.copytree(old, tmp_path / "D")
    monkeypatch.chdir(tmp_path / "D")
    saver = tmp_path / "D" / "elsewhere" / "lightning_logs" / "tiny" / "checkpoints"
    assert continued(checkpoint, saver / "last.ckpt", saver) == []


def saving_every(tmp_path: Path, monkeypatch, steps: int, every: int, **model: Any) -> Path:
    """A folder with ``fit_config``'s run, saving every ``every`` steps (all kept), made the
    working folder; returns its config file (for ``cli.main`` in this process)."""
    run = tmp_path / "run"
    run.mkdir()
    config = fit_config(run, steps, False)
    config["model"].update(model)
    config["trainer"]["callbacks"][0]["init_args"].update(every_n_train_steps=every,
                                                         save_top_k=-1)
    path = run / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    monkeypatch.chdir(run)
    return path


def test_a_csv_log_resumed_with_several_iterations_keeps_each_step_once(tmp_path, monkeypatch):
    """With ``num_iterations`` 2 a checkpoint's optimizer step (4) is twice its logging step
    (its 2nd batch): the CSV log kept the lost steps' rows below 4 and wrote them again
    (TensorBoard, purged at the logging step, did not)."""
    from maxent_grpo.cli import main

    path = saving_every(tmp_path, monkeypatch, 8, 4, num_iterations=2)
    run = path.parent
    main(["fit", "--config", str(path)])
    for name in ("last.ckpt", "epoch=1-step=8.ckpt", "epoch=0-step=8.ckpt"):
        (run / "ckpt" / name).unlink(missing_ok=True)  # as if killed after step 8's batch
    main(["fit", "--config", str(path), "--ckpt_path", "last"])
    with open(run / "logs" / "csv" / "version_0" / "metrics.csv", newline="") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("train/reward/mean")]
    assert steps == [0, 1, 2, 3]


def test_a_rollback_writes_its_own_last_and_keeps_the_runs(tmp_path, monkeypatch):
    """Resuming step 4 of a run that reached step 6 goes on as a branch: Lightning restored
    the saver's ``last_model_path`` and wrote the branch's ``last.ckpt`` over the run's (its
    step 6, kept nowhere else but in a top-k file); the branch writes ``last-v1.ckpt``."""
    from maxent_grpo.cli import main

    path = saving_every(tmp_path, monkeypatch, 6, 2)
    run = path.parent
    main(["fit", "--config", str(path)])
    before = torch.load(run / "ckpt" / "last.ckpt", weights_only=True)
    main(["fit", "--config", str(path), "--trainer.max_steps", "5",
          "--ckpt_path", str(run / "ckpt" / "epoch=1-step=4.ckpt")])
    kept = torch.load(run / "ckpt" / "last.ckpt", weights_only=True)
    assert (kept["global_step"], kept[ckpt_io.RUN_KEY]) == (6, before[ckpt_io.RUN_KEY])
    branch = torch.load(run / "ckpt" / "last-v1.ckpt", weights_only=True)
    assert (branch["global_step"], branch[ckpt_io.RUN_KEY]) == (
        5, f"{before[ckpt_io.RUN_KEY]}@4")


def test_a_home_relative_checkpoint_folder_and_path_are_the_ones_written(tmp_path,
                                                                         monkeypatch):
    """``dirpath: ~/ck`` (which Lightning expands to save) was searched as written, so
    ``--ckpt_path last`` found nothing: Lightning resumed on its own, without the skip of a
    broken file, the run check or the log version (a hunt); ``--ckpt_path=~/x.ckpt``, which
    no shell expands, was "no such file"."""
    from maxent_grpo.cli import parser as cli_module

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ck").mkdir()
    save(tmp_path / "ck" / "last.ckpt", 4)
    assert ckpt_io.resolve_checkpoint("~/ck/last.ckpt", []).path == str(
        tmp_path / "ck" / "last.ckpt")
    config = fit_config(tmp_path, 2, False)
    config["trainer"]["callbacks"][0]["init_args"]["dirpath"] = "~/ck"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = cli_module.main(["--config", str(path)], run=False)
    assert cli._checkpoint_dirpaths() == [str(tmp_path / "ck")]
    assert ckpt_io.resolve_checkpoint("last", cli._checkpoint_dirpaths()).global_step == 4


def test_a_resume_given_another_seed_keeps_and_records_the_runs(tmp_path, monkeypatch):
    """``--seed_everything 7`` on a resume of a seed-0 run changed nothing (the checkpoint's
    random state goes on) but the config.yaml saved with the logs, which then named seed 7
    for a seed-0 run (a hunt): warned, and seed 0 kept and recorded."""
    from maxent_grpo.cli import main

    path = saving_every(tmp_path, monkeypatch, 2, 2)
    run = path.parent
    main(["fit", "--config", str(path)])
    assert torch.load(run / "ckpt" / "last.ckpt", weights_only=True)[
        ckpt_io.CHECKPOINT_KEY]["seed"] == 0
    with pytest.warns(UserWarning, match="the checkpoint's run was seeded with 0: a resume "
                                         "continues its random state, so seed_everything 7"):
        main(["fit", "--config", str(path), "--trainer.max_steps", "3", "--seed_everything",
              "7", "--ckpt_path", "last"])
    saved = [yaml.safe_load(p.read_text()) for p in (run / "logs").rglob("config.yaml")]
    assert saved and all(s["seed_everything"] == 0 for s in saved)
    last = torch.load(run / "ckpt" / "last.ckpt", weights_only=True)
    assert (last["global_step"], last[ckpt_io.CHECKPOINT_KEY]["seed"]) == (3, 0)


@pytest.mark.parametrize(("run", "given", "drawn", "kept", "warned"), [
    (0, 0, False, 0, False),
    (0, False, False, 0, True),  # false == 0 in Python: it was taken for the run's seed
    (3, 7, True, 3, False),  # seed_everything true resumed (a requeue): the run's, silently
    (False, 7, False, False, True),  # an unseeded run
    (False, None, False, None, False),
    (None, 7, False, 7, False),  # a checkpoint from before the seed was recorded
])
def test_keep_seed_records_the_runs_seed(run, given, drawn, kept, warned, monkeypatch,
                                         recwarn):
    from maxent_grpo.training.run.checkpoint import keep_seed

    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    config = {"seed_everything": given}
    keep_seed(run, config, drawn)
    assert config["seed_everything"] == kept and type(config["seed_everything"]) is type(kept)
    assert any("a resume continues its random state" in str(w.message)
               for w in recwarn) == warned
    if run is False and given is not None:
        assert "PL_GLOBAL_SEED" not in os.environ  # the later checkpoints: unseeded


def test_a_write_that_finds_no_room_names_the_file_and_keeps_the_earlier(tmp_path):
    """A full disk (here a file-size limit, as ``ulimit -f``) in a checkpoint save: torch's
    zip writer turned the system's error into ``RuntimeError: ... unexpected pos``, which
    the command line called "a bug in maxent_grpo" (a hunt); the same for an export's
    safetensors. Both now name what was being written and why, and the files before stay."""
    script = """
import resource, signal, sys, torch
from pathlib import Path
from types import SimpleNamespace
from maxent_grpo.training.callbacks.export import _replace
from maxent_grpo.training.run.checkpoint_io import AtomicCheckpointIO
from safetensors.torch import save_file
out = Path(sys.argv[1])
io = AtomicCheckpointIO()
io.save_checkpoint({"w": torch.zeros(10)}, out / "last.ckpt")  # the earlier one
(out / "hf").mkdir(); (out / "hf" / "model.safetensors").write_text("earlier")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
for attempt in (
        lambda: io.save_checkpoint({"w": torch.zeros(100_000)}, out / "last.ckpt"),
        lambda: _replace(out / "hf", lambda f: save_file({"w": torch.zeros(100_000)},
                                                          f / "model.safetensors"))):
    try:
        attempt()
    except OSError as err:
        print(type(err.__cause__).__name__, "|", err)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    saved, exported = run.stdout.splitlines()
    assert saved.startswith("RuntimeError | [Errno 27] writing ")  # torch's, wrapped
    assert f"{tmp_path / 'last.ckpt'} failed: file too large" in saved
    assert "the files written before are kept" in saved
    assert f"writing the export {tmp_path / 'hf'} failed: file too large" in exported
    assert "the export there before is kept" in exported and "maxent_grpo.cli.export" in exported
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["w"].numel() == 10
    assert (tmp_path / "hf" / "model.safetensors").read_text() == "earlier"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "last.ckpt"]  # no leftovers


def test_no_room_is_told_only_of_a_write_that_found_none():
    """Torch's ``RuntimeError`` raised while the system's ENOSPC was handled is a write
    without room; a ``PermissionError`` raised while one was handled (a restore that failed)
    is itself, not an earlier error's room (a second reader)."""
    import errno

    from maxent_grpo.validation import no_room

    def raised(error, during=None):
        try:
            try:
                if during is not None:
                    raise during
            finally:
                raise error
        except BaseException as err:  # noqa: BLE001
            return err

    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = raised(RuntimeError("unexpected pos 499392 vs 499284"), full)
    assert no_room(wrapped, "x.ckpt", "kept").errno == errno.ENOSPC
    assert no_room(raised(PermissionError(errno.EACCES, "denied"), full), "x", "") is None
    assert no_room(RuntimeError("other"), "x", "") is None
    rust = Exception("Error while serializing: I/O error: File too large (os error 27)")
    assert "writing x failed: file too large" in str(no_room(rust, "x", "kept"))


def fit_saving(tmp_path: Path, folder: Path, every: int, steps: int, *extra: str) -> None:
    """A small tiny fit through the command line whose one ModelCheckpoint saves into
    ``folder`` every ``every`` steps, with ``last.ckpt``."""
    import maxent_grpo.cli.parser as cli_module

    config = tmp_path / f"saver_{folder.name}_{every}.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": [{
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(folder), "save_last": True,
                      "every_n_train_steps": every}}]}}))
    cli_module.main(["fit", "--config", "tiny", "--config", str(config),
                     "--data.train_size", "64", "--data.val_size", "4",
                     "--data.batch_size", "4", "--model.num_generations", "4",
                     "--trainer.enable_progress_bar=false", "--trainer.logger=false",
                     f"--model.model_cache_dir={tmp_path / 'models'}",
                     "--trainer.max_steps", str(steps), *extra])


def test_a_moved_checkpoint_folder_resumed_writes_over_its_last_ckpt(tmp_path, monkeypatch):
    """A run's checkpoint folder moved (another disk, another mount point) and resumed there
    with ``--ckpt_path last``: Lightning took its ModelCheckpoint's state for another
    folder's, so the new last checkpoint went beside as ``last-v1.ckpt`` and ``last.ckpt``,
    which validate, predict and export are shown, stayed at the old step (a hunt)."""
    import shutil

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def run(folder: Path, steps: int, *extra: str) -> None:
        fit_saving(tmp_path, folder, 2, steps, *extra)

    run(tmp_path / "A", 4)
    (tmp_path / "C").mkdir()
    shutil.copy(tmp_path / "A" / "last.ckpt", tmp_path / "C")
    shutil.move(tmp_path / "A", tmp_path / "B")
    run(tmp_path / "B", 6, "--ckpt_path", "last")
    assert sorted(p.name for p in (tmp_path / "B").glob("last*.ckpt")) == ["last.ckpt"]
    assert torch.load(tmp_path / "B" / "last.ckpt", weights_only=True)["global_step"] == 6
    # only last.ckpt copied: the saver's other checkpoints are not there, so its state is
    # not followed (its top-k would name files C never had): Lightning's rule, beside
    run(tmp_path / "C", 6, "--ckpt_path", "last")
    assert sorted(p.name for p in (tmp_path / "C").glob("last*.ckpt")) == [
        "last-v1.ckpt", "last.ckpt"]


def test_a_metric_in_the_file_name_leaves_no_empty_folders(cache_dir, tmp_path):
    """``{step}-{val/pass@1}`` puts each file in a folder of its own; Lightning removed a
    dropped top-k file but not its folder (one empty ``step=N-val`` a validation; a
    long-runs hunt). The fit's end removes those left empty, and only those."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.conftest import fit, make_data, make_module

    (tmp_path / "step=0-mine").mkdir()
    (tmp_path / "step=0-mine" / "notes.txt").write_text("kept")
    (tmp_path / "step=9-mine").mkdir()  # empty, but not a name the saver makes: kept too
    saver = ModelCheckpoint(dirpath=tmp_path, filename="{step}-{val/pass@1}", save_top_k=1,
                            monitor="step", mode="max", every_n_train_steps=1)  # replaced
    fit(make_module(cache_dir), make_data(cache_dir, val_size=4), steps=3, tmp_path=tmp_path,
        enable_checkpointing=True, callbacks=[saver], val_check_interval=1,
        limit_val_batches=1, num_sanity_val_steps=0)
    folders = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step="))
    kept = Path(saver.best_model_path).parent.name
    assert folders == sorted(["step=0-mine", "step=9-mine", kept]), folders


@pytest.mark.parametrize(("filename", "named", "removed"), [
    ("{step}-{val/pass@1}", True, {"step=4-val"}),
    ("{epoch}/{step}", True, {"epoch=0", "epoch=00-val"}),  # was ".*": every empty folder
    ("{step}-{val/x}", False, set()),  # no metric name written: no folder is made
    ("ckpts/{step}", False, {"ckpts"}),
    ("{epoch:02d}-{val/r}", True, {"epoch=00-val"}),
])
def test_only_empty_folders_the_saver_names_are_removed(tmp_path, filename, named, removed):
    """Readers: the first pattern made of a file name took any name for a placeholder."""
    from maxent_grpo.training.run.folders import remove_empty_name_folders

    names = {"step=4-val", "a-val", "step=0-mine", "epoch=0", "mine", "x=1", "4-val", "ckpts",
             "other", "epoch=00-val", "epoch-val"}
    for name in names:
        (tmp_path / name).mkdir()
    remove_empty_name_folders(tmp_path, filename, named)
    assert {p.name for p in tmp_path.iterdir()} == names - removed


def test_a_resume_with_other_saver_options_writes_over_its_last_ckpt(tmp_path, monkeypatch):
    """Another ``every_n_train_steps`` at a resume is another saver to Lightning (its state
    key): it wrote ``last-v1.ckpt`` beside ``last.ckpt``, which stayed at the old step and is
    what validate, predict and export are shown (an observers hunt)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def run(steps: int, every: int, *extra: str) -> None:
        fit_saving(tmp_path, tmp_path / "ckpt", every, steps, *extra)

    run(2, 2)
    run(3, 1, "--ckpt_path", "last")
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("last*.ckpt")) == ["last.ckpt"]
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 3


def test_a_changed_saver_takes_the_last_file_only_alone_in_its_folder_and_saving_it(
        tmp_path, monkeypatch):
    """Two changed savers in one folder both took the earlier saver's ``last.ckpt`` (one
    would write over the other's), and one without ``save_last`` carried a last file it
    never writes (readers)."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint

    from maxent_grpo.training.run import savers

    monkeypatch.setattr(savers, "_of_this_run", lambda path, checkpoint: True)
    old = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=100)
    last = str(tmp_path / "last.ckpt")

    def resumed(*new: ModelCheckpoint) -> list[str]:
        checkpoint = {"callbacks": {old.state_key: {"dirpath": str(tmp_path),
                                                    "last_model_path": last}}}
        savers.follow_savers(SimpleNamespace(checkpoint_callbacks=list(new)), checkpoint)
        return [checkpoint["callbacks"].get(s.state_key, {}).get("last_model_path", "")
                for s in new]

    def saver(every: int, save_last: bool = True) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=every,
                               save_last=save_last)

    assert resumed(saver(1)) == [last]
    assert resumed(saver(1, save_last=False)) == [""]
    assert resumed(saver(1), saver(2)) == ["", ""]
    # a saver that kept its state, listed first, in another folder or none (readers: the
    # moved-folder branch's name hid the list, so the changed one took nothing, or crashed)
    for kept in (ModelCheckpoint(dirpath=str(tmp_path / "other"), every_n_train_steps=50),
                 ModelCheckpoint(every_n_train_steps=50)):
        checkpoint = {"callbacks": {old.state_key: {"dirpath": str(tmp_path),
                                                    "last_model_path": last},
                                    kept.state_key: {"dirpath": kept.dirpath}}}
        changed = saver(1)
        savers.follow_savers(SimpleNamespace(checkpoint_callbacks=[kept, changed]), checkpoint)
        assert checkpoint["callbacks"][changed.state_key]["last_model_path"] == last


def test_a_long_legal_name_is_written_through_a_temporary_that_fits(tmp_path):
    """The temporary ``.<name>.<host>-<pid>.tmp`` of a legal name of 243 characters passed
    255 bytes: the fit failed at its first save, after its steps ("File name too long"), and
    predict after sampling every prompt (a hunt). Its temporary is a hash of the name, with
    ``.ckpt`` kept for the sweep of a killed write's."""
    from maxent_grpo.validation import temporary_name

    name = "c" * 245 + ".ckpt"  # 250 bytes: legal
    assert len(temporary_name(name).encode()) <= 255 < len(f".{name}.{ckpt_io._HOST}-1.tmp")
    assert temporary_name("last.ckpt") == f".last.ckpt.{ckpt_io._HOST}-{os.getpid()}.tmp"
    tail = f".jsonl.{ckpt_io._HOST}-{os.getpid()}.tmp"  # bytes no encoding reads (from argv)
    assert temporary_name("caf\udce9" * 80 + ".jsonl").endswith(tail)  # counted as bytes
    ckpt_io.atomic_write(tmp_path / name, lambda f: f.write(b"whole"))
    assert [p.name for p in tmp_path.iterdir()] == [name]
    killed = tmp_path / temporary_name(name).replace(f"-{os.getpid()}.", "-999999999.")
    killed.write_bytes(b"cut")  # a killed write's (no such process)
    assert ckpt_io.remove_stale_temporaries([str(tmp_path)], resuming=False) == [str(killed)]
