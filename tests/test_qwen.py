"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms) on the lean runtime: logits and greedy
output identical to transformers' own classes on tiny random checkpoints, every drafter keeps
greedy output, bf16 batch-invariant speculation equals target-only, and the target's
distribution survives speculation (with its negative control)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import (
    check_distribution,
    draft_pair_two_tokens,
    noisy_copy,
    resample_from_p_after_rejection,
)
from specdecode import SamplingParams, SpeculativeGenerator, load
from specdecode.models import LlamaModel, logits_of
from specdecode.models.init import init_model

ARCHS = ("qwen2", "qwen3")


@pytest.fixture(scope="module")
def qwen_pairs(tmp_path_factory):
    """arch -> (target dir, draft dir): a random 2-layer GQA target and a noisy copy as draft."""
    root = tmp_path_factory.mktemp("qwen")
    out = {}
    for arch in ARCHS:
        t = init_model(
            root / arch,
            vocab=300,
            layers=2,
            dim=64,
            heads=4,
            kv_heads=2,
            seed=11,
            init_std=0.3,
            tie_embeddings=False,
            arch=arch,
        )
        out[arch] = (t, noisy_copy(t, root / f"{arch}-draft", noise=0.05, seed=12))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_lean_runtime_logits_match_transformers_qwen(qwen_pairs, arch):
    path = qwen_pairs[arch][0]
    ours = load(path)
    assert isinstance(ours, LlamaModel)
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(ref).__name__.lower().startswith(arch)
    x = torch.randint(0, 300, (2, 18), generator=torch.Generator().manual_seed(0))
    cache = ours.new_cache(2, 32)
    got = [logits_of(ours, x[:, :9], cache)] + [logits_of(ours, x[:, t : t + 1], cache) for t in range(9, 18)]
    with torch.no_grad():
        want = ref(x).logits
    assert (torch.cat(got, 1) - want).abs().max().item() < 1e-4


def test_a_runtime_without_the_qwen_specific_parts_would_fail_the_logits_check(qwen_pairs):
    # negative control: drop qwen2's biases / qwen3's q-k norms and the logits move far past 1e-4
    for arch in ARCHS:
        ours = load(qwen_pairs[arch][0])
        x = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(1))
        want = logits_of(ours, x, ours.new_cache(1, 16))
        for layer in ours.layers:
            if arch == "qwen2":
                layer.qkv.bias = None
            else:
                layer.qk_norm_s = None
        assert (logits_of(ours, x, ours.new_cache(1, 16)) - want).abs().max().item() > 1e-2


METHODS = [
    ("target-only", {}),
    ("draft", {"method": "draft"}),
    ("draft tree", {"method": "draft", "tree": "3,2,1"}),
    ("ngram", {"method": "ngram"}),
    ("suffix", {"method": "suffix"}),
    ("auto + draft model", {"method": "auto"}),
    ("early-exit", {"method": "early-exit"}),
]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_of_every_method_equals_transformers_generate_on_qwen(qwen_pairs, arch):
    target_dir, draft_dir = qwen_pairs[arch]
    target, draft = load(target_dir), load(draft_dir)
    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    prompts = [[5, 70, 3, 200, 9], [41, 17, 88, 17, 88, 17, 88]]
    refs = [
        hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p in prompts
    ]
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    for name, kw in METHODS:
        uses_draft = kw.get("method") in ("draft", "auto")
        gen = SpeculativeGenerator(target, draft=draft if uses_draft else None, k=3, **kw)
        got = [r.token_ids for r in gen.generate(prompts, params)]
        assert got == refs, name


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_batch_invariant_speculation_equals_target_only_on_qwen(qwen_pairs, arch):
    target_dir, draft_dir = qwen_pairs[arch]
    target, draft = load(target_dir, dtype=torch.bfloat16), load(draft_dir, dtype=torch.bfloat16)
    prompts = [[5, 70, 3, 200, 9], [41, 17, 88, 17, 88, 17, 88], [1, 2, 3]]
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    want = [r.token_ids for r in SpeculativeGenerator(target, batch_invariant=True).generate(prompts, params)]
    for kw in ({"method": "draft", "k": 4}, {"method": "auto", "k": 3}, {"method": "ngram", "k": 2}):
        gen = SpeculativeGenerator(
            target, draft=draft if kw["method"] != "ngram" else None, batch_invariant=True, **kw
        )
        assert [r.token_ids for r in gen.generate(prompts, params)] == want, kw


RUNS = 20_000
PROMPT = [5, 7, 2]


@pytest.fixture(scope="module")
def qwen3_v16(tmp_path_factory):
    root = tmp_path_factory.mktemp("q3v16")
    t = init_model(root / "t", vocab=16, layers=2, dim=32, heads=2, seed=5, init_std=0.5, arch="qwen3")
    return load(t), load(noisy_copy(t, root / "d", noise=0.15, seed=6))


def _two_token(pair):
    return draft_pair_two_tokens(*pair, PROMPT, RUNS)


@pytest.mark.heavy
def test_two_token_joint_on_qwen3_equals_the_target(qwen3_v16):
    pairs, joint, rate = _two_token(qwen3_v16)
    ok, msg = check_distribution(pairs, joint)
    assert ok, msg
    assert 0.2 < rate < 0.95, rate


@pytest.mark.heavy
def test_two_token_check_on_qwen3_catches_resampling_from_p(qwen3_v16, monkeypatch):
    resample_from_p_after_rejection(monkeypatch)
    pairs, joint, _ = _two_token(qwen3_v16)
    ok, msg = check_distribution(pairs, joint)
    assert not ok, msg


def test_a_bf16_draft_under_an_fp32_target_keeps_the_targets_greedy_tokens(qwen_pairs):
    target_dir, draft_dir = qwen_pairs["qwen2"]
    target = load(target_dir)
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    prompts = [[5, 70, 3, 200, 9], [41, 17, 88, 17, 88]]
    want = [r.token_ids for r in SpeculativeGenerator(target).generate(prompts, params)]
    for method in ("draft", "auto"):
        gen = SpeculativeGenerator(target, draft=load(draft_dir, dtype=torch.bfloat16), k=3, method=method)
        got = gen.generate(prompts, params)
        assert [r.token_ids for r in got] == want, method
        assert got[0].stats.cost_ratio > 0


def test_cli_draft_dtype_reports_the_measured_cost_ratio(qwen_pairs, capsys):
    import json

    from specdecode.cli import main

    target_dir, draft_dir = (str(p) for p in qwen_pairs["qwen3"])
    args = ["generate", "--target", target_dir, "--prompt", "hello", "--max-new-tokens", "8", "--ignore-eos"]
    assert main([*args, "--draft", draft_dir, "--draft-dtype", "bf16", "--temperature", "0", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["cost_ratio"] > 0 and stats["drafted"] > 0
    assert main([*args, "--draft-dtype", "bf16"]) == 2
    assert "--draft-dtype needs --draft" in capsys.readouterr().err
