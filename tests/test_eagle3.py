"""EAGLE-3 trained on self-distilled data: distill-data stores the target's own features, the
training forward is the drafting forward, drafting keeps the target's greedy tokens and its
distribution (chain and tree, with a draft vocabulary smaller than the target's), and the
export is the checkpoint layout vLLM and SGLang load."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import write_prompts
from specdecode import SamplingParams, SpecDecodeError, SpeculativeGenerator, load
from specdecode.cli import main
from specdecode.drafters.eagle3 import Eagle3Drafter
from specdecode.models.base import ForwardMeta, extend
from specdecode.models.init import init_model
from specdecode.train.distill import DistillData, distill
from specdecode.train.eagle3 import Eagle3Trainer, _load_batch
from specdecode.train.export import check_checkpoint, export

GREEDY = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 64 for j in range(1 + (5 * i) % 10)] for i in range(6)]


@pytest.fixture(scope="module")
def eagle3(pair_dir, trained64):
    """A target (vocab 64), its distilled data and an EAGLE-3 drafter over 48 of its 64 tokens
    (conftest's trained64, shared with the exactness suite)."""
    return load(pair_dir[0], dtype=torch.float64), trained64["eagle3_data"], trained64["eagle3"]


def test_distill_data_stores_the_targets_own_features_and_answers(eagle3, pair_dir):
    target, data_dir, _ = eagle3
    data = DistillData.open(data_dir)
    assert len(data.sequences) == 12 and data.index["aux_layers"] == [0, 1, 1]
    fp32 = load(pair_dir[0])
    greedy = SpeculativeGenerator(fp32)
    for s, _p, n in data.sequences[:4]:
        tokens = torch.tensor(data.tokens[s : s + n], dtype=torch.long).view(1, n)
        _, aux = extend(fp32, fp32.new_cache(1, n), tokens, torch.tensor([n - 1]), True, False, (0, 1, 1))
        assert np.allclose(data.aux[s : s + n - 1], aux[0].numpy(), atol=2e-3, rtol=2e-3)
        _, final = extend(fp32, fp32.new_cache(1, n), tokens, torch.tensor([n - 1]), True, False)
        assert np.allclose(data.final[s : s + n - 1], final[0].numpy(), atol=2e-3, rtol=2e-3)
    answers = [json.loads(line) for line in (data_dir / "answers.jsonl").read_text().splitlines()]
    first = next(a for a in answers if a["id"] == 0)  # prompt 0: temperature 0, the target's greedy answer
    s, p, n = data.sequences[answers.index(first)]
    want = greedy.generate([first["prompt"]], SamplingParams(temperature=0, max_new_tokens=24))[0]
    assert data.tokens[s + p : s + n].tolist() == want.token_ids


def test_distill_data_resumes_where_it_stopped(pair_dir, tmp_path):
    prompts = [[1 + i, 2, 3] for i in range(6)]
    write_prompts(tmp_path / "p.jsonl", prompts)
    kw = dict(chat=False, max_new_tokens=8, batch_size=2, dtype=torch.float32, progress=False)
    distill(pair_dir[0], tmp_path / "p.jsonl", tmp_path / "d", limit=3, **kw)
    first = DistillData.open(tmp_path / "d")
    assert len(first.sequences) == 3
    index = distill(pair_dir[0], tmp_path / "p.jsonl", tmp_path / "d", **kw)
    assert sorted(index["done"]) == list(range(6)) and len(index["sequences"]) == 6
    again = distill(pair_dir[0], tmp_path / "p.jsonl", tmp_path / "d", **kw)
    assert again["num_tokens"] == index["num_tokens"]
    with pytest.raises(SpecDecodeError, match="other settings"):
        distill(pair_dir[0], tmp_path / "p.jsonl", tmp_path / "d", **{**kw, "max_new_tokens": 9})


def test_eagle3_training_forward_is_the_drafting_forward(eagle3, pair_dir):
    """Step 0 of the training-time test gives the logits the drafter's layer gives while drafting."""
    _, data_dir, drafter_dir = eagle3
    target = load(pair_dir[0])
    drafter = Eagle3Drafter(target, drafter_dir)
    data = DistillData.open(data_dir)
    batch = _load_batch(data, data.sequences, [0], 512)
    batch["prompt"] = torch.tensor([0])  # score every position: indices 0 .. T - 3
    T = batch["tokens"].shape[1]
    feats = drafter.fc(batch["aux"][0]).view(1, T, -1)
    nxt = torch.cat([batch["tokens"][:, 1:], batch["tokens"][:, -1:]], 1)
    meta = ForwardMeta(return_hidden=True, aux_layers=(1,), inputs_embeds=feats)
    logits, _ = drafter.layer.forward(nxt, drafter.layer.new_cache(1, T), meta)
    trainer = Eagle3Trainer(target.cfg, target.embed, target.lm_head, target.final_norm, drafter.draft_ids)
    names = {v: k for k, v in trainer.NAMES.items()}
    for k, v in load_file(str(drafter_dir / "model.safetensors")).items():
        if k in names:
            trainer.p[names[k]].data.copy_(v.float())
    seen = []
    trainer_head = trainer.p["lm_head"]
    real_linear = torch.nn.functional.linear

    def spy(x, w, b=None):
        out = real_linear(x, w, b)
        if w is trainer_head:
            seen.append(out)
        return out

    torch.nn.functional.linear = spy
    try:
        trainer.loss(batch, 1)
    finally:
        torch.nn.functional.linear = real_linear
    assert seen[0].shape[0] == T - 2
    assert torch.allclose(seen[0], logits[0, : T - 2], atol=1e-4, rtol=1e-4)


def test_eagle3_gives_tokens_outside_its_draft_vocabulary_probability_zero(eagle3):
    target, _, drafter_dir = eagle3
    gen = SpeculativeGenerator(target, k=3, method="eagle3", heads=drafter_dir)
    outside = torch.ones(target.vocab_size, dtype=torch.bool)
    outside[gen.drafter.draft_ids] = False
    assert int(outside.sum()) == 16
    run = gen.stream(
        [PROMPTS[3]], SamplingParams(temperature=1.0, max_new_tokens=16, seed=3, ignore_eos=True)
    )
    captured = []
    real = gen.drafter.propose

    def spy(*a, **kw):
        p = real(*a, **kw)
        captured.append(p.probs)
        return p

    gen.drafter.propose = spy
    run.results()
    probs = torch.cat([p for p in captured if p is not None], 1)
    assert probs.shape[-1] == target.vocab_size and float(probs[..., outside].abs().max()) == 0.0
    assert torch.allclose(probs.sum(-1), torch.ones(()).double(), atol=1e-6)


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_export_writes_the_layout_vllm_and_sglang_load(eagle3, pair_dir, tmp_path, fmt):
    _, _, drafter = eagle3
    out = export(drafter, fmt, tmp_path / fmt)
    cfg = check_checkpoint(out)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert (
        cfg["draft_vocab_size"] == 48 and cfg["target_hidden_size"] == 32 and not cfg["tie_word_embeddings"]
    )
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1]
    w = load_file(str(out / "model.safetensors"))
    assert w["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * 32 and w["fc.weight"].shape == (32, 96)
    ids = torch.arange(48) + w["d2t"]
    assert w["t2d"].sum() == 48 and bool(w["t2d"][ids].all())
    assert w["embed_tokens.weight"].shape == (64, 32)
    # the exported checkpoint drafts exactly as the original (it is the same layout)
    target = load(pair_dir[0], dtype=torch.float64)
    a = SpeculativeGenerator(target, k=3, method="eagle3", heads=drafter).generate(PROMPTS[:2], GREEDY)
    b = SpeculativeGenerator(target, k=3, method="eagle3", heads=out).generate(PROMPTS[:2], GREEDY)
    assert [r.stats.accepted for r in a] == [r.stats.accepted for r in b]


def test_export_check_rejects_a_checkpoint_the_engines_would_not_load(eagle3, tmp_path):
    _, _, drafter = eagle3
    out = export(drafter, "vllm", tmp_path / "x", embeddings=False)
    good = load_file(str(out / "model.safetensors"))
    w = dict(good, **{"midlayer.self_attn.q_proj.weight": good["midlayer.self_attn.q_proj.weight"][:, :32]})
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    with pytest.raises(SpecDecodeError, match="q_proj.weight has shape"):
        check_checkpoint(out)
    w = {k: v for k, v in good.items() if k != "d2t"}
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(SpecDecodeError, match="d2t is missing"):
        check_checkpoint(out)


def test_distill_train_export_cli_and_errors(pair_dir, tmp_path, capsys):
    write_prompts(tmp_path / "p.jsonl", [[1, 2, 3], [4, 5, 6, 7]])
    t = str(pair_dir[0])
    assert (
        main(
            [
                "distill-data",
                "--target",
                t,
                "--prompts",
                str(tmp_path / "p.jsonl"),
                "--out",
                str(tmp_path / "d"),
                "--max-new-tokens",
                "8",
                "--dtype",
                "fp32",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "2 sequences" in capsys.readouterr().err
    argv = [
        "train-heads",
        "--method",
        "eagle3",
        "--target",
        t,
        "--data",
        str(tmp_path / "d"),
        "--out",
        str(tmp_path / "e"),
        "--draft-vocab",
        "32",
        "--epochs",
        "1",
        "--batch-tokens",
        "64",
        "--no-progress",
    ]
    assert main(argv) == 0 and "EAGLE-3 drafter" in capsys.readouterr().err
    assert (
        main(["export", "--heads", str(tmp_path / "e"), "--format", "sglang", "--out", str(tmp_path / "x")])
        == 0
    )
    assert "checked" in capsys.readouterr().err
    bad = [
        ["train-heads", "--method", "eagle3", "--target", t, "--out", str(tmp_path / "f")],  # no --data
        ["export", "--heads", str(tmp_path), "--format", "vllm", "--out", str(tmp_path / "y")],  # no drafter
        [
            "distill-data",
            "--target",
            t,
            "--prompts",
            str(tmp_path / "none.jsonl"),
            "--out",
            str(tmp_path / "z"),
        ],
    ]
    for argv in bad:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("specdecode: error:") and "Traceback" not in err
    small = load(init_model(tmp_path / "s", vocab=64, layers=1, dim=16, seed=0))
    with pytest.raises(SpecDecodeError, match="made for a target"):
        SpeculativeGenerator(small, method="eagle3", heads=tmp_path / "e")
    with pytest.raises(SpecDecodeError, match="needs a trained EAGLE-3"):
        SpeculativeGenerator(small, method="eagle3")


def test_a_long_prompt_admitted_beside_a_row_near_its_end_drafts_and_stays_exact(eagle3):
    """Continuous batching: a row far behind (a long prompt admitted mid-run) must catch up in
    chunks, or its padding would push a row near its capacity past the cache's end."""
    target, _, drafter = eagle3
    short = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    long_prompt = [(5 * j + 1) % 64 for j in range(120)]
    plain = SpeculativeGenerator(target)
    first = [(7 * j + 2) % 64 for j in range(100)]  # long too: its cache ends near its own end
    want = [plain.generate([p], short)[0].token_ids for p in (first, long_prompt)]
    gen = SpeculativeGenerator(target, k=3, method="eagle3", heads=drafter)
    run = gen.stream([first], short)
    for i, _ in enumerate(run):
        if i == 8:  # the first row is well into its 30 tokens
            run.add(long_prompt, short)
    got = run.results()
    assert [r.token_ids for r in got] == want
    assert got[1].stats.drafted > 0
