"""The exported EAGLE-3 checkpoint, run the way the serving engines run it.

`reference_logits` is written here from vLLM's published EAGLE-3 draft architecture
(vllm/model_executor/models/llama_eagle3.py; SGLang's python/sglang/srt/models/llama_eagle3.py
is the same layer), not from our runtime: `fc` maps the three concatenated aux hidden states to
the draft width; the one decoder layer (`midlayer.*`) reads concat(input_layernorm(embedding of
the next token), hidden_norm(fc output)) with the fc output, before hidden_norm, as the residual;
then the MLP with its own residual, the final `norm`, and `lm_head` over `draft_vocab_size`
tokens, scattered into the target vocabulary at draft id + d2t, -inf elsewhere. It reads only the
exported files (config.json, model.safetensors, including the exported `embed_tokens.weight`),
in float64. Our drafter, loaded from the same files, must give the same logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdecode import load
from specdecode.drafters.eagle3 import Eagle3Drafter
from specdecode.models.init import init_model
from specdecode.train.export import export


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half convention) of x [heads, T, D] at positions 0..T-1."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.outer(torch.arange(x.shape[1], dtype=torch.float64), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_logits(
    ckpt, next_tokens: torch.Tensor, aux: torch.Tensor, misread: bool = False
) -> torch.Tensor:
    """vLLM's EAGLE-3 draft forward over T pairs (aux hidden states [T, 3 * target_hidden] of
    positions 0..T-1, the token after each [T]) -> logits [T, vocab_size]. misread: take the
    residual after hidden_norm instead (the negative control's wrong layout)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    w = {
        k: v.double() if v.is_floating_point() else v
        for k, v in load_file(str(ckpt / "model.safetensors")).items()
    }
    eps, H, Hkv = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or cfg["hidden_size"] // H
    T = next_tokens.shape[0]
    m = "midlayer."
    g = aux.double() @ w["fc.weight"].T + (w["fc.bias"] if "fc.bias" in w else 0)  # combine_hidden_states
    e = w["embed_tokens.weight"][next_tokens]
    g_normed = rms(g, w[m + "hidden_norm.weight"], eps)
    residual = g_normed if misread else g
    h = torch.cat([rms(e, w[m + "input_layernorm.weight"], eps), g_normed], -1)
    q = (h @ w[m + "self_attn.q_proj.weight"].T).view(T, H, D).transpose(0, 1)
    k = (h @ w[m + "self_attn.k_proj.weight"].T).view(T, Hkv, D).transpose(0, 1)
    v = (h @ w[m + "self_attn.v_proj.weight"].T).view(T, Hkv, D).transpose(0, 1)
    q, k = rope(q, cfg["rope_theta"]), rope(k, cfg["rope_theta"])
    k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
    scores = (q @ k.transpose(1, 2)) / D**0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, H * D)
    h = attn @ w[m + "self_attn.o_proj.weight"].T + residual
    x = rms(h, w[m + "post_attention_layernorm.weight"], eps)
    mlp = (
        torch.nn.functional.silu(x @ w[m + "mlp.gate_proj.weight"].T) * (x @ w[m + "mlp.up_proj.weight"].T)
    ) @ w[m + "mlp.down_proj.weight"].T
    out = rms(mlp + h, w["norm.weight"], eps)
    draft = out @ w["lm_head.weight"].T  # [T, draft_vocab_size]
    N = cfg["draft_vocab_size"]
    full = torch.full((T, cfg["vocab_size"]), float("-inf"), dtype=torch.float64)
    full[:, torch.arange(N) + w["d2t"].long()] = draft
    return full


def our_logits(target, ckpt, next_tokens: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """Our drafter, loaded from the exported files, over the same pairs (its catch-up step)."""
    drafter = Eagle3Drafter(target, ckpt)
    T = next_tokens.shape[0]
    cache = drafter.layer.new_cache(1, T + 4)
    feats = drafter.feature(aux.to(target.dtype).view(1, T, -1))
    logits, _ = drafter.step(next_tokens.view(1, T), feats, cache)
    return logits[0].double()


def assert_same_logits(ref: torch.Tensor, ours: torch.Tensor) -> None:
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(ours)), "the draft vocabulary maps to other target ids"
    diff = float((ref[finite] - ours[finite]).abs().max())
    assert diff <= 1e-4, f"max abs logit difference {diff:.2e}"


