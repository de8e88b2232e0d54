"""`specdecode train` end to end on a tiny budget, so the recipe never rots: tokenizer,
held-out split, family training, resume, Hugging Face loading, model cards, demo."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from specdecode.cli import main
from specdecode.models.base import ForwardMeta
from specdecode.train import data as data_mod
from specdecode.train.data import read_corpus, train_tokenizer
from specdecode.train.families import FAMILIES
from specdecode.train.trainer import train_family

TINY = dict(steps=12, seq_len=32, batch_size=4, lr=3e-3, seed=0, eval_every=4, progress=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """About 60 KB of varied text: enough for a 2,048-token BPE vocabulary to be mostly used."""
    rng = random.Random(0)
    words = "孔明 曹操 刘备 关羽 张飞 曰 ：「 」 。 ， 兵 马 城 军".split()
    words += "the army river gate said night fire ship east wind".split()
    lines = ["".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(2500)]
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def test_corpus_split_holds_out_five_percent_and_tokenizer_knows_every_byte(corpus):
    text = read_corpus(corpus)
    held = sum(map(len, text.valid)) / (sum(map(len, text.train)) + sum(map(len, text.valid)))
    assert 0.03 < held < 0.07
    tok = train_tokenizer(text.train, 512)
    sample = "孔明曰：「x🙂 ü」"  # characters absent from the corpus still encode (byte-level)
    assert tok.decode(tok.encode(sample).ids) == sample


@pytest.mark.heavy
def test_family_trains_writes_loadable_checkpoints_and_cards(corpus, tmp_path, capsys, monkeypatch):
    out = tmp_path / "tk"
    code = main(
        [
            *"train --corpus".split(),
            str(corpus),
            *"--family three-kingdoms --out".split(),
            str(out),
            *"--steps 20 --seq-len 32 --batch-size 4 --no-progress".split(),
        ]
    )
    assert code == 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for spec in FAMILIES["three-kingdoms"].default_models:
        d = out / spec.name
        model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True)
        assert sum(p.numel() for p in model.parameters()) == spec.num_parameters(2048)
        assert AutoTokenizer.from_pretrained(d, local_files_only=True).encode("孔明")
        assert all(t.dtype == torch.float16 for t in load_file(str(d / "model.safetensors")).values())
        card = (d / "MODEL_CARD.md").read_text()
        assert "held-out loss" in card and f"{spec.num_parameters(2048):,}" in card
        meta = json.loads((d / "training.json").read_text())
        assert meta["model"]["best_step"] > 0
    assert "acceptance rate" in (out / "draft-64" / "MODEL_CARD.md").read_text()
    assert not (out / ".train").exists()

    # the lesson demo runs on whatever bundled pairs exist (here only this tiny three-kingdoms family)
    out.rename(tmp_path / "three-kingdoms")
    monkeypatch.setenv("SPECDECODE_MODELS", str(tmp_path))
    assert main(["demo", "--lesson", "--max-new-tokens", "12", "--repeats", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["family"] for r in rows] == ["three-kingdoms"]
    assert rows[0]["tokens_per_forward"] >= 1 and rows[0]["speedup"] > 0


def weights(path):
    return load_file(str(path / "model.safetensors"))


@pytest.mark.heavy
def test_resumed_run_equals_uninterrupted_run(corpus, tmp_path, monkeypatch):
    family = FAMILIES["three-kingdoms"]
    train_family(family, corpus, tmp_path / "full", **TINY)

    real = data_mod.batch_at

    def crash_at_step_9(stream, step, *a, **kw):
        if step == 9:
            raise KeyboardInterrupt
        return real(stream, step, *a, **kw)

    import specdecode.train.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "batch_at", crash_at_step_9)
    with pytest.raises(KeyboardInterrupt):
        train_family(family, corpus, tmp_path / "resumed", **TINY)
    assert (tmp_path / "resumed" / ".train" / "state.pt").exists()
    monkeypatch.setattr(trainer_mod, "batch_at", real)
    train_family(family, corpus, tmp_path / "resumed", resume=True, **TINY)
    for spec in family.default_models:
        a, b = weights(tmp_path / "full" / spec.name), weights(tmp_path / "resumed" / spec.name)
        assert all(torch.equal(a[k], b[k]) for k in a), spec.name


def test_bad_training_input_is_a_clear_error(corpus, tmp_path, capsys):
    # 0 is not "use the default": it is an error
    args = ["train", "--corpus", str(corpus), "--family", "three-kingdoms", "--out", str(tmp_path / "z")]
    assert main([*args, "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    assert main([*args, "--eval-every", "0"]) == 2
    assert "--eval-every must be >= 1" in capsys.readouterr().err
    assert main(["model-card", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                "--corpus",
                str(tmp_path / "none.txt"),
                "--family",
                "three-kingdoms",
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", "--corpus", str(corpus), "--family", "nope", "--out", str(tmp_path / "o")]) == 2
    assert "unknown --family" in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                "--corpus",
                str(corpus),
                "--family",
                "three-kingdoms",
                "--out",
                str(tmp_path / "o"),
                "--resume",
            ]
        )
        == 2
    )
    assert "no training state" in capsys.readouterr().err


@pytest.mark.heavy
def test_target_alone_with_an_early_exit_loss_trains_its_first_layers_to_predict(corpus, tmp_path):
    """--models target --early-exit-layer 2: only the target is written, and its 2-layer exit
    predicts the held-out text far better than the same exit of a target trained without it."""
    import numpy as np

    from specdecode.models import load
    from specdecode.train.data import encode_stream, read_corpus

    family = FAMILIES["three-kingdoms"]
    # enough training for depth to matter: after 40 steps of 4 x 32 tokens both targets sat near
    # unigram loss, where a 2-layer exit predicts about as well as all 4 layers (gap 0.04 on an
    # AVX2 machine); after 60 steps of 8 x 64 the plain target's exit is 0.33 worse
    cfg = dict(TINY, steps=60, batch_size=8, seq_len=64, eval_every=20)
    train_family(
        family, corpus, tmp_path / "ee", only=("target",), early_exit_layer=2, early_exit_weight=1.0, **cfg
    )
    train_family(family, corpus, tmp_path / "plain", only=("target",), **cfg)
    assert sorted(p.name for p in (tmp_path / "ee").iterdir()) == ["target"]
    meta = json.loads((tmp_path / "ee" / "target" / "training.json").read_text())
    assert meta["config"]["early_exit_layer"] == 2 and meta["config"]["models"] == ["target"]

    def exit_loss(path) -> float:
        from tokenizers import Tokenizer

        model = load(path / "target")
        tok = Tokenizer.from_file(str(path / "target" / "tokenizer.json"))
        ids = encode_stream(tok, read_corpus(corpus).valid)[:256]
        x = torch.tensor(np.asarray(ids[:-1], dtype=np.int64)).view(1, -1)
        logits, _ = model.forward(x, model.new_cache(1, x.shape[1] + 1), ForwardMeta(num_layers=2))
        return float(
            torch.nn.functional.cross_entropy(logits[0], torch.tensor(np.asarray(ids[1:], dtype=np.int64)))
        )

    assert exit_loss(tmp_path / "ee") < exit_loss(tmp_path / "plain") - 0.2


@pytest.mark.heavy
def test_hybrid_trains_only_when_named_beside_the_target_on_the_same_batches(corpus, tmp_path):
    """--models target,hybrid: both written; the hybrid loads in our runtime, matches its training
    module, and its card reports its held-out loss beside the attention-only target's."""
    from specdecode.models import load

    family = FAMILIES["three-kingdoms"]
    assert "hybrid" not in [m.name for m in family.default_models]
    train_family(family, corpus, tmp_path / "h", only=("target", "hybrid"), **TINY)
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == ["hybrid", "target"]
    meta = json.loads((tmp_path / "h" / "hybrid" / "training.json").read_text())
    assert meta["architecture"] == "hybrid" and meta["model"]["params"] == family.models[3].num_parameters(
        2048
    )
    model = load(tmp_path / "h" / "hybrid")
    assert model.cfg.linear_layers == [0, 1, 2]
    from specdecode.train.model_card import write_model_cards

    write_model_cards(tmp_path / "h", corpus, only=("hybrid",))
    card = (tmp_path / "h" / "hybrid" / "MODEL_CARD.md").read_text()
    assert "Beside the attention-only target" in card and "gated delta-rule linear attention" in card
