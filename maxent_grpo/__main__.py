"""``python -m maxent_grpo fit|validate|test --config configs/x.yaml [--traceback]``.

A mistake in the configuration, the data, a model folder or a reward function prints a
short ``error: ...`` line and exits with code 1 (parse errors: usage and code 2);
``--traceback`` adds the full trace (see :mod:`maxent_grpo.errors`).
"""

from maxent_grpo.cli import main

if __name__ == "__main__":
    main(exit_on_error=True)
