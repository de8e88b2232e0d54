"""A separate small model that shares the target's vocabulary, with its own KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import SpecDecodeError
from ..models.base import CausalLM, extend
from ..tree import TokenTree
from .base import DraftChain, Proposal

if TYPE_CHECKING:
    from ..engine import Batch


class DraftModelDrafter:
    """Proposes k tokens by sampling the draft model k times (k - 1 one-token forwards after
    catching up on the tokens it has not seen)."""

    def __init__(self, draft: CausalLM, target: CausalLM) -> None:
        if draft.vocab_size != target.vocab_size:
            raise SpecDecodeError(
                f"vocabulary mismatch: target has {target.vocab_size} tokens, draft has "
                f"{draft.vocab_size}; the draft must share the target's tokenizer"
            )
        self.model = draft
        self.cache = None

    def start(self, batch: Batch, target_cache=None) -> None:
        self.cache = self.model.new_cache(batch.size, batch.capacity)
        if int(batch.lengths.max()) > 1:  # prefill with the target's (all but the pending token)
            extend(self.model, self.cache, batch.tokens, batch.lengths - 1)

    @torch.inference_mode()
    def propose(self, batch: Batch, k: int, stop_below: float | None = None) -> Proposal:
        logits = extend(self.model, self.cache, batch.tokens, batch.lengths)  # [B, V]
        chain = DraftChain(batch, stop_below)
        for i in range(k):
            tok, stopped = chain.draw(logits)
            if stopped or i == k - 1:
                break
            logits = self.model.forward(tok.view(-1, 1), self.cache)[:, -1]
        return chain.proposal()

    @torch.inference_mode()
    def propose_tree(self, batch: Batch, tree: TokenTree) -> torch.Tensor:
        """[B, N] candidates: node (..., r) is the draft's (r+1)-th most likely token after its
        parent, level by level, one draft forward per level with the tree's attention mask."""
        B, N = batch.size, tree.size
        logits = extend(self.model, self.cache, batch.tokens, batch.lengths)  # after the pending token
        base = self.cache.lengths  # the pending token is at base - 1
        parents, depths, mask = tree.parents(), tree.depths(), tree.mask()
        nodes = torch.zeros(B, N, dtype=torch.long)
        level_logits = {0: logits}  # input index of a fed node -> its next-token logits [B, V]
        for d in range(1, tree.depth + 1):
            idx = [i for i in range(1, N + 1) if int(depths[i]) == d]  # input indices at depth d
            ranks = [tree.choices[i - 1][-1] for i in idx]
            for i, r in zip(idx, ranks):
                top = level_logits[parents[i - 1]].topk(r + 1, -1).indices  # [B, r + 1]
                nodes[:, i - 1] = top[:, r]
            if d == tree.depth:
                break
            # feed this level to get the distributions after each of its nodes
            first = idx[0] - 1  # slot offset past the cache length (nodes are stored in order)
            out = self.model.forward(
                nodes[:, first : first + len(idx)],
                self.cache,
                offset=first,
                positions=(base - 1).view(B, 1) + d,
                tree_mask=mask[idx[0] : idx[-1] + 1, 1 : idx[-1] + 1],
                advance=False,
            )
            for j, i in enumerate(idx):
                level_logits[i] = out[:, j]
        return nodes

    def commit(self, lengths: torch.Tensor) -> None:
        self.cache.rewind(torch.minimum(self.cache.lengths, lengths))

    def select_rows(self, rows: torch.Tensor) -> None:
        self.cache.select_rows(rows)
