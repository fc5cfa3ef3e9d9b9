"""Multi-turn rollouts (:mod:`maxent_grpo.rollout.multiturn`) on a scripted inner engine and
the tiny model's tokenizer: what the completion holds token by token, which tokens the
model wrote, the budget, the call limit, faults and environments; and the Hugging Face
engine's ``continue_ids`` against its own ``generate``."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import numpy
import pytest
import torch

from maxent_grpo.builtin.catalog import build_tiny_model, build_tiny_tokenizer
from maxent_grpo.cli.errors import find_user_error, is_user_error
from maxent_grpo.rollout import GenerationBatch, HFGenerateEngine, RolloutOutput, SamplingSettings
from maxent_grpo.rollout.hf import completion_mask_from_ids, encode_prompts
from maxent_grpo.rollout.multiturn import MultiTurnEngine, environment_factory, message_segment
from maxent_grpo.rollout.protocol import Continuation
from maxent_grpo.rollout.toolcall import Toolbox
from maxent_grpo.validation import UserCodeError

TOK = build_tiny_tokenizer()
CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "6 * 7"}}</tool_call>'
SEGMENT = ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
           "<|im_start|>assistant\n")


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


class Scripted:
    """An inner engine whose turns are scripted: turn ``k`` of every sample (counted by the
    assistant turns opened after the prompt's) is ``turns[k]``; ``stop`` ends it with EOS."""

    def __init__(self, turns: list[str], stop: bool = True) -> None:
        self.turns, self.stop, self.tokenizer = turns, stop, TOK
        self.sequences: list[list[int]] = []

    def sync(self, model) -> None:
        pass

    def _turn(self, k: int, budget: int) -> tuple[list[int], bool]:
        row = ids(self.turns[min(k, len(self.turns) - 1)]) + ([TOK.eos_token_id] * self.stop)
        return row[:budget], self.stop and len(row) <= budget

    def generate(self, prompts, answers, G, sampling=None):
        s = sampling or SamplingSettings(max_new_tokens=200)
        self.base = prompts[0].count("<|im_start|>assistant")
        p_ids, p_mask = encode_prompts(TOK, prompts, None)
        rows = [self._turn(0, s.max_new_tokens)[0] for _ in range(len(prompts) * G)]
        T = max(map(len, rows))
        c_ids = torch.full((len(rows), T), TOK.pad_token_id)
        for i, r in enumerate(rows):
            c_ids[i, :len(r)] = torch.tensor(r)
        mask, truncated = completion_mask_from_ids(c_ids, [TOK.eos_token_id])
        texts = [TOK.decode(r, skip_special_tokens=True) for r in rows]
        return RolloutOutput(
            GenerationBatch.of_rows(prompts, answers, texts),
            p_ids.repeat_interleave(G, 0), p_mask.repeat_interleave(G, 0), c_ids, mask,
            truncated, 0.0)

    def continue_ids(self, sequences, budgets, sampling):
        self.sequences += sequences
        out = []
        for seq, budget in zip(sequences, budgets, strict=True):
            k = TOK.decode(seq).count("<|im_start|>assistant") - self.base
            row, stopped = self._turn(k, budget)
            out.append(Continuation(row, stopped))
        return out


def engine(turns, budget=200, max_calls=4, stop=True, tools=("calculate",), env=None):
    s = SamplingSettings(max_new_tokens=budget)
    box = Toolbox(list(tools), timeout=2.0) if env is None else None
    return MultiTurnEngine(Scripted(turns, stop), TOK, s, toolbox=box, environment=env,
                           max_tool_calls=max_calls)


def test_a_tool_exchange_token_by_token():
    mt = engine([CALL, "42"])
    assert message_segment(TOK, [{"role": "tool", "content": "42"}]) == SEGMENT
    out = mt.generate(["What is 6 * 7?"], ["42"], 2)
    eos = [TOK.eos_token_id]
    expected = ids(CALL) + eos + ids(SEGMENT) + ids("42") + eos
    assert out.completion_ids.tolist() == [expected, expected]
    assert out.completion_mask.all() and not out.truncated.any()
    start = len(ids(CALL)) + 1
    tool = [start <= t < start + len(ids(SEGMENT)) for t in range(len(expected))]
    assert out.tool_mask.tolist() == [tool, tool]  # exactly the template's tool message
    assert out.model_mask.sum(1).tolist() == [len(expected) - len(ids(SEGMENT))] * 2
    assert out.tools.turns.tolist() == [2, 2] and out.tools.calls.tolist() == [1, 1]
    assert all(int(v.sum()) == 0 for v in out.tools.failures.values())
    assert out.reward_completions()[0] == [
        {"role": "assistant", "content": CALL}, {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "42"}]
    assert out.batch.flatten().reward_columns() == {"tool_calls": [1, 1], "tool_failures": [0, 0],
                                    "exchange_lengths": [len(expected)] * 2}
    # the text shows the turns; the model continued from prompt + completion so far
    assert out.batch.grouped_completions[0][0] == CALL + "<|im_end|>" + SEGMENT + "42"
    assert TOK.decode(mt.engine.sequences[0]) == "What is 6 * 7?" + CALL + "<|im_end|>" + SEGMENT


def test_overlong_measures_a_multi_turn_row_as_the_budget_does():
    """A row cut at the budget gets -1 from ``overlong`` as a cut single-turn row does: it
    measures the whole exchange (``exchange_lengths``), not the model's tokens alone (which
    are fewer than the budget whenever a tool answered); a short exchange gets 0."""
    from maxent_grpo.rollout import PromptCompletionBatch
    from maxent_grpo.training.module import MaxEntGRPOModule

    budget = len(ids(CALL)) + 1 + len(ids(SEGMENT)) + 1  # one model token after the message
    module = MaxEntGRPOModule(rewards={"overlong": {"buffer": 4}},
                              max_completion_length=budget)
    for turns, expected in (([CALL, "42"], -1.0), (["7"], 0.0)):
        out = engine(turns, budget=budget).generate(["q"], ["42"], 1)
        assert bool(out.truncated[0]) == (expected == -1.0)
        pairs = PromptCompletionBatch(prompts=["q"], completions=out.reward_completions())
        total, _ = module.rewards(pairs, {"answer": ["42"]}, 1, out.completion_ids,
                                  out.model_mask, out.batch.flatten().reward_columns())
        assert total.tolist() == [expected]
        if expected == -1.0:  # the model's own tokens alone would not have been overlong
            assert int(out.model_mask.sum()) < budget - 4


def test_a_turn_without_a_call_ends_the_sample():
    out = engine(["41"]).generate(["q"], ["42"], 3)
    assert out.tool_mask.sum() == 0 and out.tools.turns.tolist() == [1, 1, 1]
    assert out.tools.calls.tolist() == [0, 0, 0]
    assert out.reward_completions()[0] == [{"role": "assistant", "content": "41"}]


def test_the_budget_holds_the_whole_exchange():
    n_call = len(ids(CALL)) + 1
    # the tool message does not leave the model a token: cut, truncated, empty last turn
    out = engine([CALL, "42"], budget=n_call + 10).generate(["q"], ["42"], 1)
    assert out.completion_ids.shape[1] == n_call + 10 and bool(out.truncated[0])
    assert out.tool_mask[0].tolist() == [False] * n_call + [True] * 10
    assert out.reward_completions()[0][-1] == {"role": "assistant", "content": ""}
    # room for one token after the message: the model's turn is cut there
    budget = n_call + len(ids(SEGMENT)) + 1
    out = engine([CALL, "42"], budget=budget).generate(["q"], ["42"], 1)
    assert out.completion_ids.shape[1] == budget and bool(out.truncated[0])
    assert out.reward_completions()[0][-1] == {"role": "assistant", "content": "4"}
    assert out.tools.turns.tolist() == [2]


def test_a_reply_far_over_the_budget_is_cut_before_it_is_tokenized():
    """A tool that returns megabytes: the tokens the model reads are the reply's first ones,
    as before, but the tokenizer never reads the whole reply (it did: seconds per call, and
    the tokenizer's warning of a sequence longer than the model takes)."""
    def dump(query: str) -> str:
        """A tool that returns a whole file.

        Args:
            query: what to read.
        """
        return "the file reads: " + " ".join(f"line {i}" for i in range(20_000))

    class Counting:  # the tiny tokenizer, recording the longest text it tokenized
        longest = 0

        def __getattr__(self, name):
            return getattr(TOK, name)

        def __call__(self, text, **kwargs):
            Counting.longest = max(Counting.longest, len(text))
            return TOK(text, **kwargs)

    call = '<tool_call>{"name": "dump", "arguments": {"query": "x"}}</tool_call>'
    budget = len(ids(call)) + 1 + 50
    mt = MultiTurnEngine(Scripted([call, "42"]), Counting(),
                         SamplingSettings(max_new_tokens=budget),
                         toolbox=Toolbox([dump], timeout=5.0), max_tool_calls=4)
    out = mt.generate(["Read it"], ["42"], 1)
    whole = ids(message_segment(TOK, [{"role": "tool", "content": dump("x")}]))
    assert out.completion_ids[0, len(ids(call)) + 1:].tolist() == whole[:50]
    assert bool(out.truncated[0]) and out.tool_mask[0].sum() == 50
    assert Counting.longest < 1_000 < len(dump("x"))


def test_the_call_limit_ends_the_sample():
    """Calls on every turn: two run, the third turn's call ends the sample, counted as a
    call past the limit (``over_limit``) with no message."""
    out = engine([CALL], budget=500, max_calls=2).generate(["q"], ["42"], 1)  # calls on every turn
    assert out.tools.calls.tolist() == [3] and out.tools.turns.tolist() == [3]
    assert out.tools.failures["over_limit"].tolist() == [1]
    assert not out.truncated[0] and out.reward_completions()[0][-1]["content"] == CALL
    assert [m["role"] for m in out.reward_completions()[0]].count("tool") == 2


def test_calls_past_the_limit_in_one_turn_are_told_they_did_not_run():
    """Three calls in one turn with a limit of two: the first two run and the model reads
    that the third did not (before, it was dropped without a word or a count)."""
    out = engine([CALL * 3, "42"], budget=1000, max_calls=2).generate(["q"], ["42"], 1)
    messages = out.reward_completions()[0]
    assert [m["content"] for m in messages[1:4]] == [
        "42", "42", "Error: calculate was not run: a sample runs at most 2 tool calls"]
    assert messages[-1] == {"role": "assistant", "content": "42"}
    assert out.tools.calls.tolist() == [3]
    assert out.tools.failures["over_limit"].tolist() == [1]
    assert out.batch.flatten().reward_columns()["tool_failures"] == [1]
    # the refusal repeats the name the model wrote: a lone surrogate reaches it as "?"
    odd = '<tool_call>{"name": "calc\\ud800", "arguments": {}}</tool_call>'
    out = engine([CALL * 2 + odd, "42"], budget=1000, max_calls=2).generate(["q"], ["42"], 1)
    assert out.reward_completions()[0][3]["content"].startswith("Error: calc? was not run")


def test_a_call_that_ends_exactly_at_the_budget_does_not_run(monkeypatch):
    """A turn that ends on its stop token exactly at the budget leaves no room for the
    tool's reply: the call is not run (before, it ran and its reply was cut away) and the
    row is truncated, its last turn empty."""
    ran = []
    original = Toolbox.run
    monkeypatch.setattr(Toolbox, "run", lambda self, call: ran.append(call) or original(self, call))
    out = engine([CALL, "42"], budget=len(ids(CALL)) + 1).generate(["q"], ["42"], 1)
    assert ran == [] and out.tools.calls.tolist() == [0]
    assert bool(out.truncated[0]) and out.tool_mask.sum() == 0
    assert out.reward_completions()[0] == [{"role": "assistant", "content": CALL},
                                           {"role": "assistant", "content": ""}]
    # one token more: the call runs (its reply is then cut by the budget)
    out = engine([CALL, "42"], budget=len(ids(CALL)) + 2).generate(["q"], ["42"], 1)
    assert len(ran) == 1 and out.tools.calls.tolist() == [1]


def test_faults_are_messages_the_model_reads():
    bad = '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    out = engine([bad, "no idea"]).generate(["q"], ["42"], 1)
    messages = out.reward_completions()[0]
    assert messages[1] == {"role": "tool",
                           "content": "Error: unknown tool 'search'; the tools are: calculate"}
    assert out.tools.failures["unknown_tool"].tolist() == [1]
    assert out.batch.flatten().reward_columns()["tool_failures"] == [1]
    assert "Error: unknown tool" in out.batch.grouped_completions[0][0]


@pytest.mark.parametrize("text", [
    "<tool_call>" + "[" * 5000 + "</tool_call>",
    '<tool_call>{"name": "calculate", "arguments": "' + "[" * 5000 + '"}</tool_call>',
    '<tool_call>{"name": "calculate", "arguments": {"expression": ' + "[" * 5000 + "]" * 5000
    + "}}</tool_call>",
])
def test_model_text_nested_at_any_depth_is_a_fault_not_a_crash(text):
    """Brackets nested past Python's recursion limit (the JSON decoder raises RecursionError,
    not ValueError): a malformed call the model reads and a counted kind, in the loop."""
    out = engine([text, "done"], budget=12_000).generate(["q"], ["42"], 1)
    message = out.reward_completions()[0][1]
    assert message["role"] == "tool" and message["content"].startswith("Error: malformed")
    assert out.tools.failures["malformed"].tolist() == [1]


class Guess:
    """Guess the answer: "higher" / "lower" until right."""

    role = "user"

    def __init__(self, limit: int = 100) -> None:
        self.limit, self.guesses, self.target = limit, [], None

    def reset(self, prompt: str, answer: str) -> None:
        if answer == "exit":
            sys.exit(3)  # a library's own exit
        self.prompt, self.target = prompt, int(answer)

    def step(self, action: str) -> tuple[str, bool]:
        if action == "wait":
            time.sleep(5)
        if action == "boom":
            raise RuntimeError("the environment broke")
        if action == "odd":
            return "not a pair"  # type: ignore[return-value]
        if action.startswith("array "):  # done computed by NumPy or torch, as simulators do
            done = int(action.split()[1]) == self.target
            return "checked", (numpy.bool_(done) if "np" in action else torch.tensor(done))
        guess = int(action)
        self.guesses.append(guess)
        if guess == self.target:
            return "right", True
        return ("higher" if guess < self.target else "lower"), False


def test_an_environment_steps_until_done():
    factory = environment_factory({"class_path": "tests.rollout.test_multiturn.Guess"})
    out = engine(["40", "42"], env=factory).generate(["guess"], ["42"], 2)
    env = out.tools.environments[0]
    assert env.prompt == "guess" and env.guesses == [40, 42]
    assert out.tools.calls.tolist() == [2, 2] and out.tools.turns.tolist() == [2, 2]
    assert [m["content"] for m in out.reward_completions()[0]] == ["40", "higher", "42"]
    assert out.batch.flatten().reward_columns()["environments"] == out.tools.environments
    assert out.tool_mask.sum(1).tolist() == [len(ids("\n<|im_start|>user\nhigher<|im_end|>\n"
                                                     "<|im_start|>assistant\n"))] * 2
    # an error in step is a message the model reads, counted; a wrong return type is a bug
    out = engine(["boom", "42"], env=factory).generate(["guess"], ["42"], 1)
    assert out.reward_completions()[0][1]["content"] == "Error: RuntimeError: the environment broke"
    assert out.tools.failures["error"].tolist() == [1]
    # the last allowed step still sees the model's turn; a time-out ends the sample
    out = engine(["40", "41", "43"], env=factory, max_calls=2).generate(["guess"], ["42"], 1)
    assert out.tools.environments[0].guesses == [40, 41] and out.tools.calls.tolist() == [2]
    assert out.tools.turns.tolist() == [2]
    mt = engine(["wait", "42"], env=factory)
    mt.timeout = 0.1
    out = mt.generate(["guess"], ["42"], 1)
    assert out.tools.failures["timeout"].tolist() == [1] and out.tools.turns.tolist() == [1]
    with pytest.raises(UserCodeError, match=r"Guess.step must return \(observation: str, "):
        engine(["odd"], env=factory).generate(["guess"], ["42"], 1)
    # a reset that raises is the environment's error, named so, with what it raised
    # (the command line printed "a bug in maxent_grpo" with a trace, or only the inner text)
    with pytest.raises(UserCodeError, match=r"Guess.reset failed on prompt 'guess': "
                                            r"ValueError: invalid literal") as raised:
        engine(["42"], env=factory).generate(["guess"], ["forty-two"], 1)
    assert is_user_error(raised.value)
    assert find_user_error(raised.value)[1].startswith("Guess.reset failed on prompt")
    # sys.exit in reset was the fit's end, with exit code 0 (a hunt of distributed failures)
    with pytest.raises(UserCodeError, match=r"Guess.reset failed on prompt 'guess': "
                                            r"SystemExit: 3"):
        engine(["42"], env=factory).generate(["guess"], ["exit"], 1)
    # a done that is a NumPy bool or a 0-d boolean tensor is a truth value, read as such
    for kind in ("np", "pt"):
        out = engine([f"array 41 {kind}", f"array 42 {kind}", "40"], env=factory,
                     max_calls=3).generate(["guess"], ["42"], 1)
        assert out.tools.calls.tolist() == [2], kind


class Board(Guess):
    """An environment whose option is a mutable starting board, which its steps extend."""

    def __init__(self, board: list | None = None) -> None:
        super().__init__()
        self.board = board

    def step(self, action: str) -> tuple[str, bool]:
        self.board.append(action)
        return f"{len(self.board)} on the board", False


class Broken(Guess):
    def __init__(self, path: str = "/nonexistent/board.txt") -> None:
        super().__init__()
        open(path).close()  # noqa: SIM115 - the environment's own mistake


def test_each_environment_starts_from_its_own_copy_of_its_options():
    """Every instance shared the ``init_args`` objects: a board one sample moved on was the
    board of every other sample, prompt and step (a multi-turn hunt)."""
    factory = environment_factory({"class_path": "tests.rollout.test_multiturn.Board",
                                   "init_args": {"board": []}})
    for _ in range(2):  # two steps
        out = engine(["a", "b"], env=factory, max_calls=2).generate(["p", "q"], ["1", "2"], 2)
        assert [env.board for env in out.tools.environments] == [["a", "b"]] * 4
        assert [m["content"] for m in out.reward_completions()[3]][:2] == ["a", "1 on the board"]


def test_an_environment_that_cannot_be_built_is_named():
    """Its constructor's error was the bare exception text, without the class or option."""
    factory = environment_factory({"class_path": "tests.rollout.test_multiturn.Broken"})
    with pytest.raises(UserCodeError, match=r"Broken\(\) \(model.environment\) failed: "
                                            "FileNotFoundError") as raised:
        engine(["42"], env=factory).generate(["guess"], ["42"], 1)
    assert "test_multiturn.py:" in find_user_error(raised.value)[1]  # where it raised


def test_call_tags_that_the_tokenizer_made_special_still_call_the_tool():
    """A tokenizer taught the format with ``<tool_call>`` as a special token: each turn was
    decoded without special tokens, so the tags were gone and no call ever ran, while the
    logged samples (special tokens kept) showed the call (a multi-turn hunt)."""
    special = build_tiny_tokenizer()
    special.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    global TOK
    plain, TOK = TOK, special  # the scripted engine writes with this tokenizer
    try:
        mt = MultiTurnEngine(Scripted([CALL, "42"]), special,
                             SamplingSettings(max_new_tokens=200),
                             toolbox=Toolbox(["calculate"], timeout=2.0), max_tool_calls=4)
        out = mt.generate(["What is 6 * 7?"], ["42"], 1)
    finally:
        TOK = plain
    assert out.tools.calls.tolist() == [1]
    assert [m["content"] for m in out.reward_completions()[0]] == [CALL, "42", "42"]
    # a tokenizer without such tags decodes a turn as before, byte for byte (readers: an
    # unknown tag's id is the unk's, a special token, which took the other path)
    mt = engine(["x"])
    assert mt._tags == {}
    turn = ids("<|im_start|>The answer is 4") + [TOK.unk_token_id, TOK.eos_token_id]
    assert mt._text(turn) == TOK.decode(turn, skip_special_tokens=True) == "The answer is 4"

def echo(query: str) -> str:
    """A tool that repeats what the model wrote (a search tool's "no results for ...").

    Args:
        query: what to look up.
    """
    return f"no results for {query}"


def test_a_lone_surrogate_the_model_wrote_and_a_tool_echoed_is_a_message():
    """JSON lets the model write ``"\\ud800"``, which decodes to a lone surrogate that the
    tokenizer and the samples' UTF-8 files refuse: the tool's message (returned or raised)
    carries ``?`` instead, and the rollout goes on."""
    def bad(query: str) -> str:
        """A tool whose error repeats what the model wrote.

        Args:
            query: what to look up.
        """
        raise ValueError(f"bad query {query}")

    for tool, text in ((echo, "no results for ?x"), (bad, "Error: ValueError: bad query ?x")):
        call = (f'<tool_call>{{"name": "{tool.__name__}", '
                '"arguments": {"query": "\\ud800x"}}</tool_call>')
        mt = MultiTurnEngine(Scripted([call, "42"]), TOK, SamplingSettings(max_new_tokens=200),
                             toolbox=Toolbox([tool], timeout=2.0), max_tool_calls=4)
        out = mt.generate(["Look it up"], ["42"], 1)
        message = out.reward_completions()[0][1]
        assert message == {"role": "tool", "content": text}
        message["content"].encode("utf-8")  # a samples file can hold it
    # an environment's observation and error text likewise
    factory = environment_factory({"class_path": "tests.rollout.test_multiturn.Echo"})
    out = engine(["\\ud800", "42"], env=factory).generate(["guess"], ["42"], 1)
    assert out.reward_completions()[0][1]["content"] == "heard ?"


class Echo(Guess):
    def step(self, action: str) -> tuple[str, bool]:
        return f"heard {json.loads(chr(34) + action + chr(34))}", False


def test_environment_and_tool_options_are_checked():
    with pytest.raises(ValueError, match="class_path"):
        environment_factory({"init_args": {}})
    with pytest.raises(ValueError, match="cannot import"):
        environment_factory({"class_path": "tests.rollout.test_multiturn.Missing"})
    with pytest.raises(ValueError, match="'.test_multiturn.Guess' is a relative path"):
        environment_factory({"class_path": ".test_multiturn.Guess"})  # was a TypeError
    with pytest.raises(ValueError, match="has no reset"):
        environment_factory({"class_path": "tests.rollout.test_multiturn.Scripted"})
    with pytest.raises(ValueError, match="unknown keys"):
        environment_factory({"class_path": "tests.rollout.test_multiturn.Guess", "args": {}})
    # a misspelt option: it failed at the first rollout, as a TypeError reported as a bug
    with pytest.raises(ValueError, match=r"model.environment.init_args do not fit .*Guess: "
                                         r".*unexpected keyword argument 'limt'"):
        environment_factory({"class_path": "tests.rollout.test_multiturn.Guess",
                             "init_args": {"limt": 5}})
    assert environment_factory({"class_path": "tests.rollout.test_multiturn.Guess",
                                "init_args": {"limit": 5}})().limit == 5
    from maxent_grpo.training.option_groups import build_tool_settings

    guess = {"class_path": "tests.rollout.test_multiturn.Guess"}
    with pytest.raises(ValueError, match="model.tool_isolation: process runs model.tools in "
                                         "a sandbox; an environment's step runs in the"):
        build_tool_settings({"environment": guess, "tool_isolation": "process"})  # ignored
    assert build_tool_settings({"environment": guess}).environment is not None
    s = SamplingSettings(max_new_tokens=8)
    with pytest.raises(ValueError, match="not both"):
        MultiTurnEngine(Scripted(["x"]), TOK, s, toolbox=Toolbox(["calculate"]),
                        environment=Guess)
    with pytest.raises(ValueError, match="has no continue_ids"):
        MultiTurnEngine(object(), TOK, s, toolbox=Toolbox(["calculate"]))


def test_hf_continue_ids_continues_as_generate_does():
    """Greedy: continuing a greedy completion's first tokens gives the rest of it."""
    model = build_tiny_model(TOK)
    s = SamplingSettings(max_new_tokens=12, do_sample=False)
    hf = HFGenerateEngine(model, TOK, s, share_prefill=False)
    prompts = ["3 + 5 =", "What is 6 * 7?"]
    out = hf.generate(prompts, ["8", "42"], 1)
    n = out.completion_mask.sum(1).tolist()
    heads = [out.prompt_ids[i][out.prompt_mask[i]].tolist() + out.completion_ids[i, :3].tolist()
             for i in range(2)]
    cont = hf.continue_ids(heads, [12 - 3, 4], s)
    assert cont[0].ids == out.completion_ids[0, 3:n[0]].tolist()[:9]
    assert cont[1].ids == out.completion_ids[1, 3:n[1]].tolist()[:4]
    assert len(cont[1].ids) <= 4 and all(c.logps is None for c in cont)
    for c in cont:  # stopped exactly when the ids end with the stop token
        assert c.stopped == (TOK.eos_token_id in c.ids)


def test_a_chat_template_that_refuses_the_tool_role_says_so():
    """Llama-2- and Mistral-style templates raise for a role they do not take: it was
    jinja2's TemplateError, reported as a bug."""
    import jinja2

    class Strict:
        eos_token = "</s>"

        def apply_chat_template(self, messages, tokenize=False, **kwargs):
            if any(m["role"] == "tool" for m in messages):
                raise jinja2.exceptions.TemplateError("roles must alternate user/assistant")
            return "".join(m["content"] for m in messages)

    with pytest.raises(ValueError, match=r"template that takes the roles \['tool'\] .*refuses "
                                         r"them \(TemplateError: roles must alternate"):
        message_segment(Strict(), [{"role": "tool", "content": "42"}])


def test_a_chat_template_that_leaves_the_tool_role_out_is_refused():
    """Zephyr- or TinyLlama-Chat-style templates skip a role they do not know: the segment
    was only the next turn's header, the model never read a tool's reply, and nothing
    counted a failure."""

    class Skipping:
        eos_token = "</s>"

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False,
                                **kwargs):
            shown = "".join(f"<|{m['role']}|>\n{m['content']}</s>\n" for m in messages
                            if m["role"] in ("system", "user", "assistant"))
            return shown + ("<|assistant|>\n" if add_generation_prompt else "")

    assert message_segment(Skipping(), [{"role": "tool", "content": "42"}]) == "\n<|assistant|>\n"
    with pytest.raises(ValueError, match="shows 'tool' messages; this tokenizer's template "
                                         "leaves them out"):
        MultiTurnEngine(Scripted(["x"]), Skipping(), SamplingSettings(max_new_tokens=8),
                        toolbox=Toolbox(["calculate"]))
    MultiTurnEngine(Scripted(["x"]), Skipping(), SamplingSettings(max_new_tokens=8),
                    environment=lambda: None)  # its replies are user messages, shown

    class Observing(Guess):  # an environment that answers in its own role
        role = "environment"

    mt = MultiTurnEngine(Scripted(["40"]), Skipping(), SamplingSettings(max_new_tokens=8),
                         environment=Observing)
    with pytest.raises(ValueError, match="shows 'environment' messages; this tokenizer's "
                                         "template leaves them out"):
        mt.generate(["guess"], ["42"], 1)


