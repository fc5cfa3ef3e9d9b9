"""The README and the pages of ``docs/`` stay true: the README is a front page, every
relative link and every repository path they name exists, every command line in their
``bash`` blocks names a make target, file or module that exists and parses with the real
command line (an option renamed or a config moved fails here), and the site builds strictly.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

# datasets' log handler keeps the sys.stderr of its import: imported here, not first under a
# test's capsys (closed after that test)
import datasets  # noqa: F401
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: the written pages outside docs/ that the README and docs link to
LINKED = sorted((ROOT / "benchmarks").glob("*.md"))
#: sample values for the shell variables of the SLURM examples (docs/SCALING.md)
SHELL_VALUES = {"$SLURM_NNODES": "4", "$SLURM_NTASKS": "32", "$SLURM_JOB_ID": "1",
                "${urls%,}": "http://10.0.0.5:8000"}
CLI = re.compile(r"(?:python -m maxent_grpo|maxent-grpo) (fit|validate|test|predict)\b(.*)")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def without_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it (MkDocs drops non-ASCII letters too; the strict
    site build checks the pages' links against its own anchors)."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.*)$", without_code(path.read_text()), re.M)}


def links(path: Path) -> list[str]:
    found = re.findall(r"\]\(([^)\s]+)\)", without_code(path.read_text()))
    return [t for t in found if not re.match(r"[a-z]+:", t)]  # https:, mailto:


def code_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block, read fence by fence (an indented fence in
    a list item included): a closing fence never opens the next block."""
    blocks, language, body = [], None, []
    for line in text.splitlines():
        fence = re.match(r"\s*```(\w*)", line)
        if fence is None:
            if language is not None:
                body.append(line.strip())
        elif language is None:
            language, body = fence.group(1), []
        else:
            blocks.append((language, "\n".join(body) + "\n"))
            language = None
    return blocks


def command_lines(text: str) -> list[str]:
    """The command lines of the shell blocks (``bash``, ``sh``, ``console`` or no language),
    continuation lines joined, comments dropped."""
    lines = []
    for language, block in code_blocks(text):
        if language not in ("bash", "sh", "console", ""):
            continue
        for line in re.sub(r"\s*\\\n\s*", " ", block).splitlines():
            line = re.split(r"\s#", line)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def test_command_lines_are_read_from_shell_blocks_only():
    text = ("Prose naming `python -m maxent_grpo fit --no_such_option`.\n\n```yaml\n"
            "model:\n  lr: 1\n```\n\nMore prose: make nothing\n\n1. A step:\n\n"
            "   ```bash\n   python -m maxent_grpo validate \\\n     --config a.yaml  # why\n"
            "   ```\n\n```\nmake test\n```\n")
    assert command_lines(text) == ["python -m maxent_grpo validate --config a.yaml",
                                   "make test"]


def test_the_readme_is_a_front_page_and_every_page_is_in_the_site():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert f": {page.name}" in nav, f"{page.name} is not in mkdocs.yml's nav"
        assert f"docs/{page.name}" in (ROOT / "README.md").read_text() or page.name == \
            "index.md", f"the README's table of pages lacks docs/{page.name}"


@pytest.mark.parametrize("page", PAGES + LINKED, ids=rel)
def test_every_relative_link_reaches_a_file_and_heading(page):
    broken = []
    for target in links(page):
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {rel(path)}")
    assert not broken, f"{rel(page)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_repository_path_named_in_code_exists(page):
    """``maxent_grpo/...``, ``benchmarks/...``, ``configs/...``, ``tests/...`` in code spans
    (not the environments a set-up makes, not patterns); ``tests/x.py::name`` names a test
    that ``tests/x.py`` defines."""
    named = re.findall(r"`((?:maxent_grpo|benchmarks|configs|tests|docs|notebooks)/"
                       r"[\w./-]*[\w/])(?:::(\w+))?`", page.read_text())
    missing = sorted({f"{p}::{name}" if name else p for p, name in named
                      if not re.search(r"/\.", p)  # .venv-trl & co.: made by set-ups
                      and not ((ROOT / p).exists() and (not name or re.search(
                          rf"def {name}\(", (ROOT / p).read_text())))})
    assert not missing, f"{rel(page)} names paths that do not exist: {missing}"


#: every Python file of the repository, as paths relative to it (not the environments a
#: set-up makes inside it, such as benchmarks/.venv-trl)
PY_FILES = [rel(f) for top in ("maxent_grpo", "benchmarks", "tests", "notebooks")
            for f in (ROOT / top).rglob("*.py")
            if not any(part.startswith(".") for part in f.relative_to(ROOT).parts)]


#: files of the user's in the pages' examples
USERS_FILES = {"my_rewards.py"}


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_python_file_named_in_code_exists(page):
    """A ``.py`` file in a code span by its path inside a package (``step/trajectory.py``,
    ``hf.py``) is a file of the repository: renamed or moved modules fail here."""
    named = set(re.findall(r"`([\w/-]+\.py)(?:::\w+)?`", without_code(page.read_text())))
    missing = sorted(n for n in named - USERS_FILES
                     if not any(f == n or f.endswith("/" + n) for f in PY_FILES))
    assert not missing, f"{rel(page)} names Python files that do not exist: {missing}"


def test_every_command_line_names_what_exists(monkeypatch):
    """``make X`` is a target, ``python -m maxent_grpo.X`` a module, ``python X.py`` a file."""
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    wrong = []
    for page in PAGES:
        for line in command_lines(page.read_text()):
            for target in re.findall(r"(?:^|\s)make ([\w-]+)", line):
                if target not in targets:
                    wrong.append(f"{rel(page)}: make {target}")
            for module in re.findall(r"python -m (maxent_grpo\.[\w.]+)", line):
                if not (ROOT / (module.replace(".", "/") + ".py")).exists():
                    wrong.append(f"{rel(page)}: {module}")
            for script in re.findall(r"python ([\w/]+\.py)", line):
                if not (ROOT / script).exists():
                    wrong.append(f"{rel(page)}: {script}")
    assert not wrong


def cli_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for line in command_lines(page.read_text()):
            match = CLI.search(line)
            if match is None:
                continue
            rest = match.group(2).split(" > ")[0].split(" &")[0]
            for name, value in SHELL_VALUES.items():
                rest = rest.replace(name, value)
            found.append((rel(page), [match.group(1), *shlex.split(rest)]))
    return found


@pytest.mark.parametrize("args", [a for _, a in cli_commands()],
                         ids=[f"{p}: {' '.join(a)}"[:90] for p, a in cli_commands()])
def test_every_command_line_parses(args, capsys, monkeypatch):
    """Parsed by the real command line with ``--print_config`` (``--help`` as written):
    nothing is built or trained; every config file and option must exist and every value
    must type-check (links between options and required values are checked later, when
    a run is built)."""
    from maxent_grpo.cli import parser as cli_module

    monkeypatch.chdir(ROOT)
    if not any(a.startswith("--help") or a == "--print_config" for a in args):
        args = [*args, "--print_config"]
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(args)
    assert exit_info.value.code == 0, capsys.readouterr().err[-2000:]


def test_the_site_builds_strictly(tmp_path):
    mkdocs = pytest.importorskip("mkdocs.commands.build", reason="the docs extra (mkdocs)")
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"))
    mkdocs.build(config)  # strict (mkdocs.yml): a warning raises
    assert (tmp_path / "site" / "TRAINING" / "index.html").is_file()
