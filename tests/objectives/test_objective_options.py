"""The objectives' options, flags and checkpointed state."""

from __future__ import annotations

import math
import re

import pytest

from maxent_grpo.objectives import GRPO, EntropyMaxEnt, GroupMaxEnt, ListwiseMaxEnt

# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "ppo"}, r"objective\.loss_type.*'grpo', 'bnpo', 'dr_grpo', 'dapo'"),
        ({"scale_rewards": "std"}, r"objective\.scale_rewards.*'group', 'batch', 'none'"),
        ({"epsilon": 1.0}, r"objective\.epsilon must be in \[0, 1\)"),
        ({"epsilon": -0.1}, r"objective\.epsilon must be in \[0, 1\)"),
        ({"epsilon_high": -0.1}, r"objective\.epsilon_high must be a finite number >= 0"),
        ({"kl_estimator": "k4"}, r"objective\.kl_estimator.*'k1', 'k2', 'k3'"),
        ({"beta": -0.1}, r"objective\.beta must be a finite number >= 0"),
        ({"beta": math.nan}, r"objective\.beta"),
        ({"beta": math.inf}, r"objective\.beta"),
    ],
)
def test_grpo_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GRPO(**kwargs)
    # EntropyMaxEnt inherits every GRPO check.
    with pytest.raises(ValueError, match=match):
        EntropyMaxEnt(**kwargs)


@pytest.mark.parametrize(
    ("make", "kwargs", "needs"),
    [
        (GRPO, {"rank_penalty": 0.5}, "answer_shaping unlikeliness"),
        (GRPO, {"repetition_coef": 0.5}, "answer_shaping repetition"),
        (GRPO, {"set_diversity_coef": 1.0, "answer_shaping": "repetition"},
         "answer_shaping set_diversity"),
        (GRPO, {"positive_weight": 0.5}, "advantage wreinforce"),
        (GRPO, {"pass_k": 2}, "advantage passk or pkpo"),
        (GRPO, {"cov_fraction": 1e-3}, "clip_rule clip_cov or kl_cov"),
        (GRPO, {"clip_cov_bounds": [0.5, 2.0], "clip_rule": "kl_cov"}, "clip_rule clip_cov"),
        (GRPO, {"kl_cov_coef": 2.0, "clip_rule": "clip_cov"}, "clip_rule kl_cov"),
        # kl_cov has no clip range, cispo one cap (a hunt: both were ignored without a word)
        (GRPO, {"epsilon": 0.1, "clip_rule": "kl_cov"}, "clip_rule ppo or clip_cov"),
        (GroupMaxEnt, {"epsilon_high": 0.3, "clip_rule": "kl_cov"}, "clip_rule ppo or clip_cov"),
        (GRPO, {"epsilon": 0.1, "epsilon_high": 0.3, "clip_rule": "cispo"},
         "epsilon_high null under clip_rule cispo"),
        (EntropyMaxEnt, {"kl_gate_gain": 5.0}, "kl_gate_threshold set"),
        (EntropyMaxEnt, {"disable_outside_trust_zone": True}, "kl_gate_threshold set"),
        # the gate scales the bonus: with none it loaded the reference for nothing (a hunt)
        (EntropyMaxEnt, {"kl_gate_threshold": 0.1, "alpha": 0.0}, "alpha > 0"),
        (ListwiseMaxEnt, {"epsilon": 0.1, "epsilon_high": 0.3}, "clip_coef > 0"),
        (ListwiseMaxEnt, {"right_reward": 0.5, "answer_level": True}, "right_only: true"),
    ],
)
def test_an_option_that_would_do_nothing_is_refused(make, kwargs: dict, needs: str) -> None:
    """Set away from its default where nothing reads it, an option was ignored without a
    word (``--model.objective.kl_gate_gain 5`` without a gate trained as if unset)."""
    moved = [k for k in kwargs
             if k not in ("answer_shaping", "clip_rule", "answer_level", "alpha")]
    with pytest.raises(ValueError, match=rf"objective\.{moved[0]}=.* would do nothing: only "
                                         rf"with objective\.{re.escape(needs)}"):
        make(**kwargs)


