"""Shared pieces of the benchmarks: workloads, the reward, worker I/O.

This module imports only the standard library at import time, so both virtual environments
(ours, ``.venv``, and TRL's, ``benchmarks/.venv-trl``) can import it. :func:`prepare_workload`
needs ``maxent_grpo`` and runs in ours only.

A workload is one model and one prompt set, materialised once under ``benchmarks/.cache/``:

- ``<workload>/model/``: a plain Hugging Face folder (weights, config, tokenizer) that both
  trainers load with ``from_pretrained``. With ``fixed_length`` (the default) the tokenizer's
  and the model's eos token is a new added token, ``<|bench_no_eos|>``, whose id is outside the
  model's vocabulary, so it is never sampled: every completion on both sides is exactly
  ``max_completion_length`` tokens long and the two trainers do identical token counts.
- ``<workload>/prompts.jsonl``: rows ``{"prompt": <rendered chat text>, "answer": ...}`` from
  a built-in task (``maxent_grpo.tasks``), rendered once with the model's chat template. Both
  trainers read this text as is (ours with ``apply_chat_template=False``; TRL treats a string
  prompt as plain text), and both tokenise it to the same ids (checked: the tokenizers add no
  special tokens).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
CACHE_DIR = BENCH_DIR / ".cache"
NO_EOS_TOKEN = "<|bench_no_eos|>"
PREPARE_VERSION = 1  # bump when prepare_workload's output changes
NUM_PROMPTS = 256


@dataclass(frozen=True)
class Workload:
    """One side-by-side workload: model, prompts and the step's shape.

    A step is ``batch_prompts`` (B) prompts x ``num_generations`` (G) completions of exactly
    ``max_completion_length`` (T) tokens (see ``fixed_length``), one optimizer step.
    """

    name: str
    model: str
    task: str
    task_options: dict[str, Any] = field(default_factory=dict)
    batch_prompts: int = 2
    num_generations: int = 4
    max_completion_length: int = 32
    learning_rate: float = 1e-5
    warmup: int = 2
    steps: int = 5
    device: str = "cpu"
    precision: str = "32-true"  # Lightning's name; TRL gets bf16=True for "bf16-mixed"
    prompt_tokens: int = 0  # > 0: synthetic prompts of exactly this many tokens (random:)
    in_all: bool = True  # part of ``--workload all``
    #: groups per forward/backward (None: all B at once); TRL gets the same split as
    #: per_device_train_batch_size = k * G over B / k accumulation steps of one generation
    micro_batch_groups: int | None = None


WORKLOADS: dict[str, Workload] = {
    # tiny: overhead-dominated (the model is 2 layers of width 64); the tiny.yaml shape
    # (16 prompts x 8) with 16-token completions
    "tiny": Workload(
        name="tiny", model="builtin:tiny", task="arithmetic_easy",
        task_options={"bare": True}, batch_prompts=16, num_generations=8,
        max_completion_length=16, learning_rate=3e-3, warmup=5, steps=40,
    ),
    # smollm2: compute-dominated (135M parameters, ~120-token countdown prompts)
    "smollm2": Workload(
        name="smollm2", model="builtin:smollm2-135m-instruct", task="countdown",
        task_options={"num_numbers": 3, "max_target": 100}, batch_prompts=2, num_generations=4,
        max_completion_length=48, learning_rate=5e-6, warmup=2, steps=5,
    ),
    # smollm2 at the vLLM issue's generation shape (8 prompts x G 8 x 128 new tokens):
    # generation-dominated, where a faster engine shows in the whole step
    "smollm2-gen": Workload(
        name="smollm2-gen", model="builtin:smollm2-135m-instruct", task="countdown",
        task_options={"num_numbers": 3, "max_target": 100}, batch_prompts=8, num_generations=8,
        max_completion_length=128, learning_rate=5e-6, warmup=1, steps=3, in_all=False,
        micro_batch_groups=1,  # 64 sequences at once need more than 24 GB on either side
    ),
    # The GPU workload of issue 13: a randomly initialised model shaped exactly like
    # Qwen2.5-0.5B-Instruct, 8 prompts of 128 tokens x G = 8 x T = 256, bf16-mixed with
    # float32 weights (benchmarks/gpu_step.py). No weights are downloaded.
    "qwen0.5b-gpu": Workload(
        name="qwen0.5b-gpu", model="random:qwen2.5-0.5b", task="synthetic",
        batch_prompts=8, num_generations=8, max_completion_length=256, learning_rate=1e-6,
        warmup=2, steps=6, device="cuda", precision="bf16-mixed", prompt_tokens=128,
    ),
    # the issue-13 model and precision at a step small enough for the CPU: where each
    # side's memory goes (gpu_step.py --shape 0.5b-cpu --memory)
    "qwen0.5b-cpu": Workload(
        name="qwen0.5b-cpu", model="random:qwen2.5-0.5b", task="synthetic",
        batch_prompts=2, num_generations=4, max_completion_length=16, learning_rate=1e-6,
        warmup=1, steps=1, precision="bf16-mixed", prompt_tokens=32,
    ),
    # the same pipeline at a tiny shape, on the CPU: every stage of gpu_step.py tested here
    "qwen-tiny-cpu": Workload(
        name="qwen-tiny-cpu", model="random:qwen-tiny", task="synthetic",
        batch_prompts=2, num_generations=4, max_completion_length=8, learning_rate=1e-4,
        warmup=1, steps=2, prompt_tokens=32,
    ),
}

#: Random-init model shapes (``random:<name>``), Qwen2 architecture, tied embeddings.
RANDOM_MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                         max_position_embeddings=32768, tie_word_embeddings=True),
    "qwen-tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=151936,
                      max_position_embeddings=1024, tie_word_embeddings=True),
}
#: The CPU comparisons (``--workload all`` of trl_vs_ours.py and step_overhead.py); the
#: ``random:`` workloads belong to gpu_step.py.
CPU_WORKLOADS = sorted(name for name, w in WORKLOADS.items()
                       if w.device == "cpu" and not w.model.startswith("random:") and w.in_all)
#: every CPU workload one can name (``smollm2-gen`` too: minutes a step)
CPU_CHOICES = sorted(name for name, w in WORKLOADS.items()
                     if w.device == "cpu" and not w.model.startswith("random:"))


def workload_dir(name: str, fixed_length: bool = True) -> Path:
    return CACHE_DIR / (name if fixed_length else f"{name}-eos")


# ----------------------------------------------------------------------------- the reward


def digit_fraction(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """The benchmark reward: the fraction of a completion's characters that are digits.

    Pure Python, cheap and the same on both sides (both call ``fn(prompts=..., completions=...,
    **columns)``); it varies within a group, so advantages are not all zero.
    """
    return [sum(ch.isdigit() for ch in text) / max(1, len(text)) for text in completions]


# ----------------------------------------------------------------------------- preparation


def prepare_workload(workload: Workload, fixed_length: bool = True) -> Path:
    """Materialise the model folder and the prompts of ``workload`` (once); return the folder.

    Runs in our environment (it uses ``maxent_grpo.models`` and ``maxent_grpo.tasks``).
    """
    folder = workload_dir(workload.name, fixed_length)
    stamp = folder / "prepared.json"
    meta = {"version": PREPARE_VERSION, "model": workload.model, "task": workload.task,
            "task_options": workload.task_options, "fixed_length": fixed_length,
            "num_prompts": NUM_PROMPTS}
    if stamp.is_file() and json.loads(stamp.read_text()) == meta:
        return folder
    if workload.model.startswith("random:"):
        prepare_random(workload, folder)
        stamp.write_text(json.dumps(meta, indent=1))
        return folder
    from transformers import AutoModelForCausalLM

    from maxent_grpo.models import load_tokenizer, resolve_model_path
    from maxent_grpo.tasks import build_task

    source = resolve_model_path(workload.model)
    tokenizer = load_tokenizer(workload.model)
    rows = build_task(workload.task, NUM_PROMPTS, 0, **workload.task_options)
    lines = []
    for row in rows:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False,
            add_generation_prompt=True,
        )
        with_special = tokenizer(text)["input_ids"]
        if with_special != tokenizer(text, add_special_tokens=False)["input_ids"]:
            raise RuntimeError(
                f"{workload.model}: the tokenizer adds special tokens to plain text; TRL "
                "(add_special_tokens=True) and ours (False) would see different prompt ids"
            )
        lines.append(json.dumps({"prompt": text, "answer": str(row["answer"])}))
    model = AutoModelForCausalLM.from_pretrained(source, dtype="float32")
    if fixed_length:
        tokenizer.add_special_tokens({"eos_token": NO_EOS_TOKEN})
        no_eos = tokenizer.convert_tokens_to_ids(NO_EOS_TOKEN)
        if no_eos < model.config.vocab_size:
            raise RuntimeError(f"{NO_EOS_TOKEN} got id {no_eos}, inside the model's vocabulary")
        model.config.eos_token_id = no_eos
        model.generation_config.eos_token_id = no_eos
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    (folder / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    stamp.write_text(json.dumps(meta, indent=1))
    return folder


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def prepare_random(workload: Workload, folder: Path) -> None:
    """A ``random:`` workload: a Qwen2 model of the named shape with seeded random weights,
    a byte-level BPE tokenizer built here (one token per byte, ChatML specials; transformers
    loads a qwen2 folder's tokenizer as a byte-level BPE), whose eos ``<|bench_no_eos|>`` has
    an id outside the model's vocabulary (never sampled: every completion is exactly T
    tokens), and ``NUM_PROMPTS`` chat prompts of exactly ``prompt_tokens`` tokens."""
    import random

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    shape = RANDOM_MODELS[workload.model.removeprefix("random:")]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for token in specials:
        vocab[token] = len(vocab)
    vocab[NO_EOS_TOKEN] = shape["vocab_size"]  # outside the embedding table
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([*specials, NO_EOS_TOKEN])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=NO_EOS_TOKEN, pad_token="<|endoftext|>",
        chat_template=CHATML,
    )
    torch.manual_seed(0)
    config = Qwen2Config(**shape, bos_token_id=vocab["<|im_start|>"],
                         eos_token_id=vocab[NO_EOS_TOKEN], pad_token_id=vocab["<|endoftext|>"])
    model = Qwen2ForCausalLM(config)
    rng = random.Random(0)
    empty = tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False,
                                          add_generation_prompt=True)
    frame = len(tokenizer(empty, add_special_tokens=False)["input_ids"])
    lines = []
    for _ in range(NUM_PROMPTS):
        content = "".join(rng.choice("0123456789abcdefghij +=") for _ in
                          range(workload.prompt_tokens - frame))
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                             tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) != workload.prompt_tokens or tokenizer(text)["input_ids"] != ids:
            raise RuntimeError(f"synthetic prompt of {len(ids)} tokens, expected "
                               f"{workload.prompt_tokens} (and no added special tokens)")
        lines.append(json.dumps({"prompt": text, "answer": "0"}))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    (folder / "prompts.jsonl").write_text("\n".join(lines) + "\n")


def read_prompts(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------- worker I/O


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB: ``VmHWM`` of
    ``/proc/self/status`` on Linux. Not ``ru_maxrss``: Linux carries it over fork and exec,
    so a worker that a driver started after loading a model reported the driver's peak (both
    sides of trl_vs_ours at the same 907 MiB). Elsewhere, ``ru_maxrss`` (KiB on Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def reset_peak_rss() -> bool:
    """Start :func:`peak_rss_mib` again from the current resident set, for a second
    measurement in the same process; False where that cannot be done (not Linux, or a
    kernel that refuses), and the peak then goes on from the earlier one."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_cuda_mib() -> float | None:
    """``torch.cuda.max_memory_allocated()`` in MiB, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated() / 2**20


class PhaseMemory:
    """Peak memory of each phase of a training step, to say where a side's peak comes from.

    Phases are marked by wrapping a side's functions (:meth:`wrap`): ``generate``,
    ``score`` (the policy's scoring forward), ``backward``, ``optimizer``; time outside them
    is ``other``. On CUDA a phase's figure is ``max_memory_allocated`` while it runs (the
    peak counter is reset at each mark), so it includes the weights, gradients and
    optimizer state. On the CPU, where there is no allocator counter, ``enabled`` counts
    the bytes of the tensors that ops create during a step (a ``TorchDispatchMode``,
    storages counted once until freed): the peak above what lived before the step (weights
    and optimizer state), with some slowdown, so it is a separate run (``--memory``).
    Figures in MiB, the maximum over the steps between :meth:`start_step` and
    :meth:`end_step` once :attr:`recording` is set.
    """

    def __init__(self, device: str, enabled: bool) -> None:
        self.cuda = device == "cuda"
        self.enabled = enabled or self.cuda
        self.recording = False
        self.peaks: dict[str, float] = {}
        self._phase = "other"
        self._mode: Any = None
        self._live = 0
        self._phase_peak = 0

    # -- CPU: live bytes of op outputs -----------------------------------------------------
    def _make_mode(self) -> Any:
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class LiveBytes(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for tensor in out if isinstance(out, (tuple, list)) else (out,):
                    if hasattr(tensor, "untyped_storage"):
                        tracker._count(tensor.untyped_storage())
                return out

        return LiveBytes()

    def _count(self, storage: Any) -> None:
        size = storage.nbytes()
        if size == 0 or getattr(storage, "_bench_counted", False):
            return
        storage._bench_counted = True
        self._live += size
        self._phase_peak = max(self._phase_peak, self._live)
        weakref.finalize(storage, self._free, size)

    def _free(self, size: int) -> None:
        self._live -= size

    # -- phases ------------------------------------------------------------------------------
    def _close(self) -> None:
        if self.cuda:
            import torch

            peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            peak = self._phase_peak
            self._phase_peak = self._live
        if self.recording:
            self.peaks[self._phase] = max(self.peaks.get(self._phase, 0.0), peak / 2**20)

    def mark(self, phase: str) -> None:
        """End the current phase and start ``phase``."""
        if self.enabled:
            self._close()
            self._phase = phase

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        """Replace ``owner.name`` by a wrapper that runs it as ``phase`` (then ``other``);
        nothing when not :attr:`enabled` (timing runs keep the plain methods)."""
        if not self.enabled:
            return
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.mark(phase)
            try:
                return original(*args, **kwargs)
            finally:
                self.mark("other")

        setattr(owner, name, wrapper)

    def start_step(self) -> None:
        if not self.enabled:
            return
        if not self.cuda and self._mode is None:
            self._mode = self._make_mode()
            self._mode.__enter__()
        self.mark("other")

    def end_step(self) -> None:
        if not self.enabled:
            return
        self.mark("other")
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
            self._live = self._phase_peak = 0

    def result(self) -> dict[str, float] | None:
        """``{phase: peak MiB}`` (None when not measured)."""
        return dict(self.peaks) if self.enabled and self.peaks else None


RESULT_MARK = "BENCH_RESULT "


def emit_result(result: dict[str, Any]) -> None:
    """Print the worker's result as one marked JSON line (the driver looks for the mark)."""
    sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


