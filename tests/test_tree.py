"""Token trees: shape, exact multi-candidate verification, and the cache after a tree round equal
to a fresh prefill of the accepted text (through the engine: tests/test_contract.py)."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from helpers import check_distribution
from specdecode import SamplingParams, SpecDecodeError, SpeculativeGenerator, load
from specdecode.core.tree import TokenTree, verify_tree
from specdecode.models.base import ForwardMeta, logits_of
from specdecode.models.init import init_model

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


@pytest.mark.heavy
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


@pytest.mark.heavy
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


# -- sampled candidates: SpecInfer (with replacement) and Sequoia (without) -------------------


def sampled_tree_case(without: bool, B: int = 200_000, seed: int = 1):
    """Tree 3,2 over V = 10: p and q per input (root + 9 nodes), each node's children drawn
    from q at that node (with or without replacement), uniforms and noise per row."""
    rng = np.random.default_rng(seed)
    V = 10
    tree = TokenTree.parse("3,2").with_sampling("without-replacement" if without else "with-replacement")
    p = torch.tensor(rng.dirichlet(np.ones(V) * 0.7, size=tree.size + 1))
    q = torch.tensor(rng.dirichlet(np.ones(V) * 0.7, size=tree.size + 1))
    g = torch.Generator().manual_seed(seed)
    kids = tree.children()
    nodes = torch.zeros(B, tree.size, dtype=torch.long)
    for parent in range(tree.size + 1):
        ks = [int(c) for c in kids[parent] if c >= 0]
        if ks:
            draws = torch.multinomial(q[parent].expand(B, V), len(ks), replacement=not without, generator=g)
            for j, c in enumerate(ks):
                nodes[:, c - 1] = draws[:, j]
    args = (
        tree,
        nodes,
        p.expand(B, -1, -1),
        p.expand(B, -1, -1),
        torch.rand(B, tree.size, generator=g, dtype=torch.float64),
        torch.empty(B, V, dtype=torch.float64).exponential_(generator=g),
    )
    return args, p, q, g


@pytest.mark.heavy
@pytest.mark.parametrize("without", [False, True], ids=["with-replacement", "without-replacement"])
def test_sampled_tree_verification_keeps_the_target_distribution(without):
    """First emitted token ~ p at the root, and after an accepted node 1 the next ~ p there,
    for candidates drawn from q; and more first candidates pass than with top-ranked ones."""
    args, p, q, _ = sampled_tree_case(without)
    B = args[1].shape[0]
    v = verify_tree(*args, q.expand(B, -1, -1), torch.ones(B, dtype=torch.bool), without)
    ok, msg = check_distribution(np.array([t[0] for t in v.tokens]), p[0].numpy())
    assert ok, msg
    via_node1 = [t[1] for t, path in zip(v.tokens, v.path) if path[:1] == [1]]
    ok, msg = check_distribution(np.array(via_node1), p[1].numpy())
    assert ok, msg
    if without:  # siblings are distinct tokens
        assert bool((args[1][:, 0] != args[1][:, 1]).all() and (args[1][:, 3] != args[1][:, 4]).all())
    assert 0 < sum(len(path) == 2 for path in v.path) < B


@pytest.mark.heavy
@pytest.mark.parametrize("without", [False, True], ids=["with-replacement", "without-replacement"])
def test_sampled_tree_check_catches_the_wrong_rules(without):
    """Negative controls on the same draws: (1) the right rule, but a walk that stops at the root
    redraws from p itself instead of the residual; (2) without-replacement draws verified with q
    left unchanged after a rejection. The check must reject each. (Verifying sampled candidates
    as one-hot proposals, q ignored, is exact too, since it samples p by elimination whatever the
    candidates, but it accepts less: checked here as well.)"""
    args, p, q, g = sampled_tree_case(without)
    B = args[1].shape[0]
    right = verify_tree(*args, q.expand(B, -1, -1), torch.ones(B, dtype=torch.bool), without)
    redraw = torch.multinomial(p[0], B, replacement=True, generator=g).numpy()
    rows = enumerate(zip(right.tokens, right.path))
    first = np.array([t[0] if path else redraw[b] for b, (t, path) in rows])
    ok, msg = check_distribution(first, p[0].numpy())
    assert not ok, msg
    if without:
        stale = verify_tree(*args, q.expand(B, -1, -1), torch.ones(B, dtype=torch.bool), False)
        ok, msg = check_distribution(np.array([t[0] for t in stale.tokens]), p[0].numpy())
        assert not ok, msg
    one_hot = verify_tree(*args)
    ok, msg = check_distribution(np.array([t[0] for t in one_hot.tokens]), p[0].numpy())
    assert ok, msg
    accepted = lambda v: sum(len(path) for path in v.path)  # noqa: E731
    assert accepted(right) > accepted(one_hot)


@pytest.mark.parametrize("sampling", ["with-replacement", "without-replacement"])
def test_sampled_tree_greedy_row_beside_sampled_rows_is_target_greedy_and_seeds_reproduce(models, sampling):
    """A greedy row in a batch whose other rows draw sampled candidates takes top-ranked ones
    and decodes the target's greedy tokens; a seeded sampled row gives the same tokens alone."""
    target, draft = models
    want = SpeculativeGenerator(target).generate([PROMPTS[0]], GREEDY)[0].token_ids
    gen = SpeculativeGenerator(target, draft=draft, tree="3,2", tree_sampling=sampling)
    hot = SamplingParams(temperature=1.0, max_new_tokens=GREEDY.max_new_tokens, seed=3, ignore_eos=True)
    mixed = gen.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [GREEDY, hot, replace(hot, seed=4)])
    assert mixed[0].token_ids == want
    assert gen.generate([PROMPTS[1]], hot)[0].token_ids == mixed[1].token_ids


def test_tree_sampling_needs_a_tree_and_a_known_mode(models):
    target, draft = models
    with pytest.raises(SpecDecodeError, match="tree sampling needs a token tree"):
        SpeculativeGenerator(target, draft=draft, tree_sampling="with-replacement")
    with pytest.raises(SpecDecodeError, match="unknown tree sampling 'random'"):
        SpeculativeGenerator(target, draft=draft, tree="2,2", tree_sampling="random")


@pytest.mark.heavy
@pytest.mark.parametrize("without", [False, True], ids=["with-replacement", "without-replacement"])
def test_sampled_tree_check_catches_swapped_p_and_q(without):
    """Negative control: the verifier given the draft's q as the target's p and p as q (swapped)
    emits tokens that follow q; the same check against p must reject them."""
    (tree, nodes, p_b, scores, u, noise), p, q, _ = sampled_tree_case(without)
    B = nodes.shape[0]
    swapped = verify_tree(
        tree,
        nodes,
        q.expand(B, -1, -1),
        scores,
        u,
        noise,
        p.expand(B, -1, -1),
        torch.ones(B, dtype=torch.bool),
        without,
    )
    ok, msg = check_distribution(np.array([t[0] for t in swapped.tokens]), p[0].numpy())
    assert not ok, msg
