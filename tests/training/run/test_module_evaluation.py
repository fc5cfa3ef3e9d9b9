"""Evaluation in validate/test: pass@k, mean@k, distinct@k, coverage@k, greedy pass@1 and a
per-task breakdown, from hand-made records and from ``trainer.validate`` on the tiny model."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from maxent_grpo.rewards.answers import coverage_answer
from maxent_grpo.rollout import GenerationBatch, HFGenerateEngine, RolloutOutput, SamplingSettings
from maxent_grpo.training.data.datamodule import collate_prompts
from maxent_grpo.training.run.evaluation import (
    PromptRecord,
    evaluation_metrics,
    sample_answer,
    valid_answer_set,
)
from tests.conftest import fit, make_data, make_module


def naive_pass(correct: list[float], k: int) -> float:
    """Fraction of k-subsets holding a correct sample (float64, by enumeration)."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def naive_distinct(answers: list[str | None], k: int) -> float:
    subsets = list(itertools.combinations(answers, k))
    return sum(len({a for a in s if a is not None}) for s in subsets) / len(subsets)


def validate(module, data) -> dict[str, float]:
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    return trainer.validate(module, data, verbose=False)[0]


# ------------------------------------------------------------------ pure helpers


def test_sample_and_coverage_answers():
    assert sample_answer("<think>x</think><answer> 3 + 5 </answer>") == "3 + 5"
    assert sample_answer(r"so \boxed{8}") == "8"
    assert sample_answer("  8 because  ") == "8 because"  # bare prompt: the whole text
    assert sample_answer("   ") is None
    assert coverage_answer("5 + 3 = 8") == coverage_answer("(3 + 5)") == "3 + 5"
    assert coverage_answer("2 × 4") == coverage_answer("4 * 2")
    assert coverage_answer(None) is None and coverage_answer("eight") is None


def test_metric_dict_from_hand_made_records():
    records = [
        PromptRecord((1.0, 0.0, 1.0, 0.0), ("8", "8", "9", None), task="a", greedy_correct=1.0),
        PromptRecord((0.0, 0.0, 0.0, 1.0), ("1", "2", "3", "4"), task="a", greedy_correct=0.0),
        PromptRecord((0.0, 0.0, 0.0, 0.0), ("x", "x", "x", "x"), task="b", greedy_correct=0.0),
    ]
    m = evaluation_metrics(records, [1, 2], "val")
    for k in (1, 2):
        assert m[f"val/pass@{k}"] == pytest.approx(
            sum(naive_pass(list(r.correct), k) for r in records) / 3
        )
        assert m[f"val/distinct@{k}"] == pytest.approx(
            sum(naive_distinct(list(r.answers), k) for r in records) / 3
        )
        assert m[f"val/mean@{k}"] == pytest.approx(3 / 12)
    assert m["val/pass@1"] == pytest.approx((0.5 + 0.25 + 0) / 3)
    assert m["val/pass@2"] == pytest.approx((5 / 6 + 0.5 + 0) / 3)  # 1 - C(2,2)/C(4,2), ...
    assert m["val/greedy_pass@1"] == pytest.approx(1 / 3)
    # per task: the same formulas over each task's prompts
    assert m["val/pass@1/a"] == pytest.approx((0.5 + 0.25) / 2)
    assert m["val/pass@2/b"] == 0.0 and m["val/distinct@1/b"] == pytest.approx(1.0)
    assert m["val/greedy_pass@1/a"] == pytest.approx(0.5)
    assert not any("coverage" in k for k in m)  # no valid-answer sets
    assert evaluation_metrics([], [1], "val") == {}
    one_task = evaluation_metrics(records[:2], [1, 2], "val")  # the totals, not repeated
    assert "val/pass@1" in one_task and not any(k.endswith("/a") for k in one_task)


def test_coverage_counts_distinct_correct_canonical_answers():
    valid = frozenset({"3 + 5", "2 * 4", "10 - 2"})
    records = [
        # correct: "5 + 3" and "(3 + 5)" are the same solution, "2*4 = 8" a second one
        PromptRecord((1.0, 1.0, 1.0, 0.0), ("5 + 3", "(3 + 5)", "2*4 = 8", "7"), valid),
        PromptRecord((0.0, 0.0, 0.0, 0.0), ("1", "2", "3", "4")),  # no valid set: left out
    ]
    canon = ["3 + 5", "3 + 5", "2 * 4", None]
    m = evaluation_metrics(records, [1, 2], "test")
    for k in (1, 2):
        assert m[f"test/coverage@{k}"] == pytest.approx(naive_distinct(canon, k) / 3)
    assert evaluation_metrics(records[:1], [4], "t")["t/coverage@4"] == pytest.approx(2 / 3)
    # a set listing one answer in two orders is one answer; a correct answer it does not
    # list covers nothing (it failed at the first such sample, deep into a run)
    both = PromptRecord((1.0, 1.0), ("4 + 5", "5 * 3"), frozenset({"5 + 4", "4 + 5"}))
    assert evaluation_metrics([both], [2], "t")["t/coverage@2"] == 1.0


def test_valid_answers_are_read_as_the_rewards_read_them():
    # a CSV cell holds JSON text; a JSONL row may hold integers (both failed in validation)
    assert valid_answer_set('["07", "11"]', "first_number") == ({"7", "11"}, [])
    assert valid_answer_set([2, 3], "first_number") == ({"2", "3"}, [])
    assert valid_answer_set(["5 * 3", "3 * 5"], None) == ({"3 * 5"}, [])
    # what has no canonical form is returned to be warned about, not read a letter at a time
    assert valid_answer_set(["4 + 5", "-3", "x", True], None) == ({"4 + 5", "-3"}, ["x", True])
    assert valid_answer_set("12", "first_number") == (set(), ["12"])
    assert valid_answer_set({"a": 1}, "first_number") == (set(), [{"a": 1}])


