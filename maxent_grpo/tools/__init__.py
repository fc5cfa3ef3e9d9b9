"""Tools around the trainer, never imported by it: :mod:`~maxent_grpo.tools.analysis` reads
runs and studies back for notebooks and benchmarks."""
