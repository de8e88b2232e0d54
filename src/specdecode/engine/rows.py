"""The running batch's per-row state (tokens, lengths, sampling parameters, generators), one
entry per live row, in one place."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.draft_context import DraftContext
from ..core.sampling import RowRandom, SamplingParams, Warp


@dataclass
class Rows:
    """Every per-row state of the running batch, one entry per live row, in one place."""

    ids: list[int]  # row id: the row's index in results() (admission order)
    tokens: torch.Tensor  # [B, capacity] prompt + generated tokens
    lengths: torch.Tensor  # [B] tokens so far; the last is pending (not yet in the target cache)
    params: list[SamplingParams]
    warp: Warp  # the params as tensors
    rng: RowRandom  # one generator per row

    @staticmethod
    def new(
        ids: list[int], prompts: list[list[int]], params: list[SamplingParams], width: int, device
    ) -> Rows:
        """Rows with room for prompt + max_new_tokens plus one round's drafts (`width`) past the end."""
        capacity = max(len(p) + s.max_new_tokens for p, s in zip(prompts, params)) + width + 1
        tokens = torch.tensor([list(p) + [0] * (capacity - len(p)) for p in prompts], dtype=torch.long)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        return Rows(
            ids,
            tokens.to(device),
            lengths,
            params,
            Warp.from_params(params, device),
            RowRandom([s.seed for s in params], device, [s.keyed for s in params]),
        )

    @property
    def size(self) -> int:
        return len(self.ids)

    def context(self) -> DraftContext:
        return DraftContext(self.tokens, self.lengths, self.warp, self.rng)

    def pending(self) -> torch.Tensor:
        """[B, 1] each row's last token, the one the target has not seen yet."""
        return self.tokens.gather(1, (self.lengths - 1).view(-1, 1))

    def append(self, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Write the first counts[b] of tokens [B, W] after each row's tokens (room: see new())."""
        B, W = tokens.shape
        pos = self.lengths.view(B, 1) + torch.arange(W, device=tokens.device).view(1, W)
        write = torch.arange(W, device=tokens.device).view(1, W) < counts.view(B, 1)
        self.tokens.scatter_(1, pos, torch.where(write, tokens, self.tokens.gather(1, pos)))
        self.lengths = self.lengths + counts
        self.rng.forget_before(self.lengths)

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.tokens.device)
        self.ids = [self.ids[i] for i in keep]
        self.tokens, self.lengths = self.tokens[index], self.lengths[index]
        self.params = [self.params[i] for i in keep]
        self.warp = self.warp.select(index)
        self.rng.select(keep)

    def extend(self, other: Rows) -> None:
        capacity = max(self.tokens.shape[1], other.tokens.shape[1])
        pad = [torch.nn.functional.pad(t, (0, capacity - t.shape[1])) for t in (self.tokens, other.tokens)]
        self.ids += other.ids
        self.tokens, self.lengths = torch.cat(pad), torch.cat([self.lengths, other.lengths])
        self.params += other.params
        self.warp = self.warp.extend(other.warp)
        self.rng.extend(other.rng)
