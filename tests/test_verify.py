"""The acceptance rules keep the target's distribution: measured against sampling noise.

Every test draws N = 200,000 rounds with fixed seeds and checks the emitted token against p
with a TV bound (mean + 4 std of direct sampling at the same N) and a chi-square test. The
negative controls are wrong rules the same check must reject.
"""

import numpy as np
import pytest
import torch

from helpers import check_distribution
from specdecode.core.sampling import SamplingParams, Warp, logits_to_probs, sample
from specdecode.engine.verify import verify_chain, verify_greedy

N = 200_000
V = 32


def dirichlet(seed: int, conc: float = 0.5) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.tensor(rng.dirichlet([conc] * V))


def run_chain(
    p: torch.Tensor, q: torch.Tensor | None, k: int = 1, seed: int = 0, draft=None, rule=verify_chain
):
    """N independent rounds with target p at every position and drafts drawn from q
    (or the fixed draft token `draft` when q is None); returns the Verdict."""
    g = torch.Generator().manual_seed(seed)
    if q is None:
        draft_tokens = torch.full((N, k), draft, dtype=torch.long)
        draft_probs = None
    else:
        draft_tokens = sample(
            q.expand(N, k, V), torch.empty(N, k, V, dtype=torch.float64).exponential_(generator=g)
        )
        draft_probs = q.expand(N, k, V)
    target_probs = p.expand(N, k + 1, V)
    uniforms = torch.rand(N, k, dtype=torch.float64, generator=g)
    noise = torch.empty(N, V, dtype=torch.float64).exponential_(generator=g)
    return rule(draft_tokens, draft_probs, target_probs, uniforms, noise)


def first_tokens(verdict) -> np.ndarray:
    return verdict.tokens[:, 0].numpy()


@pytest.mark.heavy
def test_chain_rule_output_follows_target_distribution():
    p, q = dirichlet(1), dirichlet(2)
    ok, msg = check_distribution(first_tokens(run_chain(p, q)), p.numpy())
    assert ok, msg


def test_acceptance_rate_equals_one_minus_tv():
    p, q = dirichlet(3), dirichlet(4)
    v = run_chain(p, q)
    alpha = 1 - 0.5 * float((p - q).abs().sum())
    rate = float(v.accepted.double().mean())
    assert abs(rate - alpha) < 4 * (alpha * (1 - alpha) / N) ** 0.5 + 1e-9


@pytest.mark.heavy
@pytest.mark.parametrize("k", [2, 4])
def test_second_token_after_acceptance_follows_target(k):
    p, q = dirichlet(5), dirichlet(6)
    p2 = dirichlet(7)
    g = torch.Generator().manual_seed(11)
    # position 0 uses p, positions >= 1 use p2 (a pure test: no dependence on the prefix)
    target = torch.stack([p] + [p2] * k).expand(N, k + 1, V)
    drafts = torch.stack([q] * k).expand(N, k, V)
    tokens = sample(drafts, torch.empty(N, k, V, dtype=torch.float64).exponential_(generator=g))
    v = verify_chain(
        tokens,
        drafts,
        target,
        torch.rand(N, k, dtype=torch.float64, generator=g),
        torch.empty(N, V, dtype=torch.float64).exponential_(generator=g),
    )
    ok, msg = check_distribution(v.tokens[:, 0].numpy(), p.numpy())
    assert ok, msg
    reached = v.accepted >= 1
    assert int(reached.sum()) > N // 4
    ok, msg = check_distribution(v.tokens[reached, 1].numpy(), p2.numpy())
    assert ok, msg


@pytest.mark.heavy
@pytest.mark.parametrize("draft_token", [0, 5])
def test_one_hot_draft_keeps_target_distribution(draft_token):
    p = dirichlet(8)
    ok, msg = check_distribution(first_tokens(run_chain(p, None, draft=draft_token)), p.numpy())
    assert ok, msg


@pytest.mark.heavy
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.8, min_p=0.05),
    ],
    ids=["top-k", "top-p", "min-p", "all"],
)
def test_warped_distributions_are_kept(params):
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(2, 1, V, dtype=torch.float64, generator=g) * 2
    probs = logits_to_probs(logits, Warp.from_params([params, params]))
    p, q = probs[0, 0], probs[1, 0]
    assert int((p == 0).sum()) > 0, "the filter must remove tokens for this test to mean anything"
    ok, msg = check_distribution(first_tokens(run_chain(p, q)), p.numpy())
    assert ok, msg


@pytest.mark.heavy
def test_equal_distributions_always_accept_and_stay_exact():
    p = dirichlet(9)
    v = run_chain(p, p.clone(), k=3)
    assert bool((v.accepted == 3).all())
    ok, msg = check_distribution(v.tokens[:, 3].numpy(), p.numpy())
    assert ok, msg


