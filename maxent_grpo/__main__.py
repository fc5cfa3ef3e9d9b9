"""``python -m maxent_grpo fit|validate|test --config configs/x.yaml [--traceback]``.

A mistake in the configuration, the data, a model folder or a reward function prints a
short ``error: ...`` line and exits with code 1 (parse errors: usage and code 2);
``--traceback`` adds the full trace (see :mod:`maxent_grpo.errors`). ``--help`` alone is
answered before Lightning is imported (:mod:`maxent_grpo.cli_help`).
"""

import sys

from maxent_grpo.cli_help import quick_help

if __name__ == "__main__":
    quick = quick_help(sys.argv[1:])
    if quick is not None:
        (sys.stdout if quick[1] == 0 else sys.stderr).write(quick[0])
        sys.exit(quick[1])
    from maxent_grpo.cli import main

    main(exit_on_error=True)
