"""CompletionSamples: the TensorBoard table (read back and rendered as TensorBoard renders
it), histograms, the every-n schedule, the JSONL dump, the table through W&B (offline),
MLflow (a local store) and any other logger (JSONL in its log folder), bad options, and real
fits with TensorBoard, CSV, W&B and MLflow loggers."""

from __future__ import annotations

import json
import math
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugin_util import markdown_to_safe_html
from torch.utils.tensorboard import SummaryWriter

from maxent_grpo.rollout import GenerationBatch
from maxent_grpo.training.callbacks.samples import MAX_CELL_CHARS, CompletionSamples, escape_cell
from maxent_grpo.training.data.datamodule import PromptDataModule
from maxent_grpo.training.module import MaxEntGRPOModule
from maxent_grpo.training.step.trajectory import RolloutSamples
from maxent_grpo.training.types import AdvantageStats

TEXT_TAG = "samples/completions/text_summary"


# ---------------------------------------------------------------------- helpers


def make_record(step: int = 0, *, weights: bool = True, advantages: bool = False
                ) -> RolloutSamples:
    """B = 3 prompts, G = 2 completions, two reward components."""
    acc = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    fmt = torch.tensor([[0.5, 0.5], [0.0, 0.5], [0.5, 0.0]])
    prompts = ["a | b =", "line1\nline2", "x*y_z `q`"]
    return RolloutSamples(
        step=step,
        prompts=prompts,
        generation=GenerationBatch(
            prompts=prompts, answers=["1", "2", "3"],
            grouped_completions=[["3 |", "<think>"], ["7\n8", "\\|"], ["42", "[x](y)"]],
            grouped_ref_meta=None,
        ),
        rewards=acc + fmt,
        components={"accuracy": acc, "format": fmt},
        advantages=AdvantageStats.of(torch.tensor([[0.5, -0.5], [-1.0, 1.0], [0.25, -0.25]]))
        if advantages else None,
        weights=torch.tensor([[0.6, 0.4], [0.3, 0.7], [0.5, 0.5]]) if weights else None,
        q=None,
    )


def fake(tmp_path: Path, loggers: list | None = None, *, rank0: bool = True,
         record: RolloutSamples | None = None):
    """A trainer with ``loggers``, by default one holding a real SummaryWriter in
    ``tmp_path / "tb"``; its run folder is ``tmp_path``."""
    if loggers is None:
        loggers = [SimpleNamespace(experiment=SummaryWriter(str(tmp_path / "tb")),
                                   log_dir=str(tmp_path))]
    trainer = SimpleNamespace(
        loggers=loggers, is_global_zero=rank0, global_step=0, log_dir=str(tmp_path),
        default_root_dir=str(tmp_path), strategy=SimpleNamespace(broadcast=lambda x: x),
    )
    return trainer, SimpleNamespace(trajectory=SimpleNamespace(samples=record))


def step(cb: CompletionSamples, trainer, module, record: RolloutSamples,
         iterations: int = 1) -> None:
    module.trajectory = SimpleNamespace(samples=record)
    trainer.global_step = record.step + iterations  # after the rollout's optimizer steps
    cb.on_train_batch_end(trainer, module, None, None, 0)


def events(path: Path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"tensors": 0, "histograms": 0})
    acc.Reload()
    return acc


def texts(acc: EventAccumulator, tag: str = TEXT_TAG) -> dict[int, str]:
    if tag not in acc.Tags()["tensors"]:
        return {}
    return {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)}


