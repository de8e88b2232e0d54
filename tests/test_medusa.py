"""Medusa heads: trained by train-heads, read the target's features of the right position
(greedy identity and distribution, chain and tree: tests/test_contract.py)."""

import pytest
import torch

from helpers import random_heads
from specdecode import SamplingParams, SpecDecodeError, SpeculativeGenerator, load
from specdecode.cli import main
from specdecode.drafters.medusa import MedusaHeads
from specdecode.models.base import WITH_HIDDEN

GREEDY = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 64 for j in range(2 + (5 * i) % 10)] for i in range(6)]


@pytest.fixture(scope="module")
def target(pair_dir):
    return load(pair_dir[0], dtype=torch.float64)


def test_heads_read_the_features_of_the_token_before_the_pending_one(target):
    heads = random_heads(target.cfg.hidden_size)
    gen = SpeculativeGenerator(target, k=3, method="medusa", heads=heads)
    prompt = PROMPTS[3]
    context = list(prompt)
    for event in gen.stream([prompt], GREEDY):
        (rec,) = event.records()
        cache = target.new_cache(1, 64)
        _, hidden = target.forward(torch.tensor([context[:-1]]), cache, WITH_HIDDEN)
        feats = heads.features(hidden[0, -1])  # [h, d]
        want = (feats @ target.lm_head.T).argmax(-1)[:3].tolist()
        assert rec.draft_token_ids == want
        context += rec.emitted_token_ids


def test_train_heads_writes_loadable_heads_that_generate(pair_dir, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat.\n" * 4000)
    out = tmp_path / "heads"
    code = main(
        [
            "train-heads",
            "--target",
            str(pair_dir[0]),
            "--corpus",
            str(corpus),
            "--out",
            str(out),
            "--heads",
            "2",
            "--steps",
            "5",
            "--seq-len",
            "32",
            "--batch-size",
            "4",
            "--no-progress",
        ]
    )
    assert code == 0 and "2 heads" in capsys.readouterr().err
    heads = MedusaHeads.load(out)
    assert heads.num_heads == 2 and heads.meta["steps"] == 5 and len(heads.meta["heldout_top1_per_head"]) == 2
    code = main(
        [
            "generate",
            "--target",
            str(pair_dir[0]),
            "--method",
            "medusa",
            "--heads",
            str(out),
            "--prompt",
            "the cat",
            "--max-new-tokens",
            "8",
            "--json",
        ]
    )
    assert code == 0


def test_medusa_errors_are_clear(target, pair_dir, tmp_path, capsys):
    with pytest.raises(SpecDecodeError, match="do not fit"):
        SpeculativeGenerator(target, method="medusa", heads=random_heads(16))
    with pytest.raises(SpecDecodeError, match="needs trained heads"):
        SpeculativeGenerator(target, method="medusa")
    with pytest.raises(SpecDecodeError, match="needs 3 Medusa heads"):
        SpeculativeGenerator(target, method="medusa", heads=random_heads(32, 2), tree="1,1,1").generate(
            [[1, 2, 3]], GREEDY
        )
    code = main(["generate", "--target", str(pair_dir[0]), "--method", "medusa", "--prompt", "ab"])
    err = capsys.readouterr().err
    assert code == 2 and "no Medusa heads" in err and err.count("\n") == 1
    code = main(
        [
            "generate",
            "--target",
            str(pair_dir[0]),
            "--method",
            "medusa",
            "--heads",
            str(tmp_path),
            "--prompt",
            "ab",
        ]
    )
    assert code == 2 and "holds no Medusa heads" in capsys.readouterr().err
