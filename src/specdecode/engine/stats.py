"""Per-row totals of a generation, and the trace: one record per row per round."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

HOW = ("accepted", "resampled", "bonus")


@dataclass
class GenerationStats:
    """Totals for one row (or, merged, for a batch).

    target_forwards counts the target's decoding forwards (one per round; the prefill is not
    counted, nor is a first token a server took from the prefill's forward: a round without
    one), so tokens_per_forward = new_tokens / target_forwards.
    acceptance_rate = accepted / tested: the probability that a draft token the target
    checked was accepted, Leviathan et al.'s alpha (= E[min(1, p/q)] = 1 - TV(p, q)), the
    alpha of (1 - alpha^(k+1)) / (1 - alpha). Positions after a rejection are never tested.
    draft_acceptance_rate = accepted / drafted (vLLM's figure; it also counts untested drafts).
    draft_s and target_s are the seconds the row's batch spent proposing and in the target's
    decoding forwards (shared by the rows of a batch; the rest of wall_s is prefill and overhead).
    cost_ratio = (draft_s / drafted) / (target_s / target_forwards): the drafter's seconds per
    draft token against the target's per forward, the c of speedup = E[tokens] / (k c + 1) as this
    run measured it (a draft model's forwards include its catch-up on the accepted tokens).
    per_position_acceptance[i] is the fraction of rounds whose draft position i was accepted
    (vLLM's convention: not conditioned on reaching position i).
    """

    rounds: int = 0
    target_forwards: int = 0
    drafted: int = 0
    tested: int = 0
    accepted: int = 0
    new_tokens: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0  # seconds of the prompt's prefill (included in wall_s)
    draft_s: float = 0.0  # seconds the row's batch spent proposing drafts
    target_s: float = 0.0  # seconds the row's batch spent in decoding target forwards
    position_accepted: list[int] = field(default_factory=list)
    position_drafted: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.tested if self.tested else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cost_ratio(self) -> float:
        if not (self.drafted and self.target_forwards and self.target_s > 0):
            return 0.0
        return (self.draft_s / self.drafted) / (self.target_s / self.target_forwards)

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    def to_dict(self) -> dict:
        """The `stats` object of the CLI's --json output (docs/contract.md)."""
        return {
            "rounds": self.rounds,
            "target_forwards": self.target_forwards,
            "drafted": self.drafted,
            "tested": self.tested,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "tokens_per_forward": self.tokens_per_forward,
            "per_position_acceptance": self.per_position_acceptance,
            "new_tokens": self.new_tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "target_s": self.target_s,
            "cost_ratio": self.cost_ratio,
        }

    @staticmethod
    def merge(parts: list[GenerationStats], wall_s: float) -> GenerationStats:
        """Totals over rows that ran together for wall_s seconds."""
        n = max((len(p.position_drafted) for p in parts), default=0)

        def col(name: str) -> list[int]:
            return [sum(getattr(p, name)[i] for p in parts if i < len(getattr(p, name))) for i in range(n)]

        return GenerationStats(
            rounds=sum(p.rounds for p in parts),
            target_forwards=sum(p.target_forwards for p in parts),
            drafted=sum(p.drafted for p in parts),
            tested=sum(p.tested for p in parts),
            accepted=sum(p.accepted for p in parts),
            new_tokens=sum(p.new_tokens for p in parts),
            wall_s=wall_s,
            prefill_s=max((p.prefill_s for p in parts), default=0.0),
            draft_s=max((p.draft_s for p in parts), default=0.0),  # rows of one batch share them
            target_s=max((p.target_s for p in parts), default=0.0),
            position_accepted=col("position_accepted"),
            position_drafted=col("position_drafted"),
        )


@dataclass
class RoundRecord:
    """One row's round, as written to a --trace file (one JSON line)."""

    row: int
    round: int
    draft_token_ids: list[int]
    draft_prob: list[float]
    target_prob: list[float]
    accept_prob: list[float]
    uniform: list[float | None]
    accepted: list[bool]
    emitted_token_ids: list[int]
    how: list[str]

    def to_dict(self) -> dict:
        return asdict(self)
