"""The command line: a LightningCLI with the trainer's argument links and defaults.

``python -m maxent_grpo fit --config configs/tiny.yaml`` trains; ``validate`` and
``test`` evaluate. Options that several components share are given once and linked:

- ``model.model_name_or_path`` -> ``data.tokenizer`` (the same tokenizer everywhere),
- ``model.model_cache_dir`` -> ``data.tokenizer_cache_dir``,
- ``data.max_prompt_length`` -> ``model.max_prompt_length``.

Unknown keys and wrong types are rejected by jsonargparse with the offending key named.
"""

from __future__ import annotations

import os

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from maxent_grpo.training.data import PromptDataModule
from maxent_grpo.training.module import MaxEntGRPOModule


class MaxEntGRPOCLI(LightningCLI):
    """LightningCLI wired for :class:`MaxEntGRPOModule` and :class:`PromptDataModule`."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.model_name_or_path", "data.tokenizer")
        parser.link_arguments("model.model_cache_dir", "data.tokenizer_cache_dir")
        parser.link_arguments("data.max_prompt_length", "model.max_prompt_length")
        # GRPO is the objective when none is named, so `--model.objective.beta 0.04` works
        parser.set_defaults({"model.objective": {"class_path": "maxent_grpo.objectives.GRPO"}})


def main(args: list[str] | None = None, run: bool = True) -> MaxEntGRPOCLI:
    """Entry point; ``args`` defaults to ``sys.argv[1:]``."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return MaxEntGRPOCLI(
        MaxEntGRPOModule,
        PromptDataModule,
        seed_everything_default=0,
        auto_configure_optimizers=False,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
