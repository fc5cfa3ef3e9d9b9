"""A fit with ``model.tools``: the module wraps its engine in the multi-turn loop, the
DataModule shows the tools to the chat template, the rewards read the model's last turn,
the step logs ``train/tools/...``, validation runs the same loop, and refill keeps the tool
records of the groups it picks. The first turn of every sample is a scripted call (a tiny
random model would never call); the turns after it are sampled from the policy."""

from __future__ import annotations

import warnings

import pytest
import torch

from maxent_grpo.rollout import HFGenerateEngine
from maxent_grpo.rollout.multiturn import MultiTurnEngine
from maxent_grpo.training.data.datamodule import PromptDataModule
from tests.conftest import fit, make_data, make_module
from tests.rollout.test_multiturn import Scripted

CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "6 * 7"}}</tool_call>'
BAD = '<tool_call>{"name": "calculate", "arguments": {"expression": "6 / 0"}}</tool_call>'


class CallsFirst(Scripted):
    """The first turn is ``CALL`` for even rows and ``BAD`` for odd ones; the model writes
    the turns after the tool's answer (the policy, through the Hugging Face engine)."""

    def __init__(self, model, tokenizer, sampling):
        super().__init__([CALL])
        self.inner = HFGenerateEngine(model, tokenizer, sampling)

    def generate(self, prompts, answers, G, sampling=None):
        out = super().generate(prompts, answers, G, sampling)
        bad = self.tokenizer(BAD, add_special_tokens=False)["input_ids"] + [2]
        for row in range(1, out.completion_ids.shape[0], 2):
            out.completion_ids[row, :len(bad)] = torch.tensor(bad)
        return out

    def continue_ids(self, sequences, budgets, sampling):
        return self.inner.continue_ids(sequences, budgets, sampling)


def right_last_turn(prompts, completions, tool_calls, tool_failures, answer, **kw):
    """1 when the last message is the answer; reads the multi-turn reward columns."""
    assert all(isinstance(c, list) and c[-1]["role"] == "assistant" for c in completions)
    assert tool_calls == [1] * len(completions)
    assert tool_failures == [i % 2 for i in range(len(completions))]
    return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer,
                                                                strict=True)]


