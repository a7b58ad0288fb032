"""The server against hostile or broken requests, on a tiny random target with a byte-level
tokenizer (no real model): each is refused at the door with an OpenAI-shaped 400 naming the field
(seeds beyond the generators' range, grammars beyond llguidance's limits, lone surrogates, digits
that are not ASCII, booleans for numbers, strings for booleans), the OpenAPI schema documents the
codes sent, and a failure while serving one request ends that request alone: the others' greedy
outputs are those of a run without it, and the server goes on answering."""

import json
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import dspark.engine
import dspark.server
from dspark.drafters import NgramDrafter
from dspark.drafters.base import PlainDrafter
from dspark.engine import Engine
from dspark.errors import UsageError
from dspark.protocol import CompletionRequest
from dspark.runtime.model import Decoder
from dspark.sampling import SamplingParams
from dspark.structured import GrammarSpec

from test_server import post, serving

BAD_REGEX = "(a{1000}){1000}"        # compiles; llguidance's lexer fails on its first token
PROMPTS = ["The quick brown fox", "hello world, hello", "0123456789", "abc abc abc abc"]


def _tiny_server_target(seed=0, scale=6.0, layers=2):
    """A loaded target as the server sees it: a tiny random Llama over a byte-level tokenizer (256
    bytes and an end token, no merges: any text encodes) with a chat template."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    eos = vocab["</s>"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>")
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    torch.manual_seed(seed)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)     # peaked distributions: greedy far from ties
    return SimpleNamespace(name="tiny", model=Decoder.from_hf(m), tokenizer=tok, eos_token_ids=(eos,))


@pytest.fixture(scope="module")
def tiny():
    return _tiny_server_target()


@pytest.fixture(scope="module")
def server(tiny):
    with serving(tiny, NgramDrafter(block_size=3), max_requests=4, max_len=256) as s:
        yield s


def raw(url, data: bytes, headers=None):
    """POST these bytes; (status, content type, body text)."""
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers.get("content-type"), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type"), e.read().decode()


def sse(url, body):
    """A streamed request's events: (text, finish reasons, error messages)."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"content-type": "application/json"})
    text, reasons, errors = "", [], []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                errors.append(ev["error"]["message"])
                continue
            for c in ev["choices"]:
                text += c.get("text") or ""
                if c.get("finish_reason"):
                    reasons.append(c["finish_reason"])
    return text, reasons, errors


def assert_400(out, status, field, says=None):
    assert status == 400, out
    err = out["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field, out
    assert field.split(".")[0] in err["message"] and (says is None or says in err["message"]), out


def answers(url):
    """The server still serves: health, and a short greedy completion."""
    assert urllib.request.urlopen(url + "/health", timeout=10).status == 200
    status, out = post(url + "/v1/completions", {"prompt": "ok", "max_tokens": 3, "temperature": 0})
    assert status == 200 and out["usage"]["completion_tokens"] >= 1, out


# ---------------------------------------------------------------------------------------------- seeds
@pytest.mark.parametrize("seed, n", [(2 ** 64 - 1, 2), (2 ** 70, 1), (2 ** 64, 1), (2 ** 64 - 15, 16)])
def test_a_seed_past_the_generators_range_is_a_400_naming_it(server, seed, n):
    url, srv = server
    for route, body in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        status, out = post(url + route, {**body, "max_tokens": 2, "seed": seed, "n": n})
        assert_400(out, status, "seed", "2**64")
    answers(url)


def test_the_largest_seeds_serve_every_choice(server):
    url, _ = server
    status, out = post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 3, "seed": 2 ** 64 - 2, "n": 2})
    assert status == 200 and len(out["choices"]) == 2, out
    assert SamplingParams(seed=2 ** 64 - 1).generator().initial_seed() == 2 ** 64 - 1
    with pytest.raises(UsageError, match="seed"):       # the engine's own check, behind the door's
        SamplingParams(seed=2 ** 64)
    with pytest.raises(ValidationError, match="seed"):  # the door's: choice 1 would sample with 2**64
        CompletionRequest.model_validate({"prompt": "hi", "seed": 2 ** 64 - 1, "n": 2})


