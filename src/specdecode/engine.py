"""SpeculativeGenerator: prefill, then rounds of propose -> ONE target forward -> verify ->
rewind -> emit, for a batch of rows that may stop at different times."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .drafters import (
    AVAILABLE,
    METHODS,
    Drafter,
    DraftModelDrafter,
    EagleDrafter,
    EarlyExitDrafter,
    MedusaDrafter,
    MedusaHeads,
    NgramDrafter,
    Proposal,
)
from .errors import SpecDecodeError
from .models.base import CausalLM, extend
from .models.llama import LlamaModel
from .policy import RoundOutcome, make_policy
from .sampling import SamplingParams, Warp, logits_to_probs, sample
from .stats import HOW, GenerationStats, RoundRecord
from .tree import TokenTree, verify_tree
from .verify import Verdict, verify_chain, verify_greedy

Prompt = str | Sequence[int]


class Batch:
    """Every per-row state of a running batch in one place: tokens, lengths, sampling
    parameters, stop rules. Retiring rows is select(); the RNG is shared by the batch."""

    def __init__(self, prompts: list[list[int]], params: list[SamplingParams], k: int) -> None:
        B = len(prompts)
        self.size = B
        self.prompt_lengths = torch.tensor([len(p) for p in prompts])  # [B]
        self.max_new = torch.tensor([p.max_new_tokens for p in params])  # [B]
        # room for the longest row plus one round's overshoot
        self.capacity = int((self.prompt_lengths + self.max_new).max()) + k + 1
        self.tokens = torch.zeros(B, self.capacity, dtype=torch.long)  # [B, capacity]
        for b, p in enumerate(prompts):
            self.tokens[b, : len(p)] = torch.tensor(p)
        self.lengths = (
            self.prompt_lengths.clone()
        )  # [B] context length, last token not yet in the target cache
        self.rows = torch.arange(B)  # [B] original row index of each live row
        self.params = list(params)
        self.warp = Warp.from_params(params)
        seeds = [p.seed for p in params]
        self.generator = torch.Generator()
        if all(s is not None for s in seeds):
            same = all(s == seeds[0] for s in seeds)
            self.generator.manual_seed(seeds[0] if same else hash(tuple(seeds)) & 0x7FFF_FFFF_FFFF_FFFF)
        else:
            self.generator.seed()

    def exp_noise(self, vocab: int) -> torch.Tensor:
        """[B, V] Exp(1) noise from the batch's generator."""
        return torch.empty(self.size, vocab, dtype=torch.float64).exponential_(generator=self.generator)

    def uniforms(self, k: int) -> torch.Tensor:
        return torch.rand(self.size, k, dtype=torch.float64, generator=self.generator)

    def select(self, keep: torch.Tensor) -> None:
        self.tokens = self.tokens[keep]
        self.lengths = self.lengths[keep]
        self.prompt_lengths = self.prompt_lengths[keep]
        self.max_new = self.max_new[keep]
        self.rows = self.rows[keep]
        self.params = [self.params[i] for i in keep.tolist()]
        self.warp = self.warp.select(keep)
        self.size = len(self.params)


@dataclass
class RoundEvent:
    """One round for every live row: the whole verdict, and what each row emitted."""

    round: int
    rows: list[int]  # original row index per live row
    draft_tokens: torch.Tensor  # [B, k]
    verdict: Verdict
    emitted: list[list[int]]  # per live row, after stop rules
    finished: list[bool]

    def records(self) -> list[RoundRecord]:
        """Trace lines (design.md): positions after the first rejection have uniform None."""
        v = self.verdict
        tested = v.tested.tolist()
        drafted = v.draft_lengths.tolist()
        out = []
        for i, row in enumerate(self.rows):
            a, d = int(v.accepted[i]), drafted[i]  # the row's own drafts: the first d positions
            n = len(self.emitted[i])
            how = ["accepted"] * min(a, n) + ([HOW[2] if v.bonus[i] else HOW[1]] if n > a else [])
            uni = v.uniforms[i].tolist() if v.uniforms is not None else [None] * len(tested[i])
            out.append(
                RoundRecord(
                    row=row,
                    round=self.round,
                    draft_token_ids=self.draft_tokens[i, :d].tolist(),
                    draft_prob=v.draft_prob[i, :d].tolist(),
                    target_prob=v.target_prob[i, :d].tolist(),
                    accept_prob=v.accept_prob[i, :d].tolist(),
                    uniform=[u if t else None for u, t in zip(uni[:d], tested[i][:d])],
                    accepted=v.accepted_mask[i, :d].tolist(),
                    emitted_token_ids=self.emitted[i],
                    how=how,
                )
            )
        return out


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only
    stats: GenerationStats
    finish_reason: str  # "length", "eos" or "stop"


