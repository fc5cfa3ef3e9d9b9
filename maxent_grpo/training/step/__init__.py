"""One training step, with no LightningModule inside: what ``training_step`` runs, given a
:class:`~maxent_grpo.training.step.trajectory.StepContext`: ``trajectory.collect`` (rollout ->
rewards -> frozen log-probs -> targets), then ``optimise.optimizer_step``."""