def _hybrid(target):
    """The default drafter's shape on a tiny target: n-gram lookup (also over served requests)
    where the text repeats, a random DSpark drafter elsewhere."""
    from dspark.drafters.dspark import DSparkDrafter
    from dspark.drafters.hybrid import HybridDrafter
    from _tiny import tiny_drafter_model
    dspark_drafter = DSparkDrafter(tiny_drafter_model(target.model, scale=2.0, vocab=len(target.tokenizer)),
                                   target.model)
    return HybridDrafter(NgramDrafter(block_size=3), dspark_drafter, min_match=1)


@pytest.fixture(scope="module")
def hybrid_server():
    target = _tiny_server_target(layers=3, scale=2.0)
    with serving(target, _hybrid(target), max_requests=4, max_len=256) as s:
        yield s


def test_a_seed_fixes_the_text_alone_and_inside_a_burst(hybrid_server):
    """A seeded temperature-1 request gives one text whatever the server served before (the n-gram
    drafter looks up earlier answers) and whatever shares its steps: that of plain decoding with
    its seed."""
    url, srv = hybrid_server
    body = {"prompt": "abc abc abc", "temperature": 1, "seed": 42, "max_tokens": 24, "ignore_eos": True}
    ids = srv.tokenizer(body["prompt"])["input_ids"]
    from dspark.generation import generate_ids
    want, _ = generate_ids(srv.engine.target, ids, SamplingParams(temperature=1, seed=42), 24, PlainDrafter())
    texts = []
    for _ in range(10):
        status, out = post(url + "/v1/completions", body)
        assert status == 200, out
        texts.append(out["choices"][0]["text"])
    assert set(texts) == {srv.tokenizer.decode(want, skip_special_tokens=True)}
    burst: dict = {}

    def one(key, b):
        burst[key] = post(url + "/v1/completions", b)[1]["choices"][0]["text"]
    others = [{"prompt": p, "temperature": t, "max_tokens": 24, "ignore_eos": True, **({"seed": s} if s else {})}
              for p, t, s in zip(PROMPTS * 2, (1, 0, 1, 0.7) * 2, (None, None, 7, 3, None, 1, 2, None))]
    threads = [threading.Thread(target=one, args=(("seeded", i), body)) for i in range(10)]
    threads += [threading.Thread(target=one, args=(("other", i), b)) for i, b in enumerate(others)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert {v for k, v in burst.items() if k[0] == "seeded"} == {texts[0]}


def test_a_request_the_engine_cannot_admit_fails_alone(server, monkeypatch):
    """Whatever add_request raises (here: what an out-of-range seed raised in torch), that request
    gets a 500 and the engine thread keeps serving."""
    url, srv = server
    real = srv.engine.add_request

    def add(prompt_ids, options, *a, **k):
        if options.params.seed == 666:
            raise RuntimeError("Overflow when unpacking long long")
        return real(prompt_ids, options, *a, **k)
    monkeypatch.setattr(srv.engine, "add_request", add)
    status, out = post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 666})
    assert status == 500 and "Overflow" in out["error"]["message"], out
    answers(url)


# ---------------------------------------------------------------------------------------------- grammars
@pytest.mark.parametrize("body, field, kind", [
    ({"structured_outputs": {"regex": BAD_REGEX}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"grammar": f'start: "x" /{BAD_REGEX}/'}}, "structured_outputs", "grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "string", "pattern": f"^{BAD_REGEX}$"}}}}, "response_format", "json"),
])
def test_a_grammar_past_llguidances_limits_is_a_400_naming_it(server, body, field, kind):
    url, srv = server
    status, out = post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 4, **body})
    assert_400(out, status, field, kind)
    assert "<state>" not in out["error"]["message"] and "\n" not in out["error"]["message"]
    assert srv.worker.idle
    answers(url)


def test_a_good_grammar_still_passes_the_door(server):
    url, _ = server
    status, out = post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 8, "temperature": 0,
                                                 "structured_outputs": {"regex": "(ab|c)+"}})
    assert status == 200 and out["choices"][0]["text"], out
    assert set(out["choices"][0]["text"].replace("ab", "")) <= {"c"}


def _lark_chain(n):
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "x"\n'


def _ref_chain(n):
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


