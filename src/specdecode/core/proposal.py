"""Proposal: one round's drafts, what every drafter returns and the acceptance rules read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import TokenTree


@dataclass
class Proposal:
    """One round's drafts: a chain per row (row b drafted lengths[b] tokens; positions after
    that are padding), or the candidates of a token tree (every row the tree's N nodes)."""

    tokens: torch.Tensor  # [B, k] long (a tree: [B, N] node tokens)
    probs: torch.Tensor | None = None  # [B, k, V] the draft probs (None: deterministic, one-hot)
    lengths: torch.Tensor | None = None  # [B] long (None: every row drafted k)
    tree: TokenTree | None = None

    @staticmethod
    def empty(batch_size: int, device: torch.device | str = "cpu") -> Proposal:
        return Proposal(torch.zeros(batch_size, 0, dtype=torch.long, device=device))

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def draft_lengths(self) -> torch.Tensor:
        """[B] draft tokens per row."""
        if self.lengths is not None:
            return self.lengths
        B, k = self.tokens.shape
        return torch.full((B,), k, dtype=torch.long, device=self.tokens.device)
