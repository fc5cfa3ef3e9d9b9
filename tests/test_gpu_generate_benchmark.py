"""benchmarks/gpu_generate.py at its tiny CPU shape, in-process: two real variants (plain
``generate`` and a persistent continuous-batching manager) produce B*G completions of T tokens
each and land in the JSON; a failing and an unsupported variant are recorded without stopping
the others; unknown variants and continuous-batching options are named. (The GPU figures are
taken with ``python benchmarks/gpu_generate.py`` on a GPU.)"""

from __future__ import annotations

import json

import bench_common as bc  # benchmarks/ is on sys.path (tests/conftest.py)
import gpu_generate as gg
import pytest


def test_two_variants_make_every_token_and_failures_are_recorded(bench_folder, tmp_path,
                                                                   monkeypatch) -> None:
    def boom(bench, info):
        raise RuntimeError("broken on purpose")

    def missing(bench, info):
        raise gg.Unsupported("no such option here")

    extra = [gg.Variant("boom", "boom", boom), gg.Variant("missing", "missing", missing)]
    monkeypatch.setattr(gg, "VARIANTS", [*gg.VARIANTS, *extra])
    monkeypatch.setattr(gg, "VARIANT_IDS", [*gg.VARIANT_IDS, "boom", "missing"])
    out = tmp_path / "gg.json"
    gg.main(["--shape", "tiny-cpu", "--workload-dir", str(bench_folder), "--repeats", "1",
             "--variants", "hf-dynamic,boom,cb-persistent,missing", "--out", str(out)])
    report = json.loads(out.read_text())
    workload = bc.WORKLOADS["qwen-tiny-cpu"]
    B, G, T = workload.batch_prompts, workload.num_generations, workload.max_completion_length
    assert report["shape"] == {"B": B, "G": G, "T": T, "P": workload.prompt_tokens,
                               "device": "cpu", "dtype": "torch.float32",
                               "completion_tokens_per_rollout": B * G * T}
    variants = report["variants"]
    assert list(variants) == ["hf-dynamic", "cb-persistent", "boom", "missing"]
    for name in ("hf-dynamic", "cb-persistent"):
        result = variants[name]
        assert result["status"] == "ok", result.get("error")
        assert result["completion_tokens"] == B * G * T and result["exact_lengths"]
        assert [c["tokens"] for c in result["calls"]] == [B * G * T] * 2  # warm-up + 1 timed
        assert result["tokens_per_s"] == pytest.approx(B * G * T / result["median_s"])
    cb = variants["cb-persistent"]["info"]
    assert cb["persistent_manager"]
    # G samples per prompt: forked (transformers >= 5.18) or the prompt passed G times (5.17)
    assert cb["samples_via"].startswith(("num_return_sequences", "each prompt passed G times"))
    assert cb["resolved"]["num_blocks"] == cb["cb_options"]["num_blocks"]
    assert variants["boom"]["status"] == "failed"
    assert "RuntimeError: broken on purpose" in variants["boom"]["error"]
    assert variants["missing"] == {**variants["missing"], "status": "unsupported",
                                   "error": "no such option here"}
    assert report["versions"]["transformers"] and report["machine"]["date"]
    table = gg.markdown(report)
    assert "CPU tiny shape, meaningless for GPU speed" in table
    assert "| boom | n/a | n/a | n/a | n/a | failed: RuntimeError: broken on purpose |" in table


def test_unknown_names_are_refused() -> None:
    with pytest.raises(SystemExit, match="unknown variant nope"):
        gg.parse_variants("hf-static,nope")
    assert [v.id for v in gg.parse_variants(" cb-graphs , hf-static")] == ["hf-static",
                                                                            "cb-graphs"]
    assert [v.id for v in gg.parse_variants("cb")] == [
        "cb-default", "cb-persistent", "cb-graphs", "cb-compile"]
    assert [v.id for v in gg.parse_variants("")] == gg.VARIANT_IDS
    with pytest.raises(gg.Unsupported, match="has no option no_such_option"):
        gg.cb_config({"no_such_option": 1, "num_blocks": 4})
    assert gg.cb_config({"num_blocks": 4}).num_blocks == 4


def test_the_timeout_stops_a_variant() -> None:
    import time

    with pytest.raises(gg.VariantTimeout), gg.time_limit(0.05) as check:
        time.sleep(0.2)
        check()
