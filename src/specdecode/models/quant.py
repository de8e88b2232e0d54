"""Weight-only quantized projections: int8 per output channel, int4 in groups of 32 or 128.

A memory-bound decoder's token costs the bytes of weights it reads; these read 2x (int8) and
~3.5x (int4) fewer than bf16. The kernels are PyTorch's own weight-only ops, called directly:
`torch._weight_int8pack_mm` (int8 weight, one scale per output row) and
`aten._convert_weight_to_int4pack_for_cpu` + `aten._weight_int4pack_mm_for_cpu` (4-bit values
packed two per byte, a bf16 scale and zero per group of `group` inputs: w = (q - 8) * s + z).
torchao's `Int4WeightOnlyConfig` / `Int8WeightOnlyConfig` wrap these same CPU ops, but they
quantize from float weights with their own choice of scales; a GGUF's Q4_K tensor already *is*
4-bit values with per-32 scales and minimums, and keeping those exactly (models/gguf_quant.py)
needs the raw ops. One dependency fewer, the same kernels.

On this CPU the kernels are fast only with bf16 activations (fp32 or fp16 activations take a
scalar path 10-20x slower, measured in benchmarks/NOTES.md), so a QuantLinear casts its input
to bf16 and its output back: a quantized projection works inside an fp32 or bf16 model alike.
Scales and zeros are rounded to bf16 when a weight is quantized, so `QWeight.dequantize()` is
exactly the matrix the kernel multiplies by (up to the order of its sums).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import SpecDecodeError
from .linear import UPCAST_FROM_ROWS, Linear, runs_of

# weight format name -> (bits, group size; None: one scale per output row). w8a8: int8 weights
# per row times int8 activations quantized per row on the fly (DynamicInt8Linear); kq: GGUF blocks
# through specdecode's own kernel (models/kernel_linear.py)
QUANT_KINDS = {
    "int8": (8, None),
    "int4": (4, 32),
    "int4-g128": (4, 128),
    "w8a8": (8, None),
    "kq": (4, 256),
    "kq4": (4, 32),
    "kq3": (3, 32),
}
KERNEL_KINDS = ("kq", "kq4", "kq3")  # the formats specdecode's kernel runs (models/kernel_linear.py)


def part_kind(kind: str | None, part: str) -> str | None:
    """The format one projection of a `kind` model takes: kq3 (a draft's format) rounds its MLP's
    gate and up projections (58% of a layer's weights) to 3-bit Q3_0 and keeps every other one as
    kq4 (the 0.5B's down projections in 3 bits as well: 8% fewer bytes, τ 7% lower on HumanEval
    and 9% on Spec-Bench; benchmarks/NOTES.md, issue 53, sixteenth session)."""
    if kind == "kq3":
        return "kq3" if part == "gate_up" else "kq4"
    return kind
ACT_DTYPE = torch.bfloat16  # the kernels' fast activation type on CPU


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """Round to bf16 and back to float32: the precision the kernels keep scales in."""
    return t.to(torch.bfloat16).float()


@dataclass
class QWeight:
    """A [out, in] weight as integers and scales (before packing for a kernel).
    int8: q int8 [out, in], scales [out], w = q * s.
    int4: q uint8 in 0..15 [out, in], scales and zeros [out, in / group], w = (q - 8) * s + z."""

    bits: int
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    group: int | None = None
    in_features: int | None = None  # int4: inputs before zero padding to a whole group

    def __post_init__(self) -> None:
        if self.in_features is None:
            self.in_features = self.q.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.in_features)

    @property
    def kind(self) -> str:  # (a w8a8 projection's weight is an int8 QWeight)
        if self.bits == 8:
            return "int8"
        return "int4" if self.group == 32 else f"int4-g{self.group}"

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] matrix these integers stand for."""
        if self.bits == 8:
            return self.q.float() * self.scales[:, None]
        g = self.group
        w = (self.q.float() - 8) * self.scales.repeat_interleave(g, 1) + self.zeros.repeat_interleave(g, 1)
        return w[:, : self.in_features]

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads: the packed integers plus bf16 scales (and zeros)."""
        n = self.q.numel() * self.bits // 8
        return n + 2 * (self.scales.numel() + (0 if self.zeros is None else self.zeros.numel()))

    @staticmethod
    def from_float(w: torch.Tensor, kind: str) -> QWeight:
        """Round-to-nearest quantization of a float [out, in] weight: int8 symmetric per output
        row; int4 asymmetric per group (the group's min and max span the 16 levels)."""
        if kind not in QUANT_KINDS:
            raise SpecDecodeError(f"unknown weight format {kind!r}; choose one of {', '.join(QUANT_KINDS)}")
        bits, group = QUANT_KINDS[kind]
        w = w.float()
        if bits == 8:  # int8 and w8a8
            s = _bf16(w.abs().amax(1) / 127).clamp_min(1e-10)
            q = torch.round(w / s[:, None]).clamp_(-128, 127).to(torch.int8)
            return QWeight(8, q, s)
        out, inp = w.shape
        padded = -(-inp // group) * group  # a last partial group is padded with zeros
        wg = F.pad(w, (0, padded - inp)).view(out, padded // group, group)
        lo, hi = wg.amin(-1), wg.amax(-1)
        s = _bf16((hi - lo) / 15).clamp_min(1e-10)
        z = _bf16(lo + 8 * s)
        q = torch.round((wg - z[..., None]) / s[..., None] + 8).clamp_(0, 15).to(torch.uint8)
        return QWeight(4, q.view(out, padded), s, z, group, inp)

    @staticmethod
    def cat(parts: list[QWeight]) -> QWeight:
        """Stack along the output dimension (q|k|v, gate|up) when the formats agree."""
        first = parts[0]
        if any((p.bits, p.group, p.q.shape[1]) != (first.bits, first.group, first.q.shape[1]) for p in parts):
            raise ValueError("formats differ")
        zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
        q, scales = torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts])
        return QWeight(first.bits, q, scales, zeros, first.group, first.in_features)


class QuantLinear(Linear):
    """A projection through a weight-only quantized kernel; the same call as Linear (rows in
    the caller's dtype, optional residual, batch-invariant padding)."""

    def __init__(self, weight: QWeight, bias: torch.Tensor | None = None) -> None:
        device = weight.q.device
        if device.type != "cpu":
            raise SpecDecodeError(
                f"quantized weights ({weight.kind}) run on CPU only for now; use --dtype bf16 on {device}"
            )
        self.out_features, self.in_features = weight.shape
        self.numel = weight.q.numel() + (bias.numel() if bias is not None else 0)
        self.bias = None if bias is None else bias.to(ACT_DTYPE)
        self.layout = weight.kind
        self.dtype = ACT_DTYPE
        self.bits, self.group = weight.bits, weight.group
        self._row_multiple = None
        self.nbytes = weight.nbytes + (0 if bias is None else 2 * bias.numel())
        self.pad_in = weight.q.shape[1] - self.in_features
        if weight.bits == 8:  # zero columns up to the input width the kernel is checked at
            self.pad_in = -self.in_features % INT8_K_MULTIPLE
            self.weight = F.pad(weight.q, (0, self.pad_in)).contiguous()
            self.scales = weight.scales.to(ACT_DTYPE)
            self.trusted = int8_kernel_ok()
        else:  # the packing takes whole tiles of 16 outputs: pad with zero rows, slice them off
            # and the same 4-bit values two to a byte (as many bytes again), from which a prefill
            # dequantizes the weight: the int4 kernel's cost grows with the rows (1 -> 150 rows:
            # ~60x), an fp32 GEMM over the dequantized copy's does not
            self.nibbles = (weight.q[:, 0::2] | (weight.q[:, 1::2] << 4)).contiguous()
            self.group_scales = weight.scales.to(ACT_DTYPE)  # bf16-valued already: exact
            self.group_zeros = weight.zeros.to(ACT_DTYPE)
            pad_out = -self.out_features % 16
            q = F.pad(weight.q.to(torch.int32), (0, 0, 0, pad_out), value=8)
            self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
            sz = torch.stack([weight.scales, weight.zeros], -1)  # [out, groups, 2]
            self.scales = F.pad(sz, (0, 0, 0, 0, 0, pad_out)).transpose(0, 1).to(ACT_DTYPE).contiguous()

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, invariant: bool = False
    ) -> torch.Tensor:
        if x.shape[0] >= UPCAST_FROM_ROWS and not invariant:  # a prefill: one fp32 GEMM
            out = self._upcast_product(x.float()).to(x.dtype)
        else:
            out = super().__call__(x.to(ACT_DTYPE), invariant=invariant).to(x.dtype)
        return out if residual is None else out.add_(residual)

    def float_weight(self) -> torch.Tensor:
        if self.bits == 8:
            return self.weight[:, : self.in_features].float() * self.scales.float().view(-1, 1)
        n, g = self.out_features, self.group
        q = torch.stack([self.nibbles & 15, self.nibbles >> 4], -1).view(n, -1).float()
        s, z = self.group_scales.float().view(n, -1, 1), self.group_zeros.float().view(n, -1, 1)
        w = (q - 8).view(n, -1, g).mul_(s).add_(z)
        return w.view(n, -1)[:, : self.in_features]

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(ACT_DTYPE).contiguous()
        if self.bits == 8:
            if self.pad_in:
                x = F.pad(x, (0, self.pad_in))
            if self.trusted:
                out = torch._weight_int8pack_mm(x, self.weight, self.scales)
            else:  # this build's kernel failed its check: the same product through bf16 F.linear
                out = F.linear(x, self.weight.to(ACT_DTYPE)) * self.scales
        else:
            if self.pad_in:
                x = F.pad(x, (0, self.pad_in))
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, self.group, self.scales)
            if out.shape[1] != self.out_features:
                out = out[:, : self.out_features].contiguous()
        return out if self.bias is None else out.add_(self.bias)


# torch 2.13's `_weight_int8pack_mm` on AVX-512 CPUs returns garbage (or crashes) when the input
# width is not a multiple of 16 (K = 100, 200, 232, 264, 392 measured; 192, 208, 240, 256 right),
# while AVX2 CPUs take another path that is right at every width: int8 weights are padded with zero
# columns to a multiple of 16 everywhere (every projection of the real pair already is one)
INT8_K_MULTIPLE = 16


@functools.cache
def int8_kernel_ok() -> bool:
    """Whether `_weight_int8pack_mm` computes its product on this machine: checked once per process
    on random int8 weights at padded widths (16 .. 208 inputs, 1 to 9 rows, 3 and 40 outputs) against
    the same product in float64. A build or CPU where it is wrong runs the int8 projections through
    bf16 F.linear instead (right, slower) and says so once on stderr."""
    import sys

    g = torch.Generator().manual_seed(0)
    for k in (16, 48, 208):
        for n in (3, 40):
            w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            s = (torch.rand(n, generator=g) / 100 + 1e-3).to(ACT_DTYPE)
            for rows in (1, 2, 5, 9):
                x = torch.randn(rows, k, generator=g).to(ACT_DTYPE)
                want = x.double() @ (w.double() * s.double()[:, None]).t()
                try:
                    got = torch._weight_int8pack_mm(x, w, s).double()
                except RuntimeError:
                    got = None
                scale = want.abs().max().clamp_min(1e-6)
                if got is None or not bool(((got - want).abs().max() / scale) < 2e-2):
                    print(
                        f"specdecode: torch's int8 weight kernel failed its check ({rows} x {k} by {n}); "
                        "int8 projections run through bf16 F.linear (slower)",
                        file=sys.stderr,
                    )
                    return False
    return True


@functools.cache
def _int8_gemm_engine() -> tuple[str, bool] | None:
    """(torch's quantized engine with FBGEMM's dynamic int8 linear, whether activations must
    use 7 bits): x86 or fbgemm; None when this build has neither. Without VNNI, FBGEMM's u8 x s8
    multiply-adds pairs into int16 and 8-bit activations could saturate, so it takes 7 bits."""
    engines = torch.backends.quantized.supported_engines
    engine = next((e for e in ("x86", "fbgemm") if e in engines), None)
    if engine is None:
        return None
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        flags = ""
    return engine, not ("avx512_vnni" in flags or "avx_vnni" in flags)


def _int8_codes(rows: torch.Tensor, reduce_range: bool) -> torch.Tensor:
    """The unsigned codes FBGEMM's dynamic linear gives rows whose range is exactly [-1, 1]
    (torch's choice of parameters for that range: scale 2/255, zero point 128; 2/127 and 64
    with reduce_range): torch's per-tensor quantizer at those parameters (FBGEMM's own Quantize
    on x86: fma(x, 1/scale, zero point), rounded half to even)."""
    qmax = 127 if reduce_range else 255
    scale = float(torch.tensor(2.0 / qmax, dtype=torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch marks its quantized-tensor API deprecated
        return torch.quantize_per_tensor(rows, scale, (qmax + 1) // 2, torch.quint8).int_repr()


def _onednn_product(rows: torch.Tensor, layer: DynamicInt8Linear) -> torch.Tensor:
    """FBGEMM's dynamic linear (no bias) on rows in [-1, 1] through oneDNN's int8 linear
    (torch.ops.onednn.qlinear_pointwise; AMX or VNNI where the CPU has them): the same codes
    with the same zero point and unit scales, so oneDNN returns the exact integer sums as
    float32, then FBGEMM's epilogue (sum x (activation scale x weight scale), that product in
    float32). No range row is needed: the codes are computed here, not from the rows' range."""
    ones, zeros = layer.unit
    out = torch.ops.onednn.qlinear_pointwise(
        _int8_codes(rows, layer.reduce_range), 1.0, 64 if layer.reduce_range else 128, layer.onednn,
        ones, zeros, None, 1.0, 0, torch.float32, "none", [], "",
    )
    return out.mul_(layer.epilogue)


# row counts at which choose_int8_kernels times both kernels: a step, verifications of 1-7 drafts,
# batches of a few streams, a prefill chunk
PROBE_ROWS = (1, 2, 3, 4, 6, 8, 16, 64)


def _probe_pairs(gen: torch.Generator):
    """(weight, rows) pairs on which oneDNN must give FBGEMM's bits: random weights and inputs
    over five decades of magnitude, and the extremes (every code 255 or 0 against weights of
    +-127, whose pairwise sums overflow int16 where a kernel multiplies bytes into 16 bits)."""
    for k, n in ((64, 48), (320, 40), (1024, 256)):
        w = torch.randn(n, k, generator=gen) * 0.05
        w[: n // 4] = w[: n // 4].sign() * 0.2  # rows at the int8 extremes
        x = torch.randn(9, k, generator=gen) * torch.logspace(-3, 2, 9).view(-1, 1)
        x[0], x[1] = 1.0, -1.0  # every code at one end
        x[2] = torch.where(torch.arange(k) % 2 == 0, 1.0, -0.01)
        yield QWeight.from_float(w, "int8"), x


@functools.cache
def onednn_exact(reduce_range: bool) -> bool:
    """Whether oneDNN's int8 linear runs here and gives FBGEMM's products bit for bit on the
    probe (_probe_pairs: 1 to 9 rows, and 72 rows, of each pair): checked once per process, never
    assumed from CPU flags. SPECDECODE_ONEDNN_W8A8=0 says no without asking."""
    import os

    if os.environ.get("SPECDECODE_ONEDNN_W8A8", "1") == "0":
        return False
    gen = torch.Generator().manual_seed(0)
    try:
        for weight, x in _probe_pairs(gen):
            layer = DynamicInt8Linear(weight, onednn=True)
            layer.reduce_range = reduce_range
            for rows in (*(x[:m] for m in range(1, x.shape[0] + 1)), x.repeat(8, 1) * 1.7):
                if not torch.equal(layer._product(rows, "fbgemm"), layer._product(rows, "onednn")):
                    return False
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


def choose_int8_kernels(linears: list, rows: tuple[int, ...] = PROBE_ROWS, repeats: int = 2) -> dict:
    """For each shape of w8a8 projection in `linears` (a model's, in the order a forward calls
    them), from how many rows its products go through oneDNN instead of FBGEMM: both kernels are
    timed on the model's own layers of that shape, every one of them in turn (so the weights come
    from memory, as in a forward), at each of `rows`; oneDNN takes the smallest count from which
    it is ahead at every larger count timed. Where it is ahead from one row, FBGEMM's copy of the
    weights is dropped; where never, oneDNN's (both are held only while timing). Nothing is timed
    where onednn_exact() says no (every product stays FBGEMM's). Both kernels give the same bits
    (onednn_exact), so the choice moves time only. Returns {(out, in): first oneDNN row count or
    None}. Costs ~4 s for the 1.5B's 1.55 GB of projections on two cores."""
    import time

    calls = [lin for lin in linears if isinstance(lin, DynamicInt8Linear)]
    groups: dict[tuple[int, int], list[DynamicInt8Linear]] = {}
    for lin in calls:
        groups.setdefault((lin.out_features, lin.in_features), []).append(lin)
    if not groups:
        return {}
    reduce_range = next(iter(groups.values()))[0].reduce_range
    chosen: dict[tuple[int, int], int | None] = dict.fromkeys(groups)
    if onednn_exact(reduce_range):
        for group in groups.values():
            for lin in group:
                lin.pack_onednn()
        gen = torch.Generator().manual_seed(0)
        inputs = {k: torch.randn(max(rows), k, generator=gen) for _, k in groups}
        best = {(shape, m, e): float("inf") for shape in groups for m in rows for e in ("fbgemm", "onednn")}

        def one_pass(m: int, engine: str) -> dict:
            spent = dict.fromkeys(groups, 0.0)
            for lin in calls:
                shape = (lin.out_features, lin.in_features)
                t0 = time.perf_counter()
                lin._product(inputs[shape[1]][:m], engine)
                spent[shape] += time.perf_counter() - t0
            return spent

        with torch.inference_mode():
            for engine in ("fbgemm", "onednn"):  # warm (packing caches, page faults)
                one_pass(rows[0], engine)
            for _ in range(repeats):
                for m in rows:
                    for engine in ("fbgemm", "onednn"):
                        for shape, t in one_pass(m, engine).items():
                            best[shape, m, engine] = min(best[shape, m, engine], t)
        for shape in groups:
            for m in reversed(rows):
                if best[shape, m, "onednn"] >= best[shape, m, "fbgemm"]:
                    break
                chosen[shape] = m
    for shape, group in groups.items():
        for lin in group:
            lin.use_onednn_from(chosen[shape])
    return chosen


def int8_kernels_summary(linears: list) -> str | None:
    """One clause for a start-up line: which kernel a model's w8a8 products take, and the bytes
    held in both kernels' layouts (None without w8a8 projections)."""
    lins = [lin for lin in linears if isinstance(lin, DynamicInt8Linear)]
    if not lins:
        return None
    starts = sorted({lin.onednn_from for lin in lins if lin.onednn_from is not None})
    if not starts:
        return "int8 products on FBGEMM"
    rows = str(starts[0]) if len(starts) == 1 else f"{starts[0]}-{starts[-1]}"
    both = sum(lin.nbytes for lin in lins if lin.onednn is not None and lin.packed is not None)
    held = f"; {both / 1e9:.2f} GB of weights held in both layouts" if both else ""
    return f"int8 products on oneDNN from {rows} rows by shape, FBGEMM below{held}"


class DynamicInt8Linear(Linear):
    """int8 weights (one scale per output row) times int8 activations, each row quantized on the
    fly with its own scale: an integer GEMM that streams the weight once for all rows, so a few
    rows (verification) cost about one row. Each row is divided by its largest magnitude, its
    codes are those of FBGEMM's dynamic quantized linear for the range [-1, 1] (torch.ops.quantized,
    the x86 engine: it quantizes the whole input with one scale, so a fixed row [1, -1, 0, ...] is
    appended to make that range), and the output rows are multiplied back. The integer sums are
    exact, so a row's result does not depend on the others (batch invariance, greedy identity),
    nor on the kernel: from the row count where it was measured faster on the model's own layers
    (choose_int8_kernels), oneDNN's int8 linear computes the same sums from the same codes, bit
    for bit (onednn_exact: checked on the CPU, not assumed). torch marks its quantized-tensor API
    deprecated; it is used only to hand FBGEMM the weight once, at load, and to round the codes."""

    def __init__(
        self, weight: QWeight, bias: torch.Tensor | None = None, onednn: bool | None = False
    ) -> None:
        found = _int8_gemm_engine()
        if found is None or weight.q.device.type != "cpu":
            raise SpecDecodeError("w8a8 needs torch's x86/FBGEMM quantized engine on CPU; use --dtype int8")
        engine, self.reduce_range = found
        if torch.backends.quantized.engine != engine:
            torch.backends.quantized.engine = engine
        self.out_features, self.in_features = weight.shape
        self.numel = weight.q.numel() + (0 if bias is None else bias.numel())
        self.nbytes = weight.q.numel() + 4 * self.out_features + (0 if bias is None else 4 * bias.numel())
        self.bias = None if bias is None else bias.float()
        self.layout, self.dtype, self.bits, self.group = "w8a8", torch.float32, 8, None
        self._row_multiple = None
        self.weight = None
        self.weight_scales = weight.scales.double().float()  # as FBGEMM rounds them
        self._epilogue: tuple[bool, torch.Tensor] | None = None
        # oneDNN's unit scales and zero points (its output is then the integer sums)
        self.unit = (torch.ones(self.out_features), torch.zeros(self.out_features, dtype=torch.long))
        # FBGEMM's packed weight; oneDNN's too when asked (True; None: where onednn_exact()), for
        # choose_int8_kernels to time both on the model's layers (every product is FBGEMM's until
        # it has), which then drops the copy not called
        zeros = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(weight.q, weight.scales.double(), zeros, 0)
            self.packed = torch.ops.quantized.linear_prepack(qw, None)
        if onednn is None:
            onednn = onednn_exact(self.reduce_range)
        self.onednn = torch.ops.onednn.qlinear_prepack(weight.q, None) if onednn else None
        self.onednn_from: int | None = None
        self.range_row = torch.zeros(1, self.in_features)
        self.range_row[0, 0], self.range_row[0, -1] = 1.0, -1.0

    row_multiple = 1  # row-invariant by construction (tested): no padding needed

    def pack_onednn(self) -> None:
        """oneDNN's packed copy of the weight (from FBGEMM's, whose int8 values it holds)."""
        if self.onednn is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                q = torch.ops.quantized.linear_unpack(self.packed)[0].int_repr()
            self.onednn = torch.ops.onednn.qlinear_prepack(q, None)
            self.unit = (torch.ones(self.out_features), torch.zeros(self.out_features, dtype=torch.long))

    def use_onednn_from(self, rows: int | None) -> None:
        """Products of `rows` rows or more through oneDNN (None: never), the other kernel's
        copy of the weights dropped where it is no longer called."""
        self.onednn_from = rows if self.onednn is not None else None
        if self.onednn_from is None:
            self.onednn = self.unit = None
        elif self.onednn_from <= 1:
            self.packed = None

    @property
    def epilogue(self) -> torch.Tensor:
        """FBGEMM's epilogue factor per output: activation scale x weight scale, in float32."""
        if self._epilogue is None or self._epilogue[0] != self.reduce_range:
            act = torch.tensor(2.0 / (127 if self.reduce_range else 255), dtype=torch.float32)
            self._epilogue = (self.reduce_range, act * self.weight_scales)
        return self._epilogue[1]

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, invariant: bool = False
    ) -> torch.Tensor:
        out = self._product(x).to(x.dtype)
        return out if residual is None else out.add_(residual)

    def _product(self, x: torch.Tensor, engine: str | None = None) -> torch.Tensor:
        x = x.float()
        r = x.abs().amax(-1, keepdim=True).clamp_min_(1e-30)
        if engine is None:
            use = self.onednn_from is not None and x.shape[0] >= self.onednn_from
            engine = "onednn" if use else "fbgemm"
        if engine == "onednn":
            out = _onednn_product(x / r, self).mul_(r)
        else:
            rows = torch.cat([x / r, self.range_row])
            out = torch.ops.quantized.linear_dynamic(rows, self.packed, self.reduce_range)[:-1].mul_(r)
        return out if self.bias is None else out.add_(self.bias)


class ConcatLinear:
    """Projections whose outputs sit side by side (q|k|v or gate|up) when their formats differ
    (a GGUF's Q4_K q and k beside its Q6_K v): one call per part, outputs concatenated."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.numel = sum(p.numel for p in parts)
        self.nbytes = sum(linear_nbytes(p) for p in parts)
        self.layout = "+".join(p.layout for p in parts)

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, invariant: bool = False
    ) -> torch.Tensor:
        out = torch.cat([p(x, invariant=invariant) for p in self.parts], -1)
        return out if residual is None else out.add_(residual)


def linear_nbytes(linear) -> int:
    """Bytes of weights (and bias) one call reads."""
    nbytes = getattr(linear, "nbytes", None)
    if nbytes is not None:
        return nbytes
    size = torch.empty(0, dtype=linear.dtype).element_size()
    return linear.numel * size


def quantized_linear(
    parts: list[QWeight | torch.Tensor], bias: torch.Tensor | None, kind: str, onednn: bool | None = False
):
    """One projection from the weights stacked in `parts` (float tensors are quantized to
    `kind`; QWeights are kept as they are): a QuantLinear when the formats agree, else a
    ConcatLinear of one QuantLinear per format run. onednn: a w8a8 projection's oneDNN copy
    (DynamicInt8Linear), for a model that will choose_int8_kernels."""
    if kind in KERNEL_KINDS:
        from .kernel_linear import kernel_linears

        made = kernel_linears(parts, bias, kind)
        return made[0] if len(made) == 1 else ConcatLinear(made)
    if kind == "w8a8":  # one int8 GEMM whatever the parts were stored as
        qs = [p.dequantize() if isinstance(p, QWeight) else p for p in parts]
        return DynamicInt8Linear(QWeight.from_float(torch.cat(qs), "int8"), bias, onednn=onednn)
    qs = [p if isinstance(p, QWeight) else QWeight.from_float(p, kind) for p in parts]
    try:
        return QuantLinear(QWeight.cat(qs), bias)
    except ValueError:
        pass
    out, start = [], 0
    for run in runs_of(qs, lambda q: (q.bits, q.group)):  # consecutive parts of one format: one call
        q = QWeight.cat(run)
        b = None if bias is None else bias[start : start + q.shape[0]]
        out.append(QuantLinear(q, b))
        start += q.shape[0]
    return ConcatLinear(out)
