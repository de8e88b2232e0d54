"""Token trees: shape, exact multi-candidate verification, greedy identity through the engine,
and the cache after a tree round equal to a fresh prefill of the accepted text."""

import numpy as np
import pytest
import torch

from helpers import check_distribution, noisy_copy, seeded, two_token_joint
from specdecode import SamplingParams, SpecDecodeError, SpeculativeGenerator, load
from specdecode.models.base import ForwardMeta, logits_of
from specdecode.models.init import init_model
from specdecode.tree import TokenTree, verify_tree

GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 64 for j in range(1 + (5 * i) % 12)] for i in range(8)]


def test_tree_from_branching_and_choices_has_parents_before_children():
    t = TokenTree.parse("3,2")
    assert t.size == 3 + 6 and t.depth == 2
    assert t.parents()[:3] == [0, 0, 0] and t.parents()[3:5] == [1, 1]
    m = t.mask()
    assert m[4].tolist()[:5] == [True, True, False, False, True]  # node (0, 0): root, (0,), itself
    assert t.children()[0].tolist() == [1, 2, 3]
    c = TokenTree.parse("[[1], [0], [0, 0]]")
    assert c.choices == ((0,), (1,), (0, 0)) and c.children()[0].tolist() == [1, 2]


@pytest.mark.parametrize("spec", ["0,2", "a,b", "[[0, 0]]", "[[0], [0]]", "[[-1]]"])
def test_bad_tree_specs_are_clear_errors(spec):
    with pytest.raises(SpecDecodeError, match="tree"):
        TokenTree.parse(spec)


def test_tree_verification_keeps_the_target_distribution():
    """First emitted token ~ p at the root; after an accepted depth-1 node, the next ~ p there."""
    rng = np.random.default_rng(1)
    V, B = 10, 200_000
    tree = TokenTree.parse("3,2")
    probs = torch.tensor(rng.dirichlet(np.ones(V) * 0.7, size=tree.size + 1))  # root + 9 nodes
    nodes = torch.tensor([2, 5, 7, 1, 2, 0, 9, 3, 4])  # siblings distinct
    g = torch.Generator().manual_seed(0)
    v = verify_tree(
        tree,
        nodes.expand(B, -1),
        probs.expand(B, -1, -1),
        probs.expand(B, -1, -1),
        torch.rand(B, tree.size, generator=g, dtype=torch.float64),
        torch.empty(B, V, dtype=torch.float64).exponential_(generator=g),
    )
    first = np.array([t[0] for t in v.tokens])
    ok, msg = check_distribution(first, probs[0].numpy())
    assert ok, msg
    via_node1 = [t[1] for t, p in zip(v.tokens, v.path) if p[:1] == [1]]
    ok, msg = check_distribution(np.array(via_node1), probs[1].numpy())
    assert ok, msg
    assert 0 < sum(len(p) == 2 for p in v.path) < B  # full paths and early stops both happen


@pytest.fixture(scope="module")
def models(pair_dir):
    target, draft = pair_dir
    return load(target, dtype=torch.float64), load(draft, dtype=torch.float64)


@pytest.mark.parametrize("spec", ["1,1,1", "3,2", "4,2,1", "[[0], [1], [0, 0], [1, 0], [0, 0, 0]]"])
def test_tree_greedy_tokens_equal_target_greedy_batch_1_and_4(models, spec):
    target, draft = models
    want = [r.token_ids for r in SpeculativeGenerator(target).generate(PROMPTS, GREEDY)]
    gen = SpeculativeGenerator(target, draft=draft, tree=spec)
    got = [gen.generate([p], GREEDY)[0] for p in PROMPTS]
    assert [r.token_ids for r in got] == want
    assert sum(r.stats.accepted for r in got) > 0
    assert [r.token_ids for r in gen.generate(PROMPTS[:4], GREEDY)] == want[:4]


