"""The lab: each experiment on tiny random models asserts what must hold (exactness of the
residual rule, the bias of resampling from p, greedy identity, round accounting, the formulas)."""

import json

import numpy as np
import pytest
import torch

from helpers import check_distribution, noisy_copy
from specdecode.cli import main
from specdecode.lab import LabConfig, run_experiment
from specdecode.lab.common import next_token_probs
from specdecode.lab.rules import scheme_resample_from_p, scheme_residual
from specdecode.lab.stats import noise_tvs, tv

PROMPTS = ("the cat sat", "once upon a time", "x = 1", "hello there")


@pytest.fixture(scope="module")
def far_draft(pair_dir, tmp_path_factory):
    """A draft that disagrees with the target often (alpha well below 1)."""
    return noisy_copy(pair_dir[0], tmp_path_factory.mktemp("far") / "draft", noise=1.0, seed=3)


@pytest.fixture(scope="module")
def cfg(pair_dir, far_draft):
    target, draft = pair_dir
    return LabConfig(
        str(target), (str(draft), str(far_draft)), PROMPTS[0], PROMPTS, quick=True, progress=False
    )


@pytest.mark.heavy
def test_residual_rule_keeps_target_distribution_and_resampling_from_p_does_not(cfg):
    target, draft = cfg.model(cfg.target), cfg.model(cfg.drafts[1])
    ids = target.tokenizer.encode(cfg.prompt)
    p, q = next_token_probs(target, ids), next_token_probs(draft, ids)
    n = 100_000
    g = torch.Generator().manual_seed(0)
    counts_c, accept = scheme_residual(p, q, n, g)
    ok, msg = check_distribution(np.repeat(np.arange(len(p)), counts_c.astype(int)), p)
    assert ok, msg
    alpha = np.minimum(p, q).sum()
    assert abs(accept - alpha) < 4 * np.sqrt(alpha * (1 - alpha) / n)
    # (b) follows its closed form r = min(p, q) + (1 - alpha) p, not p
    counts_b = scheme_resample_from_p(p, q, n, g)
    r = np.minimum(p, q) + (1 - alpha) * p
    ok_b, msg_b = check_distribution(np.repeat(np.arange(len(p)), counts_b.astype(int)), r)
    assert ok_b, msg_b
    assert tv(counts_b, p) > np.quantile(noise_tvs(p, n, 40), 0.99) * 3


def test_sampling_noise_is_simulated_for_a_float32_distribution_that_rounds_above_one():
    """A float32 distribution (a torch softmax product) can sum to 1 + 5e-8: numpy's multinomial
    refused it and a distribution test failed with a traceback on one CPU kind, not on another."""
    p = np.array([0.3, 0.3, 0.3, 0.1, 0.0], dtype=np.float32)
    assert p[:-1].astype(np.float64).sum() > 1 + 1e-12  # what numpy refuses
    tvs = noise_tvs(p, 1000, sims=8)
    assert tvs.shape == (8,) and (tvs >= 0).all() and tvs.max() < 0.1


def test_rules_experiment_checks_hold_on_tiny_models(cfg):
    res = run_experiment("rules", cfg, draws=50_000)
    assert res.checks["residual_tv_below_noise_p99"] and res.checks["residual_chi2_p_above_1e-4"]
    for case in res.data["cases"]:
        assert 0 < case["alpha"] <= 1
        assert abs(case["match_measured"] - case["match_theory"]) < 0.02


def test_greedy_experiment_is_identical_in_every_cell(cfg):
    res = run_experiment("greedy", cfg)
    assert res.data["cells_total"] == len(PROMPTS) * 2 * 2
    assert res.data["identical"] == res.data["cells_total"]
    assert res.checks == {"all_identical": True}


def test_replay_rounds_emit_1_to_k_plus_1_and_sum_to_the_output(cfg, tmp_path):
    res = run_experiment("replay", cfg, k=3, new_tokens=40)
    per_round = res.data["emitted_per_round"]
    assert all(1 <= n <= 4 for n in per_round)
    assert sum(per_round) == res.data["tokens"] == 40
    assert res.data["rounds"] == len(per_round)
    assert all(res.checks.values())


