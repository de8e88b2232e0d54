"""Self-speculation (LayerSkip-style early exit): the target's first m layers, then its own
final norm and LM head, draft the next tokens. The draft needs no second KV cache: it writes
layers 0..m-1 of the target's cache just past each row's length, and the target's verification
forward over the same tokens overwrites those entries with identical values."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import SpecDecodeError
from ..models.llama import LlamaModel
from .base import DraftChain, Proposal

if TYPE_CHECKING:
    from ..engine import Batch


class EarlyExitDrafter:
    def __init__(self, target, exit_layer: int | None = None) -> None:
        if not isinstance(target, LlamaModel):
            raise SpecDecodeError(
                "method early-exit needs a Llama checkpoint on our lean runtime (use --backend lean)"
            )
        L = target.cfg.num_layers
        m = exit_layer if exit_layer is not None else max(1, L // 2)
        if not 1 <= m < L:
            raise SpecDecodeError(f"exit layer must be in 1..{L - 1} for a {L}-layer target, got {m}")
        self.target, self.exit_layer = target, m
        self.model = None  # no separate draft model
        self.cache = None

    def start(self, batch: Batch, target_cache) -> None:
        self.cache = target_cache

    @torch.inference_mode()
    def propose(self, batch: Batch, k: int, stop_below: float | None = None) -> Proposal:
        B = batch.size
        tok = batch.tokens.gather(1, (batch.lengths - 1).view(B, 1))  # the pending token
        chain = DraftChain(batch, stop_below)
        for i in range(k):
            logits = self.target.forward(tok, self.cache, num_layers=self.exit_layer, offset=i)[:, -1]
            nxt, stopped = chain.draw(logits)
            if stopped:
                break
            tok = nxt.view(B, 1)
        return chain.proposal()

    def commit(self, lengths: torch.Tensor) -> None:
        pass  # the target cache is rewound by the engine

    def select_rows(self, rows: torch.Tensor) -> None:
        pass  # the same cache object, already selected by the engine
