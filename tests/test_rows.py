"""Per-request behaviour: a seeded row's tokens do not depend on its batch mates, a row admitted
between rounds (run.add) decodes as if it ran alone, two runs on one generator do not disturb
each other, and `import specdecode` stays slim."""

import subprocess
import sys

import pytest
import torch

from helpers import churn
from specdecode import SamplingParams, SpeculativeGenerator, load
from specdecode.drafters.medusa import MedusaHeads
from specdecode.engine.policy import CostModel

PROMPTS = [[(7 * i + 3 * j) % 64 for j in range(1 + (5 * i) % 12)] for i in range(8)]
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=20, seed=1234, ignore_eos=True)
WARPED = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, max_new_tokens=20, seed=99, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
# drafting pays under this cost model, so the optimal policy drafts (its k still varies per row)
CHEAP = CostModel({0: 0.01, 1: 0.0105, 3: 0.0115})  # R(k) = 0.0005 k + 0.01 s


@pytest.fixture(scope="module")
def models(pair_dir):
    target, draft = pair_dir
    return load(target, dtype=torch.float64), load(draft, dtype=torch.float64)


def heads(d: int) -> MedusaHeads:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, d, d, generator=g, dtype=torch.float64) * 0.3 / d**0.5
    return MedusaHeads(w, torch.randn(3, d, generator=g, dtype=torch.float64) * 0.3)


CONFIGS = {
    "draft-fixed": dict(method="draft"),
    "draft-heuristic": dict(method="draft", policy="heuristic"),
    "draft-confidence": dict(method="draft", policy="confidence", confidence_threshold=0.5),
    "draft-optimal": dict(method="draft", policy="optimal", cost_model=CHEAP),
    "draft-optimal-measured": dict(method="draft", policy="optimal"),
    "ngram": dict(method="ngram"),
    "early-exit": dict(method="early-exit", exit_layer=1),
    "medusa": dict(method="medusa"),
    "draft-tree": dict(method="draft", tree="2,2"),
    "medusa-tree": dict(method="medusa", tree="2,1"),
    "target-only": dict(),
}


def generator(models, name: str, k: int = 3) -> SpeculativeGenerator:
    target, draft = models
    kw = dict(CONFIGS[name])
    if kw.get("method") == "medusa":
        kw["heads"] = heads(target.cfg.hidden_size)
    return SpeculativeGenerator(target, draft=draft if kw.get("method") == "draft" else None, k=k, **kw)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("params", [SAMPLED, WARPED], ids=["T1", "warped"])
def test_seeded_row_gives_the_same_tokens_alone_and_among_seeded_and_unseeded_rows(models, name, params):
    gen = generator(models, name)
    alone = gen.generate([PROMPTS[3]], params)[0]
    mates = [
        SamplingParams(
            temperature=1.0, max_new_tokens=5 + 3 * i, seed=None if i % 2 else 7 + i, ignore_eos=True
        )
        for i in range(7)
    ]
    prompts = PROMPTS[:3] + [PROMPTS[3]] + PROMPTS[4:]
    batch = gen.generate(prompts, mates[:3] + [params] + mates[3:])
    assert batch[3].token_ids == alone.token_ids
    assert len(batch) == 8 and len({tuple(r.token_ids) for r in batch}) > 1
    if name not in ("target-only", "draft-optimal-measured"):  # measured costs may turn drafting off
        assert alone.stats.drafted > 0  # the row really drafted


@pytest.mark.parametrize(
    "name", ["draft-fixed", "draft-heuristic", "ngram", "early-exit", "medusa", "draft-tree"]
)
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "T1"])
def test_row_added_after_round_3_equals_the_same_row_run_alone(models, name, params):
    gen = generator(models, name)
    alone = gen.generate([PROMPTS[5]], params)[0]
    others = SamplingParams(temperature=1.0, max_new_tokens=30, seed=5, ignore_eos=True)
    run = gen.stream(PROMPTS[:2], others)
    for i, _ in enumerate(run):
        if i == 2:  # after round 3
            row = run.add(PROMPTS[5], params)
            break
    assert row == 2
    results = run.results()
    assert len(results) == 3 and results[row].token_ids == alone.token_ids
    assert results[row].stats.new_tokens == params.max_new_tokens


def test_rows_added_after_every_row_finished_run_on(models):
    gen = generator(models, "draft-fixed")
    short = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    run = gen.stream([PROMPTS[1]], short)
    assert sum(1 for _ in run) >= 1  # the only row finished: the iteration ended
    row = run.add(PROMPTS[4], GREEDY)
    results = run.results()
    assert [len(r.token_ids) for r in results] == [2, 20]
    assert results[row].token_ids == gen.generate([PROMPTS[4]], GREEDY)[0].token_ids


@pytest.mark.parametrize("name", ["draft-fixed", "early-exit", "medusa", "draft-tree", "draft-optimal"])
def test_two_interleaved_runs_on_one_generator_equal_each_run_alone(models, name):
    gen = generator(models, name)
    a_params = SamplingParams(temperature=1.0, max_new_tokens=18, seed=3, ignore_eos=True)
    want_a = [r.token_ids for r in gen.generate(PROMPTS[:3], a_params)]
    want_b = [r.token_ids for r in gen.generate(PROMPTS[5:7], GREEDY)]
    run_a, run_b = gen.stream(PROMPTS[:3], a_params), gen.stream(PROMPTS[5:7], GREEDY)
    live = [iter(run_a), iter(run_b)]
    while live:  # one round of each in turn
        for it in list(live):
            if next(it, None) is None:
                live.remove(it)
    assert [r.token_ids for r in run_a.results()] == want_a
    assert [r.token_ids for r in run_b.results()] == want_b


