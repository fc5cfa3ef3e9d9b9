"""The wheel as a user gets it (slow, ~1-2 min): built, installed non-editable into a fresh
environment, and used from a folder outside the repository.

The fresh environment takes its dependencies (torch, Lightning, ...) from the test's own
interpreter through a path entry, not this checkout: ``maxent_grpo`` there is the wheel's.
It runs ``maxent-grpo --version`` and ``--help``, loads every built-in model that needs no
extra package from the installed files, trains two steps of the packaged demo config
(``--config tiny``) and runs ``predict`` on the checkpoint it wrote.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def run(cmd: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONNOUSERSITE="1")
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the package sources (no build files in the checkout)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "maxent_grpo", src / "maxent_grpo",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("dist")
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", str(out), str(src)],
        cwd=src)
    (path,) = out.glob("maxent_grpo-*.whl")
    return path


def test_the_wheel_holds_the_package_and_its_assets_and_nothing_else(wheel):
    from maxent_grpo import __version__

    names = zipfile.ZipFile(wheel).namelist()
    assert wheel.name.startswith(f"maxent_grpo-{__version__}-")
    assert not [n for n in names if n.split("/")[0] in ("tests", "benchmarks", "configs",
                                                          "notebooks", "docs")]
    shipped = {p.relative_to(ROOT).as_posix() for p in (ROOT / "maxent_grpo").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert shipped <= set(names), sorted(shipped - set(names))
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "maxent-grpo = maxent_grpo.__main__:console" in text


def test_the_installed_command_trains_the_packaged_demo_and_predicts(wheel, tmp_path):
    env_dir = tmp_path / "env"
    run([sys.executable, "-m", "venv", str(env_dir)], cwd=tmp_path)
    python = env_dir / "bin" / "python"
    run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
        cwd=tmp_path)
    # the dependencies: the site-packages of the interpreter running this test, as a path
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               cwd=tmp_path).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp_path / "user"
    work.mkdir()
    command = str(env_dir / "bin" / "maxent-grpo")

    where = run([str(python), "-c", "import maxent_grpo; print(maxent_grpo.__file__)"], cwd=work)
    assert where.stdout.strip().startswith(str(env_dir))  # the wheel's files, not the checkout
    from maxent_grpo import __version__

    assert run([command, "--version"], cwd=work).stdout == f"maxent-grpo {__version__}\n"
    assert "predict" in run([command, "--help"], cwd=work).stdout
    assert "--model.num_generations" in run([command, "fit", "--help"], cwd=work).stdout
    # every built-in model that needs no extra package loads from the installed files
    load = ("from maxent_grpo.builtin.catalog import BUILTIN_MODELS\n"
            "from maxent_grpo.models import load_policy\n"
            "for name in BUILTIN_MODELS:\n"
            "    if 'smollm2' not in name:\n"
            "        load_policy('builtin:' + name, cache_dir='models')\n"
            "print('loaded', len(BUILTIN_MODELS))")
    assert run([str(python), "-c", load], cwd=work).stdout.startswith("loaded")

    small = ["--data.train_size", "64", "--data.val_size", "4", "--data.batch_size", "4",
             "--model.num_generations", "4", "--model.model_cache_dir", "models",
             "--trainer.enable_progress_bar=false"]
    run([command, "fit", "--config", "tiny", "--trainer.max_steps", "2", *small], cwd=work)
    ckpt = work / "lightning_logs/tiny/checkpoints/last.ckpt"
    assert ckpt.is_file()
    run([command, "predict", "--config", "tiny", "--ckpt_path", str(ckpt), "--output",
         "predictions.jsonl", *small], cwd=work)
    rows = [json.loads(line) for line in (work / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * 4 and {"completion", "rewards", "correct"} <= set(rows[0])
