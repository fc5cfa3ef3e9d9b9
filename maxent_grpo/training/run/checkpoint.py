"""What a checkpoint carries besides Lightning's own state: exact resume of a training run.

The module adds one entry, ``checkpoint["maxent_grpo"]``:

- ``model_name_or_path`` and ``objective_class``, checked on load, and ``model_folder``,
  the real path of a model given as a local folder (None otherwise), so that the same
  folder written another way (``../m/`` and ``/abs/m``, or from another working folder)
  is the same model, and ``model_fingerprint`` (:func:`~maxent_grpo.models.model_fingerprint`),
  so that the folder moved, copied or mounted elsewhere is too;
- ``peft``: the ``model.peft`` config as plain values (:func:`~maxent_grpo.adapters.peft_record`;
  None without adapters), which the saved hyper-parameters leave out: ``python -m
  maxent_grpo.cli.export`` rebuilds the adapters from it;
- ``objective_state``: ``Objective.state_dict`` (tau, beta, the entropy gate's multiplier)
  and ``objective_start``, the same as the run's config set it;
- the :class:`~maxent_grpo.training.step.optimise.StepCounters`;
- ``rng``: every rank's random state (torch, CUDA when initialised, python, numpy);
- ``controllers``: the run's controller state file and meta-controller
  (``LoopSettings.controller`` and ``controller_meta_manager``), so that a resume without
  the controllers that moved tau and beta is warned about;
- ``seed``: the run's ``seed_everything`` (:func:`run_seed`), which a resume given another
  records in place of it (:func:`keep_seed`).
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from maxent_grpo.adapters import check_older_adapters, check_saved_adapters, peft_record
from maxent_grpo.models import model_fingerprint, model_folder, same_model
from maxent_grpo.objectives import Objective
from maxent_grpo.training.run.folders import OBJECTIVE_KEY
from maxent_grpo.training.settings import check_resumed_schedule
from maxent_grpo.training.step.metrics import all_gather_objects
from maxent_grpo.training.step.optimise import StepCounters
from maxent_grpo.training.types import LoopSettings
from maxent_grpo.validation import require

#: Key of the module's own entry in a Lightning checkpoint.
CHECKPOINT_KEY = "maxent_grpo"
EPOCH_KEY = "maxent_grpo_epoch"  #: the fit's fractional epoch (TrainerState.epoch) at the save


def capture_rng_state() -> dict[str, Any]:
    """This process's random state: torch CPU (and CUDA when initialised), python, numpy, as
    plain types and tensors (loadable with ``torch.load(weights_only=True)``)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = (kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached))
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def step_start(restore: dict[str, Any] | None, trainer: Any) -> dict[str, Any]:
    """At a training batch's start: with ``restore`` (a resumed fit's first batch), the
    random state of the checkpoint (:func:`restore_rng_state`) and the logging step
    (:func:`realign_log_step`). Returns the random state and the global step then, which a
    checkpoint written before the step finished saves (:func:`save_state`)."""
    if restore is not None:
        restore_rng_state(restore)
        realign_log_step(trainer)
    return {"rng": capture_rng_state(), "global_step": getattr(trainer, "global_step", None)}


def _fit_loop(checkpoint: dict) -> dict:
    """Lightning's fit-loop state in ``checkpoint`` (``{}`` where it has none)."""
    return (checkpoint.get("loops") or {}).get("fit_loop") or {}


def fit_batches(checkpoint: dict) -> int | None:
    """The training batches the fit that saved ``checkpoint`` had run (Lightning's loop
    state); None where it is not recorded."""
    progress = _fit_loop(checkpoint).get("epoch_loop.batch_progress") or {}
    batches = (progress.get("total") or {}).get("processed")
    return batches if isinstance(batches, int) else None


