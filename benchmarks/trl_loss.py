"""TRL's own GRPO loss on given tensors: the other side of tests/objectives/test_trl_equivalence.py.

Run with a Python that has TRL (``benchmarks/.venv-trl``, made by ``setup_trl_venv.sh``)::

    benchmarks/.venv-trl/bin/python benchmarks/trl_loss.py cases.pt out.pt

``cases.pt`` holds a list of cases, each a dict of float64 tensors (``logps``, ``old``,
``ref`` or None, ``mask``, ``advantages``) and TRL options (``loss_type``,
``importance_sampling_level``, ``beta``, ``epsilon_low``, ``epsilon_high``,
``max_completion_length``, ``use_bias_correction_kl``: TRL's default True when absent).
For each case this calls ``GRPOTrainer._compute_loss`` itself, on a trainer shell whose
log-prob method returns the case's ``logps`` (so no model and no generation run), and
writes ``[{"loss": float, "grad": (N, T) tensor}, ...]``.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from types import SimpleNamespace

import torch


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, tensor):
        return tensor

    def gather_for_metrics(self, tensor):
        return tensor

    def reduce(self, tensor, reduction="sum"):
        return tensor


def _args(**overrides):
    """TRL's GRPOConfig defaults for the options _compute_loss reads (as plain values)."""
    from trl import GRPOConfig

    defaults = GRPOConfig.__dataclass_fields__
    values = {name: f.default for name, f in defaults.items() if not callable(f.default)}
    values.update(overrides)
    return SimpleNamespace(**values)


def trl_loss(case: dict) -> dict:
    from trl import GRPOTrainer

    logps = case["logps"].clone().requires_grad_(True)
    n, T = logps.shape
    trainer = object.__new__(GRPOTrainer)
    options = {
        "loss_type": case["loss_type"],
        "importance_sampling_level": case.get("importance_sampling_level", "token"),
        "beta": case.get("beta", 0.0),
        "epsilon_low": case.get("epsilon_low", 0.2),
        "epsilon_high": case.get("epsilon_high", 0.2),
        "max_completion_length": case["max_completion_length"],
        "top_entropy_quantile": 1.0,
        "off_policy_mask_threshold": None,
        "use_vllm": False,
        "vllm_importance_sampling_correction": False,
        "aux_loss_enabled": False,
        "_entropy_bonus_enabled": False,
        "use_adaptive_entropy": False,
        "current_gradient_accumulation_steps": 1,
    }
    for name, value in options.items():
        setattr(trainer, name, value)
    correction = case.get("use_bias_correction_kl", True)
    trainer.__dict__["args"] = _args(use_bias_correction_kl=correction,
                                     epsilon=options["epsilon_low"],
                                     epsilon_high=options["epsilon_high"],
                                     beta=options["beta"], loss_type=options["loss_type"],
                                     steps_per_generation=1, gradient_accumulation_steps=1)
    trainer.__dict__["accelerator"] = _Accelerator()
    trainer.__dict__["model"] = SimpleNamespace(training=True)
    trainer.__dict__["_metrics"] = {"train": defaultdict(list), "eval": defaultdict(list)}
    entropies = torch.zeros_like(logps)
    trainer._get_per_token_logps_and_entropies = (  # the model's forward, replaced
        lambda *a, **k: (logps, entropies, None))
    mask = case["mask"].to(torch.int64)
    inputs = {
        "prompt_ids": torch.zeros(n, 1, dtype=torch.int64),
        "prompt_mask": torch.ones(n, 1, dtype=torch.int64),
        "completion_ids": torch.zeros(n, T, dtype=torch.int64),
        "completion_mask": mask,
        "advantages": case["advantages"],
        "old_per_token_logps": case["old"],
        "num_items_in_batch": mask.sum(),
    }
    if case.get("ref") is not None:
        inputs["ref_per_token_logps"] = case["ref"]
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    return {"loss": float(loss), "grad": logps.grad.detach().clone()}


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    cases = torch.load(sys.argv[1], weights_only=False)
    results = [trl_loss(case) for case in cases]
    import trl

    torch.save({"trl": trl.__version__, "results": results}, sys.argv[2])


if __name__ == "__main__":
    main()
