"""The short ``fit --help`` page shows whole first sentences, and a mistyped option is named
with the closest real ones ("did you mean"), a prefix of an option being a mistake too.

Every test here parses only (nothing is built or trained).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest
from jsonargparse import ArgumentParser

import maxent_grpo.cli.parser as cli_module
from maxent_grpo import objectives
from maxent_grpo.cli import errors, parse_errors
from maxent_grpo.cli import help as cli_help

HELP_COLUMN = 24  # argparse's help position: where a description starts on the page
DEFAULT = re.compile(r"\s*\(default: .*\)$")  # the short default after a description
OBJECTIVES = ("GRPO", "EntropyMaxEnt", "ListwiseMaxEnt", "GroupMaxEnt")
TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch):
    # LightningCLI warns when both ``args`` and a non-empty sys.argv (pytest's) are present.
    monkeypatch.setattr(sys, "argv", ["maxent_grpo"])


# ---------------------------------------------------------------------------- the help page


def fit_help(monkeypatch, capsys) -> tuple[str, ArgumentParser]:
    """The printed ``fit --help`` page and the parser that printed it."""
    printed: list[ArgumentParser] = []
    format_help = cli_module.ShortUsageParser.format_help

    def spy(self):
        printed.append(self)
        return format_help(self)

    monkeypatch.setattr(cli_module.ShortUsageParser, "format_help", spy)
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(["fit", "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out, printed[-1]


def page_entries(page: str) -> dict[str, str]:
    """``{invocation: description}`` of each option (and link) on an argparse page: the
    invocation is indented 2, its description starts at :data:`HELP_COLUMN` on the same
    line (when the invocation is short) or the next, continued by lines indented 24."""
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in page.splitlines():
        if line.startswith(" " * HELP_COLUMN) and current is not None:
            current.append(line.strip())
        elif line.startswith("  ") and not line.startswith("   "):
            head, rest = line[2:], ""
            if len(line) > HELP_COLUMN and line[HELP_COLUMN - 2:HELP_COLUMN] == "  ":
                head, rest = line[2:HELP_COLUMN].rstrip(), line[HELP_COLUMN:].strip()
            current = entries.setdefault(head.rstrip(), [rest] if rest else [])
        else:
            current = None
    return {head: DEFAULT.sub("", " ".join(words)) for head, words in entries.items()}


def squeeze(text: str) -> str:
    """``text`` without whitespace (the page wraps lines, also after a hyphen)."""
    return re.sub(r"\s+", "", text)


def balanced(text: str) -> bool:
    """Whether the brackets outside inline code, and the backticks, of ``text`` pair up."""
    if text.count("`") % 2:
        return False
    depth = 0
    for char in re.sub(r"`[^`]*`", "", text):
        depth += (char in "([{") - (char in ")]}")
        if depth < 0:
            return False
    return depth == 0


def test_fit_help_shows_every_description_up_to_a_sentence_end(monkeypatch, capsys):
    """No description on the short page stops mid-sentence: each is its docstring entry
    whole, or the start of it ending at a ``.`` it keeps or before a ``;`` / ``:`` that
    follows, with its brackets and inline code closed (a cut inside "(e.g. ``{"a": 1}``)"
    or at a line break fails). Every model and data option has one, of at most 160
    characters (three lines of the page: a longer first sentence is to be reworded)."""
    page, parser = fit_help(monkeypatch, capsys)
    shown = page_entries(page)
    checked = set()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or not action.option_strings:
            continue
        first = action.option_strings[0]  # a link's: "model.tools --> data.tools"
        invocation = next((head for head in shown if head == first
                           or head.startswith((f"{first} ", f"{first},"))), None)
        if invocation is None:  # the --x.help CLASS lines: --help-all only
            continue
        text, whole = shown[invocation], cli_help.plain(action.help or "")
        checked.add(action.dest)
        if action.dest.startswith(("model.", "data.")):
            assert text, f"{invocation}: no description"
            assert len(text) <= 160, f"{invocation}: a first sentence of {len(text)} chars"
        if not text:
            continue
        assert squeeze(whole).startswith(squeeze(text)), (invocation, text, whole)
        after = squeeze(whole)[len(squeeze(text)):]
        assert text.endswith(".") or after[:1] in ("", ";", ":"), (invocation, text, whole)
        assert balanced(text), (invocation, text)
    # the check saw the options of each group, the linked ones too
    for dest in ("model.num_generations", "model.micro_batch_tokens", "model.tool_timeout",
                 "data.task_options", "trainer.max_steps", "data.tokenizer", "ckpt_path"):
        assert dest in checked, dest


@pytest.mark.parametrize("name", OBJECTIVES)
def test_every_objective_option_has_a_description(name):
    """The objectives' options (``--model.objective.help NAME``) read the same docstrings."""
    parser = ArgumentParser()
    parser.add_class_arguments(getattr(objectives, name), "objective")
    options = [a for a in parser._actions if a.dest.startswith("objective.")]
    assert options
    for action in options:
        assert cli_help.first_sentence(action.help or ""), f"{name}: {action.dest}"


