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
}


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


def read_prompts(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------- worker I/O


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (``ru_maxrss``, KiB on Linux), in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


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
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    folder = workload_dir(workload.name, fixed_length=not args.allow_eos)
    warmup = workload.warmup if args.warmup is None else args.warmup
    steps = workload.steps if args.steps is None else args.steps
    emit_result(run(workload, folder, warmup, steps, args.seed, lockstep=args.lockstep))
