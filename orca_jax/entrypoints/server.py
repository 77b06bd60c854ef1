"""OpenAI-compatible HTTP server (FastAPI on uvicorn).

    POST /v1/completions, POST /v1/chat/completions   (streamed as server-sent events on request)
    GET  /v1/models, /health (HEAD too), /metrics      (Prometheus text format)

What makes it safe to leave running:
- every error is an OpenAI-style body with the right status: 400 for any bad input (naming the
  field), 404 for an unknown model, 401 without the API key, 413 for an oversized body, 503
  with Retry-After when the waiting queue is full, 500 for a request that failed inside a step
  (the others carry on); no value a client sends can fail another client's request;
- a client that goes away has its requests aborted, so their KV pages return to the pool;
- the API key is compared in constant time and guards /v1/* (health and metrics stay open for
  probes and scrapers); the server binds to 127.0.0.1 unless told otherwise;
- SIGINT/SIGTERM abort the live requests first, so streams end at once and the process exits
  instead of waiting for every generation to run to its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import importlib.metadata
import re
import logging
import signal
import time
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from orca_jax.engine.async_engine import AsyncLLMEngine
from orca_jax.engine.data_parallel import DataParallelAsyncEngine
from orca_jax.engine.router import PrefixAffinityRouter, default_slack
from orca_jax.engine.engine import LLMEngine
from orca_jax.entrypoints.metrics import ServerMetrics
from orca_jax.entrypoints.openai_serving import EventStream, OpenAIServing
from orca_jax.errors import RequestError
from orca_jax.entrypoints.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, OpenAIError,
                                           TokenizeRequest, error_body, parse_request,
                                           request_error_to_openai)
from orca_jax.entrypoints.reasoning_parsers import reasoning_parser
from orca_jax.entrypoints.tool_parsers import get_tool_parser

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
# Prompts queued (not yet running) before new ones get 503. Each queued prompt costs only its token
# ids, so the bound is about back-pressure, not memory; it is high enough that one request with
# a few thousand prompts (an offline batch sent over HTTP) is admitted whole.
DEFAULT_MAX_WAITING_REQUESTS = 4096


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # Tool calling (orca_jax.entrypoints.chat_tools): tool_choice "auto" needs both, as in vLLM.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # --reasoning-parser (orca_jax.entrypoints.reasoning_parsers): a thinking model's reasoning
    # in the message's `reasoning` field, apart from its content.
    reasoning_parser: str | None = None
    # --chat-template (the template's text, or a file holding it) and
    # --default-chat-template-kwargs (template variables every chat request starts from).
    chat_template: str | None = None
    default_chat_template_kwargs: dict | None = None
    # CORS (--allowed-origins / --allowed-methods / --allowed-headers, as vLLM's): None sends no
    # CORS headers at all, so browsers keep their same-origin rule.
    allowed_origins: list[str] | None = None
    allowed_methods: list[str] | None = None
    allowed_headers: list[str] | None = None
    # --enable-request-id-headers: a client's X-Request-Id names its request (in the engine, the
    # log and the response's id) and is echoed back in the response's X-Request-Id.
    enable_request_id_headers: bool = False
    enable_log_requests: bool = False  # --enable-log-requests: one log line per request
    max_log_len: int | None = None  # --max-log-len: log this many characters of each prompt

    def __post_init__(self):
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.tool_call_parser is not None:
            parser = get_tool_parser(self.tool_call_parser)  # an unknown name fails at start, listing the known ones
            needed = getattr(parser, "requires_reasoning_parser", None)
            if needed is not None and self.reasoning_parser != needed:
                raise ValueError(f"--tool-call-parser {self.tool_call_parser} reads the output that "
                                 f"--reasoning-parser {needed} splits; pass both")
        reasoning_parser(self.reasoning_parser)  # the same for the reasoning parser

    @property
    def auto_tool_parser(self) -> str | None:
        return self.tool_call_parser if self.enable_auto_tool_choice else None


# ---- ASGI guards (before routing, so they also cover bodies FastAPI never reads) ---------------
def _error_response(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, None, code), status_code=status, headers=headers)


class RequireApiKey:
    """401 for /v1/* requests without `Authorization: Bearer <key>`. The scheme is matched
    without regard to case, as HTTP auth schemes are (RFC 9110: `bearer KEY` is the same)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = api_key.encode()

    def _has_key(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._expected)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            if not self._has_key(dict(scope["headers"]).get(b"authorization", b"")):
                response = _error_response(401, "missing or invalid API key (expected 'Authorization: Bearer <key>')",
                                           "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class LimitRequestBody:
    """413 for a body over `max_bytes`, whether announced by Content-Length or streamed in
    chunks. The body is buffered here (it is small by construction) and replayed to the app;
    after it, `receive` is the server's own, so the app still hears about disconnects."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = _error_response(413, f"request body exceeds {self.max_bytes} bytes", "request_too_large")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replaying_receive():
            return replay.pop() if replay else await receive()

        await self.app(scope, replaying_receive, send)


# What a client's X-Request-Id may hold (it becomes part of engine request ids and log lines).
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


def orca_jax_version() -> str:
    """The installed distribution's version (what vLLM's /version reports for itself)."""
    try:
        return importlib.metadata.version("orca_jax")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


# ---- the app -----------------------------------------------------------------------------------
def create_app(async_engine: AsyncLLMEngine, settings: ServerSettings, metrics: ServerMetrics) -> FastAPI:
    """The FastAPI app over a not yet started AsyncLLMEngine; the app's lifespan starts it and
    shuts it down."""
    engine = async_engine.engine
    serving = OpenAIServing(async_engine, copy.deepcopy(engine.tokenizer), settings.model_name,
                            engine.config.max_model_len, on_reject=metrics.reject,
                            auto_tool_parser=settings.auto_tool_parser, chat_template=settings.chat_template,
                            default_chat_template_kwargs=settings.default_chat_template_kwargs,
                            log_requests=settings.enable_log_requests, max_log_len=settings.max_log_len,
                            reasoning=reasoning_parser(settings.reasoning_parser))

    def client_request_id(raw: Request) -> str | None:
        if not settings.enable_request_id_headers:
            return None
        given = raw.headers.get("x-request-id")
        if given is not None and not _REQUEST_ID.fullmatch(given):
            raise OpenAIError(400, "X-Request-Id must be 1-128 letters, digits, '-', '_' or '.'", param="X-Request-Id")
        return given

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        for replica in getattr(async_engine, "replicas", [async_engine]):
            replica.engine.grammars.prepare_in_background()
        async_engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="orca_jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        request = parse_request(CompletionRequest, await raw.body())
        request_id = client_request_id(raw)
        return _respond(await serving.completions(request, _disconnect_waiter(raw), request_id), request_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        request = parse_request(ChatCompletionRequest, await raw.body())
        request_id = client_request_id(raw)
        return _respond(await serving.chat(request, _disconnect_waiter(raw), request_id), request_id)

    def model_card() -> dict:
        return {
            "id": settings.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "orca_jax", "root": engine.config.model, "max_model_len": engine.config.max_model_len,
            # Beyond OpenAI's fields (like vLLM's max_model_len): what a load generator needs
            # to draw valid random prompts without the tokenizer (`orca-jax bench serve`).
            "vocab_size": engine.model_config.vocab_size,
            "special_token_ids": sorted(set(getattr(engine.tokenizer, "all_special_ids", ()))),
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")  # :path: served names may hold a slash (org/name)
    async def model(model_id: str):
        if model_id != settings.model_name:
            raise OpenAIError(404, f"the model '{model_id}' does not exist; this server serves "
                              f"'{settings.model_name}'", param="model", code="model_not_found")
        return model_card()

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        return serving.tokenize(parse_request(TokenizeRequest, await raw.body()))

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        return serving.detokenize(parse_request(DetokenizeRequest, await raw.body()))

    @app.get("/version")
    async def version():
        return {"version": orca_jax_version()}

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD for probes that send it (curl -I, load balancers)
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's) liveness probe
    async def health():
        if not async_engine.is_running:
            return _error_response(503, "the engine is not running", "engine_not_running")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # The last one added runs first: the key is checked before a body is read, and a browser's
    # CORS preflight is answered before the key is asked for.
    app.add_middleware(LimitRequestBody, max_bytes=settings.max_request_bytes)
    if settings.api_key:
        app.add_middleware(RequireApiKey, api_key=settings.api_key)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                           allow_methods=settings.allowed_methods or ["*"],
                           allow_headers=settings.allowed_headers or ["*"], allow_credentials=True)
    return app


class _EventStreamResponse(StreamingResponse):
    """Server-sent events that abort their engine requests however the response ends."""

    def __init__(self, stream: EventStream, headers: dict[str, str] | None = None):
        super().__init__(stream.events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", **(headers or {})})
        self._close = stream.close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._close()


def _respond(result: dict | EventStream, request_id: str | None = None) -> Response | dict:
    headers = {"X-Request-Id": request_id} if request_id is not None else None
    if isinstance(result, EventStream):
        return _EventStreamResponse(result, headers)
    return JSONResponse(result, headers=headers) if headers else result


def _disconnect_waiter(raw: Request):
    """A coroutine function that returns once the client has gone away."""
    async def wait_for_disconnect() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass
    return wait_for_disconnect


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestError)
    async def request_error(_request, exc: RequestError):  # one that no endpoint translated: still a 400
        error = request_error_to_openai(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):  # 404, 405 from routing
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected_error(_request, exc: Exception):
        logger.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)


# ---- running it ------------------------------------------------------------------------------
class _Server(uvicorn.Server):
    """uvicorn, with signals that abort live requests first and end the process normally."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncLLMEngine):
        super().__init__(config)
        self._async_engine = async_engine
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises a caught signal after a graceful shutdown, which ends the process
        # by that signal; a server that shut down cleanly should exit with status 0 instead.
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit and self._loop is not None:
            # A signal handler must not take locks the interrupted code may hold: hand the
            # abort to the event loop.
            self._loop.call_soon_threadsafe(self._async_engine.begin_shutdown)
        super().handle_exit(sig, frame)


def serve(engine: LLMEngine | list[LLMEngine], settings: ServerSettings, *, host: str = "127.0.0.1", port: int = 8000,
          max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS, log_level: str = "info",
          graceful_shutdown_s: float = 10.0, ssl_keyfile: str | None = None, ssl_certfile: str | None = None,
          root_path: str = "") -> None:
    """Serve until SIGINT/SIGTERM. Blocks. `ssl_keyfile` / `ssl_certfile`: HTTPS; `root_path`:
    the path prefix a proxy in front serves the app under. A list of engines: data-parallel
    replicas (`orca_jax.engine.replicas.build_replicas`), served as one."""
    if (ssl_keyfile is None) != (ssl_certfile is None):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    async_engine, app = build_app(engine, settings, max_waiting_requests)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=graceful_shutdown_s, ssl_keyfile=ssl_keyfile,
                            ssl_certfile=ssl_certfile, root_path=root_path)
    _Server(config, async_engine).run()


def build_app(engine: LLMEngine | list[LLMEngine], settings: ServerSettings,
              max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS
              ) -> tuple[AsyncLLMEngine | DataParallelAsyncEngine, FastAPI]:
    """Wire an engine (or data-parallel replicas: a list of engines), the background thread of
    each, metrics and the app together. With replicas, max_waiting_requests bounds each one's
    queue, and the engine-state metrics carry a `replica` label."""
    if not isinstance(engine, list):
        metrics = ServerMetrics(lambda: async_engine.stats())
        async_engine = AsyncLLMEngine(engine, max_waiting_requests=max_waiting_requests, on_output=metrics.observe)
        return async_engine, create_app(async_engine, settings, metrics)
    engines = engine  # replicas, even one (a host's share under jax.distributed): labelled metrics
    metrics = ServerMetrics(lambda: dict(zip(async_engine.replica_indices, async_engine.replica_stats())),
                            routed=lambda: dict(async_engine.routed))
    replicas = [AsyncLLMEngine(e, max_waiting_requests=max_waiting_requests, on_output=metrics.observe)
                for e in engines]
    config = engines[0].config
    router = PrefixAffinityRouter(len(engines), config.page_size, slack=default_slack(config.max_num_seqs))
    async_engine = DataParallelAsyncEngine(replicas, router)
    return async_engine, create_app(async_engine, settings, metrics)
