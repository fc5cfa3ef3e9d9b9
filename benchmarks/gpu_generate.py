"""Generation only: completion tokens per second of each way to sample the issue-13 rollout.

The workload of issue 13, built offline (``bench_common.WORKLOADS["qwen0.5b-gpu"]``): a
randomly initialised model shaped exactly like Qwen2.5-0.5B-Instruct, B = 8 prompts of
128 tokens x G = 8 samples x T = 256 new tokens (16,384 completion tokens per rollout), an
eos id outside the vocabulary (never sampled: every completion is exactly T tokens), plain
sampling (temperature 1, no top-k, no top-p). The model is bf16 on CUDA (float32 on the CPU),
and every variant gets the same prompts. One command::

    python benchmarks/gpu_generate.py                      # on a GPU machine, ~6-9 minutes
    python benchmarks/gpu_generate.py --shape tiny-cpu     # every variant at a tiny shape, CPU
    python benchmarks/gpu_generate.py --variants hf-static,cb-graphs --repeats 5

Where one command may run 10 minutes at most, run it in two halves into one JSON (the
results are written after every variant, so a run stopped from outside keeps what it
measured)::

    python benchmarks/gpu_generate.py --variants hf,ours
    python benchmarks/gpu_generate.py --variants cb --merge

Variants (``--variants`` takes their ids or families ``hf``/``ours``/``cb``, comma-separated;
``--list`` prints them):

- ``hf-dynamic`` / ``hf-static``: ``model.generate(do_sample=True, num_return_sequences=G,
  max_new_tokens=T)``, dynamic key/value cache / ``cache_implementation="static"`` (on CUDA
  transformers then compiles the decode step);
- ``ours-dynamic`` / ``ours-static``: ``HFGenerateEngine(...).generate(prompts, answers, G)``
  (shared prefill; static: ``prompt_bucket=64``), tokenisation and decoding included;
- ``ours-fp32-autocast``: the dynamic engine on float32 weights inside
  ``torch.autocast(bfloat16)``: what a ``bf16-mixed`` training run does today;
- ``ours-static-bf16copy``: float32 weights under autocast as above, the static engine with
  ``generation_dtype="bfloat16"`` (generation on a bf16 copy, refreshed at every call);
- ``cb-default``: transformers' continuous batching, ``model.generate_batch(prompt_ids,
  generation_config)`` with its default settings (a new manager per call, whose paged cache
  takes 90% of the free GPU memory);
- ``cb-persistent``: ``persistent_manager=True`` (manager, cache and any CUDA graphs kept
  across calls, as a trainer would keep them), the cache sized for the workload
  (``num_blocks`` = 2 x the pages the B*G sequences need, ``max_batch_tokens`` = B*P: the whole
  prefill in one batch);
- ``cb-graphs``: ``cb-persistent`` + ``use_cuda_graph=True`` + ``use_async_batching=True``;
- ``cb-compile``: ``cb-graphs`` + ``default_compile_level=1`` (``torch.compile``, mode
  ``default``, dynamic shapes).

The continuous-batching variants sample G per prompt with ``num_return_sequences=G`` (forked
after the prompt's prefill), with the same sampling settings; where ``generate_batch`` returns
only one sample per forked prompt (transformers 5.17) each prompt is passed G times instead
(its prefix cache shares the identical prompts' pages), and the note says so. Off CUDA,
``use_cuda_graph`` and ``use_async_batching`` are dropped (CUDA only) and every CB cache gets
the sized ``num_blocks`` (the default would take 60% of the machine's RAM); both are noted.
An option the installed transformers does not have makes that variant "unsupported" (its
error recorded) instead of stopping the run. Each CB variant records the settings its manager
resolved (cache blocks, max batch tokens, CUDA graphs, async, compile) and the attention
implementation it ran with (transformers switches to flash attention by itself where the
``flash_attn`` package is installed; its version, or None, is in the JSON).

Each variant loads a fresh copy of the model (no compiled code, attention switch or
generation copy carries over; ``torch._dynamo.reset()`` between variants), makes one warm-up
call ("first call", with any compile or CUDA-graph capture) and ``--repeats`` timed calls.
Reported: first-call seconds, median seconds, completion tokens/s = completion tokens
produced / seconds, peak ``torch.cuda.max_memory_allocated`` over the variant. Every call
must return exactly B*G completions of T tokens (checked and recorded), so tokens/s are
comparable. A variant that fails or runs past ``--timeout`` seconds is recorded with its
error and the others still run. Results: ``benchmarks/results/gpu_generate.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import gc
import inspect
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import bench_common as bc  # noqa: E402

SHAPES = {"gpu": "qwen0.5b-gpu", "tiny-cpu": "qwen-tiny-cpu"}
STATIC_BUCKET = 64
#: continuous-batching options that need CUDA (dropped, and noted, on other devices)
CUDA_ONLY_CB_OPTIONS = ("use_cuda_graph", "use_async_batching")


class Unsupported(Exception):
    """The installed transformers (or this device) cannot run the variant as specified."""


class VariantTimeout(BaseException):
    """A variant ran past ``--timeout``. A BaseException, so that transformers' own
    ``except Exception`` (around ``generate_batch``'s loop) does not swallow it."""


@dataclasses.dataclass
class Bench:
    """The workload, loaded once: prompts (text and ids) and where the model lives."""

    name: str
    folder: Path
    device: Any  # torch.device
    batch: int  # B
    group: int  # G
    new_tokens: int  # T
    prompts: list[str]
    answers: list[str]
    prompt_ids: list[list[int]]
    tokenizer: Any

    @property
    def prompt_len(self) -> int:
        return max(len(ids) for ids in self.prompt_ids)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def load_model(self, dtype: Any) -> Any:
        """A fresh copy of the model in ``dtype`` on the device, in eval mode."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.folder / "model", dtype=dtype)
        return model.to(self.device).eval()

    def generation_dtype(self) -> Any:
        """The model's dtype for generation: bf16 on CUDA, float32 on the CPU."""
        import torch

        return torch.bfloat16 if self.cuda else torch.float32

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)


