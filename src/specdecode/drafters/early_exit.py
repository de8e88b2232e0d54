"""Self-speculation (LayerSkip-style early exit): the target's first m layers, then its own
final norm and LM head, draft the next tokens. The draft needs no second KV cache: it writes
layers 0..m-1 of the target's cache just past each row's length, and the target's verification
forward over the same tokens overwrites those entries with identical values."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from ..core.proposal import Proposal
from ..errors import SpecDecodeError
from ..models.base import Cache, ForwardMeta
from .base import DraftChain, DraftContext, Drafter, require_lean


class UntrainedExitWarning(UserWarning):
    """Early exit from a layer the model was not trained to draft from."""


def exit_layer_trained(target, m: int) -> bool:
    """Whether the target's training.json (written by `specdecode train --early-exit-layer`)
    says layer m was trained to predict the next token."""
    meta = Path(getattr(target, "path", "")) / "training.json"
    if not meta.is_file():
        return False
    try:
        data = json.loads(meta.read_text())
    except json.JSONDecodeError:
        return False
    return (data.get("config") or {}).get("early_exit_layer", data.get("early_exit_layer")) == m


class EarlyExitDrafter(Drafter):
    name = "early-exit"
    lean_only = True

    def __init__(self, target, exit_layer: int | None = None) -> None:
        require_lean(target, self.name)
        L = target.cfg.num_layers
        m = exit_layer if exit_layer is not None else max(1, L // 2)
        if not 1 <= m < L:
            raise SpecDecodeError(f"exit layer must be in 1..{L - 1} for a {L}-layer target, got {m}")
        self.target, self.exit_layer = target, m
        self.trained = exit_layer_trained(target, m)
        if not self.trained:
            self.advice = (
                f"early exit at layer {m} of {L}: {target.name or target.path} was not trained to draft from "
                "that layer (no training.json marks it), so its drafts are rarely accepted and this runs "
                "slower than target-only; use --policy optimal (it stops drafting where drafting does not "
                "pay) or another method (ngram, draft)"
            )
            warnings.warn(self.advice, UntrainedExitWarning, stacklevel=3)

    @classmethod
    def create(cls, target, draft, config) -> EarlyExitDrafter:
        return cls(target, config.exit_layer)

    def start(self, ctx: DraftContext, target_cache: Cache) -> Cache:
        return target_cache  # the state is the target's own cache (rows selected and added by the engine)

    @torch.inference_mode()
    def propose(
        self, state: Cache, ctx: DraftContext, limits: torch.Tensor, stop_below: float | None = None
    ) -> Proposal:
        B = ctx.size
        tok = ctx.tokens.gather(1, (ctx.lengths - 1).view(B, 1))  # the pending token
        chain = DraftChain(ctx, limits, stop_below)
        for i in range(chain.width):
            meta = ForwardMeta(num_layers=self.exit_layer, offset=i)
            logits = self.target.forward(tok, state, meta)[0][:, -1]
            nxt, stopped = chain.draw(logits)
            if stopped:
                break
            tok = nxt.view(B, 1)
        return chain.proposal()
