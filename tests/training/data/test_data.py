"""Tests for maxent_grpo.training.data: sources, rendering, errors, order and state."""

from __future__ import annotations

import csv
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from maxent_grpo.training.data.datamodule import (  # noqa: E402
    EpochShuffleSampler,
    PromptDataModule,
    collate_prompts,
)
from maxent_grpo.training.data.files import read_files  # noqa: E402

BATCH_KEYS = {"prompts", "raw_prompts", "answers", "columns", "indices"}


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """``datasets`` keeps its Arrow copies of the test files in the test's own folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


class CharTokenizer:
    """One token per character; template ``<role>content</role>...<assistant>``."""

    def apply_chat_template(
        self, messages: list[dict[str, str]], tokenize: bool = True, add_generation_prompt=False
    ) -> str:
        assert tokenize is False and add_generation_prompt is True
        body = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return body + "<assistant>"

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, Any]:
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def make(**kwargs: Any) -> PromptDataModule:
    """A module with the char tokenizer, set up for fit."""
    dm = PromptDataModule(**kwargs)
    dm.set_tokenizer(CharTokenizer())
    dm.setup("fit")
    return dm


ROWS = [
    {"prompt": f"q{i}", "answer": str(i * i), "level": i % 3, "tags": [i, i + 1]} for i in range(10)
]


def write(path: Path, rows: list[dict[str, Any]]) -> str:
    """Write rows in the format named by the suffix; return the path as str."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".parquet":
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def all_batches(loader) -> list[dict[str, Any]]:
    return list(iter(loader))


# ------------------------------------------------------------------ built-in tasks


def test_builtin_task_batches():
    dm = make(task="arithmetic", train_size=20, val_size=6, batch_size=4, max_prompt_length=None)
    assert len(dm.train_dataset) == 20 and len(dm.val_dataset) == 6
    batches = all_batches(dm.train_dataloader())
    assert len(batches) == 5
    b = batches[0]
    assert set(b) == BATCH_KEYS
    assert all(len(b[k]) == 4 for k in ("prompts", "raw_prompts", "answers", "indices"))
    assert {"answer", "task", "expression", "operands"} <= set(b["columns"])
    assert "prompt" not in b["columns"]
    assert all(len(v) == 4 for v in b["columns"].values())
    assert b["columns"]["answer"] == b["answers"]
    assert b["columns"]["task"] == ["arithmetic"] * 4
    # lists in columns stay per-prompt lists (torch's default collate would transpose them)
    assert all(isinstance(ops, list) for ops in b["columns"]["operands"])
    raw = b["raw_prompts"][0]
    assert b["prompts"][0] == f"<user>{raw}</user><assistant>"
    # one epoch visits every training row once
    seen = sorted(i for batch in batches for i in batch["indices"])
    assert seen == list(range(20))


def test_builtin_task_train_val_disjoint():
    # 1-digit sums have under 100 distinct prompts, so 200 + 30 rows must collide
    opts = {"digits": 1, "num_operands": 2, "ops": "+"}
    dm = make(task="arithmetic", task_options=opts, train_size=200, val_size=30, seed=3)
    train = {ex.raw_prompt for ex in dm.train_dataset.examples}
    val = {ex.raw_prompt for ex in dm.val_dataset.examples}
    assert len(dm.val_dataset) == 30
    assert 0 < len(dm.train_dataset) < 200  # overlapping training rows were dropped
    assert not train & val
    # a closed task evaluates the prompts it trains on when asked to
    kept = make(task="arithmetic", task_options=opts, train_size=200, val_size=30, seed=3,
                holdout_val_prompts=False)
    assert len(kept.train_dataset) == 200
    assert {ex.raw_prompt for ex in kept.train_dataset.examples} & val
    with pytest.raises(ValueError, match="data.holdout_val_prompts must be true or false"):
        make(task="arithmetic", holdout_val_prompts="no")


def test_builtin_task_with_real_tokenizer():
    pytest.importorskip("maxent_grpo.models")
    dm = PromptDataModule(
        task="countdown", train_size=8, val_size=2, batch_size=4, max_prompt_length=1024
    )
    dm.setup("fit")
    b = next(iter(dm.train_dataloader()))
    assert b["prompts"][0].endswith("assistant\n") and b["raw_prompts"][0] in b["prompts"][0]
    assert {"numbers", "target"} <= set(b["columns"])


# ------------------------------------------------------------------ files


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_file_sources(tmp_path, suffix):
    path = write(tmp_path / f"rows{suffix}", ROWS)
    dm = make(task=None, data_files=path, val_size=3, batch_size=2, max_prompt_length=None)
    assert len(dm.train_dataset) == 7 and len(dm.val_dataset) == 3
    train_idx = [ex.index for ex in dm.train_dataset.examples]
    val_idx = [ex.index for ex in dm.val_dataset.examples]
    assert sorted(train_idx + val_idx) == list(range(10))
    for ex in dm.train_dataset.examples + dm.val_dataset.examples:
        i = ex.index
        assert ex.raw_prompt == f"q{i}" and ex.answer == str(i * i)
        assert ex.prompt == f"<user>q{i}</user><assistant>"
        if suffix == ".csv":  # CSV cells stay strings
            assert ex.columns["level"] == str(i % 3)
        else:
            assert ex.columns["level"] == i % 3 and ex.columns["tags"] == [i, i + 1]
    # the split is a function of the seed only
    again = make(task=None, data_files=path, val_size=3, batch_size=2)
    assert [ex.index for ex in again.val_dataset.examples] == val_idx
    other = make(task=None, data_files=path, val_size=3, batch_size=2, seed=1)
    assert [ex.index for ex in other.val_dataset.examples] != val_idx


def test_val_files_and_numeric_answers(tmp_path):
    train = write(tmp_path / "train.jsonl", [{"q": "a", "sol": 3}, {"q": "b", "sol": 2.5}])
    val = write(tmp_path / "val.jsonl", [{"q": "c", "sol": "7"}])
    dm = make(
        task=None,
        data_files=train,
        val_files=val,
        prompt_column="q",
        answer_column="sol",
        batch_size=1,
    )
    assert [ex.answer for ex in dm.train_dataset.examples] == ["3", "2.5"]
    assert [ex.answer for ex in dm.val_dataset.examples] == ["7"]
    assert dm.val_dataset.examples[0].columns == {"sol": "7", "answer": "7"}


def test_an_answer_column_the_reference_shadows_is_warned_of(tmp_path):
    """A column named ``answer`` beside another ``answer_column`` (a worked solution beside
    the final number): the rewards' ``answer`` keyword holds the reference, so the data's own
    column never reached them, without a word (a hub dataset's column cannot be renamed, so
    it is not refused)."""
    rows = [{"q": "a", "answer": "worked: 2+6 is 8", "final": 8}]
    with pytest.warns(UserWarning, match="has a column 'answer' that the rewards do not see"):
        make(task=None, data_files=write(tmp_path / "t.jsonl", rows), prompt_column="q",
             answer_column="final", batch_size=1, val_size=0)


def test_decimal_answers_and_files_under_the_home_folder(tmp_path, monkeypatch):
    """A Parquet decimal answer was refused as "not a string or a finite number"; ``~`` in
    data_files was not expanded ("file not found") while every other path option is."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    from decimal import Decimal

    monkeypatch.setenv("HOME", str(tmp_path))
    table = pa.table({"prompt": ["a", "b"], "answer": pa.array(
        [Decimal("1.50"), Decimal("20")], type=pa.decimal128(5, 2))})
    pq.write_table(table, tmp_path / "rows.parquet")
    dm = make(task=None, data_files="~/rows.parquet", val_size=0, batch_size=1)
    assert [ex.answer for ex in dm.train_dataset.examples] == ["1.50", "20.00"]
    # float32 answers as written, not widened ('0.10000000149011612')
    table = pa.table({"prompt": ["a", "b", "c"], "answer": pa.array([0.1, 3.3, None],
                                                                     type=pa.float32())})
    pq.write_table(table, tmp_path / "f32.parquet")
    dm = make(task=None, data_files=str(tmp_path / "f32.parquet"), val_size=0, batch_size=1)
    assert [ex.answer for ex in dm.train_dataset.examples] == ["0.1", "3.3", ""]


def test_a_saved_dataset_folder_is_the_training_split(tmp_path):
    """``Dataset.save_to_disk``'s folder as dataset_name failed with datasets' advice to
    call load_from_disk, which no option does."""
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    dm = make(task=None, dataset_name=str(tmp_path / "saved"), val_size=2, batch_size=2)
    assert len(dm.train_dataset) + len(dm.val_dataset) == len(ROWS)
    with pytest.raises(ValueError, match="one saved Dataset .* no split 'validation'"):
        make(task=None, dataset_name=str(tmp_path / "saved"), val_split="validation")


def test_a_saved_dataset_dict_folder_keeps_its_split_names_and_float32_answers(tmp_path):
    """A ``DatasetDict.save_to_disk`` folder went through ``load_dataset``, which guesses
    splits from file names: ``train_sft`` was refused as "one of ['train', 'test']", and
    ``train`` then trained on ``train_sft`` and ``train_gen`` together, without a word; its
    float32 answers were widened (0.10000000149011612), as a data file's are not."""
    datasets = pytest.importorskip("datasets")

    def rows(tag, n):
        return datasets.Dataset.from_list([{"prompt": f"{tag} {i} + 1 =", "answer": str(i + 1)}
                                           for i in range(n)])

    folder = str(tmp_path / "dd")
    datasets.DatasetDict({"train_sft": rows("sft", 6), "train_gen": rows("gen", 5),
                          "test_sft": rows("tsft", 3), "test_gen": rows("tgen", 2)}
                         ).save_to_disk(folder)
    dm = make(task=None, dataset_name=folder, train_split="train_sft", val_split="test_gen",
              batch_size=2)
    assert [ex.raw_prompt.split()[0] for ex in dm.train_dataset.examples] == ["sft"] * 6
    assert [ex.raw_prompt.split()[0] for ex in dm.val_dataset.examples] == ["tgen"] * 2
    with pytest.raises(ValueError, match=r"a saved DatasetDict\): split 'train\[:4\]': .*its "
                                         r"splits: train_sft, train_gen, test_sft, test_gen"):
        make(task=None, dataset_name=folder, train_split="train[:4]", val_split="test_sft")
    dm = make(task=None, dataset_name=folder, train_split="train_sft[:2]+train_gen[60%:]",
              val_split="test_gen", batch_size=2)  # slices and sums of its own splits
    assert [ex.raw_prompt for ex in dm.train_dataset.examples] == [
        "sft 0 + 1 =", "sft 1 + 1 =", "gen 3 + 1 =", "gen 4 + 1 ="]
    floats = datasets.Dataset.from_dict(
        {"prompt": ["a", "b"], "answer": [0.1, 3.3]},
        features=datasets.Features({"prompt": datasets.Value("string"),
                                    "answer": datasets.Value("float32")}))
    datasets.DatasetDict({"train": floats}).save_to_disk(str(tmp_path / "f32"))
    dm = make(task=None, dataset_name=str(tmp_path / "f32"), val_size=0, batch_size=1)
    assert [ex.answer for ex in dm.train_dataset.examples] == ["0.1", "3.3"]
    dm = make(task=None, dataset_name=str(tmp_path / "f32"), train_split="train[:1]",
              val_size=0, batch_size=1)  # a slice, as load_dataset reads it
    assert [ex.answer for ex in dm.train_dataset.examples] == ["0.1"]


