"""Our objectives against TRL's own ``GRPOTrainer._compute_loss`` on the same float64 tensors.

TRL runs in its own environment (``bash benchmarks/setup_trl_venv.sh`` makes
``benchmarks/.venv-trl``; ``MAXENT_GRPO_TRL_PYTHON`` names another interpreter), called once
for every case through ``benchmarks/trl_loss.py``; the test is skipped, saying so, where no
TRL is installed. Cases: the four reductions with both clip bounds and the KL term, GSPO's
sequence-level ratio (TRL ``importance_sampling_level="sequence"``) and CISPO (TRL
``loss_type="cispo"``, whose ``epsilon_high`` is our ``1 + epsilon_high``). Loss and
gradient must agree to 1e-6 (they agree to float64 rounding).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from maxent_grpo.objectives import GRPO
from tests.objectives.conftest import F64, _logps, _mask, _mb

ROOT = Path(__file__).resolve().parents[2]
TRL_VENV_PYTHON = ROOT / "benchmarks" / ".venv-trl" / "bin" / "python"


def _trl_python() -> str | None:
    named = os.environ.get("MAXENT_GRPO_TRL_PYTHON")
    if named:
        return named
    try:
        import trl  # noqa: F401

        return sys.executable
    except ImportError:
        # setup_trl_venv.sh marks a finished install: a half-made environment (an install
        # still under way, as in .ci/run, or one that failed) counts as none
        finished = (TRL_VENV_PYTHON.parents[1] / ".installed").exists()
        return str(TRL_VENV_PYTHON) if finished else None


#: (our GRPO options, TRL's options): one case each. TRL 1.16 multiplies the KL by the ratio
#: by default (``use_bias_correction_kl``), ours with ``kl_bias_correction``: both are checked.
CASES = [
    *[({"loss_type": lt, "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.04},
       {"loss_type": lt, "epsilon_low": 0.2, "epsilon_high": 0.28, "beta": 0.04,
        "use_bias_correction_kl": False})
      for lt in ("grpo", "bnpo", "dr_grpo", "dapo")],
    *[({"loss_type": lt, "beta": 0.04, "kl_bias_correction": True},
       {"loss_type": lt, "beta": 0.04}) for lt in ("grpo", "dapo")],
    ({"loss_type": "grpo", "beta": 0.04, "ratio_level": "sequence", "kl_bias_correction": True},
     {"loss_type": "grpo", "beta": 0.04, "importance_sampling_level": "sequence"}),
    *[({"loss_type": lt, "ratio_level": "sequence", "epsilon": 0.05, "epsilon_high": 0.08},
       {"loss_type": lt, "importance_sampling_level": "sequence", "epsilon_low": 0.05,
        "epsilon_high": 0.08}) for lt in ("grpo", "dapo")],
    ({"loss_type": "grpo", "ratio_level": "sequence", "beta": 0.04},
     {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.04,
      "use_bias_correction_kl": False}),
    ({"loss_type": "dapo", "clip_rule": "cispo", "epsilon_high": 0.1},
     {"loss_type": "cispo", "epsilon_high": 1.1}),
    ({"loss_type": "dapo", "clip_rule": "cispo", "epsilon_high": 0.1, "beta": 0.04},
     {"loss_type": "cispo", "epsilon_high": 1.1, "beta": 0.04, "use_bias_correction_kl": False}),
]

N, T, T_MAX = 6, 5, 7


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    mask = _mask([5, 2, 3, 1, 4, 5], T)
    logps = _logps(seed, N, T)
    # old and ref differ enough that clipping is active for some tokens
    old = logps + 1.0 * (torch.rand(N, T, generator=torch.Generator().manual_seed(seed + 1),
                                    dtype=F64) - 0.5)
    ref = logps - 0.2 * torch.rand(N, T, generator=torch.Generator().manual_seed(seed + 2),
                                   dtype=F64)
    advantages = torch.tensor([1.0, -0.7, 0.3, -1.2, 0.9, -0.3], dtype=F64)
    return {"logps": logps, "old": old, "ref": ref, "mask": mask, "advantages": advantages}


def _ours(options: dict, tensors: dict) -> tuple[float, torch.Tensor, float]:
    objective = GRPO(**options)
    logps = tensors["logps"].clone().requires_grad_(True)
    mb = _mb(logps, tensors["mask"], G=2, num_rows=N, t_max=T_MAX,
             advantages=tensors["advantages"], old=tensors["old"],
             ref=tensors["ref"] if objective.beta > 0 else None,
             num_global_tokens=tensors["mask"].sum().to(F64))
    out = objective.loss(mb)
    out.loss.backward()
    clipped, tokens = out.sums["clip/total"]
    return out.loss.item(), logps.grad, float(clipped / tokens)


def test_our_losses_and_gradients_equal_trls(tmp_path):
    python = _trl_python()
    if python is None:
        why = ("TRL is not installed here (or its install has not finished): bash "
               "benchmarks/setup_trl_venv.sh makes benchmarks/.venv-trl, or set "
               "MAXENT_GRPO_TRL_PYTHON")
        if os.environ.get("MAXENT_GRPO_REQUIRE_TRL"):  # .ci/run installed it: no skipping
            pytest.fail(why)
        pytest.skip(why)
    cases, ours = [], []
    for k, (our_options, trl_options) in enumerate(CASES):
        tensors = _tensors(10 * k)
        beta = trl_options.get("beta", 0.0)
        cases.append({**tensors, **trl_options, "ref": tensors["ref"] if beta else None,
                      "max_completion_length": T_MAX})
        ours.append(_ours(our_options, tensors))
    torch.save(cases, tmp_path / "cases.pt")
    run = subprocess.run(
        [python, str(ROOT / "benchmarks" / "trl_loss.py"), str(tmp_path / "cases.pt"),
         str(tmp_path / "out.pt")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt", weights_only=False)
    for (our_options, _), (loss, grad, clipped), trl in zip(CASES, ours, theirs["results"],
                                                             strict=True):
        if "epsilon" in our_options or "clip_rule" in our_options:  # the clip is active
            assert 0 < clipped < 1, (our_options, clipped)
        assert abs(loss - trl["loss"]) <= 1e-6 * max(1.0, abs(loss)), (our_options, loss, trl)
        assert torch.allclose(grad, trl["grad"], rtol=1e-6, atol=1e-9), our_options
        assert grad.abs().sum() > 0  # a gradient that could have differed
