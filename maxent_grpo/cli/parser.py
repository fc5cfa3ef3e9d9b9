"""The command line: a LightningCLI with the trainer's argument links and defaults.

``python -m maxent_grpo fit --config configs/tiny.yaml`` trains; ``validate`` and
``test`` evaluate. Options that several components share are given once and linked
(``model.model_name_or_path`` -> ``data.tokenizer``, see ``add_arguments_to_parser``).

Resuming: ``fit --ckpt_path last`` loads the newest usable checkpoint of the configured
``ModelCheckpoint`` callbacks (refused for one without a ``dirpath``: it could never find it).

The config and the command line decide every option, also with ``--ckpt_path``:
LightningCLI's overwriting of the model options with the checkpoint's hyper-parameters is
undone, so ``validate --ckpt_path x.ckpt --model.eval_k [1,8]`` does evaluate pass@8.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Checkpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from maxent_grpo.cli import errors, parse_errors, seeds
from maxent_grpo.cli import help as cli_help
from maxent_grpo.rollout import vllm_server  # noqa: F401  (`model.engine VLLMServerEngine`)
from maxent_grpo.rollout.protocol import check_engine_factory
from maxent_grpo.training.callbacks.progress import ReadableProgressBar
from maxent_grpo.training.data.datamodule import PromptDataModule
from maxent_grpo.training.module import MaxEntGRPOModule
from maxent_grpo.training.run import checkpoint_io as ckpt_io
from maxent_grpo.training.run.checkpoint import keep_seed
from maxent_grpo.training.run.folders import (
    SaveRunConfig,
    continue_csv_log,
    continues_logger,
    warn_unreachable_trackers,
)
from maxent_grpo.training.run.signals import INTERRUPTED, resolve_with_requeue, slurm_resume
from maxent_grpo.training.step.strategy import check_launcher, warn_lone_local_rank


class ShortUsageParser(LightningArgumentParser):
    """The CLI's parser: a parse error prints one usage line (not the hundred-line list of
    every option), the ``--help`` tip and the error, which for an unknown option (also a
    prefix of one: no abbreviations) names the closest known ones."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # jsonargparse makes --x.help's parser without a prog: it was "usage: __main__.py"
        kwargs.setdefault("prog", cli_help.PROG)
        super().__init__(*args, **kwargs)

    def print_usage(self, file: Any = None) -> None:
        (file or sys.stderr).write(f"usage: {self.prog} [options]\n")

    def error(self, message: str, ex: Exception | None = None) -> None:  # NoReturn
        """jsonargparse's error made short (:mod:`maxent_grpo.cli.parse_errors`), ``; did you
        mean --x?`` added from this parser's options and its subcommands' (a config file's
        keys are checked by the parser above the subcommand's)."""
        parsers = [self]
        if self._subcommands_action is not None:
            parsers += self._subcommands_action._name_parser_map.values()
        options = [o for parser in parsers for o in parser._option_string_actions]
        linked = re.match(r"argument (\S+) --> (\S+): ", message)  # a link's target was given
        if linked:
            message = (f"--{linked[2]} is set from --{linked[1]} (linked options are given "
                       f"once): give --{linked[1]} instead")
        message = parse_errors.short_unknown_class(message, parsers)
        message = parse_errors.short_subclass_error(message)
        super().error(parse_errors.did_you_mean(message, options), ex)

    def format_help(self) -> str:
        """The short page (:mod:`maxent_grpo.cli.help`): our options before Lightning's
        Trainer options; jsonargparse's page as it is under ``--help-all``."""
        if cli_help.FULL_HELP.get():
            return super().format_help()
        with cli_help.ordered_groups(self):
            return super().format_help()


