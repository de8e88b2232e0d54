"""What every model looks like to the engine: forward(tokens, cache) -> logits, with a cache
that the model appends to and the engine rewinds."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from .tokenizer import TextTokenizer


class Cache(Protocol):
    lengths: torch.Tensor  # [B] tokens held per row

    def rewind(self, lengths: torch.Tensor) -> None: ...

    def select_rows(self, rows: torch.Tensor) -> None: ...


class CausalLM(Protocol):
    name: str
    path: Path
    vocab_size: int
    dtype: torch.dtype
    tokenizer: TextTokenizer | None
    eos_token_ids: tuple[int, ...]

    def new_cache(self, batch_size: int, capacity: int) -> Cache: ...

    def forward(self, tokens: torch.Tensor, cache: Cache) -> torch.Tensor:
        """tokens [B, T] appended at each row's cache length -> logits [B, T, V]."""
        ...

    def num_parameters(self) -> int: ...


def extend(
    model: CausalLM, cache: Cache, tokens: torch.Tensor, lengths: torch.Tensor, return_hidden: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Bring each row's cache up to lengths[b] tokens of tokens [B, N]; return the logits [B, V]
    that follow each row's last token (and, with return_hidden, the final hidden states of every
    token fed, [B, n, hidden], row b valid for its first lengths[b] - start[b] entries).

    Rows may be ragged: the uncached suffixes are fed right-padded in one forward, then the
    cache is rewound to the true lengths (the padding is never attended to again). A row
    with nothing to feed returns meaningless logits.
    """
    start = cache.lengths.clone()
    todo = lengths - start  # [B]
    n = int(todo.max())
    if n <= 0:
        raise ValueError("extend: nothing to feed")
    B = tokens.shape[0]
    idx = (start.view(B, 1) + torch.arange(n).view(1, n)).clamp(max=tokens.shape[1] - 1)
    out = model.forward(tokens.gather(1, idx), cache, **({"return_hidden": True} if return_hidden else {}))
    logits, hidden = out if return_hidden else (out, None)  # [B, n, V], [B, n, hidden]
    cache.rewind(lengths)
    last = (todo - 1).clamp(min=0).view(B, 1, 1)
    at_last = logits.gather(1, last.expand(B, 1, logits.shape[-1])).squeeze(1)
    if not return_hidden:
        return at_last
    return at_last, hidden  # hidden[b, i]: the final hidden state of token start[b] + i
