"""The grammar sandbox: a server compiles and checks each request's grammar in a process of its own.

llguidance is native code, and a request's grammar is user input of unbounded depth: its grammar
processing recurses once per level of a rule chain or a ``$ref`` chain, so a short grammar (a
10,000-rule Lark chain, a 3,000-long ``$ref`` chain: about 100 KB) overflows a thread's stack and
kills the process with SIGSEGV - which, inside the server, would cut every stream in flight.

So a server never hands llguidance a grammar it has not seen survive in the sandbox first: a
child process (``python -m dspark.grammar_sandbox``, which imports llguidance and numpy, not torch)
compiles the request, validates it on the target's tokenizer under the parser limits and takes
its first steps (grammar.GrammarSpec.compile, grammar.check_on). It runs them on a thread whose
stack is a quarter of the smallest the server decodes on (``SERVER_STACK`` for the threads the
server starts; the main thread has the process's stack limit), so that whatever passes there has
four times the stack it needed when the server's own matchers build and step it. A crash, or a
check that runs past ``timeout`` seconds, kills the child: that request gets a 400 naming its
field, and the next grammar starts a fresh child.

Protocol: one JSON line per request on the child's stdin (``{"kind", "value"}``), one JSON line
per answer on its stdout (``{"ok": text}`` or ``{"error": message}``); the first line it reads
is its set-up (the tokenizer as JSON, the vocabulary size, the end-of-text ids, its stack size).
"""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import threading
from copy import copy
from pathlib import Path

from .errors import DsparkError, UsageError

SERVER_STACK = 16 << 20            # the stack of the threads a server starts (threading.stack_size)
DEFAULT_TIMEOUT = 20.0             # seconds one grammar may take in the sandbox
DEFAULT_MAX_QUEUED = 8             # grammars waiting for the sandbox at most; the next is turned away
CHILD_MEMORY = 4 << 30             # the child's address space: a grammar that needs more crashes it alone


class SandboxBusy(DsparkError):
    """Too many grammars are queued for the sandbox: the request may come back later."""


class GrammarTimeout(UsageError):
    """The grammar took the sandbox longer than its timeout."""


def sandbox_stack() -> int:
    """The sandbox's stack: a quarter of the smaller of SERVER_STACK and this process's own stack
    limit (the main thread's, where `dspark serve` runs its engine), at least 256 KB."""
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    main = SERVER_STACK if soft == resource.RLIM_INFINITY else min(soft, SERVER_STACK)
    return max(main // 4, 256 << 10)


def tokenizer_json(hf_tokenizer) -> str:
    """A fast Hugging Face tokenizer as the JSON text llguidance builds its tokenizer from."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UsageError("structured outputs need a fast (Rust) Hugging Face tokenizer")
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


class GrammarSandbox:
    """Compiles and checks grammars in a child process, one at a time; thread-safe."""

    def __init__(self, hf_tokenizer, vocab_size: int, end_ids, timeout: float = DEFAULT_TIMEOUT,
                 max_queued: int = DEFAULT_MAX_QUEUED):
        self._setup = json.dumps({"tokenizer": tokenizer_json(hf_tokenizer), "vocab_size": int(vocab_size),
                                  "end_ids": [int(t) for t in end_ids], "stack": sandbox_stack()})
        self.timeout = timeout
        # each queued grammar holds one of the server's request threads while it waits (a slow one
        # may take the whole timeout): a bounded queue leaves threads for everyone else's requests
        self.max_queued = max_queued
        self.restarts = 0          # children that crashed or were killed
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._queued = 0
        self._count = threading.Lock()

    def start(self) -> None:
        """Start the child now (otherwise the first grammar does)."""
        with self._lock:
            self._ensure()

    def _ensure(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            root = str(Path(__file__).resolve().parent.parent)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
            self._proc = subprocess.Popen([sys.executable, "-m", "dspark.grammar_sandbox"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
            assert self._proc.stdin is not None
            self._proc.stdin.write(self._setup.encode() + b"\n")
            self._proc.stdin.flush()
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
            self.restarts += 1

    def compile(self, kind: str, value) -> str:
        """llguidance's grammar text for this structured-output request, checked on the target's
        tokenizer; a UsageError naming the problem when it is refused, crashes or takes too long
        (GrammarTimeout); SandboxBusy when ``max_queued`` grammars are waiting already."""
        try:
            line = json.dumps({"kind": kind, "value": value}).encode() + b"\n"
        except (TypeError, ValueError, RecursionError):
            raise UsageError(f"invalid {kind}: not JSON-serialisable or nested too deeply") from None
        with self._count:
            if self._queued >= self.max_queued:
                raise SandboxBusy(f"{self._queued} grammars are waiting to be compiled; retry later")
            self._queued += 1
        try:
            return self._compile(kind, line)
        finally:
            with self._count:
                self._queued -= 1

    def _compile(self, kind: str, line: bytes) -> str:
        with self._lock:
            proc = self._ensure()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], self.timeout)
                answer = proc.stdout.readline() if ready else None
            except (BrokenPipeError, OSError):
                answer = b""
            if answer is None:
                self._kill()
                raise GrammarTimeout(f"{kind} is too complex: the grammar engine took more than "
                                     f"{self.timeout:g} s to compile it")
            if not answer.endswith(b"\n"):          # the child died on it
                self._kill()
                raise UsageError(f"{kind} is too complex: it crashed the grammar engine (llguidance), which "
                                 "happens to grammars nested hundreds of levels deep (rule or $ref chains)")
        out = json.loads(answer)
        if "error" in out:
            raise UsageError(out["error"])
        return out["ok"]

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._proc.kill()
                self._proc.wait()
                self._proc = None


def _child() -> None:
    from llguidance import LLTokenizer

    from .grammar import GrammarSpec, check_on
    # llguidance allocates natively: past this it fails (and the child with it), not the machine
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))
    setup = json.loads(sys.stdin.buffer.readline())
    tokenizer = LLTokenizer(setup["tokenizer"], n_vocab=setup["vocab_size"], eos_token=setup["end_ids"])
    threading.stack_size(setup["stack"])
    out = sys.stdout.buffer

    def one(raw: bytes) -> dict:
        request: dict = {}
        try:
            request = json.loads(raw)
            text = GrammarSpec(request["kind"], request["value"]).compile()
            check_on(tokenizer, text, request["kind"], setup["vocab_size"], setup["end_ids"])
            return {"ok": text}
        except UsageError as e:
            return {"error": str(e)}
        except RecursionError:
            return {"error": f"invalid {request.get('kind')}: nested too deeply"}
        except Exception as e:      # noqa: BLE001 - any failure of the grammar engine is the grammar's
            return {"error": f"invalid {request.get('kind')}: {type(e).__name__}: {e}"}

    for raw in sys.stdin.buffer:
        result: dict = {}
        worker = threading.Thread(target=lambda r=raw, out=result: out.update(one(r)))
        worker.start()
        worker.join()
        out.write(json.dumps(result).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    _child()
