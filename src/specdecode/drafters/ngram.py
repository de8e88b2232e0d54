"""Prompt lookup (n-gram) drafting: no model. Find the longest suffix of the context that
occurred earlier (n from max_n down to min_n) and propose the tokens that followed it.

The proposal is a deterministic function of the context, so the draft probs are one-hot and
verification accepts a token with probability p(x): exact, like any other drafter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import SpecDecodeError
from .base import Proposal

if TYPE_CHECKING:
    from ..engine import Batch


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


class NgramDrafter:
    """Proposes up to k tokens per row by prompt lookup; a row with a shorter match drafts fewer
    (none: a plain target step for that row), and the round's width is the longest match."""

    model = None

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise SpecDecodeError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def start(self, batch: Batch, target_cache) -> None:
        pass

    def propose(self, batch: Batch, k: int, stop_below: float | None = None) -> Proposal:
        tokens = batch.tokens.numpy()
        lengths = batch.lengths.tolist()
        found = [lookup(tokens[b, : lengths[b]], k, self.max_n, self.min_n) for b in range(batch.size)]
        width = max(len(f) for f in found)
        out = torch.zeros(batch.size, width, dtype=torch.long)  # padding after a row's own drafts
        for b, f in enumerate(found):
            out[b, : len(f)] = torch.from_numpy(f.copy())
        return Proposal(out, None, torch.tensor([len(f) for f in found], dtype=torch.long))

    def commit(self, lengths: torch.Tensor) -> None:
        pass

    def select_rows(self, rows: torch.Tensor) -> None:
        pass
