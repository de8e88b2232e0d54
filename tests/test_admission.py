"""What a server stands on, offline: chunked prefill (a prompt fed in pieces between rounds gives
the same tokens as one fed whole), automatic prefix caching (blocks reused across requests:
the same tokens and the same seeded samples, LRU eviction within a byte budget, only whole
prefixes match) and round costs learned online (drafting stops when rounds get slow, and starts
again when they do not)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator, load
from specdecode.engine.policy import FixedPolicy, LoadAwarePolicy, LoadCosts, OnlineCosts, RoundOutcome
from specdecode.engine.prefix import PrefixCache
from specdecode.errors import SpecDecodeError
from specdecode.models.cache import BLOCK

ROOT = Path(__file__).resolve().parents[1]
FAMILY = ROOT / "models" / "three-kingdoms"
TEXT = "话说天下大势，分久必合，合久必分。周末七国分争，并入于秦。及秦灭之后，楚、汉分争，又并入于汉。" * 4

# every drafter family that keeps state of its own (draft model cache, EAGLE features, Medusa's
# last hidden state, early exit's shared cache), copy drafters, and target-only
METHODS = {
    "none": {},
    "draft": {"draft": "draft-64"},
    "eagle": {"heads": "eagle"},
    "medusa": {"heads": "medusa"},
    "early-exit": {},
    "ngram": {},
    "auto": {"draft": "draft-64"},
}
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_new_tokens=40),
    "seeded-standard": SamplingParams(temperature=1.0, seed=5, max_new_tokens=40),
    "seeded-invariant": SamplingParams(temperature=1.0, seed=5, max_new_tokens=40, sampling_rule="invariant"),
}


# every method greedy; the seeded rules with a draft model and with EAGLE (the drafters whose
# state is rebuilt or reused: the rules' draws must not notice). auto's suffix cache keeps every
# earlier answer, so its drafts differ between two runs, and the standard rule's seeded samples
# depend on the drafts (the invariant rule's do not): auto is checked greedy and invariant.
CASES = (
    [(m, "greedy") for m in METHODS]
    + [(m, r) for m in ("draft", "eagle") for r in ("seeded-standard", "seeded-invariant")]
    + [("auto", "seeded-invariant")]
)


@pytest.fixture(scope="module")
def models():
    return {name: load(FAMILY / name) for name in ("target", "draft-64")}


def generator(models, method: str) -> SpeculativeGenerator:
    opts = dict(METHODS[method])
    draft = models[opts.pop("draft")] if "draft" in opts else None
    if "heads" in opts:
        opts["heads"] = FAMILY / opts["heads"]
    return SpeculativeGenerator(
        models["target"],
        draft,
        k=3,
        method=None if method == "none" else method,
        batch_invariant=True,
        **opts,
    )


@pytest.mark.parametrize("ride", [False, True], ids=["own-forward", "riding"])
@pytest.mark.parametrize(("method", "rule"), CASES)
def test_chunked_prefill_gives_the_tokens_of_a_whole_prefill(models, method, rule, ride):
    """Two prompts (one of 170 tokens) admitted into a running batch and fed 7, 64 or 100
    tokens at a time, a round of the running row between chunks: each row's tokens are the
    ones it gets prefilled whole in a batch of its own. riding: each chunk rides the running
    row's round (one pass over the weights, LlamaModel.ride), as the server runs them."""
    params = PARAMS[rule]
    prompts = [TEXT + "曹操", TEXT[:40]]
    whole = generator(models, method).generate(prompts, params)
    gen = generator(models, method)
    target = models["target"]
    run = gen.stream([TEXT[:10]], params)
    admitted, carried = [], 0
    for budget in (7, 64, 100):
        prefill = run.begin(prompts, params)
        steps = 0
        while not prefill.done:
            assert prefill.step(budget, ride) <= budget
            waiting = bool(target.riders)
            next(run, None)
            carried += waiting and not target.riders
            target.flush_riders()  # what no round carried (the running row has finished)
            steps += 1
        assert steps > 1 or budget == 100 and method == "none"
        admitted.append(run.join(prefill))
    results = run.results()
    for ids in admitted:
        assert [results[i].token_ids for i in ids] == [r.token_ids for r in whole]
    assert (carried > 0) == ride


