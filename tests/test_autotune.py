"""The one loading path (specdecode.open / open_models) and dtype="auto": the weight-format table
is the only list, the choice ranks measured costs as documented, is cached per machine, and every
format it may pick keeps greedy speculative output equal to target-only (batch-invariant by
default). Tiny random models only; the real pair's figures are in benchmarks/."""

from __future__ import annotations

import json

import pytest

import specdecode
from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.autotune import Choice, FormatCosts, Shapes, _pick, best_step, choose
from specdecode.cli import main
from specdecode.core.config import DRAFT_DTYPES
from specdecode.errors import SpecDecodeError
from specdecode.formats import DRAFT_FORMATS, FORMATS, WEIGHT_FORMATS, weight_format
from specdecode.opener import open_models

TINY = Shapes(hidden=64, qkv_out=128, attn_in=64, inter=96, layers=2, vocab=80)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_every_front_end_reads_the_one_format_table():
    from specdecode import roofline
    from specdecode.cli import options
    from specdecode.models import GGUF_QUANTS

    assert options.WEIGHT_FORMATS == WEIGHT_FORMATS == tuple(FORMATS)
    assert DRAFT_DTYPES == DRAFT_FORMATS and not set(GGUF_QUANTS) & set(DRAFT_FORMATS)
    assert set(GGUF_QUANTS) == {n for n, f in FORMATS.items() if f.gguf}
    for name, f in FORMATS.items():
        assert roofline.DTYPE_BYTES[name] == f.bytes_per_weight
        dtype, quant = weight_format(name)
        assert str(dtype) == f"torch.{f.activations}" and quant == f.quant
    with pytest.raises(SpecDecodeError, match="choose one of"):
        weight_format("int3")


def _choice(k=4):
    target = [
        FormatCosts("fp32", t1=0.30, tk=0.34),
        FormatCosts("bf16", t1=0.13, tk=0.14),  # cheapest verification
        FormatCosts("w8a8", t1=0.06, tk=0.17),
        FormatCosts("int4", t1=0.05, tk=0.20),  # cheapest step
        FormatCosts("int8", error="kernel failed its check"),
    ]
    draft = [FormatCosts("bf16", t1=0.05), FormatCosts("int4", t1=0.02), FormatCosts("w8a8", error="x")]
    return Choice("", None, k, True, "measured", target, draft)


def test_auto_ranks_targets_by_the_round_with_or_without_a_drafter():
    """One target format per machine and model: a target-only run takes the format a speculative
    run verifies in (so adding a drafter never changes the text), not the cheapest step."""
    spec = _pick(_choice(), speculative=True)
    assert (spec.target, spec.draft) == ("bf16", "int4")
    solo = _pick(_choice(), speculative=False)
    assert solo.target == "bf16" and best_step(solo) == "int4"  # the cheapest step, reported apart
    only_broken = Choice("", None, 4, True, "measured", [FormatCosts("int8", error="x")], [])
    with pytest.raises(SpecDecodeError, match="no weight format ran"):
        _pick(only_broken, speculative=True)


def test_the_choice_counts_a_prompt_token_per_generated_token_so_a_format_slow_on_prompts_loses():
    c = _choice()
    c.target_costs = [
        FormatCosts("int4", t1=0.044, tk=0.050, tp=1 / 64),
        FormatCosts("w8a8", t1=0.048, tk=0.055, tp=1 / 225),
    ]
    # per token of a round (tau 3.36 at alpha 0.8, k 4): 16.4 + 4.4 ms < 14.9 + 15.6 ms
    assert _pick(c, speculative=False).target == _pick(c, speculative=True).target == "w8a8"
    assert best_step(c) == "int4"  # the cheapest step alone (the demo's strictest baseline)
    c.target_costs[1].tp = 1 / 70
    assert _pick(c, speculative=False).target == "int4"  # no faster on prompts: the round decides


def test_default_target_only_and_speculative_runs_choose_the_same_target_format(pair_dir, cache):
    """dtype auto measures the target once (its own cache file) and both runs read it."""
    target_dir, draft_dir = (str(p) for p in pair_dir)
    solo = open_models(target_dir, k=3, dtype="auto", log=lambda _: None)
    spec = open_models(target_dir, draft=draft_dir, k=3, dtype="auto", log=lambda _: None)
    assert solo.choice.target == spec.choice.target
    assert solo.choice.how == "measured" and spec.choice.target_costs == solo.choice.target_costs
    assert {c.format for c in spec.choice.target_costs} >= {"w8a8", "int4", "kq"}


