"""Issue 24's mechanisms on answers: listwise MaxEnt over distinct answers (§4.3, answer
level), the unlikeliness reward and the repetition penalty (§4.5), in float64 against hand
computations (docs/ALGORITHM.md §8, "answer level")."""

from __future__ import annotations

import math

import pytest
import torch

from maxent_grpo.core import (
    answer_classes,
    answer_listwise_loss,
    answer_maxent_weights,
    droppable_groups,
    listwise_loss,
    maxent_weights,
    q_distribution,
    repetition_penalty,
    unlikeliness_rewards,
)
from maxent_grpo.objectives import GRPO, GroupInputs, ListwiseMaxEnt

F64 = torch.float64

# the worked example: "4 + 5" twice as two completions (4 + 5, 5 + 4), "3 + 6", and a wrong "1 + 1"
KEYS = ["4 + 5", "4 + 5", "3 + 6", "1 + 1"]
REWARDS = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=F64)
S = torch.tensor([[-1.0, -2.0, -1.5, -3.0]], dtype=F64)


def test_answer_classes_name_each_class_by_its_first_row():
    assert answer_classes(KEYS, 4).tolist() == [[0, 0, 2, 3]]
    assert answer_classes(["a", "b", "b", "a", "c", "c", "c", "c"], 4).tolist() == [
        [0, 1, 1, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="group_size"):
        answer_classes(["a"] * 3, 2)


def test_answer_weights_by_hand():
    """Three answers, two right: each right answer gets half the target, however many of
    the sampled completions give it (the sequence-level target gives "4 + 5" two thirds)."""
    answers = answer_classes(KEYS, 4)
    eps, tau, tq = 1e-6, 0.5, 0.2
    q, w = answer_maxent_weights(REWARDS, answers, tau, q_temperature=tq, q_epsilon=eps)
    z = 2 * math.exp(1 / tq) + 1
    q_hand = [math.exp(1 / tq) / z, math.exp(1 / tq) / z, 1 / z]
    q_hand = [v * (1 - 3 * eps) + eps for v in q_hand]
    w_hand = [v ** (1 / tau) for v in q_hand]
    w_hand = [v / sum(w_hand) for v in w_hand]
    torch.testing.assert_close(q, torch.tensor([[q_hand[0], 0, q_hand[1], q_hand[2]]], dtype=F64),
                               rtol=1e-12, atol=0)
    torch.testing.assert_close(w, torch.tensor([[w_hand[0], 0, w_hand[1], w_hand[2]]], dtype=F64),
                               rtol=1e-12, atol=0)
    assert w[0, 0] == pytest.approx(0.5, abs=1e-4) and w[0, 2] == pytest.approx(0.5, abs=1e-4)
    sequence_level = maxent_weights(q_distribution(REWARDS, tq, eps).log(), tau)
    assert float(sequence_level[0, :2].sum()) == pytest.approx(2 / 3, abs=1e-4)


def test_answer_loss_and_gradient_by_hand():
    answers = answer_classes(KEYS, 4)
    _, w = answer_maxent_weights(REWARDS, answers, 0.5, q_temperature=0.2)
    s = S.clone().requires_grad_(True)
    loss = answer_listwise_loss(s, w, answers)
    loss.backward()
    e = [math.exp(v) for v in S[0].tolist()]
    Z = sum(e)
    P = {0: (e[0] + e[1]) / Z, 2: e[2] / Z, 3: e[3] / Z}
    W = {0: float(w[0, 0]), 2: float(w[0, 2]), 3: float(w[0, 3])}
    assert float(loss.detach()) == pytest.approx(-sum(W[c] * math.log(P[c]) for c in P), rel=1e-12)
    cls = [0, 0, 2, 3]
    grad = [e[i] / Z * (1 - W[cls[i]] / P[cls[i]]) for i in range(4)]
    torch.testing.assert_close(s.grad, torch.tensor([grad], dtype=F64), rtol=1e-10, atol=1e-14)


def test_one_completion_per_answer_is_the_distinct_candidates_listwise_exactly():
    """The seed's closed form is the special case: when every answer class is one candidate,
    weights and loss equal the listwise target over distinct candidates."""
    torch.manual_seed(0)
    rewards = torch.rand(3, 5, dtype=F64)
    rho = torch.randn(3, 5, dtype=F64)
    s = torch.randn(3, 5, dtype=F64)
    keys = ["a", "b", "a", "c", "d", "e", "f", "g", "h", "e", "x", "x", "x", "y", "z"]
    answers = answer_classes(keys, 5)
    cand = answers == torch.arange(5)  # duplicates of an answer are duplicate completions
    rewards = torch.gather(rewards, 1, answers)  # a duplicate has its first row's reward
    _, w = answer_maxent_weights(rewards, answers, 0.3, 0.2, rho, cand, 0.5, 1e-4)
    q = q_distribution(rewards, 0.5, 1e-4, cand)
    w_seq = maxent_weights(q.log(), 0.3, 0.2, rho, cand)
    torch.testing.assert_close(w, w_seq, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(answer_listwise_loss(s, w, answers, cand),
                               listwise_loss(s, w_seq, cand), rtol=1e-12, atol=0)


def test_answer_level_beta_uses_each_answers_reference_mass():
    answers = answer_classes(KEYS, 4)
    rho = torch.tensor([[-1.0, -3.0, -2.0, -0.5]], dtype=F64)
    tau, beta, eps, tq = 0.5, 0.25, 1e-6, 0.2
    q, w = answer_maxent_weights(REWARDS, answers, tau, beta, rho, None, tq, eps)
    rho_c = [math.log(math.exp(-1) + math.exp(-3)), -2.0, -0.5]
    logits = [(math.log(float(q[0, i])) + beta * r) / (tau + beta)
              for i, r in zip((0, 2, 3), rho_c, strict=True)]
    hand = [math.exp(v) for v in logits]
    hand = [v / sum(hand) for v in hand]
    torch.testing.assert_close(w[0, [0, 2, 3]], torch.tensor(hand, dtype=F64), rtol=1e-12, atol=0)


def test_answer_classes_are_checked():
    with pytest.raises(ValueError, match="first row"):
        answer_maxent_weights(REWARDS, torch.tensor([[0, 0, 1, 3]]), 0.5)
    with pytest.raises(ValueError, match="candidate"):
        answer_maxent_weights(REWARDS, torch.tensor([[0, 0, 2, 3]]), 0.5,
                              candidates=torch.tensor([[False, True, True, True]]))
    with pytest.raises(ValueError, match="0 outside"):
        answer_listwise_loss(S, torch.full((1, 4), 0.25, dtype=F64), torch.tensor([[0, 0, 2, 3]]))


def test_listwise_objective_answer_level_prepares_answer_targets():
    objective = ListwiseMaxEnt(tau=0.5, answer_level=True)
    answers = answer_classes(KEYS, 4)
    targets = objective.prepare(GroupInputs(REWARDS, torch.ones(1, 4), 4, None,
                                torch.ones(1, 4, dtype=torch.bool), answers=answers))
    assert targets.answers is answers and targets.weights[0, 1] == 0
    with pytest.raises(ValueError, match="answer classes"):
        objective.prepare(GroupInputs(REWARDS, torch.ones(1, 4), 4, None, None))
    with pytest.raises(ValueError, match="clip_coef"):
        ListwiseMaxEnt(answer_level=True, clip_coef=0.1)


def test_unlikeliness_by_hand():
    """The most likely right sample is paid least: ranks by mean token log-prob (0 = least
    likely), reward times 1 - 0.25 * rank / G; wrong samples stay at 0."""
    rewards = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=F64)
    logps = torch.tensor([[-0.2, -0.1, -3.0, -1.0], [-1.0, -2.0, -3.0, -4.0]], dtype=F64)
    out = unlikeliness_rewards(rewards, logps, 0.25)
    # row 0 ranks: -3.0 -> 0, -1.0 -> 1, -0.2 -> 2, -0.1 -> 3
    torch.testing.assert_close(out, torch.tensor(
        [[1 - 0.25 * 2 / 4, 0.0, 1.0, 1 - 0.25 / 4], [0.0] * 4], dtype=F64))
    objective = GRPO(answer_shaping="unlikeliness", scale_rewards="none")
    assert objective.needs_sequence_logps and not GRPO().needs_sequence_logps
    adv = objective.prepare(
        GroupInputs(rewards, torch.ones(2, 4), 4, None, seq_logps=logps)).advantages
    torch.testing.assert_close(adv.view(2, 4), out - out.mean(1, keepdim=True))
    with pytest.raises(ValueError, match="log-probs"):
        objective.prepare(GroupInputs(rewards, torch.ones(2, 4), 4, None))
    with pytest.raises(ValueError, match="rank_penalty"):
        GRPO(rank_penalty=1.5)
    with pytest.raises(ValueError, match="pkpo"):
        GRPO(answer_shaping="unlikeliness", advantage="passk")
    with pytest.raises(ValueError, match="objective.answer_shaping"):
        GRPO(answer_shaping="rarity")
    with pytest.raises(ValueError, match="objective.repetition_coef"):
        GRPO(repetition_coef=-0.1)
    with pytest.raises(ValueError, match="objective.answer_level"):
        ListwiseMaxEnt(answer_level="yes")
    # as the authors: a group whose raw rewards are all equal (all right) gets no push
    solved = torch.tensor([[1.0, 1.0, 1.0, 1.0]], dtype=F64)
    adv = GRPO(answer_shaping="unlikeliness").prepare(
        GroupInputs(solved, torch.ones(1, 4), 4, None, seq_logps=logps[:1])).advantages
    assert bool((adv == 0).all())


def test_repetition_penalty_by_hand():
    answers = torch.tensor([[0, 0, 0, 3], [0, 1, 2, 3]])
    torch.testing.assert_close(repetition_penalty(answers).double(), torch.tensor(
        [[-0.5, -0.5, -0.5, 0.0], [0.0] * 4], dtype=F64))
    rewards = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=F64)
    objective = GRPO(answer_shaping="repetition", repetition_coef=0.2, scale_rewards="none")
    adv = objective.prepare(
        GroupInputs(rewards, torch.ones(2, 4), 4, None, answers=answers)).advantages
    torch.testing.assert_close(adv.view(2, 4), torch.tensor(
        [[0.25 - 0.1, 0.25 - 0.1, 0.25 - 0.1, -0.75], [0.0] * 4], dtype=F64))
    # thirds: computed in float64 for float64 rewards (it was float32, 2e-9 off)
    thirds = torch.tensor([[0, 0, 1, 2, 3, 4]])
    adv = objective.prepare(GroupInputs(torch.zeros(1, 6, dtype=F64), torch.ones(1, 6), 6,
                                        None, answers=thirds)).advantages
    assert adv.view(-1).tolist()[:2] == [0.2 * (-1 / 6)] * 2