@pytest.mark.parametrize("method", ["draft", "auto"])
def test_a_draft_models_prefill_takes_turns_with_the_targets_chunks(models, method):
    """Between two rounds a chunked admission of a prompt longer than the budget runs either a
    target chunk or the draft model's catch-up on tokens the target already has, never both (a
    step of each would cost a round's worth of extra latency); the admission is done only when
    the draft has caught up. A prompt that fits the budget takes one step of both."""
    gen = generator(models, method)
    run = gen.stream([TEXT[:10]], PARAMS["greedy"])
    prefill = run.begin([TEXT], PARAMS["greedy"])
    draft_cache = gen.drafter.caches(prefill.state)[0]
    seen = []
    while not prefill.done:
        target_before, draft_before = int(prefill.cache.lengths[0]), int(draft_cache.lengths[0])
        fed = prefill.step(16)
        moved = (int(prefill.cache.lengths[0]) - target_before, int(draft_cache.lengths[0]) - draft_before)
        if fed and moved[1]:  # the last piece fits the budget: both in one step
            assert moved == (fed, fed) and prefill.done, moved
        else:
            assert moved == (fed, 0) if fed else moved[0] == 0 and 0 < moved[1] <= 16, moved
        seen.append("b" if fed and moved[1] else "t" if fed else "d")
        next(run, None)
    assert "".join(seen[:4]) == "tdtd" and seen[-1] in "db" and "b" not in seen[:-1]
    assert int(draft_cache.lengths[0]) == int(prefill.cache.lengths[0]) == int(prefill.goal[0])
    short = run.begin([TEXT[:12]], PARAMS["greedy"])
    short_draft = gen.drafter.caches(short.state)[0]
    assert short.step(16) == int(short.goal[0]) and short.done
    assert int(short_draft.lengths[0]) == int(short.goal[0])


@pytest.mark.parametrize(("method", "rule"), CASES)
def test_prefix_cache_reuses_blocks_and_changes_no_token(models, method, rule):
    """A request that shares a 128-token prefix with an earlier one takes those blocks from the
    cache (the target's keys and values, and the drafter's own state) and still gives the tokens
    and seeded samples it gives without the cache; EAGLE's drafts are unchanged too (its
    features come back from the blocks)."""
    params = PARAMS[rule]
    prompts = [TEXT + "曹操", TEXT[:40]]
    cold = generator(models, method).generate(prompts, params)
    gen = generator(models, method)
    cache = gen.enable_prefix_cache(64 << 20)
    gen.generate([TEXT + "刘备"], params)  # fills the cache
    assert len(cache) >= 2
    hit = cache.stats.hit
    warm = gen.generate(prompts, params)
    assert cache.stats.hit - hit >= 2 * BLOCK  # the long prompt's first blocks were reused
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
    if method in ("eagle", "medusa", "early-exit", "none"):  # drafts depend only on exact states
        assert [r.stats.accepted for r in warm] == [r.stats.accepted for r in cold]


# the admissions that draft nothing in their first round: no drafter, or every row's draft
# prefill deferred (a server's choice); the standard rule's seeded rows are never deferred
FIRST_CASES = [("none", r) for r in PARAMS]
FIRST_CASES += [(m, r) for m in ("draft", "auto") for r in ("greedy", "seeded-invariant")]


@pytest.mark.parametrize(("method", "rule"), FIRST_CASES)
def test_a_first_token_from_the_prefill_is_the_first_rounds_token(models, method, rule):
    """An admission that drafts nothing in its first round takes its first token from the
    prefill's own forward (first=True): an event without a forward, before any round, and then
    every token and seeded sample the rows get from a first round; with the prefix cache cold and
    warm (the tail after the reused blocks), in a fresh batch and fed in chunks into a running
    one. A row asking for one token ends at that event."""
    params = [PARAMS[rule], PARAMS[rule], replace(PARAMS[rule], max_new_tokens=1)]
    prompts = [TEXT + "曹操", TEXT[:40], TEXT[:20]]
    want = [r.token_ids for r in generator(models, method).generate(prompts, params)]
    gen = generator(models, method)
    gen.enable_prefix_cache(64 << 20)
    defer = None if method == "none" else [True] * 3

    def rest(run, ids: list[int]) -> list[list[int]]:
        first = next(run)
        assert not first.forward and first.rows == ids and [len(e) for e in first.emitted] == [1, 1, 1]
        assert first.finished == [False, False, True]
        if defer is not None:
            run.warm([b for b, _ in run.cold_rows()])
        results = run.results()
        assert all(results[i].stats.target_forwards == results[i].stats.rounds - 1 for i in ids)
        return [results[i].token_ids for i in ids]

    hits = gen.prefix_cache.stats.hit
    for _ in range(2):  # the cache cold, then warm
        assert rest(gen.stream(prompts, params, defer=defer, first=True), [0, 1, 2]) == want
    assert gen.prefix_cache.stats.hit - hits >= 4 * BLOCK
    run = gen.stream([TEXT[:10]], PARAMS[rule], first=True)
    next(run)
    prefill = run.begin(prompts, params, defer)
    while not prefill.done:
        prefill.step(7)
        next(run, None)
    assert rest(run, run.join(prefill)) == want


