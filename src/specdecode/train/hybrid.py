"""A hybrid Llama-like language model for training: gated delta-rule linear-attention layers
(models/linear_attention.py) beside full-attention layers, as a torch.nn.Module.

Its parameter names are the checkpoint's (model.layers.{i}.linear_attn.{q,k,v,a,b,o}_proj,
model.layers.{i}.self_attn.{q,k,v,o}_proj, ...), so `save_pretrained` writes a directory our
lean runtime loads (model_type specdecode_hybrid, with layer_types). Transformers has no such
architecture, so the trainer uses this module for hybrid models. The recurrence runs a chunk
of 64 tokens at a time (chunked_delta_rule: the same numbers as the runtime's token-by-token
delta_step)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ..models.linear_attention import chunked_delta_rule


def hybrid_config(
    vocab: int, dim: int, layers: int, heads: int, intermediate: int, linear_layers, eos_id: int | None = None
) -> dict:
    return {
        "architectures": ["SpecdecodeHybridForCausalLM"],
        "model_type": "specdecode_hybrid",
        "vocab_size": vocab,
        "hidden_size": dim,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": dim // heads,
        "layer_types": [
            "linear_attention" if i in set(linear_layers) else "full_attention" for i in range(layers)
        ],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Attention(nn.Module):
    def __init__(self, d: int, H: int) -> None:
        super().__init__()
        self.H, self.D = H, d // H
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = (
            p(x).view(B, T, self.H, self.D).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class _LinearAttention(nn.Module):
    def __init__(self, d: int, H: int, layer: int) -> None:
        super().__init__()
        self.H, self.D = H, d // H
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.a_proj = nn.Linear(d, H)  # decay α = sigmoid(.)
        self.b_proj = nn.Linear(d, H, bias=False)  # write strength β = sigmoid(.)
        with torch.no_grad():  # heads start with decays from ~0.73 to ~0.98: short and long memories
            self.a_proj.weight.mul_(0.1)
            self.a_proj.bias.copy_(torch.linspace(1.0, 4.0, H))

    def forward(self, x):
        B, T, _ = x.shape
        q = F.normalize(self.q_proj(x).view(B, T, self.H, self.D), dim=-1)
        k = F.normalize(self.k_proj(x).view(B, T, self.H, self.D), dim=-1)
        v = self.v_proj(x).view(B, T, self.H, self.D)
        a, b = torch.sigmoid(self.a_proj(x)), torch.sigmoid(self.b_proj(x))
        out, _ = chunked_delta_rule(q, k, v, a, b)
        return self.o_proj(out.reshape(B, T, -1))


class _Block(nn.Module):
    def __init__(self, cfg: dict, i: int) -> None:
        super().__init__()
        d, H, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["rms_norm_eps"]
        self.linear = cfg["layer_types"][i] == "linear_attention"
        self.input_layernorm = _RMSNorm(d, eps)
        if self.linear:
            self.linear_attn = _LinearAttention(d, H, i)
        else:
            self.self_attn = _Attention(d, H)
        self.post_attention_layernorm = _RMSNorm(d, eps)
        inter = cfg["intermediate_size"]
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(d, inter, bias=False)
        self.mlp.up_proj = nn.Linear(d, inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, d, bias=False)

    def forward(self, x, cos, sin):
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h) if self.linear else self.self_attn(h, cos, sin))
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


class HybridConfig(dict):
    """The config.json dict, also readable as attributes (what train-heads reads of a target's
    config: hidden_size, num_attention_heads, ...; max_position_embeddings defaults to 4096)."""

    def __getattr__(self, name):
        if name in self:
            return self[name]
        if name == "max_position_embeddings":
            return 4096
        raise AttributeError(name)


class _Inner(nn.Module):
    """embed_tokens, layers, norm; forward(input_ids) -> .last_hidden_state (final-normed)."""

    def __init__(self, c: dict) -> None:
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(_Block(c, i) for i in range(c["num_hidden_layers"]))
        self.norm = _RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, input_ids, **_):
        c = self.c
        x = self.embed_tokens(input_ids)
        T, D = input_ids.shape[1], c["head_dim"]
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        freqs = torch.outer(torch.arange(T, dtype=torch.float64), inv)
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos().to(x.dtype)[None, None], emb.sin().to(x.dtype)[None, None]
        for block in self.layers:
            x = block(x, cos, sin)
        return SimpleNamespace(last_hidden_state=self.norm(x))


class HybridLM(nn.Module):
    """forward(input_ids [B, T]) -> an object with .logits [B, T, V] (the trainer's interface);
    .model(input_ids).last_hidden_state, .model.embed_tokens and .lm_head.weight as
    transformers' LlamaForCausalLM has them (what train-heads reads of a frozen target)."""

    def __init__(self, config: dict, init_std: float = 0.02) -> None:
        super().__init__()
        self.config = HybridConfig(config)
        self.model = _Inner(self.config)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2 and "a_proj" not in name:
                    p.normal_(0.0, init_std)

    @property
    def lm_head(self) -> SimpleNamespace:  # tied
        return SimpleNamespace(weight=self.model.embed_tokens.weight)

    def forward(self, input_ids, **_):
        hidden = self.model(input_ids).last_hidden_state
        return SimpleNamespace(logits=F.linear(hidden, self.model.embed_tokens.weight), hidden_states=None)

    @staticmethod
    def from_pretrained(path: str | Path, dtype: torch.dtype = torch.float32) -> HybridLM:
        from safetensors.torch import load_file

        path = Path(path)
        model = HybridLM(json.loads((path / "config.json").read_text()))
        weights = load_file(str(path / "model.safetensors"))
        model.load_state_dict({k: v.to(dtype) for k, v in weights.items()})
        return model.to(dtype)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save_pretrained(self, out: str | Path, dtype: torch.dtype = torch.float16) -> None:
        """config.json + model.safetensors (the tied head is the embedding, not stored)."""
        from safetensors.torch import save_file

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = dict(self.config) | {"torch_dtype": str(dtype).removeprefix("torch.")}
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen = {"eos_token_id": cfg.get("eos_token_id")}
        (out / "generation_config.json").write_text(json.dumps(gen) + "\n")


def init_hybrid(
    out: str | Path,
    *,
    vocab: int,
    layers: int,
    dim: int,
    linear_layers,
    heads: int | None = None,
    seed: int = 0,
    init_std: float = 0.02,
) -> Path:
    """A random hybrid checkpoint with init-model's tokenizer (tests and experiments)."""
    from transformers import PreTrainedTokenizerFast

    from ..models.hf import quiet_transformers
    from ..models.init import EOS, make_tokenizer

    heads = heads or max(1, dim // 32)
    torch.manual_seed(seed)
    model = HybridLM(hybrid_config(vocab, dim, layers, heads, 4 * dim, linear_layers, eos_id=0), init_std)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, dtype=torch.float32)
    tok = PreTrainedTokenizerFast(tokenizer_object=make_tokenizer(vocab), eos_token=EOS)
    with quiet_transformers():
        tok.save_pretrained(str(out))
    return Path(out)