# ------------------------------------------------------------------ greedy engine


def test_greedy_engine_is_deterministic_argmax(cache_dir):
    module = make_module(cache_dir)
    module.configure_model()
    engine = module.rollout_engine()
    greedy = dataclasses.replace(module.loop.generation.sampling, do_sample=False)
    prompts = ["3 + 5 =", "2 + 2 ="]
    torch.manual_seed(0)
    a = engine.generate(prompts, ["", ""], 1, greedy)
    torch.manual_seed(1)
    b = engine.generate(prompts, ["", ""], 1, greedy)
    assert torch.equal(a.completion_ids, b.completion_ids)
    # the first generated token is the argmax of the next-token logits
    with torch.no_grad():
        logits = module.policy(
            input_ids=a.prompt_ids, attention_mask=a.prompt_mask.long(),
            position_ids=(a.prompt_mask.long().cumsum(-1) - 1).clamp(min=0),
        ).logits[:, -1]
    assert torch.equal(a.completion_ids[:, 0], logits.argmax(-1))
    with pytest.raises(ValueError, match="do_sample"):
        SamplingSettings(max_new_tokens=2, do_sample="no")


# ------------------------------------------------------------------ trainer.validate


def alternating(prompts, completions, **kw):
    """Rewards 1, 0, 1, 0, ... over the flattened (prompt-major) completions."""
    return [float(i % 2 == 0) for i in range(len(completions))]


def half(prompts, completions, **kw):
    return [0.5] * len(completions)


ALT = "tests.training.run.test_module_evaluation:alternating"


def test_validate_logs_pass_mean_distinct_greedy_and_per_task(cache_dir):
    module = make_module(
        cache_dir, eval_num_generations=4, eval_k=[1, 2, 4],
        rewards={ALT: 1.0, "tests.training.run.test_module_evaluation:half": 1.0},
    )
    out = validate(module, make_data(cache_dir))
    # every prompt: correctness [1, 0, 1, 0] -> c = 2 of n = 4
    assert out["val/pass@1"] == pytest.approx(0.5)
    assert out["val/pass@2"] == pytest.approx(1 - math.comb(2, 2) / math.comb(4, 2))
    assert out["val/pass@4"] == pytest.approx(1.0)
    assert out["val/mean@2"] == pytest.approx(0.5)
    assert 0.0 <= out["val/distinct@1"] <= 1.0 and 1.0 <= out["val/distinct@4"] <= 4.0
    # greedy: one completion per prompt, scored 1, 0, 1, 0 within each batch of 4
    assert out["val/greedy_pass@1"] == pytest.approx(0.5)
    # one task: no breakdown repeating the totals (with MLflow's file store, the metric
    # val/pass@1 beside val/pass@1/arithmetic_easy stopped the run at its first validation)
    assert not any(k.endswith("/arithmetic_easy") for k in out)
    assert out["val/reward/mean"] == pytest.approx(1.0)  # 0.5 + 0.5 on average
    assert not any("coverage" in k for k in out)
    assert module.evaluator.records == []  # reset for the next epoch


def test_eval_reward_and_threshold_choose_correctness(cache_dir):
    module = make_module(
        cache_dir, eval_num_generations=2, eval_greedy=False,
        rewards={ALT: 1.0, "tests.training.run.test_module_evaluation:half": 1.0},
        eval_reward="tests.training.run.test_module_evaluation:half", eval_correct_threshold=0.5,
    )
    out = validate(module, make_data(cache_dir))
    assert out["val/pass@1"] == 1.0 and "val/greedy_pass@1" not in out
    module = make_module(
        cache_dir, eval_num_generations=2, eval_greedy=False,
        rewards={"tests.training.run.test_module_evaluation:half": 1.0}, eval_correct_threshold=0.6,
    )
    assert validate(module, make_data(cache_dir))["val/pass@1"] == 0.0


def test_coverage_in_validate_with_a_fake_engine(cache_dir, caplog):
    module = make_module(
        cache_dir, eval_num_generations=2, eval_k=[1, 2], eval_greedy=False,
        rewards={"countdown": 1.0},
    )
    module.configure_model()
    data = make_data(cache_dir, task="countdown_multi", task_options={}, max_prompt_length=None)
    data.setup("validate")
    batch = collate_prompts(data.val_dataset.examples[:2])
    first, second = (sorted(v) for v in batch["columns"]["valid_answers"])
    completions = [[f"<answer>{first[0]}</answer>", f"<answer>{first[-1]}</answer>"],
                   [f"<answer>{second[0]}</answer>", "<answer>1 + 1</answer>"]]
    module.rollout_engine = lambda: SimpleNamespace(
        generate=lambda prompts, answers, G, sampling=None: RolloutOutput(
            batch=GenerationBatch(list(prompts), list(answers), completions, None),
            prompt_ids=torch.ones(4, 1, dtype=torch.long),
            prompt_mask=torch.ones(4, 1, dtype=torch.bool),
            completion_ids=torch.ones(4, 1, dtype=torch.long),  # what rewards may read
            completion_mask=torch.ones(4, 1, dtype=torch.bool),
            truncated=torch.tensor([False, True, False, True]), generate_seconds=0.0,
        )
    )
    logged: dict[str, float] = {}
    module.log_dict = lambda values, **kw: logged.update(values)
    cov0 = (1 if len(first) == 1 else 2) / len(first)  # two distinct solutions (or one)
    for cells in (None, [json.dumps(v) for v in batch["columns"]["valid_answers"]]):
        if cells is not None:  # the same sets as JSON text, as a CSV file holds them
            batch["columns"]["valid_answers"] = cells
        module.validation_step(batch, 0)
        module.on_validation_epoch_end()
        assert logged["val/coverage@2"] == pytest.approx((cov0 + 1 / len(second)) / 2)
    # sets of no answer of the form are warned about once and left out of coverage@k
    batch["columns"]["valid_answers"] = ['["not an answer"]', "[]"]
    logged.clear()
    with caplog.at_level("WARNING", logger="maxent_grpo.training.run.evaluation"):
        module.validation_step(batch, 0)
        module.on_validation_epoch_end()
    assert [r.getMessage().split(" have no")[0] for r in caplog.records] == [
        "prompt 0: valid_answers ['not an answer']"]
    assert "val/coverage@2" not in logged and "val/pass@1" in logged
    assert logged["val/pass@1"] == pytest.approx((1.0 + 0.5) / 2)
    assert "val/pass@1/countdown_multi" not in logged  # one task: the totals are its own
    # predict's rows say which completions were cut at max_completion_length
    assert [r["truncated"] for r in module.predict_step(batch, 0)] == [False, True, False, True]