def test_a_row_cancelled_before_its_first_token_is_read_leaves_the_others_theirs(models):
    """Rows of one admission share the event of their first tokens; cancelling one row before
    that event is read drops only its token: the others get theirs, and their whole answers."""
    params = PARAMS["greedy"]
    prompts = [TEXT[:30], TEXT[:40], TEXT[:50]]
    want = [r.token_ids for r in generator(models, "none").generate(prompts, params)]
    run = generator(models, "none").stream(prompts, params, first=True)
    run.cancel([1])
    first = next(run)
    assert not first.forward and first.rows == [0, 2] and first.emitted == [want[0][:1], want[2][:1]]
    results = run.results()
    assert [results[0].token_ids, results[2].token_ids] == [want[0], want[2]]
    assert results[1].finish_reason == "abort" and results[1].token_ids == want[1][:1]


def test_finished_answers_are_cached_for_the_next_turn(models):
    """A chat's next turn starts with the previous prompt and answer: blocks of the answer (written
    during verification rounds) are reused, and the next turn's tokens do not change."""
    gen = generator(models, "eagle")
    cache = gen.enable_prefix_cache(64 << 20)
    params = SamplingParams(temperature=0, max_new_tokens=120, ignore_eos=True)
    first = gen.generate([TEXT], params)[0]
    turn2 = gen.encode(TEXT) + first.token_ids + gen.encode("曹操曰")
    before = cache.stats.hit
    warm = gen.generate([turn2], params)[0]
    assert cache.stats.hit - before >= len(gen.encode(TEXT)) + 64 - BLOCK  # past the first prompt
    assert warm.token_ids == generator(models, "eagle").generate([turn2], params)[0].token_ids


