"""An endpoint's response: a stream of server-sent events, or one JSON object once every choice
has ended; either way a client that goes away cancels its choices."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import traceback
from collections.abc import Callable

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse

from .door import ApiError
from .door import text as _text
from .formats import Format, finish_reason
from .serving import Choice, Server

log = logging.getLogger("dspark.server")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away. The body has been read (the door buffers it whole),
    so what the server says next is the disconnect, or nothing until the response has gone out."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def json_off_loop(build: Callable[[], dict]) -> Response:
    """A JSON answer built and serialised in a worker thread: an echo with log probabilities or a
    tokenisation of some MB is tens of MB of JSON, seconds of work that on the event loop would hold
    up every other request and /health."""
    body = await run_in_threadpool(
        lambda: json.dumps(build(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode())
    return Response(body, media_type="application/json")


async def respond(srv: Server, body, request: Request, choices: list[Choice], queue, fmt: Format):
    """An endpoint's response, written by its formatter: a stream of chunks (``fmt.opening``'s
    fields first, then ``fmt.delta`` per piece of text, the usage if asked, [DONE]) or, once every
    choice has ended, one object (``fmt.whole`` per choice), with ``fmt.logprobs`` of a chunk's or
    the whole output's tokens when the request asked for them."""
    head = {"id": f"{fmt.prefix}-{secrets.token_hex(12)}", "created": int(time.time()), "model": srv.model_name}
    if body.stream:
        return StreamingResponse(_stream(srv, body, choices, queue, fmt, head), media_type="text/event-stream")
    # a whole response: the client's going away must cancel its choices too (a stream learns it
    # from the response, which listens for the disconnect), not only when the next event is late
    collected, gone = asyncio.ensure_future(_collect(srv, choices, queue)), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collected, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collected, gone):
            task.cancel()       # the one still running: its finally (events': cancel the jobs) runs
        await asyncio.gather(collected, gone, return_exceptions=True)
    if not collected.done() or collected.cancelled():
        return Response(status_code=499)    # nginx's "client closed request": nobody reads it
    collected.result()      # its ApiError, if a choice failed
    asked = body.num_logprobs is not None
    return await json_off_loop(lambda: {
        **head, "object": fmt.obj, "usage": srv.usage(choices),
        "choices": [{"index": ch.index, **fmt.whole(ch), "logprobs": fmt.logprobs(ch, ch.logprobs, True) if asked
                     else None, "finish_reason": finish_reason(ch)} for ch in choices]})


async def _collect(srv: Server, choices: list[Choice], queue) -> None:
    async for _ in srv.events(choices, queue):
        pass


async def _stream(srv: Server, body, choices: list[Choice], queue, fmt: Format, head: dict):
    """A stream's server-sent events. With the prompt's log probabilities (``echo``), a choice's
    opening chunk carries them, so it waits for the choice's first tokens (the prompt has been
    scored by then). A failure ends the stream with an error event."""
    asked = body.num_logprobs is not None

    def chunk(ch, fields, finish=None, lp=None):
        return {**head, "object": fmt.chunk_obj,
                "choices": [{"index": ch.index, **fields, "logprobs": lp,
                             "finish_reason": finish and finish_reason(ch)}]}

    scored = asked and any(ch.job.options.prompt_logprobs is not None for ch in choices)
    opened = set()
    try:
        if not scored:
            for ch in choices:
                for fields in fmt.opening(ch):
                    yield _sse(chunk(ch, fields))
        async for ch, text, entries in srv.events(choices, queue):
            if scored and ch.index not in opened:
                opened.add(ch.index)
                for fields in fmt.opening(ch):
                    yield _sse(chunk(ch, fields, lp=fmt.logprobs(ch, [], True)))
            lp = fmt.logprobs(ch, entries) if asked and entries else None
            yield _sse(chunk(ch, fmt.delta(ch, text), ch.finish_reason, lp))
    except ApiError as e:
        yield _sse({"error": {"message": _text(e.message), "type": e.type, "param": None, "code": None}})
        return
    except Exception as e:      # a bug formatting this response: it ends with an error event
        log.error("streaming failed: %s", traceback.format_exc())
        yield _sse({"error": {"message": _text(f"{type(e).__name__}: {e}"), "type": "internal_error",
                              "param": None, "code": None}})
        return
    if body.stream_options and body.stream_options.include_usage:
        yield _sse({**head, "object": fmt.chunk_obj, "choices": [], "usage": srv.usage(choices)})
    yield "data: [DONE]\n\n"
