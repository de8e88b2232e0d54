"""Drafting methods (ngram, early-exit) and draft-length policies: their parts (lookup, the
early-exit cache, per-row policies). Their greedy identity and sampled distribution through the
engine are rows of tests/test_contract.py."""

import numpy as np
import pytest
import torch

from helpers import check_distribution
from specdecode import SamplingParams, SpecDecodeError, SpeculativeGenerator, load
from specdecode.core.sampling import Warp
from specdecode.drafters import DraftContext
from specdecode.drafters.ngram import lookup
from specdecode.engine.policy import CostModel, HeuristicPolicy, OptimalPolicy, RoundOutcome
from specdecode.engine.verify import verify_chain
from specdecode.models.base import ForwardMeta
from specdecode.models.init import init_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 64 for j in range(1 + (5 * i) % 12)] for i in range(12)]


@pytest.fixture(scope="module")
def models(pair_dir):
    target, draft = pair_dir
    return load(target, dtype=torch.float64), load(draft, dtype=torch.float64)


# a cost model under which drafting pays (the measured one says it does not for these tiny pairs,
# and the optimal policy then never drafts): the k it picks changes, exactness must not
CHEAP = CostModel({0: 0.01, 1: 0.0105, 4: 0.012})  # R(k) = 0.0005 k + 0.01 s


def generator(models, method, policy, k=3, **kw):
    target, draft = models
    if policy == "optimal":
        kw.setdefault("cost_model", CHEAP)
    return SpeculativeGenerator(
        target, draft=draft if method == "draft" else None, k=k, method=method, policy=policy, **kw
    )


# -- sampling exactness through the engine -------------------------------------------------


@pytest.mark.heavy
def test_rows_with_fewer_drafts_are_verified_as_if_they_drafted_only_those():
    """verify_chain with draft_lengths: the first emitted token follows p_0 whatever the length."""
    rng = np.random.default_rng(0)
    V, B = 12, 200_000
    p = torch.tensor(rng.dirichlet(np.ones(V), size=3))  # positions 0..2
    q = torch.tensor(rng.dirichlet(np.ones(V), size=2))
    g = torch.Generator().manual_seed(0)
    drafts = torch.stack([torch.multinomial(q[i], B, replacement=True, generator=g) for i in range(2)], 1)
    lengths = torch.randint(0, 3, (B,), generator=g)
    v = verify_chain(
        drafts,
        q.expand(B, 2, V),
        p.expand(B, 3, V),
        torch.rand(B, 2, generator=g, dtype=torch.float64),
        torch.empty(B, V, dtype=torch.float64).exponential_(generator=g),
        lengths,
    )
    assert bool((v.accepted <= lengths).all())
    for n in range(3):
        rows = lengths == n
        ok, msg = check_distribution(v.tokens[rows, 0].numpy(), p[0].numpy())
        assert ok, f"length {n}: {msg}"
    # a row that drafted nothing emits a bonus token from p_0
    assert bool(v.bonus[lengths == 0].all())


# -- ngram, early exit, policies ------------------------------------------------------------


def test_ngram_lookup_takes_the_longest_recent_suffix_match():
    ctx = np.array([1, 2, 3, 9, 1, 2, 4, 7, 1, 2])
    assert lookup(ctx, 3, 3, 1).tolist() == [4, 7, 1]  # (1, 2) last seen at 4, followed by 4 7 1
    ctx = np.array([5, 1, 2, 3, 8, 2, 3, 6, 1, 2, 3])
    assert lookup(ctx, 2, 3, 1).tolist() == [8, 2]  # (1, 2, 3) beats the later (2, 3)
    assert lookup(np.array([1, 2, 3, 4]), 4, 3, 1).tolist() == []
    long = np.tile(np.arange(100), 82)  # 8,200 tokens
    assert lookup(long, 4, 3, 1).tolist() == [0, 1, 2, 3]