def block(value: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((1, 1, BLOCK, 2), value), torch.full((1, 1, BLOCK, 2), value)


def test_prefix_cache_evicts_the_least_recently_used_blocks_within_its_budget():
    one = sum(t.numel() * t.element_size() for t in block(0))
    cache = PrefixCache(3 * one)
    a, b = list(range(2 * BLOCK)), list(range(1000, 1000 + 2 * BLOCK))
    cache.insert(a, len(a), lambda s: block(s))
    assert len(cache.match(a, len(a))) == 2
    cache.insert(b, len(b), lambda s: block(-s))  # 4 blocks > 3: a's LRU first block goes
    assert cache.bytes <= cache.budget and len(cache) == 3 and cache.stats.evicted == 1
    assert cache.match(a, len(a)) == []  # its first block is gone, so nothing of a matches
    got = cache.match(b, len(b))
    assert [float(x.k[0, 0, 0, 0]) for x in got] == [0.0, -float(BLOCK)]
    cache.match(b, BLOCK)  # LRU order now: a's orphaned second block, b's second, b's first
    cache.insert(a, BLOCK, lambda s: block(7))  # a's first block again: the orphan goes
    assert len(cache.match(b, len(b))) == 2 and len(cache.match(a, len(a))) == 1
    cache.match(b, BLOCK)  # LRU order: b's second, a's first, b's first
    cache.insert(list(range(5000, 5000 + BLOCK)), BLOCK, lambda s: block(1))
    assert len(cache.match(b, len(b))) == 1 and len(cache.match(a, len(a))) == 1


def test_prefix_cache_matches_only_whole_prefixes_and_whole_blocks():
    cache = PrefixCache(1 << 20)
    a = list(range(2 * BLOCK))
    cache.insert(a, len(a), lambda s: block(s))
    other = [9] * BLOCK + a[BLOCK:]  # the same second block after another first block
    assert cache.match(other, len(other)) == []
    assert len(cache.match(a, 2 * BLOCK - 1)) == 1  # the second block does not fit the limit
    assert len(cache.match(a + [5], len(a) + 1)) == 2
    assert cache.match(a[: BLOCK - 1] + [77] + a[BLOCK:], 2 * BLOCK) == []  # one token differs


def test_prefix_cache_needs_the_batch_invariant_forward(models):
    gen = SpeculativeGenerator(models["target"], models["draft-64"], k=3)
    with pytest.raises(SpecDecodeError, match="prefix caching needs the batch-invariant forward"):
        gen.enable_prefix_cache(1 << 20)


# -- round costs learned online --------------------------------------------------------------------

TABLE = LoadCosts({1: {0: 1.0, 1: 1.1, 4: 1.3}, 8: {0: 1.0, 1: 1.1, 4: 1.3}})


def learning_policy(rows: int = 4) -> LoadAwarePolicy:
    policy = LoadAwarePolicy(
        FixedPolicy(4), OnlineCosts(TABLE), lambda: [SamplingParams(temperature=0)] * rows
    )
    policy.add_rows(rows)
    policy.observe(RoundOutcome([4] * rows, [4] * rows, [3] * rows))  # ~75% accepted
    for _ in range(4):
        policy.observe(RoundOutcome([4] * rows, [4] * rows, [3] * rows))
    return policy


def run_rounds(policy: LoadAwarePolicy, n: int, draft_cost: float) -> list[int]:
    """n rounds where a round that drafts costs draft_cost x the table (one that drafts nothing
    costs what the table says); the caps the policy chose."""
    caps = []
    for _ in range(n):
        ks = policy.next_k()
        width = policy.width
        table = TABLE.at(len(ks)).round_cost(width)
        policy.record(table * (draft_cost if width > 0 else 1.0))
        caps.append(policy.cap)
    return caps


def test_online_costs_stop_drafting_when_rounds_get_slow_and_start_again_when_they_do_not():
    policy = learning_policy()
    assert run_rounds(policy, 5, 1.0)[-1] == 4  # drafting pays at the measured costs
    slow = run_rounds(policy, 40, 3.0)  # the same rounds now cost 3x: drafting loses
    assert slow[-1] == 0 and slow.count(0) >= 30
    assert 1 in slow[5:]  # it keeps probing with one draft token
    fast = run_rounds(policy, 80, 1.0)  # back to normal: a probe sees it, drafting resumes
    assert fast[-1] == 4 and fast.index(4) < 70


def test_table_costs_alone_never_learn():
    """Without OnlineCosts (offline runs, --no-online-costs) the table decides, whatever rounds cost."""
    policy = LoadAwarePolicy(FixedPolicy(4), TABLE, lambda: [SamplingParams(temperature=0)] * 4)
    policy.add_rows(4)
    for _ in range(5):
        policy.observe(RoundOutcome([4] * 4, [4] * 4, [3] * 4))
    caps = []
    for _ in range(20):
        policy.next_k()
        policy.record(100.0)
        caps.append(policy.cap)
    assert caps == [4] * 20


def test_online_costs_report_the_time_spent_prefilling_but_never_charge_it_to_a_round():
    """Prefill seconds do not depend on what the rounds draft: charged to every candidate they
    made a wide round look cheaper (the pair drafted 4 tokens at B = 4 right after admissions)."""
    costs = OnlineCosts(TABLE)
    for _ in range(50):
        costs.record(4, 4, 1.3, overhead=0.5)
    model = costs.at(4)
    drafting = 1.3 / TABLE.at(4).round_cost(4)
    assert model.round_cost(0) == pytest.approx(TABLE.at(4).round_cost(0), rel=1e-3)
    assert model.round_cost(4) == pytest.approx(1.3, rel=1e-3)
    assert model.round_cost(2) == pytest.approx(TABLE.at(4).round_cost(2) * drafting, rel=1e-3)
    assert costs.to_dict()["overhead_s"] == pytest.approx(0.5, rel=1e-3)


def test_the_kv_self_check_passes_riding_admissions_and_names_a_corrupted_slot(models, monkeypatch, capsys):
    """SPECDECODE_CHECK_KV (engine/selfcheck.py): rows admitted in chunks that ride a running
    row's rounds, decoded and finished, match a whole prefill of their tokens; a key changed in
    layer 0 and a value changed in layer 1 of an admission's cache are each found, by layer, kind
    and slot (negative controls)."""
    from specdecode.engine import selfcheck

    monkeypatch.setattr(selfcheck, "ENABLED", True)
    params = PARAMS["greedy"]
    gen = generator(models, "draft")
    target = models["target"]
    run = gen.stream([TEXT[:10]], params)

    def admit(prompt: str, corrupt=None) -> None:
        prefill = run.begin([prompt], params)
        while not prefill.done:
            prefill.step(16, True)
            next(run, None)
            target.flush_riders()
        if corrupt is not None:
            with torch.inference_mode():  # the cache's tensors are inference tensors
                corrupt(prefill.cache)
        run.join(prefill)

    admit(TEXT + "曹操")
    admit(TEXT[:60])
    run.results()
    assert run.kv_mismatches == 0
    assert "KV self-check" not in capsys.readouterr().err

    def key(cache):
        cache.k[0, 0, 0, 5] += 1.0

    def value(cache):  # the invariant cache keeps values chunk-major: slot 70 is chunk 1, offset 6
        cache.v[1, 1, 0, 0, 6] += 1.0

    run = gen.stream([TEXT[:10]], params)
    admit(TEXT[:90], key)
    assert run.kv_mismatches == 1
    assert "layer 0's keys at 1 slot(s) from slot 5 first (by up to 1)" in capsys.readouterr().err
    admit(TEXT[:90], value)
    assert run.kv_mismatches == 2
    assert "layer 1's values at 1 slot(s) from slot 70 first (by up to 1)" in capsys.readouterr().err
