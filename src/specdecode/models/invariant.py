"""Attention whose result for a query does not depend on what else shares the forward.

Greedy speculative decoding is exact only if the target's logits for a token are the same
whether the token is decoded alone, verified among k + 1 drafts, or sits in a batch beside other
requests. Library kernels do not promise that: SDPA's CPU kernel and MKL's GEMMs pick blocking
and code paths from the number of query rows and keys, so a token's attention moves by an ulp
with the shape of the call, and in bf16 an ulp is enough to flip a near-tie (benchmarks/NOTES.md,
issue 17).

This attention fixes every reduction's order per query:

- scores: one GEMM over [queries padded to a multiple of ROW_MULTIPLE rows] x [keys padded to a
  whole number of KEY_CHUNK chunks], in float32 from float32 keys (an exact copy of the bf16
  projections). Measured on this machine's MKL: a row's result does not depend on the row count
  (any multiple of 4), its place among the rows, or the key count (any multiple of 64);
  tests/test_invariance.py checks it where the suite runs.
- softmax over the padded key axis (masked keys are -inf, their weights exactly 0; the row
  length is a multiple of the vector width, so no element falls in a scalar tail).
- weights x values: one GEMM per chunk of KEY_CHUNK keys (every one the same shape, so the same
  kernel and order whatever the key count), then the chunks are summed in position order
  (`cumsum`, a sequential scan in double): a query whose keys end earlier gets exact zeros from
  the chunks past its end.

So the reduction over keys is fixed by the keys' absolute positions, never by how many queries
or keys the call has. Token trees are not covered: a tree node's ancestors sit at other cache
slots than the same tokens in a chain, so the scan visits them in another order.
"""

from __future__ import annotations

import torch

from ..cache import KEY_CHUNK, chunked

# GEMM row counts are padded to a multiple of this (MKL picks another kernel for 1-3 rows)
ROW_MULTIPLE = 4


def padded_rows(n: int) -> int:
    return -(-n // ROW_MULTIPLE) * ROW_MULTIPLE


class InvariantAttention:
    """One forward's attention, built once (mask, padded query buffer) and called per layer.

    allowed: [B or 1, T, S] bool, which cache slots each new token of each of the `batch` rows
    attends to (S: the longest row's; one [1, T, S] for rows that share it). Queries are laid
    out [B, kv_heads, T * G (padded), D], row t * G + g for query head kv * G + g.
    """

    def __init__(
        self,
        allowed: torch.Tensor,
        batch: int,
        kv_heads: int,
        group: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        Bm, T, S = allowed.shape
        B = batch
        self.B, self.T, self.Hkv, self.G, self.D, self.dtype = B, T, kv_heads, group, head_dim, dtype
        self.M = T * group
        self.M0 = padded_rows(self.M)
        self.N = chunked(S)
        dev = allowed.device
        rows = torch.ones(Bm, self.M0, self.N, dtype=torch.bool, device=dev)  # padding rows see all
        rows[:, : self.M, :S] = allowed.repeat_interleave(group, dim=1)
        rows[:, : self.M, S:] = False
        mask = torch.zeros(rows.shape, dtype=torch.float32, device=dev).masked_fill_(~rows, float("-inf"))
        # [B * kv_heads, M0, N] additive (0 / -inf), shared by every layer
        self.mask = mask if Bm == 1 else mask.repeat_interleave(kv_heads, dim=0)
        self.q = torch.zeros(B, kv_heads, self.M0, head_dim, dtype=torch.float32, device=dev)
        self.scale = head_dim**-0.5

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [B, T, H, D] (model dtype); the cache's float32 keys [B, kv_heads, capacity, D] and
        chunk-major values [chunks, B, kv_heads, KEY_CHUNK, D] (capacity >= N) -> attention
        output [B * T, H * D] in the model dtype."""
        B, T, Hkv, G, D, M, M0, N = self.B, self.T, self.Hkv, self.G, self.D, self.M, self.M0, self.N
        BH, nc = B * Hkv, N // KEY_CHUNK
        self.q[:, :, :M].view(B, Hkv, T, G, D).copy_(q.view(B, T, Hkv, G, D).permute(0, 2, 1, 3, 4))
        k = keys.narrow(2, 0, N).reshape(BH, N, D)
        scores = torch.baddbmm(self.mask, self.q.view(BH, M0, D), k.transpose(1, 2), alpha=self.scale)
        p = torch.softmax(scores, dim=-1)  # [BH, M0, N]
        v = values[:nc].view(nc * BH, KEY_CHUNK, D)  # contiguous: no copy
        p = p.view(BH, M0, nc, KEY_CHUNK).permute(2, 0, 1, 3).reshape(nc * BH, M0, KEY_CHUNK)
        per_chunk = torch.bmm(p, v).view(nc, BH, M0, D)
        out = per_chunk.cumsum(dim=0)[-1]  # chunks summed in position order
        attn = torch.empty(B, T, Hkv, G, D, dtype=self.dtype, device=q.device)
        attn.copy_(out.view(B, Hkv, M0, D)[:, :, :M].view(B, Hkv, T, G, D).permute(0, 2, 1, 3, 4))
        return attn.view(B * T, Hkv * G * D)
