"""Asynchronous rollouts (``model.max_staleness``) through the LightningModule, on a sampler
that holds its own copy of the weights as a vLLM server does (the real servers:
``tests/vllm_engine/test_vllm_server.py``)."""

from __future__ import annotations

import copy
import threading
import time

import lightning as L
import pytest
import torch

from maxent_grpo.rollout import HFGenerateEngine, SamplingSettings
from maxent_grpo.rollout.hf import encode_prompts
from maxent_grpo.rollout.seeds import request_seed_base
from maxent_grpo.rollout.vllm_engine import assemble_rollout
from tests.conftest import fit, make_data, make_module, params


class RemoteCopy:
    """Samples from its own copy of the policy, refreshed by ``sync``: a stand-in for a
    server. Seeds come from :func:`request_seed_base`, as the real engines' do."""

    generates_elsewhere = True

    def __init__(self, model, tokenizer, sampling: SamplingSettings) -> None:
        self.copy = copy.deepcopy(model).eval()
        self.tokenizer, self.sampling = tokenizer, sampling
        self.stop_token_ids = (tokenizer.eos_token_id,)

    def sync(self, model) -> None:
        self.copy.load_state_dict(model.state_dict())

    @torch.no_grad()
    def generate(self, prompts, answers, num_generations, sampling=None):
        s = sampling or self.sampling
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, prompts, s.max_prompt_length)
        generator = torch.Generator().manual_seed(request_seed_base())
        rows = []
        for ids, mask in zip(prompt_ids, prompt_mask, strict=True):
            for _ in range(num_generations):
                seq, out, logps = ids[mask].tolist(), [], []
                for _ in range(s.max_new_tokens):
                    logits = self.copy(input_ids=torch.tensor([seq])).logits[0, -1].float()
                    lp = torch.log_softmax(logits / s.temperature, -1)
                    token = (int(torch.multinomial(lp.exp(), 1, generator=generator))
                             if s.do_sample else int(lp.argmax()))
                    seq.append(token)
                    out.append(token)
                    logps.append(float(lp[token]))
                    if token in self.stop_token_ids:
                        break
                rows.append((out, logps))
        return assemble_rollout(self.tokenizer, self.stop_token_ids, prompts, answers,
                                prompt_ids, prompt_mask, rows, num_generations, 0.0,
                                torch.device("cpu"))


class Batches(L.Callback):
    """The prompts of every batch handed to training_step, and of every trajectory trained."""

    def __init__(self) -> None:
        self.given, self.trained = [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.given.append(list(batch["prompts"]))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        t = module.trajectory
        self.trained.append(None if t is None else list(t.rollout.batch.prompts))


def async_module(cache_dir, k, **kw):
    return make_module(cache_dir, engine=RemoteCopy, max_staleness=k,
                       sampler_correction="token_tis",
                       rewards={"tests.conftest:alternating": 1.0},
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **kw)


def test_step_t_trains_on_the_rollout_of_batch_t_minus_k(cache_dir):
    for k in (1, 2):
        seen = Batches()
        module = async_module(cache_dir, k)
        trainer = fit(module, make_data(cache_dir), steps=3, callbacks=[seen])
        assert trainer.global_step == 3
        assert seen.trained[:k] == [None] * k  # the first k steps only start rollouts
        assert seen.trained[k:] == seen.given[:-k] and len(seen.given) == 3 + k
        logged = trainer.callback_metrics
        assert float(logged["train/rollout/staleness"]) == k
        # the copy that sampled is k steps older than the policy that scores
        assert float(logged["train/rollout/logp_gap/mean"]) > 1e-4
        assert module.pipeline.queue == type(module.pipeline.queue)()  # closed at the end


def test_staleness_zero_is_the_synchronous_step(cache_dir):
    seen = Batches()
    module = make_module(cache_dir, engine=RemoteCopy, sampler_correction="token_tis",
                         rewards={"tests.conftest:alternating": 1.0})
    trainer = fit(module, make_data(cache_dir), steps=2, callbacks=[seen])
    assert seen.trained == seen.given and module.pipeline is None
    assert float(trainer.callback_metrics["train/rollout/logp_gap/max"]) < 1e-5
    assert "train/rollout/staleness" not in trainer.callback_metrics


def test_a_resumed_asynchronous_run_continues_exactly(cache_dir, tmp_path):
    """A checkpoint after step 2 stores the rollout in flight; the run resumed from it ends
    with the uninterrupted run's weights, bit for bit."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    whole = async_module(cache_dir, 1)
    fit(whole, make_data(cache_dir), steps=4)
    first = async_module(cache_dir, 1)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    fit(first, make_data(cache_dir), steps=2, tmp_path=tmp_path, enable_checkpointing=True,
        callbacks=[saver])
    ckpt = tmp_path / "epoch=0-step=2.ckpt"
    assert len(torch.load(ckpt, weights_only=False)["maxent_grpo_rollouts"]) == 1
    resumed = async_module(cache_dir, 1)
    fit(resumed, make_data(cache_dir), steps=4, ckpt_path=str(ckpt))
    a, b = params(whole), params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_refused_without_an_engine_elsewhere_or_a_correction(cache_dir):
    """An engine class that samples here is refused when a fit sets up, before any model
    loads (the colocated vLLM engine was refused at the first step, after vLLM had started);
    a factory's engine when it is built; evaluation, which has no pipeline, on any engine."""
    module = make_module(cache_dir, max_staleness=1, sampler_correction="token_tis")
    with pytest.raises(ValueError, match="HFGenerateEngine samples here"):
        fit(module, make_data(cache_dir), steps=1)
    assert module.policy is None  # refused before the model (or vLLM) loads
    validate = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=1)
    validate.validate(module, make_data(cache_dir), verbose=False)  # no pipeline: any engine
    with pytest.raises(ValueError, match="model.sampler_correction"):
        make_module(cache_dir, max_staleness=1, engine=RemoteCopy)
    module = make_module(cache_dir, max_staleness=1, sampler_correction="token_tis",
                         engine=lambda *a: HFGenerateEngine(*a),
                         rewards={"tests.conftest:alternating": 1.0})
    with pytest.raises(ValueError, match="VLLMServerEngine"):
        fit(module, make_data(cache_dir), steps=1)


