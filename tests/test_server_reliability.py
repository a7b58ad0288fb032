"""The server under generated and concurrent load, on a tiny random target (no real model): a
schemathesis run over every operation of its OpenAPI schema (schema-valid and schema-violating
bodies, 25 examples each) gets no 5xx and nothing the schema does not document; 64 concurrent
streams (completions and chat, greedy) equal their whole responses; clients that go away at any
point (waiting for a slot, mid-stream, before a whole response) free their slots and leave the
gauges, and the requests that stay get the answers they get alone.

The issue's hostile inputs are regression tests in test_server_hardening.py (seeds past 2**64 with
n, a regex past llguidance's limits, lone surrogates, a logit_bias key "²", booleans as token ids,
"stream": "yes", the OpenAPI codes) and test_server_resources.py (a 20 MB body, too many prompts,
the API key on every route, the gauges)."""

import threading
import time
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from openai import OpenAI
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from dspark.drafters import NgramDrafter

from test_server import post, serving
from test_server_hardening import _tiny_server_target, sse
from test_server_resources import gauges, send

MAX_TOKENS = 4      # the most tokens a generated request may ask for: each example takes milliseconds
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
              ("POST", "/detokenize"), ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics")]


@pytest.fixture(scope="module")
def tiny():
    return _tiny_server_target()


# ---------------------------------------------------------------------------------------------- schemathesis
@pytest.fixture(scope="module")
def fuzzed(tiny):
    # max_len 96 bounds what a chat request without max_tokens generates; max_prompts 4 what a list of prompts costs
    with serving(tiny, NgramDrafter(block_size=3), max_requests=8, max_len=96, max_prompts=4) as (url, srv):
        schema = schemathesis.openapi.from_url(url + "/openapi.json")
        assert sorted((op.method.upper(), op.path) for op in (r.ok() for r in schema.get_all_operations())) \
            == sorted(OPERATIONS)
        yield url, srv, schema


@pytest.mark.parametrize("method, path, mode", [(m, p, "positive") for m, p in OPERATIONS]
                         + [(m, p, "negative") for m, p in OPERATIONS if m == "POST"])
def test_generated_requests_get_no_5xx_and_only_documented_answers(fuzzed, method, path, mode):
    """Schemathesis's checks on every response (no 5xx; status codes, content types and bodies as
    the schema documents; schema-violating bodies refused with a 4xx), except that a schema-valid
    body may be refused: the server checks what the schema does not say (the context length, the
    vocabulary, one of prompt or messages, seed + n, a grammar that compiles). The GET routes take
    no input, so they have no schema-violating requests to send."""
    url, srv, schema = fuzzed
    statuses: Counter = Counter()

    @given(case=schema[path][method].as_strategy(generation_mode=GenerationMode(mode)))
    @settings(max_examples=25, deadline=None, database=None, derandomize=True,   # the same examples every run
              suppress_health_check=list(HealthCheck))
    def check(case):
        if isinstance(case.body, dict):
            for key in ("max_tokens", "max_completion_tokens"):
                if type(case.body.get(key)) is int:
                    case.body[key] = min(case.body[key], MAX_TOKENS)
        response = case.call_and_validate(base_url=url, excluded_checks=[positive_data_acceptance])
        statuses[response.status_code] += 1
    check()
    assert not any(s >= 500 for s in statuses), statuses
    if method == "GET":
        assert statuses == {200: 1}, statuses
    else:
        assert sum(statuses.values()) >= 25 and (mode == "negative" or statuses[200] >= 1), statuses
    assert srv.worker.counts() == (0, 0) and srv.engine.cache.num_free == srv.engine.cache.num_slots


# ---------------------------------------------------------------------------------------------- concurrency
@pytest.fixture(scope="module")
def busy(tiny):
    with serving(tiny, NgramDrafter(block_size=3), max_requests=16, max_len=256) as s:
        yield s