class MaxEntGRPOCLI(LightningCLI):
    """LightningCLI wired for :class:`MaxEntGRPOModule` and :class:`PromptDataModule`."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit``, ``validate``, ``test`` and ``predict`` (its predictions are written by a
        :class:`~maxent_grpo.training.callbacks.module_own.CompletionWriter`, not kept)."""
        commands = LightningCLI.subcommands()
        commands["predict"] = {*commands["predict"], "return_predictions"}
        return commands

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> Any:
        """``predict`` also takes ``--output``: the JSONL file (or folder) to write."""
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if subcommand == "predict":
            parser.add_argument(
                "--output", type=str | None, default=None,
                help="the JSONL file to write the graded completions to (replaced when it "
                     "exists), or a folder to write predictions.jsonl into; default: "
                     "predictions.jsonl in the run's log folder")
        return parser

    def predict(self, **kwargs: Any) -> None:
        """``trainer.predict`` without holding the predictions in memory."""
        self.trainer.predict(**kwargs, return_predictions=False)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for source, target in cli_help.LINKS:
            parser.link_arguments(source, target)
        # GRPO is the objective when none is named, so `--model.objective.beta 0.04` works
        parser.set_defaults({"model.objective": {"class_path": "maxent_grpo.objectives.GRPO"}})

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Build the Trainer with a :class:`~maxent_grpo.training.callbacks.progress.
        ReadableProgressBar` unless ``trainer.callbacks`` names a progress bar or
        ``trainer.enable_progress_bar`` is false; predict's ``--output`` decides every
        ``CompletionWriter``'s file (``CompletionWriter.configured``)."""
        config = self._subconfig(self.config_init)
        trainer_config = {**config.get("trainer", {}), **kwargs}
        listed = trainer_config.get("callbacks") or []
        listed = listed if isinstance(listed, list) else [listed]
        if trainer_config.get("enable_checkpointing") is False and any(
                isinstance(cb, Checkpoint) for cb in listed):  # (Lightning's says no fix)
            raise ValueError(
                "--trainer.enable_checkpointing false, and trainer.callbacks has a "
                "ModelCheckpoint (the shipped configs list one): to save no checkpoints remove "
                "it from the config's callbacks (--trainer.callbacks '[]' drops them all)")
        if trainer_config.get("enable_progress_bar") is not False:
            callbacks = list(listed)
            defaults = self.trainer_defaults.get("callbacks") or []
            defaults = defaults if isinstance(defaults, list) else [defaults]
            if not any(isinstance(cb, ProgressBar) for cb in [*callbacks, *defaults]):
                kwargs["callbacks"] = [*callbacks, ReadableProgressBar()]
        if self.subcommand == "predict":
            from maxent_grpo.training.callbacks.module_own import CompletionWriter as Writer

            callbacks = kwargs.get("callbacks") or trainer_config.get("callbacks") or []
            callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
            kwargs["callbacks"] = Writer.configured(callbacks, config.get("output"))
        trainer = super().instantiate_trainer(**kwargs)
        # a default_root_dir given as the working folder is a folder asked for
        trainer.default_root_dir_given = bool(trainer_config.get("default_root_dir"))
        return trainer

    def _parse_ckpt_path(self) -> None:
        """Nothing: LightningCLI would load a ``--ckpt_path`` file here, before any check, and
        replace the model options given on the command line by its saved ones (a file that is
        no checkpoint would fail with torch's traceback). The file is checked in
        :meth:`before_instantiate_classes` instead, and the options given are the options used."""

    def _set_seed(self) -> None:
        """``seed_everything: true`` draws a seed, as its help says, and records it in the
        config (Lightning's seeds 0: every "random" run was the same); the processes that
        Lightning's DDP launcher starts take the first one's; processes that torchrun or
        SLURM start would each draw their own: refused there (:mod:`maxent_grpo.cli.seeds`:
        several runs in one process too)."""
        config = self._subconfig(self.config)
        self._drawn_seed = config.get("seed_everything") is True  # a resume keeps the run's
        config["seed_everything"] = seeds.run_seed_option(
            config.get("seed_everything"), int(config.get("trainer.num_nodes") or 1))
        super()._set_seed()

    def _subconfig(self, config: Any) -> Any:
        return config.get(str(self.subcommand), config) if self.subcommand else config

    def _checkpoint_dirpaths(self) -> list[str]:
        """The ``dirpath`` of every checkpoint callback in the parsed ``trainer.callbacks``,
        ``~`` expanded as ``ModelCheckpoint`` expands it (else ``--ckpt_path last`` found
        nothing there and the resume skipped every check)."""
        from lightning.pytorch.callbacks import Checkpoint

        callbacks = self._subconfig(self.config).get("trainer.callbacks") or []
        dirpaths = []
        for cb in callbacks if isinstance(callbacks, list) else [callbacks]:
            cls = errors.import_class(cb.get("class_path")) if hasattr(cb, "get") else None
            dirpath = cb.get("init_args.dirpath") if cls else None
            if cls and issubclass(cls, Checkpoint) and dirpath:
                dirpaths.append(os.path.expanduser(str(dirpath)))
        return dirpaths

    def before_instantiate_classes(self) -> None:
        """Before anything is built: check the checkpoint to resume from
        (:func:`~maxent_grpo.training.run.checkpoint_io.resolve_checkpoint`); when ``fit``
        resumes, its run's seed is kept, and a TensorBoardLogger or CSVLogger without a
        ``version`` gets the checkpoint's for the same ``save_dir``/``name`` (TensorBoard
        purges the later events; :meth:`before_fit` drops the later CSV rows). With
        ``trainer.logger: false`` and no ``default_root_dir`` no config.yaml (it was cwd's)."""
        self._resume: ckpt_io.ResolvedCheckpoint | None = None
        self._continued: list[tuple[Any, bool, bool]] = []  # logger init_args set here, to undo
        cfg = self._subconfig(self.config)
        trainer = cfg.get("trainer") or {}
        if self.save_config_callback and trainer.get("logger") in (False, []) and not \
                trainer.get("default_root_dir"):  # None: Lightning's logger, its folder
            self.save_config_callback = None  # no log folder chosen: write nothing to cwd
        # SLURM's requeue checkpoint (Lightning's own resume without --ckpt_path skipped ours)
        ckpt_path, extra, refusal = slurm_resume(str(self.subcommand), cfg.get(
            "ckpt_path") if self.subcommand else None, trainer.get("default_root_dir"))
        if not ckpt_path:
            return
        resolve = functools.partial(
            ckpt_io.resolve_checkpoint, str(ckpt_path), self._checkpoint_dirpaths(),
            self.subcommand == "fit", trusted=cfg.get("weights_only") is False)
        self._resume = resolve_with_requeue(resolve, extra, refusal)
        if self.subcommand == "fit" and self._resume is not None:
            keep_seed(self._resume.seed, cfg, self._drawn_seed)
            self._continue_logger_versions(trainer.get("logger"), self._resume)

    def _continue_logger_versions(self, loggers: Any, resume: ckpt_io.ResolvedCheckpoint) -> None:
        from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

        records = list(resume.loggers)
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            if not hasattr(logger, "get") or logger.get("init_args") is None:
                continue
            cls = errors.import_class(logger.get("class_path"))
            if not (cls and issubclass(cls, (TensorBoardLogger, CSVLogger))):
                continue
            args, given = logger.init_args, logger.init_args.get("version")
            for record in records:  # an explicit version: the user's; purged when the same
                if continues_logger(record, f"{cls.__module__}.{cls.__qualname__}", args,
                                    resume.path, resume.saved_in, self._checkpoint_dirpaths()):
                    args.version = record["version"] if given is None else given
                    purge = issubclass(cls, TensorBoardLogger) and args.get("purge_step") is None
                    if purge:  # TensorBoard's steps count batches, not optimizer steps
                        args.purge_step = (resume.global_step if resume.log_step is None
                                           else resume.log_step)  # None: neither recorded
                    self._continued.append((args, given is None, purge))
                    records.remove(record)
                    break

    def after_instantiate_classes(self) -> None:
        """Atomic checkpoint writes unless the plugins or strategy brought a CheckpointIO,
        :class:`LoggerVersions` in every checkpoint, and the logger versions that
        :meth:`before_instantiate_classes` set taken out of the config again."""
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        for args, set_version, purge in getattr(self, "_continued", []):
            # config.yaml shows the options as given, not this run's version and purge_step
            if set_version:
                args.version = None
            if purge:
                args.purge_step = None
        trainer = getattr(self, "trainer", None)
        if trainer is None:  # a subclass that builds no Trainer
            return
        errors.LAUNCHERS[:] = [getattr(trainer.strategy, "launcher", None)]  # stopped on a failure
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = ckpt_io.AtomicCheckpointIO()
        if not any(isinstance(cb, ckpt_io.LoggerVersions) for cb in trainer.callbacks):
            trainer.callbacks.append(ckpt_io.LoggerVersions())

    def _use_checked_checkpoint(self) -> None:
        """Hand Lightning the checkpoint that :meth:`before_instantiate_classes` checked (a
        sharded one's folder only to a strategy that reads one); warn of an MLflow server that
        does not answer."""
        from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

        check_launcher(self.trainer)  # every stage: before a spawn tries to pickle the trainer
        warn_lone_local_rank(self.trainer)  # before Lightning waits for the other processes
        resume = getattr(self, "_resume", None)
        if resume is not None and os.path.isdir(resume.path) and not isinstance(
                self.trainer.strategy, (DeepSpeedStrategy, ModelParallelStrategy)):
            raise ValueError(
                f"--ckpt_path {resume.path} is a sharded checkpoint's folder (FSDP2 or "
                f"DeepSpeed), which {type(self.trainer.strategy).__name__} cannot read: run with "
                "the strategy that wrote it (an FSDP2 one also becomes a Hugging Face model "
                f"with maxent-grpo export {resume.path})")
        if resume is not None:
            self.config_init[str(self.subcommand)]["ckpt_path"] = resume.path
        if self.trainer.is_global_zero:
            warn_unreachable_trackers(self.trainer.loggers)

    before_validate = before_test = before_predict = _use_checked_checkpoint

    def before_fit(self) -> None:
        """Refuse ``--ckpt_path last`` when no ModelCheckpoint has an explicit ``dirpath``;
        when resuming, resume from the checked checkpoint, remove the temporary files of a
        killed checkpoint write and keep a continued CSVLogger's ``metrics.csv``."""
        if getattr(self.model, "pipeline", None) is not None:  # before a logger's folder
            check_engine_factory(self.model.engine_factory, asynchronous=True)
        last = self.config.get(f"{self.subcommand}.ckpt_path") == "last"
        callbacks = self.trainer.checkpoint_callbacks
        if last and not any(getattr(cb, "dirpath", None) for cb in callbacks):
            raise ValueError(
                "--ckpt_path last needs a ModelCheckpoint with an explicit dirpath (the "
                "default folder is inside the logger's new version folder, where the previous "
                "run's last.ckpt is not); add to trainer.callbacks: class_path "
                "lightning.pytorch.callbacks.ModelCheckpoint, init_args: {dirpath: ..., "
                "save_last: true}, or pass --ckpt_path <file>")
        self._use_checked_checkpoint()
        folders = self._checkpoint_dirpaths()
        if last and self._resume is None and all(map(ckpt_io.is_local, folders)):
            # nothing to resume (a requeue script's first run): said so, not Lightning's
            # hint to set save_last, which the shipped configs set
            self.config_init[str(self.subcommand)]["ckpt_path"] = None
            rank_zero_info(f"--ckpt_path last: no checkpoint yet in {', '.join(folders)}: the "
                           "fit starts from step 0")
        fresh = not self.config_init[str(self.subcommand)]["ckpt_path"]  # (a remote: resumes)
        for cb in (c for c in self.trainer.callbacks if isinstance(c, SaveRunConfig)):
            cb.fresh = fresh  # a fit that resumes nothing: its own config.yaml
        if fresh and self.trainer.is_global_zero and not self.trainer.fast_dev_run:
            dirpaths = (getattr(cb, "dirpath", None) for cb in callbacks)  # any Checkpoint
            for folder in dict.fromkeys(str(path) for path in dirpaths if path):
                if os.path.isdir(folder) and ckpt_io.checkpoint_files(folder):
                    logging.getLogger(__name__).warning(
                        "checkpoints go to %s, which holds an earlier run's: this run's are "
                        "written beside them (a name already taken gets -v1, -v2, ...), and "
                        "--ckpt_path last will then stop and ask which run to continue. To "
                        "continue the earlier run instead: --ckpt_path last; to keep runs "
                        "apart: another ModelCheckpoint dirpath", folder)
        if self.trainer.is_global_zero:  # a write a kill cut short (a fresh fit's folder too)
            ckpt_io.remove_stale_temporaries(self._checkpoint_dirpaths(), not fresh)
        if self._resume is None or not self.trainer.is_global_zero:
            return
        from lightning.pytorch.loggers import CSVLogger
        later = [] if last else ckpt_io.later_steps_of_run(self._checkpoint_dirpaths(),
                                                           self._resume)
        if later:  # a rollback: the run goes on as a branch, which `last` will not mistake
            for cb in self.trainer.callbacks:
                if isinstance(cb, ckpt_io.LoggerVersions):
                    cb.fork = True
            logging.getLogger(__name__).warning(
                "resuming %s at step %s while the same run has later checkpoints (%s): this "
                "run goes on as a branch of its own, so --ckpt_path last will ask which to "
                "continue", self._resume.path, self._resume.global_step, ", ".join(later))
        for logger in self.trainer.loggers:
            if isinstance(logger, CSVLogger):  # keep its metrics.csv (Lightning deletes it)
                resume = self._resume  # its rows' steps count batches, as TensorBoard's
                continue_csv_log(logger, resume.global_step if resume.log_step is None
                                 else resume.log_step)




