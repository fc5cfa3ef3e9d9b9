"""What the run around the step needs: checkpoints, evaluation and the models.

- :mod:`~maxent_grpo.training.run.checkpoint`: what a checkpoint adds (objective state,
  counters, every rank's random state);
- :mod:`~maxent_grpo.training.run.checkpoint_io`: atomic checkpoint files and resume paths;
- :mod:`~maxent_grpo.training.run.folders`: the run's own folder (``{log_dir}``) and its
  ``config.yaml``;
- :mod:`~maxent_grpo.training.run.evaluation`: validation and test sampling and grading;
- :mod:`~maxent_grpo.training.run.policy_models`: loading and holding the policy, its
  tokenizer and the reference (FSDP2 sharding, the trained parameters);
- :mod:`~maxent_grpo.training.run.savers`: ``ModelCheckpoint`` savers across a resume (a
  moved folder, changed options: ``last.ckpt`` written over);
- :mod:`~maxent_grpo.training.run.signals`: SIGTERM, every rank stopping after the same batch;
- :mod:`~maxent_grpo.training.run.validated`: a validation a stop cut short runs at the resume.
"""
