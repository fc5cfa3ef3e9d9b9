"""Controller update rules (docs/ALGORITHM.md §4.2 and §5), steps computed by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest

from maxent_grpo.core.control import (
    BetaUpdate,
    MetaUpdate,
    TauUpdate,
    beta_update,
    entropy_gate_multiplier,
    entropy_target_at,
    meta_update,
    tau_update,
)

NAN, INF = float("nan"), float("inf")

# ---------------------------------------------------------------- tau controller

TAU = {"target_entropy": 1.5, "lr": 0.2, "tau_min": 0.01, "tau_max": 10.0}


def test_tau_first_observation_then_second_step_by_hand() -> None:
    first = tau_update(tau_log=0.0, entropy_ema=None, weight_entropy=1.0, **TAU)
    # EMA starts at H_w = 1.0; log tau = 0 + 0.2 * (1.5 - 1.0) = 0.1.
    assert first.entropy_ema == 1.0
    assert first.tau_log == pytest.approx(0.1, abs=1e-15)
    assert first.tau == pytest.approx(math.exp(0.1), rel=1e-15)
    second = tau_update(
        tau_log=first.tau_log, entropy_ema=first.entropy_ema, weight_entropy=2.0, **TAU
    )
    # EMA = 0.9 * 1.0 + 0.1 * 2.0 = 1.1; log tau = 0.1 + 0.2 * (1.5 - 1.1) = 0.18.
    assert second.entropy_ema == pytest.approx(1.1, abs=1e-15)
    assert second.tau_log == pytest.approx(0.18, abs=1e-15)
    assert second.tau == pytest.approx(math.exp(0.18), rel=1e-15)


def test_tau_direction_too_little_entropy_raises_tau() -> None:
    low = tau_update(tau_log=0.0, entropy_ema=0.5, weight_entropy=0.5, **TAU)
    high = tau_update(tau_log=0.0, entropy_ema=2.5, weight_entropy=2.5, **TAU)
    assert low.tau > 1.0 > high.tau


def test_tau_clipping_resyncs_log() -> None:
    up = tau_update(
        tau_log=math.log(9.9), entropy_ema=0.0, weight_entropy=0.0, **{**TAU, "lr": 5.0}
    )
    assert up.tau == 10.0 and up.tau_log == math.log(10.0)
    # No wind-up: one step with the error reversed leaves the bound at once.
    back = tau_update(tau_log=up.tau_log, entropy_ema=1.6, weight_entropy=1.6, **TAU)
    assert back.tau < 10.0
    assert back.tau_log == pytest.approx(math.log(10.0) + 0.2 * (1.5 - 1.6), abs=1e-15)
    down = tau_update(tau_log=0.0, entropy_ema=100.0, weight_entropy=100.0, **TAU)
    assert down.tau == 0.01 and down.tau_log == math.log(0.01)


def test_tau_warmup_updates_ema_only() -> None:
    out = tau_update(tau_log=0.3, entropy_ema=1.0, weight_entropy=2.0, in_warmup=True, **TAU)
    assert out == TauUpdate(tau=math.exp(0.3), tau_log=0.3, entropy_ema=pytest.approx(1.1))
    first = tau_update(tau_log=0.3, entropy_ema=None, weight_entropy=0.7, in_warmup=True, **TAU)
    assert first.entropy_ema == 0.7 and first.tau_log == 0.3


def test_tau_custom_decay_and_frozen_result() -> None:
    out = tau_update(tau_log=0.0, entropy_ema=1.0, weight_entropy=3.0, ema_decay=0.5, **TAU)
    assert out.entropy_ema == 2.0  # 0.5 * 1 + 0.5 * 3
    assert out.tau_log == pytest.approx(0.2 * (1.5 - 2.0), abs=1e-15)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.tau = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"weight_entropy": NAN}, "weight_entropy must be finite"),
        ({"weight_entropy": INF}, "weight_entropy must be finite"),
        ({"entropy_ema": NAN}, "entropy_ema must be finite"),
        ({"tau_log": INF}, "tau_log must be finite"),
        ({"target_entropy": NAN}, "target_entropy must be finite"),
        ({"lr": -0.1}, "lr must be >= 0"),
        ({"tau_min": 0.0}, "tau_min must be > 0"),
        ({"tau_min": 2.0, "tau_max": 1.0}, "tau_max must be >= tau_min"),
        ({"tau_max": INF}, "tau_max must be finite"),
        ({"ema_decay": 1.0}, r"ema_decay must be in \[0, 1\)"),
        ({"ema_decay": -0.1}, "ema_decay must be >= 0"),
    ],
)
def test_tau_validation(override: dict, match: str) -> None:
    kwargs = {"tau_log": 0.0, "entropy_ema": 1.0, "weight_entropy": 1.0, **TAU, **override}
    with pytest.raises(ValueError, match=match):
        tau_update(**kwargs)


def test_entropy_target_anneal() -> None:
    at = [entropy_target_at(s, start=2.0, final=1.0, horizon=10) for s in (0, 5, 10, 20)]
    assert at == [2.0, 1.5, 1.0, 1.0]
    assert entropy_target_at(7, start=2.0) == 2.0
    assert entropy_target_at(7, start=2.0, final=1.0, horizon=0) == 2.0
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        entropy_target_at(-1, start=2.0)
    with pytest.raises(ValueError, match="horizon must be an integer >= 0"):
        entropy_target_at(0, start=2.0, final=1.0, horizon=-5)
    with pytest.raises(ValueError, match="final must be finite"):
        entropy_target_at(0, start=2.0, final=NAN, horizon=5)


# ---------------------------------------------------------------- beta controller

BETA = {"kl_target": 0.1, "horizon": 10.0, "step_bound": 0.2}


def test_beta_steps_by_hand() -> None:
    # KL/KL* - 1 = 1 clipped to 0.2: beta = 0.1 * (1 + 0.2 / 10) = 0.102.
    up = beta_update(beta=0.1, kl=0.2, **BETA)
    assert up.error == 0.2 and up.beta == pytest.approx(0.102, abs=1e-15)
    # KL/KL* - 1 = -0.1 (unclipped): beta = 0.1 * (1 - 0.01) = 0.099.
    down = beta_update(beta=0.1, kl=0.09, **BETA)
    assert down.error == pytest.approx(-0.1, abs=1e-12)
    assert down.beta == pytest.approx(0.099, abs=1e-12)
    assert isinstance(down, BetaUpdate)


@pytest.mark.parametrize("kl", [NAN, INF, -INF])
def test_beta_non_finite_kl_counts_as_above(kl: float) -> None:
    out = beta_update(beta=0.1, kl=kl, **BETA)
    assert out.error == 0.2 and out.beta == pytest.approx(0.102, abs=1e-15)


def test_beta_never_negative() -> None:
    # horizon 0.1, bound 0.5, KL = 0: 1 + (-0.5 / 0.1) = -4 -> clamped to 0.
    assert beta_update(beta=0.3, kl=0.0, kl_target=0.1, horizon=0.1, step_bound=0.5).beta == 0.0
    assert beta_update(beta=0.0, kl=1.0, **BETA).beta == 0.0


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"beta": -0.1}, "beta must be >= 0"),
        ({"kl_target": 0.0}, "kl_target must be > 0"),
        ({"horizon": 0.0}, "horizon must be > 0"),
        ({"step_bound": -1.0}, "step_bound must be > 0"),
        ({"kl": "x"}, "kl must be a number"),
    ],
)
def test_beta_validation(override: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        beta_update(**{"beta": 0.1, "kl": 0.1, **BETA, **override})


# ---------------------------------------------------------------- meta controller

META = {
    "target_entropy": 1.0,
    "kl_target": 0.1,
    "lr_tau": 0.5,
    "lr_beta": 0.1,
    "tau_min": 0.1,
    "tau_max": 5.0,
    "kl_clip": 0.1,
}


def test_meta_step_by_hand() -> None:
    out = meta_update(tau=1.0, beta=0.1, weight_entropy=0.8, kl=0.3, **META)
    # tau_grad = 0.8 - 1.0 = -0.2 -> tau = 1 + 0.5 * 0.2 = 1.1 (too little entropy raises tau);
    # beta_grad = clip(0.3 - 0.1, -0.1, 0.1) = 0.1 -> beta = 0.1 + 0.1 * 0.1 = 0.11.
    assert out.tau_grad == pytest.approx(-0.2, abs=1e-15)
    assert out.beta_grad == pytest.approx(0.1, abs=1e-15)
    assert out.tau == pytest.approx(1.1, abs=1e-15)
    assert out.beta == pytest.approx(0.11, abs=1e-15)
    assert isinstance(out, MetaUpdate)


def test_meta_clipping_and_non_negative_beta() -> None:
    high = meta_update(tau=4.9, beta=0.1, weight_entropy=-10.0, kl=0.1, **META)
    assert high.tau == 5.0
    low = meta_update(tau=0.2, beta=0.1, weight_entropy=10.0, kl=0.1, **META)
    assert low.tau == 0.1
    # beta_grad = clip(0 - 0.1) = -0.1 with lr_beta 1: 0.005 - 0.1 < 0 -> 0.
    zero = meta_update(tau=1.0, beta=0.005, weight_entropy=1.0, kl=0.0, **{**META, "lr_beta": 1.0})
    assert zero.beta == 0.0 and zero.beta_grad == -0.1
    nan = meta_update(tau=1.0, beta=0.1, weight_entropy=1.0, kl=NAN, **META)
    assert nan.beta_grad == 0.1 and nan.beta == pytest.approx(0.11, abs=1e-15)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"weight_entropy": NAN}, "weight_entropy must be finite"),
        ({"beta": -1.0}, "beta must be >= 0"),
        ({"lr_tau": -1.0}, "lr_tau must be >= 0"),
        ({"lr_beta": -1.0}, "lr_beta must be >= 0"),
        ({"kl_clip": 0.0}, "kl_clip must be > 0"),
        ({"tau_min": 0.0}, "tau_min must be > 0"),
        ({"tau_max": 0.05}, "tau_max must be >= tau_min"),
    ],
)
def test_meta_validation(override: dict, match: str) -> None:
    kwargs = {"tau": 1.0, "beta": 0.1, "weight_entropy": 1.0, "kl": 0.1, **META, **override}
    with pytest.raises(ValueError, match=match):
        meta_update(**kwargs)


# ---------------------------------------------------------------- entropy gate (section 4.2)

GATE = {"kappa": 0.1, "gain": 2.0, "m_lo": 0.1, "m_hi": 2.5}


def test_gate_by_hand() -> None:
    assert entropy_gate_multiplier(0.05, **GATE) == pytest.approx(2.0)  # 1 + 2 * 0.05 / 0.1
    assert entropy_gate_multiplier(0.0, **GATE) == 2.5  # 1 + 2 = 3, clipped to m_hi
    assert entropy_gate_multiplier(0.1, **GATE) == 1.0
    assert entropy_gate_multiplier(0.2, **GATE) == pytest.approx(1 / 3)  # 1 / (1 + 2 * 1)
    assert entropy_gate_multiplier(1.0, **GATE) == 0.1  # 1 / 19, clipped to m_lo
    assert entropy_gate_multiplier(5.0, **{**GATE, "gain": 0.0}) == 1.0


def test_gate_disable_outside_trust_zone() -> None:
    kw = {**GATE, "disable_outside_trust_zone": True}
    assert entropy_gate_multiplier(0.2, **kw) == 0.0  # not clipped up to m_lo
    assert entropy_gate_multiplier(0.05, **kw) == pytest.approx(2.0)
    assert entropy_gate_multiplier(0.1, **kw) == 1.0
    assert entropy_gate_multiplier(NAN, **kw) == 0.0


@pytest.mark.parametrize("kl", [NAN, INF])
def test_gate_non_finite_kl_counts_as_above(kl: float) -> None:
    assert entropy_gate_multiplier(kl, **GATE) == 0.1  # limit 0, clipped to m_lo
    assert entropy_gate_multiplier(kl, **{**GATE, "m_lo": 0.0}) == 0.0
    assert entropy_gate_multiplier(kl, **{**GATE, "gain": 0.0}) == 1.0


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"kappa": 0.0}, "kappa must be > 0"),
        ({"gain": -1.0}, "gain must be >= 0"),
        ({"m_lo": -0.1}, "m_lo must be >= 0"),
        ({"m_lo": 2.0, "m_hi": 1.0}, "m_hi must be >= m_lo"),
        ({"m_hi": NAN}, "m_hi must be finite"),
    ],
)
def test_gate_validation(override: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        entropy_gate_multiplier(0.1, **{**GATE, **override})
