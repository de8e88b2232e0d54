"""Suffix decoding and auto: drafts from the longest suffix match in the row's context and in
earlier requests (a bounded per-process cache); exact at any temperature; auto switches per
round and per row between the suffix match and the trained EAGLE-3 drafter."""

import json

import numpy as np
import pytest
import torch

from helpers import check_distribution, resample_from_p_after_rejection, seeded, two_token_joint
from specdecode import SamplingParams, SpeculativeGenerator, load
from specdecode.drafters.suffix import SuffixCache, process_cache, suffix_draft
from specdecode.train.distill import distill
from specdecode.train.eagle3 import train_eagle3

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


@pytest.mark.parametrize("method", ["suffix", "auto"])
def test_suffix_and_auto_greedy_equal_target_greedy_batch_1_and_ragged_batch(pair_dir, method):
    target = load(pair_dir[0], dtype=torch.float64)
    process_cache(target).clear()
    want = [r.token_ids for r in SpeculativeGenerator(target).generate(PROMPTS, GREEDY)]
    gen = SpeculativeGenerator(target, k=3, method=method)
    got = [gen.generate([p], GREEDY)[0] for p in PROMPTS]
    assert [r.token_ids for r in got] == want
    assert sum(r.stats.accepted for r in got) > 0
    assert [r.token_ids for r in gen.generate(PROMPTS, GREEDY)] == want


def test_suffix_drafts_from_an_earlier_requests_output(pair_dir):
    """The second run of a prompt drafts the first run's answer: nearly every token accepted."""
    target = load(pair_dir[0], dtype=torch.float64)
    process_cache(target).clear()
    gen = SpeculativeGenerator(target, k=4, method="suffix")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    first = gen.generate([prompt], GREEDY)[0]
    second = gen.generate([prompt], GREEDY)[0]
    assert second.token_ids == first.token_ids
    assert second.stats.accepted > first.stats.accepted and second.stats.rounds <= 6


def suffix_pairs(target, method="suffix", heads=None, n=40_000, prompts=([1, 2, 3, 4, 1, 2, 3],)):
    """Sampled (x1, x2) pairs of each prompt, the prompts interleaved in one batch; per prompt:
    (pairs, exact joint), and the acceptance counts over all rows. In [1, 2, 3, 4, 1, 2, 3] the
    suffix "1 2 3" recurs, so the first round drafts its continuation."""
    V = target.vocab_size
    process_cache(target).clear()
    gen = SpeculativeGenerator(target, k=3, method=method, heads=heads)
    params = SamplingParams(temperature=1.0, max_new_tokens=2, seed=21, ignore_eos=True)
    rows = [prompts[i % len(prompts)] for i in range(n)]
    results = gen.generate(rows, seeded(params, n))
    out = []
    for j, prompt in enumerate(prompts):
        mine = results[j :: len(prompts)]
        pairs = np.array([r.token_ids[0] * V + r.token_ids[1] for r in mine])
        out.append((pairs, two_token_joint(target, list(prompt))))
    acc, tested = sum(r.stats.accepted for r in results), sum(r.stats.tested for r in results)
    return out, acc, tested


def test_suffix_sampling_keeps_the_two_token_joint(vocab16_dirs):
    target = load(vocab16_dirs[0], dtype=torch.float64)
    [(pairs, joint)], acc, tested = suffix_pairs(target)
    ok, msg = check_distribution(pairs, joint)
    assert ok, msg
    assert 0 < acc < tested


def test_suffix_two_token_check_catches_resampling_from_p(vocab16_dirs, monkeypatch):
    resample_from_p_after_rejection(monkeypatch)
    target = load(vocab16_dirs[0], dtype=torch.float64)
    [(pairs, joint)], _, _ = suffix_pairs(target)
    ok, msg = check_distribution(pairs, joint)
    assert not ok, msg


def test_auto_sampling_keeps_the_two_token_joint_mixing_suffix_and_eagle3_rows(vocab16_dirs, tmp_path):
    """Rows of one batch draft from different drafters (one-hot suffix drafts beside EAGLE-3's
    probabilities); each row's tokens still follow the target."""
    prompts = [[(5 * i + j) % 16 for j in range(3 + i % 4)] for i in range(8)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
    distill(
        vocab16_dirs[0],
        tmp_path / "p.jsonl",
        tmp_path / "d",
        chat=False,
        max_new_tokens=12,
        temperature="1",
        batch_size=4,
        dtype=torch.float32,
        progress=False,
    )
    train_eagle3(
        vocab16_dirs[0],
        tmp_path / "d",
        tmp_path / "e",
        draft_vocab=12,
        ttt_steps=2,
        epochs=1,
        batch_tokens=128,
        progress=False,
    )
    target = load(vocab16_dirs[0], dtype=torch.float64)
    long_repeat = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7]  # a 7-token match: suffix drafts
    no_repeat = [5, 9, 2]  # no match: EAGLE-3 drafts
    per_prompt, acc, tested = suffix_pairs(target, "auto", tmp_path / "e", 40_000, (long_repeat, no_repeat))
    for pairs, joint in per_prompt:
        ok, msg = check_distribution(pairs, joint)
        assert ok, msg
    assert 0 < acc < tested


def test_a_draft_chain_whose_rows_all_have_limit_0_proposes_nothing():
    """auto can hand every row that still needs its model drafter a limit of 0 (the others take
    suffix drafts); the chain then proposes an empty draft instead of failing."""
    from specdecode.drafters.base import DraftChain, DraftContext
    from specdecode.sampling import Warp

    ctx = DraftContext(torch.zeros(2, 8, dtype=torch.long), torch.tensor([3, 4]), Warp.greedy(2), None)
    proposal = DraftChain(ctx, torch.zeros(2, dtype=torch.long), None).proposal()
    assert proposal.width == 0 and proposal.draft_lengths().tolist() == [0, 0]
