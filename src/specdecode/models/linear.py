"""y = x W^T (+ b) (+ residual) with the weight stored the way this device multiplies fastest.

On CPU a weight is reordered once into oneDNN's blocked layout (the prepacked linear that
torch.compile's CPU backend uses after freezing) when this torch build has it: on this 2-core
AVX-512 machine that streams weights at 16-27 GB/s against 10-12 GB/s for F.linear / torch.mm
on the plain layout, and a few rows (verification) cost about what one row costs; see
benchmarks/NOTES.md. Each packed call has ~15 us of fixed cost, so small fp32 matrices (under
1 MB, most of the bundled tiny models) stay transposed for torch.mm, which is faster there.
Without oneDNN's bf16 packing (a CPU without AVX-512 or AVX-NE-CONVERT: torch refuses it) a
bf16/fp16 weight stays [out, in] for F.linear: on such an AVX2 CPU torch.mm over the transposed
bf16 weight ran 20x slower than F.linear (110 vs 4.8 ms for the 1.5B target's gate|up, one row).
On CUDA it is plain F.linear. Either way one copy of the weight is kept. SPECDECODE_LINEAR=plain
turns packing off (for measuring it).

Where specdecode's kernel is built (kernels/), a float32 weight on CPU stays [out, in] for its
float product instead (layout 'kernel', csrc/sdk_fgemm_body.h): every row is one fixed sequence of
float operations, so the batch-invariant forward needs no row padding, and a model whose
projections all run there takes the fused C layers (models/llama.py) like a kq model. Products of
up to KERNEL_ROWS rows run there in the plain forward too (the same bits as the invariant one);
larger ones (a plain prefill) take F.linear. SPECDECODE_LINEAR=packed (or plain, swapped) keeps
torch's products.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from ..errors import SpecDecodeError


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
# a plain (not batch-invariant) forward's products of up to this many rows run on the float kernel
KERNEL_ROWS = 16


@functools.cache
def float_kernel() -> bool:
    """Whether float32 weights on CPU go to specdecode's float product (built, and not turned off
    by SPECDECODE_LINEAR=packed|plain|swapped)."""
    if os.environ.get("SPECDECODE_LINEAR", "auto") != "auto":
        return False
    from ..kernels import available

    return available()


@functools.cache
def swap_fp32() -> bool:
    """Whether large fp32 products run swapped (W x^T through oneDNN, the weight as the
    activation operand): on this project's AVX2-only machines (no oneDNN bf16 packing) a 5-row
    product of the 1.5B target's gate|up took 9.9 ms swapped against 13.9 ms packed (one row: the
    same 7.1 ms), because oneDNN splits the packed product's few rows over the threads and each
    thread streams the whole weight. AVX-512 machines keep the packed layout they were measured
    with. SPECDECODE_LINEAR=swapped / packed forces either (benchmarks/NOTES.md)."""
    mode = os.environ.get("SPECDECODE_LINEAR", "auto")
    if mode in ("packed", "plain"):
        return False
    if not packing_works(torch.float32):
        return False
    return mode == "swapped" or not packing_works(torch.bfloat16)


class Linear:
    """One projection: weight [out, in] (+ bias [out]), stored as `layout`: 'packed' (oneDNN
    blocked), 'swapped' (as given, multiplied as W x^T by oneDNN), 'mm' (transposed [in, out]
    for torch.mm / addmm), 'kernel' (as given, specdecode's float product: float32 weights, and
    bfloat16 ones where oneDNN has no bf16 products) or 'linear' (as given, F.linear)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.numel = weight.numel() + (bias.numel() if bias is not None else 0)
        self.bias = bias
        if weight.device.type != "cpu":
            self.layout = "linear"
        elif weight.dtype == torch.float32 and float_kernel():
            self.layout = "kernel"
        elif weight.dtype == torch.bfloat16 and float_kernel() and not packing_works(torch.bfloat16):
            self.layout = "kernel"  # no native bf16 products here (AVX2): benchmarks/NOTES.md
        elif weight.dtype == torch.float32 and weight.numel() * 4 >= PACK_FP32_FROM_BYTES and swap_fp32():
            self.layout = "swapped"
        elif packing_works(weight.dtype) and (
            weight.dtype != torch.float32 or weight.numel() * 4 >= PACK_FP32_FROM_BYTES
        ):
            self.layout = "packed"
        elif weight.dtype not in (torch.bfloat16, torch.float16):
            self.layout = "mm"
        else:
            self.layout = "linear"
        self.dtype = weight.dtype
        self._row_multiple: int | None = None
        # the stored copy replaces the given one (nothing else holds `weight` after loading)
        if self.layout == "packed":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        elif self.layout == "mm":
            self.weight = weight.t().contiguous()
        elif self.layout in ("swapped", "kernel"):
            self.weight = weight.contiguous()
        else:
            self.weight = weight
        if self.layout == "kernel":
            self._row_multiple = 1
            if bias is not None:
                self.bias = bias.float().contiguous()

    @property
    def row_multiple(self) -> int:
        """The batch-invariant forward pads a product's rows to a multiple of this (probed once
        per kind of product, see `_probe_row_multiple`)."""
        if self._row_multiple is None:
            key = (self.layout, self.dtype, self.in_features, self.out_features, self.bias is not None)
            if key not in _ROW_MULTIPLE:
                _ROW_MULTIPLE[key] = _probe_row_multiple(self)
            self._row_multiple = _ROW_MULTIPLE[key]
        return self._row_multiple

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, invariant: bool = False
    ) -> torch.Tensor:
        """x [N, in] -> [N, out], plus residual [N, out] when given. invariant: a row's result
        does not depend on N (rows padded to `row_multiple`)."""
        n = x.shape[0]
        if self.layout == "kernel" and (invariant or n <= KERNEL_ROWS):  # bias, residual in C
            from ..kernels import float_linear

            res = None if residual is None else residual.float().contiguous()
            return float_linear(x, self.weight, bias=self.bias, residual=res).to(x.dtype)
        if invariant:  # always product, then residual: the same two steps for every row count
            if n % self.row_multiple:
                x = F.pad(x, (0, 0, 0, self.row_multiple - n % self.row_multiple))
            out = self._product(x)[:n]
            return out if residual is None else out.add_(residual)
        if residual is not None and self.layout == "mm" and self.bias is None:
            return torch.addmm(residual, x, self.weight)
        if (
            self.layout == "linear" or (self.layout == "kernel" and self.dtype != torch.float32)
        ) and n >= UPCAST_FROM_ROWS and self.weight.device.type == "cpu":
            out = self._upcast_product(x)
            return out if residual is None else out.add_(residual)
        out = self._product(x)
        return out if residual is None else out.add_(residual)

    def weight_matrix(self) -> torch.Tensor:
        """The [out, in] weight as given (to quantize a loaded model). A packed weight has no
        plain view: it is read back through the product with the identity, a block at a time."""
        if self.layout == "mm":
            return self.weight.t()
        if self.layout != "packed":
            return self.weight
        cols = []
        for start in range(0, self.in_features, 1024):
            n = min(1024, self.in_features - start)
            eye = torch.zeros(n, self.in_features, dtype=self.dtype, device=self.weight.device)
            eye[:, start : start + n].fill_diagonal_(1)
            cols.append(torch.ops.mkldnn._linear_pointwise(eye, self.weight, None, "none", [], ""))
        return torch.cat(cols).t()

    def float_weight(self) -> torch.Tensor:
        """The weight as float32 [out, in], for one many-row product (the copy lives for the call)."""
        return self.weight.float()

    def _upcast_product(self, x: torch.Tensor) -> torch.Tensor:
        """Many rows (a prefill) through an unpacked bf16/fp16 weight on a CPU without native
        bf16 GEMM: in float32, where the product is fast (the 0.5B draft's 80-token prefill:
        ~4 s in bf16); the weight's float32 copy lives for this call only."""
        w, b = self.float_weight(), None if self.bias is None else self.bias.float()
        if swap_fp32():  # oneDNN, as for fp32 weights: the draft's 80-token prefill 2.7 -> 1.8 s
            out = torch.ops.mkldnn._linear_pointwise(w, x.float().contiguous(), None, "none", [], "")
            out = out.t().contiguous()
            return (out if b is None else out.add_(b)).to(self.dtype)
        return F.linear(x.float(), w, b).to(self.dtype)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.layout == "packed":
            # the residual is added by the caller: oneDNN's fused add (`.binary(..., "add")`)
            # rounds a bf16 row differently with 1 row than with 5, so a token's result would
            # depend on how many tokens share the forward (measured; the plain product does not)
            return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        if self.layout == "swapped":  # (W x^T)^T: the weight streams once whatever the rows
            out = torch.ops.mkldnn._linear_pointwise(w, x.contiguous(), None, "none", [], "").t()
            out = out.contiguous() if x.shape[0] > 1 else out.view(1, -1)
            return out if b is None else out.add_(b)
        if self.layout == "mm":
            return torch.mm(x, w) if b is None else torch.addmm(b, x, w)
        if self.layout == "kernel" and x.shape[0] <= KERNEL_ROWS:
            from ..kernels import float_linear

            return float_linear(x, w, bias=b).to(x.dtype)
        return F.linear(x, w, b)