def _ask(client, i: int, stream: bool) -> dict:
    """Request i (even: a completion, odd: a chat completion), greedy, 24 tokens, with the
    sampled tokens' log probabilities; its text, tokens, log probabilities, finish reason."""
    prompt = f"request {i}: " + "abcdefghij"[i % 10] * (1 + i % 7)
    common = dict(model="tiny", max_tokens=24, temperature=0, stream=stream, extra_body={"ignore_eos": True})
    text, tokens, lps, finish = "", [], [], None
    if i % 2 == 0:
        out = client.completions.create(prompt=prompt, logprobs=0, **common)
        for c in (ch.choices[0] for ch in (out if stream else [out])):
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
            finish = c.finish_reason or finish
    else:
        out = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], logprobs=True,
                                             **common)
        for ch in (out if stream else [out]):
            c = ch.choices[0]
            text += (c.delta.content if stream else c.message.content) or ""
            if c.logprobs is not None and c.logprobs.content:
                tokens += [t.token for t in c.logprobs.content]
                lps += [t.logprob for t in c.logprobs.content]
            finish = c.finish_reason or finish
    return {"text": text, "tokens": tokens, "logprobs": lps, "finish": finish}


def _all_at_once(url, n: int, stream: bool) -> list[dict]:
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    got: list = [None] * n

    def one(i):
        got[i] = _ask(client, i, stream)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    client.close()
    return got


def test_64_concurrent_streams_equal_their_whole_responses(busy):
    """64 clients at once (16 decode together, the rest queue), each a stream through the openai
    client; then the same 64 requests as whole responses: every stream's text, tokens and finish
    reason equal its whole response's, log probabilities to float precision (the batches differ)."""
    url, srv = busy
    streamed = _all_at_once(url, 64, stream=True)
    whole = _all_at_once(url, 64, stream=False)
    for i, (s, w) in enumerate(zip(streamed, whole)):
        assert s is not None and w is not None, i
        assert (s["text"], s["tokens"], s["finish"]) == (w["text"], w["tokens"], w["finish"]), i
        assert len(s["tokens"]) == 24 and s["finish"] == "length", (i, s)
        assert s["logprobs"] == pytest.approx(w["logprobs"], abs=1e-4), i
    assert srv.worker.counts() == (0, 0) and srv.engine.cache.num_free == srv.engine.cache.num_slots


def test_clients_that_go_away_free_their_slots_and_leave_the_gauges(busy):
    """12 clients on 16 slots, then 12 more: the first 12 go away once all of them are in flight
    (streams after their first event, whole responses before any) while the other 12, 8 of them
    waiting for a slot, read their answers. Those answers equal the same requests' alone; the
    engine ends idle with every slot free, the gauges at 0 and 12 more aborted requests."""
    url, srv = busy
    aborted = gauges(url)[2]
    body = {"temperature": 0, "ignore_eos": True}
    kept = {f"kept {i}": {**body, "prompt": f"kept {i}", "max_tokens": 16, "stream": i % 2 == 0} for i in range(12)}
    alone = {p: post(url + "/v1/completions", {**b, "stream": False})[1]["choices"][0]["text"] for p, b in kept.items()}
    leaving = [send(url, {**body, "prompt": f"leaving {i}", "max_tokens": 200, "stream": i % 2 == 0})
               for i in range(12)]
    deadline = time.time() + 30
    while sum(srv.worker.counts()) < 12:     # all 12 taken in: a client gone sooner never reaches a handler
        assert time.time() < deadline, srv.worker.counts()
        time.sleep(0.01)
    got: dict = {}

    def read(p, b):
        if b["stream"]:
            got[p] = sse(url + "/v1/completions", b)
        else:
            c = post(url + "/v1/completions", b)[1]["choices"][0]
            got[p] = (c["text"], [c["finish_reason"]], [])
    readers = [threading.Thread(target=read, args=kv) for kv in kept.items()]
    for t in readers:
        t.start()
    for i, sock in enumerate(leaving):
        if i % 2 == 0:       # a stream: after its first event
            sock.settimeout(60)
            seen = b""
            while b"data: " not in seen:
                chunk = sock.recv(1 << 16)
                assert chunk, seen
                seen += chunk
        sock.close()
    for t in readers:
        t.join(120)
    assert {p: v[0] for p, v in got.items()} == alone
    assert all(reasons == ["length"] and not errors for _, reasons, errors in got.values()), got
    deadline = time.time() + 10
    while not srv.worker.idle:
        assert time.time() < deadline, srv.worker.counts()
        time.sleep(0.01)
    assert gauges(url) == (0, 0, aborted + 12)
    assert srv.engine.cache.num_free == srv.engine.cache.num_slots and not srv.engine.running
