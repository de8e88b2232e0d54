"""The frequency-ranked draft vocabulary (FR-Spec): `specdecode draft-vocab` ranks the tokens of
the target's own answers, a known draft model gets its shipped list by default ("full" opts out),
and a draft over the list keeps greedy output equal to target-only (its sampled distribution is
checked in test_contract's draft_vocab rows)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.cli import main
from specdecode.models import draft_vocab as dv
from specdecode.opener import open_models
from specdecode.train.draft_vocab import ranked, read_prompts


def test_answers_rank_first_and_texts_order_what_answers_never_showed():
    answers = Counter({5: 10, 7: 3, 9: 3})
    texts = Counter({1: 1000, 7: 1, 2: 500})
    ids = ranked(answers, texts)
    assert ids[0] == 5  # the answers' most frequent token
    assert ids.index(7) < ids.index(9)  # tied in the answers: the text count breaks it
    assert ids.index(1) < ids.index(2)  # only in the texts: by their text count
    assert ranked(answers, texts, size=2) == ids[:2]
    assert ranked(Counter({4: 1, 3: 1})) == [3, 4]  # ties by id: reproducible


def test_read_prompts_takes_text_and_messages_and_names_a_bad_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    assert read_prompts(f) == ["a", [{"role": "user", "content": "b"}]]
    f.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(dv.SpecDecodeError, match=r"p.jsonl:2: needs"):
        read_prompts(f)


def _prompts(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["1 2 3", "4 5 6 7", "9 9", "3 1"]))
    return f


def test_draft_vocab_command_writes_the_answers_tokens_and_a_draft_over_them_stays_exact(
    pair_dir, tmp_path, capsys
):
    target_dir, draft_dir = pair_dir
    out = tmp_path / "vocab.json"
    argv = ["draft-vocab", "--target", str(target_dir), "--prompts", str(_prompts(tmp_path))]
    argv += ["--out", str(out), "--no-chat", "--max-new-tokens", "12", "--batch-size", "3", "--size", "24"]
    assert main(argv) == 0
    assert "wrote" in capsys.readouterr().err
    ids = json.loads(out.read_text())
    assert 2 <= len(ids) <= 24 and len(set(ids)) == len(ids) and all(0 <= i < 64 for i in ids)

    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    loaded = open_models(str(target_dir), draft=str(draft_dir), k=3, draft_vocab=str(out), log=lambda s: None)
    assert loaded.config.draft_vocab == str(out)
    spec = SpeculativeGenerator(loaded.target, draft=loaded.draft, config=loaded.config)
    assert spec.drafter.model.draft_vocab_size <= 24 + len(loaded.draft.eos_token_ids)
    solo = SpeculativeGenerator(loaded.target, batch_invariant=True)
    prompts = ["1 2 3", "8 8 8 8"]
    assert [r.token_ids for r in spec.generate(prompts, params)] == [
        r.token_ids for r in solo.generate(prompts, params)
    ]


@pytest.mark.parametrize(
    "extra, message",
    [(["--size", "0"], "--size must be >= 1"), (["--prompts", "nowhere.jsonl"], "no such file")],
)
def test_draft_vocab_command_bad_input_is_one_line_and_exit_2(pair_dir, tmp_path, capsys, extra, message):
    argv = ["draft-vocab", "--target", str(pair_dir[0]), "--prompts", str(_prompts(tmp_path))]
    assert main([*argv, "--out", str(tmp_path / "v.json"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_a_shipped_list_is_used_by_name_and_the_whole_head_is_the_default(pair_dir, tmp_path, monkeypatch):
    target_dir, draft_dir = pair_dir
    listed = tmp_path / "vocab" / "tiny.json"
    listed.parent.mkdir()
    listed.write_text(json.dumps(list(range(30))))
    monkeypatch.setattr(dv, "VOCAB_DIR", listed.parent)
    monkeypatch.setattr(dv, "SHIPPED", ("tiny",))
    quiet = {"log": lambda s: None, "dtype": "fp32"}
    named = open_models(str(target_dir), draft=str(draft_dir), draft_vocab="tiny", **quiet)
    gen = SpeculativeGenerator(named.target, draft=named.draft, config=named.config)
    assert gen.drafter.model.draft_vocab_size == 30 + sum(i >= 30 for i in named.draft.eos_token_ids)
    for default in ({}, {"draft_vocab": "full"}):
        loaded = open_models(str(target_dir), draft=str(draft_dir), **default, **quiet)
        gen = SpeculativeGenerator(loaded.target, draft=loaded.draft, config=loaded.config)
        assert not hasattr(gen.drafter.model, "draft_vocab_size")  # the whole head
    with pytest.raises(dv.SpecDecodeError, match="shipped lists: tiny"):
        open_models(str(target_dir), draft=str(draft_dir), draft_vocab="nope.json", **quiet)


def test_the_shipped_list_is_a_ranked_list_of_distinct_qwen_ids():
    ids = json.loads((dv.VOCAB_DIR / "qwen2.5-coder.json").read_text())
    assert len(ids) == 32768 == len(set(ids)) and all(0 <= i < 151936 for i in ids)


def _reduced(pair_dir, size=40, **kw):
    from specdecode.models import load

    target, draft = (load(p) for p in pair_dir)
    return target, draft, dv.ReducedHeadModel(draft, dv.frequent_ids(draft, size), **kw)


def test_a_row_whose_recent_tokens_leave_the_list_drafts_with_the_whole_heads_own_bits(pair_dir):
    import torch

    _, draft, reduced = _reduced(pair_dir, 40, fallback=6)
    inside, outside = [1, 2, 3, 4, 5, 6, 7], [1, 2, 50, 3, 4, 51, 5]  # 0, 2 of the last 6 out (a quarter: 2)
    one_out = [50, 1, 2, 3, 4, 5, 6]  # its outsider is 7 tokens back: out of the window
    tokens = torch.tensor([inside, outside, one_out])
    whole = reduced.choose_heads(tokens, torch.tensor([7, 7, 7]))
    assert whole.tolist() == [False, True, False]
    assert reduced.choose_heads(tokens, torch.tensor([7, 5, 7])).tolist() == [False, False, False]  # 1 of 5

    def logits(model, rows, whole_rows=None):
        cache = model.new_cache(len(rows), 16, invariant=True)
        if whole_rows is not None:
            model.whole_rows = torch.tensor(whole_rows)
        out, _ = model.forward(torch.tensor(rows), cache)
        return out[:, -1]

    mixed = logits(reduced, [inside, outside, one_out], [False, True, False])
    plain = logits(draft, [inside, outside, one_out])
    assert torch.equal(mixed[1], plain[1])  # the whole head: the model's own logits, bit for bit
    ids = dv.frequent_ids(draft, 40)
    for r in (0, 2):
        assert torch.equal(mixed[r, ids], plain[r, ids])  # the list's rows of the same head
        rest = torch.ones(draft.vocab_size, dtype=torch.bool)
        rest[ids] = False
        assert torch.isinf(mixed[r, rest]).all()
    alone = logits(reduced, [inside], [False])  # a row's logits do not depend on its batch
    assert torch.equal(alone[0], mixed[0])
    reduced.fallback = 0  # the list's head always
    assert reduced.choose_heads(tokens, torch.tensor([7, 7, 7])) is None and reduced.whole_rows is None


def test_greedy_with_a_list_and_its_fallback_equals_target_only_in_a_ragged_batch(pair_dir):
    from specdecode import SpecConfig

    target, draft, _ = _reduced(pair_dir)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [45, 50, 2, 60, 3], [9, 8, 7, 6, 5, 4, 3]]  # inside, outside, inside
    solo = SpeculativeGenerator(target, batch_invariant=True)
    want = [r.token_ids for r in solo.generate(prompts, params)]
    for fallback in (None, 0, 3):  # 3: a quarter of 3 tokens is one, so the second prompt falls back
        config = SpecConfig(
            method="draft", k=3, draft_vocab=40, draft_vocab_fallback=fallback, batch_invariant=True
        )
        gen = SpeculativeGenerator(target, draft=draft, config=config)
        got = gen.generate(prompts, params)
        assert [r.token_ids for r in got] == want
        assert sum(r.stats.drafted for r in got) > 0


def test_a_greedy_chain_over_the_list_draws_and_stops_as_over_the_whole_row(pair_dir, monkeypatch):
    """ReducedHeadModel.step gives a greedy chain the list's logits only (no [B, V] row): the same
    values as forward()'s row, its argmax the row's (ties to the smallest id), and a confidence
    policy's stops where the full softmax stops: the same drafts, rounds and text."""
    import torch

    from specdecode import SpecConfig
    from specdecode.drafters.base import DraftChain

    target, draft, reduced = _reduced(pair_dir, 40, fallback=0)
    rows = torch.tensor([[1, 2, 3, 4], [9, 8, 7, 6]])
    a, b = reduced.new_cache(2, 16, invariant=True), reduced.new_cache(2, 16, invariant=True)
    reduced.forward(rows, a), reduced.forward(rows, b)
    step = reduced.step(torch.tensor([[5], [5]]), a)
    assert isinstance(step, dv.ListedLogits)
    assert torch.equal(step.full(), reduced.forward(torch.tensor([[5], [5]]), b)[0][:, -1])
    tie = dv.ListedLogits(torch.tensor([[0.0, 3.0, 3.0, 1.0]]), torch.tensor([2, 5, 9, 11]), 16)
    assert tie.ids[tie.values.argmax(-1)].tolist() == tie.full().argmax(-1).tolist() == [5]

    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3]]
    config = SpecConfig(method="draft", k=4, draft_vocab=40, draft_vocab_fallback=0, policy="confidence")
    drawn, real = [], DraftChain.draw

    def draw(self, logits):
        drawn.append(type(logits))
        return real(self, logits)

    monkeypatch.setattr(DraftChain, "draw", draw)

    def run():
        got = SpeculativeGenerator(target, draft=draft, config=config).generate(prompts, params)
        return [(r.token_ids, r.stats.drafted, r.stats.rounds) for r in got]

    listed = run()
    assert dv.ListedLogits in drawn  # the chain's later steps came as the list's logits
    monkeypatch.setattr(dv.ReducedHeadModel, "step", property(lambda self: None))  # full rows only
    drawn.clear()
    assert run() == listed and dv.ListedLogits not in drawn


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_fallback_is_a_one_line_error(value):
    from specdecode import SpecConfig

    with pytest.raises(dv.SpecDecodeError, match="draft_vocab_fallback must be an integer >= 0"):
        SpecConfig(method="draft", draft_vocab=40, draft_vocab_fallback=value)


