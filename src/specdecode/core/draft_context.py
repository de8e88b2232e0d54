"""DraftContext: the narrow view of the running batch a drafter sees (the engine's rows make
one per round)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import RowRandom, Warp


@dataclass
class DraftContext:
    """What a drafter sees of the running batch: the tokens so far and how to sample."""

    tokens: torch.Tensor  # [B, capacity] long: prompt + generated tokens per row
    lengths: torch.Tensor  # [B] long: tokens per row; the last is pending (not yet in the target cache)
    warp: Warp  # per-row sampling parameters
    rng: RowRandom | None  # per-row generators (None: a greedy context, nothing is drawn)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device