def test_unseeded_rows_differ_and_seeded_runs_repeat(models):
    gen = generator(models, "draft-fixed")
    free = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True)
    outs = [r.token_ids for r in gen.generate([PROMPTS[2]] * 4, free)]
    assert len({tuple(o) for o in outs}) > 1  # fresh entropy per row
    assert (
        gen.generate([PROMPTS[2]], SAMPLED)[0].token_ids == gen.generate([PROMPTS[2]], SAMPLED)[0].token_ids
    )


def test_import_specdecode_does_not_load_plotting_stats_or_transformers():
    heavy = "{'matplotlib', 'scipy', 'transformers', 'jinja2', 'rich'}"
    code = f"import specdecode, sys; loaded = {heavy} & set(sys.modules); assert not loaded, loaded"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["draft-fixed", "early-exit", "target-only"])
def test_rows_joining_through_free_slots_and_grown_storage_equal_each_row_alone(models, name):
    gen = generator(models, name)
    lengths = [4, 25, 9, 30, 6, 12, 40, 8]  # rows finish at their own rounds; later ones need room
    params = [
        SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_new_tokens=n, ignore_eos=True)
        for i, n in enumerate(lengths)
    ]
    alone = [gen.generate([p], s)[0].token_ids for p, s in zip(PROMPTS, params)]
    tokens, joins = churn(gen, PROMPTS, params)
    assert tokens == alone
    assert joins["free"] and joins["staged"], joins  # both ways a row joins were taken


KEYED = SamplingParams(temperature=1.0, max_new_tokens=20, seed=7, ignore_eos=True, sampling_rule="invariant")


def test_a_defer_function_is_asked_the_draft_lag_left_after_the_prefix_cache_and_draft_prefill_is_timed(
    pair_dir,
):
    """defer may be a function of (row, lag): it is asked once the prefix cache gave what it
    holds, so a prompt seen before (its blocks carry the draft model's state) costs the draft
    only the tokens past them; rows it defers run cold. The draft's own prefill seconds and
    tokens are counted (the server's payback rule divides them)."""
    target, draft = (load(d, dtype=torch.float32) for d in pair_dir)  # invariant: not fp64
    gen = SpeculativeGenerator(target, draft=draft, k=3, batch_invariant=True)
    gen.enable_prefix_cache(1 << 20)
    prompt = [(5 * j + 1) % 64 for j in range(40)]
    other = [(3 * j + 2) % 64 for j in range(40)]
    alone = gen.generate([prompt, other], GREEDY)
    asked = []

    def defer(row: int, lag: int) -> bool:
        asked.append((row, lag))
        return row == 1

    run = gen.stream([prompt, [9, 8, 7, 6, 5]], GREEDY, defer=defer)
    # the first prompt's 39 cached tokens: two 16-token blocks come back with the draft's state
    assert asked == [(0, 39 - 32), (1, 4)]
    assert run.cold_rows() == [(1, 4)]
    assert run.draft_prefill[1] == 39 - 32 and run.draft_prefill[0] > 0
    assert run.warm(1) == 4 and run.draft_prefill[1] == 7 + 4
    assert [r.token_ids for r in run.results()][0] == alone[0].token_ids


@pytest.mark.parametrize("name", ["draft-fixed", "draft-heuristic"])
def test_deferred_rows_draft_nothing_until_warmed_then_give_the_tokens_of_each_row_alone(models, name):
    """A row admitted without the draft model's prefill (a server under load: defer) proposes
    nothing until warm() feeds its draft model, then drafts; every row's tokens are those of the
    row alone. A seeded row sampled by the standard rule is never deferred (its drafts decide
    its text)."""
    gen = generator(models, name)
    prompts, params = PROMPTS[1:5], [GREEDY, SAMPLED, KEYED, GREEDY]
    alone = [gen.generate([p], s)[0].token_ids for p, s in zip(prompts, params)]
    run = gen.stream(prompts[:3], params[:3], defer=[True, True, True])
    assert [b for b, _ in run.cold_rows()] == [0, 2]  # not the seeded standard-rule row
    drafted_cold = []
    for _ in range(3):
        event = next(run)
        drafted_cold += [int(event.verdict.draft_lengths[b]) for b in (0, 2)]
    assert drafted_cold == [0] * 6
    pending = run.begin([prompts[3]], [params[3]], defer=[True])
    pending.step(None)
    run.join(pending)
    assert [b for b, _ in run.cold_rows()] == [0, 2, 3]
    for b, lag in run.cold_rows():
        assert lag > 0 and run.warm(b) == lag
    assert run.cold_rows() == []
    event = next(run)
    assert all(int(d) > 0 for d in event.verdict.draft_lengths)  # every row drafts again
    assert [r.token_ids for r in run.results()] == alone