def answer_value(prompts, completions, answer, **columns):
    """A reward that is the prompt's answer: it tells prompts apart, whatever is sampled."""
    return [float(a) for a in answer]


def test_a_prompt_a_padding_sampler_repeats_counts_once_in_the_reward_moments(
        cache_dir, monkeypatch):
    """Two ranks, three prompts: the sampler pads rank 1 with row 0. The @k metrics counted
    it once, the val/reward/* moments (summed over the ranks) twice."""
    from maxent_grpo.training.run import evaluation

    module = make_module(cache_dir, eval_num_generations=2, eval_greedy=False,
                         rewards={f"{__name__}:answer_value": 1.0})
    module.configure_model()
    data = make_data(cache_dir, val_size=3)
    data.setup("validate")
    rows = data.val_dataset.examples
    engine = HFGenerateEngine(module.policy, module.tokenizer, SamplingSettings(max_new_tokens=2))
    module.rollout_engine = lambda: engine
    for part in ([0, 1], [2, 0]):  # rank 0's batch, then rank 1's with the padding row
        batch = collate_prompts([rows[i] for i in part])
        batch["indices"] = part
        module.validation_step(batch, 0)
    records = module.evaluator.records
    ranks = [records[:2], records[2:]]
    for metric in (module.evaluator.reward, module.evaluator.components):
        metric._to_sync = False  # they hold both "ranks'" updates, as synced ones would
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **kw: None)
    monkeypatch.setattr(evaluation, "all_gather_objects", lambda mine: ranks)
    out = module.evaluator.compute("val")
    values = [float(rows[i].answer) for i in (0, 1, 2)]
    assert len(set(values)) > 1  # the repeat would move the mean
    assert out["val/reward/mean"] == pytest.approx(sum(values) / 3)
    assert out[f"val/reward/{__name__}:answer_value/mean"] == pytest.approx(sum(values) / 3)
    assert out["val/reward/min"] == min(values) and out["val/reward/max"] == max(values)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(eval_num_generations=2, eval_k=[1, 3]), r"model\.eval_k .*model\.eval_num_gen"),
        (dict(eval_k=[0]), r"model\.eval_k"),
        (dict(eval_k=[]), r"model\.eval_k"),
        (dict(eval_reward="accuracy"), r"model\.eval_reward .*first_number"),
        (dict(eval_correct_threshold=float("nan")), r"model\.eval_correct_threshold"),
    ],
)
def test_bad_eval_options_raise(cache_dir, kw, match):
    with pytest.raises(ValueError, match=match):
        make_module(cache_dir, **kw)


def test_evaluation_set_without_answers_raises_naming_the_option(cache_dir):
    module = make_module(cache_dir, eval_num_generations=2, eval_greedy=False)
    with pytest.raises(ValueError, match=r"model\.eval_reward 'first_number'.*answer_column"):
        validate(module, make_data(cache_dir, answer_column=None))


def odd_rows_ungraded(completions, answer, **kw):
    """1.0 on rows with an even reference, None (not applicable) on odd ones: a reward of
    one task over the rows of two."""
    return [None if int(a) % 2 else 1.0 for a in answer]


def never_graded(completions, **kw):
    return [None] * len(completions)


def test_a_reward_that_graded_nothing_is_left_out_of_the_logged_values(cache_dir):
    """Training leaves out a component no completion applied to; validation logged
    ``val/reward/<name>/mean = nan`` (a gap in every chart, and ``EarlyStopping`` on it
    stopped the fit as "not finite")."""
    rewards = {"first_number": 1.0, "tests.training.run.test_module_evaluation:never_graded": 0.5}
    module = make_module(cache_dir, rewards=rewards, eval_reward="first_number")
    logged = validate(module, make_data(cache_dir))
    assert "val/reward/first_number/mean" in logged
    assert not [k for k in logged if "never_graded" in k]
    assert all(v == v for v in logged.values())


def slow(completions, **kw):
    import time

    time.sleep(1.0)
    return [1.0] * len(completions)


