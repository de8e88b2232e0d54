"""Drafters: one file per method, each a `Drafter` subclass registered by name here. Each
proposes tokens; none of them decides acceptance."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.draft_context import DraftContext
from ..core.proposal import Proposal
from ..errors import SpecDecodeError
from .auto import AutoDrafter
from .base import DraftChain, Drafter, TargetNeeds
from .draft_model import DraftModelDrafter
from .eagle import EagleDrafter
from .eagle3 import Eagle3Drafter
from .early_exit import EarlyExitDrafter
from .medusa import MedusaDrafter, MedusaHeads
from .ngram import NgramDrafter
from .suffix import SuffixDrafter

if TYPE_CHECKING:
    from ..core.config import SpecConfig
    from ..models.base import CausalLM

DRAFTERS: dict[str, type[Drafter]] = {
    cls.name: cls
    for cls in (
        DraftModelDrafter,
        NgramDrafter,
        EarlyExitDrafter,
        MedusaDrafter,
        EagleDrafter,
        Eagle3Drafter,
        SuffixDrafter,
        AutoDrafter,
    )
}
METHODS = tuple(DRAFTERS)


def make_drafter(target: CausalLM, draft: CausalLM | None, config: SpecConfig) -> Drafter | None:
    """The configured drafter (None for target-only decoding); SpecDecodeError if it cannot run."""
    if config.method is None:
        if draft is not None:
            raise SpecDecodeError("a draft model is given but no method; use method='draft'")
        return None
    cls = DRAFTERS.get(config.method)
    if cls is None:
        raise SpecDecodeError(f"unknown method {config.method!r}; choose one of {', '.join(DRAFTERS)}")
    if draft is not None and config.method not in ("draft", "auto"):
        raise SpecDecodeError(
            f"a draft model is only used by methods 'draft' and 'auto', not {config.method!r}; drop --draft"
        )
    if config.tree is not None and not cls.supports_tree:
        names = [n for n, c in DRAFTERS.items() if c.supports_tree]
        tree_methods = ", ".join(names[:-1]) + " and " + names[-1]
        raise SpecDecodeError(f"token trees are drafted by methods {tree_methods}, not {config.method!r}")
    return cls.create(target, draft, config)


__all__ = [
    "DRAFTERS",
    "AutoDrafter",
    "Eagle3Drafter",
    "SuffixDrafter",
    "METHODS",
    "DraftChain",
    "DraftContext",
    "DraftModelDrafter",
    "Drafter",
    "EagleDrafter",
    "EarlyExitDrafter",
    "MedusaDrafter",
    "MedusaHeads",
    "NgramDrafter",
    "Proposal",
    "TargetNeeds",
    "make_drafter",
]
