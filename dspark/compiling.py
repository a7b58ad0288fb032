"""Compiled graphs built beside serving.

Building the target's and the trained drafter's one-request graphs takes minutes on a small CPU
(runtime/compiled.py, drafters/compiled.py), and inductor does not reuse frozen graphs from its
disk cache. A server that built them first would answer nothing for that long. So `dspark serve`
answers from the start with the eager forwards while a thread builds every graph on scratch
caches, and switches to them, all at once, when the last is built: a forward reads which graphs
to use once, so a step runs wholly eager or wholly compiled. Nothing is served differently than the
eager engine would.

The build shares the cores and Python's lock with the engine, so it gives way: its thread and the
C++ compilers it starts run at the lowest priority, and the lock changes hands ten times as often
while it lasts: otherwise the engine's thread team waits on the compilers at every parallel
operator and on the lock between operators, and a request served meanwhile takes many times its
eager time (docs/limits.md).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("dspark")


def trained_part(drafter):
    """The part of a drafter that has graphs to build (a trained drafter, alone or inside a
    hybrid), or None."""
    for part in (drafter, getattr(drafter, "model", None)):
        if part is not None and hasattr(part, "build_graphs"):
            return part
    return None


def _lowest_priority() -> None:
    """The calling thread (and the processes it starts) at nice 19, where the system allows it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):     # not Linux, or not permitted: the build runs as it is
        pass


class GraphBuilder:
    """Builds a target's and a drafter's graphs in a daemon thread, then puts them to use.
    ``state``: "building", "compiled" (in use), "eager" (nothing to compile or building failed);
    ``say`` gets one line per graph set and one at the end."""

    def __init__(self, decoder, drafter, say: Callable[[str], None] | None = None):
        self.decoder, self.drafter = decoder, trained_part(drafter)
        self.say = say or log.info
        self.state = "building"
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, name="dspark-compile", daemon=True)

    def start(self) -> GraphBuilder:
        self.thread.start()
        return self

    def _run(self) -> None:
        t = time.perf_counter()
        # the build and the serving share the cores: one thread each while it lasts (two thread
        # teams on two cores wait on each other at every parallel operator), inductor's C++
        # builds one at a time
        import torch
        import torch._inductor.config as inductor
        threads, workers = torch.get_num_threads(), inductor.compile_threads
        torch.set_num_threads(max(1, threads - 1))
        inductor.compile_threads = 1
        # the engine first: this thread and the C++ compilers it starts run at the lowest priority,
        # and Python's lock changes hands ten times as often while the build holds it in between
        _lowest_priority()
        switch = sys.getswitchinterval()
        sys.setswitchinterval(switch / 10)
        try:
            self._build(t)
        finally:
            sys.setswitchinterval(switch)
            torch.set_num_threads(threads)
            inductor.compile_threads = workers

    def _build(self, t: float) -> None:
        try:
            target_graphs, what = self.decoder.build_graphs()
            self.say(what)
            drafter_graphs = None
            if self.drafter is not None:
                drafter_graphs, what = self.drafter.build_graphs()
                self.say(what)
        except Exception as e:      # serving goes on eagerly
            self.state = "eager"
            self.say(f"compiling failed, serving with the eager forwards ({type(e).__name__}: {e})")
            return
        self.seconds = time.perf_counter() - t
        if target_graphs.disabled:
            self.state = "eager"
            return
        self.decoder.use_graphs(target_graphs)
        if self.drafter is not None:
            self.drafter.use_graphs(drafter_graphs)
        self.state = "compiled"
        self.say(f"compiled graphs in use, built in {self.seconds:.0f} s beside serving")
