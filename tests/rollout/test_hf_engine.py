"""HFGenerateEngine: shapes, prompt-major grouping, masks, truncation, texts, validation."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from transformers import GenerationConfig

from maxent_grpo.builtin.catalog import builtin_tiny_model_and_tokenizer
from maxent_grpo.rollout import (
    HFGenerateEngine,
    RolloutEngine,
    RolloutOutput,
    SamplingSettings,
    completion_mask_from_ids,
)
from maxent_grpo.rollout.protocol import turn_end
from maxent_grpo.training.types import GenerationBatch

PAD, EOS = 0, 2  # ids of <|endoftext|> and <|im_end|> in the tiny tokenizer


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    return builtin_tiny_model_and_tokenizer()


def render(tokenizer: Any, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


# --------------------------------------------------------------------------- mask helper


def test_completion_mask_by_hand() -> None:
    ids = torch.tensor([[5, 2, 7, 2], [2, 0, 0, 0], [5, 5, 5, 5], [9, 9, 9, 2]])
    mask, truncated = completion_mask_from_ids(ids, [2])
    expected = [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert mask.tolist() == [[bool(v) for v in row] for row in expected]
    assert truncated.tolist() == [False, False, True, False]
    mask, truncated = completion_mask_from_ids(ids, [2, 9])  # two stop ids
    assert mask[3].tolist() == [True, False, False, False] and not truncated[3]
    with pytest.raises(ValueError, match="stop_token_ids"):
        completion_mask_from_ids(ids, [])
    with pytest.raises(ValueError, match="2-D"):
        completion_mask_from_ids(ids[0], [2])


# --------------------------------------------------------------------------- tiny model


def make_engine(model, tokenizer, share_prefill=True, stop_token_ids=None, **sampling):
    """An engine whose sampling settings are given as keywords."""
    return HFGenerateEngine(
        model, tokenizer, SamplingSettings(**sampling), share_prefill=share_prefill,
        stop_token_ids=stop_token_ids,
    )


def test_tiny_rollout_shapes_grouping_masks_and_texts(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    questions = ["What is 2+2?", "Hi", "Name a colour, please."]
    prompts = [render(tokenizer, q) for q in questions]
    engine = make_engine(model, tokenizer, max_new_tokens=12)
    assert isinstance(engine, RolloutEngine)
    torch.manual_seed(0)
    out = engine.generate(prompts, ["4", "hello", "red"], num_generations=4)
    B, G = 3, 4
    lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    P, T = max(lengths), out.completion_ids.shape[1]
    assert out.prompt_ids.shape == out.prompt_mask.shape == (B * G, P)
    assert out.completion_ids.shape == out.completion_mask.shape == (B * G, T)
    assert T <= 12 and out.truncated.shape == (B * G,)
    assert out.prompt_ids.dtype == out.completion_ids.dtype == torch.long
    assert out.prompt_mask.dtype == out.completion_mask.dtype == out.truncated.dtype == torch.bool
    assert [len(g) for g in out.batch.grouped_completions] == [G] * B
    assert out.generate_seconds > 0

    # Prompt-major rows, left padding.
    for row in range(B * G):
        b = row // G
        real = tokenizer(prompts[b], add_special_tokens=False)["input_ids"]
        assert out.prompt_mask[row].tolist() == [False] * (P - lengths[b]) + [True] * lengths[b]
        assert out.prompt_ids[row, P - lengths[b] :].tolist() == real
        assert (out.prompt_ids[row, : P - lengths[b]] == PAD).all()

    # m[i,t] True up to and including the first EOS, False after; pad outside the mask.
    for row in range(B * G):
        ids = out.completion_ids[row].tolist()
        mask = out.completion_mask[row].tolist()
        first = ids.index(EOS) if EOS in ids else None
        if first is None:
            assert out.truncated[row] and all(mask) and T == 12
        else:
            assert not out.truncated[row]
            assert mask == [t <= first for t in range(T)]
            assert all(i == PAD for i in ids[first + 1 :])

    # Texts agree with the ids, grouped per prompt.
    batch = out.batch
    assert isinstance(batch, GenerationBatch)
    assert batch.prompts == prompts
    for row in range(B * G):
        b, g = divmod(row, G)
        n = int(out.completion_mask[row].sum())
        decoded = tokenizer.decode(out.completion_ids[row, :n], skip_special_tokens=True)
        assert batch.grouped_completions[b][g] == decoded


def test_tiny_rollout_is_seeded_and_restores_mode(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    engine = make_engine(model, tokenizer, max_new_tokens=6, temperature=0.7, top_k=5)
    prompts = [render(tokenizer, "abc")]
    own_config = model.generation_config
    for training in (True, False):
        model.train(training)
        torch.manual_seed(3)
        first = engine.generate(prompts, ["x"], 3)
        assert model.training is training
        assert model.generation_config is own_config
        torch.manual_seed(3)
        second = engine.generate(prompts, ["x"], 3)
        assert torch.equal(first.completion_ids, second.completion_ids)
    model.eval()


@pytest.mark.parametrize("lora", [False, True])
def test_shared_prefill_samples_what_the_plain_path_samples(tiny: tuple[Any, Any],
                                                             lora: bool) -> None:
    """Prompts of different lengths (left padding), G = 3: one prefill of the B prompts,
    then the same completions as G separate prefills under the same seed. A LoRA policy (a
    peft model, no PreTrainedModel) ran G prefills: the shared one was skipped."""
    model, tokenizer = tiny
    inner = model
    if lora:
        import copy

        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        with torch.no_grad():  # trained adapters (lora_B starts at 0)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
        inner = model.get_base_model()  # the transformers model both paths run
    prompts = [render(tokenizer, "12+7"), render(tokenizer, "a much longer question 3*4")]
    shapes: list[tuple[int, ...]] = []
    hook = inner.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    outs = {}
    try:
        for share in (False, True):
            engine = make_engine(
                model, tokenizer, max_new_tokens=10, temperature=0.9, top_k=20,
                share_prefill=share,
            )
            shapes.clear()
            torch.manual_seed(11)
            outs[share] = engine.generate(prompts, ["x", "y"], 3)
            outs[share, "first"] = shapes[0]
    finally:
        hook.remove()
    P = outs[False].prompt_ids.shape[1]
    assert outs[False, "first"] == (6, P)  # plain: every copy of every prompt
    assert outs[True, "first"] == (2, P - 1)  # shared: each prompt once, all but its last token
    assert torch.equal(outs[True].completion_ids, outs[False].completion_ids)
    assert torch.equal(outs[True].completion_mask, outs[False].completion_mask)
    assert outs[True].batch.grouped_completions == outs[False].batch.grouped_completions
    with pytest.raises(ValueError, match="share_prefill must be true or false"):
        make_engine(model, tokenizer, max_new_tokens=2, share_prefill=1)  # type: ignore


def test_model_generation_config_does_not_leak(tiny: tuple[Any, Any]) -> None:
    """Hub defaults on the model must not change the sampling distribution."""
    model, tokenizer = tiny
    saved = model.generation_config
    suppress_all_but_eos = [i for i in range(len(tokenizer)) if i != EOS]
    model.generation_config = GenerationConfig(suppress_tokens=suppress_all_but_eos)
    try:
        engine = make_engine(model, tokenizer, max_new_tokens=8)
        torch.manual_seed(0)
        out = engine.generate([render(tokenizer, "q")] * 2, ["a", "b"], 6)
    finally:
        model.generation_config = saved
    # Had suppress_tokens leaked, every completion would be the single token EOS.
    assert out.completion_mask.sum(dim=1).max() > 1


def test_max_prompt_length_truncates_from_the_left(tiny: tuple[Any, Any]) -> None:
    """Warned: a DataLoader of one's own lost its prompts' start (system prompt, question)
    in silence (a PromptDataModule drops such prompts)."""
    import warnings

    model, tokenizer = tiny
    engine = make_engine(model, tokenizer, max_new_tokens=2, max_prompt_length=3)
    with pytest.warns(UserWarning, match="max_prompt_length 3 tokens are cut to their last 3"):
        out = engine.generate(["abcdefgh", "xy"], ["", ""], 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.generate(["abc", "xy"], ["", ""], 2)  # none over the bound: nothing said
    fgh = tokenizer("fgh", add_special_tokens=False)["input_ids"]
    xy = tokenizer("xy", add_special_tokens=False)["input_ids"]
    assert out.prompt_ids.tolist() == [fgh, fgh, [PAD, *xy], [PAD, *xy]]


def test_text_the_tokenizer_cannot_spell_is_warned(tiny: tuple[Any, Any]) -> None:
    """The built-in char tokenizer read "é" and "×" as <|unk|> without a word: the model saw
    neither character, and training went on as if it had."""
    import warnings

    from maxent_grpo.rollout.hf import encode_prompts

    _, tokenizer = tiny
    with pytest.warns(UserWarning, match="cannot spell: the model sees its unknown token"):
        ids, _ = encode_prompts(tokenizer, ["3 × 4 = ?", "ab"], None)
    assert tokenizer.unk_token_id in ids[0].tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        encode_prompts(tokenizer, ["3 * 4 = ?\n", "<|im_start|>ab"], None)  # all spelled
        # the unknown token's own name, spelled (SmolLM2's is <|endoftext|>): no unknown text
        encode_prompts(tokenizer, [f"ab{tokenizer.unk_token}c", "ab"], None)
    with pytest.warns(UserWarning, match="cannot spell"):  # beside text it cannot spell
        encode_prompts(tokenizer, [f"ab{tokenizer.unk_token}é", "ab"], None)
    padded = copy.deepcopy(tokenizer)  # a common recipe: the unknown token pads (the
    padded.pad_token = padded.unk_token  # prompts are encoded unpadded: still told)
    with pytest.warns(UserWarning, match="cannot spell"):
        encode_prompts(padded, ["3 × 4 = ?", "ab"], None)


# --------------------------------------------------------------------------- fake model


class FixedLM(nn.Module):
    """``generate`` returns the prompt followed by hand-written completions."""

    def __init__(self, completions: list[list[int]]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.completions = torch.tensor(completions)
        self.generation_config = GenerationConfig(repetition_penalty=1.3)
        self.seen: dict[str, Any] = {}

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 generation_config: GenerationConfig) -> torch.Tensor:
        self.seen = {
            "training": self.training,
            "grad": torch.is_grad_enabled(),
            "config": generation_config,
            "model_config": self.generation_config,
            "input_ids": input_ids,
        }
        expanded = input_ids.repeat_interleave(generation_config.num_return_sequences, dim=0)
        return torch.cat([expanded, self.completions], dim=1)


def test_fake_model_masks_truncation_and_texts(tiny: tuple[Any, Any]) -> None:
    _, tokenizer = tiny
    a, b, c = (tokenizer(ch, add_special_tokens=False)["input_ids"][0] for ch in "abc")
    completions = [
        [a, b, EOS, PAD],  # stops at t=2
        [EOS, PAD, PAD, PAD],  # empty answer
        [a, a, a, a],  # truncated
        [c, EOS, b, EOS],  # tokens after the first EOS are dropped
    ]
    model = FixedLM(completions).train()
    engine = make_engine(model, tokenizer, max_new_tokens=4, temperature=0.5, top_p=0.9)
    out = engine.generate(["p0", "p1"], ["x", "y"], 2)
    assert out.completion_mask.int().tolist() == [
        [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]
    ]
    assert out.truncated.tolist() == [False, False, True, False]
    assert out.completion_ids.tolist() == [
        [a, b, EOS, PAD], [EOS, PAD, PAD, PAD], [a, a, a, a], [c, EOS, PAD, PAD]
    ]
    assert out.batch.grouped_completions == [["ab", ""], ["aaaa", "c"]]
    assert out.completion_mask.sum(1).tolist() == [3, 1, 4, 2]
    # What generate saw: eval mode, no grad, our sampling settings, a clean model config.
    seen = model.seen
    assert seen["training"] is False and seen["grad"] is False
    config = seen["config"]
    assert (config.do_sample, config.temperature, config.top_p, config.top_k) == (True, 0.5, 0.9, 0)
    assert (config.num_return_sequences, config.max_new_tokens) == (2, 4)
    assert config.eos_token_id == [EOS] and config.pad_token_id == PAD
    assert seen["model_config"].repetition_penalty is None
    assert model.training and model.generation_config.repetition_penalty == 1.3  # restored


def test_extra_stop_token_ids(tiny: tuple[Any, Any]) -> None:
    _, tokenizer = tiny
    semicolon = tokenizer(";", add_special_tokens=False)["input_ids"][0]
    model = FixedLM([[5, semicolon, 6, EOS]])
    engine = make_engine(model, tokenizer, max_new_tokens=4, stop_token_ids=[semicolon])
    out = engine.generate(["p"], ["x"], 1)
    assert out.completion_mask.tolist() == [[True, True, False, False]]
    assert model.seen["config"].eos_token_id == [EOS, semicolon]


def test_the_models_own_end_of_turn_ends_a_completion(tiny: tuple[Any, Any]) -> None:
    """A chat model whose tokenizer's eos ends the text and whose ``generation_config``
    lists its end of turn too (Phi-3.5, Gemma, Llama-3-Instruct ship so): the engines
    stopped at the tokenizer's eos only, so every completion ran on into an invented next
    turn, truncated; ``model.generate`` stops at either."""
    _, tokenizer = tiny
    end_of_turn = tokenizer(";", add_special_tokens=False)["input_ids"][0]
    model = FixedLM([[5, end_of_turn, 6, EOS]])
    model.generation_config = GenerationConfig(eos_token_id=[end_of_turn, EOS])
    out = make_engine(model, tokenizer, max_new_tokens=4).generate(["p"], ["x"], 1)
    assert out.completion_mask.tolist() == [[True, True, False, False]]
    assert not out.truncated.item()
    assert model.seen["config"].eos_token_id == [EOS, end_of_turn]


def test_the_chat_templates_end_of_turn_ends_a_base_models_completion(tiny) -> None:
    """A base model (Qwen2.5, Llama-3.1 base) trained with a chat template: its tokenizer's
    and generation_config's eos are the end of text, the template ends a turn with another
    token (``<|im_end|>``). Only the eos stopped a completion, so every one ran on to
    ``max_completion_length``, trained on the repeated end of turn (a defect hunt)."""
    import copy

    tokenizer = copy.deepcopy(tiny[1])
    tokenizer.eos_token = "<|endoftext|>"  # id 0; the template's end of turn is id 2
    end_of_text, end_of_turn = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(
        "<|im_end|>")
    assert (end_of_text, end_of_turn) == (0, 2)
    model = FixedLM([[5, end_of_turn, end_of_turn, end_of_turn]])
    model.generation_config = GenerationConfig(eos_token_id=end_of_text)
    out = make_engine(model, tokenizer, max_new_tokens=4).generate(["p"], ["x"], 1)
    assert out.completion_mask.tolist() == [[True, True, False, False]]
    assert not out.truncated.item()
    assert turn_end(tokenizer) == end_of_turn
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    assert turn_end(tokenizer) is None  # plain text after a message: no token to add
    tokenizer.chat_template = None
    assert turn_end(tokenizer) is None


def test_a_tokenizer_without_eos_stops_at_the_models_declared_ones(tiny) -> None:
    """A tokenizer without an eos token whose model's generation_config names one was
    refused: "completions could never stop". None at all is refused, naming the remedies."""
    import copy

    tokenizer = copy.deepcopy(tiny[1])
    tokenizer.eos_token, tokenizer.chat_template = None, None
    assert tokenizer.eos_token_id is None and tokenizer.pad_token_id is not None
    model = FixedLM([[5, EOS, 6, 6]])
    model.generation_config = GenerationConfig(eos_token_id=EOS)
    out = make_engine(model, tokenizer, max_new_tokens=4).generate(["p"], ["x"], 1)
    assert out.completion_mask.tolist() == [[True, True, False, False]]
    model.generation_config = GenerationConfig()
    with pytest.raises(ValueError, match="no token ends a completion .* give "
                                         "HFGenerateEngine.stop_token_ids"):
        make_engine(model, tokenizer, max_new_tokens=4)


class PromptOnlyLM(FixedLM):
    """A broken ``generate`` that returns the expanded prompt and nothing after it."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 generation_config: GenerationConfig) -> torch.Tensor:
        return input_ids.repeat_interleave(generation_config.num_return_sequences, dim=0)


