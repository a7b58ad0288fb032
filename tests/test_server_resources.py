"""What one request may take from the server, on a tiny random target (no real model): a body past
--max-body-mb is a 413 and more prompts than --max-prompts a 400, each naming its flag; a 20 MB
request being parsed or tokenised (held there by a stub that waits on an event, so no timing race)
does not hold up /health or other requests; the API key guards every route but /health (and
/metrics with --metrics-open); the running and waiting gauges drop the moment a client goes away,
while the engine is still inside its step."""

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

import dspark.server
import dspark.server.door
from dspark.drafters import NgramDrafter
from dspark.server.door import DEFAULT_MAX_BODY_MB, DEFAULT_MAX_PROMPTS

from test_server import post, serving
from test_server_hardening import _tiny_server_target, answers, raw

BIG = 20 * 10 ** 6      # the 20 MB body


@pytest.fixture(scope="module")
def tiny():
    return _tiny_server_target()


@pytest.fixture(scope="module")
def small(tiny):
    """A server with small limits: 1 MiB bodies, 4 prompts a request."""
    with serving(tiny, NgramDrafter(block_size=3), max_requests=4, max_len=256, max_body_mb=1, max_prompts=4) as s:
        yield s


def get(url, headers=None):
    """GET; (status, body text)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# ---------------------------------------------------------------------------------------------- limits
def test_a_body_past_the_limit_is_a_413_naming_it(small):
    url, srv = small
    for size in (BIG, (1 << 20) + 1):    # past the limit by far (the client still reads the 413), by a byte
        data = json.dumps({"prompt": "a" * (size - 14)}).encode()
        assert len(data) == size
        status, ctype, text = raw(url + "/v1/completions", data)
        err = json.loads(text)["error"]
        assert status == 413 and ctype == "application/json", text
        assert err["code"] == "request_too_large" and "--max-body-mb 1" in err["message"], err
        assert f"is {size} bytes" in err["message"] and str(1 << 20) in err["message"], err
    # a chunked body declares no length: it is counted as it comes
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/tokenize", iter([b'{"prompt": "', b"a" * (1 << 20), b'"}']),
                 {"content-type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    err = json.loads(resp.read())["error"]
    conn.close()
    assert resp.status == 413 and "--max-body-mb" in err["message"], err
    # just under the limit passes the door (and is then refused for its length, as a 400)
    status, out = post(url + "/v1/completions", {"prompt": "a" * ((1 << 20) - 100), "max_tokens": 2})
    assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
    answers(url)


@pytest.mark.parametrize("prompt", [["hi"] * 5, [[1, 2, 3]] * 5])
def test_more_prompts_than_the_limit_is_a_400_naming_it(small, prompt):
    url, _ = small
    status, out = post(url + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert status == 400 and out["error"]["param"] == "prompt" and out["error"]["code"] == "too_many_prompts", out
    assert "5 prompts" in out["error"]["message"] and "--max-prompts" in out["error"]["message"], out
    status, out = post(url + "/v1/completions", {"prompt": prompt[:4], "max_tokens": 2, "temperature": 0})
    assert status == 200 and len(out["choices"]) == 4, out
    schema = json.loads(get(url + "/openapi.json")[1])      # the limit is in the schema too
    lists = [m for m in schema["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]
             if m.get("items", {}).get("type") in ("string", "array")]
    assert len(lists) == 2 and all(m["maxItems"] == 4 for m in lists), lists


def test_a_method_a_route_lacks_is_a_405_saying_which_it_has(small):
    """What a full schemathesis run (its coverage phase sends every method) found: the 405 lacked
    the Allow header RFC 9110 requires."""
    url, _ = small
    for method, path, allowed in (("GET", "/v1/completions", "POST"), ("TRACE", "/health", "GET, HEAD"),
                                  ("DELETE", "/v1/models", "GET")):
        req = urllib.request.Request(url + path, method=method)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 405 and e.value.headers["allow"] == allowed, (path, dict(e.value.headers))
        assert json.loads(e.value.read())["error"]["type"] == "invalid_request_error"


def test_the_cli_defaults_are_the_servers():
    from dspark.cli import build_parser
    args = build_parser().parse_args(["serve"])
    assert (args.max_body_mb, args.max_prompts, args.metrics_open) == (DEFAULT_MAX_BODY_MB, DEFAULT_MAX_PROMPTS, False)
    from dspark.cli import main
    assert main(["serve", "--max-body-mb", "0"]) == 2 and main(["serve", "--max-prompts", "0"]) == 2


# ---------------------------------------------------------------------------------------------- off the event loop
class _Held:
    """Wraps a function: a call on more than 1 MB (of text, of body) says so and waits to be
    released, as a slow tokenizer or parser would run; the request is then served on its first
    bytes (tokenising 20 MB for real takes half a minute here)."""

    def __init__(self, fn, hold=True):
        self.fn, self.entered, self.release = fn, threading.Event(), threading.Event()
        if not hold:
            self.release.set()

    def __call__(self, data, *a, **k):
        if len(data) > 1 << 20:
            self.entered.set()
            assert self.release.wait(60)
            data = data[:24] if isinstance(data, str) else data
        return self.fn(data, *a, **k)

    def __getattr__(self, name):    # the rest of the tokenizer: chat template, decode, ...
        return getattr(self.fn, name)


@pytest.fixture(scope="module")
def roomy(tiny):
    with serving(tiny, NgramDrafter(block_size=3), max_requests=4, max_len=256, max_body_mb=32) as s:
        yield s


@pytest.mark.parametrize("route, body, where", [
    ("/v1/completions", {"prompt": "a" * BIG, "max_tokens": 2}, "tokenizer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * BIG}], "max_tokens": 2}, "tokenizer"),
    ("/tokenize", {"prompt": "a" * BIG}, "tokenizer"),
    ("/v1/completions", {"prompt": "a" * BIG, "max_tokens": 2}, "parser"),
])
def test_health_answers_while_a_20_mb_request_is_parsed_or_tokenised(roomy, monkeypatch, route, body, where):
    url, srv = roomy
    tok = _Held(srv.tokenizer, hold=where == "tokenizer")
    monkeypatch.setattr(srv, "tokenizer", tok)
    held = tok if where == "tokenizer" else _Held(dspark.server.door._parsed)
    monkeypatch.setattr(dspark.server.door, "_parsed", held if where == "parser" else dspark.server.door._parsed)
    got = {}
    big = threading.Thread(target=lambda: got.update(out=post(url + route, body)))
    big.start()
    try:
        assert held.entered.wait(60), "the big request never reached the " + where
        t0 = time.perf_counter()
        assert get(url + "/health")[0] == 200
        health = time.perf_counter() - t0
        assert get(url + "/metrics")[0] == 200 and get(url + "/v1/models")[0] == 200
        status, out = post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert status == 200 and out["usage"]["completion_tokens"] >= 1, out
        assert big.is_alive()         # all of that while the big request was still held
    finally:
        held.release.set()
        big.join(120)
    status, out = got["out"]
    assert status == 200, out
    assert health < 2, health      # loopback and a tiny app: milliseconds; 2 s only for a loaded machine


# ---------------------------------------------------------------------------------------------- the API key
ROUTES = [("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"), ("GET", "/metrics"), ("GET", "/v1/models"),
          ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/completions"),
          ("POST", "/v1/chat/completions"), ("GET", "/no-such-route")]
BODIES = {"/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [104, 105]},
          "/v1/completions": {"prompt": "hi", "max_tokens": 2},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}


def call(url, method, path, key=None):
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    if method == "GET":
        return get(url + path, headers)
    status, ctype, text = raw(url + path, json.dumps(BODIES[path]).encode(), headers)
    return status, text


@pytest.mark.parametrize("metrics_open", [False, True])
def test_the_api_key_guards_every_route_but_health(tiny, metrics_open):
    with serving(tiny, NgramDrafter(block_size=3), max_len=128, api_key="sesame", metrics_open=metrics_open,
                 max_body_mb=1) as (url, _):
        for method, path in ROUTES:
            for key in (None, "wrong", "sesam", "sesame2"):
                status, text = call(url, method, path, key)
                if path == "/metrics" and metrics_open:
                    assert status == 200 and "dspark:num_requests_running" in text
                    continue
                assert status == 401, (method, path, key, text)
                assert json.loads(text)["error"]["type"] == "authentication_error"
            status, text = call(url, method, path, "sesame")
            assert status == (404 if path == "/no-such-route" else 200), (path, text)
        assert get(url + "/health")[0] == 200
        # the key is asked before the body is read: a big body without it is a 401, not a 413
        status, _, text = raw(url + "/v1/completions", b"x" * (2 << 20))
        assert status == 401, text
        status, _, text = raw(url + "/v1/completions", b"x" * (2 << 20), {"authorization": "Bearer sesame"})
        assert status == 413, text


# ---------------------------------------------------------------------------------------------- the gauges
def gauges(url) -> tuple[float, float, float]:
    """(running, waiting, aborted so far) as /metrics has them now."""
    text = get(url + "/metrics")[1]
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    return (values["dspark:num_requests_running"], values["dspark:num_requests_waiting"],
            values.get('dspark:request_success_total{finished_reason="abort"}', 0.0))


def wait_for(url, want, what, seconds=10):
    deadline = time.time() + seconds
    while (got := gauges(url)[:2]) != want:
        assert time.time() < deadline, f"{what}: gauges (running, waiting) {got}, want {want}"
        time.sleep(0.01)


def send(url, body) -> socket.socket:
    """A request on a raw socket, not read: closing the socket is the client going away."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_the_gauges_drop_when_a_client_goes_away_mid_step(tiny, monkeypatch, stream):
    """Two requests decode, a third waits for a slot; the engine is held inside a step (a stub that
    waits on an event after the real step). The waiting client and a running one go away: the
    gauges drop at once, the engine still in that step; released, it frees their slots, the third
    request ends normally and the gauges read 0 with the engine idle."""
    with serving(tiny, NgramDrafter(block_size=3), max_requests=2, max_len=256) as (url, srv):
        inside, release = threading.Event(), threading.Event()
        real = srv.engine.step

        def step():
            ended = real()
            if not release.is_set() and len(srv.engine.running) == 2:
                inside.set()
                release.wait(60)
            return ended
        monkeypatch.setattr(srv.engine, "step", step)
        assert gauges(url) == (0, 0, 0)
        body = {"max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": stream}
        socks = [send(url, {**body, "prompt": p}) for p in ("first", "second")]
        assert inside.wait(30)      # both admitted: their slots taken in the step that is now held
        socks.append(send(url, {**body, "prompt": "third"}))
        wait_for(url, (2, 1), "two running, one waiting")
        try:
            socks.pop().close()             # the waiting one goes away
            wait_for(url, (2, 0), "the waiting client left", 5)
            socks.pop(0).close()            # a running one goes away
            wait_for(url, (1, 0), "a running client left", 5)
            assert srv.engine.cache.num_free == 0 and len(srv.engine.running) == 2   # still inside the step
            assert gauges(url)[2] == 2
        finally:
            release.set()
        rest = socks.pop()
        reply = b""
        while b"[DONE]" not in reply and b'"length"' not in reply:
            chunk = rest.recv(1 << 16)
            assert chunk, reply
            reply += chunk
        rest.close()
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
        deadline = time.time() + 10
        while not srv.worker.idle:
            assert time.time() < deadline
            time.sleep(0.01)
        assert gauges(url) == (0, 0, 2) and srv.engine.cache.num_free == srv.engine.cache.num_slots


