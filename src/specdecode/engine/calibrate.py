"""Timing whole rounds, in one routine (`round_seconds`), for the two cost tables that choose
draft lengths: the optimal policy's CostModel (timed on the run's own batch) and the server's
LoadCosts (timed at each batch size)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from ..core.draft_context import DraftContext
from ..core.proposal import Proposal
from ..core.sampling import SamplingParams
from ..drafters import Drafter
from ..errors import SpecDecodeError
from .generation import Generation
from .policy import CostModel, FixedPolicy, LoadCosts
from .rows import Rows
from .speculation import Speculation


def round_seconds(
    spec: Speculation, prompts: list[list[int]], params: list[SamplingParams], width: int, rounds: int
) -> float:
    """The median wall time of `rounds` rounds (after a warm-up one) of a scratch batch of these
    prompts where every row drafts `width` tokens."""
    scratch = Generation(spec, prompts, params, policy=FixedPolicy(width))
    times = []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        next(scratch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def measure_costs(spec: Speculation, rows: Rows, k: int, max_rows: int = 64, rounds: int = 6) -> CostModel:
    """The optimal policy's cost model, timed on this batch (its first `max_rows` rows): scratch
    runs of the same prompts and sampling parameters (own seeds, no stop rules), every row
    drafting 0, 1 and k tokens. Nothing of the running batch is touched."""
    n = min(rows.size, max_rows)
    lengths = rows.lengths[:n].tolist()
    prompts = [rows.tokens[b, : lengths[b]].tolist() for b in range(n)]
    params = [
        replace(p, seed=b, max_new_tokens=(rounds + 2) * (k + 1), stop=(), ignore_eos=True)
        for b, p in enumerate(rows.params[:n])
    ]
    return CostModel({w: round_seconds(spec, prompts, params, w, rounds) for w in sorted({0, 1, k})}, n)


def measure_load_costs(
    spec: Speculation,
    batch_sizes: Sequence[int],
    prompt_tokens: int = 64,
    rounds: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> LoadCosts:
    """Round costs at each batch size with every row drafting 0, 1 and k tokens, on a
    repetitive prompt of about `prompt_tokens` tokens; copy-based drafters (ngram, suffix) are
    padded to full width, so each round is timed at the width serving will run.
    progress(i, n) is called after each measurement."""
    if spec.drafter is None:
        raise SpecDecodeError("nothing to calibrate: target-only decoding never drafts")
    tok = spec.target.tokenizer
    if tok is not None:
        ids = tok.encode("one two three four five six seven eight nine ten. " * 64)[:prompt_tokens]
    else:
        ids = (list(range(1, 17)) * 64)[:prompt_tokens]
    scratch = replace(spec, drafter=_FullWidth(spec.drafter))
    todo = [(b, w) for b in batch_sizes for w in sorted({0, 1, spec.config.k})]
    table: dict[int, dict[int, float]] = {}
    for i, (b, w) in enumerate(todo):
        # a round emits at most spec.width + 1 tokens (a suffix match may draft past w), so the
        # scratch rows never run out of tokens before the timed rounds are done
        budget = (rounds + 2) * (spec.width + 1)
        params = [SamplingParams(temperature=0, max_new_tokens=budget, ignore_eos=True)] * b
        table.setdefault(b, {})[w] = round_seconds(scratch, [ids] * b, params, w, rounds)
        if progress is not None:
            progress(i + 1, len(todo))
    return LoadCosts(table)


class _FullWidth:
    """A drafter whose deterministic chains (ngram, suffix) are padded to the row's full
    limit, for timing only: a copy-based drafter that finds no match would draft nothing, and
    the round would be timed at a narrower forward than serving will run."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def propose(self, state, ctx: DraftContext, limits: torch.Tensor, stop_below=None) -> Proposal:
        p = self.inner.propose(state, ctx, limits, stop_below)
        width = int(limits.max())
        if p.probs is not None or p.tree is not None or p.width >= width:
            return p
        tokens = torch.zeros(p.tokens.shape[0], width, dtype=torch.long, device=p.tokens.device)
        tokens[:, : p.width] = p.tokens
        return Proposal(tokens, None, limits.clone())