def test_a_fit_with_tools_logs_them_and_validates_with_them(cache_dir, tmp_path):
    module = make_module(
        cache_dir, tools=["calculate"], engine=CallsFirst, max_completion_length=180,
        rewards={"tests.training.test_tools_fit:right_last_turn": 1.0},
        eval_num_generations=2, eval_greedy=False, max_prompt_length=None)
    data = make_data(cache_dir, task="tool_arithmetic", task_options=None, tools=["calculate"],
                     max_prompt_length=None, val_size=2)
    trainer = fit(module, data, steps=2, tmp_path=tmp_path, limit_val_batches=1,
                  val_check_interval=2, check_val_every_n_epoch=None)
    assert isinstance(module._engine, MultiTurnEngine)
    assert "calculate(expression: string)" in data.train_dataset.examples[0].prompt
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert logged["train/tools/calls_per_sample"] == 1.0
    assert logged["train/tools/failure_rate"] == 0.5  # the odd rows' calls are refused
    assert logged["train/tools/failures/error"] == 0.5
    assert logged["train/tools/success_rate"] == 0.5
    assert logged["train/tools/turns_per_sample"] == 2.0
    assert logged["train/tools/message_tokens_per_sample"] > 20
    assert "val/reward/mean" in logged  # validation sampled through the same loop
    t = module.trajectory
    assert int(t.loss_mask.sum()) == int(t.rollout.model_mask.sum())
    text = t.samples.generation.grouped_completions[0][0]
    assert text.startswith(CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n")


def test_refill_keeps_the_tool_records_of_the_groups_it_picks(cache_dir, tmp_path):
    module = make_module(
        cache_dir, tools=["calculate"], engine=CallsFirst, max_completion_length=180,
        rewards={"tests.conftest:alternating": 1.0}, drop_constant_groups=True,
        refill_rounds=1, solved_reward=None, max_prompt_length=None)
    data = make_data(cache_dir, task="tool_arithmetic", task_options=None, tools=["calculate"],
                     max_prompt_length=None)
    fit(module, data, steps=1, tmp_path=tmp_path)
    t = module.trajectory
    assert t.rollout.tools is not None and len(t.rollout.tools.messages) == 16
    assert t.rollout.tool_mask.shape == t.rollout.completion_mask.shape


def test_tool_options_are_checked(cache_dir):
    with pytest.raises(ValueError, match="set one of them"):
        make_module(cache_dir, tools=["calculate"],
                    environment={"class_path": "tests.rollout.test_multiturn.Guess"})
    with pytest.raises(ValueError, match="model.max_tool_calls"):
        make_module(cache_dir, tools=["calculate"], max_tool_calls=0)
    # without tools or an environment they did nothing, without a word: dropped, said (a
    # config's values with --model.tools null, the shipped "without the tool" run)
    with pytest.warns(UserWarning, match=r"dropped model.max_tool_calls=2, model.tool_timeout="
                                         r"3.0, model.tool_isolation='process': only with "
                                         r"model.tools or model.environment"):
        make_module(cache_dir, max_tool_calls=2, tool_timeout=3.0, tool_isolation="process")
    with pytest.raises(ValueError, match="cannot import 'nowhere:fn'"):
        make_module(cache_dir, tools=["nowhere:fn"])
    with pytest.raises(ValueError, match="data.apply_chat_template: true"):
        PromptDataModule(tools=["calculate"], apply_chat_template=False)
    data = make_data(cache_dir, tools=["calculate"])
    data._get_tokenizer().chat_template = (  # a template that ignores tools=
        "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="does not show the tools"):
        data.setup("fit")


def test_a_datamodule_that_renders_for_another_model_is_refused(cache_dir, tmp_path):
    """Built in Python, the DataModule and the module are set apart: a forgotten
    ``tools=`` trained without the tool ever shown (a hunt: 0 calls, reward 0) or showed
    one the model could not call, and a forgotten ``tokenizer=`` rendered every prompt with
    the default model's chat template; both trained without a word."""
    from maxent_grpo.builtin.catalog import build_tiny_model, build_tiny_tokenizer

    runs = make_module(cache_dir, tools=["calculate"], max_prompt_length=None)
    shows_none = make_data(cache_dir, task="tool_arithmetic", task_options=None,
                           max_prompt_length=None)
    with pytest.raises(ValueError, match=r"show the tools none, but the module runs \['maxent"):
        fit(runs, shows_none, steps=1, tmp_path=tmp_path)
    shows = make_data(cache_dir, task="tool_arithmetic", task_options=None, tools=["calculate"],
                      max_prompt_length=None)
    with pytest.raises(ValueError, match="but the module runs none"):
        fit(make_module(cache_dir, max_prompt_length=None), shows, steps=1, tmp_path=tmp_path)
    folder = tmp_path / "mymodel"  # the tiny model, its template marked
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = "[MINE]" + tokenizer.chat_template
    build_tiny_model().save_pretrained(folder)
    tokenizer.save_pretrained(folder)

    def module():
        return make_module(cache_dir, model_name_or_path=str(folder), max_prompt_length=None)

    def data(**kw):
        return make_data(cache_dir, task="arithmetic_easy", task_options=None,
                         max_prompt_length=None, **kw)

    with pytest.warns(UserWarning, match=r"renders prompts with the chat template of "
                                         r"'builtin:tiny', not the model's"):
        fit(module(), data(), steps=1, tmp_path=tmp_path)
    with warnings.catch_warnings():  # the model's own, or one the user gave: no word
        warnings.filterwarnings("error", message=".*chat template of")
        fit(module(), data(tokenizer=str(folder)), steps=1, tmp_path=tmp_path)
        given = data()
        given.set_tokenizer(build_tiny_tokenizer())  # the user's template, on purpose
        fit(module(), given, steps=1, tmp_path=tmp_path)
    encodes = build_tiny_tokenizer()  # one that encodes otherwise: refused, before loading
    encodes.add_tokens(["What is"])
    other, mine = data(), module()
    other.set_tokenizer(encodes)
    with pytest.raises(ValueError, match=r"tokenizer \('builtin:tiny', set_tokenizer\) "
                                         r"encodes text otherwise than the model's"):
        fit(mine, other, steps=1, tmp_path=tmp_path)
    assert mine.policy is None
