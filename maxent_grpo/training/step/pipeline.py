"""Asynchronous rollouts with bounded staleness (``model.max_staleness = k``).

With ``k = 0`` (the default) a step rolls out its own batch and trains on it. With ``k >= 1``
step ``t`` hands its batch to a background thread, which asks the engine for the rollout
(a server engine: the servers generate while the trainer computes), and trains on the
rollout of batch ``t - k``, generated from the weights of ``k`` optimizer steps before (one
per step with ``num_iterations = 1``). The first ``k`` steps only start rollouts and do not
train; the last ``k`` rollouts of a run are never trained on.

Per step, in the main thread::

    wait for the rollout in flight          # its requests finish on the weights they began on
    engine.sync(policy)                     # the new weights go to the servers
    submit rollout(batch_t), seeded here    # generates in the background
    train on rollout(batch_{t-k})           # staleness = weights version now - then

So each rollout is sampled from one weights version: no rollout spans an update. One
rollout is generated at a time, so ``k = 1`` already overlaps generation with training
fully; a larger ``k`` only makes the batch older. The request seeds are drawn in the main
thread from torch's random stream, so a run is reproducible and an exact resume continues
it: a checkpoint waits for the rollouts in flight and stores them
(:meth:`RolloutPipeline.state_dict`), and the resumed run trains on them as the
uninterrupted run does.

The policy-gradient correction for the stale sampler is ``model.sampler_correction``
(required with ``k >= 1``): docs/ALGORITHM.md §2, "Stale rollouts".
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from collections import deque
from typing import Any

import torch

from maxent_grpo.rollout.batch import checked_rollout
from maxent_grpo.rollout.protocol import RolloutOutput, samples_here, staleness_needs_a_server
from maxent_grpo.rollout.seeds import request_seeds_from
from maxent_grpo.training.step.metrics import all_gather_objects
from maxent_grpo.validation import check_int, require

__all__ = ["Prefetched", "RolloutPipeline", "check_staleness", "restore_rollouts"]

CHECKPOINT_KEY = "maxent_grpo_rollouts"
DROPPED_KEY = "maxent_grpo_rollouts_dropped"  # per rank: rollouts a failure ended unfinished
log = logging.getLogger(__name__)


def check_staleness(max_staleness: Any, sampler_correction: str | None,
                    environment: Any, objective: Any, engine: Any = None) -> None:
    """``model.max_staleness`` and ``model.sampler_correction``: what they need (ValueError
    naming the option; an ``engine`` that samples here is refused for a fit's ``setup``
    instead: no sampler_correction would make it asynchronous)."""
    check_int("model.max_staleness", max_staleness, minimum=0)
    require(max_staleness == 0 or objective.supports_sampler_correction,
            f"model.max_staleness >= 1 needs model.sampler_correction, which needs an "
            f"objective with the clipped surrogate (GRPO, EntropyMaxEnt, GroupMaxEnt); "
            f"{type(objective).__name__} has none: use max_staleness 0"
            + (" and no sampler_correction" if sampler_correction is not None else ""))
    require(sampler_correction is None or objective.supports_sampler_correction,
            f"model.sampler_correction needs an objective with the clipped surrogate "
            f"(GRPO, EntropyMaxEnt, GroupMaxEnt); {type(objective).__name__} has none")
    require(max_staleness == 0 or sampler_correction is not None or samples_here(engine),
            "model.max_staleness >= 1 trains on rollouts sampled from older weights: set "
            "model.sampler_correction (token_tis, the usual choice; docs/ALGORITHM.md §2)")
    require(max_staleness == 0 or environment is None,
            "model.max_staleness >= 1 cannot store an environment's rollouts in a "
            "checkpoint; use max_staleness 0 with model.environment")


@dataclasses.dataclass
class PendingRollout:
    """One batch's rollout: submitted after ``version`` optimizer steps; ``rollout`` once
    done."""

    batch: dict[str, Any]
    version: int
    future: concurrent.futures.Future | None = None
    rollout: RolloutOutput | None = None

    def result(self) -> RolloutOutput:
        if self.rollout is None:
            assert self.future is not None
            self.rollout, self.future = self.future.result(), None
        return self.rollout


class RolloutPipeline:
    """The rollouts in flight of an asynchronous run (see the module docstring)."""

    def __init__(self, max_staleness: int, generation: Any = None) -> None:
        self.max_staleness = max_staleness
        #: the run's GenerationSettings (None: a checkpoint's rollouts are not compared with
        #: the options they were made with)
        self.generation = generation
        self.queue: deque[PendingRollout] = deque()
        #: after :meth:`close`: the rollouts that were done, and how many were not (a
        #: checkpoint saved after a failure, Lightning's ``save_on_exception``, stores them)
        self.closed: list[PendingRollout] = []
        self.dropped = 0
        #: the queue as the step now running found it, all done (None until :meth:`next`;
        #: the module sets None as each training batch starts): what a checkpoint written
        #: before the step finished stores, since its batch runs again
        self.at_step_start: list[PendingRollout] | None = None

    def wait(self, raise_failure: bool = True) -> None:
        """Until every submitted rollout is done (before a weight update or a checkpoint);
        one that failed raises its error, or without ``raise_failure`` is left for the next
        step's wait to raise (a validation's: its checkpoint is saved without it)."""
        for pending in self.queue:
            if raise_failure:
                pending.result()
            elif pending.future is not None and (err := pending.future.exception()):
                log.warning("a rollout in flight failed (%s: %s): the validation runs, and the "
                            "run stops with that error at its next step (if any)",
                            type(err).__name__, err)

    def submit(self, engine: Any, batch: dict[str, Any], num_generations: int,
               version: int) -> None:
        """Start the rollout of ``batch`` in the background, its seeds drawn here."""
        seed = int(torch.randint(0, 2**31 - 1, (1,)))
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:  # a daemon thread: close() waits for it a bounded time only
            if not future.set_running_or_notify_cancel():
                return
            try:
                with request_seeds_from(seed):
                    future.set_result(engine.generate(batch["prompts"], batch["answers"],
                                                      num_generations))
            except BaseException as err:  # noqa: BLE001 - raised in the main thread
                future.set_exception(err)

        self.wait()  # one rollout in flight at a time
        self.closed, self.dropped = [], 0  # a new fit: what an earlier one left is gone
        threading.Thread(target=run, name="maxent-grpo-rollout", daemon=True).start()
        self.queue.append(PendingRollout(batch, version, future))

    def next(self, step_context: Any, batch: dict[str, Any], version: int,
             device: torch.device) -> tuple[Any, dict[str, Any], int] | None:
        """One asynchronous step (the module docstring): wait for the rollout in flight,
        ``step_context()`` (which syncs the engine), start ``batch``'s rollout, and return
        the step's context with the rollout to train on (the oldest, once ``max_staleness``
        newer ones were submitted), its batch and its staleness; None in the first
        ``max_staleness`` steps. The engine must generate elsewhere (a server)."""
        self.wait()  # the rollout in flight ends on its weights before the sync
        self.at_step_start = list(self.queue)
        ctx = step_context()
        inner = getattr(ctx.engine, "engine", ctx.engine)  # a multi-turn engine's own
        require(getattr(inner, "generates_elsewhere", False),  # a factory's engine
                staleness_needs_a_server(type(inner).__name__))
        self.submit(ctx.engine, batch, ctx.generation.num_generations, version)
        if len(self.queue) <= self.max_staleness:
            return None
        ready = self.queue.popleft()
        rollout = checked_rollout(  # named with the engine here, not as Prefetched
            ctx.engine, ready.result(), len(ready.batch["prompts"]),
            ctx.generation.num_generations, ctx.policy, ctx.generation.sampling.max_new_tokens,
        ).to(device)  # CPU if restored
        ctx = dataclasses.replace(ctx, engine=Prefetched(ctx.engine, rollout))
        return ctx, ready.batch, version - ready.version

    def close(self, timeout: float = 30.0) -> None:
        """Empty the queue after waiting at most ``timeout`` seconds for the rollout still
        running (its error, if any, ignored), so that no rollout thread outlives the run: a
        daemon thread still inside torch when the interpreter exits aborts the process (exit
        status 134, after a fit that succeeded too). The module closes the engine first, so
        that a rollout still running on a server fails at once instead of being finished
        and thrown away. The rollouts that were done stay in :attr:`closed` for a
        checkpoint saved after a failure; the others are counted in :attr:`dropped`."""
        concurrent.futures.wait([p.future for p in self.queue if p.future is not None],
                                timeout=timeout)
        done = [p.future is None or (p.future.done() and not p.future.cancelled()
                                     and p.future.exception() is None) for p in self.queue]
        kept = done.index(False) if False in done else len(done)  # only the newest runs
        self.closed, self.dropped = list(self.queue)[:kept], len(done) - kept
        self.queue.clear()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, step_cut_short: bool = False) -> list[dict[str, Any]]:
        """The rollouts in flight, done, as plain tensors, lists and strings (after
        :meth:`close`, those that were done; with ``step_cut_short``, those the step found,
        :attr:`at_step_start`, once it has them). One that failed is left out: the
        checkpoint is saved, and the next step raises its error."""
        kept = self.at_step_start if step_cut_short else None
        if kept is None:
            kept = self._finished() if self.queue else list(self.closed)
        return [{"batch": p.batch, "version": p.version, "rollout": p.result().state_dict()}
                for p in kept]

    def _finished(self) -> list[PendingRollout]:
        """The queue, each rollout waited for, up to one that failed (a server died; the
        newest, as one runs at a time), which a warning names."""
        kept = []
        for pending in self.queue:
            try:
                pending.result()
            except Exception as err:  # noqa: BLE001 - the next step's wait() raises it
                log.warning("a rollout in flight failed (%s: %s): this checkpoint is saved "
                            "without it, and the run stops with that error at its next step "
                            "(if any)", type(err).__name__, err)
                break
            kept.append(pending)
        return kept

    def save(self, checkpoint: dict[str, Any], step_cut_short: bool = False) -> None:
        """Every rank's rollouts in flight into ``checkpoint`` (a collective), and how many
        a failure ended unfinished (their batches are not trained after a resume). With
        ``step_cut_short`` (an exception stopped a training step, which Lightning runs again
        at the resume), the rollouts as that step found them."""
        cut = step_cut_short and self.at_step_start is not None
        state = self.state_dict(cut)
        dropped = 0 if cut else len(self.queue) - len(state) if self.queue else self.dropped
        per_rank = all_gather_objects((state, dropped))
        # after a failure one rank's newest rollout may have finished and another's not:
        # every rank keeps as many (the oldest), so that all train from the same step on
        n = min(len(state) for state, _ in per_rank)
        checkpoint[CHECKPOINT_KEY] = [state[:n] for state, _ in per_rank]
        checkpoint[DROPPED_KEY] = [dropped + len(state) - n for state, dropped in per_rank]
        rank = torch.distributed.get_rank() if len(per_rank) > 1 else 0
        if dropped := checkpoint[DROPPED_KEY][rank]:
            log.warning("this checkpoint lacks %d rollout(s) that were still being generated "
                        "when the run stopped (a failure, or a fit that ended) or that failed: "
                        "a resume does not train their batches (it is not the run an "
                        "uninterrupted fit would have made)", dropped)

    def restore(self, checkpoint: dict[str, Any], fitting: bool, rank: int, world: int) -> None:
        """This rank's rollouts from :meth:`save`'s ``checkpoint``, when the checkpoint is
        loaded to continue training (not to validate or test)."""
        self.close()
        self.closed, self.dropped = [], 0
        per_rank = checkpoint.get(CHECKPOINT_KEY)
        if not fitting or per_rank is None:
            return
        require(len(per_rank) == world,
                f"this checkpoint holds the rollouts in flight of {len(per_rank)} processes; "
                f"this run has {world}: resume with as many processes")
        if dropped := (checkpoint.get(DROPPED_KEY) or [0] * world)[rank]:
            log.warning("this checkpoint lacks %d rollout(s) that the run's stop or a "
                        "failure ended unfinished: their batches are not trained", dropped)
        made, gen = checkpoint.get("hyper_parameters") or {}, self.generation
        if gen is not None and (  # by the saved options, the same on every rank
                made.get("num_generations", gen.num_generations) != gen.num_generations
                or made.get("max_completion_length", 0) > gen.sampling.max_new_tokens):
            log.warning("the checkpoint holds %d rollout(s) in flight made with another "
                        "model.num_generations or a longer model.max_completion_length: they "
                        "are dropped, so their batches are not trained", len(per_rank[rank]))
            return
        self.load_state_dict(per_rank[rank])

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        """Restore :meth:`state_dict` (on the CPU; :meth:`RolloutOutput.to` at training time). A
        checkpoint of a larger ``max_staleness`` keeps its newest rollouts that fit, with a
        warning: the older ones' batches are not trained."""
        if len(state) > self.max_staleness:
            log.warning("the checkpoint holds %d rollout(s) in flight and model.max_staleness "
                        "is %d: the oldest %d are dropped, so their batches are not trained "
                        "(resume with the checkpoint's max_staleness to train them)",
                        len(state), self.max_staleness, len(state) - self.max_staleness)
        state = state[-self.max_staleness:]
        self.queue = deque(PendingRollout(s["batch"], s["version"],
                                          rollout=RolloutOutput.from_state(s["rollout"]))
                           for s in state)