def test_a_draft_whose_step_format_is_slow_on_prompts_gets_a_prefill_copy_only_when_it_pays():
    def draft_of(int4_tp: float) -> Choice:
        c = _choice()
        c.draft_costs = [
            FormatCosts("int4", t1=0.015, tp=int4_tp),  # the cheapest step
            FormatCosts("w8a8", t1=0.016, tp=0.0015),  # the cheapest prompt token
            FormatCosts("bf16", t1=0.034, tp=0.0018),
        ]
        return _pick(c, speculative=True)

    slow = draft_of(0.0043)  # int4 prompts 2.9x slower: its prompts on w8a8
    assert (slow.draft, slow.draft_prefill) == ("int4", "w8a8")
    assert "with its prompts on a w8a8 copy (2.9x faster)" in slow.line()
    assert draft_of(0.0020).draft_prefill is None  # 1.3x: not worth a second copy
    assert _pick(_choice(), speculative=True).draft_prefill is None  # nothing timed on prompts
    old = Choice.from_dict({k: v for k, v in slow.to_dict().items() if k != "draft_prefill"})
    assert old.draft_prefill is None  # a cached choice from before the prompt timing reads


def test_open_loads_the_drafts_prefill_copy_the_choice_asks_for_and_the_draft_prefills_on_it(
    pair_dir, cache, monkeypatch
):
    from specdecode import autotune, opener

    real = autotune._pick

    def forced(choice, speculative):
        choice = real(choice, speculative)
        choice.draft, choice.draft_prefill = "int4", "w8a8"
        return choice

    monkeypatch.setattr(autotune, "_pick", forced)
    target_dir, draft_dir = pair_dir
    loaded = opener.open_models(str(target_dir), draft=str(draft_dir), k=3, dtype="auto", log=lambda _: None)
    twin = loaded.draft.prefill_model
    assert loaded.draft.quant == "int4" and twin.quant == "w8a8"
    fed = []
    real_forward = type(twin).forward
    def forward(self, *a, **kw):
        fed.append(self is twin)
        return real_forward(self, *a, **kw)

    monkeypatch.setattr(type(twin), "forward", forward)
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    spec = SpeculativeGenerator(loaded.target, draft=loaded.draft, config=loaded.config)
    got = [r.token_ids for r in spec.generate(PROMPTS, params)]
    assert any(fed) and not all(fed)  # the prompts on the copy, the drafts (and the target) not
    solo = SpeculativeGenerator(loaded.target, batch_invariant=True)
    assert got == [r.token_ids for r in solo.generate(PROMPTS, params)]


def test_auto_choice_is_measured_once_per_machine_then_read_from_the_cache(cache):
    fmts = ("fp32", "int8", "w8a8")
    first = choose(TINY, TINY, k=2, invariant=True, speculative=True, name="t", target_formats=fmts)
    assert first.how == "measured" and first.target in fmts and first.draft is not None
    assert {c.format for c in first.target_costs} == set(fmts)
    assert all(c.error is None and 0 < c.t1 and 0 < c.tk for c in first.target_costs)
    again = choose(TINY, TINY, k=2, invariant=True, speculative=True, name="t", target_formats=fmts)
    assert again.how == "cached" and again.target_costs == first.target_costs
    assert [c["format"] for c in json.loads(open(again.cache).read())["costs"]] == list(fmts)
    redo = choose(
        TINY, TINY, k=2, invariant=True, speculative=True, name="t", target_formats=fmts, recalibrate=True
    )
    assert redo.how == "measured"
    other_k = choose(TINY, TINY, k=3, invariant=True, speculative=True, name="t", target_formats=fmts)
    assert other_k.how == "measured" and other_k.cache != first.cache


PROMPTS = ["0 1 2 3", "9 8 7", "5 5 5 5 5 5"]


