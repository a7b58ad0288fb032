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

Before any handler, the door (server_door.py) asks for the API key and bounds the body. Errors come
back in the OpenAI shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a malformed
or unsupported request (the message names the field), 401 without the API key when one is set, 404
for another model's name, 413 for a body past the limit, 500 for a failure (the OpenAPI schema
documents these, not FastAPI's 422). A failure while serving one request (its grammar, its sampling, its text) ends that
request alone with a 500 or an error event in its stream; only a failure of the step shared by all
(the target's forward) fails every request in flight. Either way the server goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Engine, RequestOptions
from .errors import DsparkError
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TextStream, TokenizeRequest,
                       chat_messages)
from .sampling import SamplingParams
from .server_door import (DEFAULT_MAX_BODY_MB, DEFAULT_MAX_PROMPTS, ApiError, Door, errors, json_body, parse_body)
from .server_door import text as _text
from .grammar_sandbox import SERVER_STACK, GrammarSandbox
from .runtime.allocator import release_memory
from .structured import grammar_state
from . import tools as tool_calls

if TYPE_CHECKING:
    from .engine import Request as EngineRequest   # fastapi's Request is the HTTP one here

log = logging.getLogger("dspark.server")


def _param(loc) -> str:
    """A pydantic error location as the field it names: without "body" and without the tags of a
    union's members ("str", "list[int]", a model's name)."""
    return ".".join(str(x) for x in loc if x != "body" and not (
        isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool", "none") or x[:1].isupper())))


class Metrics:
    """Prometheus counters in a registry of the server's own (several servers in one process, as
    in the tests, do not collide)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        # counted when scraped (EngineWorker.counts), not set after each step: a cancelled request
        # leaves them at once, not one step (or, when idle, the next request's step) later
        self.running = Gauge("dspark:num_requests_running", "requests in the engine's batch", registry=r)
        self.waiting = Gauge("dspark:num_requests_waiting", "requests queued for a cache slot", registry=r)
        self.prompt_tokens = Counter("dspark:prompt_tokens", "prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("dspark:generation_tokens", "tokens generated", registry=r)
        self.finished = Counter("dspark:request_success", "requests ended, by reason",
                                ["finished_reason"], registry=r)
        # vLLM's names: prompt tokens of the requests that could take a cached prefix, and of those found cached
        self.prefix_queries = Counter("dspark:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("dspark:prefix_cache_hits", "prompt tokens found in the prefix cache", registry=r)
        self._prefix_seen = (0, 0)
        self.steps = Counter("dspark:engine_steps", "engine steps (one target forward each)", registry=r)
        self.drafts = Counter("dspark:spec_decode_num_drafts", "rounds that verified draft tokens", registry=r)
        self.draft_tokens = Counter("dspark:spec_decode_num_draft_tokens", "draft tokens verified", registry=r)
        self.accepted = Counter("dspark:spec_decode_num_accepted_tokens", "draft tokens accepted", registry=r)
        self.accepted_pos = Counter("dspark:spec_decode_num_accepted_tokens_per_pos",
                                    "draft tokens accepted, by position in the block", ["position"], registry=r)
        self.ttft = Histogram("dspark:time_to_first_token_seconds", "from admission to the first token",
                              registry=r, buckets=(0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.latency = Histogram("dspark:e2e_request_latency_seconds", "from admission to the end",
                                 registry=r, buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))

    def prefix_counted(self, prefix) -> None:
        """Bring the prefix-cache counters up to the engine's totals."""
        self.prefix_queries.inc(prefix.queries - self._prefix_seen[0])
        self.prefix_hits.inc(prefix.hits - self._prefix_seen[1])
        self._prefix_seen = (prefix.queries, prefix.hits)

    def request_ended(self, req) -> None:
        s = req.stats
        self.drafts.inc(s.num_drafts)
        self.draft_tokens.inc(s.num_draft_tokens)
        self.accepted.inc(s.num_accepted_tokens)
        for k, n in enumerate(s.accepted_per_position):
            if n:
                self.accepted_pos.labels(position=str(k)).inc(n)


@dataclass(frozen=True)
class Tokens:
    """A job's event: tokens it emitted, and their log probabilities (entries of
    Request.output_logprobs) when it asked for them."""

    ids: list[int]
    logprobs: list | None = None


@dataclass(frozen=True)
class Ended:
    """A job's event: it ended with the engine's finish_reason (stop, length, cancelled)."""

    reason: str


@dataclass(frozen=True)
class Failed:
    """A job's event: serving it failed (the message is what its client is told)."""

    message: str


Event = Tokens | Ended | Failed


@dataclass(eq=False)     # hashed by identity: EngineWorker keeps the live ones in a set
class Job:
    """One engine request as the HTTP side sees it; ``sink`` receives its events (Event) on the
    engine thread."""

    prompt_ids: list[int]
    options: RequestOptions
    sink: Callable[[Event], None]
    request: EngineRequest | None = None    # the engine's request, once added (by the engine thread)
    t_submit: float = field(default_factory=time.perf_counter)
    first_token: bool = True


class EngineWorker:
    """Runs the engine: ``run`` steps it on the calling thread until ``close``; ``submit`` and
    ``cancel`` may be called from any thread. ``dspark serve`` runs it on the main thread, the HTTP
    server on another: on CPUs, torch's OpenMP products run 2 - 3x slower when a thread other
    than the main one drives them with more than one thread (a 1-row bf16 product at 2 threads on
    the AMD EPYC VM: 40 us from the main thread, 100 - 150 us from another, 46 us from another at
    one thread), so an engine on a side thread decoded at 0.65x its speed. ``start`` runs it on a
    thread of its own instead (tests)."""

    def __init__(self, engine: Engine, metrics: Metrics):
        self.engine = engine
        engine.isolate_failures = True   # a failure serving one request ends it alone, with an error event
        self.metrics = metrics
        self._commands: deque = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._served = False     # stepped since it last went idle (release_memory then)
        self._jobs: dict[int, Job] = {}
        # submitted and neither ended nor cancelled (guarded by _wake): what the request gauges count
        self._live: set[Job] = set()
        self._thread: threading.Thread | None = None
        metrics.running.set_function(lambda: self.counts()[0])
        metrics.waiting.set_function(lambda: self.counts()[1])

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="dspark-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def submit(self, job: Job) -> Job:
        self._command(("add", job))
        return job

    def cancel(self, job: Job) -> None:
        """The job leaves the gauges now; the engine frees its slot after the step it is in."""
        self._command(("cancel", job))

    def _command(self, c) -> None:
        kind, job = c
        with self._wake:
            if kind == "add":
                self._live.add(job)
            else:
                self._live.discard(job)
            self._commands.append(c)
            self._wake.notify()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) of the live jobs, as of now: a job is running once the engine has
        admitted its request to the batch (which it does inside a step) and until the request
        ends or the client cancels it; it waits before that (for the engine thread to add it, for a
        cache slot)."""
        with self._wake:
            requests = [j.request for j in self._live]
        # a request's status is set by the engine thread; reading it here sees its latest value
        running = sum(r is not None and r.status == "running" for r in requests)
        return running, sum(r is None or r.status == "waiting" for r in requests)

    def _forget(self, job: Job) -> None:
        with self._wake:
            self._live.discard(job)

    @property
    def idle(self) -> bool:
        return not self._jobs and not self._commands

    def run(self, alive=None) -> None:
        """Step the engine while requests are in flight, until ``close`` (or until ``alive()``, asked
        every half second while idle, turns false)."""
        eng = self.engine
        while True:
            with self._wake:
                if not self._commands and not eng.has_work() and not self._closed and self._served:
                    release_memory()     # idle after serving: the heavy requests' temporaries go back
                    self._served = False
                while not self._commands and not eng.has_work() and not self._closed:
                    self._wake.wait(0.5)
                    if alive is not None and not alive():
                        self._closed = True
                if self._closed:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for kind, job in commands:
                if kind == "add":
                    self._add(job)
                elif job.request is not None and not job.request.done:
                    eng.cancel(job.request)
                    self._end(job, "cancelled")
            if not eng.has_work():
                continue
            self._served = True
            try:
                ended = eng.step()
            except Exception as e:       # the step shared by all failed: fail what is in flight, keep serving
                log.error("engine step failed: %s", traceback.format_exc())
                for job in list(self._jobs.values()):
                    assert job.request is not None   # a job in _jobs was added to the engine
                    eng.cancel(job.request)
                    self._jobs.pop(job.request.id, None)
                    self._forget(job)
                    job.sink(Failed(_text(f"engine failure: {type(e).__name__}: {e}")))
                ended = []
            self.metrics.steps.inc()
            if eng.prefix is not None:
                self.metrics.prefix_counted(eng.prefix)
            for r in ended:
                self.metrics.request_ended(r)
                assert r.finish_reason is not None   # set when it ended
                self._end(self._jobs[r.id], r.finish_reason)

    def _add(self, job: Job) -> None:
        def on_tokens(ids, job=job):
            if job.first_token:
                job.first_token = False
                self.metrics.ttft.observe(time.perf_counter() - job.t_submit)
            self.metrics.generation_tokens.inc(len(ids))
            lps = job.request.output_logprobs[-len(ids):] if job.options.logprobs is not None else None
            job.sink(Tokens(list(ids), lps))
        try:
            job.request = self.engine.add_request(job.prompt_ids, job.options, on_tokens=on_tokens)
        except Exception as e:      # this request alone fails (the door checks what it can)
            if not isinstance(e, DsparkError):
                log.error("adding a request failed: %s", traceback.format_exc())
            self._forget(job)
            job.sink(Failed(_text(str(e) if isinstance(e, DsparkError) else f"{type(e).__name__}: {e}")))
            return
        self._jobs[job.request.id] = job
        self.metrics.prompt_tokens.inc(len(job.prompt_ids))

    def _end(self, job: Job, reason: str) -> None:
        assert job.request is not None   # only a job the engine took ends
        self._jobs.pop(job.request.id, None)
        self._forget(job)     # before its end event: a client told it has ended sees it gone
        self.metrics.latency.observe(time.perf_counter() - job.t_submit)
        if reason == "error":       # the engine ended this request alone on a failure serving it
            log.error("request %d failed: %s", job.request.id, job.request.error)
            job.sink(Failed(_text(f"request failed: {job.request.error}")))
        else:
            job.sink(Ended(reason))


@dataclass
class _Choice:
    index: int
    prompt_tokens: int
    text: TextStream
    job: Job
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)   # (token, log probability, top) of the output so far
    logprob_chars: int = 0                          # text_offset of the next token (completions)
    tools: tool_calls.ToolCallStream | None = None  # the output's calls, parsed as it comes (tools.py)


class Server:
    """The app's state: target, engine worker, metrics, and the request handling shared by both
    endpoints."""

    def __init__(self, target, engine: Engine, model_name: str, api_key: str | None = None,
                 max_prompts: int = DEFAULT_MAX_PROMPTS, tool_format: str = "auto"):
        self.target = target
        self.tokenizer = target.tokenizer
        self.tool_format = tool_calls.pick_format(target.tokenizer, tool_format)
        self.tool_tags = tool_calls.tag_tokens(target.tokenizer)
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key      # what the door asks for (Door), kept here for the app's users
        self.max_prompts = max_prompts
        self.metrics = Metrics()
        self.worker = EngineWorker(engine, self.metrics)
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}
        # requests' grammars are compiled and checked in a child process (grammar_sandbox.py); the
        # threads started from here on get the stack that sandbox's margin is measured against
        self.grammars = GrammarSandbox(self.tokenizer, target.model.config.vocab_size, target.eos_token_ids)
        if threading.stack_size() < SERVER_STACK:
            threading.stack_size(SERVER_STACK)
        release_memory()      # what loading the target and the drafter left behind

    # ------------------------------------------------------------------ requests -> jobs
    def check(self, body) -> None:
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"The model `{body.model}` does not exist; this server serves "
                                f"`{self.model_name}`.", "invalid_request_error", "model", "model_not_found")

    def limit(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """max_tokens checked against the per-request cache (or, when absent, all that fits)."""
        room = self.engine.room(len(prompt_ids))
        if max_tokens is None:
            if room < 1:
                raise ApiError(400, f"This model's maximum context length is {self.engine.cache.max_len} tokens; "
                                    f"the prompt has {len(prompt_ids)}.", param="messages",
                               code="context_length_exceeded")
            return room
        if max_tokens > room:
            raise ApiError(400, f"This model's maximum context length is {self.engine.cache.max_len} tokens "
                                f"(less {self.engine.block_size + 1} for drafting); the prompt has {len(prompt_ids)} "
                                f"and max_tokens is {max_tokens}.", param="max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                 add_special_tokens: bool = False, tools: list | None = None) -> list[int]:
        """``messages`` through the chat template; with tools, as tools.render_messages wrote them."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        if tools is None:
            messages, tools = tool_calls.render_messages(messages, [], self.tool_format)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, tools=tools)
        except Exception as e:     # a template that refuses these messages (e.g. roles out of order)
            raise ApiError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        vocab = self.target.model.config.vocab_size
        if any(t >= vocab for t in prompt):
            raise ApiError(400, f"token ids must be below the vocabulary size {vocab}", param="prompt")
        return list(prompt)

    def grammar(self, body) -> str | None:
        """The request's structured-output constraint compiled (once for all its choices) and
        checked against the parser limits on this target's tokenizer, in the grammar sandbox, or
        None. Blocks for up to the sandbox's timeout on a pathological grammar: handlers run it in
        a thread."""
        param = "structured_outputs" if body.structured_outputs is not None else "response_format"
        try:
            spec = body.grammar_spec()
            if spec is None:
                return None
            return self.grammars.compile(spec.kind, spec.value)
        except (ValueError, DsparkError) as e:
            raise ApiError(400, f"{param}: {e}", param=param) from None

    def completion_choices(self, body: CompletionRequest) -> tuple[list[_Choice], list[str]]:
        """A completion request's choices, and each prompt's echo ("" without ``echo``): the
        tokenising and checking of ``choices``, which handlers run in a worker thread."""
        self.check(body)
        if len(body.prompt) > self.max_prompts:
            raise ApiError(400, f"prompt: {len(body.prompt)} prompts in one request, more than this server's "
                                f"limit of {self.max_prompts} (--max-prompts)", param="prompt", code="too_many_prompts")
        prompts = [self.prompt_ids(p) for p in body.prompt]
        echo = [self.tokenizer.decode(p, skip_special_tokens=True) if body.echo else "" for p in prompts]
        return self.choices(prompts, body, body.max_tokens, self.grammar(body)), echo

    def chat_choices(self, body: ChatCompletionRequest) -> list[_Choice]:
        """A chat request's choices (in a worker thread, as completion_choices); with tools, the
        prompt renders them, a grammar constrains the calls and each choice parses its own."""
        self.check(body)
        mode = body.tool_mode
        if body.tool_choice not in (None, "none") and not body.tools:
            raise ApiError(400, "tool_choice: needs tools", param="tool_choice")
        functions = [tool_calls.Function(t.function.name, t.function.description or "",
                                         t.function.parameters or {"type": "object", "properties": {}})
                     for t in body.tools or []]
        if mode not in (None, "auto", "required") and mode not in {f.name for f in functions}:
            raise ApiError(400, f"tool_choice: names the function {mode!r}, which is not among tools",
                           param="tool_choice")
        if mode is not None and (body.structured_outputs is not None or (
                body.response_format is not None and body.response_format.type != "text")):
            raise ApiError(400, "tools: a tool call's grammar cannot be combined with response_format or "
                                "structured_outputs (give tool_choice none, or drop one)", param="tools")
        messages, template_tools = tool_calls.render_messages(body.chat(), functions, self.tool_format)
        ids = self.chat_ids(messages, tools=template_tools or [])
        grammar = self.tool_grammar(functions, mode, body.parallel_tool_calls) if mode else self.grammar(body)
        choices = self.choices([ids], body, body.token_limit, grammar)
        if mode:
            for ch in choices:
                ch.tools = tool_calls.ToolCallStream()
        return choices

    def tool_grammar(self, functions: list[tool_calls.Function], mode: str, parallel: bool) -> str:
        """The calls' grammar, compiled and checked in the grammar sandbox; a schema it refuses is
        named (``tools.N.function.parameters``)."""
        try:
            return self.grammars.compile("grammar", tool_calls.grammar(functions, mode, parallel, self.tool_tags))
        except DsparkError as e:
            for i, f in enumerate(functions):
                try:
                    self.grammars.compile("json", f.parameters)
                except DsparkError as bad:
                    where = f"tools.{i}.function.parameters"
                    raise ApiError(400, f"{where}: {bad}", param=where) from None
            raise ApiError(400, f"tools: {e}", param="tools") from None

    def choices(self, prompts: list[list[int]], body, max_tokens: int | None,
                grammar: str | None = None) -> list[_Choice]:
        """n choices per prompt, checked, their jobs not yet submitted (``start``). ``grammar``: the
        request's, from ``grammar``."""
        if not all(prompts):    # text a tokenizer drops whole (characters outside its vocabulary)
            raise ApiError(400, "the prompt has no tokens for this model", param="prompt" if hasattr(body, "prompt")
                           else "messages")
        limits = [self.limit(p, max_tokens) for p in prompts]      # all checked before any is submitted
        vocab = self.target.model.config.vocab_size
        if any(t >= vocab for t in body.stop_token_ids):
            raise ApiError(400, f"stop_token_ids must be below the vocabulary size {vocab}", param="stop_token_ids")
        stop_ids = (frozenset() if body.ignore_eos else self.engine.eos_ids) | frozenset(body.stop_token_ids)
        bias = tuple(sorted((int(k), float(v)) for k, v in (body.logit_bias or {}).items()))
        if any(t >= vocab for t, _ in bias):
            raise ApiError(400, f"logit_bias token ids must be below the vocabulary size {vocab}", param="logit_bias")
        choices = []
        for pi, (ids, limit) in enumerate(zip(prompts, limits)):
            for j in range(body.n):
                seed = None if body.seed is None else body.seed + j
                try:
                    params = SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=seed,
                                            presence_penalty=body.presence_penalty,
                                            frequency_penalty=body.frequency_penalty,
                                            repetition_penalty=body.repetition_penalty, logit_bias=bias)
                except DsparkError as e:
                    raise ApiError(400, str(e), param="seed" if "seed" in str(e) else None) from None
                scored = body.num_logprobs if getattr(body, "echo", False) else None    # the prompt's too
                options = RequestOptions(params, limit, stop_ids, body.num_logprobs, scored, body.min_tokens,
                                         None if grammar is None else grammar_state(self.target, grammar))
                job = Job(ids, options, _no_sink)
                choices.append(_Choice(pi * body.n + j, len(ids), TextStream(self.tokenizer, body.stop), job))
        return choices

    def start(self, choices: list[_Choice]) -> asyncio.Queue:
        """Submit the choices' jobs (on the event loop); their events arrive on the returned queue as
        (index, event)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        for ch in choices:
            def sink(ev, i=ch.index):
                loop.call_soon_threadsafe(queue.put_nowait, (i, ev))
            ch.job.sink = sink
            self.worker.submit(ch.job)
        return queue

    async def events(self, choices: list[_Choice], queue: asyncio.Queue):
        """(choice, new text, the new tokens' (token, log probability, top) if asked) as tokens come,
        until every choice has ended; a choice's last item carries its finish_reason. Cancels what
        is still running when closed before that (the client went away: see _respond)."""
        live = len(choices)
        try:
            while live:
                i, ev = await queue.get()
                ch = choices[i]
                if ch.finish_reason is not None:
                    continue
                if isinstance(ev, Failed):
                    raise ApiError(500, ev.message, "internal_error")
                if isinstance(ev, Tokens):
                    text = _decoded(ch.text.add, ev.ids)
                    kept = ch.text.kept            # the tokens after a stop string do not count
                    ch.tokens += kept
                    new = [(t, *lp) for t, lp in zip(ev.ids[:kept], ev.logprobs)] if ev.logprobs is not None else []
                    ch.logprobs.extend(new)
                    if ch.text.stopped:
                        self.worker.cancel(ch.job)
                        ch.finish_reason = "stop"
                        live -= 1
                        self.metrics.finished.labels(finished_reason="stop").inc()
                    if text or new or ch.text.stopped:
                        yield ch, text, new
                else:
                    ch.finish_reason = "length" if ev.reason == "length" else "stop"
                    live -= 1
                    self.metrics.finished.labels(finished_reason=ch.finish_reason).inc()
                    yield ch, _decoded(ch.text.finish), []
        finally:
            for ch in choices:
                if ch.finish_reason is None:
                    self.worker.cancel(ch.job)
                    ch.finish_reason = "abort"
                    self.metrics.finished.labels(finished_reason="abort").inc()

    def token_text(self, token: int) -> str:
        """A token's text as the log probabilities name it (its own decode, as vLLM does)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def completion_logprobs(self, ch: _Choice, entries: list, whole: bool = False) -> dict:
        """The legacy completions API's log probabilities of ``entries`` (the next tokens of ``ch``):
        tokens, token_logprobs, a dict per token of the most likely ones and the sampled one, and
        each token's character offset in the text. ``whole`` with ``echo``: the prompt's tokens
        first (the first one with none), as an evaluation harness scores a text."""
        if whole and ch.job.options.prompt_logprobs is not None:
            assert ch.job.request is not None   # its tokens came: the engine took it
            ids = ch.job.prompt_ids
            entries = ([(ids[0], None, None)] + [(t, lp, top) for t, (lp, top) in
                                                 zip(ids[1:], ch.job.request.prompt_logprobs_out)] + entries)
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp, top in entries:
            text = self.token_text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            if top is None:
                out["top_logprobs"].append(None)
            else:
                best = {self.token_text(t): v for t, v in top}
                best.setdefault(text, lp)
                out["top_logprobs"].append(best)
            out["text_offset"].append(ch.logprob_chars)
            ch.logprob_chars += len(text)
        return out

    def chat_logprobs(self, ch: _Choice, entries: list, whole: bool = False) -> dict:
        """The chat API's log probabilities of ``entries``: token, logprob, UTF-8 bytes and the most
        likely alternatives per token."""
        def one(token, lp):
            text = self.token_text(token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**one(token, lp), "top_logprobs": [one(t, v) for t, v in top]}
                            for token, lp, top in entries], "refusal": None}

    @staticmethod
    def usage(choices: list[_Choice]) -> dict:
        prompts: dict[int, int] = {}     # a prompt once, whatever n
        cached: dict[int, int] = {}
        for ch in choices:
            key = id(ch.job.prompt_ids)
            prompts[key] = ch.prompt_tokens
            got = ch.job.request.stats.num_cached_tokens if ch.job.request is not None else 0
            cached[key] = max(cached.get(key, 0), got)
        p, c = sum(prompts.values()), sum(ch.tokens for ch in choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


def _decoded(fn, *args) -> str:
    """The text ``fn`` (a TextStream's add or finish) decodes; a failure there (this request's
    tokens, the tokenizer) ends this request alone, with a 500 or an error event."""
    try:
        return fn(*args)
    except Exception as e:
        log.error("detokenising failed: %s", traceback.format_exc())
        raise ApiError(500, f"request failed: detokenising its output: {type(e).__name__}: {e}",
                       "internal_error") from None


def _no_sink(ev) -> None:
    raise AssertionError("a job's sink is set when it is submitted (Server.start)")


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away. The body has been read (the door buffers it whole),
    so what the server says next is the disconnect, or nothing until the response has gone out."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _finish(ch: _Choice) -> str | None:
    """A choice's finish_reason: ``tool_calls`` where it ended on its own after calling a tool."""
    if ch.finish_reason == "stop" and ch.tools is not None and ch.tools.calls:
        return "tool_calls"
    return ch.finish_reason


def _chat_delta(ch: _Choice, text: str) -> dict:
    """A chat chunk's delta: the text, or with tools the content and the call deltas it holds (the
    rest of the parse once the choice has ended)."""
    if ch.tools is None:
        return {"delta": {"content": text} if text else {}}
    content, calls = ch.tools.add(text)
    if ch.finish_reason is not None:
        more, last = ch.tools.finish()
        content, calls = content + more, tool_calls.merge_deltas(calls + last)
    d: dict = {}
    if content:
        d["content"] = content
    if calls:
        d["tool_calls"] = calls
    return {"delta": d}


def _chat_whole(ch: _Choice) -> dict:
    if ch.tools is None:
        return {"message": {"role": "assistant", "content": ch.text.output}}
    ch.tools.add(ch.text.output)
    ch.tools.finish()
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in ch.tools.calls]
    msg: dict = {"role": "assistant", "content": ch.tools.content or None}
    if calls:
        msg["tool_calls"] = calls
    return {"message": msg}