def test_a_dataset_name_that_is_a_file_or_a_script_folder_says_what_to_give(tmp_path):
    """A file as data.dataset_name read "Couldn't reach ... on the Hub", and a dataset
    script's folder ended as "a bug in maxent_grpo" (datasets 4's RuntimeError)."""
    datasets = pytest.importorskip("datasets")
    path = write(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"data.dataset_name '.*rows.jsonl' is a file: give it "
                                         r"as --data.data_files"):
        make(task=None, dataset_name=path)
    if int(datasets.__version__.split(".")[0]) >= 4:
        (tmp_path / "scripted").mkdir()
        (tmp_path / "scripted" / "scripted.py").write_text("import datasets\n")
        with pytest.raises(ValueError, match=r"data.dataset_name '.*scripted': .*scripts are no "
                                             r"longer supported.*--data.data_files"):
            make(task=None, dataset_name=str(tmp_path / "scripted"))


def test_prompts_longer_than_the_tokenizer_takes_are_said_without_a_length_limit(tmp_path):
    path = write(tmp_path / "rows.jsonl", ROWS)
    dm = PromptDataModule(task=None, data_files=path, val_size=2, batch_size=2,
                          max_prompt_length=None)
    tokenizer = CharTokenizer()
    tokenizer.model_max_length = 1  # every rendered prompt has more
    dm.set_tokenizer(tokenizer)
    with pytest.warns(UserWarning, match=r"the longest train prompt has 26 tokens, more than the "
                                         r"tokenizer's model_max_length \(1\)"):
        dm.setup("fit")


def test_answer_column_none(tmp_path):
    path = write(tmp_path / "rows.jsonl", [{"prompt": "x"}, {"prompt": "y"}])
    dm = make(task=None, data_files=path, answer_column=None, val_size=1, batch_size=1)
    assert [ex.answer for ex in dm.train_dataset.examples] == [""]
    assert dm.train_dataset.examples[0].columns == {"answer": ""}


def test_local_dataset_name(tmp_path):
    pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    folder.mkdir()
    write(folder / "train.jsonl", ROWS[:6])
    write(folder / "validation.jsonl", ROWS[6:])
    dm = make(
        task=None,
        dataset_name=str(folder),
        val_split="validation",
        batch_size=2,
        dataset_cache_dir=str(tmp_path / "cache"),
    )
    assert [ex.raw_prompt for ex in dm.train_dataset.examples] == [f"q{i}" for i in range(6)]
    assert [ex.answer for ex in dm.val_dataset.examples] == ["36", "49", "64", "81"]


# ------------------------------------------------------------------ several files, formats


def test_glob_of_files_reads_the_matches_in_sorted_order(tmp_path):
    folder = tmp_path / "data"
    (folder / "more").mkdir(parents=True)
    write(folder / "rows-1.jsonl", ROWS[4:8])  # written first, read second
    write(folder / "rows-0.jsonl", ROWS[:4])
    write(folder / "more" / "rows-2.jsonl", ROWS[8:])
    dm = make(task=None, data_files=str(folder / "rows-*.jsonl"),
              val_files=str(folder / "more" / "*.jsonl"), batch_size=2, max_prompt_length=None)
    assert [ex.raw_prompt for ex in dm.train_dataset.examples] == [f"q{i}" for i in range(8)]
    assert [ex.index for ex in dm.train_dataset.examples] == list(range(8))
    assert [ex.raw_prompt for ex in dm.val_dataset.examples] == ["q8", "q9"]
    # "**" crosses folders; "data/more/..." sorts before "data/rows-..."
    deep = make(task=None, data_files=str(folder / "**" / "rows-*.jsonl"), val_size=2,
                batch_size=2, max_prompt_length=None)
    rows = {ex.index: ex.raw_prompt for ex in deep.train_dataset.examples
            + deep.val_dataset.examples}
    assert [rows[i] for i in range(10)] == [f"q{i}" for i in (8, 9, *range(8))]


def test_list_of_files_with_other_formats_and_columns(tmp_path):
    jsonl = write(tmp_path / "a.jsonl", [
        {"prompt": "j0", "answer": "1", "level": 2}, {"prompt": "j1", "answer": "3"},
    ])
    csv_file = write(tmp_path / "b.csv", [{"prompt": "c0", "answer": "007", "note": ""}])
    parquet = write(tmp_path / "c.parquet", [{"prompt": "p0", "answer": "4", "tags": [1, 2]}])
    dm = make(task=None, data_files=[parquet, jsonl, csv_file], val_files=[csv_file],
              batch_size=1, max_prompt_length=None)
    none = {"tags": None, "level": None, "note": None}
    got = [(ex.index, ex.raw_prompt, ex.answer, ex.columns) for ex in dm.train_dataset.examples]
    assert got == [  # in the order given; a column a file (or row) lacks is None
        (0, "p0", "4", {**none, "answer": "4", "tags": [1, 2]}),
        (1, "j0", "1", {**none, "answer": "1", "level": 2}),
        (2, "j1", "3", {**none, "answer": "3"}),
        (3, "c0", "007", {**none, "answer": "007", "note": ""}),  # CSV cells stay strings
    ]
    assert [ex.columns for ex in dm.val_dataset.examples] == [{"answer": "007", "note": ""}]


def test_json_file_forms(tmp_path):
    columns = tmp_path / "columns.json"  # an object of column lists, as Dataset.to_dict()
    columns.write_text(json.dumps({"prompt": ["a", "b", "c"], "answer": [1, 2.5, 3]}))
    lines = tmp_path / "lines.json"
    lines.write_text('{"prompt": "d", "answer": "4"}\n\n{"prompt": "e", "answer": "5"}\n')
    dm = make(task=None, data_files=[str(columns), str(lines)], val_files=str(lines),
              batch_size=1)
    # Arrow reads 1, 2.5, 3 as floats; integral answers lose the ".0"
    assert [(ex.raw_prompt, ex.answer) for ex in dm.train_dataset.examples] == [
        ("a", "1"), ("b", "2.5"), ("c", "3"), ("d", "4"), ("e", "5"),
    ]
    # a list holding one row whose values are lists stays that row
    one = tmp_path / "one.json"
    one.write_text(json.dumps([{"prompt": [{"role": "user", "content": "hi"}], "tags": [1]}]))
    dm = make(task=None, data_files=str(one), val_files=str(one), answer_column=None,
              batch_size=1)
    assert [ex.raw_prompt for ex in dm.train_dataset.examples] == [[{"role": "user",
                                                                      "content": "hi"}]]
    columns.write_text(json.dumps({"prompt": ["a", "b"], "answer": ["1"]}))
    with pytest.raises(ValueError, match=r"data\.val_files file '.*columns\.json'.*differ"):
        make(task=None, data_files=str(lines), val_files=str(columns), batch_size=1)
    # pandas' DataFrame.to_json: objects keyed by row, one per column (or the other way):
    # read as one row ("the 1 rows ... cannot hold data.val_size"), then a whole column shown
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"prompt": [f"{i} + 1 =" for i in range(50)], "answer": "1"})
    for orient in ("columns", "index"):
        frame.to_json(columns, orient=orient)
        with pytest.raises(ValueError, match=r"columns\.json' could not be read as JSON: it is "
                                             r"one object of objects .* orient='records'"):
            make(task=None, data_files=str(columns), batch_size=1)


