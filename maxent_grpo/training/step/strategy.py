"""What differs between Lightning strategies, in one place (docs/SCALING.md, "Strategies and
manual optimisation"): FSDP1 is refused and DeepSpeed clips inside its engine, with one
backward pass per step (:func:`check_strategy`); under ``ModelParallelStrategy`` (FSDP2)
:func:`fully_shard_models` shards the policy and the reference; DDP needs nothing here.
Also what a ``fit`` checks as it attaches the module (:func:`attach_for_fit`).
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import (
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    Strategy,
)
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.utilities import rank_zero_only

from maxent_grpo.validation import require, unwritable

if TYPE_CHECKING:
    from maxent_grpo.training.types import BatchingSettings


def check_strategy(strategy: Strategy, gradient_clip_val: float | None,
                   batching: BatchingSettings | None = None) -> None:
    """Refuse FSDP1; hand the clipping norm to DeepSpeed (ValueError on a conflict), and
    refuse DeepSpeed with micro-batch limits in ``batching`` (``model.micro_batch_groups``
    or ``model.micro_batch_tokens`` set: a step could take several backward passes)."""
    require(not isinstance(strategy, FSDPStrategy),
            "trainer.strategy FSDPStrategy (FSDP1) cannot run MaxEntGRPOModule: its manual "
            "backward passes run inside the root FSDP forward, which FSDP1 does not "
            "support; use class_path lightning.pytorch.strategies.ModelParallelStrategy "
            "with init_args {data_parallel_size: <number of processes>, "
            "tensor_parallel_size: 1} (FSDP2, see configs/scaling/node8_fsdp_*.yaml)")
    if isinstance(strategy, DeepSpeedStrategy):
        require(batching is None or (batching.logprob_chunk_size is None
                                     and batching.score_slice is None),
                "model.micro_batch_groups / model.micro_batch_tokens split a step into "
                "several backward passes, which DeepSpeed does not accumulate here; set both "
                "to null under DeepSpeedStrategy")
        clip = float(gradient_clip_val or 0.0)
        config = strategy.config
        if float(config.get("gradient_clipping", clip)) != clip:
            raise ValueError(
                f"model.gradient_clip_val ({clip}) differs from the DeepSpeed config's "
                f"gradient_clipping ({config['gradient_clipping']}); set one of them"
            )
        config["gradient_clipping"] = clip


def check_launcher(trainer: Any) -> None:
    """Refuse a strategy that spawns its processes (``ddp_spawn``, ``ddp_notebook``): it
    hands each a copy of the module and returns only its weights, not the step counters,
    controllers and objective state a fit moves (the command line checks before the fit,
    whose trainer a spawn could not even pickle)."""
    launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
    require(not isinstance(launcher, _MultiProcessingLauncher),
            f"trainer.strategy {type(trainer.strategy).__name__} with start method "
            f"{getattr(launcher, '_start_method', '?')!r} runs each process on a copy of the "
            "module and sends back only its weights: use strategy ddp (Lightning starts the "
            "processes itself, or run under torchrun; not in a notebook: run a script)")


def warn_lone_local_rank(trainer: Any) -> None:
    """Lightning takes any ``LOCAL_RANK`` for a process that a launcher started and waits
    (30 minutes) for the others: one left in the shell made a run of several processes wait
    without a word. A launcher of one's own sets it the same way, so this warns (the CLI,
    before the wait) rather than refuses."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    environment = getattr(getattr(trainer, "strategy", None), "cluster_environment", None)
    if (getattr(trainer, "world_size", 1) > 1 and isinstance(environment, LightningEnvironment)
            and "LOCAL_RANK" in os.environ and "WORLD_SIZE" not in os.environ):
        logging.getLogger(__name__).warning(
            "LOCAL_RANK=%s is set and WORLD_SIZE is not: Lightning takes this process for "
            "one that a launcher started and waits (up to 30 minutes) for the run's other %d "
            "process(es). If nothing started them (a LOCAL_RANK left from another launch), "
            "stop and unset LOCAL_RANK: Lightning then starts them itself",
            os.environ["LOCAL_RANK"], trainer.world_size - 1)