def random_eagle3(target_dir, out, *, vocab: int, target_hidden: int, seed: int = 0, draft_vocab: int = 40):
    """A random (untrained) EAGLE-3 drafter in our layout, with GQA and a draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    d, inter, H, Hkv, D = target_hidden, 96, 4, 2, 16  # our runtime shares the target's embeddings

    def r(*shape, std=0.2):
        return (torch.randn(*shape, generator=g) * std).to(torch.float16)

    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    w = {
        "fc.weight": r(d, 3 * target_hidden),
        "midlayer.input_layernorm.weight": 1 + r(d),
        "midlayer.hidden_norm.weight": 1 + r(d),
        "midlayer.post_attention_layernorm.weight": 1 + r(d),
        "midlayer.self_attn.q_proj.weight": r(H * D, 2 * d),
        "midlayer.self_attn.k_proj.weight": r(Hkv * D, 2 * d),
        "midlayer.self_attn.v_proj.weight": r(Hkv * D, 2 * d),
        "midlayer.self_attn.o_proj.weight": r(d, H * D),
        "midlayer.mlp.gate_proj.weight": r(inter, d),
        "midlayer.mlp.up_proj.weight": r(inter, d),
        "midlayer.mlp.down_proj.weight": r(d, inter),
        "norm.weight": 1 + r(d),
        "lm_head.weight": r(draft_vocab, d),
        "d2t": (ids - torch.arange(draft_vocab)).to(torch.int64),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True),
    }
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": d,
        "intermediate_size": inter,
        "num_attention_heads": H,
        "num_key_value_heads": Hkv,
        "head_dim": D,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": target_hidden,
        "eagle_aux_hidden_state_layer_ids": [0, 1, 1],
        "tie_word_embeddings": False,
        "specdecode": {"kind": "specdecode-eagle3", "target": str(target_dir)},
    }
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(out / "model.safetensors"))
    return out


def fp16_target(root):
    """A tiny target whose embeddings are fp16 values: the export ships them in fp16, so the
    engines and our drafter (which reads the target's own) then see the same numbers."""
    target_dir = init_model(root / "t", vocab=64, layers=2, dim=32, seed=0, heads=4, kv_heads=2)
    f = target_dir / "model.safetensors"
    w = load_file(str(f))
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"].half().float()
    save_file(w, str(f), metadata={"format": "pt"})
    return target_dir


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_exported_random_eagle3_runs_under_vllms_forward_as_ours(tmp_path, fmt):
    target_dir = fp16_target(tmp_path)
    heads = random_eagle3(target_dir, tmp_path / "e3", vocab=64, target_hidden=32)
    ckpt = export(heads, fmt, tmp_path / fmt)
    target = load(target_dir, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    next_tokens, aux = torch.randint(0, 64, (12,), generator=g), torch.randn(12, 96, generator=g)
    assert_same_logits(reference_logits(ckpt, next_tokens, aux), our_logits(target, ckpt, next_tokens, aux))


def test_a_misread_layout_fails_the_comparison(tmp_path):
    """Negative control: the reference with the residual taken after hidden_norm (a plausible
    misreading of the layout) disagrees with our drafter, so the comparison above can fail."""
    target_dir = fp16_target(tmp_path)
    heads = random_eagle3(target_dir, tmp_path / "e3", vocab=64, target_hidden=32)
    ckpt = export(heads, "vllm", tmp_path / "vllm")
    target = load(target_dir, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    next_tokens, aux = torch.randint(0, 64, (12,), generator=g), torch.randn(12, 96, generator=g)
    ours = our_logits(target, ckpt, next_tokens, aux)
    with pytest.raises(AssertionError, match="max abs logit difference"):
        assert_same_logits(reference_logits(ckpt, next_tokens, aux, misread=True), ours)


@pytest.mark.heavy
def test_exported_smollm2_eagle3_runs_under_vllms_forward_as_ours(tmp_path):
    from specdecode.models import models_dir, resolve
    from specdecode.models.llama import LlamaModel

    ckpt = export(models_dir() / "smollm2-135m" / "eagle3", "vllm", tmp_path / "vllm")
    target = LlamaModel.from_dir(resolve("smollm2-135m"), torch.float64)  # float64, as the reference
    cfg = json.loads((ckpt / "config.json").read_text())
    g = torch.Generator().manual_seed(0)
    T = 16
    next_tokens = torch.randint(0, cfg["vocab_size"], (T,), generator=g)
    aux = torch.randn(T, 3 * cfg["target_hidden_size"], generator=g)
    assert_same_logits(reference_logits(ckpt, next_tokens, aux), our_logits(target, ckpt, next_tokens, aux))
