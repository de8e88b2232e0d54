"""EAGLE and EAGLE-3: feature-level drafters, one algorithm (FeatureDrafter) with the feature
step as the only difference (EAGLE-3's is in eagle3.py).

EAGLE: a feature-level drafter. One decoder layer reads, at every position j, the target's
final hidden state h_j fused with the embedding of the next token x_{j+1}, and predicts h_{j+1};
the target's LM head turns the prediction into draft probabilities. Drafting runs in feature
space: the predicted feature and the sampled token feed the next step.

The layer keeps its own one-layer KV cache over (feature, token) pairs. Pairs whose feature is
the target's own are committed; pairs built from predicted features are written past the
cache length and overwritten next round (as the early-exit drafter does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..core.proposal import Proposal
from ..errors import SpecDecodeError
from ..models.base import Cache, ForwardMeta
from ..models.cache import BLOCK
from ..models.llama import LlamaConfig, LlamaModel
from ..models.quant import quantized_linear
from .base import (
    DraftChain,
    DraftContext,
    Drafter,
    TreeDraw,
    catch_up,
    pad_positions,
    require_lean,
    weights_dtype_of,
)

KIND = "specdecode-eagle"


def load_eagle(path: str | Path, target: LlamaModel) -> tuple[LlamaModel, torch.Tensor, torch.Tensor, dict]:
    """The one-layer draft (sharing the target's embeddings and LM head) and the fusion fc."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file = path / "config.json"
    meta = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    if meta.get("kind") != KIND:
        raise SpecDecodeError(
            f"{path} holds no EAGLE drafter; train one with `specdecode train-heads --method eagle`"
        )
    if meta["layer_config"]["hidden_size"] != target.cfg.hidden_size:
        raise SpecDecodeError(
            f"EAGLE drafter of width {meta['layer_config']['hidden_size']} does not fit a target of width "
            f"{target.cfg.hidden_size}; train one for this target"
        )
    w = load_file(str(path / "eagle.safetensors"))
    fc_w = w.pop("fc.weight").to(target.device, target.dtype)
    fc_b = w.pop("fc.bias").to(target.device, target.dtype)
    w["model.embed_tokens.weight"] = target.embed
    layer = LlamaModel(LlamaConfig.from_dict(meta["layer_config"]), w, target.dtype, target.device)
    layer.lm_head = target.lm_head
    return layer, fc_w, fc_b, meta


@dataclass
class EagleState:
    cache: Cache  # the layer's one-layer cache over (feature, next token) pairs
    feats: torch.Tensor  # [B, capacity, d] the features by position (made by Eagle.feature())


class FeatureDrafter(Drafter):
    """EAGLE's algorithm, shared by EAGLE and EAGLE-3 (vLLM's EagleProposer does the same): one
    decoder layer over (feature of position j, token j + 1) pairs with its own cache, drafting
    in feature space. A subclass says only how a feature is made from the target's hidden
    states (feature), how the layer reads a pair and what it returns (step), and what it needs
    from the target (target_needs)."""

    requires_hidden = True
    supports_tree = True
    lean_only = True
    layer: LlamaModel
    feature_size: int

    def feature(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, *] the target's hidden states -> [B, T, feature_size] the features stored."""
        return hidden

    def step(self, tokens: torch.Tensor, feats: torch.Tensor, cache: Cache, **meta) -> tuple:
        """The layer over pairs (feats [B, T, d] of positions j, tokens [B, T] at j + 1):
        (logits over the target vocabulary [B, T, V], the next features [B, T, d])."""
        raise NotImplementedError

    @property
    def weights_dtype(self) -> str | None:
        return weights_dtype_of(self.layer)

    def quantize(self, kind: str) -> None:
        """The layer's projections, its head and the feature projection fc, in place."""
        self.layer.quantize(kind)
        self.quantize_fc(kind)

    def quantize_fc(self, kind: str) -> None:
        raise NotImplementedError

    def start(self, ctx: DraftContext, target_cache) -> EagleState:
        d, dtype = self.feature_size, self.target.dtype
        feats = torch.zeros(ctx.size, ctx.capacity, d, dtype=dtype, device=ctx.device)
        return EagleState(self.layer.new_cache(ctx.size, ctx.capacity), feats)

    keeps_prefix = True

    def save_prefix(self, state: EagleState, row: int, start: int):
        return state.feats[row, start : start + BLOCK].clone()

    def load_prefix(self, state: EagleState, row: int, start: int, saved) -> None:
        state.feats[row, start : start + BLOCK] = saved

    def observe(
        self, state: EagleState, hidden: torch.Tensor, start: torch.Tensor, count: torch.Tensor
    ) -> None:
        feats = self.feature(hidden)
        B, T = feats.shape[:2]
        rows, j = (torch.arange(T, device=feats.device).view(1, T) < count.view(B, 1)).nonzero(as_tuple=True)
        state.feats[rows, start[rows] + j] = feats[rows, j]  # row b's first count[b] at start[b] on

    def _catch_up(
        self, state: EagleState, ctx: DraftContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feed the committed pairs not yet in the layer's cache; return the logits [B, V] and
        predicted feature [B, d] after the pending token, and how many pairs each row fed [B]."""
        n = ctx.lengths  # the pending token is at n - 1; pairs j = 0 .. n - 2 are known
        todo = (n - 1 - state.cache.lengths).clamp(min=0)

        def feed(j: torch.Tensor):
            j = j.clamp(max=ctx.capacity - 2)  # pairs
            feats = state.feats.gather(1, j.unsqueeze(-1).expand(*j.shape, state.feats.shape[-1]))
            return self.step(ctx.tokens.gather(1, j + 1), feats, state.cache)

        logits, hidden = catch_up(state.cache, todo, feed)
        return logits, hidden, todo

    @torch.inference_mode()
    def propose(
        self, state: EagleState, ctx: DraftContext, limits: torch.Tensor, stop_below: float | None = None
    ) -> Proposal:
        B = ctx.size
        if int((ctx.lengths - 1 - state.cache.lengths).max()) <= 0:  # one-token prompts: no feature yet
            return Proposal.empty(B, ctx.device)
        logits, feat, todo = self._catch_up(state, ctx)
        chain = DraftChain(ctx, torch.where(todo > 0, limits, 0), stop_below)  # no feature yet: no drafts
        for i in range(chain.width):
            tok, stopped = chain.draw(logits)
            if stopped or i == chain.width - 1:
                break
            out, h = self.step(tok.view(B, 1), feat.view(B, 1, -1), state.cache, offset=i, advance=False)
            logits, feat = out[:, -1], h[:, -1]
        return chain.proposal()

    @torch.inference_mode()
    def propose_tree(self, state: EagleState, ctx: DraftContext, tree):
        """Candidates (TreeDraw: each node's children top-ranked or drawn from the layer's q
        after it), one layer forward per depth over (parent feature, node token) pairs."""
        B = ctx.size
        logits, feat, _ = self._catch_up(state, ctx)
        base = state.cache.lengths  # slot of the first draft pair
        parents, mask = tree.parents(), tree.mask().to(ctx.device)
        draw = TreeDraw(ctx, tree)
        level = {0: (logits, feat)}  # input index -> (logits after it, its predicted feature)
        for d in range(1, tree.depth + 1):
            idx = draw.level(d, lambda i: level[i][0])
            if d == tree.depth:
                break
            first = idx[0] - 1
            parent_feats = torch.stack([level[parents[i - 1]][1] for i in idx], 1)  # [B, T, d]
            toks = draw.nodes[:, first : first + len(idx)]
            out, h = self.step(
                toks,
                parent_feats,
                state.cache,
                positions=base.view(B, 1) + d - 1,
                tree_mask=mask[idx[0] : idx[-1] + 1, 1 : idx[-1] + 1],
                offset=first,
                advance=False,
            )
            for t, i in enumerate(idx):
                level[i] = (out[:, t], h[:, t])
        return draw.proposal()

    def commit(self, state: EagleState, lengths: torch.Tensor) -> None:
        state.cache.rewind(torch.minimum(state.cache.lengths, (lengths - 1).clamp(min=0)))

    def select_rows(self, state: EagleState, rows: torch.Tensor) -> None:
        state.cache.select_rows(rows)
        state.feats = state.feats[rows]

    def caches(self, state: EagleState) -> list:
        return [state.cache]

    def add_rows(self, state: EagleState, new: EagleState) -> None:
        state.cache.add_rows(new.cache)
        capacity = state.cache.capacity
        state.feats = torch.cat([pad_positions(state.feats, capacity), pad_positions(new.feats, capacity)])


class EagleDrafter(FeatureDrafter):
    """EAGLE: the feature is the target's final hidden state; the layer reads
    fc([embedding of the next token, feature]) and returns its final-normed output, which is
    both the next feature and, through the target's LM head, the draft distribution."""

    name = "eagle"

    def __init__(self, target, eagle: str | Path) -> None:
        require_lean(target, self.name)
        self.target = target
        self.layer, self.fc_w, self.fc_b, self.meta = load_eagle(eagle, target)
        self.fc = None  # a quantized fc (quantize()); else F.linear over fc_w, fc_b
        self.feature_size = target.cfg.hidden_size

    @classmethod
    def create(cls, target, draft, config) -> EagleDrafter:
        if config.heads is None:
            raise SpecDecodeError("method 'eagle' needs a trained EAGLE drafter (--heads DIR)")
        return cls(target, config.heads)

    def _fuse(self, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """[B, T] next tokens and [B, T, d] features -> [B, T, d] inputs of the layer."""
        x = torch.cat([F.embedding(tokens, self.target.embed).to(feats.dtype), feats], -1)
        if self.fc is not None:
            return self.fc(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        return F.linear(x, self.fc_w, self.fc_b)

    def quantize_fc(self, kind: str) -> None:
        self.fc = quantized_linear([self.fc_w], self.fc_b, kind)

    def step(self, tokens, feats, cache, **meta):
        fused = self._fuse(tokens, feats)
        return self.layer.forward(tokens, cache, ForwardMeta(return_hidden=True, inputs_embeds=fused, **meta))
