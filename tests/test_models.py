"""Both runtimes: logits match transformers, caches rewind exactly, load() picks the backend."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import tiny_hf_model
from specdecode import SpecDecodeError, load
from specdecode.models import HFModel, LlamaModel, extend, logits_of
from specdecode.models.init import init_model


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    return {
        "tied-gqa": init_model(
            root / "a", vocab=96, layers=2, dim=64, heads=4, kv_heads=2, seed=3, init_std=0.2
        ),
        "untied-mha": init_model(
            root / "b", vocab=96, layers=3, dim=32, heads=2, seed=4, init_std=0.2, tie_embeddings=False
        ),
    }


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, llama_dirs):
    root = tmp_path_factory.mktemp("hf")
    tiny_hf_model("gpt2", root / "gpt2", vocab=96, seed=0)
    tiny_hf_model("qwen2", root / "qwen2", vocab=96, seed=0)
    return {"gpt2": root / "gpt2", "qwen2": root / "qwen2"}


@pytest.mark.parametrize("name", ["tied-gqa", "untied-mha"])
def test_lean_runtime_logits_match_transformers_llama(llama_dirs, name):
    path = llama_dirs[name]
    ours = load(path)
    assert isinstance(ours, LlamaModel)
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    x = torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(0))
    cache = ours.new_cache(3, 32)
    # prefill 11 tokens, then one token at a time: the incremental path must match too
    got = [logits_of(ours, x[:, :11], cache)] + [
        logits_of(ours, x[:, t : t + 1], cache) for t in range(11, 20)
    ]
    with torch.no_grad():
        want = ref(x).logits
    assert (torch.cat(got, 1) - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2"])
def test_rewind_then_extend_equals_fresh_prefill_for_ragged_rows(kind, llama_dirs, hf_dirs):
    model = (
        load(llama_dirs["tied-gqa"], dtype=torch.float64)
        if kind == "llama"
        else load(hf_dirs[kind], dtype=torch.float64, backend="hf")
    )
    g = torch.Generator().manual_seed(1)
    B = 3
    tokens = torch.randint(0, 96, (B, 24), generator=g)
    cache = model.new_cache(B, 40)
    model.forward(tokens[:, :6], cache)
    model.forward(torch.randint(0, 96, (B, 5), generator=g), cache)  # a rejected draft
    cache.rewind(torch.tensor([6, 4, 5]))  # ragged rewind, then feed the true continuation
    lengths = torch.tensor([14, 12, 16])
    last, _ = extend(model, cache, tokens, lengths)
    fresh = model.new_cache(B, 40)
    for b in range(B):
        n = int(lengths[b])
        row_cache = model.new_cache(1, 40)
        want = logits_of(model, tokens[b : b + 1, :n], row_cache)[0, -1]
        assert (last[b] - want).abs().max().item() < 1e-9, f"row {b}"
    assert cache.lengths.tolist() == lengths.tolist()
    del fresh


def test_select_rows_keeps_the_selected_rows_state(llama_dirs):
    model = load(llama_dirs["tied-gqa"], dtype=torch.float64)
    tokens = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(3, 16)
    model.forward(tokens[:, :8], cache)
    cache.select_rows(torch.tensor([2, 0]))
    got = logits_of(model, tokens[[2, 0], 8:9], cache)[:, 0]
    want = logits_of(model, tokens[[2, 0], :9], model.new_cache(2, 16))[:, -1]
    assert (got - want).abs().max().item() < 1e-9


def test_load_uses_transformers_for_other_architectures(hf_dirs):
    model = load(hf_dirs["gpt2"])
    assert isinstance(model, HFModel)
    assert model.vocab_size == 96


def test_load_runs_qwen2_on_the_lean_runtime_unless_told_otherwise(hf_dirs):
    assert isinstance(load(hf_dirs["qwen2"]), LlamaModel)
    assert isinstance(load(hf_dirs["qwen2"], backend="hf"), HFModel)


def test_load_rejects_unknown_names_with_a_clear_error(tmp_path):
    with pytest.raises(SpecDecodeError, match="unknown model"):
        load("no/such-model")
    with pytest.raises(SpecDecodeError, match="no config.json"):
        load(tmp_path)


def test_checkpoints_from_init_model_load_in_transformers_offline(llama_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dirs["tied-gqa"], local_files_only=True)
    ours = load(llama_dirs["tied-gqa"])
    assert tok.encode("hello") == ours.tokenizer.encode("hello")
    assert ours.tokenizer.decode(ours.tokenizer.encode("hello world")) == "hello world"


def test_forward_computes_only_the_logits_asked_for(llama_dirs):
    from specdecode.models.base import ForwardMeta

    model = load(llama_dirs["untied-mha"], dtype=torch.float64)
    x = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(2))
    full = model.forward(x, model.new_cache(2, 8))[0]
    at = torch.tensor([6, 3])
    picked, _ = model.forward(x, model.new_cache(2, 8), ForwardMeta(logits_at=at))
    assert picked.shape == (2, 1, 96)
    torch.testing.assert_close(picked[:, 0], full[torch.arange(2), at], rtol=0, atol=1e-12)
    cache = model.new_cache(2, 8)
    none, hidden = model.forward(x, cache, ForwardMeta(need_logits=False, return_hidden=True))
    assert none is None and hidden.shape == (2, 7, 32) and cache.lengths.tolist() == [7, 7]
