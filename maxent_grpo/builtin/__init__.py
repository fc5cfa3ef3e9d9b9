"""The built-in offline models and the warm starts that made their shipped weights.

- :mod:`~maxent_grpo.builtin.catalog`: ``builtin:tiny`` and its variants, SmolLM2-135M from
  its GGUF file; written once into a cache folder on first use;
- :mod:`~maxent_grpo.builtin.warm_start`: the answer-format warm start of
  ``builtin:tiny-warm`` and ``builtin:tiny-h64-warm`` (``python -m
  maxent_grpo.builtin.warm_start``, ``--head-dim 64``);
- :mod:`~maxent_grpo.builtin.tool_warm_start`: the call-format warm start of
  ``builtin:tiny-tools-warm`` and ``builtin:tiny-python-warm``.
"""
