"""GGUF block formats as the kernel reads them: decoding a file's Q4_K, Q6_K, Q8_0, Q5_0 and Q4_0
rows, quantizing float rows to Q4_K, Q8_0, Q4_0 or Q3_0, and repacking rows into the kernel's tiles.

A `BlockWeight` is a matrix as a GGUF stores it: `raw` [rows, bytes per row] in llama.cpp's own
block layout, so a file's tensor is used byte for byte (rows may be reordered, stacked or
selected without touching a block). `tiles()` lays the blocks out for the kernel:
groups of 16 output rows, per block their integers first (4 inputs x 16 rows per 64 bytes, the
order a vpdpbusd reads), then the scales (Q4_K and Q6_K within each block's record, Q8_0, Q5_0
and Q4_0 after all of a tile's integers); sdk.h gives the record sizes.

Layouts (ggml's, ggml-common.h): Q4_K, 144 bytes per 256: fp16 d, fp16 dmin, 12 bytes of 6-bit
scales and mins, 128 bytes of nibbles (chunk c of 64: low nibbles inputs c*64..+31, high ones
c*64+32..+63); w = d * sc * q - dmin * m. Q6_K, 210 bytes per 256: 128 bytes of low nibbles, 64 of
high 2-bit pairs, 16 int8 scales (one per 16), fp16 d; w = d * sc * (q - 32). Q8_0, 34 bytes per
32: fp16 d, 32 int8; w = d * q. Q5_0, 22 bytes per 32: fp16 d, 32 fifth bits, 16 bytes of nibbles
(inputs 0..15 low, 16..31 high); w = d * (u - 16). Q4_0, 18 bytes per 32: fp16 d, 16 bytes of
nibbles (as Q5_0's); w = d * (u - 8).

Q3_0 is specdecode's own block (no GGUF type has it; a draft's 3.5 bits a weight, `kq3`): 14 bytes
per 32: fp16 d, 4 bytes of third bits (bit i: input i), 8 bytes of 2-bit values (byte j, bits 2t,
2t + 1: input 8t + j); w = d * (u - 4), u in 0..7.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import SpecDecodeError

TILE = 16
# inputs, bytes
BLOCK = {
    "q4_k": (256, 144),
    "q6_k": (256, 210),
    "q8_0": (32, 34),
    "q5_0": (32, 22),
    "q4_0": (32, 18),
    "q3_0": (32, 14),
}
RECORD = {
    "q4_k": 2048 + 128 + 128 + 32 + 32,
    "q6_k": 2048 + 1024 + 256 + 32 + 32,
    "q8_0": 512 + 32,
    "q5_0": 320 + 32,
    "q4_0": 256 + 32,
    "q3_0": 192 + 32,
}
CODE = {"q4_k": 1, "q6_k": 2, "q8_0": 3, "q5_0": 4, "q4_0": 5, "q3_0": 6}  # sdk.h's SDK_Q4K .. SDK_Q3_0


@dataclass
class BlockWeight:
    """A [rows, in_features] matrix in a GGUF block format (raw: [rows, blocks * block bytes])."""

    kind: str
    raw: np.ndarray
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.in_features)

    @property
    def blocks(self) -> int:
        return self.raw.shape[1] // BLOCK[self.kind][1]

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def rows(self, index) -> BlockWeight:
        """These rows (an index array or slice), blocks untouched."""
        return BlockWeight(self.kind, np.ascontiguousarray(self.raw[index]), self.in_features)

    @property
    def sources(self) -> list[np.ndarray]:
        """The arrays these blocks are made of (a packing's key in kernels/store.py)."""
        return [self.raw]

    @staticmethod
    def cat(parts: list[BlockWeight]) -> BlockWeight:
        """The parts' rows stacked (their blocks as they are). The copy is made when `raw` is
        first read, not before: a packing read back from the store never needs it."""
        first = parts[0]
        if any((p.kind, p.raw.shape[1]) != (first.kind, first.raw.shape[1]) for p in parts):
            raise ValueError("formats differ")
        if len(parts) == 1:  # no copy: a file's blocks stay a view of its memory map
            return first
        return _Stacked(first.kind, None, first.in_features, [p.raw for p in parts])

    def dequantize(self) -> np.ndarray:
        """The float32 [rows, in_features] matrix the blocks stand for (ggml's dequantization)."""
        n = self.raw.shape[0]
        if self.kind == "q8_0":
            d, q = _q8_0_fields(self.raw)
            w = q.astype(np.float32) * d[..., None]
        elif self.kind == "q5_0":
            d, u = _q5_0_fields(self.raw)
            w = (u.astype(np.float32) - 16) * d[..., None]
        elif self.kind == "q4_0":
            d, u = _q4_0_fields(self.raw)
            w = (u.astype(np.float32) - 8) * d[..., None]
        elif self.kind == "q3_0":
            d, u = _q3_0_fields(self.raw)
            w = (u.astype(np.float32) - 4) * d[..., None]
        elif self.kind == "q4_k":
            d, dmin, sc, mn, q = _q4_k_fields(self.raw)
            scale = (d[..., None] * sc).repeat(32, -1)  # [n, nb, 256]
            mins = (dmin[..., None] * mn).repeat(32, -1)
            w = scale * q - mins
        else:
            d, sc, q = _q6_k_fields(self.raw)
            w = (d[..., None] * sc).repeat(16, -1) * (q.astype(np.float32) - 32)
        return w.reshape(n, -1)[:, : self.in_features].astype(np.float32)

    def tiles(self) -> np.ndarray:
        """The kernel's layout: uint8 [ceil(rows / 16), blocks, record bytes] (Q8_0 and Q5_0: a
        tile's integers for every block first, then its scales; sdk.h)."""
        pad = -self.raw.shape[0] % TILE
        raw = np.concatenate([self.raw, np.zeros((pad, self.raw.shape[1]), np.uint8)]) if pad else self.raw
        tiles = {"q4_k": _tiles_q4_k, "q6_k": _tiles_q6_k, "q8_0": _tiles_q8_0, "q5_0": _tiles_q5_0}
        return {**tiles, "q4_0": _tiles_q4_0, "q3_0": _tiles_q3_0}[self.kind](raw)


class _Stacked(BlockWeight):
    """BlockWeight.cat of several parts: `raw` is their concatenation, made at first read."""

    def __init__(self, kind: str, raw, in_features: int, parts: list[np.ndarray]) -> None:
        self.kind, self.in_features, self._parts, self._raw = kind, in_features, parts, raw

    @property
    def raw(self) -> np.ndarray:
        if self._raw is None:
            self._raw = np.concatenate(self._parts)
        return self._raw

    @raw.setter
    def raw(self, value: np.ndarray) -> None:
        self._raw = value

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self._parts), self.in_features)

    @property
    def blocks(self) -> int:
        return self._parts[0].shape[1] // BLOCK[self.kind][1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._parts)

    @property
    def sources(self) -> list[np.ndarray]:
        return list(self._parts)


