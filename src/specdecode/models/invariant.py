"""Attention whose result for a query does not depend on what else shares the forward.

Greedy speculative decoding is exact only if the target's logits for a token are the same
whether the token is decoded alone, verified among k + 1 drafts, or sits in a batch beside other
requests. Library kernels do not promise that: SDPA's CPU kernel and MKL's GEMMs pick blocking
and code paths from the number of query rows and keys, so a token's attention moves by an ulp
with the shape of the call, and in bf16 an ulp is enough to flip a near-tie (benchmarks/NOTES.md,
issue 17).

This attention fixes every reduction's order per query:

- scores: one GEMM per chunk of KEY_CHUNK keys, [queries padded to a multiple of ROW_MULTIPLE
  rows] x [64 keys], batched over chunks, in float32 from float32 keys (an exact copy of the bf16
  projections), then scaled and masked elementwise. One GEMM over all keys is not enough: on an
  AMX Xeon MKL's result for the first 64 keys differed in the last bits between 64 and 128 keys
  (benchmarks/NOTES.md, issue 35). A row's result does not depend on the row count (any multiple
  of 4), its place among the rows, or the number of chunks; tests/test_invariance.py checks it
  where the suite runs, across chunk boundaries.
- softmax over the padded key axis (masked keys are -inf, their weights exactly 0; the row
  length is a multiple of the vector width, so no element falls in a scalar tail).
- weights x values: one GEMM per chunk of KEY_CHUNK keys (every one the same shape, so the same
  kernel and order whatever the key count), then the chunks are summed in position order
  (`sum_in_order`: accumulated in double, rounded once): a query whose keys end earlier gets
  exact zeros from the chunks past its end.

So the reduction over keys is fixed by the keys' absolute positions, never by how many queries
or keys the call has. A long prefill uses that: its queries go in blocks of QUERY_BLOCK tokens,
each over the key chunks its last token sees, not over all of them (the causal triangle instead
of the square; keys past a query's end add exact zeros, so every query gets the bits it gets
alone, checked in tests/test_invariance.py).

Token trees: a node's ancestors sit at other cache slots than the same tokens in a chain
(slot L + node index instead of L + depth). Given `order` (for each node, the slot of each
logical position), the scores are gathered into logical order before the softmax, and the
chunks from the row's length on are multiplied per node with its own values gathered in logical
order (one GEMM of 4 rows per node and chunk, the same result per row as the chain's wider GEMM),
so a node's attention equals that of the same tokens verified as a chain.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .cache import KEY_CHUNK, chunked

# GEMM row counts are padded to a multiple of this (MKL picks another kernel for 1-3 rows; on an
# AMX Xeon a 4-row score GEMM also differed from an 8- or 16-row one in the last bits)
ROW_MULTIPLE = 8


# a prefill's queries are attended in blocks of this many tokens (rows: QUERY_BLOCK * group, a
# multiple of ROW_MULTIPLE for any group), each block over the key chunks it sees
QUERY_BLOCK = 64


# sum_in_order adds chunk by chunk in Python from this many elements on (a prefill's blocks), where
# cumsum's writing of every partial sum cost more than the sum (1,929-token prompt: 4.2 of 34 s)
LOOP_FROM = 1 << 20


def sum_in_order(per_chunk: torch.Tensor) -> torch.Tensor:
    """per_chunk [n, ...] summed over its first axis in position order, accumulated in float64
    and rounded once: the last row of torch's CPU cumsum, which accumulates float32 in double.
    Small sums (decode) take cumsum (one call); large ones an in-place double accumulation (6x
    faster at a prefill block's size), where `cumsum_matches_loop` found the two equal bit for bit
    on this machine, else the loop everywhere."""
    if per_chunk.shape[0] == 1:
        return per_chunk[0]
    if per_chunk.numel() < LOOP_FROM and cumsum_matches_loop():
        return per_chunk.cumsum(dim=0)[-1]
    return _double_loop(per_chunk)


def _double_loop(per_chunk: torch.Tensor) -> torch.Tensor:
    acc = per_chunk[0].double()
    for chunk in per_chunk[1:]:
        acc.add_(chunk)
    return acc.to(per_chunk.dtype)


@functools.cache
def cumsum_matches_loop() -> bool:
    """Whether this torch's cumsum over float32 equals the double loop (checked once per process
    on random chunks of several counts and magnitudes); if not, every sum takes the loop."""
    g = torch.Generator().manual_seed(0)
    for n in (2, 3, 7, 31):
        x = torch.randn(n, 3, 40, 16, generator=g) * torch.rand(n, 1, 1, 1, generator=g).mul(100)
        if not torch.equal(x.cumsum(dim=0)[-1], _double_loop(x)):
            return False
    return True


def _row_groups(ends: torch.Tensor) -> list[tuple[int, int, int]]:
    """Consecutive batch rows whose key chunks (ends [B]: one past the last key slot a row's
    queries see) are within 2x of each other share one group: (first row, end row, chunks)."""
    chunks = [max(chunked(int(e)) // KEY_CHUNK, 1) for e in ends.tolist()]
    groups, start, low, high = [], 0, chunks[0], chunks[0]
    for b, n in enumerate(chunks[1:], 1):
        if max(high, n) > 2 * min(low, n):
            groups.append((start, b, high))
            start, low, high = b, n, n
        else:
            low, high = min(low, n), max(high, n)
    groups.append((start, len(chunks), high))
    return groups


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
        order: torch.Tensor | None = None,
        logical_allowed: torch.Tensor | None = None,
        shared_chunks: int = 0,
    ) -> None:
        """order [B, T, N] long, logical_allowed [B, T, N] bool, shared_chunks: for a token
        tree, each node's slot of every logical position, which logical positions it sees, and
        how many leading chunks hold committed tokens only (the same for every node)."""
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
        self.order = None
        # (first row, end row, key chunks) per block of a long prefill; None: one block of all
        self.blocks = None
        # one past the last key slot each query of each row sees: [Bm, M]
        seen_end = (rows[:, : self.M] * torch.arange(1, self.N + 1, device=dev)).amax(-1)
        if order is None and T > QUERY_BLOCK:
            need = seen_end.amax(0)  # [M]
            step = QUERY_BLOCK * group
            ends = [min(r + step, self.M) for r in range(0, self.M, step)]
            chunks = [chunked(int(need[e - 1])) // KEY_CHUNK for e in ends]
            starts = [0, *ends[:-1]]
            ends[-1] = self.M0  # the padding rows go with the last block
            self.blocks = [(a, b, max(n, 1)) for a, b, n in zip(starts, ends, chunks)]
        # (first row, end row, key chunks) per group of batch rows of similar lengths; None: one
        # group of all. A decode batch's rows attend over their own key chunks, not the longest
        # row's: a 1,929-token row beside four short ones cost every row its 31 chunks
        self.groups = None
        if order is None and self.blocks is None and Bm > 1:
            self.groups = _row_groups(seen_end.amax(1))
        if order is not None:
            N, C = self.N, KEY_CHUNK
            order = F.pad(order, (0, N - order.shape[2]), value=0)
            seen = F.pad(logical_allowed, (0, N - logical_allowed.shape[2]), value=False)
            rows = torch.zeros(B, self.M0, N, dtype=torch.long, device=dev)
            rows[:, : self.M] = order.repeat_interleave(group, dim=1)
            self.order = rows.repeat_interleave(kv_heads, dim=0)  # [BH, M0, N]
            blocked = torch.zeros(B, self.M0, N, dtype=torch.bool, device=dev)
            blocked[:, : self.M] = ~seen.repeat_interleave(group, dim=1)
            self.blocked = blocked.repeat_interleave(kv_heads, dim=0)
            self.shared = shared_chunks
            tail = order[:, :, shared_chunks * C :]  # [B, T, nb * C] slots of the per-node chunks
            self.tail_chunk, self.tail_offset = tail // C, tail % C
            self.batch_index = torch.arange(B, device=dev).view(B, 1, 1)

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [B, T, H, D] (model dtype); the cache's float32 keys [B, kv_heads, capacity, D] and
        chunk-major values [chunks, B, kv_heads, KEY_CHUNK, D] (capacity >= N) -> attention
        output [B * T, H * D] in the model dtype."""
        B, T, Hkv, G, D, M, M0 = self.B, self.T, self.Hkv, self.G, self.D, self.M, self.M0
        self.q[:, :, :M].view(B, Hkv, T, G, D).copy_(q.view(B, T, Hkv, G, D).permute(0, 2, 1, 3, 4))
        if self.groups is not None:
            out = torch.cat([self._attend(0, M0, n, keys, values, b0, b1) for b0, b1, n in self.groups])
        elif self.blocks is None:
            out = self._attend(0, M0, self.N // KEY_CHUNK, keys, values)
        else:
            out = torch.cat([self._attend(a, b, n, keys, values) for a, b, n in self.blocks], dim=1)
        attn = torch.empty(B, T, Hkv, G, D, dtype=self.dtype, device=q.device)
        attn.copy_(out.view(B, Hkv, M0, D)[:, :, :M].view(B, Hkv, T, G, D).permute(0, 2, 1, 3, 4))
        return attn.view(B * T, Hkv * G * D)

    def _attend(
        self,
        r0: int,
        r1: int,
        nc: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        b0: int = 0,
        b1: int | None = None,
    ) -> torch.Tensor:
        """The attention output of query rows r0:r1 of batch rows b0:b1 (default all) over the
        first nc key chunks: [(b1 - b0) * kv_heads, r1 - r0, D]."""
        Hkv, D, M0 = self.Hkv, self.D, self.M0
        b1 = self.B if b1 is None else b1
        B = b1 - b0
        BH, N, R = B * Hkv, nc * KEY_CHUNK, r1 - r0
        if B != self.B:
            keys, values = keys.narrow(0, b0, B), values.narrow(1, b0, B)
        mask = self.mask if self.mask.shape[0] == 1 else self.mask[b0 * Hkv : b1 * Hkv]
        # scores: one GEMM per chunk of KEY_CHUNK keys, all of one shape ([M0, D] x [D, 64]):
        # a GEMM over all N keys at once took another kernel for 64 than for 128 keys on an AMX
        # Xeon's MKL, and a token's scores moved in the last bits with the key count
        k = keys.narrow(2, 0, N).reshape(BH * nc, KEY_CHUNK, D)
        q = (
            self.q.narrow(0, b0, B)
            .reshape(BH, 1, M0, D)[:, :, r0:r1]
            .expand(BH, nc, R, D)
            .reshape(BH * nc, R, D)
        )
        scores = torch.bmm(q, k.transpose(1, 2)).view(BH, nc, R, KEY_CHUNK).transpose(1, 2)
        scores = scores.reshape(BH, R, N).mul_(self.scale).add_(mask[:, r0:r1, :N])
        if self.order is not None:  # a tree: the scores in each node's logical key order
            scores = scores.gather(2, self.order).masked_fill_(self.blocked, float("-inf"))
        p = torch.softmax(scores, dim=-1)  # [BH, R, N]
        shared = nc if self.order is None else self.shared
        per_chunk = []
        if shared:
            # contiguous for a batch (no copy); a one-row view of a batch cache (a row prefilled
            # on its own) is copied, which changes no value
            v = values[:shared].reshape(shared * BH, KEY_CHUNK, D)
            ps = p.view(BH, R, nc, KEY_CHUNK)[:, :, :shared]
            ps = ps.permute(2, 0, 1, 3).reshape(shared * BH, R, KEY_CHUNK)
            per_chunk.append(torch.bmm(ps, v).view(shared, BH, R, D))
        if shared < nc:  # a tree (one block of every row)
            per_chunk.append(self._per_node_chunks(p, values, nc - shared))
        per_chunk = per_chunk[0] if len(per_chunk) == 1 else torch.cat(per_chunk)
        return sum_in_order(per_chunk)

    def _per_node_chunks(self, p: torch.Tensor, values: torch.Tensor, nb: int) -> torch.Tensor:
        """Weights x values for a tree's last nb chunks, per node with its own values in logical
        order: [nb, BH, M0, D]."""
        B, T, Hkv, G, D, M, M0 = self.B, self.T, self.Hkv, self.G, self.D, self.M, self.M0
        BH, C, R = B * Hkv, KEY_CHUNK, ROW_MULTIPLE
        # each node's G rows, padded to R, over the last nb chunks: [nb, BH, T, R, C]
        pt = p.new_zeros(BH, T, -(-G // R) * R, nb * C)
        pt[:, :, :G] = p[:, :M, -nb * C :].view(BH, T, G, nb * C)
        Gp = pt.shape[2]
        pt = pt.view(BH, T, Gp, nb, C).permute(3, 0, 1, 2, 4).reshape(nb * BH * T, Gp, C)
        # each node's values in logical order: [B, T, nb*C, Hkv, D] -> [nb, B, Hkv, T, C, D]
        vt = values[self.tail_chunk, self.batch_index, :, self.tail_offset]
        vt = vt.view(B, T, nb, C, Hkv, D).permute(2, 0, 4, 1, 3, 5).reshape(nb * BH * T, C, D)
        out = torch.bmm(pt, vt).view(nb, BH, T, Gp, D)[:, :, :, :G].reshape(nb, BH, M, D)
        return F.pad(out, (0, 0, 0, M0 - M))


class KernelAttention:
    """The batch-invariant attention of a model on specdecode's kernel (kq): each query over the
    slots it sees, in logical order, in one C call per layer (kernels.attention), instead of
    InvariantAttention's chunked GEMMs. A query's bits depend only on its own query, keys and
    values, so the row count, the batch and the threads change nothing; a tree's node sees its
    ancestors' slots in logical order, the same values a chain would show it. Every forward of a
    kq model takes this attention (never InvariantAttention), so decode, verification, prefill
    and trees agree bit for bit. Same constructor and call as InvariantAttention."""

    def __init__(
        self,
        allowed: torch.Tensor,
        batch: int,
        kv_heads: int,
        group: int,
        head_dim: int,
        dtype: torch.dtype,
        order: torch.Tensor | None = None,
        logical_allowed: torch.Tensor | None = None,
        shared_chunks: int = 0,
    ) -> None:
        del kv_heads, group, shared_chunks
        B, T = batch, allowed.shape[1]
        if order is None:
            # the slots a token sees, in slot order: the allowed ones first (stable sort)
            S = allowed.shape[2]
            ar = torch.arange(S, device=allowed.device)
            seen = allowed.expand(B, T, S)
            # contiguous: the C call reads them as plain arrays (a tree's `allowed` comes permuted)
            order = torch.sort(torch.where(seen, ar, ar + S), dim=-1, stable=True).indices
            self.idx = order.to(torch.int32).contiguous()
            self.n = seen.sum(-1).to(torch.int32).contiguous()
        else:  # a tree: each node's slot of every logical position, the seen ones a prefix
            self.idx = order.to(torch.int32).contiguous()
            self.n = logical_allowed.sum(-1).to(torch.int32)
        self.scale = head_dim**-0.5
        self.dtype = dtype
        self.slots: torch.Tensor | None = None  # [B, T] int32 write slots, set by plan_forward
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None  # RoPE's cos, sin in float32

    @classmethod
    def causal(cls, batch: int, start: int, count: int, head_dim: int, dtype, device) -> KernelAttention:
        """The attention of `count` tokens appended at `start` in every row (no tree, no ragged
        lengths): token t sees slots 0 .. start + t, so its slots in order are a prefix of 0 .. S - 1.
        What the constructor derives from that `allowed` mask (sorting it), built directly."""
        S = start + count
        self = cls.__new__(cls)
        slots = torch.arange(S + 1, dtype=torch.int32, device=device)
        self.idx = slots[:S].expand(batch, count, S).contiguous()
        self.n = slots[start + 1 :].expand(batch, count).contiguous()
        self.scale, self.dtype = head_dim**-0.5, dtype
        self.slots, self.tables = None, None
        return self

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        from ..kernels import attention

        B, T, H, D = q.shape
        out = attention(q.float(), keys, values, self.idx, self.n, self.scale)
        return out.view(B * T, H * D).to(self.dtype)
