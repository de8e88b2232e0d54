"""Projections through specdecode's own kernel (kernels/): GGUF blocks times int8 activations.

`kq` is the weight format: a GGUF's own Q4_K, Q6_K, Q8_0, Q5_0 and Q4_0 blocks byte for byte, or
float weights rounded to Q4_K (Q8_0 where the input width is not a multiple of 256). `kq4`, for a
draft model, keeps a GGUF's Q4_K, Q6_K and Q4_0 and rounds everything else to Q4_0 (4.5 bits a
weight: the 0.5B draft's Q5_0 and Q8_0 matrices, 17% of its bytes less). `kq3`, a draft's layers
in 3.5 bits a weight, rounds its float weights to Q3_0 (specdecode's own block, kernels/blocks.py)
and its head to kq4's blocks. Each row's
activations are quantized on their own and every integer sum is exact, so a row's output does
not depend on how many rows share the call, on the instruction set or on the threads: the
batch-invariant forward needs no padding (`row_multiple` 1) and costs nothing, and a prefill
writes the keys and values one-token steps would write.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import SpecDecodeError
from ..kernels import (
    BlockWeight,
    PackedWeight,
    available,
    float_linear,
    linear,
    linear_parts,
    quantize_q4_k,
    quantize_q8_0,
)
from ..kernels import blocks as blocks_module
from ..kernels.blocks import quantize_q3_0, quantize_q4_0
from ..kernels.store import cached, source_tag
from .linear import Linear, runs_of


def to_blocks(weight: torch.Tensor, kind: str = "kq") -> BlockWeight:
    """A float [out, in] weight as the blocks of `kind`, rounded as ggml rounds them: kq, Q4_K (in
    a multiple of 256) or Q8_0; kq4, Q4_K or Q4_0; kq3, Q3_0 at every width (kept in the cache by
    the weight's bytes: rounding the 0.5B's layers takes seconds in numpy)."""
    w = weight.detach().float().cpu().numpy()
    if kind == "kq3":
        tag = f"rounded:float->q3_0:{w.shape[0]}x{w.shape[1]}:{source_tag(blocks_module.__file__)}"
        return BlockWeight("q3_0", cached(tag, [w], lambda: quantize_q3_0(w).raw), w.shape[1])
    if w.shape[1] % 256 == 0:
        return quantize_q4_k(w)
    return quantize_q4_0(w) if kind == "kq4" else quantize_q8_0(w)


def random_blocks(out: int, inp: int, seed: int, narrow: str = "q8_0") -> BlockWeight:
    """Random blocks of the format a load gives an [out, inp] weight (Q4_K when inp is a multiple
    of 256, else `narrow`: Q8_0, a GGUF's Q5_0, or kq4's Q4_0; kq3's Q3_0 at every width), with
    small finite scales: for timing (autotune) without quantizing."""
    from ..kernels.blocks import BLOCK

    rng = np.random.default_rng(seed)
    if inp % 256 == 0 and narrow != "q3_0":
        raw = rng.integers(0, 256, (out, inp // 256, 144), dtype=np.uint8)
        raw[..., 0:4] = np.array([1e-3, 1e-3], np.float16).view(np.uint8)
        return BlockWeight("q4_k", raw.reshape(out, -1), inp)
    raw = rng.integers(0, 256, (out, -(-inp // 32), BLOCK[narrow][1]), dtype=np.uint8)
    raw[..., 0:2] = np.array([1e-3], np.float16).view(np.uint8)
    return BlockWeight(narrow, raw.reshape(out, -1), inp)


def _release_mapped(a: np.ndarray) -> None:
    """madvise(MADV_DONTNEED) over the whole pages of `a` when it is a view of a read-only file
    mapping (the GGUF's: a later read faults them back in from the file); else nothing."""
    import ctypes
    import mmap

    base = a
    while isinstance(base, np.ndarray) and not isinstance(base, np.memmap):
        base = base.base
    if not isinstance(base, np.memmap) or base.mode != "r" or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start = a.__array_interface__["data"][0]
    lo, hi = -(-start // page) * page, (start + a.nbytes) // page * page
    if hi > lo:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)


class KernelLinear(Linear):
    """One projection whose weight is one block format, through the kernel; the same call as
    Linear (rows in the caller's dtype, optional residual; invariant by construction)."""

    row_multiple = 1

    def __init__(
        self, weight: BlockWeight, bias: torch.Tensor | None = None, keep_blocks: bool = True
    ) -> None:
        if not available():
            raise SpecDecodeError(
                "the kq format needs specdecode's kernel, which is not built here (no C "
                "compiler?); use --dtype int4 or w8a8"
            )
        self.out_features, self.in_features = weight.shape
        self.packed = PackedWeight(weight)
        # the file's blocks, for row selections (a draft vocabulary's head) and float_weight: kept
        # when they are a view of the file (free), not when stacking copied them (q|k|v, gate|up)
        self.block_weight = weight if keep_blocks else None
        self.bias = None if bias is None else bias.float().contiguous()
        self.numel = self.out_features * self.in_features + (0 if bias is None else bias.numel())
        self.nbytes = self.packed.nbytes + (0 if bias is None else 4 * bias.numel())
        bits = 3 if weight.kind == "q3_0" else 4
        self.layout, self.dtype, self.bits, self.group = f"kq:{weight.kind}", torch.float32, bits, None
        self.weight = None
        self._row_multiple = 1

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, invariant: bool = False
    ) -> torch.Tensor:
        out = self._product(x).to(x.dtype)
        return out if residual is None else out.add_(residual)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.packed)
        return out if self.bias is None else out.add_(self.bias)

    def float_weight(self) -> torch.Tensor:
        if self.block_weight is None:
            raise SpecDecodeError("this kq projection keeps only its packed tiles; load the model in float")
        return torch.from_numpy(self.block_weight.dequantize())

    def weight_matrix(self) -> torch.Tensor:
        return self.float_weight()

    def rows(self, ids: torch.Tensor) -> KernelLinear:
        """The projection onto these outputs only (their blocks as they are)."""
        bias = None if self.bias is None else self.bias[ids]
        if self.block_weight is None:
            raise SpecDecodeError("this kq projection keeps only its packed tiles; load the model in float")
        # the selected rows are a copy, not a view of the file: packed, then let go; the file's
        # pages the selection read go back to the OS (rows spread over the whole matrix touch
        # most of its pages: ~90 MB of resident file for the 0.5B's 32k-row list)
        made = KernelLinear(self.block_weight.rows(np.asarray(ids.cpu())), bias, keep_blocks=False)
        _release_mapped(self.block_weight.raw)
        return made


