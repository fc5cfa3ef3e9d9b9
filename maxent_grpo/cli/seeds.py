"""The command line's ``seed_everything``, for one run in a process and for several (a
notebook, a sweep calling :func:`~maxent_grpo.cli.parser.main` in a loop).

Lightning's ``seed_everything`` leaves the seed in the environment (``PL_GLOBAL_SEED``); a
later run of the same process found it there, and ``seed_everything: true`` took it
instead of drawing (every "random" run of a sweep the same seed), and an unseeded run
recorded it as its seed. Each run's first process now says its seed in
:data:`~maxent_grpo.training.run.checkpoint.SEED_ENV` (also after a resume keeps the
checkpoint's), and only the processes Lightning's DDP launcher starts for it (they begin
with that variable and a ``LOCAL_RANK`` of 1 or more) take it.
"""

from __future__ import annotations

import os
import random

from maxent_grpo.training.run.checkpoint import SEED_ENV

__all__ = ["launcher_child", "run_seed_option"]

#: the environment the process started with
_AT_START = {key: os.environ.get(key) for key in (
    SEED_ENV, "LOCAL_RANK", "WORLD_SIZE", "SLURM_NTASKS", "SLURM_JOB_NAME", "NODE_RANK",
    "GROUP_RANK")}


def launcher_child() -> bool:
    """Whether Lightning's DDP launcher started this process for a run of the command line
    (which then takes that run's seed)."""
    return _AT_START[SEED_ENV] is not None and _AT_START["LOCAL_RANK"] not in (None, "0")


def run_seed_option(given: int | bool | None, num_nodes: int = 1) -> int | bool | None:
    """The ``seed_everything`` a run seeds with: ``true`` draws one (a launched process
    takes its first process's: False when that run is unseeded), any other value is as
    given; the first process records its choice for the processes it launches. Processes
    that torchrun, SLURM or each node's own launcher start would each draw their own:
    ValueError."""
    if launcher_child():
        inherited = _AT_START[SEED_ENV]
        return (False if inherited == "none" else int(inherited)) if given is True else given
    os.environ.pop("PL_GLOBAL_SEED", None)  # an earlier run's, in this process
    os.environ.pop("PL_SEED_WORKERS", None)
    if given is True:
        slurm = _AT_START["SLURM_NTASKS"] if _AT_START["SLURM_JOB_NAME"] not in (
            "bash", "interactive") else None  # (Lightning's reading: its own launcher then)
        world = _AT_START["WORLD_SIZE"] or slurm or "1"
        if world != "1" or num_nodes > 1 or any(  # (a node's rank but the first's)
                _AT_START[key] not in (None, "0") for key in ("NODE_RANK", "GROUP_RANK")):
            started = (f"torchrun or SLURM started ({world})" if world != "1"
                       else f"each of the {num_nodes} nodes starts")
            raise ValueError(f"seed_everything: true would draw another seed in each of the "
                             f"processes {started}; give one number, e.g. "
                             "--seed_everything 1234")
        given = random.SystemRandom().randrange(2**32)
    os.environ[SEED_ENV] = str(given) if type(given) is int else "none"
    return given
