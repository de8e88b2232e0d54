"""Draft-length policies: how many tokens each row drafts next round, decided from that row's
past rounds only (never from its batch mates, so a seeded row's output does not depend on them).

Any such choice keeps the output exact: the acceptance rule is exact for every draft length,
so the length may depend on anything except the current round's target probs and uniforms.
The confidence policy also stops drafting inside a round, on the draft's own probabilities.
Every policy is reproducible under a seed; the optimal one reads a cost model that is measured
once per generator (or given), never re-timed during a run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core.config import DEFAULT_CONFIDENCE, POLICIES, SpecConfig, adaptive_max_k
from ..core.theory import expected_tokens_per_round
from ..drafters.base import PrefixThreshold
from ..errors import SpecDecodeError


@dataclass
class RoundOutcome:
    """What a policy may learn from one finished round, per live row."""

    drafted: list[int]  # draft tokens the row proposed
    tested: list[int]  # draft positions the target checked (accepted ones and the first rejection)
    accepted: list[int]  # draft tokens accepted


class FixedPolicy:
    """Always k, for every row."""

    name = "fixed"
    stop_below: float | None = None

    def __init__(self, k: int) -> None:
        self.k = self.max_k = k
        self.ks: list[int] = []  # per live row: its next draft length

    def add_rows(self, n: int) -> None:
        self.ks += [self.k] * n

    def select_rows(self, rows: Sequence[int]) -> None:
        self.ks = [self.ks[i] for i in rows]

    def next_k(self) -> list[int]:
        return list(self.ks)

    def observe(self, outcome: RoundOutcome) -> None:
        pass


class HeuristicPolicy(FixedPolicy):
    """transformers' schedule, per row: +2 after a round whose drafts were all accepted, −1
    otherwise (never below 1, never above max_k)."""

    name = "heuristic"

    def __init__(self, k: int, max_k: int | None = None) -> None:
        super().__init__(k)
        self.max_k = adaptive_max_k(k, max_k)

    def observe(self, outcome: RoundOutcome) -> None:
        for b, (d, a) in enumerate(zip(outcome.drafted, outcome.accepted)):
            if d:
                self.ks[b] = min(self.ks[b] + 2, self.max_k) if a == d else max(self.ks[b] - 1, 1)


class ConfidencePolicy(FixedPolicy):
    """Draft up to k tokens, but a row stops as soon as the draft's probability of its own token
    falls below `threshold` (transformers' assistant_confidence_threshold, 0.4)."""

    name = "confidence"

    def __init__(self, k: int, threshold: float = DEFAULT_CONFIDENCE) -> None:
        if not 0 < threshold < 1:
            raise SpecDecodeError(f"confidence threshold must be in (0, 1), got {threshold}")
        super().__init__(k)
        self.stop_below = threshold


class PrefixPolicy(FixedPolicy):
    """Draft up to max_k tokens (default max(2k, 8)), but a row stops as soon as the product of
    the draft's probabilities of its tokens this round, by the draft's own reckoning the chance
    that the target accepts every one of them, falls below `threshold`.

    Drafting one more token pays a draft step d and one more verified row ΔV, and returns a
    token (worth a target step T1) about as often as that product says; so a row should go on
    while the product is at least (d + ΔV) / T1. open_models sets the threshold so from the
    calibration's measured costs (autotune.Choice.prefix_threshold): ~0.5 on an AVX2-only CPU,
    where a verified row of the 1.5B costs a fifth of a step, ~0.25 where it costs a twentieth.
    Measured on the Qwen pair on an AVX2-only EPYC (benchmarks/NOTES.md, issue 53; threshold 0.47
    from its costs): 6-10% more tokens/s than the confidence policy's per-token 0.4 at k = 4 on
    code, HumanEval and Spec-Bench, the same tokens."""

    name = "prefix"

    def __init__(self, k: int, threshold: float = DEFAULT_CONFIDENCE, max_k: int | None = None) -> None:
        if not 0 < threshold < 1:
            raise SpecDecodeError(f"prefix threshold must be in (0, 1), got {threshold}")
        super().__init__(adaptive_max_k(k, max_k))
        self.stop_below = PrefixThreshold(threshold)


@dataclass
class CostModel:
    """Seconds of one whole round (drafting, the target forward, verification, bookkeeping)
    when every row drafts k tokens, measured at a few k (k = 0: a round with nothing drafted)
    on a batch of `batch_size` rows; other k are read off the straight line through the
    measured k >= 1."""

    round_s: dict[int, float]
    batch_size: int = 1

    def round_cost(self, k: int) -> float:
        """R(k): measured, or read off the least-squares line through the drafted widths (never
        below the cheapest drafted one)."""
        if k in self.round_s:
            return self.round_s[k]
        pts = [(x, y) for x, y in self.round_s.items() if x >= 1] or list(self.round_s.items())
        mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
        var = sum((x - mx) ** 2 for x, _ in pts)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in pts) / var) if var else 0.0
        return max(my + slope * (k - mx), min(y for _, y in pts))

    def to_dict(self) -> dict:
        return {"round_s": {str(k): s for k, s in self.round_s.items()}, "batch_size": self.batch_size}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @staticmethod
    def load(path: str | Path) -> CostModel:
        try:
            d = json.loads(Path(path).read_text())
            round_s = {int(k): float(s) for k, s in d["round_s"].items()}
            if 0 not in round_s or len(round_s) < 2 or min(round_s.values()) <= 0:
                raise ValueError("needs positive round costs at k = 0 and at least one k >= 1")
            return CostModel(round_s, int(d.get("batch_size", 1)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise SpecDecodeError(
                f"cost model {path}: unreadable ({e}); give a file written by --cost-model, or none"
            ) from None


class OptimalPolicy(FixedPolicy):
    """k per row from Leviathan et al.'s Theorem 3.8 with measured round costs: maximise
    S(k) = τ(α, k) · R(0) / R(k), τ = (1 − α^(k+1)) / (1 − α), where α is the row's own
    acceptance rate so far and R(k) the cost model's seconds of a round drafting k tokens.
    With R(k) = k·d + T (a flat verification forward T, d per draft token, no overhead) this is
    the theorem's (1 − α^(k+1)) / ((1 − α)(kc + 1)), c = d / T. When the batch the costs were
    measured on makes verification compute-bound (R grows fast with k), it shortens k or stops.

    Each row explores first: drafts at k = 1 and the given k in turn until `min_tests` of its
    draft tokens were tested (so one early rejection does not decide). If then no k beats
    target-only decoding, the row drafts nothing, probing with k = 1 after `probe_every`
    rounds; each probe that leaves drafting off doubles the wait (up to 256 rounds). If no k
    pays even at α = 1, no row drafts at all."""

    name = "optimal"

    def __init__(
        self, k: int, cost: CostModel, max_k: int | None = None, probe_every: int = 16, min_tests: int = 8
    ) -> None:
        super().__init__(k)
        self.cost, self.min_tests, self.probe_every = cost, min_tests, probe_every
        self.max_k = adaptive_max_k(k, max_k)
        self.rows: list[dict] = []
        self.hopeless = max(self.speedups(1.0)) <= 1

    def add_rows(self, n: int) -> None:
        super().add_rows(n)
        self.rows += [
            {"tested": 0, "accepted": 0, "explored": 0, "off": 0, "wait": self.probe_every} for _ in range(n)
        ]

    def select_rows(self, rows: Sequence[int]) -> None:
        super().select_rows(rows)
        self.rows = [self.rows[i] for i in rows]

    @staticmethod
    def alpha(row: dict) -> float:
        # a prior of one accepted and one rejected test keeps α away from 0 and 1 early on
        return (row["accepted"] + 1) / (row["tested"] + 2)

    def speedups(self, alpha: float) -> list[float]:
        """Expected speed-up over rounds that draft nothing, for k = 0..max_k (1.0 at k = 0)."""
        a, R = min(alpha, 0.999999), self.cost.round_cost
        return [1.0] + [expected_tokens_per_round(a, k) * R(0) / R(k) for k in range(1, self.max_k + 1)]

    def _row_k(self, row: dict) -> int:
        if self.hopeless:
            return 0
        if row["tested"] < self.min_tests:  # explore, alternating k = 1 and the given k
            row["explored"] += 1
            return self.k if row["explored"] % 2 == 0 else 1
        gains = self.speedups(self.alpha(row))
        best = max(range(1, self.max_k + 1), key=gains.__getitem__)
        if gains[best] >= 1:
            row["off"], row["wait"] = 0, self.probe_every
            return best
        row["off"] += 1
        if row["off"] < row["wait"]:
            return 0
        row["off"], row["wait"] = 0, min(2 * row["wait"], 256)
        return 1

    def next_k(self) -> list[int]:
        self.ks = [self._row_k(r) for r in self.rows]
        return list(self.ks)

    def observe(self, outcome: RoundOutcome) -> None:
        for row, t, a in zip(self.rows, outcome.tested, outcome.accepted):
            row["tested"] += t
            row["accepted"] += a


def make_policy(config: SpecConfig, cost: CostModel | None = None):
    """A fresh policy object for one run (per-row state is added as rows arrive)."""
    name, k = config.policy, config.k
    if name == "fixed":
        return FixedPolicy(k)
    if name == "heuristic":
        return HeuristicPolicy(k, config.max_k)
    threshold = DEFAULT_CONFIDENCE if config.confidence_threshold is None else config.confidence_threshold
    if name == "confidence":
        return ConfidencePolicy(k, threshold)
    if name == "prefix":
        return PrefixPolicy(k, threshold, config.max_k)
    if name == "optimal":
        if cost is None:
            raise SpecDecodeError("the optimal policy needs a cost model")
        return OptimalPolicy(k, cost, config.max_k)
    raise SpecDecodeError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")


@dataclass
class LoadCosts:
    """Seconds of one whole round at several batch sizes: {batch size: {k: seconds}}, measured
    by SpeculativeGenerator.measure_load_costs. A batch size between two measured ones is read
    off the straight line between them (beyond the largest: the line through the last two)."""

    round_s: dict[int, dict[int, float]]

    def at(self, batch: int) -> CostModel:
        sizes = sorted(self.round_s)
        if batch in self.round_s or len(sizes) == 1:
            b = batch if batch in self.round_s else sizes[0]
            return CostModel(self.round_s[b], b)
        lo = max([s for s in sizes if s < batch], default=sizes[0])
        hi = min([s for s in sizes if s > batch], default=sizes[-1])
        if lo == hi:  # outside the measured range: the nearest two
            lo, hi = (sizes[0], sizes[1]) if batch < sizes[0] else (sizes[-2], sizes[-1])
        t = (batch - lo) / (hi - lo)
        ks = set(self.round_s[lo]) & set(self.round_s[hi])
        costs = {k: max(1e-9, (1 - t) * self.round_s[lo][k] + t * self.round_s[hi][k]) for k in ks}
        return CostModel(costs, batch)

    def to_dict(self) -> dict:
        return {"round_s": {str(b): {str(k): s for k, s in c.items()} for b, c in self.round_s.items()}}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @staticmethod
    def load(path: str | Path) -> LoadCosts:
        try:
            d = json.loads(Path(path).read_text())["round_s"]
            costs = {int(b): {int(k): float(s) for k, s in c.items()} for b, c in d.items()}
            if not costs or any(0 not in c or len(c) < 2 or min(c.values()) <= 0 for c in costs.values()):
                raise ValueError("needs positive round costs at k = 0 and some k >= 1 for each batch size")
            return LoadCosts(costs)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise SpecDecodeError(
                f"load costs {path}: unreadable ({e}); give a file written by `specdecode serve "
                "--load-costs`, or none"
            ) from None


class OnlineCosts:
    """The load-aware round costs as the server actually pays them: the start-up table
    (LoadCosts, timed on a synthetic batch) times a correction learned from every round the
    server runs. R(B, w) = table(B, w) · c(bucket(B), w > 0), where c is a running estimate
    (exponentially weighted, weight `rate`) of observed / table seconds for the rounds of that
    batch-size bucket (powers of two) that drafted (w > 0) or did not (w = 0), starting from 1
    and moved at most 3x by one round (a warm-up round or a pause does not flip decisions). A
    cell last updated more than `stale` observations ago is replaced by its next observation, so
    a probe after a slow spell resets the estimate at once.

    Measured (benchmarks/NOTES.md, issue 28): the start-up table, timed on a repetitive prompt,
    calls break-even rounds that cost more in service (mixed lengths, the drafter's catch-up
    forwards, stray prefill), so the policy drafted where it lost.

    `overhead` is the running mean of the seconds each loop iteration spends outside the round
    (admission prefills): reported (to_dict), never added to a round's cost. Prefill seconds are
    paid per prompt token whatever the rounds draft, so a term added to every candidate only
    makes a wide round look cheaper (a fixed cost shared by more tokens): measured on the pair at
    c = 4 (NOTES, issue 37 fourth session), 3.6 s of prefill made the policy draft 4 tokens at
    B = 4 in rounds of 0.54 s where a round without drafts costs 0.08 s."""

    def __init__(self, table: LoadCosts, rate: float = 0.25, stale: int = 32) -> None:
        self.table, self.rate, self.stale = table, rate, stale
        self.ratio: dict[tuple[int, bool], float] = {}  # (bucket, drafted) -> observed / table
        self.updated: dict[tuple[int, bool], int] = {}  # (bucket, drafted) -> observation number
        self.overhead = 0.0
        self.seen = 0

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(0, int(batch) - 1).bit_length()

    def correction(self, batch: int, drafted: bool) -> float:
        """observed / table for rounds of this bucket that drafted (or not). A kind not seen yet
        borrows from the other: a drafting round holds a plain round's forward, so it is taken
        to be at least as far over the table as plain rounds were (max(1, plain)), and a plain
        round at most as far as drafting rounds were (min(1, drafting)). Measured: a server whose
        rows never drafted at B = 3 learned plain rounds at 1.7x the table (longer contexts than
        the table's), and a raw one-token round then looked cheaper than none."""
        bucket = self.bucket(batch)
        own = self.ratio.get((bucket, drafted))
        if own is not None:
            return own
        other = self.ratio.get((bucket, not drafted), 1.0)
        return max(1.0, other) if drafted else min(1.0, other)

    def record(self, batch: int, width: int, seconds: float, overhead: float = 0.0) -> None:
        """One finished round of `batch` rows drafting up to `width` tokens took `seconds`
        (the round itself), and the loop spent `overhead` seconds outside it."""
        self.seen += 1
        self.overhead += self.rate * (overhead - self.overhead)
        predicted = self.table.at(batch).round_cost(width)
        if predicted <= 0 or seconds <= 0:
            return
        key = (self.bucket(batch), width > 0)
        r = seconds / predicted
        old = self.ratio.get(key)
        if old is not None and self.seen - self.updated[key] > self.stale:
            self.ratio[key] = r  # a probe after a long pause: what rounds cost now
        else:  # a running mean of log ratios, each round moving it by at most a factor 3
            old = 1.0 if old is None else old
            r = min(max(r, old / 3), old * 3)
            self.ratio[key] = math.exp(math.log(old) + self.rate * (math.log(r) - math.log(old)))
        self.updated[key] = self.seen

    def at(self, batch: int) -> CostModel:
        base = self.table.at(batch)
        plain, drafting = self.correction(batch, False), self.correction(batch, True)
        costs = {k: s * (drafting if k > 0 else plain) for k, s in base.round_s.items()}
        return _Corrected(costs, batch, base, drafting)

    def to_dict(self) -> dict:
        return {
            "overhead_s": self.overhead,
            "corrections": {f"{b}{'+draft' if d else ''}": r for (b, d), r in sorted(self.ratio.items())},
            "rounds": self.seen,
        }


@dataclass
class _Corrected(CostModel):
    """A CostModel whose k not in the table is read off the table's line, then corrected."""

    base: CostModel | None = None
    drafting: float = 1.0

    def round_cost(self, k: int) -> float:
        if k in self.round_s or self.base is None:
            return super().round_cost(k)
        return self.base.round_cost(k) * self.drafting


def seconds_saved_per_token(
    costs: LoadCosts | OnlineCosts, batch: int, k: int, alpha: float = 0.9
) -> float:
    """Seconds one row's token costs less with drafts than without, in a batch of `batch` rows
    that each accept `alpha` of their drafts: R(0) - min over c in 1..k of R(c) / tau(alpha, c),
    at these round costs (each row gets one token per plain round, tau per drafting round); 0
    where no draft length beats none. What a row's draft-model prefill must be paid back from."""
    if k < 1:
        return 0.0
    cost = costs.at(batch)
    plain = cost.round_cost(0)
    best = min(cost.round_cost(c) / expected_tokens_per_round(alpha, c) for c in range(1, k + 1))
    return max(0.0, plain - best)


def drafting_pays(costs: LoadCosts | OnlineCosts, batch: int, k: int, alpha: float = 0.9) -> bool:
    """Would some draft length 1..k beat no drafting for `batch` rows that each accept `alpha`
    of their drafts, at these round costs (the table, or the server's learned ones)? With the
    default, optimistic alpha, False means drafting loses at this batch size with any drafter a
    user would run: a server then skips the draft model's prefill of what it admits (loop.py)."""
    return seconds_saved_per_token(costs, batch, k, alpha) > 0


class LoadAwarePolicy:
    """Wraps a policy for a server: each round it caps the rows' draft lengths at the one that
    maximises the batch's expected tokens per second, Σ_b τ(α_b, min(k_b, cap)) / R_B(width),
    where R_B is the round cost at the running batch size B (LoadCosts measured at start, or
    OnlineCosts: that table corrected by the rounds actually run, see record()) and α_b each
    row's own acceptance so far (shrunk toward the pooled acceptance of every row seen).
    cap = 0 (no drafting) is always a candidate, so when the verification forward turns
    compute-bound at a large batch the rows stop drafting, and the server is never expected to
    be slower than with speculation off.

    A row whose drafter drafts more than k when left uncapped (suffix, up to suffix_max) is rated
    at the length it drafted in its uncapped rounds, so the cost of that wider forward counts.
    Until `min_tests` draft tokens were tested (pooled) every α counts as at least 0.5; when the
    cap is 0 only because acceptance looks low, it probes with one draft token after
    `probe_every` rounds, doubling the wait after each probe that changes nothing.

    Rows sampled (temperature > 0) under a seed by the standard rule are never capped: their
    draft lengths decide which uniforms they draw, so capping them by load would make a seeded
    output depend on what else is running. Greedy, unseeded and invariant-rule rows (whose text
    no draft length changes) are capped freely (exactness holds for any draft length)."""

    def __init__(
        self, inner, costs: LoadCosts | OnlineCosts, params_of, min_tests: int = 16, probe_every: int = 16
    ) -> None:
        self.inner, self.costs, self.params_of = inner, costs, params_of
        self.name = f"{inner.name}+load"
        self.stop_below = inner.stop_below
        self.max_k = inner.max_k
        self.rows: list[list[float]] = []  # per live row: [tested, accepted, drafted when uncapped]
        self._uncapped: list[bool] = []  # per live row: last round's limit was the policy's own
        self.pool = [0, 0]  # every row's, finished ones included: [tested, accepted]
        self.cap: int | None = None  # the last round's cap (None: no rows)
        self.min_tests, self.probe_every = min_tests, probe_every
        self.off, self.wait = 0, probe_every  # rounds capped at 0 since the last probe; the wait
        self.width, self.batch = 0, 0  # the last planned round: its widest draft (its cost's k), its rows

    def add_rows(self, n: int) -> None:
        self.inner.add_rows(n)
        self.rows += [[0, 0, -1.0] for _ in range(n)]
        self._uncapped += [False] * n

    def select_rows(self, rows: Sequence[int]) -> None:
        self.inner.select_rows(rows)
        self.rows = [self.rows[i] for i in rows]
        self._uncapped = [self._uncapped[i] for i in rows]

    def observe(self, outcome: RoundOutcome) -> None:
        self.inner.observe(outcome)
        for b, (row, t, a) in enumerate(zip(self.rows, outcome.tested, outcome.accepted)):
            row[0] += t
            row[1] += a
            if b < len(self._uncapped) and self._uncapped[b]:  # what the drafter drafts when free
                d = outcome.drafted[b]
                row[2] = d if row[2] < 0 else 0.7 * row[2] + 0.3 * d
        self.pool[0] += sum(outcome.tested)
        self.pool[1] += sum(outcome.accepted)

    def alpha(self, row: list[int]) -> float:
        """The row's acceptance so far, shrunk toward the acceptance of every row this policy
        has seen (a new row, or one that drafted nothing yet, gets the pooled rate: a prior of
        0.5 made a weak drafter look worth drafting for at every load)."""
        pooled = (self.pool[1] + 1) / (self.pool[0] + 2)
        return min((row[1] + 2 * pooled) / (row[0] + 2), 0.999999)

    def pooled_alpha(self) -> float | None:
        """The acceptance of every row this policy has seen, once `min_tests` draft tokens were
        tested (None before)."""
        return (self.pool[1] + 1) / (self.pool[0] + 2) if self.pool[0] >= self.min_tests else None

    def next_k(self) -> list[int]:
        ks = self.inner.next_k()
        if not ks:
            return ks
        params = self.params_of()
        exempt = [p.drafts_decide for p in params]
        cost = self.costs.at(len(ks))
        alphas = [self.alpha(row) for row in self.rows]
        if self.pool[0] < self.min_tests:  # explore: a few rejections must not decide
            alphas = [max(a, 0.5) for a in alphas]
        fixed_width = max([k for k, e in zip(ks, exempt) if e], default=0)

        # a drafter may draft more than k when not capped below k (suffix: up to suffix_max);
        # rate that case at what the row drafted in its uncapped rounds
        free = [max(k, round(row[2])) for k, row in zip(ks, self.rows)]

        def rate(cap: int, alphas: list[float]) -> float:
            capped = [f if e or cap >= k else min(k, cap) for k, f, e in zip(ks, free, exempt)]
            tokens = sum(expected_tokens_per_round(a, k) for a, k in zip(alphas, capped))
            return tokens / cost.round_cost(max(max(capped), fixed_width))

        caps = range(max(ks) + 1)
        best = max(caps, key=lambda c: (rate(c, alphas), -c))
        if best > 0:
            self.off, self.wait = 0, self.probe_every
        elif self._could_pay(ks, free, exempt, fixed_width):
            # off, though drafting would pay at this load with a good drafter at the costs
            # measured at start: probe with one draft token now and then (each probe that turns
            # nothing on doubles the wait, up to 256 rounds), so an acceptance spoilt by early
            # rejections, or a round cost learned in a slow spell, recovers
            self.off += 1
            if self.off >= self.wait:
                best, self.off, self.wait = 1, 0, min(2 * self.wait, 256)
        self.cap = best
        capped = [f if e or best >= k else min(k, best) for k, f, e in zip(ks, free, exempt)]
        self.width, self.batch = max(max(capped), fixed_width), len(ks)
        self._uncapped = [e or best >= k for k, e in zip(ks, exempt)]
        return [k if e else min(k, best) for k, e in zip(ks, exempt)]

    def _could_pay(self, ks: list[int], free: list[int], exempt: list[bool], fixed_width: int) -> bool:
        """Would some cap > 0 beat no drafting if every row accepted 90% and rounds cost what
        the start-up table says?"""
        table = self.costs.table if isinstance(self.costs, OnlineCosts) else self.costs
        cost = table.at(len(ks))

        def rate(cap: int) -> float:
            capped = [f if e or cap >= k else min(k, cap) for k, f, e in zip(ks, free, exempt)]
            tokens = sum(expected_tokens_per_round(0.9, k) for k in capped)
            return tokens / cost.round_cost(max(max(capped), fixed_width))

        return max(range(max(ks) + 1), key=lambda c: (rate(c), -c)) > 0

    def record(self, seconds: float, overhead: float = 0.0) -> None:
        """The last round (the one next_k() planned) took `seconds`, and the loop spent
        `overhead` seconds outside it: corrects the round costs when they are learned online
        (OnlineCosts), else nothing."""
        if isinstance(self.costs, OnlineCosts) and self.cap is not None:
            self.costs.record(self.batch, self.width, seconds, overhead)
