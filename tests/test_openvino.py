"""The OpenVINO engine (backend='openvino', models/openvino.py) on tiny random checkpoints: its
logits against our runtime's (float32, and int4 / int8 against our runtime on the very weights
the compressed constants stand for), ragged rows and rewinds, greedy speculation equal to its own
target-only, the two-token joint through it with its negative control, the graph kept on disk,
and one-line refusals of what it does not do."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import (
    check_distribution,
    draft_pair_two_tokens,
    noisy_copy,
    resample_from_p_after_rejection,
)
from specdecode import SamplingParams, SpeculativeGenerator, load
from specdecode import open as sd_open
from specdecode.errors import SpecDecodeError
from specdecode.models.base import ForwardMeta, logits_of
from specdecode.models.init import init_model

pytest.importorskip("openvino")

from specdecode.models.openvino import OVModel, dequantize_sym, quantize_sym  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> a random 2-layer GQA checkpoint (untied head; qwen2 biases, qwen3 q/k norms)."""
    root = tmp_path_factory.mktemp("ov")
    return {
        arch: init_model(
            root / arch, vocab=96, layers=2, dim=64, heads=4, kv_heads=2, seed=11, init_std=0.3,
            tie_embeddings=False, arch=arch,
        )
        for arch in ARCHS
    }


def _chunked_logits(model, tokens: list[int], split: int) -> torch.Tensor:
    """Logits of every position, fed as a prefill of `split` tokens then one forward of the rest."""
    cache = model.new_cache(1, len(tokens) + 1)
    t = torch.tensor([tokens])
    return torch.cat([logits_of(model, t[:, :split], cache), logits_of(model, t[:, split:], cache)], 1)


TOKENS = [5, 70, 3, 90, 9, 11, 12, 40]


@pytest.mark.parametrize("arch", ARCHS)
def test_openvino_float32_logits_match_our_runtime(models, arch):
    ours = logits_of(load(models[arch]), torch.tensor([TOKENS]), load(models[arch]).new_cache(1, 9))
    ov = OVModel.from_dir(models[arch], "fp32", progress=False)
    got = _chunked_logits(ov, TOKENS, 5)
    assert got.dtype == torch.float32 and got.shape == ours.shape
    assert torch.allclose(got, ours, atol=1e-4, rtol=1e-4), float((got - ours).abs().max())


def _dequantized_copy(src, out, fmt: str):
    """The checkpoint with every projection and the head replaced by the float matrix its OpenVINO
    `fmt` constants stand for (and the embedding by its int8 rows): what the engine must compute."""
    bits, group = {"int8": (8, None), "int4": (4, 32), "int4-g128": (4, 128)}[fmt]
    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    for f in src.glob("*.safetensors"):
        w = load_file(str(f))
        for name, t in w.items():
            if t.dim() == 2 and name.endswith("weight"):
                b, g = (8, None) if name == "model.embed_tokens.weight" else (bits, group)
                q, s = quantize_sym(t.float().numpy(), b, g)
                w[name] = torch.from_numpy(dequantize_sym(q, s))
        save_file(w, str(out / f.name), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-g128"])
def test_openvino_compressed_weights_compute_the_matrices_they_stand_for(models, tmp_path, fmt):
    """The i8 / i4 constants (two per byte), their scales and the plugin's fused decompression
    give our runtime's logits on the dequantized weights (activations kept in float32)."""
    # widths of whole groups of 128
    src = init_model(tmp_path / "src", vocab=96, layers=2, dim=128, heads=4, kv_heads=2, intermediate=256,
                     seed=3, init_std=0.3, tie_embeddings=False, arch="qwen2")
    ref = load(_dequantized_copy(src, tmp_path / "deq", fmt))
    want = logits_of(ref, torch.tensor([TOKENS]), ref.new_cache(1, 9))
    ov = OVModel.from_dir(src, fmt, precision="f32", progress=False)
    got = _chunked_logits(ov, TOKENS, 3)
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-3), float((got - want).abs().max())
    # and the quantization is not the identity: the float model's logits differ
    plain = logits_of(load(src), torch.tensor([TOKENS]), load(src).new_cache(1, 9))
    assert float((plain - want).abs().max()) > 1e-2


def test_openvino_ragged_rows_and_rewinds_keep_each_rows_logits(models):
    ov = OVModel.from_dir(models["llama"], "fp32", progress=False)
    a, b = [5, 70, 3, 90, 9], [41, 17]
    alone = [_chunked_logits(ov, s, 1)[0, -1] for s in (a + [7, 8], b + [7, 8])]
    cache = ov.new_cache(2, 12)
    prompts = torch.tensor([a, b + [0, 0, 0]])
    logits_of(ov, prompts, cache)
    cache.rewind(torch.tensor([5, 2]))  # row b's padding is dropped
    logits_of(ov, torch.tensor([[1, 2, 3], [4, 5, 6]]), cache)  # a draft of 3, rejected
    cache.rewind(torch.tensor([5, 2]))
    got = logits_of(ov, torch.tensor([[7, 8], [7, 8]]), cache)[:, -1]
    for row in range(2):
        assert torch.allclose(got[row], alone[row], atol=1e-4), row
    assert cache.lengths.tolist() == [7, 4]
    # a prefill may ask for one position's logits only
    one = ov.forward(torch.tensor([a]), ov.new_cache(1, 8), ForwardMeta(logits_at=torch.tensor([4])))[0]
    assert one.shape == (1, 1, 96)
    assert torch.allclose(one[0, 0], logits_of(ov, torch.tensor([a]), ov.new_cache(1, 8))[0, 4], atol=1e-5)