def test_an_objective_without_the_correction_is_told_to_train_synchronously(cache_dir):
    """The listwise objective cannot take the correction that stale rollouts need: one
    message says so (it used to ask for the correction, which is refused for it)."""
    from maxent_grpo.objectives import ListwiseMaxEnt

    with pytest.raises(ValueError, match="ListwiseMaxEnt has none: use max_staleness 0"):
        make_module(cache_dir, objective=ListwiseMaxEnt(tau=0.5), max_staleness=1,
                    engine=RemoteCopy)


class SlowEngine:
    """A rollout that takes ``seconds``, or until the engine is closed; records its end."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.ended, self.closed = seconds, threading.Event(), threading.Event()

    def generate(self, prompts, answers, num_generations):
        self.closed.wait(self.seconds)
        self.ended.set()
        raise RuntimeError("a rollout whose result nobody reads")

    def close(self) -> None:
        self.closed.set()


def rollout_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "maxent-grpo-rollout"]


def test_the_end_of_a_run_waits_a_bounded_time_for_the_rollout_in_flight():
    from maxent_grpo.training.step.pipeline import RolloutPipeline

    batch = {"prompts": ["p"], "answers": ["a"]}
    pipeline, engine = RolloutPipeline(1), SlowEngine(0.3)
    pipeline.submit(engine, batch, 2, version=0)
    pipeline.close()  # the end of a run: no rollout thread may outlive it
    assert engine.ended.is_set() and not pipeline.queue
    for thread in rollout_threads():
        thread.join(5.0)  # the thread returns right after setting its future
    assert not rollout_threads()
    stuck, slow = RolloutPipeline(1), SlowEngine(30.0)
    stuck.submit(slow, batch, 2, version=0)
    began = time.monotonic()
    stuck.close(timeout=0.2)  # a rollout that does not end is not waited for past the bound
    assert time.monotonic() - began < 5.0 and not slow.ended.is_set() and not stuck.queue
    slow.close()
    assert slow.ended.wait(10.0)


def test_teardown_closes_the_engine_before_waiting_for_its_rollout(cache_dir):
    """A rollout running on a server ends when the engine closes, instead of being finished
    (or waited for up to the bound) and thrown away."""
    from maxent_grpo.training.step.pipeline import RolloutPipeline

    module = async_module(cache_dir, 1)
    module.pipeline, module._engine = RolloutPipeline(1), SlowEngine(60.0)
    engine = module._engine
    module.pipeline.submit(engine, {"prompts": ["p"], "answers": ["a"]}, 2, version=0)
    began = time.monotonic()
    module.teardown("fit")
    assert time.monotonic() - began < 10.0
    assert engine.closed.is_set() and engine.ended.is_set() and module._engine is None


def test_a_failing_engine_close_still_ends_the_rollout_and_the_clean_up_is_logged(
        cache_dir, caplog):
    from maxent_grpo.training.callbacks import CleanUp
    from maxent_grpo.training.step.pipeline import RolloutPipeline

    class BrokenClose(SlowEngine):
        def close(self) -> None:
            super().close()
            raise OSError("the server's group could not be left")

    module = async_module(cache_dir, 1)
    module.pipeline, module._engine = RolloutPipeline(1), BrokenClose(60.0)
    engine = module._engine
    module.pipeline.submit(engine, {"prompts": ["p"], "answers": ["a"]}, 2, version=0)
    with caplog.at_level("WARNING"):
        CleanUp().on_exception(None, module, RuntimeError("the step failed"))
    assert "cleaning up after the failed run failed too: OSError: the server's group" in (
        caplog.text)
    # the rollout in flight was still waited for (it ended with the close), the engine let go
    assert engine.ended.is_set() and not module.pipeline.queue and module._engine is None


class Boom(L.Callback):
    """A failure at the end of training batch ``at`` (a server dying, say)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.at:
            raise RuntimeError("boom")


