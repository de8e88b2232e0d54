"""specdecode's quantized linear kernel (csrc/): GGUF blocks (Q4_K, Q6_K, Q8_0) times int8
activations, weight-stationary, the same bits for every row count, instruction set and thread
count. The rest of the runtime sees `linear(x, packed)`.

Which instruction-set path runs is decided once per process: every path this build has and this
CPU runs (cpuid + xgetbv, in C) is checked bit for bit against the scalar reference on random
and extreme inputs (`selfcheck`); of those that pass, the widest runs unless a narrower one
was clearly faster on a timed product (`chosen_isa`).
SPECDECODE_ISA=ref|avx2|avxvnni|avx512vnni|amx forces one (an error if it cannot run or fails the
check). Without a compiler or with a failed build, `available()` is False with one line on
stderr, and the formats that need the kernel are not offered.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import sys
import time

import numpy as np
import torch

from ..errors import SpecDecodeError
from ..paths import cpu_name
from .blocks import CODE, BlockWeight, quantize_q4_k, quantize_q8_0
from .build import BuildError, built_library
from .store import cached, source_tag

ISAS = ("ref", "avx2", "avxvnni", "avx512vnni", "amx")  # sdk.h's SDK_ISA_* order, narrow to wide
CLEARLY = 1.15  # a narrower path is chosen over a wider one only when this much faster
ABI = 11
PRE = {None: 0, "rms_norm": 1, "swiglu": 2}  # sdk_quantize's pre-pass codes

__all__ = [
    "ISAS",
    "NO_AMX",
    "BlockWeight",
    "PackedWeight",
    "available",
    "amx_rows",
    "amx_rows_forced",
    "chosen_isa",
    "prefetch_blocks",
    "prefetch_choice",
    "prefetch_one",
    "prefetch_q6k_l1",
    "prefetch_small",
    "linear",
    "linear_parts",
    "float_linear",
    "rope_attention",
    "quantize_q4_k",
    "quantize_q8_0",
    "attention",
    "build_id",
    "runnable_isas",
    "selfcheck",
]


@functools.cache
def _lib() -> ctypes.CDLL | None:
    if os.environ.get("SPECDECODE_KERNEL", "1") == "0":
        return None
    try:
        path = built_library()
    except BuildError as e:
        print(
            f"specdecode: the quantized kernel is not available ({e}); using torch's kernels", file=sys.stderr
        )
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        print(f"specdecode: cannot load the quantized kernel ({e}); using torch's kernels", file=sys.stderr)
        return None
    if lib.sdk_abi_version() != ABI:
        print("specdecode: the quantized kernel's build is stale; remove it and rerun", file=sys.stderr)
        return None
    lib.sdk_linear.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.sdk_linear.restype = ctypes.c_int
    i, L, P, f = ctypes.c_int, ctypes.c_long, ctypes.c_void_p, ctypes.c_float
    lib.sdk_quantize.argtypes = [P, L, i, i, i, P, f, i, i]
    lib.sdk_set_prefetch.argtypes = [i]
    lib.sdk_set_prefetch.restype = None
    lib.sdk_set_prefetch_hint.argtypes = [i]
    lib.sdk_set_prefetch_small.argtypes = [i]
    lib.sdk_set_prefetch_small.restype = None
    lib.sdk_set_prefetch_q6.argtypes = [i]
    lib.sdk_set_prefetch_q6.restype = None
    lib.sdk_set_prefetch_one.argtypes = [i]
    lib.sdk_set_prefetch_one.restype = None
    lib.sdk_set_prefetch_hint.restype = None
    lib.sdk_evict.argtypes = [P, L]
    lib.sdk_evict.restype = None
    lib.sdk_set_steal.argtypes = [i]
    lib.sdk_set_steal.restype = None
    lib.sdk_product.argtypes = [i, P, i, i, i, i, P, L, P, P, L, i, i]
    lib.sdk_linear_ex.argtypes = [i, P, i, i, i, P, L, i, P, L, i, P, f, P, P, L, i, i]
    lib.sdk_rope_attention.argtypes = [
        P,
        L,
        P,
        P,
        L,
        L,
        P,
        L,
        L,
        L,
        P,
        L,
        L,
        L,
        P,
        i,
        P,
        P,
        i,
        i,
        i,
        i,
        i,
        i,
        f,
        P,
        P,
        i,
        i,
    ]
    for fn in (lib.sdk_quantize, lib.sdk_product, lib.sdk_linear_ex, lib.sdk_rope_attention):
        fn.restype = ctypes.c_int
    lib.sdk_attention.argtypes = [P, L, L, P, L, L, L, P, L, L, L, P, P, i, i, i, i, i, i, f, P, i, i]
    lib.sdk_attention.restype = ctypes.c_int
    lib.sdk_float_linear.argtypes = [P, L, i, i, P, f, P, i, L, i, i, P, P, L, P, L, i, i]
    lib.sdk_float_linear.restype = ctypes.c_int
    # desc, nlayers, kv, eps, x, x2, m, hidden, qkv, qbuf, attn, gu, gu_width, then sdk_rope_attention's
    lib.sdk_layers.argtypes = [P, i, P, f, P, P, i, i, P, P, P, P, i, P, P, L, L, L, L, L, L, L, L, P, i,
                               P, P, i, i, i, i, i, i, f, i, i]  # fmt: skip
    lib.sdk_layers.restype = ctypes.c_int
    try:  # the AMX path's setter (absent when the compiler could not build sdk_amx.c)
        lib.sdk_set_amx_rows.argtypes = [i, i, i]
        lib.sdk_set_amx_rows.restype = None
        lib.sdk_get_amx_rows.argtypes = [i]
        lib.sdk_get_amx_rows.restype = ctypes.c_int
    except AttributeError:
        pass
    return lib


def available() -> bool:
    """Whether the kernel is built and loaded here (building it on first use)."""
    return _lib() is not None


@functools.cache
def build_id() -> str | None:
    """The loaded build's key (a hash of the sources, compiler and flags), None when none is
    loaded: a cached measurement of the kernel is redone when it changes."""
    return None if _lib() is None else built_library().parent.name


def runnable_isas() -> list[str]:
    """The paths this build has and this CPU and OS run (before the self-check)."""
    lib = _lib()
    return [] if lib is None else [name for i, name in enumerate(ISAS) if lib.sdk_isa_runs(i)]


@functools.cache
def _blocks_tag() -> str:
    """The version of the code that lays blocks out as tiles (a cached packing's key)."""
    from . import blocks

    return source_tag(blocks.__file__)


class PackedWeight:
    """A BlockWeight in the kernel's tiles (what `linear` multiplies by)."""

    def __init__(self, weight: BlockWeight) -> None:
        self.kind, self.code = weight.kind, CODE[weight.kind]
        self.out_features, self.in_features = weight.shape
        # kept in the cache by the blocks' bytes (kernels/store.py): packing the pair takes
        # seconds in numpy, reading it back a fraction of one (stacked parts are keyed by the
        # parts, so a packing read back never stacks them)
        tag = f"tiles:{weight.kind}:{weight.in_features}:{_blocks_tag()}"
        made = cached(tag, weight.sources, lambda: np.ascontiguousarray(weight.tiles()))
        self.tiles = torch.from_numpy(made)
        self.blocks = self.tiles.shape[1]
        self.nbytes = self.tiles.numel()


def _call(lib, x: torch.Tensor, w: PackedWeight, isa: int, threads: int) -> torch.Tensor:
    x = x.detach().to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], w.out_features)
    rc = lib.sdk_linear(
        w.code,
        w.tiles.data_ptr(),
        w.out_features,
        w.blocks,
        w.in_features,
        x.data_ptr(),
        x.shape[0],
        y.data_ptr(),
        isa,
        threads,
    )
    if rc != 0:
        raise SpecDecodeError(
            f"the quantized kernel refused a product ({rc}: {ISAS[isa]}, {tuple(x.shape)} "
            f"x {w.kind} {w.out_features}x{w.in_features})"
        )
    return y


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _refused(rc: int, what: str) -> SpecDecodeError:
    why = {-1: "bad arguments", -2: "path not runnable here", -3: "out of memory"}.get(rc, str(rc))
    return SpecDecodeError(f"the quantized kernel refused {what} ({why})")


