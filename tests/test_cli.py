"""The command line: every shipped config parses and builds, the links hold, bad input is named.

Configs are parsed with the real parser of :func:`maxent_grpo.cli.main`; the model and data
classes are then built from the parsed values (cheap: construction loads no model and no
dataset), and so is a Trainer with the config's settings on CPU (GPU configs cannot build
their GPU Trainer here). Nothing trains in this file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml

import maxent_grpo.cli.parser as cli_module
from maxent_grpo import objectives
from maxent_grpo.builtin.catalog import BUILTIN_MODELS, DEFAULT_CACHE_DIR
from maxent_grpo.cli import help as cli_help
from maxent_grpo.training.data.datamodule import PromptDataModule
from maxent_grpo.training.module import MaxEntGRPOModule

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


class ParseOnlyCLI(cli_module.MaxEntGRPOCLI):
    """The project's CLI, stopped after parsing (no classes, no Trainer)."""

    def instantiate_classes(self) -> None:
        pass


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch):
    # LightningCLI warns when both ``args`` and a non-empty sys.argv (pytest's) are present.
    monkeypatch.setattr(sys, "argv", ["maxent_grpo"])


def parse(monkeypatch, *args: str):
    """``main(args, run=False)`` with the real parser, stopped before instantiation."""
    monkeypatch.setattr(cli_module, "MaxEntGRPOCLI", ParseOnlyCLI)
    return cli_module.main(list(args), run=False)


def build(cli) -> Any:
    """Instantiate every class in the parsed config (model, data, logger, callbacks)."""
    return cli.parser.instantiate(cli.config)


def read_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


# ---------------------------------------------------------------------------- shipped configs