@pytest.mark.parametrize("fmt", ["auto", "fp32", "bf16", "w8a8", "int4", "kq"])
def test_every_format_the_auto_choice_may_pick_is_greedy_identical_to_target_only(pair_dir, cache, fmt):
    """open_models' default forward is batch-invariant, so whatever format runs the target (the
    measured choice or a pinned one), greedy speculative tokens equal target-only's in that format."""
    target_dir, draft_dir = pair_dir
    loaded = open_models(str(target_dir), draft=str(draft_dir), k=3, dtype=fmt, log=lambda line: None)
    assert loaded.config.batch_invariant and loaded.choice.target in WEIGHT_FORMATS
    assert loaded.choice.draft in DRAFT_FORMATS
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    spec = SpeculativeGenerator(loaded.target, draft=loaded.draft, config=loaded.config)
    solo = SpeculativeGenerator(loaded.target, batch_invariant=True)
    got = [r.token_ids for r in spec.generate(PROMPTS, params)]
    want = [r.token_ids for r in solo.generate(PROMPTS, params)]
    assert got == want
    assert sum(r.stats.accepted for r in spec.generate(PROMPTS[:1], params)) > 0


def test_open_returns_a_generator_that_says_which_formats_run(pair_dir, cache):
    target_dir, draft_dir = pair_dir
    lines = []
    gen = specdecode.open(str(target_dir), draft=str(draft_dir), dtype="auto", k=2, log=lines.append)
    assert gen.choice.how == "measured" and gen.k == 2 and gen.batch_invariant
    assert len(lines) == 1 and lines[0].startswith("specdecode: formats: target ")
    assert gen.choice.summary()["target"] == gen.choice.target
    plain = specdecode.open(str(target_dir), log=lines.append)  # a local directory: fp32, said nowhere
    assert plain.choice.how == "default" and plain.choice.target == "fp32" and len(lines) == 1
    opted_out = specdecode.open(str(target_dir), dtype="bf16", batch_invariant=False)
    assert opted_out.choice.how == "pinned" and not opted_out.batch_invariant
    # "none", as the command line spells it, is target-only here too (it raised before)
    assert specdecode.open(str(target_dir), method="none", log=lines.append).drafter is None
    with pytest.raises(SpecDecodeError, match="method 'none' runs the target alone"):
        specdecode.open(str(target_dir), draft=str(draft_dir), method="none")


