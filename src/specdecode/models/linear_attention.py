"""Gated linear attention with the delta rule (Gated DeltaNet-style) for hybrid targets, and the
cache that rolls its recurrent state back after a rejected draft.

A linear-attention layer keeps one matrix state per head instead of a key/value cache. For
each new token t, with q_t, k_t L2-normalised per head, a decay α_t and a write strength β_t in
(0, 1) (sigmoids of projections of the layer's input):

    S_t = α_t S_{t-1} + β_t (v_t − α_t S_{t-1} k_t) k_tᵀ      (S: [value dim, key dim])
    o_t = S_t q_t

The state is overwritten in place, token after token, so a rejected draft cannot be cut off by
lowering a length, as with a KV cache. HybridCache keeps what one verification forward needs to
go back, as one of two strategies behind the same `rewind`:

- "snapshot": the state after every position of the last forward (memory: positions × heads ×
  key dim × value dim per layer); rewinding picks one. Token trees need it: a node's state
  follows from its parent's, and `keep_path` moves the accepted path's snapshots forward.
- "recompute": only the last forward's per-position inputs (k, v, α, β: positions × heads ×
  (2·dim + 2)) and the state before it; rewinding replays the accepted prefix from that state
  (the approach of the hybrid-model serving work the lesson cites). About dim / 2 times less
  memory, a replay of up to k + 1 steps per rewind. Trees work too: keep_path reorders the
  kept inputs into the accepted path.

Forwards that do not advance the cache (an early-exit draft, written past the length) run on a
scratch copy of the state and leave the committed state and the journal alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import SpecDecodeError
from .cache import KVCache

ROLLBACK = ("snapshot", "recompute")
MAX_JOURNAL = 64  # advancing forwards remembered between two rewinds


def delta_step(S: torch.Tensor, q, k, v, a, b) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for every row and head: S [B, H, Dv, Dk]; q, k [B, H, Dk]; v [B, H, Dv];
    a, b [B, H]. Returns (the new state, the output [B, H, Dv])."""
    a4, b3 = a.unsqueeze(-1).unsqueeze(-1), b.unsqueeze(-1)
    Sk = torch.einsum("bhvk,bhk->bhv", S, k)
    S = a4 * S + (b3 * (v - a.unsqueeze(-1) * Sk)).unsqueeze(-1) * k.unsqueeze(-2)
    return S, torch.einsum("bhvk,bhk->bhv", S, q)


def chunked_delta_rule(q, k, v, a, b, S0: torch.Tensor | None = None, chunk: int = 64):
    """The same recurrence over a whole sequence, a chunk at a time (training): q, k, v
    [B, T, H, D], a, b [B, T, H] -> (outputs [B, T, H, D], the final state [B, H, D, D]).

    Within a chunk, with γ_t the product of the decays up to t and u_t = β_t (v_t − α_t S_{t-1} k_t)
    the value position t writes: S_t = γ_t S_0 + Σ_{i≤t} (γ_t/γ_i) u_i k_iᵀ. Substituting S_{t-1}
    into u_t gives a unit lower-triangular system (I + A) U = β V − β γ K S_0ᵀ with
    A[t, i] = β_t (γ_t/γ_i) k_t·k_i (i < t), solved in one call; the outputs are
    O = γ Q S_0ᵀ + (M ∘ Q Kᵀ) U with M[t, i] = γ_t/γ_i (i ≤ t). Exact, like delta_step token by
    token (tests/test_hybrid.py), with a handful of batched products per chunk instead of a
    Python step per token."""
    B, T, H, D = q.shape
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
    a, b = a.transpose(1, 2), b.transpose(1, 2)  # [B, H, T]
    S = q.new_zeros(B, H, D, D) if S0 is None else S0
    outs = []
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        C = e - s
        qc, kc, vc, bc = q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], b[:, :, s:e]
        g = torch.cumsum(torch.log(a[:, :, s:e].clamp_min(1e-30)), -1)  # log γ_t  [B, H, C]
        diff = g.unsqueeze(-1) - g.unsqueeze(-2)  # log γ_t/γ_i  [B, H, C, C]
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        ratio = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()  # i <= t
        strict = ratio * (~torch.eye(C, dtype=torch.bool, device=q.device))
        A = bc.unsqueeze(-1) * strict * (kc @ kc.transpose(-1, -2))
        gamma = g.exp().unsqueeze(-1)  # [B, H, C, 1]
        rhs = bc.unsqueeze(-1) * (vc - gamma * (kc @ S.transpose(-1, -2)))
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        outs.append(gamma * (qc @ S.transpose(-1, -2)) + (ratio * (qc @ kc.transpose(-1, -2))) @ U)
        last = (g[..., -1:] - g).exp().unsqueeze(-1)  # γ_C/γ_i  [B, H, C, 1]
        S = g[..., -1].exp().unsqueeze(-1).unsqueeze(-1) * S + U.transpose(-1, -2) @ (last * kc)
    return torch.cat(outs, 2).transpose(1, 2), S