@dataclasses.dataclass
class Variant:
    """One way to sample the rollout: ``setup(bench, info)`` loads what it needs and returns
    the call to time, which returns the completion lengths (one per completion) it produced;
    ``info`` collects notes and settings for the report."""

    id: str
    name: str
    setup: Callable[[Bench, dict[str, Any]], Callable[[], list[int]]]


# ----------------------------------------------------------------------------- the workload


def load_bench(workload: bc.Workload, folder: Path, device: str | None = None) -> Bench:
    import torch
    from transformers import AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() and workload.device == "cuda"
                        else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    rows = bc.read_prompts(folder / "prompts.jsonl")[: workload.batch_prompts]
    prompts = [row["prompt"] for row in rows]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
    return Bench(name=workload.name, folder=folder, device=torch.device(device),
                 batch=len(prompts), group=workload.num_generations,
                 new_tokens=workload.max_completion_length, prompts=prompts,
                 answers=[row["answer"] for row in rows], prompt_ids=ids, tokenizer=tokenizer)


def sampling_kwargs(bench: Bench) -> dict[str, Any]:
    """Plain sampling, the same for every variant: temperature 1, top-k off, top-p off."""
    return dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=bench.new_tokens, eos_token_id=bench.tokenizer.eos_token_id,
                pad_token_id=bench.tokenizer.pad_token_id)


# ----------------------------------------------------------------------------- variants


def hf_variant(cache: str) -> Callable[[Bench, dict[str, Any]], Callable[[], list[int]]]:
    def setup(bench: Bench, info: dict[str, Any]) -> Callable[[], list[int]]:
        import torch
        from transformers import GenerationConfig

        model = bench.load_model(bench.generation_dtype())
        extra = {"cache_implementation": "static"} if cache == "static" else {}
        config = GenerationConfig(**sampling_kwargs(bench), num_return_sequences=bench.group,
                                  use_cache=True, **extra)
        lengths = {len(ids) for ids in bench.prompt_ids}
        if len(lengths) != 1:
            raise RuntimeError(f"the benchmark's prompts must have one length; got {lengths}")
        input_ids = torch.tensor(bench.prompt_ids, device=bench.device)
        mask = torch.ones_like(input_ids)
        eos = bench.tokenizer.eos_token_id
        info["model_dtype"] = str(model.dtype)

        def call() -> list[int]:
            with torch.no_grad():
                out = model.generate(input_ids=input_ids, attention_mask=mask,
                                     generation_config=config)
            completions = out[:, input_ids.shape[1]:]
            if bool((completions == eos).any()):
                raise AssertionError("a completion holds the eos id, which cannot be sampled")
            return [completions.shape[1]] * completions.shape[0]

        return call

    return setup


