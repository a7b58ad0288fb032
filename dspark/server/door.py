"""What ``dspark serve`` checks before a route's handler runs, and the error shape every refusal takes.

The door (``Door``, an ASGI middleware in front of the whole app) asks for the API key on every
route but ``/health`` (and ``/metrics`` with ``--metrics-open``), and reads the body up to the size
limit, answering 413 past it; the body is then parsed and validated off the event loop
(``parse_body``), so that no request, however large, holds up the others or ``/health``. Errors
take the OpenAI API's shape, ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

DEFAULT_MAX_BODY_MB = 8.0   # a full 64-prompt batch of 2048-token prompts as token ids is under 1 MB
DEFAULT_MAX_PROMPTS = 64    # prompts in one /v1/completions request (each of them n choices)
# a body past the limit is still read (and thrown away) up to this much before the 413 goes out:
# a client such as urllib writes its whole body before it reads the answer, and a server that
# closes on unread bytes makes the kernel reset the connection, so that client never sees the 413
DRAIN_BYTES = 64 << 20
BODY_SECONDS = 30.0         # the whole body must arrive within this (a stalled upload: 408, connection closed)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": text(self.message), "type": self.type,
                          "param": None if self.param is None else text(self.param), "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def text(s: str) -> str:
    """One line, valid UTF-8 (lone surrogates escaped), at most 1000 characters: safe in a JSON
    response or an event whatever an exception's text holds."""
    s = " ".join(str(s).split()).encode("utf-8", "backslashreplace").decode()
    return s if len(s) <= 1000 else s[:997] + "..."


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error, in the OpenAI API's shape."""
    error: ErrorBody


_ERRORS = {400: "a malformed or unsupported request; the message names the field",
           401: "no or a wrong API key (only with --api-key)", 404: "another model's name",
           408: "the body did not arrive within 30 s",
           413: "a body larger than the server's limit (--max-body-mb)",
           415: "a body sent as another content type than application/json",
           500: "a failure serving this request; the server goes on"}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The error responses a route documents in the OpenAPI schema (what it sends)."""
    return {c: {"model": ErrorResponse, "description": _ERRORS[c]} for c in codes}


def json_body(model: type[BaseModel]) -> dict:
    """The OpenAPI ``requestBody`` of a route that parses ``model`` itself (``parse_body``): FastAPI
    would parse a declared body on the event loop. The openapi() of create_app adds the model's
    schema to the components."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


async def parse_body(request, model: type[BaseModel]):
    """The request's body as ``model``: JSON parsing and validation (a walk over every string for
    lone surrogates) take seconds on a body of some MB, so they run in a worker thread, as the
    tokenising after them does. Errors are those FastAPI's own parsing raises (a 400 naming the
    field, through create_app's handler)."""
    raw = await request.body()
    return await run_in_threadpool(_parsed, raw, model)


def _parsed(raw: bytes, model: type[BaseModel]):
    try:
        data = json.loads(raw)      # bytes: UTF-8 (or -16/-32) decoded here; not UTF-8 is a ValueError
    except ValueError:              # not JSON, not UTF-8, an integer of over 4300 digits
        raise ApiError(400, "the request body is not valid JSON") from None
    except RecursionError:          # nested deeper than the interpreter's recursion limit
        raise ApiError(400, "the request body is nested too deeply") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None
    except RecursionError:     # JSON nested nearly as deep as json.loads goes: a recursive check ran out
        raise ApiError(400, "the request body is nested too deeply") from None


class Door:
    """ASGI middleware in front of the app: the API key (every route but ``/health``, and
    ``/metrics`` when ``metrics_open``; the ``Bearer`` scheme in any case, as RFC 7235 has it), a
    JSON content type on a POST (415 for a form or text/plain: what a web page can send to a local
    server without asking, the browser's "simple requests"), then the body read whole up to
    ``max_body`` bytes (413 past it, before anything parses it) within BODY_SECONDS (408 for a
    stalled upload) and handed on to the app."""

    def __init__(self, app, api_key: str | None, max_body: int, metrics_open: bool = False):
        self.app = app
        self.key = None if not api_key else api_key.encode()
        self.max_body = max_body
        self.open = {"/health"} | ({"/metrics"} if metrics_open else set())

    def _authorised(self, header: bytes) -> bool:
        scheme, _, credentials = header.strip().partition(b" ")
        assert self.key is not None
        return scheme.lower() == b"bearer" and secrets.compare_digest(credentials.strip(), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self.key is not None and scope["path"] not in self.open:
            if not self._authorised(headers.get(b"authorization", b"")):
                return await self._refuse(receive, send, ApiError(
                    401, "invalid or missing API key (Authorization: Bearer <key>)", "authentication_error",
                    code="invalid_api_key"))
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body:
            # past what is drained anyway, or with no body coming: answer now and close
            return await self._refuse(receive, send, self._too_large(int(declared)),
                                      drain=int(declared) <= DRAIN_BYTES)
        kind = headers.get(b"content-type")
        if scope["method"] == "POST" and kind is not None:
            mime = kind.split(b";")[0].strip().lower()
            if mime != b"application/json" and not mime.endswith(b"+json"):
                return await self._refuse(receive, send, ApiError(
                    415, f"content-type {text(kind.decode('latin-1'))!r}: send the body as application/json",
                    param="content-type", code="unsupported_media_type"))
        chunks, size, more = [], 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), BODY_SECONDS)
            except asyncio.TimeoutError:
                return await self._refuse(receive, send, ApiError(
                    408, f"the request body did not arrive within {BODY_SECONDS:g} s", code="request_timeout"),
                    drain=False)
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > self.max_body:        # a chunked body, or one longer than it declared
                return await self._refuse(receive, send, self._too_large(size, more), more)
            chunks.append(chunk)
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()      # then what the server says next: the client's disconnect
        return await self.app(scope, replay, send)

    def _too_large(self, size: int, more: bool = False) -> ApiError:
        """``more``: ``size`` bytes came so far, more are coming."""
        mb = self.max_body / (1 << 20)
        return ApiError(413, f"the request body is {'over ' if more else ''}{size} bytes, more than this "
                             f"server's limit of {self.max_body} bytes (--max-body-mb {mb:g})",
                        code="request_too_large")

    @staticmethod
    async def _refuse(receive, send, error: ApiError, more: bool = True, drain: bool = True) -> None:
        """Answer ``error`` once the rest of the body (``more``: there is some) has been read and
        thrown away, up to DRAIN_BYTES, for up to BODY_SECONDS (``drain`` False: at once); the
        connection closes after the answer wherever some of the body may be left unread."""
        read = 0
        while more and drain and read <= DRAIN_BYTES:
            try:
                message = await asyncio.wait_for(receive(), BODY_SECONDS)
            except asyncio.TimeoutError:
                break
            if message["type"] == "http.disconnect":
                return
            read += len(message.get("body", b""))
            more = message.get("more_body", False)
        payload = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]
                    + ([(b"connection", b"close")] if more else [])})
        await send({"type": "http.response.body", "body": payload})