def test_an_eval_reward_that_grades_some_completions_counts_the_rest_not_correct(
        cache_dir, caplog):
    """A reward that applies to some rows only (per-task rewards; here one row per batch,
    so whole batches of rows it does not grade), or a time-out's ``fallback: null`` over
    every batch, stopped the whole fit; those completions count as not correct, warned of
    once. An epoch that nothing graded otherwise still raises (the test above)."""
    rewards = {"tests.training.run.test_module_evaluation:odd_rows_ungraded": 1.0}
    data = make_data(cache_dir, val_batch_size=1)
    data.setup("validate")
    even = [int(ex.answer) % 2 == 0 for ex in data.val_dataset.examples]
    assert 0 < sum(even) < len(even)
    module = make_module(cache_dir, rewards=rewards, eval_num_generations=2, eval_greedy=False,
                         eval_k=[1])
    with caplog.at_level("WARNING"):
        logged = validate(module, make_data(cache_dir, val_batch_size=1))
    assert logged["val/pass@1"] == pytest.approx(sum(even) / len(even))
    assert sum("count as not correct" in r.getMessage() for r in caplog.records) == 1
    timed = {"tests.training.run.test_module_evaluation:slow":
             {"weight": 1.0, "timeout": 0.2, "fallback": None}}
    module = make_module(cache_dir, rewards=timed, eval_num_generations=2, eval_greedy=False,
                         eval_k=[1])
    assert validate(module, make_data(cache_dir))["val/pass@1"] == 0.0


def test_the_ungraded_warning_counts_a_prompt_a_loader_repeated_once(cache_dir, caplog):
    """A loader of one's own giving an ungraded prompt twice: the @k values count it once,
    and so does the warning's count of ungraded completions (it said 4 of 6, a readers'
    finding; greedy completions count too: 2 samples and 1 greedy per prompt)."""
    from torch.utils.data import DataLoader

    rewards = {"tests.training.run.test_module_evaluation:odd_rows_ungraded": 1.0}
    data = make_data(cache_dir)
    data.setup("validate")
    rows = data.val_dataset.examples
    odd = next(r for r in rows if int(r.answer) % 2)
    even = next(r for r in rows if int(r.answer) % 2 == 0)
    module = make_module(cache_dir, rewards=rewards, eval_num_generations=2, eval_k=[1])
    loader = DataLoader([odd, odd, even], batch_size=3, collate_fn=collate_prompts)
    with caplog.at_level("WARNING"):
        logged = validate(module, loader)
    assert logged["val/pass@1"] == pytest.approx(0.5)
    said = [r.getMessage() for r in caplog.records if "count as not correct" in r.getMessage()]
    assert len(said) == 1 and "for 3 of 6 evaluation completions" in said[0], said


def test_engine_is_chosen_by_class_path_built_once_and_synced(cache_dir, tmp_path):
    """``model.engine`` builds the engine once per run with the module's sampling
    settings; ``sync(policy)`` comes before each rollout that follows an optimizer step
    (validation included), never twice for the same weights; evaluation's greedy pass uses
    the same engine with ``do_sample=False``."""
    built, events = [], []

    class Recording(HFGenerateEngine):
        def __init__(self, model, tokenizer, sampling, share_prefill=True):
            built.append(sampling)
            super().__init__(model, tokenizer, sampling, share_prefill=share_prefill)

        def sync(self, model):
            assert model is module.policy
            events.append("sync")

        def generate(self, prompts, answers, num_generations, sampling=None):
            events.append("greedy" if sampling is not None and not sampling.do_sample
                          else "sample")
            return super().generate(prompts, answers, num_generations, sampling)

    module = make_module(cache_dir, engine=Recording, temperature=0.7, top_k=3,
                         eval_num_generations=2)
    fit(module, make_data(cache_dir, val_size=2), steps=2, tmp_path=tmp_path,
        limit_val_batches=1, val_check_interval=2, num_sanity_val_steps=1)
    assert built == [SamplingSettings(max_new_tokens=4, temperature=0.7, top_k=3,
                                      max_prompt_length=256)]
    # sanity validation (sample + greedy), step 1, sync, step 2, sync, validation
    assert events == ["sample", "greedy", "sample", "sync", "sample", "sync", "sample",
                      "greedy"]


def test_ordered_answers_count_each_order_once():
    """Under ``answer_form: ordered`` "4 + 5" and "5 + 4" are two of target 9's ten answers:
    coverage counts both, where the expression form counts them as one of five."""
    from maxent_grpo.tasks.digit_pairs import pair_solutions

    answers = ("4 + 5", "5+4", " 4 + 5 ", "1 + 1")
    correct = (1.0, 1.0, 1.0, 0.0)
    ordered = PromptRecord(correct, answers, frozenset(pair_solutions(9, ordered=True)),
                           answer_form="ordered")
    plain = PromptRecord(correct, answers, frozenset(pair_solutions(9)))
    m_ordered = evaluation_metrics([ordered], [4], "val")
    m_plain = evaluation_metrics([plain], [4], "val")
    assert m_ordered["val/distinct_correct@4"] == 2 and m_plain["val/distinct_correct@4"] == 1
    assert m_ordered["val/coverage@4"] == pytest.approx(2 / 10)
    assert m_plain["val/coverage@4"] == pytest.approx(1 / 5)
    # the answers' spread, as train/answer_entropy reads it: 2-1-1 ordered, 3-1 as sums
    assert m_ordered["val/answer_entropy"] == pytest.approx(
        -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))
    assert m_plain["val/answer_entropy"] == pytest.approx(
        -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))


