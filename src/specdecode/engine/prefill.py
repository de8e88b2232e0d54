"""Admission: filling a new group of rows' caches before they decode, at once or in chunks.

A Prefill holds rows that are admitted but not decoding yet: their target cache, the drafter's
state for them, and how far each row's prompt is cached. step(budget) feeds at most `budget`
prompt tokens (None: all), so a server can interleave a long prompt's prefill with the running
rows' rounds (chunked prefill, vLLM's --max-num-batched-tokens) instead of stalling them all for
its whole length. Chunking changes nothing in the output: the batch-invariant forward computes
each token's keys and values independently of how many tokens share the forward (and a plain
forward's differ by rounding only, as between any two batch shapes).

With a PrefixCache, a row first takes the longest run of cached blocks its prompt starts with
(at least one prompt token is always prefilled, so the drafter sees the target's state after it),
and the blocks of every prefilled prompt (and, at retirement, of every finished row) are stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..models.base import extend, extend_call
from ..models.cache import BLOCK, KVCache
from .prefix import PrefixCache
from .rows import Rows

# which admitted rows skip the draft model's prefill: flags per row, or a function of (row, the
# prompt tokens its draft model would still have to be fed) asked after the prefix cache's reuse
Defer = list[bool] | Callable[[int, int], bool] | None


def prefix_capable(spec, cache) -> bool:
    """Blocks can be copied in and out of this cache, and reusing them is exact (batch-invariant)."""
    return spec.invariant and type(cache) is KVCache


class Prefill:
    """Rows admitted but not decoding yet; see the module docstring."""

    def __init__(
        self, spec, rows: Rows, prefix: PrefixCache | None = None, defer: Defer = None, first: bool = False
    ) -> None:
        """defer: per row, skip the draft model's prefill (a drafter that prefills_own, chains
        only; never a seeded row sampled by the standard rule): the row joins cold and drafts
        nothing until the drafter's warm() feeds it (a server deferring where drafting does not
        pay at its load, or would not pay back this prompt's draft prefill; see serve/loop.py).
        A list of flags, or a function of (row, lag) asked once the prefix cache has given what
        it holds, lag being the prompt tokens the draft model would still have to be fed.

        first: when no row of this admission drafts in its first round (no drafter, or every row
        deferred) and a token's keys, values and logits do not depend on the forward that
        computed them (prefix_capable), the prompt's last token is fed too and its logits kept
        (first_logits): the rows' first tokens come from the prefill's own forward instead of a
        first round's (Generation samples them at the join), one pass over the weights fewer
        before the first token."""
        self.started = time.perf_counter()
        self.spec, self.rows = spec, rows
        self.cache = spec.new_cache(rows.size, rows.tokens.shape[1])
        self.drafter = spec.drafter
        self.state = self.drafter.start(rows.context(), self.cache) if self.drafter is not None else None
        self.goal = rows.lengths - 1  # every prompt token but the pending one is cached
        self.prefix = prefix if prefix is not None and prefix_capable(spec, self.cache) else None
        self.reused = [0] * rows.size  # prompt tokens each row took from the prefix cache
        # of those, the tokens whose drafter state came back too (a draft model's keys and values)
        self.draft_reused = torch.zeros_like(self.cache.lengths)
        self.outputs: list = []  # the rows' RowOutputs (set by the Generation)
        if self.prefix is not None:
            self._reuse()
        # a drafter whose prefill() runs a forward of its own (a draft model) catches up on a
        # prompt longer than the step's budget in steps of its own, taking turns with the
        # target's chunks, so no step between two rounds costs a target chunk and a draft chunk
        # together (a prompt that fits the budget takes one step of both, as it would whole);
        # None: it follows each target chunk at once
        self.drafted: torch.Tensor | None = None
        self.deferred = torch.zeros(rows.size, dtype=torch.bool, device=self.cache.lengths.device)
        if self.drafter is not None and self.drafter.prefills_own:
            self.drafted = self.draft_reused.clone()
            if defer is not None and spec.tree is None:
                if callable(defer):
                    lags = (self.goal - self.draft_reused).clamp(min=0).tolist()
                    defer = [
                        not p.drafts_decide and bool(defer(b, lag))
                        for b, (lag, p) in enumerate(zip(lags, rows.params))
                    ]
                # never a seeded row sampled by the standard rule: its drafts decide its text
                free = [d and not p.drafts_decide for d, p in zip(defer, rows.params)]
                self.deferred = torch.tensor(free, dtype=torch.bool, device=self.cache.lengths.device)
        self._draft_turn = False
        self.draft_s, self.draft_fed = 0.0, 0  # the draft model's own prefill: seconds, tokens
        # [B, 1, V] the logits after each prompt's last token, once fed (first=True only)
        self.first_logits: torch.Tensor | None = None
        self._logits: list[torch.Tensor | None] = []
        self.riding = False  # a step of the target rides the next forward (_target_step)
        plain = self.drafter is None or bool(self.deferred.all())
        if first and plain and prefix_capable(spec, self.cache):
            self.goal = rows.lengths.clone()  # every prompt token, the last one too
            self._logits = [None] * rows.size

    @property
    def done(self) -> bool:
        if self.riding:  # a step waits for the forward that carries it
            return False
        target = bool((self.cache.lengths >= self.goal).all())
        return target and (self.drafted is None or bool((self.deferred | (self.drafted >= self.goal)).all()))

    @property
    def remaining(self) -> int:
        """Prompt tokens still to prefill."""
        return int((self.goal - self.cache.lengths).clamp(min=0).sum())

    def _reuse(self) -> None:
        keeps = self.drafter is not None and self.drafter.keeps_prefix
        # a drafter that prefills on its own (a draft model) takes the target's blocks as far as
        # they go and its own state as far as they carry it, then feeds itself the rest; any
        # other keeper (EAGLE features) needs its state in every block it takes
        own = keeps and self.drafter.prefills_own
        needs_hidden = self.spec.needs.hidden
        for b in range(self.rows.size):
            n = int(self.goal[b])
            tokens = self.rows.tokens[b, :n].tolist()
            blocks = self.prefix.match(tokens, n - 1 if needs_hidden else n, drafter_state=keeps and not own)
            carried = True
            for i, block in enumerate(blocks):
                self.cache.write_block(b, i * BLOCK, block.k, block.v)
                carried = carried and keeps and block.drafter is not None
                if carried:
                    self.drafter.load_prefix(self.state, b, i * BLOCK, block.drafter)
                    self.draft_reused[b] = (i + 1) * BLOCK
            self.cache.lengths[b] = len(blocks) * BLOCK
            self.reused[b] = len(blocks) * BLOCK

    @torch.inference_mode()
    def step(self, budget: int | None, ride: bool = False) -> int:
        """Prefill up to `budget` more prompt tokens (None: all that remain), the earliest rows
        first; returns how many the target was fed (0 for a step of a draft model's own, which
        feeds it up to `budget` tokens the target already has). ride: the target's forwards
        ride the next forward of the running rows (_target_step); the step is done after it."""
        if self.riding:
            return 0
        if budget is None:
            fed = self._target_step(None, ride)
            self._draft_step(None)
            return fed
        if self.drafted is not None:
            lags = bool(((self.drafted < self.cache.lengths) & ~self.deferred).any())
            if not lags and self.remaining <= budget:  # the rest fits: both in this step
                fed = self._target_step(budget, ride)
                self._draft_step(None)
                return fed
            target_done = bool((self.cache.lengths >= self.goal).all())
            if lags and (self._draft_turn or target_done):
                self._draft_turn = False
                self._draft_step(budget)
                return 0
            self._draft_turn = True
        return self._target_step(budget, ride)

    def _draft_step(self, budget: int | None) -> None:
        """Bring the draft model's cache up to `budget` tokens nearer the target's."""
        if self.drafted is None:
            return
        todo = torch.where(self.deferred, 0, (self.cache.lengths - self.drafted).clamp(min=0))
        if budget is not None:
            todo = torch.minimum(todo, (budget - (torch.cumsum(todo, 0) - todo)).clamp(min=0))
        fed = int(todo.sum())
        if fed:
            t0 = time.perf_counter()
            self.drafter.prefill(self.state, self.rows.context(), self.drafted + todo)
            self.draft_s += time.perf_counter() - t0
            self.draft_fed += fed
        self.drafted = self.drafted + todo

    def _target_step(self, budget: int | None, ride: bool = False) -> int:
        """Feed the target up to `budget` more prompt tokens. ride: let the next forward of the
        target that can carry them (the running rows' round) make this step's forwards in its
        own pass (LlamaModel.ride; batch-invariant caches only, so no bit changes): the step
        completes in that forward (`riding` until then), or in the target's flush_riders()."""
        start = self.cache.lengths.clone()
        todo = (self.goal - start).clamp(min=0)
        if budget is not None:
            left = torch.cumsum(todo, 0) - todo  # tokens of the rows before each
            todo = torch.minimum(todo, (budget - left).clamp(min=0))
        fed = int(todo.sum())
        if fed == 0:
            return 0
        upto = start + todo
        spec, rows, cache = self.spec, self.rows, self.cache
        needs, aux = spec.needs, spec.needs.aux_layers
        # the rows whose prompt this step completes keep their last logits (first=True)
        first = bool(self._logits) and bool(((todo > 0) & (upto >= self.goal)).any())
        # the forwards: all rows at once, or row by row (a row's cache holds what it would hold
        # in a batch of one): (row, the cache the forward writes, its tokens, its lengths)
        if not (spec.invariant and rows.size > 1):
            parts = [(None, cache, rows.tokens, upto)]
        else:
            parts = [
                (b, cache.row(b), rows.tokens[b : b + 1], upto[b : b + 1])
                for b in range(rows.size)
                if int(todo[b]) > 0
            ]
        results: list = [None] * len(parts)

        def after() -> None:  # every forward of the step made: the bookkeeping after them
            hiddens: list = [None] * rows.size
            hidden = None
            for (b, _, _, _), (logits, h) in zip(parts, results):
                if b is None:
                    hidden = h
                    if first:
                        self._keep_logits(range(rows.size), upto, logits)
                    continue
                cache.lengths[b] = upto[b]
                if first:
                    self._keep_logits([b], upto, logits, at=0)
                hiddens[b] = h
            if parts[0][0] is not None:
                hidden = _stack(hiddens, rows.size) if needs.hidden else None
            if self.drafter is not None:
                if hidden is not None:  # features of the tokens just fed
                    self.drafter.observe(self.state, hidden, start, todo)
                if self.drafted is None:
                    self.drafter.prefill(self.state, rows.context(), upto)
            self.riding = False

        target = spec.target
        calls = [extend_call(c, t, n, needs.hidden, first, aux) for _, c, t, n in parts]
        if ride and getattr(target, "ride", None) is not None and all(
            call is not None and target.can_carry(part[1], call[1]) for part, call in zip(parts, calls)
        ):
            self.riding = True
            for j, ((_, c, _, _), (feed, meta, finish)) in enumerate(zip(parts, calls)):

                def done(logits, hidden, j=j, finish=finish) -> None:
                    results[j] = finish(logits, hidden)
                    if all(r is not None for r in results):
                        after()

                target.ride(feed, c, meta, done)
            return fed
        for j, (_, c, t, n) in enumerate(parts):
            results[j] = extend(target, c, t, n, needs.hidden, first, aux)
        after()
        return fed

    def _keep_logits(self, rows, upto: torch.Tensor, logits: torch.Tensor, at: int | None = None) -> None:
        """Keep the logits of the rows whose whole prompt is now cached (logits[at or b])."""
        for b in rows:
            if int(upto[b]) >= int(self.goal[b]) and self._logits[b] is None:
                self._logits[b] = logits[b if at is None else at]
        if all(x is not None for x in self._logits):
            self.first_logits = torch.stack(self._logits).unsqueeze(1)

    @torch.inference_mode()
    def finish(self) -> tuple[Rows, Any, Any]:
        """The rows, their target cache and drafter state, ready to join a batch; the prompts'
        blocks go into the prefix cache."""
        took = time.perf_counter() - self.started
        for out in self.outputs:
            out.stats.prefill_s = took
        if self.prefix is not None:
            for b in range(self.rows.size):
                remember(self.prefix, self.spec, self.rows, self.cache, self.state, b)
        if bool(self.deferred.any()):
            self.drafter.defer(self.state, [b for b, d in enumerate(self.deferred.tolist()) if d])
        return self.rows, self.cache, self.state


def _stack(hiddens: list[torch.Tensor | None], B: int) -> torch.Tensor | None:
    fed = [h for h in hiddens if h is not None]
    if not fed:
        return None
    out = fed[0].new_zeros(B, max(h.shape[1] for h in fed), fed[0].shape[-1])
    for b, h in enumerate(hiddens):
        if h is not None:
            out[b, : h.shape[1]] = h[0]
    return out


def remember(prefix: PrefixCache, spec, rows: Rows, cache, state, b: int) -> None:
    """Store row b's whole blocks of cached tokens (and the drafter's state for them)."""
    if not prefix_capable(spec, cache):
        return
    count = int(cache.lengths[b])
    if count < BLOCK:
        return
    drafter = spec.drafter
    save = None
    if drafter is not None and drafter.keeps_prefix:

        def save(start: int):
            return drafter.save_prefix(state, b, start)

    tokens = rows.tokens[b, :count].tolist()
    prefix.insert(tokens, count, lambda start: cache.read_block(b, start, BLOCK), save)
