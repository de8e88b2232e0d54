"""Draft-length policies: how many tokens to draft next round, decided from past rounds only.

Any such choice keeps the output exact: the acceptance rule is exact for every draft length,
so the length may depend on anything except the current round's target probs and uniforms.
The confidence policy also stops drafting inside a round, on the draft's own probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SpecDecodeError
from .theory import expected_tokens_per_round

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
    round_s: float | None = None  # the whole round after drafting (forward, verification, bookkeeping)


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
    """k each round from Leviathan et al.'s Theorem 3.8, with the verification cost measured:
    maximise S(k) = τ(α, k) · R(0) / (k·d + R(k)), τ = (1 − α^(k+1)) / (1 − α), where α is the
    acceptance rate so far, d the measured seconds per draft token and R(k) the measured
    seconds of a round after drafting: the target forward over k + 1 tokens per row, F(k + 1),
    plus the round's verification and bookkeeping (measured separately for drafted and
    undrafted rounds). With F flat and no bookkeeping this is the theorem's
    (1 − α^(k+1)) / ((1 − α)(kc + 1)), c = d / F(1).

    F(n) is kept per width (moving average) and read off a straight line through the widths
    measured so far, so when a large batch makes the verification forward compute-bound
    (F(k+1) >> F(1)) the policy shortens k or stops drafting. It explores first: drafts at
    k = 1 and at the given k in turn until `min_tests` draft tokens have been tested (so one
    early rejection does not decide, and F is measured at two widths), with one undrafted round
    after the first drafted one to measure F(1) (again every `refresh_every` rounds). If then
    no k beats target-only decoding, it drafts nothing, probing with k = 1 after `probe_every`
    rounds so α and the costs stay current; each probe
    that leaves drafting off doubles the wait (up to 256 rounds), and once no k would pay even
    if every draft were accepted (α = 1: drafting and verification cost more than the k + 1
    tokens they can give, as at large batches) it stops probing for good. A pair that never
    pays thus costs little over target-only decoding: the exploration, then almost nothing."""

    name = "optimal"

    def __init__(
        self,
        k: int,
        max_k: int | None = None,
        probe_every: int = 16,
        refresh_every: int = 64,
        min_tests: int = 8,
    ) -> None:
        super().__init__(k)
        self.min_tests = min_tests
        self.max_k = max_k or max(2 * k, 8)
        self.probe_every = probe_every
        self.refresh_every = refresh_every
        self.tested = self.accepted = 0
        self.draft_s_per_token = 0.0
        self.width_s: dict[int, float] = {}  # n tokens per row -> seconds of the target forward
        self.overhead_s = {False: 0.0, True: 0.0}  # rest of an undrafted / drafted round
        self.rounds = self.rounds_off = 0
        self.hopeless = False  # no k pays even at α = 1: drafting stays off
        self.explored = 0
        self.probe_wait = probe_every
        self.drafted_last = True  # the drafter starts in step (prefilled with the target)

    @property
    def alpha(self) -> float:
        # a prior of one accepted and one rejected test keeps α away from 0 and 1 early on
        return (self.accepted + 1) / (self.tested + 2)

    def _cost_line(self) -> tuple[float, float, float]:
        """(mean width, mean seconds, slope) of the least-squares line through the measured
        widths (slope never negative; 0 if one width is known)."""
        xs, ys = list(self.width_s), list(self.width_s.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
        return mx, my, slope

    def target_cost(self, n: int, line: tuple[float, float, float] | None = None) -> float:
        """F(n), seconds of a target forward over n tokens per row: measured, or read off the
        line through the measured widths (never below the cheapest measured one)."""
        if n in self.width_s or not self.width_s:
            return self.width_s.get(n, 0.0)
        mx, my, slope = line or self._cost_line()
        return max(my + slope * (n - mx), min(self.width_s.values()))

    @property
    def cost_ratio(self) -> float:
        """c = d / F(1): a draft token's cost relative to a one-token target forward."""
        t1 = self.target_cost(1)
        return self.draft_s_per_token / t1 if t1 > 0 else 0.0

    def speedups(self, alpha: float | None = None) -> list[float]:
        """Expected speed-up over target-only decoding for k = 0..max_k (1.0 at k = 0), at the
        measured α or the one given."""
        line = self._cost_line()
        a, d = min(self.alpha if alpha is None else alpha, 0.999999), self.draft_s_per_token
        plain = self.target_cost(1, line) + self.overhead_s[False]
        extra = self.overhead_s[True] or self.overhead_s[False]
        return [1.0] + [
            expected_tokens_per_round(a, k) * plain / (k * d + self.target_cost(k + 1, line) + extra)
            for k in range(1, self.max_k + 1)
        ]

    def next_k(self) -> int:
        self.rounds += 1
        if self.tested == 0 or not self.width_s:
            self.explored += 1
            return 1  # no measurement yet: a cheap probe
        if 1 not in self.width_s or self.rounds % self.refresh_every == 0:
            return 0  # measure F(1)
        if self.tested < self.min_tests:  # explore, alternating widths so F(n) is fitted, not guessed
            self.explored += 1
            return self.k if self.explored % 2 == 0 else 1
        if self.hopeless:
            return 0
        gains = self.speedups()
        best = max(range(1, self.max_k + 1), key=gains.__getitem__)
        if gains[best] < 1:
            if max(self.speedups(alpha=1.0)) <= 1:
                self.hopeless = True
                return 0
            self.rounds_off += 1
            if self.rounds_off < self.probe_wait:
                return 0
            self.rounds_off, self.probe_wait = 0, min(2 * self.probe_wait, 256)
            return 1
        self.rounds_off, self.probe_wait = 0, self.probe_every
        return best

    def observe(self, outcome: RoundOutcome) -> None:
        n, drafted = outcome.drafted + 1, outcome.drafted > 0
        self.width_s[n] = _ema(self.width_s.get(n, 0.0), outcome.target_s)
        if outcome.round_s is not None:
            rest = max(outcome.round_s - outcome.target_s, 1e-9)
            self.overhead_s[drafted] = _ema(self.overhead_s[drafted], rest)
        resumed = not self.drafted_last  # a drafter first catches up on the tokens it skipped
        self.drafted_last = drafted
        if not drafted:
            return
        self.tested += outcome.tested
        self.accepted += outcome.accepted
        if not (resumed and self.draft_s_per_token):  # catching up is not the cost of a draft token
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