def test_solved_groups_are_not_droppable():
    r = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.5, 0.5], [1.0, 0.0]])
    assert droppable_groups(r).tolist() == [True, True, True, False]
    assert droppable_groups(r, 1.0).tolist() == [False, True, True, False]
    assert droppable_groups(r, 0.5).tolist() == [False, True, False, False]


def test_listwise_kl_coef_adds_the_per_token_kl_by_hand():
    """``kl_coef`` adds ``kl_coef * (1/N) sum_i mean_t k3`` to the listwise loss; its
    gradient reaches every token (the listwise term alone moves only sequence scores)."""
    from tests.objectives.conftest import _logps, _mask, _mb

    mask = _mask([3, 2, 4, 1], 4)
    logps = _logps(0, 4, 4).requires_grad_(True)
    ref = _logps(1, 4, 4)
    w = torch.tensor([[0.7, 0.3], [0.5, 0.5]], dtype=F64)
    plain = ListwiseMaxEnt(tau=0.5).loss(_mb(logps, mask, G=2, num_rows=4, t_max=4,
                                            weights=w, ref=ref)).loss
    objective = ListwiseMaxEnt(tau=0.5, kl_coef=0.1)
    assert objective.needs_reference and not ListwiseMaxEnt(tau=0.5).needs_reference
    with_kl = objective.loss(_mb(logps, mask, G=2, num_rows=4, t_max=4, weights=w,
                                 ref=ref)).loss
    d = (ref - logps).detach()
    k3 = torch.expm1(d) - d
    m = mask.to(F64)
    hand = sum(float((k3[i] * m[i]).sum() / m[i].sum()) for i in range(4)) / 4
    assert float((with_kl - plain).detach()) == pytest.approx(0.1 * hand, rel=1e-12)
    with pytest.raises(ValueError, match="kl_coef"):
        ListwiseMaxEnt(kl_coef=-1.0)


