"""The logged record of a training step: torchmetrics in, :class:`LogStepArtifacts` out.

During a step, :class:`StepMetrics` accumulates the step's statistics in torchmetrics
(sums, so exact over micro-batches and ranks): the rewards and their components, the token
counts, and token-weighted means of everything the objective's loss reports (KL, entropy,
clip fractions, loss parts). After the optimizer step(s) it builds the documented
:class:`LogStepArtifacts`, whose ``as_dict()`` (``train/...`` names, listed in
docs/LOGGING.md) a ``MetricWriter`` logs, and resets. NaN means "not measured this step"
and is not logged.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import statistics
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torchmetrics.aggregation import MaxMetric

from maxent_grpo.core.advantages import answer_entropy
from maxent_grpo.rollout.toolcall import FAILURE_KINDS
from maxent_grpo.training.step.metrics import (
    RewardComponentsMetric,
    RewardMomentsMetric,
    TokenMean,
    TokenUsageMetric,
    all_gather_objects,
)
from maxent_grpo.training.types import (
    LoggingConfigView,
    LogStepArtifacts,
    LossScalarBundle,
    TrainingScalarStats,
)
from maxent_grpo.validation import UserCodeError, check_int, check_number

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from maxent_grpo.rollout import RolloutOutput
    from maxent_grpo.rollout.protocol import ToolUsage
    from maxent_grpo.training.settings import EvaluationSettings
    from maxent_grpo.training.step.trajectory import Trajectory


#: names the trainer logs under ``train/`` itself: an objective's statistic of such a name
#: was averaged into the trainer's value or replaced it, without a word (objective_values)
TRAINER_PREFIXES = ("reward/", "reward_log/", "tokens/", "logp/", "rollout/", "tools/",
                    "env/", "perf/", "entropy_bonus/", "entropy/")
TRAINER_NAMES = frozenset({"loss/total", "loss/kl", "loss/weighted_kl", "lr", "lr_warmup",
                           "grad_norm", "grad_clipped", "answer_entropy", "distinct_correct",
                           "epoch_progress", "nonfinite_skips", "dropped_groups",
                           "empty_steps", "refill_rounds", "beta", "tau"})


def objective_values(owner: str, values: Any, *, pairs: bool,
                     taken: Iterable[str] = ()) -> dict[str, Any]:
    """An objective's logged values (``Targets.stats``: a 0-d tensor or a number each;
    ``LossOutput.sums``, ``pairs``: a ``(sum, count)`` pair each), numbers as tensors;
    UserCodeError naming ``owner`` (``MyObjective.prepare: Targets.stats``) and the key for
    a name the trainer logs itself (or ``taken``: the objective's ``state()``, logged too),
    or a value of another kind (each crashed deep in the step as "a bug", or logged a
    plausible wrong value)."""
    reserved = TRAINER_NAMES | set(taken)
    if not isinstance(values, dict):
        raise UserCodeError(f"{owner} must be a dict; got {type(values).__name__}")

    def scalar(v: Any) -> Any:  # a number as a float64 tensor; None: neither
        if isinstance(v, torch.Tensor):
            return v if v.dim() == 0 and v.dtype != torch.bool and not v.is_complex() else None
        real = isinstance(v, numbers.Real) and not isinstance(v, bool)  # NaN too
        return torch.tensor(float(v), dtype=torch.float64) if real else None

    out = {}
    for key, value in values.items():
        if not isinstance(key, str) or key in reserved or key.startswith(TRAINER_PREFIXES):
            raise UserCodeError(
                f"{owner}[{key!r}]: the trainer logs train/{key} itself, so the two would be "
                f"mixed; give the value another name (not {', '.join(sorted(reserved))}, "
                f"nor one under {', '.join(TRAINER_PREFIXES)})" if isinstance(key, str)
                else f"{owner}: the names must be strings; got {key!r}")
        parts = tuple(value) if pairs and isinstance(value, (tuple, list)) else (value,)
        tensors = [scalar(v) for v in parts]
        if len(parts) != (2 if pairs else 1) or any(t is None for t in tensors):
            got = [f"{tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor)
                   else type(v).__name__ for v in parts]
            kind = "a pair (sum, count) of 0-d tensors or numbers" if pairs else "a 0-d " \
                "tensor or a number"
            raise UserCodeError(f"{owner}[{key!r}] must be {kind}; got {got if pairs else got[0]}")
        out[key] = tuple(tensors) if pairs else tensors[0]
    return out


class LightningWriter:
    """A :class:`~maxent_grpo.training.types.MetricWriter` that logs through the
    LightningModule (``log_dict``) to every configured Lightning logger and
    ``trainer.callback_metrics``; Lightning stamps the step itself, so ``step`` is checked."""

    def __init__(self, module: pl.LightningModule) -> None:
        self.module = module

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if step != self.module.global_step:
            raise ValueError(f"LightningWriter logs at the current step "
                             f"{self.module.global_step}; got step={step}")
        forget_unlogged(self.module)
        self.module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    def flush(self) -> None:
        """Lightning's loggers flush on their own schedule (``trainer.log_every_n_steps``)."""


def forget_unlogged(module: pl.LightningModule) -> None:
    """Lightning writes every per-step value logged earlier in the epoch again at each later
    step, with its last value, until the epoch ends, as if this step had measured it (an
    empty step's KL, a controller that did not act). After each written step (each with
    ``log_every_n_steps: 1``) the per-step tensor values of the training step and
    ``on_train_batch_end`` are forgotten before the step logs: one written was measured since."""
    trainer = getattr(module, "_trainer", None)
    results = getattr(trainer, "_results", None)
    if not hasattr(results, "items") or not trainer.log_every_n_steps or (
            trainer.fit_loop.epoch_loop._batches_that_stepped % trainer.log_every_n_steps
            and not trainer.should_stop):  # (a stop deferred by min_steps writes every step)
        return
    for key, result in results.items():
        meta = getattr(result, "meta", None)
        if (str(key).split(".", 1)[0] in ("training_step", "on_train_batch_end")
                and getattr(result, "is_tensor", False) and getattr(meta, "on_step", False)
                and not getattr(meta, "on_epoch", True)):
            result.reset()


class StepMetrics(torch.nn.Module):
    """The per-step torchmetrics and the record built from them; ``reward_names`` are the
    names of ``model.rewards``, in order; with ``evaluation`` (which reward and threshold
    make a sample correct) the step also logs its answers' spread (:meth:`observe_answers`).
    ``tool_watch`` (:class:`ToolFailureWatch`) warns
    on the console when most recent tool calls fail; :meth:`artifacts` ends its steps."""

    def __init__(self, reward_names: list[str],
                 evaluation: EvaluationSettings | None = None) -> None:
        super().__init__()
        self.evaluation = evaluation
        self.reward = RewardMomentsMetric()
        self.components = RewardComponentsMetric(reward_names)
        self.tokens = TokenUsageMetric()
        self.means = torch.nn.ModuleDict()  # token-weighted means, created on first use
        self.maxima = torch.nn.ModuleDict()  # maxima, created on first use
        self._updated: set[tuple[str, str]] = set()  # ("mean" | "max", key) of this step
        self.tool_watch = ToolFailureWatch()

    def mean(self, key: str) -> TokenMean:
        """The :class:`TokenMean` logged as ``train/<key>`` (created on first use)."""
        self._updated.add(("mean", key))
        return self._metric(self.means, key, TokenMean)

    def maximum(self, key: str) -> MaxMetric:
        """The ``MaxMetric`` logged as ``train/<key>`` (created on first use)."""
        self._updated.add(("max", key))
        return self._metric(self.maxima, key, functools.partial(
            MaxMetric, nan_strategy="disable"))  # the NaN check would sync the host

    def _metric(self, table: torch.nn.ModuleDict, key: str, make: Any) -> Any:
        # ModuleDict keys hold no "/" or ".": escaped one to one (a reward's log_metric
        # names "acc.5" and "acc_5" stay two metrics)
        name = key.replace("_", "_u").replace(".", "_d").replace("/", "_s")
        if name not in table:  # float64 (after .to, which resets it to the default dtype)
            table[name] = make().to(self.reward.total.device).set_dtype(torch.float64)
        return table[name]

    def _aligned(self) -> list[tuple[str, str]]:
        """The metrics this step updated on *any* rank, in one order on every rank.

        ``compute()`` all-gathers a metric's states, and the gathers pair up by call order
        only; a metric that some rank never touched this step (a ghost rank's log-prob gap,
        a key an objective reports only for some data) would pair one rank's metric with
        another's. So the ranks exchange the names (one small all-gather), each creates and
        zero-updates the metrics it lacks (no data: they add nothing), and all compute the
        union in sorted order."""
        parts = all_gather_objects((sorted(self._updated), getattr(self, "_clash", None)))
        if clash := next((c for _, c in parts if c), None):
            self._clash = None
            raise UserCodeError(clash)
        names = {tuple(n) for part, _ in parts for n in part}
        device = self.reward.total.device
        for kind, key in sorted(names - self._updated):
            if kind == "mean":
                self.mean(key).update(torch.zeros((), dtype=torch.float64, device=device),
                                      count=torch.zeros((), dtype=torch.float64, device=device))
            else:
                self.maximum(key).update(torch.tensor(-math.inf, device=device))
        return sorted(names)

    def add(self, key: str, value: Tensor, count: Tensor | float, weight: float = 1.0) -> None:
        """Add a loss statistic's ``(sum, count)``, both times ``weight`` (0 for the ghost
        group), to ``train/<key>``."""
        self.mean(key).update(weight * value.detach().double(),
                              count=weight * torch.as_tensor(count, dtype=torch.float64))

    def observe_answers(self, trajectory: Trajectory) -> None:
        """``train/answer_entropy``: per group, the entropy (nats) of its G samples' answers
        (``Trajectory.answer_keys``: canonical under the rows' ``answer_form`` as coverage@k
        reads them, else with whitespace collapsed; no answer is one more value), and
        ``train/distinct_correct``: per group, the distinct correct answers (eval reward >=
        the threshold); both means over every group of the step, dropped ones included."""
        t, ev = trajectory, self.evaluation
        G = t.rewards.shape[1]
        answers = t.answer_keys
        # the rollout's record on the CPU (already copied there): no second device sync
        judged = t.samples.components[self.components.names[ev.reward_index]].reshape(-1)
        correct = (judged >= ev.correct_threshold).tolist()
        entropy = distinct = 0.0
        groups = len(answers) // G
        for b in range(groups):
            group = answers[b * G:(b + 1) * G]
            entropy += answer_entropy(group)
            distinct += len({a for a, ok in zip(group, correct[b * G:(b + 1) * G], strict=True)
                             if ok and a is not None})
        device = self.reward.total.device
        count = torch.tensor(float(groups), dtype=torch.float64, device=device)
        for key, total in (("answer_entropy", entropy), ("distinct_correct", distinct)):
            self.mean(key).update(torch.tensor(total, dtype=torch.float64, device=device),
                                  count=count)

    def observe_tools(self, rollout: RolloutOutput) -> None:
        """A multi-turn rollout's ``train/tools/...``, over its ``N`` samples (all rows, the
        dropped groups' included): ``calls_per_sample``, ``turns_per_sample``,
        ``message_tokens_per_sample`` (tokens the model did not write), ``success_rate``
        (samples with at least one call that returned), ``failure_rate`` (failed calls /
        calls) and ``failures/<kind>`` (calls failed so / calls); ``tool_watch`` counts
        them too."""
        tools = rollout.tools
        self.tool_watch.add(tools)
        failed = tools.failed
        n, calls = len(tools.messages), tools.calls.sum()
        self.add("tools/calls_per_sample", calls, n)
        self.add("tools/turns_per_sample", tools.turns.sum(), n)
        self.add("tools/message_tokens_per_sample", rollout.tool_mask.sum(), n)
        self.add("tools/success_rate", (tools.calls > failed).sum(), n)
        self.add("tools/failure_rate", failed.sum(), calls)
        for kind, counts in tools.failures.items():
            self.add(f"tools/failures/{kind}", counts.sum(), calls)

    def observe(self, trajectory: Trajectory, objective: Any = None) -> None:
        """Add the step's rollout statistics (its losses came through :meth:`add`); the
        ``objective``'s ``Targets.stats`` checked (:func:`objective_values`)."""
        t = trajectory
        if self.evaluation is not None:
            self.observe_answers(t)
        rollout = t.rollout
        self.reward.update(t.rewards)
        self.components.update(t.components)
        # the tokens the model wrote, those the loss leaves out (truncated rows) included
        self.tokens.update(rollout.prompt_mask, rollout.model_mask, rollout.truncated)
        if t.ref_logps is not None:  # the ghost group's rows do not count
            self.mean("logp/ref_token").update(
                t.ref_logps, torch.zeros_like(t.mask) if t.ghost else t.mask)
        device = self.reward.total.device
        if rollout.tools is not None:
            self.observe_tools(rollout)
        stats = t.targets.stats if objective is None else objective_values(
            f"{type(objective).__name__}.prepare: Targets.stats", t.targets.stats,
            pairs=False, taken=objective.state())
        clash = [key for key in stats if objective is not None and ("mean", key) in self._updated]
        self._clash = clash and (  # raised by every rank in _aligned (one may not see it)
            f"{type(objective).__name__}.prepare: Targets.stats[{clash[0]!r}]: its loss logs "
            f"train/{clash[0]} (LossOutput.sums) already, and the two were averaged together; "
            "name the statistic otherwise")
        for key, value in stats.items():
            self.mean(key).update(value.detach(), count=torch.ones((), device=device))
        for name, value in t.reward_logs:  # a reward function's log_metric: each call once
            self.mean(f"reward_log/{name}").update(
                torch.tensor(value, dtype=torch.float64, device=device), count=1.0)

    def artifacts(
        self, view: LoggingConfigView, *, updates: Sequence[Any], epoch_progress: float,
        latency_ms: float | None, step: int, extra: dict[str, float],
    ) -> LogStepArtifacts:
        """The step's :class:`LogStepArtifacts` (values reduced over ranks), then reset;
        ``updates`` are the rollout's optimizer steps (``optimise.Update``, one per
        ``num_iterations``: ``lr``, ``grad_norm`` and ``grad_clipped`` are their means, as
        the other values are the passes' means; the skipped ones left out), ``latency_ms`` is
        the rollout engine's, ``step`` the optimizer steps taken so far (``lr_warmup``, the
        warm-up's progress, while ``view.schedule.lr_warmup_steps`` runs); ``extra`` are
        further diagnostics (timings, counters) logged as they are.
        Ends the step of ``tool_watch`` (its warning, if any, comes from global rank 0)."""
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.tool_watch.end_step(step, rank_zero=rank == 0)
        means: dict[str, float] = {}
        for kind, key in self._aligned():  # every rank, the same metrics in the same order
            value = float(self.mean(key).compute() if kind == "mean"
                          else self.maximum(key).compute())
            if kind == "mean" or value > -math.inf:  # a maximum of no data is not logged
                means[key] = value
        nan = math.nan
        kl = means.pop("kl", nan)
        weighting = view.weighting.state()  # tau, beta, ... as the step used them
        losses = LossScalarBundle(
            total_loss=means.pop("loss/total", nan),
            policy_loss=means.pop("loss/policy", nan),
            clip_loss=means.pop("loss/clip", None),
            kl_loss=kl,
            weighted_kl_loss=kl * view.weighting.kl_weight(),
        )
        h, h2 = means.pop("entropy/sequence", None), means.pop("entropy/sequence_sq", None)
        alpha = weighting.get("alpha")  # the entropy bonus of EntropyMaxEnt
        bonus_std = None
        if alpha is not None and h is not None and h2 is not None:
            bonus_std = alpha * math.sqrt(max(h2 - h * h, 0.0))
        norms = [float(u.grad_norm) for u in updates if u.grad_norm is not None]
        lrs = [u.lr for u in updates if not u.skipped]
        scalars = TrainingScalarStats(
            ref_logp_mean=means.pop("logp/ref_token", nan),
            tokens=self.tokens.summary(),
            current_lr=statistics.fmean(lrs) if lrs else nan,
            grad_norm_scalar=statistics.fmean(norms) if norms else None,
            epoch_progress=epoch_progress,
            vllm_latency_ms=latency_ms,
            policy_entropy=means.pop("entropy", None),
            entropy_bonus_coef=alpha,
            entropy_bonus_reward_std=bonus_std,
        )
        moments = self.reward.summary()  # the documented RewardMoments
        diagnostics: dict[str, Any] = {"reward/mean": moments.mean, "reward/std": moments.std}
        diagnostics.update({f"reward/{k}": float(v) for k, v in self.reward.compute().items()
                            if f"reward/{k}" not in diagnostics})
        for name, stats in self.components.summaries().items():  # RewardComponentStats
            diagnostics[f"reward/{name}/mean"] = stats.mean
            diagnostics[f"reward/{name}/std"] = stats.std
        diagnostics.update(means)
        diagnostics["kl"] = kl
        tokens = {k: float(v) for k, v in self.tokens.compute().items()}
        logged = scalars.as_dict()
        diagnostics["tokens"] = {k: v for k, v in tokens.items()  # the rest of the counts
                                 if f"tokens/{k}" not in logged}
        diagnostics.update(logged)
        diagnostics.update(weighting)
        if view.clipping is not None and norms:  # the fraction of the passes clipped
            diagnostics["grad_clipped"] = statistics.fmean(n > view.clipping for n in norms)
        warmup = view.schedule.lr_warmup_steps
        if warmup and step <= warmup:  # the warm-up's progress, while it runs
            diagnostics["lr_warmup"] = step / warmup
        diagnostics.update(extra)
        artifacts = LogStepArtifacts(
            loss_outputs=losses,
            diagnostics=diagnostics,  # as_dict leaves out what was not measured
            grad_norm_scalar=scalars.grad_norm_scalar,
            epoch_progress=scalars.epoch_progress,
        )
        for metric in [self.reward, self.components, self.tokens, *self.means.values(),
                       *self.maxima.values()]:
            metric.reset()
        self._updated.clear()
        return artifacts


log = logging.getLogger(__name__)

#: failure kind -> the words the warning uses for it
FAILURE_NAMES = {"malformed": "malformed call", "unknown_tool": "unknown tool",
                 "bad_arguments": "bad arguments", "error": "tool error",
                 "timeout": "time-out", "over_limit": "calls past model.max_tool_calls"}

#: failure kind -> what the warning suggests
FAILURE_HINTS = {
    "malformed": "The model's <tool_call> blocks are not JSON objects with a \"name\" (the "
                 "call format is in maxent_grpo/rollout/toolcall.py); a model never taught "
                 "that format writes such calls: start from one that was (the tiny tool demos "
                 "start from builtin:tiny-tools-warm)",
    "unknown_tool": "The model calls tools that model.tools does not hold; check the names "
                    "in model.tools against the ones the prompts show",
    "bad_arguments": "The calls' arguments do not match the tools' signatures (missing, "
                     "extra or mistyped arguments)",
    "error": "The tools (or the environment's step) raise, or their sandbox fails; the "
             "logged samples (CompletionSamples) show the error messages the model reads",
    "timeout": "The calls (or environment steps) run past model.tool_timeout seconds: raise "
               "it, or make the tool faster",
    "over_limit": "The model writes more tool calls per sample than model.max_tool_calls "
                  "runs: raise it, or teach fewer calls",
}


class ToolFailureWatch:
    """Warns once per failure kind when most recent tool calls fail, naming how they fail
    (docs/TOOLS.md): otherwise a run whose calls all time out, or whose model writes no
    readable call, shows nothing but a reward near 0.

    At the end of a step, when the tool calls (or environment steps) of the last ``window``
    steps (fewer at the start of a run) number at least ``min_calls`` and more than
    ``threshold`` of them failed, one warning (logger ``maxent_grpo.training.step.step_log``)
    names the kind (:data:`~maxent_grpo.rollout.toolcall.FAILURE_KINDS`) with the most
    failures over the window, every kind's share and what to change. A kind already named in
    this run is not named again (each kind has its own remedy). The counts are this
    process's own rollouts; only global rank 0 warns. :class:`StepMetrics` feeds it.

    Args:
        window: the steps whose calls are added up (>= 1).
        threshold: warn when more than this share of those calls failed (0 to 1).
        min_calls: fewer calls over the window never warn (>= 1), so that a step with
            one failed call of one does not.
    """

    def __init__(self, window: int = 5, threshold: float = 0.5, min_calls: int = 4) -> None:
        check_int("window", window, minimum=1)
        check_number("threshold", threshold, minimum=0, maximum=1)
        check_int("min_calls", min_calls, minimum=1)
        self.window, self.threshold, self.min_calls = window, threshold, min_calls
        self.steps: deque[tuple[int, dict[str, int]]] = deque(maxlen=window)
        self.warned: set[str] = set()  # the kinds already named in this run
        self._calls, self._failures = 0, dict.fromkeys(FAILURE_KINDS, 0)

    def add(self, tools: ToolUsage) -> None:
        """Count a rollout's calls and failures into the current step."""
        self._calls += int(tools.calls.sum())
        for kind, counts in tools.failures.items():
            self._failures[kind] = self._failures.get(kind, 0) + int(counts.sum())

    def end_step(self, step: int, rank_zero: bool = True) -> str | None:
        """Close the current step (its counts join the window) and return the warning's text
        when it warns (logged when ``rank_zero``), else None."""
        self.steps.append((self._calls, self._failures))
        self._calls, self._failures = 0, dict.fromkeys(FAILURE_KINDS, 0)
        calls = sum(c for c, _ in self.steps)
        failures = Counter(dict.fromkeys(FAILURE_KINDS, 0))  # FAILURE_KINDS' order first
        for _, counts in self.steps:
            failures.update(counts)
        failed = sum(failures.values())
        if calls < self.min_calls or failed <= self.threshold * calls:
            return None
        kind = max(failures, key=failures.__getitem__)  # ties: the first in FAILURE_KINDS
        if kind in self.warned:
            return None
        self.warned.add(kind)
        shares = ", ".join(f"{FAILURE_NAMES.get(k, k)} {n / calls:.0%}"
                           for k, n in failures.items() if n)
        text = (f"most tool calls fail: {failed} of the {calls} calls of the last "
                f"{len(self.steps)} step(s) up to step {step} failed, most by "
                f"{FAILURE_NAMES.get(kind, kind)} (train/tools/failures/{kind}; {shares}). "
                f"{FAILURE_HINTS.get(kind, '')}. This warning is not repeated for this kind.")
        if rank_zero:
            log.warning("%s", text)
        return text