def count_cut_batch_once(checkpoint: dict[str, Any]) -> None:
    """A checkpoint saved in mid-batch (Ctrl-C or an error with ``save_on_exception``)
    counts the cut batch as started in Lightning's run totals; Lightning runs it again from
    its start but takes it back from the epoch's count only, so the run's batch index, which
    places validation with ``check_val_every_n_epoch: null``, stayed one ahead for the rest
    of the run (validation a step early, once more for each such resume). The totals are
    set back to the batches the fit finished."""
    progress = _fit_loop(checkpoint).get("epoch_loop.batch_progress") or {}
    try:
        current, total = progress["current"], progress["total"]
        done = int(current["processed"])  # the cut batch's step did not finish
        if int(current["ready"]) > done:  # started: only once its start hooks had run
            total["ready"] -= int(current["ready"]) - done
            total["started"] -= int(current["started"]) - done
    except (KeyError, TypeError, ValueError):
        return


def resume_where_stopped(checkpoint: dict[str, Any], trainer: Any) -> bool:
    """Make a checkpoint written after its fit's last training batch resume where the fit
    stopped; returns whether it changed the checkpoint's loop state.

    Lightning continued some of these inexactly: a fit that ``max_steps`` stopped in
    mid-epoch, continued with a higher ``max_steps``, began the next epoch's order and never
    trained the rest of this one (Lightning had counted the epoch as ended); one stopped at
    the epoch's last batch began the next epoch at that batch's index (that epoch ended
    after one batch), and so did one resumed with more batches per epoch (another batch size
    or number of processes); a checkpoint of ``on_train_epoch_end`` ran the ended epoch
    again from its last batch. From the DataModule's position (its entry in ``checkpoint``),
    which must count the batches Lightning completed: in mid-epoch the loop state becomes
    the one written at the last batch's end (``ModelCheckpoint``'s form in mid-epoch, which
    Lightning continues exactly); after the epoch's last batch, the one of the next epoch's
    start. Anything else is left as it is."""
    from maxent_grpo.training.data.sampler import epoch_positions

    datamodule = getattr(trainer, "datamodule", None)
    state = checkpoint.get(type(datamodule).__qualname__) if datamodule is not None else None
    loop = _fit_loop(checkpoint)
    epochs, batches = loop.get("epoch_progress"), loop.get("epoch_loop.batch_progress")
    steps = loop.get("epoch_loop.state_dict") or {}
    try:
        epoch, current, ranks = int(state["epoch"]), batches["current"], int(state["world_size"])
        done, per_batch = int(current["completed"]), int(state["batch_size"]) * ranks
        handed = int(state["consumed"]) // per_batch
        whole = epoch_positions(int(state["num_rows"]), int(state["batch_size"]), ranks)
        ended = epochs["current"]["processed"] == epochs["current"]["ready"] == epoch + 1
        # the epoch's every batch handed over, or the last the loader gave (a
        # limit_train_batches) whose step finished
        finished = int(state["consumed"]) >= whole or (
            batches.get("is_last_batch") is True and current["ready"] == current["processed"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return False
    if not (current["processed"] == handed >= 1 and done in (handed, handed - 1)
            and (ended or finished) and "_batches_that_stepped" in steps):
        return False
    if finished:  # the next epoch from its first batch
        for part in ("total", "current"):
            epochs[part].update({key: epoch + 1 for key in epochs[part]})
        total = batches["total"]  # every batch finished (not one to complete at the restart)
        total.update({key: total["processed"] for key in total})
        current.update({key: 0 for key in current})
        checkpoint["epoch"] = epoch + 1
    else:  # this epoch's last batch's end
        for part in ("total", "current"):
            epochs[part]["processed"] -= 1
            epochs[part]["completed"] = epochs[part]["processed"]
            batches[part]["completed"] = batches[part]["processed"] - 1
        steps["_batches_that_stepped"] -= 1
        checkpoint["epoch"] = epoch
    batches["is_last_batch"] = False
    return True


def realign_log_step(trainer: Any) -> bool:
    """Set the step Lightning writes every logged scalar at (``_batches_that_stepped`` of
    the epoch loop) to the training batches completed, as in a run never interrupted;
    returns whether it was off.

    Lightning 2.6 restores that count and then corrects it by the stage its progress
    counters show, assuming the checkpoint was written before the count was raised for the
    batch (ModelCheckpoint's saves at a batch's or a validation's end). A checkpoint written
    after it was raised, by ``ModelCheckpoint(save_on_exception=True)`` after a SIGTERM at a
    step that also ran validation, got one step more, and every later scalar was written one
    step late. Under manual optimisation every completed batch raises the count once, so
    the batches completed are the count. A Lightning without these attributes is left as
    it is."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    total = getattr(getattr(loop, "batch_progress", None), "total", None)
    stepped, completed = getattr(loop, "_batches_that_stepped", None), getattr(
        total, "completed", None)
    if not (isinstance(stepped, int) and isinstance(completed, int)) or stepped == completed:
        return False
    loop._batches_that_stepped = completed
    return True


def _controllers(loop: LoopSettings | None) -> dict[str, Any]:
    """The record of the run's controllers (None paths and ``attached`` False without any)."""
    paths = None if loop is None else loop.controller
    meta = None if loop is None else loop.controller_meta_manager
    return {"state_path": None if paths is None else paths.state_path,
            "attached": loop is not None and loop.controller_objective is not None,
            "meta_manager": None if meta is None else type(meta).__name__}


def save_state(
    checkpoint: dict[str, Any], model_name_or_path: str, objective: Objective,
    counters: StepCounters, loop: LoopSettings | None = None, peft: Any = None,
    cut_short: dict[str, Any] | None = None, start: dict[str, float] | None = None,
) -> None:
    """Write the module's entry (see the module docstring); ``peft`` is ``model.peft``,
    ``start`` the objective's state as the config set it (default: now). Lightning calls the
    module's ``on_save_checkpoint`` on every rank, so the random states are gathered here.
    ``cut_short``: :func:`step_start` of a training step an exception stopped (Ctrl-C,
    ``save_on_exception``), which Lightning runs again at the resume: its random state is saved,
    so the step runs as it would have, unless the step had already updated the weights (warned:
    that batch is trained twice)."""
    if cut_short is not None and cut_short["global_step"] != checkpoint.get("global_step"):
        rank_zero_warn("this checkpoint was written after the optimizer update of a training "
                       "step an exception stopped: the resume trains that batch again (it "
                       "is not the run an uninterrupted fit would have made)")
    checkpoint[CHECKPOINT_KEY] = {
        "model_name_or_path": model_name_or_path,
        "model_folder": (folder := model_folder(model_name_or_path)),
        "model_fingerprint": model_fingerprint(folder),
        "objective_class": type(objective).__name__,
        "peft": peft_record(peft),
        "objective_state": objective.state_dict(),
        "objective_start": objective.state_dict() if start is None else start,
        **asdict(counters),
        "rng": all_gather_objects(capture_rng_state() if cut_short is None
                                  else cut_short["rng"]),
        "controllers": _controllers(loop),
        "seed": run_seed(),
    }


SEED_ENV = "MAXENT_GRPO_RUN_SEED"  #: a CLI run's seed for its launched processes (cli/seeds)


def run_seed() -> int | bool:
    """The run's ``seed_everything`` (Lightning's ``PL_GLOBAL_SEED``); False when unseeded:
    a resume continues the checkpoint's random state, and is told when given another."""
    seed = os.environ.get("PL_GLOBAL_SEED")
    return int(seed) if seed is not None and seed.lstrip("-").isdigit() else False


def keep_seed(seed: int | bool | None, config: Any, drawn: bool = False) -> None:
    """A fit resumed with another ``seed_everything`` than its run's ``seed`` (None: not
    recorded): the resume continues the checkpoint's random state, so the seed changed
    nothing but the config.yaml saved with the logs, which then named a seed that did not
    make the run (a hunt). The run's seed is recorded and set in its place, with a warning
    unless this one was ``true``'s draw (the same command resumed, a SLURM requeue)."""
    given = config.get("seed_everything")
    if seed is None or (type(given) is int and given == seed) or (
            seed is False and given in (None, False)):
        return
    if not drawn:
        was = "not seeded" if seed is False else f"seeded with {seed}"
        rank_zero_warn(
            f"the checkpoint's run was {was}: a resume continues its random state, so "
            f"seed_everything {given} changes nothing; the run's seed is kept (and recorded "
            "with the logs). To train with another seed, start a new run from the "
            "checkpoint's weights (maxent-grpo export, then --model.model_name_or_path)")
    config["seed_everything"] = seed
    os.environ[SEED_ENV] = "none" if seed is False else str(seed)  # the launched processes'
    if seed is False:
        os.environ.pop("PL_GLOBAL_SEED", None)  # the later checkpoints record it unseeded
        return
    from lightning.pytorch import seed_everything

    seed_everything(seed, workers=True, verbose=False)


def load_state(
    checkpoint: dict[str, Any], model_name_or_path: str, objective: Objective,
    counters: StepCounters, loop: LoopSettings | None = None, fitting: bool = False,
    peft: Any = None, trainer: Any = None, optimizer: Any = None, reference: bool = True,
    scheduler: Any = None,
) -> dict[str, Any] | None:
    """Check that the checkpoint fits this run; when ``fitting``, restore the objective's
    state (winning over the config and a controller's file) and the counters, and return
    this rank's random state (the caller restores it before the first training batch);
    otherwise (validate, test, predict, ``load_from_checkpoint``) return None and restore
    none of them: the checkpoint gives the weights, and a later fit starts as configured.
    ``trainer``'s ``fit`` is ``fitting``; its ``validate`` or ``test`` logs at the step of
    the fit that wrote the checkpoint's weights' training scalars (not at 0): evaluations
    of several checkpoints line up with the fit's curves.

    Raises ValueError naming the option when the checkpoint was made with another
    ``model.model_name_or_path``, another objective class, or adapters its weights do not
    fit (``model.peft`` set in one and not the other, or another adapter type, rank,
    target modules, layers or saved modules: ``adapters.ADAPTER_SHAPE``). When ``fitting``,
    controllers the checkpoint had and ``loop`` lacks, and changed options, are warned of
    (:func:`_check_optimizer`: ``model.optimizer`` ``optimizer``; ``check_resumed_schedule``:
    ``model.lr_scheduler`` ``scheduler``; ``reference``: whether a reference model loaded).
    """
    fitting = fitting or getattr(getattr(trainer, "state", None), "fn", None) == "fit"
    epochs = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if trainer is not None and trainer.state.fn in ("validate", "test"):
        batches = fit_batches(checkpoint)
        if batches is not None and batches > 0:  # the fit's last batch's scalars' step
            epochs.evaluated_at = batches - 1  # ModuleHooks logs there (_evaluated_at)
    if epochs is not None and trainer.state.fn in ("validate", "test", "predict"):
        epochs.evaluated = (checkpoint.get("global_step"),  # the rewards' step and epoch
                            checkpoint.get(EPOCH_KEY, checkpoint.get("epoch")))
    saved = checkpoint.get(CHECKPOINT_KEY)
    require(isinstance(saved, dict),
            f"the checkpoint has no {CHECKPOINT_KEY!r} entry: it was not written by "
            "MaxEntGRPOModule.on_save_checkpoint, so the objective's state and the random "
            "state cannot be restored; resume from a checkpoint of this trainer")
    same = same_model(saved, model_name_or_path)
    require(same is not None, "the checkpoint was made with model.model_name_or_path="
            f"{saved['model_name_or_path']!r}, but this run has {model_name_or_path!r}"
            + ("" if saved.get("model_fingerprint") or saved.get("model_folder") is None else
               " (this checkpoint predates the record of a folder's files, by which a folder "
               "that moved is known: give its old path, a link to the new place)"))
    if same == "moved":
        rank_zero_warn(f"the checkpoint's model folder {saved.get('model_folder')} is "
                       f"{model_name_or_path} now (the same config and weights files)")
    name = type(objective).__name__
    require(saved["objective_class"] == name,
            f"the checkpoint was made with model.objective {saved['objective_class']}, "
            f"but this run has {name}; " + ("resume with the same objective class_path"
                                           if fitting else "use the config the fit ran with")
            + f" (in Python: objective={saved['objective_class']}(...), which "
            "load_from_checkpoint also takes)")
    if "peft" in saved:  # checkpoints from before the record have none: their weights tell
        check_saved_adapters(saved["peft"], peft, fitting)
    else:
        check_older_adapters(checkpoint.get("state_dict") or {}, peft)
    if not fitting:  # evaluated, or load_from_checkpoint: a later fit starts as configured
        if trainer is None:
            _warn_unlike_the_run(checkpoint.get(OBJECTIVE_KEY), objective)
        return None
    before, now = saved.get("controllers") or {}, _controllers(loop)
    if before.get("attached") and not now["attached"]:
        rank_zero_warn(
            f"the checkpoint was trained with tau/beta controllers "
            f"({before.get('meta_manager') or 'TauController/BetaController'}, state file "
            f"{before.get('state_path')!r}); this run has none, so tau and beta stay at the "
            "checkpoint's values: add the same trainer.callbacks to keep them moving")
    objective.load_state_dict(_objective_state(saved, objective, before["attached"] if before
                                               else now["attached"], reference))
    if optimizer is not None and checkpoint.get("optimizer_states"):
        _check_optimizer(checkpoint, optimizer)
    schedule = None if loop is None else loop.optimization.schedule
    if schedule is not None and checkpoint.get("lr_schedulers"):
        check_resumed_schedule(checkpoint["lr_schedulers"][0], schedule, scheduler)
    counters.nonfinite_in_a_row = int(saved["nonfinite_in_a_row"])
    counters.nonfinite_total = int(saved["nonfinite_total"])
    counters.empty_steps = int(saved.get("empty_steps", 0))
    states = saved["rng"]
    dist = torch.distributed
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    if len(states) != world:
        rank_zero_warn(
            f"the checkpoint holds the random state of {len(states)} processes, this run "
            f"has {world}: every process continues from process 0's state, so sampling "
            "will not repeat the interrupted run exactly"
        )
        rank = 0
    return states[rank]


def _warn_unlike_the_run(record: dict[str, Any] | None, objective: Objective) -> None:
    """``load_from_checkpoint`` builds the module from its saved hyper-parameters, which
    leave the objective out (an object): the options of an objective given to it (or of the
    default GRPO) that differ from the command-line run's record are warned of."""
    args = dict((record or {}).get("init_args") or {})
    if "epsilon_high" in args and args["epsilon_high"] is None:  # kept as epsilon
        args["epsilon_high"] = args.get("epsilon")
    differ = [f"{k} {getattr(objective, k)!r} (the run's {v!r})" for k, v in args.items()
              if hasattr(objective, k) and getattr(objective, k) != (
                  list(v) if isinstance(getattr(objective, k), list) else v)]
    if differ:
        name = type(objective).__name__
        rank_zero_warn(f"load_from_checkpoint: the objective differs from the one the "
                       f"checkpoint's run trained with ({', '.join(differ)}); the objective "
                       f"is not a saved hyper-parameter: pass objective={name}(...) with the "
                       "run's options to train on as it did")


def _objective_state(entry: dict[str, Any], objective: Objective, controllers: bool,
                     reference: bool) -> dict[str, float]:
    """The objective state a fit resumes with: the checkpoint's (moved by controllers, a
    callback, or the objective: ``EntropyMaxEnt``'s gate), except, with no controller
    attached then (or now, for a checkpoint without the record), the :attr:`~Objective.tunable`
    values the config changed from the checkpoint run's ``objective_start`` (or its state),
    warned of: the reference model was loaded for the config's beta. A checkpoint's beta > 0
    kept where this run loaded no reference model is refused."""
    saved = entry["objective_state"]
    start = {**saved, **(entry.get("objective_start") or {})}
    config = {k: v for k, v in objective.state_dict().items() if k in objective.tunable}
    changed = {k: v for k, v in config.items() if k in saved and start[k] != v != saved[k]}
    if controllers or not changed:
        require(reference or saved.get("beta", 0) == 0,
                f"the checkpoint's beta {saved.get('beta', 0):g} goes on (moved by tau/beta "
                "controllers or a callback), but this run loaded no reference model "
                "(model.objective.beta 0): resume with the checkpoint's beta, or start afresh")
        if changed:
            rank_zero_info("model.objective's %s (the config) not used: tau/beta controllers "
                           "are attached, so the checkpoint's values go on (%s)", ", ".join(
                               f"{k} {v:g}" for k, v in changed.items()),
                           ", ".join(f"{k} {saved[k]:g}" for k in changed))
        return saved
    pairs = ", ".join(f"{k} {saved[k]:g} -> {v:g}" for k, v in changed.items())
    rank_zero_warn(f"model.objective differs from the checkpoint's ({pairs}): the config's "
                   "values are used from here on")
    return {**saved, **changed}


def _check_optimizer(checkpoint: dict[str, Any], factory: Any) -> None:
    """Refuse a resume whose ``model.optimizer`` takes other settings than the checkpoint's
    optimizer (another class: its state would not load, or fail at the first step), and
    warn of changed values (``lr``, ``weight_decay``, ...): Lightning restores the
    optimizer and its learning-rate schedule, so the config's values are not used."""
    try:
        group = factory([torch.zeros(1, requires_grad=True)]).param_groups[0]
    except Exception:  # noqa: BLE001 -- a factory that wants the real parameters: not checked
        return
    saved = checkpoint["optimizer_states"][0]["param_groups"][0]
    old = {k: v for k, v in saved.items() if k not in ("params", "lr")}
    new = {k: v for k, v in group.items() if k not in ("params", "lr")}
    old["lr"], new["lr"] = old.pop("initial_lr", saved.get("lr")), group["lr"]
    schedulers = [state for top in checkpoint.get("lr_schedulers") or []
                  for state in (top, *top.get("_schedulers", []))]  # SequentialLR's parts
    cyclic = "max_lr" in old or any("max_lrs" in state for state in schedulers)
    moved = ["lr"] * cyclic + ["betas", "momentum"] * ("base_momentum" in old)
    for key in moved:  # OneCycleLR, CyclicLR set these in the optimizer themselves
        old.pop(key, None)
        new.pop(key, None)
    require(not (set(old) - set(new) and set(new) - set(old)),  # a torch release adds some
            f"model.optimizer takes other settings ({sorted(new)}) than the checkpoint's "
            f"optimizer ({sorted(old)}): another optimizer cannot resume its state; resume "
            "with the optimizer the checkpoint was trained with, or start afresh")
    changed = [f"{k} {old[k]!r} -> {new[k]!r}" for k in sorted(set(new) & set(old))
               if old[k] != new[k]]
    if changed:
        rank_zero_warn(f"model.optimizer differs from the checkpoint's ({', '.join(changed)}): "
                       "a resume restores the checkpoint's optimizer and learning-rate "
                       "schedule, so the config's values are not used; start afresh to use "
                       "them")