def check_trainer_flags(trainer: Any, gradient_clip_val: float | None) -> None:
    """Stop, naming this trainer's option, on the Lightning Trainer flags that automatic
    optimisation would honour and this module's own optimizer step cannot: Lightning's
    message ("switch to automatic optimization") names nothing a user of this trainer can
    do; on ``val_check_interval`` 0 (Lightning's modulo by zero); and on a spawning strategy
    (:func:`check_launcher`). Checked when a ``fit`` attaches the module (in each spawned
    process), before Lightning's own check."""
    check_launcher(trainer)
    clip = getattr(trainer, "gradient_clip_val", None)
    require(clip is None or not clip > 0,
            f"Trainer(gradient_clip_val={clip}): this trainer clips in its own optimizer "
            f"step; set --model.gradient_clip_val={clip} (now {gradient_clip_val}; the "
            "default 1.0 already clips) and leave --trainer.gradient_clip_val unset")
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)  # an enum of str
    require(algorithm in (None, "norm"),
            f"Trainer(gradient_clip_algorithm={getattr(algorithm, 'value', algorithm)!r}): "
            "this trainer clips the gradient by its norm, at --model.gradient_clip_val, in its "
            "own optimizer step; it has no clipping by value: leave "
            "--trainer.gradient_clip_algorithm unset")
    every = getattr(trainer, "val_check_interval", None)  # Lightning divides by it
    require(every != 0 or isinstance(every, float) or not trainer.limit_val_batches,
            "trainer.val_check_interval 0: validation every 0 batches; give a count >= 1 or "
            "a fraction of an epoch (for no validation: trainer.limit_val_batches 0)")
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    require(accumulate == 1,
            f"Trainer(accumulate_grad_batches={accumulate}): one training step here is one "
            "rollout of data.batch_size prompts, whose micro-batches already accumulate "
            f"before one optimizer step; for {accumulate}x the prompts per update set "
            f"--data.batch_size to {accumulate}x its value, and bound the memory with "
            "--model.micro_batch_groups (groups per forward/backward) or "
            "--model.micro_batch_tokens; leave --trainer.accumulate_grad_batches at 1")
    from lightning.pytorch.callbacks import GradientAccumulationScheduler as Accumulation
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    for cb in getattr(trainer, "callbacks", []):
        require(not isinstance(cb, Accumulation), "GradientAccumulationScheduler: one "
                "training step here is one rollout, whose micro-batches already accumulate "
                "before one optimizer step; for more prompts per update raise --data.batch_size "
                "(bound the memory with --model.micro_batch_groups or --model.micro_batch_tokens)"
                " and remove the callback")
        require(not isinstance(cb, StochasticWeightAveraging), "StochasticWeightAveraging "
                "would do nothing here (no averaged weights, its learning rate never used): it "
                "copies the module before the policy is built (configure_model), and the "
                "optimizer steps are the module's own; remove the callback (average saved "
                "checkpoints' weights afterwards instead)")


def check_step_multiples(trainer: Any, num_iterations: int) -> None:
    """With ``model.num_iterations`` k > 1 the optimizer-step count moves by k per training
    step: a ``trainer.max_steps`` that is not a multiple of k was overshot (3 ran 4 with k 2)
    and a ``ModelCheckpoint(every_n_train_steps=N)``, which saves when the count is a
    multiple of N, saved every lcm(N, k) steps (N 4, k 3: every 12). Both are refused,
    naming the multiples to use (not under ``fast_dev_run``: its own max_steps, one batch
    either way, and no checkpoints). Skipped updates count as steps
    (:func:`~maxent_grpo.training.step.optimise.count_update`), so the count stays a
    multiple of k."""
    k = num_iterations
    if k <= 1:
        return
    max_steps = getattr(trainer, "max_steps", -1)
    smoke = getattr(trainer, "fast_dev_run", False)  # its max_steps: one rollout's batch
    if not smoke and max_steps is not None and max_steps > 0 and max_steps % k:
        low, high = max_steps // k * k, (max_steps // k + 1) * k
        raise ValueError(
            f"trainer.max_steps {max_steps} is not a multiple of model.num_iterations {k}: "
            f"each training step takes {k} optimizer steps, so the fit would run {high}; "
            f"set --trainer.max_steps {high}" + (f" or {low}" if low else ""))
    for cb in [] if smoke else getattr(trainer, "callbacks", []):  # a smoke run saves none
        every = getattr(cb, "_every_n_train_steps", 0) if isinstance(cb, ModelCheckpoint) else 0
        require(not every or every % k == 0,
                f"ModelCheckpoint(every_n_train_steps={every}) saves when the optimizer-step "
                f"count is a multiple of {every}, and with model.num_iterations {k} that count "
                f"moves by {k}: it would save every {math.lcm(every, k)} steps; set "
                f"every_n_train_steps to a multiple of {k}")


