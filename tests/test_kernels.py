"""specdecode's own quantized kernel (src/specdecode/kernels/): every instruction-set path this
machine runs gives the scalar reference's bits, which are the integer products of the quantized
rows; GGUF blocks decode as the gguf library decodes them; a path one off in one lane is caught;
a row's output never depends on the row count; the build falls back with one line; the C code
stays inside its buffers under AddressSanitizer; and a tiny model on the kernel is exact."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import check_distribution, draft_pair_two_tokens, noisy_copy, resample_from_p_after_rejection
from specdecode import SamplingParams, SpeculativeGenerator, kernels, load
from specdecode.errors import SpecDecodeError
from specdecode.kernels import BlockWeight, PackedWeight, quantize_q4_k, quantize_q8_0
from specdecode.models.init import init_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernel could not be built here")

SIMD = [isa for isa in kernels.ISAS if isa != "ref"]
# AMX: one chunk of rows, a pair of chunks, three chunks; 300: a call of 256 rows and one of 44
# (SDK_AMX_ROWS), elsewhere four of 64 and one of 44
ROWS = [*range(1, 17), 20, 40, 64, 300]


def random_q6_k(n: int, k: int, rng: np.random.Generator) -> BlockWeight:
    """Random Q6_K blocks (random 6-bit values and int8 scales, one row of every extreme)."""
    return kernels._q6_k_of(np.zeros((n, k), np.float32), rng)


def weights(rng: np.random.Generator, n: int, k: int) -> list[BlockWeight]:
    """Each format at [n, k], random over decades, with rows at the extremes."""
    w = (rng.standard_normal((n, k)) * np.logspace(-2, 1, n)[:, None]).astype(np.float32)
    w[0] = 1.0
    if n > 1:
        w[1, ::2], w[1, 1::2] = 4.0, -4.0
    return [
        quantize_q4_k(w),
        quantize_q8_0(w),
        random_q6_k(n, k, rng),
        kernels._q5_0_of(w, rng),
        kernels._q4_0_of(w, rng),
        kernels._blocks32_of(w, rng, "q3_0"),
    ]


def tile_modes(isa: str) -> list:
    """The AMX path with its tiles at every row count (its fewer rows otherwise take the AVX-512
    VNNI code, tested as its own path), Q4_K without and with its scales folded into the weights;
    other paths as they are."""
    if isa != "amx":
        return [contextlib.nullcontext()]
    return [kernels.amx_rows_forced(1, kernels.NO_AMX), kernels.amx_rows_forced(1, 1)]


def rows(rng: np.random.Generator, m: int, k: int) -> torch.Tensor:
    x = (rng.standard_normal((m, k)) * np.logspace(-3, 2, m)[:, None]).astype(np.float32)
    x[0] = 1.0  # every code +127 against the largest weights: no int16 pair may saturate
    if m > 1:
        x[1, ::2], x[1, 1::2] = -1.0, 1.0
    return torch.from_numpy(x)


@pytest.mark.parametrize("isa", SIMD)
@pytest.mark.parametrize("shape", [(40, 520), (24, 96), (16, 1024), (3, 300)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_path_gives_the_scalar_references_bits(isa, shape):
    """Forced one at a time, every path this CPU runs equals the reference bit for bit at 1-16,
    20, 40, 64 and 300 rows, on widths that are no whole number of blocks, with 1 and 2 threads."""
    if isa not in kernels.runnable_isas():
        pytest.skip(f"this CPU does not run {isa}")
    rng = np.random.default_rng(0)
    n, k = shape
    x = rows(rng, max(ROWS), k)
    for w in weights(rng, n, k):
        packed = PackedWeight(w)
        want = kernels.linear(x, packed, isa="ref", threads=1)
        for mode in tile_modes(isa):
            with mode:
                for m in ROWS:
                    for threads in (1, 2):
                        got = kernels.linear(x[:m], packed, isa=isa, threads=threads)
                        assert torch.equal(got, want[:m]), (w.kind, m, threads)


@pytest.mark.parametrize("pre", ["rms_norm", "swiglu"])
def test_a_fused_pre_pass_bias_and_residual_give_one_set_of_bits_on_every_path(pre):
    """kernels.linear with the input's RMSNorm or SwiGLU done in C and bias and residual added in
    the epilogue: every path (forced) equals the reference bit for bit, at any row count and
    place, and the result is the plain product of torch's norm or SwiGLU of the rows (the
    pre-pass's float code differs from torch's by rounding only; quantization can move a code
    by one)."""
    rng = np.random.default_rng(5)
    n, k = 40, 520
    width = 2 * k if pre == "swiglu" else k
    x = (
        rows(rng, 64, width)
        if pre == "rms_norm"
        else torch.from_numpy(rng.standard_normal((64, width)).astype(np.float32) * 3)
    )
    x[2, :k] = -200.0  # SwiGLU: exp(-200) underflows and nothing overflows
    wn = torch.from_numpy(rng.standard_normal(k).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    res = torch.from_numpy(rng.standard_normal((64, n)).astype(np.float32))
    eps = k * 1e-6
    kw = dict(pre=pre, pre_weight=wn if pre == "rms_norm" else None, eps=eps)
    for w in weights(rng, n, k):
        packed = PackedWeight(w)
        want = kernels.linear(x, packed, isa="ref", threads=1, bias=bias, residual=res, **kw)
        for isa in kernels.runnable_isas():
            for m in (1, 3, 8, 64):
                got = kernels.linear(
                    x[64 - m :], packed, isa=isa, threads=2, bias=bias, residual=res[64 - m :], **kw
                )
                assert torch.equal(got, want[64 - m :]), (w.kind, isa, m)
        xd = x.double()
        if pre == "rms_norm":
            h = xd * wn.double() / (xd.square().sum(-1, keepdim=True) + eps).sqrt()
        else:
            h = torch.nn.functional.silu(xd[:, :k]) * xd[:, k:]
        plain = (
            kernels.linear(h.float(), packed, isa="ref", threads=1).double() + bias.double() + res.double()
        )
        scale = (
            h.abs().amax(-1, keepdim=True) * torch.from_numpy(w.dequantize()).abs().sum(-1).double()
        ) / 127
        assert ((want.double() - plain).abs() <= 2 * scale + 1e-4).all(), w.kind


def test_a_fused_swiglu_that_drops_the_silu_is_caught():
    """The comparison above is no formality: silu(g) * u replaced by g * u fails it."""
    rng = np.random.default_rng(6)
    k = 256
    x = torch.from_numpy(rng.standard_normal((4, 2 * k)).astype(np.float32) * 3)
    packed = PackedWeight(quantize_q4_k(rng.standard_normal((16, k)).astype(np.float32)))
    got = kernels.linear(x, packed, pre="swiglu")
    wrong = kernels.linear(x[:, :k] * x[:, k:], packed)
    right = kernels.linear(torch.nn.functional.silu(x[:, :k]) * x[:, k:], packed)
    assert (got - right).abs().max() < 0.05 * (got - wrong).abs().max()


def test_rope_attention_rotates_writes_and_attends_as_the_torch_layers_do():
    """kernels.rope_attention: RoPE on q and k as the runtime's torch layer computes it (x * cos
    + roll(x, D / 2) * sin), the rotated key and the value written at each token's slot of the
    float32 chunk-major cache, then kernels.attention over the rotated queries; every path the
    same bits; a slot outside the cache is refused."""
    from specdecode.models.rope import RopeTables

    g = torch.Generator().manual_seed(9)
    B, T, H, Hkv, D, cap = 2, 3, 4, 2, 40, 192
    rope = RopeTables(10000.0, D, torch.float32, torch.device("cpu"))
    rope.grow(cap)
    slots = torch.tensor([[70, 71, 72], [5, 9, 6]], dtype=torch.int32)
    cos, sin = rope.cos[slots.long()].unsqueeze(2), rope.sin[slots.long()].unsqueeze(2)
    qkv = torch.randn(B * T, (H + 2 * Hkv) * D, generator=g) * 2
    keys0 = torch.randn(B, Hkv, cap, D, generator=g)
    values0 = torch.randn(cap // 64, B, Hkv, 64, D, generator=g)
    S = 80
    idx = torch.stack([torch.randperm(S, generator=g) for _ in range(B * T)]).view(B, T, S)
    idx[:, :, 0] = slots  # each token sees its own new key first
    n = torch.randint(1, S + 1, (B, T), generator=g)
    outs = {}
    for isa in kernels.runnable_isas():
        keys, values = keys0.clone(), values0.clone()
        out = kernels.rope_attention(
            qkv, (B, T, H, Hkv, D), cos, sin, keys, values, slots, idx, n, D**-0.5, isa=isa
        )
        outs[isa] = (out, keys, values)
    ref_out, ref_keys, ref_values = outs["ref"]
    for isa, got in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(got, outs["ref"])), isa
    x = qkv.view(B, T, H + 2 * Hkv, D)
    qk = x[:, :, : H + Hkv] * cos + x[:, :, : H + Hkv].roll(D // 2, -1) * sin
    keys, values = keys0.clone(), values0.clone()
    for b in range(B):
        for t in range(T):
            s = int(slots[b, t])
            keys[b, :, s] = qk[b, t, H:]
            values[s // 64, b, :, s % 64] = x[b, t, H + Hkv :]
    assert torch.allclose(ref_keys, keys, atol=1e-6, rtol=1e-6)
    assert torch.equal(ref_values, values)
    want = kernels.attention(qk[:, :, :H].contiguous(), ref_keys, ref_values, idx, n, D**-0.5)
    assert torch.allclose(ref_out, want.view(B * T, H * D), atol=1e-5)
    bad = slots.clone()
    bad[1, 2] = cap
    with pytest.raises(SpecDecodeError, match="refused"):
        kernels.rope_attention(
            qkv, (B, T, H, Hkv, D), cos, sin, keys0.clone(), values0.clone(), bad, idx, n, 1.0
        )


def quantized_rows(x: np.ndarray, kp: int) -> np.ndarray:
    """The rows as the kernel sees them: per 256 inputs, codes rint(x * (127 / max|x|)) in
    float32 (round half to even) times the scale max|x| / 127, exactly, in float64."""
    m, k = x.shape
    xp = np.zeros((m, kp), np.float32)
    xp[:, :k] = x
    out = np.zeros((m, kp))
    for b in range(kp // 256):
        blk = xp[:, b * 256 : (b + 1) * 256]
        amax = np.abs(blk).max(1, keepdims=True)
        inv = np.where(amax > 0, np.float32(127) / np.maximum(amax, np.float32(1e-38)), np.float32(0))
        codes = np.clip(np.rint((blk * inv.astype(np.float32)).astype(np.float32)), -127, 127)
        out[:, b * 256 : (b + 1) * 256] = codes * (amax / np.float32(127)).astype(np.float32)
    return out[:, :k]


def test_the_reference_is_the_product_of_the_files_weights_and_the_quantized_rows():
    """The reference (so every path) computes dequantized weights times quantized rows: its only
    rounding is float32's, over the blocks (relative 1e-5 of the largest output)."""
    rng = np.random.default_rng(1)
    x = rows(rng, 9, 520).numpy()
    for w in weights(rng, 40, 520):
        got = kernels.linear(torch.from_numpy(x), PackedWeight(w), isa="ref").double().numpy()
        want = quantized_rows(x, -(-520 // 256) * 256) @ w.dequantize().astype(np.float64).T
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), w.kind


def test_blocks_decode_as_the_gguf_library_decodes_them():
    gguf = pytest.importorskip("gguf")
    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(2)
    w = rng.standard_normal((24, 512)).astype(np.float32)
    for ours, kind in (
        (quantize_q4_k(w), T.Q4_K),
        (quantize_q8_0(w), T.Q8_0),
        (random_q6_k(24, 512, rng), T.Q6_K),
    ):
        want = gguf.quants.dequantize(ours.raw, kind).reshape(24, 512)
        assert np.array_equal(ours.dequantize(), want), kind
    # rounding to nearest: every weight within half its sub-block's step (and the fp16 scales' rounding)
    from specdecode.kernels.blocks import _q4_k_fields

    d, _, sc, _, _ = _q4_k_fields(quantize_q4_k(w).raw)
    half_step = np.repeat(d[..., None] * sc / 2, 32, -1).reshape(24, 512)
    assert (np.abs(quantize_q4_k(w).dequantize() - w) <= half_step * 1.01 + 1e-6).all()
    q5 = gguf.quants.quantize(w, T.Q5_0)  # a file's Q5_0 rows, kept as they are
    for raw in (q5, kernels._q5_0_of(w, rng).raw):
        want = gguf.quants.dequantize(raw, T.Q5_0).reshape(24, 512)
        assert np.array_equal(BlockWeight("q5_0", raw, 512).dequantize(), want)
    # Q4_0: a file's rows (the gguf library's quantizer) and ours, byte for byte the same rounding
    from specdecode.kernels.blocks import quantize_q4_0

    q4 = gguf.quants.quantize(w, T.Q4_0)
    assert np.array_equal(quantize_q4_0(w).raw, q4)
    for raw in (q4, kernels._q4_0_of(w, rng).raw):
        want = gguf.quants.dequantize(raw, T.Q4_0).reshape(24, 512)
        assert np.array_equal(BlockWeight("q4_0", raw, 512).dequantize(), want)


def test_q3_0_blocks_hold_their_documented_bytes_and_round_to_nearest_in_three_bits():
    """Q3_0, specdecode's own block (no GGUF type to check it against): its bytes decode by the
    layout kernels/blocks.py documents, read here bit by bit, and its rounding puts every weight
    within half a step of its value (the block's largest magnitude exactly), except the values
    of the other sign beyond three steps, which clip to the third."""
    from specdecode.kernels.blocks import quantize_q3_0

    rng = np.random.default_rng(3)
    w = rng.standard_normal((24, 300)).astype(np.float32)  # 300: the last block padded
    w[0, :32] = np.linspace(-1, 1, 32)
    q = quantize_q3_0(w)
    assert q.raw.shape == (24, 10 * 14)
    blocks = q.raw.reshape(24, 10, 14)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    u = np.zeros((24, 10, 32), np.int64)
    for i in range(32):
        third = (blocks[..., 2 + i // 8] >> (i % 8)) & 1
        low = (blocks[..., 6 + i % 8] >> (2 * (i // 8))) & 3
        u[..., i] = low | (third.astype(np.int64) << 2)
    mine = ((u - 4) * d[..., None]).reshape(24, -1)[:, :300]
    assert np.array_equal(q.dequantize(), mine.astype(np.float32))
    wp = np.pad(w, ((0, 0), (0, 20))).reshape(24, 10, 32)
    m = np.take_along_axis(wp, np.abs(wp).argmax(-1)[..., None], -1)[..., 0]
    assert np.allclose(d, (m / -4).astype(np.float16).astype(np.float32))
    err = np.abs(mine - w)
    step = np.repeat(np.abs(d), 32, -1)[:, :300]
    clipped = (u.reshape(24, -1)[:, :300] == 7) & (w / np.repeat(d, 32, -1)[:, :300] > 3.5)
    assert (err[~clipped] <= step[~clipped] * 0.5 * (1 + 1e-3) + 1e-6).all()
    assert (err[clipped] <= step[clipped] * (1 + 1e-3)).all() and clipped.any()


def test_a_q6_k_block_reads_as_one_stream_its_record_holds_its_scales():
    """Each Q6_K block's integers and scales sit in one record of whole cache lines (a thread
    reads one stream; with a tile's scales kept after all its integers the one-row head ran at
    ~75% of a plain read, benchmarks/NOTES.md issue 53, fifth session)."""
    rng = np.random.default_rng(5)
    w = random_q6_k(16, 768, rng)
    base = w.tiles()
    assert base.shape == (1, 3, 3392) and 3392 % 64 == 0
    for offset in (0, 150, 200, 209):  # low nibbles, high bits, a scale, d: block 1 of row 0
        raw = w.raw.copy()
        raw[0, 210 + offset] ^= 0x11
        changed = np.argwhere(BlockWeight("q6_k", raw, 768).tiles() != base)
        assert len(changed) and (changed[:, :2] == [0, 1]).all(), offset


@pytest.mark.parametrize("isa", SIMD)
def test_a_path_one_off_in_one_lane_fails_the_self_check(isa):
    """Negative control: each path adds 1 to lane 3 of one integer sum; the check refuses it."""
    if isa not in kernels.runnable_isas():
        pytest.skip(f"this CPU does not run {isa}")
    assert kernels.selfcheck(isa)
    kernels.set_fault(True)
    try:
        assert not kernels.selfcheck(isa)
    finally:
        kernels.set_fault(False)
    assert kernels.selfcheck(isa)


@pytest.mark.parametrize("isa", SIMD)
def test_the_one_off_fault_reaches_every_format_and_row_regime_of_a_path(isa):
    """Negative control per branch: a path has several code paths by format and row count (on
    AVX2, Q4_K decodes in registers up to 4 rows and through the scratch above, Q6_K up to 2),
    and the fault moves the product in each one, so the bit-for-bit test above would catch a
    slip in any of them."""
    if isa not in kernels.runnable_isas():
        pytest.skip(f"this CPU does not run {isa}")
    rng = np.random.default_rng(7)
    # not rows(): its all-ones row 0 takes Q4_K's integer sum past 2**24, where the float epilogue
    # cannot see a change of one
    x = torch.from_numpy(rng.standard_normal((17, 512)).astype(np.float32))
    for w in weights(rng, 16, 512):
        packed = PackedWeight(w)
        for m in (1, 2, 3, 4, 5, 8, 9, 17):
            want = kernels.linear(x[:m], packed, isa="ref", threads=1)
            for mode in tile_modes(isa):
                with mode:
                    assert torch.equal(kernels.linear(x[:m], packed, isa=isa, threads=1), want), (w.kind, m)
                    kernels.set_fault(True)
                    try:
                        got = kernels.linear(x[:m], packed, isa=isa, threads=1)
                        assert not torch.equal(got, want), (w.kind, m)
                    finally:
                        kernels.set_fault(False)


def test_a_rows_output_is_the_same_whatever_the_row_count_and_its_place():
    rng = np.random.default_rng(3)
    x = rows(rng, 13, 768)
    for w in weights(rng, 70, 768):
        packed = PackedWeight(w)
        alone = torch.cat([kernels.linear(x[i : i + 1], packed) for i in range(13)])
        assert torch.equal(kernels.linear(x, packed), alone)
        order = torch.randperm(13, generator=torch.Generator().manual_seed(0))
        assert torch.equal(kernels.linear(x[order], packed), alone[order])


def test_isa_can_be_forced_and_a_bad_one_is_a_clear_error(monkeypatch):
    kernels.chosen_isa.cache_clear()
    try:
        monkeypatch.setenv("SPECDECODE_ISA", "avx2" if "avx2" in kernels.runnable_isas() else "ref")
        assert kernels.chosen_isa() == os.environ["SPECDECODE_ISA"]
        kernels.chosen_isa.cache_clear()
        monkeypatch.setenv("SPECDECODE_ISA", "sse9")
        with pytest.raises(SpecDecodeError, match="choose one of ref, avx2"):
            kernels.chosen_isa()
    finally:
        kernels.chosen_isa.cache_clear()


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_a_build_leaves_out_the_instruction_sets_the_cpu_lacks_and_keys_on_them(monkeypatch):
    """An AVX2-only CPU compiles neither the AVX-512, AVX-VNNI nor AMX files (their code could
    never run there), an AMX Xeon compiles every one, an OS that does not report the features
    too; the required files always; and the build's cache key differs between the first two."""
    from specdecode.kernels import build

    avx2 = {"avx", "avx2", "fma", "f16c", "bmi2"}
    keep, left = build.units_for_this_cpu(avx2)
    assert sorted(left) == ["sdk_amx.c", "sdk_attn_avx512.c", "sdk_avx512vnni.c", "sdk_avxvnni.c"]
    assert set(build.REQUIRED) <= set(keep) and {"sdk_avx2.c", "sdk_attn_avx2.c"} <= set(keep)
    xeon = avx2 | {"avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"}
    assert build.units_for_this_cpu(xeon) == (build.UNITS, [])
    monkeypatch.setattr(build, "cpu_flags", lambda: None)
    assert build.units_for_this_cpu() == (build.UNITS, [])
    key_all = build.build_key("cc")
    monkeypatch.setattr(build, "cpu_flags", lambda: avx2)
    assert build.build_key("cc") != key_all


def test_without_a_compiler_the_kernel_is_left_out_with_one_line(tmp_path):
    env = {**os.environ, "SPECDECODE_CACHE": str(tmp_path / "cache"), "PATH": str(tmp_path)}
    env.pop("CC", None)
    code = "from specdecode import kernels; print(kernels.available())"
    r = _python(code, env)
    assert r.stdout.strip() == "False"
    assert r.stderr.strip().splitlines() == [
        "specdecode: the quantized kernel is not available (no C compiler found (set CC or install gcc)); "
        "using torch's kernels"
    ]


def test_a_corrupt_build_is_rebuilt_with_one_line(tmp_path):
    from specdecode.kernels import build

    if not kernels.available():
        pytest.skip("the kernel is not built here")
    # this session's sound build, copied into a fresh cache (one compile fewer than building it)
    sound = build.built_library().parent
    shutil.copytree(sound, tmp_path / "cache" / "kernels" / sound.name)
    env = {**os.environ, "SPECDECODE_CACHE": str(tmp_path / "cache")}
    code = "from specdecode import kernels; print(kernels.available(), kernels.selfcheck('ref'))"
    first = _python(code, env)
    assert first.stdout.strip() == "True True" and not first.stderr.strip(), first.stderr
    (lib,) = (tmp_path / "cache" / "kernels").glob("*/libspecdecode_kernel.so")
    lib.write_bytes(b"\x7fELF but not a library")
    again = _python(code, env)
    assert again.stdout.strip() == "True True"
    assert "corrupt; rebuilding it" in again.stderr and len(again.stderr.strip().splitlines()) == 1


def test_the_kernel_stays_inside_its_buffers_under_address_sanitizer(tmp_path):
    """The kernel's sources and a harness (tests/csrc/kernel_asan.c) built with -fsanitize=address:
    odd shapes, every format and path, the fused pre-passes, bias and residual, RoPE + cache
    write + attention, the float products, buffers of their exact size. On a CPU without AVX-VNNI
    (an AVX2-only or a Zen 4 EPYC) that path is built with vpdpbusd emulated in AVX2 and runs too, so its code
    is checked against the reference wherever the suite runs."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    from specdecode.kernels.build import BASE_FLAGS, UNITS, compile_units, units_for_this_cpu

    exe = tmp_path / "asan"
    objs = []
    # the units this CPU can run (the harness runs no other path; AVX-512 under ASan alone took
    # 20 s to compile on an AVX2-only CPU), and the AVX-VNNI one emulated where it cannot
    chosen = units_for_this_cpu()[0]
    emulated = "avx2" in kernels.runnable_isas() and "avxvnni" not in kernels.runnable_isas()
    if emulated:
        emulate = "-DSDK_EMULATE_VNNI256"
        chosen["sdk_avxvnni.c"] = ["-mavx2", "-mfma", "-mf16c", emulate]
        chosen["sdk_core.c"] = [*UNITS["sdk_core.c"], emulate]
    units = [(src, tmp_path / (src + ".o"), flags) for src, flags in chosen.items()]
    asan = [*BASE_FLAGS, "-O1", "-g", "-fsanitize=address"]
    for (src, obj, _), r in zip(units, compile_units(cc, asan, units)):
        if r.returncode == 0:
            objs.append(str(obj))
        elif src in ("sdk_core.c", "sdk_ref.c"):
            pytest.fail(r.stderr)
    harness = Path(__file__).parent / "csrc" / "kernel_asan.c"
    r = subprocess.run(
        [cc, "-g", "-fsanitize=address", "-fopenmp", str(harness), *objs, "-o", str(exe), "-lm"],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0 and "asan" in r.stderr.lower():
        pytest.skip(f"no AddressSanitizer runtime: {r.stderr.splitlines()[0]}")
    assert r.returncode == 0, r.stderr
    rng = np.random.default_rng(4)
    cases, count = tmp_path / "cases.bin", 0
    with open(cases, "wb") as f:
        for n, k in ((1, 32), (17, 300), (33, 520), (5, 256), (16, 1040)):
            for w in weights(rng, n, k):
                packed = PackedWeight(w)
                # pre: none, RMSNorm, SwiGLU; on AMX 17 rows: a pair of chunks, 40: three
                for m, pre in ((1, 0), (3, 1), (7, 2), (17, 1), (40, 0), (65, 0), (65, 2), (300, 1)):
                    count += 1
                    tiles = packed.tiles.numpy()
                    head = [packed.code, n, packed.blocks, k, m, tiles.nbytes, pre]
                    f.write(
                        np.array(head, np.int32).tobytes()
                        + tiles.tobytes()
                        + rows(rng, m, 2 * k if pre == 2 else k).numpy().tobytes()
                    )
    run = subprocess.run(
        [str(exe), str(cases)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith(f"{count} cases")  # every format: q4_k, q8_0, q6_k, q5_0, q4_0, q3_0
    paths = len(kernels.runnable_isas()) + emulated
    runs = int(run.stdout.split(" cases, ")[1].split()[0])
    assert runs == count * (paths - 1) * 2  # each case on each SIMD path (an emulated one too), 1, 2 threads
    rope = int(run.stdout.split(" path runs, ")[1].split()[0])
    assert rope == 3 * paths  # RoPE + attention ran on every path, in each of its three shapes
    floats = int(run.stdout.split(" rope_attention runs, ")[1].split()[0])
    assert floats == 4 * 4 * 2 * 3 * 2 * (paths - 1)  # every float case, SIMD path and thread count


# -- float weights (csrc/sdk_fgemm_body.h) --------------------------------------------------------


def emulated_float_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The float product's definition in numpy float32, independent of the C code: 16 lane sums,
    lane j += x[i] * w[i] (rounded product, then rounded sum) for i = j, j + 16, ... in order,
    zero padding past K, then lane j += lane j + s for s = 8, 4, 2, 1; lane 0 is the result."""
    x, w = x.numpy().astype(np.float32), w.float().numpy().astype(np.float32)
    (m, k), n = x.shape, w.shape[0]
    kp = -(-k // 16) * 16
    xp, wp = np.zeros((m, kp), np.float32), np.zeros((n, kp), np.float32)
    xp[:, :k], wp[:, :k] = x, w
    acc = np.zeros((m, n, 16), np.float32)
    for i in range(0, kp, 16):
        acc = acc + xp[:, None, i : i + 16] * wp[None, :, i : i + 16]
    for s in (8, 4, 2, 1):
        acc = acc + acc[..., np.arange(16) % (2 * s) ^ s if s < 8 else np.r_[8:16, 0:8]]
    return torch.from_numpy(acc[..., 0].copy())


def float_case(rng: np.random.Generator, m: int, n: int, k: int, dtype: torch.dtype):
    """Rows and an [n, k] weight over ten decades, with rows of +-1 and of the largest values."""
    x = (rng.standard_normal((m, k)) * np.logspace(-5, 5, m)[:, None]).astype(np.float32)
    w = (rng.standard_normal((n, k)) * np.logspace(-5, 5, n)[:, None]).astype(np.float32)
    x[0] = 1.0
    w[0, ::2], w[0, 1::2] = 1e5, -1e5
    return torch.from_numpy(x), torch.from_numpy(w).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(9, 576), (40, 300), (3, 7), (17, 16)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_float_path_gives_the_emulated_products_bits(dtype, shape):
    """Every path this CPU runs (each forced) equals the numpy emulation of the defined order bit
    for bit: float32 and bfloat16 weights, widths that are not whole vectors, 1-16 and 64 rows."""
    rng = np.random.default_rng(shape[1])
    x, w = float_case(rng, 64, *shape, dtype)
    want = emulated_float_product(x, w)
    for isa in kernels.runnable_isas():
        for m in (m for m in ROWS if m <= 64):
            assert torch.equal(kernels.float_linear(x[:m], w, isa=isa), want[:m]), (isa, m)


def test_the_emulation_tells_a_fused_multiply_add_from_the_defined_order():
    """Negative control for the emulation test: a product computed with fused multiply-adds or in
    one torch GEMM differs from the defined order's bits, so the test above can fail."""
    x, w = float_case(np.random.default_rng(0), 16, 24, 576, torch.float32)
    want = emulated_float_product(x, w)
    assert not torch.equal(x @ w.T, want)
    fused = torch.from_numpy(
        np.array([[np.float32(sum(np.float64(a) * np.float64(b) for a, b in zip(r, c))) for c in w.numpy()]
                  for r in x.numpy()])  # fmt: skip
    )
    assert not torch.equal(fused, want)


def test_a_float_products_row_is_the_same_whatever_the_row_count_and_its_place():
    x, w = float_case(np.random.default_rng(5), 13, 70, 333, torch.float32)
    for weight in (w, w.bfloat16()):
        alone = torch.cat([kernels.float_linear(x[i : i + 1], weight) for i in range(13)])
        assert torch.equal(kernels.float_linear(x, weight), alone)
        order = torch.randperm(13, generator=torch.Generator().manual_seed(0))
        assert torch.equal(kernels.float_linear(x[order], weight, threads=1), alone[order])


@pytest.mark.parametrize("isa", SIMD)
def test_a_float_path_one_ulp_off_in_one_column_fails_the_self_check(isa):
    """Negative control: with the test fault each SIMD path moves row 0, column 3 of a float
    product by one ulp (and nothing else); the self-check's float cases refuse it."""
    if isa not in kernels.runnable_isas():
        pytest.skip(f"this CPU does not run {isa}")
    x, w = float_case(np.random.default_rng(1), 5, 9, 40, torch.float32)
    want = kernels.float_linear(x, w, isa="ref")
    kernels.set_fault(True)
    try:
        got = kernels.float_linear(x, w, isa=isa)
        assert not kernels._float_products_match(np.random.default_rng(0), isa)
    finally:
        kernels.set_fault(False)
    assert (got != want).nonzero().tolist() == [[0, 3]]
    assert kernels._float_products_match(np.random.default_rng(0), isa)


def test_a_float_pre_pass_bias_and_residual_are_the_torch_layers_within_rounding():
    """RMSNorm / SwiGLU before the float product and bias + residual after it compute what the
    torch layers compute (to float32 rounding)."""
    g = torch.Generator().manual_seed(2)
    x, w, nw = (torch.randn(*shape, generator=g) for shape in ((6, 2 * 48), (20, 48), (48,)))
    bias, res = torch.randn(20, generator=g), torch.randn(6, 20, generator=g)
    h = x[:, :48]
    normed = h * nw / torch.sqrt((h * h).sum(-1, keepdim=True) + 0.5)
    got = kernels.float_linear(h, w, pre="rms_norm", pre_weight=nw, eps=0.5, bias=bias, residual=res)
    assert torch.allclose(got, normed @ w.T + bias + res, atol=1e-4, rtol=1e-4)
    glu = torch.nn.functional.silu(x[:, :48]) * x[:, 48:]
    got = kernels.float_linear(x, w, pre="swiglu")
    assert torch.allclose(got, glu @ w.T, atol=1e-4, rtol=1e-4)


def test_a_float_product_refuses_a_bad_weight_with_one_line():
    with pytest.raises(SpecDecodeError, match="float32 or bfloat16"):
        kernels.float_linear(torch.ones(2, 8), torch.ones(4, 8, dtype=torch.float16))
    with pytest.raises(SpecDecodeError, match="input width 8 does not match"):
        kernels.float_linear(torch.ones(2, 8), torch.ones(4, 9))


# -- a model on the kernel -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kq_pair(tmp_path_factory):
    """(target, draft) on the kernel: 256-wide layers (Q4_K) with a 96-wide MLP input (Q8_0)."""
    root = tmp_path_factory.mktemp("kq")
    t = init_model(
        root / "t", vocab=64, layers=2, dim=256, heads=4, kv_heads=2, intermediate=96, seed=7, init_std=0.2
    )
    d = noisy_copy(t, root / "d", noise=0.1, seed=8)
    return load(t, quant="kq"), load(d, quant="kq")


def test_a_kq_model_holds_q4_k_and_q8_0_blocks_and_runs_near_its_float_self(kq_pair, tmp_path):
    target, _ = kq_pair
    layouts = {lin.layout for _, lin in target.linears()}
    assert layouts == {"kq:q4_k", "kq:q8_0"}  # down_proj's 96 inputs are no whole super-block
    f = load(target.path)
    ids = torch.tensor([[3, 14, 15, 9, 26, 5]])
    lq, lf = (m.forward(ids, m.new_cache(1, 8))[0] for m in (target, f))
    # a quantized copy of the model (random weights lose much in 4 bits: int4's bound, test_quant)
    assert torch.nn.functional.cosine_similarity(lq.flatten(), lf.flatten(), 0) > 0.85


@pytest.fixture(scope="module", params=["kq", "fp32"])
def kernel_pair(request, kq_pair, tmp_path_factory):
    """A pair on the kernel: kq blocks, or float32 weights on its float product (the default
    layout of a float32 model where the kernel is built)."""
    if request.param == "kq":
        return kq_pair
    root = tmp_path_factory.mktemp("kf")
    t = init_model(
        root / "t", vocab=64, layers=2, dim=96, heads=4, kv_heads=2, intermediate=80, seed=7, init_std=0.2
    )
    target, draft = load(t), load(noisy_copy(t, root / "d", noise=0.1, seed=8))
    assert {lin.layout for _, lin in target.linears()} == {"kernel"}
    return target, draft


def test_greedy_speculation_on_the_kernel_equals_its_own_target_only(kernel_pair):
    target, draft = kernel_pair
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4], [11]]
    want = [r.token_ids for r in SpeculativeGenerator(target).generate(prompts, params)]
    for kw in ({"method": "draft", "k": 3}, {"method": "ngram", "k": 2}):
        gen = SpeculativeGenerator(target, draft=draft if kw["method"] == "draft" else None, **kw)
        assert [r.token_ids for r in gen.generate(prompts, params)] == want, kw


def test_all_layers_in_one_c_call_give_the_one_call_a_step_bits(kernel_pair, monkeypatch):
    """kernels.layers makes the fused layers' calls in their order: logits, hidden states and
    every key and value written equal the one-call-a-step path's bit for bit, for a prefill of
    two rows of different lengths, one-token steps, a token tree written past the lengths and an
    early exit; and a table that does not match the model is refused in one line."""
    from specdecode.models.base import ForwardMeta
    from specdecode.models.llama import LlamaModel

    target, _ = kernel_pair
    tree = ForwardMeta(
        positions=torch.tensor([[5, 6, 6], [3, 4, 4]]),
        tree_mask=torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool),
        advance=False,
    )

    def run(in_c: bool):
        monkeypatch.setattr(LlamaModel, "layers_in_c", in_c)
        cache = target.new_cache(2, 96, invariant=True)
        prompt = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
        outs = [target.forward(prompt, cache, ForwardMeta(return_hidden=True))]
        cache.lengths[1] = 3  # row 1 keeps three tokens
        for t in (11, 12):
            outs.append(target.forward(torch.tensor([[t], [t + 1]]), cache))
        outs.append(target.forward(torch.tensor([[13, 14, 15], [16, 17, 18]]), cache, tree))
        outs.append(target.forward(torch.tensor([[19], [20]]), cache, ForwardMeta(num_layers=1)))
        kv = [t.clone() for i in range(len(target.layers)) for t in (cache.layer_k[i], cache.layer_v[i])]
        return [o for pair in outs for o in pair if o is not None], kv

    (one_call, kv_c), (per_step, kv_p) = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(one_call, per_step)) and len(one_call) == len(per_step)
    assert all(torch.equal(a, b) for a, b in zip(kv_c, kv_p))
    x = torch.zeros(1, target.cfg.hidden_size)
    with pytest.raises(SpecDecodeError, match="table must be contiguous int64"):
        kernels.layers(torch.zeros(2, 3, dtype=torch.int64), 1, x, 1e-6, (x.shape[1], 8), (1, 1, 4, 2, 64),
                       x, x, [], x, x, x, 1.0)  # fmt: skip


@pytest.mark.parametrize("path", ["layers-in-c", "fused-layers", "torch-layers", "torch-rope"])
def test_kernel_attention_gives_target_only_tokens_for_trees_batches_and_admitted_rows(
    kernel_pair, path, monkeypatch
):
    """A model on the kernel attends in it: greedy speculation with a draft tree, a batch of rows
    of different lengths and a row admitted mid-run all give target-only's tokens alone, as the
    batch-invariant forward promises; kq and float32 weights, on each way a layer reaches the
    attention: all the layers of a forward in one C call (kernels.layers), the fused layers one
    C call a step (norms, RoPE,
    cache write, attention, SwiGLU and residuals in C), the layers in torch around the C RoPE +
    cache write + attention (a bf16 model's), and RoPE in torch before KernelAttention (a model
    with Qwen3's q/k norms: here norms of weight 1)."""
    import specdecode.kernels as kernels
    import specdecode.models.kernel_linear as kernel_linear
    from specdecode.models.invariant import KernelAttention
    from specdecode.models.llama import LlamaModel

    target, draft = kernel_pair
    assert target.kernel_attention and target.fused_layers and LlamaModel.layers_in_c
    if path == "fused-layers":
        monkeypatch.setattr(LlamaModel, "layers_in_c", False)
    elif path != "layers-in-c":
        monkeypatch.setattr(LlamaModel, "fused_layers", property(lambda self: False))
    if path == "torch-rope":
        for layer in (*target.layers, *draft.layers):
            monkeypatch.setattr(layer, "qk_norm_s", torch.ones(target.cfg.head_dim))
    seen = []
    kernels.chosen_isa()  # the path's self-check (it calls rope_attention) before the spies

    def spy(owner, name, label):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, **k: seen.append(label) or real(*a, **k))

    spy(KernelAttention, "__call__", "attention")
    spy(kernels, "rope_attention", "rope_attention")
    spy(kernel_linear, "fused_product", "fused")
    spy(kernels, "layers", "layers")
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4], [11], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 2]]
    base = SpeculativeGenerator(target, batch_invariant=True)
    want = [base.generate([p], params)[0].token_ids for p in prompts]
    for kw in ({"k": 3}, {"tree": "3,2,1"}):
        gen = SpeculativeGenerator(target, draft=draft, method="draft", batch_invariant=True, **kw)
        assert [r.token_ids for r in gen.generate(prompts, params)] == want, kw
        run = gen.stream(prompts[:2], params)
        for _ in range(3):
            next(run)
        run.add(prompts[3], params)
        assert [r.token_ids for r in run.results()] == [want[0], want[1], want[3]], kw
    want_seen = {
        "layers-in-c": {"layers"},
        "fused-layers": {"fused", "rope_attention"},
        "torch-layers": {"rope_attention"},
        "torch-rope": {"attention"},
    }
    assert set(seen) == want_seen[path]  # the path under test ran, and only it