def test_files_are_cached_by_datasets_and_read_again_when_changed(tmp_path):
    path = tmp_path / "rows.csv"  # JSON is read by Python's json, without a cache
    write(path, ROWS)
    make(task=None, data_files=str(path), val_size=2)
    assert list((tmp_path / "hf_cache" / "csv").rglob("*.arrow"))  # the default cache
    cache = tmp_path / "own_cache"
    dm = make(task=None, data_files=str(path), val_files=str(path), dataset_cache_dir=str(cache))
    assert list((cache / "csv").rglob("*.arrow"))
    assert len(dm.val_dataset) == 10
    write(path, ROWS[:3])
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    dm = make(task=None, data_files=str(path), val_files=str(path), dataset_cache_dir=str(cache),
              batch_size=1)
    assert [ex.raw_prompt for ex in dm.val_dataset.examples] == ["q0", "q1", "q2"]


# ------------------------------------------------------------------ rendering


def test_system_prompt_rendering(tmp_path):
    path = write(tmp_path / "rows.jsonl", ROWS)
    dm = make(task=None, data_files=path, system_prompt="Be brief.", val_size=1)
    ex = dm.train_dataset.examples[0]
    assert ex.prompt == f"<system>Be brief.</system><user>{ex.raw_prompt}</user><assistant>"
    raw = make(
        task=None,
        data_files=path,
        system_prompt="Be brief.",
        val_size=1,
        apply_chat_template=False,
    )
    ex = raw.train_dataset.examples[0]
    assert ex.prompt == f"Be brief.\n\n{ex.raw_prompt}"
    plain = make(task=None, data_files=path, val_size=1, apply_chat_template=False)
    assert plain.train_dataset.examples[0].prompt == plain.train_dataset.examples[0].raw_prompt


def test_conversational_prompts(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "hi"}], "answer": "1"},
        {
            "prompt": [
                {"role": "system", "content": "Own."},
                {"role": "user", "content": "yo"},
            ],
            "answer": "2",
        },
    ]
    path = write(tmp_path / "chat.jsonl", rows)
    dm = make(task=None, data_files=path, val_files=path, system_prompt="Sys.", batch_size=2)
    first, second = dm.train_dataset.examples
    assert first.prompt == "<system>Sys.</system><user>hi</user><assistant>"
    assert second.prompt == "<system>Own.</system><user>yo</user><assistant>"  # kept as is
    assert first.raw_prompt == rows[0]["prompt"]
    b = next(iter(dm.train_dataloader()))
    assert sorted(map(len, b["raw_prompts"])) == [1, 2]  # message lists intact


def test_max_prompt_length_drops(tmp_path, caplog):
    # rendered "<user>" + p + "</user><assistant>" is 24 + len(p) characters = tokens
    rows = [{"prompt": "a" * n, "answer": ""} for n in (1, 2, 6, 7)]
    path = write(tmp_path / "rows.jsonl", rows)
    with pytest.warns(UserWarning, match="1 of 4 train prompts are longer") as seen:
        dm = make(task=None, data_files=path, val_files=path, max_prompt_length=30, batch_size=1)
    assert [len(ex.raw_prompt) for ex in dm.train_dataset.examples] == [1, 2, 6]
    assert dm.dropped == {"train": 1, "val": 1}
    # a warning (it was an INFO line, which the command line does not show), naming a row
    said = [str(w.message) for w in seen if "longer than" in str(w.message)]
    assert len(said) == 2 and f"{path!r} row 3" in said[0] and "(31 tokens)" not in said[0]
    assert "the longest has 31" in said[0]


def test_each_process_needs_a_batch_of_training_rows(tmp_path):
    """6 rows, batch 4, 2 processes: each rank's share of 3 made no batch, and the fit
    ended at once with Lightning's "No training batches" naming no option."""
    from types import SimpleNamespace

    path = write(tmp_path / "rows.jsonl", [{"prompt": f"q{i}", "answer": ""} for i in range(6)])
    dm = PromptDataModule(task=None, data_files=path, val_files=path, batch_size=4)
    dm.set_tokenizer(CharTokenizer())
    dm.trainer = SimpleNamespace(world_size=2)
    with pytest.raises(ValueError, match=r"data.batch_size \(4 x 2 processes\) exceeds the "
                       r"number of training prompts \(6\); set --data.batch_size 3 or less"):
        dm.setup("fit")
    dm.trainer = SimpleNamespace(world_size=1)
    dm.setup("fit")  # one process: a batch
    task = PromptDataModule(task="arithmetic", train_size=3, val_size=4, batch_size=2)
    task.set_tokenizer(CharTokenizer())
    task.trainer = SimpleNamespace(world_size=2)  # 2 x 2 rows: 3 was "2 or more" (a hunt)
    with pytest.raises(ValueError, match=r"set --data.train_size 4 or more"):
        task.setup("fit")


# ------------------------------------------------------------------ errors


def test_source_must_be_exactly_one(tmp_path):
    path = write(tmp_path / "rows.jsonl", ROWS)
    for kwargs in (
        {"task": None},
        {"data_files": path},
        {"task": None, "data_files": path, "dataset_name": "x"},
    ):
        with pytest.raises(ValueError, match="task.*data_files.*dataset_name"):
            PromptDataModule(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"task": "nope"}, "task must be one of 'arithmetic'"),
        ({"task": "countdown", "task_options": {"bare": True}},
         r"'bare', which task 'countdown' does not take: drop them with "
         r"--data\.task_options null, or pass only options of task 'countdown' \("),
        ({"task": "arithmetic_easy", "data_files": "x.jsonl"},
         r"add --data\.data_files null to use data\.task or add --data\.task null to use "
         r"data\.data_files"),
        ({"batch_size": 0}, "batch_size"),
        ({"val_size": -1}, "val_size"),
        ({"max_prompt_length": 0}, "max_prompt_length"),
        ({"num_workers": -1}, "num_workers"),
        # a task drew its validation rows with seed 2 * seed + 1 (-1: "seed must be an int
        # >= 0; got -2"); 2**64 overflowed in torch's generator
        ({"seed": -1}, r"data\.seed must be an int >= 0 and <= 4294967295; got -1"),
        ({"seed": 2**64}, r"data\.seed must be an int >= 0 and <= 4294967295"),
        ({"task": None, "data_files": "rows.txt"}, "data_files.*.jsonl"),
    ],
)
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        PromptDataModule(**kwargs)


def test_missing_file_names_path_and_option(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match=r"data_files.*nope\.jsonl"):
        PromptDataModule(task=None, data_files=missing)
    with pytest.raises(FileNotFoundError, match=r"data\.val_files file not found.*nope\.jsonl"):
        read_files("data.val_files", [missing], None)


def test_missing_columns(tmp_path):
    path = write(tmp_path / "rows.jsonl", [{"question": "x", "answer": "1"}] * 3)
    with pytest.raises(ValueError, match=r"'prompt'.*prompt_column.*\['answer', 'question'\]"):
        make(task=None, data_files=path, val_size=1, batch_size=1)
    with pytest.raises(ValueError, match="'sol'.*answer_column"):
        make(
            task=None,
            data_files=path,
            prompt_column="question",
            answer_column="sol",
            val_size=1,
            batch_size=1,
        )


@pytest.mark.parametrize(
    ("value", "error", "pattern"),
    [
        ([], ValueError, r"data\.data_files must be a file path or glob pattern, or a non-empty"),
        (5, ValueError, r"data\.data_files must be a file path or glob pattern"),
        (["{ok}", "rows.txt"], ValueError, r"data\.data_files must end in one of .*'rows\.txt'"),
        ("{dir}/*.jsonl", FileNotFoundError, r"data\.data_files pattern matches no file: '.*'"),
        (["{ok}", "{dir}/nope.csv"], FileNotFoundError, r"data_files file not found: '.*nope"),
    ],
)
def test_file_option_errors(tmp_path, value, error, pattern):
    ok = write(tmp_path / "ok.jsonl", ROWS)
    folder = tmp_path / "empty"
    folder.mkdir()

    def fill(v):
        return v.format(ok=ok, dir=folder) if isinstance(v, str) else v

    value = [fill(v) for v in value] if isinstance(value, list) else fill(value)
    with pytest.raises(error, match=pattern):
        PromptDataModule(task=None, data_files=value)
    with pytest.raises(error, match=pattern.replace("data_files", "val_files")):
        PromptDataModule(task=None, data_files=ok, val_files=value)


@pytest.mark.parametrize(
    ("name", "text", "pattern"),
    [
        ("b.jsonl", '{"prompt": "x"}\n\n{"prompt": oops}\n',
         r"read as JSON lines: line 3 is not valid JSON"),
        ("b.jsonl", '{"prompt": "x"}\n["prompt"]\n',
         "read as JSON lines: line 2 is not a JSON object"),
        ("b.json", '[\n  {"prompt": "x"},\n  {"prompt": }\n]',
         r"read as JSON: line 3 is not valid JSON"),
        ("b.json", "5", "read as JSON: it holds neither a list of row objects nor an object"),
        ("b.json", '[{"prompt": "x"}, 5]', "read as JSON: row 1 is not a JSON object"),
        ("b.jsonl", "\n", "read as JSON lines: it holds no rows"),
        ("b.csv", "prompt,answer\n", "read as CSV: it holds no rows"),
        ("b.csv", "prompt,answer\na,1\nb,2,3\n", "read as CSV: .*line 3"),
        ("b.parquet", "not parquet", "read as Parquet: "),
    ],
)
def test_unreadable_file_names_option_file_and_line(tmp_path, name, text, pattern):
    folder = tmp_path / "data"
    folder.mkdir()
    write(folder / "a.jsonl", ROWS)
    (folder / name).write_text(text)
    where = rf"data\.data_files file '.*{name.replace('.', '[.]')}' could not be "
    with pytest.raises(ValueError, match=where + pattern):
        make(task=None, data_files=[str(folder / "a.jsonl"), f"{folder}/*{Path(name).suffix}"],
             val_size=1)
    with pytest.raises(ValueError, match=where.replace("data_files", "val_files") + pattern):
        make(task=None, data_files=str(folder / "a.jsonl"), val_files=str(folder / name))


