"""Drafters: one file per method. Each proposes tokens; none of them decides acceptance."""

from .base import Drafter, Proposal
from .draft_model import DraftModelDrafter
from .eagle import EagleDrafter
from .early_exit import EarlyExitDrafter
from .medusa import MedusaDrafter, MedusaHeads
from .ngram import NgramDrafter

METHODS = ("draft", "ngram", "early-exit", "medusa", "eagle")
AVAILABLE = METHODS

__all__ = [
    "AVAILABLE",
    "METHODS",
    "DraftModelDrafter",
    "Drafter",
    "EagleDrafter",
    "EarlyExitDrafter",
    "MedusaDrafter",
    "MedusaHeads",
    "NgramDrafter",
    "Proposal",
]
