"""RoPE's cos and sin tables, the same bits in every process, at every table size, forever.

A row's cached keys are RoPE of its projected keys at their positions, so a key written early in
a server's life (a prefix-cache block, a row decoding beside a long admission) must meet the same
table as a key written later, or the two differ by an ulp and a greedy near-tie can flip. Two
things keep that true here:

- the values come from Python's `math.cos` / `math.sin` (the C library's), one angle at a time.
  torch's vectorized float64 sin/cos split a table between threads and were seen, in a server, to
  give one thread's share of the first table (positions 128-255) values accurate to ~1e-9 instead
  of ~1e-16: 500 of 16,384 float32 entries an ulp away from every later table's. The KV
  self-check (engine/selfcheck.py) caught the keys; benchmarks/NOTES.md has the hunt.
- growing a table computes the new positions only and keeps the old ones as they are.

The cost: about 15 ms per 1,000 positions at head dim 128 (4,096 positions: 59 ms), once per
process.
"""

from __future__ import annotations

import math

import torch


def inverse_frequencies(theta: float, head_dim: int) -> list[float]:
    """theta ** (-2i / head_dim) for i < head_dim / 2, in float64."""
    return [1.0 / theta ** (2 * i / head_dim) for i in range(head_dim // 2)]


def rope_rows(theta: float, head_dim: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every frequency at positions start .. end - 1, float64 [end - start,
    head_dim / 2], one angle (position x frequency, float64) at a time."""
    freqs = inverse_frequencies(theta, head_dim)
    angles = [p * f for p in range(start, end) for f in freqs]
    shape = (end - start, len(freqs))
    cos = torch.tensor(list(map(math.cos, angles)), dtype=torch.float64).view(shape)
    sin = torch.tensor(list(map(math.sin, angles)), dtype=torch.float64).view(shape)
    return cos, sin


class RopeTables:
    """A model's tables [positions, head_dim], grown on demand in `dtype` on `device`: each
    frequency twice (the halves of rotate_half) and, `signed`, sin negated in the first half, so
    that RoPE(x) = x * cos + x.roll(head_dim / 2) * sin (unsigned: for a graph that negates the
    rotated half itself, OpenVINO's). Positions once computed never change (a growth appends the
    new ones)."""

    def __init__(
        self,
        theta: float,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        signed: bool = True,
    ):
        self.theta, self.head_dim, self.dtype, self.device = theta, head_dim, dtype, device
        self.signed = signed
        self.cos = self.sin = torch.empty(0, head_dim, dtype=dtype, device=device)

    def __len__(self) -> int:
        return self.cos.shape[0]

    def grow(self, need: int) -> None:
        """Make positions 0 .. need - 1 available (at least doubling, from 256)."""
        have = len(self)
        if need <= have:
            return
        n = max(need, 2 * have, 256)
        cos, sin = rope_rows(self.theta, self.head_dim, have, n)
        self.cos = torch.cat([self.cos, torch.cat([cos, cos], -1).to(self.device, self.dtype)])
        first = -sin if self.signed else sin
        self.sin = torch.cat([self.sin, torch.cat([first, sin], -1).to(self.device, self.dtype)])
