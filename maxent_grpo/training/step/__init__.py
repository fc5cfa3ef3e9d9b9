"""One training step, with no LightningModule inside: what ``training_step`` runs.

- :mod:`~maxent_grpo.training.step.context`: :class:`StepContext`, everything a step uses;
- :mod:`~maxent_grpo.training.step.trajectory`: ``collect``, rollout -> rewards -> frozen
  log-probs -> targets, as a :class:`Trajectory`;
- :mod:`~maxent_grpo.training.step.optimise`: ``optimizer_step`` over a trajectory's
  micro-batches, returning an :class:`Update`;
- :mod:`~maxent_grpo.training.step.scoring` (teacher-forced log-probs) and
  :mod:`~maxent_grpo.training.step.batching` (micro-batch plans);
- :mod:`~maxent_grpo.training.step.metrics` (exact torchmetrics) and
  :mod:`~maxent_grpo.training.step.step_log` (the logged record);
- :mod:`~maxent_grpo.training.step.strategy`: what differs between DDP, FSDP2 and DeepSpeed;
- :mod:`~maxent_grpo.training.step.timing`: the step's phase timings.
"""