def test_empty_residual_falls_back_to_target():
    # q >= p everywhere (p sums to 1 - 1 ulp): a rejection leaves max(0, p - q) all zero.
    # The token must then come from p, not from argmax over zeros (which would be token 0).
    p = torch.tensor([0.5, 0.4999999999999999], dtype=torch.float64)
    q = torch.tensor([0.5, 0.5], dtype=torch.float64)
    v = verify_chain(
        torch.tensor([[1]]),
        q.view(1, 1, 2),
        p.expand(1, 2, 2),
        torch.tensor([[0.9999999999999999]], dtype=torch.float64),
        torch.tensor([[1.0, 0.25]], dtype=torch.float64),  # Exp noise that makes p pick token 1
    )
    assert int(v.accepted) == 0
    assert int(v.tokens[0, 0]) == 1


def test_zero_probability_residual_never_emitted():
    p = torch.tensor([0.0, 0.3, 0.7], dtype=torch.float64)
    q = torch.tensor([0.6, 0.4, 0.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    n = 20_000
    d = sample(q.expand(n, 1, 3), torch.empty(n, 1, 3, dtype=torch.float64).exponential_(generator=g))
    v = verify_chain(
        d,
        q.expand(n, 1, 3),
        p.expand(n, 2, 3),
        torch.rand(n, 1, dtype=torch.float64, generator=g),
        torch.empty(n, 3, dtype=torch.float64).exponential_(generator=g),
    )
    assert int((v.tokens[:, 0] == 0).sum()) == 0


# -- negative controls: the check above must catch these wrong rules ------------------------


def resample_from_target_rule(draft_tokens, draft_probs, target_probs, uniforms, noise):
    """Lesson 001's bug: after a rejection, draw from p instead of the residual."""
    v = verify_chain(draft_tokens, draft_probs, target_probs, uniforms, noise)
    rejected = v.accepted < draft_tokens.shape[1]
    redraw = sample(target_probs[:, 0], noise)
    v.tokens[:, 0] = torch.where(rejected, redraw, v.tokens[:, 0])
    return v


@pytest.mark.heavy
def test_negative_control_resample_from_target_is_caught():
    p, q = dirichlet(1), dirichlet(2)
    ok, msg = check_distribution(first_tokens(run_chain(p, q, rule=resample_from_target_rule)), p.numpy())
    assert not ok, msg


@pytest.mark.heavy
def test_negative_control_swapped_target_and_draft_is_caught():
    p, q = dirichlet(1), dirichlet(2)
    g = torch.Generator().manual_seed(0)
    draft_tokens = sample(
        q.expand(N, 1, V), torch.empty(N, 1, V, dtype=torch.float64).exponential_(generator=g)
    )
    # p and q swapped in the rule: accept with min(1, q/p), residual max(0, q - p)
    v = verify_chain(
        draft_tokens,
        p.expand(N, 1, V),
        q.expand(N, 2, V),
        torch.rand(N, 1, dtype=torch.float64, generator=g),
        torch.empty(N, V, dtype=torch.float64).exponential_(generator=g),
    )
    ok, msg = check_distribution(first_tokens(v), p.numpy())
    assert not ok, msg


def test_greedy_rule_accepts_matching_prefix_then_emits_argmax():
    scores = torch.full((2, 4, 6), -1.0)
    best = torch.tensor([[1, 2, 3, 4], [5, 0, 1, 2]])
    scores.scatter_(-1, best.unsqueeze(-1), 1.0)
    drafts = torch.tensor([[1, 2, 0], [5, 0, 1]])
    v = verify_greedy(drafts, scores)
    assert v.accepted.tolist() == [2, 3]
    assert v.tokens[0, :3].tolist() == [1, 2, 3]
    assert v.tokens[1].tolist() == [5, 0, 1, 2]
    assert v.bonus.tolist() == [False, True]


def test_chain_rule_with_one_hot_target_is_greedy():
    scores = torch.randn(64, 4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    best = scores.argmax(-1)
    drafts = torch.where(
        torch.rand(64, 3, generator=torch.Generator().manual_seed(4)) < 0.7,
        best[:, :3],
        (best[:, :3] + 1) % 16,
    )
    one_hot = torch.zeros_like(scores).scatter_(-1, best.unsqueeze(-1), 1.0)
    g = torch.Generator().manual_seed(5)
    chain = verify_chain(
        drafts,
        None,
        one_hot,
        torch.rand(64, 3, dtype=torch.float64, generator=g),
        torch.empty(64, 16, dtype=torch.float64).exponential_(generator=g),
    )
    greedy = verify_greedy(drafts, scores)
    assert torch.equal(chain.accepted, greedy.accepted)
    for b in range(64):
        n = int(greedy.accepted[b]) + 1
        assert chain.tokens[b, :n].tolist() == greedy.tokens[b, :n].tolist()
