"""Distances between a sample and a distribution, and how large they get by chance alone."""

from __future__ import annotations

import numpy as np
from scipy import stats


def tv(counts: np.ndarray, p: np.ndarray) -> float:
    """Total-variation distance between the empirical distribution of counts and p."""
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


def noise_tvs(
    p: np.ndarray, n: int, sims: int = 64, seed: int = 0, draw_from: np.ndarray | None = None
) -> np.ndarray:
    """TV(empirical, p) of n direct draws from p (or from draw_from), for `sims` independent
    simulations: the distance that sampling noise alone produces at this sample size."""
    rng = np.random.default_rng(seed)
    src = np.asarray(p if draw_from is None else draw_from, dtype=np.float64)
    # renormalised in float64: a float32 distribution can sum to 1 + 1e-7, which numpy's
    # multinomial refuses (seen on an AMX machine, whose kernels round differently)
    src = src / src.sum()
    return np.array([tv(rng.multinomial(n, src), p) for _ in range(sims)])


def chi2_pvalue(counts: np.ndarray, p: np.ndarray) -> float:
    """Chi-square goodness of fit of counts to p; bins with expected count < 5 are pooled.
    Any count on a zero-probability token gives p-value 0."""
    n = counts.sum()
    if counts[p == 0].sum() > 0:
        return 0.0
    expected = n * p
    small = (expected < 5) & (p > 0)
    obs = np.append(counts[expected >= 5], counts[small].sum())
    exp = np.append(expected[expected >= 5], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    exp = exp * obs.sum() / exp.sum()
    return float(stats.chisquare(obs, exp).pvalue)