def test_bad_generate_output_is_reported(tiny: tuple[Any, Any]) -> None:
    _, tokenizer = tiny
    engine = make_engine(PromptOnlyLM([[5, EOS]]), tokenizer, max_new_tokens=2)
    with pytest.raises(RuntimeError, match="expected \\(2, > 1\\)"):
        engine.generate(["p"], ["x"], 2)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an int >= 1"),
        # it advised model.top_k: 1, with which a group's completions are equal (a hunt)
        ({"temperature": 0.0}, "temperature must be from 1e-05 .*greedy evaluation: "
                               "model.eval_greedy, while training samples"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        # below, the scored logits overflowed ("this is a bug"), and vLLM decodes greedily;
        # above, float32's inf: uniform sampling and no gradient (a numerical-extremes hunt)
        ({"temperature": 1e-38}, "temperature must be from 1e-05 to 3.4e38 .*got 1e-38"),
        ({"temperature": 1e39}, "temperature must be from 1e-05 to 3.4e38"),
        ({"top_p": 0.0}, r"top_p must be a finite number in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be a finite number in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an int >= 0"),
        ({"max_prompt_length": 0}, "max_prompt_length must be an int >= 1 \\(or null\\)"),
        ({"stop_token_ids": [-3]}, "stop_token_ids must be non-negative ints"),
    ],
)
def test_constructor_validates(tiny: tuple[Any, Any], kwargs: dict, message: str) -> None:
    model, tokenizer = tiny
    arguments = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        make_engine(model, tokenizer, **arguments)


