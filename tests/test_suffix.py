"""Suffix decoding and auto: drafts from the longest suffix match in the row's context and in
earlier requests (a bounded per-process cache); auto switches per round and per row between
the suffix match and the trained EAGLE-3 drafter (exactness: tests/test_contract.py)."""


import numpy as np
import torch

from specdecode import SamplingParams, SpeculativeGenerator, load
from specdecode.drafters.suffix import SuffixCache, suffix_draft

GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 64 for j in range(1 + (5 * i) % 10)] * 3 for i in range(6)]


def test_suffix_draft_follows_the_most_frequent_continuation_of_the_longest_match():
    ctx = np.array([1, 2, 3, 4, 9, 5, 1, 2, 3, 4, 9, 7, 1, 2, 3, 4])
    draft, match = suffix_draft(ctx, None, limit=8, factor=1.0, min_prob=0.1)
    assert match == 4 and draft[0] == 9 and len(draft) == 4  # "1 2 3 4" occurred twice, then 9
    cache = SuffixCache()
    cache.add(np.array([5, 5, 2, 3, 4, 8, 8, 8]))
    cache.add(np.array([6, 2, 3, 4, 8, 8, 1]))
    draft, match = suffix_draft(np.array([0, 0, 2, 3, 4]), cache, limit=8, factor=2.0, min_prob=0.1)
    assert match == 3 and draft.tolist() == [8, 8, 8]
    # the two earlier requests agree on "8 8", then only 1 of 2 says 8: min_prob 0.6 stops there
    draft, _ = suffix_draft(np.array([0, 0, 2, 3, 4]), cache, limit=8, factor=2.0, min_prob=0.6)
    assert draft.tolist() == [8, 8]
    # the draft is at most factor x the match length
    draft, _ = suffix_draft(np.array([0, 0, 2, 3, 4]), cache, limit=8, factor=0.5, min_prob=0.1)
    assert draft.tolist() == [8]


def test_suffix_cache_holds_at_most_its_bound_dropping_the_oldest():
    cache = SuffixCache(max_tokens=20)
    for i in range(5):
        cache.add(np.arange(8) + 100 * i)
    assert cache.tokens <= 20 and len(cache.seqs) == 2
    assert cache.occurrences((0, 1, 2)) == [] and cache.occurrences((400, 401, 402))


def test_suffix_drafts_from_an_earlier_requests_output(pair_dir):
    """The second run of a prompt drafts the first run's answer: nearly every token accepted."""
    target = load(pair_dir[0], dtype=torch.float64)
    gen = SpeculativeGenerator(target, k=4, method="suffix")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    first = gen.generate([prompt], GREEDY)[0]
    second = gen.generate([prompt], GREEDY)[0]
    assert second.token_ids == first.token_ids
    assert second.stats.accepted > first.stats.accepted and second.stats.rounds <= 6
    gen.forget()  # forgotten: the third run drafts as the first did
    third = gen.generate([prompt], GREEDY)[0]
    assert third.token_ids == first.token_ids and third.stats.accepted == first.stats.accepted


def test_a_fresh_generator_does_not_draft_from_another_generators_answers(pair_dir):
    """The cache of earlier requests belongs to the generator (its drafter): a new generator on the
    same target starts empty, unless it is given the other's cache on purpose (suffix_cache)."""
    target = load(pair_dir[0], dtype=torch.float64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    first = SpeculativeGenerator(target, k=4, method="suffix")
    answer = first.generate([prompt], GREEDY)[0]
    for method in ("suffix", "auto"):
        fresh = SpeculativeGenerator(target, k=4, method=method).generate([prompt], GREEDY)[0]
        assert fresh.token_ids == answer.token_ids
        assert fresh.stats.accepted == answer.stats.accepted  # drafted only from its own context
    shared = SpeculativeGenerator(target, k=4, method="suffix", suffix_cache=first.drafter.cache)
    again = shared.generate([prompt], GREEDY)[0]
    assert again.token_ids == answer.token_ids and again.stats.accepted > answer.stats.accepted


def test_a_draft_chain_whose_rows_all_have_limit_0_proposes_nothing():
    """auto can hand every row that still needs its model drafter a limit of 0 (the others take
    suffix drafts); the chain then proposes an empty draft instead of failing."""
    from specdecode.core.sampling import Warp
    from specdecode.drafters.base import DraftChain, DraftContext

    ctx = DraftContext(torch.zeros(2, 8, dtype=torch.long), torch.tensor([3, 4]), Warp.greedy(2), None)
    proposal = DraftChain(ctx, torch.zeros(2, dtype=torch.long), None).proposal()
    assert proposal.width == 0 and proposal.draft_lengths().tolist() == [0, 0]


def test_auto_prices_its_draft_model_by_that_models_drafts_alone(pair_dir):
    """What a server pays a draft model's prefill back from is the acceptance of the drafts that
    model made (Generation.model_acceptance): auto's suffix drafts, accepted nearly always on
    repeated text, are left out. Checked against a tally of every round's rows by the source of
    their drafts; the run must have drafted from both, or the check would not tell them apart."""
    target = load(pair_dir[0], dtype=torch.float64)
    draft = load(pair_dir[1], dtype=torch.float64)
    gen = SpeculativeGenerator(target, draft, k=4, method="auto")
    run = gen.stream(PROMPTS, GREEDY)
    tally = {True: [0, 0], False: [0, 0]}  # from a suffix match?: [tested, accepted]
    for event in run:
        if not event.forward or not event.verdict.draft_lengths.any():
            continue
        drafted, accepted = event.verdict.draft_lengths.tolist(), event.verdict.accepted.tolist()
        for src, d, a in zip(run.state.from_suffix, drafted, accepted):
            tally[src][0] += min(a + 1, d)  # tested: the accepted ones and the first rejected
            tally[src][1] += a
    assert tally[True][0] > 0 and tally[False][0] > 0
    assert run.model_drafts == tally[False]
    model = run.model_acceptance(min_tests=1)
    assert model == (tally[False][1] + 1) / (tally[False][0] + 2)
    pooled = (tally[True][1] + tally[False][1] + 1) / (tally[True][0] + tally[False][0] + 2)
    assert model != pooled  # what the server priced it at before
