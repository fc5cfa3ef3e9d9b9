"""The command line before Lightning: the help pages, ``--version``, config names and
the configs given checked (:func:`check_given_configs`).

``--config tiny`` names a config shipped in the package (:func:`resolve_config_names`): a
wheel's user has no repository, and a named config is one command away from an editable
file (``--print_config > my.yaml``), so no separate "write a config" command is needed.

``python -m maxent_grpo --help`` is answered here, before Lightning is imported (building
the full parser costs several seconds of imports for a page that lists three commands).
``<command> --help`` prints each option with the first sentence of its description and a
short default, model and data options first, Lightning's Trainer options after them;
``<command> --help-all`` prints jsonargparse's full page (whole docstrings, types, the known
subclasses). This module imports neither Lightning nor torch at module level.
"""

from __future__ import annotations

import codecs
import contextlib
import contextvars
import difflib
import itertools
import locale
import os
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from maxent_grpo.cli.quiet import QUIET_INFO, QUIET_WARNINGS  # noqa: F401 - the CLI's filters

PROG = "python -m maxent_grpo"
HELP_ALL_FLAG = "--help-all"

#: the commands and what each does (``MaxEntGRPOCLI.subcommands`` has the same names, tested)
SUBCOMMANDS: dict[str, str] = {
    "fit": "train: rollout -> score -> loss each step, with validation and checkpoints",
    "validate": "evaluate pass@k on the validation prompts (a checkpoint: --ckpt_path FILE)",
    "test": "validate's evaluation, logged as test/ (a checkpoint: --ckpt_path FILE)",
    "predict": "sample graded completions of the validation prompts into a JSONL file "
               "(--ckpt_path FILE, --output FILE)",
}
#: commands outside LightningCLI: ``maxent-grpo export`` (:mod:`maxent_grpo.cli.export`)
OTHER_COMMANDS: dict[str, str] = {
    "export": "write a checkpoint's model (or adapter) and tokenizer as a Hugging Face folder",
}

#: whether the page being printed is the full one (``--help-all``)
FULL_HELP: contextvars.ContextVar[bool] = contextvars.ContextVar("full_help", default=False)

_SHORT_DEFAULT = 40  # a longer default is left to --help-all and --print_config
_DEFAULT_MARK = "\x00"


def configs_folder() -> Path:
    """The configs shipped inside the package (``configs/`` of the repository links here)."""
    return Path(__file__).resolve().parent.parent / "configs"


def shipped_configs() -> list[str]:
    """The names ``--config`` accepts besides a path: ``tiny``, ``scaling/ddp_cpu_tiny``, ..."""
    folder = configs_folder()
    return sorted(str(p.relative_to(folder).with_suffix("")) for p in folder.rglob("*.yaml"))


def resolve_config_names(args: list[str]) -> list[str]:
    """``args`` with each ``--config NAME`` (or ``-c NAME``) that is not an existing file
    replaced by the shipped config of that name (``tiny`` or ``tiny.yaml`` ->
    ``<package>/configs/tiny.yaml``; ``scaling/ddp_cpu_tiny``).

    A name (no folder in it) that is neither an existing file nor a shipped config raises
    ValueError naming the shipped configs; a file that exists always wins over a name, and a
    missing path is left to the parser. A file name (``tiny.yml``) read as a shipped config
    says so on stderr: it may be a typo of a file the user meant.
    """
    out = list(args)
    for i, arg in enumerate(out):
        if arg in ("--config", "-c") and i + 1 < len(out):
            out[i + 1] = _config_path(out[i + 1])
        elif arg.startswith(("--config=", "-c=")):
            flag, _, value = arg.partition("=")
            out[i] = f"{flag}={_config_path(value)}"
    return out


