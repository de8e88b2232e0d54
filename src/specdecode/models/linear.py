"""y = x W^T (+ b) (+ residual) with the weight stored the way this device multiplies fastest.

On CPU a weight is reordered once into oneDNN's blocked layout (the prepacked linear that
torch.compile's CPU backend uses after freezing) when this torch build has it: on this 2-core
AVX-512 machine that streams weights at 16-27 GB/s against 10-12 GB/s for F.linear / torch.mm
on the plain layout, and a few rows (verification) cost about what one row costs; see
benchmarks/NOTES.md. Each packed call has ~15 us of fixed cost, so small fp32 matrices (under
1 MB, most of the bundled tiny models) stay transposed for torch.mm, which is faster there. On CUDA it
is plain F.linear. Either way one copy of the weight is kept. SPECDECODE_LINEAR=plain turns
packing off (for measuring it).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F


@functools.cache
def packing_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear is here and agrees with F.linear for this dtype
    (checked once per dtype on a small random product)."""
    if os.environ.get("SPECDECODE_LINEAR", "packed") == "plain":
        return False
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if mkldnn is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 64, generator=g).to(dtype)
        x = torch.randn(3, 64, generator=g).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 3)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    ref = F.linear(x.float(), w.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    return bool(torch.allclose(y.float(), ref, atol=tol, rtol=tol))


PACK_FP32_FROM_BYTES = 2_000_000


class Linear:
    """One projection: weight [out, in] (+ bias [out]), stored as `layout`: 'packed' (oneDNN
    blocked), 'mm' (transposed [in, out] for torch.mm / addmm) or 'linear' (as given)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.numel = weight.numel() + (bias.numel() if bias is not None else 0)
        self.bias = bias
        if weight.device.type != "cpu":
            self.layout = "linear"
        elif packing_works(weight.dtype) and (
            weight.dtype != torch.float32 or weight.numel() * 4 >= PACK_FP32_FROM_BYTES
        ):
            self.layout = "packed"
        else:
            self.layout = "mm"
        # the stored copy replaces the given one (nothing else holds `weight` after loading)
        if self.layout == "packed":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        elif self.layout == "mm":
            self.weight = weight.t().contiguous()
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, in] -> [N, out], plus residual [N, out] when given."""
        w, b = self.weight, self.bias
        if self.layout == "packed":
            out = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
            # the residual is added separately: oneDNN's fused add (`.binary(..., "add")`) rounds a
            # bf16 row differently with 1 row than with 5, so a token's result would depend on how
            # many tokens share the forward (measured; the plain product does not)
            return out if residual is None else out.add_(residual)
        if self.layout == "mm":
            if residual is None:
                return torch.mm(x, w) if b is None else torch.addmm(b, x, w)
            out = torch.addmm(residual, x, w)
            return out if b is None else out.add_(b)
        out = F.linear(x, w, b)
        return out if residual is None else out.add_(residual)
