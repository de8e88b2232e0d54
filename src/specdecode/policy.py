"""Draft-length policies: how many tokens to draft next round, decided from past rounds only.

Any such choice keeps the output exact: the acceptance rule is exact for every draft length,
so the length may depend on anything except the current round's target probs and uniforms.
The confidence policy also stops drafting inside a round, on the draft's own probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SpecDecodeError
from .theory import expected_speedup, optimal_k

POLICIES = ("fixed", "heuristic", "confidence", "optimal")


@dataclass
class RoundOutcome:
    """What a policy may learn from one finished round (summed over the batch's rows)."""

    drafted: int  # draft tokens per row this round
    tested: int  # draft positions the target checked, all rows
    accepted: int  # draft tokens accepted, all rows
    rows: int
    all_accepted: bool  # every row accepted every draft token
    draft_s: float  # wall time of proposing
    target_s: float  # wall time of the target forward


class FixedPolicy:
    """Always k."""

    name = "fixed"
    stop_below: float | None = None

    def __init__(self, k: int) -> None:
        self.k = self.max_k = k

    def next_k(self) -> int:
        return self.k

    def observe(self, outcome: RoundOutcome) -> None:
        pass


class HeuristicPolicy(FixedPolicy):
    """transformers' schedule: +2 after a round whose drafts were all accepted, −1 otherwise
    (never below 1, never above max_k)."""

    name = "heuristic"

    def __init__(self, k: int, max_k: int | None = None) -> None:
        super().__init__(k)
        self.max_k = max_k or max(2 * k, 8)

    def observe(self, outcome: RoundOutcome) -> None:
        if outcome.drafted == 0:
            return
        self.k = min(self.k + 2, self.max_k) if outcome.all_accepted else max(self.k - 1, 1)


class ConfidencePolicy(FixedPolicy):
    """Draft up to k tokens, but stop as soon as the draft's probability of its own token falls
    below `threshold` in every row (transformers' assistant_confidence_threshold, 0.4)."""

    name = "confidence"

    def __init__(self, k: int, threshold: float = 0.4) -> None:
        if not 0 < threshold < 1:
            raise SpecDecodeError(f"confidence threshold must be in (0, 1), got {threshold}")
        super().__init__(k)
        self.stop_below = threshold


class OptimalPolicy(FixedPolicy):
    """k from Leviathan et al.'s Theorem 3.8 each round: maximise (1 − α^(k+1)) / ((1 − α)(kc + 1))
    with α the acceptance rate so far and c the measured cost of a draft token relative to a
    target forward. If no k beats target-only decoding, draft nothing, probing with k = 1 every
    `probe_every` rounds so α and c stay current."""

    name = "optimal"

    def __init__(self, k: int, max_k: int | None = None, probe_every: int = 16) -> None:
        super().__init__(k)
        self.max_k = max_k or max(2 * k, 8)
        self.probe_every = probe_every
        self.tested = self.accepted = 0
        self.draft_s_per_token = self.target_s = 0.0
        self.rounds_off = 0

    @property
    def alpha(self) -> float:
        # a prior of one accepted and one rejected test keeps α away from 0 and 1 early on
        return (self.accepted + 1) / (self.tested + 2)

    @property
    def cost_ratio(self) -> float:
        return self.draft_s_per_token / self.target_s if self.target_s > 0 else 0.0

    def next_k(self) -> int:
        if self.tested == 0 or self.target_s == 0:
            return self.k  # no measurement yet
        a, c = min(self.alpha, 0.999), self.cost_ratio
        best = optimal_k(a, c, self.max_k)
        if expected_speedup(a, best, c) < 1:
            self.rounds_off += 1
            return 1 if self.rounds_off % self.probe_every == 0 else 0
        self.rounds_off = 0
        return best

    def observe(self, outcome: RoundOutcome) -> None:
        self.target_s = _ema(self.target_s, outcome.target_s)
        if outcome.drafted == 0:
            return
        self.tested += outcome.tested
        self.accepted += outcome.accepted
        self.draft_s_per_token = _ema(self.draft_s_per_token, outcome.draft_s / outcome.drafted)


def _ema(old: float, new: float, weight: float = 0.2) -> float:
    return new if old == 0 else (1 - weight) * old + weight * new


def make_policy(name: str, k: int, *, confidence_threshold: float = 0.4, max_k: int | None = None):
    """A policy object by name (fixed, heuristic, confidence, optimal); k is its starting length."""
    if name == "fixed":
        return FixedPolicy(k)
    if name == "heuristic":
        return HeuristicPolicy(k, max_k)
    if name == "confidence":
        return ConfidencePolicy(k, confidence_threshold)
    if name == "optimal":
        return OptimalPolicy(k, max_k)
    raise SpecDecodeError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