def _config_path(value: str) -> str:
    if Path(value).is_file():
        _check_yaml(value)
        return value
    if value.lstrip().startswith(("{", "[")) or ":" in value or (
            "\n" in value):  # inline YAML (jsonargparse reads files and text)
        return value
    path_given = "/" in value or os.sep in value  # configs/tiny.yml: a typo of a user's file
    name = value.removesuffix(".yaml")
    name = name if path_given else name.removesuffix(".yml")
    parts = os.path.normpath(name).split(os.sep)
    if len(parts) > 1 and parts[0] == "configs":  # the docs' path, away from a clone: the
        name = "/".join(parts[1:])  # same shipped file
    path = configs_folder() / f"{name}.yaml"
    if name in shipped_configs() and path.is_file():
        if name != value:  # a file name that is not here: say which file is read instead
            print(f"--config {value}: no such file in {Path.cwd()}; reading the shipped "
                  f"config {name} ({path})", file=sys.stderr)
        return str(path)
    if path_given:  # a path: the parser says it does not exist (code 2)
        return value
    names = ", ".join(shipped_configs())
    raise ValueError(
        f"--config {value}: there is no such file (from the folder {Path.cwd()}) and no "
        f"shipped config of that name; the shipped configs are: {names} (e.g. --config "
        "tiny; to edit one, write it out with --print_config > my.yaml)")


