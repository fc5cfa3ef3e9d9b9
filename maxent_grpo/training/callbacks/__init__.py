"""Lightning callbacks: the adaptive tau / beta controllers (docs/ALGORITHM.md §5), HF export,
the samples, the progress bar and the module's own.

Named in YAML by their package path, e.g. ``maxent_grpo.training.callbacks.TauController``:

- :mod:`~maxent_grpo.training.callbacks.controller_base`: :class:`Controller`, what the
  controllers share: when they act, their checkpointed state and the restore order;
- :mod:`~maxent_grpo.training.callbacks.controllers`: :class:`TauController`,
  :class:`BetaController`, :class:`MetaController`: which objectives they drive (by
  ``objective.tunable``) and their update rules;
- :mod:`~maxent_grpo.training.callbacks.state_file`: ``controller_state.json``, its schema
  and the one mapping between it and the objective / controllers;
- :mod:`~maxent_grpo.training.callbacks.export`: :class:`HFExport`;
- :mod:`~maxent_grpo.training.callbacks.samples`: :class:`CompletionSamples`, the step's
  samples through every logger;
- :mod:`~maxent_grpo.training.callbacks.progress`: :class:`ReadableProgressBar`, with
  :mod:`~maxent_grpo.training.callbacks.run_report`, what it prints after a validation and
  at the end of a fit;
- :mod:`~maxent_grpo.training.callbacks.module_own`: the callbacks the module adds itself
  (``ModuleHooks`` before the user's, for a resumed fit's first batch; ``CleanUp`` after
  them, teardown after a failed run; ``predict``'s ``CompletionWriter``).
"""

from maxent_grpo.training.callbacks.controller_base import Controller
from maxent_grpo.training.callbacks.controllers import BetaController, MetaController, TauController
from maxent_grpo.training.callbacks.export import HFExport
from maxent_grpo.training.callbacks.module_own import CleanUp, CompletionWriter, ModuleHooks
from maxent_grpo.training.callbacks.progress import ReadableProgressBar
from maxent_grpo.training.callbacks.samples import CompletionSamples
from maxent_grpo.training.callbacks.state_file import (
    STATE_FILENAME,
    STATE_KEYS,
    apply_snapshot,
    build_snapshot,
    read_controller_state,
    write_controller_state,
)

__all__ = [
    "STATE_FILENAME",
    "STATE_KEYS",
    "BetaController",
    "CleanUp",
    "ModuleHooks",
    "CompletionSamples",
    "CompletionWriter",
    "Controller",
    "HFExport",
    "MetaController",
    "ReadableProgressBar",
    "TauController",
    "apply_snapshot",
    "build_snapshot",
    "read_controller_state",
    "write_controller_state",
]
