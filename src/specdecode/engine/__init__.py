"""The engine: one round of exact speculative decoding and everything around it.

generator.py  SpeculativeGenerator, the front (encode, stream, generate)
generation.py one run: prefill, then rounds of propose -> ONE target forward -> verify -> commit -> emit
speculation.py how a generator speculates, decided once (drafter, policy, tree, invariance)
rows.py       the running batch's per-row state
prefill.py    prompts into the caches, in chunks, reusing the prefix cache
verify.py     the acceptance rules (chain, greedy, invariant, tree): pure batched functions
emit.py       committed tokens -> streamed events, stop strings, log-probabilities
policy.py     how many tokens to draft (fixed, heuristic, confidence, prefix, optimal, load-aware)
prefix.py     the prefix cache (KV blocks keyed by token prefixes)
stats.py      per-run counters (acceptance, tokens per forward, times)
calibrate.py  a round's cost measured on scratch runs (the optimal and load-aware policies)

It reads the models (specdecode.models) and drafters (specdecode.drafters) below it and the
shared vocabulary in specdecode.core; nothing here imports an application."""

from .emit import GenerationResult, RoundEvent
from .generation import Generation
from .generator import SpeculativeGenerator
from .prefill import Prefill
from .rows import Rows

__all__ = ["Generation", "GenerationResult", "Prefill", "RoundEvent", "Rows", "SpeculativeGenerator"]