def test_wreinforce_by_hand():
    """W-REINFORCE: right samples +lambda, wrong -1, no baseline (an all-right group keeps
    its +lambda); fractional rewards interpolate; rewards outside [0, 1] are refused."""
    from maxent_grpo.core import wreinforce_advantages

    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.5, 0.0, 0.25, 1.0]],
                           dtype=F64)
    expected = torch.tensor([[0.1, -1.0, 0.1, -1.0], [0.1] * 4,
                             [0.05 - 0.5, -1.0, 0.025 - 0.75, 0.1]], dtype=F64)
    torch.testing.assert_close(wreinforce_advantages(rewards, 0.1), expected)
    adv = GRPO(advantage="wreinforce", positive_weight=0.1).prepare(
        GroupInputs(rewards, torch.ones(3, 4), 4, None)).advantages
    torch.testing.assert_close(adv.view(3, 4), expected)
    torch.testing.assert_close(wreinforce_advantages(rewards[:1], 1.0),
                               2 * rewards[:1] - 1)  # lambda 1: plain REINFORCE on +-1
    with pytest.raises(ValueError, match="rewards in \\[0, 1\\]"):
        wreinforce_advantages(torch.tensor([[2.0, 0.0]], dtype=F64))
    with pytest.raises(ValueError, match="objective.scale_rewards"):
        GRPO(advantage="wreinforce", scale_rewards="none")
    with pytest.raises(ValueError, match="objective.positive_weight"):
        GRPO(positive_weight=1.5)