def test_missing_column_and_bad_row_name_their_file(tmp_path):
    good = write(tmp_path / "a.jsonl", ROWS)
    other = write(tmp_path / "b.jsonl", [{"question": "x", "answer": "1"}])
    with pytest.raises(ValueError, match=r"data\.data_files file '.*b\.jsonl' has no prompt "
                       r"column 'prompt' \(data\.prompt_column\); columns: \['answer', "):
        make(task=None, data_files=[good, other], val_size=1)
    bad = write(tmp_path / "c.jsonl", [{"prompt": "ok", "answer": "1"}, {"prompt": ""}])
    with pytest.raises(ValueError, match=r"data\.val_files file '.*c\.jsonl' row 1 column "
                       r"'prompt' \(data\.prompt_column\) is an empty prompt"):
        make(task=None, data_files=good, val_files=[good, bad])


@pytest.mark.parametrize("bad", ["", "   ", None, 5, [], [{"role": "user"}]])
def test_bad_prompt_names_row_and_column(tmp_path, bad):
    rows = [{"prompt": "ok", "answer": "1"}, {"prompt": bad, "answer": "2"}]
    path = write(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ValueError, match="row 1 column 'prompt'"):
        make(task=None, data_files=path, val_files=path, batch_size=1)


def test_chat_messages_need_template(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}]
    path = write(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ValueError, match="apply_chat_template"):
        make(task=None, data_files=path, val_files=path, batch_size=1, apply_chat_template=False)


def test_bad_answer_names_row(tmp_path):
    path = write(tmp_path / "rows.jsonl", [{"prompt": "a", "answer": "1"},
                                           {"prompt": "b", "answer": [1]}])
    with pytest.raises(ValueError, match="row 1 column 'answer'.*answer_column"):
        make(task=None, data_files=path, val_files=path, batch_size=1)


def test_size_errors(tmp_path):
    path = write(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(ValueError, match="val_size"):
        make(task=None, data_files=path, val_size=10)
    with pytest.raises(ValueError, match="batch_size"):
        make(task=None, data_files=path, val_size=2, batch_size=9)
    with pytest.raises(ValueError, match="max_prompt_length"):
        make(task=None, data_files=path, val_size=2, max_prompt_length=5)


# ------------------------------------------------------------------ messages that say what to type


def test_switching_the_source_on_the_command_line_drops_the_configs_task_options(
    tmp_path, caplog
):
    # `fit --config configs/tiny.yaml --data.task null --data.data_files my.jsonl`: the config's
    # task_options come along; the override wins, and one warning names what was dropped
    path = write(tmp_path / "my.jsonl", ROWS)
    with caplog.at_level("WARNING", logger="maxent_grpo.training.data.sources"):
        dm = make(task=None, data_files=path, task_options={"bare": True}, train_size=4000,
                  val_size=2, batch_size=4)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    # the config's train_size too: a file gives all its rows (it passed without a word, and
    # the logged hparams said 4000 rows; a hunt of data at scale)
    assert lines[0].startswith("dropped data.task_options={'bare': True}, data.train_size=4000: "
                               "they apply only to data.task, which is null (the source is "
                               "data.data_files=")
    assert dm.task_options == {} and dm.hparams["task_options"] is None
    assert dm.hparams["train_size"] == 2000
    assert len(dm.train_dataset) == 8 and len(dm.val_dataset) == 2
    caplog.clear()
    with caplog.at_level("WARNING", logger="maxent_grpo.training.data.sources"):
        make(task=None, data_files=path, task_options={}, val_size=2)  # empty: nothing to drop
    assert not caplog.records


def test_every_option_of_an_unused_source_is_dropped_in_one_line(tmp_path, caplog):
    path = write(tmp_path / "rows.jsonl", ROWS)
    with caplog.at_level("WARNING", logger="maxent_grpo.training.data.sources"):
        dm = make(task=None, data_files=path, dataset_config="main", val_split="test",
                  val_size=2)  # the config's dataset_name was switched to data_files
        assert (dm.dataset_config, dm.val_split) == (None, None)
        assert len(dm.train_dataset) == 8  # val_size rows split off, as without a val_split
        # a train_split away from its default too (it passed without a word)
        dm = make(task=None, data_files=path, train_split="test", val_size=2)
        assert dm.train_split == "train" and dm.hparams["train_split"] == "train"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("dropped data.dataset_config='main', data.val_split='test': "
                               "they apply only to data.dataset_name, which is null")
    assert lines[1].startswith("dropped data.train_split='test': it applies only to "
                               "data.dataset_name")


def test_val_files_are_the_validation_rows_whatever_the_training_source(tmp_path):
    """``predict --data.val_files mine.jsonl`` with a task's config sampled the task's own
    validation prompts, after a one-line warning that the file was dropped (only
    ``data_files`` honoured it)."""
    from maxent_grpo.tasks import build_task

    train = build_task("arithmetic", 8, 0)
    mine = [{"prompt": "7 + 8 =", "answer": "15"}, dict(train[0])]  # one is a training prompt
    path = write(tmp_path / "mine.jsonl", mine)
    dm = make(task="arithmetic", val_files=path, train_size=8, val_size=3, batch_size=2,
              max_prompt_length=None)
    assert [ex.answer for ex in dm.val_dataset.examples] == ["15", train[0]["answer"]]
    assert len(dm.train_dataset) == 7  # the file's prompt held out of training
    dm = PromptDataModule(task="arithmetic", val_files=path, train_size=8, batch_size=2)
    dm.set_tokenizer(CharTokenizer())
    dm.setup("predict")
    assert len(dm.val_dataset) == 2
    every = write(tmp_path / "every.jsonl", [dict(r) for r in train])  # holds out them all
    with pytest.raises(ValueError, match="repeat a validation prompt.*give other "
                                         "data.val_files"):  # not "lower --data.val_size"
        make(task="arithmetic", val_files=every, train_size=8, batch_size=2,
             max_prompt_length=None)
    with pytest.raises(FileNotFoundError, match="data.val_files"):
        PromptDataModule(task="arithmetic", val_files=str(tmp_path / "gone.jsonl"))
    with pytest.raises(ValueError, match="both name the validation rows"):
        PromptDataModule(task=None, dataset_name="x", val_split="test", val_files=path)


def test_the_cli_switch_to_a_file_proceeds(tmp_path, monkeypatch, caplog):
    import sys

    from maxent_grpo.cli import parser as cli_module

    config = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
    path = write(tmp_path / "my.jsonl", ROWS * 4)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["maxent_grpo"])
    with caplog.at_level("WARNING", logger="maxent_grpo.training.data.sources"):
        cli = cli_module.main(
            ["--config", str(config), "--data.task", "null", "--data.data_files", path,
             "--model.model_name_or_path", "builtin:tiny", "--data.val_size", "4",
             "--data.batch_size", "8"],
            run=False,
        )
    dm = cli.datamodule
    assert (dm.task, dm.data_files, dm.task_options) == (None, path, {})
    assert "dropped data.task_options={'bare': True}" in caplog.text