def test_the_config_folder_is_covered():
    names = {p.name for p in CONFIGS}
    assert len(CONFIGS) >= 6, names
    assert {
        "tiny.yaml", "smollm2_countdown.yaml", "qwen2.5-0.5b_grpo.yaml",
        "qwen2.5-0.5b_listwise.yaml", "qwen2.5-0.5b_entropy.yaml",
        "qwen2.5-1.5b_math_listwise.yaml",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_builds(path, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # relative logger/checkpoint folders must land here, if anywhere
    raw = read_yaml(path)
    cli = parse(monkeypatch, "--config", str(path))
    cfg = cli.config

    # the YAML's values arrive, and the links fill the data side
    assert cfg.model.model_name_or_path == raw["model"]["model_name_or_path"]
    assert cfg.data.tokenizer == cfg.model.model_name_or_path
    assert cfg.data.tokenizer_cache_dir == cfg.model.model_cache_dir
    assert cfg.model.max_prompt_length == cfg.data.max_prompt_length
    assert cfg.model.objective.class_path == raw["model"]["objective"]["class_path"]

    # the constructors accept the values
    init = build(cli)
    model, data = init.model, init.data
    assert isinstance(model, MaxEntGRPOModule) and isinstance(data, PromptDataModule)
    assert model.policy is None and data.train_dataset is None  # nothing loaded yet
    objective_cls = raw["model"]["objective"]["class_path"].rsplit(".", 1)[1]
    assert type(model.objective) is getattr(objectives, objective_cls)
    for key, value in raw["model"]["objective"].get("init_args", {}).items():
        assert getattr(model.objective, key) == value, key
    assert model.rewards.names == list(raw["model"]["rewards"])
    optimizer = model.optimizer_factory([torch.nn.Parameter(torch.zeros(1))])
    assert type(optimizer).__name__ == raw["model"]["optimizer"]["class_path"].rsplit(".", 1)[1]
    assert optimizer.param_groups[0]["lr"] == raw["model"]["optimizer"]["init_args"]["lr"]

    # the Trainer accepts the settings (on CPU: GPU configs cannot build their Trainer here)
    trainer_kwargs = dict(init.trainer)
    trainer_kwargs.update(accelerator="cpu", devices=1, default_root_dir=str(tmp_path))
    trainer = L.Trainer(**trainer_kwargs)
    assert trainer.max_steps == raw["trainer"]["max_steps"]


def test_the_tools_reach_the_data_and_an_environment_parses(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    config = str(ROOT / "configs/tiny_tools.yaml")
    cfg = parse(monkeypatch, "--config", config).config
    assert cfg.model.tools == cfg.data.tools == ["calculate"]  # linked
    cli = parse(monkeypatch, "--config", config, "--model.tools", "null")
    assert cli.config.model.tools is None and cli.config.data.tools is None
    # the shipped "without the tool" run builds: the config's tool options are dropped, said
    with pytest.warns(UserWarning, match=r"dropped model.max_tool_calls=2, model.tool_timeout"):
        assert build(cli).model.loop.generation.tools is None
    env = '{class_path: tests.rollout.test_multiturn.Guess, init_args: {limit: 5}}'
    cli = parse(monkeypatch, "--config", config, "--model.tools", "null",
                "--model.environment", env)
    assert cli.config.model.environment == {"class_path": "tests.rollout.test_multiturn.Guess",
                                            "init_args": {"limit": 5}}
    model = build(cli).model
    assert model.loop.generation.tools.environment().limit == 5
    # the class path alone, as --model.objective takes one (it was a parse error)
    cli = parse(monkeypatch, "--config", config, "--model.tools", "null",
                "--model.environment", "tests.rollout.test_multiturn.Guess")
    assert build(cli).model.loop.generation.tools.environment().limit == 100


GPU_CONFIGS = [p for p in CONFIGS if read_yaml(p)["trainer"].get("accelerator") == "gpu"]


def test_there_are_gpu_configs():
    assert len(GPU_CONFIGS) >= 4


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_gpu_configs_keep_float32_weights_under_bf16_autocast(path):
    raw = read_yaml(path)
    assert raw["trainer"]["precision"] == "bf16-mixed"
    assert raw["trainer"]["devices"] == 1
    # bf16 weights under bf16-mixed would also keep the AdamW state in bf16
    assert raw["model"]["dtype"] == "float32"
    if "1.5b" in path.name.lower():
        assert raw["model"]["gradient_checkpointing"] is True


def test_the_three_half_billion_configs_differ_only_in_the_objective():
    """grpo / listwise / entropy on Qwen2.5-0.5B are a comparison: same everything else."""
    stripped = []
    for name in ("grpo", "listwise", "entropy"):
        raw = read_yaml(ROOT / "configs" / f"qwen2.5-0.5b_{name}.yaml")
        assert raw["trainer"]["logger"]["init_args"].pop("name") == f"qwen2.5-0.5b_{name}"
        saver = raw["trainer"]["callbacks"][0]["init_args"]  # its folder named by the run
        assert saver.pop("dirpath") == f"lightning_logs/qwen2.5-0.5b_{name}/checkpoints"
        raw["model"].pop("objective")
        stripped.append(raw)
    assert stripped[0] == stripped[1] == stripped[2]


def test_math_config_reads_one_hub_dataset_with_a_system_prompt(monkeypatch):
    cfg = parse(monkeypatch, "--config", str(ROOT / "configs/qwen2.5-1.5b_math_listwise.yaml"))
    data = cfg.config.data
    assert data.task is None and data.data_files is None
    assert (data.dataset_name, data.dataset_config) == ("openai/gsm8k", "main")
    assert (data.prompt_column, data.answer_column) == ("question", "answer")
    assert "<answer>" in data.system_prompt and "<think>" in data.system_prompt
    assert "accuracy" in cfg.config.model.rewards


def test_accuracy_reward_reads_the_number_after_hashes_in_a_gsm8k_style_answer():
    """The math config feeds GSM8K's worked solutions to ``accuracy`` unchanged: the final
    number (after ``####``) must count, not the intermediate ones."""
    from maxent_grpo.rewards import get_reward

    gold = (
        "Each box holds 4 rows of 6 = <<4*6=24>>24 eggs.\n"
        "Three boxes hold 3 * 24 = <<3*24=72>>72 eggs, and 72 - 5 = <<72-5=67>>67 are left.\n"
        "#### 67"
    )
    completions = [f"<think>...</think><answer>{x}</answer>" for x in ("67", "72", "24", "6")]
    scores = get_reward("accuracy")(["q"] * 4, completions, answer=[gold] * 4)
    assert scores == [1.0, 0.0, 0.0, 0.0]


SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_DIR = Path(DEFAULT_CACHE_DIR).expanduser() / f"{SMOLLM2}-v{BUILTIN_MODELS[SMOLLM2][0]}"


@pytest.mark.skipif(not SMOLLM2_DIR.is_dir(), reason="SmolLM2 not converted (make setup-smollm2)")
def test_smollm2_config_keeps_every_countdown_prompt(monkeypatch):
    """``data.max_prompt_length`` must fit the countdown prompts as SmolLM2's chat template
    renders them (it adds a default system message): no row may be dropped."""
    config = str(ROOT / "configs/smollm2_countdown.yaml")
    data = build(parse(monkeypatch, "--config", config, "--data.train_size", "400")).data
    data.setup("fit")
    assert data.dropped == {"train": 0, "val": 0}
    assert len(data.train_dataset) > 0
    assert data.train_dataset[0].prompt.startswith("<|im_start|>system")


# ---------------------------------------------------------------------------- links


def test_links_copy_model_name_cache_dir_and_prompt_length(monkeypatch):
    cli = parse(
        monkeypatch,
        "--model.model_name_or_path", "builtin:smollm2-135m-instruct",
        "--model.model_cache_dir", "/tmp/models",
        "--data.max_prompt_length", "77",
    )
    cfg = cli.config
    assert cfg.data.tokenizer == "builtin:smollm2-135m-instruct"
    assert cfg.data.tokenizer_cache_dir == "/tmp/models"
    assert cfg.model.max_prompt_length == 77


def test_a_link_target_cannot_be_set_directly(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(monkeypatch, "--data.tokenizer", "gpt2")
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "data.tokenizer" in err and "model.model_name_or_path" in err


def print_config(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(["fit", *args, "--print_config"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_print_config_round_trips(capsys, tmp_path):
    """``--print_config`` (also what a run saves as config.yaml) reads back to the same
    config; objective and optimizer appear as ``class_path`` + ``init_args``."""
    printed = print_config(capsys, "--config", str(ROOT / "configs/smollm2_countdown.yaml"))
    dumped = yaml.safe_load(printed)
    assert dumped["model"]["objective"]["class_path"] == "maxent_grpo.objectives.ListwiseMaxEnt"
    assert dumped["model"]["optimizer"]["class_path"] == "torch.optim.AdamW"
    assert dumped["model"]["optimizer"]["init_args"]["lr"] == 5e-6
    assert "tokenizer" not in dumped["data"]  # a link target is derived, never written

    copy = tmp_path / "printed.yaml"
    copy.write_text(printed)
    assert print_config(capsys, "--config", str(copy)) == printed


def test_a_callback_whose_str_option_defaults_to_an_enum_is_written_and_read_back(capsys,
                                                                                 tmp_path):
    """Lightning's ``Timer`` (``interval: str = Interval.step``) stopped every fit at the
    config's dump: "RepresenterError: cannot represent an object". Written as its value."""
    printed = print_config(capsys, "--config", "tiny",
                           "--trainer.callbacks+=lightning.pytorch.callbacks.Timer")
    timer = yaml.safe_load(printed)["trainer"]["callbacks"][-1]
    assert timer["class_path"].endswith("Timer") and timer["init_args"]["interval"] == "step"
    copy = tmp_path / "printed.yaml"
    copy.write_text(printed)
    assert print_config(capsys, "--config", str(copy)) == printed


# ---------------------------------------------------------------------------- bad input


def parse_error(monkeypatch, capsys, *args: str) -> str:
    """Parse ``args``; return jsonargparse's error text (it exits with a non-zero code)."""
    with pytest.raises(SystemExit) as exit_info:
        parse(monkeypatch, *args)
    assert exit_info.value.code != 0
    return capsys.readouterr().err.split("error:", 1)[-1]


def test_unknown_key_on_the_command_line_is_named(monkeypatch, capsys):
    err = parse_error(monkeypatch, capsys, "--model.bogus", "1")
    assert "--model.bogus" in err


def test_unknown_key_in_a_yaml_file_is_named(monkeypatch, capsys, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("model:\n  num_generations: 4\n  bogus: 1\n")
    err = parse_error(monkeypatch, capsys, "--config", str(config))
    assert "bogus" in err


def test_wrong_type_names_the_key_and_the_value(monkeypatch, capsys):
    err = parse_error(monkeypatch, capsys, "--model.num_generations", "abc")
    assert "model.num_generations" in err and "abc" in err


def test_unknown_choice_lists_the_allowed_values(monkeypatch, capsys):
    err = parse_error(
        monkeypatch, capsys, "--model.objective", "GRPO", "--model.objective.loss_type", "foo"
    )
    assert "loss_type" in err and "foo" in err and "dr_grpo" in err


def test_an_option_of_another_objective_is_named(monkeypatch, capsys):
    err = parse_error(
        monkeypatch, capsys, "--model.objective", "GRPO", "--model.objective.tau", "0.3"
    )
    assert "'tau'" in err and "GRPO" in err


SHIPPED_OBJECTIVES = ("GRPO", "EntropyMaxEnt", "ListwiseMaxEnt", "GroupMaxEnt")


@pytest.mark.parametrize("args, name, shipped, closest", [
    (["--model.objective", "Nope"], "Nope", SHIPPED_OBJECTIVES, None),
    (["--model.objective", "grpo"], "grpo", SHIPPED_OBJECTIVES, "GRPO"),
    (["--model.objective.help", "Entropymaxent"], "Entropymaxent", SHIPPED_OBJECTIVES,
     "EntropyMaxEnt"),
    (["--model.engine", "HFEngine"], "HFEngine",
     ("HFGenerateEngine", "VLLMEngine", "VLLMServerEngine"), "HFGenerateEngine"),
], ids=["objective", "lower-case", "objective-help", "engine"])
def test_a_class_name_that_names_no_class_lists_the_ones_it_could_be(monkeypatch, capsys,
                                                                     args, name, shipped,
                                                                     closest):
    """Was jsonargparse's "Expected a dot import path string: Nope" among what every other
    type of the option accepts (a config path, None), listing no objective. (Other
    subclasses imported, such as the tests' own objectives, are listed too.)"""
    err = parse_error(monkeypatch, capsys, *args).strip()
    option = args[0].removesuffix(".help")
    assert err.startswith(f"{option}: no class named {name!r}: give one of "), err
    listed = err.split("give one of ", 1)[1].split(", or a class's import path")[0].split(", ")
    assert set(shipped) <= set(listed) and "VLLMEngineBase" not in listed
    assert "or a class's import path (my_module.MyClass)" in err
    hint = err.split("; did you mean ", 1)[1] if "did you mean" in err else ""
    assert (closest in hint.rstrip("?").split(" or ")) if closest else not hint


@pytest.mark.parametrize("args, start", [
    (["--trainer.strategy.cluster_environment", "Nope"],
     "--trainer.strategy.cluster_environment (lightning.pytorch.strategies.DDPStrategy): no "
     "class named 'Nope': give one of "),
    (["--trainer.strategy.cluster_environment", "LightningEnvironment",
      "--trainer.strategy.cluster_environment.foo", "3"],
     "--trainer.strategy.cluster_environment (lightning.fabric.plugins.environments."
     "LightningEnvironment): Option 'foo' is not accepted"),
], ids=["unknown-class", "unknown-argument"])
def test_a_nested_class_options_error_names_the_whole_option(monkeypatch, capsys, args, start):
    """A class option's own class option (a strategy's cluster environment) was said as
    ``--trainer.strategy (DDPStrategy): --cluster_environment: ...``."""
    err = parse_error(monkeypatch, capsys, "--trainer.strategy", "DDPStrategy", *args).strip()
    assert err.startswith(start), err


def built_error(monkeypatch, tmp_path, *args: str, exc: type[Exception] = ValueError) -> str:
    """Run the real CLI (parse + build, no fit) and return the constructor's error text."""
    monkeypatch.chdir(tmp_path)  # a Trainer that did get built must write nothing here
    with pytest.raises(exc) as exc_info:
        cli_module.main(list(args), run=False)
    return str(exc_info.value)


def test_one_generation_per_group_is_rejected_by_the_module(monkeypatch, tmp_path):
    err = built_error(monkeypatch, tmp_path, "--model.num_generations", "1")
    assert "model.num_generations" in err and ">= 2" in err


def test_unknown_reward_name_lists_the_registered_ones(monkeypatch, tmp_path):
    err = built_error(monkeypatch, tmp_path, "--model.rewards", "{nope: 1.0}")
    assert "model.rewards" in err and "'nope'" in err and "'accuracy'" in err


def test_objective_constructor_error_names_the_option(monkeypatch, tmp_path):
    err = built_error(
        monkeypatch, tmp_path,
        "--model.objective", "ListwiseMaxEnt", "--model.objective.tau", "0.0",
    )
    assert "objective.tau" in err


def test_unknown_task_lists_the_built_in_ones(monkeypatch, tmp_path):
    err = built_error(monkeypatch, tmp_path, "--data.task", "sudoku")
    assert "'sudoku'" in err and "'countdown'" in err


def test_missing_data_file_is_named(monkeypatch, tmp_path):
    err = built_error(
        monkeypatch, tmp_path,
        "--data.task", "null", "--data.data_files", "/no/such/file.jsonl",
        exc=FileNotFoundError,
    )
    assert "/no/such/file.jsonl" in err and "data_files" in err


def test_data_files_take_a_list_or_a_glob(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the Trainer built here must write nothing elsewhere
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text('{"prompt": "x", "answer": "1"}\n')
    listed = cli_module.main(
        ["--data.task", "null", "--data.data_files", f"[{tmp_path}/a.jsonl, {tmp_path}/b.jsonl]"],
        run=False,
    )
    assert listed.datamodule.data_files == [f"{tmp_path}/a.jsonl", f"{tmp_path}/b.jsonl"]
    globbed = cli_module.main(
        ["--data.task", "null", "--data.data_files", "*.jsonl", "--data.val_files", "b.jsonl"],
        run=False,
    )
    assert (globbed.datamodule.data_files, globbed.datamodule.val_files) == ("*.jsonl", "b.jsonl")
    err = built_error(monkeypatch, tmp_path, "--data.task", "null", "--data.data_files", "c*.jsonl",
                      exc=FileNotFoundError)
    assert "data.data_files pattern matches no file: 'c*.jsonl'" in err
    assert f"relative paths are read from the working folder {os.getcwd()}" in err  # which


def test_two_data_sources_are_rejected(monkeypatch, tmp_path):
    err = built_error(monkeypatch, tmp_path, "--data.dataset_name", "openai/gsm8k")
    assert "exactly one of" in err and "task: null" in err


# ---------------------------------------------------------------------------- help


def test_fit_help_lists_the_objective_and_the_task(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(["fit", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--model.objective", "--model.rewards", "--data.task", "--config"):
        assert option in out, option


def _help_page(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(list(args))
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_fit_help_is_one_sentence_per_option_and_help_all_is_whole(capsys):
    short = _help_page(capsys, "fit", "--help")
    whole = _help_page(capsys, "fit", "--help-all")
    assert len(short.splitlines()) < 0.5 * len(whole.splitlines())
    # our options come before Lightning's Trainer options on the short page only
    assert short.index("--model.objective") < short.index("--trainer.max_steps")
    assert whole.index("--trainer.max_steps") < whole.index("--model.objective")
    assert "lightning.pytorch.accelerators.CPUAccelerator" in whole
    assert "CPUAccelerator" not in short
    assert "--model.objective.help" in whole and "--model.objective.help " not in short
    assert cli_help.TRAINER_TITLE in short and cli_help.TRAINER_TITLE not in whole
    # a short default is shown, the first sentence of a long description is kept
    assert "--model.num_generations" in short and "(default: 8)" in short
    assert "Stop training after this number of steps." in short
    assert "``" not in short  # reStructuredText markup is cleaned up


def test_without_run_the_parser_answers_help_itself(capsys):
    """``main(..., run=False)`` has no subcommands: ``--help`` is the parser's own page."""
    page = _help_page_run_false(capsys)
    assert "--model.objective" in page and "commands:" not in page


def _help_page_run_false(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(["--help"], run=False)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_the_top_level_page_lists_the_cli_commands_without_importing_lightning(capsys):
    assert list(cli_help.SUBCOMMANDS) == list(cli_module.MaxEntGRPOCLI.subcommands())
    page = _help_page(capsys, "--help")
    for name in cli_help.SUBCOMMANDS:
        assert f"\n  {name} " in page
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main([])
    assert exit_info.value.code == 2 and "commands:" in capsys.readouterr().err
    probe = (  # `python -m maxent_grpo --help`, then: was Lightning imported?
        "import runpy, sys; sys.argv = ['maxent_grpo', '--help']\n"
        "try:\n    runpy.run_module('maxent_grpo', run_name='__main__')\n"
        "except SystemExit as e:\n    code = e.code\n"
        "print('CODE', code, 'lightning' in sys.modules, 'torch' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert run.stdout.strip().splitlines()[-1] == "CODE 0 False False", run.stdout + run.stderr
    assert "commands:" in run.stdout


def test_objective_help_lists_that_objectives_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(["fit", "--model.objective.help", "ListwiseMaxEnt"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--model.objective.tau" in out and "--model.objective.q_temperature" in out
    assert out.startswith("usage: python -m maxent_grpo")  # was named after sys.argv[0]


def test_an_engine_is_named_by_its_short_name_as_an_objective_is(capsys):
    """``--model.engine.help HFGenerateEngine`` and ``--model.engine VLLMEngine`` were
    refused ("Expected a dot import path string"): only the full class path was taken, while
    the objectives took their short names (a reported defect)."""
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(["fit", "--model.engine.help", "VLLMServerEngine"])
    assert exit_info.value.code == 0
    assert "--model.engine.urls" in capsys.readouterr().out
    printed = yaml.safe_load(print_config(capsys, "--model.engine", "VLLMEngine"))
    assert printed["model"]["engine"]["class_path"] == "maxent_grpo.rollout.VLLMEngine"


def test_command_line_options_win_over_a_checkpoints_hyper_parameters(monkeypatch, tmp_path):
    """Lightning's CLI would overwrite model options with the checkpoint's saved ones, so
    `validate --ckpt_path x --model.eval_k [1,2]` would silently evaluate pass@1 only."""

    class Parsed(Exception):
        pass

    class CaptureCLI(cli_module.MaxEntGRPOCLI):
        def instantiate_classes(self) -> None:
            raise Parsed(self.config)

    ckpt = tmp_path / "x.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {
        "eval_k": [1], "eval_num_generations": 2, "model_name_or_path": "elsewhere",
    }}, ckpt)
    monkeypatch.setattr(cli_module, "MaxEntGRPOCLI", CaptureCLI)
    with pytest.raises(Parsed) as caught:
        cli_module.main([
            "validate", "--ckpt_path", str(ckpt), "--model.eval_num_generations=4",
            "--model.eval_k=[1,2]",
        ])
    model = caught.value.args[0].validate.model
    assert model.eval_k == [1, 2] and model.eval_num_generations == 4
    assert model.model_name_or_path == "builtin:tiny"  # a mismatch is refused at load time


def test_the_saved_config_records_the_seed_that_seed_everything_true_used(monkeypatch):
    """``seed_everything: true`` takes a seed (a process Lightning's DDP launcher started:
    its first process's, else a random one: it was always 0, so every "random" run was the
    same, against the option's help); the config saved with the run (config.yaml) records
    that number, so that the run can be made again from it. Several runs in one process
    (a notebook, a sweep): an earlier run's seed left in the environment was taken by every
    later ``true`` and recorded by an unseeded run."""
    from maxent_grpo.cli import seeds
    from maxent_grpo.training.run.checkpoint import SEED_ENV, run_seed

    class Parsed(Exception):
        pass

    class CaptureCLI(cli_module.MaxEntGRPOCLI):
        def instantiate_classes(self) -> None:
            raise Parsed(self.config)

    def seed(value: str = "true"):
        with pytest.raises(Parsed) as caught:
            cli_module.main(["fit", "--seed_everything", value])
        return caught.value.args[0].fit.seed_everything

    fresh = dict.fromkeys(seeds._AT_START)
    monkeypatch.delenv(SEED_ENV, raising=False)  # (the runs set it: taken away after)
    monkeypatch.setattr(cli_module, "MaxEntGRPOCLI", CaptureCLI)
    launched = {**fresh, SEED_ENV: "7", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    monkeypatch.setattr(seeds, "_AT_START", launched)  # a process the DDP launcher started
    assert seed() == 7
    monkeypatch.setattr(seeds, "_AT_START", {**launched, SEED_ENV: "none"})  # (a resume of
    assert seed() is False  # an unseeded run: the first process set its seed aside)
    monkeypatch.setattr(seeds, "_AT_START", fresh)  # a process that started unseeded
    drawn = []
    for _ in range(2):
        monkeypatch.setenv("PL_GLOBAL_SEED", "123")  # an earlier run's, in this process
        monkeypatch.setenv("WORLD_SIZE", "2")  # an earlier DDP run's launcher set it here
        drawn.append(seed())
        assert os.environ[SEED_ENV] == str(drawn[-1])  # for the processes it launches
    assert all(isinstance(s, int) and not isinstance(s, bool) for s in drawn)
    assert drawn[0] != drawn[1] and 123 not in drawn  # equal once in four billion
    monkeypatch.setenv("PL_GLOBAL_SEED", "123")
    assert seed("false") is False and run_seed() is False  # not recorded as seeded with 123
    assert os.environ[SEED_ENV] == "none"
    interactive = {**fresh, "SLURM_NTASKS": "4", "SLURM_JOB_NAME": "interactive"}
    monkeypatch.setattr(seeds, "_AT_START", interactive)  # Lightning launches them itself
    assert isinstance(seed(), int)
    monkeypatch.setattr(seeds, "_AT_START", {**fresh, "GROUP_RANK": "0", "WORLD_SIZE": "1",
                                             "NODE_RANK": "0"})  # torchrun of one process
    assert isinstance(seed(), int)
    for started, args in (({**fresh, "WORLD_SIZE": "2"}, []),  # torchrun
                          ({**interactive, "SLURM_JOB_NAME": "train"}, []),  # srun -n 4
                          (fresh, ["--trainer.num_nodes", "2"]),  # each node's launcher
                          ({**fresh, "NODE_RANK": "1"}, [])):
        monkeypatch.setattr(seeds, "_AT_START", started)
        with pytest.raises(ValueError, match="would draw another seed in each of the "
                                             "processes"):
            cli_module.main(["fit", "--seed_everything", "true", *args])


def test_a_spawning_strategy_is_refused_before_the_spawn(monkeypatch, tmp_path):
    """``--trainer.strategy ddp_spawn`` died pickling the CLI's trainer for the spawned
    processes, reported as "a bug" with its traceback (a hunt of the docs' claims)."""
    monkeypatch.chdir(tmp_path)
    for stage in ("fit", "validate"):
        with pytest.raises(ValueError, match="start method 'spawn' runs each process on a copy"):
            cli_module.main([stage, "--config", "tiny", "--trainer.strategy", "ddp_spawn",
                             "--trainer.devices", "2", "--trainer.logger=false",
                             "--trainer.callbacks", "null",
                             "--trainer.enable_checkpointing=false"])


@pytest.mark.parametrize("content", [b'{"prompt": "1+1", "answer": "2"}\n',
                                     b"PK\x03\x04" + b"0" * 64],
                         ids=["not-a-checkpoint", "cut-short"])
def test_a_ckpt_path_file_that_is_no_checkpoint_is_named_not_loaded(monkeypatch, tmp_path,
                                                                     content):
    """Lightning's CLI loaded the file (for its hyper-parameters) before any check: a file
    that is no checkpoint failed with torch's traceback instead of the checkpoint check."""
    bad = tmp_path / "data.ckpt"
    bad.write_bytes(content)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="is not usable: truncated, corrupt or unsafe"):
        cli_module.main(["validate", "--ckpt_path", str(bad), "--trainer.logger=false"])


def test_a_sharded_checkpoint_folder_needs_a_strategy_that_reads_one(monkeypatch, tmp_path):
    """An FSDP2 checkpoint's folder given to a one-process run failed with a bare "[Errno
    21] Is a directory"; it names the folder and the two ways on."""
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"")
    (folder / "meta.pt").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"is a sharded checkpoint's folder .* SingleDevice"
                                         r"Strategy cannot read: .* maxent-grpo export"):
        cli_module.main(["validate", "--ckpt_path", str(folder), "--trainer.logger=false"])


def test_a_linked_option_given_directly_names_the_one_to_give(capsys):
    """``--model.max_prompt_length`` (set from ``data.max_prompt_length``) failed with
    jsonargparse's "int | None is not callable"; a bad value named the option not typed."""
    with pytest.raises(SystemExit):
        cli_module.main(["fit", "--model.max_prompt_length", "5"], exit_on_error=True)
    assert ("--model.max_prompt_length is set from --data.max_prompt_length (linked options "
            "are given once): give --data.max_prompt_length instead") in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"max_prompt_length must be .* got 0 \(data\."
                                         r"max_prompt_length sets it\)"):
        cli_module.main(["fit", "--data.max_prompt_length", "0", "--trainer.logger=false"])


@pytest.mark.parametrize("text, target", [
    ("model:\n  max_prompt_length: 1\n", "model.max_prompt_length"),
    ("data:\n  tokenizer: ./nonexistent_tok\n", "data.tokenizer"),
])
def test_a_config_that_sets_a_linked_option_is_refused(tmp_path, text, target):
    """The parser dropped a link's target set in a config file without a word (the run
    went on with the source's value)."""
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    short = ["--trainer.logger=false", "--trainer.max_steps=1", "--trainer.limit_val_batches=0",
             "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]",
             f"--trainer.default_root_dir={tmp_path}"]  # a fit it starts is short
    with pytest.raises(ValueError, match=f"--config {path} sets {target}, which is set from"):
        cli_module.main(["fit", "--config", str(path), *short])
    with pytest.raises(ValueError, match=f"sets {target}"):  # inline YAML too
        cli_module.main(["fit", f"--config={{{text.split(':')[0]}: {{{target.split('.')[1]}"
                                f": 1}}}}", *short])
    with pytest.raises(ValueError, match=f"sets {target}"):  # block-style inline YAML
        cli_module.main(["fit", "--config", text, *short])
    group, key = target.split(".")
    with pytest.raises(ValueError, match=f"--{group} {{{key}: 1}} sets {target}"):  # a group
        cli_module.main(["fit", f"--{group}", f"{{{key}: 1}}", *short])
    dotted = tmp_path / "dotted.yaml"
    dotted.write_text(f"{target}: 1\n")
    with pytest.raises(ValueError, match=f"sets {target}"):
        cli_module.main(["fit", "--config", str(dotted), *short])
    (tmp_path / "inner.yaml").write_text(f"{key}: 1\n")
    outer = tmp_path / "outer.yaml"
    outer.write_text(f"{group}: inner.yaml\n")  # the group's own file, beside the config
    with pytest.raises(ValueError, match=f"sets {target}"):
        cli_module.main(["fit", "--config", str(outer), *short])
    with pytest.raises(ValueError, match=f"--{group} {tmp_path / 'inner.yaml'} sets"):
        cli_module.main(["fit", f"--{group}", str(tmp_path / "inner.yaml"), *short])
    whole = tmp_path / "whole.yaml"  # a whole-CLI config's fit: section (it passed unread)
    whole.write_text(f"fit:\n  {group}:\n    {key}: 1\n")
    with pytest.raises(ValueError, match=f"--config {whole} sets {target}"):
        cli_module.cli_help.check_given_configs(["--config", str(whole), "fit"])


def test_the_config_check_reads_yaml_as_the_parser_does(tmp_path):
    """It read with yaml.safe_load, where an impossible date (a run named 2025-02-29)
    raised ValueError: a valid config was refused; a tag it cannot read was "a bug"."""
    dated = tmp_path / "dated.yaml"
    dated.write_text("trainer:\n  logger:\n    init_args:\n      name: 2025-02-29\n")
    cli_module.cli_help.check_given_configs(["fit", "--config", str(dated)])
    cli_module.cli_help.check_given_configs(["fit", "--config", "a: !!bool x"])


def test_a_config_before_its_subcommand_is_refused_naming_the_order(tmp_path, capsys):
    """``--config tiny fit --print_config`` wrote the defaults (another model, task and no
    step limit) with exit code 0; without --print_config the parser named an obscure key."""
    with pytest.raises(ValueError, match=r"--config .*tiny.yaml comes before the subcommand "
                                         r"'fit'.*\(.* fit --config .*tiny.yaml\)"):
        cli_module.main(["--config", "tiny", "fit", "--print_config"])
    whole = tmp_path / "whole.yaml"  # a whole-CLI config, a section per subcommand: allowed
    whole.write_text("fit:\n  trainer:\n    max_steps: 3\n")
    with pytest.raises(SystemExit):
        cli_module.main(["--config", str(whole), "fit", "--print_config"])
    assert "max_steps: 3" in capsys.readouterr().out


def test_a_whole_cli_configs_keys_outside_its_sections_are_refused(tmp_path):
    """Beside ``fit:``, ``seed_everything``, ``model``, ``data`` and ``trainer`` were dropped
    without a word (seed 0, the defaults trained), and a misspelt section too (a hunt)."""
    whole = tmp_path / "whole.yaml"
    whole.write_text("seed_everything: 5\nfit:\n  trainer:\n    max_steps: 7\nmodel:\n"
                     "  num_generations: 4\nvalidat:\n  trainer:\n    max_steps: 3\n")
    with pytest.raises(ValueError, match=r"only a section per subcommand \(fit, validate, test, "
                       r"predict\) is read; its keys 'seed_everything', 'model', 'validat' "
                       r"\(did you mean 'validate'\?\) would be ignored"):
        cli_module.cli_help.check_given_configs(["--config", str(whole), "fit"])
    whole.write_text("subcommand: validate\nfit:\n  trainer:\n    max_steps: 7\n")
    cli_module.cli_help.check_given_configs(["--config", str(whole), "fit"])  # the parser's


def test_an_option_given_before_a_config_whose_group_or_class_file_sets_it_is_refused(
        tmp_path):
    """``--data.batch_size 16 --config c.yaml`` with ``data: d.yaml`` there trained batch 8
    without a word (the same in the config itself was refused; a hunt): group and class
    files are read, beside the config or in the working folder."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.yaml").write_text("batch_size: 8\n")
    (tmp_path / "sub" / "obj.yaml").write_text(
        "class_path: maxent_grpo.objectives.GRPO\ninit_args:\n  beta: 0.3\n")
    config = tmp_path / "sub" / "c.yaml"
    config.write_text("data: d.yaml\nmodel:\n  objective: obj.yaml\n")
    for before in (["--data.batch_size", "16"], ["--model.objective.beta", "0.7"]):
        with pytest.raises(ValueError, match=f"{before[0]} is given before --config {config}"):
            cli_module.cli_help.check_given_configs(["fit", *before, "--config", str(config)])
    cli_module.cli_help.check_given_configs(["fit", "--data.shuffle", "false", "--config",
                                            str(config)])  # an option the files do not set


def test_an_option_given_before_a_config_that_sets_it_is_refused(tmp_path, capsys):
    """``fit --trainer.max_steps 3 --config tiny`` trained 800 steps: the later value wins
    and the typed one was dropped without a word (a hunt); after the config it is taken,
    and so is an option before a config that does not set it."""
    mine = tmp_path / "mine.yaml"
    mine.write_text("trainer:\n  max_steps: 800\nmodel:\n  objective.init_args.beta: 0.1\n")
    for given in (["--trainer.max_steps", "3"], ["--trainer.max_steps=3"],
                  ["--model.objective.init_args.beta=0.2"]):
        option = given[0].partition("=")[0]
        with pytest.raises(ValueError, match=f"{option} is given before --config {mine}, "
                                             f"which sets it too.*give {option} after"):
            cli_module.cli_help.check_given_configs(["fit", *given, "--config", str(mine)])
    cli_module.cli_help.check_given_configs(["fit", "--config", str(mine), "--trainer.max_steps",
                                            "3", "--model.top_p=0.9", "--config", "x: 1"])
    cli_module.cli_help.check_given_configs(["fit", "--model.top_p=0.9", "--config", str(mine)])
    with pytest.raises(ValueError, match="--trainer.max_steps is given before --config"):
        cli_module.main(["fit", "--trainer.max_steps", "3", "--config", "tiny", "--print_config"])
    # a class's or a group's options in the config are merged with one given before it
    # (readers: those were refused); a list appended to (+=) is replaced, and a short form
    # without init_args is the same option
    tiny = str(ROOT / "configs" / "tiny.yaml")
    for before, config in ((["--model.objective", "EntropyMaxEnt"], str(mine)),
                           (["--trainer.logger", "CSVLogger"], "{trainer: {logger: {init_args: "
                                                               "{name: mine}}}}"),
                           (["--model", "{temperature: 0.7}"], "{model: {top_p: 0.5}}")):
        cli_module.cli_help.check_given_configs(["fit", *before, "--config", config])
    for before in (["--trainer.callbacks+=LearningRateMonitor"],
                   ["--model.objective.beta", "0.2"],
                   ["--model.rewards={first_number: 2.0, format: 1.0}"],  # a mapping option
                   ["--trainer.logger=CSVLogger"]):  # another class
        option = before[0].partition("=")[0].removesuffix("+")
        with pytest.raises(ValueError, match=f"{option} is given before --config"):
            cli_module.cli_help.check_given_configs(["fit", *before, "--config", tiny])
    # the config's class is the one given: its options are merged (readers)
    cli_module.cli_help.check_given_configs([
        "fit", "--trainer.logger=TensorBoardLogger", "--trainer.logger.version=fixed",
        "--config", tiny])
    for before in (["--trainer.logger", "{class_path: lightning.pytorch.loggers."
                                        "TensorBoardLogger, init_args: {version: fixed}}"],
                   ["--model.optimizer", "{class_path: torch.optim.AdamW, init_args: "
                                         "{betas: [0.8, 0.9]}}"],
                   ["--model", "{top_p: 0.5}"]):  # options the config does not set: kept
        cli_module.cli_help.check_given_configs(["fit", *before, "--config", tiny])
    for before in (["--model", "{optimizer: {class_path: torch.optim.AdamW, init_args: "
                               "{betas: [0.8, 0.9]}}}"],  # a class in a group's mapping
                   ["--trainer", "{logger: {class_path: lightning.pytorch.loggers."
                                 "TensorBoardLogger, init_args: {version: fixed}}}"]):
        cli_module.cli_help.check_given_configs(["fit", *before, "--config", tiny])
    for before in (["--trainer", "{max_steps: 3}"], ["--model", "{temperature: 0.7}"],
                   ["--model", "{rewards: {format: 0.5}}"],  # a mapping the config replaces
                   ["--model.rewards.format", "0.5"]):
        with pytest.raises(ValueError, match=f"{before[0]} is given before --config"):
            cli_module.cli_help.check_given_configs(["fit", *before, "--config", tiny])


def test_the_subcommands_are_fit_validate_test_and_predict(capsys):
    """``predict`` writes graded completions (tests/test_predict.py); a command that does not
    exist is refused, naming them and ``export``."""
    assert set(cli_module.MaxEntGRPOCLI.subcommands()) == {"fit", "validate", "test", "predict"}
    with pytest.raises(SystemExit):
        cli_module.main(["sample"], exit_on_error=True)
    assert "'sample' is not a command; choose from fit, validate, test, predict, export" in (
        capsys.readouterr().err)


def test_a_mistyped_command_is_answered_with_every_command_export_too():
    """The console answers before LightningCLI, whose list lacked ``export``."""
    from maxent_grpo.cli import help as cli_help

    page, code = cli_help.quick_help(["--traceback", "exprt", "run.ckpt"])
    assert code == 2 and "choose from fit, validate, test, predict, export" in page
    assert "did you mean export?" in page
    assert cli_help.quick_help(["fit", "--config", "tiny"]) is None
    assert cli_help.quick_help(["--config", "tiny", "fit"]) is None


def test_the_console_command_imports_a_module_of_the_working_folder(tmp_path):
    """``maxent-grpo fit ... {my_rewards:score: 1.0}`` run from the folder of
    ``my_rewards.py`` said "No module named 'my_rewards'" where ``python -m maxent_grpo``
    trained: a console script puts its bin folder on ``sys.path``, not the working folder (a
    hunt of the extension points)."""
    (tmp_path / "my_rewards.py").write_text("def score(prompts, completions, **kw):\n"
                                            "    return [1.0] * len(completions)\n")
    script = ("import sys\nsys.path[0] = sys.argv[1]  # a console script's: its bin folder\n"
              "sys.argv = ['maxent-grpo', '--version']\n"
              "from maxent_grpo.__main__ import console\n"
              "try:\n    console()\nexcept SystemExit:\n    pass\n"
              "from maxent_grpo.rewards.registry import get_reward\n"
              "print(get_reward('my_rewards:score')(prompts=['p'], completions=['c']))\n")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "bin")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0 and run.stdout.strip().endswith("[1.0]"), run.stdout + run.stderr


def test_a_checkpoint_callback_without_a_folder_trains(monkeypatch, tmp_path, capsys):
    """A ``Checkpoint`` that is not a ``ModelCheckpoint`` (Lightning's base, a user's own
    saver) has no ``dirpath``: the fit's folder checks and its end summary crashed on it as
    "a bug" (AttributeError) before or after training."""
    monkeypatch.chdir(tmp_path)
    cli_module.main(["fit", "--config", "tiny", "--trainer.max_steps", "1",
                     "--trainer.callbacks+=lightning.pytorch.callbacks.Checkpoint"])
    assert "fit done: 1 steps" in capsys.readouterr().out
    assert (tmp_path / "lightning_logs" / "tiny" / "checkpoints").is_dir()


def test_no_checkpointing_with_a_configured_checkpoint_names_the_fix(monkeypatch, tmp_path):
    """Lightning's "Trainer was configured with enable_checkpointing=False but found
    ModelCheckpoint in callbacks list" named no way out of a shipped config's saver."""
    tiny = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    err = built_error(monkeypatch, tmp_path, "--config", tiny,
                      "--trainer.enable_checkpointing", "false")
    assert "trainer.callbacks has a ModelCheckpoint" in err and "--trainer.callbacks '[]'" in err


def test_a_config_file_that_is_not_yaml_is_named(monkeypatch, tmp_path, capsys):
    """jsonargparse said "in '<unicode string>', line 2": which of several --config files
    was broken was for the user to guess."""
    (tmp_path / "tab.yaml").write_text("model:\n\tnum_generations: 4\n")
    (tmp_path / "indent.yaml").write_text("model:\n  num_generations: 4\n   beta: 2\n")
    (tmp_path / "good.yaml").write_text("model:\n  num_generations: 4\n")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trailing.yaml").write_text("model:\n  num_generations: 4\t\n")
    (tmp_path / "tabbed.json").write_text('{\n\t"model": {"num_generations": 4}\n}\n')
    for accepted in ("trailing.yaml", "tabbed.json"):  # as jsonargparse's loader takes them
        parse(monkeypatch, "--config", str(tmp_path / accepted))
    for name, said in (("tab.yaml", "cannot start any token (line 2, column 1; indent "
                                    "with spaces, not tabs)"),
                       ("indent.yaml", "(line 3, column 8)")):
        with pytest.raises(SystemExit) as stop:
            cli_module.main(["fit", "--config", "good.yaml", "--config", name],
                            exit_on_error=True)
        assert stop.value.code == 1
        err = capsys.readouterr().err
        assert f"error: --config {name} is not valid YAML: " in err and said in err, err


def test_a_config_beyond_ascii_under_a_locale_that_is_not_utf8_is_refused(monkeypatch,
                                                                          tmp_path, capsys):
    """Under a Latin-1 locale the parser read a config's ``Réponds`` as ``RÃ©ponds`` and
    trained with it in silence (a hunt); under an ASCII one it failed naming no file."""
    import locale

    (tmp_path / "fr.yaml").write_text('data:\n  system_prompt: "Réponds"\n', "utf-8")
    (tmp_path / "plain.yaml").write_text("data:\n  batch_size: 4\n", "utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(locale, "getpreferredencoding", lambda *a: "ISO-8859-1")
    with pytest.raises(SystemExit) as stop:
        cli_module.main(["fit", "--config", "tiny", "--config", "fr.yaml"], exit_on_error=True)
    assert stop.value.code == 1
    assert ("error: --config fr.yaml holds text beyond ASCII, which the parser would read as "
            "iso8859-1 (the locale's encoding): run with PYTHONUTF8=1") in capsys.readouterr().err
    parse(monkeypatch, "--config", "plain.yaml")  # ASCII: read alike
    (tmp_path / "noted.yaml").write_text("# § 3 of the docs\ndata:\n  batch_size: 4\n", "utf-8")
    parse(monkeypatch, "--config", "noted.yaml")  # only a comment differs (readers: refused)
    monkeypatch.setattr(locale, "getpreferredencoding", lambda *a: "UTF-8")
    assert parse(monkeypatch, "--config", "fr.yaml").config.data.system_prompt == "Réponds"


@pytest.mark.parametrize("text, said", [
    ("", " holds no options (it is empty or comments only: a failed --print_config > FILE "
         "leaves it empty)"),
    ("# model:\n", " holds no options (it is empty or comments only"),
    ("- model\n", " holds no options (a list, not a mapping"),
    ("data:\nbatch_size: 4\n", ": data: has nothing under it: indent its options below it"),
    ("fit:\n  model:\n  # num_generations: 4\n", ": model: has nothing under it"),
])
def test_a_config_file_without_options_is_named_with_the_fix(text, said, monkeypatch, tmp_path,
                                                              capsys):
    """An empty file said "Unexpected config: "; a group with its options not indented
    under it named a linked key the file never had (a hunt)."""
    (tmp_path / "mine.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        cli_module.main(["fit", "--config", "tiny", "--config", "mine.yaml"],
                        exit_on_error=True)
    assert stop.value.code == 1
    assert f"error: --config mine.yaml{said}" in capsys.readouterr().err


def test_lightnings_advice_to_evaluate_on_one_device_is_not_printed():
    """``validate``/``test`` on two processes printed Lightning's advice to evaluate on one
    device so that each row counts once, which the evaluator already ensures (it drops the
    rows a distributed sampler repeats; a DDP hunt). The filter matches Lightning's own
    message as its data connector formats it."""
    import inspect
    import warnings

    from lightning.pytorch.trainer.connectors import data_connector
    from lightning.pytorch.utilities.warnings import PossibleUserWarning

    from maxent_grpo.cli import help as cli_help

    assert "During `trainer.{trainer_fn.value}()`, it is" in inspect.getsource(data_connector)
    for stage in ("validate", "test"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for message, category in cli_help.QUIET_WARNINGS:
                warnings.filterwarnings("ignore", message, category)
            warnings.warn(f"Using `DistributedSampler` with the dataloaders. During `trainer."
                          f"{stage}()`, it is recommended to use `Trainer(devices=1, "
                          "num_nodes=1)` to ensure each sample/batch gets evaluated exactly "
                          "once.", PossibleUserWarning, stacklevel=1)
        assert caught == []


def test_torchs_deprecation_of_lightnings_all_gather_is_not_printed():
    """Every rank of a run on several processes printed it at the first metric gather:
    Lightning's to act on, not a user's (the two-process demo's console)."""
    import warnings

    from torch.distributed.nn import functional

    from maxent_grpo.cli import help as cli_help

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for message, category in cli_help.QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message, category)
        functional._deprecated("all_gather", "another")  # torch's own text
        functional._deprecated("all_reduce", "another")  # not ours to hide: still printed
    assert [str(w.message).split(" is ")[0] for w in caught] == [
        "torch.distributed.nn.functional.all_reduce"]


def test_every_shipped_config_counts_its_validation_interval_over_the_whole_run():
    """An int ``val_check_interval`` under Lightning's ``check_val_every_n_epoch: 1`` counts
    each epoch's rollouts: the multi-GPU configs' 493-step epochs validated at 50..450 and
    never at step 500 (a hunt of the shipped configs)."""
    counted = []
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        trainer = (yaml.safe_load(path.read_text()) or {}).get("trainer") or {}
        if isinstance(trainer.get("val_check_interval"), int):
            counted.append(path.name)
            assert trainer.get("check_val_every_n_epoch", 1) is None, path
    assert len(counted) >= 20  # the configs that validate by steps


def test_threads_left_running_after_the_command_are_named(capsys):
    """A reward that started a thread that is not a daemon kept the process waiting after
    "Trainer.fit stopped", with no word (a hunt)."""
    import threading

    from maxent_grpo import __main__ as entry

    done = threading.Event()
    poller = threading.Thread(target=done.wait, name="reward-poller")
    poller.start()
    try:
        entry._name_lingering_threads(after=0.05).join(10)
        said = capsys.readouterr().err
        assert "the process waits for" in said and "reward-poller" in said
    finally:
        done.set()
        poller.join()


@pytest.mark.parametrize(("env", "shown"), [({}, True), ({"LOCAL_RANK": "1"}, False),
                                            ({"RANK": "0"}, True), ({"SLURM_LOCALID": "3"}, False)])
def test_the_console_command_prints_the_packages_progress_lines(monkeypatch, capsys, env,
                                                                 shown):
    """The first use's conversion of SmolLM2 (a minute), an export or a SIGTERM's stop were
    logged at INFO, which nothing printed: the console showed only progress bars (a first
    hour with SmolLM2). The command prints them, from each node's first process only."""
    import logging

    from maxent_grpo import __main__ as entry

    for key in entry.RANK_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # (pytest's capture is one)
    entry._show_progress()
    entry._show_progress()  # once per process: not printed twice
    logging.getLogger("maxent_grpo.builtin.catalog").info("materialising x into y")
    logging.getLogger("maxent_grpo.models").warning("a warning")
    err = capsys.readouterr().err
    assert ("materialising x into y\n" in err) == shown and err.count("a warning\n") == 1
    # a program that configured logging itself (a root handler) prints them its own way
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    logging.getLogger("maxent_grpo.models").warning("a warning")
    assert capsys.readouterr().err == ""
