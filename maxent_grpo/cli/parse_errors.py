"""A jsonargparse parse error (the usage line, ``error: ...``, exit code 2), made short.

An unknown option or config key ends with the closest known ones (:func:`did_you_mean`). A
class given by path (``--model.objective EntropyMaxEnt``, ``--trainer.logger+=CSVLogger``,
``--trainer.callbacks+=...``) whose arguments are wrong is said in one line naming the option,
the class and the problem (:func:`short_subclass_error`), not jsonargparse's list of what
every other type of the option would accept.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from typing import Any

from maxent_grpo.cli.help import PROG, SUBCOMMANDS

#: a parse error's naming of an unknown option: jsonargparse's text for one on the command
#: line (``args``: the rest of the command line from it) and for a key in a config file
_UNKNOWN_OPTION = (
    re.compile(r"unrecognized arguments: (?P<args>.*)"),
    re.compile(r"Group '(?P<group>[^']+)' does not accept option '(?P<key>[^']+)'"),
    re.compile(r"Subcommand '[^']+' does not accept option '(?P<key>[^']+)'"),
    re.compile(r"Option '(?P<key>[^']+)' is not accepted"),
)
DID_YOU_MEAN = "did you mean"
#: options an older version had, and what took their place (docs/CHANGELOG.md)
REMOVED = {
    "model.share_prefill": "model.engine.init_args.share_prefill",
    "model.lr_schedule": "model.lr_scheduler (a scheduler class, e.g. CosineAnnealingLR)",
    "model.min_lr_ratio": "model.lr_scheduler (e.g. CosineAnnealingLR's eta_min)",
}


def close_options(key: str, known: Iterable[str], n: int = 3) -> list[str]:
    """The up to ``n`` names of ``known`` (dotted: ``trainer.max_steps``) closest to the
    unknown ``key``: by the last part among the names of the same group, else by the last
    part among all (a misspelt or wrong group: ``modle.num_generations``)."""
    group, _, leaf = key.rpartition(".")
    by_leaf: dict[str, list[str]] = {}
    same_group: dict[str, str] = {}
    for name in sorted(set(known)):
        name_group, _, name_leaf = name.rpartition(".")
        by_leaf.setdefault(name_leaf, []).append(name)
        if name_group == group and name != key:  # another subcommand's option: no hint
            same_group[name_leaf] = name
    found = [same_group[m] for m in difflib.get_close_matches(leaf, list(same_group), n)]
    if not found:
        close = difflib.get_close_matches(leaf, list(by_leaf), n, cutoff=0.8)
        found = [name for m in close for name in by_leaf[m] if name != key]
    return found[:n]


def did_you_mean(message: str, options: Iterable[str]) -> str:
    """A parse error's ``message`` with, for each unknown option it names, the closest of
    ``options`` (``--trainer.max_steps``, ...): ``...; did you mean --trainer.max_steps?``.
    A key of a config file is answered with keys (``model.num_generations``)."""
    if DID_YOU_MEAN in message:  # a parent parser reporting its subcommand's error
        return message
    known = {o[2:] for o in options if o.startswith("--") and not o.endswith("+")}
    unknown = _unknown_options(message)
    hints = []
    for key, dashes in unknown:
        sub, _, rest = key.partition(".")
        if not dashes and sub in SUBCOMMANDS and rest in known:  # a whole-CLI config's key
            hints.append(f"a config with a '{sub}:' section goes before the subcommand "
                         f"({PROG} --config FILE {sub}); after it, leave out the '{sub}:' level")
            continue
        if (unprefixed := key.partition(".")[2] if sub in SUBCOMMANDS else key) in REMOVED:
            hints.append(f"{dashes}{key} was removed: use {dashes}{REMOVED[unprefixed]}")
            continue
        close = close_options(key, known)
        if close:
            names = " or ".join(f"{dashes}{name}" for name in close)
            hints.append(f"{dashes}{key}: {DID_YOU_MEAN} {names}?" if len(unknown) > 1
                         else f"{DID_YOU_MEAN} {names}?")
    return "; ".join([message, *hints])


def _unknown_options(message: str) -> list[tuple[str, str]]:
    """``(key, prefix as written: "--" or "")`` of each unknown option ``message`` names."""
    for pattern in _UNKNOWN_OPTION:
        match = pattern.search(message)
        if match and "args" in pattern.groupindex:
            words = match["args"].split()
            return [(w.split("=", 1)[0][2:], "--") for w in words if w.startswith("--")]
        if match:
            group = match.groupdict().get("group")
            return [(f"{group}.{match['key']}" if group else match["key"], "")]
    return []


_UNION_KEY = re.compile(r'^Parser key "(?P<key>[^"]+)":\s*\n\s*Does not validate against any of '
                        r"the Union subtypes")
_CLASS_PROBLEM = re.compile(r"^(?P<indent>\s*)- Problem with given class_path '(?P<cls>[^']+)':$")
_NESTED_KEY = re.compile(r'^Parser key "(?P<key>[^"]+)":\s*(?P<rest>.*)$', re.DOTALL)
_OWN_KEY = re.compile(r"^--(?P<key>[\w.]+)(?: \((?P<cls>[\w.]+)\))?: (?P<rest>.*)$", re.DOTALL)
_REQUIRED = re.compile(r"the following arguments are required: (?P<names>[\w, ]+)")


_NUMBER = re.compile(r"Expected a <class '(float|int)'>")  # lr: float | Tensor, read as a class
_CALLABLE = re.compile(r'Parser key "(?P<key>[^"]+)":\s+(?:Does not validate against any of '
                       r"the Union subtypes.*?- )?Type \S.*? expects a function or a "
                       r"callable class: (?P<rest>.*?)\.? Got value: "
                       r"Namespace\(class_path='(?P<cls>[^']+)'", re.DOTALL)


def short_subclass_error(message: str) -> str:
    """jsonargparse's error for a class given by path to an option that accepts several types
    (``Parser key "trainer.logger": Does not validate against any of the Union subtypes ...
    - Problem with given class_path 'X': <the problem> - Expected a <class 'bool'> ...``) as
    ``--trainer.logger (X): <the problem>``, with how to give a missing argument (an unknown
    one already ends with the class's closest: its own parser's :func:`did_you_mean`); any
    other message as it is."""
    if given := _CALLABLE.match(message):  # model.optimizer's: one line
        inner = re.match(r'(?:--([\w.]+):|Parser key "([\w.]+)":)\s+(.*)', given["rest"],
                         re.DOTALL)  # one argument's problem, else the class's
        key = given["key"] + (f".{inner[1] or inner[2]}" if inner else "")
        text = _expected(" ".join((inner[3] if inner else given["rest"]).split()))
        number, value = _NUMBER.search(text), _GIVEN.search(text)
        if text.startswith("Does not validate") and number and value:
            text = f"expected a number ({number[1]}); got {value['value']!r}"
        return f"--{key} ({given['cls']}): {text}"
    union = _UNION_KEY.match(message)
    lines = message.splitlines()
    problems = [(i, m) for i, m in enumerate(map(_CLASS_PROBLEM.match, lines)) if m]
    if union is None or not problems or len({len(m["indent"]) for _, m in problems}) > 1:
        return message  # several at one level: the class given, then its base (Callback)
    (at, problem), key = problems[0], union["key"]
    depth = len(problem["indent"])
    body = []
    for line in lines[at + 1:]:
        if len(line) - len(line.lstrip()) <= depth:
            break
        body.append(line.strip())
    text = " ".join(body)
    nested = _NESTED_KEY.match(text)
    if nested:  # an argument's value: Parser key "alpha": Expected a <class 'float'>. ...
        key, text = f"{key}.{nested['key']}", _expected(nested["rest"])
    cls_path = problem["cls"]
    if not nested and (own := _OWN_KEY.match(text)):  # the class's own parser's: --name: ...
        key, text, cls_path = f"{key}.{own['key']}", own["rest"], own["cls"] or cls_path
    short = f"--{key} ({cls_path}): {text}"
    required = _REQUIRED.search(text)
    if required:
        names = [n.strip() for n in required["names"].split(",") if n.strip()]
        given = " ".join(f"--{key}.{n} VALUE" for n in names)
        return (f"{short}; give {'it' if len(names) == 1 else 'them'} after the class "
                f"({given}) or in its init_args in a config")
    return short



_EXPECTED = re.compile(r"- Expected an? (?:<class '(?P<type>[^']+)'>"
                       r"|typing\.Literal\[(?P<of>[^]]+)\])")
_GIVEN = re.compile(r"Given value: (?P<value>.*)$")


def _expected(text: str) -> str:
    """An argument's "Does not validate against any of the Union subtypes ... - Expected a
    <class 'int'> - Expected a <class 'NoneType'> ... Given value: x" as "expected int or
    null; got 'x'"; another text as it is."""
    types = [m["type"] or " or ".join(map(str.strip, m["of"].split(",")))
             for m in _EXPECTED.finditer(text)]
    given = _GIVEN.search(text)
    if "Union subtypes" not in text or given is None or len(types) != text.count("- "):
        return text  # (a class among the types: its own words are kept)
    names = " or ".join("null" if t == "NoneType" else t for t in types)
    return f"expected {names}; got {given['value']!r}"