def test_a_small_file_names_the_val_size_that_fits(tmp_path):
    path = write(tmp_path / "my.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)])
    where = rf"the 20 rows of data\.data_files '{tmp_path}/my\.jsonl'"
    # tiny.yaml's val_size 32 and batch_size 32: both must come down
    with pytest.raises(ValueError, match=rf"{where} cannot hold data\.val_size \(32\) "
                       r"validation rows and a batch of data\.batch_size \(32\) training rows; "
                       r"set --data\.val_size 5 --data\.batch_size 15 \(any val_size \+ "
                       r"batch_size up to 20, batch_size at least 1\), or give data\.val_files"):
        make(task=None, data_files=path, val_size=32, batch_size=32)
    dm = make(task=None, data_files=path, val_size=5, batch_size=15)  # as told: it fits
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (15, 5)
    # the batch fits the rows: only val_size must come down, to rows - batch_size
    with pytest.raises(ValueError, match=r"data\.val_size \(8\) leaves only 12 training rows "
                       rf"from {where}, fewer than one batch \(data\.batch_size 16\); "
                       r"set --data\.val_size 4 or less, or give data\.val_files"):
        make(task=None, data_files=path, val_size=8, batch_size=16)
    with pytest.raises(ValueError, match=r"data\.val_size \(32\) leaves no training rows"):
        make(task=None, data_files=path, val_size=32, batch_size=16)
    assert len(make(task=None, data_files=path, val_size=4, batch_size=16).train_dataset) == 16
    # evaluating needs no batch of training rows, only one
    dm = PromptDataModule(task=None, data_files=path, val_size=20, batch_size=16)
    dm.set_tokenizer(CharTokenizer())
    with pytest.raises(ValueError, match=r"data\.val_size \(20\) leaves no training rows "
                       r"from the 20 rows .*; set --data\.val_size 19 or less"):
        dm.setup("validate")


def test_too_few_training_prompts_name_the_flags(tmp_path):
    with pytest.raises(ValueError, match=r"data\.batch_size \(32\) exceeds the number of "
                       r"training prompts \(10: 10 generated \(data\.train_size\)\); set "
                       r"--data\.batch_size 10 or less, or set --data\.train_size 32 or more"):
        make(task="arithmetic", train_size=10, val_size=2, batch_size=32, max_prompt_length=None)
    # rendered "<user>" + p + "</user><assistant>" is 24 + len(p) tokens
    rows = [{"prompt": "a" * (1 + i % 4), "answer": ""} for i in range(20)]
    path = write(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ValueError, match=r"exceeds the number of training prompts \(\d+: 4 rows "
                       r"split off for validation \(data\.val_size\); \d+ dropped as longer than "
                       r"data\.max_prompt_length \(26 tokens\)\); set --data\.batch_size \d+ or "
                       r"less, or raise --data\.max_prompt_length \(now 26\), or add rows"):
        make(task=None, data_files=path, val_size=4, batch_size=16, max_prompt_length=26,
             holdout_val_prompts=False)  # val_size 0 alone: 11 rows, fewer than 16
    with pytest.raises(ValueError, match=r"longer than data\.max_prompt_length \(5 tokens; the "
                       r"shortest has 25\); set --data\.max_prompt_length 25 or more \(every "
                       r"prompt fits 28\), or --data\.max_prompt_length null"):
        make(task=None, data_files=path, val_size=4, max_prompt_length=5,
             holdout_val_prompts=False)


def test_rows_split_off_a_file_for_validation_hold_out_their_prompts(tmp_path, caplog):
    """Validation rows split off a file by row (``val_size``) shared their prompts with the
    training rows whenever the file repeats prompts: ``holdout_val_prompts`` held out only a
    task's (a hunt's file of 100 prompts in 199,936 rows: 91,704 training rows repeated one of
    the 64 validation rows' prompts)."""
    rows = [{"prompt": f"p{i % 6}", "answer": str(i % 6)} for i in range(30)]
    path = write(tmp_path / "rows.jsonl", rows)
    caplog.set_level("WARNING")
    dm = make(task=None, data_files=path, val_size=2, batch_size=2)
    val = {ex.raw_prompt for ex in dm.val_dataset.examples}
    train = [ex.raw_prompt for ex in dm.train_dataset.examples]
    assert len(dm.val_dataset) == 2 and not set(train) & val
    assert len(train) == 30 - 5 * len(val)  # every copy of a validation prompt went
    assert f"{30 - 2 - len(train)} of the 28 training rows repeat the prompt" in caplog.text
    kept = make(task=None, data_files=path, val_size=2, batch_size=2, holdout_val_prompts=False)
    assert len(kept.train_dataset) == 28 and {
        ex.raw_prompt for ex in kept.train_dataset.examples} & val
    with pytest.raises(ValueError, match=r"training prompts \(\d+: 2 rows split off for "
                       r"validation \(data\.val_size\); \d+ repeat the prompt of one of them "
                       r"\(data\.holdout_val_prompts\)\); set --data\.batch_size \d+ or less, or "
                       r"set --data\.holdout_val_prompts false, or lower --data\.val_size"):
        make(task=None, data_files=path, val_size=2, batch_size=27)
    # set up by a validate first, the rows a later fit on the same module reuses (a reader)
    evaluated = PromptDataModule(task=None, data_files=path, val_size=2, batch_size=2)
    evaluated.set_tokenizer(CharTokenizer())
    evaluated.setup("validate")
    assert {ex.raw_prompt for ex in evaluated.val_dataset.examples} == val
    assert [ex.raw_prompt for ex in evaluated.train_dataset.examples] == train
    # a file's numbers/target columns are no countdown problem: other prompts stay
    rows = [{"prompt": f"q{i}", "answer": "", "numbers": [1, 2], "target": 3} for i in range(9)]
    assert len(make(task=None, data_files=write(tmp_path / "cd.jsonl", rows), val_size=2,
                    batch_size=2).train_dataset) == 7


class NamedTokenizer(CharTokenizer):
    """The char tokenizer, except that it has no token for "?" (like a vocabulary that does
    not cover the prompts' text)."""

    name_or_path = "models/my-model"

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, Any]:
        return {"input_ids": [[ord(c) for c in t if c != "?"] for t in texts]}


def test_prompts_of_no_tokens_are_refused_at_set_up(tmp_path):
    rows = [{"question": "ok", "answer": "1"}] * 6 + [{"question": "??", "answer": "2"}]
    path = write(tmp_path / "rows.jsonl", rows)
    dm = PromptDataModule(task=None, data_files=path, val_files=path, prompt_column="question",
                          apply_chat_template=False, max_prompt_length=None, batch_size=2)
    dm.set_tokenizer(NamedTokenizer())
    with pytest.raises(ValueError, match=r"the tokenizer 'models/my-model' \(data\.tokenizer, "
                       r"linked to model\.model_name_or_path\) turns 1 of the 7 train prompts into "
                       rf"no tokens, first data\.data_files file '{tmp_path}/rows\.jsonl' row 6 "
                       r"\(column 'question', data\.prompt_column\), rendered as '\?\?'"):
        dm.setup("fit")


def test_a_model_folder_whose_tokenizer_empties_a_prompt_is_named(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    # a BPE vocabulary of digits and " +=" and no unknown token: other characters vanish
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate("0123456789+= ")}}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    folder = tmp_path / "my-model"
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>").save_pretrained(folder)
    rows = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(8)]
    rows[3]["prompt"] = "what?"
    path = write(tmp_path / "rows.jsonl", rows)
    dm = PromptDataModule(task=None, data_files=path, tokenizer=str(folder), val_size=2,
                          batch_size=2, apply_chat_template=False)
    with pytest.raises(ValueError, match=rf"the tokenizer '{folder}' \(data\.tokenizer.* into no "
                       rf"tokens, first .*rows\.jsonl' row 3 \(column 'prompt'"):
        dm.setup("fit")
    rows[3]["prompt"] = "3 + 1 ="
    path = write(tmp_path / "rows.jsonl", rows)
    dm = PromptDataModule(task=None, data_files=path, tokenizer=str(folder), val_size=2,
                          batch_size=2, apply_chat_template=False)
    dm.setup("fit")  # a vocabulary that covers the prompts is accepted
    assert len(dm.train_dataset) == 6


