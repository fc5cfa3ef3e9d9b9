"""The command line: ``maxent-grpo fit|validate|test|predict|export`` (also
``python -m maxent_grpo ...``).

- :mod:`~maxent_grpo.cli.parser`: the LightningCLI subclass and :func:`main`;
- :mod:`~maxent_grpo.cli.help`: the help pages, ``--version`` and ``--config NAME``,
  answered without importing Lightning;
- :mod:`~maxent_grpo.cli.errors`: a user's mistake as one ``error: ...`` line;
- :mod:`~maxent_grpo.cli.export`: ``maxent-grpo export CHECKPOINT``.

``main`` and ``MaxEntGRPOCLI`` are importable from here; they load Lightning on first use,
so ``maxent_grpo.cli.help`` stays quick.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MaxEntGRPOCLI", "main"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from maxent_grpo.cli import parser

        return getattr(parser, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
