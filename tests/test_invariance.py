"""Batch invariance (issue 17): with batch_invariant=True a token's logits do not depend on how
many drafts or rows share the target's forward, so greedy speculative output equals target-only
token for token in bf16 as in fp32, for every method and policy, alone, in a batch of 8 and
admitted mid-run; and a seeded sampled row is the same alone and in a batch."""

import pytest
import torch

from helpers import churn
from specdecode import SamplingParams, SpeculativeGenerator, load
from specdecode.models import BUNDLED, models_dir
from specdecode.models.base import extend
from specdecode.models.cache import KEY_CHUNK, KVCache
from specdecode.models.linear import Linear
from specdecode.opener import heads_dir

pytestmark = pytest.mark.heavy  # bit-exact identity on the bundled models: seconds per case

FAMILY = "three-kingdoms"
present = all((models_dir() / f"{FAMILY}/{n}" / "config.json").exists() for n in ("target", "draft-64"))
bundled = pytest.mark.skipif(not present or f"{FAMILY}/target" not in BUNDLED, reason="no bundled family")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GREEDY = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
TEXTS = ["孔明曰：「", "曹操", "玄德大喜，", "却說", "關公", "趙雲引兵", "司馬懿", "吳軍"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(576, 1536), (960, 576)])
def test_invariant_linear_gives_a_row_the_same_result_for_every_row_count(dtype, shape):
    g = torch.Generator().manual_seed(1)
    lin = Linear((torch.randn(*shape, generator=g) * 0.05).to(DTYPES[dtype]))
    x = (torch.randn(64, shape[1], generator=g) * 2).to(DTYPES[dtype])
    alone = torch.cat([lin(x[i : i + 1], invariant=True) for i in range(64)])
    for n in (2, 3, 5, 8, 13, 40, 64):
        together = torch.cat([lin(x[i : i + n], invariant=True) for i in range(0, 64, n)])
        assert torch.equal(together, alone), n


@pytest.fixture(scope="module", params=["bf16", "fp32"])
def family(request):
    if not present:
        pytest.skip("no bundled family")
    dtype = DTYPES[request.param]
    return request.param, load(f"{FAMILY}/target", dtype=dtype), load(f"{FAMILY}/draft-64", dtype=dtype)


@bundled
def test_invariant_forward_gives_a_token_the_same_logits_alone_in_a_block_and_beside_another_row(family):
    _, target, _ = family
    ids = torch.tensor([target.tokenizer.encode("孔明曰：「吾觀天象，")])
    n, T = ids.shape[1], 6
    other = torch.tensor([target.tokenizer.encode("曹操大怒，令許褚出戰")])

    def decode(split: list[int], beside: bool) -> torch.Tensor:
        cache = target.new_cache(1, 128, invariant=True)
        extend(target, cache, ids, torch.tensor([n - T]), need_logits=False)
        if beside:  # a ragged batch: another row, longer, joins this one
            c2 = target.new_cache(1, 128, invariant=True)
            extend(target, c2, other, torch.tensor([other.shape[1]]), need_logits=False)
            cache.add_rows(c2)
        out, at = [], n - T
        for width in split:
            rows = ids[:, at : at + width]
            if beside:
                rows = torch.cat([rows, torch.full_like(rows, 5)])
            out.append(target.forward(rows, cache)[0][:1])
            at += width
        return torch.cat(out, 1)

    alone = decode([1] * T, beside=False)
    for split, beside in (([T], False), ([2, 4], False), ([1] * T, True), ([3, 3], True)):
        assert torch.equal(decode(split, beside), alone), (split, beside)