def test_plain_prompts_without_the_bos_the_tokenizer_adds_are_warned_about(tmp_path):
    """Plain prompts are encoded as written (as TRL does), without the bos a Llama-2, Mistral
    or Gemma tokenizer adds before a text: they lost it without a word (a hunt)."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<s>": 1, **{c: i + 2 for i, c in enumerate("0123456789+= ")}}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    rows = write(tmp_path / "rows.jsonl",
                 [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(8)])
    for adds in (False, True):
        if adds:
            backend.post_processor = tokenizers.processors.TemplateProcessing(
                single="<s> $A", special_tokens=[("<s>", 1)])
        folder = tmp_path / f"model-{adds}"
        PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>",
                                bos_token="<s>").save_pretrained(folder)
        dm = PromptDataModule(task=None, data_files=rows, tokenizer=str(folder), val_size=2,
                              batch_size=2, apply_chat_template=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dm.setup("fit")
        said = [str(w.message) for w in caught if "starts a text with '<s>'" in str(w.message)]
        assert len(said) == adds and (not adds or "write it at the start" in said[0])
    given = write(tmp_path / "given.jsonl", [{"prompt": f"<s>{i} + 1 =", "answer": str(i + 1)}
                                             for i in range(8)])  # as the warning says
    shutil.copytree(tmp_path / "model-True", tmp_path / "model-given")  # not yet warned of
    dm = PromptDataModule(task=None, data_files=given, tokenizer=str(tmp_path / "model-given"),
                          val_size=2, batch_size=2, apply_chat_template=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.setup("fit")
    assert not [w for w in caught if "starts a text with" in str(w.message)]


# ------------------------------------------------------------------ order and state


def order(dm: PromptDataModule) -> list[int]:
    return [i for b in all_batches(dm.train_dataloader()) for i in b["indices"]]


def test_order_is_deterministic_per_seed():
    kwargs = {"task": "arithmetic", "train_size": 32, "val_size": 4, "batch_size": 4}
    a, b, c = make(**kwargs), make(**kwargs), make(**kwargs, seed=1)
    assert order(a) == order(b)
    assert sorted(order(a)) == list(range(32))
    # train rows of seed 0 and 1 differ, so compare the permutation of positions instead
    assert list(a.train_dataloader().sampler) != list(c.train_dataloader().sampler)


def test_epoch_permutation_matches_randperm():
    sampler = EpochShuffleSampler(10, seed=5)
    for epoch in (0, 1, 2):
        sampler.set_epoch(epoch)
        expected = torch.randperm(10, generator=torch.Generator().manual_seed(5 + epoch))
        assert list(sampler) == expected.tolist()
    sampler.set_epoch(0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
    assert list(EpochShuffleSampler(5, seed=5, shuffle=False)) == [0, 1, 2, 3, 4]


def test_drop_last_and_val_loader(tmp_path):
    path = write(tmp_path / "rows.jsonl", ROWS)
    dm = make(task=None, data_files=path, val_size=3, batch_size=3, val_batch_size=2)
    train = all_batches(dm.train_dataloader())
    assert [len(b["prompts"]) for b in train] == [3, 3]  # 7 rows: last partial batch dropped
    val = all_batches(dm.val_dataloader())
    assert [len(b["prompts"]) for b in val] == [2, 1]
    ordered = [ex.index for ex in dm.val_dataset.examples]
    assert [i for b in val for i in b["indices"]] == ordered  # no shuffling
    assert [i for b in all_batches(dm.test_dataloader()) for i in b["indices"]] == ordered


def test_collate_keeps_lists():
    dm = make(task="countdown", train_size=4, val_size=1, batch_size=2, max_prompt_length=None)
    b = collate_prompts(dm.train_dataset.examples[:2])
    assert b["columns"]["numbers"] == [
        ex.columns["numbers"] for ex in dm.train_dataset.examples[:2]
    ]


def test_sampler_shards_and_resumes_mid_epoch():
    # W = 3 ranks over N = 10 rows: 9 usable positions, rank r takes order[r::3]
    order = torch.randperm(10, generator=torch.Generator().manual_seed(7 + 2)).tolist()[:9]
    ranks = [EpochShuffleSampler(10, seed=7, epoch=2, num_replicas=3, rank=r) for r in range(3)]
    assert [list(s) for s in ranks] == [order[0::3], order[1::3], order[2::3]]
    assert [len(s) for s in ranks] == [3, 3, 3]
    # resuming epoch 2 after 3 positions (one per rank): each rank continues its own share
    for r, s in enumerate(ranks):
        s.resume_at(2, 3)
        assert list(s) == order[3:][r::3] == order[r::3][1:]
        assert len(s) == 3  # Lightning counts the batches already done itself
        s.set_epoch(3)  # other epochs are untouched
        assert list(s) == torch.randperm(
            10, generator=torch.Generator().manual_seed(7 + 3)
        ).tolist()[:9][r::3]
    with pytest.raises(ValueError, match="multiple of the number of ranks"):
        ranks[0].resume_at(2, 4)


def test_state_dict_roundtrip_and_incompatible_checkpoints():
    kwargs = {"task": "arithmetic", "train_size": 8, "val_size": 2, "batch_size": 2}
    dm = make(**kwargs)
    state = dm.state_dict()
    assert state == {
        "epoch": 0, "consumed": 0, "seed": 0, "shuffle": True, "num_rows": 8,
        "batch_size": 2, "world_size": 1, "refill_drawn": 0,
        "rows_digest": state["rows_digest"],  # tests/training/data/test_data_rows.py
    }
    fresh = make(**kwargs)
    fresh.load_state_dict({**state, "epoch": 3, "consumed": 4})
    assert fresh.state_dict() == {**state, "epoch": 3, "consumed": 4}
    sampler = fresh.train_dataloader().sampler
    full = torch.randperm(8, generator=torch.Generator().manual_seed(3)).tolist()
    assert sampler.epoch == 3 and list(sampler) == full[4:]
    for change, option in (
        ({"seed": 7}, "data.seed"),
        ({"shuffle": False}, "data.shuffle"),
        ({"num_rows": 9}, "training prompts"),
        ({"consumed": 2, "batch_size": 4}, "data.batch_size"),
        ({"consumed": 4, "world_size": 2}, "trainer.devices"),
    ):
        with pytest.raises(ValueError, match=option):
            make(**kwargs).load_state_dict({**state, **change})
    # at an epoch boundary (consumed 0) another batch size is fine
    make(**kwargs).load_state_dict({**state, "epoch": 1, "batch_size": 4})
    # so is a checkpoint at an epoch's end (it records the whole epoch: 8 // 2 // 2 batches
    # of 2 on 2 ranks), on 1 rank with batches of 3: it skips the rest of that epoch here
    ended = make(**kwargs)
    ended.load_state_dict({**state, "epoch": 2, "consumed": 8, "world_size": 2})
    assert ended.state_dict()["consumed"] == 8 and list(ended.train_dataloader().sampler) == []
    ended = make(**{**kwargs, "batch_size": 3})
    ended.load_state_dict({**state, "epoch": 2, "consumed": 8, "world_size": 2})
    assert ended.state_dict()["consumed"] == 6  # 8 // 1 // 3 batches of 3
    sampler = ended.train_dataloader().sampler
    assert len(list(sampler)) == 2 and sampler.epoch == 2  # what drop_last leaves out
    with pytest.raises(ValueError, match="missing keys"):
        make(**kwargs).load_state_dict({"epoch": 0, "seed": 0, "consumed": 0})


def test_a_fit_after_a_resumed_one_starts_the_order_afresh():
    """A DataModule given to a fresh fit after a resumed one (a notebook) began at the
    resume's position: its first epoch skipped the prompts the resume had skipped, and the
    refill stream went on from the resume's place (a hunt of the Python API)."""
    from types import SimpleNamespace

    dm = make(task="arithmetic", train_size=8, val_size=2, batch_size=2)
    first = list(dm.train_dataloader().sampler)
    dm.load_state_dict({**dm.state_dict(), "epoch": 1, "consumed": 4, "refill_drawn": 3})
    assert list(dm.train_dataloader().sampler) != first
    dm.trainer = SimpleNamespace(world_size=1, global_rank=0, state=SimpleNamespace(fn="fit"))
    dm.setup("fit")  # a fit's start: Lightning restores a resume's position after it
    state = dm.state_dict()
    assert (state["epoch"], state["consumed"], state["refill_drawn"]) == (0, 0, 0)
    assert list(dm.train_dataloader().sampler) == first
    dm.load_state_dict({**dm.state_dict(), "epoch": 1, "consumed": 4, "refill_drawn": 3})
    dm.trainer.global_step = 2  # a fit going on on the same Trainer: its position kept
    dm.setup("fit")
    assert (dm.state_dict()["epoch"], dm.state_dict()["refill_drawn"]) == (1, 3)


def test_evaluating_a_checkpoint_accepts_any_data():
    """validate/test restore no prompt order: another data set is not an error there."""
    import lightning as L
    from lightning.pytorch.trainer.states import TrainerFn

    kwargs = {"task": "arithmetic", "train_size": 8, "val_size": 2, "batch_size": 2}
    state = {**make(**kwargs).state_dict(), "num_rows": 9, "seed": 7}
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    dm = make(**kwargs)
    dm.trainer = trainer
    trainer.state.fn = TrainerFn.VALIDATING
    dm.load_state_dict(state)  # nothing checked, nothing restored
    assert dm.state_dict()["seed"] == 0
    trainer.state.fn = TrainerFn.FITTING
    with pytest.raises(ValueError, match="data.seed"):
        dm.load_state_dict(state)


class Recorder:
    """A LightningModule factory that records (epoch, indices) of every training batch."""

    @staticmethod
    def build():
        import lightning.pytorch as pl

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.weight = torch.nn.Parameter(torch.zeros(1))
                self.seen: list[tuple[int, list[int]]] = []

            def training_step(self, batch, batch_idx):
                assert set(batch) == BATCH_KEYS
                self.seen.append((self.current_epoch, batch["indices"]))
                return (self.weight**2).sum()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        return Module()


def fit_recorder(tmp_path, max_steps: int, ckpt_path: str | None = None, **data_kw):
    """Fit the recorder for ``max_steps`` (checkpoint every step); return its batches."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    opts = {"task": "arithmetic", "train_size": 7, "val_size": 2, "batch_size": 2, "seed": 4}
    opts.update(data_kw)
    dm = PromptDataModule(**opts)
    dm.set_tokenizer(CharTokenizer())
    model = Recorder.build()
    trainer = pl.Trainer(
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1)],
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen, dm, trainer


def test_lightning_sets_epoch_and_counts(tmp_path):
    seen, dm, _ = fit_recorder(tmp_path, max_steps=6)  # 3 batches per epoch (7 rows, B = 2)
    for epoch in (0, 1):
        got = [i for e, idx in seen if e == epoch for i in idx]
        perm = torch.randperm(7, generator=torch.Generator().manual_seed(4 + epoch)).tolist()
        assert got == [dm.train_dataset.examples[p].index for p in perm[:6]]
    # the counters are Lightning's: stopped after epoch 1's last batch
    assert dm.state_dict()["epoch"] == 1 and dm.state_dict()["consumed"] == 6


@pytest.mark.parametrize("stop", [1, 3, 4])  # mid-epoch, at the end of epoch 0, mid-epoch 1
def test_resume_continues_with_the_same_prompts(tmp_path, stop):
    whole, _, _ = fit_recorder(tmp_path / "whole", max_steps=7)
    first, _, _ = fit_recorder(tmp_path / "cut", max_steps=stop)
    rest, dm, _ = fit_recorder(
        tmp_path / "cut", max_steps=7, ckpt_path=str(tmp_path / "cut" / "last.ckpt")
    )
    assert [idx for _, idx in first + rest] == [idx for _, idx in whole]
    assert [e for e, _ in first + rest] == [e for e, _ in whole]
    assert dm.state_dict()["epoch"] == 2 and dm.state_dict()["consumed"] == 2


def test_consumed_counts_training_batches_only(tmp_path):
    """After N training batches of an epoch the saved ``consumed`` is N * batch_size * world,
    whatever validation ran in between (sanity check, a validation after every step)."""

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.val_batches = 0

        def training_step(self, batch, batch_idx):
            return (self.weight**2).sum()

        def validation_step(self, batch, batch_idx):
            self.val_batches += 1

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class CheckCount(pl.Callback):
        """At every hook: consumed == this epoch's training batches so far x B x W."""

        def __init__(self) -> None:
            self.epoch, self.batches, self.checks = -1, 0, 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.current_epoch != self.epoch:
                self.epoch, self.batches = trainer.current_epoch, 0
            self.batches += 1

        def check(self, trainer, *args):
            state = trainer.datamodule.state_dict()
            assert state["consumed"] == self.batches * state["batch_size"] * state["world_size"]
            self.checks += 1

        on_train_batch_end = on_validation_batch_end = on_validation_end = check

    dm = PromptDataModule(task="arithmetic", train_size=7, val_size=3, batch_size=2, seed=4,
                          val_batch_size=1)
    dm.set_tokenizer(CharTokenizer())
    model, counter = Module(), CheckCount()
    trainer = pl.Trainer(
        max_steps=5, val_check_interval=1, check_val_every_n_epoch=None, num_sanity_val_steps=2,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[counter, ModelCheckpoint(dirpath=tmp_path, save_top_k=-1,
                                            every_n_train_steps=1)],
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    assert model.val_batches == 2 + 5 * 3  # the sanity check, then 3 batches after every step
    assert counter.checks == 5 + model.val_batches + 6  # + 6 validation ends
    per_epoch = len(dm.train_dataset) // 2
    saved = {}
    for path in tmp_path.glob("*.ckpt"):
        state = torch.load(path, weights_only=True)
        saved[state["global_step"]] = state["PromptDataModule"]
    assert sorted(saved) == [1, 2, 3, 4, 5]
    for step, state in saved.items():
        n = (step - 1) % per_epoch + 1  # training batches of this step's epoch
        assert state["epoch"] == (step - 1) // per_epoch
        assert state["consumed"] == n * 2 * 1 and state["world_size"] == 1


def test_loaders_leave_the_global_random_state_alone():
    """A resumed run restores the random state; iterating a loader must not move it."""
    dm = make(task="arithmetic", train_size=8, val_size=2, batch_size=2)
    before = torch.get_rng_state()
    for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader()):
        all_batches(loader)
    assert torch.equal(torch.get_rng_state(), before)