def _check_yaml(path: str) -> None:
    """ValueError naming a config file that is not YAML: jsonargparse's message named no
    file ("<unicode string>", line 2), whichever of several --config it was; or one beyond
    ASCII that the parser would read in a locale's encoding other than UTF-8."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # jsonargparse's (libyaml takes
    try:  # a tab where the pure-Python reader does not: a trailing one, a JSON file's)
        raw = Path(path).read_bytes()
        text, reader = raw.decode("utf-8"), codecs.lookup(locale.getpreferredencoding(False)).name
        data = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
        if not text.isascii() and reader != "utf-8":  # Latin-1 garbled it in silence (a
            try:  # comment's § is read alike)
                read = yaml.load(raw.decode(reader), Loader=loader)  # noqa: S506
            except (UnicodeDecodeError, yaml.YAMLError):
                read = None
            if read != data:
                raise ValueError(f"--config {path} holds text beyond ASCII, which the parser "
                                 f"would read as {reader} (the locale's encoding): run with "
                                 "PYTHONUTF8=1 or a UTF-8 locale")
    except (yaml.scanner.ScannerError, yaml.parser.ParserError) as err:  # the syntax
        at, lines = err.problem_mark, text.splitlines()
        line = lines[at.line] if at.line < len(lines) else ""
        tabs = "; indent with spaces, not tabs" if line[at.column:at.column + 1] == "\t" else ""
        raise ValueError(f"--config {path} is not valid YAML: {err.problem} (line "
                         f"{at.line + 1}, column {at.column + 1}{tabs})") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return  # (the parser's own message)
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} holds no options (" + (
            "it is empty or comments only: a failed --print_config > FILE leaves it empty"
            if data is None
            else f"a {type(data).__name__}, not a mapping of groups such as model: and data:")
            + ")")
    sections = [data, *(data[c] for c in SUBCOMMANDS if isinstance(data.get(c), dict))]
    empty = [g for section in sections for g in ("model", "data", "trainer")
             if g in section and section[g] is None]
    if empty:  # the linked options failed first, naming a key the file never had
        raise ValueError(f"--config {path}: {', '.join(g + ':' for g in empty)} has nothing "
                         "under it: indent its options below it (or remove the line)")


def top_level_help() -> str:
    """The page for ``python -m maxent_grpo --help`` (and for no arguments at all)."""
    commands = "\n".join(f"  {name:<10} {text}"
                         for name, text in {**SUBCOMMANDS, **OTHER_COMMANDS}.items())
    return (
        f"usage: {PROG} {{{','.join([*SUBCOMMANDS, *OTHER_COMMANDS])}}} [--config FILE|NAME] "
        "[--<group>.<option> VALUE ...]\n"
        "\nGRPO and MaxEnt-GRPO fine-tuning of language models (PyTorch Lightning).\n"
        f"\ncommands:\n{commands}\n"
        "\nshipped configs (--config NAME):\n"
        + textwrap.fill(", ".join(shipped_configs()), 88, initial_indent="  ",
                        subsequent_indent="  ") + "\n"
        "\nexamples:\n"
        f"  {PROG} fit --config tiny\n"
        f"  {PROG} fit --config tiny --trainer.max_steps 50 --print_config > my.yaml\n"
        f"  {PROG} predict --config tiny --ckpt_path lightning_logs/tiny/checkpoints/last.ckpt\n"
        f"  {PROG} fit --help          options, one line each ({HELP_ALL_FLAG}: in full)\n"
        f"  {PROG} fit --model.objective.help ListwiseMaxEnt   one objective's options\n"
        "\nA mistake in a config or the data prints `error: ...`; --traceback adds the trace.\n"
    )


def quick_help(args: list[str]) -> tuple[str, int] | None:
    """``(page, exit code)`` when ``args`` ask for the top-level page: ``-h``/``--help``
    alone (code 0) or nothing at all (code 2, the page is the usage); for ``--version`` the
    version line (code 0); for a first word that is no command, usage naming every command
    (``export`` too, which LightningCLI does not know) and code 2; else ``None``."""
    if args in (["-h"], ["--help"], [HELP_ALL_FLAG]):
        return top_level_help(), 0
    if args == ["--version"]:
        from maxent_grpo import __version__

        return f"maxent-grpo {__version__}\n", 0
    if not args:
        return top_level_help(), 2
    command = next((a for a in args if a != "--traceback"), "")
    names = [*SUBCOMMANDS, *OTHER_COMMANDS]
    if command and not command.startswith("-") and command not in names:
        close = difflib.get_close_matches(command, names, 1)
        return (f"usage: {PROG} {{{','.join(names)}}} ...\nerror: {command!r} is not a "
                f"command; choose from {', '.join(names)}"
                + (f" (did you mean {close[0]}?)" if close else "") + "\n"), 2
    return None


_ABBREVIATION = re.compile(r"\b(?:e\.g|i\.e|ie|vs|cf)$")  # "e.g." ends no sentence
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :class:`~a.B` -> `a.B`


def plain(text: str) -> str:
    """``text`` on one line, reStructuredText roles and double backticks as single ones."""
    return _ROLE.sub(r"`\1`", " ".join(text.split())).replace("``", "`")


def first_sentence(text: str) -> str:
    """The first sentence of :func:`plain` ``text``: up to the first ``.``, ``;`` or ``:``
    (the ``.`` kept) that a space or the end follows, outside brackets and inline code and
    not of an abbreviation (``e.g.``); the whole text when there is none. Never cut
    elsewhere: a docstring whose first sentence is long is reworded, not truncated."""
    text, depth, code = plain(text), 0, False
    for i, char in enumerate(text):
        if char == "`":
            code = not code
        elif code:
            continue
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(depth - 1, 0)
        elif (depth == 0 and char in ".;:" and text[i + 1:i + 2] in ("", " ")
              and not _ABBREVIATION.search(text[:i])):
            return text[: i + (char == ".")]
    return text


def _is_trainer_group(group: Any) -> bool:
    return any(str(getattr(a, "dest", "")).startswith("trainer.") for a in group._group_actions)


TRAINER_TITLE = "Lightning's Trainer (the shipped configs set the ones a run needs)"


@contextlib.contextmanager
def ordered_groups(parser: Any) -> Iterator[None]:
    """``parser``'s option groups in the short page's order while it is formatted: ours
    first, then Lightning's Trainer options (titled :data:`TRAINER_TITLE`), then the linked
    arguments; as they were afterwards."""
    def rank(group: Any) -> int:
        title = str(group.title or "")
        if title.startswith("Linked arguments"):
            return 2
        return 1 if _is_trainer_group(group) else 0

    groups, titles = parser._action_groups, {}
    parser._action_groups = sorted(groups, key=rank)
    for group in filter(_is_trainer_group, groups):
        titles[group], group.title = group.title, TRAINER_TITLE
    try:
        yield
    finally:
        parser._action_groups = groups
        for group, title in titles.items():
            group.title = title


def help_formatter_class() -> type:
    """The formatter of every parser of the CLI (built on jsonargparse's, imported here so
    that :func:`quick_help` stays free of it)."""
    from jsonargparse import DefaultHelpFormatter
    from jsonargparse._actions import _ActionHelpClassPath

    class ShortHelpFormatter(DefaultHelpFormatter):
        """jsonargparse's page with :data:`FULL_HELP`; otherwise one sentence per option."""

        def _format_usage(self, usage: Any, actions: Any, groups: Any, prefix: Any) -> str:
            if FULL_HELP.get() or prefix == "":  # "": argparse naming a subcommand's parser
                return super()._format_usage(usage, actions, groups, prefix)
            return (f"usage: {self._prog} [--config FILE] [--<group>.<option> VALUE ...]\n"
                    f"       ({HELP_ALL_FLAG}: every option's whole description, type and "
                    "known subclasses)\n\n")

        def _format_action(self, action: Any) -> str:
            if not FULL_HELP.get() and isinstance(action, _ActionHelpClassPath):
                return ""  # --x.help CLASS lines: named once in the usage and the docs
            return super()._format_action(action)

        def _get_help_string(self, action: Any) -> str:
            if FULL_HELP.get() or getattr(action, "_jsonargparse_preexpanded_help", False):
                return super()._get_help_string(action)
            return first_sentence(action.help or "") + _DEFAULT_MARK + "(default: %(default)s)"

        def _expand_help(self, action: Any) -> str:
            text = super()._expand_help(action)
            if FULL_HELP.get() or _DEFAULT_MARK not in text:
                return text
            text, default = text.split(_DEFAULT_MARK, 1)
            shown = default[len("(default: "):-1]
            if "%(default)" in default or shown == "null" or len(shown) > _SHORT_DEFAULT:
                return text  # no default, or one too long for a line: --help-all shows it
            return f"{text} {default}" if text else default

    return ShortHelpFormatter