def test_the_zoo_draft_gets_its_shipped_list_by_default_where_our_cpu_runtime_runs_it():
    from specdecode.opener import default_draft_vocab

    draft = "qwen2.5-coder-0.5b"
    assert default_draft_vocab(draft, "draft", "auto", "cpu") == "qwen2.5-coder" in dv.SHIPPED
    assert default_draft_vocab(draft, "auto", "lean", "cpu") == "qwen2.5-coder"
    for args in [
        (draft, "draft", "openvino", "cpu"),
        (draft, "draft", "hf", "cpu"),
        (draft, "draft", "auto", "cuda"),
        (draft, "suffix", "auto", "cpu"),
        ("smollm2-135m", "draft", "auto", "cpu"),
        (None, "auto", "auto", "cpu"),
    ]:
        assert default_draft_vocab(*args) is None, args


def test_releasing_a_files_pages_after_a_head_selection_keeps_its_bytes(tmp_path):
    import numpy as np

    from specdecode.models.kernel_linear import _release_mapped

    data = np.arange(3 * 8192, dtype=np.uint8).reshape(3, 8192)
    path = tmp_path / "blocks.bin"
    data.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=(3, 8192))
    view = mapped[1:]
    before = np.array(view)
    _release_mapped(view)  # the pages go back to the OS; a read faults them in from the file
    assert np.array_equal(view, before)
    owned = np.array(data)
    _release_mapped(owned)  # not a file's view: left alone
    assert np.array_equal(owned, data)