def _f16(raw: np.ndarray, offset: int) -> np.ndarray:
    return np.ascontiguousarray(raw[..., offset : offset + 2]).view(np.float16)[..., 0]


def _blocks(raw: np.ndarray, kind: str) -> np.ndarray:
    return raw.reshape(raw.shape[0], -1, BLOCK[kind][1])


def _q8_0_fields(raw):
    b = _blocks(raw, "q8_0")
    return _f16(b, 0).astype(np.float32), np.ascontiguousarray(b[..., 2:]).view(np.int8)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    s = s.astype(np.uint8)
    lo, hi = s[..., 0:4], s[..., 4:8]
    sc = np.concatenate([lo & 63, (s[..., 8:12] & 15) | ((lo >> 6) << 4)], -1)
    mn = np.concatenate([hi & 63, (s[..., 8:12] >> 4) | ((hi >> 6) << 4)], -1)
    return sc, mn


def _q4_k_fields(raw):
    b = _blocks(raw, "q4_k")
    d, dmin = _f16(b, 0).astype(np.float32), _f16(b, 2).astype(np.float32)
    sc, mn = _scale_min_k4(b[..., 4:16])
    qs = b[..., 16:].reshape(*b.shape[:2], 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    q = (qs & 15).reshape(*b.shape[:2], 256)
    return d, dmin, sc, mn, q


def _q6_k_fields(raw):
    b = _blocks(raw, "q6_k")
    nb = b.shape[:2]
    ql, qh = b[..., :128].reshape(*nb, 2, 64), b[..., 128:192].reshape(*nb, 2, 32)
    parts = [
        (ql[..., :32] & 15) | ((qh >> 0) & 3) << 4,
        (ql[..., 32:] & 15) | ((qh >> 2) & 3) << 4,
        (ql[..., :32] >> 4) | ((qh >> 4) & 3) << 4,
        (ql[..., 32:] >> 4) | ((qh >> 6) & 3) << 4,
    ]
    q = np.stack(parts, -2).reshape(*nb, 256)  # [.., half, part, 32]: input half*128 + part*32 + l
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    return _f16(b, 208).astype(np.float32), sc, q


def _q5_0_fields(raw):
    """Q5_0 rows (22 bytes per 32: fp16 d, 32 high bits, 16 bytes of nibbles; w = d * (u - 16))
    -> d [n, nb] and the values u [n, nb, 32] (0..31)."""
    b = _blocks(raw, "q5_0")
    qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)  # [n, nb, 1]
    qs = b[..., 6:22]
    bits = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [n, nb, 32]
    return _f16(b, 0).astype(np.float32), np.concatenate([qs & 15, qs >> 4], -1) | (bits << 4)


