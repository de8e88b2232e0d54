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
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SpecDecodeError
from ..models.base import Cache, ForwardMeta
from ..models.linear import Linear
from ..models.llama import LlamaConfig, LlamaModel
from ..verify import Proposal
from .base import DraftChain, DraftContext, Drafter, TreeDraw, catch_up, pad_positions

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


@dataclass
class Eagle3State:
    cache: Cache  # the layer's one-layer cache over (feature, next token) pairs
    feats: torch.Tensor  # [B, capacity, d] fused target features g_j by position


class Eagle3Drafter(Drafter):
    name = "eagle3"
    requires_hidden = True
    supports_tree = True

    def __init__(self, target, path: str | Path) -> None:
        if not isinstance(target, LlamaModel):
            raise SpecDecodeError("method eagle3 needs a Llama target on our lean runtime (--backend lean)")
        self.target = target
        self.layer, self.fc, self.draft_ids, self.meta = load_eagle3(path, target)
        self.aux_layers = tuple(self.meta["eagle_aux_hidden_state_layer_ids"])
        self.vocab = target.vocab_size
        self._prenorm = (1,)  # aux layer 1 of a one-layer model: its output before the final norm

    @classmethod
    def create(cls, target, draft, config) -> Eagle3Drafter:
        if config.heads is None:
            raise SpecDecodeError("method 'eagle3' needs a trained EAGLE-3 drafter (--heads DIR)")
        return cls(target, config.heads)

    def start(self, ctx: DraftContext, target_cache) -> Eagle3State:
        d = self.layer.cfg.hidden_size
        feats = torch.zeros(ctx.size, ctx.capacity, d, dtype=self.target.dtype, device=ctx.device)
        return Eagle3State(self.layer.new_cache(ctx.size, ctx.capacity), feats)

    def observe(
        self, state: Eagle3State, hidden: torch.Tensor, start: torch.Tensor, count: torch.Tensor
    ) -> None:
        B, T, _ = hidden.shape
        fused = self.fc(hidden.reshape(B * T, -1)).view(B, T, -1)
        for b, (s, n) in enumerate(zip(start.tolist(), count.tolist())):
            state.feats[b, s : s + n] = fused[b, :n]

    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., N] -> target-vocabulary logits [..., V] (-inf elsewhere)."""
        full = logits.new_full((*logits.shape[:-1], self.vocab), float("-inf"))
        return full.index_copy_(-1, self.draft_ids, logits)

    def _step(self, tokens, state, meta_kw) -> tuple[torch.Tensor, torch.Tensor]:
        meta = ForwardMeta(return_hidden=True, aux_layers=self._prenorm, **meta_kw)
        logits, hidden = self.layer.forward(tokens, state.cache, meta)
        return logits, hidden

    def _catch_up(self, state: Eagle3State, ctx: DraftContext):
        """Feed the committed pairs not yet in the layer's cache; return the logits [B, V] and the
        feature [B, d] after the pending token, and how many pairs each row fed [B]."""
        n = ctx.lengths  # the pending token is at n - 1; pairs j = 0 .. n - 2 are known
        todo = (n - 1 - state.cache.lengths).clamp(min=0)

        def feed(j: torch.Tensor):
            j = j.clamp(max=ctx.capacity - 2)
            feats = state.feats.gather(1, j.unsqueeze(-1).expand(*j.shape, state.feats.shape[-1]))
            return self._step(ctx.tokens.gather(1, j + 1), state, {"inputs_embeds": feats})

        logits, hidden = catch_up(state.cache, todo, feed)
        return self._full(logits), hidden, todo

    @torch.inference_mode()
    def propose(
        self, state: Eagle3State, ctx: DraftContext, limits: torch.Tensor, stop_below: float | None = None
    ) -> Proposal:
        B = ctx.size
        if int((ctx.lengths - 1 - state.cache.lengths).max()) <= 0:  # one-token prompts: no feature yet
            return Proposal.empty(B, ctx.device)
        logits, feat, todo = self._catch_up(state, ctx)
        chain = DraftChain(ctx, torch.where(todo > 0, limits, 0), stop_below)
        for i in range(chain.width):
            tok, stopped = chain.draw(logits)
            if stopped or i == chain.width - 1:
                break
            out, h = self._step(
                tok.view(B, 1), state, {"offset": i, "advance": False, "inputs_embeds": feat.view(B, 1, -1)}
            )
            logits, feat = self._full(out[:, -1]), h[:, -1]
        return chain.proposal()

    @torch.inference_mode()
    def propose_tree(self, state: Eagle3State, ctx: DraftContext, tree):
        """Candidates (TreeDraw: each node's children top-ranked or drawn from the layer's q
        after it), one layer forward per depth over (parent feature, node token) pairs."""
        B = ctx.size
        logits, feat, _ = self._catch_up(state, ctx)
        base = state.cache.lengths
        parents, mask = tree.parents(), tree.mask().to(ctx.device)
        draw = TreeDraw(ctx, tree)
        level = {0: (logits, feat)}
        for d in range(1, tree.depth + 1):
            idx = draw.level(d, lambda i: level[i][0])
            if d == tree.depth:
                break
            first = idx[0] - 1
            parent_feats = torch.stack([level[parents[i - 1]][1] for i in idx], 1)
            toks = draw.nodes[:, first : first + len(idx)]
            out, h = self._step(
                toks,
                state,
                {
                    "positions": base.view(B, 1) + d - 1,
                    "tree_mask": mask[idx[0] : idx[-1] + 1, 1 : idx[-1] + 1],
                    "offset": first,
                    "advance": False,
                    "inputs_embeds": parent_feats,
                },
            )
            for t, i in enumerate(idx):
                level[i] = (self._full(out[:, t]), h[:, t])
        return draw.proposal()

    def commit(self, state: Eagle3State, lengths: torch.Tensor) -> None:
        state.cache.rewind(torch.minimum(state.cache.lengths, (lengths - 1).clamp(min=0)))

    def select_rows(self, state: Eagle3State, rows: torch.Tensor) -> None:
        state.cache.select_rows(rows)
        state.feats = state.feats[rows]

    def add_rows(self, state: Eagle3State, new: Eagle3State) -> None:
        state.cache.add_rows(new.cache)
        capacity = state.cache.capacity
        state.feats = torch.cat([pad_positions(state.feats, capacity), pad_positions(new.feats, capacity)])


__all__ = ["ARCHITECTURE", "KIND", "Eagle3Drafter", "is_eagle3", "load_eagle3"]