@pytest.mark.parametrize(
    ("make", "kwargs"),
    [
        (GRPO, {"rank_penalty": 0.5, "answer_shaping": "unlikeliness", "advantage": "pkpo",
                "pass_k": 2}),
        (GRPO, {"clip_cov_bounds": [1.0, 5.0]}),  # the default, as a YAML list
        (GRPO, {"cov_fraction": 1e-3, "clip_cov_bounds": (0.5, 2.0), "clip_rule": "clip_cov"}),
        (EntropyMaxEnt, {"kl_gate_threshold": 0.1, "kl_gate_gain": 5.0}),
        (ListwiseMaxEnt, {"epsilon": 0.1, "clip_coef": 0.5}),
        (GRPO, {"epsilon_high": 0.3, "clip_rule": "cispo"}),
        (GroupMaxEnt, {"epsilon": 0.1, "clip_rule": "cispo"}),  # its cap then
        (ListwiseMaxEnt, {"right_reward": 0.5, "right_only": True, "answer_level": True}),
    ],
)
def test_an_option_that_acts_is_accepted(make, kwargs: dict) -> None:
    make(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": -0.01}, r"objective\.alpha must be a finite number >= 0"),
        ({"alpha": math.inf}, r"objective\.alpha"),
        ({"kl_gate_threshold": 0.0}, r"objective\.kl_gate_threshold must be a finite number > 0"),
        ({"kl_gate_threshold": -1.0}, r"objective\.kl_gate_threshold must be a finite number"),
        ({"kl_gate_threshold": 0.1, "kl_gate_gain": -1.0}, r"objective\.kl_gate_gain must be"),
        (
            {"kl_gate_threshold": 0.1, "kl_gate_min_multiplier": -0.5},
            r"objective\.kl_gate_min_multiplier must be a finite number >= 0",
        ),
        (
            {"kl_gate_threshold": 0.1, "kl_gate_min_multiplier": 1.5,
             "kl_gate_max_multiplier": 1.0},
            r"objective\.kl_gate_min_multiplier must be <= objective\.kl_gate_max_multiplier",
        ),
    ],
)
def test_entropy_maxent_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EntropyMaxEnt(**kwargs)


def test_entropy_gate_errors_name_the_objective_argument() -> None:
    with pytest.raises(ValueError, match=r"objective\.kl_gate_threshold"):
        EntropyMaxEnt(kl_gate_threshold=0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"beta": -0.1}, r"objective\.beta must be a finite number >= 0"),
        ({"tau": -0.1}, r"objective\.tau must be a finite number >= 0"),
        ({"tau": math.nan}, r"objective\.tau"),
        ({"tau": math.inf}, r"objective\.tau"),
        ({"tau": 0.0, "beta": 0.0}, r"objective\.tau must be > 0 when objective\.beta = 0"),
        ({"q_temperature": 0.0}, r"objective\.q_temperature must be a finite number > 0"),
        ({"q_temperature": -1.0}, r"objective\.q_temperature must be a finite number > 0"),
        ({"q_epsilon": 0.0}, r"objective\.q_epsilon must be a finite number > 0"),
        ({"clip_coef": -0.5}, r"objective\.clip_coef must be a finite number >= 0"),
        ({"distinct_candidates": 1}, r"objective\.distinct_candidates must be true or false"),
        ({"distinct_candidates": True, "clip_coef": 0.1},
         r"objective\.clip_coef must be 0 with objective\.distinct_candidates"),
        ({"epsilon": 1.0}, r"objective\.epsilon must be in \[0, 1\)"),
    ],
)
def test_listwise_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ListwiseMaxEnt(**kwargs)


