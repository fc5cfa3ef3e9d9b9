"""The seeds of a rollout's sampling requests, which the colocated and the server vLLM
engines share: drawn from torch's random stream (or a thread's own generator), with a span
of seeds per rank so that no two samples of a call share a random stream."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from maxent_grpo.validation import require

__all__ = ["SEED_SPAN", "request_seed_base", "request_seeds", "request_seeds_from"]

_SEEDS = threading.local()


@contextlib.contextmanager
def request_seeds_from(seed: int) -> Iterator[None]:
    """In this thread, draw the request seeds from a generator seeded with ``seed`` instead
    of torch's global stream: a rollout made in a background thread
    (:mod:`~maxent_grpo.training.step.pipeline`) is then reproducible whatever the main
    thread draws meanwhile."""
    _SEEDS.generator = torch.Generator().manual_seed(int(seed))
    try:
        yield
    finally:
        _SEEDS.generator = None


#: seeds a rank may use in one call: rank r draws from [base + r * SEED_SPAN, ... + SEED_SPAN)
SEED_SPAN = 2**20


def request_seeds(base: int, rank: int, num_requests: int, group: int) -> list[int]:
    """The seed of each of ``num_requests`` requests of ``group`` samples, such that no two
    samples of a call on any rank share a random stream.

    vLLM seeds the ``g``-th sample of a request with seed ``s`` as ``s + g`` (``g < n``), so
    request ``i`` gets ``base + rank * SEED_SPAN + i * group``: its samples take the
    ``group`` seeds from there, and the ranks (which draw the same ``base`` from the same
    torch stream) take disjoint spans. (A seed ``base + i`` per request gave sample
    ``(i, g)`` the stream of ``(i + 1, g - 1)``.)

    >>> request_seeds(100, 0, 3, 2), request_seeds(100, 1, 1, 2)
    ([100, 102, 104], [1048676])
    """
    require(num_requests * group <= SEED_SPAN,
            f"{num_requests} requests of {group} samples exceed the {SEED_SPAN} seeds a rank "
            "may use in one call")
    return [base + rank * SEED_SPAN + i * group for i in range(num_requests)]


def request_seed_base() -> int:
    """The base of a call's request seeds (:func:`request_seeds`), drawn from torch's random
    stream (so that ``seed_everything`` reproduces the samples and an exact resume continues
    them; in a :func:`request_seeds_from` block, from its generator). Shared by the
    colocated and the server engine, so that both sample alike from the same seed; with
    the ranks' spans the seeds stay below 2**31 up to 1024 ranks."""
    generator = getattr(_SEEDS, "generator", None)
    return int(torch.randint(0, 2**30, (1,), generator=generator))
