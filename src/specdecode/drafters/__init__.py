"""Drafters: one file per method. Each proposes tokens; none of them decides acceptance."""

from .base import Drafter
from .draft_model import DraftModelDrafter

METHODS = ("draft", "ngram", "early-exit", "medusa", "eagle")

__all__ = ["METHODS", "DraftModelDrafter", "Drafter"]
