"""benchmarks/demo_seeds.py: one short run through the real CLI with an override and an
environment variable, its JSON line, and the report that groups runs by setting."""

from __future__ import annotations

import json

import demo_seeds
import pytest


def test_a_short_run_is_recorded_with_its_settings_and_reported(tmp_path) -> None:
    out = tmp_path / "runs.jsonl"
    demo_seeds.main([
        "--seeds", "3", "--workers", "1", "--label", "short", "--out", str(out),
        "--set", "trainer.max_steps=3", "--set", "trainer.limit_val_batches=0",
        "--env", "ATEN_CPU_CAPABILITY=default", "--model-cache-dir", str(tmp_path / "models"),
    ])
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert "error" not in record, record.get("error")
    assert record["seed"] == 3 and record["steps"] == 3
    assert record["env"] == {"ATEN_CPU_CAPABILITY": "default"}
    assert record["sets"] == ["trainer.max_steps=3", "trainer.limit_val_batches=0"]
    assert 0.0 <= record["first20"] <= 1.0 and 0.0 <= record["last20"] <= 1.0
    assert record["machine"] and record["commit"]

    # a failed run is recorded with its error, and the report groups by label and setting
    with out.open("a") as handle:
        handle.write(json.dumps({**record, "seed": 4, "label": "other", "first20": 0.1,
                                 "last20": 0.7}) + "\n")
        handle.write(json.dumps({**record, "seed": 5, "label": "other", "error": "boom"}) + "\n")
    text = demo_seeds.report(out)
    assert "\nshort |" in text and "\nother |" in text
    assert "seed   4: 0.100 -> 0.700" in text and "seed 5: FAILED boom" in text
    assert "1 runs: last-20 min 0.700" in text and ">= 0.6: 1/1" in text
    # runs of another config are their own group, named (a vLLM run without --label was
    # counted among the demo's seeds; a hunt)
    with out.open("a") as handle:
        handle.write(json.dumps({**record, "seed": 6, "config": "configs/tiny_vllm.yaml",
                                 "last20": 0.2}) + "\n")
    text = demo_seeds.report(out)
    assert text.count("\nshort |") == 2 and "| config configs/tiny_vllm.yaml |" in text
    assert text.count("1 runs: last-20") == 3  # short (tiny), other, short (tiny_vllm)


@pytest.mark.parametrize("argv, message", [
    (["--env", "ATEN_CPU_CAPABILITY"], "--env takes NAME=VALUE; got 'ATEN_CPU_CAPABILITY'"),
    (["--set", "=3"], "--set takes NAME=VALUE; got '=3'"),
    (["--workers", "0"], "--workers and --threads must be >= 1"),
])
def test_bad_arguments_are_refused_before_any_run(argv, message, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        demo_seeds.main([*argv, "--out", str(tmp_path / "runs.jsonl")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs.jsonl").exists()