def _q4_0_fields(raw):
    """Q4_0 rows (18 bytes per 32: fp16 d, 16 bytes of nibbles, inputs 0..15 low, 16..31 high;
    w = d * (u - 8)) -> d [n, nb] and the values u [n, nb, 32] (0..15)."""
    b = _blocks(raw, "q4_0")
    qs = b[..., 2:18]
    return _f16(b, 0).astype(np.float32), np.concatenate([qs & 15, qs >> 4], -1)


def _q3_0_fields(raw):
    """Q3_0 rows (14 bytes per 32: fp16 d, 4 bytes of third bits, 8 of 2-bit values; module
    docstring) -> d [n, nb] and the values u [n, nb, 32] (0..7)."""
    b = _blocks(raw, "q3_0")
    qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)  # [n, nb, 1]
    bits = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    qs = b[..., 6:14]  # byte j: inputs j, 8 + j, 16 + j, 24 + j
    low = np.concatenate([(qs >> (2 * t)) & 3 for t in range(4)], -1)
    return _f16(b, 0).astype(np.float32), low | (bits << 2)


def quantize_q3_0(w: np.ndarray) -> BlockWeight:
    """Float [rows, k] -> Q3_0 as Q4_0 is rounded, in 3 bits: per 32 inputs d = m / -4 with m the
    value of largest magnitude, u = min(7, trunc(w / d + 4.5)) (so m is exact). A search for the
    scale of least squared error gave no better acceptance to the 0.5B draft (benchmarks/NOTES.md,
    issue 53, sixteenth session)."""
    n, k = w.shape
    out = np.empty((n, -(-k // 32) * 14), np.uint8)
    for r0 in range(0, n, 1024):  # in slices: a float copy of a slice at a time
        x = np.pad(w[r0 : r0 + 1024].astype(np.float32), ((0, 0), (0, -k % 32)))
        x = x.reshape(x.shape[0], -1, 32)
        m = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
        d = m / -4
        inv = np.where(d != 0, 1 / np.where(d != 0, d, 1), 0).astype(np.float32)
        u = np.clip(np.trunc(x * inv[..., None] + 4.5), 0, 7).astype(np.uint8)
        qh = ((u >> 2).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(-1, dtype=np.uint32)
        low = (u & 3).reshape(*u.shape[:2], 4, 8)
        qs = low[..., 0, :] | (low[..., 1, :] << 2) | (low[..., 2, :] << 4) | (low[..., 3, :] << 6)
        parts = [d.astype(np.float16)[..., None].view(np.uint8), qh[..., None].view(np.uint8), qs]
        out[r0 : r0 + 1024] = np.concatenate(parts, -1).reshape(x.shape[0], -1)
    return BlockWeight("q3_0", out, k)


def quantize_q4_0(w: np.ndarray) -> BlockWeight:
    """Float [rows, k] -> Q4_0 as ggml's reference quantizes it: per 32 inputs d = m / -8 with m
    the value of largest magnitude, u = min(15, trunc(w / d + 8.5)) (so m is exact)."""
    n, k = w.shape
    w = np.pad(w.astype(np.float32), ((0, 0), (0, -k % 32))).reshape(n, -1, 32)
    m = np.take_along_axis(w, np.abs(w).argmax(-1)[..., None], -1)[..., 0]
    d = m / -8
    inv = np.where(d != 0, 1 / np.where(d != 0, d, 1), 0).astype(np.float32)
    u = np.minimum(15, np.trunc(w * inv[..., None] + 8.5)).astype(np.uint8)
    qs = u[..., :16] | (u[..., 16:] << 4)
    out = np.concatenate([d.astype(np.float16)[..., None].view(np.uint8), qs], -1)
    return BlockWeight("q4_0", out.reshape(n, -1), k)


def quantize_q8_0(w: np.ndarray) -> BlockWeight:
    """Float [rows, k] -> Q8_0 (round to nearest, d = max|w| / 127 per 32 as fp16)."""
    n, k = w.shape
    w = np.pad(w.astype(np.float32), ((0, 0), (0, -k % 32))).reshape(n, -1, 32)
    d = (np.abs(w).max(-1) / 127).astype(np.float16)
    inv = np.where(d > 0, 1 / np.maximum(d.astype(np.float32), 1e-30), 0)
    q = np.clip(np.rint(w * inv[..., None]), -127, 127).astype(np.int8)
    out = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], -1)
    return BlockWeight("q8_0", out.reshape(n, -1), k)


def quantize_q4_k(w: np.ndarray) -> BlockWeight:
    """Float [rows, k] -> Q4_K by rounding to nearest (no search, unlike llama-quantize). Per 32
    inputs a minimum -dmin * m (m rounded up, so it is at most min(w, 0)) and a step d * sc (sc
    rounded up, so 15 steps reach the maximum): every weight is within half a step of its value."""
    n, k = w.shape
    w = np.pad(w.astype(np.float32), ((0, 0), (0, -k % 256))).reshape(n, -1, 8, 32)
    lo = np.minimum(w.min(-1), 0)  # [n, nb, 8]
    dmin = ((-lo).max(-1) / 63).astype(np.float16)
    dmin32 = dmin.astype(np.float32)[..., None]
    mn = np.clip(np.ceil(np.where(dmin32 > 0, -lo / np.maximum(dmin32, 1e-30), 0)), 0, 63).astype(np.uint8)
    span = w.max(-1) + dmin32 * mn  # what 15 steps must reach above the minimum
    d = (span.max(-1) / (15 * 63)).astype(np.float16)
    d32 = d.astype(np.float32)[..., None]
    sc = np.clip(np.ceil(np.where(d32 > 0, span / np.maximum(15 * d32, 1e-30), 0)), 0, 63).astype(np.uint8)
    step = (d32 * sc)[..., None]
    off = (dmin32 * mn)[..., None]
    q = np.clip(np.rint(np.where(step > 0, (w + off) / np.maximum(step, 1e-30), 0)), 0, 15).astype(np.uint8)
    scales = np.zeros((*sc.shape[:2], 12), np.uint8)
    scales[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    scales[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    q = q.reshape(*q.shape[:2], 4, 2, 32)  # chunk c: sub-blocks 2c (low nibbles), 2c + 1 (high)
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*q.shape[:2], 128)
    out = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), scales, qs], -1)
    return BlockWeight("q4_k", out.reshape(n, -1), k)