def test_early_exit_draft_is_the_first_layers_and_the_cache_ends_as_a_fresh_prefill(models):
    target, _ = models
    gen = SpeculativeGenerator(target, k=3, method="early-exit", exit_layer=1)
    prompt = [3, 14, 15, 9, 26]
    params = SamplingParams(temperature=1.0, max_new_tokens=17, seed=3, ignore_eos=True)
    run = gen.stream([prompt], params)
    events = list(run)
    (res,) = run.results()
    assert sum(len(e.emitted[0]) for e in events) == 17 and res.stats.accepted > 0
    # the draft probs of each round's first token are the 1-layer exit at the context so far
    seq = list(prompt)
    for ev in events[:5]:
        (rec,) = ev.records()
        logits = target.forward(torch.tensor([seq]), target.new_cache(1, 64), ForwardMeta(num_layers=1))[0][
            0, -1
        ]
        q = torch.softmax(logits, -1)
        assert rec.draft_prob[0] == pytest.approx(float(q[rec.draft_token_ids[0]]), rel=1e-9)
        seq += rec.emitted_token_ids
    # after the run, the shared cache holds exactly what a fresh prefill of the text gives
    cache = target.new_cache(1, 64)
    text = prompt + res.token_ids
    drafter = SpeculativeGenerator(target, k=3, method="early-exit", exit_layer=1).drafter
    live = target.new_cache(1, 64)
    target.forward(torch.tensor([text[:-1]]), live)
    tokens = torch.zeros(1, 64, dtype=torch.long)
    tokens[0, : len(text)] = torch.tensor(text)
    ctx = DraftContext(tokens, torch.tensor([len(text)]), Warp.greedy(1), None)
    state = drafter.start(ctx, live)
    drafter.propose(state, ctx, torch.tensor([3]))  # drafts write past the length ...
    assert int(live.lengths[0]) == len(text) - 1  # ... without moving it
    target.forward(torch.tensor([text[-1:]]), live)
    target.forward(torch.tensor([text]), cache)
    n = len(text)
    assert torch.allclose(live.k[:, :, :, :n], cache.k[:, :, :, :n], atol=1e-12)
    assert torch.allclose(live.v[:, :, :, :n], cache.v[:, :, :, :n], atol=1e-12)


def test_early_exit_needs_the_lean_runtime_and_a_valid_layer(models, tmp_path):
    target, _ = models
    with pytest.raises(SpecDecodeError, match="exit layer must be in 1..1"):
        SpeculativeGenerator(target, method="early-exit", exit_layer=2)
    hf = load(init_model(tmp_path / "m", vocab=64, layers=2, dim=32, seed=0), backend="hf")
    with pytest.raises(SpecDecodeError, match="lean runtime"):
        SpeculativeGenerator(hf, method="early-exit")


def outcome(drafted: int, accepted: int, rows: int = 1) -> RoundOutcome:
    """One round in which every row drafted `drafted` tokens and accepted `accepted`."""
    tested = min(accepted + 1, drafted)
    return RoundOutcome([drafted] * rows, [tested] * rows, [accepted] * rows)


def optimal(k=4, max_k=None, target_s=(0.01, 0.01), draft_s=0.0004, **kw) -> OptimalPolicy:
    """An optimal policy over one row whose rounds cost R(k) = k·d + F(k + 1): the target
    forward F over k + 1 tokens (linear through F(1) and F(k + 1)) and d per draft token."""
    f1, fk = target_s
    forward = lambda n: f1 + (fk - f1) * (n - 1) / k  # noqa: E731
    cost = CostModel({j: j * draft_s + forward(j + 1) for j in (0, 1, k)})
    p = OptimalPolicy(k, cost, max_k, **kw)
    p.add_rows(1)
    return p


def test_heuristic_policy_adds_two_after_full_acceptance_and_drops_one_otherwise_per_row():
    p = HeuristicPolicy(4, max_k=7)
    p.add_rows(2)
    p.observe(RoundOutcome([4, 4], [4, 1], [4, 0]))
    assert p.next_k() == [6, 3]  # each row by its own round
    p.observe(RoundOutcome([6, 3], [6, 3], [6, 3]))
    assert p.next_k() == [7, 5]  # capped
    for _ in range(10):
        p.observe(RoundOutcome([7, 5], [1, 1], [0, 0]))
    assert p.next_k() == [1, 1]  # never below 1


def test_prefix_policy_stops_a_row_when_the_product_of_its_draft_probabilities_falls_below():
    """The prefix policy drafts up to max_k and stops a row after the token that takes the product
    of its draft probabilities this round below the threshold; the confidence policy looks at
    each token's own probability. Rows of one chain: probabilities 0.9 each (products 0.9, 0.81,
    0.729, 0.656, 0.59, ...) and 0.6 each (0.6, 0.36, ...)."""
    from specdecode.core.config import SpecConfig
    from specdecode.drafters.base import DraftChain, PrefixThreshold
    from specdecode.engine.policy import PrefixPolicy, make_policy

    def chain_lengths(stop_below, limit=8) -> list[int]:
        ctx = DraftContext(torch.zeros(2, 16, dtype=torch.long), torch.tensor([3, 3]), Warp.greedy(2), None)
        chain = DraftChain(ctx, torch.tensor([limit, limit]), stop_below)
        top = torch.log(torch.tensor([[0.9, 0.1 / 3, 0.1 / 3, 0.1 / 3], [0.6, 0.4 / 3, 0.4 / 3, 0.4 / 3]]))
        for _ in range(limit):
            if chain.draw(top)[1]:
                break
        return chain.proposal().draft_lengths().tolist()

    assert chain_lengths(PrefixThreshold(0.6)) == [5, 2]  # the fifth token takes 0.9 ^ 5 = 0.59 below
    assert chain_lengths(PrefixThreshold(0.7)) == [4, 1]
    assert chain_lengths(0.7) == [8, 1]  # per token: 0.9 never falls below
    policy = make_policy(SpecConfig(method="draft", k=3, policy="prefix"))
    assert isinstance(policy, PrefixPolicy) and policy.max_k == 8 and policy.next_k() == []
    policy.add_rows(2)
    assert policy.next_k() == [8, 8] and isinstance(policy.stop_below, PrefixThreshold)
    assert policy.stop_below == 0.4  # no measured costs: the default
    with pytest.raises(SpecDecodeError, match="prefix threshold"):
        PrefixPolicy(4, 1.0)