# grammars that overflow llguidance's stack (SIGSEGV in whatever process compiles them), and JSON
# nested deeper than Python's recursion limit
DEEP = [({"structured_outputs": {"grammar": _lark_chain(10_000)}}, "structured_outputs", "grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _ref_chain(3_000)}}},
         "response_format", "json"),
        ({"structured_outputs": {"json": _ref_chain(3_000)}}, "structured_outputs", "json")]


def test_grammars_that_crash_llguidance_are_a_400_and_others_decode_on(server):
    """Each hostile grammar is sent while greedy streams decode: each gets a 400 naming its field,
    the sandbox restarts, the streams' tokens equal a run without them, and a normal grammar still
    compiles afterwards; so do the other hostile classes in the same window (numbers at fp32's
    edge: a 400 or their greedy limit; a text/plain body: 415; a schema nested just below the door's
    limit: 400)."""
    url, srv = server
    baseline = _greedy_runs(server, PROMPTS[:3])
    restarts = srv.grammars.restarts
    results: list = []

    others: list = []

    def hostile():
        for body, field, _ in DEEP:
            results.append((post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 4, **body}), field))
        # the other classes in the same window: numbers past fp32's range, a body a web page can send,
        # a schema nested just below the door's limit
        for extra in ({"repetition_penalty": 1e-38}, {"temperature": 5e-324}, {"top_p": 1e-45}):
            others.append(post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 4, **extra})[0])
        others.append(raw(url + "/v1/completions", b'{"prompt": "hi"}', {"content-type": "text/plain"})[0])
        deep = '{"type": "array", "items": ' * 900 + '{"type": "string"}' + "}" * 900
        others.append(raw(url + "/v1/completions",
                          ('{"prompt": "hi", "structured_outputs": {"json": ' + deep + "}}").encode())[0])
    t = threading.Thread(target=hostile)
    t.start()
    got = _greedy_runs(server, PROMPTS[:3])
    t.join(300)
    assert got == baseline
    assert len(results) == len(DEEP)
    for (status, out), field in results:
        assert_400(out, status, field, "too complex")
    assert others == [400, 200, 200, 415, 400]
    assert srv.grammars.restarts >= restarts + 2        # the two chains crashed the sandbox, not the server
    test_a_good_grammar_still_passes_the_door(server)
    answers(url)


def test_grammars_queued_past_the_bound_are_a_503_and_the_queue_drains(server):
    """While the sandbox is busy (its lock held, as by a slow grammar), up to ``max_queued`` grammars
    wait; the next request is turned away at once with a 503, not parked on a server thread; once
    the sandbox is free the queued ones compile and new grammars pass again."""
    url, srv = server
    sandbox = srv.grammars
    body = {"prompt": "hi", "max_tokens": 4, "structured_outputs": {"regex": "(ab|c)+"}}
    queued: list = []
    with sandbox._lock:         # a grammar compiling
        waiting = [threading.Thread(target=lambda: queued.append(post(url + "/v1/completions", body)[0]))
                   for _ in range(sandbox.max_queued)]
        for t in waiting:
            t.start()
        deadline = time.monotonic() + 60
        while sandbox._queued < sandbox.max_queued and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        status, out = post(url + "/v1/completions", body)
        assert status == 503 and "retry" in out["error"]["message"], out
        assert time.monotonic() - t0 < 5
    for t in waiting:
        t.join(120)
    assert queued == [200] * sandbox.max_queued
    assert post(url + "/v1/completions", body)[0] == 200
    answers(url)


def test_a_tool_grammar_that_times_out_is_not_retried_tool_by_tool(server, monkeypatch):
    """A tools request whose grammar runs past the sandbox's timeout gets its 400 after one
    timeout, not one more per tool (each could take the timeout again)."""
    from dspark.grammar_sandbox import GrammarTimeout
    url, srv = server
    calls = []

    def slow(kind, value):
        calls.append(kind)
        raise GrammarTimeout(f"{kind} is too complex: the grammar engine took more than 20 s to compile it")
    monkeypatch.setattr(srv.grammars, "compile", slow)
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(8)]
    status, out = post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                      "tool_choice": "required", "max_tokens": 4})
    assert_400(out, status, "tools", "too complex")
    assert calls == ["grammar"]


