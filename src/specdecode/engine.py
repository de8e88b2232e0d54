"""SpeculativeGenerator: prefill, then rounds of propose -> ONE target forward -> verify ->
commit -> emit, for a batch of rows that may stop at different times and may be joined by new
rows between rounds. The round is `Generation._round`; everything else here sets it up."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .config import SpecConfig
from .drafters import DraftContext, Drafter, make_drafter
from .emit import GenerationResult, RoundEvent, RowOutput, emit
from .errors import SpecDecodeError
from .models.base import PLAIN, WITH_HIDDEN, CausalLM, ForwardMeta, extend
from .models.llama import LlamaModel
from .models.tokenizer import is_messages
from .policy import CostModel, FixedPolicy, LoadAwarePolicy, LoadCosts, RoundOutcome, make_policy
from .sampling import RowRandom, SamplingParams, Warp
from .verify import Proposal, Verdict, verify_proposal

# text, token ids, or a chat: [{"role": "user", "content": ...}, ...] rendered by the target's template
Prompt = str | Sequence[int] | Sequence[dict]

__all__ = ["Generation", "GenerationResult", "RoundEvent", "Rows", "SpeculativeGenerator"]


@dataclass
class Rows:
    """Every per-row state of the running batch, one entry per live row, in one place."""

    ids: list[int]  # row id: the row's index in results() (admission order)
    tokens: torch.Tensor  # [B, capacity] prompt + generated tokens
    lengths: torch.Tensor  # [B] tokens so far; the last is pending (not yet in the target cache)
    params: list[SamplingParams]
    warp: Warp  # the params as tensors
    rng: RowRandom  # one generator per row

    @staticmethod
    def new(
        ids: list[int], prompts: list[list[int]], params: list[SamplingParams], width: int, device
    ) -> Rows:
        """Rows with room for prompt + max_new_tokens plus one round's drafts (`width`) past the end."""
        capacity = max(len(p) + s.max_new_tokens for p, s in zip(prompts, params)) + width + 1
        tokens = torch.zeros(len(prompts), capacity, dtype=torch.long)
        for b, p in enumerate(prompts):
            tokens[b, : len(p)] = torch.tensor(p)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        return Rows(
            ids,
            tokens.to(device),
            lengths,
            params,
            Warp.from_params(params, device),
            RowRandom([s.seed for s in params], device),
        )

    @property
    def size(self) -> int:
        return len(self.ids)

    def context(self) -> DraftContext:
        return DraftContext(self.tokens, self.lengths, self.warp, self.rng)

    def pending(self) -> torch.Tensor:
        """[B, 1] each row's last token, the one the target has not seen yet."""
        return self.tokens.gather(1, (self.lengths - 1).view(-1, 1))

    def append(self, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Write the first counts[b] of tokens [B, W] after each row's tokens (room: see new())."""
        B, W = tokens.shape
        pos = self.lengths.view(B, 1) + torch.arange(W, device=tokens.device).view(1, W)
        write = torch.arange(W, device=tokens.device).view(1, W) < counts.view(B, 1)
        self.tokens.scatter_(1, pos, torch.where(write, tokens, self.tokens.gather(1, pos)))
        self.lengths = self.lengths + counts

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.tokens.device)
        self.ids = [self.ids[i] for i in keep]
        self.tokens, self.lengths = self.tokens[index], self.lengths[index]
        self.params = [self.params[i] for i in keep]
        self.warp = self.warp.select(index)
        self.rng.select(keep)

    def extend(self, other: Rows) -> None:
        capacity = max(self.tokens.shape[1], other.tokens.shape[1])
        pad = [torch.nn.functional.pad(t, (0, capacity - t.shape[1])) for t in (self.tokens, other.tokens)]
        self.ids += other.ids
        self.tokens, self.lengths = torch.cat(pad), torch.cat([self.lengths, other.lengths])
        self.params += other.params
        self.warp = self.warp.extend(other.warp)
        self.rng.extend(other.rng)