@dataclass
class _Journal:
    """What the last advancing forward of one layer left for a rewind."""

    start: torch.Tensor  # [B] long: each row's length before it
    state0: torch.Tensor  # [B, H, Dv, Dk]: the state before it
    snaps: torch.Tensor | None  # snapshot: [B, T, H, Dv, Dk] the state after each position
    inputs: tuple[torch.Tensor, ...] | None  # recompute: k, v [B, T, H, D], a, b [B, T, H]


class HybridCache(KVCache):
    """A KV cache for the attention layers plus one recurrent state per linear-attention layer
    ([B, heads, head_dim, head_dim]), rolled back by `rollback` (module docstring)."""

    def __init__(
        self,
        kv_layers: int,
        linear_layers: list[int],
        batch: int,
        kv_heads: int,
        heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        rollback: str = "snapshot",
    ) -> None:
        if rollback not in ROLLBACK:
            raise SpecDecodeError(f"unknown rollback {rollback!r}; choose one of {', '.join(ROLLBACK)}")
        super().__init__(max(kv_layers, 1), batch, kv_heads, capacity, head_dim, dtype, device)
        self.rollback = rollback
        self.linear_layers = list(linear_layers)
        shape = (batch, heads, head_dim, head_dim)
        # the recurrence runs in float32 (float64 for a float64 model: the exactness tests)
        self.state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.state = {i: torch.zeros(shape, dtype=self.state_dtype, device=device) for i in linear_layers}
        # per layer, the advancing forwards since the last rewind (a draft model's chain is one
        # forward per token; a rewind lands anywhere in them, then starts a new journal)
        self.journal: dict[int, list[_Journal]] = {}
        self.scratch: dict[int, torch.Tensor] = {}  # non-advancing forwards (early-exit drafts)

    def row(self, b: int):  # the batch-invariant prefill's per-row view
        raise SpecDecodeError("batch invariance is not implemented for linear-attention layers")

    # -- the layer's side ---------------------------------------------------------------
    def run_layer(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        parents: list[int] | None,
        advance: bool,
        offset: int,
    ) -> torch.Tensor:
        """Run the recurrence over T new positions (q, k, v [B, T, H, D]; a, b [B, T, H], all
        float32) and return the outputs [B, T, H, D]. parents: for a token tree, each position's
        parent position (-1: the committed state); None: a chain."""
        B, T = q.shape[:2]
        if not advance:
            if parents is not None:
                raise SpecDecodeError("a linear-attention model cannot draft token trees")
            S = (self.state[layer] if offset == 0 else self.scratch[layer]).clone()
        else:
            if offset:
                raise SpecDecodeError("linear-attention layers cannot write past the cache length")
            S = self.state[layer]
        state0 = S
        keep_snaps = parents is not None or (advance and self.rollback == "snapshot")
        snaps = [] if keep_snaps else None
        outs = []
        for t in range(T):
            prev = S if parents is None else (state0 if parents[t] < 0 else snaps[parents[t]])
            S, o = delta_step(prev, q[:, t], k[:, t], v[:, t], a[:, t], b[:, t])
            outs.append(o)
            if snaps is not None:
                snaps.append(S)
        if parents is not None:  # the last node is not the end of a path: the journal decides
            S = snaps[-1]
        if not advance:
            self.scratch[layer] = S
        else:
            self.state[layer] = S
            if self.rollback == "snapshot":
                entry = _Journal(self.lengths.clone(), state0, torch.stack(snaps, 1), None)
            else:  # a tree's snapshots were only needed during the forward
                entry = _Journal(self.lengths.clone(), state0, None, (k, v, a, b))
            entries = self.journal.setdefault(layer, [])
            entries.append(entry)
            if len(entries) > MAX_JOURNAL:  # forwards with no rewind between: forget the oldest
                del entries[0]
        return torch.stack(outs, 1)

    # -- the cache's side ---------------------------------------------------------------
    def rewind(self, lengths: torch.Tensor) -> None:
        """Keep the first lengths[b] tokens of each row: the attention layers' lengths drop, and
        each linear layer's state goes back to the one after lengths[b] tokens, found in the
        journal of the forwards since the last rewind (which then becomes the new start)."""
        lengths = lengths.to(torch.long)
        old = self.lengths
        super().rewind(lengths)
        changed = (lengths != old).nonzero().flatten()
        if changed.numel():
            for layer, entries in self.journal.items():
                S = self.state[layer].clone()
                S[changed] = self._states_at(entries, changed, lengths[changed])
                self.state[layer] = S
        self.journal = {}

    def _states_at(self, entries: list[_Journal], rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The state of each of `rows` after lengths[i] tokens [R, H, Dv, Dk], from the latest
        journal entry that starts at or before it: a snapshot, or its kept inputs replayed for
        the rows of that entry together (a row's replay stops at its own length)."""
        out = torch.empty((rows.shape[0], *entries[0].state0.shape[1:]), dtype=entries[0].state0.dtype,
                          device=entries[0].state0.device)  # fmt: skip
        todo = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        for e in reversed(entries):
            n = lengths - e.start[rows]
            hit = (todo & (n >= 0)).nonzero().flatten()
            if not hit.numel():
                continue
            r, n = rows[hit], n[hit]
            if e.snaps is not None:
                s = e.state0[r].clone()
                later = (n > 0).nonzero().flatten()
                s[later] = e.snaps[r[later], n[later] - 1]
            else:
                s = e.state0[r]
                k, v, a, b = (x[r] for x in e.inputs)
                for t in range(int(n.max())):  # replay the kept positions (the output is not needed)
                    nxt, _ = delta_step(s, k[:, t], k[:, t], v[:, t], a[:, t], b[:, t])
                    s = torch.where((t < n).view(-1, 1, 1, 1), nxt, s)
            out[hit] = s
            todo[hit] = False
            if not todo.any():
                return out
        raise SpecDecodeError(
            "a linear-attention state can only rewind to a length reached since its last rewind"
        )

    def keep_path(self, base: torch.Tensor, paths: list[list[int]]) -> None:
        """After a tree forward: the accepted nodes' snapshots (or kept inputs) move to the
        positions right after the root, like the attention layers' keys and values."""
        super().keep_path(base, paths)
        for entries in self.journal.values():
            j = entries[-1]
            snaps = None if j.snaps is None else j.snaps.clone()
            inputs = None if j.inputs is None else tuple(x.clone() for x in j.inputs)
            for r, path in enumerate(paths):
                if not path:
                    continue
                src = torch.tensor(path, device=self.lengths.device)
                dst = 1 + torch.arange(len(path), device=self.lengths.device)
                for x in [snaps] if snaps is not None else inputs:
                    x[r, dst] = x[r, src]
            j.snaps, j.inputs = snaps, inputs

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self.state = {i: s[rows].contiguous() for i, s in self.state.items()}
        self.journal, self.scratch = {}, {}

    def add_rows(self, other: KVCache) -> None:
        if not isinstance(other, HybridCache):
            raise ValueError("cannot join a hybrid cache and a plain one")
        super().add_rows(other)
        self.state = {i: torch.cat([s, other.state[i]]) for i, s in self.state.items()}
        self.journal, self.scratch = {}, {}

    def rollback_bytes(self) -> dict[str, int]:
        """Memory the last forward's journal holds for a rewind: `journal` (the snapshots, or
        the kept inputs) and `state_before` (the state before that forward, which both
        strategies keep; a runtime that updates the state in place would have dropped it)."""
        journal = before = 0
        for j in (e for entries in self.journal.values() for e in entries):
            parts = [j.snaps] if j.snaps is not None else list(j.inputs or ())
            journal += sum(x.numel() * x.element_size() for x in parts)
            before += j.state0.numel() * j.state0.element_size()
        return {"journal": journal, "state_before": before}


def linear_attention_inputs(proj: torch.Tensor, B: int, T: int, H: int, D: int, dtype=torch.float32):
    """Split one fused projection [B*T, 3·H·D + 2·H] into q, k (L2-normalised), v [B, T, H, D]
    and the gates α, β [B, T, H] (sigmoids), in the state's dtype."""
    x = proj.to(dtype).view(B, T, -1)
    q, k, v = (x[..., i * H * D : (i + 1) * H * D].reshape(B, T, H, D) for i in range(3))
    a = torch.sigmoid(x[..., 3 * H * D : 3 * H * D + H])
    b = torch.sigmoid(x[..., 3 * H * D + H :])
    return F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, a, b


def tree_parents(tree_mask: torch.Tensor) -> list[int]:
    """Each input's parent in a tree's ancestor mask [T, T] (-1 for the root)."""
    m = tree_mask.cpu()
    out = []
    for i in range(m.shape[0]):
        anc = [j for j in range(i) if bool(m[i, j])]
        out.append(anc[-1] if anc else -1)
    return out