def test_a_checkpoint_saved_on_a_failure_keeps_the_rollouts_that_were_done(cache_dir, tmp_path):
    """Lightning's ``ModelCheckpoint(save_on_exception=True)`` saves after the module's
    clean-up closed the pipeline: the rollout done by then is stored (before, none was, and
    the resumed run skipped that batch), so the resume is exact."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    whole = async_module(cache_dir, 1)
    fit(whole, make_data(cache_dir), steps=5)
    first = async_module(cache_dir, 1)
    saver = ModelCheckpoint(dirpath=tmp_path, save_on_exception=True, every_n_train_steps=1000)
    with pytest.raises(RuntimeError, match="boom"):
        fit(first, make_data(cache_dir), steps=5, tmp_path=tmp_path, enable_checkpointing=True,
            callbacks=[Boom(3), saver])
    (ckpt,) = tmp_path.glob("*.ckpt")
    saved = torch.load(ckpt, weights_only=False)
    assert saved["global_step"] == 3
    assert [len(r) for r in saved["maxent_grpo_rollouts"]] == [1]
    assert saved["maxent_grpo_rollouts_dropped"] == [0]
    resumed = async_module(cache_dir, 1)
    fit(resumed, make_data(cache_dir), steps=5, ckpt_path=str(ckpt))
    a, b = params(whole), params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_saved_on_a_failure_records_the_runs_controllers(cache_dir, tmp_path):
    """The module's clean-up runs before Lightning's exception checkpoint: it detached the
    controllers, so the checkpoint said the run had none and a resume without them was not
    warned about. The next fit still starts without them."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from maxent_grpo.objectives import ListwiseMaxEnt
    from maxent_grpo.training.callbacks import TauController
    from maxent_grpo.training.run.checkpoint import load_state
    from maxent_grpo.training.step.optimise import StepCounters

    module = make_module(cache_dir, objective=ListwiseMaxEnt(tau=0.5))
    saver = ModelCheckpoint(dirpath=tmp_path, save_on_exception=True, every_n_train_steps=1000)
    with pytest.raises(RuntimeError, match="boom"):
        fit(module, make_data(cache_dir), steps=3, tmp_path=tmp_path, enable_checkpointing=True,
            callbacks=[Boom(1), TauController(target_entropy=1.0), saver])
    (ckpt,) = tmp_path.glob("*.ckpt")
    saved = torch.load(ckpt, weights_only=False)
    assert saved["maxent_grpo"]["controllers"]["attached"] is True
    with pytest.warns(UserWarning, match="trained with tau/beta controllers"):
        load_state(saved, "builtin:tiny", ListwiseMaxEnt(tau=0.5), StepCounters(), None,
                   fitting=True)
    fit(module, make_data(cache_dir), steps=1)  # a new fit without controllers has none
    assert module.loop.controller_objective is None


STOP_AT = {"call": None, "calls": 0}


def stopped_by_ctrl_c(prompts, completions, **kw):
    """A reward that presses Ctrl-C at its ``STOP_AT["call"]``-th call (mid-step)."""
    STOP_AT["calls"] += 1
    if STOP_AT["calls"] == STOP_AT["call"]:
        raise KeyboardInterrupt
    return [float(len(c) % 3) for c in completions]


