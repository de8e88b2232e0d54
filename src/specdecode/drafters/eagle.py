"""EAGLE: a feature-level drafter. One decoder layer reads, at every position j, the target's
final hidden state h_j fused with the embedding of the next token x_{j+1}, and predicts h_{j+1};
the target's LM head turns the prediction into draft probabilities. Drafting runs in feature
space: the predicted feature and the sampled token feed the next step.

The layer keeps its own one-layer KV cache over (feature, token) pairs. Pairs whose feature is
the target's own are committed; pairs built from predicted features are written past the
cache length and overwritten next round (as the early-exit drafter does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..errors import SpecDecodeError
from ..models.llama import LlamaConfig, LlamaModel
from .base import DraftChain, Proposal

if TYPE_CHECKING:
    from ..engine import Batch

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
    fc_w, fc_b = w.pop("fc.weight").to(target.dtype), w.pop("fc.bias").to(target.dtype)
    w["model.embed_tokens.weight"] = target.embed
    layer = LlamaModel(LlamaConfig.from_dict(meta["layer_config"]), w, target.dtype)
    layer.lm_head = target.lm_head
    return layer, fc_w, fc_b, meta


class EagleDrafter:
    needs_hidden = True

    def __init__(self, target, eagle: str | Path) -> None:
        if not isinstance(target, LlamaModel):
            raise SpecDecodeError("method eagle needs a Llama target on our lean runtime (--backend lean)")
        self.target = target
        self.layer, self.fc_w, self.fc_b, self.meta = load_eagle(eagle, target)
        self.model = None
        self.cache = None
        self.feats: torch.Tensor | None = None  # [B, capacity, d] the target's features by position

    def start(self, batch: Batch, target_cache) -> None:
        self.cache = self.layer.new_cache(batch.size, batch.capacity)
        self.feats = torch.zeros(
            batch.size, batch.capacity, self.target.cfg.hidden_size, dtype=self.target.dtype
        )

    def observe_features(self, hidden: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> None:
        for b in range(hidden.shape[0]):
            n = int(count[b])
            self.feats[b, int(start[b]) : int(start[b]) + n] = hidden[b, :n]

    def _fuse(self, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """[B, T] next tokens and [B, T, d] features -> [B, T, d] inputs of the layer."""
        return F.linear(torch.cat([F.embedding(tokens, self.target.embed), feats], -1), self.fc_w, self.fc_b)

    def _catch_up(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feed the committed pairs not yet in the layer's cache; return the logits [B, V] and
        predicted feature [B, d] after the pending token, and how many pairs each row fed [B]."""
        B = batch.size
        n = batch.lengths  # the pending token is at n - 1; pairs j = 0 .. n - 2 are known
        done = self.cache.lengths.clone()
        todo = (n - 1 - done).clamp(min=0)
        M = max(int(todo.max()), 1)
        j = (done.view(B, 1) + torch.arange(M).view(1, M)).clamp(max=batch.capacity - 2)  # pair indices
        fused = self._fuse(
            batch.tokens.gather(1, j + 1),
            self.feats.gather(1, j.unsqueeze(-1).expand(B, M, self.feats.shape[-1])),
        )
        logits, hidden = self.layer.forward(j, self.cache, inputs_embeds=fused, return_hidden=True)
        self.cache.rewind(done + todo)  # padding of shorter rows is dropped
        last = (todo - 1).clamp(min=0)
        return logits[torch.arange(B), last], hidden[torch.arange(B), last], todo

    @torch.inference_mode()
    def propose_tree(self, batch: Batch, tree) -> torch.Tensor:
        """[B, N] candidates: each node's children are the layer's top-ranked tokens after it,
        one layer forward per depth over (parent feature, node token) pairs with the tree mask."""
        B, N = batch.size, tree.size
        logits, feat, _ = self._catch_up(batch)
        base = self.cache.lengths  # slot of the first draft pair
        parents, depths, mask = tree.parents(), tree.depths(), tree.mask()
        nodes = torch.zeros(B, N, dtype=torch.long)
        level = {0: (logits, feat)}  # input index -> (logits after it, its predicted feature)
        for d in range(1, tree.depth + 1):
            idx = [i for i in range(1, N + 1) if int(depths[i]) == d]
            for i in idx:
                r = tree.choices[i - 1][-1]
                nodes[:, i - 1] = level[parents[i - 1]][0].topk(r + 1, -1).indices[:, r]
            if d == tree.depth:
                break
            first = idx[0] - 1
            parent_feats = torch.stack([level[parents[i - 1]][1] for i in idx], 1)  # [B, T, d]
            toks = nodes[:, first : first + len(idx)]
            out, h = self.layer.forward(
                toks,
                self.cache,
                inputs_embeds=self._fuse(toks, parent_feats),
                offset=first,
                positions=base.view(B, 1) + d - 1,
                tree_mask=mask[idx[0] : idx[-1] + 1, 1 : idx[-1] + 1],
                advance=False,
                return_hidden=True,
            )
            for t, i in enumerate(idx):
                level[i] = (out[:, t], h[:, t])
        return nodes

    @torch.inference_mode()
    def propose(self, batch: Batch, k: int, stop_below: float | None = None) -> Proposal:
        B = batch.size
        if int((batch.lengths - 1 - self.cache.lengths).max()) <= 0:  # one-token prompts: no feature yet
            return Proposal.empty(B)
        logits, feat, todo = self._catch_up(batch)
        chain = DraftChain(batch, stop_below)
        for i in range(k):
            tok, stopped = chain.draw(logits)
            if stopped or i == k - 1:
                break
            fused = self._fuse(tok.view(B, 1), feat.view(B, 1, -1))
            out, h = self.layer.forward(
                tok.view(B, 1), self.cache, inputs_embeds=fused, offset=i, advance=False, return_hidden=True
            )
            logits, feat = out[:, -1], h[:, -1]
        lengths = chain.stop.result()
        if lengths is None:
            lengths = torch.full((B,), len(chain.tokens), dtype=torch.long)
        # rows with no feature yet draft nothing
        return chain.proposal(torch.where(todo > 0, lengths, torch.zeros_like(lengths)))

    def commit(self, lengths: torch.Tensor) -> None:
        self.cache.rewind(torch.minimum(self.cache.lengths, (lengths - 1).clamp(min=0)))

    def select_rows(self, rows: torch.Tensor) -> None:
        self.cache.select_rows(rows)
        self.feats = self.feats[rows]