class Cells(HTMLParser):
    """Rows of a rendered HTML table, as lists of cell texts (``<br>`` -> newline)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.rows: list[list[str]] = []
        self.cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self.cell = []
        elif tag == "br" and self.cell is not None:
            self.cell.append("\n")

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.rows[-1].append("".join(self.cell).strip())
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


def render(markdown: str) -> list[list[str]]:
    parser = Cells()
    parser.feed(markdown_to_safe_html(markdown))
    return parser.rows


# ---------------------------------------------------------------------- the table


def test_table_renders_every_text_literally_and_the_numbers(tmp_path):
    record = make_record(step=0)
    trainer, module = fake(tmp_path)
    cb = CompletionSamples(every_n_steps=5, max_prompts=2)
    step(cb, trainer, module, record)
    table = texts(events(tmp_path / "tb"))[0]
    rows = render(table)
    assert rows[0] == ["prompt", "completion", "reward", "accuracy", "format", "weight"]
    assert len(rows) == 1 + 2 * 2  # max_prompts x G, the third prompt is left out
    assert all(len(r) == 6 for r in rows)  # no '|' or newline split a row
    assert [r[0] for r in rows[1:]] == ["a | b =", "", "line1\nline2", ""]
    assert [r[1] for r in rows[1:]] == ["3 |", "<think>", "7\n8", "\\|"]
    assert [r[2:] for r in rows[1:]] == [
        ["1.5", "1", "0.5", "0.6"], ["0.5", "0", "0.5", "0.4"],
        ["0", "0", "0", "0.3"], ["0.5", "0", "0.5", "0.7"],
    ]


def test_chat_prompts_are_shown_as_their_messages(tmp_path):
    """A dataset of chat messages (``apply_chat_template``) gives message lists as prompts:
    the table shows them one ``role: content`` line each (it failed at the first step)."""
    record = make_record(step=0)
    chats = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "3 + 1 ="}],
             [{"role": "user", "content": "2 | 2"}], [{"role": "user", "content": "x"}]]
    record = RolloutSamples(**{**vars(record), "prompts": chats})
    trainer, module = fake(tmp_path)
    step(CompletionSamples(every_n_steps=5, max_prompts=2), trainer, module, record)
    rows = render(texts(events(tmp_path / "tb"))[0])
    assert [r[0] for r in rows[1:]] == ["system: be brief\nuser: 3 + 1 =", "", "user: 2 | 2", ""]


def test_table_shows_advantages_when_the_objective_has_them(tmp_path):
    trainer, module = fake(tmp_path)
    cb = CompletionSamples(every_n_steps=1, max_prompts=10)
    step(cb, trainer, module, make_record(weights=False, advantages=True))
    rows = render(texts(events(tmp_path / "tb"))[0])
    assert rows[0][-1] == "advantage" and "weight" not in rows[0]
    assert len(rows) == 1 + 3 * 2
    assert [r[0] for r in rows[5:]] == ["x*y_z `q`", ""]  # markdown specials stay literal
    assert rows[6][1] == "[x](y)"
    assert [float(r[-1]) for r in rows[1:]] == [0.5, -0.5, -1.0, 1.0, 0.25, -0.25]


def test_long_texts_are_cut():
    text = "7" * (MAX_CELL_CHARS + 50)
    assert escape_cell(text) == "7" * MAX_CELL_CHARS + "…"
    assert escape_cell("short") == "short"
    assert escape_cell("a\r\nb|c") == "a<br>b\\|c"


def test_histograms_of_rewards_weights_and_advantages(tmp_path):
    record = make_record(advantages=True)
    record.rewards[1, 1] = math.nan  # non-finite values are left out of the histogram
    trainer, module = fake(tmp_path)
    step(cb := CompletionSamples(every_n_steps=1), trainer, module, record)
    acc = events(tmp_path / "tb")
    assert set(acc.Tags()["histograms"]) == {"samples/reward", "samples/weight",
                                             "samples/advantage"}
    reward = acc.Histograms("samples/reward")[0].histogram_value
    assert reward.num == 5 and reward.sum == pytest.approx(1.5 + 0.5 + 0.0 + 1.5 + 1.0)
    assert (reward.min, reward.max) == (0.0, 1.5)
    weight = acc.Histograms("samples/weight")[0].histogram_value
    assert weight.num == 6 and weight.sum == pytest.approx(3.0)  # each group sums to 1
    adv = acc.Histograms("samples/advantage")[0].histogram_value
    assert (adv.min, adv.max) == (-1.0, 1.0)
    assert cb.histograms


def test_no_histograms_when_disabled(tmp_path):
    trainer, module = fake(tmp_path)
    step(CompletionSamples(every_n_steps=1, histograms=False), trainer, module, make_record())
    acc = events(tmp_path / "tb")
    assert acc.Tags()["histograms"] == [] and list(texts(acc)) == [0]


# ---------------------------------------------------------------------- schedule and ranks


def test_written_only_at_multiples_of_every_n_steps(tmp_path):
    trainer, module = fake(tmp_path)
    cb = CompletionSamples(every_n_steps=3)
    for s in range(8):
        step(cb, trainer, module, make_record(step=s))
    cb.on_train_batch_end(trainer, module, None, None, 0)  # the same record again: ignored
    acc = events(tmp_path / "tb")
    assert sorted(texts(acc)) == [0, 3, 6]
    assert [e.step for e in acc.Histograms("samples/reward")] == [0, 3, 6]


def test_rollouts_spanning_several_steps_write_when_they_cross_a_multiple(tmp_path):
    # num_iterations = 2: rollouts at steps 0, 2, 4, 6, 8, each trained on at its own step
    # and the next; with n = 3 the multiples 0, 3, 6, 9 fall in the rollouts of steps 0, 2
    # (steps 2 and 3), 6 and 8 (steps 8 and 9); the rollout after the one holding 3 (step
    # 4) was written instead
    trainer, module = fake(tmp_path)
    cb = CompletionSamples(every_n_steps=3)
    for s in range(0, 10, 2):
        step(cb, trainer, module, make_record(step=s), iterations=2)
    assert sorted(texts(events(tmp_path / "tb"))) == [0, 2, 6, 8]


def test_other_ranks_write_nothing(tmp_path):
    trainer, module = fake(tmp_path, rank0=False)
    cb = CompletionSamples(every_n_steps=1, jsonl_path=str(tmp_path / "r.jsonl"))
    step(cb, trainer, module, make_record())
    assert texts(events(tmp_path / "tb")) == {}
    assert not (tmp_path / "r.jsonl").exists()


def test_the_cli_config_is_logged_once_at_fit_start(tmp_path):
    (tmp_path / "config.yaml").write_text("model:\n  objective: ListwiseMaxEnt\n")
    trainer, module = fake(tmp_path)
    cb = CompletionSamples()
    cb.on_fit_start(trainer, module)
    cb.on_train_start(trainer, module)
    config = texts(events(tmp_path / "tb"), "hparams/config/text_summary")
    assert config == {0: "    model:\n      objective: ListwiseMaxEnt"}


def test_a_resumed_fits_config_is_logged_at_the_step_it_resumes_from(tmp_path):
    """It was written at step 0 (Lightning restores the step after ``on_fit_start``), where
    TensorBoard keeps one text a step: the resumed fit's options showed as the first's (a
    hunt of logging backends)."""
    (tmp_path / "config.yaml").write_text("model:\n  temperature: 1.0\n")
    trainer, module = fake(tmp_path)
    first = CompletionSamples()
    first.on_fit_start(trainer, module)
    first.on_train_start(trainer, module)
    (tmp_path / "config.yaml").write_text("model:\n  temperature: 0.7\n")
    resumed = CompletionSamples()
    resumed.on_fit_start(trainer, module)  # the checkpoint is restored after this hook
    trainer.fit_loop = SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=3))
    trainer.global_step = 6  # num_iterations 2: the scalars' step is the batch's
    resumed.on_train_start(trainer, module)
    config = texts(events(tmp_path / "tb"), "hparams/config/text_summary")
    assert config == {0: "    model:\n      temperature: 1.0",
                      3: "    model:\n      temperature: 0.7"}


# ---------------------------------------------------------------------- JSONL


def test_a_jsonl_path_whose_folder_cannot_be_made_names_the_option(tmp_path):
    """It said only "[Errno 2] No such file or directory: '/proc/self/nope'" (a hunt)."""
    trainer, _ = fake(tmp_path)
    (tmp_path / "afile").write_text("x")
    cb = CompletionSamples(every_n_steps=1, jsonl_path=str(tmp_path / "afile" / "r.jsonl"))
    with pytest.raises(ValueError, match=r"CompletionSamples.jsonl_path '.*afile/r.jsonl': its "
                                         r"folder cannot be made \(.*\); name a file in a "
                                         "folder you can write to"):
        cb.on_fit_start(trainer, None)


def test_a_jsonl_path_in_the_home_folder_is_written_there(tmp_path, monkeypatch):
    """``~/rollouts.jsonl`` made a folder named ``~`` where the run started (a hunt)."""
    trainer, _ = fake(tmp_path / "run")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    cb = CompletionSamples(every_n_steps=1, jsonl_path="~/rollouts.jsonl")
    cb.on_fit_start(trainer, None)
    assert cb._resolve_jsonl(trainer) == tmp_path / "home" / "rollouts.jsonl"
    assert not (tmp_path / "~").exists()


def test_jsonl_has_every_completion_of_every_step(tmp_path):
    trainer, module = fake(tmp_path)
    cb = CompletionSamples(every_n_steps=100, jsonl_path="{log_dir}/samples/run.jsonl")
    path = tmp_path / "samples" / "run.jsonl"
    first = make_record(step=0, weights=False, advantages=True)
    first.rewards[2, 1] = math.inf
    step(cb, trainer, module, first)
    assert len(path.read_text().splitlines()) == 3 * 2  # flushed after the step
    step(cb, trainer, module, make_record(step=1))
    step(cb, trainer, module, make_record(step=2))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 3 * 3 * 2
    assert [r["step"] for r in lines] == [0] * 6 + [1] * 6 + [2] * 6
    assert [r["prompt_index"] for r in lines[:6]] == [0, 0, 1, 1, 2, 2]
    assert lines[3] == {
        "step": 0, "prompt_index": 1, "prompt": "line1\nline2", "answer": "2",
        "completion": "\\|",
        "reward": 0.5, "components": {"accuracy": 0.0, "format": 0.5},
        "advantage": 1.0, "weight": None, "q": None,
    }
    assert lines[5]["reward"] is None  # inf is not JSON
    assert lines[6]["weight"] == pytest.approx(0.6) and lines[6]["advantage"] is None
    assert set(texts(events(tmp_path / "tb"))) == {0}  # the table stays every 100 steps


# ---------------------------------------------------------------------- other loggers

COLUMNS = ["step", "prompt_index", "prompt", "completion", "reward", "reward/accuracy",
           "reward/format", "advantage", "weight", "q"]


def expected_table(step: int) -> list[list]:
    """The first 2 prompts of :func:`make_record` (weights, no advantages) as table rows."""
    return [
        [step, 0, "a | b =", "3 |", 1.5, 1.0, 0.5, None, pytest.approx(0.6), None],
        [step, 0, "a | b =", "<think>", 0.5, 0.0, 0.5, None, pytest.approx(0.4), None],
        [step, 1, "line1\nline2", "7\n8", 0.0, 0.0, 0.0, None, pytest.approx(0.3), None],
        [step, 1, "line1\nline2", "\\|", 0.5, 0.0, 0.5, None, pytest.approx(0.7), None],
    ]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_other_loggers_get_the_table_as_jsonl_in_their_log_folder(tmp_path, recwarn):
    csv = CSVLogger(str(tmp_path / "csv"))
    trainer, module = fake(tmp_path, loggers=[csv])
    cb = CompletionSamples(every_n_steps=2, max_prompts=2, jsonl_path=str(tmp_path / "r.jsonl"))
    for s in range(4):
        step(cb, trainer, module, make_record(step=s))
    rows = read_jsonl(Path(csv.log_dir) / "samples" / "completions.jsonl")
    assert [r["step"] for r in rows] == [0] * 4 + [2] * 4  # max_prompts x G per written step
    assert rows[2] == {
        "step": 0, "prompt_index": 1, "prompt": "line1\nline2", "answer": "2",
        "completion": "7\n8",
        "reward": 0.0, "components": {"accuracy": 0.0, "format": 0.0},
        "advantage": None, "weight": pytest.approx(0.3), "q": None,
    }
    assert len(read_jsonl(tmp_path / "r.jsonl")) == 4 * 6  # the dump: every row, every step
    assert not [w for w in recwarn if "CompletionSamples" in str(w.message)]


def test_without_a_logger_nothing_is_written_and_the_log_says_how_to_keep_samples(
    tmp_path, caplog,
):
    trainer, module = fake(tmp_path, loggers=[])
    cb = CompletionSamples(every_n_steps=1, max_prompts=1)
    with caplog.at_level("INFO"):
        step(cb, trainer, module, make_record(step=0))
        step(cb, trainer, module, make_record(step=1))
    assert list(tmp_path.iterdir()) == []  # not the run folder, not the cwd
    told = [r for r in caplog.records if "no samples table" in r.getMessage()]
    assert len(told) == 1 and "jsonl_path" in told[0].getMessage()


def test_every_logger_of_the_run_gets_the_table(tmp_path):
    csv = CSVLogger(str(tmp_path / "csv"))
    tb = SimpleNamespace(experiment=SummaryWriter(str(tmp_path / "tb")))
    trainer, module = fake(tmp_path, loggers=[csv, tb])
    step(CompletionSamples(every_n_steps=1, max_prompts=2), trainer, module, make_record())
    assert list(texts(events(tmp_path / "tb"))) == [0]
    assert len(read_jsonl(Path(csv.log_dir) / "samples" / "completions.jsonl")) == 2 * 2


def test_a_jsonl_dump_at_the_table_file_is_not_written_twice(tmp_path):
    trainer, module = fake(tmp_path, loggers=[])
    cb = CompletionSamples(every_n_steps=1, max_prompts=1,
                           jsonl_path="{log_dir}/samples/completions.jsonl")
    step(cb, trainer, module, make_record(step=0))
    step(cb, trainer, module, make_record(step=1))
    rows = read_jsonl(tmp_path / "samples" / "completions.jsonl")
    assert [(r["step"], r["prompt_index"]) for r in rows] == [
        (s, i) for s in (0, 1) for i in (0, 0, 1, 1, 2, 2)
    ]


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B in offline mode with every folder under ``tmp_path``; the run is finished after."""
    wandb = pytest.importorskip("wandb")
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield
    wandb.finish()


