"""SuffixDecoding-style drafting: no model. The drafts continue the longest suffix of the context
that also occurs in the row's own context or in earlier requests (their prompts and outputs,
kept in a per-process cache with a size bound), choosing the draft length from how often the
continuations agree.

At each round the context's last tokens are matched against every earlier occurrence of its
final `MIN_MATCH`-gram (an n-gram index over the cache, plus a scan of the row's context), each
extended backwards to its full match length. The occurrences with the longest match are the
node of a suffix tree; the draft walks down its most frequent branch: token t is the commonest
continuation among the occurrences that agree so far, with estimated probability count / total,
and drafting stops when the product of those probabilities falls below `min_prob` or the draft
reaches `factor` x the match length (SuffixDecoding's adaptive speculation length, Oliaro et
al. 2024). The proposal is a deterministic function of the context and the cache, which this
row's future random draws never touch, so verification with one-hot draft probabilities is
exact (as for prompt lookup).

The cache of earlier requests belongs to the drafter, hence to the generator that holds it: a
server (one generator) drafts from every earlier request it served; a fresh generator starts
empty. Generators that should learn from each other are given one cache on purpose
(SpecConfig.suffix_cache); `SpeculativeGenerator.forget()` empties a generator's.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from ..core.proposal import Proposal
from .base import DraftContext, Drafter

MIN_MATCH = 3  # the n-gram that indexes occurrences
MAX_MATCH = 32  # longest suffix compared
MAX_OCCURRENCES = 256  # the most recent occurrences of an n-gram considered


class SuffixCache:
    """Earlier requests' token sequences, indexed by n-gram; holds at most `max_tokens` tokens
    (the oldest sequences are dropped first)."""

    def __init__(self, max_tokens: int = 1_000_000) -> None:
        self.max_tokens = max_tokens
        self.seqs: OrderedDict[int, np.ndarray] = OrderedDict()
        self.index: dict[tuple, list[tuple[int, int]]] = {}
        self.tokens = 0
        self._next = 0

    def add(self, seq: np.ndarray) -> None:
        seq = np.asarray(seq, dtype=np.int64)
        if len(seq) <= MIN_MATCH:
            return
        if len(seq) > self.max_tokens:
            seq = seq[-self.max_tokens :]
        sid, self._next = self._next, self._next + 1
        self.seqs[sid] = seq
        self.tokens += len(seq)
        for end in range(MIN_MATCH, len(seq)):  # occurrences with at least one token after them
            self.index.setdefault(tuple(seq[end - MIN_MATCH : end].tolist()), []).append((sid, end))
        while self.tokens > self.max_tokens and len(self.seqs) > 1:
            _, old = self.seqs.popitem(last=False)
            self.tokens -= len(old)
        if sum(len(v) for v in self.index.values()) > 2 * self.tokens + 1024:  # drop stale entries
            self.index = {k: [o for o in v if o[0] in self.seqs] for k, v in self.index.items()}
            self.index = {k: v for k, v in self.index.items() if v}

    def occurrences(self, key: tuple) -> list[tuple[np.ndarray, int]]:
        found = self.index.get(key, [])[-MAX_OCCURRENCES:]
        return [(self.seqs[sid], end) for sid, end in found if sid in self.seqs]

    def clear(self) -> None:
        self.__init__(self.max_tokens)


def _match_length(seq: np.ndarray, end: int, context: np.ndarray) -> int:
    """How many tokens before seq[end] equal the context's last tokens (at most MAX_MATCH)."""
    n = min(MAX_MATCH, end, len(context))
    a, b = seq[end - n : end][::-1], context[len(context) - n :][::-1]
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else n


def suffix_draft(
    context: np.ndarray, cache: SuffixCache | None, limit: int, factor: float, min_prob: float
) -> tuple[np.ndarray, int]:
    """(draft tokens, match length) for a row's context [L]."""
    L = len(context)
    if L <= MIN_MATCH or limit <= 0:
        return context[:0], 0
    key = context[L - MIN_MATCH :]
    occ: list[tuple[np.ndarray, int]] = []
    windows = np.lib.stride_tricks.sliding_window_view(context[: L - 1], MIN_MATCH)  # in its own context
    for start in np.flatnonzero((windows == key).all(axis=1))[-MAX_OCCURRENCES:]:
        occ.append((context, int(start) + MIN_MATCH))
    if cache is not None:
        occ += cache.occurrences(tuple(key.tolist()))
    if not occ:
        return context[:0], 0
    lengths = [_match_length(seq, end, context) for seq, end in occ]
    best = max(lengths)
    n = min(limit, max(1, int(factor * best)))
    conts = [seq[end : end + n] for (seq, end), m in zip(occ, lengths) if m == best]
    draft: list[int] = []
    score = 1.0
    for t in range(n):
        counts = Counter(int(c[t]) for c in conts if len(c) > t)
        if not counts:
            break
        tok, c = counts.most_common(1)[0]
        score *= c / sum(counts.values())
        if score < min_prob:
            break
        draft.append(tok)
        conts = [c for c in conts if len(c) > t and c[t] == tok]
    return np.asarray(draft, dtype=np.int64), best


