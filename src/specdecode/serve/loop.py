"""The engine loop: one thread owns the SpeculativeGenerator's running batch. Each iteration it
drops the rows of cancelled requests, admits waiting requests (as many rows as the batch has
room for), prefills admitted prompts (in chunks of at most --max-num-batched-tokens tokens while
other rows are decoding, so a long prompt never stalls them for its whole length; a request's
rows join the batch when their prompt is cached), then runs ONE round for every live row and
hands each request its rows' new tokens. Each round's wall time and the time spent prefilling
go to the load-aware policy, which corrects its round costs from them (policy.OnlineCosts).
Nothing a request carries can stop the loop: an error inside a round fails the requests in that
batch (HTTP 500 for them) and the loop starts a fresh batch.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
import traceback
from dataclasses import dataclass, field

from ..core.sampling import SamplingParams
from ..engine import Generation, Prefill, SpeculativeGenerator
from ..engine.policy import drafting_pays, seconds_saved_per_token
from .metrics import Metrics
from .protocol import APIError


@dataclass
class Choice:
    """One row of a request as the handler sees it."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_text: str | None = None  # the text cut before a stop string, when one ended the choice
    stats: object | None = None  # GenerationStats once finished


@dataclass
class Update:
    """What one round gave one request: per choice index, new tokens (and their logprobs)."""

    tokens: dict[int, list[int]]
    logprobs: dict[int, list]
    finished: list[int]
    error: APIError | None = None


