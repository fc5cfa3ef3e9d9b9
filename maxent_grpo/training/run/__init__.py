"""What the run around the step needs: checkpoints and evaluation.

- :mod:`~maxent_grpo.training.run.checkpoint`: what a checkpoint adds (objective state,
  counters, every rank's random state);
- :mod:`~maxent_grpo.training.run.checkpoint_io`: atomic checkpoint files and resume paths;
- :mod:`~maxent_grpo.training.run.evaluation`: validation and test sampling and grading.
"""