_NO_CLASS = re.compile(r"Expected a dot import path string: (?P<name>\S+)")
_OPTION_KEY = re.compile(r'^(?:Parser key "(?P<key>[^"]+)":|--(?P<help>\S+?)\.help:)')


def short_unknown_class(message: str, parsers: Sequence[Any]) -> str:
    """jsonargparse's error for a class name that names no class (``--model.objective Nope``,
    ``--model.objective.help Nope``: "Expected a dot import path string: Nope" among what
    every other type would accept) as the option, the name and the classes it could be (the
    subclasses ``parsers``' ``--<option>.help`` knows), the closest first; any other message
    as it is."""
    missing, option = _NO_CLASS.search(message), _OPTION_KEY.match(message)
    if missing is None or option is None:
        return message
    key = option["key"] or option["help"]
    if number := _NUMBER.search(message):
        return f"--{key}: expected a number ({number[1]}); got {missing['name']!r}"
    names = _class_names(parsers, key)
    if not names:
        return message
    name, by_lower = missing["name"], {n.lower(): n for n in names}  # grpo: GRPO
    close = [by_lower[n] for n in difflib.get_close_matches(name.lower(), by_lower, 3, 0.5)]
    hint = f"; {DID_YOU_MEAN} {' or '.join(close)}?" if close else ""
    return (f"--{key}: no class named {name!r}: give one of {', '.join(names)}, or a class's "
            f"import path (my_module.MyClass){hint}")