class Job:
    """A client request: its prompt, one SamplingParams per choice, and the queue its handler
    reads Updates from (filled from the engine thread)."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], params: list[SamplingParams], loop: asyncio.AbstractEventLoop):
        self.id = next(self._ids)
        self.prompt_ids, self.params = prompt_ids, params
        self.choices = [Choice() for _ in params]
        self.arrived = time.perf_counter()
        self.first_token: float | None = None
        self.rows: list[int] = []  # engine row ids, choice i -> rows[i]
        self.cancelled = False
        self._loop = loop
        self.queue: asyncio.Queue[Update] = asyncio.Queue()

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def put(self, update: Update) -> None:
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, update)
        except RuntimeError:  # the handler's event loop is gone (server shutting down)
            pass


class EngineLoop:
    """Runs the batch in a daemon thread; submit() and cancel() are safe from any thread."""

    def __init__(
        self,
        gen: SpeculativeGenerator,
        metrics: Metrics,
        max_batch: int = 32,
        max_queue: int = 256,
        max_batched_tokens: int | str | None = None,
        carry: bool = True,
    ) -> None:
        """max_batched_tokens: the tokens one iteration may feed the target, the running rows'
        (1 + k each) and prefill chunks together (at least 16 tokens of prefill); "auto": prefill
        chunks sized to cost about 3/4 of a round (from the measured seconds per prefilled token
        and per round), so a running row's inter-token latency stays under twice its value
        while a long prompt is admitted; None: prefill each admission whole. carry: a prefill
        chunk rides the running rows' round, one pass over the weights for both (_rides), where
        the forward is batch-invariant (the default); False: each chunk is a forward of its own."""
        self.gen, self.metrics = gen, metrics
        self.max_batch, self.max_queue = max_batch, max_queue
        if max_batched_tokens not in (None, "auto") and not (
            isinstance(max_batched_tokens, int) and max_batched_tokens > 0
        ):
            raise ValueError(
                f"max_batched_tokens must be a positive int, 'auto' or None, got {max_batched_tokens!r}"
            )
        self.max_batched_tokens = max_batched_tokens
        self.round_s: float | None = None  # running mean of a round's seconds (auto chunks)
        self.token_s: float | None = None  # running mean of seconds per prefilled token
        # prompt chunks ride the running rows' round (_rides; carry=False: each runs on its own):
        # the tokens riding this iteration, and the running mean of what one adds to a round
        self.carry = carry
        self.riding = 0
        self.ride_token_s: float | None = None
        # running means of the draft model's prefill seconds per token and of an answer's
        # tokens (the payback rule, _worth), and the admissions since one was let explore
        self.draft_token_s: float | None = None
        self.answer_tokens: float | None = None
        self._draft_seen = (None, 0.0, 0)  # (run, its draft_prefill seconds, tokens) last read
        self.unexplored = 0
        # rows whose draft model is fed only after their first token (time to first token: the
        # payback rule said yes, so they draft from their second round); their row ids
        self.eager: set[int] = set()
        self._eager_asked: list[int] = []  # the admission's row indices _defer's function said so of
        self.waiting: collections.deque[Job] = collections.deque()
        self.prefilling: list[tuple[Job, Prefill]] = []  # admitted, prompt not yet cached
        self.running: dict[int, tuple[Job, int]] = {}  # row id -> (request, choice index)
        self.requests: set[Job] = set()
        self.run: Generation | None = None
        self._cv = threading.Condition()
        self._stop = False
        self.rounds = 0
        self.thread = threading.Thread(target=self._main, name="specdecode-engine", daemon=True)

    # -- from the handlers ------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def run_here(self) -> None:
        """Run the loop in the calling thread until stop() (or KeyboardInterrupt)."""
        self.thread = threading.current_thread()
        self._main()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self.thread is not threading.current_thread() and self.thread.is_alive():
            self.thread.join(timeout=30)

    def submit(self, req: Job) -> None:
        if len(req.params) > self.max_batch:
            raise APIError(
                400, f"n = {len(req.params)} exceeds the server's --max-batch {self.max_batch}", "n"
            )
        with self._cv:
            if len(self.waiting) >= self.max_queue:
                self.metrics.rejected.labels("queue_full").inc()
                raise APIError(429, f"the queue is full ({self.max_queue} requests waiting); retry later")
            self.waiting.append(req)
            self.metrics.waiting.set(len(self.waiting))
            self._cv.notify()

    def cancel(self, req: Job) -> None:
        """The client went away: its rows leave the batch at the next round."""
        with self._cv:
            req.cancelled = True
            self._cv.notify()

    @property
    def batch_size(self) -> int:
        return len(self.running)

    # -- the engine thread -----------------------------------------------------------------
    def _main(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self.waiting and not self.running and not self.prefilling:
                    self._cv.wait(timeout=0.5)  # wakes for Ctrl-C in the main thread
                if self._stop:
                    return
            try:
                self._drop_cancelled()
                t0 = time.perf_counter()
                self._admit()
                self._prefill()
                overhead = time.perf_counter() - t0
                if self.running:
                    self._round(overhead)
                self._settle()
            except Exception as e:  # noqa: BLE001 — the loop must survive anything
                self._fail_all(e)

    def _drop_cancelled(self) -> None:
        with self._cv:
            gone = [r for r in self.waiting if r.cancelled]
            for r in gone:
                self.waiting.remove(r)
                self.metrics.request_done("abort")
        for req, prefill in [(r, p) for r, p in self.prefilling if r.cancelled]:
            self.prefilling.remove((req, prefill))
            for row in prefill.rows.ids:
                self.run.forget(row)
            self.requests.discard(req)
            self.metrics.request_done("abort")
        rows = [row for row, (req, _) in self.running.items() if req.cancelled]
        if not rows:
            return
        self.run.cancel(rows)
        for row in rows:
            req, _ = self.running.pop(row)
            self.run.forget(row)
            if req in self.requests and all(r not in self.running for r in req.rows):
                self.requests.discard(req)
                self.metrics.request_done("abort")
        self._gauges()

    def _admit(self) -> None:
        batch: list[Job] = []
        with self._cv:
            room = self.max_batch - len(self.running) - sum(len(r.params) for r, _ in self.prefilling)
            while self.waiting and len(self.waiting[0].params) <= room:
                req = self.waiting.popleft()
                room -= len(req.params)
                batch.append(req)
        if not batch:
            return
        if self.run is None:  # a fresh batch: these prompts are prefilled whole, nobody waits
            prompts = [r.prompt_ids for r in batch for _ in r.params]
            params = [p for r in batch for p in r.params]
            try:
                defer = self._defer(params, len(params))
                self.run = self.gen.stream(prompts, params, defer=defer, first=True)
            except Exception as e:  # noqa: BLE001 — e.g. out of memory on a long prompt
                for r in batch:
                    self._refuse(r, e)
                return
            self.eager.update(self._eager_asked)  # a fresh run's row ids are the prompts' indices
            it = iter(range(len(prompts)))
            for r in batch:
                self._joined(r, [next(it) for _ in r.params])
            self._prefix_metrics()
            self._draft_prefill_seen()
            return
        # the batch these rows will decode in: the running rows, those being admitted, and these
        rows = len(self.running) + sum(len(r.params) for r, _ in self.prefilling)
        rows += sum(len(r.params) for r in batch)
        for r in batch:
            try:
                defer = self._defer(r.params, rows)
                prefill = self.run.begin([r.prompt_ids] * len(r.params), r.params, defer)
                self.eager.update(prefill.rows.ids[b] for b in self._eager_asked)
                self.prefilling.append((r, prefill))
                self.requests.add(r)
            except Exception as e:  # noqa: BLE001
                self._refuse(r, e)

    def _defer(self, params: list, batch: int):
        """Which rows admitted into a batch of `batch` rows skip the draft model's prefill
        (Prefill's `defer`): all of them when drafting would not pay at that size even at 90%
        acceptance (_pays, at the round costs the load-aware policy reads): the policy would not
        let them draft, and a plain server never pays that prefill. (Not the acceptance seen so
        far: rows that never draft would never show a better one, and a server could stay off
        for good after a bad spell.) Where drafting can pay, each row whose draft prefill would
        not be paid back (_worth: a long prompt for a short answer at the acceptance seen) is
        asked once the prefix cache has given its share. Never a seeded row sampled by the
        standard rule (its drafts decide its text, so they must not depend on the load). None:
        every row prefills as usual.

        A row whose draft prefill is worth it skips it too, for now: it is fed after the row's
        first token (_warm, eager rows), so time to first token is the target's prefill alone
        and the row drafts from its second round. Its row index goes to _eager_asked."""
        self._eager_asked = []
        gen = self.gen
        drafter, costs = gen.drafter, getattr(gen, "load_costs", None)
        if drafter is None or costs is None or not drafter.prefills_own or gen.spec.tree is not None:
            return None
        if self._pays(batch):

            def defer(row: int, lag: int) -> bool:
                if lag <= 0:
                    return False
                skip = not self._worth(params[row], lag, 0, batch, explore=True)
                self.metrics.deferred_rows.inc(skip)
                if not skip and not params[row].drafts_decide:
                    self._eager_asked.append(row)  # fed after its first token
                    return True
                return skip

            return defer
        defer = [not p.drafts_decide for p in params]
        self.metrics.deferred_rows.inc(sum(defer))
        return defer if any(defer) else None

    def _pays(self, batch: int, seen: bool = False) -> bool:
        """Drafting pays for a batch of `batch` rows at the learned round costs, if the rows
        accept 90% of their drafts, or (seen) the share they have accepted so far (90% before
        enough were tested)."""
        return drafting_pays(self.gen.load_costs, batch, self.gen.k, self._alpha(seen))

    def _alpha(self, seen: bool) -> float:
        """The acceptance a draft model's prefill is priced at: (seen) that of the drafts the
        draft model itself made in this run (Generation.model_acceptance: auto's suffix drafts
        left out, whose near-perfect acceptance on repeated text would price the prefill of rows
        whose draft model drafts little), else the optimistic 0.9."""
        model = getattr(self.run, "model_acceptance", None) if seen else None
        alpha = model() if model is not None else None
        return 0.9 if alpha is None else alpha

    EXPLORE = 8  # rows deferred because drafting saves nothing at the acceptance seen, before one drafts

    def _worth(
        self, params: SamplingParams, lag: int, produced: int, batch: int, explore: bool = False
    ) -> bool:
        """The payback rule: is feeding a row's draft model the `lag` prompt tokens it lacks
        (at the measured seconds per draft-prefill token) paid back by its tokens still to come
        (max_tokens less the `produced` ones, at most an average answer's length) times the
        seconds a token is saved by drafting in a batch of `batch` rows at the acceptance seen
        so far (policy.seconds_saved_per_token)? Measured on the pair (benchmarks/NOTES.md,
        issue 37 fifth session): a 671-token chat prompt's draft prefill took 1.8 s for 64
        tokens that drafting at 65% acceptance sped up by less. Yes before the draft's prefill
        was ever timed. Where drafting saves nothing at the acceptance seen, every EXPLORE-th
        such admission still drafts (explore), so that acceptance is measured again."""
        if lag <= 0 or self.draft_token_s is None:
            return True
        to_go = params.max_new_tokens - produced
        if self.answer_tokens is not None:
            to_go = min(to_go, self.answer_tokens)
        saved = seconds_saved_per_token(self.gen.load_costs, batch, self.gen.k, self._alpha(True))
        if saved == 0 and explore:
            self.unexplored += 1
            if self.unexplored > self.EXPLORE:
                self.unexplored = 0
                return True
        return to_go * saved > lag * self.draft_token_s

    def _warm(self, budget: int | None) -> int:
        """Feed deferred rows' draft models once drafting pays at the running batch's size and
        the acceptance seen so far: the eager rows (_defer) once they have their first token,
        the others only if their catch-up is paid back (_worth); at most `budget` draft tokens
        (the iteration's prefill budget, counted in target-prefill tokens, converted at the
        measured seconds per token of each), or all they lack when every running row is an eager
        row still cold (no other stream's inter-token latency to keep: chunks would only add
        rounds without drafts, measured on code at c = 1). Returns the tokens fed."""
        run, gen = self.run, self.gen
        costs = getattr(gen, "load_costs", None)
        if run is None or costs is None or not self.running:
            return 0
        cold = run.cold_rows()
        ids = run.rows.ids
        admitting = {i for _, p in self.prefilling for i in p.rows.ids}
        self.eager &= {ids[b] for b, _ in cold} | admitting  # forget rows warmed, finished, gone
        if not cold or not self._pays(len(self.running), seen=True):
            return 0
        if not self.running.keys() - self.eager:
            budget = None  # no other stream to keep decoding: the rows' own catch-up, whole
        elif budget is not None and self.token_s is not None and self.draft_token_s:
            budget = max(int(budget * self.token_s / self.draft_token_s), budget)
        cold.sort(key=lambda c: ids[c[0]] not in self.eager)  # the eager rows first
        fed = 0
        for b, lag in cold:
            out = run.outputs[ids[b]]
            if ids[b] in self.eager:
                req, c = self.running[ids[b]]
                if not req.choices[c].tokens:
                    continue  # its first token first (sent, not only sampled)
            elif not self._worth(out.params, lag, len(out.tokens), len(self.running)):
                continue
            n = run.warm(b, None if budget is None else budget - fed)
            fed += n
            if n >= lag:
                self.metrics.warmed_rows.inc()
            if budget is not None and fed >= budget:
                break
        return fed

    def _draft_prefill_seen(self) -> None:
        """Fold what the run's draft model spent prefilling since the last look into the running
        mean of its seconds per token."""
        run = self.run
        if run is None:
            return
        seconds, tokens = run.draft_prefill
        last_run, last_s, last_n = self._draft_seen
        if last_run is not run:
            last_s, last_n = 0.0, 0
        if tokens > last_n:
            self.draft_token_s = _mean(self.draft_token_s, (seconds - last_s) / (tokens - last_n))
            self.metrics.draft_prefill_tokens.inc(tokens - last_n)
            self.metrics.draft_prefill_seconds.inc(max(seconds - last_s, 0.0))
        self._draft_seen = (run, seconds, tokens)

    def _prefill(self) -> None:
        """Feed the admitted prompts, the oldest first: all of them when no row is decoding (or
        chunking is off), else at most the iteration's token budget less the running rows'; then
        deferred rows' draft models, when they are worth it (_warm)."""
        if not self.prefilling:
            if self.running:
                self._warm(self._chunk_budget())
                self._draft_prefill_seen()
            return
        budget = self._chunk_budget() if self.running else None
        ride = budget is not None and self._rides()
        for req, prefill in list(self.prefilling):
            try:
                t0 = time.perf_counter()
                fed = prefill.step(budget, ride)
                if prefill.riding:
                    self.riding += fed
                elif fed:
                    self.token_s = _mean(self.token_s, (time.perf_counter() - t0) / fed)
                self.metrics.prefill_tokens.inc(fed)
                if prefill.done:
                    self.prefilling.remove((req, prefill))
                    self._joined(req, self.run.join(prefill))
            except Exception as e:  # noqa: BLE001 — e.g. out of memory on a long prompt
                self.prefilling.remove((req, prefill))
                self.requests.discard(req)
                self._refuse(req, e)
                continue
            if budget is not None:
                budget -= fed
                if budget <= 0:
                    break
        if budget is None or budget > 0:
            self._warm(budget)
        self._draft_prefill_seen()
        self._prefix_metrics()

    def _rides(self) -> bool:
        """Prompt chunks ride the running rows' round (one pass over the target's weights for
        both, LlamaModel.ride): where the target carries riders and its forward is
        batch-invariant, so that sharing the pass changes no token's keys, values or logits."""
        target = self.gen.spec.target
        return self.carry and getattr(target, "ride", None) is not None and bool(self.gen.spec.invariant)

    def _settle(self) -> None:
        """After the round: prompt chunks it did not carry run on their own, and the admissions
        whose prompts are now cached join the batch (their first tokens come at the next round)."""
        target = self.gen.spec.target
        if getattr(target, "riders", None):
            target.flush_riders()
        self.riding = 0
        for req, prefill in list(self.prefilling):
            if prefill.done:
                self.prefilling.remove((req, prefill))
                self._joined(req, self.run.join(prefill))

    def _chunk_budget(self) -> int | None:
        """Prompt tokens this iteration may prefill while rows are decoding: with chunks riding
        the round, as many as add 3/4 of a round to it at the measured seconds a riding token
        adds (ride_token_s); else as many as take 3/4 of a round on their own."""
        if self.max_batched_tokens is None:
            return None
        if self.max_batched_tokens == "auto":
            per_token = self.ride_token_s if self._rides() else self.token_s
            if self.round_s is None or per_token is None:
                return 32 if self._rides() else 64
            # a riding token's cost is a difference of two noisy times, 0 when the carrying rounds
            # ran no slower: at most 192 tokens ride a round however small it reads
            per_token = max(per_token, self.round_s / 256)
            return int(min(max(0.75 * self.round_s / per_token, 16), 8192))
        decode = len(self.running) * (1 + (self.gen.k if self.gen.drafter is not None else 0))
        return max(self.max_batched_tokens - decode, 16)

    def _joined(self, req: Job, rows: list[int]) -> None:
        req.rows = rows
        for i, row in enumerate(rows):
            self.running[row] = (req, i)
        self.requests.add(req)
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        self._gauges()

    def _refuse(self, req: Job, e: Exception) -> None:
        req.put(Update({}, {}, [], APIError(500, f"admission failed: {e}")))
        self.metrics.request_done("error")

    def _prefix_metrics(self) -> None:
        cache = self.gen.prefix_cache
        if cache is None:
            return
        st, seen = cache.stats, getattr(self, "_prefix_seen", (0, 0))
        self.metrics.prefix_queries.inc(st.queried - seen[0])
        self.metrics.prefix_hits.inc(st.hit - seen[1])
        self._prefix_seen = (st.queried, st.hit)
        self.metrics.prefix_bytes.set(cache.bytes)

    def _round(self, overhead: float = 0.0) -> None:
        """ONE round for every live row, and its tokens to the requests. First tokens the
        prefill gave (Generation's `first`: admissions that would not draft in their first round)
        come first, without a forward; the round follows at once when other rows are decoding,
        else in the next iteration, after the new rows' draft models were fed (_warm)."""
        run = self.run
        joined: set[int] = set()
        target = self.gen.spec.target
        while True:
            t0 = time.perf_counter()
            carrying = self.riding if getattr(target, "riders", None) else 0
            event = next(run)
            now = time.perf_counter()
            if event.forward:
                carried = carrying if not getattr(target, "riders", None) else 0
                self._timed(event, now - t0, overhead, carried)
            verdict = event.verdict
            drafted, accepted = verdict.draft_lengths.tolist(), verdict.accepted.tolist()
            emitted = sum(len(e) for e in event.emitted)
            self.metrics.round(drafted, accepted, emitted, getattr(run.policy, "cap", None), event.forward)
            self._deliver(event, now)
            joined.update(event.rows)
            if event.forward or not self.running.keys() - joined:
                return

    def _timed(self, event, seconds: float, overhead: float, carried: int = 0) -> None:
        """A round's wall time: the running mean (auto chunks) and the load-aware policy's. A
        round that carried `carried` prompt tokens (_rides) teaches only what a riding token adds
        to a round (ride_token_s), not what a round costs."""
        run = self.run
        self.rounds += 1
        drafter = self.gen.drafter
        # a draft model catching up after rounds without drafting is a one-off cost: the learned
        # round costs leave it out, or the first round that drafts after a long pause (a probe)
        # would look as dear as the catch-up and keep drafting off (its wait doubling each time)
        take = getattr(drafter, "take_catch_up_seconds", None)
        caught_up = take() if take is not None else 0.0
        if carried:
            self.metrics.carried_tokens.inc(carried)
            if self.round_s is not None:
                self.ride_token_s = _mean(self.ride_token_s, max(seconds - self.round_s, 0.0) / carried)
            return
        self.round_s = _mean(self.round_s, seconds)
        record = getattr(run.policy, "record", None)
        if record is not None:  # the load-aware policy learns what rounds really cost
            record(max(seconds - caught_up, 1e-6), overhead)
            costs = getattr(run.policy, "costs", None)
            if hasattr(costs, "correction"):
                self.metrics.round_cost.set(costs.correction(len(event.rows), True))

    def _deliver(self, event, now: float) -> None:
        """Each request's new tokens (and the end of the finished ones)."""
        run = self.run
        updates: dict[Job, Update] = {}
        for i, row in enumerate(event.rows):
            req, c = self.running[row]
            up = updates.setdefault(req, Update({}, {}, []))
            new = event.emitted[i]
            out = run.outputs[row]
            choice = req.choices[c]
            if new:
                if req.first_token is None:
                    req.first_token = now
                    self.metrics.ttft.observe(now - req.arrived)
                choice.tokens.extend(new)
                up.tokens[c] = new
                if out.params.logprobs is not None:
                    lps = out.logprobs[len(choice.logprobs) :]
                    choice.logprobs.extend(lps)
                    up.logprobs[c] = lps
            if event.finished[i]:
                self.answer_tokens = _mean(self.answer_tokens, len(choice.tokens))
                choice.finish_reason, choice.stop_text = out.reason, out.text
                choice.stats = out.result(None).stats
                up.finished.append(c)
                del self.running[row]
                run.forget(row)
        for req, up in updates.items():
            if req.done:
                self.requests.discard(req)
                self._finish_metrics(req, now)
            req.put(up)
        self._gauges()

    def _finish_metrics(self, req: Job, now: float) -> None:
        n = sum(len(c.tokens) for c in req.choices)
        for c in req.choices:
            self.metrics.request_done(c.finish_reason)
        self.metrics.e2e.observe(now - req.arrived)
        if req.first_token is not None and n > len(req.choices):
            self.metrics.tpot.observe((now - req.first_token) / (n / len(req.choices) - 1))

    def _fail_all(self, e: Exception) -> None:
        """An error inside a round: fail every request in the batch, start a fresh one."""
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        err = APIError(500, f"the engine failed while running this request's batch: {detail}")
        for req in list(self.requests):
            req.put(Update({}, {}, [], err))
            self.metrics.request_done("error")
        self.requests.clear()
        self.running.clear()
        self.prefilling.clear()
        if getattr(self.gen.spec.target, "riders", None):
            self.gen.spec.target.riders.clear()
        self.riding = 0
        self.run = None
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.running_rows.set(len(self.running))
        self.metrics.running.set(len(self.requests))
        self.metrics.waiting.set(len(self.waiting))


def _mean(old: float | None, new: float, rate: float = 0.2) -> float:
    """A running mean (exponentially weighted); the first value as is."""
    return new if old is None else old + rate * (new - old)