def wandb_tables(logger: WandbLogger) -> list[dict]:
    """The tables the offline run saved, in the order they were logged."""
    files = Path(logger.experiment.dir).glob("media/table/samples/completions_*.table.json")
    files = sorted(files, key=lambda f: int(f.name.split("_")[1]))  # completions_<_step>_
    return [json.loads(f.read_text()) for f in files]


def test_wandb_gets_a_table_per_written_step(tmp_path, wandb_offline):
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="samples")
    trainer, module = fake(tmp_path, loggers=[logger])
    cb = CompletionSamples(every_n_steps=2, max_prompts=2)
    for s in range(4):
        step(cb, trainer, module, make_record(step=s))
    tables = wandb_tables(logger)
    assert [t["columns"] for t in tables] == [COLUMNS, COLUMNS]
    assert [t["data"] for t in tables] == [expected_table(0), expected_table(2)]
    assert not (tmp_path / "samples").exists()  # no JSONL fallback for W&B


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A local MLflow file store (MLflow 3 refuses it unless allowed)."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return str(tmp_path / "mlruns")


def mlflow_table(logger: MLFlowLogger, step: int) -> dict:
    path = logger.experiment.download_artifacts(logger.run_id, f"samples/step_{step}.json")
    return json.loads(Path(path).read_text())