# ------------------------------------------------------------------ distributed sampling


def ranks_of(world: int, **kwargs: Any) -> list[PromptDataModule]:
    """One DataModule per rank, each seeing a trainer of ``world`` processes."""
    from types import SimpleNamespace

    modules = [make(**kwargs) for _ in range(world)]
    for rank, dm in enumerate(modules):
        dm.trainer = SimpleNamespace(world_size=world, global_rank=rank)
    return modules


def test_two_ranks_split_each_one_rank_batch_without_overlap():
    """W = 2 ranks with B = 2 prompts each take, at every step, disjoint halves of the 2B
    prompts a single process with batch 2B takes at that step. A group (one prompt's G
    completions) is built on the rank that holds its prompt, so no group is ever split."""
    kwargs = {"task": "arithmetic", "train_size": 21, "val_size": 2, "seed": 5}
    single = all_batches(make(**kwargs, batch_size=4).train_dataloader())
    r0, r1 = (all_batches(dm.train_dataloader()) for dm in ranks_of(2, **kwargs, batch_size=2))
    # 21 rows: one process drops the last partial batch (5 x 4); the sampler cuts the order
    # to 2 * floor(21 / 2) = 20 positions, 10 per rank (5 x 2)
    assert len(single) == len(r0) == len(r1) == 5
    seen: list[int] = []
    for a, b, both in zip(r0, r1, single, strict=True):
        assert len(a["indices"]) == len(b["indices"]) == 2
        assert not set(a["indices"]) & set(b["indices"])
        assert sorted(a["indices"] + b["indices"]) == sorted(both["indices"])
        assert a["prompts"] == [p for p, i in zip(both["prompts"], both["indices"], strict=True)
                                if i in a["indices"]]
        seen += a["indices"] + b["indices"]
    assert len(seen) == len(set(seen)) == 20  # no prompt twice in the epoch, on any rank


def test_two_ranks_resume_mid_epoch_on_their_own_shares():
    kwargs = {"task": "arithmetic", "train_size": 21, "val_size": 2, "seed": 5, "batch_size": 2}
    whole = [all_batches(dm.train_dataloader()) for dm in ranks_of(2, **kwargs)]
    state = {
        "epoch": 0, "consumed": 8, "seed": 5, "shuffle": True, "num_rows": 21,
        "batch_size": 2, "world_size": 2,
    }  # two steps of 2 ranks x 2 prompts done
    resumed = ranks_of(2, **kwargs)
    for rank, dm in enumerate(resumed):
        dm.load_state_dict(state)
        rest = all_batches(dm.train_dataloader())
        assert [b["indices"] for b in rest] == [b["indices"] for b in whole[rank][2:]]
    with pytest.raises(ValueError, match="on 2 processes, but this run has 4"):
        ranks_of(4, **kwargs)[0].load_state_dict(state)


def test_a_task_with_no_validation_rows(cache_dir):
    """``val_size: 0`` with a task asked the task for 0 rows, which it refuses ("num_rows
    must be an int >= 1"), naming no option; data files already allowed it."""
    data = PromptDataModule(task="arithmetic_easy", train_size=8, val_size=0, batch_size=4,
                            tokenizer="builtin:tiny", tokenizer_cache_dir=cache_dir)
    data.setup("fit")
    assert len(data.train_dataset) == 8 and len(data.val_dataset) == 0


# ------------------------------------------------------------------ files read as written
def test_json_answers_stay_as_written_when_a_column_mixes_strings_and_numbers(tmp_path):
    """datasets' reader stored such a column as JSON and decoded "007" back as 7 and "1.10"
    as 1.1: the reference answers changed in silence."""
    rows = [{"prompt": "a", "answer": 42}, {"prompt": "b", "answer": "007"},
            {"prompt": "c", "answer": "1.10"}, {"prompt": "d", "answer": "3.0", "x": ["007", 7]}]
    for suffix in (".jsonl", ".json"):
        dm = make(task=None, data_files=write(tmp_path / f"mixed{suffix}", rows), val_size=0,
                  batch_size=1)
        got = [(ex.answer, ex.columns["x"]) for ex in dm.train_dataset.examples]
        assert got == [("42", None), ("007", None), ("1.10", None), ("3.0", ["007", 7])]


def test_a_csv_row_with_a_cell_too_many_is_refused_naming_its_line(tmp_path):
    """pandas read a first row with one more cell as an index: every column shifted. What
    pandas reads right still reads: blank lines, a short row, a cell over 128 KiB."""
    path = tmp_path / "ok.csv"
    long = "x" * 200_000
    path.write_text(f"\nprompt,answer\nq,1\n  \nr\n\"{long}\",3\n")
    dm = make(task=None, data_files=str(path), val_size=0, batch_size=1,
              max_prompt_length=None)
    assert [(ex.raw_prompt[:3], ex.answer) for ex in dm.train_dataset.examples] == [
        ("q", "1"), ("r", ""), ("xxx", "3")]
    for text, line in (("prompt,answer\nWhat is 1,000 + 2?,1002\nWhat is 7?,7\n", 2),
                       ("prompt,answer\nq,1\nr,2,\n", 3)):
        path = tmp_path / "rows.csv"
        path.write_text(text)
        with pytest.raises(ValueError, match=f"line {line} has 3 cells and the header 2: quote"):
            make(task=None, data_files=str(path), val_size=0, batch_size=1)


def test_a_file_named_twice_is_read_once_and_validation_files_in_training_are_warned(
    tmp_path, caplog,
):
    """Before, an entry and a pattern that overlapped read a file twice (its prompts
    weighed double), and validation files inside the training pattern went unsaid."""
    folder = tmp_path / "data"
    folder.mkdir()
    write(folder / "train.jsonl", ROWS[:4])
    val = write(folder / "val.jsonl", ROWS[4:6])
    with caplog.at_level("WARNING", logger="maxent_grpo.training.data"):
        dm = make(task=None, data_files=[val, str(folder / "*.jsonl")], val_size=0,
                  batch_size=1)
    assert [ex.raw_prompt for ex in dm.train_dataset.examples] == [
        "q4", "q5", "q0", "q1", "q2", "q3"]  # val.jsonl where first named, then train.jsonl
    assert caplog.text.count("names 1 file(s) more than once") == 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="maxent_grpo.training.data"):
        make(task=None, data_files=str(folder / "*.jsonl"), val_files=val, batch_size=1)
    assert "is in data.data_files too" in caplog.text and "val.jsonl" in caplog.text


