"""After a round is verified: the stop rules (max_new_tokens, end-of-text, stop strings), the
per-row stats, and the trace (one RoundRecord per row per round)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..core.sampling import SamplingParams
from ..models.tokenizer import TextTokenizer
from .stats import HOW, GenerationStats, RoundRecord
from .verify import Verdict


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only
    stats: GenerationStats
    finish_reason: str  # "length", "eos", "stop" or "abort"
    # with SamplingParams.logprobs: per generated token (its logprob, [(alternative id, logprob), ...])
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class RowOutput:
    """One row's output so far (a row keeps its id, its index in results(), for good)."""

    params: SamplingParams
    started: float  # perf_counter when the row's prefill began
    tokens: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    reason: str | None = None  # set when the row finishes
    text: str | None = None  # the text cut before a stop string
    ended: float | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)

    def result(self, tokenizer: TextTokenizer | None) -> GenerationResult:
        st = self.stats
        st.new_tokens = len(self.tokens)
        st.wall_s = (self.ended or time.perf_counter()) - self.started
        text = self.text
        if text is None:
            text = tokenizer.decode(self.tokens) if tokenizer is not None else ""
        logprobs = list(self.logprobs) if self.params.logprobs is not None else None
        return GenerationResult(text, list(self.tokens), st, self.reason or "length", logprobs)


@dataclass
class RoundEvent:
    """One round for every live row: the whole verdict, and what each row emitted."""

    round: int
    rows: list[int]  # row id (index in results()) per live row
    draft_tokens: torch.Tensor  # [B, k]
    verdict: Verdict
    emitted: list[list[int]]  # per live row, after stop rules
    finished: list[bool]
    # False: first tokens sampled from the prefill's logits (Generation's `first`): no round's
    # forward, and `rows` are only the rows just admitted
    forward: bool = True

    def records(self) -> list[RoundRecord]:
        """Trace lines (docs/contract.md): positions after the first rejection have uniform None."""
        v = self.verdict
        tested = v.tested.tolist()
        drafted = v.draft_lengths.tolist()
        accepted, mask = v.accepted.tolist(), v.accepted_mask.tolist()
        bonus = v.bonus.tolist()
        draft_tokens = self.draft_tokens.tolist()
        draft_prob, target_prob, accept_prob = (
            v.draft_prob.tolist(),
            v.target_prob.tolist(),
            v.accept_prob.tolist(),
        )
        uniforms = v.uniforms.tolist() if v.uniforms is not None else None
        out = []
        for i, row in enumerate(self.rows):
            a, d = accepted[i], drafted[i]  # the row's own drafts: the first d positions
            n = len(self.emitted[i])
            how = ["accepted"] * min(a, n) + ([HOW[2] if bonus[i] else HOW[1]] if n > a else [])
            uni = uniforms[i] if uniforms is not None else [None] * len(tested[i])
            out.append(
                RoundRecord(
                    row=row,
                    round=self.round,
                    draft_token_ids=draft_tokens[i][:d],
                    draft_prob=draft_prob[i][:d],
                    target_prob=target_prob[i][:d],
                    accept_prob=accept_prob[i][:d],
                    uniform=[u if t else None for u, t in zip(uni[:d], tested[i][:d])],
                    accepted=mask[i][:d],
                    emitted_token_ids=self.emitted[i],
                    how=how,
                )
            )
        return out


def emit(
    outputs: list[RowOutput],
    row_ids: list[int],
    verdict: Verdict,
    eos_ids: tuple[int, ...],
    tokenizer: TextTokenizer | None,
    times: tuple[float, float],
    logprobs: list | None = None,
    forward: bool = True,
) -> tuple[list[list[int]], list[bool]]:
    """Append each row's verified tokens to its output under the stop rules, and count its
    stats; return what each row emitted and whether it finished. logprobs: per row, those of
    its verified tokens (None for rows that asked for none), cut like the tokens. forward=False:
    the tokens came from the prefill's forward (not a decoding forward: not counted as one)."""
    tokens = verdict.tokens.tolist()
    n_emit = verdict.num_emitted.tolist()
    accepted = verdict.accepted.tolist()
    drafted = verdict.draft_lengths.tolist()
    emitted, finished = [], []
    now = time.perf_counter()
    for i, row in enumerate(row_ids):
        out = outputs[row]
        p = out.params
        new = tokens[i][: n_emit[i]][: p.max_new_tokens - len(out.tokens)]
        reason = None
        if eos_ids and not p.ignore_eos:
            for j, t in enumerate(new):
                if t in eos_ids:
                    new, reason = new[: j + 1], "eos"
                    break
        if p.stop and tokenizer is not None:
            new, stop_text = _apply_stop(tokenizer, out.tokens, new, p.stop)
            if stop_text is not None:
                reason, out.text = "stop", stop_text
        out.tokens.extend(new)
        if logprobs is not None and logprobs[i] is not None:
            out.logprobs.extend(logprobs[i][: len(new)])
        if reason is None and len(out.tokens) >= p.max_new_tokens:
            reason = "length"
        if reason is not None:
            out.reason, out.ended = reason, now
        emitted.append(new)
        finished.append(reason is not None)
        _count(out.stats, drafted[i], accepted[i], times, forward)
    return emitted, finished


def _count(
    st: GenerationStats, drafted: int, accepted: int, times: tuple[float, float], forward: bool = True
) -> None:
    st.rounds += 1
    st.target_forwards += forward
    st.draft_s += times[0]
    st.target_s += times[1]
    st.drafted += drafted
    st.accepted += accepted
    st.tested += min(accepted + 1, drafted)  # accepted ones and the first rejection
    if len(st.position_drafted) < drafted:
        pad = drafted - len(st.position_drafted)
        st.position_drafted += [0] * pad
        st.position_accepted += [0] * pad
    for j in range(drafted):
        st.position_drafted[j] += 1
        st.position_accepted[j] += j < accepted


def _apply_stop(
    tokenizer: TextTokenizer, out: list[int], new: list[int], stops: tuple[str, ...]
) -> tuple[list[int], str | None]:
    """Cut new tokens after the one that completes a stop string; the text ends before it."""
    for j in range(len(new)):
        text = tokenizer.decode(out + new[: j + 1])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return new[: j + 1], text[: min(hits)]
    return new, None


def token_logprobs(logits: torch.Tensor, verdict: Verdict, params: list[SamplingParams]) -> list | None:
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
