"""The engine: greedy equivalence with target-only decoding, batching, stopping, and the
joint distribution of sampled outputs through the whole engine."""

import itertools

import numpy as np
import pytest
import torch

from helpers import check_distribution, independent, tiny_hf_model
from specdecode import SamplingParams, SpecDecodeError, SpeculativeGenerator, load
from specdecode.core.sampling import Warp, logits_to_probs
from specdecode.models.base import logits_of
from specdecode.models.init import init_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 64 for j in range(1 + (5 * i) % 12)] for i in range(16)]


@pytest.fixture(scope="module")
def models(pair_dir):
    target, draft = pair_dir
    return load(target, dtype=torch.float64), load(draft, dtype=torch.float64)


def naive_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Reference: recompute the whole sequence every step, no cache tricks."""
    seq = list(prompt)
    for _ in range(n):
        logits = logits_of(model, torch.tensor([seq]), model.new_cache(1, len(seq)))
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.fixture(scope="module")
def target_greedy(models):
    target, _ = models
    return [r.token_ids for r in SpeculativeGenerator(target).generate(PROMPTS, GREEDY)]


def test_target_only_decoding_matches_naive_reference(models, target_greedy):
    target, _ = models
    for prompt, got in list(zip(PROMPTS, target_greedy))[:4]:
        assert got == naive_greedy(target, prompt, GREEDY.max_new_tokens)


def test_each_batched_row_equals_the_same_prompt_alone(models):
    target, draft = models
    gen = SpeculativeGenerator(target, draft=draft, k=3)
    batched = gen.generate(PROMPTS[:6], GREEDY)
    for prompt, r in zip(PROMPTS[:6], batched):
        assert r.token_ids == gen.generate([prompt], GREEDY)[0].token_ids


def test_rows_stop_independently_on_max_new_tokens(models, target_greedy):
    target, draft = models
    gen = SpeculativeGenerator(target, draft=draft, k=4)
    lengths = [1, 5, 24, 13]
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in lengths]
    results = gen.generate(PROMPTS[:4], params)
    for n, r, want in zip(lengths, results, target_greedy):
        assert r.token_ids == want[:n]
        assert r.finish_reason == "length"


def test_row_stops_at_eos_while_others_continue(models, target_greedy):
    target, draft = models
    # make the 4th greedy token of prompt 0 the end-of-text token
    eos = target_greedy[0][3]
    assert eos not in target_greedy[1][:24] or target_greedy[1].index(eos) > 3
    target.eos_token_ids = (eos,)
    try:
        gen = SpeculativeGenerator(target, draft=draft, k=4)
        params = SamplingParams(temperature=0, max_new_tokens=24)
        r0, r1 = gen.generate(PROMPTS[:2], params)
    finally:
        target.eos_token_ids = (0,)
    assert r0.token_ids == target_greedy[0][: target_greedy[0].index(eos) + 1]
    assert r0.finish_reason == "eos"
    cut = target_greedy[1].index(eos) + 1 if eos in target_greedy[1] else 24
    assert r1.token_ids == target_greedy[1][:cut]


def test_stop_string_ends_the_row_and_is_cut_from_the_text(models):
    target, _ = models
    gen = SpeculativeGenerator(target)
    full = gen.generate(["abc"], SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))[0]
    stop = full.text[5:7]
    r = gen.generate(
        ["abc"], SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop=(stop,))
    )[0]
    assert r.finish_reason == "stop"
    assert r.text == full.text[: full.text.find(stop)]
    assert full.token_ids[: len(r.token_ids)] == r.token_ids


def test_seeded_sampling_is_reproducible(models):
    target, draft = models
    gen = SpeculativeGenerator(target, draft=draft, k=4)
    p = SamplingParams(temperature=1.0, max_new_tokens=32, seed=123, ignore_eos=True)
    assert gen.generate(PROMPTS[:3], p)[2].token_ids == gen.generate(PROMPTS[:3], p)[2].token_ids


def test_stats_count_rounds_tokens_and_acceptance_consistently(models):
    target, draft = models
    gen = SpeculativeGenerator(target, draft=draft, k=4)
    p = SamplingParams(temperature=1.0, max_new_tokens=40, seed=0, ignore_eos=True)
    run = gen.stream([PROMPTS[3]], p)
    events = list(run)
    (r,) = run.results()
    st = r.stats
    records = [rec for e in events for rec in e.records()]
    assert st.rounds == st.target_forwards == len(records)
    assert st.drafted == 4 * st.rounds
    assert st.accepted == sum(sum(rec.accepted) for rec in records)
    assert st.tested == sum(sum(u is not None for u in rec.uniform) for rec in records)
    assert st.acceptance_rate == st.accepted / st.tested
    assert [t for rec in records for t in rec.emitted_token_ids] == r.token_ids
    assert st.new_tokens == len(r.token_ids) == 40
    for rec in records:
        a = sum(rec.accepted)
        assert rec.accepted == [True] * a + [False] * (4 - a)
        assert rec.how[:a] == ["accepted"] * min(a, len(rec.how))
        assert rec.how[-1] in ("resampled", "bonus", "accepted")
        assert all((u is None) == (i > a) for i, u in enumerate(rec.uniform))
        for q, pp, ap in zip(rec.draft_prob, rec.target_prob, rec.accept_prob):
            assert ap == pytest.approx(min(1.0, pp / q))


def test_vocabulary_mismatch_is_a_clear_error(tmp_path, models):
    target, _ = models
    other = load(init_model(tmp_path / "v", vocab=80, layers=1, dim=16))
    with pytest.raises(SpecDecodeError, match="target has 64 tokens, draft has 80"):
        SpeculativeGenerator(target, draft=other)


def test_bad_k_and_prompts_are_clear_errors(models):
    target, draft = models
    with pytest.raises(SpecDecodeError, match="k must be"):
        SpeculativeGenerator(target, draft=draft, k=0)
    with pytest.raises(SpecDecodeError, match="empty"):
        SpeculativeGenerator(target).generate([""])
    with pytest.raises(SpecDecodeError, match="token ids must be in"):
        SpeculativeGenerator(target).generate([[1, 99]])


# -- sampling exactness through the whole engine ------------------------------------------

RUNS = 30_000
PROMPT = [5, 9, 2]


@pytest.fixture(scope="module")
def small_vocab_models(vocab16_dirs):
    # float32: float64's forwards cost more and bought no power (benchmarks/NOTES.md, issue 36)
    return tuple(load(p, dtype=torch.float32) for p in vocab16_dirs)


def exact_joint(target, params: SamplingParams) -> np.ndarray:
    """P(x1, x2 | PROMPT) under the target's warped distribution, from full forwards."""
    V = target.vocab_size
    warp = Warp.from_params([params])
    first = logits_of(target, torch.tensor([PROMPT]), target.new_cache(1, 8))[:, -1:]
    p1 = logits_to_probs(first, warp)[0, 0]
    seqs = torch.tensor([PROMPT + [x] for x in range(V)])
    second = logits_of(target, seqs, target.new_cache(V, 8))[:, -1:]
    p2 = logits_to_probs(second, Warp.from_params([params] * V))[:, 0]
    return (p1.view(V, 1) * p2).numpy().ravel()


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("k", "params"),
    [
        (1, SamplingParams(temperature=1.0)),
        (3, SamplingParams(temperature=1.0)),
        (2, SamplingParams(temperature=0.8, top_p=0.9, top_k=8)),
    ],
    ids=["k1-T1", "k3-T1", "k2-warped"],
)
def test_two_token_joint_through_engine_equals_target(small_vocab_models, k, params):
    target, draft = small_vocab_models
    params = SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        max_new_tokens=2,
        seed=2024 + k,
        ignore_eos=True,
    )
    gen = SpeculativeGenerator(target, draft=draft, k=k)
    results = gen.generate([PROMPT] * RUNS, independent(params, RUNS))
    pairs = np.array([r.token_ids[0] * target.vocab_size + r.token_ids[1] for r in results])
    joint = exact_joint(target, params)
    ok, msg = check_distribution(pairs, joint)
    assert ok, msg
    # the test exercised both rejections and acceptances
    rate = sum(r.stats.accepted for r in results) / sum(r.stats.drafted for r in results)
    assert 0.2 < rate < 0.95, rate