#: (source, target) of the options one sets for both: the target is given by the source
LINKS = (("model.model_name_or_path", "data.tokenizer"),
         ("model.model_cache_dir", "data.tokenizer_cache_dir"),
         ("data.max_prompt_length", "model.max_prompt_length"),
         ("model.tools", "data.tools"))


def check_given_configs(args: list[str]) -> None:
    """ValueError when a ``--config`` file or inline YAML, or a group's ``--model`` /
    ``--data`` value, sets the target of one of the :data:`LINKS`
    (``model.max_prompt_length``, ``data.tokenizer``, ...), nested (``data: {tokenizer:
    ...}``), dotted (``data.tokenizer: ...``) or in a group's own file (``model:
    model.yaml``): the parser drops it without a word and takes the source's value. Also
    when a subcommand's config comes before the subcommand (``--config my.yaml fit``): the
    parser reads no ``trainer``/``model``/``data`` there (``--print_config`` then wrote the
    defaults). And when an option given before a ``--config`` is set by it too (the later
    value wins: the one typed was dropped without a word)."""
    first = next((i for i, a in enumerate(args) if a in SUBCOMMANDS), len(args))
    from jsonargparse import get_loader

    def load(value: str) -> Any:
        try:  # a file, or inline YAML (flow or block style; anything else loads as a string)
            return get_loader("yaml")(Path(value).read_text("utf-8") if os.path.isfile(value)
                                      else value)  # as the parser reads it (no dates)
        except Exception:  # noqa: BLE001 -- the parser says what is wrong with it
            return None

    for i, arg in enumerate(args):
        flag, inline, value = arg.partition("=")
        flag = "--config" if flag == "-c" else flag
        if flag not in ("--config", "--model", "--data"):
            continue
        value = value if inline else (args[i + 1] if i + 1 < len(args) else "")
        config = _with_files(load(value) if flag == "--config" else {flag[2:]: load(value)},
                             os.path.dirname(value), load)  # a file's: beside it
        stray = [k for k in config if k not in (*SUBCOMMANDS, "subcommand")] if isinstance(
            config, dict) else []  # the parser reads `subcommand: validate` too
        if flag == "--config" and i < first < len(args) and stray:  # a section each, no more
            near = {k: difflib.get_close_matches(str(k), SUBCOMMANDS, 1) for k in stray}
            raise ValueError(
                f"--config {value} comes before the subcommand {args[first]!r}, where the "
                f"options of one subcommand are not read: give it after the subcommand "
                f"({PROG} {args[first]} --config {value})" if len(stray) == len(config) else
                f"--config {value} comes before the subcommand, where only a section per "
                f"subcommand ({', '.join(SUBCOMMANDS)}) is read; its keys "
                + ", ".join(f"{k!r}" + (f" (did you mean {near[k][0]!r}?)" if near[k] else "")
                            for k in stray) + " would be ignored: move them into a section")
        parts = [config] + [config[sub] for sub in SUBCOMMANDS if isinstance(config, dict)
                            and isinstance(config.get(sub), dict)]  # a whole-CLI config's
        for j in range(first + 1, i) if flag == "--config" else []:
            name, inline_, given = args[j].partition("=")
            given = given if inline_ else (args[j + 1] if j + 1 < i else "")
            option = name[2:].removesuffix("+")  # += appends to a list
            keys = option.split(".")
            if args[j].startswith("--") and option not in ("config", "c") and any(
                    _replaces(_value(part, keys), load(given), name.endswith("+"), len(keys) == 1)
                    or _whole(_value(part, keys[:1]), keys[1:]) for part in parts):
                raise ValueError(
                    f"--{option} is given before --config {value}, which sets it too: the "
                    f"later one wins, so the value given would be ignored; give --{option} "
                    f"after --config {value}")
        for (source, target), part in itertools.product(LINKS, parts):
            group, key = target.split(".")
            section = part.get(group) if isinstance(part, dict) else None
            if (isinstance(part, dict) and target in part) or (
                    isinstance(section, dict) and key in section):
                raise ValueError(
                    f"{flag} {value} sets {target}, which is set from {source} (linked "
                    f"options are given once, and this value would be ignored): set {source} "
                    f"instead and remove {target}")


