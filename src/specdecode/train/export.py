"""`specdecode export`: an EAGLE-3 drafter in the checkpoint layout vLLM and SGLang load.

Both engines read a Llama-style config.json (architectures ["LlamaForCausalLMEagle3"],
num_hidden_layers 1, draft_vocab_size, target_hidden_size, the aux layer ids) and one
safetensors file with `fc.weight` [d, 3 * d_target], `midlayer.{input_layernorm, hidden_norm,
post_attention_layernorm}.weight` [d], `midlayer.self_attn.{q,k,v}_proj.weight` [*, 2 * d],
`midlayer.self_attn.o_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`,
`lm_head.weight` [draft_vocab, d], `d2t` [draft_vocab] int64 (target id = draft id + d2t) and
`t2d` [vocab] bool (vLLM's vllm/model_executor/models/llama_eagle3.py and SGLang's
python/sglang/srt/models/llama_eagle3.py). The export adds the target's `embed_tokens.weight`, so
the checkpoint does not depend on either engine sharing the target's embeddings; they are written in
the target's stored precision, so the engines read the very numbers our drafter reads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..drafters.eagle3 import ARCHITECTURE, is_eagle3
from ..errors import SpecDecodeError

FORMATS = ("vllm", "sglang")
LAYER = ("input_layernorm", "hidden_norm", "post_attention_layernorm")


def expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name of an EAGLE-3 checkpoint and its shape, from its config."""
    d, td, inter = (
        cfg["hidden_size"],
        cfg.get("target_hidden_size", cfg["hidden_size"]),
        cfg["intermediate_size"],
    )
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or d // H
    N, V = cfg["draft_vocab_size"], cfg["vocab_size"]
    shapes = {
        "fc.weight": (d, 3 * td),
        "midlayer.self_attn.q_proj.weight": (H * D, 2 * d),
        "midlayer.self_attn.k_proj.weight": (Hkv * D, 2 * d),
        "midlayer.self_attn.v_proj.weight": (Hkv * D, 2 * d),
        "midlayer.self_attn.o_proj.weight": (d, H * D),
        "midlayer.mlp.gate_proj.weight": (inter, d),
        "midlayer.mlp.up_proj.weight": (inter, d),
        "midlayer.mlp.down_proj.weight": (d, inter),
        "norm.weight": (d,),
        "lm_head.weight": (N, d),
        "d2t": (N,),
        "t2d": (V,),
    }
    shapes.update({f"midlayer.{n}.weight": (d,) for n in LAYER})
    return shapes


def check_checkpoint(path: str | Path) -> dict:
    """Read an exported (or our own) EAGLE-3 checkpoint back and check it against the layout the
    engines load; return its config. SpecDecodeError naming the first problem."""
    from safetensors import safe_open

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "vocab_size"):
        if key not in cfg:
            raise SpecDecodeError(f"{path}/config.json lacks {key}")
    if ARCHITECTURE not in cfg.get("architectures", []) or cfg.get("num_hidden_layers") != 1:
        raise SpecDecodeError(f"{path}: architectures must be [{ARCHITECTURE!r}] with num_hidden_layers 1")
    if cfg.get("tie_word_embeddings"):
        raise SpecDecodeError(f"{path}: tie_word_embeddings must be false (the draft head is its own)")
    want = expected_shapes(cfg)
    got: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                t = fh.get_tensor(k)
                got[k], dtypes[k] = tuple(t.shape), t.dtype
                if k == "d2t":
                    ids = t.long() + torch.arange(t.shape[0])
                    if (
                        int(ids.min()) < 0
                        or int(ids.max()) >= cfg["vocab_size"]
                        or len(set(ids.tolist())) != len(ids)
                    ):
                        raise SpecDecodeError(f"{path}: d2t does not map draft ids to distinct target ids")
    for name, shape in want.items():
        if name not in got:
            raise SpecDecodeError(f"{path}: tensor {name} is missing")
        if got[name] != shape:
            raise SpecDecodeError(f"{path}: {name} has shape {got[name]}, the engines expect {shape}")
    if dtypes["d2t"] != torch.int64 or dtypes["t2d"] != torch.bool:
        raise SpecDecodeError(f"{path}: d2t must be int64 and t2d bool")
    extra = set(got) - set(want) - {"embed_tokens.weight"}
    if extra:
        raise SpecDecodeError(f"{path}: unexpected tensors {sorted(extra)}")
    return cfg


def _target_embeddings(target: str) -> torch.Tensor:
    """The target's token embeddings, read from its files (no model is built)."""
    from safetensors import safe_open

    from ..models import resolve

    path = resolve(target)
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            if "model.embed_tokens.weight" in fh.keys():
                return fh.get_tensor("model.embed_tokens.weight")
    raise SpecDecodeError(f"{path} has no model.embed_tokens.weight; export with --no-embeddings")


def export(heads: str | Path, fmt: str, out: str | Path, embeddings: bool = True) -> Path:
    """Write `heads` (a drafter from train-heads --method eagle3) to `out` for vLLM or SGLang."""
    from safetensors.torch import load_file, save_file

    heads, out = Path(heads), Path(out)
    if fmt not in FORMATS:
        raise SpecDecodeError(f"--format must be vllm or sglang, got {fmt!r}")
    if not is_eagle3(heads):
        raise SpecDecodeError(f"{heads} holds no EAGLE-3 drafter; train one with train-heads --method eagle3")
    if out.resolve() == heads.resolve():
        raise SpecDecodeError("--out must differ from --heads")
    cfg = json.loads((heads / "config.json").read_text())
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(heads.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    meta = cfg.pop("specdecode", {})
    if embeddings:
        target = meta.get("target")
        if not target:
            raise SpecDecodeError(f"{heads}/config.json names no target; export with --no-embeddings")
        # in the target's own stored precision: an fp16 copy of fp32 embeddings (a GGUF target's
        # dequantized ones) moved the drafter's logits by 4e-4 (tests/test_export_reference.py)
        weights["embed_tokens.weight"] = _target_embeddings(target).contiguous()
    aux = cfg["eagle_aux_hidden_state_layer_ids"]
    cfg.update(
        architectures=[ARCHITECTURE],
        tie_word_embeddings=False,
        torch_dtype="float16",
        eagle_config={"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": aux},
    )
    cfg["exported_by"] = {"tool": "specdecode export", "format": fmt, "target": meta.get("target")}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    card = heads / "MODEL_CARD.md"
    if card.exists():
        shutil.copy(card, out / "README.md")
    check_checkpoint(out)
    return out
