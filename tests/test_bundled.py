"""The bundled, trained checkpoints: loadable by name, by transformers offline, and consistent."""

import json

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator, load
from specdecode.models import BUNDLED, models_dir

present = [n for n in BUNDLED if (models_dir() / n / "config.json").exists()]
pytestmark = pytest.mark.skipif(not present, reason="no bundled models in this checkout")


def is_hybrid(name: str) -> bool:
    return json.loads((models_dir() / name / "config.json").read_text())["model_type"] == "specdecode_hybrid"


@pytest.mark.parametrize("name", [n for n in present if not is_hybrid(n)])
def test_bundled_model_loads_by_name_and_in_transformers_offline(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours = load(name)
    ref = AutoModelForCausalLM.from_pretrained(
        models_dir() / name, local_files_only=True, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(models_dir() / name, local_files_only=True)
    ids = tok.encode("孔明曰：「" if name.startswith("three") else "def f(x):\n    return")
    assert ids == ours.tokenizer.encode("孔明曰：「" if name.startswith("three") else "def f(x):\n    return")
    x = torch.tensor([ids])
    with torch.no_grad():
        want = ref(x).logits
    got = ours.forward(x, ours.new_cache(1, len(ids)))[0]
    assert (got - want).abs().max().item() < 1e-3
    assert (models_dir() / name / "MODEL_CARD.md").exists()


@pytest.mark.parametrize("family", sorted({n.split("/")[0] for n in present}))
def test_family_shares_one_tokenizer_and_targets_have_lowest_heldout_loss(family):
    names = [n for n in present if n.startswith(family + "/")]
    metas = {n: json.loads((models_dir() / n / "training.json").read_text()) for n in names}
    tokenizers = {(models_dir() / n / "tokenizer.json").read_text() for n in names}
    assert len(tokenizers) == 1
    target = f"{family}/target"
    for n in names:
        if metas[n]["role"] == "draft":
            assert metas[target]["model"]["best_val_loss"] < metas[n]["model"]["best_val_loss"], n


def test_bundled_pair_greedy_speculative_equals_target_only():
    if "three-kingdoms/draft-64" not in present:
        pytest.skip("three-kingdoms pair not bundled")
    target = load("three-kingdoms/target", dtype=torch.float64)
    draft = load("three-kingdoms/draft-64", dtype=torch.float64)
    params = SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True)
    want = SpeculativeGenerator(target).generate(["孔明曰：「"], params)[0].token_ids
    got = SpeculativeGenerator(target, draft=draft, k=4).generate(["孔明曰：「"], params)[0].token_ids
    assert got == want


@pytest.mark.heavy
def test_lab_on_bundled_three_kingdoms_greedy_identical_and_residual_within_noise():
    from specdecode.lab import LabConfig, run_experiment

    cfg = LabConfig(progress=False, quick=True)
    greedy = run_experiment("greedy", cfg)
    assert greedy.data["identical"] == greedy.data["cells_total"] == 16
    rules = run_experiment(
        "rules", LabConfig(drafts=cfg.drafts[:1], progress=False), draws=50_000, prompts=(cfg.prompt,)
    )
    (case,) = rules.data["cases"]
    assert case["residual_tv"] < case["noise_tv_p99"]
    assert case["resample_p_tv"] > 3 * case["noise_tv_p99"]
    # at 50,000 draws noise still inflates (b)'s TV by ~10%; test_lab checks (b) against its closed form


def test_streamed_text_equals_the_json_text_across_split_characters(capsys):
    """Byte-level tokens split Chinese characters: the stream waits for whole characters and
    prints all of the text."""
    from specdecode.cli import main

    args = [
        "generate",
        "--target",
        "three-kingdoms/target",
        "--draft",
        "three-kingdoms/draft-64",
        "--prompt",
        "孔明曰：「",
        "--max-new-tokens",
        "48",
        "--seed",
        "0",
    ]
    assert main(args) == 0
    streamed = capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    assert streamed == text + "\n"


@pytest.mark.skipif("three-kingdoms/hybrid" not in present, reason="the hybrid target is not bundled")
def test_bundled_hybrid_loads_by_name_matches_its_training_module_and_reports_beside_the_target():
    from safetensors.torch import load_file

    from specdecode.train.hybrid import HybridLM

    path = models_dir() / "three-kingdoms/hybrid"
    ours = load("three-kingdoms/hybrid")
    ref = HybridLM(json.loads((path / "config.json").read_text()))
    ref.load_state_dict({k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()})
    ids = ours.tokenizer.encode("孔明曰：「")
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits
    got = ours.forward(torch.tensor([ids]), ours.new_cache(1, len(ids)))[0]
    assert (got - want).abs().max().item() < 1e-3
    card = (path / "MODEL_CARD.md").read_text()
    assert "Beside the attention-only target" in card and "linear attention" in card
    meta = json.loads((path / "training.json").read_text())
    target = json.loads((models_dir() / "three-kingdoms/target/training.json").read_text())
    assert (
        meta["config"]["steps"] == target["config"]["steps"]
        and meta["config"]["seed"] == target["config"]["seed"]
    )