def test_mlflow_gets_a_table_artifact_per_written_step(tmp_path, mlflow_store):
    logger = MLFlowLogger(experiment_name="samples", save_dir=mlflow_store)
    trainer, module = fake(tmp_path, loggers=[logger])
    cb = CompletionSamples(every_n_steps=2, max_prompts=3)
    for s in range(3):
        step(cb, trainer, module, make_record(step=s))
    names = [f.path for f in logger.experiment.list_artifacts(logger.run_id, "samples")]
    assert names == ["samples/step_0.json", "samples/step_2.json"]
    table = mlflow_table(logger, 2)
    assert table["columns"] == COLUMNS
    assert table["data"][:4] == expected_table(2)
    assert [r[3] for r in table["data"][4:]] == ["42", "[x](y)"]  # texts stay texts
    assert not (tmp_path / "samples").exists()


# ---------------------------------------------------------------------- bad options


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_steps": 0}, "every_n_steps must be an int >= 1; got 0"),
        ({"every_n_steps": 2.5}, "every_n_steps"),
        ({"max_prompts": 0}, "max_prompts must be an int >= 1; got 0"),
        ({"max_prompts": True}, "max_prompts"),
        ({"jsonl_path": " "}, "jsonl_path must be None or a non-empty path"),
    ],
)
def test_bad_options_name_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CompletionSamples(**kwargs)