async def _respond(srv: Server, body, request: Request, choices: list[_Choice], queue, prefix: str, obj: str,
                   chunk_obj: str, delta, opening, whole, logprobs):
    """The response of either endpoint: a stream of chunks (``opening(choice)``'s fields first, then
    ``delta(choice, text)`` per piece of text, the usage if asked, [DONE]) or, once every choice has ended,
    one object (``whole(choice)`` per choice); ``logprobs(choice, entries, whole)`` formats the log
    probabilities of a chunk's or the whole output's tokens, when the request asked for them. With
    the prompt's log probabilities (``echo``), a stream's opening chunk of a choice carries them,
    so it waits for the choice's first tokens (the prompt has been scored by then)."""
    head = {"id": f"{prefix}-{secrets.token_hex(12)}", "created": int(time.time()), "model": srv.model_name}
    asked = body.num_logprobs is not None

    def chunk(ch, fields, finish=None, lp=None):
        return {**head, "object": chunk_obj,
                "choices": [{"index": ch.index, **fields, "logprobs": lp,
                             "finish_reason": finish and _finish(ch)}]}

    if body.stream:
        async def stream():
            scored = asked and any(ch.job.options.prompt_logprobs is not None for ch in choices)
            opened = set()
            try:
                if not scored:
                    for ch in choices:
                        for fields in opening(ch):
                            yield _sse(chunk(ch, fields))
                async for ch, text, entries in srv.events(choices, queue):
                    if scored and ch.index not in opened:
                        opened.add(ch.index)
                        for fields in opening(ch):
                            yield _sse(chunk(ch, fields, lp=logprobs(ch, [], True)))
                    lp = logprobs(ch, entries) if asked and entries else None
                    yield _sse(chunk(ch, delta(ch, text), ch.finish_reason, lp))
            except ApiError as e:
                yield _sse({"error": {"message": _text(e.message), "type": e.type, "param": None, "code": None}})
                return
            except Exception as e:      # a bug formatting this response: it ends with an error event
                log.error("streaming failed: %s", traceback.format_exc())
                yield _sse({"error": {"message": _text(f"{type(e).__name__}: {e}"), "type": "internal_error",
                                      "param": None, "code": None}})
                return
            if body.stream_options and body.stream_options.include_usage:
                yield _sse({**head, "object": chunk_obj, "choices": [], "usage": srv.usage(choices)})
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")
    async def collect():
        async for _ in srv.events(choices, queue):
            pass
    # a whole response: the client's going away must cancel its choices too (a stream learns it
    # from the response, which listens for the disconnect), not only when the next event is late
    collected, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collected, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collected, gone):
            task.cancel()       # the one still running: its finally (events': cancel the jobs) runs
        await asyncio.gather(collected, gone, return_exceptions=True)
    if not collected.done() or collected.cancelled():
        return Response(status_code=499)    # nginx's "client closed request": nobody reads it
    collected.result()      # its ApiError, if a choice failed
    return await _json_off_loop(lambda: {
        **head, "object": obj, "usage": srv.usage(choices),
        "choices": [{"index": ch.index, **whole(ch), "logprobs": logprobs(ch, ch.logprobs, True) if asked else None,
                     "finish_reason": _finish(ch)} for ch in choices]})


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