class Generation:
    """A running batch: an iterator of RoundEvents; results() finishes it and returns the outputs."""

    def __init__(self, gen: SpeculativeGenerator, ids: list[list[int]], params: list[SamplingParams]) -> None:
        self._gen = gen
        self._state = gen._new_results(len(ids))
        self._events = gen._run(ids, params, self._state)

    def __iter__(self) -> Iterator[RoundEvent]:
        return self._events

    def results(self) -> list[GenerationResult]:
        for _ in self._events:
            pass
        return self._gen._results(self._state)


class SpeculativeGenerator:
    """Exact speculative decoding of `target`, drafting with `draft` (or a method).

    draft=None and no method: plain autoregressive decoding through the same runtime, the
    baseline every speed-up is measured against.
    """

    def __init__(
        self,
        target: CausalLM,
        draft: CausalLM | None = None,
        k: int = 4,
        method: str | None = None,
        policy: str = "fixed",
        *,
        exit_layer: int | None = None,
        ngram_max: int = 3,
        ngram_min: int = 1,
        confidence_threshold: float = 0.4,
        max_k: int | None = None,
        tree: TokenTree | str | None = None,
        heads=None,
    ) -> None:
        if not isinstance(k, int) or k < 1:
            raise SpecDecodeError(f"k must be an integer >= 1, got {k!r}")
        if method is None:
            method = "draft" if draft is not None else None
        self.target = target
        self.k = k
        self.drafter: Drafter | None = None
        if method is not None and method not in METHODS:
            raise SpecDecodeError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
        if method is not None and method not in AVAILABLE:
            raise SpecDecodeError(
                f"method {method!r} is not available yet; use one of {', '.join(AVAILABLE)}"
            )
        if draft is not None and method != "draft":
            raise SpecDecodeError(
                f"a draft model is only used by method 'draft', not {method!r}; drop --draft"
            )
        if method == "draft":
            if draft is None:
                raise SpecDecodeError("method 'draft' needs a draft model (--draft MODEL)")
            self.drafter = DraftModelDrafter(draft, target)
        elif method == "ngram":
            self.drafter = NgramDrafter(ngram_max, ngram_min)
        elif method == "early-exit":
            self.drafter = EarlyExitDrafter(target, exit_layer)
        elif method == "eagle":
            if heads is None:
                raise SpecDecodeError("method 'eagle' needs a trained EAGLE drafter (--heads DIR)")
            self.drafter = EagleDrafter(target, heads)
        elif method == "medusa":
            if heads is None:
                raise SpecDecodeError("method 'medusa' needs trained heads (--heads DIR)")
            self.drafter = MedusaDrafter(
                target, MedusaHeads.load(heads) if isinstance(heads, (str, Path)) else heads
            )
        self.method = method
        self._needs_hidden = bool(getattr(self.drafter, "needs_hidden", False))
        self._hidden_kw = {"return_hidden": True} if self._needs_hidden else {}
        self.tree = TokenTree.parse(tree) if isinstance(tree, str) else tree
        if self.tree is not None:
            if method not in ("draft", "medusa", "eagle"):
                raise SpecDecodeError(
                    f"token trees are drafted by methods draft, medusa and eagle, not {method!r}"
                )
            if not all(isinstance(m, LlamaModel) for m in (target, draft) if m is not None):
                raise SpecDecodeError(
                    "token trees need Llama checkpoints on our lean runtime (--backend lean)"
                )
            if policy != "fixed":
                raise SpecDecodeError("a token tree has a fixed shape; use --policy fixed with --tree")
            k = self.k = self.tree.depth
        make_policy(policy, k, confidence_threshold=confidence_threshold, max_k=max_k)  # validates
        self._policy_args = (policy, k, confidence_threshold, max_k)

    def new_policy(self):
        """A fresh draft-length policy for one batch."""
        name, k, threshold, max_k = self._policy_args
        return make_policy(name, k, confidence_threshold=threshold, max_k=max_k)

    # -- inputs -------------------------------------------------------------------------
    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if prompt == "":
                raise SpecDecodeError("the prompt is empty; give at least one character")
            if self.target.tokenizer is None:
                raise SpecDecodeError(f"{self.target.path} has no tokenizer; pass token ids instead of text")
            ids = self.target.tokenizer.encode(prompt)
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
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
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

    # -- the loop -----------------------------------------------------------------------
    def stream(
        self,
        prompts: Sequence[Prompt] | Prompt,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Generation:
        """Start a batch: iterate the returned Generation for one RoundEvent per round, then
        call its results()."""
        ids, plist = self._prepare(prompts, params)
        return Generation(self, ids, plist)

    def generate(
        self,
        prompts: Sequence[Prompt] | Prompt,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (one batch); results in prompt order."""
        return self.stream(prompts, params).results()

    def _new_results(self, n: int) -> dict:
        return {
            "tokens": [[] for _ in range(n)],
            "stats": [GenerationStats() for _ in range(n)],
            "reason": ["length"] * n,
            "text": [None] * n,
            "wall_s": 0.0,
            "prefill_s": 0.0,
        }

    def _results(self, state: dict) -> list[GenerationResult]:
        out = []
        tok = self.target.tokenizer
        for b, ids in enumerate(state["tokens"]):
            st = state["stats"][b]
            st.new_tokens = len(ids)
            st.wall_s = state["wall_s"]
            st.prefill_s = state["prefill_s"]
            text = state["text"][b]
            if text is None:
                text = tok.decode(ids) if tok is not None else ""
            out.append(GenerationResult(text, ids, st, state["reason"][b]))
        return out

    def _run(self, ids: list[list[int]], params: list[SamplingParams], state: dict) -> Iterator[RoundEvent]:
        t0 = time.perf_counter()
        policy = self.new_policy() if self.drafter is not None else None
        width = 0 if policy is None else (self.tree.size if self.tree is not None else policy.max_k)
        batch = Batch(ids, params, width)  # room for one round's drafts (a whole tree) past the end
        for model in (self.target, getattr(self.drafter, "model", None)):
            limit = getattr(model, "max_positions", None)
            if limit is not None and batch.capacity > limit:
                raise SpecDecodeError(
                    f"{model.name or model.path}: prompt + max_new_tokens + k + 1 = {batch.capacity} tokens "
                    f"exceeds its {limit} positions; shorten the prompt or lower max_new_tokens"
                )
        cache = self.target.new_cache(batch.size, batch.capacity)
        hidden = None
        if int(batch.lengths.max()) > 1:  # prefill all but the last prompt token
            out = extend(
                self.target, cache, batch.tokens, batch.lengths - 1, return_hidden=self._needs_hidden
            )
            hidden = out[1] if self._needs_hidden else None
        if self.drafter is not None:
            self.drafter.start(batch, cache)
            if hidden is not None:  # features of every prompt token but the pending one
                self.drafter.observe_features(hidden, torch.zeros_like(batch.lengths), batch.lengths - 1)
        state["prefill_s"] = time.perf_counter() - t0
        eos = torch.tensor(self.target.eos_token_ids, dtype=torch.long)
        round_no = 0
        while batch.size > 0:
            event = self._round(batch, cache, policy, round_no, eos, state)
            round_no += 1
            state["wall_s"] = time.perf_counter() - t0
            yield event
            done = torch.tensor(event.finished)
            if bool(done.any()):
                keep = (~done).nonzero().squeeze(1)
                batch.select(keep)
                cache.select_rows(keep)
                if self.drafter is not None:
                    self.drafter.select_rows(keep)
        state["wall_s"] = time.perf_counter() - t0

    def _round(
        self, batch: Batch, cache, policy, round_no: int, eos: torch.Tensor, state: dict
    ) -> RoundEvent:
        if self.tree is not None:
            return self._tree_round(batch, cache, round_no, eos, state)
        B = batch.size
        k = policy.next_k() if policy is not None else 0
        t0 = time.perf_counter()
        proposal = self.drafter.propose(batch, k, policy.stop_below) if k > 0 else Proposal.empty(B)
        draft_tokens, n_drafts = proposal.tokens, proposal.lengths
        k = draft_tokens.shape[1]  # a drafter may propose fewer
        t1 = time.perf_counter()
        if k == 0:
            return self._plain_round(batch, cache, policy, round_no, eos, state, t1 - t0)
        pending = batch.tokens.gather(1, (batch.lengths - 1).view(B, 1))
        out = self.target.forward(torch.cat([pending, draft_tokens], 1), cache, **self._hidden_kw)
        logits, hidden = out if self._needs_hidden else (out, None)  # [B, k+1, V], [B, k+1, d]
        t2 = time.perf_counter()
        if batch.warp.all_greedy:
            verdict = verify_greedy(draft_tokens, logits, n_drafts)
        else:
            target_probs = logits_to_probs(logits, batch.warp)
            verdict = verify_chain(
                draft_tokens,
                proposal.probs,
                target_probs,
                batch.uniforms(k),
                batch.exp_noise(logits.shape[-1]),
                n_drafts,
            )
        outcome = None
        if policy is not None:
            outcome = RoundOutcome(
                drafted=k,
                tested=int(verdict.tested.sum()) if k else 0,
                accepted=int(verdict.accepted.sum()),
                rows=B,
                all_accepted=k > 0 and bool((verdict.accepted == verdict.draft_lengths).all()),
                draft_s=t1 - t0,
                target_s=t2 - t1,
            )
        if hidden is not None:  # features of the pending token and the accepted drafts
            self.drafter.observe_features(hidden, batch.lengths - 1, verdict.accepted + 1)
        # keep pending + accepted drafts in the target cache; the new last token is pending
        kept = batch.lengths + verdict.accepted
        cache.rewind(kept)
        if self.drafter is not None:
            self.drafter.commit(kept)
        n_emit = verdict.num_emitted
        # live rows have lengths <= prompt + max_new - 1, so pos < capacity (see Batch)
        pos = batch.lengths.view(B, 1) + torch.arange(k + 1).view(1, k + 1)
        write = torch.arange(k + 1).view(1, k + 1) < n_emit.view(B, 1)
        batch.tokens.scatter_(1, pos, torch.where(write, verdict.tokens, batch.tokens.gather(1, pos)))
        batch.lengths = batch.lengths + n_emit
        event = self._emit(batch, verdict, draft_tokens, round_no, eos, state, (t1 - t0, t2 - t1))
        if outcome is not None:  # the whole round after drafting: forward, verification, bookkeeping
            outcome.round_s = time.perf_counter() - t1
            policy.observe(outcome)
        return event

    def _plain_round(
        self, batch: Batch, cache, policy, round_no: int, eos: torch.Tensor, state: dict, draft_s: float
    ) -> RoundEvent:
        """A round with nothing drafted (target-only decoding, or a policy that paused drafting):
        one target step and one token per row, with none of the verification machinery."""
        B = batch.size
        t1 = time.perf_counter()
        rows = torch.arange(B)
        pending = batch.tokens[rows, batch.lengths - 1].view(B, 1)
        out = self.target.forward(pending, cache, **self._hidden_kw)
        logits, hidden = out if self._needs_hidden else (out, None)  # [B, 1, V], [B, 1, d]
        t2 = time.perf_counter()
        if batch.warp.all_greedy:
            token = logits[:, 0].argmax(-1)
        else:
            token = sample(logits_to_probs(logits, batch.warp)[:, 0], batch.exp_noise(logits.shape[-1]))
        verdict = Verdict.plain(token)
        if self.drafter is not None:
            if hidden is not None:
                self.drafter.observe_features(hidden, batch.lengths - 1, verdict.num_emitted)
            self.drafter.commit(batch.lengths)
        batch.tokens[rows, batch.lengths] = token  # live rows have room (see Batch)
        batch.lengths = batch.lengths + 1
        event = self._emit(batch, verdict, verdict.tokens[:, :0], round_no, eos, state, (draft_s, t2 - t1))
        if policy is not None:
            policy.observe(RoundOutcome(0, 0, 0, B, False, draft_s, t2 - t1, time.perf_counter() - t1))
        return event

    def _tree_round(self, batch: Batch, cache, round_no: int, eos: torch.Tensor, state: dict) -> RoundEvent:
        """One round with a token tree: all candidates in one target forward, the accepted path
        kept in the cache. Reported like a chain whose drafts are the accepted path (plus the
        level where every candidate was rejected)."""
        B, tree = batch.size, self.tree
        t0 = time.perf_counter()
        nodes = self.drafter.propose_tree(batch, tree)  # [B, N]
        t1 = time.perf_counter()
        pending = batch.tokens.gather(1, (batch.lengths - 1).view(B, 1))
        base = cache.lengths.clone()  # the pending token's slot
        out = self.target.forward(
            torch.cat([pending, nodes], 1),
            cache,
            positions=base.view(B, 1) + tree.depths().view(1, -1),
            tree_mask=tree.mask(),
            **self._hidden_kw,
        )
        logits, hidden = out if self._needs_hidden else (out, None)  # [B, N + 1, V], [B, N + 1, d]
        t2 = time.perf_counter()
        greedy = batch.warp.all_greedy
        probs = None if greedy else logits_to_probs(logits, batch.warp)
        tv = verify_tree(
            tree,
            nodes,
            probs,
            logits,
            None if greedy else batch.uniforms(tree.size),
            None if greedy else batch.exp_noise(logits.shape[-1]),
        )
        accepted = torch.tensor([len(p) for p in tv.path])
        if hidden is not None:  # features along the accepted path: the root, then its nodes
            width = 1 + int(accepted.max())
            along = torch.tensor([[0, *p] + [0] * (width - 1 - len(p)) for p in tv.path])  # [B, width]
            path_hidden = hidden.gather(1, along.unsqueeze(-1).expand(B, width, hidden.shape[-1]))
            self.drafter.observe_features(path_hidden, batch.lengths - 1, accepted + 1)
        cache.keep_path(base, tv.path)
        cache.rewind(base + 1 + accepted)
        self.drafter.commit(batch.lengths + accepted)
        D = tree.depth
        tokens = torch.zeros(B, D + 1, dtype=torch.long)
        target_prob = torch.ones(B, D, dtype=torch.float64)
        src = probs if probs is not None else torch.softmax(logits.double(), -1)
        for b in range(B):
            tokens[b, : len(tv.tokens[b])] = torch.tensor(tv.tokens[b])
            parents = [0] + tv.path[b]
            for j in range(len(tv.path[b])):  # p of each accepted node's token at its parent
                target_prob[b, j] = float(src[b, parents[j], tokens[b, j]])
        n_drafts = (accepted + (~torch.tensor(tv.bonus)).long()).clamp(max=D)
        mask = torch.arange(D).view(1, D) < accepted.view(B, 1)
        verdict = Verdict(accepted, tokens, torch.ones(B, D), target_prob, target_prob, None, mask, n_drafts)
        pos = batch.lengths.view(B, 1) + torch.arange(D + 1).view(1, D + 1)
        write = torch.arange(D + 1).view(1, D + 1) < verdict.num_emitted.view(B, 1)
        batch.tokens.scatter_(1, pos, torch.where(write, tokens, batch.tokens.gather(1, pos)))
        batch.lengths = batch.lengths + verdict.num_emitted
        return self._emit(batch, verdict, tokens[:, :D], round_no, eos, state, (t1 - t0, t2 - t1))

    def _emit(
        self,
        batch: Batch,
        verdict: Verdict,
        draft_tokens: torch.Tensor,
        round_no: int,
        eos: torch.Tensor,
        state: dict,
        times: tuple[float, float],
    ) -> RoundEvent:
        """Apply the stop rules (max_new_tokens, EOS, stop strings) and record stats."""
        tokens = verdict.tokens.tolist()
        n_emit = verdict.num_emitted.tolist()
        accepted = verdict.accepted_mask.tolist()
        drafted = verdict.draft_lengths.tolist()
        rows = batch.rows.tolist()
        emitted, finished = [], []
        for i, row in enumerate(rows):
            p = batch.params[i]
            out = state["tokens"][row]
            new = tokens[i][: n_emit[i]][: p.max_new_tokens - len(out)]
            reason = None
            if eos.numel() and not p.ignore_eos:
                for j, t in enumerate(new):
                    if t in self.target.eos_token_ids:
                        new, reason = new[: j + 1], "eos"
                        break
            if p.stop and self.target.tokenizer is not None:
                new, stop_text = self._apply_stop(out, new, p.stop)
                if stop_text is not None:
                    reason, state["text"][row] = "stop", stop_text
            out.extend(new)
            if reason is None and len(out) >= p.max_new_tokens:
                reason = "length"
            if reason is not None:
                state["reason"][row] = reason
            emitted.append(new)
            finished.append(reason is not None)
            st = state["stats"][row]
            st.rounds += 1
            st.target_forwards += 1
            st.draft_s += times[0]
            st.target_s += times[1]
            kk = drafted[i]
            st.drafted += kk
            st.accepted += sum(accepted[i][:kk])
            st.tested += min(sum(accepted[i][:kk]) + 1, kk)  # accepted ones and the first rejection
            if len(st.position_drafted) < kk:
                pad = kk - len(st.position_drafted)
                st.position_drafted += [0] * pad
                st.position_accepted += [0] * pad
            for j in range(kk):
                st.position_drafted[j] += 1
                st.position_accepted[j] += accepted[i][j]
        return RoundEvent(round_no, rows, draft_tokens, verdict, emitted, finished)

    def _apply_stop(
        self, out: list[int], new: list[int], stops: tuple[str, ...]
    ) -> tuple[list[int], str | None]:
        """Cut new tokens after the one that completes a stop string; the text ends before it."""
        tok = self.target.tokenizer
        for j in range(len(new)):
            text = tok.decode(out + new[: j + 1])
            hits = [text.find(s) for s in stops if s in text]
            if hits:
                return new[: j + 1], text[: min(hits)]
        return new, None
