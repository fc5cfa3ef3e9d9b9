"""A task every objective learns in seconds, shared by ``tests/training/test_objectives_learn.py``
and the recording script ``benchmarks/objective_learning.py`` (which measured the bounds).

The random-init ``builtin:tiny`` model (a character vocabulary of about 100 symbols) writes
4 characters after a bare sum; the reward is the share of them that are digits, about 0.1 by
chance. Dense, exact and free of any warm start, it shows in 40 steps whether an objective
moves the policy towards what is rewarded.
"""

from __future__ import annotations

import copy

import lightning as L
import torch

from maxent_grpo.objectives import GRPO, EntropyMaxEnt, GroupMaxEnt, ListwiseMaxEnt

STEPS = 40
WINDOW = 10  # first and last WINDOW steps are compared

OBJECTIVES = {
    "GRPO": GRPO(),
    "EntropyMaxEnt": EntropyMaxEnt(alpha=0.01),
    "ListwiseMaxEnt": ListwiseMaxEnt(tau=0.5),
    "GroupMaxEnt": GroupMaxEnt(tau=0.5),
}


def digit_share(prompts, completions, **kw):
    """The share of each completion's characters that are digits."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


class RewardCurve(L.Callback):
    """``train/reward/mean`` after every training batch."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.values.append(float(trainer.callback_metrics["train/reward/mean"]))


def learning_curve(name: str, seed: int, cache_dir: str) -> list[float]:
    """The mean reward of each of ``STEPS`` steps of ``name`` on the digit task."""
    from maxent_grpo.training.data import PromptDataModule
    from maxent_grpo.training.module import MaxEntGRPOModule

    L.seed_everything(seed)
    module = MaxEntGRPOModule(
        objective=copy.deepcopy(OBJECTIVES[name]),
        rewards={"tests.objective_learning:digit_share": 1.0}, num_generations=4,
        max_completion_length=4, model_cache_dir=cache_dir,
        optimizer=lambda params: torch.optim.Adam(params, lr=3e-3))
    data = PromptDataModule(
        task="arithmetic_easy", task_options={"bare": True}, train_size=STEPS * 4, val_size=4,
        batch_size=4, max_prompt_length=32, tokenizer="builtin:tiny",
        tokenizer_cache_dir=cache_dir, seed=seed)
    curve = RewardCurve()
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[curve])
    trainer.fit(module, data)
    return curve.values


def first_and_last(curve: list[float]) -> tuple[float, float]:
    return sum(curve[:WINDOW]) / WINDOW, sum(curve[-WINDOW:]) / WINDOW
