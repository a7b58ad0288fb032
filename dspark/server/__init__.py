"""``dspark serve``: an OpenAI-compatible HTTP server over the engine.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streaming as server-sent
events, ``n`` choices, stop strings, seeds), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(Prometheus text: vLLM's request and speculative-decoding counters under a ``dspark:`` prefix).

One engine serves every request: it runs on a thread of its own (``EngineWorker``) and steps while
any request is in flight, so that all of them share each target forward (continuous batching, up
to ``max_requests`` at once, the rest queued). On the event loop, HTTP handlers only submit,
cancel and read events; parsing, tokenising and grammar compilation run in worker threads, so that
a large request holds up no other; the engine thread hands each request's new tokens to its
handler's event loop. A client that goes away (a closed stream, a dropped connection, whether
streaming or not) cancels its requests: they leave the gauges at once, their cache slots at the end
of the step in flight.

Before any handler, the door (door.py) asks for the API key and bounds the body. Errors come
back in the OpenAI shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a malformed
or unsupported request (the message names the field), 401 without the API key when one is set, 404
for another model's name, 413 for a body past the limit, 500 for a failure (the OpenAPI schema
documents these, not FastAPI's 422). A failure while serving one request (its grammar, its sampling, its text) ends that
request alone with a 500 or an error event in its stream; only a failure of the step shared by all
(the target's forward) fails every request in flight. Either way the server goes on.

The package, by concern: ``app`` (the FastAPI app, its routes and error handlers, ``serve``),
``serving`` (a request's checks, its choices and their events), ``formats`` (each endpoint's
OpenAI shapes), ``responses`` (a stream of chunks or one object), ``worker`` (the engine's
thread), ``metrics`` (Prometheus) and ``door`` (API key, body limits, the error shape).
"""

from .app import create_app, in_thread, serve
from .metrics import Metrics
from .serving import Choice, Server
from .worker import Ended, EngineWorker, Event, Failed, Job, Tokens

__all__ = ["Choice", "Ended", "EngineWorker", "Event", "Failed", "Job", "Metrics", "Server", "Tokens", "create_app",
           "in_thread", "serve"]