def check_checkpoint_savers(trainer: Any) -> None:
    """Refuse a ``file://`` ``dirpath`` (Lightning writes it to ``./file:/...``), one with a
    ``$VAR`` (a folder of that name: Lightning does not expand it), or one that
    cannot be written (found at the first save, after its steps trained), and the
    ``ModelCheckpoint`` settings that Lightning's manual-optimisation path
    (every step here) gets wrong without a word: ``train_time_interval``, which it never
    checks (no checkpoint until training ends), and ``every_n_train_steps`` with a
    ``val/`` or ``test/`` monitor, which it scores with the validation before that step
    (the save runs at the batch's end, before the step's own validation)."""
    for cb in getattr(trainer, "callbacks", []):
        if not isinstance(cb, ModelCheckpoint):
            continue
        require(getattr(cb, "_train_time_interval", None) is None,
                "ModelCheckpoint(train_time_interval=...) never saves here (Lightning checks "
                "it only under automatic optimisation): use every_n_train_steps")
        folder = str(cb.dirpath or "")
        require(f"{os.sep}file:{os.sep}" not in folder,
                f"ModelCheckpoint(dirpath='file://...') is written to {folder} (Lightning "
                "reads the file:// address as a relative folder named 'file:'): give the "
                "folder as a plain path, without file://")
        _no_variable("ModelCheckpoint(dirpath=...)", folder)
        if trainer.world_size == 1 and not trainer.fast_dev_run:  # several: check_on_rank_zero
            check_saver_folder(folder)
        monitor = str(cb.monitor or "")
        require(not (cb._every_n_train_steps and monitor.startswith(("val/", "test/"))),
                f"ModelCheckpoint(monitor={monitor!r}, every_n_train_steps="
                f"{cb._every_n_train_steps}) would score each checkpoint with the validation "
                "before it (it saves at the batch's end, before that step's validation): "
                "leave every_n_train_steps unset to save at each validation's end, or add a "
                "second ModelCheckpoint without a monitor for the periodic saves")


def check_saver_folder(folder: str) -> None:
    """A ModelCheckpoint's local ``dirpath`` that cannot be written: refused."""
    why = unwritable(folder, folder=True) if folder and "://" not in folder else None
    require(why is None, f"ModelCheckpoint(dirpath={folder!r}) cannot be written ({why}): the "
            "first checkpoint would fail after its steps trained; give a folder you can write to")


def check_on_rank_zero(trainer: Any, stage: str) -> None:
    """With several processes, the checkpoint folder checks a fit makes with one (each
    ModelCheckpoint's ``dirpath``, :func:`check_checkpoint_root`): there they ran before the
    process group, where one rank refusing alone could leave the others waiting, so a folder
    that cannot be written failed at the first save, after its steps. Here every rank is at
    its setup: global rank 0, which writes the checkpoints, checks, and every rank stops with
    its answer. (The log folders: :func:`check_logger_folders`.)"""
    if getattr(trainer, "world_size", 1) == 1 or getattr(trainer, "fast_dev_run", False) or (
            stage != "fit"):
        return
    problem = None
    if trainer.is_global_zero:
        try:
            for cb in getattr(trainer, "callbacks", []):
                if isinstance(cb, ModelCheckpoint):
                    check_saver_folder(str(cb.dirpath or ""))
            check_checkpoint_root(trainer, several=True)
        except ValueError as err:
            problem = str(err)
        except Exception as err:  # noqa: BLE001 - shared all the same: no rank left waiting
            problem = f"rank 0's checks of the checkpoint folders failed: {err!r}"
    problem = trainer.strategy.broadcast(problem)
    if problem is not None:
        error = ValueError(problem)
        error.every_rank = True  # type: ignore[attr-defined]  # nothing to save (on_exception)
        raise error