def test_tree_round_through_engine_keeps_the_two_token_joint(tmp_path):
    root = tmp_path
    t = init_model(root / "t", vocab=16, layers=2, dim=32, heads=2, seed=5, init_std=0.5)
    d = noisy_copy(t, root / "d", noise=0.3, seed=6)
    target, draft = load(t, dtype=torch.float64), load(d, dtype=torch.float64)
    prompt, V = [5, 9, 2], 16
    joint = two_token_joint(target, prompt)
    params = SamplingParams(temperature=1.0, max_new_tokens=2, seed=5, ignore_eos=True)
    results = SpeculativeGenerator(target, draft=draft, tree="2,2").generate(
        [prompt] * 40_000, seeded(params, 40_000)
    )
    pairs = np.array([r.token_ids[0] * V + r.token_ids[1] for r in results])
    ok, msg = check_distribution(pairs, joint)
    assert ok, msg


def test_cache_after_keeping_a_tree_path_equals_a_fresh_prefill(models):
    target, _ = models
    tree = TokenTree.parse("2,2")
    prefix, pending = [3, 1, 4, 1, 5], 9
    nodes = torch.tensor([[11, 12, 21, 22, 23, 24]])  # (0,), (1,), (0,0), (0,1), (1,0), (1,1)
    cache = target.new_cache(1, 32)
    target.forward(torch.tensor([prefix]), cache)
    base = cache.lengths.clone()
    target.forward(
        torch.cat([torch.tensor([[pending]]), nodes], 1),
        cache,
        ForwardMeta(positions=base.view(1, 1) + tree.depths().view(1, -1), tree_mask=tree.mask()),
    )
    path = [2, 5]  # node (1,) = 12, then its child (1, 0) = 23
    cache.keep_path(base, [path])
    cache.rewind(base + 1 + len(path))
    fresh = target.new_cache(1, 32)
    text = prefix + [pending, 12, 23]
    target.forward(torch.tensor([text]), fresh)
    n = len(text)
    assert int(cache.lengths[0]) == n
    assert torch.allclose(cache.k[:, :, :, :n], fresh.k[:, :, :, :n], atol=1e-10)
    assert torch.allclose(cache.v[:, :, :, :n], fresh.v[:, :, :, :n], atol=1e-10)
    # and decoding continues identically from either cache
    nxt = torch.tensor([[7]])
    assert torch.allclose(logits_of(target, nxt, cache), logits_of(target, nxt, fresh), atol=1e-10)


def test_tree_needs_method_draft_lean_models_and_fixed_policy(models, tmp_path):
    target, draft = models
    with pytest.raises(SpecDecodeError, match="drafted by methods draft, medusa, eagle and eagle3"):
        SpeculativeGenerator(target, method="ngram", tree="2,2")
    with pytest.raises(SpecDecodeError, match="fixed"):
        SpeculativeGenerator(target, draft=draft, tree="2,2", policy="heuristic")
    hf = load(init_model(tmp_path / "m", vocab=64, layers=1, dim=16, seed=0), backend="hf")
    with pytest.raises(SpecDecodeError, match="lean runtime"):
        SpeculativeGenerator(target, draft=hf, tree="2,2")


def test_tree_check_catches_resampling_from_p_after_every_candidate_is_rejected():
    """Negative control: redraw the first token from p itself (not from p without the rejected
    candidates) when the walk stops at the root; the same check must reject it."""
    rng = np.random.default_rng(1)
    V, B = 10, 200_000
    tree = TokenTree.parse("3,2")
    probs = torch.tensor(rng.dirichlet(np.ones(V) * 0.7, size=tree.size + 1))
    nodes = torch.tensor([2, 5, 7, 1, 2, 0, 9, 3, 4])
    g = torch.Generator().manual_seed(0)
    v = verify_tree(
        tree,
        nodes.expand(B, -1),
        probs.expand(B, -1, -1),
        probs.expand(B, -1, -1),
        torch.rand(B, tree.size, generator=g, dtype=torch.float64),
        torch.empty(B, V, dtype=torch.float64).exponential_(generator=g),
    )
    redraw = torch.multinomial(probs[0], B, replacement=True, generator=g).numpy()
    first = np.array([t[0] if p else redraw[b] for b, (t, p) in enumerate(zip(v.tokens, v.path))])
    ok, msg = check_distribution(first, probs[0].numpy())
    assert not ok, msg