def restore_rollouts(pipeline: RolloutPipeline | None, checkpoint: dict[str, Any],
                     fitting: bool, rank: int, world: int) -> None:
    """:meth:`RolloutPipeline.restore`; without a pipeline (``max_staleness`` 0), a warning
    when a fit resumes from a checkpoint that holds rollouts in flight (not trained)."""
    if pipeline is not None:
        pipeline.restore(checkpoint, fitting, rank, world)
    elif fitting and any(checkpoint.get(CHECKPOINT_KEY) or []):
        log.warning("the checkpoint holds rollouts in flight of a run with model.max_staleness "
                    ">= 1; with max_staleness 0 they are dropped, so their batches are not "
                    "trained (resume with the checkpoint's max_staleness to train them)")


class Prefetched:
    """The step's engine with its rollout already made: the first ``generate`` for these
    prompts returns it; anything else (a refill round's prompts) goes to the engine."""

    def __init__(self, engine: Any, rollout: RolloutOutput) -> None:
        self._engine, self._rollout = engine, rollout

    def generate(self, prompts: list[str], answers: list[str], num_generations: int,
                 sampling: Any = None) -> RolloutOutput:
        out = self._rollout
        if (out is not None and sampling is None and list(prompts) == out.batch.prompts
                and out.batch.num_completions == len(prompts) * num_generations):
            self._rollout = None
            return out
        return self._engine.generate(prompts, answers, num_generations, sampling)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)
