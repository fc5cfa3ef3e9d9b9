"""Two nodes on one machine: ``--trainer.num_nodes 2`` run as two ``python -m maxent_grpo fit``
processes on localhost (``NODE_RANK`` 0 and 1, ``MASTER_ADDR``/``MASTER_PORT``: Lightning's
own environment, as a cluster would set it), under DDP and FSDP2.

For each strategy, four runs of one small configuration (the tiny model sampling with the
Hugging Face engine, 4 steps, a checkpoint every step):

- ``local``: one node with 2 processes (Lightning launches the second);
- ``nodes``: 2 nodes x 1 process;
- ``killed``: 2 nodes x 1 process, both SIGKILLed as step 3 starts (step 2's checkpoint is
  on disk);
- ``resumed``: the killed run continued with ``--ckpt_path last`` on 2 nodes.

The 2-node run must train exactly what the 2-process run trains (the same ranks with the
same seeds: bit-identical weights; that a 2-process step equals a 1-process step over the
same prompts is ``tests/test_distributed.py``), write its checkpoint once (the same files as
the 2-process run, none doubled), and the killed-and-resumed run must end bit-identical to
it. About 4 minutes on 2 cores: marked slow (``make test-all``; ``.ci/run`` runs it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
STEPS, KILL_AFTER = 4, 2
#: the most one run may take before it counts as hung (it takes ~30 s)
HANG = 300

pytestmark = pytest.mark.slow

STRATEGIES = {
    "ddp": "ddp",
    "fsdp": {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
             "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1}},
}


def config(run: Path, strategy: str, nodes: int, kill: bool) -> dict[str, Any]:
    callbacks: list[dict[str, Any]] = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(run / "ckpt"), "save_last": True,
                       "every_n_train_steps": 1, "save_top_k": 1}},
    ]
    if kill:
        callbacks.append({"class_path": "test_resume.KillAt", "init_args": {"step": KILL_AFTER}})
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 2 // nodes, "num_nodes": nodes,
            "strategy": STRATEGIES[strategy], "max_steps": STEPS, "logger": False,
            "enable_progress_bar": False, "enable_model_summary": False,
            "limit_val_batches": 0, "num_sanity_val_steps": 0,
            "default_root_dir": str(run), "callbacks": callbacks,
        },
        "model": {
            "model_name_or_path": "builtin:tiny",
            "model_cache_dir": str(run.parent / "models"),
            "objective": {"class_path": "maxent_grpo.objectives.GRPO",
                          "init_args": {"loss_type": "dr_grpo", "beta": 0.04}},
            "rewards": {"first_number": 1.0},
            "num_generations": 4,
            "max_completion_length": 4,
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}},
        },
        "data": {
            "task": "arithmetic_easy", "task_options": {"bare": True},
            "train_size": 24, "val_size": 2, "batch_size": 2, "max_prompt_length": 32,
        },
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run: Path, strategy: str, nodes: int, kill: bool = False,
           *extra: str) -> list[subprocess.CompletedProcess]:
    """Fit the configuration as ``nodes`` node processes (or one that launches the second
    rank itself); each in its own session, killed with its children if it hangs."""
    run.mkdir(parents=True, exist_ok=True)
    path = run / ("config_kill.yaml" if kill else "config.yaml")
    path.write_text(yaml.safe_dump(config(run, strategy, nodes, kill), sort_keys=False))
    port = str(free_port())
    env = {k: v for k, v in os.environ.items()
           if k not in ("NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    cmd = [sys.executable, "-m", "maxent_grpo", "fit", "--config", str(path), *extra]
    procs = []
    try:
        for node in range(nodes):
            procs.append(subprocess.Popen(
                cmd, cwd=run, env={**env, "NODE_RANK": str(node)}, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, start_new_session=True))
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=HANG)
            results.append(subprocess.CompletedProcess(cmd, proc.returncode, out))
        return results
    except subprocess.TimeoutExpired:
        pytest.fail(f"{run.name}: a node hung past {HANG} s (a collective one rank never "
                    "joined?)")
    finally:
        for proc in procs:  # the sessions, with any rank Lightning launched
            if proc.poll() is None:
                with _quiet():
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()


class _quiet:
    def __enter__(self) -> None:
        pass

    def __exit__(self, kind, value, tb) -> bool:
        return kind is ProcessLookupError


def weights(run: Path) -> dict[str, torch.Tensor]:
    """The module's parameters in ``run``'s last checkpoint: a file (DDP) or a distributed
    checkpoint folder of one shard per rank (FSDP2), read back whole."""
    last = run / "ckpt" / "last.ckpt"
    if last.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        assert sorted(p.name for p in last.iterdir()) == [".metadata", "__0_0.distcp",
                                                          "__1_0.distcp", "meta.pt"]
        meta = torch.load(last / "meta.pt", weights_only=False, map_location="cpu")
        assert meta["global_step"] == STEPS
        whole = run / "whole.pt"
        dcp_to_torch_save(last, whole)
        state = torch.load(whole, weights_only=False, map_location="cpu")
    else:
        state = torch.load(last, weights_only=False, map_location="cpu")
        assert state["global_step"] == STEPS
    return {k: v for k, v in state["state_dict"].items() if k.startswith("policy.")}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_two_nodes_train_as_two_processes_and_resume_exactly(tmp_path, strategy):
    local = launch(tmp_path / "local", strategy, nodes=1)
    assert local[0].returncode == 0, local[0].stdout[-3000:]
    nodes = launch(tmp_path / "nodes", strategy, nodes=2)
    for node, result in enumerate(nodes):
        assert result.returncode == 0, (node, result.stdout[-3000:])
        assert f"`max_steps={STEPS}` reached" in result.stdout or node == 1
    # Lightning saw one world of 2 ranks over 2 nodes
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in nodes[0].stdout
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in nodes[1].stdout

    # written once: the same checkpoint files as the 2-process run, none doubled ("-v1")
    names = sorted(p.name for p in (tmp_path / "nodes" / "ckpt").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "local" / "ckpt").iterdir())
    assert not any("-v" in n for n in names), names

    expected = weights(tmp_path / "local")
    got = weights(tmp_path / "nodes")
    assert got.keys() == expected.keys() and len(got) > 0
    for name, value in expected.items():
        assert torch.equal(got[name], value), name

    killed = launch(tmp_path / "resumed", strategy, 2, True)
    assert [r.returncode for r in killed] == [-signal.SIGKILL] * 2, killed[0].stdout[-3000:]
    resumed = launch(tmp_path / "resumed", strategy, 2, False, "--ckpt_path", "last")
    for node, result in enumerate(resumed):
        assert result.returncode == 0, (node, result.stdout[-3000:])
    assert "Restored all states" in resumed[0].stdout
    again = weights(tmp_path / "resumed")
    for name, value in expected.items():
        assert torch.equal(again[name], value), name