def test_first_sentence_ends_outside_brackets_code_and_abbreviations():
    first = cli_help.first_sentence
    assert first("Clip, e.g. at 1.0. More here.") == "Clip, e.g. at 1.0."
    assert first("one; two") == "one"
    assert first(":class:`~a.B` and ``x``.") == "`a.B` and `x`."
    assert first("cache (None: the default). More.") == "cache (None: the default)."
    assert first('options (e.g. ``{"digits": 3}``). More.') == 'options (e.g. `{"digits": 3}`).'
    assert first("a (x; y) b: c") == "a (x; y) b"
    assert first("a long\n   line break") == "a long line break"  # never cut mid-text
    assert first("word " * 100) == ("word " * 100).strip()


# ---------------------------------------------------------------------------- did you mean


class ParseOnlyCLI(cli_module.MaxEntGRPOCLI):
    """The project's CLI, stopped after parsing (no classes, no Trainer)."""

    def instantiate_classes(self) -> None:
        pass


def parse_error(monkeypatch, capsys, *args: str, run: bool = True) -> str:
    """The ``error: ...`` line of parsing ``args`` (jsonargparse exits with code 2)."""
    monkeypatch.setattr(cli_module, "MaxEntGRPOCLI", ParseOnlyCLI)
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(list(args), run=run)
    assert exit_info.value.code == errors.PARSE_ERROR_EXIT_CODE
    return capsys.readouterr().err.split("error:", 1)[-1].strip()


def test_a_misspelt_option_names_the_closest_ones(monkeypatch, capsys):
    err = parse_error(monkeypatch, capsys, "fit", "--config", TINY,
                      "--model.num_generatoins", "4")
    assert "--model.num_generatoins" in err
    assert "did you mean --model.num_generations" in err


@pytest.mark.parametrize("last", [[], ["--print_config"]], ids=["parse", "print_config"])
def test_a_misspelt_key_in_a_config_file_names_the_closest_ones(monkeypatch, capsys,
                                                               tmp_path, last):
    """jsonargparse words it "Subcommand 'fit' does not accept option 'model.x'", or under
    ``--print_config`` "Group 'model' does not accept option 'x'": both get the keys."""
    config = tmp_path / "bad.yaml"
    config.write_text("model:\n  num_generatoins: 4\ntrainer:\n  max_steps: 2\n")
    err = parse_error(monkeypatch, capsys, "fit", "--config", str(config), *last)
    assert "does not accept option" in err and "num_generatoins" in err
    assert "did you mean model.num_generations" in err


@pytest.mark.parametrize("run", [True, False], ids=["fit", "no-subcommand"])
def test_a_prefix_of_an_option_is_an_error_naming_the_option(monkeypatch, capsys, run):
    """argparse would take ``--trainer.max_step 5`` as ``--trainer.max_steps 5``."""
    args = ["--trainer.max_step", "5", "--model.num_generation", "4"]
    err = parse_error(monkeypatch, capsys, *(["fit", *args] if run else args), run=run)
    assert "unrecognized arguments: --trainer.max_step 5 --model.num_generation 4" in err
    assert "--trainer.max_step: did you mean --trainer.max_steps" in err
    assert "--model.num_generation: did you mean --model.num_generations" in err