def test_a_schema_nested_nearly_as_deep_as_the_door_allows_is_a_400(server):
    url, _ = server
    deep = '{"type": "array", "items": ' * 900 + '{"type": "string"}' + "}" * 900
    status, _, out = raw(url + "/v1/completions",
                      ('{"prompt": "hi", "max_tokens": 4, "structured_outputs": {"json": ' + deep + "}}").encode())
    assert status == 400 and "structured_outputs" in out, out
    answers(url)


def _greedy_runs(server, prompts, extra=None):
    """Each prompt streamed concurrently (greedy, 40 tokens), plus ``extra`` (a body) among them;
    {prompt: (text, finish reasons, errors, the engine's output token ids)} and extra's (text,
    finish reasons, errors) under the key None. The ids, because the text of a random byte-level
    model's output is mostly U+FFFD."""
    url, srv = server
    got, ids = {}, {}
    record = srv.metrics.request_ended

    def ended(r):
        ids[tuple(r.prompt_ids)] = list(r.output_ids)
        record(r)

    def one(key, body):
        got[key] = sse(url + "/v1/completions", body)
    bodies = {p: {"prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True} for p in prompts}
    if extra is not None:
        bodies[None] = extra
    srv.metrics.request_ended = ended
    try:
        threads = [threading.Thread(target=one, args=kv) for kv in bodies.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        srv.metrics.request_ended = record
    assert len(got) == len(bodies)
    tok = srv.tokenizer
    return {k: v if k is None else (*v, ids[tuple(tok(k)["input_ids"])]) for k, v in got.items()}


def test_a_grammar_failing_in_the_engine_ends_its_request_alone(server, monkeypatch):
    """The grammar the door now refuses, let past it: it fails at its first token inside the
    engine step; its stream ends with a one-line error event, every other request in flight ends
    as it would have without it, and the server still answers."""
    url, srv = server
    baseline = _greedy_runs(server, PROMPTS[:3])
    monkeypatch.setattr(srv.grammars, "compile", lambda kind, value: GrammarSpec(kind, value).compile())
    bad = {"prompt": "x", "max_tokens": 40, "temperature": 0, "structured_outputs": {"regex": BAD_REGEX}}
    got = _greedy_runs(server, PROMPTS[:3], bad)
    text, reasons, errors = got.pop(None)
    assert len(errors) == 1 and "request failed" in errors[0] and "too many expressions" in errors[0], errors
    assert "<state>" not in errors[0] and not reasons
    assert got == baseline and all(r == ["length"] and not e and len(i) == 40 for _, r, e, i in got.values())
    answers(url)
    assert srv.engine.cache.num_free == srv.engine.cache.num_slots


@pytest.mark.parametrize("where", ["prefill", "law", "draft", "emit"])
def test_an_exception_serving_one_request_ends_it_alone(server, monkeypatch, where):
    """Something one request uses raises (its first token's sampling, its processed logits (the law
    its block is verified under), its drafts, its emitted tokens), on its 4th use so that it is
    running among the others: it alone ends, with an error event; the others' greedy outputs equal
    a run without it."""
    url, srv = server
    baseline = _greedy_runs(server, PROMPTS)
    calls = []

    def poisoned(fn, params_of):
        def wrapper(*a, **k):
            if params_of(*a, **k).seed == 666:
                calls.append(1)
                if len(calls) >= (1 if where == "prefill" else 4):
                    raise ValueError(f"injected failure in {where}")
            return fn(*a, **k)
        return wrapper
    if where == "prefill":
        monkeypatch.setattr(dspark.engine, "sample_from_logits",
                            poisoned(dspark.engine.sample_from_logits, lambda logits, params, g: params))
    elif where == "law":
        monkeypatch.setattr(srv.engine, "_law", poisoned(srv.engine._law, lambda r, logits, drafts=None: r.params))
    elif where == "draft":
        drafter = srv.engine.drafter
        monkeypatch.setattr(drafter, "propose", poisoned(
            drafter.propose, lambda ctxs: next((c.params for c in ctxs if c.params.seed == 666), ctxs[0].params)))
    else:
        monkeypatch.setattr(srv.engine, "_append", poisoned(srv.engine._append, lambda r, tokens, logits: r.params))
    bad = {"prompt": "abcabcabcabcabc", "max_tokens": 40, "temperature": 0, "seed": 666, "ignore_eos": True}
    got = _greedy_runs(server, PROMPTS, bad)
    text, reasons, errors = got.pop(None)
    assert calls and errors == [f"request failed: ValueError: injected failure in {where}"], (errors, text)
    assert got == baseline and all(r == ["length"] and not e and len(i) == 40 for _, r, e, i in got.values())
    monkeypatch.undo()
    answers(url)
    assert srv.engine.cache.num_free == srv.engine.cache.num_slots


def test_without_isolation_a_failure_still_raises_out_of_the_step(tiny, monkeypatch):
    """Batch generation (no server to tell) keeps the old contract: the exception leaves step."""
    e = Engine(tiny.model, PlainDrafter(), max_requests=2, max_len=64, eos_ids=tiny.eos_token_ids)
    e.add_request([1, 2, 3], SamplingParams(temperature=0), 4)

    def boom(*a, **k):
        raise ValueError("boom")
    monkeypatch.setattr(dspark.engine, "sample_from_logits", boom)
    with pytest.raises(ValueError, match="boom"):
        e.step()


def test_a_server_refuses_an_engine_that_lets_one_failure_end_the_step(tiny):
    """The server never changes the engine it is given: one built without isolation is refused."""
    e = Engine(tiny.model, PlainDrafter(), max_requests=2, max_len=64, eos_ids=tiny.eos_token_ids)
    with pytest.raises(UsageError, match="isolate_failures"):
        dspark.server.Server(tiny, e, "tiny")
    assert not e.isolate_failures


def test_engine_isolation_reports_the_failed_request(tiny, monkeypatch):
    e = Engine(tiny.model, NgramDrafter(block_size=3), max_requests=3, max_len=64, isolate_failures=True,
               prefix_caching=True, prefix_min_match=2)
    greedy = SamplingParams(temperature=0)
    good = [e.add_request([5, 6, 7, 5, 6], greedy, 12), e.add_request([9, 9, 9], greedy, 12)]
    bad = e.add_request([1, 2, 3], SamplingParams(temperature=0, seed=666), 12)
    real = e._law

    def law(r, logits, drafts=None):       # its decoding rows' law raises; its first token came
        if r.params.seed == 666 and drafts is not None:
            raise ValueError("bad request")
        return real(r, logits, drafts)
    monkeypatch.setattr(e, "_law", law)
    ended = []
    while e.has_work():
        ended += e.step()
    assert bad in ended and bad.status == "failed" and bad.finish_reason == "error"
    assert bad.error == "ValueError: bad request" and len(bad.output_ids) == 1    # its first token came
    assert all(r.status == "finished" and len(r.output_ids) == 12 for r in good)
    assert e.cache.num_free == e.cache.num_slots
    ref = Engine(tiny.model, NgramDrafter(block_size=3), max_requests=3, max_len=64)
    want = [ref.add_request(r.prompt_ids, greedy, 12) for r in good]
    ref.run()
    assert [r.output_ids for r in good] == [r.output_ids for r in want]


# ---------------------------------------------------------------------------------------------- text and types
@pytest.mark.parametrize("route, body, field", [
    ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "prompt.1"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"]}', "stop.0"),
    ("/v1/completions", '{"prompt": "hi", "structured_outputs": {"regex": "a\\ud800"}}', "structured_outputs.regex"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\udc00"}]}]}',
     "messages.0.content.0.text"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "logit_bias": {"\\ud800": 1}}', "logit_bias.\\ud800"),
])
def test_a_lone_surrogate_is_a_400_naming_its_field(server, route, body, field):
    url, _ = server
    status, ctype, text = raw(url + route, body.encode())
    assert ctype == "application/json", text
    out = json.loads(text)
    assert status == 400 and out["error"]["param"] == field and "lone surrogate" in out["error"]["message"], out
    assert out["error"]["message"].startswith(field + ":")


@pytest.mark.parametrize("key", ["\u00b2", "\u0663", "1_0", " 7", "+7", "1" * 5000])
def test_a_logit_bias_key_int_takes_but_that_is_no_token_id_is_a_400(server, key):
    url, _ = server
    status, out = post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {key: 5}})
    assert_400(out, status, "logit_bias", "token ids")


@pytest.mark.parametrize("route, body, field", [
    ("/v1/completions", {"prompt": [True, 5]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, False]]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "echo": 1}, "echo"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids.0"),
    ("/v1/completions", {"prompt": "hi", "n": True}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "seed": 1.5}, "seed"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": True}}, "logit_bias.5"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "true"}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs"),
    ("/detokenize", {"tokens": [True]}, "tokens.0"),
    ("/tokenize", {"prompt": "hi", "return_token_strs": "yes"}, "return_token_strs"),
])
def test_types_are_strict(server, route, body, field):
    url, _ = server
    status, out = post(url + route, body)
    assert_400(out, status, field)


