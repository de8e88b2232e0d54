"""Weight-only quantized weights: the kernels against their dequantized reference, the
quantizers' error bounds, quantized models and drafters, a GGUF's own Q4_K blocks kept bit for
bit. (Exactness with a quantized drafter is in test_contract.py's tables.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import write_tiny_qwen_gguf
from specdecode import SamplingParams, SpecConfig, SpeculativeGenerator, load
from specdecode.errors import SpecDecodeError
from specdecode.models import ZOO, LlamaModel, ZooModel
from specdecode.models.quant import QUANT_KINDS, DynamicInt8Linear, QuantLinear, QWeight, quantized_linear

KINDS = tuple(QUANT_KINDS)
WEIGHT_ONLY = tuple(k for k in KINDS if k != "w8a8")


def bf16_close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """Equal up to the kernels' bf16 roundings: the product, the scale multiply and the bias add
    each round to bf16 (2^-9 relative each, of the value or of `scale`, the bias), plus the
    fp32 sums' order."""
    err = (got.double() - want.double()).abs()
    size = want.double().abs() + (0 if scale is None else scale.double().abs())
    bound = size * 2**-7 + 1e-3 * want.double().abs().max()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


# odd outputs (int4 packs tiles of 16), inputs that are not whole groups (zero-padded), 1-5 rows;
# 200, 100 and 232 inputs: widths torch's AVX-512 int8 kernel got wrong or crashed on (not a
# multiple of 16), so this table fails on such a CPU unless the projection pads them
SHAPES = [(48, 64), (37, 96), (16, 200), (160, 256), (24, 100), (40, 232)]


@pytest.mark.parametrize("kind", WEIGHT_ONLY)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantized_linear_computes_its_dequantized_weight_product(kind, shape):
    g = torch.Generator().manual_seed(sum(shape))
    w, b = torch.randn(*shape, generator=g), torch.randn(shape[0], generator=g)
    q = QWeight.from_float(w, kind)
    linear = QuantLinear(q, b)
    for rows in (1, 2, 5, 20):  # 20: a prefill, through an fp32 GEMM over the dequantized weight
        x = torch.randn(rows, shape[1], generator=g)
        xr = x.double() if rows >= 16 else x.to(torch.bfloat16).double()
        want = xr @ q.dequantize().double().t() + b.to(torch.bfloat16).double()
        got = linear(x)
        assert got.dtype == x.dtype and got.shape == (rows, shape[0])
        bf16_close(got, want, b)
        res = torch.randn(rows, shape[0], generator=g)
        bf16_close(linear(x, residual=res.clone()) - res, want, b + res)


def test_int8_kernel_check_passes_here_and_its_fallback_computes_the_same_product(monkeypatch):
    """The int8 kernel is checked once per process at padded widths; on a machine where the check
    fails the projection runs bf16 F.linear over the same integers: both agree with the dequantized
    product (the fallback forced here, so every CPU runs it)."""
    from specdecode.models import quant

    assert quant.int8_kernel_ok(), "torch's int8 kernel failed its check on this CPU (see stderr)"
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 200, generator=g)
    q = QWeight.from_float(w, "int8")
    fast = QuantLinear(q)
    slow = QuantLinear(q)
    slow.trusted = False
    x = torch.randn(5, 200, generator=g)
    want = x.to(torch.bfloat16).double() @ q.dequantize().double().t()
    bf16_close(fast(x), want)
    bf16_close(slow(x), want)
    assert fast.float_weight().shape == (40, 200)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_w8a8_is_the_int8_product_up_to_half_an_activation_step_and_row_invariant(shape):
    """Activations quantized per row to 7 bits (8 with VNNI) over [-max|x|, max|x|]: each output
    is off by at most half a step times the row's scale times sum |w|; a row's result is the
    same alone and among 96 rows (bit for bit)."""
    g = torch.Generator().manual_seed(sum(shape) + 7)
    w, b = torch.randn(*shape, generator=g), torch.randn(shape[0], generator=g)
    linear = quantized_linear([w], b, "w8a8")
    assert isinstance(linear, DynamicInt8Linear)
    deq = QWeight.from_float(w, "int8").dequantize().double()
    x = torch.randn(96, shape[1], generator=g) * torch.logspace(-3, 2, 96).view(-1, 1)
    got = linear(x)
    want = x.double() @ deq.t() + b.double()
    r = x.double().abs().amax(1, keepdim=True)
    bound = r * (1 / 127) * deq.abs().sum(1) + 1e-5 * want.abs()
    assert bool(((got.double() - want).abs() <= bound).all())
    assert torch.equal(torch.cat([linear(x[i : i + 1]) for i in range(96)]), got)
    assert torch.equal(torch.cat([linear(x[i : i + 5]) for i in range(0, 96, 5)]), got)


