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


def test_a_datamodule_keeping_longer_prompts_than_the_module_reads_is_refused(cache_dir):
    """Built in Python, ``PromptDataModule(max_prompt_length=None)`` beside the module's
    default 256: prompts over 256 tokens were cut to their last 256 at generation (the
    chat header and the question's start gone) without a word."""
    import pytest

    from tests.conftest import fit, make_data, make_module

    with pytest.raises(ValueError, match=r"keeps prompts of up to None tokens .* "
                                         r"MaxEntGRPOModule\(max_prompt_length=256\)"):
        fit(make_module(cache_dir), make_data(cache_dir, max_prompt_length=None), steps=1)
    with pytest.raises(ValueError, match="keeps prompts of up to 300 tokens"):
        fit(make_module(cache_dir), make_data(cache_dir, max_prompt_length=300), steps=1)
    fit(make_module(cache_dir), make_data(cache_dir, max_prompt_length=200), steps=1)
    fit(make_module(cache_dir, max_prompt_length=None),
        make_data(cache_dir, max_prompt_length=None), steps=1)