class Generation:
    """A running batch. Iterate it for one RoundEvent per round; between rounds add() admits a
    new row; results() runs it to the end and returns every row in admission order."""

    def __init__(
        self, gen: SpeculativeGenerator, ids: list[list[int]], params: list[SamplingParams], policy=None
    ) -> None:
        self.gen, self.target, self.drafter = gen, gen.target, gen.drafter
        self.outputs: list[RowOutput] = []
        self.round_no = 0
        with torch.inference_mode():
            self.rows, self.cache, self.state = self._start(ids, params)
            self.policy = policy or gen.new_policy(self)
        self.policy.add_rows(self.rows.size)

    # -- the round ------------------------------------------------------------------------
    def _round(self) -> RoundEvent:
        rows, cache = self.rows, self.cache
        t0 = time.perf_counter()
        # 1. each row's draft length, from its own past rounds
        limits = self.policy.next_k()
        # 2. the drafter proposes: up to limits[b] tokens per row, or a token tree
        proposal = self._propose(limits)
        t1 = time.perf_counter()
        # 3. ONE target forward over [pending token, drafts]
        tokens, meta = self._target_inputs(proposal)
        logits, hidden = self.target.forward(tokens, cache, meta)  # [B, 1 + width, V], [.., d] | None
        t2 = time.perf_counter()
        # 4. verify: how many drafts each row keeps, and the one token the target adds
        verdict = verify_proposal(proposal, logits, rows.warp, rows.rng)
        logprobs = _logprobs(logits, verdict, rows.params)
        # 5. commit: the accepted drafts stay in the caches, the tokens join the rows
        self._commit(verdict, hidden)
        # 6. emit: stop rules, stats, trace
        tok = self.target.tokenizer
        emitted, finished = emit(
            self.outputs, rows.ids, verdict, self.target.eos_token_ids, tok, (t1 - t0, t2 - t1), logprobs
        )
        self.policy.observe(_outcome(verdict))
        draft_tokens = proposal.tokens if proposal.tree is None else verdict.tokens[:, :-1]
        event = RoundEvent(self.round_no, list(rows.ids), draft_tokens, verdict, emitted, finished)
        self.round_no += 1
        return event

    def _propose(self, limits: list[int]) -> Proposal:
        rows, drafter = self.rows, self.drafter
        if drafter is not None and self.gen.tree is not None and max(limits, default=0) > 0:
            nodes = drafter.propose_tree(self.state, rows.context(), self.gen.tree)
            if isinstance(nodes, Proposal):  # sampled candidates, with the drafter's q
                return nodes
            return Proposal(nodes, tree=self.gen.tree)
        if drafter is None or max(limits) == 0:
            return Proposal.empty(rows.size, rows.tokens.device)
        limit_t = torch.tensor(limits, device=rows.tokens.device)
        return drafter.propose(self.state, rows.context(), limit_t, self.policy.stop_below)

    def _target_inputs(self, proposal: Proposal) -> tuple[torch.Tensor, ForwardMeta]:
        tokens = torch.cat([self.rows.pending(), proposal.tokens], 1)
        hidden, aux = self.gen.needs_hidden, self.gen.aux_layers
        if proposal.tree is None:
            if not hidden:
                return tokens, PLAIN
            return tokens, (WITH_HIDDEN if aux is None else ForwardMeta(return_hidden=True, aux_layers=aux))
        depths, mask = self.gen.tree_layout
        positions = self.cache.lengths.view(-1, 1) + depths.view(1, -1)
        return tokens, ForwardMeta(positions=positions, tree_mask=mask, return_hidden=hidden, aux_layers=aux)

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
        """Admit several rows at once (one prefill, one copy of the caches); their row ids."""
        ids, plist = self.gen._prepare(list(prompts), params)
        with torch.inference_mode():
            rows, cache, state = self._start(ids, plist)
            if self.rows.size == 0:
                self.rows, self.cache, self.state = rows, cache, state
            else:
                self.rows.extend(rows)
                self.cache.add_rows(cache)
                if self.drafter is not None:
                    self.drafter.add_rows(self.state, state)
        self.policy.add_rows(len(ids))
        return list(rows.ids)

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

    def _start(self, ids: list[list[int]], params: list[SamplingParams]) -> tuple[Rows, Any, Any]:
        """Rows for these prompts with a target cache holding all but each pending token, and
        the drafter's state for them."""
        t0 = time.perf_counter()
        first = len(self.outputs)
        rows = Rows.new(list(range(first, first + len(ids))), ids, params, self.gen.width, self.target.device)
        self.gen._check_capacity(rows.tokens.shape[1])
        self.outputs += [RowOutput(p, t0) for p in params]
        invariant = self.gen.batch_invariant
        if invariant:
            cache = self.target.new_cache(rows.size, rows.tokens.shape[1], invariant=True)
        elif self.gen.config.rollback is not None:  # a hybrid target (checked by the generator)
            cache = self.target.new_cache(rows.size, rows.tokens.shape[1], rollback=self.gen.config.rollback)
        else:
            cache = self.target.new_cache(rows.size, rows.tokens.shape[1])
        hidden = None
        if int(rows.lengths.max()) > 1:  # prefill all but the last prompt token
            if invariant and rows.size > 1:
                hidden = self._prefill_rows(rows, cache)
            else:
                todo = rows.lengths - 1
                needs = self.gen.needs_hidden
                aux = self.gen.aux_layers
                _, hidden = extend(
                    self.target, cache, rows.tokens, todo, needs, need_logits=False, aux_layers=aux
                )
        state = None
        if self.drafter is not None:
            state = self.drafter.start(rows.context(), cache)
            if hidden is not None:  # features of every prompt token but the pending one
                self.drafter.observe(state, hidden, torch.zeros_like(rows.lengths), rows.lengths - 1)
        prefill_s = time.perf_counter() - t0
        for out in self.outputs[first:]:
            out.stats.prefill_s = prefill_s
        return rows, cache, state

    def _prefill_rows(self, rows: Rows, cache) -> torch.Tensor | None:
        """Prefill each row on its own, so that its cache holds what it would hold in a batch of
        one (a padded batch prefill is one SDPA call whose blocking depends on the longest
        prompt). Returns the hidden states [B, n, d] when the drafter needs them."""
        hiddens = []
        for b in range(rows.size):
            n = int(rows.lengths[b]) - 1
            if n == 0:
                hiddens.append(None)
                continue
            row = cache.row(b)
            lengths = torch.tensor([n], device=rows.lengths.device)
            needs, aux = self.gen.needs_hidden, self.gen.aux_layers
            _, h = extend(self.target, row, rows.tokens[b : b + 1], lengths, needs, False, aux)
            cache.lengths[b] = n
            hiddens.append(h)
        if not self.gen.needs_hidden:
            return None
        fed = [h for h in hiddens if h is not None]
        first = fed[0]
        width = max(h.shape[1] for h in fed)
        out = first.new_zeros(rows.size, width, first.shape[-1])
        for b, h in enumerate(hiddens):
            if h is not None:
                out[b, : h.shape[1]] = h[0]
        return out

    def _retire(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.rows.tokens.device)
        self.rows.select(keep)
        self.cache.select_rows(index)
        if self.drafter is not None:
            self.drafter.select_rows(self.state, index)
        self.policy.select_rows(keep)

    def measure_costs(self, k: int, max_rows: int = 64, rounds: int = 6) -> CostModel:
        """The optimal policy's cost model, timed on this batch (its first `max_rows` rows):
        whole rounds of scratch runs of the same prompts and sampling parameters (own seeds,
        no stop rules), every row drafting 0, 1 and k tokens; the median of `rounds` rounds
        after a warm-up one. Nothing of this run (caches, generators) is touched."""
        rows = self.rows
        n = min(rows.size, max_rows)
        lengths = rows.lengths[:n].tolist()
        prompts = [rows.tokens[b, : lengths[b]].tolist() for b in range(n)]
        params = [
            replace(p, seed=b, max_new_tokens=(rounds + 2) * (k + 1), stop=(), ignore_eos=True)
            for b, p in enumerate(rows.params[:n])
        ]
        round_s = {}
        for width in sorted({0, 1, k}):
            scratch = Generation(self.gen, prompts, params, policy=FixedPolicy(width))
            times = []
            for _ in range(rounds + 1):
                t0 = time.perf_counter()
                next(scratch)
                times.append(time.perf_counter() - t0)
            round_s[width] = statistics.median(times[1:])
        return CostModel(round_s, n)


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


