"""Data rows that used to train silently wrong: blank answers, repeated columns, message lists
written out as text, chat messages with no content (each refused or warned, naming the row)."""

from __future__ import annotations

import json
import warnings

import pytest

from tests.training.data.test_data import make


def test_blank_answers_are_warned_with_their_count_and_first_row(tmp_path):
    """An empty CSV cell, a row missing its last cell and a JSON "" were accepted without a
    word, and every completion of those rows trained on a reward of 0."""
    path = tmp_path / "rows.csv"
    path.write_text("prompt,answer\n1 + 1 =,2\n2 + 1 =\n3 + 1 =,\n4 + 1 =,5\n")
    with pytest.warns(UserWarning, match=r"2 of 4 rows have a blank answer in column 'answer' "
                      r"\(data\.answer_column; the first: .*rows\.csv' row 1\)"):
        make(task=None, data_files=str(path), val_size=0, batch_size=1)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "q", "answer": " "}) + "\n")
    with pytest.warns(UserWarning, match="1 of 1 rows have a blank answer"):
        make(task=None, data_files=str(path), val_size=0, batch_size=1)
    # a JSON null and a row without the key are blank too (they were refused as no string)
    path.write_text("".join(json.dumps(row) + "\n" for row in (
        {"prompt": "q", "answer": None}, {"prompt": "r"}, {"prompt": "s", "answer": "1"})))
    with pytest.warns(UserWarning, match="2 of 3 rows have a blank answer"):
        make(task=None, data_files=str(path), val_size=0, batch_size=1)


def test_numeric_answers_are_written_out_not_in_scientific_notation(tmp_path):
    """``str(1e-05)`` is ``"1e-05"``, which math-verify reads as 1."""
    path = tmp_path / "rows.jsonl"
    values = [1e-05, 3e20, 2.5, 4.0, 7, 0.1]
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": v}) + "\n"
                            for i, v in enumerate(values)))
    data = make(task=None, data_files=str(path), val_size=0, batch_size=1)
    answers = sorted(e.answer for e in data.train_dataset.examples)
    assert answers == sorted(["0.00001", "300000000000000000000", "2.5", "4", "7", "0.1"])


def test_a_repeated_column_is_refused(tmp_path):
    """JSON kept the last of two "answer" keys and pandas renamed a CSV's second "answer"
    to "answer.1", both silently."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "q", "answer": "1"}\n{"prompt": "r", "answer": "1", '
                    '"answer": "WRONG"}\n')
    with pytest.raises(ValueError, match=r"line 2: an object names the key\(s\) \['answer'\] "
                                         "more than once"):
        make(task=None, data_files=str(path), val_size=0, batch_size=1)
    path = tmp_path / "rows.json"
    path.write_text('[{"prompt": "q", "answer": "1", "answer": "2"}]')
    with pytest.raises(ValueError, match=r"names the key\(s\) \['answer'\] more than once"):
        make(task=None, data_files=str(path), val_size=0, batch_size=1)
    path = tmp_path / "rows.csv"
    path.write_text("prompt,answer,answer\nq,1,2\n")
    with pytest.raises(ValueError, match=r"header names the column\(s\) \['answer'\] more "
                                         "than once"):
        make(task=None, data_files=str(path), val_size=0, batch_size=1)
    path.write_text("prompt,answer,,\nq,1,,\n")  # blank names (a spreadsheet's export) read
    dm = make(task=None, data_files=str(path), val_size=0, batch_size=1)
    assert dm.train_dataset.examples[0].answer == "1"


@pytest.mark.parametrize("cell", [
    "\"[{'role': 'user', 'content': '0 + 1 ='}]\"",  # pandas' repr of a list of dicts
    '"[{""role"": ""user"", ""content"": ""0 + 1 =""}]"',  # the same as JSON
    '"[\n  {""role"": ""user"", ""content"": ""0 + 1 =""}\n]"',  # JSON with an indent
])
def test_a_message_list_written_as_text_is_refused(tmp_path, cell):
    """A CSV cell holds only text: a list of messages saved there was rendered as the
    literal repr, and the model trained on it."""
    path = tmp_path / "rows.csv"
    path.write_text(f"prompt,answer\n{cell},1\n")
    with pytest.raises(ValueError, match="is a list of chat messages written out as text"):
        make(task=None, data_files=str(path), val_size=0, batch_size=1,
             apply_chat_template=True)
    path.write_text("prompt,answer\n\"[{not messages}] and more\",1\n")  # text that only looks so
    dm = make(task=None, data_files=str(path), val_size=0, batch_size=1,
              apply_chat_template=True)
    assert dm.train_dataset.examples[0].raw_prompt == "[{not messages}] and more"


def test_chat_messages_with_no_content_at_all_are_refused(tmp_path):
    """An empty string prompt was refused and an empty message list's content was not."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "  "}],
                                "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match="every chat message is empty"):
        make(task=None, data_files=str(path), val_size=0, batch_size=1,
             apply_chat_template=True)


