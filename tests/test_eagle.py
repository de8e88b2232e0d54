"""EAGLE: a one-layer feature-level drafter trained by train-heads; it reads the target's
features of committed positions (greedy identity and distribution: tests/test_contract.py)."""

import pytest
import torch

from specdecode import SamplingParams, SpecDecodeError, SpeculativeGenerator, load
from specdecode.cli import main
from specdecode.drafters.eagle import load_eagle
from specdecode.models.base import WITH_HIDDEN, ForwardMeta
from specdecode.models.init import init_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 64 for j in range(1 + (5 * i) % 10)] for i in range(6)]


def corpus(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("".join(f"the {w} sat on the mat {i}.\n" for i in range(3000) for w in ["cat"]))
    return path


@pytest.fixture(scope="module")
def eagle_pair(pair_dir, trained64):
    """The vocab-64 target and its EAGLE drafter (conftest's trained64)."""
    return load(pair_dir[0], dtype=torch.float64), trained64["eagle"]


def test_eagle_first_draft_reads_the_targets_own_features(eagle_pair):
    """Round r's first draft probs = the layer over (h_j, x_{j+1}) pairs of the text so far."""
    target, eagle = eagle_pair
    layer, fc_w, fc_b, _ = load_eagle(eagle, target)
    gen = SpeculativeGenerator(target, k=2, method="eagle", heads=eagle)
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=4, ignore_eos=True)
    context = list(prompt)
    for event in gen.stream([prompt], params):
        (rec,) = event.records()
        _, h = target.forward(torch.tensor([context[:-1]]), target.new_cache(1, 64), WITH_HIDDEN)
        e = torch.nn.functional.embedding(torch.tensor([context[1:]]), target.embed)
        fused = torch.nn.functional.linear(torch.cat([e, h], -1), fc_w, fc_b)
        meta = ForwardMeta(inputs_embeds=fused)
        logits = layer.forward(torch.tensor([context[1:]]), layer.new_cache(1, 64), meta)[0][0, -1]
        q = torch.softmax(logits, -1)
        assert rec.draft_prob[0] == pytest.approx(float(q[rec.draft_token_ids[0]]), rel=1e-8)
        context += rec.emitted_token_ids


def test_train_heads_eagle_cli_and_errors(pair_dir, tmp_path, capsys):
    out = tmp_path / "e"
    argv = [
        "train-heads",
        "--method",
        "eagle",
        "--target",
        str(pair_dir[0]),
        "--corpus",
        str(corpus(tmp_path)),
        "--out",
        str(out),
        "--steps",
        "2",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--no-progress",
    ]
    assert main(argv) == 0 and "EAGLE drafter" in capsys.readouterr().err
    small = load(init_model(tmp_path / "s", vocab=64, layers=1, dim=16, seed=0))
    with pytest.raises(SpecDecodeError, match="does not fit"):
        SpeculativeGenerator(small, method="eagle", heads=out)
    with pytest.raises(SpecDecodeError, match="holds no EAGLE"):
        SpeculativeGenerator(small, method="eagle", heads=tmp_path)
    assert (
        main(
            [
                "train-heads",
                "--method",
                "lookahead",
                "--target",
                str(pair_dir[0]),
                "--corpus",
                "x",
                "--out",
                str(out),
            ]
        )
        == 2
    )