def one_process_is_rank_zero(trainer: Any) -> None:
    """A one-process run whose environment holds a scheduler's ``RANK``, ``LOCAL_RANK`` or
    ``SLURM_PROCID`` logs as rank 0: Lightning took it for a non-zero rank, and every
    logger (and every rank-zero message) stayed silent while the run "succeeded". One of
    several tasks that ``srun`` started (in a batch job, not an interactive shell) is
    refused: each trained the whole run alone into the same folders."""
    started = os.environ.get("WORLD_SIZE", "1")  # torchrun's (TORCHELASTIC_RUN_ID: its own)
    require(getattr(trainer, "world_size", 1) != 1 or "TORCHELASTIC_RUN_ID" not in os.environ
            or not started.isdigit() or int(started) == 1,
            f"torchrun started {started} processes (WORLD_SIZE) for a run of one process "
            "(trainer.devices x trainer.num_nodes = 1): each would train the whole run alone, "
            "into the same folders. Set trainer.devices to --nproc-per-node (and "
            "trainer.strategy: ddp), or start one process")
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "1")  # srun's (a batch script has none)
    require(getattr(trainer, "world_size", 1) != 1 or not SLURMEnvironment.detect()
            or not tasks.isdigit() or int(tasks) == 1,
            f"srun started {tasks} tasks (SLURM_STEP_NUM_TASKS) for a run of one process "
            "(trainer.devices x trainer.num_nodes = 1): each would train the whole run alone, "
            "into the same folders. Set trainer.devices to the tasks per node and "
            "trainer.num_nodes to the nodes ($SLURM_NNODES), or start one task")
    if getattr(trainer, "world_size", 1) == 1 and rank_zero_only.rank != 0:
        rank_zero_only.rank = 0
        logging.getLogger(__name__).warning(
            "RANK, LOCAL_RANK or SLURM_PROCID in the environment said this process "
            "is not rank 0, but the run has one process: it logs as rank 0")


def attach_for_fit(trainer: Any, schedule: Any) -> None:
    """What a ``fit`` checks as it attaches the module (``schedule``: its
    ``ScheduleSettings``): :func:`check_trainer_flags`, :func:`check_step_multiples` and
    :func:`check_checkpoint_savers`, then :func:`drop_unasked_checkpoints`,
    :func:`no_checkpoints_in_smoke_runs` and :func:`check_checkpoint_root` (other stages,
    and ``trainer=None`` at detachment, pass); at any stage first
    :func:`one_process_is_rank_zero`, :func:`check_mesh_size` and :func:`check_logger_folders`.
    """
    if trainer is not None:  # any stage: before the DataModule's setup and its messages
        one_process_is_rank_zero(trainer)
        check_mesh_size(trainer)
        expand_logger_folders(trainer)  # the root, taken as written, where something saves
        if not getattr(trainer, "loggers", None) or SLURMEnvironment.detect():  # there
            _no_variable("trainer.default_root_dir", getattr(trainer, "_default_root_dir", None))
        check_logger_folders(trainer, several=getattr(trainer, "is_global_zero", False))
    if trainer is None or getattr(getattr(trainer, "state", None), "fn", None) != "fit":
        return
    check_trainer_flags(trainer, schedule.gradient_clip_val)
    check_step_multiples(trainer, schedule.num_iterations)
    check_checkpoint_savers(trainer)
    drop_unasked_checkpoints(trainer)
    no_checkpoints_in_smoke_runs(trainer)
    check_checkpoint_root(trainer)