def _class_names(parsers: Sequence[Any], key: str) -> list[str]:
    """The names of the classes the class-typed option ``key`` of one of ``parsers`` takes:
    the subclasses of its type that are imported (jsonargparse's list, by which a name is
    resolved), less the type itself."""
    try:  # jsonargparse's own lookup (private: a version without it gives no list)
        from jsonargparse._typehints import get_all_subclass_paths
    except ImportError:
        return []

    for parser in parsers:
        action = parser._option_string_actions.get(f"--{key}.help")
        bases = getattr(action, "_help_types", None)
        if bases:
            own = {f"{b.__module__}.{b.__qualname__}" for b in bases}
            paths = [p for b in bases for p in get_all_subclass_paths(b)]
            names = [p.rsplit(".", 1)[-1] for p in paths if p not in own]
            names = [n for n in names if n not in {b.__name__ for b in bases}
                     and not n.endswith("Base")]  # a shared base (VLLMEngineBase): not one
            return list(dict.fromkeys(names))
    return []


MISMATCH = ("Expected a ", "Not a valid subclass of ")  # a value tried as another subtype


def failed_subtype(message: str) -> str | None:
    """The one entry of jsonargparse's "Does not validate against any of the Union subtypes
    ... Errors:" list that is not a mismatch of the value's type with another subtype
    ("Expected a <class 'bool'>", "Not a valid subclass of Logger. Got value: [...]"), or
    None (no such list, or not one such entry)."""
    lines = message.splitlines()
    if "Errors:" not in lines or "Union subtypes" not in message:
        return None
    entries: list[list[str]] = []
    for line in lines[lines.index("Errors:") + 1:]:
        if line.startswith("  - "):
            entries.append([line[4:]])
        elif line.startswith("    ") and entries:
            entries[-1].append(line.strip())
        else:
            break
    kept = [" ".join(e) for e in entries if not e[0].startswith(MISMATCH)]
    return kept[0] if len(kept) == 1 else None
