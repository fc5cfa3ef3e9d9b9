"""Lightning callbacks: the adaptive tau / beta controllers (docs/ALGORITHM.md §5) and HF export.

Named in YAML by their package path, e.g. ``maxent_grpo.training.callbacks.TauController``:

- :mod:`~maxent_grpo.training.callbacks.base`: :class:`Controller`, what the controllers
  share: when they act, their checkpointed state and the restore order;
- :mod:`~maxent_grpo.training.callbacks.controllers`: :class:`TauController`,
  :class:`BetaController`, :class:`MetaController`: which objectives they drive (by
  ``objective.tunable``) and their update rules;
- :mod:`~maxent_grpo.training.callbacks.state_file`: ``controller_state.json``, its schema
  and the one mapping between it and the objective / controllers;
- :mod:`~maxent_grpo.training.callbacks.export`: :class:`HFExport`.

(``CompletionSamples`` lives in :mod:`maxent_grpo.training.samples`.)
"""

from maxent_grpo.training.callbacks.base import Controller
from maxent_grpo.training.callbacks.controllers import BetaController, MetaController, TauController
from maxent_grpo.training.callbacks.export import HFExport
from maxent_grpo.training.callbacks.state_file import (
    CONTROLLER_FIELDS,
    STATE_FILENAME,
    STATE_KEYS,
    apply_snapshot,
    build_snapshot,
    read_controller_state,
    write_controller_state,
)

__all__ = [
    "CONTROLLER_FIELDS",
    "STATE_FILENAME",
    "STATE_KEYS",
    "BetaController",
    "Controller",
    "HFExport",
    "MetaController",
    "TauController",
    "apply_snapshot",
    "build_snapshot",
    "read_controller_state",
    "write_controller_state",
]
