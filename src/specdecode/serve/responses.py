"""Response shaping, one path for both endpoints: a `Shape` says how a completion or a chat
completion writes a choice, a streamed chunk and logprobs; `collect` and `stream` turn a job's
updates into the JSON body or the server-sent events. Usage and the `speculative` object come
from the engine's own stats (GenerationStats.merge)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from ..engine.stats import GenerationStats
from .loop import Choice, EngineLoop, Job, Update
from .protocol import APIError
from .text import TextStream

REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def reason(c: Choice) -> str:
    return REASONS.get(c.finish_reason, c.finish_reason or "stop")


def speculative(method: str | None, job: Job) -> dict:
    """The per-request `speculative` object, from the merged stats of its choices, and the
    sampling rule that ran (greedy: the same tokens under either rule)."""
    choices = job.choices
    s = GenerationStats.merge([c.stats for c in choices if c.stats is not None], 0.0)
    tokens = sum(len(c.tokens) for c in choices)
    params = job.params[0]
    return {
        "method": method,
        "sampling_rule": "greedy" if params.greedy else params.sampling_rule,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "acceptance_rate": s.accepted / s.drafted if s.drafted else None,
        "target_forwards": s.target_forwards,
        "mean_accepted_tokens_per_forward": tokens / s.target_forwards if s.target_forwards else None,
        "per_position_acceptance": [
            a / d if d else None for a, d in zip(s.position_accepted, s.position_drafted)
        ],
    }


def usage(job: Job) -> dict:
    n = sum(len(c.tokens) for c in job.choices)
    return {
        "prompt_tokens": len(job.prompt_ids),
        "completion_tokens": n,
        "total_tokens": len(job.prompt_ids) + n,
    }


class Shape:
    """How one endpoint writes its responses; `chat` picks chat.completion over text_completion."""

    def __init__(self, tokenizer, model_id: str, method: str | None, chat: bool) -> None:
        self.tok, self.method, self.chat = tokenizer, method, chat
        prefix, obj = ("chatcmpl", "chat.completion.chunk") if chat else ("cmpl", "text_completion")
        self.base = {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": obj,
            "created": int(time.time()),
            "model": model_id,
        }

    def token_text(self, t: int) -> str:
        return self.tok.decode([t]) if self.tok is not None else str(t)

    def text(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens) if self.tok is not None else ""

    def final_text(self, c: Choice) -> str:
        return c.stop_text if c.stop_text is not None else self.text(c.tokens)

    def logprobs(self, tokens: list[int], lps: list, offset: int = 0) -> dict:
        if self.chat:

            def entry(t: int, lp: float) -> dict:
                s = self.token_text(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

            return {
                "content": [
                    {**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
                    for t, (lp, top) in zip(tokens, lps)
                ]
            }
        texts = [self.token_text(t) for t in tokens]
        offsets, pos = [], offset
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": texts,
            "token_logprobs": [lp for lp, _ in lps],
            "top_logprobs": [{self.token_text(a): v for a, v in top} for _, top in lps],
            "text_offset": offsets,
        }

    def body(self, job: Job, with_logprobs: bool) -> dict:
        """The whole (non-streamed) response."""
        choices = []
        for i, c in enumerate(job.choices):
            lp = self.logprobs(c.tokens, c.logprobs) if with_logprobs else None
            content = self.final_text(c)
            what = {"message": {"role": "assistant", "content": content}} if self.chat else {"text": content}
            choices.append({"index": i, **what, "logprobs": lp, "finish_reason": reason(c)})
        obj = {"object": "chat.completion"} if self.chat else {}
        return {
            **self.base,
            **obj,
            "choices": choices,
            "usage": usage(job),
            "speculative": speculative(self.method, job),
        }

    def head(self, i: int) -> dict | None:
        """A chat stream's first chunk per choice (the assistant role); None for completions."""
        if not self.chat:
            return None
        delta = {"role": "assistant", "content": ""}
        return {
            **self.base,
            "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}],
        }

    def chunk(self, i: int, c: Choice, delta: str, toks: list[int], lps, fin: bool, sent: str) -> dict:
        logprobs = None
        if lps is not None:
            logprobs = self.logprobs(toks, lps, len(sent) - len(delta))
        what = {"delta": {"content": delta} if delta else {}} if self.chat else {"text": delta}
        choice = {"index": i, **what, "logprobs": logprobs, "finish_reason": reason(c) if fin else None}
        return {**self.base, "choices": [choice]}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def updates(engine: EngineLoop, job: Job, is_disconnected) -> AsyncIterator[Update]:
    """The job's updates until every choice's last one was read (not until job.done: the engine
    thread marks a choice done before its last update reaches this queue); cancels the job when
    the client goes away."""
    finished: set[int] = set()
    try:
        while len(finished) < len(job.params):
            try:
                up = await asyncio.wait_for(job.queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await is_disconnected():
                    engine.cancel(job)
                    return
                continue
            if up.error is not None:
                raise up.error
            finished.update(up.finished)
            yield up
    finally:
        if len(finished) < len(job.params):
            engine.cancel(job)


async def collect(engine: EngineLoop, job: Job, is_disconnected) -> bool:
    """Wait for the whole job; False when the client left first."""
    async for _ in updates(engine, job, is_disconnected):
        pass
    return job.done


async def stream(
    engine: EngineLoop, job: Job, is_disconnected, shape: Shape, include_usage: bool
) -> AsyncIterator[str]:
    """The server-sent events of a job: each round's text per choice (stop strings held back
    until they cannot start), then usage if asked, then [DONE]."""
    texts = [TextStream(p.stop) for p in job.params]
    # the tokens delivered so far, per choice: only what the updates carried (the engine
    # thread may already have appended the next round's tokens to job.choices)
    delivered: list[list[int]] = [[] for _ in job.params]
    try:
        for i in range(len(job.params)):
            if (head := shape.head(i)) is not None:
                yield sse(head)
        async for up in updates(engine, job, is_disconnected):
            for i in sorted(set(up.tokens) | set(up.finished)):
                c = job.choices[i]
                fin = i in up.finished
                delivered[i] += up.tokens.get(i, [])
                text = shape.final_text(c) if fin else shape.text(delivered[i])
                delta = texts[i].delta(text, fin)
                toks, lps = up.tokens.get(i, []), up.logprobs.get(i)
                if delta or fin or lps:
                    yield sse(shape.chunk(i, c, delta, toks, lps, fin, texts[i].sent))
        if include_usage:
            yield sse(
                {
                    **shape.base,
                    "choices": [],
                    "usage": usage(job),
                    "speculative": speculative(shape.method, job),
                }
            )
        yield "data: [DONE]\n\n"
    except APIError as e:
        yield sse(e.body())