def test_a_draft_models_tree_runs_in_its_invariant_cache_on_the_kernel_and_its_first_path_is_its_chain(
    kernel_pair, monkeypatch
):
    """A draft model on the kernel drafts a token tree in its batch-invariant cache: each level,
    written past the cache's length, is one forward on the kernel path (kernels.layers, as a chain
    step), never the plain cache's torch attention; and a node sees its ancestors as a chain
    would, so the tree's first-ranked path is the draft's greedy chain token for token, in a
    ragged batch. (It had drafted trees in the plain cache, per projection, 1.24x slower on the
    real pair; a tree's attention order built for nodes at the length had been wrong past it.)"""
    import specdecode.kernels as kernels
    from specdecode.drafters.draft_model import DraftModelDrafter

    target, draft = kernel_pair
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4]]
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    first: dict[str, object] = {}
    layer_calls = []
    real_layers = kernels.layers
    monkeypatch.setattr(kernels, "layers", lambda *a, **k: layer_calls.append(a[0]) or real_layers(*a, **k))
    for name in ("propose", "propose_tree"):
        real = getattr(DraftModelDrafter, name)

        def spy(self, state, *a, _real=real, _name=name, **k):
            before = len(layer_calls)
            out = _real(self, state, *a, **k)
            calls = len(layer_calls) - before  # the draft's forwards on the kernel path
            first.setdefault(_name, (out, bool(getattr(state.cache, "invariant", False)), calls))
            return out

        monkeypatch.setattr(DraftModelDrafter, name, spy)
    for kw in ({"k": 3, "policy": "fixed"}, {"tree": "2,1,1", "policy": "fixed"}):
        gen = SpeculativeGenerator(target, draft=draft, method="draft", batch_invariant=True, **kw)
        gen.generate(prompts, params)
    chain, chain_invariant, _ = first["propose"]
    nodes, tree_invariant, tree_calls = first["propose_tree"]
    assert chain_invariant and tree_invariant
    assert tree_calls >= 2  # the levels at depths 1 and 2, each one C call
    assert torch.equal(nodes[:, [0, 2, 4]], chain.tokens)  # nodes (0), (0, 0), (0, 0, 0)