def engine_supports(option: str) -> bool:
    from maxent_grpo.rollout import HFGenerateEngine

    return option in inspect.signature(HFGenerateEngine).parameters


def ours_variant(cache: str, fp32_autocast: bool = False, bf16_copy: bool = False
                 ) -> Callable[[Bench, dict[str, Any]], Callable[[], list[int]]]:
    def setup(bench: Bench, info: dict[str, Any]) -> Callable[[], list[int]]:
        import torch

        from maxent_grpo.rollout import HFGenerateEngine, SamplingSettings

        options: dict[str, Any] = {"cache": cache,
                                   "prompt_bucket": STATIC_BUCKET if cache == "static" else 1}
        if bf16_copy:
            if not engine_supports("generation_dtype"):
                raise Unsupported("HFGenerateEngine has no generation_dtype option in this tree")
            options["generation_dtype"] = "bfloat16"
        dtype = torch.float32 if fp32_autocast else bench.generation_dtype()
        model = bench.load_model(dtype)
        sampling = SamplingSettings(max_new_tokens=bench.new_tokens, temperature=1.0,
                                    top_p=1.0, top_k=0)
        engine = HFGenerateEngine(model, bench.tokenizer, sampling, **options)
        info["engine_options"] = options
        info["model_dtype"] = str(model.dtype)
        amp = (torch.autocast(bench.device.type, dtype=torch.bfloat16) if fp32_autocast
               else contextlib.nullcontext())
        if fp32_autocast:
            info["autocast"] = "bfloat16"
        refreshes: list[float] = info.setdefault("refresh_s", []) if bf16_copy else []

        def call() -> list[int]:
            with amp:
                out = engine.generate(bench.prompts, bench.answers, bench.group)
            if bf16_copy:
                refreshes.append(engine.refresh_seconds)
            if bool(out.completion_ids.eq(bench.tokenizer.eos_token_id).any()):
                raise AssertionError("a completion holds the eos id, which cannot be sampled")
            return [int(n) for n in out.completion_mask.sum(dim=1).tolist()]

        return call

    return setup


def cb_config_fields() -> list[str]:
    """The fields of the installed transformers' ``ContinuousBatchingConfig``."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return [f.name for f in dataclasses.fields(ContinuousBatchingConfig)]


def cb_config(options: dict[str, Any]) -> Any:
    """A ``ContinuousBatchingConfig`` with ``options``; :class:`Unsupported` names any option
    the installed transformers does not have."""
    import transformers

    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError as error:
        raise Unsupported(f"transformers {transformers.__version__} has no "
                          f"ContinuousBatchingConfig ({error})") from error
    fields = set(cb_config_fields())
    missing = sorted(set(options) - fields)
    if missing:
        raise Unsupported(f"ContinuousBatchingConfig of transformers {transformers.__version__} "
                          f"has no option {', '.join(missing)}")
    return ContinuousBatchingConfig(**options)


def cb_page_size(fields: list[str]) -> int:
    """Tokens per page (``page_size``; ``block_size`` up to transformers 5.17)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    for name in ("page_size", "block_size"):
        value = getattr(ContinuousBatchingConfig(), name, None) if name in fields else None
        if isinstance(value, int):
            return value
    return 256


def cb_sized_blocks(bench: Bench) -> int:
    """Twice the pages the B*G sequences of P + T tokens need (no prefix sharing counted)."""
    pages = math.ceil((bench.prompt_len + bench.new_tokens) / cb_page_size(cb_config_fields()))
    return 2 * bench.batch * bench.group * pages


def cb_can_fork(model: Any) -> bool:
    """Whether ``generate_batch`` returns the G samples of a prompt forked with
    ``num_return_sequences`` (transformers >= 5.18: it collects the children's ids; 5.17
    samples them but returns the parents only). Otherwise each prompt is passed G times."""
    import transformers

    try:
        return "__child#" in inspect.getsource(type(model).generate_batch)
    except (OSError, TypeError):
        from packaging.version import Version

        return Version(transformers.__version__).release >= (5, 18)


