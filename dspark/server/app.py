"""The FastAPI app of ``dspark serve``: its routes, its error handlers, its OpenAPI schema, and
``serve`` (HTTP on a side thread, the engine on the main one)."""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Engine
from ..errors import DsparkError
from ..protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, chat_messages
from .door import DEFAULT_MAX_BODY_MB, DEFAULT_MAX_PROMPTS, ApiError, Door, errors, json_body, parse_body
from .formats import ChatFormat, CompletionFormat
from .responses import json_off_loop, respond
from .serving import Server

log = logging.getLogger("dspark.server")


def _param(loc) -> str:
    """A pydantic error location as the field it names: without "body" and without the tags of a
    union's members ("str", "list[int]", a model's name)."""
    return ".".join(str(x) for x in loc if x != "body" and not (
        isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool", "none") or x[:1].isupper())))


_BODIES = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
# what a completion route's 200 may carry: one JSON object, or with "stream" server-sent events
_STREAMED: dict[int | str, dict[str, Any]] = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}


def create_app(target, engine: Engine, model_name: str | None = None, api_key: str | None = None,
               engine_thread: bool = True, max_body_mb: float = DEFAULT_MAX_BODY_MB,
               max_prompts: int = DEFAULT_MAX_PROMPTS, metrics_open: bool = False,
               tool_format: str = "auto") -> FastAPI:
    """The FastAPI app serving ``engine`` (whose target is ``target.model``). ``engine_thread``: the
    engine steps on a thread of its own for the app's lifetime; else the caller runs
    ``app.state.server.worker.run()`` on its thread (the main one: see EngineWorker). ``api_key``:
    wanted on every route but /health (and /metrics with ``metrics_open``); ``max_body_mb``: larger
    bodies get a 413; ``max_prompts``: prompts one completion request may hold (more: a 400);
    ``tool_format``: how tools are rendered (tools.py: auto, hermes, generic)."""
    srv = Server(target, engine, model_name or target.name, api_key, max_prompts, tool_format)

    @asynccontextmanager
    async def lifespan(app):
        srv.grammars.start()
        if engine_thread:
            srv.worker.start()
        try:
            yield
        finally:
            srv.worker.close()
            srv.grammars.close()

    app = FastAPI(title="dspark", version="0.1.0", lifespan=lifespan)
    app.state.server = srv
    app.add_middleware(Door, api_key=api_key, max_body=int(max_body_mb * (1 << 20)), metrics_open=metrics_open)
    app.openapi = lambda: _openapi(app)   # type: ignore[method-assign]
    app.exception_handler(ApiError)(_api_error)
    app.exception_handler(StarletteHTTPException)(_http_error)
    app.exception_handler(Exception)(_failure)
    app.exception_handler(RequestValidationError)(_invalid)
    # the request bodies are parsed, and prompts tokenised, in worker threads: a body of some MB
    # takes seconds to parse and tokenise, which on the event loop would hold up every other request
    app.get("/health")(health)
    app.head("/health", include_in_schema=False)(health)     # load balancers' probes
    app.get("/metrics", responses=errors(401), response_class=PlainTextResponse)(metrics)
    app.get("/v1/models", responses=errors(401))(models)
    for path, route, model, extra in (("/tokenize", tokenize, TokenizeRequest, {}),
                                      ("/detokenize", detokenize, DetokenizeRequest, {}),
                                      ("/v1/completions", completions, CompletionRequest, _STREAMED),
                                      ("/v1/chat/completions", chat_completions, ChatCompletionRequest, _STREAMED)):
        app.post(path, responses={**extra, **errors(400, 401, 404, 408, 413, 415, 500)},
                 openapi_extra=json_body(model))(route)
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema with the status codes the server sends: errors are 400 (and 401, 404,
    413, 500) in the OpenAI shape, never FastAPI's 422 with its validation-error body; the
    request bodies the handlers parse themselves (parse_body) are the models'."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
                for code, resp in op.get("responses", {}).items():
                    if code != "200" and "content" in resp:   # an error is JSON whatever the route's 200
                        resp["content"] = {"application/json": next(iter(resp["content"].values()))}
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for model in _BODIES:
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
        for member in components["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
            if member.get("items", {}).get("type") in ("string", "array"):   # a list of prompts
                member["maxItems"] = app.state.server.max_prompts
        app.openapi_schema = schema
    return app.openapi_schema


async def _api_error(request, e: ApiError):
    return e.response()


async def _http_error(request, e: StarletteHTTPException):   # an unknown route, a method it has not ...
    response = ApiError(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500
                        else "internal_error").response()
    response.headers.update(e.headers or {})    # a 405's Allow: the methods the route has (RFC 9110)
    if e.status_code == 405:      # Starlette names the first route's; a path may have several (/health)
        path = request.url.path
        methods = {m for r in request.app.routes if getattr(r, "path", None) == path for m in getattr(r, "methods", ())}
        if methods:
            response.headers["allow"] = ", ".join(sorted(methods))
    return response


async def _failure(request, e: Exception):     # a bug: still an OpenAI-shaped 500, and logged
    log.error("request failed: %s", "".join(traceback.format_exception(e)))
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", "internal_error").response()


async def _invalid(request, e: RequestValidationError):
    msgs, params = [], []
    for err in e.errors()[:4]:
        loc = _param(err.get("loc", ()))
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msgs.append(f"unknown field {loc!r}")
        elif err.get("type") == "lone_surrogate":     # a model-level check: the field is in its context
            loc = err["ctx"]["field"]
            msgs.append(msg)
        else:
            msgs.append(f"{loc}: {msg}" if loc else msg)
        params.append(loc)
    return ApiError(400, "; ".join(msgs) or "invalid request", param=params[0] if params and params[0] else None
                    ).response()     # a check of the whole body (loc ()) names no field


# ---------------------------------------------------------------------------------------------- routes
def _server(request: Request) -> Server:
    return request.app.state.server


async def health(request: Request):
    """Up; ``compiled``: whether one request's forwards run as compiled graphs yet (`dspark serve`
    builds them beside serving: dspark/compiling.py)."""
    return {"status": "ok", "compiled": bool(getattr(_server(request).engine.target, "compiled", False))}


async def metrics(request: Request):
    return Response(generate_latest(_server(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request):
    srv = _server(request)
    return {"object": "list", "data": [{"id": srv.model_name, "object": "model", "created": srv.created,
                                        "owned_by": "dspark", "max_model_len": srv.engine.cache.max_len}]}


def _tokenized(srv: Server, body: TokenizeRequest) -> dict:
    srv.check(body)
    if body.prompt is not None:
        ids = srv.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens is not False)["input_ids"]
    else:
        assert body.messages is not None   # TokenizeRequest has exactly one of prompt, messages
        ids = srv.chat_ids(chat_messages(body.messages), body.add_generation_prompt, bool(body.add_special_tokens))
    strs = srv.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": srv.engine.cache.max_len, "tokens": ids, "token_strs": strs}


async def tokenize(request: Request):
    srv, body = _server(request), await parse_body(request, TokenizeRequest)
    return await json_off_loop(lambda: _tokenized(srv, body))


def _detokenized(srv: Server, body: DetokenizeRequest) -> dict:
    srv.check(body)
    srv.prompt_ids(body.tokens)     # the ids are checked against the vocabulary
    return {"prompt": srv.tokenizer.decode(body.tokens)}


async def detokenize(request: Request):
    return await run_in_threadpool(_detokenized, _server(request), await parse_body(request, DetokenizeRequest))


async def completions(request: Request):
    srv = _server(request)
    body = await parse_body(request, CompletionRequest)
    choices, echo = await run_in_threadpool(srv.completion_choices, body)
    return await respond(srv, body, request, choices, srv.start(choices), CompletionFormat(srv, body, echo))


async def chat_completions(request: Request):
    srv = _server(request)
    body = await parse_body(request, ChatCompletionRequest)
    choices = await run_in_threadpool(srv.chat_choices, body)
    return await respond(srv, body, request, choices, srv.start(choices), ChatFormat(srv, body))


@contextmanager
def in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
    """Serve ``app`` from a thread of this process (port 0: a free one); yields its base URL, the
    uvicorn server and its thread."""
    import socket

    import uvicorn
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise DsparkError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="dspark-http", daemon=True)
    thread.start()
    deadline = time.time() + 60
    try:
        while not server.started:
            if not thread.is_alive() or time.time() > deadline:
                raise DsparkError("the HTTP server did not start")
            time.sleep(0.02)
        yield f"http://{host}:{sock.getsockname()[1]}", server, thread
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


def serve(target, engine: Engine, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          api_key: str | None = None, log_level: str = "info", banner: str | None = None,
          max_body_mb: float = DEFAULT_MAX_BODY_MB, max_prompts: int = DEFAULT_MAX_PROMPTS,
          metrics_open: bool = False, tool_format: str = "auto") -> None:
    """Serve until SIGINT or SIGTERM: HTTP on a side thread, the engine on this (main) thread. The
    first signal stops accepting requests and lets those in flight finish (the engine steps on
    until the HTTP server has closed its last connection); a second one stops at once."""
    import signal
    app = create_app(target, engine, model_name, api_key, engine_thread=False, max_body_mb=max_body_mb,
                     max_prompts=max_prompts, metrics_open=metrics_open, tool_format=tool_format)
    worker = app.state.server.worker
    with in_thread(app, host, port, log_level) as (url, server, thread):
        if banner:
            print(f"{banner} on {url}", file=sys.stderr, flush=True)

        def stop(signum, frame):
            if server.should_exit:
                worker.close()
            server.should_exit = True
        previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            worker.run(alive=thread.is_alive)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