def _along(hidden: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
    """[B, 1 + max path, d] the root's hidden state, then those of each row's accepted nodes."""
    B, width = hidden.shape[0], 1 + max(len(p) for p in paths)
    along = torch.tensor([[0, *p] + [0] * (width - 1 - len(p)) for p in paths], device=hidden.device)
    return hidden.gather(1, along.unsqueeze(-1).expand(B, width, hidden.shape[-1]))


def _logprobs(logits: torch.Tensor, verdict: Verdict, params: list[SamplingParams]) -> list | None:
    """Per row that asked (None for the others): each verified token's log-probability under
    the target's own distribution (log-softmax of the verification forward's logits at the
    position that predicted it, no temperature or filters), with the n most likely tokens."""
    if all(p.logprobs is None for p in params):
        return None
    n_emit = verdict.num_emitted.tolist()
    out: list = []
    for b, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        n = n_emit[b]
        pos = list(range(n)) if verdict.path is None else [0, *verdict.path[b]][:n]
        lp = torch.log_softmax(logits[b, pos].float(), -1)
        chosen = lp.gather(1, verdict.tokens[b, :n].view(-1, 1)).squeeze(1).tolist()
        if p.logprobs:
            top_v, top_i = lp.topk(p.logprobs, -1)
            tops = [list(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
        else:
            tops = [[] for _ in range(n)]
        out.append(list(zip(chosen, tops)))
    return out


def _outcome(verdict: Verdict) -> RoundOutcome:
    drafted, accepted = verdict.draft_lengths.tolist(), verdict.accepted.tolist()
    return RoundOutcome(drafted, [min(a + 1, d) for a, d in zip(accepted, drafted)], accepted)


class SpeculativeGenerator:
    """Exact speculative decoding of `target`, drafting with `draft` (or a method).

    draft=None and no method: plain autoregressive decoding through the same runtime, the
    baseline every speed-up is measured against. Options (exit_layer, ngram_max, tree, heads,
    confidence_threshold, max_k, cost_model, ...) are SpecConfig's fields; or pass config=.
    """

    def __init__(
        self,
        target: CausalLM,
        draft: CausalLM | None = None,
        k: int = 4,
        method: str | None = None,
        policy: str = "fixed",
        *,
        config: SpecConfig | None = None,
        **options,
    ) -> None:
        if config is None:
            if method is None and draft is not None:
                method = "draft"
            config = SpecConfig(method=method, k=k, policy=policy, **options)
        self.target, self.config = target, config
        self.drafter: Drafter | None = make_drafter(target, draft, config)
        self.tree = config.tree if self.drafter is not None else None
        if self.tree is not None:
            if not all(isinstance(m, LlamaModel) for m in (target, draft) if m is not None):
                raise SpecDecodeError(
                    "token trees need Llama checkpoints on our lean runtime (--backend lean)"
                )
            self.tree_layout = (self.tree.depths().to(target.device), self.tree.mask().to(target.device))
        self.needs_hidden = self.drafter is not None and self.drafter.requires_hidden
        lean = isinstance(target, LlamaModel)
        if config.batch_invariant and not lean:
            raise SpecDecodeError(
                "batch invariance needs a Llama checkpoint on our lean runtime (--backend lean); "
                "transformers' kernels do not give it"
            )
        self.batch_invariant = lean and bool(config.batch_invariant)
        if config.rollback is not None and not (lean and target.cfg.linear_layers):
            raise SpecDecodeError(
                "--rollback applies to hybrid targets (linear-attention layers); this target has none"
            )
        self.width = config.max_draft if self.drafter is not None else 0
        cost = config.cost_model
        self.cost_model: CostModel | None = CostModel.load(cost) if isinstance(cost, (str, Path)) else cost
        load = config.load_costs
        self.load_costs: LoadCosts | None = LoadCosts.load(load) if isinstance(load, (str, Path)) else load

    @property
    def aux_layers(self) -> tuple[int, ...] | None:
        """The target layers whose inputs the drafter reads instead of the final hidden states
        (EAGLE-3); None: the final hidden states."""
        return getattr(self.drafter, "aux_layers", None)

    @property
    def k(self) -> int:
        return self.config.k

    @property
    def method(self) -> str | None:
        return self.config.method if self.drafter is not None else None

    def new_policy(self, run: Generation):
        """A fresh draft-length policy for one run. The optimal policy's cost model is measured
        on the first run's batch (before its first round) and then kept, so later runs choose k
        the same way."""
        if self.drafter is None:
            return make_policy(SpecConfig())  # fixed, never asked: nothing to draft
        if self.config.policy == "optimal" and self.cost_model is None:
            self.cost_model = run.measure_costs(self.config.k)
        policy = make_policy(self.config, self.cost_model)
        if self.load_costs is not None:
            policy = LoadAwarePolicy(policy, self.load_costs, lambda: run.rows.params)
        return policy

    def measure_load_costs(
        self, batch_sizes: Sequence[int], prompt_tokens: int = 64, rounds: int = 8, progress=None
    ) -> LoadCosts:
        """Time whole rounds at each batch size with every row drafting 0, 1 and k tokens (the
        median of `rounds` rounds after a warm-up one) on a repetitive prompt of about
        `prompt_tokens` tokens, so that copy-based drafters (ngram, suffix) draft in full too.
        progress(i, n) is called after each measurement. Set the result as `load_costs` (or pass
        it as SpecConfig.load_costs) to draft by load."""
        if self.drafter is None:
            raise SpecDecodeError("nothing to calibrate: target-only decoding never drafts")
        tok = self.target.tokenizer
        if tok is not None:
            ids = tok.encode("one two three four five six seven eight nine ten. " * 64)[:prompt_tokens]
        else:
            ids = (list(range(1, 17)) * 64)[:prompt_tokens]
        k = self.config.k
        widths = sorted({0, 1, k})
        table: dict[int, dict[int, float]] = {}
        scratch_gen = copy.copy(self)  # drafts padded to full width: see _FullWidth
        scratch_gen.drafter = _FullWidth(self.drafter)
        todo = [(b, w) for b in batch_sizes for w in widths]
        for i, (b, w) in enumerate(todo):
            params = [
                SamplingParams(temperature=0, max_new_tokens=(rounds + 2) * (w + 1), ignore_eos=True)
            ] * b
            scratch = Generation(scratch_gen, [ids] * b, params, policy=FixedPolicy(w))
            times = []
            for _ in range(rounds + 1):
                t0 = time.perf_counter()
                next(scratch)
                times.append(time.perf_counter() - t0)
            table.setdefault(b, {})[w] = statistics.median(times[1:])
            if progress is not None:
                progress(i + 1, len(todo))
        return LoadCosts(table)

    # -- inputs -------------------------------------------------------------------------
    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if prompt == "":
                raise SpecDecodeError("the prompt is empty; give at least one character")
            if self.target.tokenizer is None:
                raise SpecDecodeError(f"{self.target.path} has no tokenizer; pass token ids instead of text")
            ids = self.target.tokenizer.encode(prompt)
        elif is_messages(prompt):
            if self.target.tokenizer is None:
                raise SpecDecodeError(f"{self.target.path} has no tokenizer; chat messages need one")
            ids = self.target.tokenizer.encode_chat(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise SpecDecodeError("the prompt is empty; give at least one token")
        V = self.target.vocab_size
        if min(ids) < 0 or max(ids) >= V:
            raise SpecDecodeError(f"prompt token ids must be in [0, {V}); got {min(ids)}..{max(ids)}")
        return ids

    def _prepare(
        self, prompts: Sequence[Prompt] | Prompt, params: SamplingParams | Sequence[SamplingParams] | None
    ) -> tuple[list[list[int]], list[SamplingParams]]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) or is_messages(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        if not prompts:
            raise SpecDecodeError("no prompts given")
        ids = [self._encode(p) for p in prompts]
        params = params if params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(ids)
        if len(params) != len(ids):
            raise SpecDecodeError(f"got {len(ids)} prompts but {len(params)} SamplingParams")
        return ids, list(params)

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids (chat messages through the target's template); SpecDecodeError
        with a one-line reason when it cannot be encoded."""
        return self._encode(prompt)

    def check_request(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        """SpecDecodeError when prompt + max_new_tokens (+ one round's drafts) does not fit."""
        self._check_capacity(len(prompt_ids) + max_new_tokens + self.width + 1)

    def _check_capacity(self, capacity: int) -> None:
        for model in (self.target, getattr(self.drafter, "model", None)):
            limit = getattr(model, "max_positions", None)
            if limit is not None and capacity > limit:
                raise SpecDecodeError(
                    f"{model.name or model.path}: prompt + max_new_tokens + k + 1 = {capacity} tokens "
                    f"exceeds its {limit} positions; shorten the prompt or lower max_new_tokens"
                )

    # -- running ------------------------------------------------------------------------
    def stream(
        self,
        prompts: Sequence[Prompt] | Prompt,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Generation:
        """Start a batch: iterate the returned Generation for one RoundEvent per round (admit
        more rows with its add()), then call its results()."""
        ids, plist = self._prepare(prompts, params)
        return Generation(self, ids, plist)

    def generate(
        self,
        prompts: Sequence[Prompt] | Prompt,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (one batch); results in prompt order."""
        return self.stream(prompts, params).results()