@pytest.mark.parametrize("stage", ["validate", "predict"])
def test_validate_and_predict_close_the_engine_and_the_tools_sandbox(cache_dir, tmp_path,
                                                                      stage):
    """A server engine's connections and weights file, and the tools' sandbox processes,
    are closed after ``validate`` and ``predict`` as after ``fit`` (they were left to the
    garbage collector); the module builds its engine again when it runs again."""
    closed: list[str] = []

    class Closing:
        """The built engine with the two ``close`` methods of a server engine with tools."""

        def __init__(self, inner):
            self.engine, self.toolbox = inner, SimpleNamespace(
                close=lambda: closed.append("toolbox"))
            inner.close = lambda: closed.append("engine")

        def __getattr__(self, name):
            return getattr(self.engine, name)

    module = make_module(cache_dir, eval_num_generations=2, eval_k=[1, 2])
    built = module.engine_factory
    module.engine_factory = lambda *a: Closing(built(*a))
    data = make_data(cache_dir)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=1,
                        limit_predict_batches=1, default_root_dir=tmp_path)
    if stage == "validate":
        trainer.validate(module, data, verbose=False)
    else:
        trainer.predict(module, data)
    assert closed == ["engine", "toolbox"]  # the engine first: its rollouts end, then tools
    assert module._engine is None
    assert isinstance(module.rollout_engine(), Closing)  # built again on the next use


def test_answers_are_compared_alike_in_every_record_and_metric():
    """``distinct_correct@k`` used the canonical form as soon as any prompt had a valid
    set, which drops what is not an expression (``\\frac{1}{2}``, ``x = 3``), and raw text
    otherwise, where ``4+5`` and ``5+4`` were two answers; every record now compares as
    ``answer_entropy`` and ``train/distinct_correct`` do (a defect hunt)."""
    from maxent_grpo.training.run.evaluation import PromptRecord, evaluation_metrics

    countdown = PromptRecord((1.0, 1.0), ("4+5", "5+4"), valid_answers=frozenset({"4 + 5"}),
                             task="cd")
    maths = PromptRecord((1.0, 1.0), (r"\frac{1}{2}", "x = 3"), task="math")
    out = evaluation_metrics([countdown, maths], [2], "val")
    assert (out["val/distinct_correct@2/cd"], out["val/distinct_correct@2/math"]) == (1.0, 2.0)
    assert out["val/distinct_correct@2"] == 1.5 and out["val/coverage@2"] == 1.0
    alone = evaluation_metrics([dataclasses.replace(countdown, valid_answers=None)], [2], "val")
    assert alone["val/distinct@2"] == 1.0 and alone["val/distinct_correct@2"] == 1.0


def test_validating_a_checkpoint_logs_at_the_step_the_fit_logged_its_weights(cache_dir, tmp_path):
    """``validate --ckpt_path`` logged at step 0, whatever the checkpoint: evaluations of
    several checkpoints all sat at the start of the fit's curves. The fit writes a step's
    scalars at its batch count less one (the 2nd batch's at 1); so does the evaluation."""
    import csv

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    saver = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1)
    module = make_module(cache_dir)
    fit(module, make_data(cache_dir), steps=4, tmp_path=tmp_path, callbacks=[saver],
        enable_checkpointing=True, logger=CSVLogger(tmp_path, name="fit"),
        log_every_n_steps=1)
    for name, step in (("epoch=0-step=2.ckpt", 1), ("epoch=0-step=4.ckpt", 3)):
        logger = CSVLogger(tmp_path, name="val")
        trainer = L.Trainer(accelerator="cpu", logger=logger, limit_val_batches=1,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.validate(make_module(cache_dir), make_data(cache_dir),
                         ckpt_path=str(tmp_path / "ck" / name))
        rows = list(csv.DictReader(open(f"{logger.log_dir}/metrics.csv")))
        assert {int(r["step"]) for r in rows if r.get("val/pass@1")} == {step}
    rows = list(csv.DictReader(open(tmp_path / "fit" / "version_0" / "metrics.csv")))
    assert {int(r["step"]) for r in rows if r.get("train/reward/mean")} == {0, 1, 2, 3}
    # the same Trainer fits afterwards from its own step 0, not the checkpoint's
    trainer.fit_loop.epoch_loop.max_steps = 1
    trainer.fit(make_module(cache_dir), make_data(cache_dir))
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == 1  # its one step (4: from 3)


def test_evaluating_after_a_fit_on_its_trainer_logs_at_the_fits_last_step(cache_dir, tmp_path):
    """``trainer.validate``/``test`` after a fit on the same Trainer logged at the step after
    the fit's last training scalars (its batch count: 3 for scalars at 0..2, where the fit's
    own validation logged at 2), off the curves a fresh Trainer's evaluation lines up with
    (a hunt of the Python API); a checkpoint's evaluation there logs at its own step, and a
    fit continued on that Trainer logs on from its own step."""
    import csv

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="fit")
    saver = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1)
    module, data = make_module(cache_dir), make_data(cache_dir)
    trainer = fit(module, data, steps=3, tmp_path=tmp_path, logger=logger, log_every_n_steps=1,
                  limit_val_batches=1, val_check_interval=3, check_val_every_n_epoch=None,
                  callbacks=[saver], enable_checkpointing=True)
    trainer.validate(module, data)
    trainer.test(module, data)
    trainer.validate(make_module(cache_dir), data,
                     ckpt_path=str(tmp_path / "ck" / "epoch=0-step=2.ckpt"))
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(module, data)
    logger.save()
    rows = list(csv.DictReader(open(f"{logger.log_dir}/metrics.csv")))
    assert [int(r["step"]) for r in rows if r.get("val/pass@1")] == [2, 2, 1]
    assert [int(r["step"]) for r in rows if r.get("test/pass@1")] == [2]
    assert [int(r["step"]) for r in rows if r.get("train/reward/mean")] == [0, 1, 2, 3]


def step_seen(completions, trainer_state=None, **kw):
    """Records the step the rewards are told (a reward that ramps with training) in the
    file ``$STEPS_SEEN`` (the registry imports this module under another name)."""
    import os

    with open(os.environ["STEPS_SEEN"], "a") as f:
        f.write(f"{trainer_state.global_step} {trainer_state.epoch}\n")
    return [1.0] * len(completions)