@pytest.mark.heavy
def test_two_token_joint_of_target_only_decoding_equals_target(small_vocab_models):
    """Plain rounds (nothing drafted) sample on their own fast path: argmax(p / Exp(1))."""
    target, _ = small_vocab_models
    params = SamplingParams(temperature=0.9, top_k=10, max_new_tokens=2, seed=77, ignore_eos=True)
    results = SpeculativeGenerator(target).generate([PROMPT] * RUNS, independent(params, RUNS))
    pairs = np.array([r.token_ids[0] * target.vocab_size + r.token_ids[1] for r in results])
    ok, msg = check_distribution(pairs, exact_joint(target, params))
    assert ok, msg


@pytest.mark.heavy
def test_target_only_joint_check_catches_a_biased_sampler(small_vocab_models, monkeypatch):
    """Negative control for the plain-round path: sampling from p² (renormalised) must fail."""
    import specdecode.engine.verify as verify_mod
    from specdecode.core.sampling import sample

    def sharpened(probs, noise):
        p2 = probs * probs
        return sample(p2 / p2.sum(-1, keepdim=True), noise)

    monkeypatch.setattr(verify_mod, "sample", sharpened)
    target, _ = small_vocab_models
    params = SamplingParams(temperature=0.9, top_k=10, max_new_tokens=2, seed=77, ignore_eos=True)
    results = SpeculativeGenerator(target).generate([PROMPT] * RUNS, independent(params, RUNS))
    pairs = np.array([r.token_ids[0] * target.vocab_size + r.token_ids[1] for r in results])
    ok, _ = check_distribution(pairs, exact_joint(target, params))
    assert not ok


