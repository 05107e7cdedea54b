"""The FastAPI application: routes, the OpenAI error object for every refusal, streaming.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET
/metrics. A request is parsed and checked on the event loop (a bad one costs no decoder time),
queued on the engine, and answered from the job's events: all at once, or as server-sent events.
A client that goes away cancels its job (stopped at the next token, or skipped while queued).
In front of the routes: the API key (auth.py), then the body's size (body.py).
"""
from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .auth import ApiKeyAuth
from .body import BodyLimit
from .engine import Engine, Job
from .limits import Limits
from .openai_api import (
    ChunkWriter,
    Defaults,
    chat_job,
    chat_response,
    completion_job,
    completion_response,
    new_id,
)
from .schemas import ApiError, ChatRequest, CompletionRequest


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _outcome(status: int) -> str:
    return "rejected" if status == 503 else "bad_request" if status < 500 else "error"


async def _parse(request: Request, model):
    """The body as `model`, or ApiError 400 naming the field, the value and the rule."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e}); send a JSON object") \
            from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body is a JSON {type(data).__name__}; send an object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            raise ApiError(400, f"Unrecognized request argument supplied: {loc}", loc) from None
        msg = err["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{loc}: {msg}" if loc and not msg.startswith(loc) else msg,
                       loc or None) from None


def create_app(engine: Engine, tokenizer, defaults: Defaults, limits: Limits | None = None,
               api_key: str | None = None, key_all_routes: bool = False) -> FastAPI:
    """The app over a started engine (model loaded, graphs captured). limits: bodies over
    limits.max_request_bytes are refused (413) while they are read (the other bounds are the
    connection's: connection.bounded_protocol); api_key: every route but /health and /metrics
    (all, with key_all_routes) answers 401 without `Authorization: Bearer <api_key>`."""
    app = FastAPI(title="dsv4", docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)
    _add_info_routes(app, engine, defaults)
    _add_generation_routes(app, _Generation(engine, tokenizer, defaults))
    # the middleware added last runs first: the key is checked before a byte of the body is read
    if limits is not None:
        app.add_middleware(BodyLimit, max_bytes=limits.max_request_bytes,
                           on_refuse=engine.metrics.refuse)
    if api_key is not None:
        app.add_middleware(ApiKeyAuth, key=api_key, all_routes=key_all_routes,
                           on_refuse=engine.metrics.refuse)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal as the OpenAI error object, an unknown route naming the routes there are."""
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: "
                                        f"{exc.detail} (routes: POST /v1/chat/completions, POST "
                                        f"/v1/completions, GET /v1/models, /health, /metrics)"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return _error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                                        kind="server_error"))


def _add_info_routes(app: FastAPI, engine: Engine, defaults: Defaults) -> None:
    """GET /health, /v1/models, /v1/models/{name}, /metrics."""
    created = int(time.time())

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return _error_response(ApiError(503, engine.problem, kind="server_error"))
        return {"status": "ok", "waiting": engine.waiting, "running": int(engine.busy)}

    def _model_card() -> dict:
        return {"id": defaults.model, "object": "model", "created": created, "owned_by": "dsv4",
                "max_model_len": defaults.max_seq_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != defaults.model:
            raise ApiError(404, f"The model `{name}` does not exist: this server serves "
                                f"`{defaults.model}`", "model", code="model_not_found")
        return _model_card()

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")


def _add_generation_routes(app: FastAPI, gen: "_Generation") -> None:
    """POST /v1/chat/completions, /v1/completions."""
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await gen.serve(request, "chat", ChatRequest, chat_job, chat_response)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await gen.serve(request, "completions", CompletionRequest, completion_job,
                               completion_response)


class _Generation:
    """A generation request from its body to its answer: parsed and checked on the event loop,
    queued on the engine, answered from the job's events (all at once, or as server-sent events),
    cancelled when its client goes away; its outcome counted in the metrics."""

    def __init__(self, engine: Engine, tokenizer, defaults: Defaults):
        self.engine, self.tokenizer, self.defaults = engine, tokenizer, defaults
        self.metrics = engine.metrics

    async def serve(self, request: Request, endpoint: str, parse_model, make_job, respond):
        try:
            req = await _parse(request, parse_model)
            # off the event loop: a prompt's encoding, a schema's compilation take time
            job = await asyncio.to_thread(make_job, req, self.tokenizer, self.defaults,
                                          asyncio.get_running_loop())
            self.engine.submit(job)
        except ApiError as err:
            self.metrics.request(endpoint, _outcome(err.status))
            raise
        except Exception:
            self.metrics.request(endpoint, "error")
            raise
        rid = new_id("chatcmpl" if endpoint == "chat" else "cmpl")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            writer = ChunkWriter(job, rid, self.defaults.model, endpoint == "chat", include_usage)
            return StreamingResponse(self._stream(request, job, writer, endpoint),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        deltas = await self._collect(request, job, endpoint)
        self.metrics.request(endpoint, "cancelled" if job.finish == "cancelled" else "ok")
        return respond(job, deltas, rid, self.defaults.model, req.return_token_ids)

    async def _collect(self, request: Request, job: Job, endpoint: str) -> list:
        """The job's deltas, once it is done (ApiError if it failed)."""
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            deltas = []
            while True:
                kind, payload = await job.events.get()
                if kind == "deltas":
                    deltas += payload
                elif kind == "error":
                    self.metrics.request(endpoint, _outcome(payload.status))
                    raise payload
                else:
                    return deltas
        finally:
            watcher.cancel()
            job.cancel.set()                  # a no-op once done; stops it if we were cancelled

    async def _stream(self, request: Request, job: Job, writer: ChunkWriter, endpoint: str):
        outcome = "cancelled"
        # a stream that waits in the queue sends nothing, so a failed send cannot tell that its
        # client left: watch the connection too
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            yield writer.start()
            while True:
                kind, payload = await job.events.get()
                if kind == "deltas":
                    yield writer.deltas(payload)
                elif kind == "error":
                    outcome = _outcome(payload.status)
                    yield ChunkWriter.error(payload)
                    return
                else:
                    outcome = "cancelled" if job.finish == "cancelled" else "ok"
                    yield writer.end()
                    return
        finally:
            watcher.cancel()
            job.cancel.set()                  # the client went away: stop at the next token
            self.metrics.request(endpoint, outcome)


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client disconnects (the body is read: the next message is the
    disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            job.cancel.set()
            return