@pytest.mark.parametrize("reduce_range", [False, True], ids=["8-bit", "7-bit"])
def test_w8a8_through_onednn_gives_fbgemms_bits_for_any_rows_and_each_row_alone(reduce_range):
    """From the row count a probe measured faster (a verification, a prefill; on some CPUs one
    row), the w8a8 product runs through oneDNN's int8 linear instead of FBGEMM: the same
    activation codes and exact integer sums, so the same bits at every row count, which keeps a
    verification's logits a one-token step's and a prompt's keys and values those its tokens get
    one at a time (prefix cache, greedy identity). Checked on this CPU, not assumed: where the
    probe refuses oneDNN's int8 linear (it does not run, or its bits differ), nothing holds it."""
    from specdecode.models import quant

    g = torch.Generator().manual_seed(11)
    w, b = torch.randn(96, 160, generator=g), torch.randn(96, generator=g)
    w[:8] = w[:8].sign()  # weights at +-127: pairs of byte products past int16
    if not quant.onednn_exact(reduce_range):  # refused here: no projection holds oneDNN's copy
        linear = DynamicInt8Linear(QWeight.from_float(w, "int8"), b, onednn=None)
        linear.reduce_range = reduce_range
        assert quant.choose_int8_kernels([linear]) == {(96, 160): None} and linear.onednn is None
        return
    linear = DynamicInt8Linear(QWeight.from_float(w, "int8"), b, onednn=True)
    linear.reduce_range = reduce_range  # FBGEMM's 7-bit activations (CPUs without VNNI), or 8
    x = torch.randn(300, 160, generator=g) * torch.logspace(-3, 2, 300).view(-1, 1)
    x[0], x[1] = 1.0, -1.0  # every code at one end
    fast = linear._product(x, "onednn")
    for rows in (1, 2, 3, 5, 8, 300):
        assert torch.equal(linear._product(x[:rows], "onednn"), linear._product(x[:rows], "fbgemm")), rows
    alone = torch.cat([linear._product(x[i : i + 1], "fbgemm") for i in range(0, 300, 7)])
    assert torch.equal(fast[::7], alone)


def test_w8a8_onednn_probe_refuses_a_kernel_that_is_not_fbgemms_bits(monkeypatch):
    """Negative control for the probe: a oneDNN product whose sums are off by one in the last
    place for one output (what an int16 saturation or another rounding gives) is not used."""
    from specdecode.models import quant

    real = quant._onednn_product

    def off_by_one(rows, layer):
        out = real(rows, layer)
        out[:, 0] = torch.nextafter(out[:, 0], torch.full_like(out[:, 0], float("inf")))
        return out

    monkeypatch.setattr(quant, "_onednn_product", off_by_one)
    quant.onednn_exact.cache_clear()
    try:
        assert not quant.onednn_exact(False)
    finally:
        quant.onednn_exact.cache_clear()


def test_the_reference_check_rejects_another_zero_convention():
    """Negative control: reading int4 as q * s + z (no offset of 8) is caught by the same check."""
    g = torch.Generator().manual_seed(1)
    q = QWeight.from_float(torch.randn(32, 64, generator=g), "int4")
    x = torch.randn(3, 64, generator=g)
    wrong = q.q.float() * q.scales.repeat_interleave(32, 1) + q.zeros.repeat_interleave(32, 1)
    with pytest.raises(AssertionError):
        bf16_close(QuantLinear(q)(x), x.to(torch.bfloat16).double() @ wrong.double().t())