def _rows_in(x: torch.Tensor, k: int, pre: str | None, pre_weight: torch.Tensor | None) -> torch.Tensor:
    """x as float32 rows with a contiguous last axis, checked against the width the pre-pass reads."""
    code = PRE.get(pre, -1)
    if code < 0:
        raise SpecDecodeError(f"unknown pre-pass {pre!r}; choose rms_norm or swiglu")
    width = 2 * k if code == 2 else k
    if x.shape[-1] != width:
        raise SpecDecodeError(f"input width {x.shape[-1]} does not match the weight's {width}")
    if code == 1 and (pre_weight is None or pre_weight.shape != (k,) or pre_weight.dtype != torch.float32):
        raise SpecDecodeError(f"rms_norm needs a float32 weight of {k} values")
    if x.dim() != 2:
        x = x.reshape(-1, width)
    if x.dtype != torch.float32 or x.stride(1) != 1:
        x = x.detach().to(torch.float32).contiguous()
    return x


def _isa_index(isa: str | None) -> int:
    if isa is None:
        isa = chosen_isa()
        prefetch_blocks()
        prefetch_small()
        prefetch_q6k_l1()
        prefetch_one()
        amx_rows()
    return ISAS.index(isa)


def linear(
    x: torch.Tensor,
    w: PackedWeight,
    isa: str | None = None,
    threads: int | None = None,
    *,
    pre: str | None = None,
    pre_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, in] float -> x W^T [M, out] float32, on the chosen path (or `isa`), split over
    torch's thread count (or `threads`) by output tiles. pre: the input row's pre-pass in C before
    it is quantized: "rms_norm" (x * pre_weight / sqrt(sum x^2 + eps)) or "swiglu" (x holds
    2 * in values a row, gate then up: silu(gate) * up); bias [out] and residual [M, out] float32
    are added to the product in that order. Every path gives the same bits."""
    return linear_parts(x, [w], isa, threads, pre=pre, pre_weight=pre_weight, eps=eps,
                        biases=[bias], residual=residual)  # fmt: skip


def linear_parts(
    x: torch.Tensor,
    parts: list[PackedWeight],
    isa: str | None = None,
    threads: int | None = None,
    *,
    pre: str | None = None,
    pre_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    biases: list[torch.Tensor | None] | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`linear` for weights whose outputs sit side by side ([M, sum of outs]; q|k|v of two
    formats): the rows are quantized once, then each part's product is written into its columns."""
    lib = _lib()
    if lib is None:
        raise SpecDecodeError("the quantized kernel is not built here (no C compiler?); use another --dtype")
    k = parts[0].in_features
    if any(p.in_features != k for p in parts):
        raise SpecDecodeError("linear_parts: every part must read the same input width")
    x = _rows_in(x, k, pre, pre_weight)
    m = x.shape[0]
    n = parts[0].out_features if len(parts) == 1 else sum(p.out_features for p in parts)
    if residual is not None and (
        residual.shape != (m, n) or residual.dtype != torch.float32 or not residual.is_contiguous()
    ):
        raise SpecDecodeError(f"the residual must be a contiguous float32 [{m}, {n}]")
    i = _isa_index(isa)
    threads = threads or torch.get_num_threads()
    y = torch.empty(m, n)
    biases = biases or [None] * len(parts)
    if len(parts) == 1:
        p, b = parts[0], biases[0]
        rc = lib.sdk_linear_ex(p.code, p.tiles.data_ptr(), n, p.blocks, k, x.data_ptr(), x.stride(0),
                               m, y.data_ptr(), n, PRE[pre], _ptr(pre_weight), eps, _ptr(b), _ptr(residual),
                               n, i, threads)  # fmt: skip
        if rc != 0:
            raise _refused(rc, f"a product ({ISAS[i]}, {tuple(x.shape)} x {p.kind} {p.out_features}x{k})")
        return y
    rc = lib.sdk_quantize(x.data_ptr(), x.stride(0), m, k, PRE[pre], _ptr(pre_weight), eps, i, threads)
    if rc != 0:
        raise _refused(rc, f"rows {tuple(x.shape)}")
    col = 0
    for p, b in zip(parts, biases):
        res = None if residual is None else residual.data_ptr() + 4 * col
        rc = lib.sdk_product(p.code, p.tiles.data_ptr(), p.out_features, p.blocks, k, m,
                             y.data_ptr() + 4 * col, n, _ptr(b), res, n, i, threads)  # fmt: skip
        if rc != 0:
            raise _refused(rc, f"a product ({ISAS[i]}, {m} rows x {p.kind} {p.out_features}x{k})")
        col += p.out_features
    return y


FLOAT_WEIGHTS = {torch.float32: 0, torch.bfloat16: 1}  # sdk_float_linear's weight types