def test_openvino_speculation_keeps_its_own_greedy_tokens(models, tmp_path):
    target_dir = models["qwen2"]
    draft_dir = noisy_copy(target_dir, tmp_path / "draft", noise=0.05, seed=12)
    target = load(target_dir, backend="openvino")
    prompts = [[5, 70, 3, 90, 9], [41, 17, 88, 17, 88]]
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    want = [r.token_ids for r in SpeculativeGenerator(target).generate(prompts, params)]
    draft = load(draft_dir, backend="openvino")
    for kw in ({"method": "draft", "k": 3, "draft": draft}, {"method": "ngram", "k": 2}):
        got = SpeculativeGenerator(target, **kw).generate(prompts, params)
        assert [r.token_ids for r in got] == want, kw["method"]
        assert sum(r.stats.accepted for r in got) > 0


RUNS = 20_000
PROMPT = [5, 7, 2]


@pytest.fixture(scope="module")
def ov_v16(tmp_path_factory):
    root = tmp_path_factory.mktemp("ov16")
    t = init_model(root / "t", vocab=16, layers=2, dim=32, heads=2, seed=5, init_std=0.5, arch="qwen2")
    d = noisy_copy(t, root / "d", noise=0.15, seed=6)
    return OVModel.from_dir(t, "fp32", progress=False), OVModel.from_dir(d, "fp32", progress=False)


def _two_token(pair):
    return draft_pair_two_tokens(*pair, PROMPT, RUNS)


@pytest.mark.heavy
def test_two_token_joint_through_openvino_equals_the_target(ov_v16):
    pairs, joint, rate = _two_token(ov_v16)
    ok, msg = check_distribution(pairs, joint)
    assert ok, msg
    assert 0.2 < rate < 0.95, rate


@pytest.mark.heavy
def test_two_token_check_through_openvino_catches_resampling_from_p(ov_v16, monkeypatch):
    resample_from_p_after_rejection(monkeypatch)
    pairs, joint, _ = _two_token(ov_v16)
    ok, msg = check_distribution(pairs, joint)
    assert not ok, msg


def test_openvino_graph_is_built_once_and_read_back(models, capsys):
    load(models["llama"], backend="openvino", dtype=torch.float32)
    assert "building the OpenVINO graph" in capsys.readouterr().err
    again = load(models["llama"], backend="openvino", dtype=torch.float32)
    assert "building" not in capsys.readouterr().err
    assert again.quant == "fp32" and not again.lean and not again.supports_invariant


def test_openvino_graphs_of_one_model_in_two_formats_are_both_kept(tmp_path, capsys):
    """int4 and int4-g128 of one model are two files (one name must not be the other's prefix)."""
    src = init_model(tmp_path / "m", vocab=32, layers=1, dim=128, heads=2, seed=1)
    for fmt in ("int4-g128", "int4", "int4-g128", "int4"):
        load(src, backend="openvino", dtype=torch.bfloat16, quant=fmt)
    assert capsys.readouterr().err.count("building") == 2


def test_open_with_openvino_says_what_runs_and_refuses_what_it_cannot(models, capsys):
    target, draft = str(models["qwen2"]), str(models["llama"])
    lines: list[str] = []
    gen = sd_open(target, draft=draft, backend="openvino", dtype="auto", log=lines.append)
    # OpenVINO's 4-bit groups, of 32 here (a hidden size of 64 is no whole group of 128)
    assert "target int4, draft int4" in lines[0] and "OpenVINO" in lines[0]
    assert "not batch-invariant" in lines[0]
    assert gen.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=4))[0].token_ids
    with pytest.raises(SpecDecodeError, match="batch invariance needs our lean runtime"):
        sd_open(target, backend="openvino", batch_invariant=True)
    lines.clear()
    with pytest.raises(SpecDecodeError, match="openvino backend runs .* not 'w8a8'"):
        sd_open(target, backend="openvino", dtype="w8a8", log=lines.append)
    assert not lines  # refused before anything is said or loaded
    with pytest.raises(SpecDecodeError, match="int4 in groups of 128 needs input widths divisible by 128"):
        sd_open(target, backend="openvino", dtype="int4-g128")  # hidden size 64
    for kw in ({"tree": "2,1"}, {"draft_vocab": 32}, {"method": "eagle"}):
        with pytest.raises(SpecDecodeError, match="needs our lean runtime: drop --backend openvino"):
            sd_open(target, draft=draft, backend="openvino", dtype="fp32", log=lines.append, **kw)
    assert not lines


def test_cli_generate_runs_on_openvino_and_rejects_bad_combinations(models, capsys):
    from specdecode.cli import main

    target = str(models["qwen2"])
    code = main(["generate", "--target", target, "--draft", target, "--backend", "openvino",
                 "--dtype", "int8", "--prompt", "ab", "--max-new-tokens", "4"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "target int8" in out.err and "OpenVINO" in out.err
    assert main(["generate", "--target", target, "--backend", "openvino", "--batch-invariant",
                 "--prompt", "ab"]) == 2
    err = capsys.readouterr().err
    assert "batch invariance needs our lean runtime" in err and "Traceback" not in err