def test_listwise_tau_zero_allowed_with_beta() -> None:
    obj = ListwiseMaxEnt(tau=0.0, beta=0.1)
    assert obj.tau == 0.0 and obj.beta == 0.1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tau": -1.0}, r"objective\.tau must be a finite number >= 0"),
        ({"tau": math.inf}, r"objective\.tau"),
        ({"lam": -0.1}, r"objective\.lam must be a finite number >= 0"),
        ({"epsilon": 1.0}, r"objective\.epsilon must be in \[0, 1\)"),
        ({"epsilon_high": -0.1}, r"objective\.epsilon_high must be a finite number >= 0"),
    ],
)
def test_group_maxent_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GroupMaxEnt(**kwargs)


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        pytest.param(ListwiseMaxEnt, {"epsilon_high": -0.1}, r"objective\.epsilon_high"),
        pytest.param(ListwiseMaxEnt, {"clip_coef": math.nan}, r"objective\.clip_coef",
                     ),
        pytest.param(ListwiseMaxEnt, {"q_temperature": math.inf}, r"objective\.q_temperature"),
        pytest.param(GRPO, {"epsilon_high": math.nan}, r"objective\.epsilon_high"),
        pytest.param(GRPO, {"epsilon_high": math.inf}, r"objective\.epsilon_high"),
    ],
)
def test_non_finite_or_negative_hyperparameters_rejected_at_construction(
    cls: type, kwargs: dict, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


# ------------------------------------------------------------------ flags and state


def test_needs_reference_and_entropy_flags() -> None:
    assert not GRPO().needs_reference and not GRPO().needs_entropy
    assert GRPO(beta=0.04).needs_reference
    assert EntropyMaxEnt().needs_entropy and not EntropyMaxEnt().needs_reference
    assert EntropyMaxEnt(beta=0.1).needs_reference
    assert EntropyMaxEnt(kl_gate_threshold=0.05).needs_reference  # the gate needs KL
    assert not ListwiseMaxEnt().needs_reference and not ListwiseMaxEnt().needs_entropy
    assert ListwiseMaxEnt(beta=0.2).needs_reference
    assert not GroupMaxEnt().needs_reference and not GroupMaxEnt().needs_entropy
    assert GroupMaxEnt(lam=0.3).needs_reference
    # Flags follow attributes that controllers change.
    obj = GRPO()
    obj.beta = 0.5
    assert obj.needs_reference


def test_state_contents() -> None:
    assert GRPO(beta=0.1).state() == {"beta": 0.1}
    ent = EntropyMaxEnt(alpha=0.2, beta=0.1, kl_gate_threshold=0.1, kl_gate_gain=1.0)
    assert ent.state() == {"beta": 0.1, "alpha": 0.2}
    ent.observe({"train/kl": 0.05})  # multiplier 1 + (0.1 - 0.05)/0.1 = 1.5
    assert ent.state() == pytest.approx({"beta": 0.1, "alpha": 0.3})
    lw = ListwiseMaxEnt(tau=1, beta=0)
    assert lw.state() == {"tau": 1.0, "beta": 0.0}
    assert all(isinstance(v, float) for v in lw.state().values())
    lw.tau = 0.7  # as a controller would
    assert lw.state()["tau"] == 0.7
    assert GroupMaxEnt(tau=2.0, lam=0.5).state() == {"tau": 2.0, "lam": 0.5}


def test_tunable_and_mutable_attributes() -> None:
    assert GRPO.tunable == EntropyMaxEnt.tunable == ("beta",)
    assert ListwiseMaxEnt.tunable == ("tau", "beta")
    assert GroupMaxEnt.tunable == ("tau",)
    for obj in (GRPO(), EntropyMaxEnt(), ListwiseMaxEnt(), GroupMaxEnt()):
        assert set(obj.tunable) <= set(obj.mutable)
        for name in obj.mutable:
            assert isinstance(getattr(obj, name), float), (type(obj).__name__, name)
    assert EntropyMaxEnt.mutable == ("beta", "alpha_multiplier")


def test_group_maxent_has_no_beta_and_is_not_grpo() -> None:
    obj = GroupMaxEnt(tau=0.5, lam=0.2)
    assert not isinstance(obj, GRPO)
    assert not hasattr(obj, "beta") and not hasattr(obj, "loss_type")
    assert "beta" not in obj.state() and "beta" not in obj.state_dict()
    # Dr.GRPO divides by this rank's rows: the base factor W * rows / rows_all_ranks
    assert obj.loss_scale(2, 6, 8) == pytest.approx(1.5)
    assert obj.loss_scale(2, 4, 0) == 1.0
    assert obj.epsilon == obj.epsilon_high == 0.2
    assert GroupMaxEnt(epsilon=0.1, epsilon_high=0.3).epsilon_high == 0.3


@pytest.mark.parametrize(
    ("make", "moved"),
    [
        (lambda: GRPO(beta=0.1), {"beta": 0.25}),
        (lambda: EntropyMaxEnt(beta=0.1, kl_gate_threshold=0.1),
         {"beta": 0.3, "alpha_multiplier": 1.5}),
        (lambda: ListwiseMaxEnt(tau=0.5, beta=0.1), {"tau": 0.7, "beta": 0.02}),
        (lambda: GroupMaxEnt(tau=2.0), {"tau": 0.4}),
    ],
)
def test_state_dict_round_trip(make, moved: dict) -> None:
    obj = make()
    for name, value in moved.items():  # as a controller or the entropy gate would
        setattr(obj, name, value)
    saved = obj.state_dict()
    assert saved == moved and set(saved) == set(obj.mutable)
    fresh = make()
    assert fresh.state_dict() != saved
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved and fresh.state() == obj.state()


def test_load_state_dict_refuses_an_unknown_key() -> None:
    obj = GroupMaxEnt(tau=1.0)
    with pytest.raises(ValueError, match=r"GroupMaxEnt has no mutable state \['beta'\]"):
        obj.load_state_dict({"tau": 0.5, "beta": 0.1})
    assert obj.tau == 1.0  # nothing applied
    with pytest.raises(ValueError, match=r"GRPO has no mutable state \['tau'\]"):
        GRPO().load_state_dict({"tau": 0.5})


def test_a_tunable_attribute_outside_mutable_is_refused() -> None:
    """A controller's value lived only in ``tunable``: the checkpoint (``mutable``) did not
    carry it, and a resume went back to the config's beta without a word (a hunt of
    extensions)."""
    from maxent_grpo.objectives.base import check_objective

    class Forgets(GRPO):
        mutable = ()

    with pytest.raises(ValueError, match=r"Forgets.tunable \['beta'\] is not in its mutable"):
        check_objective(Forgets(beta=0.1))
    check_objective(GRPO(beta=0.1))