def parse_result(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    raise RuntimeError("worker printed no result line")


READY_MARK = "BENCH_READY"
DONE_MARK = "BENCH_STEP_DONE"


class LockstepGate:
    """Lets the driver run the two sides' steps alternately (``--lockstep`` workers).

    Before each step the worker calls :meth:`wait`: the first call prints ``BENCH_READY``
    (start-up is over), every call then blocks until the driver writes a line on stdin.
    After the step :meth:`done` prints ``BENCH_STEP_DONE``. The step timer starts after
    ``wait`` returns, so the time spent waiting for the other side is not counted. Disabled,
    both are no-ops.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._ready_sent = False

    def wait(self) -> None:
        if not self.enabled:
            return
        if not self._ready_sent:
            sys.stdout.write(READY_MARK + "\n")
            sys.stdout.flush()
            self._ready_sent = True
        if not sys.stdin.readline():
            raise RuntimeError("lockstep: the driver closed stdin before the run ended")

    def done(self) -> None:
        if self.enabled:
            sys.stdout.write(DONE_MARK + "\n")
            sys.stdout.flush()


def median(values: list[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def git_commit(root: str | os.PathLike[str]) -> str:
    """Short hash of ``HEAD`` in ``root``, with ``+dirty`` when tracked files have
    uncommitted edits; ``"unknown"`` outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                             capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, text=True, capture_output=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out + ("+dirty" if dirty else "")


def versions(*packages: str) -> dict[str, str]:
    """``{package: __version__}`` of the named (importable) packages."""
    import importlib

    return {name: importlib.import_module(name).__version__ for name in packages}


def worker_main(run: Any, description: str) -> None:
    """The command line both workers share: parse the workload and step counts, call
    ``run(workload, folder, warmup, steps, seed, lockstep=...)`` and emit its result."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--allow-eos", action="store_true",
                        help="use the model's own eos (completion lengths then vary)")
    parser.add_argument("--lockstep", action="store_true",
                        help="wait for a line on stdin before each step (driver-paced)")
    parser.add_argument("--cache", choices=("dynamic", "static", "vllm"), default=None,
                        help="ours only: the rollout engine (HFGenerateEngine's dynamic or "
                        "static key/value cache, or VLLMEngine, in the vLLM environment)")
    parser.add_argument("--generation-dtype", choices=("model", "bfloat16", "float16"),
                        default=None, help="ours only: generate on a copy of the weights "
                        "in this dtype (HFGenerateEngine.generation_dtype)")
    parser.add_argument("--fused-lm-head", choices=("auto", "true", "false"), default=None,
                        help="ours only: model.fused_lm_head (auto: fused on CUDA)")
    parser.add_argument("--memory", action="store_true",
                        help="CPU: count each phase's peak tensor bytes (PhaseMemory; "
                        "slower, so not for timing); always on with CUDA")
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    folder = workload_dir(workload.name, fixed_length=not args.allow_eos)
    warmup = workload.warmup if args.warmup is None else args.warmup
    steps = workload.steps if args.steps is None else args.steps
    extra = {} if args.cache is None else {"cache": args.cache}
    if args.generation_dtype is not None:
        extra["generation_dtype"] = args.generation_dtype
    if args.memory:
        extra["memory"] = True
    if args.fused_lm_head not in (None, "auto"):
        extra["fused_lm_head"] = args.fused_lm_head == "true"
    emit_result(run(workload, folder, warmup, steps, args.seed, lockstep=args.lockstep, **extra))
