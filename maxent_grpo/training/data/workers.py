"""DataLoader workers that leave the stop signals to their main process.

A scheduler's stop reaches every process of a job, not only the trainer: SLURM's
``scancel`` and time limit send SIGTERM, ``#SBATCH --signal=USR1@600`` SIGUSR1, a terminal's
Ctrl-C SIGINT to the whole foreground group. The main process takes them (it stops after
its batch, or saves and requeues) and shuts its workers down itself; a worker they killed
first failed the run ("DataLoader worker ... killed by signal", exit 1, without the
``save_on_exception`` save), and Ctrl-C printed each worker's trace. So a worker ignores
SIGINT and SIGUSR1, and (where the platform has ``sigwaitinfo``: Linux) takes SIGTERM only
from its main process (PyTorch's and multiprocessing's own shutdown) or once that process
is gone; SIGTERM from anyone else is left to the main process. Elsewhere (macOS) SIGTERM
ends a worker as by default. The signals are blocked while the workers start, so a worker
spawned (not forked) is not killed before it has set this up.
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import signal
import threading
from multiprocessing import forkserver, resource_tracker
from typing import Any

from torch.utils.data import DataLoader

__all__ = ["SignalSafeLoader", "LeaveStops"]

_IGNORED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGUSR1") if hasattr(signal, name))
_TAKES_SENDER = hasattr(signal, "sigwaitinfo") and hasattr(signal, "pthread_sigmask")
_BLOCKED = {*_IGNORED, signal.SIGTERM} if _TAKES_SENDER else set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process of that number: not ours, but there
        return True
    return True


def _take_sigterm(owners: frozenset[int]) -> None:
    """A worker's thread: SIGTERM (blocked in the worker) from one of ``owners`` (its main
    process, its parent: a shutdown) ends the worker with 0, as PyTorch's own handler does
    (another code reads as a worker that failed); after the main process is gone, with 143;
    from anyone else it is left to the main process."""
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid in owners:
            os._exit(0)
        if not all(_alive(pid) for pid in owners):
            os._exit(128 + signal.SIGTERM)


class LeaveStops:
    """A DataLoader's ``worker_init_fn`` (picklable): the signals as the module docstring
    says, then the user's own ``worker_init_fn``, if any."""

    def __init__(self, then: Any = None) -> None:
        self.main = os.getpid()
        self.then = then

    def __call__(self, worker_id: int) -> None:
        for sig in _IGNORED:
            signal.signal(sig, signal.SIG_IGN)  # a pending one is dropped
        if _TAKES_SENDER:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # (forkserver's)
            threading.Thread(target=_take_sigterm, name="maxent-grpo-sigterm", daemon=True,
                             args=(frozenset({self.main, os.getppid()}),)).start()
            signal.pthread_sigmask(signal.SIG_UNBLOCK, set(_IGNORED))
        if self.then is not None:
            self.then(worker_id)


class SignalSafeLoader(DataLoader):
    """A DataLoader whose workers leave the stop signals to the main process
    (:class:`LeaveStops`, around a ``worker_init_fn`` given)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(DataLoader.__init__).bind(self, *args, **kwargs)
        given = bound.arguments.get("worker_init_fn")
        if not isinstance(given, LeaveStops):  # (Lightning rebuilds a loader with its own)
            bound.arguments["worker_init_fn"] = LeaveStops(given)
        super().__init__(*bound.args[1:], **bound.kwargs)

    def _get_iterator(self) -> Any:
        """The workers start with the stop signals blocked (they inherit the mask)."""
        if self.num_workers == 0 or not _BLOCKED:
            return super()._get_iterator()
        method = (self.multiprocessing_context or multiprocessing).get_start_method()
        if method != "fork":
            resource_tracker.ensure_running()  # its first start unblocks SIGINT and SIGTERM
        if method == "forkserver":  # started while blocked, it would block them in all it forks
            forkserver.ensure_running()
        before = signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED)
        try:
            return super()._get_iterator()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
