"""The Python API example of docs/TRAINING.md, run as written (its code block is read from the page,
so the two cannot drift apart): it trains, prints a reward, and shows the command line's
progress display."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def api_example() -> str:
    text = (ROOT / "docs" / "TRAINING.md").read_text("utf-8")
    section = text[text.index("## The Python API"):text.index("## Configs")]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_python_api_example_trains_with_the_cli_progress_display(
    tmp_path, monkeypatch, capsys,
):
    monkeypatch.chdir(tmp_path)  # nothing is written: no logger, no checkpoints
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("maxent_grpo.builtin.catalog.DEFAULT_CACHE_DIR", str(tmp_path / "models"))
    namespace: dict = {}
    exec(compile(api_example(), "docs/TRAINING.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.global_step == 20
    printed = capsys.readouterr().out
    reward = float(printed.strip().splitlines()[-1])
    assert 0.0 <= reward <= 1.0
    from maxent_grpo.training.callbacks import ReadableProgressBar

    bars = [cb for cb in trainer.callbacks if isinstance(cb, ReadableProgressBar)]
    assert len(bars) == 1 and "fit done: 20 steps" in printed
    assert [p.name for p in tmp_path.iterdir()] == ["models"]  # the built-in model only