def resolved_cb_settings(manager: Any) -> dict[str, Any]:
    """What the manager resolved its configuration to (the settings that matter here)."""
    config = getattr(manager, "continuous_batching_config", None)
    if config is None:
        return {}
    keys = ("page_size", "block_size", "num_blocks", "max_batch_tokens", "max_memory_percent",
            "max_requests_per_batch", "max_blocks_per_request", "use_cuda_graph",
            "use_async_batching", "varlen_compile_config", "decode_compile_config",
            "default_compile_level", "scheduler_type", "allow_block_sharing")
    out = {}
    for key in keys:
        value = getattr(config, key, None)
        if value is None:
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = {k: v for k, v in dataclasses.asdict(value).items() if not callable(v)}
        out[key] = value if isinstance(value, (int, float, str, bool, dict)) else str(value)
    return out


def cb_variant(options: dict[str, Any], persistent: bool, sized: bool
               ) -> Callable[[Bench, dict[str, Any]], Callable[[], list[int]]]:
    def setup(bench: Bench, info: dict[str, Any]) -> Callable[[], list[int]]:
        from transformers import GenerationConfig

        opts = dict(options)
        notes = []
        if not bench.cuda:
            dropped = [key for key in CUDA_ONLY_CB_OPTIONS if key in opts]
            for key in dropped:
                del opts[key]
            if dropped:
                notes.append(f"{bench.device.type}: {', '.join(dropped)} dropped (CUDA only)")
        if sized or not bench.cuda:
            opts["num_blocks"] = cb_sized_blocks(bench)
            if sized:
                opts["max_batch_tokens"] = max(bench.batch * bench.prompt_len,
                                               bench.batch * bench.group)
            else:
                notes.append(f"{bench.device.type}: num_blocks capped to {opts['num_blocks']}")
        config = cb_config(opts) if opts else None
        model = bench.load_model(bench.generation_dtype())
        if not callable(getattr(model, "generate_batch", None)):
            import transformers

            raise Unsupported(f"transformers {transformers.__version__} has no generate_batch")
        fork = cb_can_fork(model)
        group = bench.group if fork else 1
        inputs = bench.prompt_ids if fork else [ids for ids in bench.prompt_ids
                                                for _ in range(bench.group)]
        generation = GenerationConfig(**sampling_kwargs(bench), num_return_sequences=group)
        info["cb_options"] = {k: v for k, v in opts.items()}
        info["persistent_manager"] = persistent
        info["samples_via"] = ("num_return_sequences" if fork else
                               "each prompt passed G times (this generate_batch returns only "
                               "the first sample of a num_return_sequences request)")
        if notes:
            info["notes"] = notes
        seen: dict[str, Any] = {}
        original = model.init_continuous_batching

        def init_and_record(*args: Any, **kwargs: Any) -> Any:
            manager = original(*args, **kwargs)
            seen["manager"] = manager
            seen["attn"] = model.config._attn_implementation
            return manager

        model.init_continuous_batching = init_and_record  # generate_batch calls it on self
        kwargs: dict[str, Any] = {"generation_config": generation}
        if config is not None:
            kwargs["continuous_batching_config"] = config
        if persistent:
            kwargs["persistent_manager"] = True
        parameters = inspect.signature(model.generate_batch).parameters
        if "progress_bar" in parameters:
            kwargs["progress_bar"] = False
        unknown = [k for k in kwargs if k not in parameters and not any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())]
        if unknown:
            raise Unsupported(f"generate_batch takes no {', '.join(unknown)}")
        expected = bench.batch * bench.group

        def call() -> list[int]:
            outputs = model.generate_batch(inputs, **kwargs)
            if "manager" in seen:
                info["resolved"] = resolved_cb_settings(seen["manager"])
                info["attn_implementation"] = seen["attn"]
            errors = sorted({str(o.error) for o in outputs.values()
                             if getattr(o, "error", None)})
            if len(outputs) != expected or errors:
                raise AssertionError(f"continuous batching returned {len(outputs)} of {expected} "
                                     f"completions; errors: {errors[:3]}")
            eos = bench.tokenizer.eos_token_id
            if any(eos in o.generated_tokens for o in outputs.values()):
                raise AssertionError("a completion holds the eos id, which cannot be sampled")
            return [len(o.generated_tokens) for o in outputs.values()]

        def cleanup() -> None:
            """Stop a manager still running (a timeout can interrupt transformers' own stop)
            and free a persistent one, so that nothing runs beside the next variant."""
            manager = seen.get("manager")
            if manager is not None and manager.is_running():
                hard = "hard_stop" in inspect.signature(manager.stop).parameters
                manager.stop(block=True, timeout=60, **({"hard_stop": True} if hard else {}))
            destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
            if callable(destroy):
                destroy()

        info["_cleanup"] = cleanup
        return call

    return setup


