"""``maxent-grpo fit|validate|test|predict --config FILE|NAME [--traceback]`` (also
``python -m maxent_grpo ...``), ``maxent-grpo export CHECKPOINT``, ``maxent-grpo --version``.

A mistake in the configuration, the data, a model folder or a reward function prints a
short ``error: ...`` line and exits with code 1 (parse errors: usage and code 2);
``--traceback`` adds the full trace (see :mod:`maxent_grpo.cli.errors`). ``--help`` alone and
``--version`` are answered before Lightning is imported (:mod:`maxent_grpo.cli.help`).
"""

import os
import sys
import threading

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
    if len(args) == 2 and args[0] in ("-h", "--help") and not args[1].startswith("-"):
        args = sys.argv[1:] = [args[1], args[0]]  # `--help fit` is `fit --help`
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
    _name_lingering_threads()


def _name_lingering_threads(after: float = 5.0) -> threading.Timer:
    """A thread that is not a daemon, started by code of the run's (a reward function's),
    kept the process waiting after the command ended, without a word: named when the wait
    lasts ``after`` seconds (a daemon timer: a process that ends sooner says nothing; idle
    ``ThreadPoolExecutor`` workers, which Python ends at exit, are no wait)."""

    def name_them() -> None:
        alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()
                 and not t.daemon and t.is_alive() and t is not timer]
        if alive:
            print(f"warning: the command ended, but the process waits for {len(alive)} "
                  f"thread(s) that did not end ({', '.join(alive[:5])}), started by a reward "
                  "function or other code of the run's: end them, or start them as daemon "
                  "threads (Ctrl-C or kill ends the wait; the run's files are written)",
                  file=sys.stderr)

    timer = threading.Timer(after, name_them)
    timer.daemon = True
    timer.start()
    return timer


#: where launchers put a process's rank on its node (torchrun and Lightning's DDP, SLURM's
#: srun, LSF's jsrun, Open MPI), then its global rank
RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID", "JSM_NAMESPACE_LOCAL_RANK",
                  "OMPI_COMM_WORLD_LOCAL_RANK", "RANK")


def _show_progress() -> None:
    """The package's progress lines (a model converted on first use, an export, a SIGTERM's
    stop) on stderr, as Lightning prints its own: those of each node's first process (every
    process of a run on several runs this command); warnings from all, as before. Once per
    process; nothing where the program configured logging itself (a root handler)."""
    import logging

    class Progress(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if logging.getLogger().handlers:  # the root's handler prints it
                return
            try:  # above a live progress bar, not glued to it; the stderr of now
                from tqdm import tqdm

                tqdm.write(self.format(record), file=sys.stderr)
            except Exception:  # noqa: BLE001 - logging's own rule: report, never raise
                self.handleError(record)

    log = logging.getLogger("maxent_grpo")
    if not any(type(h).__name__ == "Progress" for h in log.handlers):
        log.addHandler(Progress())
    rank = next((os.environ[k] for k in RANK_VARIABLES if k in os.environ), "0")
    log.setLevel(logging.INFO if rank == "0" else logging.WARNING)


if __name__ == "__main__":
    console(prog="python -m maxent_grpo")
