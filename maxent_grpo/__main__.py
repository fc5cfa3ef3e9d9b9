"""``maxent-grpo fit|validate|test|predict --config FILE|NAME [--traceback]`` (also
``python -m maxent_grpo ...``), ``maxent-grpo export CHECKPOINT``, ``maxent-grpo --version``.

A mistake in the configuration, the data, a model folder or a reward function prints a
short ``error: ...`` line and exits with code 1 (parse errors: usage and code 2);
``--traceback`` adds the full trace (see :mod:`maxent_grpo.cli.errors`). ``--help`` alone and
``--version`` are answered before Lightning is imported (:mod:`maxent_grpo.cli.help`).
"""

import os
import sys

from maxent_grpo.cli import help as cli_help


def console(prog: str = "maxent-grpo") -> None:
    """The console command (``[project.scripts]``): the CLI of :mod:`maxent_grpo.cli`. The
    working folder is on ``sys.path``, as ``python -m`` puts it (a console script puts its
    own bin folder there), last (a ``yaml.py`` there does not hide the library): a reward,
    tool or objective module beside the config imports under either command."""
    cli_help.PROG = prog
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    args = sys.argv[1:]
    quick = cli_help.quick_help(args)
    if quick is not None:
        (sys.stdout if quick[1] == 0 else sys.stderr).write(quick[0])
        sys.exit(quick[1])
    command = [a for a in args if a != "--traceback"]  # allowed anywhere on the line
    _show_progress()
    try:  # torch, Lightning and transformers load for seconds: a Ctrl-C there is no bug
        if command[:1] == ["export"]:
            from maxent_grpo.cli.export import main as export
        else:
            from maxent_grpo.cli import main
    except KeyboardInterrupt:
        if len(command) < len(args):  # --traceback
            raise
        print("error: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
    if command[:1] == ["export"]:
        sys.exit(export(command[1:] + ["--traceback"] * (len(command) < len(args))))
    main(exit_on_error=True)


def _show_progress() -> None:
    """The package's progress lines (a model converted on first use, an export, a SIGTERM's
    stop) on stderr, as Lightning prints its own: those of each node's first process (every
    process of a run on several runs this command); warnings from all, as before."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("maxent_grpo")
    log.addHandler(handler)
    first = os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0"
    log.setLevel(logging.INFO if first else logging.WARNING)


if __name__ == "__main__":
    console(prog="python -m maxent_grpo")
