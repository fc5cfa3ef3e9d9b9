"""Training objectives: GRPO, entropy-regularised GRPO, listwise MaxEnt-GRPO, group MaxEnt.

Each objective is a small class with validated hyper-parameters, chosen in YAML with
``class_path`` (``docs/ALGORITHM.md`` §4), e.g. ``maxent_grpo.objectives.ListwiseMaxEnt``.
The LightningModule drives them in two phases per rollout:

1. :meth:`Objective.prepare` once per rollout, on whole groups: a :class:`GroupInputs`
   of ``(B, G)`` tensors (rewards, completion lengths, the distinct completions, the answer
   classes, and, when :attr:`Objective.needs_reference`, the length-normalised reference
   log-likelihood ``rho``). It returns :class:`Targets`: per-row advantages and/or
   per-group weights, all constants.
2. :meth:`Objective.loss` once per micro-batch of whole groups, on token log-probs with
   gradient, scaled so that the *sum* over the micro-batches of one optimizer step equals
   the loss of the whole batch.

Modules: ``base`` (the interface, and the clipped surrogate shared by GRPO, EntropyMaxEnt
and GroupMaxEnt), ``grpo`` (:class:`GRPO` §4.1, :class:`EntropyMaxEnt` §4.2)
and ``maxent`` (:class:`ListwiseMaxEnt` §4.3, :class:`GroupMaxEnt` §4.4); the mathematics
lives in :mod:`maxent_grpo.core`.
"""

from maxent_grpo.objectives.base import (
    GroupInputs,
    LossOutput,
    LossType,
    MicroBatch,
    Objective,
    Targets,
    check_objective,
    sequence_ref_loglik,
    weight_stats,
)
from maxent_grpo.objectives.grpo import GRPO, EntropyMaxEnt, KLEstimator, ScaleRewards
from maxent_grpo.objectives.maxent import GroupMaxEnt, ListwiseMaxEnt

__all__ = [
    "GRPO", "EntropyMaxEnt", "GroupInputs", "GroupMaxEnt", "KLEstimator", "ListwiseMaxEnt",
    "LossOutput", "LossType", "MicroBatch", "Objective", "ScaleRewards", "Targets",
    "check_objective", "sequence_ref_loglik", "weight_stats",
]