def test_a_record_whose_shapes_disagree_is_refused(tmp_path):
    record = make_record()
    record.generation.grouped_completions[1] = ["only one"]
    trainer, module = fake(tmp_path)
    with pytest.raises(ValueError, match="completions"):
        step(CompletionSamples(every_n_steps=1), trainer, module, record)


# ---------------------------------------------------------------------- a real fit


def make_data(cache_dir: str) -> PromptDataModule:
    return PromptDataModule(
        task="arithmetic_easy", task_options={"bare": True}, train_size=64, val_size=8,
        batch_size=4, max_prompt_length=32, tokenizer="builtin:tiny",
        tokenizer_cache_dir=cache_dir,
    )


def make_module(cache_dir: str) -> MaxEntGRPOModule:
    # max_prompt_length as the CLI links it (Lightning merges both hparams for the logger)
    return MaxEntGRPOModule(
        rewards={"first_number": 1.0}, num_generations=4, max_completion_length=4,
        max_prompt_length=32, model_cache_dir=cache_dir,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
    )


def test_a_real_fit_writes_samples_at_the_steps_of_the_scalars(tmp_path, tmp_path_factory):
    cache_dir = str(tmp_path_factory.mktemp("models"))
    logger = TensorBoardLogger(str(tmp_path), name="run", default_hp_metric=False)
    cb = CompletionSamples(every_n_steps=1, max_prompts=2, jsonl_path="{log_dir}/r.jsonl")
    L.seed_everything(0)
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", devices=1, logger=logger, callbacks=[cb],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, log_every_n_steps=1,
    )
    trainer.fit(make_module(cache_dir), make_data(cache_dir))
    acc = events(Path(logger.log_dir))
    samples = texts(acc)
    scalar_steps = [e.step for e in acc.Scalars("train/reward/mean")]
    assert sorted(samples) == scalar_steps == [0, 1]
    rows = render(samples[1])
    assert rows[0] == ["prompt", "completion", "reward", "first_number", "advantage"]
    assert len(rows) == 1 + 2 * 4  # max_prompts x G
    lines = (Path(logger.log_dir) / "r.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 4 * 4  # steps x B x G
    assert (Path(logger.log_dir) / "hparams.yaml").is_file()  # Lightning's own hparams


def fit(tmp_path, tmp_path_factory, loggers, cb: CompletionSamples) -> None:
    cache_dir = str(tmp_path_factory.mktemp("models"))
    L.seed_everything(0)
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", devices=1, logger=loggers, callbacks=[cb],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, log_every_n_steps=1, default_root_dir=str(tmp_path),
    )
    trainer.fit(make_module(cache_dir), make_data(cache_dir))


