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
