"""EAGLE-3: a feature-level drafter over the target's low, middle and high layers.

At every position j the target's residual streams entering three of its layers (vLLM's default:
2, L // 2 and L - 3) are concatenated and fused by `fc` into one feature g_j. One decoder layer
reads [norm(embedding of x_{j+1}), norm(g_j)] (2 * hidden inputs to q|k|v) with g_j as the
residual, and its output (before the final norm) is both the next step's feature and, through
the final norm and a small LM head, the draft distribution. Drafting runs in that feature space:
step i + 1 reads the feature step i produced and the token it drew. Training (train/eagle3.py)
feeds the layer its own predictions for several steps (EAGLE-3's training-time test), so it
learns to draft from its own features, not only from the target's.

Draft vocabulary (FR-Spec): the LM head covers only the N tokens most frequent in the target's
answers; `d2t[i]` maps draft id i to target id i + d2t[i]. Every other token gets draft
probability 0; verification stays exact (the residual max(0, p - q) covers those tokens).

The checkpoint is the layout vLLM and SGLang load (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
`t2d`; config.json with `draft_vocab_size`, `target_hidden_size` and
`eagle_aux_hidden_state_layer_ids`), plus a `specdecode` section naming the target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import SpecDecodeError
from ..models.base import ForwardMeta
from ..models.linear import Linear
from ..models.llama import LlamaConfig, LlamaModel
from ..models.quant import quantized_linear
from .base import TargetNeeds, require_lean
from .eagle import FeatureDrafter

KIND = "specdecode-eagle3"
ARCHITECTURE = "LlamaForCausalLMEagle3"


def is_eagle3(path: str | Path) -> bool:
    f = Path(path) / "config.json"
    if not f.exists():
        return False
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError:
        return False
    return "eagle_aux_hidden_state_layer_ids" in cfg or ARCHITECTURE in cfg.get("architectures", [])


def layer_config(cfg: dict) -> LlamaConfig:
    """The draft layer as a one-layer Llama whose vocabulary is the draft vocabulary."""
    d = dict(cfg, model_type="llama", num_hidden_layers=1, vocab_size=cfg["draft_vocab_size"])
    d["tie_word_embeddings"] = False
    return LlamaConfig.from_dict(d)


def weights_to_llama(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """EAGLE-3 checkpoint names -> our runtime's Llama names for the one layer."""
    out = {}
    for name, t in w.items():
        if name.startswith("midlayer."):
            out["model.layers.0." + name.removeprefix("midlayer.")] = t
        elif name == "norm.weight":
            out["model.norm.weight"] = t
        elif name == "lm_head.weight":
            out[name] = t
    return out


def load_eagle3(path: str | Path, target: LlamaModel):
    """(layer as a LlamaModel, fc Linear, draft->target ids [N], config) for `target`."""
    from safetensors.torch import load_file

    path = Path(path)
    if not is_eagle3(path):
        raise SpecDecodeError(
            f"{path} holds no EAGLE-3 drafter; train one with `specdecode train-heads --method eagle3`"
        )
    cfg = json.loads((path / "config.json").read_text())
    tc = target.cfg
    want = {"target_hidden_size": tc.hidden_size, "vocab_size": tc.vocab_size}
    got = {
        k: cfg.get("target_hidden_size", cfg.get("hidden_size")) if k == "target_hidden_size" else cfg.get(k)
        for k in want
    }
    if got != want:
        raise SpecDecodeError(
            f"EAGLE-3 drafter {path} was made for a target with {got}, not {want}; train one for this target"
        )
    aux = tuple(cfg["eagle_aux_hidden_state_layer_ids"])
    if len(aux) != 3 or not all(0 <= i < tc.num_layers for i in aux):
        raise SpecDecodeError(f"{path}: aux layers {aux} do not fit a target of {tc.num_layers} layers")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpecDecodeError(f"no *.safetensors weights in {path}")
    w: dict[str, torch.Tensor] = {}
    for f in files:
        w.update(load_file(str(f)))
    dev, dtype = target.device, target.dtype
    N = cfg["draft_vocab_size"]
    d2t = w.get("d2t")
    ids = torch.arange(N) + (d2t.long() if d2t is not None else 0)
    if int(ids.max()) >= tc.vocab_size or int(ids.min()) < 0:
        raise SpecDecodeError(f"{path}: d2t maps outside the target's {tc.vocab_size} tokens")
    lw = weights_to_llama(w)
    lw["model.embed_tokens.weight"] = target.embed
    try:
        layer = LlamaModel(layer_config(cfg), lw, dtype, dev)
    except KeyError as e:
        raise SpecDecodeError(f"{path}: weight {e} is missing; is this an EAGLE-3 checkpoint?") from None
    fc = Linear(w["fc.weight"].to(dev, dtype), w["fc.bias"].to(dev, dtype) if "fc.bias" in w else None)
    return layer, fc, ids.to(dev), cfg


class Eagle3Drafter(FeatureDrafter):
    """EAGLE-3: the feature is fc(the target's residual streams entering three layers); the layer
    reads [norm(embedding of the next token), hidden_norm(feature)] with the feature as the
    residual, and its output before the final norm is the next feature; the final norm and the
    draft-vocabulary head give logits, mapped into the target vocabulary (-inf elsewhere)."""

    name = "eagle3"

    def __init__(self, target, path: str | Path) -> None:
        require_lean(target, self.name)
        self.target = target
        self.layer, self.fc, self.draft_ids, self.meta = load_eagle3(path, target)
        self.aux_layers = tuple(self.meta["eagle_aux_hidden_state_layer_ids"])
        self.vocab = target.vocab_size
        self.feature_size = self.layer.cfg.hidden_size

    @classmethod
    def create(cls, target, draft, config) -> Eagle3Drafter:
        if config.heads is None:
            raise SpecDecodeError("method 'eagle3' needs a trained EAGLE-3 drafter (--heads DIR)")
        return cls(target, config.heads)

    def target_needs(self) -> TargetNeeds:
        return TargetNeeds(hidden=True, aux_layers=self.aux_layers)

    def quantize_fc(self, kind: str) -> None:
        self.fc = quantized_linear([self.fc.weight_matrix()], self.fc.bias, kind)

    def feature(self, hidden: torch.Tensor) -> torch.Tensor:
        B, T, _ = hidden.shape
        return self.fc(hidden.reshape(B * T, -1)).view(B, T, -1)

    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., N] -> target-vocabulary logits [..., V] (-inf elsewhere)."""
        full = logits.new_full((*logits.shape[:-1], self.vocab), float("-inf"))
        return full.index_copy_(-1, self.draft_ids, logits)

    def step(self, tokens, feats, cache, **meta):
        # aux layer 1 of a one-layer model: its output before the final norm
        meta = ForwardMeta(return_hidden=True, aux_layers=(1,), inputs_embeds=feats, **meta)
        logits, hidden = self.layer.forward(tokens, cache, meta)
        return self._full(logits), hidden


__all__ = ["ARCHITECTURE", "KIND", "Eagle3Drafter", "is_eagle3", "load_eagle3"]