@dataclass
class SuffixState:
    tokens: torch.Tensor | None = None  # the batch's tokens as last seen (for the cache at retirement)
    lengths: list[int] = field(default_factory=list)
    match: list[int] = field(default_factory=list)  # each row's last match length


class SuffixDrafter(Drafter):
    """Drafts up to max(limits[b], max_tokens) tokens per row from the suffix match (only
    limits[b] when a policy caps the row below the configured k, e.g. the server's load-aware
    cap); a row without a match drafts nothing that round. Each finished row's prompt and output join the
    drafter's cache, so later requests can draft from them."""

    name = "suffix"

    def __init__(
        self,
        cache: SuffixCache | None,
        max_tokens: int = 16,
        factor: float = 1.0,
        min_prob: float = 0.1,
        k: int = 1,
    ) -> None:
        self.cache, self.max_tokens, self.factor, self.min_prob = cache, max_tokens, factor, min_prob
        self.k = k

    @classmethod
    def create(cls, target, draft, config) -> SuffixDrafter:
        cache = config.suffix_cache if config.suffix_cache is not None else SuffixCache()
        return cls(cache, config.suffix_max, k=config.k)

    def forget(self) -> None:
        if self.cache is not None:
            self.cache.clear()

    def start(self, ctx: DraftContext, target_cache) -> SuffixState:
        return SuffixState(ctx.tokens, ctx.lengths.tolist(), [0] * ctx.size)

    def drafts(self, state: SuffixState, ctx: DraftContext, limits: list[int]) -> list[np.ndarray]:
        tokens = ctx.tokens.cpu().numpy()
        state.tokens, state.lengths = ctx.tokens, ctx.lengths.tolist()
        out = []
        for b in range(ctx.size):
            limit = max(limits[b], self.max_tokens) if limits[b] >= self.k else limits[b]
            d, m = suffix_draft(tokens[b, : state.lengths[b]], self.cache, limit, self.factor, self.min_prob)
            state.match[b] = m
            out.append(d)
        return out

    def propose(
        self, state: SuffixState, ctx: DraftContext, limits: torch.Tensor, stop_below=None
    ) -> Proposal:
        found = self.drafts(state, ctx, limits.tolist())
        return one_hot_proposal(found, ctx)

    def commit(self, state: SuffixState, lengths: torch.Tensor) -> None:
        state.lengths = (lengths + 1).tolist()  # + the token the target adds this round

    def select_rows(self, state: SuffixState, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        if self.cache is not None and state.tokens is not None:
            gone = set(range(len(state.lengths))) - set(keep)
            cap = state.tokens.shape[1]
            for b in sorted(gone):
                self.cache.add(state.tokens[b, : min(state.lengths[b], cap)].cpu().numpy())
        state.tokens = None if state.tokens is None else state.tokens[rows]
        state.lengths = [state.lengths[i] for i in keep]
        state.match = [state.match[i] for i in keep]

    def add_rows(self, state: SuffixState, new: SuffixState) -> None:
        state.tokens = None  # refreshed at the next propose
        state.lengths += new.lengths
        state.match += new.match


def one_hot_proposal(found: list[np.ndarray], ctx: DraftContext) -> Proposal:
    """Rows' deterministic drafts as a Proposal (draft probs one-hot: left None, which the
    verifier reads as a deterministic draft)."""
    width = max((len(f) for f in found), default=0)
    out = torch.zeros(ctx.size, width, dtype=torch.long)
    for b, f in enumerate(found):
        out[b, : len(f)] = torch.from_numpy(np.ascontiguousarray(f))
    drafted = torch.tensor([len(f) for f in found], dtype=torch.long)
    return Proposal(out.to(ctx.device), None, drafted.to(ctx.device))