@pytest.mark.parametrize(
    "H, Hkv, D",
    [(6, 2, 40), (12, 2, 128), (18, 2, 64), (4, 1, 64)],
    ids=["tail-past-16-lanes", "six-heads-a-group", "six-then-three", "three-then-one"],
)
def test_the_kernel_attention_of_a_query_is_the_same_alone_and_among_others(H, Hkv, D):
    """kernels.attention: a query's output does not depend on the other queries of the call or
    the thread count, and equals softmax(q k^T / sqrt(D)) v over its slots; every build gives the
    reference's bits, whether it scores keys one at a time or 8 at once and sums values for one
    query head at a time or for 6 or 3 (the AVX-512 build, D a multiple of 64)."""
    g = torch.Generator().manual_seed(3)
    B, T, S = 2, 5, 130
    q = torch.randn(B, T, H, D, generator=g)
    keys = torch.randn(B, Hkv, 192, D, generator=g)
    values = torch.randn(3, B, Hkv, 64, D, generator=g)
    idx = torch.stack([torch.randperm(S, generator=g) for _ in range(B * T)]).view(B, T, S)
    n = torch.randint(1, S + 1, (B, T), generator=g)
    n[0, 0] = 0  # a query that sees nothing: zeros
    out = kernels.attention(q, keys, values, idx, n, D**-0.5, threads=2, isa="ref")
    for isa in kernels.runnable_isas():  # every build of the attention: the same bits
        assert torch.equal(kernels.attention(q, keys, values, idx, n, D**-0.5, isa=isa), out), isa
    for b in range(B):
        for t in range(T):
            one = kernels.attention(
                q[b : b + 1, t : t + 1],
                keys[b : b + 1],
                values[:, b : b + 1],
                idx[b : b + 1, t : t + 1],
                n[b : b + 1, t : t + 1],
                D**-0.5,
                threads=1,
            )
            assert torch.equal(one[0, 0], out[b, t])
            m = int(n[b, t])
            if m == 0:
                assert not out[b, t].any()
                continue
            sl = idx[b, t, :m]
            v = values[:, b].permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, sl]  # [Hkv, m, D]
            k = keys[b][:, sl]
            qq = q[b, t].view(Hkv, H // Hkv, D)
            ref = torch.softmax(qq.double() @ k.double().transpose(1, 2) / D**0.5, -1) @ v.double()
            assert torch.allclose(out[b, t].view(Hkv, H // Hkv, D).double(), ref, atol=1e-5)


def test_a_prefill_writes_the_keys_and_values_one_token_steps_write(kernel_pair):
    target, _ = kernel_pair
    seq = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    whole, steps = target.new_cache(1, 48, invariant=True), target.new_cache(1, 48, invariant=True)
    logits = target.forward(seq, whole)[0][0]
    one = torch.stack([target.forward(seq[:, i : i + 1], steps)[0][0, 0] for i in range(40)])
    assert torch.equal(logits, one)
    assert torch.equal(whole.k[..., :40, :], steps.k[..., :40, :])
    assert torch.equal(whole.v, steps.v)


@pytest.fixture(scope="module")
def kq_v16(tmp_path_factory):
    root = tmp_path_factory.mktemp("kqv16")
    # test_qwen's vocab-16 pair at 8x the width (init std / sqrt(8): logits as spread)
    t = init_model(root / "t", vocab=16, layers=2, dim=256, heads=2, intermediate=64, seed=5, init_std=0.18)
    return load(t, quant="kq"), load(noisy_copy(t, root / "d", noise=0.15, seed=6), quant="kq")


@pytest.mark.heavy
def test_two_token_joint_through_a_kernel_target_and_draft_equals_the_target(kq_v16):
    pairs, joint, rate = draft_pair_two_tokens(*kq_v16, [5, 7, 2], 20_000)
    ok, msg = check_distribution(pairs, joint)
    assert ok, msg
    assert 0.2 < rate < 0.95, rate


@pytest.mark.heavy
def test_two_token_check_through_the_kernel_catches_resampling_from_p(kq_v16, monkeypatch):
    resample_from_p_after_rejection(monkeypatch)
    pairs, joint, _ = draft_pair_two_tokens(*kq_v16, [5, 7, 2], 20_000)
    ok, msg = check_distribution(pairs, joint)
    assert not ok, msg


# kq3 on a 256-wide model with a 64- or 96-wide MLP: gate|up in Q3_0, the rest as kq4 (Q4_K where
# the input width is 256, Q4_0 for down's)
KQ3_LAYOUTS = {
    ("qkv", "kq:q4_k"),
    ("o", "kq:q4_k"),
    ("gate_up", "kq:q3_0"),
    ("down", "kq:q4_0"),
    ("head", "kq:q4_k"),
}


def test_greedy_speculation_with_a_kq3_draft_gives_the_targets_tokens(kq_pair):
    target, draft = kq_pair
    d3 = load(draft.path, quant="kq3")
    assert {(n.split(".")[-1], lin.layout) for n, lin in d3.linears()} == KQ3_LAYOUTS
    assert d3.fused_layers and d3.kernel_attention
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4], [11]]
    want = [r.token_ids for r in SpeculativeGenerator(target).generate(prompts, params)]
    got = SpeculativeGenerator(target, draft=d3, method="draft", k=3).generate(prompts, params)
    assert [r.token_ids for r in got] == want


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A random Qwen2 GGUF with the real pair's tensor types (Q4_K, Q6_K, Q5_0, Q8_0)."""
    from helpers import write_tiny_qwen_gguf

    return write_tiny_qwen_gguf(tmp_path_factory.mktemp("kq-gguf"))[1]


def test_a_gguf_path_runs_on_its_own_blocks_and_speculation_keeps_its_tokens(
    tiny_gguf, tmp_path, monkeypatch
):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    target = load(str(tiny_gguf), quant="kq")
    kinds = {lin.layout for _, lin in target.linears()}
    assert kinds == {"kq:q4_k", "kq:q6_k", "kq:q4_k+kq:q6_k", "kq:q8_0"}  # the head: Q8_0 as stored
    from specdecode.models.gguf_quant import GGUFQWeights

    blocks = GGUFQWeights(tiny_gguf, "kq")
    name = next(n for n in blocks if blocks.type_of(n) == "Q6_K" and "down_proj" in n)
    assert np.array_equal(
        blocks[name].raw, np.asarray(blocks.tensors[name].data).reshape(blocks[name].raw.shape)
    )
    # a projection of one matrix keeps the file's blocks as a view of its memory map, not a copy
    # (copies of the head and the down projections were ~0.5 GB of the 1.5B's resident set)
    kept = [getattr(lin, "block_weight", None) for _, lin in target.linears()]
    kept = [b.raw for b in kept if b is not None]
    assert kept and not any(r.flags.owndata for r in kept)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    prompts = [[5, 70, 3], [200, 9, 41, 17]]
    want = [r.token_ids for r in SpeculativeGenerator(target).generate(prompts, params)]
    got = SpeculativeGenerator(target, method="ngram", k=3).generate(prompts, params)
    assert [r.token_ids for r in got] == want
    assert (tmp_path / "cache" / "gguf-files").is_dir()  # converted once, under the file's hash


def test_a_kq4_draft_keeps_the_files_q4_k_rounds_the_rest_to_q4_0_and_the_targets_tokens(
    tiny_gguf, tmp_path, monkeypatch
):
    """kq4, a draft's format: the file's Q4_K blocks as stored, its other matrices (Q6_K and the
    head's Q8_0 here, the 0.5B's Q5_0) rounded to Q4_0 as ggml rounds them (4.5 bits a weight);
    greedy speculation with it as the draft gives the kq target's own tokens."""
    from specdecode.kernels.blocks import quantize_q4_0
    from specdecode.models.gguf_quant import GGUFQWeights

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    target, draft = load(str(tiny_gguf), quant="kq"), load(str(tiny_gguf), quant="kq4")
    assert {lin.layout for _, lin in draft.linears()} == {"kq:q4_k", "kq:q4_k+kq:q4_0", "kq:q4_0"}
    kq, kq4 = GGUFQWeights(tiny_gguf, "kq"), GGUFQWeights(tiny_gguf, "kq4")
    rounded = set()
    for name in kq:
        if kq.type_of(name) == "Q4_K":
            assert np.array_equal(kq4[name].raw, kq[name].raw), name
        elif isinstance(kq[name], BlockWeight):
            assert np.array_equal(kq4[name].raw, quantize_q4_0(kq[name].dequantize()).raw), name
            rounded.add(kq.type_of(name))
    assert {"Q6_K", "Q8_0"} <= rounded
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    prompts = [[5, 70, 3], [200, 9, 41, 17]]
    want = [r.token_ids for r in SpeculativeGenerator(target).generate(prompts, params)]
    got = SpeculativeGenerator(target, draft=draft, method="draft", k=3).generate(prompts, params)
    assert [r.token_ids for r in got] == want


def test_a_kq3_draft_rounds_a_files_gate_and_up_to_q3_0_keeps_the_rest_as_kq4_and_the_targets_tokens(
    tiny_gguf, tmp_path, monkeypatch
):
    from specdecode.kernels.blocks import quantize_q3_0
    from specdecode.models.gguf_quant import GGUFQWeights

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    kq, kq4, kq3 = (GGUFQWeights(tiny_gguf, f) for f in ("kq", "kq4", "kq3"))
    mlp = 0
    for name in kq:
        if not isinstance(kq[name], BlockWeight):
            continue
        if name.split(".")[-2] in ("gate_proj", "up_proj"):
            assert np.array_equal(kq3[name].raw, quantize_q3_0(kq[name].dequantize()).raw), name
            mlp += 1
        else:
            assert kq3[name].kind == kq4[name].kind and np.array_equal(kq3[name].raw, kq4[name].raw), name
    assert mlp >= 2
    target, draft = load(str(tiny_gguf), quant="kq"), load(str(tiny_gguf), quant="kq3")
    assert {lin.layout for n, lin in draft.linears() if n.endswith("gate_up")} == {"kq:q3_0"}
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    prompts = [[5, 70, 3], [200, 9, 41, 17]]
    want = [r.token_ids for r in SpeculativeGenerator(target).generate(prompts, params)]
    got = SpeculativeGenerator(target, draft=draft, method="draft", k=3).generate(prompts, params)
    assert [r.token_ids for r in got] == want


def test_generate_takes_a_gguf_path_and_measures_its_format_by_default(
    tiny_gguf, tmp_path, monkeypatch, capsys
):
    from specdecode.cli import main
    from specdecode.opener import default_dtype

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    assert default_dtype(str(tiny_gguf)) == "auto"
    args = ["generate", "--target", str(tiny_gguf), "--prompt", "he", "--max-tokens", "4", "--ignore-eos"]
    assert main([*args, "--dtype", "kq", "--json"]) == 0
    assert len(__import__("json").loads(capsys.readouterr().out)["token_ids"]) == 4
    assert main(["generate", "--target", str(tmp_path / "missing.gguf"), "--prompt", "x"]) == 2
    assert "no such GGUF file" in capsys.readouterr().err


def test_amx_stands_in_for_avx512_vnni_whose_code_it_runs_below_its_row_counts(monkeypatch, tmp_path):
    """A timing at 1 and 8 rows cannot see what the tiles win at 16-64 rows (AMX runs the VNNI code
    below its own timed row counts): amx is never timed against avx512vnni, it takes its place;
    a clearly faster narrower path still wins over both."""
    monkeypatch.delenv("SPECDECODE_ISA", raising=False)
    monkeypatch.setattr(kernels, "runnable_isas", lambda: ["ref", "avx2", "avx512vnni", "amx"])
    monkeypatch.setattr(kernels, "selfcheck", lambda isa: True)
    monkeypatch.setattr(kernels, "_timing_weights", lambda kind="q4_k": [])
    for seconds, want in (
        ({"avx2": 1.0, "avx512vnni": 1.1}, "amx"),
        ({"avx2": 1.0, "avx512vnni": 1.3}, "avx2"),
    ):
        build = tmp_path / want
        build.mkdir()
        monkeypatch.setattr(kernels, "built_library", lambda b=build: b / "lib.so")
        monkeypatch.setattr(kernels, "_timed", lambda isa, weights, s=seconds: s[isa])  # KeyError for amx
        kernels.chosen_isa.cache_clear()
        try:
            assert kernels.chosen_isa() == want, seconds
        finally:
            kernels.chosen_isa.cache_clear()


def test_the_widest_checked_path_runs_unless_a_narrower_one_is_clearly_faster(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDECODE_ISA", raising=False)
    monkeypatch.setattr(kernels, "runnable_isas", lambda: ["ref", "avx2", "avx512vnni"])
    monkeypatch.setattr(kernels, "selfcheck", lambda isa: True)
    monkeypatch.setattr(kernels, "_timing_weights", lambda kind="q4_k": [])
    for seconds, want in (
        ({"avx2": 1.0, "avx512vnni": 1.1}, "avx512vnni"),
        ({"avx2": 1.0, "avx512vnni": 1.3}, "avx2"),
    ):
        build = tmp_path / want  # a build of its own: no choice recorded yet
        build.mkdir()
        monkeypatch.setattr(kernels, "built_library", lambda b=build: b / "lib.so")
        monkeypatch.setattr(kernels, "_timed", lambda isa, weights, s=seconds: s[isa])
        kernels.chosen_isa.cache_clear()
        try:
            assert kernels.chosen_isa() == want, seconds
            # a later process reads the recorded choice and times nothing
            monkeypatch.setattr(kernels, "_timed", lambda isa, weights: pytest.fail("timed again"))
            kernels.chosen_isa.cache_clear()
            assert kernels.chosen_isa() == want
        finally:
            kernels.chosen_isa.cache_clear()
    # a record naming a path that is not among the passing ones is measured again
    record = tmp_path / "avx2" / "choice.json"
    record.write_text(record.read_text().replace('"avx2"', '"sse9"'))
    monkeypatch.setattr(kernels, "_timed", lambda isa, weights: {"avx2": 1.0, "avx512vnni": 1.3}[isa])
    assert kernels.chosen_isa() == "avx2"
    kernels.chosen_isa.cache_clear()
    monkeypatch.setattr(kernels, "selfcheck", lambda isa: isa == "ref")  # nothing else is exact here
    assert kernels.chosen_isa() == "ref"
    kernels.chosen_isa.cache_clear()


@pytest.mark.parametrize("isa", SIMD)
def test_a_products_bits_do_not_depend_on_how_far_ahead_it_prefetches(isa):
    if not kernels.selfcheck(isa):
        pytest.skip(f"{isa} does not run here")
    rng = np.random.default_rng(11)
    x = rows(rng, 8, 1280)  # 5 records a row of weights: a distance of up to 8 runs past a tile
    lib = kernels._lib()
    try:
        for w in weights(rng, 40, 1280):
            packed = PackedWeight(w)
            lib.sdk_set_prefetch(1)
            lib.sdk_set_prefetch_hint(0)
            want = [kernels.linear(x[:m], packed, isa=isa) for m in range(1, 9)]
            settings = ((2, 0, 8, 1), (3, 1, 64, 0), (4, 0, 1, 1), (8, 1, 128, 0), (1, 1, 32, 1))
            for (blocks, hint, small, q6), one in zip(settings, (2, 8, 1, 4, 3)):
                lib.sdk_set_prefetch_one(one)
                lib.sdk_set_prefetch(blocks)
                lib.sdk_set_prefetch_hint(hint)
                lib.sdk_set_prefetch_small(small)  # past the end of the blocks of 32's tiles
                lib.sdk_set_prefetch_q6(q6)
                for m in range(1, 9):
                    got = kernels.linear(x[:m], packed, isa=isa)
                    assert torch.equal(got, want[m - 1]), (w.kind, blocks, hint, small, q6, one, m)
    finally:
        blocks, hint = kernels.prefetch_choice()
        lib.sdk_set_prefetch(blocks)
        lib.sdk_set_prefetch_hint(kernels.HINTS.index(hint))
        lib.sdk_set_prefetch_small(kernels.prefetch_small())
        lib.sdk_set_prefetch_q6(int(kernels.prefetch_q6k_l1()))
        lib.sdk_set_prefetch_one(kernels.prefetch_one())


@pytest.mark.parametrize("isa", SIMD)
def test_a_products_bits_do_not_depend_on_which_thread_takes_a_tile(isa):
    """Threads done with their share of the tiles take the others' last ones (csrc/sdk_core.c):
    the same bits as each thread kept to its share, and as one thread, at 1-3 threads."""
    if isa not in kernels.runnable_isas():
        pytest.skip(f"this CPU does not run {isa}")
    rng = np.random.default_rng(12)
    x = rows(rng, 6, 1280)
    lib = kernels._lib()
    try:
        for w in weights(rng, 88, 1280):  # 6 tiles: shares of 2 and 4 or 3 and 3
            packed = PackedWeight(w)
            lib.sdk_set_steal(0)
            want = [kernels.linear(x[:m], packed, isa=isa, threads=1) for m in (1, 2, 6)]
            for steal, threads in ((0, 2), (1, 2), (1, 3), (0, 3), (1, 1)):
                lib.sdk_set_steal(steal)
                for _ in range(3):  # which tiles a thread steals changes from run to run
                    for i, m in enumerate((1, 2, 6)):
                        got = kernels.linear(x[:m], packed, isa=isa, threads=threads)
                        assert torch.equal(got, want[i]), (w.kind, steal, threads, m)
    finally:
        lib.sdk_set_steal(1)


# each timed prefetch setting: (setter, environment, timed weights, cases, forced, bad values, error)
KNOBS = {
    "prefetch_small": (  # the blocks of 32's lead, over a draft's short tiles
        "sdk_set_prefetch_small",
        "SPECDECODE_PREFETCH_SMALL",
        "q4_0",
        (
            ({4: 1.0, 8: 0.97, 16: 0.98, 32: 0.99, 64: 1.0}, 4),  # within PREFETCH_CLEARLY
            ({4: 1.0, 8: 0.9, 16: 0.85, 32: 0.8, 64: 0.82}, 32),
            ({4: 0.8, 8: 0.9, 16: 0.85, 32: 0.81, 64: 0.82}, 4),
        ),
        ("16", 16),
        ("0", "129", "far"),
        "from 1 to 128",
    ),
    "prefetch_one": (  # a one-row product's lead, over the target-shaped mix
        "sdk_set_prefetch_one",
        "SPECDECODE_PREFETCH_ONE",
        "mix",
        (
            ({1: 1.0, 2: 0.99, 3: 0.995, 4: 1.0}, 1),  # within ONE_CLEARLY
            ({1: 1.0, 2: 0.92, 3: 0.95, 4: 0.97}, 2),
            ({1: 0.9, 2: 1.0, 3: 0.95, 4: 0.97}, 1),
        ),
        ("3", 3),
        ("0", "9"),
        "from 1 to 8",
    ),
    "prefetch_q6k_l1": (  # Q6_K's lines to L1 rather than L2 at one or two rows
        "sdk_set_prefetch_q6",
        "SPECDECODE_PREFETCH_Q6",
        "q6_k",
        (({0: 1.0, 1: 0.97}, False), ({0: 1.0, 1: 0.9}, True), ({0: 0.8, 1: 1.0}, False)),
        ("l1", True),
        ("l3", "1"),
        "l1 or l2",
    ),
}


@pytest.mark.parametrize("knob", KNOBS)
def test_each_timed_prefetch_setting_keeps_its_default_unless_another_is_clearly_faster(
    knob, monkeypatch, tmp_path
):
    """prefetch_small, prefetch_one and prefetch_q6k_l1: timed on their own weights after the
    distance and hint, recorded per build and CPU (a later process times nothing), set in the
    library either way; the environment forces each and a bad value is one clear error."""
    setter, env, kind, cases, (forced, forced_value), bad, error = KNOBS[knob]
    choose = getattr(kernels, knob)

    class Lib:
        value = 0

        def __getattr__(self, name):
            assert name == setter, name
            return lambda v: setattr(self, "value", v)

    lib = Lib()
    monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(kernels, "_lib", lambda: lib)
    monkeypatch.setattr(kernels, "chosen_isa", lambda: "avx512vnni")
    monkeypatch.setattr(kernels, "prefetch_choice", lambda: (1, "t0"))
    if knob != "prefetch_q6k_l1":
        monkeypatch.setattr(kernels, "prefetch_q6k_l1", lambda: False)
    kinds = []
    monkeypatch.setattr(kernels, "_timing_weights", lambda kind="q4_k": kinds.append(kind) or [])
    for seconds, want in cases:
        build = tmp_path / str(len(list(tmp_path.iterdir())))
        build.mkdir()
        monkeypatch.setattr(kernels, "built_library", lambda b=build: b / "lib.so")
        monkeypatch.setattr(kernels, "_timed", lambda *a, s=seconds, **k: s[lib.value])
        choose.cache_clear()
        try:
            got = choose()
            assert got == want and type(got) is type(want) and lib.value == want, seconds
            lib.value = 0  # a later process reads the recorded choice and times nothing
            monkeypatch.setattr(kernels, "_timed", lambda *a, **k: pytest.fail("timed again"))
            choose.cache_clear()
            assert choose() == want and lib.value == want
        finally:
            choose.cache_clear()
    assert set(kinds) == {kind}
    try:
        monkeypatch.setenv(env, forced)
        assert choose() == forced_value and lib.value == forced_value
        choose.cache_clear()
        for value in bad:
            monkeypatch.setenv(env, value)
            with pytest.raises(SpecDecodeError, match=error):
                choose()
            choose.cache_clear()
    finally:
        choose.cache_clear()


def test_the_prefetch_hint_is_the_faster_and_the_distance_one_record_unless_another_is_clearly_faster(
    monkeypatch, tmp_path
):
    class Lib:
        blocks, hint = 1, 0

        def sdk_set_prefetch(self, blocks):
            self.blocks = blocks

        def sdk_set_prefetch_hint(self, nta):
            self.hint = nta

        def sdk_set_prefetch_q6(self, l1):
            pass

    lib = Lib()
    monkeypatch.delenv("SPECDECODE_PREFETCH", raising=False)
    monkeypatch.delenv("SPECDECODE_PREFETCH_HINT", raising=False)
    monkeypatch.setattr(kernels, "_lib", lambda: lib)
    monkeypatch.setattr(kernels, "chosen_isa", lambda: "avx512vnni")
    monkeypatch.setattr(kernels, "_timing_weights", lambda kind="q4_k": [])
    t0 = {1: 1.0, 2: 0.99, 3: 0.98, 4: 0.97}  # longer distances within PREFETCH_CLEARLY
    for seconds, want in (  # NTA unless T0 is clearly faster (products alone cannot see its gain)
        ({**{(b, 0): s for b, s in t0.items()}, **{(b, 1): s + 0.1 for b, s in t0.items()}}, (1, "t0")),
        ({**{(b, 0): s for b, s in t0.items()}, **{(b, 1): s + 0.03 for b, s in t0.items()}}, (1, "nta")),
        ({**{(b, 0): s for b, s in t0.items()}, **{(b, 1): s - 0.1 for b, s in t0.items()}}, (1, "nta")),
        ({(1, 0): 1.0, (2, 0): 0.9, (3, 0): 0.7, (4, 0): 0.75, **{(b, 1): 1.2 for b in t0}}, (3, "t0")),
        ({**{(b, 0): 1.0 for b in t0}, (1, 1): 1.0, (2, 1): 0.9, (3, 1): 0.92, (4, 1): 1.0}, (2, "nta")),
    ):
        build = tmp_path / str(len(list(tmp_path.iterdir())))
        build.mkdir()
        monkeypatch.setattr(kernels, "built_library", lambda b=build: b / "lib.so")
        monkeypatch.setattr(kernels, "_timed", lambda *a, s=seconds, **k: s[lib.blocks, lib.hint])
        set_to = (want[0], kernels.HINTS.index(want[1]))
        kernels.prefetch_choice.cache_clear()
        try:
            assert kernels.prefetch_choice() == want and (lib.blocks, lib.hint) == set_to, seconds
            # a later process reads the recorded choice, sets it and times nothing
            lib.blocks, lib.hint = 1, 0
            monkeypatch.setattr(kernels, "_timed", lambda *a, **k: pytest.fail("timed again"))
            kernels.prefetch_choice.cache_clear()
            assert kernels.prefetch_blocks() == want[0] and (lib.blocks, lib.hint) == set_to
        finally:
            kernels.prefetch_choice.cache_clear()
    try:
        monkeypatch.setattr(kernels, "chosen_isa", lambda: "ref")  # the reference prefetches nothing
        assert kernels.prefetch_choice() == (1, "t0")
        kernels.prefetch_choice.cache_clear()
        monkeypatch.setattr(kernels, "chosen_isa", lambda: "avx512vnni")
        monkeypatch.setenv("SPECDECODE_PREFETCH", "2")
        monkeypatch.setenv("SPECDECODE_PREFETCH_HINT", "nta")
        assert kernels.prefetch_choice() == (2, "nta") and (lib.blocks, lib.hint) == (2, 1)
        kernels.prefetch_choice.cache_clear()
        monkeypatch.setenv("SPECDECODE_PREFETCH", "9")
        with pytest.raises(SpecDecodeError, match="from 1 to 8"):
            kernels.prefetch_choice()
        monkeypatch.setenv("SPECDECODE_PREFETCH", "2")
        monkeypatch.setenv("SPECDECODE_PREFETCH_HINT", "l3")
        with pytest.raises(SpecDecodeError, match="t0, nta"):
            kernels.prefetch_choice()
    finally:
        kernels.prefetch_choice.cache_clear()


def test_the_amx_tiles_start_at_the_fewest_rows_from_which_they_are_never_slower(monkeypatch, tmp_path):
    """The AMX path's thresholds (Q4_K and blocks of 32; Q6_K; Q4_K's folded scales): below one a
    product takes the AVX-512 VNNI code or the unfolded tiles (the same bits), from it the tiles
    or the fold; the timing keeps, per choice, the smallest count from which it is no slower at
    every larger count, records them and sets them; SPECDECODE_AMX_ROWS forces them."""
    no = kernels.NO_AMX

    class Lib:
        rows = (8, 16, 24)

        def sdk_set_amx_rows(self, *rows):
            self.rows = rows

    lib = Lib()
    monkeypatch.delenv("SPECDECODE_AMX_ROWS", raising=False)
    monkeypatch.setattr(kernels, "_lib", lambda: lib)
    monkeypatch.setattr(kernels, "chosen_isa", lambda: "amx")
    monkeypatch.setattr(kernels, "_timing_weights", lambda kind="q4_k": kind)  # the timing sees the kind
    base = {r: 1.0 + r / 10 for r in kernels.AMX_ROWS}  # the VNNI code
    q6k_tiles = {r: base[r] + (0.5 if r < 16 else -0.1) for r in kernels.AMX_ROWS}
    for q4k_tiles, want in (
        ({r: 1.3 for r in kernels.AMX_ROWS}, (3, 16, 32)),  # slower at 2 rows only
        ({**{r: 1.0 for r in kernels.AMX_ROWS}, 6: 2.0}, (8, 16, 32)),  # a slower count above the first win
        # never faster: never the tiles (and the fold, 0.2% slower, within the noise: the count
        # of a fold the tiles never reach)
        ({r: 99.0 for r in kernels.AMX_ROWS}, (no, 16, 2)),
        ({**{r: 1.0 for r in kernels.AMX_ROWS}, 6: 1.62}, (2, 16, 32)),  # 1% slower at 6 rows: noise
        ({r: 0.5 for r in kernels.AMX_ROWS}, (2, 16, 32)),
    ):
        build = tmp_path / str(len(list(tmp_path.iterdir())))
        build.mkdir()
        monkeypatch.setattr(kernels, "built_library", lambda b=build: b / "lib.so")
        # the fold against the unfolded tiles: slower below 32 rows, faster from 32
        fold = {r: q4k_tiles[r] + (0.2 if r < 32 else -0.2) for r in kernels.AMX_ROWS}

        def timed(isa, kind, rows, q4k_tiles=q4k_tiles, fold=fold, **k):  # per the thresholds set
            r = rows[0]
            if lib.rows == (no, no, no):
                return base[r]
            if lib.rows == (1, 1, 1):
                return fold[r]
            assert lib.rows == (1, 1, no)
            return (q4k_tiles if kind == "q4_k" else q6k_tiles)[r]

        monkeypatch.setattr(kernels, "_timed", timed)
        kernels.amx_rows.cache_clear()
        try:
            assert kernels.amx_rows() == want and lib.rows == want, q4k_tiles
            lib.rows = (8, 16, 24)  # a later process reads the record, sets it and times nothing
            monkeypatch.setattr(kernels, "_timed", lambda *a, **k: pytest.fail("timed again"))
            kernels.amx_rows.cache_clear()
            assert kernels.amx_rows() == want and lib.rows == want
        finally:
            kernels.amx_rows.cache_clear()
    try:
        monkeypatch.setenv("SPECDECODE_AMX_ROWS", "6")
        assert kernels.amx_rows() == (6, 6, 6) and lib.rows == (6, 6, 6)
        kernels.amx_rows.cache_clear()
        monkeypatch.setenv("SPECDECODE_AMX_ROWS", "6,20,30")
        assert kernels.amx_rows() == (6, 20, 30) and lib.rows == (6, 20, 30)
        kernels.amx_rows.cache_clear()
        monkeypatch.setenv("SPECDECODE_AMX_ROWS", "0")
        with pytest.raises(SpecDecodeError, match="from 1 to 65"):
            kernels.amx_rows()
        kernels.amx_rows.cache_clear()
        monkeypatch.setattr(kernels, "chosen_isa", lambda: "avx512vnni")  # not the AMX path: no threshold
        assert kernels.amx_rows() == (0, 0, 0)
    finally:
        kernels.amx_rows.cache_clear()
