"""The HTTP side: FastAPI routes for OpenAI's completions and chat completions (streamed as
server-sent events or not), models, health and Prometheus metrics. Each handler validates its
request completely (schema, sampling, prompt length) before it is queued, so a bad request is a
400 with OpenAI's error shape and never reaches the engine loop."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import SpecDecodeError
from .loop import EngineLoop, Job, Update
from .protocol import APIError, ChatRequest, CompletionRequest, ErrorResponse
from .text import TextStream

ERRORS = {
    400: {"model": ErrorResponse, "description": "Bad request: the message says what is wrong"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    429: {"model": ErrorResponse, "description": "The queue is full"},
}
SSE = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}
DISTRIBUTION = "it would change the model's distribution, which the output follows exactly"
UNSUPPORTED = {
    "presence_penalty": DISTRIBUTION + " (only 0 is accepted)",
    "frequency_penalty": DISTRIBUTION + " (only 0 is accepted)",
    "logit_bias": DISTRIBUTION + " (only {} is accepted)",
    "echo": "the prompt is not returned (only false is accepted)",
    "best_of": "every sample is returned; use n (only 1 is accepted)",
    "suffix": "insertion is not supported (only an empty suffix is accepted)",
}


def create_app(
    engine: EngineLoop, model_id: str, max_model_len: int, default_max_tokens: int = 256
) -> FastAPI:
    app = FastAPI(
        title="specdecode",
        version="0.1.0",
        description="OpenAI-compatible server with exact speculative decoding and continuous batching.",
    )
    gen = engine.gen
    tok = gen.target.tokenizer
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_req, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, exc: StarletteHTTPException):  # unparsable body, unknown route, ...
        body = APIError(exc.status_code, str(exc.detail)).body()
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if loc and loc[0] in UNSUPPORTED:
            message = f"{loc[0]} is not supported: {UNSUPPORTED[loc[0]]}"
        else:
            message = (f"{param}: " if param else "") + str(err.get("msg"))
        return JSONResponse(APIError(400, message, param).body(), status_code=400)

    # -- checks shared by both endpoints --------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name not in (model_id, ""):
            raise APIError(
                404, f"model {name!r} is not served here; GET /v1/models lists {model_id!r}", "model"
            )

    def budget(prompt_ids: list[int], max_tokens: int | None) -> int:
        room = max_model_len - len(prompt_ids) - gen.width - 1
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {len(prompt_ids)} tokens; this server's context is {max_model_len} "
                "(--max-model-len), with room for at least one new token",
                "prompt",
            )
        if max_tokens is None:
            return min(default_max_tokens, room)
        if max_tokens > room:
            raise APIError(
                400,
                f"max_tokens = {max_tokens} with a {len(prompt_ids)}-token prompt exceeds this server's "
                f"context of {max_model_len} tokens (--max-model-len); ask for at most {room}",
                "max_tokens",
            )
        return max_tokens

    def encode(prompt) -> list[int]:
        try:
            return gen.encode(prompt)
        except SpecDecodeError as e:
            raise APIError(400, str(e), "prompt") from None

    def token_text(t: int) -> str:
        return tok.decode([t]) if tok is not None else str(t)

    def full_text(tokens: list[int]) -> str:
        return tok.decode(tokens) if tok is not None else ""

    def speculative(choices) -> dict:
        stats = [c.stats for c in choices if c.stats is not None]
        drafted = sum(s.drafted for s in stats)
        accepted = sum(s.accepted for s in stats)
        forwards = sum(s.target_forwards for s in stats)
        tokens = sum(len(c.tokens) for c in choices)
        width = max((len(s.position_drafted) for s in stats), default=0)
        pos_d = [
            sum(s.position_drafted[j] for s in stats if j < len(s.position_drafted)) for j in range(width)
        ]
        pos_a = [
            sum(s.position_accepted[j] for s in stats if j < len(s.position_accepted)) for j in range(width)
        ]
        return {
            "method": gen.method,
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "target_forwards": forwards,
            "mean_accepted_tokens_per_forward": tokens / forwards if forwards else None,
            "per_position_acceptance": [a / d if d else None for a, d in zip(pos_a, pos_d)],
        }

    def usage(job: Job) -> dict:
        n = sum(len(c.tokens) for c in job.choices)
        return {
            "prompt_tokens": len(job.prompt_ids),
            "completion_tokens": n,
            "total_tokens": len(job.prompt_ids) + n,
        }

    def final_text(c) -> str:
        return c.stop_text if c.stop_text is not None else full_text(c.tokens)

    # -- logprobs in each endpoint's shape --------------------------------------------------
    def completion_logprobs(tokens: list[int], lps: list, offset: int) -> dict:
        texts = [token_text(t) for t in tokens]
        offsets, pos = [], offset
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": texts,
            "token_logprobs": [lp for lp, _ in lps],
            "top_logprobs": [{token_text(a): v for a, v in top} for _, top in lps],
            "text_offset": offsets,
        }

    def chat_logprobs(tokens: list[int], lps: list) -> dict:
        def entry(t: int, lp: float) -> dict:
            s = token_text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return {
            "content": [
                {**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
                for t, (lp, top) in zip(tokens, lps)
            ]
        }

    # -- running a job --------------------------------------------------------------------
    async def submit(prompt_ids: list[int], params) -> Job:
        job = Job(prompt_ids, params, asyncio.get_running_loop())
        engine.submit(job)
        return job

    async def updates(job: Job, http: Request) -> AsyncIterator[Update]:
        """The job's updates until every choice's last one was read (not until job.done: the
        engine thread marks a choice done before its last update reaches this queue); cancels
        the job when the client goes away."""
        finished: set[int] = set()
        try:
            while len(finished) < len(job.params):
                try:
                    up = await asyncio.wait_for(job.queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
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

    async def collect(job: Job, http: Request) -> bool:
        """Wait for the whole job; False when the client left first."""
        async for _ in updates(job, http):
            pass
        return job.done

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def stream(job: Job, http: Request, chunk, include_usage: bool, head=None) -> AsyncIterator[str]:
        texts = [TextStream(p.stop) for p in job.params]
        # the tokens delivered so far, per choice: only what the updates carried (the engine
        # thread may already have appended the next round's tokens to job.choices)
        delivered: list[list[int]] = [[] for _ in job.params]
        try:
            if head is not None:
                for i in range(len(job.params)):
                    yield sse(head(i))
            async for up in updates(job, http):
                for i in sorted(set(up.tokens) | set(up.finished)):
                    c = job.choices[i]
                    fin = i in up.finished
                    delivered[i] += up.tokens.get(i, [])
                    text = final_text(c) if fin else full_text(delivered[i])
                    delta = texts[i].delta(text, fin)
                    toks, lps = up.tokens.get(i, []), up.logprobs.get(i)
                    if delta or fin or lps:
                        yield sse(chunk(i, delta, toks, lps, c.finish_reason if fin else None, texts[i]))
            if include_usage:
                yield sse(
                    chunk(None, "", [], None, None, None)
                    | {"usage": usage(job)}
                    | {"speculative": speculative(job.choices)}
                )
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield sse(e.body())

    def reason(c) -> str:
        return {"eos": "stop", "stop": "stop", "length": "length"}.get(
            c.finish_reason, c.finish_reason or "stop"
        )

    # -- routes ---------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            "running_requests": len(engine.requests),
            "waiting_requests": len(engine.waiting),
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_id,
                    "object": "model",
                    "created": created,
                    "owned_by": "specdecode",
                    "max_model_len": max_model_len,
                }
            ],
        }

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", responses={**ERRORS, **SSE})
    async def completions(body: CompletionRequest, http: Request):
        check_model(body.model)
        prompt = (
            body.prompt[0]
            if isinstance(body.prompt, list) and isinstance(body.prompt[0], str)
            else body.prompt
        )
        ids = encode(prompt)
        params = body.params(budget(ids, body.max_tokens), body.logprobs)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        job = await submit(ids, params)
        base = {"id": rid, "object": "text_completion", "created": now, "model": model_id}

        if body.stream:

            def chunk(i, delta, toks, lps, fin, ts):
                if i is None:
                    return {**base, "choices": []}
                logprobs = None
                if lps is not None:
                    logprobs = completion_logprobs(toks, lps, len(ts.sent) - len(delta))
                choice = {
                    "index": i,
                    "text": delta,
                    "logprobs": logprobs,
                    "finish_reason": reason(job.choices[i]) if fin else None,
                }
                return {**base, "choices": [choice]}

            include = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream(job, http, chunk, include), media_type="text/event-stream")
        if not await collect(job, http):
            return Response(status_code=499)
        choices = []
        for i, c in enumerate(job.choices):
            lp = completion_logprobs(c.tokens, c.logprobs, 0) if body.logprobs is not None else None
            choices.append({"index": i, "text": final_text(c), "logprobs": lp, "finish_reason": reason(c)})
        return {**base, "choices": choices, "usage": usage(job), "speculative": speculative(job.choices)}

    @app.post("/v1/chat/completions", responses={**ERRORS, **SSE})
    async def chat(body: ChatRequest, http: Request):
        check_model(body.model)
        if tok is None or tok.chat_template is None:
            raise APIError(400, f"{model_id} has no chat template; use /v1/completions", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = encode(messages)
        if body.max_tokens is not None:  # checked even when max_completion_tokens wins
            budget(ids, body.max_tokens)
        max_tokens = budget(ids, body.max_completion_tokens or body.max_tokens)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.params(max_tokens, logprobs)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        job = await submit(ids, params)
        base = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_id}

        if body.stream:

            def head(i):
                delta = {"role": "assistant", "content": ""}
                return {
                    **base,
                    "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}],
                }

            def chunk(i, delta, toks, lps, fin, _ts):
                if i is None:
                    return {**base, "choices": []}
                logprobs = chat_logprobs(toks, lps) if lps is not None else None
                choice = {
                    "index": i,
                    "delta": {"content": delta} if delta else {},
                    "logprobs": logprobs,
                    "finish_reason": reason(job.choices[i]) if fin else None,
                }
                return {**base, "choices": [choice]}

            include = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream(job, http, chunk, include, head), media_type="text/event-stream")
        if not await collect(job, http):
            return Response(status_code=499)
        choices = []
        for i, c in enumerate(job.choices):
            lp = chat_logprobs(c.tokens, c.logprobs) if body.logprobs else None
            msg = {"role": "assistant", "content": final_text(c)}
            choices.append({"index": i, "message": msg, "logprobs": lp, "finish_reason": reason(c)})
        return {
            **base,
            "object": "chat.completion",
            "choices": choices,
            "usage": usage(job),
            "speculative": speculative(job.choices),
        }

    def openapi() -> dict:
        """The schema, with this server's limits: max_tokens within the context, n within
        --max-batch, token ids within the vocabulary."""
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            _json_schema_bounds(schema)
            comps = schema["components"]["schemas"]
            for name in ("CompletionRequest", "ChatRequest"):
                for field in ("max_tokens", "max_completion_tokens"):
                    for alt in comps[name]["properties"].get(field, {}).get("anyOf", []):
                        if alt.get("type") == "integer":
                            alt["maximum"] = max_model_len - gen.width - 2
            for name in ("CompletionRequest", "ChatRequest"):
                n = comps[name]["properties"]["n"]
                n["maximum"] = min(n.get("maximum", 16), engine.max_batch)
            for alt in comps["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
                if alt.get("type") == "array" and alt["items"].get("type") == "integer":
                    alt["items"].update(minimum=0, maximum=gen.target.vocab_size - 1)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    # the web lab (/lab) beside the API; kept out of the schema above
    try:
        from ..lab.web import mount_lab
    except ImportError:  # the lab extra (rich, scipy) is not installed: serve the API alone
        return app
    mount_lab(app, in_schema=False)
    return app


BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _json_schema_bounds(node) -> None:
    """Pydantic writes a bound on a type with a before-validator (protocol.Int, Float) under its
    own name (ge, le, ...); rename those to JSON Schema's (minimum, maximum, ...)."""
    if isinstance(node, dict):
        if node.get("type") in ("integer", "number"):
            for ours, theirs in BOUNDS.items():
                if ours in node:
                    node[theirs] = node.pop(ours)
        for v in node.values():
            _json_schema_bounds(v)
    elif isinstance(node, list):
        for v in node:
            _json_schema_bounds(v)
