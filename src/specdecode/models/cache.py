"""A static KV cache with per-row lengths: written by position (by the model's forward, in
place), rewound by length.

Nothing is copied on a rejection: rewinding only lowers a row's length, and the next write
overwrites the stale entries (as in gpt-fast). Rewind is a method of the cache so that a
cache of another kind (recurrent state, Hugging Face's own) can implement it its own way.
"""

from __future__ import annotations

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
        shape = (layers, batch, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        if invariant:
            shape = (layers, capacity // KEY_CHUNK, batch, kv_heads, KEY_CHUNK, head_dim)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [B]
        self.capacity = capacity
        self._layer_views()

    def _layer_views(self) -> None:
        # per-layer views [B, kv_heads, capacity, head_dim]: narrow() on these is a cheap call,
        # indexing the 5-d tensor with a tuple of slices is not (it runs per layer per forward)
        self.layer_k, self.layer_v = list(self.k.unbind(0)), list(self.v.unbind(0))

    def row(self, b: int) -> KVCache:
        """Row b as a one-row cache that shares this cache's storage (a forward on it writes
        here); its length starts at this row's and is not copied back."""
        view = object.__new__(KVCache)
        view.invariant, view.capacity = self.invariant, self.capacity
        view.k = self.k[:, b : b + 1]
        view.v = self.v[:, :, b : b + 1] if self.invariant else self.v[:, b : b + 1]
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

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the given rows (retire the others); one copy, made when rows finish."""
        self.k = self.k[:, rows].contiguous()
        self.v = (self.v[:, :, rows] if self.invariant else self.v[:, rows]).contiguous()
        self._layer_views()
        self.lengths = self.lengths[rows].clone()

    def grow(self, capacity: int) -> None:
        """Make room for `capacity` positions per row (never shrinks; entries kept)."""
        if self.invariant:
            capacity = chunked(capacity)
        if capacity <= self.capacity:
            return
        pad = capacity - self.capacity
        self.k = torch.nn.functional.pad(self.k, (0, 0, 0, pad))
        if self.invariant:  # more chunks (dim 1 of 6)
            self.v = torch.nn.functional.pad(self.v, (0, 0) * 4 + (0, pad // KEY_CHUNK))
        else:
            self.v = torch.nn.functional.pad(self.v, (0, 0, 0, pad))
        self.capacity = capacity
        self._layer_views()

    def add_rows(self, other: KVCache) -> None:
        """Append the rows of another cache of the same model (admission between rounds)."""
        capacity = max(self.capacity, other.capacity)
        self.grow(capacity)
        other.grow(capacity)
        if self.invariant != other.invariant:
            raise ValueError("cannot join an invariant cache and a plain one")
        self.k = torch.cat([self.k, other.k], 1)
        self.v = torch.cat([self.v, other.v], 2 if self.invariant else 1)
        self.lengths = torch.cat([self.lengths, other.lengths])
        self._layer_views()


def write_chunked(layer_v: torch.Tensor, start: int, v: torch.Tensor) -> None:
    """Write v [B, kv_heads, T, D] at slots start.. of a chunk-major value cache [chunks, B,
    kv_heads, KEY_CHUNK, D] (one slice copy per chunk the slots touch)."""
    T = v.shape[2]
    for c in range(start // KEY_CHUNK, (start + T - 1) // KEY_CHUNK + 1):
        lo, hi = max(start, c * KEY_CHUNK), min(start + T, (c + 1) * KEY_CHUNK)
        layer_v[c, :, :, lo - c * KEY_CHUNK : hi - c * KEY_CHUNK].copy_(v[:, :, lo - start : hi - start])
