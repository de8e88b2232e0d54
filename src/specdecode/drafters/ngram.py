"""Prompt lookup (n-gram) drafting: no model. Find the longest suffix of the context that
occurred earlier (n from max_n down to min_n) and propose the tokens that followed it.

The proposal is a deterministic function of the context, so the draft probs are one-hot and
verification accepts a token with probability p(x): exact, like any other drafter.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.proposal import Proposal
from ..errors import SpecDecodeError
from .base import DraftContext, Drafter


def lookup(context: np.ndarray, k: int, max_n: int, min_n: int) -> np.ndarray:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
    (length max_n down to min_n) of context [L]; empty if no suffix recurs."""
    L = len(context)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = context[L - n :]
        windows = np.lib.stride_tricks.sliding_window_view(context[: L - 1], n)  # starts 0..L-1-n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent occurrence, continued
            return context[start : start + k]
    return context[:0]


class NgramDrafter(Drafter):
    """Proposes up to limits[b] tokens per row by prompt lookup; a row with a shorter match
    drafts fewer (none: a plain target step for that row), and the round's width is the longest
    match. Stateless: the context is all it reads."""

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise SpecDecodeError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    @classmethod
    def create(cls, target, draft, config) -> NgramDrafter:
        return cls(config.ngram_max, config.ngram_min)

    def propose(
        self, state: None, ctx: DraftContext, limits: torch.Tensor, stop_below: float | None = None
    ) -> Proposal:
        tokens = ctx.tokens.cpu().numpy()
        lengths, ks = ctx.lengths.tolist(), limits.tolist()
        found = [lookup(tokens[b, : lengths[b]], ks[b], self.max_n, self.min_n) for b in range(ctx.size)]
        width = max(len(f) for f in found)
        out = torch.zeros(ctx.size, width, dtype=torch.long)  # padding after a row's own drafts
        for b, f in enumerate(found):
            out[b, : len(f)] = torch.from_numpy(f.copy())
        drafted = torch.tensor([len(f) for f in found], dtype=torch.long)
        return Proposal(out.to(ctx.device), None, drafted.to(ctx.device))