def test_a_resume_over_edited_rows_is_warned(tmp_path, caplog):
    """The resume check compared the row count only: a data file edited to as many rows
    resumed in silence, the saved order now over other prompts."""
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(6)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    state = make(task=None, data_files=str(path), val_size=0, batch_size=2).state_dict()
    with caplog.at_level("WARNING", logger="maxent_grpo.training.data"):
        make(task=None, data_files=str(path), val_size=0, batch_size=2).load_state_dict(state)
    assert "differ from the checkpoint's" not in caplog.text
    with caplog.at_level("WARNING", logger="maxent_grpo.training.data"):  # rendered anew
        make(task=None, data_files=str(path), val_size=0, batch_size=2,
             system_prompt="Answer.").load_state_dict(state)
    assert "differ from the checkpoint's" not in caplog.text
    rows[3]["answer"] = "30"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level("WARNING", logger="maxent_grpo.training.data"):
        make(task=None, data_files=str(path), val_size=0, batch_size=2).load_state_dict(state)
    assert "the training rows differ from the checkpoint's" in caplog.text


def test_a_parquet_file_without_rows_says_so(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()),
                             "answer": pa.array([], pa.string())}), path)
    with pytest.raises(ValueError, match=r"could not be read as Parquet: it holds no rows"):
        make(task=None, data_files=str(path), val_size=0, batch_size=1)