def test_a_turn_that_ends_on_the_models_end_of_turn_is_not_closed_twice():
    """A chat model whose tokenizer's eos ends the text (Phi-3.5, Gemma): its turn ends on
    the end-of-turn token (a stop id from its generation config), which the template's
    tail writes again; only the eos text was taken off it."""
    from maxent_grpo.builtin.catalog import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.eos_token = "<|endoftext|>"
    tool = [{"role": "tool", "content": "42"}]
    assert message_segment(tokenizer, tool).startswith("<|im_end|>")  # closed twice
    assert message_segment(tokenizer, tool, stops=["<|im_end|>"]).startswith(
        "\n<|im_start|>user\n<tool_response>\n42")


def test_a_reasoning_template_that_drops_an_empty_block_takes_tool_turns():
    """Qwen3's template gives a last assistant turn without reasoning an empty think block,
    dropped once the turn is not last: the probe's turn (no reasoning) read that as
    rewriting earlier turns and tools were refused, though a real turn (with reasoning)
    appends. A template that really rewrites (drops reasoning) is still refused."""

    class Reasoning:
        eos_token = "<|im_end|>"

        def __init__(self, keeps_reasoning: bool = True) -> None:
            self.keeps = keeps_reasoning

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False,
                                **kwargs):
            out = ""
            for i, m in enumerate(messages):
                content = m["content"]
                if m["role"] == "assistant":
                    last = i == len(messages) - 1
                    if "</think>" not in content and last:
                        content = "<think>\n\n</think>\n\n" + content
                    if not self.keeps and not last:
                        content = content.split("</think>")[-1].lstrip()
                out += f"<|im_start|>{m['role']}\n{content}<|im_end|>\n"
            return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    tool = [{"role": "tool", "content": "7"}]
    assert message_segment(Reasoning(), tool) == (
        "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="rewrites earlier turns"):
        message_segment(Reasoning(keeps_reasoning=False), tool)


def test_a_template_ending_a_conversation_with_its_eos_gives_the_segment():
    """Phi-4-mini's template ends a conversation with ``<|endoftext|>`` unless a generation
    prompt follows: it was refused as one that "rewrites earlier turns" (a tool-formats
    hunt). A template's refusal of the tool role says what the trainer's messages hold."""
    import jinja2

    class EndsWithEos:
        eos_token = "<|endoftext|>"

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False,
                                **kwargs):
            out = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
            return out + ("<|assistant|>" if add_generation_prompt else self.eos_token)

    tool = [{"role": "tool", "content": "7"}]
    assert message_segment(EndsWithEos(), tool, stops=["<|end|>"]) == (
        "<|tool|>7<|end|><|assistant|>")

    class NeedsIds(EndsWithEos):
        def apply_chat_template(self, messages, **kwargs):
            if any(m["role"] == "tool" for m in messages):
                raise jinja2.exceptions.TemplateError("Tool call IDs should be 9 characters")
            return super().apply_chat_template(messages, **kwargs)

    with pytest.raises(ValueError, match=r"9 characters\) \(the trainer's tool messages carry "
                                         r"no tool_call_id, and it reads calls written as "
                                         r"<tool_call> blocks"):
        message_segment(NeedsIds(), tool)


