"""``controller_state.json``: the controllers' side file, and its one mapping to the objective.

Schema (every scalar a finite number or ``null``)::

    {
      "beta": 0.1,               # objective.beta  (null: the objective has no tunable beta)
      "tau": 0.4,                # objective.tau   (null: the objective has no tunable tau)
      "tau_log": -0.916,         # log(tau), for readers; tau is what is restored
      "tau_entropy_ema": 1.3,    # TauController's entropy EMA (null: none, or no TauController)
      "meta": {                  # each controller's own state, when it is in the run
        "tau_steps": 7,                                 # TauController
        "beta_steps": 7, "kl_error": -0.1,              # BetaController
        "meta_steps": 7, "tau_grad": 0.2, "beta_grad": 0.03   # MetaController
      }
    }

tau and beta belong to the objective (the controllers keep no copy); so does any other
attribute a controller of one's own moves, at the top level by its name (``"alpha": 0.3``);
everything else is a controller's own state, mapped by its class's ``file_fields`` to and
from its ``state_dict``.
When it is written and read: :mod:`~maxent_grpo.training.callbacks.controller_base`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from maxent_grpo.objectives import Objective
from maxent_grpo.training.run.checkpoint_io import atomic_write
from maxent_grpo.validation import is_number, require

__all__ = [
    "STATE_FILENAME",
    "STATE_KEYS",
    "apply_snapshot",
    "build_snapshot",
    "read_controller_state",
    "write_controller_state",
]

STATE_FILENAME = "controller_state.json"
STATE_KEYS = ("beta", "tau", "tau_log", "tau_entropy_ema", "meta")


class FileBackedController(Protocol):
    """What the file needs of a controller
    (:class:`~maxent_grpo.training.callbacks.controller_base.Controller` satisfies it)."""

    #: the objective attributes it moves (``tau`` / ``beta``, or another ``tunable`` one)
    moves: tuple[str, ...]
    #: its ``state_dict`` key -> where the value lives in the file (``meta.x`` is
    #: ``state["meta"]["x"]``); ``steps`` is required on read, the rest may be null
    file_fields: dict[str, str]

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def write_controller_state(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` as JSON to ``path`` atomically (a reader sees the old file or the new
    one, never half of one); non-finite numbers are refused (``allow_nan=False``)."""
    text = json.dumps(state, indent=2, sort_keys=True, allow_nan=False) + "\n"
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def read_controller_state(path: str | Path) -> dict[str, Any]:
    """Read ``controller_state.json`` and check its schema (see the module docstring).

    Raises FileNotFoundError for a missing file and ValueError naming the file (and the key)
    for invalid JSON (a truncated or corrupt file), a missing key or a value of the wrong type.
    """
    path = Path(path)
    require(not path.is_dir(), f"controller state file {str(path)!r} is a folder; name the "
            "controller_state.json file in it")
    if not path.is_file():
        raise FileNotFoundError(f"controller state file not found: {str(path)!r}")
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(
            f"controller state file {str(path)!r} is not valid JSON (truncated or corrupt?): "
            f"{err}"
        ) from err
    require(isinstance(state, dict), f"controller state file {str(path)!r} must hold a JSON object")
    for key in STATE_KEYS:
        require(
            key in state,
            f"controller state file {str(path)!r} has no key {key!r}; expected keys "
            f"{list(STATE_KEYS)}",
        )
    for key in STATE_KEYS[:-1]:
        require(
            state[key] is None or is_number(state[key]),
            f"controller state file {str(path)!r}: {key!r} must be a finite number or null; "
            f"got {state[key]!r}",
        )
    require(isinstance(state["meta"], dict),
            f"controller state file {str(path)!r}: 'meta' must be an object")
    return state


def build_snapshot(
    objective: Objective, controllers: Sequence[FileBackedController]
) -> dict[str, Any]:
    """The file's content: tau / beta from the objective (``null`` unless tunable), any other
    attribute a controller moves by its name, each controller's own state through its
    ``file_fields``."""
    tau = float(objective.tau) if "tau" in objective.tunable else None
    beta = float(objective.beta) if "beta" in objective.tunable else None
    snapshot: dict[str, Any] = {
        "beta": beta,
        "tau": tau,
        "tau_log": math.log(tau) if tau else None,
        "tau_entropy_ema": None,
        "meta": {},
    }
    for controller in controllers:
        snapshot.update({name: float(getattr(objective, name))
                         for name in controller.moves if name not in ("tau", "beta")})
        for key, value in controller.state_dict().items():
            where, name = _location(snapshot, controller.file_fields[key])
            where[name] = value
    return snapshot


#: the largest step count a state file may hold: the JSON number is read as a float, whole
#: numbers beyond it are not exact
MAX_STEPS = 2**53


def apply_snapshot(
    state: dict[str, Any], path: str, objective: Objective,
    controllers: Sequence[FileBackedController],
) -> None:
    """Restore a :func:`read_controller_state` result: each controller's own state, and the
    objective attributes it moves (``controller.moves``: ``tau`` / ``beta``, or one of its
    own).

    Every value is checked before any is applied: a missing key, or a required value that
    is not a finite number (``tau``, ``beta``, another moved attribute, ``meta.<x>_steps``) or
    out of its range (``tau > 0``, ``beta >= 0``, whole step counts in ``[0, 2**53]``), raises
    ValueError naming the file and the key, and leaves the objective and the controllers as
    they were.
    """
    moved: dict[str, float] = {}
    own: list[tuple[FileBackedController, dict[str, Any]]] = []
    for controller in controllers:
        for name in controller.moves:
            moved[name] = value = _value(state, name, path, required=True)
            least = "> 0" if name == "tau" else ">= 0"  # what the objective takes
            require(value > 0 if name == "tau" else value >= 0 or name != "beta",
                    f"controller state file {path!r}: {name!r} must be {least}; got {value!r}")
        values = {key: _value(state, loc, path, required=key == "steps")
                  for key, loc in controller.file_fields.items()}
        steps = values["steps"]
        require(0 <= steps <= MAX_STEPS and steps == int(steps),
                f"controller state file {path!r}: {controller.file_fields['steps']!r} must be "
                f"a whole number from 0 to 2**53; got {steps!r}")
        values["steps"] = int(steps)
        own.append((controller, values))
    for name, value in moved.items():
        setattr(objective, name, value)
    for controller, values in own:
        controller.load_state_dict(values)


def _location(state: dict[str, Any], location: str) -> tuple[dict[str, Any], str]:
    """The dict that holds ``location`` (``"tau"`` or ``"meta.tau_steps"``) and its key."""
    if location.startswith("meta."):
        return state["meta"], location.removeprefix("meta.")
    return state, location


def _value(state: dict[str, Any], location: str, path: str, required: bool) -> float | None:
    """The number at ``location``: a finite number, or also ``null`` unless ``required``;
    the key itself must be there."""
    where, name = _location(state, location)
    require(name in where, f"controller state file {path!r} has no key {location!r}")
    value = where[name]
    if value is None and not required:
        return None
    require(
        is_number(value),
        f"controller state file {path!r}: {location!r} must be a finite number"
        f"{'' if required else ' or null'}; got {value!r}",
    )
    return float(value)