def test_messages_the_chat_template_leaves_out_are_warned_with_their_role(tmp_path):
    """A template that knows no ``developer`` role (many render only system, user and
    assistant) dropped that message's text without a word: the model never saw it."""
    from maxent_grpo.training.data import PromptDataModule
    from tests.training.data.test_data import CharTokenizer

    class KnownRoles(CharTokenizer):
        def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
            known = [m for m in messages if m["role"] in ("system", "user", "assistant")]
            return super().apply_chat_template(known, tokenize, add_generation_prompt)

    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": [{"role": "developer", "content": "Answer in French."},
                        {"role": "user", "content": f"q{i}"}], "answer": "1"} for i in range(3)]
    rows.append({"prompt": [{"role": "user", "content": "q3"}], "answer": "1"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = PromptDataModule(task=None, data_files=str(path), val_size=0, batch_size=1)
    dm.set_tokenizer(KnownRoles())
    with pytest.warns(UserWarning, match=r"leaves out the content of prompt messages with "
                                         r"role\(s\) 'developer' \(first: .*rows\.jsonl' row 0\)"):
        dm.setup("fit")
    dm = PromptDataModule(task=None, data_files=str(path), val_size=0, batch_size=1)
    dm.set_tokenizer(CharTokenizer())  # renders every role: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm.setup("fit")


def test_a_trailing_assistant_message_closed_by_the_end_of_text_is_refused(tmp_path):
    """Mistral's template has no generation prompt: a prompt ending with an assistant
    message rendered as ``[INST] q [/INST]Let me think.</s>``, and the model sampled on after
    its end of text, trained without a word (a templates hunt); a template that opens a
    new turn after it (ChatML's, this CharTokenizer's) is fine."""
    from maxent_grpo.training.data import PromptDataModule
    from tests.training.data.test_data import CharTokenizer

    class Mistral(CharTokenizer):
        eos_token = "</s>"

        def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
            return "".join(f"[INST] {m['content']} [/INST]" if m["role"] == "user"
                           else f"{m['content']}</s>" for m in messages)

    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": "1"} for i in range(3)]
    rows.append({"prompt": [{"role": "user", "content": "q3"},
                            {"role": "assistant", "content": "Let me think."}], "answer": "1"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for tokenizer, refused in ((Mistral(), True), (CharTokenizer(), False)):
        dm = PromptDataModule(task=None, data_files=str(path), val_size=0, batch_size=1)
        dm.set_tokenizer(tokenizer)
        if not refused:
            dm.setup("fit")
            continue
        with pytest.raises(ValueError, match=r"rows\.jsonl' row 3: the prompt ends with an "
                                             r"assistant message.*'</s>'.*leave the trailing"):
            dm.setup("fit")


def test_a_system_prompt_the_chat_template_leaves_out_is_warned():
    """``data.system_prompt`` through a template that renders no system message (Phi-3's
    first one rendered only user and assistant turns) was dropped without a word."""
    from maxent_grpo.training.data import PromptDataModule
    from tests.training.data.test_data import CharTokenizer

    class NoSystem(CharTokenizer):
        def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
            known = [m for m in messages if m["role"] != "system"]
            return super().apply_chat_template(known, tokenize, add_generation_prompt)

    dm = PromptDataModule(task="arithmetic_easy", train_size=8, val_size=0, batch_size=1,
                          system_prompt="Answer in French.")
    dm.set_tokenizer(NoSystem())
    with pytest.warns(UserWarning, match=r"role\(s\) 'system' .* \(data.system_prompt adds"):
        dm.setup("fit")
    assert "French" not in dm.train_dataset.examples[0].prompt
    dm = PromptDataModule(task="arithmetic_easy", train_size=8, val_size=0, batch_size=1,
                          system_prompt="Answer in French.")
    dm.set_tokenizer(CharTokenizer())  # renders it: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm.setup("fit")
    assert "French" in dm.train_dataset.examples[0].prompt



def test_a_prompt_with_half_a_character_names_its_row(tmp_path):
    """A lone surrogate (an emoji cut in two by the tool that wrote the file) stopped the
    setup with "TypeError: TextEncodeInput must be Union[...]" from inside the tokenizer."""
    import json

    from maxent_grpo.training.data import PromptDataModule

    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(4)]
    rows[2]["prompt"] = "What is 2+2? \ud83d"  # JSON writes it as the escape \ud83d
    path.write_text("\n".join(json.dumps(r) for r in rows))
    data = PromptDataModule(task=None, data_files=str(path), val_size=0, batch_size=1,
                            tokenizer="builtin:tiny")
    with pytest.raises(ValueError, match=r"rows.jsonl.*not valid Unicode: '\\ud83d'"):
        data.setup("fit")
    # in the answer: the fit trained, then its samples file (or predict's) could not be
    # written ("'utf-8' codec can't encode"); another column's is written as its escape
    rows[2] |= {"prompt": "What is 2+2?", "answer": "4\ud83d"}
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match=r"rows.jsonl' row 2 column 'answer' "
                                         r"\(data.answer_column\) is not valid Unicode"):
        PromptDataModule(task=None, data_files=str(path), val_size=0, batch_size=1,
                         tokenizer="builtin:tiny").setup("fit")
    from maxent_grpo.training.callbacks.samples import append_jsonl

    append_jsonl(tmp_path / "samples.jsonl", [{"note": "4\ud83d", "completion": "4"}])
    assert json.loads((tmp_path / "samples.jsonl").read_text()) == {
        "note": "4\ud83d", "completion": "4"}


def test_a_hub_dataset_out_of_reach_names_the_option_and_the_ways_out(tmp_path, monkeypatch):
    """Offline (as tests run: HF_HUB_OFFLINE) and not cached: datasets' "Couldn't reach ... on
    the Hub (OfflineModeIsEnabled)" named neither the option nor a way out (a hunt)."""
    import datasets

    from maxent_grpo.training.data.sources import load_hub_rows

    def unreachable(path, *args, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(ConnectionError, match=r"data.dataset_name 'someone/gsm': Couldn't reach "
                                              r".*not in the local cache.*--data.data_files"):
        load_hub_rows("someone/gsm", None, "train", str(tmp_path))