def test_a_real_fit_with_a_csv_logger_writes_the_table_next_to_its_metrics(
    tmp_path, tmp_path_factory
):
    logger = CSVLogger(str(tmp_path), name="run")
    fit(tmp_path, tmp_path_factory, logger, CompletionSamples(every_n_steps=1, max_prompts=2))
    rows = read_jsonl(Path(logger.log_dir) / "samples" / "completions.jsonl")
    assert [r["step"] for r in rows] == [0] * 8 + [1] * 8  # steps x max_prompts x G
    assert [r["prompt_index"] for r in rows[:8]] == [0] * 4 + [1] * 4
    assert set(rows[0]["components"]) == {"first_number"}
    assert all(isinstance(r["advantage"], float) and r["weight"] is None for r in rows)
    metrics = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    steps = {
        int(line.split(",")[header.index("step")]) for line in metrics[1:]
        if line.split(",")[header.index("train/reward/mean")]
    }
    assert steps == {0, 1}  # the table's steps are those of the scalars


def test_a_real_fit_with_wandb_and_mlflow_loggers_writes_both_tables(
    tmp_path, tmp_path_factory, wandb_offline, mlflow_store
):
    wandb_logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="samples")
    mlflow_logger = MLFlowLogger(experiment_name="samples", save_dir=mlflow_store)
    cb = CompletionSamples(every_n_steps=1, max_prompts=1)
    fit(tmp_path, tmp_path_factory, [wandb_logger, mlflow_logger], cb)
    tables = wandb_tables(wandb_logger)
    assert [[r[0] for r in t["data"]] for t in tables] == [[0] * 4, [1] * 4]
    assert tables[0]["columns"] == ["step", "prompt_index", "prompt", "completion", "reward",
                                    "reward/first_number", "advantage", "weight", "q"]
    for s in (0, 1):
        table = mlflow_table(mlflow_logger, s)
        assert table["columns"] == tables[0]["columns"]
        assert table["data"] == tables[s]["data"]  # the same rows in both loggers
    assert not (tmp_path / "samples").exists()