def kernel_linears(parts: list, bias: torch.Tensor | None, kind: str = "kq") -> list[KernelLinear]:
    """The projection stacking `parts` (BlockWeights kept as they are, float tensors rounded to
    the blocks of `kind`, to_blocks): one KernelLinear when their formats agree, else one per run
    of a format, whose outputs sit side by side (ConcatLinear)."""
    blocks = [p if isinstance(p, BlockWeight) else to_blocks(p, kind) for p in parts]
    made, start = [], 0
    for run in runs_of(blocks, lambda b: (b.kind, b.raw.shape[1])):
        w = BlockWeight.cat(run)
        b = None if bias is None else bias[start : start + w.shape[0]]
        made.append(KernelLinear(w, b, keep_blocks=len(run) == 1))
        start += w.shape[0]
    return made


def fused_product(
    lin,
    x: torch.Tensor,
    pre: str | None = None,
    pre_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """A kq projection (a KernelLinear, or a ConcatLinear of them) or a float32 Linear on the
    kernel's float product (layout 'kernel') of x float32 rows with the input's pre-pass
    ("rms_norm" with pre_weight and eps, or "swiglu": silu(gate) * up of rows of 2 * in values)
    done in C before the product, and bias and residual added in the product's epilogue: one C
    call (kernels.linear_parts, kernels.float_linear) instead of a norm, a SiLU and adds in
    torch. The fused layers of LlamaModel (models/llama.py) run every projection this way."""
    if getattr(lin, "layout", None) == "kernel":
        return float_linear(
            x, lin.weight, pre=pre, pre_weight=pre_weight, eps=eps, bias=lin.bias, residual=residual
        )
    parts = getattr(lin, "parts", [lin])
    return linear_parts(
        x,
        [p.packed for p in parts],
        pre=pre,
        pre_weight=pre_weight,
        eps=eps,
        biases=[p.bias for p in parts],
        residual=residual,
    )


def projection_parts(lin) -> list[tuple]:
    """A projection of a model with fused layers as kernels.projection_words takes it: (packed
    blocks, bias) per KernelLinear part, or (float weight, bias) for a float Linear in layout
    'kernel'."""
    if getattr(lin, "layout", None) == "kernel":
        return [(lin.weight, lin.bias)]
    return [(p.packed, p.bias) for p in getattr(lin, "parts", [lin])]