@pytest.mark.heavy
def test_engine_joint_check_catches_a_biased_engine(small_vocab_models, monkeypatch):
    """Negative control: the engine with resample-from-p after rejection must fail the check."""
    import specdecode.engine.verify as verify_mod
    from specdecode.core.sampling import sample
    from specdecode.engine.verify import verify_chain

    def biased(draft_tokens, draft_probs, target_probs, uniforms, noise, draft_lengths=None):
        v = verify_chain(draft_tokens, draft_probs, target_probs, uniforms, noise, draft_lengths)
        B, k = draft_tokens.shape
        rejected = v.accepted < k
        at = v.accepted.clamp(max=k).view(B, 1, 1).expand(B, 1, target_probs.shape[-1])
        redraw = sample(target_probs.gather(1, at).squeeze(1), noise)
        v.tokens.scatter_(
            1,
            v.accepted.view(B, 1),
            torch.where(rejected, redraw, v.tokens.gather(1, v.accepted.view(B, 1)).squeeze(1)).view(B, 1),
        )
        return v

    monkeypatch.setattr(verify_mod, "verify_chain", biased)
    target, draft = small_vocab_models
    params = SamplingParams(temperature=1.0, max_new_tokens=2, seed=7, ignore_eos=True)
    rows = independent(params, RUNS)
    results = SpeculativeGenerator(target, draft=draft, k=1).generate([PROMPT] * RUNS, rows)
    pairs = np.array([r.token_ids[0] * target.vocab_size + r.token_ids[1] for r in results])
    ok, msg = check_distribution(pairs, exact_joint(target, params))
    assert not ok, msg


def test_prompts_of_one_token_and_mixed_lengths_work(models):
    target, draft = models
    gen = SpeculativeGenerator(target, draft=draft, k=2)
    solo = [gen.generate([p], GREEDY)[0].token_ids for p in ([3], [1, 2, 3, 4, 5, 6, 7])]
    both = [r.token_ids for r in gen.generate([[3], [1, 2, 3, 4, 5, 6, 7]], GREEDY)]
    assert solo == both


def test_mixed_greedy_and_sampled_rows_in_one_batch(models, target_greedy):
    target, draft = models
    gen = SpeculativeGenerator(target, draft=draft, k=3)
    params = [GREEDY, SamplingParams(temperature=1.0, max_new_tokens=24, seed=1, ignore_eos=True)] * 2
    results = gen.generate(PROMPTS[:4], params)
    assert results[0].token_ids == target_greedy[0]
    assert results[2].token_ids == target_greedy[2]
    assert all(len(r.token_ids) == 24 for r in results)


def test_draft_in_other_runtime_gives_target_greedy(tmp_path):
    """A transformers GPT-2 target with a lean-runtime Llama draft of the same vocabulary."""
    tiny_hf_model("gpt2", tmp_path / "gpt2", vocab=64, seed=0, init_std=0.3, n_positions=128)
    target = load(tmp_path / "gpt2", dtype=torch.float64)
    draft = load(init_model(tmp_path / "d", vocab=64, layers=1, dim=16, seed=1), dtype=torch.float64)
    want = [r.token_ids for r in SpeculativeGenerator(target).generate(PROMPTS[:4], GREEDY)]
    for k in (1, 4):
        got = [
            r.token_ids for r in SpeculativeGenerator(target, draft=draft, k=k).generate(PROMPTS[:4], GREEDY)
        ]
        assert got == want
    assert want[0] == naive_greedy(target, PROMPTS[0], GREEDY.max_new_tokens)


def test_every_k_and_batch_combination_is_consistent_for_the_hf_adapter(tmp_path):
    tiny_hf_model("qwen2", tmp_path / "q", vocab=64, seed=1, init_std=0.3)
    target = load(tmp_path / "q", dtype=torch.float64, backend="hf")
    from helpers import noisy_copy

    qd = noisy_copy(tmp_path / "q", tmp_path / "qd", noise=0.05, seed=2)
    draft = load(qd, dtype=torch.float64, backend="hf")
    want = [r.token_ids for r in SpeculativeGenerator(target).generate(PROMPTS[:4], GREEDY)]
    for k, b in itertools.product((2, 5), (1, 4)):
        gen = SpeculativeGenerator(target, draft=draft, k=k)
        got = [r.token_ids for i in range(0, 4, b) for r in gen.generate(PROMPTS[i : i + b], GREEDY)]
        assert got == want, (k, b)


def test_sequence_longer_than_learned_positions_is_a_clear_error(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    ).save_pretrained(tmp_path / "g")
    gen = SpeculativeGenerator(load(tmp_path / "g"))
    with pytest.raises(SpecDecodeError, match="exceeds its 32 positions"):
        gen.generate([[1, 2, 3]], SamplingParams(max_new_tokens=40))
    assert (
        len(gen.generate([[1, 2, 3]], SamplingParams(max_new_tokens=20, ignore_eos=True))[0].token_ids) == 20
    )