def test_a_jsonl_path_that_is_a_folder_fails_at_fit_start(tmp_path):
    """It failed after the first step with "Is a directory", naming no option."""
    trainer, module = fake(tmp_path)
    with pytest.raises(ValueError, match="CompletionSamples.jsonl_path .* is a folder"):
        CompletionSamples(jsonl_path=str(tmp_path)).on_fit_start(trainer, module)


def test_a_resumed_fit_drops_the_rows_it_writes_again(tmp_path):
    """Resumed from step 2, a fit writes steps 2, 3, ... again: their earlier rows (and a
    line cut short by a kill) leave the run's JSONL dump and the loggers' samples files; a
    row whose text holds U+2028 or U+0085 is one row. A ``jsonl_path`` outside the run's
    folder may hold other runs' rows, and keeps them."""
    dump = tmp_path / "csv" / "rollouts.jsonl"  # {log_dir}: the first logger's folder
    shared = tmp_path / "shared.jsonl"
    logged = tmp_path / "csv" / "samples" / "completions.jsonl"
    logged.parent.mkdir(parents=True)
    rows = "".join(json.dumps({"step": s, "completion": "a\u2028b\x85c"}, ensure_ascii=False)
                   + "\n" for s in range(5)) + '{"step": 5, "rew'
    for path in (dump, logged, shared):
        path.write_text(rows, "utf-8")
    trainer, module = fake(tmp_path, loggers=[SimpleNamespace(log_dir=str(tmp_path / "csv"))])
    for jsonl_path in ("{log_dir}/rollouts.jsonl", str(shared)):
        cb = CompletionSamples(every_n_steps=1, jsonl_path=jsonl_path)
        cb.on_fit_start(trainer, module)
        trainer.global_step = 2
        cb.on_train_start(trainer, module)
        trainer.global_step = 0
    def lines(path: Path) -> list[dict]:  # on "\n" only: str.splitlines splits U+2028 too
        return [json.loads(line) for line in path.read_text("utf-8").split("\n") if line]

    assert [r["step"] for r in lines(dump)] == [0, 1]
    assert [r["step"] for r in lines(logged)] == [0, 1]
    assert lines(dump)[0]["completion"] == "a\u2028b\x85c"
    assert shared.read_text("utf-8") == rows
    dump.write_text(json.dumps({"step": 7}) + "\n")  # a fresh fit into a file appends
    CompletionSamples(every_n_steps=1, jsonl_path=str(dump)).on_train_start(trainer, module)
    assert [r["step"] for r in read_jsonl(dump)] == [7]


def test_a_full_disk_names_the_jsonl_and_a_resume_with_nothing_to_drop_copies_nothing(
        tmp_path, monkeypatch):
    """A full disk while rows were appended said "[Errno 28] No space left on device"
    alone; a resume copied the whole file to drop nothing (on a nearly full disk it failed,
    leaving its half-written temporary beside it)."""
    import builtins
    import errno

    from maxent_grpo.training.callbacks import samples

    path = tmp_path / "rollouts.jsonl"
    samples.append_jsonl(path, [{"step": 0, "completion": "4"}, {"step": 1, "completion": "5"}])
    real_open = builtins.open

    class Full:  # a file made, then the disk full at its first write
        def __init__(self, file) -> None:
            self.file = real_open(file, "wb")

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.file.close()

        def writelines(self, lines) -> None:
            self.file.write(b"{")
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_disk(file, mode="r", *args, **kwargs):
        if mode == "wb":
            return Full(file)
        if any(c in mode for c in "aw"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_disk)
    with pytest.raises(OSError, match=rf"writing {path} failed: no space left"):
        samples.append_jsonl(path, [{"step": 2, "completion": "6"}])
    assert samples.drop_steps_from(path, 2) == 0  # nothing to drop: no copy written
    with pytest.raises(OSError, match=rf"writing {path} failed: no space left.*as it was"):
        samples.drop_steps_from(path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollouts.jsonl"]
    monkeypatch.undo()
    from maxent_grpo.validation import HOST

    killed = tmp_path / f".rollouts.jsonl.{HOST}-999999999.tmp"  # a rewrite killed: its
    killed.write_text("cut")  # temporary was left by each one, named by its process (readers)
    assert samples.drop_steps_from(path, 1) == 1
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollouts.jsonl"]
