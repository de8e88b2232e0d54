"""Hybrid targets: gated delta-rule linear-attention layers beside full attention. The runtime
against the training module, the chunked recurrence against the token-by-token one, both
rollback strategies (greedy identity with every method, the two-token distribution with a
negative control that skips the rollback), trees through the recurrent state, and the memory
each strategy keeps."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import check_distribution, independent, noisy_copy, random_heads, two_token_joint
from specdecode import SamplingParams, SpecDecodeError, SpeculativeGenerator, load
from specdecode.models.base import ForwardMeta
from specdecode.models.init import init_model
from specdecode.models.linear_attention import HybridCache, chunked_delta_rule, delta_step
from specdecode.train.hybrid import HybridLM, init_hybrid

GREEDY = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 64 for j in range(1 + (5 * i) % 10)] for i in range(6)]
ROLLBACKS = ("snapshot", "recompute")


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A hybrid target (layers 0, 1 linear, 2 attention; vocab 64), a noisy hybrid copy as a
    draft model, and an attention-only draft of the same vocabulary."""
    root = tmp_path_factory.mktemp("hybrid")
    t = init_hybrid(
        root / "t", vocab=64, layers=3, dim=64, linear_layers=(0, 1), heads=2, seed=1, init_std=0.3
    )
    d = noisy_copy(t, root / "d", noise=0.05, seed=2)
    a = init_model(root / "a", vocab=64, layers=1, dim=32, seed=3, init_std=0.3)
    return t, d, a


@pytest.fixture(scope="module")
def hybrid(hybrid_dirs):
    t, d, a = hybrid_dirs
    return load(t, dtype=torch.float64), load(d, dtype=torch.float64), load(a, dtype=torch.float64)


@pytest.fixture(scope="module")
def hybrid_eagle(hybrid_dirs, tmp_path_factory) -> Path:
    """An EAGLE drafter trained (briefly) on the hybrid target's features by train-heads."""
    from helpers import train_tiny_eagle

    lines = [f"the cat sat on the mat {i}." for i in range(2000)]
    return train_tiny_eagle(hybrid_dirs[0], tmp_path_factory.mktemp("hybrid-eagle"), lines, 32)


