"""Pure MaxEnt-GRPO math on tensors (``docs/ALGORITHM.md``).

Everything here imports torch only: no Lightning, no transformers, no files. Shapes use
one vocabulary: ``B`` prompts, ``G`` generations per prompt, ``T`` completion tokens,
``V`` vocabulary size. Per-token tensors are ``(B*G, T)`` in prompt-major order.
"""

from maxent_grpo.core.advantages import (
    ESTIMATORS,
    answer_classes,
    batch_normalised,
    check_answer_classes,
    constant_groups,
    distinct_candidates,
    droppable_groups,
    estimate_advantages,
    group_advantages,
    leave_one_out_advantages,
    passk_advantages,
    pkpo_advantages,
    repetition_penalty,
    set_diversity_bonus,
    unlikeliness_rewards,
    wreinforce_advantages,
    zero_std_fraction,
)
from maxent_grpo.core.at_k import coverage_at_k, distinct_at_k, mean_at_k, pass_at_k
from maxent_grpo.core.control import (
    BetaUpdate,
    MetaUpdate,
    TauUpdate,
    beta_update,
    entropy_gate_multiplier,
    entropy_target_at,
    meta_update,
    tau_update,
)
from maxent_grpo.core.fused_head import fused_head_log_softmax
from maxent_grpo.core.listwise import (
    answer_listwise_loss,
    answer_maxent_weights,
    class_logsumexp,
    group_utility,
    group_weights,
    listwise_loss,
    maxent_weights,
    q_distribution,
    sequence_clip_loss,
    weight_entropy,
)
from maxent_grpo.core.logprobs import (
    selective_log_softmax,
    selective_log_softmax_with_entropy,
    token_entropy,
)
from maxent_grpo.core.losses import (
    CORRECTIONS,
    RATIO_LEVELS,
    cispo_surrogate,
    clip_cov_surrogate,
    clip_fractions,
    clipped_surrogate,
    importance_ratio,
    importance_ratio_at,
    kl_cov_surrogate,
    kl_penalty,
    reduce_token_loss,
    sampler_correction_weights,
    token_covariance,
    top_entropy_mask,
)

__all__ = [
    "answer_classes", "answer_listwise_loss", "answer_maxent_weights", "check_answer_classes",
    "class_logsumexp", "repetition_penalty", "set_diversity_bonus", "unlikeliness_rewards",
    "wreinforce_advantages",
    "ESTIMATORS", "RATIO_LEVELS", "batch_normalised", "cispo_surrogate", "clip_cov_surrogate",
    "estimate_advantages", "kl_cov_surrogate", "token_covariance", "top_entropy_mask",
    "importance_ratio_at", "leave_one_out_advantages", "passk_advantages", "pkpo_advantages",
    "BetaUpdate", "MetaUpdate", "TauUpdate", "beta_update", "clip_fractions", "clipped_surrogate",
    "constant_groups", "droppable_groups", "coverage_at_k", "distinct_candidates", "distinct_at_k",
    "entropy_gate_multiplier", "entropy_target_at", "fused_head_log_softmax", "group_advantages",
    "group_utility", "group_weights", "importance_ratio", "kl_penalty", "listwise_loss",
    "maxent_weights", "mean_at_k", "meta_update", "pass_at_k", "q_distribution",
    "reduce_token_loss", "sampler_correction_weights", "selective_log_softmax",
    "selective_log_softmax_with_entropy", "CORRECTIONS",
    "sequence_clip_loss", "tau_update", "token_entropy", "weight_entropy", "zero_std_fraction",
]