def test_optimal_policy_follows_theorem_3_8_and_turns_drafting_off_when_it_cannot_pay():
    from specdecode.core.theory import optimal_k

    cheap = optimal(max_k=16)
    for _ in range(50):
        cheap.observe(outcome(4, 3))  # alpha ~ 0.75, c = 0.04
    (k,) = cheap.next_k()
    alpha = OptimalPolicy.alpha(cheap.rows[0])
    # verification as cheap as one token: exactly Theorem 3.8 with c = d / F(1) = 0.04
    assert k == optimal_k(alpha, 0.0004 / 0.01, 16) > 4
    dear = optimal(draft_s=0.006, probe_every=4)
    for _ in range(50):
        dear.observe(outcome(4, 0))  # c = 0.6, alpha ~ 0.02
    assert max(dear.speedups(OptimalPolicy.alpha(dear.rows[0]))) == 1.0 < max(dear.speedups(1.0))
    ks = [dear.next_k()[0] for _ in range(28)]
    # off, probing with k = 1 after 4 rounds, then after 8, then 16 (each probe doubles the wait)
    assert [i + 1 for i, k in enumerate(ks) if k] == [4, 12, 28] and set(ks) == {0, 1}
    # verification five times a plain step (a large batch): no k pays even at alpha = 1
    hopeless = optimal(target_s=(0.01, 0.05), draft_s=0.006, probe_every=4)
    assert hopeless.hopeless and [hopeless.next_k()[0] for _ in range(40)] == [0] * 40


def test_optimal_policy_explores_until_min_tests_before_turning_drafting_off():
    p = optimal(target_s=(0.01, 0.011), draft_s=0.005, min_tests=8)
    ks = []
    for _ in range(12):  # the first draft token always rejected (one test), drafts half a forward
        (k,) = p.next_k()
        ks.append(k)
        p.observe(RoundOutcome([k], [min(k, 1)], [0]))
    # one early rejection did not decide: k = 1 and the given k in turn until 8 tests, then off
    assert ks[:8] == [1, 4] * 4 and ks[8:] == [0] * 4, ks


def test_optimal_policy_shortens_k_then_stops_as_verification_becomes_compute_bound():
    ks = []
    for slope in (0.0, 0.1, 0.5, 2.0):  # T(n) = T(1) (1 + slope (n - 1)), as in a growing batch
        p = optimal(max_k=16, target_s=(0.01, 0.01 * (1 + 4 * slope)))
        for _ in range(50):
            p.observe(outcome(4, 3))
        ks.append(p.next_k()[0])
    assert ks[0] > ks[1] > ks[2] > ks[3] == 0, ks
    assert ks[2] == 1  # slope 0.5: S(1) = 1.75 / 1.54 = 1.13 beats S(2) = 2.31 / 2.08 = 1.11


def test_optimal_policy_cost_model_is_measured_once_per_generator_and_saved_as_given(models, tmp_path):
    gen = generator(models, "draft", "optimal", cost_model=None)
    assert gen.cost_model is None
    gen.generate(PROMPTS[:2], GREEDY)
    cost = gen.cost_model
    assert cost is not None and set(cost.round_s) == {0, 1, 3} and cost.batch_size == 2
    # measured, not assumed: every round took time (their order is a timing and depends on what
    # else the machine runs, so it is not asserted here; benchmarks/ measures it)
    assert all(cost.round_cost(k) > 0 for k in (0, 1, 3))
    gen.generate(PROMPTS[:3], GREEDY)
    assert gen.cost_model is cost  # not re-timed
    cost.save(tmp_path / "cost.json")
    again = generator(models, "draft", "optimal", cost_model=tmp_path / "cost.json").cost_model
    assert again == cost
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SpecDecodeError, match="cost model"):
        generator(models, "draft", "optimal", cost_model=tmp_path / "bad.json")


def test_unknown_policy_and_bad_threshold_are_clear_errors(models):
    with pytest.raises(SpecDecodeError, match="unknown policy"):
        SpeculativeGenerator(models[0], k=2, method="ngram", policy="greedy")
    with pytest.raises(SpecDecodeError, match="confidence threshold"):
        SpeculativeGenerator(models[0], k=2, method="ngram", policy="confidence", confidence_threshold=1.5)
    with pytest.raises(SpecDecodeError, match="only used by methods 'draft' and 'auto'"):
        SpeculativeGenerator(models[0], draft=models[1], method="ngram")
