"""The target's distribution through the whole engine at a later position whose rounds cross
boundaries (the 6th generated token with k = 4; the two-token joint in fp32 and bf16 is in
tests/test_contract.py), with its negative control (the same check, same sample size,
must reject the engine that redraws from p after a rejection)."""

import numpy as np
import pytest
import torch

from helpers import check_distribution, independent, noisy_copy, resample_from_p_after_rejection
from specdecode import SamplingParams, SpeculativeGenerator, load
from specdecode.models.base import logits_of
from specdecode.models.init import init_model

PROMPT = [5, 7, 2]


@pytest.fixture(scope="module")
def pair8(tmp_path_factory):
    root = tmp_path_factory.mktemp("v8")
    t = init_model(root / "t", vocab=8, layers=2, dim=32, heads=2, seed=2, init_std=0.6)
    d = noisy_copy(t, root / "d", noise=0.3, seed=3)
    return load(t), load(d)  # fp32


def sixth_token_marginal(target, prompt: list[int]) -> np.ndarray:
    """P(x6 | prompt) at T = 1: the next-token distribution after every 5-token continuation,
    weighted by that continuation's probability (V^5 prefixes, one forward per length)."""
    V = target.vocab_size
    prefixes, weights = [list(prompt)], np.ones(1)
    for _ in range(6):
        x = torch.tensor(prefixes)
        logits = logits_of(target, x, target.new_cache(len(prefixes), x.shape[1]))[:, -1]
        probs = torch.softmax(logits.double(), -1).numpy()
        if len(prefixes[0]) == len(prompt) + 5:
            return (weights[:, None] * probs).sum(0)
        weights = (weights[:, None] * probs).ravel()
        prefixes = [p + [v] for p in prefixes for v in range(V)]
    raise AssertionError("unreachable")


SIXTH_RUNS = 20_000


def sixth_token_run(pair8) -> tuple[np.ndarray, list]:
    target, draft = pair8
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=77, ignore_eos=True)
    runs = SIXTH_RUNS
    rows = independent(params, runs)
    results = SpeculativeGenerator(target, draft=draft, k=4).generate([PROMPT] * runs, rows)
    return np.array([r.token_ids[5] for r in results]), results


@pytest.mark.heavy
def test_sixth_token_marginal_with_k4_equals_target(pair8):
    target, _ = pair8
    sixth, results = sixth_token_run(pair8)
    ok, msg = check_distribution(sixth, sixth_token_marginal(target, PROMPT))
    assert ok, msg
    # the 6th token was produced in a later round, by every way a token can be produced
    assert all(r.stats.rounds >= 2 for r in results[:1000])
    accepted = sum(r.stats.accepted for r in results)
    assert 0 < accepted < sum(r.stats.tested for r in results)


@pytest.mark.heavy
def test_sixth_token_check_catches_resampling_from_p(pair8, monkeypatch):
    target, _ = pair8
    resample_from_p_after_rejection(monkeypatch)
    sixth, _ = sixth_token_run(pair8)
    ok, msg = check_distribution(sixth, sixth_token_marginal(target, PROMPT))
    assert not ok, msg