@pytest.mark.parametrize("kind", WEIGHT_ONLY)
def test_quantization_error_is_within_half_a_step(kind):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-2, 1, 64).view(-1, 1)
    q = QWeight.from_float(w, kind)
    err = (q.dequantize() - w).abs()
    if q.bits == 8:
        step = q.scales.view(-1, 1)
    else:
        step = q.scales.repeat_interleave(q.group, 1)
    # half a step, plus the bf16 rounding of the zero (int4) and of the scale times the level
    assert bool((err <= 0.5 * step * (1 + 2**-6) + w.abs() * 2**-8).all())
    # int8: 8 bits + a bf16 scale per row; int4: 4 bits + a bf16 scale and zero per group
    assert q.nbytes < w.numel() * 2 * (0.51 if q.bits == 8 else 0.32)


def test_projections_whose_formats_differ_run_as_one_concatenated_projection():
    """A GGUF's Q4_K q, k beside its Q6_K-derived int8 v: one ConcatLinear, same outputs as parts."""
    g = torch.Generator().manual_seed(3)
    parts = [QWeight.from_float(torch.randn(32, 64, generator=g), k) for k in ("int4", "int4", "int8")]
    bias = torch.randn(96, generator=g)
    fused = quantized_linear(parts, bias, "int4")
    assert fused.layout == "int4+int8" and fused.out_features == 96
    x = torch.randn(2, 64, generator=g)
    int4, int8 = QuantLinear(QWeight.cat(parts[:2]), bias[:64]), QuantLinear(parts[2], bias[64:])
    want = torch.cat([int4(x), int8(x)], -1)
    torch.testing.assert_close(fused(x), want)


@pytest.fixture(scope="module")
def tiny_target(pair_dir):
    return pair_dir[0]


@pytest.mark.parametrize("kind", KINDS)
def test_a_model_quantized_at_load_equals_one_quantized_after_loading(tiny_target, kind):
    a = load(tiny_target, quant=kind)
    b = load(tiny_target).quantize(kind)
    f = load(tiny_target)
    ids = torch.tensor([[3, 14, 15, 9, 26, 5]])
    la, lb, lf = (m.forward(ids, m.new_cache(1, 8))[0] for m in (a, b, f))
    assert torch.equal(la, lb)
    assert a.quant == kind and a.weight_bytes() < f.weight_bytes() * 0.5  # of fp32 (tiny shapes pad)
    # a quantized copy of the model, not another one (random weights lose much in 4 bits)
    cos = torch.nn.functional.cosine_similarity(la.flatten(), lf.flatten(), 0)
    assert cos > (0.99 if kind in ("int8", "w8a8") else 0.85)


def test_quantizing_twice_or_through_transformers_is_a_clear_error(tiny_target):
    m = load(tiny_target, quant="int4")
    assert m.quantize("int4") is m
    with pytest.raises(SpecDecodeError, match="already int4"):
        m.quantize("int8")
    with pytest.raises(SpecDecodeError, match="lean runtime"):
        load(tiny_target, backend="hf", quant="int4")
    with pytest.raises(SpecDecodeError, match="unknown weight format"):
        load(tiny_target, quant="int3")


@pytest.mark.parametrize("kind", ["int4", "w8a8"])
def test_a_quantized_target_is_exact_relative_to_itself(pair_dir, kind):
    """Greedy speculative decoding on a quantized target equals that target's own greedy run."""
    target = load(pair_dir[0], quant=kind)
    draft = load(pair_dir[1])
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4], [11]]
    want = [r.token_ids for r in SpeculativeGenerator(target).generate(prompts, params)]
    got = SpeculativeGenerator(target, draft=draft, method="draft", k=3).generate(prompts, params)
    assert [r.token_ids for r in got] == want