def test_replay_reads_a_generate_trace_file(cfg, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    main(
        [
            "generate",
            "--target",
            cfg.target,
            "--draft",
            cfg.drafts[0],
            "--prompt",
            "ab",
            "--seed",
            "1",
            "--max-new-tokens",
            "20",
            "--trace",
            str(trace),
            "--json",
            "--ignore-eos",
        ]
    )
    produced = json.loads(capsys.readouterr().out)
    code = main(
        [
            "lab",
            "replay",
            "--target",
            cfg.target,
            "--draft",
            cfg.drafts[0],
            "--trace",
            str(trace),
            "--json",
            "--no-progress",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["data"]["tokens"] == len(produced["token_ids"]) == 20
    assert out["data"]["rounds"] == produced["stats"]["rounds"]


def test_formula_matches_measured_tokens_per_forward(cfg):
    res = run_experiment("formula", cfg, k=4, new_tokens=96, seeds=3)
    for pair in res.data["pairs"]:
        assert 1 <= pair["tokens_per_forward"] <= 5
        assert pair["rel_error"] < 0.1, pair
    for alphas in res.data["positions"].values():
        assert len(alphas) == 64 and all(0 <= a <= 1 + 1e-9 for a in alphas)
    assert "sampled from the target" in res.data["positions_source"]  # no corpus for random models


def test_speedup_experiment_reports_prediction_and_measurement_per_k(cfg):
    res = run_experiment("speedup", cfg, ks=(1, 2), new_tokens=24, repeats=1)
    for curve in res.data["curves"].values():
        assert [r["k"] for r in curve] == [1, 2]
        assert all(r["speedup"] > 0 and r["predicted_c_measured"] > 0 for r in curve)
    for s in res.data["summary"]:
        assert 1 <= s["optimal_k_c_params"] <= 16 and s["c_measured"] > 0


@pytest.mark.heavy
def test_lesson2_trains_its_toy_pair_and_its_checks_hold():
    res = run_experiment("lesson2", LabConfig(quick=True, progress=False))
    assert all(res.checks.values()), res.checks
    hw = res.data["homework2"]
    assert hw["right_formula"] == pytest.approx(3.6893, abs=1e-4)
    assert hw["lesson_formula"] == pytest.approx(3.3616, abs=1e-4)
    sweep = res.data["k_sweep"]
    assert all(1 <= r["tokens_per_call"] <= r["k"] + 1 for r in sweep)
    assert res.data["models"]["target"]["final_loss"] < 0.1  # the pattern is learnt


def test_roofline_reproduces_the_lessons_anchor(cfg, capsys):
    code = main(
        ["lab", "roofline", "--target", cfg.target, "--draft", cfg.drafts[0], "--json", "--no-progress"]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    h100 = out["data"]["hardware"]["H100 SXM"]
    assert h100["weight_read_ms_1"] == pytest.approx(15.30, abs=0.01)
    assert h100["compute_ms_1"] == pytest.approx(0.052, abs=0.001)
    assert h100["compute_ms_5"] == pytest.approx(0.26, abs=0.002)
    assert out["data"]["measured_cpu"]["verify_cost_ratio"] > 0


def test_report_writes_html_with_plots_and_json(cfg, tmp_path):
    from specdecode.lab.report import write_report

    html, js, results = write_report(cfg, tmp_path / "lab", only=("greedy", "replay"))
    text = html.read_text()
    assert "data:image/png;base64," in text and "main results" in text
    doc = json.loads(js.read_text())
    assert set(doc["experiments"]) == {"greedy", "replay", "plan"}
    assert doc["summary"]["rows"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["lab", "rules", "--draws", "5"], "--draws must be >= 100"),
        (["lab", "greedy", "--target", "/no/such/model"], "unknown model"),
        (["lab", "replay", "--trace", "/no/such.jsonl"], "cannot read --trace"),
        (["lab", "roofline", "--dtype", "fp5"], "unknown --dtype"),
        (["lab", "formula", "--k", "0"], "--k must be >= 1"),
        (["lab", "greedy", "--prompt", ""], "--prompt is empty"),
        (["plan", "--alpha", "1.5"], "--alpha must be numbers in [0, 1]"),
        (["plan", "--batch", "0,2"], "--batch sizes must be >= 1"),
        (["plan", "--batch", "a"], "--batch must be comma-separated numbers"),
        (["plan", "--target", "no-such-model"], "unknown model"),
        (["plan", "--compute-efficiency", "2"], "--compute-efficiency must be in (0, 1]"),
    ],
)
def test_lab_and_plan_bad_input_is_one_line_and_exit_2(argv, needle, capsys, pair_dir):
    if argv[1] in ("rules", "replay", "formula", "roofline") or argv[1:3] == ["greedy", "--prompt"]:
        argv = [*argv, "--target", str(pair_dir[0]), "--draft", str(pair_dir[1])]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err