VARIANTS: list[Variant] = [
    Variant("hf-dynamic", "hf dynamic", hf_variant("dynamic")),
    Variant("hf-static", "hf static", hf_variant("static")),
    Variant("ours-dynamic", "ours dynamic", ours_variant("dynamic")),
    Variant("ours-static", "ours static", ours_variant("static")),
    Variant("ours-fp32-autocast", "ours dynamic (fp32 weights + autocast)",
            ours_variant("dynamic", fp32_autocast=True)),
    Variant("ours-static-bf16copy", "ours static + bf16 copy (fp32 weights + autocast)",
            ours_variant("static", fp32_autocast=True, bf16_copy=True)),
    Variant("cb-default", "cb default", cb_variant({}, persistent=False, sized=False)),
    Variant("cb-persistent", "cb persistent, sized cache",
            cb_variant({}, persistent=True, sized=True)),
    Variant("cb-graphs", "cb persistent, sized, cuda graphs + async",
            cb_variant({"use_cuda_graph": True, "use_async_batching": True},
                       persistent=True, sized=True)),
    Variant("cb-compile", "cb persistent, sized, cuda graphs + async + compile",
            cb_variant({"use_cuda_graph": True, "use_async_batching": True,
                        "default_compile_level": 1}, persistent=True, sized=True)),
]
VARIANT_IDS = [v.id for v in VARIANTS]