def check_mesh_size(trainer: Any) -> None:
    """Under ``ModelParallelStrategy`` (FSDP2), ``data_parallel_size`` x
    ``tensor_parallel_size`` must be the number of processes ("auto": Lightning's, the nodes
    and the devices per node); checked before Lightning, whose message came inside a
    traceback (a scaling config run on fewer GPUs than it names)."""
    strategy = getattr(trainer, "strategy", None)
    if not isinstance(strategy, ModelParallelStrategy):
        return
    nodes, devices = int(trainer.num_nodes), int(trainer.num_devices)
    data, tensor = strategy._data_parallel_size, strategy._tensor_parallel_size
    data, tensor = (nodes if data == "auto" else data), (devices if tensor == "auto" else tensor)
    require(data * tensor == nodes * devices,
            f"trainer.strategy ModelParallelStrategy: data_parallel_size {data} x "
            f"tensor_parallel_size {tensor} must be the number of processes, {nodes * devices} "
            f"(trainer.num_nodes {nodes} x trainer.devices {devices}); set "
            f"--trainer.strategy.data_parallel_size={nodes * devices} (tensor_parallel_size 1)")


def _no_variable(option: str, folder: Any) -> None:
    """Refuse a ``$VAR`` in a folder Lightning takes as written (the loggers' are expanded)."""
    variable = re.search(r"\$\{?[A-Za-z_]\w*\}?", folder) if isinstance(
        folder, str) and folder != os.getcwd() else None  # (the root's default)
    require(variable is None, f"{option} {folder!r}: Lightning does not expand "
            f"{variable and variable.group()} in it (it would make a folder of that name); "
            "give the path itself (a shell expands it on a command line)")


def expand_logger_folders(trainer: Any) -> None:
    """A TensorBoard or CSV logger's local ``save_dir`` with ``~`` or ``$VAR`` expanded:
    Lightning's TensorBoardLogger expanded them for its files but numbered the versions in
    the folder as written (no such folder: every fresh run was ``version_0``, mixing their
    events), and its CSVLogger wrote into a folder literally named ``$VAR``."""
    for logger in getattr(trainer, "loggers", None) or []:
        for name in ("_root_dir", "_save_dir"):  # CSV's: both, one for its files
            given = getattr(logger, name, None)
            if isinstance(logger, (TensorBoardLogger, CSVLogger)) and isinstance(
                    given, str) and "://" not in given:
                setattr(logger, name, os.path.expanduser(os.path.expandvars(given)))


def check_logger_folders(trainer: Any, several: bool = False) -> None:
    """ValueError naming the logger whose ``save_dir`` cannot be written (W&B's too, where
    its run's config.yaml goes); the error was the file system's alone, without the option,
    after the model loaded. With several processes (before the process group exists) on
    global rank 0 only (``several``), which writes the logs: Lightning makes its loggers'
    folders there before the others can be told, so it failed alone at that point anyway,
    with the file system's error."""
    if getattr(trainer, "world_size", 1) != 1 and not several or getattr(
            trainer, "fast_dev_run", False):
        return
    for logger in getattr(trainer, "loggers", None) or []:
        folder, named = getattr(logger, "save_dir", None), f"save_dir={logger.save_dir!r}"
        if isinstance(getattr(logger, "root_dir", None), str):  # <save_dir>/<name>
            folder, named = logger.root_dir, f"{named}, name={logger.name!r}"
        why = unwritable(folder, folder=True) if (
            isinstance(folder, str) and folder and "://" not in folder) else None
        require(why is None, f"trainer.logger {type(logger).__name__}({named}) cannot be "
                f"written ({why}): give a folder you can write to")
    root = getattr(trainer, "default_root_dir", None)  # config.yaml's folder without a logger
    given = isinstance(root, str) and (getattr(trainer, "default_root_dir_given", False) or (
        os.path.abspath(root) != os.getcwd()))  # Lightning's default: the working folder
    why = None if getattr(trainer, "loggers", None) or not given or (
        "://" in root) else unwritable(root, folder=True)
    require(why is None, f"trainer.default_root_dir {root!r} cannot be written ({why}): give "
            "a folder you can write to")