def test_json_numbers_still_fill_float_fields(server):
    url, _ = server
    status, out = post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0,
                                                 "top_p": 1, "logit_bias": {"5": 1}})
    assert status == 200, out


def test_bodies_that_are_not_json_and_unknown_routes_get_openai_errors(server):
    url, _ = server
    for data in (b'{"prompt": "\xff\xfe"}', b"{not json", b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}"):
        status, ctype, text = raw(url + "/v1/completions", data)
        assert status == 400 and ctype == "application/json" and json.loads(text)["error"]["message"], text
    status, ctype, text = raw(url + "/v1/nothing-here", b"{}")
    assert status == 404 and json.loads(text)["error"]["type"] == "invalid_request_error", text


def test_the_openapi_schema_documents_the_codes_sent(server):
    url, _ = server
    schema = json.loads(urllib.request.urlopen(url + "/openapi.json", timeout=10).read())
    post_codes = {"200", "400", "401", "404", "408", "413", "415", "500"}
    sent = {"/v1/completions": post_codes, "/v1/chat/completions": post_codes, "/tokenize": post_codes,
            "/detokenize": post_codes, "/v1/models": {"200", "401"}, "/health": {"200"}, "/metrics": {"200", "401"}}
    for path, ops in schema["paths"].items():
        for op in ops.values():
            assert set(op["responses"]) == sent[path], (path, op["responses"])
            for code, resp in op["responses"].items():
                if code != "200":
                    ref = resp["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith("/ErrorResponse"), (path, code, ref)
    paths = schema["paths"]
    for route in ("/v1/completions", "/v1/chat/completions"):     # a stream is a 200 too
        assert set(paths[route]["post"]["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        body = paths[route]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert "prompt" in schema["components"]["schemas"][body.split("/")[-1]]["properties"] or "chat" in route
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    assert set(schema["components"]["schemas"]["ErrorBody"]["properties"]) == {"message", "type", "param", "code"}
    # and what a route answers a malformed body is the documented 400 in that shape
    status, out = post(url + "/v1/completions", {"prompt": "hi", "temperature": -1})
    assert_400(out, status, "temperature")


def test_grammar_check_refuses_what_the_matcher_cannot_serve(tiny):
    from dspark.structured import check
    with pytest.raises(UsageError, match="regex fails in the grammar engine on its first tokens"):
        check(tiny, GrammarSpec("regex", BAD_REGEX).compile(), "regex")
    for kind, value in (("regex", "(a{100}){100}"), ("choice", ["yes", "no"]),
                        ("json", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})):
        check(tiny, GrammarSpec(kind, value).compile(), kind)


def test_a_job_receives_typed_events(tiny):
    """The engine thread tells a job what happened with dataclasses: Tokens (with their log
    probabilities when asked), then Ended with the finish reason, or Failed with a message."""
    from dspark.engine import RequestOptions
    from dspark.server import Ended, Failed, Job, Tokens
    srv = dspark.server.Server(tiny, Engine(tiny.model, NgramDrafter(block_size=3), max_requests=2, max_len=64,
                                            isolate_failures=True), "tiny")
    events: dict[int, list] = {0: [], 1: []}
    greedy = SamplingParams(temperature=0)
    ok = Job([5, 6, 7], RequestOptions(greedy, 6, frozenset(), logprobs=1), events[0].append)
    bad = Job([5, 6, 7], RequestOptions(greedy, 6, frozenset({10 ** 6})), events[1].append)   # no such stop token
    srv.worker.start()
    try:
        srv.worker.submit(ok)
        srv.worker.submit(bad)
        for _ in range(600):
            if events[0] and isinstance(events[0][-1], Ended) and events[1]:
                break
            threading.Event().wait(0.05)
    finally:
        srv.worker.close()
    *tokens, end = events[0]
    assert tokens and all(isinstance(t, Tokens) and len(t.logprobs) == len(t.ids) for t in tokens)
    assert sum(len(t.ids) for t in tokens) == 6 and end == Ended("length")
    assert len(events[1]) == 1 and isinstance(events[1][0], Failed) and "stop token ids" in events[1][0].message


def test_the_engine_verifies_a_step_in_one_call_and_a_nan_ends_its_request_alone(tiny, monkeypatch):
    """Every decoding request of a step goes through one verify_batch call; a request whose law
    turns NaN ends alone ("failed"), and the others' seeded outputs equal a run without it."""
    calls = []
    real = dspark.engine.verify_batch

    def counted(tokens, probs, target, batch):
        calls.append(len(batch.lengths))
        return real(tokens, probs, target, batch)
    monkeypatch.setattr(dspark.engine, "verify_batch", counted)
    e = Engine(tiny.model, NgramDrafter(block_size=3), max_requests=4, max_len=64, isolate_failures=True)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    # rejection sampling (seeded requests' exact path verifies apart: ``exact`` below)
    good = [e.add_request([5, 6, 7, 5, 6, 7, 5], p, 12, exact_seed=False) for p in params]
    bad = e.add_request([1, 2, 3], SamplingParams(temperature=1.0, seed=666), 12, exact_seed=False)
    exact = e.add_request([1, 2, 3], SamplingParams(temperature=1.0, seed=667), 12)
    law = e._law

    def nan_law(r, logits, drafts=None):
        out = law(r, logits, drafts)
        broken = r in (bad, exact) and drafts is not None and len(r.output_ids) >= 3
        return out.float().fill_(float("nan")) if broken else out
    monkeypatch.setattr(e, "_law", nan_law)
    while e.has_work():
        decoding = sum(r.ctx is not None and r is not exact for r in e.running)
        before = len(calls)
        e.step()
        assert len(calls) - before == (1 if decoding else 0) and (not decoding or calls[-1] == decoding)
    assert bad.status == "failed" and "NaN" in bad.error and len(bad.output_ids) >= 3
    assert exact.status == "failed" and "NaN" in exact.error and len(exact.output_ids) >= 3
    assert all(r.status == "finished" and len(r.output_ids) == 12 for r in good)
    ref = Engine(tiny.model, NgramDrafter(block_size=3), max_requests=4, max_len=64)
    want = [ref.add_request(r.prompt_ids, p, 12, exact_seed=False) for r, p in zip(good, params)]
    ref.run()
    assert [r.output_ids for r in good] == [r.output_ids for r in want]


# ------------------------------------------------------------------------------ numbers at fp32's edge
@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [1e-38, 1e-45, 5e-324, 1e-300])
def test_sampling_numbers_near_zero_decode_as_their_limit(server, field, value):
    """A temperature under 1e-5 is greedy (vLLM's rule); a top_p under fp32's smallest number keeps
    the most likely token: both give greedy's tokens, never a NaN, a 500 or a garbage token."""
    url, _ = server
    body = {"prompt": "The quick brown fox", "max_tokens": 12, "ignore_eos": True, "seed": 1}
    status, greedy = post(url + "/v1/completions", {**body, "temperature": 0})
    status2, out = post(url + "/v1/completions", {**body, field: value, "temperature": value if field ==
                                                  "temperature" else 1.0})
    assert status == 200 and status2 == 200, out
    assert out["choices"][0]["text"] == greedy["choices"][0]["text"]


@pytest.mark.parametrize("value", [1e-38, 5e-324, 1e-7, 1e7])
def test_a_repetition_penalty_outside_fp32s_range_is_a_400(server, value):
    url, _ = server
    for stream in (False, True):
        status, out = post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 4, "repetition_penalty": value,
                                                     "stream": stream})
        assert_400(out, status, "repetition_penalty")
    answers(url)
