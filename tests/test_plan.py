"""`specdecode plan` and the roofline: model sizes from configs, anchors, and the batch trend."""

import json

import pytest

from specdecode.cli import main
from specdecode.errors import SpecDecodeError
from specdecode.plan import run_plan
from specdecode.roofline import HARDWARE, ModelSpec, forward_time, spec_from_config, spec_from_path


def test_param_count_from_config_matches_the_real_checkpoint(tmp_path):
    from specdecode.models import load
    from specdecode.models.init import init_model

    for tie in (True, False):
        path = init_model(
            tmp_path / str(tie), vocab=300, layers=3, dim=64, heads=4, kv_heads=2, seed=0, tie_embeddings=tie
        )
        assert spec_from_path(path).params == load(path).num_parameters()


def test_llama_8b_preset_has_its_published_size():
    from specdecode.plan import _CONFIGS

    spec = spec_from_config(_CONFIGS["llama-3.1-8b"], "llama-3.1-8b")
    assert spec.params == pytest.approx(8.03e9, rel=0.01)
    assert spec.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads of 128, bf16


def test_roofline_anchor_26b_on_h100():
    t = forward_time(ModelSpec("anchor", 25.63e9, 2), HARDWARE["h100-sxm"], 1)
    assert t["memory_s"] * 1e3 == pytest.approx(15.30, abs=0.01)
    assert t["compute_s"] * 1e3 == pytest.approx(0.052, abs=0.001)
    assert t["bound"] == "memory"


def test_plan_gain_shrinks_and_best_k_falls_as_the_batch_grows():
    res = run_plan(batches=(1, 8, 64, 256, 1024), compute_efficiency=0.5)
    best = res.data["best"]
    assert best[0]["speedup"] > best[-1]["speedup"]
    assert best[0]["k"] >= best[-1]["k"]
    assert best[-1]["verify_bound"] == "compute"
    # at batch 1 verification is memory-bound: the speed-up is tokens per round over (1 + k c)
    b1 = [p for p in res.data["points"] if p["batch"] == 1 and p["k"] == 4][0]
    assert b1["verify_bound"] == "memory"
    assert 1 < b1["speedup"] < b1["tokens_per_round"]
    assert res.checks["gain_shrinks_with_batch"]


def test_plan_cli_json_and_plot(tmp_path, capsys):
    png = tmp_path / "plan.png"
    code = main(
        ["plan", "--alpha", "0.9,0.8,0.7", "--batch", "1,4", "--max-k", "3", "--json", "--plot", str(png)]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and png.stat().st_size > 1000
    assert {p["k"] for p in out["data"]["points"]} == {1, 2, 3}
    assert out["data"]["alphas"] == [0.9, 0.8, 0.7]


def test_a_quantized_draft_reads_fewer_bytes_so_the_plan_predicts_more_speed_up():
    kw = {"target": "1.5e9", "draft": "0.5e9", "batches": (1,), "alphas": (0.9,)}
    plain, int4 = run_plan(**kw), run_plan(**kw, draft_dtype="int4")
    assert int4.data["best"][0]["speedup"] > plain.data["best"][0]["speedup"]
    assert int4.data["draft_dtype"] == "int4"
    with pytest.raises(SpecDecodeError, match="--draft-dtype"):
        run_plan(**kw, draft_dtype="int3")