def check_checkpoint_root(trainer: Any, several: bool = False) -> None:
    """Without a logger (or with one that has no ``save_dir``: MLflow's server) a
    ModelCheckpoint with no ``dirpath`` saves into ``<default_root_dir>/checkpoints`` (the
    working folder's by default): refused, naming both options, when that cannot be
    written (it failed at the first save, after the training steps). With several processes
    only on rank 0 at the setup (``several``: :func:`check_on_rank_zero`); not a
    ``fast_dev_run`` (it saves nothing)."""
    loggers = getattr(trainer, "loggers", None) or []
    if loggers and loggers[0].save_dir is not None or getattr(trainer, "world_size", 1) != 1 and (
            not several) or getattr(trainer, "fast_dev_run", False):
        return
    root = getattr(trainer, "default_root_dir", None)
    if isinstance(root, str) and "://" not in root and any(
            isinstance(cb, ModelCheckpoint) and cb.dirpath is None
            for cb in getattr(trainer, "callbacks", [])):
        why = unwritable(root if loggers else os.path.join(root, "checkpoints"), folder=True)
        require(why is None, f"a ModelCheckpoint without a dirpath saves into "
                f"trainer.default_root_dir {root!r} when there is no logger (or it has no "
                f"save_dir), and that cannot be written ({why}): give the ModelCheckpoint a "
                "dirpath, or trainer.default_root_dir a folder you can write to")


def no_checkpoints_in_smoke_runs(trainer: Any) -> None:
    """A ``fast_dev_run`` writes no checkpoint: Lightning skips every save of its
    ModelCheckpoints then except ``save_last`` at the end of training, which would leave a
    one-step ``last*.ckpt`` for ``--ckpt_path last`` to find; that save is switched off for
    the run."""
    if getattr(trainer, "fast_dev_run", False):
        for cb in getattr(trainer, "callbacks", []):
            if isinstance(cb, ModelCheckpoint) and cb.save_last:
                cb.save_last = False


def drop_unasked_checkpoints(trainer: Any) -> None:
    """With no logger and no ``default_root_dir``, Lightning's own checkpoint callback (the
    ``ModelCheckpoint()`` it adds when ``trainer.callbacks`` has none) would write to
    ``./checkpoints``, a folder nobody named: it is removed, with one line saying how to
    keep checkpoints. A ModelCheckpoint the user configured stays. From the command line a
    ``default_root_dir`` given as the working folder counts as given; a Trainer built in
    Python cannot tell it from none."""
    if trainer.loggers or getattr(trainer, "default_root_dir_given", False) or (
            os.path.abspath(trainer.default_root_dir) != os.getcwd()):
        return
    default = ModelCheckpoint()
    unasked = [cb for cb in trainer.callbacks if type(cb) is ModelCheckpoint and all(
        getattr(cb, name, None) == getattr(default, name, None) for name in _CHECKPOINT_OPTIONS)]
    for cb in unasked:
        trainer.callbacks.remove(cb)
    if unasked and trainer.is_global_zero:
        logging.getLogger(__name__).warning(
            "no checkpoints are saved: there is no logger and no trainer.default_root_dir, "
            "so Lightning's default checkpoint would land in ./checkpoints; to keep them pass "
            "--trainer.default_root_dir DIR or add a ModelCheckpoint to trainer.callbacks")


#: the attributes that tell Lightning's default ``ModelCheckpoint()`` from a configured one
_CHECKPOINT_OPTIONS = ("dirpath", "filename", "monitor", "save_last", "save_top_k",
                       "_every_n_train_steps", "_every_n_epochs", "_train_time_interval")


def fully_shard_models(mesh: Any, models: Iterable[torch.nn.Module | None]) -> None:
    """FSDP2-shard each model over ``mesh["data_parallel"]``: every transformer block (the
    classes in the model's ``_no_split_modules``) is one unit, the rest (embeddings, final
    norm, head) the root unit. Tensor parallelism is refused."""
    from torch.distributed.fsdp import fully_shard  # needs a distributed build of torch

    require(mesh["tensor_parallel"].size() == 1,
            "ModelParallelStrategy: tensor_parallel_size must be 1 (MaxEntGRPOModule "
            f"shards with FSDP2 only); got {mesh['tensor_parallel'].size()}")
    data_parallel = mesh["data_parallel"]
    for model in models:
        if model is None:
            continue
        blocks = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module, mesh=data_parallel)
        fully_shard(model, mesh=data_parallel)
