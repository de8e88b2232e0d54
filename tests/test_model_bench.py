"""`specdecode bench --target`: any model, per category; and early exit's warning."""

from __future__ import annotations

import json
import warnings

import pytest

from helpers import write_tiny_gguf
from specdecode.bench.model_bench import category_of, read_prompts
from specdecode.cli import main
from specdecode.errors import SpecDecodeError
from specdecode.models.gguf_import import import_gguf

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("mb")
    _, path = write_tiny_gguf(root)
    model = import_gguf(path, root / "m", progress=False)
    prompts = root / "p.jsonl"
    rows = [
        {"category": "qa", "turns": ["hello hello hello", "second turn is ignored"]},
        {"category": "qa", "prompt": "he he he he"},
        {"category": "writing", "text": "hel hel hel"},
    ]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return model, prompts


def test_bench_on_any_model_reports_every_category_with_greedy_identity(imported, tmp_path, capsys):
    model, prompts = imported
    rc = main(
        [
            "bench",
            "--target",
            str(model),
            "--method",
            "ngram",
            "--prompts",
            str(prompts),
            "--chat",
            "--max-new-tokens",
            "8",
            "--json",
            "--out",
            str(tmp_path),
            "--no-progress",
            "--no-llama-cpp",
        ]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert list(res["categories"]) == ["mt_bench", "qa"]  # MT-bench's categories report as one
    assert res["categories"]["qa"]["prompts"] == 2
    ov = res["overall"]
    assert set(ov["runners"]) == {
        "ours target-only",
        "ours target-only (batch-invariant)",
        "ours ngram (fixed)",
        "ours ngram (fixed, batch-invariant)",
        "transformers generate",
        "transformers prompt lookup (k=4)",
    }
    assert ov["greedy_identical_to_transformers"]["ours ngram (fixed)"] == "3/3"
    assert ov["greedy_identical_to_ours_target_only"] == "3/3"
    # the batch-invariant pair: per category and overall, divergences, cost and a batch of 8
    assert ov["divergences"] == {"plain": 0, "batch_invariant": 0}
    assert set(ov["invariance_cost"]) == {"target_only", "method"}
    assert ov["batch8_divergences"] == 0
    assert res["categories"]["qa"]["batch8_divergences"]["prompts"] == 0
    assert ov["runners"]["ours target-only"]["tokens"] == 3 * 8
    rt = res["runtime"]
    assert rt["verification_cost"] > 0 and rt["memory_floor_tokens_per_s"] > 0
    assert 0 < rt["ours_target_only_fraction_of_floor"]
    assert (tmp_path / "model-bench.json").exists() and (tmp_path / "model-bench.md").exists()


def test_bench_category_filter_and_limit(imported, tmp_path, capsys):
    model, prompts = imported
    rc = main(
        [
            "bench",
            "--target",
            str(model),
            "--prompts",
            str(prompts),
            "--category",
            "qa",
            "--limit",
            "1",
            "--max-new-tokens",
            "4",
            "--json",
            "--out",
            str(tmp_path),
            "--no-progress",
            "--no-transformers",
            "--no-llama-cpp",
        ]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert "divergences" not in res["overall"]  # no method: nothing to diverge
    assert list(res["categories"]) == ["qa"] and res["categories"]["qa"]["prompts"] == 1
    assert list(res["overall"]["runners"]) == ["ours target-only", "ours target-only (batch-invariant)"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--category", "poetry"], "unknown --category 'poetry'"),
        (["--prompts", "/no/such.jsonl"], "no such file"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
    ],
)
def test_bench_on_any_model_rejects_bad_input_with_one_line(imported, tmp_path, capsys, args, message):
    model, prompts = imported
    base = ["bench", "--target", str(model), "--out", str(tmp_path), "--no-progress", "--no-llama-cpp"]
    if "--prompts" not in args:
        base += ["--prompts", str(prompts)]
    assert main(base + args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bench_family_flags_need_a_target(capsys):
    assert main(["bench", "--method", "ngram"]) == 2
    assert "--method needs --target" in capsys.readouterr().err
    assert main(["bench", "--prompts", "spec-bench"]) == 2
    assert "number of prompts per set" in capsys.readouterr().err


def test_spec_bench_prompts_ship_with_the_repository():
    rows = read_prompts("spec-bench")
    assert len(rows) == 180
    counts = {c: sum(r["category"] == c for r in rows) for c in {r["category"] for r in rows}}
    assert counts == {
        "mt_bench": 80,
        "translation": 20,
        "summarization": 20,
        "qa": 20,
        "math_reasoning": 20,
        "rag": 20,
    }
    assert category_of("coding") == "mt_bench"


def test_prompt_file_lines_without_a_prompt_are_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"category": "qa"}\n')
    with pytest.raises(SpecDecodeError, match="has no prompt"):
        read_prompts(str(bad))


def test_early_exit_from_an_untrained_layer_warns_with_the_measured_acceptance(pair_dir, capsys):
    from specdecode.drafters.early_exit import UntrainedExitWarning
    from specdecode.engine import SpeculativeGenerator
    from specdecode.models import load

    with pytest.warns(UntrainedExitWarning, match="not trained to draft"):
        SpeculativeGenerator(load(pair_dir[0]), method="early-exit", exit_layer=1)
    rc = main(
        [
            "generate",
            "--target",
            str(pair_dir[0]),
            "--method",
            "early-exit",
            "--prompt",
            "abc",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0",
        ]
    )
    assert rc == 0
    err = capsys.readouterr().err
    assert "warning: early exit at layer 1 of 2" in err and "acceptance on this run" in err
    assert "--policy optimal" in err


def test_early_exit_from_a_trained_layer_does_not_warn():
    from specdecode.engine import SpeculativeGenerator
    from specdecode.models import load

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen = SpeculativeGenerator(load("three-kingdoms/target"), method="early-exit")
    assert gen.drafter.advice is None
