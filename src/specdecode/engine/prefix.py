"""Automatic prefix caching: the target's keys and values of earlier requests, kept in blocks of
BLOCK (16) tokens and reused when a new request starts with the same tokens.

Blocks are found by hashing, as vLLM's automatic prefix caching does: block i of a token
sequence is keyed by (key of block i - 1, its 64 tokens), so a key names the whole prefix up to
the block's end, and a lookup walks the new prompt block by block from the start until a key is
missing. We chose hashing over SGLang's radix tree because a block of our caches is one slice
copy (the batch-invariant cache stores values in 64-token chunks; a 16-token block is a quarter
of one), and a dict of blocks with an LRU order is all the bookkeeping it needs; a radix tree
pays off for token-granular sharing, which 16-token blocks (vLLM's default size) nearly give.

Exact by construction: a block matches only when its tokens and its whole prefix are equal
(the tokens are compared, not just the hash), and the batch-invariant forward computes a
token's keys and values independently of how many tokens or rows shared the forward, so a
block computed for another request, in a prefill chunk or a verification round, holds the
same bits a fresh prefill would write. Without the batch-invariant forward (--no-batch-invariant)
that does not hold, and the engine turns the cache off.

A block may carry the drafter's own state for its tokens (an EAGLE drafter's features, a draft
model's keys and values: Drafter.save_prefix); a drafter that keeps such state reuses a
prefix only as far as its blocks carry it (the target then prefills the rest, and the drafter
with it). Memory: a byte budget over every block; the least recently used blocks go first.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models.cache import BLOCK


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    return 0


@dataclass
class Block:
    """One cached block: its tokens, the key of the block before it, the target's keys and
    values [layers, kv_heads, BLOCK, head_dim] each, and the drafter's state (None: none kept)."""

    parent: int | None
    tokens: tuple[int, ...]
    k: torch.Tensor
    v: torch.Tensor
    drafter: Any = None
    nbytes: int = 0


@dataclass
class PrefixStats:
    queried: int = 0  # prompt tokens looked up
    hit: int = 0  # of those, tokens found in the cache
    evicted: int = 0  # blocks dropped for room
    inserted: int = 0  # blocks stored
    extra: dict = field(default_factory=dict)


class PrefixCache:
    """Blocks of the target's keys and values by prefix, within `budget_bytes` (LRU)."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("the prefix cache budget must be >= 0 bytes")
        self.budget = int(budget_bytes)
        self.blocks: collections.OrderedDict[int, Block] = collections.OrderedDict()  # LRU first
        self.bytes = 0
        self.stats = PrefixStats()

    @staticmethod
    def key(parent: int | None, tokens: Sequence[int]) -> int:
        return hash((parent, tuple(tokens)))

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, tokens: Sequence[int], limit: int, drafter_state: bool = False) -> list[Block]:
        """The stored blocks that begin `tokens`, in order, covering at most `limit` tokens;
        with drafter_state, only as far as the blocks carry the drafter's state. Marks them
        recently used."""
        out: list[Block] = []
        parent = None
        for start in range(0, limit - BLOCK + 1, BLOCK):
            chunk = tuple(tokens[start : start + BLOCK])
            key = self.key(parent, chunk)
            block = self.blocks.get(key)
            if block is None or block.tokens != chunk or block.parent != parent:
                break
            if drafter_state and block.drafter is None:
                break
            out.append(block)
            self.blocks.move_to_end(key)
            parent = key
        self.stats.queried += max(0, limit)
        self.stats.hit += len(out) * BLOCK
        return out

    def insert(
        self,
        tokens: Sequence[int],
        count: int,
        read: Callable[[int], tuple[torch.Tensor, torch.Tensor]],  # start -> (k, v) of BLOCK tokens
        drafter: Callable[[int], Any] | None = None,
    ) -> None:
        """Store the whole blocks among the first `count` tokens: read(start) gives the target's
        (k, v) of the block at `start`, drafter(start) the drafter's state for it (or None).
        Blocks already stored are marked used (and given the drafter's state if they lacked it)."""
        if self.budget == 0:
            return
        parent = None
        for start in range(0, count - BLOCK + 1, BLOCK):
            chunk = tuple(tokens[start : start + BLOCK])
            key = self.key(parent, chunk)
            block = self.blocks.get(key)
            if block is not None and block.tokens == chunk and block.parent == parent:
                self.blocks.move_to_end(key)
                if block.drafter is None and drafter is not None:
                    state = drafter(start)
                    if state is not None:
                        block.drafter = state
                        self._grow(block, _nbytes(state))
            else:
                if block is not None:  # a hash collision: the newer prefix takes the slot
                    self._drop(key)
                k, v = read(start)
                state = drafter(start) if drafter is not None else None
                block = Block(parent, chunk, k, v, state)
                size = _nbytes((k, v, state))
                if size > self.budget:
                    return
                block.nbytes = size
                self.blocks[key] = block
                self.bytes += size
                self.stats.inserted += 1
                self._evict()
                if key not in self.blocks:  # evicted at once: nothing after it can match
                    return
            parent = key

    def _grow(self, block: Block, extra: int) -> None:
        block.nbytes += extra
        self.bytes += extra
        self._evict()

    def _drop(self, key: int) -> None:
        block = self.blocks.pop(key)
        self.bytes -= block.nbytes

    def _evict(self) -> None:
        while self.bytes > self.budget and self.blocks:
            self._drop(next(iter(self.blocks)))
            self.stats.evicted += 1

    def clear(self) -> None:
        self.blocks.clear()
        self.bytes = 0
