"""The web lab: the lessons' interactive experiments in the browser, on the live engine.

`lab_router()` gives the page (GET /lab), its static files (/lab/static/...) and the JSON/SSE
API (/lab/api/...); `specdecode serve` includes it, and `specdecode lab serve` serves it alone
(`create_lab_app`). No JavaScript build step and no library: the page is plain HTML, CSS and
one script, with its charts drawn as SVG, so it works offline."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...errors import SpecDecodeError
from .api import (
    DistRequest,
    FormulaRequest,
    GenerateRequest,
    Lab,
    MeasuredRequest,
    ReplayRequest,
    RooflineRequest,
    RoundRequest,
    SampleRequest,
)

STATIC = Path(__file__).parent / "static"


def error(status: int, message: str) -> JSONResponse:
    """OpenAI's error shape, as the server's own endpoints answer."""
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    return JSONResponse(body, status_code=status)


def lab_router(lab: Lab | None = None, in_schema: bool = True) -> APIRouter:
    """The lab's routes; in_schema=False keeps them out of the OpenAPI schema (the server's
    schema describes its OpenAI API only)."""
    lab = lab or Lab()
    router = APIRouter(include_in_schema=in_schema)

    async def call(fn, req):
        def locked():
            with lab.lock:
                return fn(req)

        try:
            return await run_in_threadpool(locked)
        except SpecDecodeError as e:
            return error(400, str(e))

    @router.get("/lab", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html")

    @router.get("/lab/api/presets", tags=["lab"])
    async def presets():
        return lab.presets()

    @router.post("/lab/api/roofline", tags=["lab"])
    async def roofline(req: RooflineRequest):
        return await call(lab.roofline, req)

    @router.post("/lab/api/rules/dist", tags=["lab"])
    async def dist(req: DistRequest):
        return await call(lab.dist, req)

    @router.post("/lab/api/rules/round", tags=["lab"])
    async def one_round(req: RoundRequest):
        return await call(lab.round, req)

    @router.post("/lab/api/rules/sample", tags=["lab"])
    async def sample(req: SampleRequest):
        return await call(lab.sample, req)

    @router.post("/lab/api/replay", tags=["lab"])
    async def replay(req: ReplayRequest):
        return await call(lab.replay, req)

    @router.post("/lab/api/formula", tags=["lab"])
    async def formula(req: FormulaRequest):
        return lab.formula(req)  # arithmetic only: no lock, no thread

    @router.post("/lab/api/measured", tags=["lab"])
    async def measured(req: MeasuredRequest):
        return await call(lab.measured, req)

    @router.post("/lab/api/generate", tags=["lab"])
    async def generate(req: GenerateRequest):
        """Server-sent events: one `data:` JSON per round, then a 'done' event (or 'error')."""
        # check the request before the stream starts, so a bad one is a plain 400
        checked = await call(lab.generate_prompt, req)
        if isinstance(checked, JSONResponse):
            return checked

        def events():
            with lab.lock:
                try:
                    for ev in lab.generate(req):
                        yield f"data: {json.dumps(ev, ensure_ascii=False)}\n\n"
                except SpecDecodeError as e:
                    yield f"data: {json.dumps({'phase': 'error', 'message': str(e)})}\n\n"

        return StreamingResponse(iterate_in_threadpool(events()), media_type="text/event-stream")

    return router


def mount_lab(app: FastAPI, lab: Lab | None = None, in_schema: bool = True) -> None:
    app.include_router(lab_router(lab, in_schema))
    app.mount("/lab/static", StaticFiles(directory=STATIC), name="lab-static")


def create_lab_app() -> FastAPI:
    """The lab on its own (`specdecode lab serve`): / redirects to /lab."""
    app = FastAPI(title="specdecode lab", version="0.1.0", description="The lessons' experiments, live.")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        return error(400, (f"{loc}: " if loc else "") + str(err.get("msg")))

    @app.get("/", include_in_schema=False)
    async def root():
        return RedirectResponse("/lab")

    mount_lab(app)
    return app
