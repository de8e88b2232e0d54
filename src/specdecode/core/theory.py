"""Closed forms of speculative decoding (Leviathan et al. 2023, section 3)."""

from __future__ import annotations


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """E[tokens per target forward] = (1 − α^(k+1)) / (1 − α): accepted drafts plus the one
    resampled or bonus token (Leviathan et al. 2023, eq. 1). α = 1 gives k + 1."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha == 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """Walltime improvement (1 − α^(k+1)) / ((1 − α)(kc + 1)) for draft cost ratio c (Theorem 3.8)."""
    return expected_tokens_per_round(alpha, k) / (k * c + 1)


def tokens_per_round_without_bonus(alpha: float, k: int) -> float:
    """(1 − α^k) / (1 − α): lesson 001's homework formula. It leaves out the one resampled or
    bonus token every round emits, so it undercounts; kept to show the error beside the right one."""
    if alpha == 1:
        return float(k)
    return (1 - alpha**k) / (1 - alpha)


def expected_tokens_per_round_positions(alphas: list[float], k: int) -> float:
    """E[tokens per round] with conditional acceptance rates α_1..α_k per draft position
    (the last one repeats): 1 + Σ_i Π_{j≤i} α_j. Equal rates give (1 − α^(k+1)) / (1 − α)."""
    total, reach = 1.0, 1.0
    for i in range(k):
        reach *= alphas[min(i, len(alphas) - 1)]
        total += reach
    return total


def optimal_k(alpha: float, c: float, k_max: int = 16) -> int:
    """The k in 1..k_max that maximises expected_speedup (Leviathan et al. 2023, Theorem 3.8:
    the walltime improvement is (1 − α^(k+1)) / ((1 − α)(kc + 1)); choose k to maximise it)."""
    return max(range(1, k_max + 1), key=lambda k: expected_speedup(alpha, k, c))


def speedup_bound(alpha: float, c: float) -> float:
    """Corollary 3.9: if α > c some k gives an improvement of at least (1 + α) / (1 + c)
    (the value at k = 1)."""
    return (1 + alpha) / (1 + c)


def acceptance_from_probs(target_probs, draft_probs) -> float:
    """α = Σ_x min(p(x), q(x)) = 1 − TV(p, q), the chance min(1, p/q) accepts a draw from q."""
    import numpy as np

    return float(np.minimum(np.asarray(target_probs), np.asarray(draft_probs)).sum())


def match_acceptance(target_probs, draft_probs) -> float:
    """Σ_x p(x) q(x): the chance that independent draws from the draft and the target agree."""
    import numpy as np

    return float((np.asarray(target_probs) * np.asarray(draft_probs)).sum())


def resample_from_target_tv(target_probs, draft_probs) -> float:
    """TV(r, p) of the biased rule that resamples a rejection from p instead of the residual.

    Its output is r = min(p, q) + (1 − α)·p: the mass min(p, q) that the accept step already
    gave is counted again. TV(r, p) = ½ Σ |min(p, q) − α·p|."""
    import numpy as np

    p, q = np.asarray(target_probs, dtype=np.float64), np.asarray(draft_probs, dtype=np.float64)
    m = np.minimum(p, q)
    return float(0.5 * np.abs(m - m.sum() * p).sum())


def invariant_acceptance(target_probs, draft_probs, top: int | None = None) -> float:
    """Pr[argmax q/E = argmax p/E] for one Exp(1) vector E shared by draft and target (the
    invariant rule's acceptance of one position): Σ_x 1 / Σ_y max(p_y/p_x, q_y/q_x).

    (x wins both races iff E_y > E_x·max(p_y/p_x, q_y/q_x) for every y; integrating over E_x
    gives the term.) Only tokens with p_x > 0 and q_x > 0 contribute. With `top`, the sum runs
    over the `top` tokens of largest min(p, q) only (a lower estimate; each term left out is at
    most min(p_x, q_x)), for vocabularies too large for the V x V sum."""
    import torch

    p = torch.as_tensor(target_probs, dtype=torch.float64).flatten()
    q = torch.as_tensor(draft_probs, dtype=torch.float64).flatten()
    both = torch.minimum(p, q)
    xs = torch.nonzero(both > 0).flatten()
    if top is not None and xs.numel() > top:
        xs = both.topk(top).indices
    total = 0.0
    for chunk in xs.split(256):
        ratio = torch.maximum(p.view(1, -1) / p[chunk].view(-1, 1), q.view(1, -1) / q[chunk].view(-1, 1))
        total += float((1.0 / ratio.sum(-1)).sum())
    return total


def invariant_bound(tv: float) -> float:
    """(1 − TV) / (1 + TV): the least acceptance of Gumbel / exponential-race coupling for two
    distributions at total variation TV (Daliri, Musco, Suresh 2024), beside the standard
    rule's 1 − TV."""
    return (1 - tv) / (1 + tv)