def _slots(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [layers, B, kv_heads, capacity, D] whatever the value layout."""
    v = cache.v
    if cache.invariant:
        L, nc, B, H, C, D = v.shape
        v = v.permute(0, 2, 3, 1, 4, 5).reshape(L, B, H, nc * C, D)
    return cache.k, v


def test_invariant_cache_moves_rows_and_paths_like_a_plain_cache():
    g = torch.Generator().manual_seed(0)
    caches = [KVCache(2, 3, 2, 70, 4, torch.float32, invariant=inv) for inv in (False, True)]
    assert caches[1].capacity == 2 * KEY_CHUNK
    k, v = torch.randn(2, 3, 2, 70, 4, generator=g), torch.randn(2, 3, 2, 70, 4, generator=g)
    for c in caches:
        ck, cv = _slots(c)
        c.k[..., :70, :] = k
        if c.invariant:
            full = torch.zeros(2, 3, 2, c.capacity, 4)
            full[..., :70, :] = v
            c.v.copy_(full.view(2, 3, 2, -1, KEY_CHUNK, 4).permute(0, 3, 1, 2, 4, 5))
        else:
            c.v.copy_(v)
        c.lengths[:] = 60
        c.keep_path(torch.tensor([50, 60, 62]), [[2, 4], [], [1, 3, 5]])
        c.select_rows(torch.tensor([2, 0]))
        other = KVCache(2, 1, 2, 10, 4, torch.float32, invariant=c.invariant)
        c.add_rows(other)
        c.grow(150)
    (pk, pv), (ik, iv) = _slots(caches[0]), _slots(caches[1])
    assert caches[0].lengths.tolist() == caches[1].lengths.tolist() == [60, 60, 0]
    for b, n in enumerate(caches[0].lengths.tolist()):  # the tokens a row holds (past them: stale)
        assert torch.equal(pk[:, b, :, :n], ik[:, b, :, :n]) and torch.equal(pv[:, b, :, :n], iv[:, b, :, :n])
    assert torch.equal(pk[:, 0, :, :60], k[:, 2, :, :60])  # row 2 moved to row 0 (its path kept)
    row = caches[1].row(1)
    assert torch.equal(_slots(row)[1][:, 0], iv[:, 1])


def _generator(target, draft, method: str, policy: str, tree: str | None, **kw) -> SpeculativeGenerator:
    if method in ("medusa", "eagle"):
        kw["heads"] = heads_dir(f"{FAMILY}/target", method, None)
    if method == "draft":
        kw["draft"] = draft
    return SpeculativeGenerator(
        target, method=method, policy=policy, k=4, tree=tree, batch_invariant=True, **kw
    )


COMBOS = [("ngram", p, None) for p in ("fixed", "heuristic", "confidence", "optimal")] + [
    ("draft", "fixed", None),
    ("early-exit", "fixed", None),
    ("medusa", "fixed", None),
    ("eagle", "fixed", None),
    ("eagle", "confidence", None),
    ("draft", "fixed", "3,2,1"),
    ("medusa", "fixed", "3,2,1"),
    ("eagle", "fixed", "4,2,1"),
]


@bundled
@pytest.mark.parametrize(("method", "policy", "tree"), COMBOS)
def test_greedy_speculative_equals_target_only_alone_in_batch_of_8_and_admitted(family, method, policy, tree):
    _, target, draft = family
    base = SpeculativeGenerator(target, batch_invariant=True)
    want = [base.generate(t, GREEDY)[0].token_ids for t in TEXTS]
    gen = _generator(target, draft, method, policy, tree)
    alone = [gen.generate(t, GREEDY)[0].token_ids for t in TEXTS[:3]]
    assert alone == want[:3]
    assert [r.token_ids for r in gen.generate(TEXTS, GREEDY)] == want
    run = gen.stream(TEXTS[:2], GREEDY)
    for _ in range(3):
        next(run)
    run.add(TEXTS[5], GREEDY)
    assert [r.token_ids for r in run.results()] == [want[0], want[1], want[5]]


@bundled
def test_seeded_sampled_row_is_the_same_alone_and_in_a_batch(family):
    _, target, draft = family
    gen = SpeculativeGenerator(target, draft=draft, k=3, batch_invariant=True)
    params = [SamplingParams(temperature=1.0, max_new_tokens=40, seed=100 + i) for i in range(len(TEXTS))]
    alone = [gen.generate(t, p)[0].token_ids for t, p in zip(TEXTS[:3], params)]
    batch = [r.token_ids for r in gen.generate(TEXTS, params)]
    assert batch[:3] == alone


@bundled
def test_without_batch_invariance_a_bf16_batch_of_8_leaves_target_only():
    """The negative control: the plain forward is not shape-invariant in bf16, so the checks
    above would fail without batch_invariant (measured: 3 of these 8 prompts differ)."""
    target = load(f"{FAMILY}/target", dtype=torch.bfloat16)
    draft = load(f"{FAMILY}/draft-64", dtype=torch.bfloat16)
    want = [SpeculativeGenerator(target).generate(t, GREEDY)[0].token_ids for t in TEXTS]
    got = [r.token_ids for r in SpeculativeGenerator(target, draft=draft, k=4).generate(TEXTS, GREEDY)]
    assert got != want


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_invariant_forward_is_the_same_when_a_verification_crosses_a_key_chunk(tmp_path, dtype):
    """Qwen2's head size (128) and grouped queries, drafts verified across the 64- and 128-key
    chunk boundaries, rejected ones rewound: every token's logits equal its one-token decode.
    (MKL's score GEMM over 64 and over 128 keys differed in the last bits on an AMX Xeon, and a
    near-tie flipped: the scores are now one GEMM per 64-key chunk, whatever the key count.)"""
    from specdecode.models.init import init_model

    path = init_model(
        tmp_path / "m",
        vocab=64,
        layers=2,
        dim=768,
        heads=6,
        kv_heads=2,
        intermediate=256,
        seed=3,
        init_std=0.2,
    )
    model = load(str(path), dtype=DTYPES[dtype])
    assert model.cfg.head_dim == 128
    seq = torch.randint(0, 64, (1, 160), generator=torch.Generator().manual_seed(0))
    start = 52
    ref_cache, cache = (model.new_cache(1, 256, invariant=True) for _ in range(2))
    for c in (ref_cache, cache):
        model.forward(seq[:, :start], c)
    alone = [model.forward(seq[:, i : i + 1], ref_cache)[0][0, 0] for i in range(start, 150)]
    at, keep = start, [3, 5, 1, 4, 5, 2, 5, 5, 3, 4, 5, 2, 5, 1, 5, 4, 3, 5, 5, 2, 4, 5, 3, 5, 5]
    for kept in keep:
        if at + 5 > 150:
            break
        out = model.forward(seq[:, at : at + 5], cache)[0][0]
        for i in range(kept):
            assert torch.equal(out[i], alone[at + i - start]), f"position {at + i}"
        cache.rewind(cache.lengths - (5 - kept))
        at += kept
    assert at > 2 * KEY_CHUNK


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_long_prefill_attended_in_query_blocks_gives_every_token_its_one_token_decode(
    tmp_path, dtype, monkeypatch
):
    """A prompt longer than QUERY_BLOCK is attended block by block, each block over only the key
    chunks it sees: every prompt token's logits and cached keys and values equal those of the
    same prompt decoded one token at a time, and of the prompt prefilled in uneven chunks (the
    torch attention; a float32 model on the kernel attends in C: tests/test_kernels.py)."""
    from specdecode.models import invariant
    from specdecode.models.init import init_model
    from specdecode.models.llama import LlamaModel

    monkeypatch.setattr(LlamaModel, "kernel_attention", property(lambda self: False))

    path = init_model(
        tmp_path / "m",
        vocab=64,
        layers=2,
        dim=384,
        heads=6,
        kv_heads=2,
        intermediate=256,
        seed=4,
        init_std=0.2,
    )
    model = load(str(path), dtype=DTYPES[dtype])
    seq = torch.randint(0, 64, (1, 300), generator=torch.Generator().manual_seed(1))
    made = []
    real = invariant.InvariantAttention.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        made.append(self)

    whole_cache, chunk_cache, one_cache = (model.new_cache(1, 320, invariant=True) for _ in range(3))
    invariant.InvariantAttention.__init__ = spy
    try:
        whole = model.forward(seq, whole_cache)[0][0]
    finally:
        invariant.InvariantAttention.__init__ = real
    assert made and made[0].blocks is not None and len(made[0].blocks) == 5  # the blocked path ran
    assert [n for _, _, n in made[0].blocks] == [1, 2, 3, 4, 5]  # the causal triangle, in chunks
    one = torch.stack([model.forward(seq[:, i : i + 1], one_cache)[0][0, 0] for i in range(300)])
    at, chunks = 0, []
    for width in (70, 130, 1, 99):
        chunks.append(model.forward(seq[:, at : at + width], chunk_cache)[0][0])
        at += width
    assert torch.equal(whole, one)
    assert torch.equal(torch.cat(chunks), one)
    for a, b in zip(_slots(whole_cache), _slots(one_cache)):
        assert torch.equal(a[..., :300, :], b[..., :300, :])


def test_the_in_order_chunk_sum_is_the_same_bits_through_cumsum_and_through_the_loop():
    """A prefill block sums its key chunks with the in-place double loop, a decode step with
    cumsum: the two must agree bit for bit (or every sum takes the loop), else a prompt's keys and
    values would differ from its decode's. A float32 loop does not agree (the negative control)."""
    from specdecode.models.invariant import _double_loop, cumsum_matches_loop, sum_in_order

    g = torch.Generator().manual_seed(3)
    x = torch.randn(31, 2, 64, 128, generator=g) * torch.rand(31, 1, 1, 1, generator=g).mul(50)
    assert torch.equal(sum_in_order(x), _double_loop(x))
    if cumsum_matches_loop():
        assert torch.equal(x.cumsum(dim=0)[-1], _double_loop(x))
    single = x[0].clone()
    for chunk in x[1:]:
        single.add_(chunk)
    assert not torch.equal(single, _double_loop(x))


@bundled
def test_rows_joining_through_free_slots_and_staged_storage_keep_target_only_tokens(family):
    """Rows admitted between rounds into a free slot (stale keys of a finished row past their
    length) and into storage staged while their prefill ran: the same bits as target-only."""
    _, target, draft = family
    params = [
        SamplingParams(
            temperature=0 if i % 3 else 1.0,
            seed=i,
            max_new_tokens=n,
            ignore_eos=True,
            sampling_rule="invariant",
        )
        for i, n in enumerate((6, 30, 12, 90, 8, 20, 70, 10))
    ]
    base = SpeculativeGenerator(target, batch_invariant=True)
    want = [base.generate(t, p)[0].token_ids for t, p in zip(TEXTS, params)]
    gen = SpeculativeGenerator(target, draft=draft, k=3, batch_invariant=True)
    tokens, joins = churn(gen, TEXTS, params)
    assert tokens == want
    assert joins["free"] and joins["staged"], joins


@bundled
def test_rows_of_very_different_lengths_attend_in_groups_with_the_bits_of_each_row_alone(family, monkeypatch):
    """A short row beside 150- and 300-token ones attends over its own key chunks (its own group), not the
    long row's: every row's logits equal its own decode alone. Negative control: a group given one
    key chunk too few changes the long row's logits."""
    from specdecode.models import invariant

    _, target, _ = family
    # the torch attention under test (a float32 model on the kernel attends in C, one query at a time)
    monkeypatch.setattr(type(target), "kernel_attention", property(lambda self: False))
    texts = [TEXTS[0], TEXTS[1] * 150, TEXTS[2], TEXTS[3] * 150]  # 2, 150, 3 and 300 tokens
    ids = [target.tokenizer.encode(t) for t in texts]
    nxt = torch.tensor([[5, 9, 2]] * len(ids))

    def decode(rows: list[int]) -> torch.Tensor:
        cache = None
        for b in rows:
            c = target.new_cache(1, 512, invariant=True)
            extend(target, c, torch.tensor([ids[b]]), torch.tensor([len(ids[b])]), need_logits=False)
            cache = c if cache is None else (cache.add_rows(c) or cache)
        return target.forward(nxt[rows], cache)[0]

    alone = torch.cat([decode([b]) for b in range(len(ids))])
    seen = []
    real = invariant._row_groups
    monkeypatch.setattr(invariant, "_row_groups", lambda ends: seen.append(real(ends)) or seen[-1])
    assert torch.equal(decode(list(range(len(ids)))), alone)
    assert len(seen[-1]) == 4, seen[-1]  # short, long, short, long: four groups
    short = lambda ends: [(a, b, n - 1 if n > 1 else n) for a, b, n in real(ends)]  # noqa: E731
    monkeypatch.setattr(invariant, "_row_groups", short)
    assert not torch.equal(decode(list(range(len(ids)))), alone)


@bundled
def test_a_deferred_row_warmed_later_holds_the_draft_keys_of_a_row_prefilled_at_admission(family, monkeypatch):  # noqa: E501
    """A row whose draft prefill was deferred drafts nothing while cold, though the other rows'
    draft forwards run over it; warmed after 3 rounds, its draft model's keys and values are bit
    for bit those of the same row prefilled at admission, and greedy tokens equal target-only.
    Negative control: keeping what the chain's forwards wrote past the cold row's tokens
    (no _keep_cold) leaves keys that are not the row's."""
    from specdecode.drafters.draft_model import DraftModelDrafter

    _, target, draft = family
    texts = ["孔明曰：「吾觀天象，", TEXTS[1]]
    gen = SpeculativeGenerator(target, draft=draft, k=3, batch_invariant=True)
    want = SpeculativeGenerator(target, batch_invariant=True).generate(texts, GREEDY)

    def warmed_keys() -> tuple[torch.Tensor, list]:
        run = gen.stream(texts, GREEDY, defer=[True, False])
        for _ in range(3):
            next(run)
        ((b, _),) = run.cold_rows()
        run.warm(b)
        n = int(run.state.cache.lengths[b])
        return run.state.cache.k[:, b, ..., :n, :].clone(), [r.token_ids for r in run.results()]

    keys, tokens = warmed_keys()
    assert tokens == [r.token_ids for r in want]
    ref = gen.stream(texts, GREEDY)  # the same row, prefilled at admission
    for _ in range(3):
        next(ref)
    n = min(keys.shape[-2], int(ref.state.cache.lengths[0]))  # the tokens both rows hold
    assert n > len(target.tokenizer.encode(texts[0]))  # the prompt and some answer
    assert torch.equal(ref.state.cache.k[:, 0, ..., :n, :], keys[..., :n, :])
    monkeypatch.setattr(DraftModelDrafter, "_keep_cold", staticmethod(lambda state, held: None))
    broken, _ = warmed_keys()
    assert not torch.equal(ref.state.cache.k[:, 0, ..., :n, :], broken[..., :n, :])


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "w8a8"])
def test_a_forward_carrying_riders_gives_every_call_the_bits_it_gets_alone(tmp_path, fmt):
    """A server's prompt chunks ride the running rows' round (LlamaModel.ride): one pass over
    the weights, their rows stacked in every projection, each call attending in its own cache.
    The round's logits, each rider's logits and hidden states, and every key and value written
    equal those of the same forwards made one after another."""
    from specdecode.models.base import ForwardMeta
    from specdecode.models.init import init_model

    path = init_model(
        tmp_path / "m", vocab=64, layers=2, dim=128, heads=4, kv_heads=2, intermediate=96, seed=5
    )
    dtype, quant = (torch.float32, "w8a8") if fmt == "w8a8" else (DTYPES[fmt], None)
    model = load(str(path), dtype=dtype, quant=quant)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 64, (3, 120), generator=g)

    def setup():
        batch = model.new_cache(2, 160, invariant=True)  # two rows decoding, at lengths 30 and 75
        for b, n in ((0, 30), (1, 75)):
            row = batch.row(b)
            model.forward(seq[b : b + 1, :n], row)
            batch.lengths[b] = n
        prompt = model.new_cache(1, 160, invariant=True)  # an admission, 20 tokens in
        model.forward(seq[2:3, :20], prompt)
        return batch, prompt

    round_tokens = torch.stack([seq[0, 30:33], seq[1, 75:78]])  # a verification of 3 per row
    chunk, meta = seq[2:3, 20:61], ForwardMeta(return_hidden=True, logits_at=torch.tensor([40]))
    batch, prompt = setup()
    alone_round = model.forward(round_tokens, batch)[0]
    alone_logits, alone_hidden = model.forward(chunk, prompt, meta)
    alone_slots = [_slots(c) for c in (batch, prompt)]

    batch, prompt = setup()
    got = []
    model.ride(chunk, prompt, meta, lambda logits, hidden: got.append((logits, hidden)))
    carried_round = model.forward(round_tokens, batch)[0]
    assert len(got) == 1 and not model.riders  # carried by that forward
    assert torch.equal(carried_round, alone_round)
    assert torch.equal(got[0][0], alone_logits) and torch.equal(got[0][1], alone_hidden)
    for (k, v), (k0, v0), n in zip((_slots(c) for c in (batch, prompt)), alone_slots, (78, 61)):
        assert torch.equal(k[..., :n, :], k0[..., :n, :]) and torch.equal(v[..., :n, :], v0[..., :n, :])
    assert prompt.lengths.tolist() == [61] and batch.lengths.tolist() == [33, 78]

    # a forward that cannot carry (an early exit) leaves the rider for the next one
    model.ride(seq[2:3, 61:70], prompt, ForwardMeta(), lambda *out: got.append(out))
    model.forward(seq[:2, 33:34], model.new_cache(2, 160, invariant=True), ForwardMeta(num_layers=1))
    assert len(got) == 1 and len(model.riders) == 1
    model.flush_riders()
    assert len(got) == 2 and not model.riders and prompt.lengths.tolist() == [70]


