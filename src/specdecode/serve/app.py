"""The HTTP side: FastAPI routes for OpenAI's completions and chat completions (streamed as
server-sent events or not), models, health and Prometheus metrics. Each handler validates its
request completely (schema, sampling, prompt length) before it is queued, so a bad request is a
400 with OpenAI's error shape and never reaches the engine loop."""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from .loop import EngineLoop, Job
from .protocol import APIError, ChatRequest, CompletionRequest, ErrorResponse
from .requests import Admission
from .responses import Shape, collect, stream

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
    engine: EngineLoop,
    model_id: str,
    max_model_len: int,
    default_max_tokens: int = 256,
    sampling_rule: str = "auto",
) -> FastAPI:
    """The FastAPI app: routes only; checks live in requests.Admission, shaping in responses."""
    app = FastAPI(
        title="specdecode",
        version="0.1.0",
        description="OpenAI-compatible server with exact speculative decoding and continuous batching.",
    )
    gen = engine.gen
    admit = Admission(gen, model_id, max_model_len, default_max_tokens, sampling_rule)
    created = int(time.time())
    _errors(app)

    async def respond(body, http: Request, ids: list[int], params, chat: bool, with_logprobs: bool):
        job = Job(ids, params, asyncio.get_running_loop())
        engine.submit(job)
        shape = Shape(gen.target.tokenizer, model_id, gen.method, chat)
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            events = stream(engine, job, http.is_disconnected, shape, include)
            return StreamingResponse(events, media_type="text/event-stream")
        if not await collect(engine, job, http.is_disconnected):
            return Response(status_code=499)
        return shape.body(job, with_logprobs)

    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            "running_requests": len(engine.requests),
            "waiting_requests": len(engine.waiting),
        }

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_id, "object": "model", "created": created, "owned_by": "specdecode"}
        return {"object": "list", "data": [{**card, "max_model_len": max_model_len}]}

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", responses={**ERRORS, **SSE})
    async def completions(body: CompletionRequest, http: Request):
        ids, params = admit.completion(body)
        return await respond(body, http, ids, params, chat=False, with_logprobs=body.logprobs is not None)

    @app.post("/v1/chat/completions", responses={**ERRORS, **SSE})
    async def chat(body: ChatRequest, http: Request):
        ids, params = admit.chat(body)
        return await respond(body, http, ids, params, chat=True, with_logprobs=bool(body.logprobs))

    app.openapi = lambda: _openapi(app, admit.max_tokens, engine.max_batch, gen.target.vocab_size)
    try:  # the web lab (/lab) beside the API; kept out of the schema
        from ..lab.web import mount_lab
    except ImportError:  # the lab extra (rich, scipy) is not installed: serve the API alone
        return app
    mount_lab(app, in_schema=False)
    return app


def _errors(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours (APIError), HTTP ones and schema violations (400)."""

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


def _openapi(app: FastAPI, max_tokens: int, max_batch: int, vocab_size: int) -> dict:
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
                        alt["maximum"] = max_tokens
            n = comps[name]["properties"]["n"]
            n["maximum"] = min(n.get("maximum", 16), max_batch)
        for alt in comps["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
            if alt.get("type") == "array" and alt["items"].get("type") == "integer":
                alt["items"].update(minimum=0, maximum=vocab_size - 1)
        app.openapi_schema = schema
    return app.openapi_schema


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