@pytest.mark.parametrize("stage", ["validate", "predict"])
def test_a_checkpoints_evaluation_tells_the_rewards_its_step(cache_dir, tmp_path, stage,
                                                             monkeypatch):
    """Rewards that read ``trainer_state`` were told step 0 by a checkpoint's validate or
    predict (Lightning restores no step outside fit), so a reward ramping with training
    graded a step-4 checkpoint as at the start; a fit on the same Trainer counts its own. The
    epoch was 0.0 there (the fit's own validation at that step said 1.5 in the hunt's run)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    seen = tmp_path / "steps"
    monkeypatch.setenv("STEPS_SEEN", str(seen))
    monkeypatch.chdir(tmp_path)  # predict writes its predictions.jsonl here
    rewards = {"tests.training.run.test_module_evaluation:step_seen": 1.0}
    saver = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=4, save_top_k=-1)
    fitted = fit(make_module(cache_dir, rewards=rewards), make_data(cache_dir), steps=4,
                 tmp_path=tmp_path, callbacks=[saver], enable_checkpointing=True)
    fitted.save_checkpoint(tmp_path / "ck" / "after.ckpt")  # as a last.ckpt at the fit's end
    epochs = {int(s): float(e) for s, e in (line.split() for line in seen.read_text(
        ).splitlines())}  # by step: the batches' share of an epoch is epochs[1]
    seen.write_text("")
    trainer = L.Trainer(accelerator="cpu", logger=False, limit_val_batches=1,
                        limit_predict_batches=1, enable_progress_bar=False,
                        enable_model_summary=False)
    run = trainer.validate if stage == "validate" else trainer.predict
    for name in ("epoch=0-step=4.ckpt", "after.ckpt"):  # the second said one epoch more
        run(make_module(cache_dir, rewards=rewards), make_data(cache_dir),
            ckpt_path=str(tmp_path / "ck" / name))
    assert {line.split()[0] for line in seen.read_text().splitlines()} == {"4"}
    assert [float(line.split()[1]) for line in seen.read_text().splitlines()] == pytest.approx(
        [epochs[3] + epochs[1]] * len(seen.read_text().splitlines())) and epochs[1] > 0
    seen.write_text("")
    trainer.fit_loop.epoch_loop.max_steps = 1
    trainer.fit(make_module(cache_dir, rewards=rewards), make_data(cache_dir))
    assert seen.read_text().split()[0] == "0"


def test_a_failed_evaluation_of_a_checkpoint_leaves_the_trainer_as_it_was(cache_dir, tmp_path):
    """A validate of a checkpoint logs at its step; when it failed (a reward error, a
    SIGTERM), Lightning ran no teardown and a later fit on the same Trainer logged from the
    checkpoint's step on; and the Trainer kept this trainer's SIGTERM handler after it."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)
    fit(make_module(cache_dir), make_data(cache_dir), steps=3, tmp_path=tmp_path,
        callbacks=[saver], enable_checkpointing=True)

    class Fail(L.Callback):
        def on_validation_batch_start(self, *args, **kwargs):
            raise RuntimeError("a reward failed")

    trainer = L.Trainer(accelerator="cpu", logger=False, limit_val_batches=1,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Fail()], default_root_dir=tmp_path)
    with pytest.raises(RuntimeError, match="a reward failed"):
        trainer.validate(make_module(cache_dir), make_data(cache_dir),
                         ckpt_path=str(tmp_path / "ck" / "last.ckpt"))
    assert "_sigterm_notifier_fn" not in vars(trainer._signal_connector)
    trainer.callbacks.remove(next(c for c in trainer.callbacks if isinstance(c, Fail)))
    trainer.fit_loop.epoch_loop.max_steps = 1
    trainer.fit(make_module(cache_dir), make_data(cache_dir))
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == 1  # 3 before: from 2
    assert "_sigterm_notifier_fn" not in vars(trainer._signal_connector)