def test_draft_dtype_without_a_drafter_is_one_line_before_anything_loads(pair_dir, capsys):
    target_dir, _ = pair_dir
    with pytest.raises(SpecDecodeError, match="--draft-dtype needs --draft"):
        open_models(str(target_dir), draft_dtype="int4")
    with pytest.raises(SpecDecodeError, match="unknown dtype 'int3'"):
        open_models(str(target_dir), dtype="int3")
    for argv in (
        ["generate", "--target", str(target_dir), "--draft-dtype", "int4", "--prompt", "x"],
        ["serve", "--target", str(target_dir), "--draft-dtype", "int4", "--method", "ngram"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--draft-dtype needs --draft" in err[0]


def test_generate_json_reports_the_auto_choice_and_models_calibrate_prints_the_table(pair_dir, cache, capsys):
    target_dir, draft_dir = pair_dir
    argv = ["generate", "--target", str(target_dir), "--draft", str(draft_dir), "--dtype", "auto"]
    assert main([*argv, "--prompt", "1 2 3", "--temperature", "0", "--max-new-tokens", "8", "--json"]) == 0
    out = capsys.readouterr()
    formats = json.loads(out.out)["stats"]["formats"]
    assert formats["how"] == "measured" and formats["batch_invariant"] is True
    assert "specdecode: formats: target" in out.err
    assert (
        main(["models", "--calibrate", "--target", str(target_dir), "--draft", str(draft_dir), "--json"]) == 0
    )
    row = json.loads(capsys.readouterr().out)
    assert row["how"] == "measured" and {c["format"] for c in row["target_costs"]} >= {"fp32", "w8a8", "int4"}
    assert main(["models", "--calibrate", "--target", str(target_dir), "--k", "2"]) == 0
    text = capsys.readouterr().out
    assert "<- chosen" in text and "T(3) ms" in text


def test_a_draft_model_drafts_with_the_prefix_policy_unless_one_is_asked(pair_dir, cache):
    """open_models' default draft-length policy: prefix with a draft model (measured faster on
    the Qwen pair), fixed for model-free methods and token trees; a given policy is kept, and
    generate passes none unless --policy is on its command line."""
    from specdecode.cli import build_parser
    from specdecode.cli.options import spec_config
    from specdecode.opener import spec_fields

    target_dir, draft_dir = pair_dir
    quiet = {"log": lambda line: None, "dtype": "fp32"}
    assert open_models(str(target_dir), draft=str(draft_dir), **quiet).config.policy == "prefix"
    auto = open_models(str(target_dir), draft=str(draft_dir), method="auto", **quiet)
    assert auto.config.policy == "prefix"
    assert open_models(str(target_dir), method="ngram", **quiet).config.policy == "fixed"
    tree = open_models(str(target_dir), draft=str(draft_dir), tree="2,1", **quiet)  # a tree's shape is fixed
    assert tree.config.policy == "fixed"
    pinned = open_models(str(target_dir), draft=str(draft_dir), policy="heuristic", **quiet)
    assert pinned.config.policy == "heuristic"
    for argv, kept in (([], False), (["--policy", "fixed"], True)):
        args = build_parser().parse_args(["generate", "--target", "t", "--prompt", "x", *argv])
        fields = spec_fields(spec_config(args), keep_default_policy=args.policy is None)
        assert ("policy" in fields) is kept


def test_the_prefix_threshold_is_a_draft_step_and_a_verified_row_over_a_target_step(pair_dir, cache):
    """Choice.prefix_threshold: (d + (T(k+1) - T(1)) / k) / T(1) from the chosen formats' costs,
    within [0.1, 0.9], None without them; open_models sets it for the prefix policy when no
    threshold is given and says so on the choice line, and keeps a given one."""
    c = _choice()
    c.target, c.draft = "w8a8", "int4"  # T(1) 60 ms, T(5) 170 ms, a draft step 20 ms
    assert c.prefix_threshold() == pytest.approx(round((0.02 + 0.11 / 4) / 0.06, 2))
    c.draft = "bf16"  # 50 ms a step: capped
    assert c.prefix_threshold() == 0.9
    c.target = "int8"  # failed: no cost
    assert c.prefix_threshold() is None
    target_dir, draft_dir = pair_dir
    lines: list[str] = []
    loaded = open_models(str(target_dir), draft=str(draft_dir), dtype="auto", log=lines.append, k=2)
    expected = loaded.choice.prefix_threshold()
    assert expected is not None and loaded.config.confidence_threshold == expected
    assert f"draft policy prefix (stops below {expected:g}" in lines[-1]
    asked = open_models(str(target_dir), draft=str(draft_dir), dtype="auto", log=lines.append, k=2,
                        confidence_threshold=0.3)  # fmt: skip
    assert asked.config.confidence_threshold == 0.3 and "0.3, as asked" in lines[-1]


def test_the_leading_formats_are_timed_again_and_keep_their_fastest_times(cache, monkeypatch):
    """A slow spell during one pass must not decide for good: the two leading formats of each
    model are timed RETIMES more times, interleaved, each keeping its fastest t1, tk and tp; the
    others once."""
    from specdecode import autotune

    calls: list[str] = []

    def fake(shapes, fmt, k, invariant, repeats=5, with_tk=True):
        calls.append(fmt)
        slow = 3.0 if (fmt == "kq" and calls.count("kq") == 1) else 1.0  # kq's first pass hit a slow spell
        base = {"kq": 0.040, "w8a8": 0.065, "int4": 0.11}[fmt]
        return FormatCosts(fmt, t1=base, tk=base * 1.4 * slow, tp=base / 10 if with_tk else base / 12)

    monkeypatch.setattr(autotune, "measure", fake)
    shapes = Shapes(hidden=64, qkv_out=96, attn_in=64, inter=128, layers=2, vocab=256)
    seen: list[tuple[int, int]] = []
    choice = autotune.choose(
        shapes, None, k=4, invariant=True, speculative=False, target_formats=("kq", "w8a8", "int4"),
        progress=lambda done, total, label: seen.append((done, total)),
    )  # fmt: skip
    assert choice.target == "kq"  # one pass alone: tk 0.168 against w8a8's 0.091, w8a8 chosen
    assert calls == ["kq", "w8a8", "int4"] + ["w8a8", "kq"] * autotune.RETIMES
    kq = choice.cost(choice.target_costs, "kq")
    assert kq.tk == pytest.approx(0.056) and kq.tp == pytest.approx(0.004)
    assert seen[-1][0] == seen[-1][1] and all(d <= t for d, t in seen)  # the progress bar's total holds
