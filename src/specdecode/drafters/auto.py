"""auto: per round and per row, suffix decoding's drafts where the context's suffix match is long,
the model drafter's (a draft model, or trained EAGLE-3 heads) elsewhere; each row's drafts come
from one drafter with that drafter's probabilities, so verification stays exact."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.proposal import Proposal
from ..errors import SpecDecodeError
from .base import NOTHING, DraftContext, Drafter, TargetNeeds
from .suffix import SuffixDrafter, one_hot_proposal


@dataclass
class AutoState:
    """A run's suffix state, its model drafter's state (None without one), and per row whether
    the last proposal was the suffix match's."""

    suffix: Any
    model: Any
    from_suffix: list[bool] = field(default_factory=list)


class AutoDrafter(Drafter):
    """Per round and per row: the suffix match's drafts when the match is long (at least
    `long_match` tokens, with at least two tokens to draft), the model drafter's otherwise: a
    draft model when one is given (--draft), else trained EAGLE-3 heads (--heads). Without
    either it is the suffix method alone. Exact either way: each row's drafts come from one
    drafter, with that drafter's draft probabilities."""

    name = "auto"
    requires_hidden = True

    def __init__(self, suffix: SuffixDrafter, model_drafter: Drafter | None, long_match: int = 6) -> None:
        self.suffix, self.inner, self.long_match = suffix, model_drafter, long_match
        self.requires_hidden = model_drafter is not None and model_drafter.requires_hidden
        if model_drafter is None:
            self.advice = (
                "no draft model and no trained EAGLE-3 drafter for this target: auto drafts from "
                "suffix matches only"
            )

    @classmethod
    def create(cls, target, draft, config) -> AutoDrafter:
        from .draft_model import DraftModelDrafter
        from .eagle3 import Eagle3Drafter

        if draft is not None and config.heads is not None:
            raise SpecDecodeError("auto drafts with a draft model or with EAGLE-3 heads, not both; drop one")
        if draft is not None:
            inner: Drafter | None = DraftModelDrafter(
                draft, target, config.draft_vocab, fallback=config.draft_vocab_fallback
            )
        else:
            inner = Eagle3Drafter(target, config.heads) if config.heads is not None else None
        return cls(SuffixDrafter.create(target, None, config), inner)

    def forget(self) -> None:
        self.suffix.forget()

    def take_catch_up_seconds(self) -> float:
        return self.inner.take_catch_up_seconds() if self.inner is not None else 0.0

    def target_needs(self) -> TargetNeeds:
        return self.inner.target_needs() if self.inner is not None else NOTHING

    @property
    def weights_dtype(self) -> str | None:
        return self.inner.weights_dtype if self.inner is not None else None

    def quantize(self, kind: str) -> None:
        if self.inner is None:
            super().quantize(kind)
        self.inner.quantize(kind)

    def start(self, ctx, target_cache):
        inner = self.inner.start(ctx, target_cache) if self.inner is not None else None
        return AutoState(self.suffix.start(ctx, target_cache), inner)

    @property
    def keeps_prefix(self) -> bool:  # type: ignore[override]
        return self.inner is not None and self.inner.keeps_prefix

    @property
    def prefills_own(self) -> bool:  # type: ignore[override]
        return self.inner is not None and self.inner.prefills_own

    def prefill(self, state, ctx, lengths) -> None:
        if self.inner is not None:
            self.inner.prefill(state.model, ctx, lengths)

    def defer(self, state, rows: list[int]) -> None:
        if self.inner is not None:
            self.inner.defer(state.model, rows)

    def cold_lags(self, state, ctx):
        return self.inner.cold_lags(state.model, ctx) if self.inner is not None else None

    def warm(self, state, ctx, rows: list[int], budget: int | None = None) -> int:
        return self.inner.warm(state.model, ctx, rows, budget) if self.inner is not None else 0

    def save_prefix(self, state, row: int, start: int):
        return self.inner.save_prefix(state.model, row, start) if self.inner is not None else None

    def load_prefix(self, state, row: int, start: int, saved) -> None:
        if self.inner is not None:
            self.inner.load_prefix(state.model, row, start, saved)

    def observe(self, state, hidden, start, count) -> None:
        if self.inner is not None:
            self.inner.observe(state.model, hidden, start, count)

    def prefilled_rows(self, state) -> list[bool] | None:
        return [not s for s in state.from_suffix]

    def propose(self, state, ctx: DraftContext, limits: torch.Tensor, stop_below=None) -> Proposal:
        ks = limits.tolist()
        found = self.suffix.drafts(state.suffix, ctx, ks)
        use_suffix = [len(f) >= 2 and m >= self.long_match for f, m in zip(found, state.suffix.match)]
        state.from_suffix = use_suffix if self.inner is not None else [True] * len(use_suffix)
        if self.inner is None:
            return one_hot_proposal(found, ctx)
        if all(use_suffix):
            return one_hot_proposal(found, ctx)
        inner_limits = torch.tensor([0 if s else k for s, k in zip(use_suffix, ks)], device=limits.device)
        model = self.inner.propose(state.model, ctx, inner_limits, stop_below)
        if not any(use_suffix):
            return model
        chosen = [f if s else f[:0] for f, s in zip(found, use_suffix)]
        suffix = one_hot_proposal(chosen, ctx)
        W = max(model.width, suffix.width)
        tokens = torch.zeros(ctx.size, W, dtype=torch.long, device=ctx.device)
        rows = torch.tensor(use_suffix, device=ctx.device)
        tokens[:, : model.width] = model.tokens
        tokens[rows, : suffix.width] = suffix.tokens[rows]
        lengths = torch.where(rows, suffix.draft_lengths(), model.draft_lengths())
        probs = None
        if model.probs is not None:  # sampled: one-hot rows for the suffix drafts
            V = model.probs.shape[-1]
            probs = torch.zeros(ctx.size, W, V, dtype=model.probs.dtype, device=ctx.device)
            probs[:, : model.width] = model.probs
            probs[rows] = torch.nn.functional.one_hot(tokens[rows], V).to(probs.dtype)
        return Proposal(tokens, probs, lengths)

    def commit(self, state, lengths) -> None:
        self.suffix.commit(state.suffix, lengths)
        if self.inner is not None:
            self.inner.commit(state.model, lengths)

    def select_rows(self, state, rows) -> None:
        self.suffix.select_rows(state.suffix, rows)
        if self.inner is not None:
            self.inner.select_rows(state.model, rows)

    def caches(self, state) -> list:
        return [] if self.inner is None else self.inner.caches(state.model)

    def add_rows(self, state, new) -> None:
        self.suffix.add_rows(state.suffix, new.suffix)
        if self.inner is not None:
            self.inner.add_rows(state.model, new.model)