def runs_of(items: list, key) -> list[list]:
    """Consecutive items with the same key(item), in order: projections whose stacked parts
    differ in format run one kernel call per run (q|k beside v)."""
    runs: list[list] = []
    for item in items:
        if runs and key(runs[-1][0]) == key(item):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


# unpacked bf16/fp16 products of this many rows or more (not batch-invariant ones) run in float32
UPCAST_FROM_ROWS = 16
_ROW_MULTIPLE: dict[tuple, int] = {}
PROBE_ROWS = 96


def _probe_row_multiple(linear: Linear) -> int:
    """The smallest r in (1, 2, 4) such that products of r, 3r and 96 rows give each row the same
    result, on random rows through this very weight.

    Measured here: oneDNN's packed bf16 GEMM with 1536 inputs takes another path for one row than
    for two or more (about 1 row in 10 comes out an ulp apart), with 576 inputs it does not; MKL's
    fp32 GEMM agrees only among row counts that are multiples of 4. A kernel that took another
    reduction order for one of these shapes differs on many of 96 random rows (at 1 row in 10, a
    miss has odds 4e-5)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, linear.in_features, generator=g).to(linear.weight.device, linear.dtype)
    with torch.inference_mode():
        full = linear._product(x)
        for r in (1, 2, 4):
            if all(
                torch.equal(torch.cat([linear._product(x[i : i + m]) for i in range(0, PROBE_ROWS, m)]), full)
                for m in (r, 3 * r)
            ):
                return r
    raise SpecDecodeError(
        f"no row padding makes this machine's {linear.layout} {linear.dtype} product row-invariant; "
        "run without --batch-invariant"
    )