def _nibble_tiles(q: np.ndarray) -> np.ndarray:
    """[n, nb, 256] values < 16 -> [T, nb, 2048] bytes: per 32 inputs, 4 vectors of 64 bytes whose
    byte c * 4 + kk holds input i * 4 + kk (low nibble) and (i + 4) * 4 + kk (high) of row c."""
    t, nb = q.shape[0] // TILE, q.shape[1]
    q = q.reshape(t, TILE, nb, 8, 2, 4, 4)  # tile, row, block, sub-block, half, i, kk
    b = q[..., 0, :, :] | (q[..., 1, :, :] << 4)  # [t, 16, nb, 8, 4, 4]
    return b.transpose(0, 2, 3, 4, 1, 5).reshape(t, nb, 2048)


def _per_row(x: np.ndarray, t: int) -> np.ndarray:
    """[n, nb, s] per-row values -> [T, nb, s * 16] (value s of the 16 rows side by side)."""
    nb, s = x.shape[1], x.shape[2]
    return np.ascontiguousarray(x.reshape(t, TILE, nb, s).transpose(0, 2, 3, 1)).reshape(t, nb, s * TILE)


def _tiles_q4_k(raw):
    d, dmin, sc, mn, q = _q4_k_fields(raw)
    t = raw.shape[0] // TILE
    f16 = lambda x: _per_row(x.astype(np.float16)[..., None], t).view(np.uint8)  # noqa: E731
    # minimums as (2p, 2p + 1) pairs per row: [p][row][2], the int16 pairs vpdpwssd reads
    mins = mn.reshape(t, TILE, -1, 4, 2).transpose(0, 2, 3, 1, 4).reshape(t, -1, 128)
    return np.concatenate([_nibble_tiles(q), _per_row(sc, t), mins, f16(d), f16(dmin)], -1)


