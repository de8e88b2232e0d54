"""What every model looks like to the engine: forward(tokens, cache, meta) -> (logits, hidden),
with a cache that the model appends to and the engine rewinds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from .tokenizer import TextTokenizer


@dataclass(frozen=True)
class ForwardMeta:
    """What one forward does besides appending tokens [B, T] at each row's cache length.

    positions: [B, T] RoPE positions (default: the cache slots the tokens are written to).
    tree_mask: [T, offset + T] bool, which of the slots past each row's length a new token may
        attend to (every slot below the length is always visible); token trees.
    offset: write `offset` slots past each row's length (drafts not counted in the length).
    advance: move each row's length past the new tokens (False: leave lengths alone).
    num_layers: run only the first m layers, then the final norm and LM head (an early exit);
        never advances the lengths.
    return_hidden: also return the final-normed hidden states [B, T, hidden].
    inputs_embeds: [B, T, hidden] replaces the token embeddings (EAGLE feeds fused features).
    logits_at: [B] one position per row: the forward may return logits [B, 1, V] of just those
        (a prefill needs the last one only; the LM head over a long prompt is wasted work).
    need_logits: False: the forward may return None for the logits (a prefill whose logits
        nobody reads). Runtimes that ignore these two return all logits.
    aux_layers: with return_hidden, return instead the residual stream entering each of these
        layers, concatenated: [B, T, len(aux_layers) * hidden] (EAGLE-3's low, middle and high
        features; vLLM's convention for `eagle_aux_hidden_state_layer_ids`). Layer index
        num_layers is the last layer's output, before the final norm.
    Only our lean runtime takes the tree, offset, early-exit, embedding and aux-layer fields.
    """

    positions: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    offset: int = 0
    advance: bool = True
    num_layers: int | None = None
    return_hidden: bool = False
    inputs_embeds: torch.Tensor | None = None
    logits_at: torch.Tensor | None = None
    need_logits: bool = True
    aux_layers: tuple[int, ...] | None = None


PLAIN = ForwardMeta()
WITH_HIDDEN = ForwardMeta(return_hidden=True)


class Cache(Protocol):
    lengths: torch.Tensor  # [B] tokens held per row
    capacity: int

    def rewind(self, lengths: torch.Tensor) -> None: ...

    def select_rows(self, rows: torch.Tensor) -> None: ...

    def add_rows(self, other: Cache) -> None: ...

    def reserve_for(self, other: Cache) -> None:
        """An admission of other's rows has started: prepare storage for add_rows(other)."""

    def tick(self) -> None:
        """Called once per round: a slice of the preparation reserve_for() started."""


class CausalLM(Protocol):
    name: str
    path: Path
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    tokenizer: TextTokenizer | None
    eos_token_ids: tuple[int, ...]
    max_positions: int | None
    # capabilities, asked by the engine and the drafters (never an isinstance check):
    lean: bool  # our runtime: trees, offsets, early exit, fused inputs, aux layers (ForwardMeta)
    supports_invariant: bool  # a batch-invariant forward (new_cache(..., invariant=True))
    hybrid: bool  # linear-attention layers (new_cache(..., rollback=...))

    def new_cache(self, batch_size: int, capacity: int) -> Cache: ...

    def forward(
        self, tokens: torch.Tensor, cache: Cache, meta: ForwardMeta = PLAIN
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [B, T] appended at each row's cache length -> (logits [B, T, V], hidden
        [B, T, d] when meta.return_hidden else None)."""
        ...

    def num_parameters(self) -> int: ...


def logits_of(model: CausalLM, tokens: torch.Tensor, cache: Cache) -> torch.Tensor:
    """Just the logits [B, T, V] of a plain forward (appends to the cache)."""
    return model.forward(tokens, cache)[0]


def extend(
    model: CausalLM,
    cache: Cache,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    return_hidden: bool = False,
    need_logits: bool = True,
    aux_layers: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Bring each row's cache up to lengths[b] tokens of tokens [B, N]; return the logits [B, V]
    that follow each row's last token (None with need_logits=False) and, with return_hidden, the
    final hidden states of every token fed ([B, n, hidden], row b valid for its first
    lengths[b] - start[b] entries; else None).

    Rows may be ragged: the uncached suffixes are fed right-padded in one forward, then the
    cache is rewound to the true lengths (the padding is never attended to again). A row
    with nothing to feed returns meaningless logits.
    """
    call = extend_call(cache, tokens, lengths, return_hidden, need_logits, aux_layers)
    if call is None:
        return _extend_in_chunks(model, cache, tokens, lengths, return_hidden, need_logits, aux_layers)
    feed, meta, finish = call
    return finish(*model.forward(feed, cache, meta))


def extend_call(
    cache: Cache,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    return_hidden: bool = False,
    need_logits: bool = True,
    aux_layers: tuple[int, ...] | None = None,
):
    """extend() as one forward to make: (the tokens to feed, its ForwardMeta, finish), where
    finish(logits, hidden) of that forward rewinds the cache to `lengths` and returns what
    extend() returns; None when one forward would write past the cache's end (extend() feeds
    such rows in chunks). A forward that carries riders (LlamaModel.ride) makes it there."""
    start = cache.lengths.clone()
    todo = lengths - start  # [B]
    n = int(todo.max())
    if n <= 0:
        raise ValueError("extend: nothing to feed")
    B = tokens.shape[0]
    capacity = getattr(cache, "capacity", None)
    if capacity is not None and int(start.max()) + n > capacity:
        return None
    idx = (start.view(B, 1) + torch.arange(n, device=tokens.device).view(1, n)).clamp(max=tokens.shape[1] - 1)
    last = (todo - 1).clamp(min=0)
    meta = ForwardMeta(
        return_hidden=return_hidden, logits_at=last, need_logits=need_logits, aux_layers=aux_layers
    )

    def finish(logits, hidden):  # logits [B, n or 1, V], hidden [B, n, hidden]
        cache.rewind(lengths)
        if not need_logits or logits is None:
            return None, hidden
        if logits.shape[1] == 1:  # the runtime computed just the asked positions
            return logits[:, 0], hidden
        at_last = logits.gather(1, last.view(B, 1, 1).expand(B, 1, logits.shape[-1])).squeeze(1)
        return at_last, hidden  # hidden[b, i]: the final hidden state of token start[b] + i

    return tokens.gather(1, idx), meta, finish


def chunk_steps(cache: Cache, todo: torch.Tensor, at_least_once: bool = False):
    """Plan the feeding of todo[b] more positions per row in chunks of at most the smallest room
    any row has left in the cache, so that a row far behind (admitted mid-run, or after rounds
    without drafting) never pushes a row near its capacity past the end. Yields (done [B]: each
    row's length before the chunk, fed [B]: how many of its positions the chunk holds, M: the
    chunk's width); the caller feeds positions done .. done + M - 1 and leaves each row's cache
    at done + fed. Used by extend() and by the drafters' catch-up (drafters/base.catch_up)."""
    left = todo.clone()
    once = at_least_once
    while once or int(left.max()) > 0:
        once = False
        done = cache.lengths.clone()
        M = max(1, min(int(left.max()), int((cache.capacity - done).min())))
        fed = left.clamp(min=0, max=M)
        yield done, fed, M
        left = left - fed


def _extend_in_chunks(model, cache, tokens, lengths, return_hidden, need_logits, aux_layers):
    """extend() when one forward would write a short row's padding past the cache's end (a
    row far behind beside a row near its capacity, e.g. one admitted mid-run): feed chunks
    (chunk_steps) and stitch the results together."""
    B = tokens.shape[0]
    start = cache.lengths.clone()
    logits_out, parts = None, []
    for at, fed, _ in chunk_steps(cache, lengths - start):
        logits, hidden = extend(model, cache, tokens, at + fed, return_hidden, need_logits, aux_layers)
        if logits is not None:
            if logits_out is None:
                logits_out = logits
            else:
                logits_out = torch.where((fed > 0).view(B, 1), logits, logits_out)
        if hidden is not None:
            parts.append((at - start, fed, hidden))
    if not parts:
        return logits_out, None
    width = int((lengths - start).max())
    out = parts[0][2].new_zeros(B, width, parts[0][2].shape[-1])
    for offset, fed, hidden in parts:
        for b in range(B):
            o, f = int(offset[b]), int(fed[b])
            out[b, o : o + f] = hidden[b, :f]
    return logits_out, out