async def _json_off_loop(build: Callable[[], dict]) -> Response:
    """A JSON answer built and serialised in a worker thread: an echo with log probabilities or a
    tokenisation of some MB is tens of MB of JSON, seconds of work that on the event loop would hold
    up every other request and /health."""
    body = await run_in_threadpool(
        lambda: json.dumps(build(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode())
    return Response(body, media_type="application/json")


async def tokenize(request: Request):
    srv, body = _server(request), await parse_body(request, TokenizeRequest)
    return await _json_off_loop(lambda: _tokenized(srv, body))


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
    return await _respond(srv, body, request, choices, srv.start(choices), "cmpl", "text_completion",
                          "text_completion", delta=lambda ch, text: {"text": text},
                          opening=lambda ch: [{"text": echo[ch.index // body.n]}] if body.echo else [],
                          whole=lambda ch: {"text": echo[ch.index // body.n] + ch.text.output},
                          logprobs=srv.completion_logprobs)


async def chat_completions(request: Request):
    srv = _server(request)
    body = await parse_body(request, ChatCompletionRequest)
    choices = await run_in_threadpool(srv.chat_choices, body)
    return await _respond(srv, body, request, choices, srv.start(choices), "chatcmpl", "chat.completion",
                          "chat.completion.chunk", delta=_chat_delta,
                          opening=lambda ch: [{"delta": {"role": "assistant", "content": ""}}],
                          whole=_chat_whole,
                          logprobs=srv.chat_logprobs)


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
