"""A static KV cache with per-row lengths: written by position (by the model's forward, in
place), rewound by length.

Nothing is copied on a rejection: rewinding only lowers a row's length, and the next write
overwrites the stale entries (as in gpt-fast). Rewind is a method of the cache so that a
cache of another kind (recurrent state, Hugging Face's own) can implement it its own way.
"""

from __future__ import annotations

import copy

import torch

from ..errors import SpecDecodeError

# the batch-invariant attention reduces over keys in chunks of this many positions
KEY_CHUNK = 64
# tokens per prefix-cache block (vLLM's default; engine/prefix.py): divides KEY_CHUNK, so a block
# read or written by the drafters and the prefix cache never straddles a key chunk
BLOCK = 16


def chunked(n: int) -> int:
    """n rounded up to a whole number of key chunks."""
    return -(-n // KEY_CHUNK) * KEY_CHUNK


class KVCache:
    """Keys and values [layers, B, kv_heads, capacity, head_dim]; row b holds lengths[b] tokens.

    invariant=True: the cache of the batch-invariant forward (models/invariant.py). Keys and
    values are float32 (an exact copy of the model-dtype projections), the capacity is a whole
    number of KEY_CHUNK chunks, and the values are stored chunk-major, [layers, chunks, B,
    kv_heads, KEY_CHUNK, head_dim], so the first n chunks of every row and head are one
    contiguous block that the attention multiplies chunk by chunk without a copy.

    Rows live in slots: the storage has `slots` >= B rows and the live rows are its first B, so
    a row joins the batch by a copy of its own tokens into a free slot and a finished row leaves
    it by moving the rows after it down a slot (their tokens only): the rest of the batch is
    never copied. The storage is reallocated only when the rows or the capacity outgrow it; an
    engine that knows an admission is coming calls reserve_for() when the admission starts and
    tick() once per round, so the new storage's memory is touched a slice per round instead of
    stalling the batch at the join.
    """

    def __init__(
        self,
        layers: int,
        batch: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        invariant: bool = False,
    ) -> None:
        self.invariant = invariant  # see the class docstring
        if invariant:
            dtype = torch.float32
            capacity = chunked(capacity)
        self.layers, self.kv_heads, self.head_dim, self.dtype = layers, kv_heads, head_dim, dtype
        self.device = device
        self._k, self._v = self._storage(batch, capacity, torch.zeros)
        self.capacity = capacity
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [B]
        self._staged: _Staged | None = None  # storage reserved for a coming admission
        self._layer_views()

    # -- storage ------------------------------------------------------------------------
    def _storage(self, slots: int, capacity: int, alloc) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.layers, slots, self.kv_heads, capacity, self.head_dim)
        k = alloc(shape, dtype=self.dtype, device=self.device)
        if self.invariant:
            shape = (self.layers, capacity // KEY_CHUNK, slots, self.kv_heads, KEY_CHUNK, self.head_dim)
        return k, alloc(shape, dtype=self.dtype, device=self.device)

    @property
    def size(self) -> int:
        """Live rows (B)."""
        return self.lengths.shape[0]

    @property
    def slots(self) -> int:
        """Rows the storage has room for (the live rows are the first `size`)."""
        return self._k.shape[1]

    @property
    def k(self) -> torch.Tensor:
        """The live rows' keys [layers, B, kv_heads, capacity, head_dim] (a view)."""
        return self._k.narrow(1, 0, self.size)

    @property
    def v(self) -> torch.Tensor:
        """The live rows' values (a view; chunk-major when invariant, see the class docstring)."""
        return self._v.narrow(2 if self.invariant else 1, 0, self.size)

    def _layer_views(self) -> None:
        # per-layer views [B, kv_heads, capacity, head_dim] of the live rows: narrow() on these
        # is a cheap call, indexing the 5-d tensor with a tuple of slices is not (it runs per
        # layer per forward)
        B = self.size
        self.layer_k = [t.narrow(0, 0, B) for t in self._k.unbind(0)]
        self.layer_v = [t.narrow(1 if self.invariant else 0, 0, B) for t in self._v.unbind(0)]

    def _copy_row(self, dst_k, dst_v, dst: int, src_k, src_v, src: int, n: int) -> None:
        """Copy the first n tokens of row src of (src_k, src_v) to row dst of (dst_k, dst_v)."""
        if n <= 0:
            return
        dst_k[:, dst, :, :n].copy_(src_k[:, src, :, :n])
        if self.invariant:  # whole chunks: a chunk's tail past n is never read
            c = -(-n // KEY_CHUNK)
            dst_v[:, :c, dst].copy_(src_v[:, :c, src])
        else:
            dst_v[:, dst, :, :n].copy_(src_v[:, src, :, :n])

    def _copy_rows(self, dst: list[int], src: list[int], n: int) -> None:
        """Rows src to rows dst of this storage, the first n tokens of each, in one gather and one
        scatter (each source is read before any row is written, so the lists may overlap). A
        destination past its row's own length gets the source's stale entries, as a row reused
        after a retired one holds that row's: positions past a row's length are never read."""
        if n <= 0:
            return
        d = torch.tensor(dst, device=self._k.device)
        s = torch.tensor(src, device=self._k.device)
        self._k[:, d, :, :n] = self._k[:, s, :, :n]
        if self.invariant:
            c = -(-n // KEY_CHUNK)
            self._v[:, :c, d] = self._v[:, :c, s]
        else:
            self._v[:, d, :, :n] = self._v[:, s, :, :n]

    def row(self, b: int) -> KVCache:
        """Row b as a one-row cache that shares this cache's storage (a forward on it writes
        here); its length starts at this row's and is not copied back."""
        view = copy.copy(self)  # the shape fields; storage, lengths and views replaced below
        view._staged = None
        view._k = self._k[:, b : b + 1]
        view._v = self._v[:, :, b : b + 1] if self.invariant else self._v[:, b : b + 1]
        view.lengths = self.lengths[b : b + 1].clone()
        view._layer_views()
        return view

    def aligned_start(self) -> int | None:
        """The common length of every row (the next write slot), or None if rows differ."""
        first = int(self.lengths[0])
        if self.lengths.shape[0] == 1 or bool((self.lengths == first).all()):
            return first
        return None

    def positions(self, num_new: int, offset: int = 0) -> torch.Tensor:
        """[B, T] positions of the next num_new tokens of every row, after `offset` tokens that
        are written but not (yet) counted in lengths (an early-exit draft's)."""
        pos = (
            self.lengths.view(-1, 1) + offset + torch.arange(num_new, device=self.lengths.device).view(1, -1)
        )
        if int(pos.max()) >= self.capacity:
            raise SpecDecodeError(
                f"sequence longer than the cache ({self.capacity} tokens); lower max_new_tokens"
            )
        return pos

    def advance(self, num_new: int) -> None:
        self.lengths += num_new

    def rewind(self, lengths: torch.Tensor) -> None:
        """Keep only the first lengths[b] tokens of each row (lengths may not exceed the current)."""
        lengths = lengths.to(torch.long)
        if bool((lengths > self.lengths).any()) or bool((lengths < 0).any()):
            raise ValueError("rewind can only shorten rows")
        self.lengths = lengths.clone()

    def keep_path(self, base: torch.Tensor, paths: list[list[int]]) -> None:
        """After a tree forward written from slot base[b]: move the accepted nodes' entries
        (slots base[b] + paths[b][i]) to base[b] + 1 + i, right after the root (every row at
        once: the sources are gathered before any is overwritten)."""
        rows = [b for b, path in enumerate(paths) for _ in path]
        if not rows:
            return
        dev = self.k.device
        b_idx = torch.tensor(rows, device=dev)
        starts = base.to(dev)[b_idx]
        src = starts + torch.tensor([i for path in paths for i in path], device=dev)
        dst = starts + 1 + torch.tensor([i for path in paths for i in range(len(path))], device=dev)
        self.k[:, b_idx, :, dst] = self.k[:, b_idx, :, src].clone()
        if self.invariant:  # as [layers, B, kv_heads, chunks, KEY_CHUNK, D]: slot = (chunk, offset)
            v, C = self.v.permute(0, 2, 3, 1, 4, 5), KEY_CHUNK
            v[:, b_idx, :, dst // C, dst % C] = v[:, b_idx, :, src // C, src % C].clone()
        else:
            self.v[:, b_idx, :, dst] = self.v[:, b_idx, :, src].clone()

    def read_block(self, b: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of row b's keys and values at slots start .. start + n - 1, each [layers,
        kv_heads, n, head_dim] (in the invariant layout the slots must lie in one 64-slot chunk):
        a prefix-cache block."""
        end = start + n
        k = self.k[:, b, :, start:end].clone()
        if self.invariant:
            c, off = divmod(start, KEY_CHUNK)
            if off + n > KEY_CHUNK:
                raise ValueError("a block of the invariant cache must lie in one chunk")
            v = self.v[:, c, b, :, off : off + n].clone()
        else:
            v = self.v[:, b, :, start:end].clone()
        return k, v

    def write_block(self, b: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put a block read by read_block() at row b's slots start .. (lengths are not moved)."""
        n = k.shape[2]
        self.k[:, b, :, start : start + n] = k
        if self.invariant:
            c, off = divmod(start, KEY_CHUNK)
            self.v[:, c, b, :, off : off + n] = v
        else:
            self.v[:, b, :, start : start + n] = v

    @torch.inference_mode()
    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the given rows, in that order (retire the others). Increasing rows (the
        engine's case) move down in place, each copying its own tokens only; any other order is
        one gather into new storage."""
        keep = rows.tolist()
        if all(a < b for a, b in zip(keep, keep[1:])):
            moved = [(i, r) for i, r in enumerate(keep) if r != i]
            lengths = self.lengths.tolist()
            n = [lengths[r] for _, r in moved]
            if len(moved) > 1 and max(n) * len(moved) <= 2 * sum(n):
                self._copy_rows([i for i, _ in moved], [r for _, r in moved], max(n))
            else:  # a few rows, or rows of very different lengths: each its own tokens
                for (i, r), m in zip(moved, n):
                    self._copy_row(self._k, self._v, i, self._k, self._v, r, m)
        else:
            index = rows.to(self._k.device)
            self._k = self._k[:, index].contiguous()
            self._v = (self._v[:, :, index] if self.invariant else self._v[:, index]).contiguous()
        self.lengths = self.lengths[rows].clone()
        self._layer_views()

    def grow(self, capacity: int) -> None:
        """Make room for `capacity` positions per row (never shrinks; entries kept)."""
        if self.invariant:
            capacity = chunked(capacity)
        if capacity > self.capacity:
            self._reallocate(self.slots, capacity)

    def _fits(self, rows: int, capacity: int) -> bool:
        return rows <= self.slots and capacity <= self.capacity

    def _plan(self, rows: int, capacity: int) -> tuple[int, int]:
        """Slots and capacity of the storage that holds `rows` rows of `capacity` tokens: a
        quarter more rows than asked when the rows outgrow the storage (a server's batch fills
        one admission at a time), the capacity as asked."""
        slots = self.slots if rows <= self.slots else rows + rows // 4
        capacity = max(self.capacity, chunked(capacity) if self.invariant else capacity)
        return slots, capacity

    @torch.inference_mode()
    def _reallocate(self, slots: int, capacity: int) -> None:
        """Move the live rows (their tokens only) to storage of slots x capacity: the storage
        reserve_for() staged if it is large enough (its untouched rest zeroed now), else new."""
        staged, self._staged = self._staged, None
        if staged is not None and staged.slots >= slots and staged.capacity >= capacity:
            k, v = staged.finish()
            capacity = staged.capacity
        else:
            k, v = self._storage(slots, capacity, torch.zeros)
        for b in range(self.size):
            self._copy_row(k, v, b, self._k, self._v, b, int(self.lengths[b]))
        self._k, self._v, self.capacity = k, v, capacity
        self._layer_views()

    @torch.inference_mode()
    def add_rows(self, other: KVCache) -> None:
        """Append the rows of another cache of the same model (admission between rounds): each
        new row's tokens are copied into a free slot; the live rows stay where they are unless
        the storage must grow."""
        if self.invariant != other.invariant:
            raise ValueError("cannot join an invariant cache and a plain one")
        B, n = self.size, other.size
        if not self._fits(B + n, other.capacity):
            self._reallocate(*self._plan(B + n, other.capacity))
        for j in range(n):
            self._copy_row(self._k, self._v, B + j, other._k, other._v, j, int(other.lengths[j]))
        self.lengths = torch.cat([self.lengths, other.lengths])
        self._layer_views()

    @torch.inference_mode()
    def reserve_for(self, other: KVCache) -> None:
        """An admission of `other`'s rows has started (its prefill runs between rounds): if
        add_rows(other) will outgrow the storage, stage the new storage now; tick() zeroes it a
        slice per round, so the join finds its memory touched instead of faulting it in."""
        if not isinstance(other, KVCache) or other.invariant != self.invariant:
            return
        if self._fits(self.size + other.size, other.capacity):
            return
        slots, capacity = self._plan(self.size + other.size, other.capacity)
        if self._staged is not None and self._staged.slots >= slots and self._staged.capacity >= capacity:
            return
        self._staged = _Staged(*self._storage(slots, capacity, torch.empty), slots, capacity)

    @torch.inference_mode()
    def tick(self) -> None:
        """Zero the next slice of the staged storage (see reserve_for); a no-op without one."""
        if self._staged is not None:
            self._staged.zero_next()


class _Staged:
    """Storage reserved for a coming admission, allocated uninitialised and zeroed a slice at a
    time (every slot must hold finite numbers: a masked key's weight is an exact 0, and 0 times a
    NaN left in memory would not be)."""

    SLICE = 1 << 23  # elements zeroed per tick (32 MB of float32)

    def __init__(self, k: torch.Tensor, v: torch.Tensor, slots: int, capacity: int) -> None:
        self.k, self.v, self.slots, self.capacity = k, v, slots, capacity
        self.flat = [k.view(-1), v.view(-1)]
        self.done = [0, 0]

    def zero_next(self) -> None:
        for i, flat in enumerate(self.flat):
            if self.done[i] < flat.numel():
                end = min(self.done[i] + self.SLICE, flat.numel())
                flat[self.done[i] : end].zero_()
                self.done[i] = end
                return

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        for i, flat in enumerate(self.flat):
            flat[self.done[i] :].zero_()
        return self.k, self.v


def write_chunked(layer_v: torch.Tensor, start: int, v: torch.Tensor) -> None:
    """Write v [B, kv_heads, T, D] at slots start.. of a chunk-major value cache [chunks, B,
    kv_heads, KEY_CHUNK, D] (one slice copy per chunk the slots touch)."""
    T = v.shape[2]
    for c in range(start // KEY_CHUNK, (start + T - 1) // KEY_CHUNK + 1):
        lo, hi = max(start, c * KEY_CHUNK), min(start + T, (c + 1) * KEY_CHUNK)
        layer_v[c, :, :, lo - c * KEY_CHUNK : hi - c * KEY_CHUNK].copy_(v[:, :, lo - start : hi - start])