# ---------------------------------------------------------------------------------------------- transport
def _exchange(url, data: bytes, wait: float = 10.0) -> bytes:
    """Raw bytes to the server; what it answers before closing or ``wait`` seconds."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            pass
    return out


def test_transport_refuses_what_a_web_page_or_a_stalled_client_sends(tiny, monkeypatch):
    """415 for a body sent as a form or text/plain (what any web page can send a local server);
    408 and a closed connection for a body that stalls; a 413 at once for a Content-Length past the
    limit with no body behind it; HEAD /health; the Bearer scheme in any case."""
    monkeypatch.setattr(dspark.server.door, "BODY_SECONDS", 1.0)
    with serving(tiny, NgramDrafter(block_size=3), max_len=128, api_key="sesame", max_body_mb=1) as (url, _):
        key = {"authorization": "Bearer sesame"}
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            status, _, body = raw(url + "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}',
                                  {**key, "content-type": kind})
            assert status == 415 and json.loads(body)["error"]["param"] == "content-type", body
        status, _, body = raw(url + "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}',
                              {**key, "content-type": "application/json; charset=utf-8"})
        assert status == 200, body
        for scheme in ("bearer", "BEARER", "Bearer"):
            assert get(url + "/v1/models", {"authorization": f"{scheme} sesame"})[0] == 200
        assert get(url + "/v1/models", {"authorization": "Basic sesame"})[0] == 401
        head = urllib.request.urlopen(urllib.request.Request(url + "/health", method="HEAD"), timeout=10)
        assert head.status == 200
        t = time.monotonic()
        out = _exchange(url, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             b"authorization: Bearer sesame\r\ncontent-length: 100\r\n\r\n{\"prompt\"")
        assert out.startswith(b"HTTP/1.1 408") and time.monotonic() - t < 8, out[:200]
        t = time.monotonic()
        out = _exchange(url, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             b"authorization: Bearer sesame\r\ncontent-length: 99999999999\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 413") and time.monotonic() - t < 0.9, out[:200]
        assert get(url + "/health")[0] == 200


def test_memory_goes_back_when_the_server_goes_idle(small, monkeypatch):
    """After serving, the engine thread hands the heap's free memory back once it is idle
    (runtime/allocator.release_memory: glibc's malloc_trim), not at every step."""
    from dspark.runtime.allocator import release_memory
    url, _ = small
    calls: list[int] = []
    monkeypatch.setattr(dspark.server.worker, "release_memory", lambda: calls.append(1) or True)
    status, out = post(url + "/v1/completions", {"prompt": "hello", "max_tokens": 6, "temperature": 0})
    assert status == 200, out
    deadline = time.time() + 10
    while not calls and time.time() < deadline:
        time.sleep(0.05)
    assert len(calls) == 1
    time.sleep(1.2)                 # idle: no more releases until it serves again
    assert len(calls) == 1
    assert isinstance(release_memory(), bool)