class Reporting(Scripted):
    """A scripted engine that reports its log-probs, as vLLM and a generation copy do."""

    LOGP = -1.006828  # not a bfloat16 value (that is -1.0078125)

    def generate(self, prompts, answers, G, sampling=None):
        out = super().generate(prompts, answers, G, sampling)
        logps = torch.full(out.completion_ids.shape, self.LOGP, dtype=torch.float32)
        return dataclasses.replace(out, sampler_logps=logps * out.completion_mask)

    def continue_ids(self, sequences, budgets, sampling):
        return [dataclasses.replace(c, logps=[self.LOGP] * len(c.ids))
                for c in super().continue_ids(sequences, budgets, sampling)]


def test_the_sampler_log_probs_stay_float32_under_a_true_precision():
    """``bf16-true`` makes bfloat16 torch's default dtype inside the training step: a
    multi-turn rollout's (and vLLM's) sampler log-probs were rounded to it (a hunt: the
    logged gap 0.073 -> 0.25 nats, and the sampler correction off by the rounding)."""
    from lightning.pytorch.plugins.precision import HalfPrecision

    mt = MultiTurnEngine(Reporting([CALL, "42"]), TOK, SamplingSettings(max_new_tokens=200),
                         toolbox=Toolbox(["calculate"], timeout=2.0), max_tool_calls=4)
    with HalfPrecision("bf16-true").forward_context():
        out = mt.generate(["What is 6 * 7?"], ["42"], 2)
    model = out.model_mask
    assert out.sampler_logps.dtype == torch.float32
    assert set(out.sampler_logps[model].tolist()) == {torch.tensor(Reporting.LOGP).item()}