def float_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    isa: str | None = None,
    threads: int | None = None,
    *,
    pre: str | None = None,
    pre_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, in] float -> x W^T [M, out] float32 with weight [out, in] float32 or bfloat16 (rows
    contiguous), on the chosen path (or `isa`), split over torch's thread count (or `threads`) by
    output columns (csrc/sdk_fgemm_body.h). Each (row, column) dot product is one fixed sequence
    of float operations (16 lane sums in K order, a fixed tree), so a row's bits do not depend on
    the row count, the path or the threads. pre, pre_weight, eps, bias, residual: as `linear`."""
    lib = _lib()
    if lib is None:
        raise SpecDecodeError("the kernel is not built here (no C compiler?); use torch's products")
    wt = FLOAT_WEIGHTS.get(weight.dtype)
    if wt is None or weight.dim() != 2 or weight.stride(1) != 1 or weight.device.type != "cpu":
        raise SpecDecodeError(
            "float_linear: the weight must be a CPU float32 or bfloat16 [out, in] with rows contiguous"
        )
    n, k = weight.shape
    x = _rows_in(x, k, pre, pre_weight)
    m = x.shape[0]
    if residual is not None and (
        residual.shape != (m, n) or residual.dtype != torch.float32 or residual.stride(1) != 1
    ):
        raise SpecDecodeError(f"the residual must be float32 [{m}, {n}] with rows contiguous")
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise SpecDecodeError(f"the bias must be a contiguous float32 [{n}]")
    i = _isa_index(isa)
    y = torch.empty(m, n)
    rc = lib.sdk_float_linear(
        x.data_ptr(), x.stride(0), m, PRE[pre], _ptr(pre_weight), eps, weight.data_ptr(), wt,
        weight.stride(0), n, k, _ptr(bias), _ptr(residual), 0 if residual is None else residual.stride(0),
        y.data_ptr(), n, i, threads or torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise _refused(rc, f"a float product ({ISAS[i]}, {tuple(x.shape)} x {weight.dtype} {n}x{k})")
    return y


def rope_attention(
    qkv: torch.Tensor,
    shape: tuple[int, int, int, int, int],
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    idx: torch.Tensor,
    n: torch.Tensor,
    scale: float,
    threads: int | None = None,
    isa: str | None = None,
    checked: bool = False,
) -> torch.Tensor:
    """A layer's attention from its q|k|v rows in one C call: RoPE on every token's query and key
    heads (x * cos + roll(x, D / 2) * sin, the sign in `sin`), its key and value written at its
    slot, then `attention` over the slots each query sees. qkv [B * T, (H + 2 Hkv) * D] float32
    rows; shape (B, T, H, Hkv, D); cos, sin [1 or B, T, 1, D] float32; keys, values the cache
    layer's (as `attention`); slots [B, T] int32 write slots; idx [B, T, N], n [B, T] int32 ->
    [B * T, H * D]. Every path gives the same bits. checked: the caller already passed these
    arguments of this forward through here once (the layers after the first skip the checks;
    the C code still refuses a slot outside the cache)."""
    lib = _lib()
    if lib is None:
        raise SpecDecodeError("the kernel's attention is not built here (no C compiler?)")
    args = (lib, qkv, shape, cos, sin, keys, values, slots, idx, n, scale, threads, isa)
    if checked:
        return _rope_attention_call(*args)
    idx, n = _rope_arguments(qkv, shape, cos, sin, keys, values, slots, idx, n)
    return _rope_attention_call(*args[:8], idx, n, *args[10:])


PROJ_WORDS = 18  # csrc/sdk_forward.c: one projection's int64 words
LAYER_WORDS = 4 * PROJ_WORDS + 2  # q|k|v, o, gate|up, down, the two norms' weights


def projection_words(parts: list[tuple[PackedWeight | torch.Tensor, torch.Tensor | None]]) -> list[int]:
    """One projection as sdk_layers reads it: up to three (PackedWeight, bias) parts whose outputs
    sit side by side, or one (float32 or bfloat16 weight [out, in], bias). The tensors must
    outlive the words (kernels.layers' caller keeps them)."""
    if not 1 <= len(parts) <= 3:
        raise SpecDecodeError("a projection for sdk_layers has one to three parts")
    words = [len(parts)]
    floats = [w for w, _ in parts if isinstance(w, torch.Tensor)]
    for w, b in parts:
        if b is not None and (b.dtype != torch.float32 or not b.is_contiguous()):
            raise SpecDecodeError("a bias for sdk_layers must be a contiguous float32 tensor")
        if isinstance(w, torch.Tensor):
            words += [0, w.data_ptr(), w.shape[0], 0, _ptr(b) or 0]
        else:
            words += [w.code, w.tiles.data_ptr(), w.out_features, w.blocks, _ptr(b) or 0]
    words += [0] * (1 + 5 * 3 - len(words))
    if floats:
        w = floats[0]
        if len(parts) != 1 or FLOAT_WEIGHTS.get(w.dtype) is None or w.stride(1) != 1:
            raise SpecDecodeError("a float projection for sdk_layers is one float32 or bfloat16 weight")
        return words + [FLOAT_WEIGHTS[w.dtype], w.stride(0)]
    return words + [0, 0]


def layers(
    table: torch.Tensor,
    count: int,
    x: torch.Tensor,
    eps: float,
    widths: tuple[int, int],
    shape: tuple[int, int, int, int, int],
    cos: torch.Tensor,
    sin: torch.Tensor,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    slots: torch.Tensor,
    idx: torch.Tensor,
    n: torch.Tensor,
    scale: float,
    threads: int | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """The first `count` decoder layers of `table` (int64 [layers, LAYER_WORDS]: per layer the
    projection_words of q|k|v, o, gate|up and down, then the input norm's and the MLP norm's
    float32 weights' addresses) over the residual stream x [B * T, hidden] float32, in one C
    call (csrc/sdk_forward.c): per layer the input norm inside q|k|v, rope_attention into the
    layer's (keys, values) of `caches`, o plus the residual, the MLP norm inside gate|up, SwiGLU
    inside down plus the residual: the calls the fused layers make one by one, in their order,
    so the same bits. widths: (hidden, gate|up outputs). The rest: as rope_attention. Returns a
    new stream; x is left as it was."""
    lib = _lib()
    if lib is None:
        raise SpecDecodeError("the kernel is not built here (no C compiler?)")
    B, T, H, Hkv, D = shape
    hidden, gu_width = widths
    if table.dtype != torch.int64 or table.shape[1:] != (LAYER_WORDS,) or not table.is_contiguous():
        raise SpecDecodeError(f"layers: the table must be contiguous int64 [layers, {LAYER_WORDS}]")
    if not 0 <= count <= table.shape[0] or len(caches) < count:
        raise SpecDecodeError(
            f"layers: {count} layers asked of a table of {table.shape[0]} rows and {len(caches)} caches"
        )
    if x.shape != (B * T, hidden):
        raise SpecDecodeError(f"layers: the stream must be [{B * T}, {hidden}]")
    x = x.to(torch.float32, copy=True).contiguous()
    keys, values = caches[0]
    for k, v in caches[:count]:  # every layer's cache of one layout (the C call takes one set of strides)
        if k.stride() != keys.stride() or v.stride() != values.stride() or k.shape != keys.shape:
            raise SpecDecodeError("layers: every layer's cache must have the first one's shape and strides")
    kv = torch.tensor([t.data_ptr() for pair in caches[:count] for t in pair], dtype=torch.int64)
    q = torch.empty(B * T, (H + 2 * Hkv) * D)
    idx, n = _rope_arguments(q, shape, cos, sin, keys, values, slots, idx, n)
    cap = min(keys.shape[2], values.shape[0] * 64)
    cb = cos.stride(0) if cos.shape[0] > 1 else 0
    x2, qbuf, attn = torch.empty(B * T, hidden), torch.empty(B * T * H * D), torch.empty(B * T, H * D)
    gu = torch.empty(B * T, gu_width)
    rc = lib.sdk_layers(
        table.data_ptr(), count, kv.data_ptr(), eps, x.data_ptr(), x2.data_ptr(), B * T, hidden,
        q.data_ptr(), qbuf.data_ptr(), attn.data_ptr(), gu.data_ptr(), gu_width,
        cos.data_ptr(), sin.data_ptr(), cb, cos.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        slots.data_ptr(), cap, idx.data_ptr(), n.data_ptr(), B, T, H, Hkv, D, idx.shape[-1],
        scale, _isa_index(isa), threads or torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise _refused(rc, f"a run of {count} layers")
    return x


def _rope_arguments(qkv, shape, cos, sin, keys, values, slots, idx, n) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_attention's checks of its arguments; (idx, n) as contiguous int32."""
    B, T, H, Hkv, D = shape
    if qkv.dtype != torch.float32 or qkv.shape != (B * T, (H + 2 * Hkv) * D) or qkv.stride(-1) != 1:
        raise SpecDecodeError("rope_attention: qkv must be float32 [B * T, (H + 2 Hkv) * D] rows")
    for name, t in (("cos", cos), ("sin", sin), ("keys", keys), ("values", values)):
        if t.dtype != torch.float32 or t.stride(-1) != 1:
            raise SpecDecodeError(f"rope_attention: {name} must be float32 with a contiguous last axis")
    if cos.stride() != sin.stride() or cos.shape[-1] != D or cos.shape[1] != T:
        raise SpecDecodeError("rope_attention: cos and sin must be [1 or B, T, 1, D] of one layout")
    if values.stride(-2) != D or values.shape[-2] != 64:
        raise SpecDecodeError("rope_attention: values must be chunk-major [chunks, B, Hkv, 64, D]")
    if slots.dtype != torch.int32 or slots.shape != (B, T) or not slots.is_contiguous():
        raise SpecDecodeError("rope_attention: slots must be int32 [B, T]")
    return idx.to(torch.int32).contiguous(), n.to(torch.int32).contiguous()


def _rope_attention_call(lib, qkv, shape, cos, sin, keys, values, slots, idx, n, scale, threads, isa):
    B, T, H, Hkv, D = shape
    cap = min(keys.shape[2], values.shape[0] * 64)  # the C code refuses a slot outside it
    cb = cos.stride(0) if cos.shape[0] > 1 else 0
    qbuf, out = torch.empty(B * T * H * D), torch.empty(B * T, H * D)
    rc = lib.sdk_rope_attention(
        qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), cb, cos.stride(1),
        keys.data_ptr(), keys.stride(0), keys.stride(1), keys.stride(2),
        values.data_ptr(), values.stride(0), values.stride(1), values.stride(2),
        slots.data_ptr(), cap, idx.data_ptr(), n.data_ptr(), B, T, H, Hkv, D, idx.shape[-1], scale,
        qbuf.data_ptr(), out.data_ptr(), threads or torch.get_num_threads(), _isa_index(isa),
    )  # fmt: skip
    if rc != 0:
        raise SpecDecodeError(f"the kernel's attention refused its inputs ({rc})")
    return out


def attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    idx: torch.Tensor,
    n: torch.Tensor,
    scale: float,
    threads: int | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """Each query's attention over the slots it sees, in logical order, computed on its own
    (csrc/sdk_attn.c: a query's bits depend on nothing else in the call). q [B, T, H, D] float32
    (head dimension contiguous); keys [B, Hkv, slots, D]; values chunk-major [chunks, B, Hkv, 64,
    D]; idx [B, T, N] int32 slots in logical order, n [B, T] int32 how many -> [B, T, H, D].
    Every path gives the same bits (csrc/sdk_attn_body.h); `isa` forces one."""
    lib = _lib()
    if lib is None:
        raise SpecDecodeError("the kernel's attention is not built here (no C compiler?)")
    B, T, H, D = q.shape
    Hkv = keys.shape[1]
    for name, t in (("q", q), ("keys", keys), ("values", values)):
        if t.dtype != torch.float32 or t.stride(-1) != 1:
            raise SpecDecodeError(f"attention: {name} must be float32 with a contiguous last axis")
    if values.stride(-2) != D or values.shape[-2] != 64:
        raise SpecDecodeError("attention: values must be chunk-major [chunks, B, Hkv, 64, D]")
    idx, n = idx.to(torch.int32).contiguous(), n.to(torch.int32).contiguous()
    out = torch.empty(B, T, H, D)
    rc = lib.sdk_attention(
        q.data_ptr(), q.stride(0), q.stride(1),
        keys.data_ptr(), keys.stride(0), keys.stride(1), keys.stride(2),
        values.data_ptr(), values.stride(0), values.stride(1), values.stride(2),
        idx.data_ptr(), n.data_ptr(), B, T, H, Hkv, D, idx.shape[-1], scale, out.data_ptr(),
        threads or torch.get_num_threads(),
        _isa_index(isa),
    )  # fmt: skip
    if rc != 0:
        raise SpecDecodeError(f"the kernel's attention refused its inputs ({rc})")
    return out


def set_fault(on: bool) -> None:
    """Tests only: the SIMD paths add 1 to one lane of one integer sum (the self-check's negative
    control). Clears the cached choice."""
    lib = _lib()
    if lib is not None:
        lib.sdk_set_fault(int(on))
    chosen_isa.cache_clear()
    _checked.cache_clear()


def _check_cases(gen: np.random.Generator):
    """(weight, rows) pairs every path must give the reference's bits on: each format, widths
    that are not whole blocks, 1-16 and 64 rows, random values over decades, and the extremes
    (codes of +-127 against the largest nibbles, bytes and scales)."""
    for k, n in ((256, 16), (520, 40), (96, 24)):
        w = (gen.standard_normal((n, k)) * np.logspace(-2, 1, n)[:, None]).astype(np.float32)
        w[0] = 1.0
        w[1, ::2], w[1, 1::2] = 4.0, -4.0
        x = (gen.standard_normal((70, k)) * np.logspace(-3, 2, 70)[:, None]).astype(np.float32)
        x[0], x[1] = 1.0, -1.0
        x[2, ::2], x[2, 1::2] = 1.0, -1.0
        weights = (quantize_q4_k(w), quantize_q8_0(w), _q6_k_of(w, gen), _q5_0_of(w, gen), _q4_0_of(w, gen))
        for weight in (*weights, _blocks32_of(w, gen, "q3_0")):
            yield weight, torch.from_numpy(x)


def _q6_k_of(w: np.ndarray, gen: np.random.Generator) -> BlockWeight:
    """A Q6_K matrix of w's shape with random bytes and scales (the extremes included)."""
    n, k = w.shape
    nb = -(-k // 256)
    raw = gen.integers(0, 256, (n, nb, 210), dtype=np.uint8)
    raw[0, :, :192] = 0xFF  # every value 63
    raw[..., 192:208] = gen.integers(-128, 128, (n, nb, 16)).astype(np.int8).view(np.uint8)
    raw[0, :, 192:208] = np.uint8(0x80)  # scale -128
    raw[..., 208:210] = np.float16(0.01 * (1 + gen.random())).reshape(1).view(np.uint8)
    return BlockWeight("q6_k", raw.reshape(n, -1), k)


def _q5_0_of(w: np.ndarray, gen: np.random.Generator) -> BlockWeight:
    """A Q5_0 matrix of w's shape with random bytes (row 0: every value 31, row 1: every value 0)."""
    return _blocks32_of(w, gen, "q5_0")


def _q4_0_of(w: np.ndarray, gen: np.random.Generator) -> BlockWeight:
    """A Q4_0 matrix of w's shape with random bytes (row 0: every value 15, row 1: every value 0)."""
    return _blocks32_of(w, gen, "q4_0")


def _blocks32_of(w: np.ndarray, gen: np.random.Generator, kind: str) -> BlockWeight:
    """Random blocks of 32 with an fp16 d first (Q5_0, Q4_0, Q3_0): every other byte 0xFF in row 0
    (every value the largest), 0 in row 1, small positive scales."""
    from .blocks import BLOCK

    n, k = w.shape
    raw = gen.integers(0, 256, (n, -(-k // 32), BLOCK[kind][1]), dtype=np.uint8)
    raw[0, :, 2:] = 0xFF
    if n > 1:
        raw[1, :, 2:] = 0
    d = np.float16(0.01) * (1 + gen.random((*raw.shape[:2], 1)))
    raw[..., 0:2] = d.astype(np.float16).view(np.uint8)
    return BlockWeight(kind, raw.reshape(n, -1), k)


@functools.cache
def _checked(isa: str) -> bool:
    lib = _lib()
    if lib is None or isa not in runnable_isas():
        return False
    gen = np.random.default_rng(0)
    ref, i = ISAS.index("ref"), ISAS.index(isa)
    # the AMX path with the tiles at every row count (its fewer rows otherwise take the AVX-512
    # VNNI code, checked as its own path), Q4_K with and without its folded scales
    for fold in (1, NO_AMX) if isa == "amx" else (None,):
        with amx_rows_forced(1, fold) if isa == "amx" else contextlib.nullcontext():
            for weight, x in _check_cases(gen):
                packed = PackedWeight(weight)
                want = _call(lib, x, packed, ref, 1)
                for rows in (1, 2, 3, 5, 8, 9, 16, 20, 40, 64, 70):  # AMX: 1, 2 (paired) and 3 chunks
                    for threads in (1, 2):
                        if not torch.equal(_call(lib, x[:rows], packed, i, threads), want[:rows]):
                            return False
    for args in _attention_cases(gen):  # the attention's build for this path: the base build's bits
        if not torch.equal(attention(*args, threads=2, isa=isa), attention(*args, threads=1, isa="ref")):
            return False
    # the fused layers' pieces: a pre-pass (RMSNorm, SwiGLU) with bias and residual, and RoPE + the
    # cache write + attention
    x = torch.from_numpy(gen.standard_normal((9, 512)).astype(np.float32) * 4)
    nw = torch.from_numpy(gen.standard_normal(256).astype(np.float32))
    packed = PackedWeight(quantize_q4_k(gen.standard_normal((24, 256)).astype(np.float32)))
    bias, res = torch.from_numpy(gen.standard_normal(24).astype(np.float32)), torch.ones(9, 24)
    for pre, xs in (("rms_norm", x[:, :256]), ("swiglu", x)):
        kw = dict(pre=pre, pre_weight=nw if pre == "rms_norm" else None, eps=0.01, bias=bias, residual=res)
        if not torch.equal(linear(xs, packed, isa, 2, **kw), linear(xs, packed, "ref", 1, **kw)):
            return False
    if not _float_products_match(gen, isa):
        return False
    return _rope_attention_matches(gen, isa)


def _float_products_match(gen: np.random.Generator, isa: str) -> bool:
    """float_linear on `isa` gives the reference path's bits: float32 and bfloat16 weights, widths
    that are not whole vectors, 1-17 and 70 rows, 1 and 2 threads, a pre-pass, bias, residual."""

    def draw(*shape):  # values over six decades (row by row for matrices)
        scale = np.logspace(-3, 3, shape[0])[:, None] if len(shape) == 2 else 1.0
        return torch.from_numpy((gen.standard_normal(shape) * scale).astype(np.float32))

    for n, k in ((37, 300), (5, 16), (20, 7)):
        w, x, nw, bias = draw(n, k), draw(70, 2 * k), draw(k), draw(n)
        for weight in (w, w.bfloat16()):
            for pre, xs in ((None, x[:, :k]), ("rms_norm", x[:, :k]), ("swiglu", x)):
                kw = dict(pre=pre, pre_weight=nw if pre == "rms_norm" else None, eps=0.01, bias=bias)
                ones = torch.ones(70, n)
                want = float_linear(xs, weight, "ref", 1, **kw, residual=ones)
                for rows in (1, 2, 3, 5, 8, 9, 17, 70):
                    for threads in (1, 2):
                        got = float_linear(xs[:rows], weight, isa, threads, **kw, residual=ones[:rows])
                        if not torch.equal(got, want[:rows]):
                            return False
    return True


def _rope_attention_matches(gen: np.random.Generator, isa: str) -> bool:
    """rope_attention on `isa` writes and returns the reference path's bits."""
    B, T, H, Hkv, D = 2, 2, 4, 2, 24
    r = lambda *s: torch.from_numpy(gen.standard_normal(s).astype(np.float32))  # noqa: E731
    qkv, cos, sin = r(B * T, (H + 2 * Hkv) * D), r(B, T, 1, D), r(B, T, 1, D)
    keys, values = r(B, Hkv, 128, D), r(2, B, Hkv, 64, D)
    slots = torch.tensor([[100, 101], [3, 7]], dtype=torch.int32)
    idx = torch.from_numpy(np.stack([gen.permutation(110) for _ in range(B * T)]).reshape(B, T, 110))
    n = torch.from_numpy(gen.integers(1, 111, (B, T)))
    got = []
    for path, threads in ((isa, 2), ("ref", 1)):
        k, v = keys.clone(), values.clone()
        out = rope_attention(qkv, (B, T, H, Hkv, D), cos, sin, k, v, slots, idx, n, 0.2, threads, path)
        got.append((out, k, v))
    return all(torch.equal(a, b) for a, b in zip(*got))


def _attention_cases(gen: np.random.Generator):
    """(q, keys, values, idx, n, scale) for the attention's self-check: head sizes with and without
    a tail past 16 lanes, groups of 2, 3, 6 and 9 query heads a key head (the AVX-512 build scores
    8 keys at a time and sums values for 6 or 3 heads at a time), slots in random logical order,
    values over decades."""
    for D, H, Hkv in ((64, 4, 2), (40, 6, 2), (8, 2, 1), (128, 12, 2), (64, 9, 1)):
        B, T, S = 2, 3, 150
        r = lambda *s: torch.from_numpy(gen.standard_normal(s).astype(np.float32))  # noqa: E731
        q, keys = r(B, T, H, D) * 3, r(B, Hkv, 192, D)
        values = r(3, B, Hkv, 64, D) * torch.from_numpy(np.logspace(-3, 2, D).astype(np.float32))
        idx = torch.from_numpy(np.stack([gen.permutation(S) for _ in range(B * T)]).reshape(B, T, S))
        n = torch.from_numpy(gen.integers(0, S + 1, (B, T)))
        yield q, keys, values, idx, n, D**-0.5


def selfcheck(isa: str) -> bool:
    """Whether `isa` runs here and gives the scalar reference's bits on the check cases."""
    return _checked(isa)


def _recorded(key: str):
    """The timed choice kept under `key` in the build's choice.json (per CPU), or None."""
    try:
        return json.loads((built_library().parent / "choice.json").read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def _record(key: str, value) -> None:
    """Keep a timed choice in the build's choice.json (written whole and renamed: another
    process reads the old file or the new, never half of one); a read-only cache keeps nothing."""
    record = built_library().parent / "choice.json"
    try:
        try:
            known = json.loads(record.read_text())
        except (OSError, ValueError):
            known = {}
        tmp = record.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**known, key: value}))
        tmp.replace(record)
    except OSError:
        pass


@functools.cache
def chosen_isa() -> str:
    """The path products take: SPECDECODE_ISA when set, else of those that pass the self-check
    the widest, unless a narrower one was more than CLEARLY times faster (timed at 1 and 8 rows
    on 56 MB of Q4_K weights: _timed; amx stands in for avx512vnni, whose code it runs below
    its own row counts; the outcome is kept in the build's choice.json per CPU, so later
    processes run the self-checks only)."""
    forced = os.environ.get("SPECDECODE_ISA")
    if forced:
        if forced not in ISAS:
            raise SpecDecodeError(f"SPECDECODE_ISA={forced!r}: choose one of {', '.join(ISAS)}")
        if not selfcheck(forced):
            raise SpecDecodeError(
                f"SPECDECODE_ISA={forced}: this machine cannot run it or it failed its self-check "
                f"(runnable here: {', '.join(runnable_isas()) or 'none'})"
            )
        return forced
    passing = [isa for isa in runnable_isas() if isa != "ref" and selfcheck(isa)]
    if not passing:
        return "ref"
    # amx is timed as the avx512vnni path it extends: below its timed row counts (amx_rows) it
    # runs that very code, so a timing at 1 and 8 rows can only see noise or tiles that amx_rows
    # would not use there (on the AMX Xeon it once picked avx512vnni by 15%, and the 64-row
    # products ran at half speed)
    timed = [isa for isa in passing if isa != "amx" or "avx512vnni" not in passing]
    chosen = timed[0] if len(timed) == 1 else None
    # the timing (~0.3 s a process) is kept beside the build, per CPU and set of passing paths
    key = f"{cpu_name()} {','.join(passing)}"
    if chosen is None and _recorded(key) in passing:
        chosen = _recorded(key)
    elif chosen is None:
        weights = _timing_weights()  # held for the choice only
        seconds = {isa: _timed(isa, weights) for isa in timed}
        # the widest path unless a narrower one is clearly faster: a timing beside other work on the
        # machine is noisy, and a wrong pick here costs speed only (every path gives the same bits)
        chosen = next(isa for isa in reversed(timed) if seconds[isa] <= CLEARLY * min(seconds.values()))
    if chosen == "avx512vnni" and "amx" in passing:
        chosen = "amx"
    if len(passing) > 1 and _recorded(key) != chosen:
        _record(key, chosen)
    return chosen


PREFETCH = (1, 2, 3, 4)  # records ahead a product of several rows may prefetch
PREFETCH_CLEARLY = 1.05  # a longer distance is chosen over one record only when this much faster
HINTS = ("t0", "nta")  # the prefetches' cache hint: to L1 (Q6_K's to L2), or non-temporal


def prefetch_blocks() -> int:
    """How many weight records ahead the SIMD paths prefetch Q4_K and Q6_K in a product of two
    or more rows (one row: prefetch_one(); the blocks of 32: prefetch_small()); prefetch_choice() says
    it with the hint."""
    return prefetch_choice()[0]


@functools.cache
def prefetch_choice() -> tuple[int, str]:
    """(records ahead, cache hint) of the SIMD paths' weight prefetches, set in the library. Speed
    only, never bits, and what pays is the CPU's: the distance on a Zen 4 EPYC one record, on a
    Zen 5 EPYC three or four (a 5-row step of the 1.5B 28.3 -> 20.9 ms, of the 0.5B 16.0 -> 13.3);
    the hint on the Zen 5 non-temporal (the 1.5B's step 3-4% faster, the pair's rounds 4-5%;
    benchmarks/NOTES.md). SPECDECODE_PREFETCH=1..8 and SPECDECODE_PREFETCH_HINT=t0|nta force them;
    else 1 and 5 rows through the 56 MB of random Q4_K weights are timed at each distance of
    PREFETCH with each hint, interleaved (_time_prefetch): NTA unless T0 is clearly faster, then one
    record unless another distance is PREFETCH_CLEARLY faster with that hint (kept in the build's
    choice.json per CPU, as chosen_isa)."""
    lib = _lib()
    if lib is None:
        return 1, "t0"
    forced, forced_hint = os.environ.get("SPECDECODE_PREFETCH"), os.environ.get("SPECDECODE_PREFETCH_HINT")
    if forced and (not forced.isdigit() or not 1 <= int(forced) <= 8):
        raise SpecDecodeError(f"SPECDECODE_PREFETCH={forced!r}: give a number of records from 1 to 8")
    if forced_hint and forced_hint not in HINTS:
        raise SpecDecodeError(f"SPECDECODE_PREFETCH_HINT={forced_hint!r}: give one of {', '.join(HINTS)}")
    isa = chosen_isa()
    if isa == "ref":  # the scalar reference prefetches nothing
        return 1, "t0"
    chosen = (int(forced), forced_hint) if forced and forced_hint else None
    key = f"{cpu_name()} {isa} prefetch"
    if chosen is None:
        got = _recorded(key)
        if isinstance(got, list) and len(got) == 2 and got[0] in PREFETCH and got[1] in HINTS:
            chosen = (got[0], got[1])
        else:
            chosen = _time_prefetch(lib, isa)
            _record(key, list(chosen))
        chosen = (int(forced) if forced else chosen[0], forced_hint or chosen[1])
    lib.sdk_set_prefetch(chosen[0])
    lib.sdk_set_prefetch_hint(HINTS.index(chosen[1]))
    return chosen


SMALL = (4, 8, 16, 32, 64)  # records ahead the blocks of 32 may prefetch (the first: the default)
ONE = (1, 2, 3, 4)  # records ahead a one-row Q4_K / Q6_K product may prefetch (the first: the default)
ONE_CLEARLY = 1.02  # products alone show a third to half of a forward's gain (Zen 4: 2-5% against 9%)


def _timed_knob(
    name: str,
    env: str,
    parse,
    setter: str,
    candidates: tuple,
    clearly: float,
    kind: str,
    rows: tuple,
    rounds: int,
):
    """One of the prefetch settings timed after the distance and hint (prefetch_small, prefetch_one,
    prefetch_q6k_l1): the environment's value (parse: it or None when invalid) when set, the
    first candidate on the reference path, else the recorded choice of this build and CPU, else
    each candidate timed over _timing_weights(kind) at `rows`, interleaved `rounds` times: the
    first unless another is `clearly` faster. Set in the library either way."""
    lib = _lib()
    if lib is None:
        return candidates[0]
    forced = os.environ.get(env)
    if forced and parse(forced) is None:
        raise SpecDecodeError(f"{env}={forced!r}: give {name}")
    isa = chosen_isa()
    if forced or isa == "ref":  # the scalar reference prefetches nothing
        chosen = parse(forced) if forced else candidates[0]
    else:
        prefetch_choice()  # the distance and hint the timing runs with
        key = f"{cpu_name()} {isa} prefetch {setter}"
        chosen = _recorded(key)
        if chosen not in candidates or type(chosen) is not type(candidates[0]):
            weights = _timing_weights(kind)
            seconds = dict.fromkeys(candidates, float("inf"))
            for _ in range(rounds):  # interleaved: memory speed moves within seconds on a VM
                for c in candidates:
                    getattr(lib, setter)(int(c))
                    seconds[c] = min(seconds[c], _timed(isa, weights, rows=rows, repeats=1))
            best = min(candidates, key=seconds.__getitem__)
            chosen = candidates[0] if seconds[candidates[0]] <= clearly * seconds[best] else best
            _record(key, chosen)
    getattr(lib, setter)(int(chosen))
    return chosen


def _records(low: int, high: int):
    return lambda v: int(v) if v.isdigit() and low <= int(v) <= high else None


@functools.cache
def prefetch_small() -> int:
    """Records ahead the SIMD paths prefetch the blocks of 32 (Q8_0, Q5_0, Q4_0, Q3_0: a draft
    model's formats), at every row count. Speed only, never bits. Their records are 160-544 bytes,
    so the lead that pays is longer than Q4_K's and the CPU's own: 32 on a Zen 5 EPYC (the 0.5B's
    one-row step 7% faster than at 4, five rows 17%) and on a Zen 4 EPYC, whose Q4_K distance is
    one record (the kq4 draft's step 17% faster; benchmarks/NOTES.md, issue 53).
    SPECDECODE_PREFETCH_SMALL=1..128 forces it; else 1 and 5 rows through 62 MB of random Q4_0
    blocks with a draft's 896 inputs are timed at each distance of SMALL, interleaved five times,
    with the chosen hint: 4 unless another is PREFETCH_CLEARLY faster (kept in the build's
    choice.json per CPU, as chosen_isa)."""
    return _timed_knob(
        "a number of records from 1 to 128", "SPECDECODE_PREFETCH_SMALL", _records(1, 128),
        "sdk_set_prefetch_small", SMALL, PREFETCH_CLEARLY, "q4_0", (1, 5), 5,
    )


@functools.cache
def prefetch_one() -> int:
    """Records ahead a one-row Q4_K or Q6_K product prefetches (a target's decode step). Speed
    only, never bits: on a Zen 4 EPYC two records made the 1.5B's one-row step 8-10% faster than
    one (28.4-29.7 ms against 31.2-32.9, interleaved), where products alone time 2-5% apart.
    SPECDECODE_PREFETCH_ONE=1..8 forces it; else one row through the target-shaped mix is timed at
    each distance of ONE, interleaved seven times: one record unless another is ONE_CLEARLY faster
    (kept in the build's choice.json per CPU, as chosen_isa)."""
    prefetch_q6k_l1()  # Q6_K's level first: the mix's Q6_K runs with it
    return _timed_knob(
        "a number of records from 1 to 8", "SPECDECODE_PREFETCH_ONE", _records(1, 8),
        "sdk_set_prefetch_one", ONE, ONE_CLEARLY, "mix", (1,), 7,
    )


@functools.cache
def prefetch_q6k_l1() -> bool:
    """Whether Q6_K's prefetches go to L1 (T0) for one or two rows (the AVX2 path: at every row
    count) instead of L2 (T1). Speed only, never bits, and the CPU's: L1 made a Zen 5 EPYC's Q6_K
    head and down 5-7% faster at one row, and a Zen 4 EPYC's 28% slower (its 1.5B step 12%).
    SPECDECODE_PREFETCH_Q6=l1|l2 forces it; else one and two rows through 83 MB of random Q6_K are
    timed with each, interleaved five times, after the distance and hint: L2 unless L1 is
    PREFETCH_CLEARLY faster (kept in the build's choice.json per CPU, as chosen_isa)."""
    return _timed_knob(
        "l1 or l2", "SPECDECODE_PREFETCH_Q6", {"l1": True, "l2": False}.get,
        "sdk_set_prefetch_q6", (False, True), PREFETCH_CLEARLY, "q6_k", (1, 2), 5,
    )


AMX_ROWS = (2, 3, 4, 5, 6, 8, 12, 16, 20, 24, 32, 48)  # the row counts at which the AMX choices are timed
NO_AMX = 65  # a threshold above SDK_ROWS (64): the tiles never run


@functools.cache
def amx_rows() -> tuple[int, int, int]:
    """(Q4_K and blocks of 32, Q6_K, Q4_K folded): the fewest rows a product on the AMX path takes
    through the tiles, per kind, and from how many Q4_K folds its sub-block scales into the
    weights (csrc/sdk_amx.c q4k_fold: a split of every weight into two bytes, shared by the call's
    rows, against stores and multiplies a row); fewer rows take the AVX-512 VNNI code, or the
    tiles without the fold (the same bits: all are exact integer sums). A tile multiply costs the
    same for 1 to 8 rows, so few rows pay the tiles' set-up and stores for nothing; Q6_K on the
    tiles always folds its scales, a split that pays from a count of its own.
    SPECDECODE_AMX_ROWS=N, N,M or N,M,F (1..65; 65: never) forces them; else AMX_ROWS rows through
    timing weights of each kind are timed both ways, interleaved three times, and for each the
    smallest count from which the tiles (the fold) are no slower at every larger count is kept
    (in the build's choice.json per CPU, as chosen_isa). (0, 0, 0) when the chosen path is not
    AMX."""
    lib = _lib()
    if lib is None or not hasattr(lib, "sdk_set_amx_rows") or chosen_isa() != "amx":
        return 0, 0, 0
    forced = os.environ.get("SPECDECODE_AMX_ROWS")
    if forced:
        parts = forced.split(",")
        if len(parts) > 3 or not all(p.isdigit() and 1 <= int(p) <= NO_AMX for p in parts):
            raise SpecDecodeError(
                f"SPECDECODE_AMX_ROWS={forced!r}: give a number of rows from 1 to {NO_AMX} "
                "(or three: Q4_K,Q6_K,Q4_K folded)"
            )
        chosen = tuple(int(p) for p in (parts + parts[-1:] * 2)[:3])
    else:
        key = f"{cpu_name()} amx rows"
        got = _recorded(key)
        valid = isinstance(got, list) and len(got) == 3
        if valid and all(isinstance(r, int) and 1 <= r <= NO_AMX for r in got):
            chosen = tuple(got)
        else:
            chosen = _time_amx_rows(lib)
            _record(key, list(chosen))
    lib.sdk_set_amx_rows(*chosen)
    return chosen


@contextlib.contextmanager
def amx_rows_forced(rows: int, fold: int | None = None):
    """Within the block, products on the AMX path take the tiles from `rows` rows in every format
    (1: always; NO_AMX: never) and Q4_K's folded scales from `fold` rows (default: `rows`), then
    the thresholds before (tests: every row count on the tiles, with and without the fold)."""
    lib = _lib()
    if lib is None or not hasattr(lib, "sdk_set_amx_rows"):
        yield
        return
    before = tuple(lib.sdk_get_amx_rows(i) for i in range(3))
    lib.sdk_set_amx_rows(rows, rows, rows if fold is None else fold)
    try:
        yield
    finally:
        lib.sdk_set_amx_rows(*before)


AMX_NOISE = 1.02  # a choice counts as no slower within this (the timings move by a few % on a VM)


def _from_rows(seconds: dict) -> int:
    """The smallest of AMX_ROWS from which seconds[r, True] <= AMX_NOISE * seconds[r, False] at
    every larger count (NO_AMX: none). Without the margin one count's noise among the larger ones
    kept Q4_K off the tiles at 8-11 rows on the AMX Xeon, where they were 4-5% faster on the
    1.5B's projections."""
    rows = NO_AMX
    for r in reversed(AMX_ROWS):
        if seconds[r, True] > AMX_NOISE * seconds[r, False]:
            break
        rows = r
    return rows


def _time_amx_rows(lib) -> tuple[int, int, int]:
    q4k, q6k = _timing_weights(), _timing_weights("q6_k")
    # (weights, thresholds with the choice off, with it on): the tiles for Q4_K, for Q6_K, then
    # Q4_K's fold on the tiles
    cases = (
        (q4k, (NO_AMX, NO_AMX, NO_AMX), (1, 1, NO_AMX)),
        (q6k, (NO_AMX, NO_AMX, NO_AMX), (1, 1, NO_AMX)),
        (q4k, (1, 1, NO_AMX), (1, 1, 1)),
    )
    chosen = []
    for weights, off, on in cases:
        seconds = {(r, use): float("inf") for r in AMX_ROWS for use in (False, True)}
        for _ in range(3):  # interleaved: memory speed moves within seconds on a VM
            for r, use in seconds:
                lib.sdk_set_amx_rows(*(on if use else off))
                took = _timed("amx", weights, rows=(r,), repeats=1, evict=False)
                seconds[r, use] = min(seconds[r, use], took)
        chosen.append(_from_rows(seconds))
    return chosen[0], chosen[1], chosen[2]


def _time_prefetch(lib, isa: str) -> tuple[int, str]:
    """prefetch_choice's timing: every (distance, hint), interleaved five times, the fastest pass
    of each. The hint is non-temporal unless T0 is PREFETCH_CLEARLY faster: products alone time
    the same with either on a Zen 5 EPYC (56 and 232 MB of Q4_K, 1 and 5 rows), while its whole
    forwards ran 3-4% faster with NTA (the weights' stream leaves L2 to the activations, the cache
    and the rest of the step: benchmarks/NOTES.md, issue 53), so the timing only guards against a
    CPU whose products NTA slows (lines evicted before their loads): a Zen 4 EPYC's Q6_K, hence
    the target-shaped mix of Q4_K and Q6_K it times (_timing_weights("mix"))."""
    weights = _timing_weights("mix")
    lib.sdk_set_prefetch_q6(0)  # Q6_K to L2 while the distance is timed (prefetch_q6k_l1 follows)
    seconds = {(b, h): float("inf") for b in PREFETCH for h in HINTS}
    for _ in range(5):  # interleaved: memory speed moves within seconds on a VM
        for b, h in seconds:
            lib.sdk_set_prefetch(b)
            lib.sdk_set_prefetch_hint(HINTS.index(h))
            seconds[b, h] = min(seconds[b, h], _timed(isa, weights, rows=(1, 5), repeats=1))
    fastest = {h: min(seconds[b, h] for b in PREFETCH) for h in HINTS}
    hint = "t0" if fastest["nta"] > PREFETCH_CLEARLY * fastest["t0"] else "nta"
    best = min(PREFETCH, key=lambda b: seconds[b, hint])
    return (1 if seconds[1, hint] <= PREFETCH_CLEARLY * seconds[best, hint] else best), hint


def _timed(
    isa: str,
    weights: list[PackedWeight],
    rows: tuple[int, ...] = (1, 8),
    repeats: int = 3,
    evict: bool = True,
) -> float:
    """Seconds of `rows` rows through 56 MB of random Q4_K weights on `isa`, the fastest of
    `repeats` passes after a warm one, each pass (evict) after the weights' cache lines are
    dropped (sdk_evict, ~30 ms): read from memory, as in a forward (the AMX Xeon's 480 MiB
    last-level cache held them, and a pass of one row ran at 45 GB/s against the memory's 28).
    The AMX thresholds' 200-odd passes of 2-48 rows, bound by arithmetic, skip it."""
    lib, threads, i = _lib(), torch.get_num_threads(), ISAS.index(isa)
    x = torch.randn(max(rows), weights[0].in_features, generator=torch.Generator().manual_seed(0))
    best = float("inf")
    for rep in range(repeats + 1):
        for w in weights if evict else ():
            lib.sdk_evict(w.tiles.data_ptr(), w.nbytes)
        t0 = time.perf_counter()
        for m in rows:
            for w in weights:
                _call(lib, x[:m], w, i, threads)
        if rep:
            best = min(best, time.perf_counter() - t0)
    return best


def _timing_weights(kind: str = "q4_k") -> list[PackedWeight]:
    """Distinct random weights (each pass reads them from memory), ~56-63 MB: six copies of a
    4096 x 4096 matrix of Q4_K (or Q6_K) blocks; "q4_0": six of 20480 x 896 Q4_0, a draft's
    short tiles (28 records a tile: a lead of 4 records left the first seventh of each tile to demand
    misses on a Zen 4 EPYC, where 4096 inputs timed every distance alike); "mix": a target's
    tiles, 1536 inputs (6 Q4_K records a tile), four Q4_K matrices of 12288 rows and two Q6_K of
    8192 (a third of the bytes: the Q4_K_M files keep the head and half the down projections in
    Q6_K, whose best hint and lead differ from Q4_K's: on a Zen 4 EPYC NTA made Q6_K 15-25% slower
    at one row and 40% at five, Q4_K about equal, and the 1.5B's step 12% slower)."""
    gen = np.random.default_rng(1)

    def q4_k(n, k):
        raw = gen.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
        raw[..., 0:4] = np.array([0.01, 0.01], np.float16).view(np.uint8)  # small finite d, dmin
        return PackedWeight(BlockWeight("q4_k", raw.reshape(n, -1), k))

    if kind == "mix":
        ones = [q4_k(12288, 1536)] * 4 + [PackedWeight(_q6_k_of(np.zeros((8192, 1536), np.float32), gen))] * 2
    elif kind == "q6_k":
        ones = [PackedWeight(_q6_k_of(np.zeros((4096, 4096), np.float32), gen))] * 6
    elif kind == "q4_0":
        ones = [PackedWeight(_q4_0_of(np.zeros((20480, 896), np.float32), gen))] * 6
    else:
        ones = [q4_k(4096, 4096)] * 6
    copies = []
    for one in ones:  # distinct buffers
        w = PackedWeight.__new__(PackedWeight)
        w.__dict__.update(one.__dict__, tiles=one.tiles.clone())
        copies.append(w)
    return copies