@pytest.mark.parametrize("args, expected", [
    (["--trainer.logger+=CSVLogger"],
     "--trainer.logger (lightning.pytorch.loggers.CSVLogger): the following arguments are "
     "required: save_dir; give it after the class (--trainer.logger.save_dir VALUE) or in its "
     "init_args in a config"),
    (["--model.objective", "EntropyMaxEnt", "--model.objective.alpha", "x"],
     "--model.objective.alpha (maxent_grpo.objectives.EntropyMaxEnt): Expected a <class "
     "'float'>. Got value: x"),
    (["--model.objective", "GRPO", "--model.objective.epsilno", "0.1"],
     "--model.objective (maxent_grpo.objectives.GRPO): Option 'epsilno' is not accepted; did "
     "you mean epsilon or epsilon_high?"),
    (["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps", "x"],
     "--trainer.callbacks.every_n_train_steps (lightning.pytorch.callbacks.ModelCheckpoint): "
     "expected int or null; got 'x'"),  # two problems: the class's, then its base's
    (["--model.objective", "GRPO", "--model.objective.epsilon_high", "x"],
     "--model.objective.epsilon_high (maxent_grpo.objectives.GRPO): expected float or null; "
     "got 'x'"),
    (["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.save_last", "zz"],
     "--trainer.callbacks.save_last (lightning.pytorch.callbacks.ModelCheckpoint): expected "
     "bool or 'link' or null; got 'zz'"),
    # "no class named 'abc': give one of SparseSemiStructuredTensor, ... DTensor" (lr is
    # float | Tensor) inside jsonargparse's callable-type sentence (a hunt)
    (["--model.optimizer.lr", "abc"],
     "--model.optimizer.lr (torch.optim.AdamW): expected a number (float); got 'abc'"),
    (["--model.optimizer.weight_decay", "[1]"],
     "--model.optimizer.weight_decay (torch.optim.AdamW): Expected a <class 'float'>. Got "
     "value: [1]"),
    (["--model.optimizer.fused", "x"],
     "--model.optimizer.fused (torch.optim.AdamW): expected bool or null; got 'x'"),
    (["--model.lr_scheduler", "torch.optim.lr_scheduler.CosineAnnealingLR",
      "--model.lr_scheduler.T_max", "x"],  # optional: the union's sentence around it
     "--model.lr_scheduler.T_max (torch.optim.lr_scheduler.CosineAnnealingLR): Expected a "
     "<class 'int'>. Got value: x"),
], ids=["missing-argument", "bad-value", "unknown-argument", "appended-class", "optional",
        "literal", "optimizer-number", "optimizer-value", "optimizer-optional",
        "scheduler-value"])
def test_a_class_given_by_path_with_wrong_arguments_is_one_line(monkeypatch, capsys, args,
                                                               expected):
    """Not jsonargparse's list of what every type of the option accepts (a bool, None, the
    forms of a class path), with the given value's repr, for one missing argument."""
    assert parse_error(monkeypatch, capsys, "fit", "--config", TINY, *args) == expected


def test_with_traceback_the_raised_parse_error_has_the_suggestion(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(["fit", "--trainer.max_step", "5", errors.TRACEBACK_FLAG],
                        exit_on_error=True)
    assert exit_info.value.code == errors.PARSE_ERROR_EXIT_CODE
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: unrecognized arguments: --trainer.max_step 5; did you mean "
                           "--trainer.max_steps")
    assert last.count(parse_errors.DID_YOU_MEAN) == 1


def test_an_option_an_older_version_had_names_what_took_its_place():
    """An old config's ``model.share_prefill`` and ``model.min_lr_ratio`` were refused with
    no pointer (only ``lr_schedule`` got "did you mean lr_scheduler", by spelling)."""
    options = ["--model.lr_scheduler", "--model.engine"]
    say = parse_errors.did_you_mean
    assert say("unrecognized arguments: --model.share_prefill true", options).endswith(
        "; --model.share_prefill was removed: use --model.engine.init_args.share_prefill")
    assert say("Subcommand 'fit' does not accept option 'model.min_lr_ratio'", options).endswith(
        "; model.min_lr_ratio was removed: use model.lr_scheduler (e.g. CosineAnnealingLR's "
        "eta_min)")


def test_did_you_mean_prefers_the_same_group_and_stays_quiet_without_a_close_name():
    options = ["--config", "--model.gradient_clip_val", "--trainer.gradient_clip_val",
               "--trainer.max_steps", "--model.tools", "--model.tools+", "--model.rewards"]
    say = parse_errors.did_you_mean
    assert say("unrecognized arguments: --model.gradient_clip 1", options).endswith(
        "; did you mean --model.gradient_clip_val?")
    assert say("unrecognized arguments: --model.max_steps 3", options).endswith(
        "; did you mean --trainer.max_steps?")  # the right name in another group
    assert say("unrecognized arguments: --model.tool x", options).endswith(
        "; did you mean --model.tools?")  # the list form --model.tools+ is not offered
    assert say("unrecognized arguments: --model.bogus 1", options) == (
        "unrecognized arguments: --model.bogus 1")
    assert say("Option 'confg' is not accepted", options).endswith("did you mean config?")
    already = "unrecognized arguments: --confg x; did you mean --config?"
    assert say(already, options) == already
    # a key another subcommand has (predict's output under validate) is not its own hint
    assert say("Option 'output' is not accepted", [*options, "--output"]) == (
        "Option 'output' is not accepted")
    # a whole-CLI config given after its subcommand: the hint was the key as written
    assert say("Group 'fit' does not accept option 'model.tools'", options).endswith(
        "; a config with a 'fit:' section goes before the subcommand (python -m maxent_grpo "
        "--config FILE fit); after it, leave out the 'fit:' level")
    assert "a config with" not in say("unrecognized arguments: --fit.model.tools x", options)
