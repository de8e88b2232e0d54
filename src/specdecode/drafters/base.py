"""The drafter interface: propose k tokens with their draft probs, then keep what was accepted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..engine import Batch


@dataclass
class Proposal:
    """One round's drafts. Row b drafted lengths[b] tokens; positions after that are padding."""

    tokens: torch.Tensor  # [B, k'] long
    probs: torch.Tensor | None = None  # [B, k', V] the draft probs (None: deterministic, one-hot)
    lengths: torch.Tensor | None = None  # [B] long (None: every row drafted k')

    @staticmethod
    def empty(batch_size: int) -> Proposal:
        return Proposal(torch.zeros(batch_size, 0, dtype=torch.long))


class StopTracker:
    """Per-row early stop of drafting on low draft confidence (stop_below): row b keeps the
    tokens up to and including the first one whose draft probability falls below it."""

    def __init__(self, batch_size: int, stop_below: float | None) -> None:
        self.stop_below = stop_below
        self.active = torch.ones(batch_size, dtype=torch.bool)
        self.lengths = torch.zeros(batch_size, dtype=torch.long)

    def update(self, step: int, conf: torch.Tensor | None) -> bool:
        """After drafting token `step` (0-based) with confidence [B]; True when every row stopped."""
        self.lengths[self.active] = step + 1
        if self.stop_below is not None and conf is not None:
            self.active &= conf >= self.stop_below
        return not bool(self.active.any())

    def result(self) -> torch.Tensor | None:
        return self.lengths if self.stop_below is not None else None


class DraftChain:
    """One round's chain of draft tokens: each drawn from the drafter's logits (warped and
    sampled, or argmax when the batch is greedy), its draft probs kept, and per-row stops on
    low confidence tracked. The shared part of every autoregressive drafter's propose()."""

    def __init__(self, batch: Batch, stop_below: float | None) -> None:
        self.batch, self.stop_below = batch, stop_below
        self.greedy = batch.warp.all_greedy
        self.tokens: list[torch.Tensor] = []  # each [B]
        self.probs: list[torch.Tensor] = []  # each [B, V] (empty when greedy)
        self.stop = StopTracker(batch.size, stop_below)

    def draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Draw the next token [B] from logits [B, V]; also True once every row has stopped."""
        from ..sampling import logits_to_probs, sample

        if self.greedy:
            tok = logits.argmax(-1)
        else:
            q = logits_to_probs(logits.unsqueeze(1), self.batch.warp).squeeze(1)  # [B, V]
            tok = sample(q, self.batch.exp_noise(q.shape[-1]))
            self.probs.append(q)
        self.tokens.append(tok)
        conf = None
        if self.stop_below is not None:
            conf = confidence(logits, self.probs or None, tok.view(-1, 1))
        return tok, self.stop.update(len(self.tokens) - 1, conf)

    def proposal(self, lengths: torch.Tensor | None = None) -> Proposal:
        probs = None if self.greedy else torch.stack(self.probs, 1)
        return Proposal(
            torch.stack(self.tokens, 1), probs, self.stop.result() if lengths is None else lengths
        )


class Drafter(Protocol):
    def start(self, batch: Batch, target_cache) -> None:
        """A new batch begins: set up per-row state (caches) for batch.tokens / batch.lengths.
        target_cache is the target's cache, for drafters that share it (early exit)."""

    def propose(self, batch: Batch, k: int, stop_below: float | None = None) -> Proposal:
        """Up to k draft tokens per row and the draft probs they were drawn from. With
        stop_below, a row stops after a token whose draft probability is below it."""
        ...

    def commit(self, lengths: torch.Tensor) -> None:
        """The first lengths[b] tokens of row b are now final; forget anything after them."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows (others finished)."""


def confidence(logits: torch.Tensor, probs: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """[B] the draft's probability of its chosen tokens [B, 1]: from the warped probs when it
    sampled, from the plain softmax when it decoded greedily."""
    p = probs[-1] if probs is not None else torch.softmax(logits.float(), -1)
    return p.gather(1, tokens).squeeze(1)
