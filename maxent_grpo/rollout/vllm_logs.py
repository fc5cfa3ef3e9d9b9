"""What vLLM prints in the training process: its warnings and errors, without the lines
nobody can act on.

A colocated :class:`~maxent_grpo.rollout.VLLMEngine` runs vLLM inside the trainer, and vLLM
logs at its default level, INFO: about 33 lines each time the engine starts (one of them the
whole engine configuration, several KB), and on the CPU a warning after every rollout.
:func:`quiet_vllm_logs`, which :func:`~maxent_grpo.rollout.vllm_engine.require_vllm` calls
before it imports vLLM, makes the default:

- ``VLLM_LOGGING_LEVEL=WARNING``, set in this process's environment: vLLM reads the variable
  when it configures its logging, when ``vllm.LLM`` is built; processes vLLM starts inherit
  it;
- the warnings of :data:`NOT_ACTIONABLE` dropped (a ``logging.Filter`` on each logger that
  emits one, in this process): lines that come on every run and report either a choice the
  engine makes on purpose or vLLM's own internals, so there is nothing a user could change;
  each entry says why;
- vLLM's own use of a deprecated torch name (a ``FutureWarning``) ignored.

Every other warning, and every error, still shows (``libtcmalloc is not found in
LD_PRELOAD`` on the CPU, for one: a user can act on it). The engine also turns off vLLM's
progress bar of weight loading while these defaults hold (``use_tqdm_on_load``) and keeps
vLLM's logger at ERROR during each weight reload (:func:`quiet_during`: three lines after
every optimizer step). The user's choice wins: with ``VLLM_LOGGING_LEVEL``,
``VLLM_LOGGING_CONFIG_PATH`` or ``VLLM_CONFIGURE_LOGGING`` in the environment before the
run, none of this applies (``VLLM_LOGGING_LEVEL=INFO`` brings back every line vLLM prints
by itself, ``DEBUG`` more).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

__all__ = ["NOT_ACTIONABLE", "QUIET_LEVEL", "USER_SETTINGS", "quiet_during", "quiet_vllm_logs",
           "quieted"]

#: the level vLLM logs at by default in a training run
QUIET_LEVEL = "WARNING"
#: environment variables that mean the user configures vLLM's logging: any one set, and
#: :func:`quiet_vllm_logs` changes nothing
USER_SETTINGS = ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING")

#: vLLM logger name -> the starts of the warnings (their format strings) that are dropped
NOT_ACTIONABLE: dict[str, tuple[str, ...]] = {
    "vllm.engine.arg_utils": (
        # the engine runs vLLM in this process on purpose and restores python's, numpy's
        # and torch's random states around every vLLM call itself
        "The global random seed is set to",
        # the engine turns chunked prefill off on the CPU on purpose (a chunked prefill
        # rewinds a seeded sampler, which CPU generators cannot do); no option changes it
        "This model does not officially support disabling chunked prefill",
    ),
    "vllm.config.vllm": (
        # the consequences of enforce_eager, which the engine always sets on the CPU and
        # whose option (VLLMEngine.enforce_eager) is documented: not a fault
        "Enforce eager set",
        "Inductor compilation was disabled by user settings",
        # the CPU build runs without Triton (next entries); vLLM picks its other runner
        "Model Runner V2 requires Triton",
    ),
    # the CPU build of vLLM comes without triton-cpu, and the triton that torch installs
    # has no CPU backend; vLLM runs without it, and no package a user could add supplies it
    "vllm.platforms.cpu": ("Triton is not installed",),
    "vllm.triton_utils.importing": ("Triton is installed, but doesn't include CPU backend",),
    # vLLM's CPU worker replaces torch.set_num_threads with this warning, and vLLM's own code
    # then calls it around every rollout: one line per rollout, from vLLM to itself
    "vllm.v1.worker.cpu_worker": ("CPU backend doesn't allow to use `torch.set_num_threads`",),
}

_ours: str | None = None  # the VLLM_LOGGING_LEVEL this module set, once it did


class _Drop(logging.Filter):
    """Drops the records whose format string starts with one of ``starts``."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno < logging.ERROR and str(record.msg).startswith(self.starts))


def quieted() -> bool:
    """Whether the quiet defaults hold in this process (:func:`quiet_vllm_logs` set them
    and the user has not set ``VLLM_LOGGING_LEVEL`` since)."""
    return _ours is not None and os.environ.get("VLLM_LOGGING_LEVEL") == _ours


def quiet_vllm_logs() -> bool:
    """Apply the quiet defaults (module docstring) unless the user set one of
    :data:`USER_SETTINGS`; returns whether they hold. Call it before vLLM is first imported
    (a later call still filters the lines to come). Calling it again changes nothing."""
    global _ours
    if not quieted():
        if any(name in os.environ for name in USER_SETTINGS):
            return False
        os.environ["VLLM_LOGGING_LEVEL"] = _ours = QUIET_LEVEL
    for name, starts in NOT_ACTIONABLE.items():
        log = logging.getLogger(name)  # the logger vLLM's module gets when it is imported
        if not any(isinstance(f, _Drop) for f in log.filters):
            log.addFilter(_Drop(starts))
    # vLLM's scan of torch's modules touches this deprecated name (vLLM's code, not ours)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_op` is deprecated",
                            category=FutureWarning, module=r"vllm\.")
    return True


@contextlib.contextmanager
def quiet_during() -> Iterator[None]:
    """vLLM's logger held at ERROR for the block, while the quiet defaults hold: a weight
    reload logs three lines (one a warning that rotary embeddings have no weights to load)
    after every optimizer step."""
    if not quieted():
        yield
        return
    log = logging.getLogger("vllm")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)