def test_a_draft_model_times_only_the_tokens_it_fell_behind_on(pair_dir):
    """A server's learned round costs leave out a draft model's catch-up (serve/loop.py): a
    round that feeds it one or two tokens counts none, one that feeds it many counts its seconds,
    once (take_catch_up_seconds resets)."""
    import torch

    from specdecode.core.draft_context import DraftContext
    from specdecode.core.sampling import Warp
    from specdecode.drafters import DraftModelDrafter
    from specdecode.models import load

    target, draft = (load(p) for p in pair_dir)
    drafter = DraftModelDrafter(draft, target)
    tokens = torch.randint(0, 64, (1, 64))
    state = drafter.start(DraftContext(tokens, torch.tensor([5]), Warp.greedy(1), None))
    drafter.prefill(state, DraftContext(tokens, torch.tensor([5]), Warp.greedy(1), None), torch.tensor([4]))
    limits = torch.tensor([2])
    drafter.propose(state, DraftContext(tokens, torch.tensor([5]), Warp.greedy(1), None), limits)
    assert drafter.take_catch_up_seconds() == 0.0  # one pending token: an ordinary round
    drafter.commit(state, torch.tensor([5]))
    drafter.propose(state, DraftContext(tokens, torch.tensor([40]), Warp.greedy(1), None), limits)
    assert drafter.take_catch_up_seconds() > 0.0  # 35 tokens behind: a catch-up
    assert drafter.take_catch_up_seconds() == 0.0  # taken once