_ABSENT = object()


def _with_files(config: Any, folder: str, load: Callable[[str], Any]) -> Any:
    """``config`` with each value naming a YAML file (``model: model.yaml``, ``objective:
    grpo.yaml``; beside the config or here) read in, as the parser reads it."""
    if isinstance(config, dict):
        return {k: _with_files(v, folder, load) for k, v in config.items()}
    if isinstance(config, str) and config.endswith((".yaml", ".yml")):
        found = [f for f in (os.path.join(folder, config), config) if os.path.isfile(f)]
        loaded = load(found[0]) if found else None
        return _with_files(loaded, os.path.dirname(found[0]), load) if isinstance(
            loaded, dict) else config
    return config


def _value(config: Any, keys: list[str]) -> Any:
    """What ``config`` gives the option ``keys`` (nested, dotted, or both; a class's
    ``init_args`` may be left out, as on the command line), or ``_ABSENT``."""
    if not keys:
        return config
    if not isinstance(config, dict):
        return _ABSENT
    for j in range(1, len(keys) + 1):
        if ".".join(keys[:j]) in config and (
                found := _value(config[".".join(keys[:j])], keys[j:])) is not _ABSENT:
            return found
    return _value(config["init_args"], keys) if keys[0] != "init_args" and isinstance(
        config.get("init_args"), dict) else _ABSENT


def _replaces(value: Any, given: Any, appended: bool, group: bool) -> bool:
    """Whether a config's ``value`` replaces what an option given before it set (``given``,
    loaded): a value, a mapping option's whole mapping (``model.rewards``), another class
    than the one given, anything for a list appended to (``+=``). A group's options
    (``--model``, ``group``) and a class's merge, as the parser merges them: refused only
    where the config sets one of the options given, or names another class."""
    if value is _ABSENT or appended or not isinstance(value, dict):
        return value is not _ABSENT
    if not group and not {"class_path", "init_args"} & set(value):
        return True  # a mapping option's value: replaced whole
    def short(name: Any) -> str:  # a class by its short or its full name
        return str(name).rpartition(".")[2]
    if not isinstance(given, dict):  # a class's name (or a value the parser refuses)
        return "class_path" in value and short(value["class_path"]) != short(given)
    return any(_whole(value, keys) or ((found := _value(value, keys)) is not _ABSENT and (
        keys[-1] != "class_path" or short(found) != short(leaf))) for keys, leaf in _leaves(given))


def _whole(config: Any, keys: list[str]) -> bool:
    """Whether ``config`` replaces a mapping option (``rewards``, ``task_options``) on the way
    to ``keys`` whole, so the key given there is dropped however the config leaves it."""
    for j in range(1, len(keys)):
        found = _value(config, keys[:j])
        if keys[j - 1] != "init_args" and isinstance(found, dict) and not {
                "class_path", "init_args"} & set(found):
            return True
    return False


def _leaves(mapping: dict, keys: tuple[str, ...] = ()) -> Iterator[tuple[list[str], Any]]:
    """Each option a mapping sets: its keys (dotted ones split) and its value."""
    for key, value in mapping.items():
        path = (*keys, *str(key).split("."))
        if isinstance(value, dict) and value:
            yield from _leaves(value, path)
        else:
            yield list(path), value