@bundled
@pytest.mark.parametrize("threads", [2, 4])
def test_a_prefill_gives_its_first_tokens_the_same_keys_whatever_its_length_and_thread_count(threads):
    """The three-kingdoms target's MLP is 688 wide: torch splits its silu between threads at
    rows x 688 / threads elements, mid-row for odd row counts, where the scalar exp takes over
    from the vectorized one; the rows then go in one-thread slices (models/llama.py _mlp). Whole
    prefills of 58 to 199 tokens must give tokens 0..57 the keys and values of the 58-token one
    in every layer (without the slicing: 65 and 99 tokens differ on 2 threads, more on 4)."""
    target = load(models_dir() / FAMILY / "target")
    tokens = torch.randint(20, 1900, (1, 200), generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:

        def prefill(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            cache = target.new_cache(1, n + 1, invariant=True)
            target.forward(tokens[:, :n], cache)
            return cache.k[:, 0, :, :58].clone(), cache.v[:, 0, 0, :, :58].clone()

        keys, values = prefill(58)
        for n in (64, 65, 70, 99, 100, 129, 130, 150, 199):
            k, v = prefill(n)
            assert torch.equal(k, keys) and torch.equal(v, values), n
    finally:
        torch.set_num_threads(before)


def _inaccurate(op):
    """A float64 sin or cos that, like the share of a table one thread computed in a server,
    is accurate to ~1e-9 instead of ~1e-16 (enough to move float32 entries by an ulp)."""

    def wrong(x, *args, **kwargs):
        out = op(x, *args, **kwargs)
        return out + 3e-9 * torch.sign(out) if out.dtype == torch.float64 else out

    return wrong


def test_rope_tables_keep_every_position_as_they_grow_whatever_torchs_sin_and_cos_give(pair_dir, monkeypatch):
    """A key cached early (a prefix-cache block, a row beside a long admission) must meet the table
    a later key meets: in a server the first table's positions 128-255 came out of torch's float64
    sin an ulp away (float32) from every later table's, and every row reusing those keys differed
    from a whole prefill. Tables come from the C library one angle at a time (models/rope.py) and a
    growth keeps the positions it has: so neither a wrong vectorized sin nor growing in steps
    changes an entry."""
    import math

    target = load(pair_dir[0])
    target._rope_tables(2048)
    cos, sin = target._cos.clone(), target._sin.clone()
    D = target.cfg.head_dim
    monkeypatch.setattr(torch.Tensor, "sin", _inaccurate(torch.Tensor.sin))
    monkeypatch.setattr(torch.Tensor, "cos", _inaccurate(torch.Tensor.cos))
    monkeypatch.setattr(torch, "sin", _inaccurate(torch.sin))
    monkeypatch.setattr(torch, "cos", _inaccurate(torch.cos))
    grown = load(pair_dir[0])
    for need in (1, 200, 256, 300, 700, 2048):
        grown._rope_tables(need)
        n = grown._cos.shape[0]
        assert torch.equal(grown._cos, cos[:n]) and torch.equal(grown._sin, sin[:n]), need
    # and the values are the C library's, rounded once
    theta = target.cfg.rope_theta
    for p, j in [(1, 0), (130, 1), (200, D // 2 - 1), (1999, D // 4)]:
        angle = p * (1.0 / theta ** (2 * j / D))
        assert cos[p, j] == torch.tensor(math.cos(angle)).to(cos.dtype) == cos[p, j + D // 2]
        assert sin[p, j + D // 2] == torch.tensor(math.sin(angle)).to(sin.dtype) == -sin[p, j]


def test_a_w8a8_model_gives_the_same_bits_whichever_int8_kernel_each_row_count_takes(tmp_path, monkeypatch):
    """w8a8 products run through FBGEMM or oneDNN by row count, as measured at load
    (choose_int8_kernels): a prefill, a verification of 5 tokens and the one-token steps give
    the same logits and keys with FBGEMM everywhere, oneDNN from 2 rows (a verification on
    oneDNN, its steps on FBGEMM) and oneDNN everywhere; so a verification's logits stay a
    step's. Where oneDNN's int8 linear is not FBGEMM's bit for bit here, only FBGEMM runs."""
    from specdecode.models import llama, quant
    from specdecode.models.init import init_model

    if not quant.onednn_exact(quant._int8_gemm_engine()[1]):
        pytest.skip("oneDNN's int8 linear is not FBGEMM's bits on this CPU: FBGEMM runs every product")
    path = init_model(
        tmp_path / "m", vocab=64, layers=2, dim=128, heads=4, kv_heads=2, intermediate=96, seed=3
    )
    monkeypatch.setattr(llama, "choose_int8_kernels", lambda linears: {})  # keep both copies
    model = load(str(path), dtype=torch.float32, quant="w8a8")
    seq = torch.randint(0, 64, (1, 48), generator=torch.Generator().manual_seed(1))

    def run(onednn_from):
        for _, lin in model.linears():
            lin.onednn_from = onednn_from
        cache = model.new_cache(1, 64, invariant=True)
        pre = model.forward(seq[:, :40], cache)[0]
        verify = model.forward(seq[:, 40:45], cache)[0]
        cache.rewind(cache.lengths - 5)
        steps = torch.cat([model.forward(seq[:, i : i + 1], cache)[0] for i in range(40, 45)], 1)
        return pre, verify, steps, _slots(cache)[0][..., :45, :].clone()

    fbgemm = run(None)
    assert torch.equal(fbgemm[1], fbgemm[2])  # a verification's logits are its steps'
    for onednn_from in (2, 1):
        got = run(onednn_from)
        for a, b in zip(got, fbgemm):
            assert torch.equal(a, b), onednn_from


def test_loading_a_w8a8_model_keeps_each_projection_on_the_kernels_it_calls(tmp_path):
    """After the load-time measurement every w8a8 projection holds the packed weights it will
    call and no others: oneDNN's alone where it is ahead from one row, FBGEMM's alone where
    never, both where the rows split them."""
    from specdecode.models.init import init_model
    from specdecode.models.quant import DynamicInt8Linear

    path = init_model(
        tmp_path / "m", vocab=64, layers=2, dim=128, heads=4, kv_heads=2, intermediate=96, seed=3
    )
    model = load(str(path), dtype=torch.float32, quant="w8a8")
    lins = [lin for _, lin in model.linears()]
    assert lins and all(isinstance(lin, DynamicInt8Linear) for lin in lins)
    assert set(model.int8_kernels) == {(lin.out_features, lin.in_features) for lin in lins}
    for lin in lins:
        start = model.int8_kernels[(lin.out_features, lin.in_features)]
        assert lin.onednn_from == start
        assert (lin.onednn is not None) == (start is not None)
        assert (lin.packed is not None) == (start is None or start > 1)