def test_model_without_generate_rejected(tiny: tuple[Any, Any]) -> None:
    _, tokenizer = tiny
    with pytest.raises(TypeError, match="generate"):
        make_engine(nn.Linear(2, 2), tokenizer, max_new_tokens=4)


def test_generate_validates_its_arguments(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    engine = make_engine(model, tokenizer, max_new_tokens=2)
    with pytest.raises(ValueError, match="num_generations must be an int >= 1"):
        engine.generate(["p"], ["a"], 0)
    with pytest.raises(ValueError, match="answers must have one entry per prompt"):
        engine.generate(["p", "q"], ["a"], 2)
    with pytest.raises(ValueError, match="prompts must not be empty"):
        engine.generate([], [], 2)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.generate(["p", ""], ["a", "b"], 2)


def test_rollout_output_checks_shapes() -> None:
    batch = GenerationBatch(["p"], ["a"], [["x", "y"]], None)
    ok = {
        "prompt_ids": torch.zeros(2, 3, dtype=torch.long),
        "prompt_mask": torch.ones(2, 3, dtype=torch.bool),
        "completion_ids": torch.zeros(2, 4, dtype=torch.long),
        "completion_mask": torch.ones(2, 4, dtype=torch.bool),
        "truncated": torch.zeros(2, dtype=torch.bool),
    }
    assert RolloutOutput(batch=batch, generate_seconds=0.0, **ok).batch.num_completions == 2
    bad_rows = {**ok, "completion_ids": torch.zeros(3, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match="completion_ids must have 2 dims and 2 rows"):
        RolloutOutput(batch=batch, generate_seconds=0.0, **bad_rows)
    bad_mask = {**ok, "completion_mask": torch.ones(2, 5, dtype=torch.bool)}
    with pytest.raises(ValueError, match="completion_mask shape"):
        RolloutOutput(batch=batch, generate_seconds=0.0, **bad_mask)
    bad_dtype = {**ok, "truncated": torch.zeros(2, dtype=torch.long)}
    with pytest.raises(ValueError, match="truncated must be a bool tensor"):
        RolloutOutput(batch=batch, generate_seconds=0.0, **bad_dtype)


def record_generate_calls(model, monkeypatch) -> list[dict]:
    """The keyword arguments of every ``model.generate`` call from now on (it still runs)."""
    seen: list[dict] = []
    real = model.generate

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "generate", recording)
    return seen


def test_generation_is_synced_when_parameters_are_sharded(tiny, monkeypatch) -> None:
    """With several ranks and ZeRO-3-partitioned parameters (``ds_id``), ``generate`` runs
    with ``synced_gpus=True``; unsharded, or on one process, it does not."""
    from maxent_grpo.rollout import hf

    model, tokenizer = tiny
    seen = record_generate_calls(model, monkeypatch)
    engine = make_engine(model, tokenizer, share_prefill=False, max_new_tokens=2)
    engine.generate(["ab"], ["x"], 2)
    assert not hf.sharded_across_ranks(model) and "synced_gpus" not in seen[-1]
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    assert not hf.sharded_across_ranks(model)  # replicated (DDP): each rank runs alone
    for p in model.parameters():
        monkeypatch.setattr(p, "ds_id", 0, raising=False)
    assert hf.sharded_across_ranks(model)
    # one process stands in for two: the synced loop's all-reduce is a no-op sum here
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, *a, **k: None)
    engine.generate(["ab"], ["x"], 2)
    assert seen[-1]["synced_gpus"] is True


