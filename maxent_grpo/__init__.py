"""maxent-grpo: a PyTorch Lightning trainer for GRPO and maximum-entropy GRPO.

Importing the top-level package is cheap on purpose: it pulls in neither Lightning nor
transformers. The pure math lives in :mod:`maxent_grpo.core`.
"""

__version__ = "0.2.0"