def test_a_fit_after_an_evaluation_on_the_same_trainer_runs_with_its_own_seed(cache_dir,
                                                                              tmp_path):
    """``trainer.validate`` then ``trainer.fit`` stopped at the fit's first validation
    ("Inplace update to inference tensor outside InferenceMode"); and a validate of a
    checkpoint put that checkpoint's random state on the next fit, so a seed sweep after it
    sampled the same completions for every seed."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    fit(make_module(cache_dir), make_data(cache_dir), steps=2, tmp_path=tmp_path,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)],
        enable_checkpointing=True)
    sampled = []

    class Sampled(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            sampled.append(pl_module.trajectory.rollout.completion_ids.tolist())

    for seed in (1, 2):
        module, data = make_module(cache_dir), make_data(cache_dir)
        trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, limit_val_batches=1,
                            val_check_interval=1, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[Sampled()], default_root_dir=tmp_path)
        trainer.validate(module, data, ckpt_path=str(tmp_path / "ck" / "last.ckpt"))
        L.seed_everything(seed)
        trainer.fit(module, data)  # its sanity check and validation update the metrics
        assert trainer.global_step == 1
    assert sampled[0] != sampled[1]


def test_predict_on_prompts_without_answers_writes_them_ungraded(cache_dir, caplog):
    """Sampling prompts that have no reference is what predict is for: it raised after the
    whole sampling pass (nothing written); now each row's ``correct`` is None and no @k is
    reported. Validation still refuses an evaluation that graded nothing."""
    module = make_module(cache_dir, eval_num_generations=2, eval_greedy=False, eval_k=[1])
    module.configure_model()
    data = make_data(cache_dir)
    data.setup("validate")
    batch = collate_prompts(data.val_dataset.examples[:2])
    batch["answers"] = batch["columns"]["answer"] = ["", ""]  # the rewards read the column
    assert [r["correct"] for r in module.predict_step(batch, 0)] == [None] * 4
    with caplog.at_level("WARNING"):
        metrics = module.evaluator.compute("predict")
    assert "predict/reward/mean" in metrics and not [k for k in metrics if "@" in k]
    assert "graded none of the 4 completions" in caplog.text
    module.predict_step(batch, 0)
    with pytest.raises(ValueError, match="for every one of the 4 evaluation completions"):
        module.evaluator.compute("val")


def test_a_batch_that_is_not_collate_prompts_is_named(cache_dir):
    """A DataLoader of one's own without ``indices``: a bare ``KeyError: 'indices'`` deep in
    the evaluation (a hunt of the Python API)."""
    module = make_module(cache_dir)
    data = make_data(cache_dir)
    data.setup("validate")
    batch = collate_prompts(data.val_dataset.examples[:2])
    del batch["indices"]
    with pytest.raises(ValueError, match=r"an evaluation batch has no 'indices': a DataLoader "
                                         r"of yours must yield the batches collate_prompts"):
        module.evaluator.step(batch, None, None)


def test_predict_names_the_completions_a_repeating_loader_left_out(cache_dir, tmp_path,
                                                                  monkeypatch):
    """A DataLoader of one's own that gives one prompt twice: predict writes one line per
    ``(row, sample)`` (as its @k values count a prompt once), which dropped the second copy's
    completions without a word (a hunt of the Python API); it is warned of now."""
    from torch.utils.data import DataLoader

    module = make_module(cache_dir, eval_num_generations=2, eval_k=[1])
    data = make_data(cache_dir)
    data.setup("validate")
    row = data.val_dataset.examples[0]
    loader = DataLoader([row, row, data.val_dataset.examples[1]], batch_size=3,
                        collate_fn=collate_prompts)
    monkeypatch.chdir(tmp_path)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="predict: 2 completions were left out: the predict "
                                         "loader gave a prompt's row twice"):
        trainer.predict(module, loader)
    lines = (tmp_path / "predictions.jsonl").read_text().splitlines()
    assert sorted((json.loads(x)["row"], json.loads(x)["sample"]) for x in lines) == [
        (0, 0), (0, 1), (1, 0), (1, 1)]


def test_math_answers_in_other_forms_are_one_answer_in_every_metric():
    """A hunt with MATH-style rows: ``-\\frac{1}{2}`` was another answer than ``-0.5`` and
    had no canonical form (coverage left it out of the valid set); coverage did not drop
    Markdown's bold; ``(1, 3]`` and ``(1,3]`` were two answers."""
    from maxent_grpo.rewards.answers import answer_key, canonical_answer

    halves = [r"-\frac{1}{2}", r"\frac{-1}{2}", r"-\dfrac{1}{2}", "-0.5", "-1/2"]
    assert {canonical_answer(a) for a in halves} == {"-1 / 2"}
    assert canonical_answer(r"3\frac{1}{2}") is None  # a mixed number: not 31/2
    assert {answer_key(f"<answer>{a}</answer>") for a in ("2(3)", "23", "(2)(3)")} == {
        "2(3)", "23", "(2)(3)"}  # numbers side by side stay apart
    assert {answer_key(f"<answer>{a}</answer>") for a in ("(1, 3]", "(1,3]", " ( 1 ,3 ] ")} == {
        "(1,3]"}
    assert answer_key("<answer>x = 5</answer>") == answer_key("<answer>x=5</answer>")
    assert answer_key("<answer>New  York</answer>") == "New York"  # words keep one space
    record = PromptRecord((1.0, 1.0, 1.0), (r"-\frac{1}{2}", "-0.5", "**4**"),
                          frozenset({r"\frac{1}{2}", r"-\frac{1}{2}", "4"}))
    metrics = evaluation_metrics([record], [3], "val")
    assert metrics["val/distinct_correct@3"] == 2  # -1/2 twice, 4
    assert metrics["val/coverage@3"] == pytest.approx(2 / 3)


def test_each_evaluation_batch_draws_new_random_numbers_and_training_keeps_its_own(cache_dir):
    """Every evaluation batch began from the training's random state, so each drew the same
    numbers: with a model that barely reads its prompt, every batch's samples repeated the
    first's (a defect hunt). The epoch's batches go on from one another now; the training's
    state is as it was, and the next epoch starts from it again."""
    module = make_module(cache_dir, eval_num_generations=2, eval_greedy=False)
    module.configure_model()
    data = make_data(cache_dir)
    data.setup("validate")
    batch = collate_prompts(data.val_dataset.examples[:2])
    draws: list[float] = []

    def generate(prompts, answers, G, sampling=None):
        draws.append(torch.rand(()).item())
        return RolloutOutput(
            batch=GenerationBatch(list(prompts), list(answers), [["1", "2"]] * 2, None),
            prompt_ids=torch.ones(4, 1, dtype=torch.long),
            prompt_mask=torch.ones(4, 1, dtype=torch.bool),
            completion_ids=torch.ones(4, 1, dtype=torch.long),
            completion_mask=torch.ones(4, 1, dtype=torch.bool),
            truncated=torch.zeros(4, dtype=torch.bool), generate_seconds=0.0)

    module.rollout_engine = lambda: SimpleNamespace(generate=generate)
    module.log_dict = lambda values, **kw: None
    training = torch.get_rng_state()
    for _ in range(2):  # two epochs of three batches
        for i in range(3):
            module.validation_step(batch, i)
        module.on_validation_epoch_end()
    assert torch.equal(torch.get_rng_state(), training)
    assert len(set(draws[:3])) == 3 and draws[3:] == draws[:3]


