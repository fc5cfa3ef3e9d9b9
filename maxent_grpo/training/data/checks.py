"""At a run's setup: a PromptDataModule built apart from the module (in Python; the command
line links the two) is held to the module's prompt length, tokenizer and tools."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from maxent_grpo.training.data.datamodule import PromptDataModule
from maxent_grpo.validation import require

__all__ = ["check_prompt_bound", "check_prompt_format"]


def check_prompt_bound(bound: int | None, datamodule: Any) -> None:
    """Refuse a PromptDataModule whose longest prompt (``longest``, after its setup) is
    longer than the module's ``max_prompt_length``, to which generation cuts every prompt
    (its last ``bound`` tokens): built in Python the two are set apart (the command line
    links them), and ``PromptDataModule(max_prompt_length=None)`` beside the module's
    default 256 trained on prompts without their start."""
    if bound is None or not isinstance(datamodule, PromptDataModule):
        return
    longest = max(datamodule.longest.values(), default=0)
    require(longest <= bound,
            f"the DataModule keeps prompts of up to {longest} tokens (its max_prompt_length "
            f"is {datamodule.max_prompt_length}), but MaxEntGRPOModule(max_prompt_length="
            f"{bound}) cuts every prompt to its last {bound} tokens at generation, so the "
            "model would not see the start of longer ones: give the module the DataModule's "
            "max_prompt_length (the command line's data.max_prompt_length sets both)")


def check_prompt_format(pl_module: Any, datamodule: Any) -> None:
    """Refuse a PromptDataModule that renders prompts for another model than the module's
    (built in Python the two are set apart; the command line links them): a tokenizer that
    encodes otherwise, or tools the prompts show that the module does not run, or the
    reverse (the model never saw the tool it may call); warn of another chat template (a
    ``tokenizer`` left at its default; one given with ``set_tokenizer`` is the user's)."""
    if not isinstance(datamodule, PromptDataModule) or datamodule.tokenizer is None:
        return
    tools = pl_module.loop.generation.tools
    box = None if tools is None else tools.toolbox
    ours = [f"{f.__module__}:{f.__qualname__}" for f in (box.functions.values() if box else ())]
    shown = [f"{f.__module__}:{f.__qualname__}" for f in datamodule.tools]
    require(ours == shown or (box is None and tools is not None),  # an environment's own
            f"the DataModule's prompts show the tools {shown or 'none'}, but the module runs "
            f"{ours or 'none'}: give PromptDataModule(tools=...) the module's tools (the "
            "command line's model.tools sets both)")
    name = pl_module.source.name_or_path
    if datamodule.tokenizer_name == name and not datamodule.tokenizer_given:
        return
    from maxent_grpo.models import load_tokenizer

    theirs = datamodule.tokenizer
    own = pl_module.tokenizer or load_tokenizer(name, cache_dir=pl_module.source.cache_dir)
    text = "What is 2 + 2? <answer>4</answer>"
    require(own(text, add_special_tokens=False)["input_ids"]
            == theirs(text, add_special_tokens=False)["input_ids"],
            f"the DataModule's tokenizer ({datamodule.tokenizer_name!r}"
            f"{', set_tokenizer' if datamodule.tokenizer_given else ''}) encodes text otherwise "
            f"than the model's ({name!r}): give PromptDataModule(tokenizer={name!r}) (the "
            "command line links them)")

    def template(tok: Any) -> str | None:
        try:
            return tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                           tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that cannot render a lone turn: unknown
            return None

    if datamodule.apply_chat_template and not datamodule.tokenizer_given and (
            template(own) != template(theirs)):
        rank_zero_warn(f"the DataModule renders prompts with the chat template of "
                       f"{datamodule.tokenizer_name!r}, not the model's ({name!r}): give "
                       f"PromptDataModule(tokenizer={name!r}) unless that is meant")
