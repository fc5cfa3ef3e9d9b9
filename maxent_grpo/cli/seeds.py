"""The command line's ``seed_everything``, for one run in a process and for several (a
notebook, a sweep calling :func:`~maxent_grpo.cli.parser.main` in a loop).

Lightning's ``seed_everything`` leaves the seed in the environment (``PL_GLOBAL_SEED``),
which is how the processes its DDP launcher starts take the first one's; a later run of the
same process found it there too, and ``seed_everything: true`` took it instead of drawing
(every "random" run of a sweep the same seed), and an unseeded run recorded it as its
seed. What the process started with tells the two apart.
"""

from __future__ import annotations

import os
import random

__all__ = ["launcher_child", "run_seed_option"]

#: the environment the process started with: one that Lightning's DDP launcher started
#: inherits its first process's seed and a ``LOCAL_RANK`` of 1 or more
_AT_START = {key: os.environ.get(key)
             for key in ("PL_GLOBAL_SEED", "LOCAL_RANK", "WORLD_SIZE", "SLURM_NTASKS")}


def launcher_child() -> bool:
    """Whether this process was started by Lightning's DDP launcher for a seeded run."""
    return _AT_START["PL_GLOBAL_SEED"] is not None and _AT_START["LOCAL_RANK"] not in (None, "0")


def run_seed_option(given: int | bool | None) -> int | bool | None:
    """The ``seed_everything`` a run seeds with: ``true`` draws one (a launched process
    takes its first process's), any other value is as given. An earlier run's seed left in
    the environment is dropped first, so a run that is not seeded records no seed. Processes
    that torchrun or SLURM start would each draw their own: ValueError."""
    if launcher_child():
        return int(_AT_START["PL_GLOBAL_SEED"]) if given is True else given
    os.environ.pop("PL_GLOBAL_SEED", None)
    os.environ.pop("PL_SEED_WORKERS", None)
    if given is not True:
        return given
    world = _AT_START["WORLD_SIZE"] or _AT_START["SLURM_NTASKS"] or "1"
    if world != "1":
        raise ValueError(
            "seed_everything: true would draw another seed in each of the processes "
            f"torchrun or SLURM started ({world}); give one number, e.g. "
            "--seed_everything 1234")
    return random.SystemRandom().randrange(2**32)
