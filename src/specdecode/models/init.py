"""Random-initialised Llama, Qwen2 and Qwen3 checkpoints with a matching tokenizer, for tests and
experiments."""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

from ..errors import SpecDecodeError
from .hf import quiet_transformers

EOS = "<|endoftext|>"
UNK = "<unk>"
# characters of the small (char-level) vocabularies, most useful first
_CHARS = (
    string.ascii_lowercase
    + " "
    + string.digits
    + ".,!?'\"-:;()\n"
    + string.ascii_uppercase
    + "[]{}<>=+*/_#@$%&|\\^`~\t"
)


def make_tokenizer(vocab_size: int):
    """A `tokenizers` Tokenizer with no more than vocab_size tokens and id 0 = EOS.

    vocab >= 258: byte-level (every text encodes, nothing is unknown). Smaller: one token per
    character of a fixed alphabet, the rest mapped to <unk>.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size >= 258:
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        vocab = {EOS: 0} | {ch: i + 1 for i, ch in enumerate(alphabet)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
    else:
        chars = _CHARS[: vocab_size - 2]
        vocab = {EOS: 0, UNK: 1} | {ch: i + 2 for i, ch in enumerate(chars)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
        tok.decoder = decoders.Fuse()
    tok.add_special_tokens([EOS])
    return tok


# arch -> transformers' (config class, model class)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def init_model(
    out: str | Path,
    *,
    vocab: int,
    layers: int,
    dim: int,
    seed: int = 0,
    heads: int | None = None,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    init_std: float = 0.02,
    tie_embeddings: bool = True,
    arch: str = "llama",
) -> Path:
    """Write a random checkpoint (config.json, model.safetensors, tokenizer) to out, made with
    transformers' own class for `arch`: llama, qwen2 (q/k/v biases) or qwen3 (q/k norms)."""
    import transformers
    from transformers import PreTrainedTokenizerFast

    if arch not in ARCHS:
        raise SpecDecodeError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")

    if vocab < 8:
        raise SpecDecodeError(f"vocab must be >= 8, got {vocab}")
    if layers < 1 or dim < 2:
        raise SpecDecodeError(f"need layers >= 1 and dim >= 2, got layers={layers}, dim={dim}")
    heads = heads or max(1, dim // 32)
    kv_heads = kv_heads or heads
    if dim % heads or heads % kv_heads or (dim // heads) % 2:
        raise SpecDecodeError(
            f"dim {dim} must split into {heads} heads of even size, and heads into {kv_heads} kv heads"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config_class, model_class = (getattr(transformers, n) for n in ARCHS[arch])
    extra = {"head_dim": dim // heads} if arch == "qwen3" else {}
    config = config_class(
        **extra,
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=intermediate or 4 * dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        initializer_range=init_std,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    # norms start at 1 and biases at 0 in transformers; jitter them so a test can tell weights
    # apart (and a runtime that drops a bias or a q/k norm fails it)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    tok = PreTrainedTokenizerFast(tokenizer_object=make_tokenizer(vocab), eos_token=EOS)
    with quiet_transformers():
        model.save_pretrained(str(out))
        tok.save_pretrained(str(out))
    (out / "specdecode.json").write_text(
        json.dumps({"created_by": "specdecode init-model", "arch": arch, "seed": seed}) + "\n"
    )
    return out
