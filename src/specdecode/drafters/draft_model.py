"""A separate small model that shares the target's vocabulary, with its own KV cache."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..core.proposal import Proposal
from ..core.tree import TokenTree
from ..errors import SpecDecodeError
from ..models.base import Cache, CausalLM, ForwardMeta, extend
from ..models.cache import BLOCK, KVCache
from .base import DraftChain, DraftContext, Drafter, TreeDraw, weights_dtype_of

CATCH_UP = 4  # a row this many tokens behind catches up through the prefill copy (_catch_up)
CAUGHT_UP = 2  # tokens a round leaves a draft model behind: its last draft and the target's token


def _seeded_standard(ctx: DraftContext) -> list[bool]:
    """Per row: seeded and sampled by the standard rule (its drafts' q decide its text)."""
    rng = ctx.rng
    if rng is None:
        return [False] * ctx.size
    temps = ctx.warp.temperature.tolist()
    return [g is not None and k is None and t > 0 for g, k, t in zip(rng.generators, rng.keys, temps)]


@dataclass
class DraftModelState:
    cache: Cache  # the draft model's cache: every committed token it has seen
    # per row: its prompt was not fed (defer()), so it drafts nothing and its cache is left
    # alone until warm() catches it up
    cold: torch.Tensor  # [B] bool, on the CPU


class DraftModelDrafter(Drafter):
    """Proposes k tokens by sampling the draft model k times (k - 1 one-token forwards after
    catching up on the tokens it has not seen)."""

    name = "draft"
    supports_tree = True

    def __init__(
        self,
        draft: CausalLM,
        target: CausalLM,
        draft_vocab=None,
        chains: bool = True,
        fallback: int | None = None,
    ) -> None:
        """draft_vocab: the draft's head over only its N most frequent tokens (an int N, or a JSON
        file of token ids in frequency order; models/draft_vocab.py), FR-Spec; None: all.
        fallback: with a draft_vocab, a row drafts with the whole head while a quarter or more of
        its last `fallback` tokens are outside the list (models/draft_vocab.py; 0: never; None:
        the default, 64).
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
        self._catch_up_s = 0.0  # seconds spent feeding tokens it had fallen behind on (take_catch_up_seconds)
        # a copy of the draft in a format that runs prompts faster (opener.py, autotune.py), or
        # None: it writes the same cache (a draft's weights change its drafts, never the output)
        self.prefill_model = getattr(draft, "prefill_model", None)
        if draft_vocab not in (None, "full"):  # "full": the whole vocabulary
            from ..models.draft_vocab import FALLBACK, ReducedHeadModel, frequent_ids

            if not draft.lean:
                raise SpecDecodeError("a draft vocabulary needs our lean runtime for the draft model")
            ids = frequent_ids(draft, draft_vocab)
            self.model = ReducedHeadModel(draft, ids, FALLBACK if fallback is None else fallback)

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
        chains, fallback = config.tree is None, config.draft_vocab_fallback
        return cls(draft, target, config.draft_vocab, chains=chains, fallback=fallback)

    keeps_prefix = True
    prefills_own = True

    def start(self, ctx: DraftContext, target_cache=None) -> DraftModelState:
        """The draft's own cache; batch-invariant when the target's is and the draft drafts chains
        (so a draft, and with it a seeded sample under the standard rule, does not depend on the
        batch either). A tree's level-by-level draft forwards, written past the cache length, run
        invariant only on the kernel's attention (kq); other formats draft trees in the plain
        cache."""
        chains_or_kernel = self.chains or getattr(self.model, "kernel_attention", False)
        invariant = getattr(target_cache, "invariant", False) and chains_or_kernel
        cold = torch.zeros(ctx.size, dtype=torch.bool)
        if invariant and self.model.lean and self.model.supports_invariant:
            return DraftModelState(self.model.new_cache(ctx.size, ctx.capacity, invariant=True), cold)
        return DraftModelState(self.model.new_cache(ctx.size, ctx.capacity), cold)

    def prefill(self, state: DraftModelState, ctx: DraftContext, lengths: torch.Tensor) -> None:
        """Feed the draft model the tokens the target has prefilled (with the target's chunks),
        through its prefill copy when it has one."""
        lengths = torch.maximum(lengths, state.cache.lengths)
        if bool((lengths > state.cache.lengths).any()):
            extend(self.prefill_model or self.model, state.cache, ctx.tokens, lengths, need_logits=False)

    def defer(self, state: DraftModelState, rows: list[int]) -> None:
        cold = state.cold.clone()
        cold[rows] = True
        state.cold = cold

    def cold_lags(self, state: DraftModelState, ctx: DraftContext) -> list[int] | None:
        if not bool(state.cold.any()):
            return None
        lag = (ctx.lengths.cpu() - 1 - state.cache.lengths.cpu()).clamp(min=0)
        state.cold = state.cold & (lag > 0)  # nothing to catch up (a one-token prompt): it drafts
        return torch.where(state.cold, lag, 0).tolist()

    @torch.inference_mode()
    def warm(
        self, state: DraftModelState, ctx: DraftContext, rows: list[int], budget: int | None = None
    ) -> int:
        """Feed cold rows up to `budget` each of the tokens they lack (all but the pending one)
        through the prefill copy: one row alone, several in one padded forward; a row drafts
        again once it has them all. Returns the tokens fed."""
        cache = state.cache
        have = cache.lengths.clone()
        goal = ctx.lengths.to(have.device) - 1
        upto = have.clone()
        for b in rows:
            upto[b] = goal[b] if budget is None else min(int(goal[b]), int(have[b]) + budget)
        model = self.prefill_model or self.model
        if len(rows) == 1 and int(upto[rows[0]]) > int(have[rows[0]]):
            self._feed_row(cache, ctx, rows[0], int(upto[rows[0]]), model)
        elif bool((upto > have).any()):
            extend(model, cache, ctx.tokens, upto, need_logits=False)
        cold = state.cold.clone()
        for b in rows:
            if int(upto[b]) >= int(goal[b]):
                cold[b] = False
        state.cold = cold
        return int((upto - have).sum())

    @staticmethod
    def _feed_row(cache: Cache, ctx: DraftContext, row: int, upto: int, model: CausalLM) -> None:
        """Bring row `row` of the draft's cache to `upto` tokens, the row alone where the cache
        can give one (its bits in any batch, with an invariant cache)."""
        lengths = cache.lengths.clone()
        lengths[row] = upto
        if hasattr(cache, "row"):
            one = cache.row(row)
            extend(model, one, ctx.tokens[row : row + 1], lengths[row : row + 1], need_logits=False)
            cache.lengths[row] = upto
        else:
            extend(model, cache, ctx.tokens, lengths, need_logits=False)

    def take_catch_up_seconds(self) -> float:
        seconds, self._catch_up_s = self._catch_up_s, 0.0
        return seconds

    def _catch_up(self, state: DraftModelState, ctx: DraftContext) -> None:
        """Rows CATCH_UP or more tokens behind (rounds in which the load-aware policy let nobody
        draft) catch up through the prefill copy, a row at a time, instead of in the step's
        format in one padded forward (measured on the pair at c = 4: 3 rows 13 tokens behind
        took 0.32 s in the int4 step format). Never a seeded row sampled by the standard rule:
        how far behind it falls depends on its batch mates, and its drafts' q must not."""
        if self.prefill_model is None:
            return
        behind = (ctx.lengths - 1 - state.cache.lengths).cpu()
        far = (behind >= CATCH_UP) & ~state.cold
        if not bool(far.any()):
            return
        standard = _seeded_standard(ctx)
        for b in torch.nonzero(far).flatten().tolist():
            if not standard[b]:
                self._feed_row(state.cache, ctx, b, int(ctx.lengths[b]) - 1, self.prefill_model)

    def save_prefix(self, state: DraftModelState, row: int, start: int):
        cache = state.cache
        if not isinstance(cache, KVCache) or int(cache.lengths[row]) < start + BLOCK:
            return None
        return cache.read_block(row, start, BLOCK)

    def load_prefix(self, state: DraftModelState, row: int, start: int, saved) -> None:
        state.cache.write_block(row, start, *saved)
        state.cache.lengths[row] = start + BLOCK

    def _choose_heads(self, ctx: DraftContext) -> None:
        """With a draft vocabulary: which rows draft with the whole head this round (from each
        row's own tokens; models/draft_vocab.py)."""
        choose = getattr(self.model, "choose_heads", None)
        if choose is not None:
            choose(ctx.tokens, ctx.lengths)

    def _heads_done(self) -> None:
        if hasattr(self.model, "choose_heads"):
            self.model.whole_rows = None

    @torch.inference_mode()
    def propose(
        self, state: DraftModelState, ctx: DraftContext, limits: torch.Tensor, stop_below: float | None = None
    ) -> Proposal:
        self._choose_heads(ctx)
        try:
            return self._propose(state, ctx, limits, stop_below)
        finally:
            self._heads_done()

    def _propose(
        self, state: DraftModelState, ctx: DraftContext, limits: torch.Tensor, stop_below: float | None
    ) -> Proposal:
        t0 = time.perf_counter()
        lag = (ctx.lengths.cpu() - state.cache.lengths.cpu()).masked_fill(state.cold, 0)
        behind = int(lag.max()) if lag.numel() else 0  # warm rows' tokens to feed, _catch_up's included
        self._catch_up(state, ctx)
        if bool(state.cold.any()):
            self.cold_lags(state, ctx)  # settles rows with nothing to catch up
        cache, cold = state.cache, state.cold
        held = cache.lengths.clone()  # a cold row keeps what it has (it drafts nothing)
        any_cold = bool(cold.any())
        lengths = torch.where(cold.to(held.device), held, ctx.lengths) if any_cold else ctx.lengths
        logits, _ = extend(self.model, cache, ctx.tokens, lengths)  # [B, V]
        if behind > CAUGHT_UP:  # fed more than a round leaves it behind: a catch-up, timed
            self._catch_up_s += time.perf_counter() - t0
        chain = DraftChain(ctx, limits, stop_below)
        # a greedy chain over a draft vocabulary: each step's logits over the list only
        step = getattr(self.model, "step", None) if chain.greedy else None
        for i in range(chain.width):
            tok, stopped = chain.draw(logits)
            if stopped or i == chain.width - 1:
                break
            fed = tok.view(-1, 1)
            logits = step(fed, cache) if step else self.model.forward(fed, cache)[0][:, -1]
        if any_cold:
            self._keep_cold(state, held)
        return chain.proposal()

    @staticmethod
    def _keep_cold(state: DraftModelState, held: torch.Tensor) -> None:
        """Cold rows back to the tokens they held before the chain: what the chain's forwards
        wrote after them is not theirs (their next tokens come from warm())."""
        cache = state.cache
        cache.rewind(torch.where(state.cold.to(held.device), held, cache.lengths))

    @torch.inference_mode()
    def propose_tree(self, state: DraftModelState, ctx: DraftContext, tree: TokenTree):
        """Candidates level by level (TreeDraw: top-ranked, or drawn from the draft's q after
        their parent), one draft forward per level with the tree's attention mask."""
        self._choose_heads(ctx)
        try:
            return self._propose_tree(state, ctx, tree)
        finally:
            self._heads_done()

    def _propose_tree(self, state: DraftModelState, ctx: DraftContext, tree: TokenTree):
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
                positions=((base - 1).view(B, 1) + d).expand(B, len(idx)),  # every node of the level
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
        state.cold = state.cold[rows.cpu()]

    def add_rows(self, state: DraftModelState, new: DraftModelState) -> None:
        state.cache.add_rows(new.cache)
        state.cold = torch.cat([state.cold, new.cold])

    def caches(self, state: DraftModelState) -> list:
        return [state.cache]
