"""A running batch (Generation): prefill, then rounds of propose -> ONE target forward -> verify
-> commit -> emit (`Generation._round`), rows stopping at their own time and joining between
rounds; it reads only the Speculation that speculation.build decided (generator.py's
SpeculativeGenerator starts them; calibrate.py times scratch ones)."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.proposal import Proposal
from ..core.sampling import SamplingParams
from ..errors import SpecDecodeError
from . import selfcheck
from .emit import GenerationResult, RoundEvent, RowOutput, emit, token_logprobs
from .policy import RoundOutcome
from .prefill import Defer, Prefill, remember
from .prefix import PrefixCache
from .rows import Rows
from .speculation import Prompt, Speculation, prepare
from .verify import Verdict, verify_proposal


class Generation:
    """A running batch. Iterate it for one RoundEvent per round; between rounds add() admits a
    new row; results() runs it to the end and returns every row in admission order."""

    def __init__(
        self,
        spec: Speculation,
        ids: list[list[int]],
        params: list[SamplingParams],
        policy=None,
        make_policy: Callable[[Generation], Any] | None = None,
        prefix: PrefixCache | None = None,
        defer: Defer = None,
        first: bool = False,
    ) -> None:
        """A batch of these prompts (token ids) under `spec`; the draft-length policy is
        `policy`, or make_policy(this run) once the rows exist (the optimal policy times them).
        prefix: a PrefixCache to reuse earlier requests' keys and values from (and to fill).
        defer: per row, skip the draft model's prefill (Prefill); the row drafts once warm()ed.
        first: rows that would not draft in their first round take their first token from the
        prefill's forward (Prefill's `first`); it comes out as an event of its own, without a
        target forward (RoundEvent.forward False), before the next round."""
        self.spec, self.target, self.drafter = spec, spec.target, spec.drafter
        self.prefix = prefix
        self.first = first
        self.outputs: list[RowOutput] = []
        self.round_no = 0
        self._firsts: collections.deque[RoundEvent] = collections.deque()  # first tokens not yet read
        # the draft model's own prefill of every admission and warm(): [seconds, tokens fed]
        self.draft_prefill = [0.0, 0]
        # the drafts of a drafter's own prefilled model (auto: not its suffix matches): [tested,
        # accepted], what that model's prefill is paid back by (model_acceptance)
        self.model_drafts = [0, 0]
        # rows whose cache differed from a whole prefill of their tokens (selfcheck, when on)
        self.kv_mismatches = 0
        with torch.inference_mode():
            self.rows, self.cache, self.state = self._start(ids, params, defer)
            self.policy = policy if policy is not None else make_policy(self)
        self.policy.add_rows(self.rows.size)

    # -- the round ------------------------------------------------------------------------
    def _round(self) -> RoundEvent:
        rows, cache = self.rows, self.cache
        t0 = time.perf_counter()
        # 1. each row's draft length, from its own past rounds (none for a cold row: its draft
        # model has not seen its prompt)
        limits = self.policy.next_k()
        if self.drafter is not None and (lags := self.drafter.cold_lags(self.state, rows.context())):
            limits = [0 if lag else k for k, lag in zip(limits, lags)]
        # 2. the drafter proposes: up to limits[b] tokens per row, or a token tree
        proposal = self._propose(limits)
        t1 = time.perf_counter()
        # 3. ONE target forward over [pending token, drafts]
        tokens = torch.cat([rows.pending(), proposal.tokens], 1)
        meta = self.spec.verify_meta(proposal, cache.lengths)
        logits, hidden = self.target.forward(tokens, cache, meta)  # [B, 1 + width, V], [.., d] | None
        t2 = time.perf_counter()
        # 4. verify: how many drafts each row keeps, and the one token the target adds
        verdict = verify_proposal(proposal, logits, rows.warp, rows.rng, rows.lengths)
        logprobs = token_logprobs(logits, verdict, rows.params)
        # 5. commit: the accepted drafts stay in the caches, the tokens join the rows
        self._commit(verdict, hidden)
        for c in self._caches(self.cache, self.state):  # a slice of a coming admission's storage
            c.tick()
        # 6. emit: stop rules, stats, trace
        tok = self.target.tokenizer
        emitted, finished = emit(
            self.outputs, rows.ids, verdict, self.target.eos_token_ids, tok, (t1 - t0, t2 - t1), logprobs
        )
        outcome = _outcome(verdict)
        self.policy.observe(outcome)
        self._count_model_drafts(outcome)
        draft_tokens = proposal.tokens if proposal.tree is None else verdict.tokens[:, :-1]
        event = RoundEvent(self.round_no, list(rows.ids), draft_tokens, verdict, emitted, finished)
        self.round_no += 1
        return event

    def _count_model_drafts(self, outcome: RoundOutcome) -> None:
        drafter = self.drafter
        if drafter is None or not drafter.prefills_own or not any(outcome.tested):
            return
        mask = drafter.prefilled_rows(self.state) or [True] * len(outcome.tested)
        for own, t, a in zip(mask, outcome.tested, outcome.accepted):
            if own:
                self.model_drafts[0] += t
                self.model_drafts[1] += a

    def model_acceptance(self, min_tests: int = 16) -> float | None:
        """The share of its drafts the drafter's own prefilled model (a draft model) has had
        accepted in this run, smoothed as the policy's pooled rate; None before `min_tests` of
        them were tested, or without such a model. Auto's suffix drafts are not counted: they
        need no draft-model prefill, and their acceptance (near 1 on repeated text) says
        nothing of the model's."""
        tested, accepted = self.model_drafts
        return (accepted + 1) / (tested + 2) if tested >= min_tests else None

    def _propose(self, limits: list[int]) -> Proposal:
        rows, drafter = self.rows, self.drafter
        tree = self.spec.tree
        if drafter is not None and tree is not None and max(limits, default=0) > 0:
            nodes = drafter.propose_tree(self.state, rows.context(), tree)
            if isinstance(nodes, Proposal):  # sampled candidates, with the drafter's q
                return nodes
            return Proposal(nodes, tree=tree)
        if drafter is None or max(limits) == 0:
            return Proposal.empty(rows.size, rows.tokens.device)
        limit_t = torch.tensor(limits, device=rows.tokens.device)
        return drafter.propose(self.state, rows.context(), limit_t, self.policy.stop_below)

    def _commit(self, verdict: Verdict, hidden: torch.Tensor | None) -> None:
        rows, cache, drafter = self.rows, self.cache, self.drafter
        base = rows.lengths - 1  # the pending token's slot in the target cache
        kept = rows.lengths + verdict.accepted  # pending + accepted drafts stay cached
        if verdict.path is not None:  # a tree: move the accepted path next to the root
            cache.keep_path(base, verdict.path)
            if hidden is not None:
                hidden = _along(hidden, verdict.path)
        cache.rewind(kept)
        if drafter is not None:
            if hidden is not None:  # features of the pending token and the accepted drafts
                drafter.observe(self.state, hidden, base, verdict.accepted + 1)
            drafter.commit(self.state, kept)
        rows.append(verdict.tokens, verdict.num_emitted)

    # -- the batch ------------------------------------------------------------------------
    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> RoundEvent:
        while self._firsts:  # first tokens the prefill gave: their event, no forward
            event = self._firsts.popleft()
            live = set(self.rows.ids)
            keep = [i for i, row in enumerate(event.rows) if row in live]  # not cancelled since
            if not keep:
                continue
            if len(keep) < len(event.rows):
                event = _first_rows(event, keep)
            done = {row for row, f in zip(event.rows, event.finished) if f}
            if done:
                self._retire([i for i, row in enumerate(self.rows.ids) if row not in done])
            return event
        if self.rows.size == 0:
            raise StopIteration
        with torch.inference_mode():
            event = self._round()
        if any(event.finished):
            self._retire([i for i, f in enumerate(event.finished) if not f])
        return event

    def add(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Admit a row between rounds: prefilled on its own, then decoded with the others.
        Returns its row id, its index in results()."""
        return self.add_many([prompt], params)[0]

    def add_many(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[int]:
        """Admit several rows at once (one prefill, then their caches join); their row ids."""
        prefill = self.begin(prompts, params)
        with torch.inference_mode():
            prefill.step(None)
        return self.join(prefill)

    def cancel(self, row_ids: Sequence[int]) -> None:
        """Drop these live rows between rounds (finish reason "abort"): their slots, caches and
        drafter state are freed now; the other rows go on untouched."""
        drop = set(row_ids)
        if not drop & set(self.rows.ids):
            return
        now = time.perf_counter()
        for row in drop & set(self.rows.ids):
            out = self.outputs[row]
            out.reason, out.ended = "abort", now
        self._retire([i for i, row in enumerate(self.rows.ids) if row not in drop])

    def forget(self, row_id: int) -> None:
        """Release a finished row's output (a long-running server calls this once it has read
        it, so memory stays flat); results() cannot report that row afterwards."""
        if row_id in self.rows.ids:
            raise SpecDecodeError(f"row {row_id} is still running; cancel it first")
        self.outputs[row_id] = None  # type: ignore[call-overload]

    def results(self) -> list[GenerationResult]:
        """Run to the end; every row's result, in admission order (the row ids)."""
        for _ in self:
            pass
        return [out.result(self.target.tokenizer) for out in self.outputs]

    def begin(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        defer: Defer = None,
    ):
        """Admit rows whose prefill runs in chunks between rounds: returns a Prefill; call its
        step(budget) between rounds until it is done, then join() it. Its rows have their ids
        (indices in results()) from now on, but decode only once joined. defer: as in the
        constructor."""
        ids, plist = prepare(self.target, list(prompts), params)
        with torch.inference_mode():
            prefill = self._begin(ids, plist, defer)
        if self.rows.size:  # the join will add these rows to the batch's caches: prepare them
            for old, new in zip(
                self._caches(self.cache, self.state), self._caches(prefill.cache, prefill.state)
            ):
                old.reserve_for(new)
        return prefill

    def _caches(self, cache, state) -> list:
        """The target's cache and the drafter's own caches of one batch (or admission)."""
        return [cache] + ([] if self.drafter is None else self.drafter.caches(state))

    def join(self, prefill: Prefill) -> list[int]:
        """Rows whose prefill is done join the running batch (their tokens copied into free
        slots of the batch's caches, or into storage begin() staged); their ids."""
        if not prefill.done:
            raise SpecDecodeError("this admission's prefill is not done; step() it until done")
        self._count_draft_prefill(prefill)
        with torch.inference_mode():
            rows, cache, state = prefill.finish()
            if selfcheck.ENABLED:
                for b in range(rows.size):
                    self.kv_mismatches += not selfcheck.check_row(self.spec, rows, cache, b, "at its join")
            self._first_tokens(prefill)
            if self.rows.size == 0:
                self.rows, self.cache, self.state = rows, cache, state
            else:
                self.rows.extend(rows)
                self.cache.add_rows(cache)
                if self.drafter is not None:
                    self.drafter.add_rows(self.state, state)
        self.policy.add_rows(rows.size)
        return list(rows.ids)

    def cold_rows(self) -> list[tuple[int, int]]:
        """(row index, tokens its draft model lacks) of every cold row (see warm())."""
        if self.drafter is None or self.rows.size == 0:
            return []
        lags = self.drafter.cold_lags(self.state, self.rows.context())
        return [(b, lag) for b, lag in enumerate(lags or []) if lag]

    def warm(self, rows: int | Sequence[int], budget: int | None = None) -> int:
        """Feed cold rows' draft model up to `budget` each of the tokens they lack (None: all);
        a row drafts again from the round after it has them all. Returns the tokens fed. The
        server decides which rows are worth it (serve/loop.py)."""
        rows = [rows] if isinstance(rows, int) else list(rows)
        t0 = time.perf_counter()
        with torch.inference_mode():
            fed = self.drafter.warm(self.state, self.rows.context(), rows, budget)
        if fed:
            self.draft_prefill[0] += time.perf_counter() - t0
            self.draft_prefill[1] += fed
        return fed

    def _count_draft_prefill(self, prefill: Prefill) -> None:
        self.draft_prefill[0] += prefill.draft_s
        self.draft_prefill[1] += prefill.draft_fed

    def _begin(self, ids: list[list[int]], params: list[SamplingParams], defer=None) -> Prefill:
        first = len(self.outputs)
        rows = Rows.new(
            list(range(first, first + len(ids))), ids, params, self.spec.width, self.target.device
        )
        self.spec.check_capacity(rows.tokens.shape[1])
        prefill = Prefill(self.spec, rows, self.prefix, defer, self.first)
        self.outputs += [RowOutput(p, prefill.started) for p in params]
        prefill.outputs = self.outputs[first:]
        return prefill

    def _start(self, ids: list[list[int]], params: list[SamplingParams], defer=None) -> tuple[Rows, Any, Any]:
        """Rows for these prompts with a target cache holding all but each pending token, and
        the drafter's state for them (the whole prefill at once)."""
        prefill = self._begin(ids, params, defer)
        prefill.step(None)
        self._count_draft_prefill(prefill)
        finished = prefill.finish()
        self._first_tokens(prefill)
        return finished

    def _first_tokens(self, prefill: Prefill) -> None:
        """Sample the first token of rows whose prefill kept the logits after their prompt
        (Prefill's `first`), by the round's own rule (verify_proposal with nothing drafted, so
        the same token a plain first round would give: those logits are bit for bit the round's),
        emit it, and queue its event for __next__."""
        logits = prefill.first_logits
        if logits is None:
            return
        rows = prefill.rows
        proposal = Proposal.empty(rows.size, rows.tokens.device)
        verdict = verify_proposal(proposal, logits, rows.warp, rows.rng, rows.lengths)
        logprobs = token_logprobs(logits, verdict, rows.params)
        rows.append(verdict.tokens, verdict.num_emitted)  # the cache holds every prompt token
        tok = self.target.tokenizer
        eos = self.target.eos_token_ids
        times = (0.0, 0.0)  # no decoding forward: the prefill's seconds are the row's prefill_s
        emitted, finished = emit(self.outputs, rows.ids, verdict, eos, tok, times, logprobs, forward=False)
        event = RoundEvent(self.round_no, list(rows.ids), proposal.tokens, verdict, emitted, finished, False)
        self.round_no += 1
        self._firsts.append(event)

    def _retire(self, keep: list[int]) -> None:
        if selfcheck.ENABLED:
            for b in sorted(set(range(self.rows.size)) - set(keep)):
                ok = selfcheck.check_row(self.spec, self.rows, self.cache, b, "when it left")
                self.kv_mismatches += not ok
        if self.prefix is not None:
            kept = set(keep)
            for b in range(self.rows.size):
                if b not in kept:
                    remember(self.prefix, self.spec, self.rows, self.cache, self.state, b)
        index = torch.tensor(keep, dtype=torch.long, device=self.rows.tokens.device)
        self.rows.select(keep)
        self.cache.select_rows(index)
        if self.drafter is not None:
            self.drafter.select_rows(self.state, index)
        self.policy.select_rows(keep)


def _first_rows(event: RoundEvent, keep: list[int]) -> RoundEvent:
    """A first-token event (a plain verdict) cut to the rows at indices `keep`."""
    idx = torch.tensor(keep, dtype=torch.long, device=event.verdict.tokens.device)
    return RoundEvent(
        event.round,
        [event.rows[i] for i in keep],
        event.draft_tokens[idx],
        Verdict.plain(event.verdict.tokens[idx, 0]),
        [event.emitted[i] for i in keep],
        [event.finished[i] for i in keep],
        False,
    )


def _along(hidden: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
    """[B, 1 + max path, d] the root's hidden state, then those of each row's accepted nodes."""
    B, width = hidden.shape[0], 1 + max(len(p) for p in paths)
    along = torch.tensor([[0, *p] + [0] * (width - 1 - len(p)) for p in paths], device=hidden.device)
    return hidden.gather(1, along.unsqueeze(-1).expand(B, width, hidden.shape[-1]))


def _outcome(verdict: Verdict) -> RoundOutcome:
    drafted, accepted = verdict.draft_lengths.tolist(), verdict.accepted.tolist()
    return RoundOutcome(drafted, [min(a + 1, d) for a, d in zip(accepted, drafted)], accepted)