@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared"])
@pytest.mark.parametrize("bucket", [1, 16])
def test_static_cache_and_prompt_buckets_sample_what_the_dynamic_cache_samples(
    tiny, monkeypatch, share: bool, bucket: int
) -> None:
    """Same seed, same completions with a static cache (prefilled from the shared prefix, or
    built by ``generate``) and with prompts padded to a bucket; the static cache is really
    used, and the padded prompts are a multiple of the bucket wide."""
    from transformers import StaticCache

    model, tokenizer = tiny
    prompts = [render(tokenizer, "12+7"), render(tokenizer, "a much longer question 3*4")]
    sampling = dict(max_new_tokens=10, temperature=0.9, top_k=20)
    torch.manual_seed(5)
    reference = make_engine(model, tokenizer, share_prefill=False, **sampling).generate(
        prompts, ["19", "12"], 3)
    seen = record_generate_calls(model, monkeypatch)
    engine = HFGenerateEngine(model, tokenizer, SamplingSettings(**sampling), share_prefill=share,
                              cache="static", prompt_bucket=bucket)
    torch.manual_seed(5)
    out = engine.generate(prompts, ["19", "12"], 3)
    assert torch.equal(out.completion_ids, reference.completion_ids)
    assert out.batch.grouped_completions == reference.batch.grouped_completions
    P = reference.prompt_ids.shape[1]
    assert out.prompt_ids.shape[1] == (P if bucket == 1 else -(-P // bucket) * bucket)
    real_tokens = out.prompt_ids[out.prompt_mask]
    assert torch.equal(real_tokens, reference.prompt_ids[reference.prompt_mask])
    if share:
        caches = [v for v in seen[-1].values() if isinstance(v, StaticCache)]
        assert len(caches) == 1
        assert caches[0].layers[0].max_cache_len == out.prompt_ids.shape[1] + 10
    else:
        assert seen[-1]["generation_config"].cache_implementation == "static"


def test_engine_cache_options_are_checked(tiny) -> None:
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="HFGenerateEngine.cache must be one of"):
        HFGenerateEngine(model, tokenizer, SamplingSettings(max_new_tokens=2), cache="paged")
    with pytest.raises(ValueError, match="HFGenerateEngine.prompt_bucket must be an int >= 1"):
        HFGenerateEngine(model, tokenizer, SamplingSettings(max_new_tokens=2), prompt_bucket=0)


@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared"])
def test_static_cache_under_autocast_generates_on_a_copy(tiny, monkeypatch, share: bool) -> None:
    """bf16 autocast over float32 weights gives float32 keys and bf16 values; the static
    cache of transformers before 5.2x holds one dtype (emulated here) and failed on the H200
    with an index_copy_ dtype error. The engine generates on a bf16 copy instead, as
    ``generation_dtype: bfloat16`` does, and says so; without autocast nothing changes."""
    from transformers.cache_utils import StaticLayer

    original = StaticLayer.lazy_initialization
    monkeypatch.setattr(StaticLayer, "lazy_initialization",
                        lambda self, keys, values: original(self, keys, values.to(keys.dtype)))
    model, tokenizer = tiny
    prompts, answers = [render(tokenizer, "12+7"), render(tokenizer, "3*4")], ["19", "12"]
    sampling = SamplingSettings(max_new_tokens=6)

    def sample(engine: HFGenerateEngine):
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return engine.generate(prompts, answers, 3)

    engine = HFGenerateEngine(model, tokenizer, sampling, share_prefill=share, cache="static")
    with pytest.warns(UserWarning, match="generation runs on a bfloat16 copy"):
        out = sample(engine)
    explicit = HFGenerateEngine(model, tokenizer, sampling, share_prefill=share, cache="static",
                                generation_dtype="bfloat16")
    assert torch.equal(out.completion_ids, sample(explicit).completion_ids)
    calls = []
    monkeypatch.setattr(model, "generate", lambda *a, **k: calls.append(1) or original_generate(
        *a, **k), raising=False)
    original_generate = type(model).generate.__get__(model)
    sample(engine)  # the copy generates, refreshed: not the model
    assert (calls, engine.refresh_seconds > 0) == ([], True)
    engine.generate(prompts, answers, 3)  # no autocast: the model itself
    assert (calls, engine.refresh_seconds) == ([1], 0.0)


def test_the_copy_is_only_made_where_the_static_cache_needs_it(tiny, monkeypatch) -> None:
    """Where the installed static cache holds two dtypes (transformers 5.24), and where the
    embeddings are already in the autocast dtype (a bf16 base with float32 adapters), the
    model itself generates under autocast, with no copy and no warning."""
    import copy
    import warnings

    from transformers.cache_utils import StaticLayer

    from maxent_grpo.rollout.hf import static_cache_holds_two_dtypes

    model, tokenizer = tiny
    prompts, answers = [render(tokenizer, "12+7")], ["19"]
    sampling = SamplingSettings(max_new_tokens=4)

    def copies(engine: HFGenerateEngine) -> bool:
        calls = []
        target = engine.model
        monkeypatch.setattr(target, "generate", lambda *a, **k: calls.append(1) or type(
            target).generate(target, *a, **k), raising=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a warning would fail the call
            with torch.autocast("cpu", dtype=torch.bfloat16):
                engine.generate(prompts, answers, 2)
        return not calls

    if static_cache_holds_two_dtypes():
        assert not copies(HFGenerateEngine(model, tokenizer, sampling, cache="static"))
    original = StaticLayer.lazy_initialization
    monkeypatch.setattr(StaticLayer, "lazy_initialization",
                        lambda self, keys, values: original(self, keys, values.to(keys.dtype)))
    assert not static_cache_holds_two_dtypes()
    mixed = copy.deepcopy(model).to(torch.bfloat16)
    mixed.model.norm.weight.data = mixed.model.norm.weight.data.float()  # an fp32 part
    assert not copies(HFGenerateEngine(mixed, tokenizer, sampling, cache="static"))


def test_continue_ids_buckets_the_static_cache_length(tiny, monkeypatch) -> None:
    """Multi-turn turns of many widths and budgets: with the static cache each generate's
    cache length (the padded width + the turn's budget) is a multiple of ``prompt_bucket``,
    so a compiled decode meets few shapes (before, one per width and budget); the padding
    is masked, so greedy continuations are the unpadded ones."""
    model, tokenizer = tiny
    s = SamplingSettings(max_new_tokens=12, do_sample=False)
    heads = [tokenizer(render(tokenizer, q), add_special_tokens=False)["input_ids"]
             for q in ("12+7", "a much longer question 3*4", "1")]
    plain = HFGenerateEngine(model, tokenizer, s, cache="static")
    bucketed = HFGenerateEngine(model, tokenizer, s, cache="static", prompt_bucket=16)
    seen = record_generate_calls(model, monkeypatch)
    for budgets in ([5, 9, 3], [7, 2, 11]):
        reference = plain.continue_ids(heads, budgets, s)
        out = bucketed.continue_ids(heads, budgets, s)
        assert [c.ids for c in out] == [c.ids for c in reference]
        assert [c.stopped for c in out] == [c.stopped for c in reference]
        width, new = seen[-1]["input_ids"].shape[1], seen[-1]["generation_config"].max_new_tokens
        assert (width + new) % 16 == 0 and new == max(budgets)


def test_an_engine_interface_is_refused_and_an_engine_is_not() -> None:
    """``model.engine`` naming an interface, or nothing, is refused at build; a class, the
    CLI's ``partial`` of one, a factory function or a mock stand-in pass."""
    import functools
    from unittest import mock

    from maxent_grpo.rollout.protocol import ContinuableEngine, RolloutEngine, check_engine_factory

    for engine in (HFGenerateEngine, functools.partial(HFGenerateEngine, cache="static"),
                   lambda model, tokenizer, sampling: None, mock.MagicMock()):
        check_engine_factory(engine)
    for interface in (RolloutEngine, ContinuableEngine, functools.partial(RolloutEngine)):
        with pytest.raises(ValueError, match="is an interface, not an engine"):
            check_engine_factory(interface)
    with pytest.raises(ValueError, match="model.engine must be an engine class"):
        check_engine_factory(None)


def test_answer_tags_that_the_tokenizer_made_special_stay_in_the_text(tiny) -> None:
    """A tokenizer with ``<think>``/``</think>`` (Qwen3's, R1's) or the answer tags as special
    tokens: the completions were decoded without special tokens, so ``</think>`` was gone,
    every answer after reasoning was None (0.0 from every reward) and a hybrid model's
    scratch work read as its answer (a templates hunt). Other special tokens stay out."""
    from maxent_grpo.rewards.answers import answer_key, sample_answer
    from maxent_grpo.rollout.hf import rollout_from_ids

    special = copy.deepcopy(tiny[1])
    special.add_special_tokens({"additional_special_tokens": [
        "<think>", "</think>", "<answer>", "</answer>"]})
    written = ["3+5 is 8</think>\n<answer>8</answer>", "<think>maybe 9? no</think>8"]
    rows = [special("<|im_start|>" + w, add_special_tokens=False)["input_ids"] + [EOS]
            for w in written]
    width = max(map(len, rows))
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    out = rollout_from_ids(special, [EOS], ["p"], ["8"], torch.ones(1, 1, dtype=torch.long),
                           torch.ones(1, 1, dtype=torch.bool), ids, 2, 0.0)
    assert out.batch.grouped_completions == [written]  # <|im_start|>, <|im_end|> left out
    assert sample_answer(written[0], opens_think=True) == "8"
    assert answer_key(out.batch.grouped_completions[0][1]) == "8"
    plain = tiny[1]  # no such special tokens: the one batch decode, as before
    rows = [plain(w, add_special_tokens=False)["input_ids"] for w in written]
    width = max(map(len, rows))
    ids = torch.tensor([r + [EOS] * (width - len(r) + 1) for r in rows])
    out = rollout_from_ids(plain, [EOS], ["p"], ["8"], torch.ones(1, 1, dtype=torch.long),
                           torch.ones(1, 1, dtype=torch.bool), ids, 2, 0.0)
    assert out.batch.grouped_completions == [written]
    # one decode with the other special ids taken out: a piece decoded apart lost its
    # leading space under a SentencePiece decoder (readers)
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    from maxent_grpo.rollout.protocol import decode_texts, read_tags

    inner = Tokenizer(tokenizer_models.BPE(unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    inner.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])  # Llama's, Mistral's
    inner.train_from_iterator(["hello world the answer is 42. The answer"] * 20,
                              trainers.BpeTrainer(vocab_size=200, initial_alphabet=["\u2581"],
                                                  special_tokens=["<unk>", "<s>", "</s>"]))
    piece = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="</s>", unk_token="<unk>")
    piece.add_special_tokens({"additional_special_tokens": ["<think>", "</think>", "<answer>",
                                                           "</answer>"]})
    text = "<think> hello</think> The answer is <answer> 42 </answer>"
    ids = piece(text, add_special_tokens=False)["input_ids"] + [piece.eos_token_id]
    assert decode_texts(piece, [ids], read_tags(piece)) == [text]