@contextlib.contextmanager
def _without_tips() -> Iterator[None]:
    """Lightning's rank-zero logger without the :data:`~maxent_grpo.cli.help.QUIET_INFO`
    lines, for the call."""
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")

    def drop(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(cli_help.QUIET_INFO)

    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def main(
    args: list[str] | None = None, run: bool = True, *, exit_on_error: bool | None = None
) -> MaxEntGRPOCLI:
    """Entry point; ``args`` defaults to ``sys.argv[1:]``; ``--traceback`` is removed first.

    With ``exit_on_error`` (default when ``args`` is None) a user's mistake is printed as
    ``error: <message>`` plus a hint on stderr and exits with code 1, with a trace only under
    ``--traceback`` or for a bug (:mod:`maxent_grpo.cli.errors`); otherwise exceptions propagate.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from_argv = args is None
    quick = cli_help.quick_help(list(sys.argv[1:] if from_argv else args or [])) if run else None
    if quick is not None:  # the top-level page of the subcommands: nothing to build
        (sys.stdout if quick[1] == 0 else sys.stderr).write(quick[0])
        raise SystemExit(quick[1])
    if exit_on_error is None:
        exit_on_error = from_argv
    show_trace = False
    if isinstance(args, list) or (from_argv and errors.TRACEBACK_FLAG in sys.argv[1:]):
        args, show_trace = errors.pop_traceback_flag(list(sys.argv[1:] if from_argv else args))
    given = sys.argv[1:] if args is None else args
    full_help = cli_help.HELP_ALL_FLAG in given
    if full_help:  # jsonargparse prints its full page for --help under FULL_HELP
        args = ["--help" if a == cli_help.HELP_ALL_FLAG else a for a in given]
    # with --traceback, jsonargparse raises its parse errors (printed with their trace by
    # errors.report) instead of printing the usage and exiting 2
    parser_kwargs = {"exit_on_error": False} if show_trace and exit_on_error else {}

    def build() -> MaxEntGRPOCLI:
        token = cli_help.FULL_HELP.set(full_help)
        try:
            return _build(_named_configs(args), run, parser_kwargs, from_argv)
        finally:
            cli_help.FULL_HELP.reset(token)

    if exit_on_error:
        return errors.exit_on_error(build, show_trace)
    handler = signal.getsignal(signal.SIGINT)
    try:
        return build()
    except SystemExit as stop:  # Lightning's sys.exit(1) after a Ctrl-C: the Ctrl-C, in Python
        if stop.code == 1 and isinstance(stop.__context__, KeyboardInterrupt) or type(  # or
                stop).__name__ == "SIGTERMException" and INTERRUPTED:  # after a batch (several)
            raise (stop.__context__ if stop.code == 1 else KeyboardInterrupt()) from None
        raise
    finally:  # Lightning ignores Ctrl-C after one: a notebook's next run could not be stopped
        if handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, handler)


def _named_configs(args: Any) -> Any:
    """``--config NAME`` -> the shipped config's path (:func:`cli_help.resolve_config_names`);
    with ``args`` None in ``sys.argv`` itself, which DDP's launcher runs again. A config
    that sets a link's target is refused (:func:`cli_help.check_given_configs`)."""
    if args is None:
        sys.argv[1:] = cli_help.resolve_config_names(sys.argv[1:])
        cli_help.check_given_configs(sys.argv[1:])
    elif isinstance(args, list):
        args = cli_help.resolve_config_names(args)
        cli_help.check_given_configs(args)
    return args


def _build(args: Any, run: bool, parser_kwargs: dict[str, Any], from_argv: bool) -> MaxEntGRPOCLI:
    """The CLI, built with the :data:`~maxent_grpo.cli.help.QUIET_WARNINGS` and
    :data:`~maxent_grpo.cli.help.QUIET_INFO` filters."""
    with warnings.catch_warnings(), _without_tips():
        if from_argv:  # args is sys.argv less --traceback (kept there for DDP's launcher)
            warnings.filterwarnings("ignore", "LightningCLI's args parameter is intended")
        for message, category in cli_help.QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message, category)
        formatter = cli_help.help_formatter_class()
        commands = {
            name: {"formatter_class": formatter, "description": f"{name}: {text}.",
                   "allow_abbrev": False}  # --trainer.max_step: an error, not max_steps
            for name, text in cli_help.SUBCOMMANDS.items()
        }
        return MaxEntGRPOCLI(
            MaxEntGRPOModule,
            PromptDataModule,
            parser_class=ShortUsageParser,
            seed_everything_default=0,
            auto_configure_optimizers=False,
            save_config_callback=SaveRunConfig,
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
            parser_kwargs={"prog": cli_help.PROG, "formatter_class": formatter,
                           "allow_abbrev": False, **parser_kwargs, **commands},
        )