class CtrlCAtBatchStart(L.Callback):
    """Ctrl-C as training batch ``at`` starts, before its step's rollout."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("k, where", [(0, "reward"), (1, "reward"), (1, "batch start")])
def test_a_checkpoint_saved_on_ctrl_c_in_the_middle_of_a_step_resumes_exactly(
        cache_dir, tmp_path, k, where):
    """Lightning runs a step cut short again at the resume; the checkpoint counted its
    batch as done and saved the random state after its sampling, so the resumed run
    trained another batch with other samples (and, asynchronously, lost the rollout that
    step had taken). Stopped as the batch starts, the step has taken no rollout yet."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def module():
        return make_module(cache_dir, rewards={f"{__name__}:stopped_by_ctrl_c": 1.0},
                           **({"engine": RemoteCopy, "max_staleness": k,
                               "sampler_correction": "token_tis"} if k else {}))

    STOP_AT.update(call=None, calls=0)
    whole = module()
    fit(whole, make_data(cache_dir), steps=5)
    STOP_AT.update(call=3 if where == "reward" else None, calls=0)  # the third step's reward
    saver = ModelCheckpoint(dirpath=tmp_path, save_on_exception=True, every_n_train_steps=1000)
    stop = [] if where == "reward" else [CtrlCAtBatchStart(3)]
    with pytest.raises(SystemExit):  # Lightning's answer to Ctrl-C
        fit(module(), make_data(cache_dir), steps=5, tmp_path=tmp_path,
            enable_checkpointing=True, callbacks=[*stop, saver])
    (ckpt,) = tmp_path.glob("*.ckpt")
    assert torch.load(ckpt, weights_only=False)["global_step"] == 2
    STOP_AT.update(call=None, calls=0)
    resumed = module()
    fit(resumed, make_data(cache_dir), steps=5, ckpt_path=str(ckpt))
    a, b = params(whole), params(resumed)
    assert all(torch.equal(a[key], b[key]) for key in a)