def _diversity(rewards: list[float], answers: list[int]) -> float:
    """D(S): per answer, the best reward among the samples that gave it, summed."""
    best: dict[int, float] = {}
    for r, a in zip(rewards, answers, strict=True):
        best[a] = max(best.get(a, r), r)
    return sum(best.values())


def test_set_diversity_bonus_by_hand_and_as_leave_one_out():
    from maxent_grpo.core import set_diversity_bonus

    rewards = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.5, 1.0, 0.0, 0.2]], dtype=F64)
    answers = torch.tensor([[0, 0, 2, 3], [0, 0, 2, 3]])
    # group 0: only "2" is a right answer no other sample gives: m = [0, 0, 1, 0]
    # group 1: sample 1 is answer 0's best by 0.5, sample 3 alone with 0.2: m = [0, .5, 0, .2]
    torch.testing.assert_close(set_diversity_bonus(rewards, answers), torch.tensor(
        [[-0.25, -0.25, 0.75, -0.25], [-0.175, 0.325, -0.175, 0.025]], dtype=F64))
    # the definition itself, D(S) - D(S - {i}) centred, on random groups with ties
    gen = torch.Generator().manual_seed(0)
    r = torch.randint(0, 3, (20, 6), generator=gen).to(F64) / 2
    a = torch.randint(0, 3, (20, 6), generator=gen)
    bonus = set_diversity_bonus(r, a)
    for b in range(20):
        rs, ans = r[b].tolist(), a[b].tolist()
        m = [_diversity(rs, ans) - _diversity(rs[:i] + rs[i + 1:], ans[:i] + ans[i + 1:])
             for i in range(6)]
        mean = sum(m) / 6
        torch.testing.assert_close(bonus[b], torch.tensor([x - mean for x in m], dtype=F64))
    # as an answer shaping of GRPO: c * bonus added to the advantages
    plain = GRPO(scale_rewards="none").prepare(
        GroupInputs(rewards, torch.ones(2, 4), 4, None, answers=answers)).advantages
    shaped = GRPO(scale_rewards="none", answer_shaping="set_diversity",
                  set_diversity_coef=0.5).prepare(
        GroupInputs(rewards, torch.ones(2, 4), 4, None, answers=answers)).advantages
    torch.testing.assert_close(shaped - plain,
                               0.5 * set_diversity_bonus(rewards, answers).reshape(-1))
    with pytest.raises(ValueError, match="objective.set_diversity_coef"):
        GRPO(set_diversity_coef=-1.0)


def test_right_only_target_restricts_the_weights_and_the_reference_to_right_answers():
    """``right_only``: w_C ∝ q_C^(1/(tau+beta)) pi_ref(C | right)^(beta/(tau+beta)) on the
    right answers, 0 on the wrong one; a group with no right answer keeps the full target."""
    answers = answer_classes(KEYS, 4)  # classes [0, 0, 2, 3]; "1 + 1" (class 3) is wrong
    tau, beta, tq, eps = 0.5, 0.3, 0.2, 1e-6
    rho = torch.tensor([[-1.0, -2.0, -1.5, -0.1]], dtype=F64)  # the wrong answer likeliest
    q, w = answer_maxent_weights(REWARDS, answers, tau, beta, rho, q_temperature=tq,
                                 q_epsilon=eps, right_reward=1.0)
    rho_c = {0: math.log(math.exp(-1.0) + math.exp(-2.0)), 2: -1.5}
    logits = {c: (math.log(float(q[0, c])) + beta * rho_c[c]) / (tau + beta) for c in rho_c}
    z = sum(math.exp(v) for v in logits.values())
    torch.testing.assert_close(w, torch.tensor(
        [[math.exp(logits[0]) / z, 0.0, math.exp(logits[2]) / z, 0.0]], dtype=F64),
        rtol=1e-12, atol=0)
    _, full = answer_maxent_weights(REWARDS, answers, tau, beta, rho, q_temperature=tq,
                                    q_epsilon=eps)
    assert float(full[0, 3]) > 1e-3  # without it the reference holds the wrong answer up
    # no right answer in the group: the target over all answers, as without the option
    wrong = torch.zeros(1, 4, dtype=F64)
    torch.testing.assert_close(
        answer_maxent_weights(wrong, answers, tau, beta, rho, q_temperature=tq,
                              right_reward=1.0)[1],
        answer_maxent_weights(wrong, answers, tau, beta, rho, q_temperature=tq)[1])
    # through the objective
    objective = ListwiseMaxEnt(tau=tau, beta=beta, q_temperature=tq, answer_level=True,
                               right_only=True)
    targets = objective.prepare(GroupInputs(REWARDS, torch.ones(1, 4), 4, rho,
                                            answers=answers))
    torch.testing.assert_close(targets.weights, w)
    with pytest.raises(ValueError, match="objective.right_only needs objective.answer_level"):
        ListwiseMaxEnt(right_only=True)