def test_draft_dtype_quantizes_each_model_drafter_and_refuses_weightless_ones(pair_dir, trained64):
    target, draft = load(pair_dir[0]), load(pair_dir[1])
    gen = SpeculativeGenerator(target, draft=draft, method="draft", draft_dtype="int4")
    assert draft.quant == "int4" and gen.drafter.weights_dtype == "int4"
    gen = SpeculativeGenerator(target, method="eagle3", heads=trained64["eagle3"], draft_dtype="int8")
    assert gen.drafter.layer.quant == "int8" and gen.drafter.fc.layout == "int8"
    with pytest.raises(SpecDecodeError, match="no draft weights of its own"):
        SpeculativeGenerator(target, method="ngram", draft_dtype="int4")
    with pytest.raises(SpecDecodeError, match="weights are fp32, not bf16"):
        SpeculativeGenerator(target, draft=load(pair_dir[1]), method="draft", draft_dtype="bf16")
    with pytest.raises(SpecDecodeError, match="draft_dtype"):
        SpecConfig(draft_dtype="int4")  # target-only decoding drafts nothing
    with pytest.raises(SpecDecodeError, match="draft_dtype 'int2'"):
        SpecConfig(method="draft", draft_dtype="int2")


# -- a GGUF's own quantization ---------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_gguf(tmp_path_factory):
    """(its GGUF, the GGUF imported): the pair's tensor types, random blocks."""
    from specdecode.models.gguf_import import import_gguf

    root = tmp_path_factory.mktemp("qwen-gguf-quant")
    _, path = write_tiny_qwen_gguf(root)
    return path, import_gguf(path, root / "fp32", progress=False)


