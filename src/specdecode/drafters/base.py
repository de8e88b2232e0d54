"""The drafter interface: propose k tokens with their draft probs, then keep what was accepted."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..engine import Batch


class Drafter(Protocol):
    def start(self, batch: Batch) -> None:
        """A new batch begins: set up per-row state (caches) for batch.tokens / batch.lengths."""

    def propose(self, batch: Batch, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [B, k] and the draft probs they were drawn from [B, k, V]
        (None when drafting is deterministic: the tokens are treated as one-hot)."""
        ...

    def commit(self, lengths: torch.Tensor) -> None:
        """The first lengths[b] tokens of row b are now final; forget anything after them."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows (others finished)."""
