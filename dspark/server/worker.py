"""The engine's thread: it steps the engine while requests are in flight, takes jobs in and
cancels them from any thread, and hands each job its events (tokens, its end, its failure)."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..engine import Engine, RequestOptions
from ..errors import DsparkError, UsageError
from ..runtime.allocator import release_memory
from .door import text as _text
from .metrics import Metrics

if TYPE_CHECKING:
    from ..engine import Request as EngineRequest

log = logging.getLogger("dspark.server")


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
    server on another: on CPUs, torch's OpenMP products run several times slower when a thread
    other than the main one drives them with more than one thread (docs/serving.md). ``start``
    runs it on a thread of its own instead (tests)."""

    def __init__(self, engine: Engine, metrics: Metrics):
        if not engine.isolate_failures:     # one request's failure must end it alone, with an error event
            raise UsageError("a server's engine ends a failing request alone: build it with "
                             "Engine(..., isolate_failures=True) or serving_engine")
        self.engine = engine
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