# ----------------------------------------------------------------------------- running


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise :class:`VariantTimeout` in the main thread once ``seconds`` have passed: SIGALRM
    at the deadline and every second after it (an exception raised where Python ignores it,
    e.g. in a ``__del__``, is raised again), and the ``check()`` this yields, which the caller
    runs between calls. Without SIGALRM or off the main thread only ``check()`` works."""
    import threading

    deadline = time.monotonic() + seconds if seconds and seconds > 0 else None

    def check() -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise VariantTimeout(f"ran past --timeout {seconds:g} s")

    usable = (deadline is not None and hasattr(signal, "SIGALRM")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield check
        return

    def expire(signum: int, frame: Any) -> None:
        raise VariantTimeout(f"ran past --timeout {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield check
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def fresh_state(bench: Bench) -> None:
    import torch

    gc.collect()
    with contextlib.suppress(Exception):
        torch._dynamo.reset()
    if bench.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(bench.device)


def run_variant(bench: Bench, variant: Variant, repeats: int, timeout: float | None
                ) -> dict[str, Any]:
    """One variant: setup, a warm-up call, ``repeats`` timed calls; never raises (a failure
    or timeout is recorded as ``status`` and ``error``)."""
    import torch

    expected = bench.batch * bench.group
    info: dict[str, Any] = {}
    result: dict[str, Any] = {"name": variant.name, "status": "ok", "info": info,
                              "expected_completions": expected,
                              "expected_tokens": expected * bench.new_tokens}
    fresh_state(bench)
    base = torch.cuda.memory_allocated(bench.device) if bench.cuda else None

    def checked(call: Callable[[], list[int]], check: Callable[[], None]) -> tuple[float, int]:
        torch.manual_seed(len(result.setdefault("calls", [])))
        bench.sync()
        start = time.perf_counter()
        lengths = call()
        bench.sync()
        seconds = time.perf_counter() - start
        check()
        ok = len(lengths) == expected and all(n == bench.new_tokens for n in lengths)
        result["calls"].append({"seconds": seconds, "completions": len(lengths),
                                "tokens": sum(lengths), "all_T": ok})
        if not ok:
            raise AssertionError(f"{len(lengths)} completions of lengths "
                                 f"{sorted(set(lengths))[:5]}; expected {expected} of "
                                 f"{bench.new_tokens} tokens")
        return seconds, sum(lengths)

    try:
        with time_limit(timeout) as check:
            start = time.perf_counter()
            call = variant.setup(bench, info)
            result["setup_s"] = time.perf_counter() - start
            result["first_call_s"], _ = checked(call, check)
            timed = [checked(call, check) for _ in range(repeats)]
        seconds = [s for s, _ in timed]
        result["seconds"] = seconds
        result["median_s"] = bc.median(seconds)
        result["completion_tokens"] = timed[0][1] if timed else None
        result["exact_lengths"] = all(c["all_T"] for c in result["calls"])  # B*G x T, each call
        result["tokens_per_s"] = (bc.median([t / s for s, t in timed]) if timed else None)
    except Unsupported as error:
        result.update(status="unsupported", error=str(error))
    except VariantTimeout as error:
        result.update(status="timeout", error=str(error))
    except Exception as error:  # noqa: BLE001 - recorded; the other variants still run
        result.update(status="failed", error=f"{type(error).__name__}: {error}",
                      traceback=traceback.format_exc(limit=8))
    finally:
        cleanup = info.pop("_cleanup", None)
        if cleanup is not None:
            with contextlib.suppress(Exception):
                cleanup()
    if bench.cuda:
        result["peak_gib"] = torch.cuda.max_memory_allocated(bench.device) / 2**30
        result["base_gib"] = base / 2**30 if base is not None else None
    else:
        result["peak_gib"] = None
    if "refresh_s" in info and info["refresh_s"]:
        info["refresh_median_s"] = bc.median(info["refresh_s"][1:] or info["refresh_s"])
    return result


def note(result: dict[str, Any]) -> str:
    info = result.get("info", {})
    if result["status"] != "ok":
        text = result.get("error", "")
        return f"{result['status']}: {text[:160]}"
    parts = list(info.get("notes", []))
    if "refresh_median_s" in info:
        parts.append(f"copy refresh {info['refresh_median_s']:.4f} s/call")
    resolved = info.get("resolved")
    if resolved:
        graphs = resolved.get("use_cuda_graph")
        compiled = "varlen" if resolved.get("varlen_compile_config") else ""
        if resolved.get("decode_compile_config"):
            compiled = (compiled + "+decode").strip("+")
        parts.append(f"attn {info.get('attn_implementation')}, graphs {graphs}, "
                     f"async {resolved.get('use_async_batching')}, "
                     f"compile {compiled or 'none'}, blocks {resolved.get('num_blocks')}, "
                     f"max_batch_tokens {resolved.get('max_batch_tokens')}")
    if info.get("samples_via") and info["samples_via"] != "num_return_sequences":
        parts.append("each prompt passed G times")
    return "; ".join(parts)


def markdown(report: dict[str, Any]) -> str:
    shape = report["shape"]
    title = (f"{report['workload']} on {shape['device']} ({shape['B']} prompts x G {shape['G']}"
             f" x T {shape['T']}, P {shape['P']}, {shape['dtype']})")
    if shape["device"] != "cuda":
        title += ": CPU tiny shape, meaningless for GPU speed"
    rows = [title, "", "| variant | first call s | median s | tokens/s | peak GiB | note |",
            "|---|---:|---:|---:|---:|---|"]

    def num(value: Any, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    for result in report["variants"].values():
        rows.append(f"| {result['name']} | {num(result.get('first_call_s'), '.3f')} | "
                    f"{num(result.get('median_s'), '.3f')} | "
                    f"{num(result.get('tokens_per_s'), ',.0f')} | "
                    f"{num(result.get('peak_gib'), '.2f')} | {note(result)} |")
    return "\n".join(rows)


def git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=bc.REPO_DIR, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=bc.REPO_DIR, text=True, capture_output=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def machine_info(bench: Bench) -> dict[str, Any]:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(),
            "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(bench.device) if bench.cuda else None}
    return info


def library_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = bc.versions("torch", "transformers")
    for name in ("flash_attn", "kernels"):
        try:
            out[name] = bc.versions(name)[name]
        except Exception:  # noqa: BLE001 - absent or broken: recorded as None
            out[name] = None
    return out


def parse_variants(text: str | None) -> list[Variant]:
    """The variants named in ``text``: ids, or families (``hf``, ``ours``, ``cb``), comma-
    separated; all of them for None or empty."""
    if not text:
        return list(VARIANTS)
    wanted = [part.strip() for part in text.split(",") if part.strip()]

    def selects(item: str, vid: str) -> bool:
        return vid == item or vid.startswith(item + "-")

    unknown = [w for w in wanted if not any(selects(w, vid) for vid in VARIANT_IDS)]
    if unknown:
        raise SystemExit(f"unknown variant {', '.join(unknown)}; choose from "
                         f"{', '.join(VARIANT_IDS)} (or a family: hf, ours, cb)")
    return [v for v in VARIANTS if any(selects(w, v.id) for w in wanted)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpu")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variant ids (default: all; see --list)")
    parser.add_argument("--list", action="store_true", help="print the variant ids and exit")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per variant")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds per variant (setup, warm-up and timed calls)")
    parser.add_argument("--device", default=None,
                        help="default: cuda for the GPU shape when available, else cpu")
    parser.add_argument("--workload-dir", type=Path, default=None,
                        help="an already prepared workload folder (default: prepare it under "
                        "benchmarks/.cache)")
    parser.add_argument("--out", type=Path,
                        default=bc.BENCH_DIR / "results" / "gpu_generate.json")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other variants already in --out (same workload and "
                        "shape): a run split into several commands fills one JSON")
    args = parser.parse_args(argv)
    if args.list:
        for variant in VARIANTS:
            print(f"{variant.id:22s} {variant.name}")
        return {}
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    variants = parse_variants(args.variants)

    started = time.perf_counter()
    workload = bc.WORKLOADS[SHAPES[args.shape]]
    if args.workload_dir is None:
        print(f"preparing {workload.name} ...", flush=True)
        folder = bc.prepare_workload(workload)
    else:
        folder = args.workload_dir
    bench = load_bench(workload, folder, args.device)
    shape = {"B": bench.batch, "G": bench.group, "T": bench.new_tokens, "P": bench.prompt_len,
             "device": bench.device.type, "dtype": str(bench.generation_dtype()),
             "completion_tokens_per_rollout": bench.batch * bench.group * bench.new_tokens}
    results: dict[str, Any] = {}
    if args.merge and args.out.is_file():  # keep the other variants of an earlier run
        earlier = json.loads(args.out.read_text())
        if earlier.get("workload") == workload.name and earlier.get("shape") == shape:
            results.update(earlier.get("variants", {}))
    report: dict[str, Any] = {
        "workload": workload.name,
        "shape": shape,
        "repeats": args.repeats,
        "machine": machine_info(bench),
        "versions": library_versions(),
        "commit": git_commit(),
        "cb_config_fields": _safe(cb_config_fields),
        "variants": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for variant in variants:
        print(f"running {variant.id} ...", flush=True)
        r = run_variant(bench, variant, args.repeats, args.timeout)
        r["date"] = dt.datetime.now().astimezone().isoformat(timespec="seconds")
        results[variant.id] = r
        print(f"  {r['status']}: first {r.get('first_call_s', float('nan')):.3f} s, median "
              f"{r.get('median_s', float('nan')):.3f} s" if r["status"] == "ok"
              else f"  {r['status']}: {r.get('error')}", flush=True)
        report["total_s"] = time.perf_counter() - started
        # written after every variant: a run stopped from outside keeps what it measured
        args.out.write_text(json.dumps(report, indent=1, default=str))
    report["variants"] = {v.id: results[v.id] for v in VARIANTS if v.id in results}
    report["total_s"] = time.perf_counter() - started
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(markdown(report))
    print(f"\n{report['total_s']:.0f} s in all; JSON: {args.out}")
    return report


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - recorded instead
        return f"{type(error).__name__}: {error}"


if __name__ == "__main__":
    main()