def _tiles_q6_k(raw):
    d, sc, q = _q6_k_fields(raw)
    t, nb = raw.shape[0] // TILE, q.shape[1]
    hi = (q >> 4).reshape(t, TILE, nb, 8, 2, 4, 4)  # tile, row, block, chunk, half, i, kk
    hb = sum(hi[..., i, :] << (2 * i) for i in range(4)).astype(np.uint8)  # [t, 16, nb, 8, 2, 4]
    hb = hb.transpose(0, 2, 3, 4, 1, 5).reshape(t, nb, 8, 128)
    lo = _nibble_tiles(q & 15).reshape(t, nb, 8, 256)  # per 32 inputs: 256 bytes of nibbles, 128 of pairs
    # the 16 scales of a column in pairs: byte p * 32 + c * 2 + i = column c's scale of sub-block 2p + i
    scales = sc.astype(np.int8).view(np.uint8).reshape(t, TILE, nb, 8, 2)
    scales = scales.transpose(0, 2, 3, 1, 4).reshape(t, nb, 256)
    f16 = _per_row(d.astype(np.float16)[..., None], t).view(np.uint8)
    ints = np.concatenate([lo, hb], -1).reshape(t, nb, 3072)
    # a block's record: its integers, its scales, padded to 53 cache lines (one read stream)
    return np.concatenate([ints, scales, f16, np.zeros((t, nb, 32), np.uint8)], -1)


def _ints_then_scales(ints: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[T, nb, a] and [T, nb, b] -> [T, nb, a + b] laid out as every block's integers, then every
    block's scales (so each block's integers start on a cache line)."""
    t, nb = ints.shape[:2]
    return np.concatenate([ints.reshape(t, -1), scales.reshape(t, -1)], 1).reshape(t, nb, -1)


def _tiles_q8_0(raw):
    d, q = _q8_0_fields(raw)
    t, nb = raw.shape[0] // TILE, q.shape[1]
    u = (q.astype(np.int16) + 128).astype(np.uint8).reshape(t, TILE, nb, 8, 4)
    u = u.transpose(0, 2, 3, 1, 4).reshape(t, nb, 512)
    f16 = _per_row(d.astype(np.float16)[..., None], t).view(np.uint8)
    return _ints_then_scales(u, f16)


def _tiles_q5_0(raw):
    d, u = _q5_0_fields(raw)
    t, nb = raw.shape[0] // TILE, u.shape[1]
    u = u.reshape(t, TILE, nb, 2, 4, 4)  # tile, row, block, half, i, kk: input 16 half + 4 i + kk
    nib = (u[..., 0, :, :] & 15) | ((u[..., 1, :, :] & 15) << 4)  # [t, 16, nb, 4, 4]
    nib = nib.transpose(0, 2, 3, 1, 4).reshape(t, nb, 256)
    f16 = _per_row(d.astype(np.float16)[..., None], t).view(np.uint8)
    return _ints_then_scales(np.concatenate([nib, _plane(u >> 4)], -1), f16)


def _plane(bits: np.ndarray) -> np.ndarray:
    """[T, 16, nb, .. 32 inputs] one bit each -> [T, nb, 64]: byte c * 4 + kk holds in bit g the
    bit of input 4 g + kk of row c (Q5_0's fifth bits, Q3_0's third)."""
    t, nb = bits.shape[0], bits.shape[2]
    g = bits.reshape(t, TILE, nb, 8, 4)
    plane = sum(g[:, :, :, j, :] << j for j in range(8)).astype(np.uint8)  # [t, 16, nb, 4]
    return plane.transpose(0, 2, 1, 3).reshape(t, nb, 64)


def _tiles_q4_0(raw):
    d, u = _q4_0_fields(raw)
    t, nb = raw.shape[0] // TILE, u.shape[1]
    u = u.reshape(t, TILE, nb, 2, 4, 4)  # tile, row, block, half, i, kk: input 16 half + 4 i + kk
    nib = (u[..., 0, :, :] | (u[..., 1, :, :] << 4)).transpose(0, 2, 3, 1, 4).reshape(t, nb, 256)
    f16 = _per_row(d.astype(np.float16)[..., None], t).view(np.uint8)
    return _ints_then_scales(nib, f16)


def _tiles_q3_0(raw):
    d, u = _q3_0_fields(raw)
    t, nb = raw.shape[0] // TILE, u.shape[1]
    u = u.reshape(t, TILE, nb, 2, 4, 4)  # tile, row, block, j, i, kk: input 4 (4 j + i) + kk
    low = sum((u[..., i, :] & 3) << (2 * i) for i in range(4)).astype(np.uint8)  # [t, 16, nb, 2, 4]
    low = low.transpose(0, 2, 3, 1, 4).reshape(t, nb, 128)
    f16 = _per_row(d.astype(np.float16)[..., None], t).view(np.uint8)
    return _ints_then_scales(np.concatenate([low, _plane(u >> 2)], -1), f16)


def check_kind(kind: str) -> str:
    if kind not in BLOCK:
        raise SpecDecodeError(f"the kernel reads {', '.join(BLOCK)} blocks, not {kind!r}")
    return kind
