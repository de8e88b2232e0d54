"""GGUF -> a Hugging Face directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json) for the architectures
our runtime runs: `llama`, `qwen2` (q/k/v biases) and `qwen3` (per-head q/k norms).

Tensors are read and dequantized with the `gguf` library (llama.cpp's own Python package),
whatever their type (F32, F16, BF16, Q8_0, Q5_0, Q4_K, Q6_K, ...); the tokenizer is rebuilt
from the GGUF metadata with transformers' GGUF tokenizer converter. Two things llama.cpp's
converter did to a Llama checkpoint are undone here:
- q and k projections were permuted (rows interleaved per head for llama.cpp's RoPE); the
  inverse permutation restores Hugging Face's rotate-half layout (qwen2/qwen3 use rotate-half
  RoPE in llama.cpp too: their rows were never permuted);
- the pre-tokenizer is stored as a name (`tokenizer.ggml.pre`); 'smollm' splits every digit
  on its own before the byte-level BPE, which the converter does not know, so we add it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..errors import SpecDecodeError

# GGUF tensor names -> Hugging Face Llama names ({i}: the layer)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
}
# GGUF architecture -> (Hugging Face class, model_type); only llama's q/k rows are permuted
_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# pre-tokenizers whose digits go one by one (llama.cpp's `\p{N}` split before the GPT-2 regex)
_DIGIT_SPLIT_PRE = ("smollm",)


def _require_gguf():
    try:
        import gguf
    except ImportError:
        raise SpecDecodeError(
            "reading GGUF files needs the gguf library: pip install 'specdecode[gguf]'"
        ) from None
    return gguf


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for one we do not use (rope_freqs...)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: per head, rows were reordered from [first half, second
    half] (rotate-half RoPE) to interleaved pairs; this puts them back. w: [n_head * D, in]."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_config(reader, path: Path) -> dict:
    """A Hugging Face config dict (Llama, Qwen2 or Qwen3) from the GGUF metadata;
    SpecDecodeError for what we cannot run."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise SpecDecodeError(
            f"{path}: architecture {arch!r}; import-gguf converts {', '.join(_ARCHS)} GGUFs only "
            "(for other models convert with transformers and pass the directory)"
        )
    hf_class, model_type = _ARCHS[arch]

    def meta(key: str, default=None):
        return _field(reader, f"{arch}.{key}", default)

    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        raise SpecDecodeError(f"{path}: RoPE scaling {scaling!r} is not supported by our runtime")
    names = {t.name for t in reader.tensors}
    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    # the embedding's rows (Qwen pads its vocabulary past the tokenizer's 151,665 tokens)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    rows = int(embd.shape[1]) if embd is not None else (len(tokens.data) if tokens is not None else 0)
    vocab = int(meta("vocab_size", rows))
    head_dim = int(meta("attention.key_length", hidden // heads))
    cfg = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
    }
    if model_type == "llama":
        cfg.update(attention_bias="blk.0.attn_q.bias" in names, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None)
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = _field(reader, f"tokenizer.ggml.{name}")
        if value is not None:
            cfg[key] = int(value)
    return cfg


def _tensors(reader, cfg: dict, dtype: torch.dtype, progress: bool) -> dict[str, torch.Tensor]:
    gguf = _require_gguf()
    from ..progress import bar

    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    permuted = cfg["model_type"] == "llama"
    out: dict[str, torch.Tensor] = {}
    for t in bar(reader.tensors, "dequantizing", enabled=progress):
        name = hf_name(t.name)
        if name is None:
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        # (F32 tensors come back as read-only views of the memory-mapped file: copy)
        w = np.array(w, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])
        if permuted and ".attn_q." in t.name:
            w = unpermute_rope(w, heads)
        elif permuted and ".attn_k." in t.name:
            w = unpermute_rope(w, kv_heads)
        out[name] = torch.from_numpy(np.ascontiguousarray(w)).to(dtype)
    return out


def _tokenizer_files(path: Path, reader, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) and special tokens."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )
    except ImportError:
        raise SpecDecodeError(
            "building the tokenizer from a GGUF needs transformers: pip install 'specdecode[gguf]'"
        ) from None
    from tokenizers import pre_tokenizers

    arch, tok_dict, tok_config = get_gguf_tokenizer(str(path))
    tokenizer, _ = convert_gguf_tokenizer(arch, tok_dict)
    if tok_dict.get("pre_tokenizer_type") in _DIGIT_SPLIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), tokenizer.pre_tokenizer]
        )
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(_field(reader, f"{arch}.context_length", 2048)),
        "clean_up_tokenization_spaces": False,
        **{k: v for k, v in tok_config.items() if v is not None},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


def import_gguf(
    path: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype = torch.float32, progress: bool = True
) -> Path:
    """Convert a Llama, Qwen2 or Qwen3 GGUF into a Hugging Face model directory at `out` (weights
    dequantized and stored in `dtype`). Written to a temporary directory first, so an
    interrupted conversion never leaves a half-written model behind."""
    gguf = _require_gguf()
    from safetensors.torch import save_file

    src, dst = Path(path), Path(out)
    if not src.is_file():
        raise SpecDecodeError(f"{src} is not a file; pass a .gguf model file")
    try:
        reader = gguf.GGUFReader(str(src))
    except (ValueError, OSError) as e:
        raise SpecDecodeError(f"{src} is not a readable GGUF file ({e})") from None
    cfg = read_config(reader, src)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".", dir=dst.parent))
    try:
        weights = _tensors(reader, cfg, dtype, progress)
        missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight") if n not in weights]
        if missing:
            raise SpecDecodeError(f"{src}: tensors {missing} are missing; is this a model GGUF?")
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del weights
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        gen = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")}
        (tmp / "generation_config.json").write_text(
            json.dumps({k: v for k, v in gen.items() if v is not None})
        )
        _tokenizer_files(src, reader, tmp)
        (tmp / "SOURCE").write_text(f"converted by specdecode import-gguf from {src.resolve()}\n")
        tmp.chmod(0o755)
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dst
