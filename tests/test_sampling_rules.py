"""The invariant sampling rule (sampling.py): noise keyed by (seed, absolute position), its
acceptance against the coupling's closed form and bound, negative controls that break the
invariance or the distribution, and the command line's --sampling-rule (docs/sampling-rules.md).
The token-for-token table over every method is in test_contract.py."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from helpers import check_distribution, seeded, two_token_joint
from specdecode import SamplingParams, SpeculativeGenerator, load
from specdecode.core.sampling import RowRandom, position_noise
from specdecode.core.theory import invariant_acceptance, invariant_bound
from specdecode.errors import SpecDecodeError

INV = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, sampling_rule="invariant")
PROMPTS = [[(7 * i + 3 * j) % 64 for j in range(1 + (5 * i) % 12)] for i in range(8)]


def test_position_noise_is_a_function_of_seed_and_position_alone():
    a = position_noise(3, 17, 1000)
    assert torch.equal(a, position_noise(3, 17, 1000))
    assert not torch.equal(a, position_noise(3, 18, 1000))
    assert not torch.equal(a, position_noise(4, 17, 1000))
    assert torch.equal(position_noise(-1, 5, 10), position_noise(2**64 - 1, 5, 10))  # seed mod 2**64
    many = torch.stack([position_noise(9, t, 2000) for t in range(50)])
    assert abs(float(many.mean()) - 1.0) < 0.02 and abs(float(many.var()) - 1.0) < 0.05  # Exp(1)


def test_a_keyed_row_reads_the_same_noise_whoever_asks_and_in_any_order():
    one = RowRandom([5], keyed=[True])
    other = RowRandom([7, 5], keyed=[False, True])
    other.exp_noise(64, [True, False])  # a stream draw by another row changes nothing
    late = other.exp_noise(64, [False, True], torch.tensor([0, 12]))[1]
    assert torch.equal(late, one.keyed_noise(64, torch.tensor([[12]]), [True])[0, 0])
    one.forget_before(torch.tensor([13]))
    assert one._cache == [{}]  # committed positions are dropped


def test_an_unseeded_invariant_row_draws_its_key_once():
    a, b = RowRandom([None], keyed=[True]), RowRandom([None], keyed=[True])
    assert a.keys[0] != b.keys[0]
    first = a.exp_noise(32, None, torch.tensor([4]))
    assert torch.equal(first, a.exp_noise(32, None, torch.tensor([4])))


def test_sampling_rule_is_validated_with_a_one_line_error():
    with pytest.raises(SpecDecodeError, match="sampling rule must be one of auto, standard, invariant"):
        SamplingParams(sampling_rule="fair")


def test_auto_rule_is_resolved_by_sampling_params_invariant_when_seeded():
    """"auto" has one home: SamplingParams turns it into invariant for a seeded row (its seed then
    fixes the text whatever runs beside it) and standard for an unseeded one."""
    assert SamplingParams(sampling_rule="auto", seed=3).sampling_rule == "invariant"
    assert SamplingParams(sampling_rule="auto").sampling_rule == "standard"
    assert SamplingParams(sampling_rule="standard", seed=3).sampling_rule == "standard"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_invariant_acceptance_is_the_closed_form_and_above_the_bound(seed):
    """Draft argmax q/E against target argmax p/E with E from position_noise, one position per
    trial: the match rate is Σ_x 1/Σ_y max(p_y/p_x, q_y/q_x) within sampling noise, and at
    least (1 − TV)/(1 + TV); the standard rule's 1 − TV is higher (the price)."""
    rng = np.random.default_rng(seed)
    p, q = rng.dirichlet(np.full(12, 0.6)), rng.dirichlet(np.full(12, 0.6))
    n = 20_000
    E = torch.stack([position_noise(seed, t, 12) for t in range(n)]).numpy()
    measured = float(np.mean(np.argmax(p / E, 1) == np.argmax(q / E, 1)))
    exact, tv = invariant_acceptance(p, q), 0.5 * np.abs(p - q).sum()
    sigma = np.sqrt(exact * (1 - exact) / n)
    assert abs(measured - exact) < 4 * sigma, (measured, exact)
    assert exact >= invariant_bound(tv) - 1e-12
    assert exact <= 1 - tv + 1e-12  # no coupling beats the maximal one


@pytest.fixture(scope="module")
def tiny(pair_dir):
    return tuple(load(p, dtype=torch.float64) for p in pair_dir)


def outputs(gen, params=INV):
    return [
        r.token_ids
        for r in gen.generate(PROMPTS, [replace(params, seed=40 + i) for i in range(len(PROMPTS))])
    ]


