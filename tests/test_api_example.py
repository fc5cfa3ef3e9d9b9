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


def test_a_datamodule_keeping_longer_prompts_than_the_module_reads_is_refused(cache_dir,
                                                                             tmp_path):
    """Built in Python, ``PromptDataModule(max_prompt_length=None)`` beside the module's
    default 256: prompts over 256 tokens were cut to their last 256 at generation (the
    chat header and the question's start gone) without a word. Short prompts pass."""
    import json

    import pytest

    from tests.conftest import fit, make_data, make_module

    rows = [{"prompt": f"{'.' * 300} {i} + 1 =", "answer": str(i + 1)} for i in range(8)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    long = dict(task=None, task_options=None, data_files=str(path), val_size=0,
                max_prompt_length=None)
    with pytest.raises(ValueError, match=r"keeps prompts of up to 3\d\d tokens \(its "
                                         r"max_prompt_length is None\), but MaxEntGRPOModule"
                                         r"\(max_prompt_length=256\)"):
        fit(make_module(cache_dir), make_data(cache_dir, **long), steps=1)
    fit(make_module(cache_dir, max_prompt_length=None), make_data(cache_dir, **long), steps=1)
    # short prompts kept with no bound: nothing is cut, nothing refused
    fit(make_module(cache_dir), make_data(cache_dir, max_prompt_length=None), steps=1)