def test_a_json_lines_string_may_hold_a_line_separator(tmp_path):
    """U+2028 is valid unescaped inside a JSON string (json.dumps(ensure_ascii=False))."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "x\u2028y", "answer": "1"}, ensure_ascii=False)
                    + "\n", encoding="utf-8")
    dm = make(task=None, data_files=str(path), val_size=0, batch_size=1)
    assert dm.train_dataset.examples[0].raw_prompt == "x\u2028y"


def test_a_file_that_is_not_utf8_is_named_with_the_fix(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes('{"prompt": "Café?", "answer": "3"}\n'.encode("cp1252"))
    with pytest.raises(ValueError, match=r"rows.jsonl' is not UTF-8 text .*save it as UTF-8"):
        make(task=None, data_files=str(path), val_size=0, batch_size=1)


def test_a_file_or_a_cache_the_system_refuses_names_the_option(tmp_path, monkeypatch):
    """An unreadable data file, and datasets' cache in a read-only HOME, were a bare
    "[Errno 13] Permission denied" naming neither the option nor the fix (a hunt)."""
    from maxent_grpo.training.data import files

    path = tmp_path / "rows.csv"
    path.write_text("prompt,answer\n1 + 1 =,2\n", encoding="utf-8")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"data.data_files file '.*rows.csv': datasets cannot "
                                         r"write its cache '.*a_file.*' \(Not a directory\): "
                                         "set data.dataset_cache_dir to a folder you can"):
        files.read_file("data.data_files", str(path), str(tmp_path / "a_file" / "cache"))

    def refused(name, *args, **kwargs):  # (as root: the system's answer to another user)
        raise PermissionError(13, "Permission denied", str(name))

    monkeypatch.setattr(files, "open", refused, raising=False)
    with pytest.raises(ValueError, match=r"data.data_files file '.*rows.csv' cannot be read "
                                         r"\(Permission denied\)"):
        files.read_file("data.data_files", str(path), str(tmp_path / "cache"))


class StrictTokenizer(CharTokenizer):
    """A template that refuses a system message, as Gemma's does."""

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        import jinja2

        if messages[0]["role"] == "system":
            raise jinja2.exceptions.TemplateError("System role not supported")
        return super().apply_chat_template(messages, tokenize, add_generation_prompt)


def test_a_chat_template_that_refuses_a_prompt_names_the_row_and_the_option(tmp_path):
    """It was jinja2's TemplateError, which the command line reports as a bug."""
    path = write(tmp_path / "rows.jsonl", ROWS[:2])
    dm = PromptDataModule(task=None, data_files=path, val_size=0, batch_size=1,
                          system_prompt="Be brief.")
    dm.set_tokenizer(StrictTokenizer())
    with pytest.raises(ValueError, match=r"row 0: the tokenizer's chat template refuses the "
                       r"messages with roles \['system', 'user'\] \(data.system_prompt"):
        dm.setup("fit")


def test_rows_an_unshuffled_order_never_reaches_are_warned_of():
    """Without shuffling the rows past the last full batch are the same every epoch:
    never trained on, and nothing said so (10 rows in batches of 4: rows 8 and 9)."""
    with pytest.warns(UserWarning, match=r"the last 2 of the 10 training rows fill no batch"):
        EpochShuffleSampler(10, seed=0, shuffle=False, batch_size=4)
    with pytest.warns(UserWarning, match=r"the last 4 of the 10 training rows"):
        EpochShuffleSampler(10, seed=0, shuffle=False, num_replicas=2, batch_size=3)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EpochShuffleSampler(10, seed=0, shuffle=True, batch_size=4)  # another tail each epoch
        EpochShuffleSampler(8, seed=0, shuffle=False, batch_size=4)
        EpochShuffleSampler(10, seed=0, shuffle=False, num_replicas=2, batch_size=2, rank=1)
        EpochShuffleSampler(10, seed=0, shuffle=True, batch_size=2, limit=2)
        EpochShuffleSampler(8, seed=0, shuffle=False, batch_size=4, limit=1.0)
        EpochShuffleSampler(8, seed=0, shuffle=False, batch_size=4, limit=5)


def test_rows_that_limit_train_batches_cuts_from_an_unshuffled_order_are_counted():
    """``trainer.limit_train_batches`` keeps the first batches of each epoch's order: without
    shuffling, the rows past them too are never trained on (the warning counted only the
    incomplete last batch: 6 of 38 said where 22 were never reached)."""
    with pytest.warns(UserWarning, match=r"the last 22 of the 38 training rows fill no batch "
                      r"of data.batch_size 8 \(on 1 process\(es\)\) within "
                      r"trainer.limit_train_batches 2 "):
        EpochShuffleSampler(38, seed=0, shuffle=False, batch_size=8, limit=2)
    with pytest.warns(UserWarning,
                      match=r"the last 14 of the 38 .* trainer.limit_train_batches 0.75 "):
        EpochShuffleSampler(38, seed=0, shuffle=False, batch_size=8, limit=0.75)  # 3 of 4
    # the loader passes the Trainer's limit; a smoke run's (fast_dev_run: 1) says nothing
    from types import SimpleNamespace

    dm = make(task="arithmetic", train_size=8, val_size=2, batch_size=2, shuffle=False)
    dm.trainer = SimpleNamespace(world_size=1, global_rank=0, limit_train_batches=1,
                                 fast_dev_run=0)
    with pytest.warns(UserWarning, match=r"the last 6 of the 8 .* trainer.limit_train_batches 1 "):
        dm.train_dataloader()
    dm.trainer.fast_dev_run = 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm.train_dataloader()


def test_lowering_val_size_is_offered_only_where_it_can_fill_the_batches():
    """Two processes, 3 rows, batch_size 2, val_size 1: the message offered "lower
    --data.val_size (now 1)", and with val_size 0 the run was still refused."""
    from maxent_grpo.training.data.sources import too_few_train_prompts

    counts = {"kept": 2, "long": 0, "heldout": 0, "split_off": 1}
    options = dict(task=None, train_size=0, val_size=1, max_prompt_length=None, world=2)
    assert "lower --data.val_size" not in too_few_train_prompts(counts, batch_size=2, **options)
    assert "lower --data.val_size (now 1)" in too_few_train_prompts(
        counts | {"kept": 1}, batch_size=1, **options)
    # val_size 0 brings back the rows split off and those held out for repeating them, not
    # the rows too long for max_prompt_length
    counts = {"kept": 1, "long": 6, "heldout": 0, "split_off": 1}
    assert "lower --data.val_size" not in too_few_train_prompts(counts, batch_size=2, **options)
    assert "lower --data.val_size" in too_few_train_prompts(counts | {"heldout": 2},
                                                            batch_size=2, **options)
    assert "lower --data.val_size" not in too_few_train_prompts(  # the rows split off: long
        counts | {"split_off": 6, "val_kept": 0}, batch_size=2, **options)


class _WorkerPids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        return os.getpid()


def test_loader_workers_leave_a_stop_signal_to_the_main_process():
    """A scheduler's SIGTERM (and SIGUSR1, a terminal's Ctrl-C) reaches every process of the
    job: a DataLoader worker it killed first failed the run with "DataLoader worker ...
    killed by signal" (exit 1, the stopped step not saved; a hunt, ``data.num_workers: 1``),
    where the main process would have stopped after its batch. A worker ignores SIGINT and
    SIGUSR1, and SIGTERM unless its main process sends it (a reader: ignoring that one too
    made a process that ended with a loader's iterator alive hang, as multiprocessing ends
    its children with SIGTERM)."""
    import signal
    import subprocess
    import sys
    import textwrap

    from maxent_grpo.training.data import workers
    from maxent_grpo.training.data.workers import _TAKES_SENDER, LeaveStops, SignalSafeLoader

    loader = SignalSafeLoader(_WorkerPids(), batch_size=1, num_workers=1)
    batches = iter(loader)
    (worker,) = next(batches).tolist()
    assert worker != os.getpid()
    stops = (signal.SIGINT, signal.SIGUSR1) + ((signal.SIGTERM,) if _TAKES_SENDER else ())
    killer = subprocess.Popen([sys.executable, "-c", "import os, sys\nfor s in sys.argv[2:]: "
                               "os.kill(int(sys.argv[1]), int(s))", str(worker),
                               *map(str, map(int, stops))])  # another process: not the main
    assert killer.wait(timeout=60) == 0
    assert [b.item() for b, _ in zip(batches, range(8), strict=False)] == [worker] * 8
    del batches  # the main process shuts its worker down
    # a process that ends with an iterator alive ends (it hung when workers ignored SIGTERM)
    # and a worker its main process ends exits 0, not read as a failure (readers); a fork
    # server started for them does not block the signals in what it forks later (readers)
    script = textwrap.dedent("""
        import multiprocessing, sys, time
        sys.path.insert(0, sys.argv[2])  # the module alone (it imports torch only): quicker
        from workers import SignalSafeLoader
        method = sys.argv[1]
        live = iter(SignalSafeLoader(list(range(8)), batch_size=1, num_workers=1,
                                     multiprocessing_context=method))
        print(next(live).item())
        later = multiprocessing.get_context(method).Process(target=time.sleep, args=(60,))
        later.start()
        later.terminate()
        later.join(20)
        print("later", later.exitcode)
        raise SystemExit("stopped with the iterator alive")
        """)
    for method in ("fork", "forkserver") if _TAKES_SENDER else ("spawn",):
        ended = subprocess.run([sys.executable, "-c", script, method, os.path.dirname(
            workers.__file__)], capture_output=True, text=True, timeout=120)
        assert ended.returncode == 1, ended.stderr
        assert "later -15" in ended.stdout, (method, ended.stdout)
        assert "DataLoader worker" not in ended.stderr, (method, ended.stderr)
    dm = make(task="arithmetic", train_size=16, val_size=4, batch_size=2, num_workers=1)
    dm.setup("predict")
    for made in (dm.train_dataloader(), dm.val_dataloader(), dm.predict_dataloader()):
        assert isinstance(made.worker_init_fn, LeaveStops)
    own = SignalSafeLoader(_WorkerPids(), 1, False, None, None, 1, None, False, False, 0, print)
    assert own.worker_init_fn.then is print  # a user's own, positional too, runs after it
