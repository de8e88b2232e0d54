"""Closed forms of speculative decoding against hand-computed values and brute force."""

import numpy as np
import pytest

from specdecode.core import theory


@pytest.mark.parametrize(
    ("alpha", "k", "expected"),
    [(0.8, 5, 3.68928), (0.5, 4, 1.9375), (1.0, 4, 5.0), (0.0, 3, 1.0)],
)
def test_expected_tokens_per_round_hand_values(alpha, k, expected):
    assert theory.expected_tokens_per_round(alpha, k) == pytest.approx(expected, abs=1e-5)


def test_lessons_formula_leaves_out_the_bonus_token():
    assert theory.tokens_per_round_without_bonus(0.8, 5) == pytest.approx(3.36160, abs=1e-5)
    # neither formula gives the homework's expected 4.096
    for f in (theory.expected_tokens_per_round, theory.tokens_per_round_without_bonus):
        assert abs(f(0.8, 5) - 4.096) > 0.3


def test_per_position_rates_reduce_to_the_closed_form():
    assert theory.expected_tokens_per_round_positions([0.7], 6) == pytest.approx(
        theory.expected_tokens_per_round(0.7, 6)
    )
    assert theory.expected_tokens_per_round_positions([0.5, 0.2], 2) == pytest.approx(1 + 0.5 + 0.1)


def test_optimal_k_is_the_brute_force_argmax_and_bound_is_k1_value():
    for alpha, c in [(0.8, 0.05), (0.6, 0.3), (0.9, 0.01)]:
        best = max(range(1, 17), key=lambda k: theory.expected_speedup(alpha, k, c))
        assert theory.optimal_k(alpha, c) == best
        assert theory.speedup_bound(alpha, c) == pytest.approx(theory.expected_speedup(alpha, 1, c))


def test_resample_from_target_tv_matches_the_explicit_mixture():
    rng = np.random.default_rng(0)
    for _ in range(5):
        p, q = rng.dirichlet(np.ones(50) * 0.3), rng.dirichlet(np.ones(50) * 0.3)
        alpha = theory.acceptance_from_probs(p, q)
        assert alpha == pytest.approx(1 - 0.5 * np.abs(p - q).sum())
        r = np.minimum(p, q) + (1 - alpha) * p  # accepted mass + rejections redrawn from p
        assert r.sum() == pytest.approx(1)
        assert theory.resample_from_target_tv(p, q) == pytest.approx(0.5 * np.abs(r - p).sum())
        assert theory.match_acceptance(p, q) == pytest.approx(float(p @ q))