def test_q4_k_blocks_keep_their_4_bit_values_and_scales_up_to_bf16(qwen_gguf):
    import gguf

    from specdecode.models.gguf_quant import GGUFQWeights

    path, _ = qwen_gguf
    qw = GGUFQWeights(path, "q4_k")
    report = qw.compare()
    assert report["Q4_K"]["ours"] == "int4" and report["Q4_K"]["matrices"] >= 5
    for kind in ("Q6_K", "Q5_0", "Q8_0"):
        assert report[kind]["ours"] == "int8"
    name = next(n for n in qw if qw.type_of(n) == "Q4_K")
    q, ref = qw[name], qw.dequantized(name)
    # the file's 4-bit values, bit for bit: dequantizing with unrounded scales gives its weights
    t = qw.tensors[name]
    blocks = np.asarray(t.data).reshape(-1, 144)
    d = torch.from_numpy(blocks[:, 0:2].copy().view(np.float16).astype(np.float32))
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
    dmin = torch.from_numpy(blocks[:, 2:4].copy().view(np.float16).astype(np.float32))
    s = (d * torch.from_numpy(sc.astype(np.float32))).reshape(q.q.shape[0], -1)
    mins = (dmin * torch.from_numpy(m.astype(np.float32))).reshape(q.q.shape[0], -1)
    exact = q.q.float() * s.repeat_interleave(32, 1) - mins.repeat_interleave(32, 1)
    torch.testing.assert_close(exact, ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    # and the bf16 scale and zero stay within their rounding (2^-8 relative each):
    # ours - file = q (s_bf16 - s) + (z_bf16 - (8 s_bf16 - m)), q <= 15
    s_abs, z_abs = s.abs().repeat_interleave(32, 1), (8 * s - mins).abs().repeat_interleave(32, 1)
    bound = 2**-8 * (15 * s_abs + z_abs * (1 + 2**-7))
    assert bool(((q.dequantize() - ref).abs() <= bound + 1e-9).all())
    assert report["Q4_K"]["max_abs_diff"] <= float(bound.max())


def test_a_q4_k_target_runs_its_ggufs_blocks_exactly_relative_to_itself(qwen_gguf, tmp_path, monkeypatch):
    path, imported = qwen_gguf
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(ZOO, "tiny-q4", ZooModel("helpers", "../" + path.name, "pip install tiny"))
    monkeypatch.setattr(ZooModel, "gguf_path", lambda self: path)
    target = load("tiny-q4", quant="q4_k")  # fp32 activations: this random model is erratic in bf16
    assert target.quant == "q4_k"
    layouts = {linear.layout for _, linear in target.linears()}
    assert "int4+int8" in layouts  # Q4_K q, k beside the Q6_K v
    ref = load(imported)
    ids = torch.tensor([[5, 70, 3, 200, 9, 41, 17, 88]])
    lq = target.forward(ids, target.new_cache(1, 16))[0]
    lr = ref.forward(ids, ref.new_cache(1, 16))[0]
    assert (lq - lr).abs().max() < 0.03 * lr.abs().max()  # the same model up to int8/bf16 rounding
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    prompts = [[5, 70, 3], [200, 9, 41, 17]]
    want = [r.token_ids for r in SpeculativeGenerator(target).generate(prompts, params)]
    got = SpeculativeGenerator(target, method="ngram", k=3).generate(prompts, params)
    assert [r.token_ids for r in got] == want
    with pytest.raises(SpecDecodeError, match="keeps a GGUF.s own quantization"):
        load(str(imported), quant="q4_k")


def test_lean_model_linears_report_every_projection_and_the_head(tiny_target):
    m = load(tiny_target, quant="int8")
    names = [n for n, _ in m.linears()]
    assert names[-1] == "head" and len(names) == 4 * m.cfg.num_layers + 1
    assert isinstance(m, LlamaModel)


# -- a draft vocabulary (FR-Spec) -------------------------------------------------------------


def test_a_reduced_draft_head_gives_the_full_heads_logits_on_its_tokens_and_minus_inf_elsewhere(pair_dir):
    from specdecode.models.draft_vocab import ReducedHeadModel, frequent_ids

    draft = load(pair_dir[1])
    draft.eos_token_ids = (60,)
    ids = frequent_ids(draft, 20)
    assert ids.tolist() == [*range(20), 60]  # the 20 lowest ids and the EOS
    reduced = ReducedHeadModel(draft, ids)
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    full, _ = draft.forward(tokens, draft.new_cache(1, 8))
    small, _ = reduced.forward(tokens, reduced.new_cache(1, 8))
    torch.testing.assert_close(small[..., ids], full[..., ids])
    outside = torch.ones(draft.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert bool(torch.isinf(small[..., outside]).all())
    assert reduced.weight_bytes() < draft.weight_bytes()


def test_draft_vocab_needs_a_draft_model_and_a_valid_list(pair_dir, tmp_path):
    from specdecode.models.draft_vocab import frequent_ids

    with pytest.raises(SpecDecodeError, match="method draft or auto"):
        SpecConfig(method="ngram", draft_vocab=100)
    with pytest.raises(SpecDecodeError, match="integer >= 2"):
        SpecConfig(method="draft", draft_vocab=1)
    bad = tmp_path / "ids.json"
    bad.write_text("[1, 2, 999]")
    with pytest.raises(SpecDecodeError, match="outside the model's 64 tokens"):
        frequent_ids(load(pair_dir[1]), bad)
    bad.write_text("{not json")
    with pytest.raises(SpecDecodeError, match="not a JSON list"):
        frequent_ids(load(pair_dir[1]), bad)


def test_the_int8_kernels_summary_says_which_kernel_from_how_many_rows_and_what_is_held_twice():
    """The start-up line's clause: FBGEMM alone, or oneDNN from the chosen row counts, with the
    bytes of the projections that keep both layouts."""
    from specdecode.models.quant import int8_kernels_summary

    g = torch.Generator().manual_seed(2)
    lins = [DynamicInt8Linear(QWeight.from_float(torch.randn(32, 64, generator=g), "int8")) for _ in range(3)]
    assert int8_kernels_summary([]) is None
    assert int8_kernels_summary(lins) == "int8 products on FBGEMM"
    for lin, start in zip(lins, (1, 4, None)):
        lin.onednn = object()  # a packed copy, as choose_int8_kernels leaves it
        lin.use_onednn_from(start)
    nbytes = lins[1].nbytes  # the one split at 4 rows holds both
    assert int8_kernels_summary(lins) == (
        f"int8 products on oneDNN from 1-4 rows by shape, FBGEMM below; {nbytes / 1e9:.2f} GB of weights "
        "held in both layouts"
    )
