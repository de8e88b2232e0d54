"""The `specdecode` command: the design.md contract, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest
import torch

from specdecode.cli import main
from specdecode.models.init import init_model

STATS_KEYS = {
    "rounds",
    "target_forwards",
    "drafted",
    "accepted",
    "acceptance_rate",
    "tokens_per_forward",
    "per_position_acceptance",
    "wall_s",
    "tokens_per_s",
}
TRACE_KEYS = {
    "row",
    "round",
    "draft_token_ids",
    "draft_prob",
    "target_prob",
    "accept_prob",
    "uniform",
    "accepted",
    "emitted_token_ids",
    "how",
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return {
        "t": str(init_model(root / "t", vocab=64, layers=2, dim=32, seed=0)),
        "d": str(init_model(root / "d", vocab=64, layers=1, dim=16, seed=1)),
        "other": str(init_model(root / "o", vocab=72, layers=1, dim=16, seed=2)),
    }


def run_cli(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors (a bad choice): one line, code 2
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "ab", "--k", "0"], "--k must be an integer >= 1"),
        (["--prompt", "ab", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt", "ab", "--top-p", "0"], "top-p must be in (0, 1]"),
        (["--prompt", "ab", "--top-p", "1.5"], "top-p must be in (0, 1]"),
        (["--prompt", "ab", "--min-p", "1"], "min-p must be in [0, 1)"),
        (["--prompt", "ab", "--max-new-tokens", "0"], "max-new-tokens must be >= 1"),
        (["--prompt", "ab", "--policy", "bogus"], "argument --policy: invalid choice: 'bogus'"),
        (["--prompt", "ab", "--method", "bogus"], "unknown method"),
        (["--prompt", "ab", "--device", "tpu"], "device"),
        (["--prompt", "ab", "--cost-model", "c.json"], "--cost-model is read by --policy optimal only"),
    ]
    + ([] if torch.cuda.is_available() else [(["--prompt", "ab", "--device", "cuda"], "no CUDA GPU")]),
)
def test_bad_input_exits_2_with_one_line(dirs, capsys, extra, needle):
    code, out, err = run_cli(["generate", "--target", dirs["t"], "--draft", dirs["d"], *extra], capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and needle in err, err


def test_unknown_model_exits_2_with_one_line(capsys):
    code, _, err = run_cli(["generate", "--target", "nope/none", "--prompt", "ab"], capsys)
    assert code == 2 and err.count("\n") == 1 and "unknown model 'nope/none'" in err


def test_vocab_mismatch_exits_2_naming_both_sizes(dirs, capsys):
    code, _, err = run_cli(
        ["generate", "--target", dirs["t"], "--draft", dirs["other"], "--prompt", "ab"], capsys
    )
    assert code == 2 and err.count("\n") == 1 and "target has 64 tokens, draft has 72" in err


def test_usage_errors_are_one_line_too(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--target", "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prompt" in err


def test_json_has_the_contract_fields_and_speculative_equals_target_only(dirs, capsys):
    base = [
        *"generate --target".split(),
        dirs["t"],
        *"--temperature 0 --prompt ab --max-new-tokens 32 --json --ignore-eos".split(),
    ]
    code, out, _ = run_cli(base + ["--draft", dirs["d"]], capsys)
    assert code == 0
    spec = json.loads(out)
    assert set(spec) == {"text", "token_ids", "stats"}
    assert STATS_KEYS <= set(spec["stats"])
    assert len(spec["token_ids"]) == 32
    _, out, _ = run_cli(base, capsys)
    assert json.loads(out)["token_ids"] == spec["token_ids"]


def test_num_return_sequences_gives_independent_samples(dirs, capsys):
    code, out, _ = run_cli(
        [
            *"generate --target".split(),
            dirs["t"],
            *"--draft".split(),
            dirs["d"],
            *"--prompt ab --seed 0 --num-return-sequences 4 --max-new-tokens 16 --json --ignore-eos".split(),
        ],
        capsys,
    )
    assert code == 0
    res = json.loads(out)
    assert len(res["samples"]) == 4
    assert res["samples"][0]["token_ids"] == res["token_ids"]
    assert len({tuple(s["token_ids"]) for s in res["samples"]}) > 1
    assert res["stats"]["rounds"] >= 4


def test_trace_writes_one_line_per_round_with_contract_fields(dirs, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    code, out, _ = run_cli(
        [
            *"generate --target".split(),
            dirs["t"],
            *"--draft".split(),
            dirs["d"],
            # fixed k: every round drafts 4 (generate's default with a draft model is confidence)
            *"--policy fixed --prompt ab --seed 3 --max-new-tokens 20 --json --ignore-eos --trace".split(),
            str(trace),
        ],
        capsys,
    )
    assert code == 0
    res = json.loads(out)
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(lines) == res["stats"]["rounds"]
    assert all(set(x) == TRACE_KEYS for x in lines)
    assert [t for x in lines for t in x["emitted_token_ids"]] == res["token_ids"]
    for x in lines:
        assert len(x["how"]) == len(x["emitted_token_ids"])
        assert len(x["draft_prob"]) == len(x["uniform"]) == len(x["accepted"]) == 4


def test_plain_output_streams_text_and_reports_speed(dirs, capsys):
    code, out, err = run_cli(
        [
            *"generate --target".split(),
            dirs["t"],
            *"--draft".split(),
            dirs["d"],
            *"--prompt ab --temperature 0 --max-new-tokens 8 --ignore-eos".split(),
        ],
        capsys,
    )
    assert code == 0 and out.strip() != ""
    assert "tokens/s" in err and "acceptance" in err


@pytest.mark.heavy
def test_init_model_then_generate_in_fresh_processes(tmp_path):
    """The issue's 'done when' commands, as a user runs them (no traceback, JSON on stdout)."""
    exe = [sys.executable, "-m", "specdecode.cli"]
    for out, args in (
        (tmp_path / "t", ["--layers", "2", "--dim", "32", "--seed", "0"]),
        (tmp_path / "d", ["--layers", "1", "--dim", "16", "--seed", "1"]),
    ):
        subprocess.run(
            exe + ["init-model", str(out), "--vocab", "64", *args], check=True, capture_output=True
        )
    gen = exe + [
        "generate",
        "--target",
        str(tmp_path / "t"),
        "--temperature",
        "0",
        "--prompt",
        "ab",
        "--max-new-tokens",
        "32",
        "--json",
    ]
    spec = subprocess.run(gen + ["--draft", str(tmp_path / "d")], check=True, capture_output=True, text=True)
    plain = subprocess.run(gen, check=True, capture_output=True, text=True)
    assert json.loads(spec.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    bad = subprocess.run(gen + ["--k", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1


def test_optimal_policy_cost_model_file_is_written_then_read(dirs, tmp_path, capsys):
    cost = tmp_path / "cost.json"
    argv = ["generate", "--target", dirs["t"], "--draft", dirs["d"], "--policy", "optimal", "--prompt", "ab"]
    argv += ["--seed", "3", "--max-new-tokens", "16", "--ignore-eos", "--json", "--cost-model", str(cost)]
    code, first, _ = run_cli(argv, capsys)
    assert code == 0 and cost.exists()
    written = cost.read_text()
    code, second, _ = run_cli(argv, capsys)
    assert code == 0 and cost.read_text() == written  # read, not re-measured
    assert json.loads(first)["token_ids"] == json.loads(second)["token_ids"]


def test_num_return_sequences_with_a_seed_gives_independent_samples(dirs, capsys):
    argv = ["generate", "--target", dirs["t"], "--prompt", "ab", "--seed", "1", "--ignore-eos"]
    code, out, _ = run_cli([*argv, "--num-return-sequences", "4", "--max-new-tokens", "12", "--json"], capsys)
    samples = [s["token_ids"] for s in json.loads(out)["samples"]]
    assert code == 0 and len({tuple(s) for s in samples}) > 1


def test_max_tokens_and_max_new_tokens_are_one_flag_in_every_subcommand():
    """generate shows --max-new-tokens and chat --max-tokens (the server's name); each takes the other."""
    from specdecode.cli import build_parser

    parser = build_parser()
    for cmd in ("generate", "chat"):
        for flag in ("--max-new-tokens", "--max-tokens"):
            args = parser.parse_args([cmd, "--target", "t", "--prompt", "p", flag, "7"] if cmd == "generate"
                                     else [cmd, "--target", "t", flag, "7"])
            assert args.max_new_tokens == 7, (cmd, flag)