class Scripted:
    """Finished rollouts (a RolloutOutput of one prompt) or, with ``fail``, an error."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def generate(self, prompts, answers, num_generations):
        if self.fail:
            raise RuntimeError("the engine was closed")
        from maxent_grpo.rollout.protocol import RolloutOutput
        from maxent_grpo.training.types import GenerationBatch

        n = len(prompts) * num_generations
        return RolloutOutput(
            batch=GenerationBatch.of_rows(list(prompts), list(answers), ["c"] * n, None),
            prompt_ids=torch.ones(n, 2, dtype=torch.long),
            prompt_mask=torch.ones(n, 2, dtype=torch.bool),
            completion_ids=torch.ones(n, 1, dtype=torch.long),
            completion_mask=torch.ones(n, 1, dtype=torch.bool),
            truncated=torch.zeros(n, dtype=torch.bool), generate_seconds=0.0)


def test_rollouts_a_failure_ended_or_a_smaller_staleness_drops_are_warned_about(caplog):
    """None of these batches is trained after the resume: each case says so, with the
    count."""
    from maxent_grpo.training.step.pipeline import RolloutPipeline, restore_rollouts

    batch = {"prompts": ["p"], "answers": ["a"]}
    pipeline = RolloutPipeline(2)
    pipeline.submit(Scripted(), batch, 2, version=0)
    pipeline.submit(Scripted(fail=True), batch, 2, version=1)  # in flight when it failed
    pipeline.close()
    assert [p.version for p in pipeline.closed] == [0] and pipeline.dropped == 1
    checkpoint: dict = {}
    with caplog.at_level("WARNING"):
        pipeline.save(checkpoint)
    assert "lacks 1 rollout(s) that were still being generated" in caplog.text
    assert len(checkpoint["maxent_grpo_rollouts"][0]) == 1
    assert checkpoint["maxent_grpo_rollouts_dropped"] == [1]
    caplog.clear()
    resumed = RolloutPipeline(2)
    with caplog.at_level("WARNING"):
        resumed.restore(checkpoint, fitting=True, rank=0, world=1)
    assert "lacks 1 rollout(s) that the run's stop or a failure ended unfinished" in caplog.text
    assert [p.version for p in resumed.queue] == [0]
    resumed.submit(Scripted(), batch, 2, version=3)  # a new fit: nothing left is kept
    assert not resumed.closed and resumed.dropped == 0

    two = {"maxent_grpo_rollouts": [[{"batch": batch, "version": v,
                                      "rollout": Scripted().generate(["p"], ["a"], 2)
                                      .state_dict()} for v in (0, 1)]]}
    caplog.clear()
    smaller = RolloutPipeline(1)
    with caplog.at_level("WARNING"):
        smaller.restore(two, fitting=True, rank=0, world=1)
    assert "holds 2 rollout(s) in flight and model.max_staleness is 1: the oldest 1" in (
        caplog.text)
    assert [p.version for p in smaller.queue] == [1]
    caplog.clear()
    with caplog.at_level("WARNING"):
        restore_rollouts(None, two, fitting=True, rank=0, world=1)
        restore_rollouts(None, two, fitting=False, rank=0, world=1)  # validate: nothing
    assert caplog.text.count("with max_staleness 0 they are dropped") == 1


def test_rollouts_made_with_other_generation_settings_are_dropped_at_the_resume(caplog):
    """Resumed with another ``num_generations`` or a shorter ``max_completion_length``, the
    restored rollouts failed the step's checks, which blamed the engine (docs/CHECKPOINTS.md:
    a changed option is used from the resume on). They are dropped by the checkpoint's saved
    options, not by each rollout's width: that would differ between ranks (one training, the
    other only submitting, their collectives out of step)."""
    from types import SimpleNamespace

    from maxent_grpo.training.step.pipeline import RolloutPipeline

    batch = {"prompts": ["p"], "answers": ["a"]}
    made = {"num_generations": 2, "max_completion_length": 8}
    two = {"hyper_parameters": made,
           "maxent_grpo_rollouts": [[{"batch": batch, "version": v,
                                      "rollout": Scripted().generate(["p"], ["a"], 2)
                                      .state_dict()} for v in (0, 1)]]}

    def restored(num_generations: int, max_new_tokens: int) -> list[int]:
        gen = SimpleNamespace(num_generations=num_generations,
                              sampling=SimpleNamespace(max_new_tokens=max_new_tokens))
        pipeline = RolloutPipeline(2, gen)
        pipeline.restore(two, fitting=True, rank=0, world=1)
        return [p.version for p in pipeline.queue]

    assert restored(2, 8) == restored(2, 16) == [0, 1] and not caplog.text
    with caplog.at_level("WARNING"):  # (every rollout here is 1 token wide: dropped anyway)
        assert restored(3, 8) == [] and restored(2, 4) == []
    assert caplog.text.count("holds 2 rollout(s) in flight made with another") == 2


def test_after_a_failure_every_rank_keeps_as_many_rollouts(monkeypatch, caplog):
    """One rank's newest rollout finished before the clean-up and another's did not: the
    checkpoint keeps the oldest ones every rank has, so that on resume all ranks train from
    the same step (one training while the other only submits would hang its collectives)."""
    import maxent_grpo.training.step.pipeline as pipeline_module
    from maxent_grpo.training.step.pipeline import RolloutPipeline

    batch = {"prompts": ["p"], "answers": ["a"]}
    mine = RolloutPipeline(2)
    mine.submit(Scripted(), batch, 2, version=0)
    mine.submit(Scripted(), batch, 2, version=1)  # finished before the clean-up here
    mine.close()
    other = RolloutPipeline(2)
    other.submit(Scripted(), batch, 2, version=0)
    other.submit(Scripted(fail=True), batch, 2, version=1)  # ended unfinished there
    other.close()
    assert (len(mine.closed), mine.dropped, len(other.closed), other.dropped) == (2, 0, 1, 1)
    monkeypatch.setattr(pipeline_module, "all_gather_objects",
                        lambda value: [value, (other.state_dict(), other.dropped)])
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    checkpoint: dict = {}
    with caplog.at_level("WARNING"):
        mine.save(checkpoint)
    assert [[s["version"] for s in r] for r in checkpoint["maxent_grpo_rollouts"]] == [[0], [0]]
    assert checkpoint["maxent_grpo_rollouts_dropped"] == [1, 1]
    assert "lacks 1 rollout(s)" in caplog.text  # rank 0's finished one is dropped too



class NoSync:
    """An engine written without ``sync``."""

    def __init__(self, model, tokenizer, sampling) -> None:
        self.inner = HFGenerateEngine(model, tokenizer, sampling)

    def generate(self, prompts, answers, num_generations, sampling=None):
        return self.inner.generate(prompts, answers, num_generations, sampling)


def test_an_engine_without_sync_is_refused_when_built(cache_dir):
    """It trained a whole step, then stopped on ``AttributeError: ... 'sync'`` (a hunt)."""
    module = make_module(cache_dir, engine=NoSync)
    with pytest.raises(ValueError, match="model.engine built a NoSync, which has no sync"):
        fit(module, make_data(cache_dir), steps=2)
    assert module.global_step == 0


def test_a_sync_a_validation_made_is_logged_with_the_next_step(cache_dir):
    """The validation's rollout synced the engine and the next training step's call reset
    ``sync_seconds`` to 0 before logging it: that sync was logged nowhere (a hunt)."""
    module = make_module(cache_dir, engine=RemoteCopy)
    module.configure_model()
    module.rollout_engine()  # built: holds the policy's weights
    module._weights_version += 1  # a step, then a validation
    module.rollout_engine()
    synced = module.sync_seconds
    assert synced > 0
    module.rollout_engine()  # the next training step's: nothing new to sync
    assert module.sync_seconds == synced


class FailsOnce(RemoteCopy):
    """A server that dies in its ``at``-th rollout (the third: in flight while step 2 is
    saved)."""

    at = 3

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.calls = 0

    def generate(self, prompts, answers, num_generations, sampling=None):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("the server died")
        return super().generate(prompts, answers, num_generations, sampling)


def test_a_rollout_failing_in_flight_still_lets_the_step_save_and_log(cache_dir, tmp_path):
    """A checkpoint saved while the rollout in flight fails is written without it (with a
    warning) and the step's scalars are logged; the run stops with the rollout's error at
    the next step (before, the save raised it: the step's checkpoint and scalars were
    lost)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import Logger

    class Steps(Logger):
        name, version = "steps", 0

        def __init__(self) -> None:
            super().__init__()
            self.steps = set()

        def log_hyperparams(self, params, *args, **kwargs) -> None:
            pass

        def log_metrics(self, metrics, step=None) -> None:
            if any(k.startswith("train/") for k in metrics):
                self.steps.add(step)

    logger = Steps()
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1,
                            filename="{step}")
    module = make_module(cache_dir, engine=FailsOnce, max_staleness=1,
                         sampler_correction="token_tis",
                         rewards={"tests.conftest:alternating": 1.0},
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(RuntimeError, match="the server died"):
        fit(module, make_data(cache_dir), steps=6, tmp_path=tmp_path, enable_checkpointing=True,
            callbacks=[saver], logger=logger, log_every_n_steps=1)
    saved = sorted(int(p.stem.split("=")[1]) for p in tmp_path.glob("step=*.ckpt"))
    assert saved == sorted(logger.steps) == [1, 2]
    last = torch.load(tmp_path / "step=2.ckpt", weights_only=False)
    assert last["maxent_grpo_rollouts"] == [[]] and last["maxent_grpo_rollouts_dropped"] == [1]
    resumed = async_module(cache_dir, 1)  # the servers back: the run goes on from there
    trainer = fit(resumed, make_data(cache_dir), steps=4, ckpt_path=str(tmp_path / "step=2.ckpt"))
    assert trainer.global_step == 4


def test_a_rollout_failing_in_flight_before_a_validation_still_lets_it_save(cache_dir, tmp_path,
                                                                           caplog):
    """The rollout in flight at a validation's start failed: the validation runs and its
    checkpoint is saved without that rollout; the next step raises the error (before, the
    validation's start raised it and the checkpoint was lost)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    class FailsSecond(FailsOnce):
        at = 2  # batch 2's (step 1's) submit: in flight when the validation after it starts

    saver = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{step}")
    module = make_module(cache_dir, engine=FailsSecond, max_staleness=1,
                         sampler_correction="token_tis",
                         rewards={"tests.conftest:alternating": 1.0},
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(RuntimeError, match="the server died"), caplog.at_level("WARNING"):
        fit(module, make_data(cache_dir), steps=6, tmp_path=tmp_path, enable_checkpointing=True,
            callbacks=[saver], val_check_interval=2, limit_val_batches=1,
            num_sanity_val_steps=0)
    assert "failed (RuntimeError: the server died): the validation runs" in caplog.text
    saved = torch.load(tmp_path / "step=1.ckpt", weights_only=False)
    assert saved["maxent_grpo_rollouts_dropped"] == [1]
    assert module.global_step == 1