def test_runtime_logits_equal_the_training_module_and_decoding_step_by_step(hybrid_dirs, hybrid):
    from safetensors.torch import load_file

    target = hybrid[0]
    ref = HybridLM(__import__("json").loads((hybrid_dirs[0] / "config.json").read_text())).double()
    ref.load_state_dict(
        {k: v.double() for k, v in load_file(str(hybrid_dirs[0] / "model.safetensors")).items()}
    )
    ids = torch.tensor([[5, 9, 2, 7, 1, 3, 3, 8, 12, 40]])
    want = ref(ids).logits
    assert torch.allclose(target.forward(ids, target.new_cache(1, 16))[0], want, atol=1e-10)
    cache = target.new_cache(1, 16)
    steps = torch.cat([target.forward(ids[:, i : i + 1], cache)[0] for i in range(ids.shape[1])], 1)
    assert torch.allclose(steps, want, atol=1e-10)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_delta_rule_equals_the_token_by_token_recurrence(chunk):
    g = torch.Generator().manual_seed(0)
    B, T, H, D = 2, 70, 3, 8
    q, k = (F.normalize(torch.randn(B, T, H, D, generator=g, dtype=torch.float64), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    a = torch.rand(B, T, H, generator=g, dtype=torch.float64) * 0.6 + 0.4
    b = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    S, outs = torch.zeros(B, H, D, D, dtype=torch.float64), []
    for t in range(T):
        S, o = delta_step(S, q[:, t], k[:, t], v[:, t], a[:, t], b[:, t])
        outs.append(o)
    out, S_chunked = chunked_delta_rule(q, k, v, a, b, chunk=chunk)
    assert torch.allclose(out, torch.stack(outs, 1), atol=1e-12)
    assert torch.allclose(S_chunked, S, atol=1e-12)


@pytest.mark.parametrize("rollback", ROLLBACKS)
def test_rewind_restores_the_state_of_a_fresh_prefill(hybrid, rollback):
    """Feed 3 tokens, then 5 drafts, rewind to keep 2 of them: the next logits equal those of a
    cache that only ever saw the kept tokens."""
    target = hybrid[0]
    cache = target.new_cache(2, 32, rollback=rollback)
    prompt = torch.tensor([[5, 9, 2], [7, 7, 1]])
    target.forward(prompt, cache)
    target.forward(torch.tensor([[60, 61, 62, 63, 1], [3, 4, 5, 6, 8]]), cache)
    cache.rewind(torch.tensor([5, 3]))  # row 0 keeps 2 drafts, row 1 none
    got = target.forward(torch.tensor([[11], [12]]), cache)[0][:, -1]
    for b, seq in enumerate([[5, 9, 2, 60, 61, 11], [7, 7, 1, 12]]):
        fresh = target.new_cache(1, 32)
        want = target.forward(torch.tensor([seq]), fresh)[0][0, -1]
        assert torch.allclose(got[b], want, atol=1e-10)


def test_recompute_keeps_at_most_one_kth_of_the_snapshots_memory(hybrid):
    target = hybrid[0]
    for k in (2, 4, 8):
        used = {}
        for rollback in ROLLBACKS:
            cache = target.new_cache(1, 32, rollback=rollback)
            target.forward(torch.tensor([[5, 9, 2]]), cache)
            cache.rewind(cache.lengths.clone())  # the prompt committed, as the engine does
            target.forward(torch.arange(k + 1).view(1, -1), cache)
            used[rollback] = cache.rollback_bytes()["journal"]
        assert used["recompute"] * k <= used["snapshot"], (k, used)


@pytest.fixture(scope="module")
def hybrid_eagle3(hybrid_dirs, tmp_path_factory) -> Path:
    """An EAGLE-3 drafter distilled from the hybrid target (our runtime) and trained briefly."""
    from helpers import train_tiny_eagle3

    root = tmp_path_factory.mktemp("hybrid-eagle3")
    prompts = [[(5 * i + j) % 64 for j in range(3 + i % 4)] for i in range(16)]
    return train_tiny_eagle3(hybrid_dirs[0], root, prompts, draft_vocab=48, tokens=16)[1]


def generators(hybrid, eagle: Path, eagle3: Path, rollback: str) -> dict:
    target, hybrid_draft, attention_draft = hybrid
    common = {"rollback": rollback}
    return {
        "draft (hybrid)": SpeculativeGenerator(target, draft=hybrid_draft, k=3, **common),
        "draft (attention)": SpeculativeGenerator(target, draft=attention_draft, k=3, **common),
        "draft tree": SpeculativeGenerator(target, draft=attention_draft, tree="2,2", **common),
        "ngram": SpeculativeGenerator(target, method="ngram", k=3, **common),
        "suffix": SpeculativeGenerator(target, method="suffix", k=3, **common),
        "early-exit": SpeculativeGenerator(target, method="early-exit", exit_layer=1, k=2, **common),
        "medusa": SpeculativeGenerator(
            target, method="medusa", k=3, heads=random_heads(64, scale=1.0), **common
        ),
        "medusa tree": SpeculativeGenerator(
            target, method="medusa", heads=random_heads(64, scale=1.0), tree="3,1,1", **common
        ),
        "eagle": SpeculativeGenerator(target, method="eagle", heads=eagle, k=3, **common),
        "eagle tree": SpeculativeGenerator(
            target, method="eagle", heads=eagle, tree="2,2", tree_sampling="with-replacement", **common
        ),
        "eagle3": SpeculativeGenerator(target, method="eagle3", heads=eagle3, k=3, **common),
        "eagle3 tree": SpeculativeGenerator(target, method="eagle3", heads=eagle3, tree="2,2", **common),
        "auto": SpeculativeGenerator(target, method="auto", heads=eagle3, k=3, **common),
    }


@pytest.mark.heavy
@pytest.mark.filterwarnings("ignore::specdecode.drafters.early_exit.UntrainedExitWarning")
@pytest.mark.parametrize("rollback", ROLLBACKS)
def test_greedy_output_equals_target_only_with_every_method_batch_1_and_ragged(
    hybrid, hybrid_eagle, hybrid_eagle3, rollback
):
    target = hybrid[0]
    want = [r.token_ids for r in SpeculativeGenerator(target).generate(PROMPTS, GREEDY)]
    for name, gen in generators(hybrid, hybrid_eagle, hybrid_eagle3, rollback).items():
        alone = [gen.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
        assert alone == want, name
        assert [r.token_ids for r in gen.generate(PROMPTS, GREEDY)] == want, name


def hybrid_pairs(target, draft, n: int = 20_000, **options):
    prompt, V = [5, 9, 2], target.vocab_size
    gen = SpeculativeGenerator(target, draft=draft, **options)
    params = SamplingParams(temperature=1.0, max_new_tokens=2, seed=5, ignore_eos=True)
    results = gen.generate([prompt] * n, independent(params, n))
    pairs = np.array([r.token_ids[0] * V + r.token_ids[1] for r in results])
    accepted = sum(r.stats.accepted for r in results)
    return pairs, two_token_joint(target, prompt), accepted


@pytest.fixture(scope="module")
def small_hybrid(tmp_path_factory):
    """A vocab-16 hybrid target and a noisy copy (the two-token joint has 256 cells)."""
    root = tmp_path_factory.mktemp("hybrid16")
    t = init_hybrid(root / "t", vocab=16, layers=2, dim=32, linear_layers=(0,), heads=2, seed=5, init_std=0.5)
    d = noisy_copy(t, root / "d", noise=0.3, seed=6)
    a = init_model(root / "a", vocab=16, layers=1, dim=32, seed=7, init_std=0.5)
    return load(t), load(d), load(a)  # float32: as powerful as float64 here, cheaper (NOTES, issue 36)


@pytest.mark.heavy
@pytest.mark.parametrize(
    "case",
    ["snapshot", "recompute/tree"],  # each strategy once, a chain and a sampled tree
)
def test_sampling_keeps_the_two_token_joint(small_hybrid, case):
    target, hybrid_draft, attention_draft = small_hybrid
    rollback, _, tree = case.partition("/")
    if tree:  # trees are drafted by an attention-only draft; sampled candidates (Sequoia's rule)
        opts = {"tree": "2,2", "tree_sampling": "without-replacement"}
        pairs, joint, accepted = hybrid_pairs(target, attention_draft, rollback=rollback, **opts)
    else:
        pairs, joint, accepted = hybrid_pairs(target, hybrid_draft, k=2, rollback=rollback)
    ok, msg = check_distribution(pairs, joint)
    assert ok, msg
    assert accepted > 0


@pytest.mark.heavy
def test_two_token_check_catches_a_target_whose_state_is_not_rolled_back(small_hybrid, monkeypatch):
    """Negative control: rewind lowers the lengths but leaves the recurrent state as the
    rejected drafts left it. The same check must reject the output."""
    from specdecode.models.cache import KVCache

    monkeypatch.setattr(HybridCache, "rewind", KVCache.rewind)
    target, hybrid_draft, _ = small_hybrid
    pairs, joint, _ = hybrid_pairs(target, hybrid_draft, k=2)
    ok, msg = check_distribution(pairs, joint)
    assert not ok, msg


def test_tree_forward_then_keep_path_leaves_the_state_of_the_accepted_text(hybrid):
    """A tree written after a prompt; keep the path root -> node 2 -> node 5 (tree 2,2): the
    next logits equal a fresh prefill of the prompt and those two tokens, with both strategies."""
    from specdecode.core.tree import TokenTree

    target = hybrid[0]
    tree = TokenTree.parse("2,2")
    nodes = torch.tensor([[3, 4, 10, 11, 12, 13]])
    for rollback in ROLLBACKS:
        cache = target.new_cache(1, 32, rollback=rollback)
        target.forward(torch.tensor([[5, 9]]), cache)
        base = cache.lengths.clone()
        meta = ForwardMeta(positions=base.view(1, 1) + tree.depths().view(1, -1), tree_mask=tree.mask())
        target.forward(torch.cat([torch.tensor([[2]]), nodes], 1), cache, meta)
        cache.keep_path(base, [[2, 5]])  # node 2 = token 4, node 5 = its first child, token 12
        cache.rewind(base + 3)
        got = target.forward(torch.tensor([[7]]), cache)[0][0, -1]
        want = target.forward(torch.tensor([[5, 9, 2, 4, 12, 7]]), target.new_cache(1, 32))[0][0, -1]
        assert torch.allclose(got, want, atol=1e-10), rollback


def test_hybrid_errors_are_one_line(hybrid, tmp_path):
    target, hybrid_draft, attention_draft = hybrid
    with pytest.raises(SpecDecodeError, match="batch invariance is not implemented"):
        SpeculativeGenerator(target, draft=attention_draft, batch_invariant=True).generate([[1, 2]], GREEDY)
    with pytest.raises(SpecDecodeError, match="cannot draft token trees"):
        SpeculativeGenerator(target, draft=hybrid_draft, tree="2,2").generate([[1, 2]], GREEDY)
    with pytest.raises(SpecDecodeError, match="--rollback applies to hybrid targets"):
        SpeculativeGenerator(attention_draft, rollback="recompute")
    with pytest.raises(SpecDecodeError, match="unknown rollback"):
        SpeculativeGenerator(target, rollback="undo")