def noisy(completions, **kwargs):
    """A reward that draws random numbers (a sampled judge, a noise term), of each kind."""
    return [torch.rand(()).item() + random.random() + np.random.rand() for _ in completions]


def stub_engine(right_rows: int):
    """An engine whose completions of each batch's first ``right_rows`` prompts give the
    prompt's answer, and of the others a wrong one."""
    def generate(prompts, answers, G, sampling=None):
        texts = [[str(a) if i < right_rows else "-1"] * G for i, a in enumerate(answers)]
        B = len(prompts)
        return RolloutOutput(
            batch=GenerationBatch(list(prompts), list(answers), texts, None),
            prompt_ids=torch.ones(B * G, 1, dtype=torch.long),
            prompt_mask=torch.ones(B * G, 1, dtype=torch.bool),
            completion_ids=torch.ones(B * G, 1, dtype=torch.long),
            completion_mask=torch.ones(B * G, 1, dtype=torch.bool),
            truncated=torch.zeros(B * G, dtype=torch.bool), generate_seconds=0.0)

    return SimpleNamespace(generate=generate)


def test_a_reward_drawing_random_numbers_leaves_the_trainings_stream_alone(cache_dir):
    """Validation graded outside its own random state: a reward that draws random numbers
    took them from the training's stream, and a run with validation then sampled other
    training rollouts than one without (a hunt of the evaluation)."""
    module = make_module(cache_dir, eval_num_generations=2,
                         rewards={"tests.training.run.test_module_evaluation:noisy": 1.0})
    module.configure_model()
    data = make_data(cache_dir)
    data.setup("validate")
    module.rollout_engine = lambda: stub_engine(right_rows=1)
    module.log_dict = lambda values, **kw: None
    training = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist())
    module.validation_step(collate_prompts(data.val_dataset.examples[:2]), 0)
    module.on_validation_epoch_end()
    assert torch.equal(torch.get_rng_state(), training[0])
    assert (random.getstate(), np.random.get_state()[1].tolist()) == training[1:]


def test_a_prompt_a_loader_repeats_counts_once_on_one_process(cache_dir):
    """On one process a row the loader gave twice counted twice in the @k values and the
    reward moments (several processes counted it once, and predict's file holds it once):
    pass@1 was 2/3 for one right prompt of two (a hunt of the evaluation)."""
    module = make_module(cache_dir, eval_num_generations=2, eval_greedy=False)
    module.configure_model()
    data = make_data(cache_dir)
    data.setup("validate")
    right, wrong = data.val_dataset.examples[:2]
    module.rollout_engine = lambda: stub_engine(right_rows=2)
    module.validation_step(collate_prompts([right, right, wrong]), 0)
    metrics = module.evaluator.compute("val")
    assert metrics["val/pass@1"] == metrics["val/reward/mean"] == 0.5
    module.rollout_engine = lambda: stub_engine(right_rows=1)
    module.validation_step(collate_prompts([right, wrong]), 0)  # no repeat: as it was
    assert module.evaluator.compute("val")["val/pass@1"] == 0.5


def test_an_evaluation_a_failure_cut_short_leaves_nothing_to_the_next(cache_dir):
    """The records, counts and random stream were reset only when an evaluation ended
    (``compute``): after a validate that raised mid-way (a notebook) the next one counted
    the stale prompts, and with one process's repeats counted once now, a stale copy of a
    row won over the fresh one (a second reader)."""
    data = make_data(cache_dir)
    clean = validate(make_module(cache_dir, eval_num_generations=2), data)
    module = make_module(cache_dir, eval_num_generations=2)
    module.evaluator.records.append(PromptRecord((1.0, 1.0), ("1", "1"), None, row=0))
    module.evaluator.graded = [5, 0, 0]
    module.evaluator.stream = {"stale": True}
    assert validate(module, data) == clean


def test_a_prediction_row_names_the_answer_as_distinct_at_k_counts_it():
    """``parsed_answer`` is the answer as read (``" 11, which isn"`` gives ``"11, which
    isn"``), not the form the answer statistics count; ``compared_answer`` is that form, so
    ``distinct@k`` can be recomputed from a predictions file (the SmolLM2 hunt)."""
    from maxent_grpo.training.run.evaluation import prediction_row

    completions = ["<answer>5+4</answer>", " 4 + 5 ", "**72**", " 11, which isn"]
    forms = ["expression", "expression", None, None]
    batch = {"prompts": ["p"] * 4, "raw_prompts": ["p"] * 4, "answers": ["9"] * 4,
             "indices": [0, 0, 1, 1], "columns": {"answer_form": forms}}
    rows = [prediction_row(batch, b, 0, c, torch.tensor(0.0), torch.zeros(1), ["r"], 1.0, False)
            for b, c in enumerate(completions)]
    assert [r["parsed_answer"] for r in rows] == ["5+4", "4 + 5", "**72**", "11, which isn"]
    assert [r["compared_answer"] for r in rows] == ["4 + 5", "4 + 5", "72", "11,which isn"]
    records = [PromptRecord((1.0, 1.0), tuple(r["parsed_answer"] for r in rows[i:i + 2]),
                            answer_form=forms[i]) for i in (0, 2)]
    by_hand = sum(len({r["compared_answer"] for r in rows[i:i + 2]}) for i in (0, 2)) / 2
    assert evaluation_metrics(records, [2], "val")["val/distinct@2"] == by_hand == 1.5
