"""A separate small model that shares the target's vocabulary, with its own KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.proposal import Proposal
from ..core.tree import TokenTree
from ..errors import SpecDecodeError
from ..models.base import Cache, CausalLM, ForwardMeta, extend
from ..models.cache import BLOCK, KVCache
from .base import DraftChain, DraftContext, Drafter, TreeDraw, weights_dtype_of


@dataclass
class DraftModelState:
    cache: Cache  # the draft model's cache: every committed token it has seen


class DraftModelDrafter(Drafter):
    """Proposes k tokens by sampling the draft model k times (k - 1 one-token forwards after
    catching up on the tokens it has not seen)."""

    name = "draft"
    supports_tree = True

    def __init__(self, draft: CausalLM, target: CausalLM, draft_vocab=None, chains: bool = True) -> None:
        """draft_vocab: the draft's head over only its N most frequent tokens (an int N, or a JSON
        file of token ids in frequency order; models/draft_vocab.py), FR-Spec; None: all.
        chains: it drafts chains only (no token tree), so its cache may be batch-invariant."""
        self.chains = chains
        if draft.vocab_size != target.vocab_size:
            raise SpecDecodeError(
                f"vocabulary mismatch: target has {target.vocab_size} tokens, draft has "
                f"{draft.vocab_size}; the draft must share the target's tokenizer"
            )
        if draft.device != target.device:
            raise SpecDecodeError(
                f"the draft is on {draft.device} and the target on {target.device}; load both on one device"
            )
        self.model = draft
        # a copy of the draft in a format that runs prompts faster (opener.py, autotune.py), or
        # None: it writes the same cache (a draft's weights change its drafts, never the output)
        self.prefill_model = getattr(draft, "prefill_model", None)
        if draft_vocab not in (None, "full"):  # "full": the whole vocabulary
            from ..models.draft_vocab import ReducedHeadModel, frequent_ids

            if not draft.lean:
                raise SpecDecodeError("a draft vocabulary needs our lean runtime for the draft model")
            self.model = ReducedHeadModel(draft, frequent_ids(draft, draft_vocab))

    @property
    def weights_dtype(self) -> str | None:
        return weights_dtype_of(self.model) if self.model.lean else None

    def quantize(self, kind: str) -> None:
        """Quantizes the draft model itself, in place."""
        if not self.model.lean:
            raise SpecDecodeError("a quantized draft model needs our lean runtime; load it with backend=lean")
        self.model.quantize(kind)

    @classmethod
    def create(cls, target, draft, config) -> DraftModelDrafter:
        if draft is None:
            raise SpecDecodeError("method 'draft' needs a draft model (--draft MODEL)")
        return cls(draft, target, config.draft_vocab, chains=config.tree is None)

    keeps_prefix = True
    prefills_own = True

    def start(self, ctx: DraftContext, target_cache=None) -> DraftModelState:
        """The draft's own cache; batch-invariant when the target's is and the draft drafts chains
        (so a draft, and with it a seeded sample under the standard rule, does not depend on the
        batch either; a tree's level-by-level draft forwards need the plain cache)."""
        invariant = getattr(target_cache, "invariant", False) and self.chains
        if invariant and self.model.lean and self.model.supports_invariant:
            return DraftModelState(self.model.new_cache(ctx.size, ctx.capacity, invariant=True))
        return DraftModelState(self.model.new_cache(ctx.size, ctx.capacity))

    def prefill(self, state: DraftModelState, ctx: DraftContext, lengths: torch.Tensor) -> None:
        """Feed the draft model the tokens the target has prefilled (with the target's chunks),
        through its prefill copy when it has one."""
        lengths = torch.maximum(lengths, state.cache.lengths)
        if bool((lengths > state.cache.lengths).any()):
            extend(self.prefill_model or self.model, state.cache, ctx.tokens, lengths, need_logits=False)

    def save_prefix(self, state: DraftModelState, row: int, start: int):
        cache = state.cache
        if not isinstance(cache, KVCache) or int(cache.lengths[row]) < start + BLOCK:
            return None
        return cache.read_block(row, start, BLOCK)

    def load_prefix(self, state: DraftModelState, row: int, start: int, saved) -> None:
        state.cache.write_block(row, start, *saved)
        state.cache.lengths[row] = start + BLOCK

    @torch.inference_mode()
    def propose(
        self, state: DraftModelState, ctx: DraftContext, limits: torch.Tensor, stop_below: float | None = None
    ) -> Proposal:
        logits, _ = extend(self.model, state.cache, ctx.tokens, ctx.lengths)  # [B, V]
        chain = DraftChain(ctx, limits, stop_below)
        for i in range(chain.width):
            tok, stopped = chain.draw(logits)
            if stopped or i == chain.width - 1:
                break
            logits = self.model.forward(tok.view(-1, 1), state.cache)[0][:, -1]
        return chain.proposal()

    @torch.inference_mode()
    def propose_tree(self, state: DraftModelState, ctx: DraftContext, tree: TokenTree):
        """Candidates level by level (TreeDraw: top-ranked, or drawn from the draft's q after
        their parent), one draft forward per level with the tree's attention mask."""
        B, cache = ctx.size, state.cache
        logits, _ = extend(self.model, cache, ctx.tokens, ctx.lengths)  # after the pending token
        base = cache.lengths  # the pending token is at base - 1
        mask = tree.mask().to(ctx.device)
        draw = TreeDraw(ctx, tree)
        level_logits = {0: logits}  # input index of a fed node -> its next-token logits [B, V]
        for d in range(1, tree.depth + 1):
            idx = draw.level(d, level_logits.__getitem__)  # input indices at depth d
            if d == tree.depth:
                break
            # feed this level to get the distributions after each of its nodes
            first = idx[0] - 1  # slot offset past the cache length (nodes are stored in order)
            meta = ForwardMeta(
                positions=(base - 1).view(B, 1) + d,
                tree_mask=mask[idx[0] : idx[-1] + 1, 1 : idx[-1] + 1],
                offset=first,
                advance=False,
            )
            out, _ = self.model.forward(draw.nodes[:, first : first + len(idx)], cache, meta)
            for j, i in enumerate(idx):
                level_logits[i] = out[:, j]
        return draw.proposal()

    def commit(self, state: DraftModelState, lengths: torch.Tensor) -> None:
        state.cache.rewind(torch.minimum(state.cache.lengths, lengths))

    def select_rows(self, state: DraftModelState, rows: torch.Tensor) -> None:
        state.cache.select_rows(rows)

    def add_rows(self, state: DraftModelState, new: DraftModelState) -> None:
        state.cache.add_rows(new.cache)

    def caches(self, state: DraftModelState) -> list:
        return [state.cache]