def test_negative_control_noise_keyed_by_stream_position_breaks_the_invariance(tiny, monkeypatch):
    """The noise of a row's n-th request instead of its position's: the drafter's requests shift
    the verifier's noise, so the drafted text is no longer target-only's."""
    target, draft = tiny
    gen = SpeculativeGenerator(target, draft, k=4)
    assert outputs(gen) == outputs(SpeculativeGenerator(target))  # the real rule holds here

    counter: dict[int, int] = {}

    def by_stream(self, b, position, vocab):
        key = id(self._cache[b])
        counter[key] = counter.get(key, -1) + 1
        return position_noise(self.keys[b], counter[key], vocab)

    monkeypatch.setattr(RowRandom, "_keyed", by_stream)
    drafted, plain = outputs(gen), outputs(SpeculativeGenerator(target))
    assert sum(a != b for a, b in zip(drafted, plain)) >= len(PROMPTS) // 2


@pytest.mark.heavy
def test_negative_control_one_noise_for_every_position_breaks_the_distribution(vocab16_dirs, monkeypatch):
    """Noise keyed by the seed alone (the same E at every position): x1 and x2 are no longer
    independent draws, and the two-token joint check must fail; keyed by position it passes."""
    target = load(vocab16_dirs[0], dtype=torch.float64)
    prompt = [5, 9, 2]
    joint = two_token_joint(target, prompt)
    joint /= joint.sum()
    params = SamplingParams(
        temperature=1.0, max_new_tokens=2, seed=1, ignore_eos=True, sampling_rule="invariant"
    )
    n, V = 20_000, target.vocab_size

    def pairs():
        res = SpeculativeGenerator(target).generate([prompt] * n, seeded(params, n))
        return np.array([r.token_ids[0] * V + r.token_ids[1] for r in res])

    ok, msg = check_distribution(pairs(), joint)
    assert ok, msg
    real = position_noise
    monkeypatch.setattr(
        "specdecode.core.sampling.position_noise", lambda seed, position, vocab: real(seed, 0, vocab)
    )
    ok, msg = check_distribution(pairs(), joint)
    assert not ok, msg


def test_the_shared_noise_is_what_makes_drafts_match(tiny, monkeypatch):
    """A drafter guessing with independent noise keeps the text (the verifier alone decides it) but
    loses acceptance: the coupling, not luck, makes the invariant rule pay."""
    target, draft = tiny
    gen = SpeculativeGenerator(target, draft, k=4)
    want = outputs(SpeculativeGenerator(target))

    def accepted():
        res = gen.generate(PROMPTS, [replace(INV, seed=40 + i) for i in range(len(PROMPTS))])
        assert [r.token_ids for r in res] == want
        return sum(r.stats.accepted for r in res) / sum(r.stats.tested for r in res)

    shared = accepted()
    import specdecode.drafters.base as base

    real = base.DraftChain.draw

    def independent(self, logits):  # the drafter's guesses from noise no verifier reads
        shifted = replace(self.ctx, lengths=self.ctx.lengths + 10_000)
        self.ctx, ctx = shifted, self.ctx
        try:
            return real(self, logits)
        finally:
            self.ctx = ctx

    monkeypatch.setattr(base.DraftChain, "draw", independent)
    assert accepted() < shared - 0.1


GENERATE = [
    sys.executable,
    "-m",
    "specdecode.cli",
    "generate",
    "--target",
    "three-kingdoms/target",
    "--prompt",
]


@pytest.mark.heavy
def test_generate_invariant_prints_the_same_text_with_and_without_drafts(capsys):
    """The issue's done-when command, three ways: target-only, a draft model, EAGLE with a tree
    (in this process: the command in a fresh one is test_generate_rejects_an_unknown_sampling_rule's
    and test_cli's)."""
    from specdecode.cli import main

    base = GENERATE[3:] + [
        "孔明曰：「",
        "--temperature",
        "1",
        "--seed",
        "3",
        "--sampling-rule",
        "invariant",
        "--json",
    ]
    texts = []
    for extra in ([], ["--draft", "three-kingdoms/draft-64"], ["--method", "eagle", "--tree", "4,2,1"]):
        assert main(base + extra) == 0
        texts.append(json.loads(capsys.readouterr().out)["text"])
    assert texts[0] == texts[1] == texts[2] and len(texts[0]) > 10


def test_generate_rejects_an_unknown_sampling_rule_with_exit_2():
    out = subprocess.run(GENERATE + ["a", "--sampling-rule", "fair"], capture_output=True, text=True)
    assert out.returncode == 2 and "invalid choice: 'fair'" in out.stderr + out.stdout
