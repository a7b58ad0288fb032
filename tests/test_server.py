"""The OpenAI-compatible server on the real default model (fp32), driven by the `openai` client and
raw HTTP: greedy output equal to plain decoding, streaming equal to the whole response, stop
strings, a queue of concurrent requests, seeds, errors, the API key, a dropped stream's cancellation
and the metrics."""

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest
from openai import OpenAI, BadRequestError, AuthenticationError, NotFoundError

from dspark.drafters import load_drafter
from dspark.drafters.base import PlainDrafter
from dspark.engine import Engine
from dspark.generation import generate_ids
from dspark.protocol import TextStream
from dspark.sampling import SamplingParams
from dspark.server import create_app, in_thread

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Here is a list of fruits:", "import numpy as np\n",
           "Once upon a time"]


@contextmanager
def serving(target, drafter, *, max_requests=2, max_len=512, api_key=None, prefix_caching=False, **app_flags):
    """The app on a free loopback port; ``app_flags``: create_app's (max_body_mb, max_prompts, ...)."""
    engine = Engine(target.model, drafter, max_requests=max_requests, max_len=max_len,
                    block_size=drafter.block_size, eos_ids=target.eos_token_ids, prefix_caching=prefix_caching,
                    isolate_failures=True)
    app = create_app(target, engine, api_key=api_key, **app_flags)
    with in_thread(app) as (url, _, _):
        yield url, app.state.server


@pytest.fixture(scope="module")
def server(target_fp32):
    with serving(target_fp32, load_drafter("ngram", target_fp32)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def plain(target, prompt_ids, n):
    ids, _ = generate_ids(target.model, prompt_ids, SamplingParams(temperature=0), n, PlainDrafter(),
                          eos_ids=target.eos_token_ids)
    return ids


def post(url, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_greedy_completion_equals_plain_decoding(client, target_fp32):
    tok = target_fp32.tokenizer
    for prompt in PROMPTS[:2]:
        ids = tok(prompt)["input_ids"]
        want = plain(target_fp32, ids, 24)
        r = client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
        assert r.choices[0].finish_reason == ("stop" if want[-1] in target_fp32.eos_token_ids else "length")
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))
    # token-id prompts and echo
    r = client.completions.create(model="smollm2-135m-instruct", prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[1] + tok.decode(want[:8], skip_special_tokens=True)


def test_chat_stream_equals_whole_response(client):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=30,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_stop_strings_cut_before_the_first_occurrence(server, client, target_fp32):
    tok = target_fp32.tokenizer
    full = tok.decode(plain(target_fp32, tok(PROMPTS[0])["input_ids"], 40), skip_special_tokens=True)
    stop = full[12:17]          # spans tokens: held back while it could still be a stop string
    want = full[:full.find(stop)]
    r = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                  stop=[stop, "never appears \u2603"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    parts = list(client.completions.create(model="smollm2-135m-instruct", prompt=PROMPTS[0], max_tokens=40,
                                           temperature=0, stop=stop, stream=True))
    assert "".join(p.choices[0].text for p in parts) == want
    assert parts[-1].choices[0].finish_reason == "stop"
    text = urllib.request.urlopen(server[0] + "/metrics", timeout=10).read().decode()
    stops = [float(x.split()[1]) for x in text.splitlines() if x.startswith('dspark:request_success_total{finished_reason="stop"}')]
    assert stops and stops[0] >= 2       # the two stop-string endings are counted


def test_text_stream_holds_back_incomplete_characters_and_stop_prefixes(target_fp32):
    tok = target_fp32.tokenizer
    ids = tok("naïve café ☃ snowman end")["input_ids"]
    s = TextStream(tok, ["snow"])
    out = "".join(s.add([t]) for t in ids) + s.finish()
    assert out == "naïve café ☃ " and s.stopped
    s = TextStream(tok)
    pieces = [s.add([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + s.finish() == tok.decode(ids, skip_special_tokens=True)


def test_concurrent_requests_queue_and_match_plain(server, client, target_fp32):
    tok = target_fp32.tokenizer
    want = {p: tok.decode(plain(target_fp32, tok(p)["input_ids"], 16), skip_special_tokens=True) for p in PROMPTS}
    got = {}

    def one(p):
        got[p] = client.completions.create(model="smollm2-135m-instruct", prompt=p, max_tokens=16,
                                           temperature=0).choices[0].text
    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]   # 5 requests, 2 slots
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want
    # several prompts in one request: one choice each, in order
    r = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPTS[:3], max_tokens=16, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [want[p] for p in PROMPTS[:3]]


def test_seeded_choices_are_reproducible(target_fp32):
    with serving(target_fp32, PlainDrafter()) as (url, _):
        c = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        runs = [[ch.text for ch in c.completions.create(model="smollm2-135m-instruct", prompt=PROMPTS[4], max_tokens=12, temperature=1.0,
                                                         seed=7, n=2).choices] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 2


@pytest.mark.parametrize("body, status, says", [
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "bogus": 1}, 400, "unknown field 'bogus'"),
    ({"prompt": ""}, 400, "prompt is empty"),
    ({"prompt": [10 ** 9]}, 400, "vocabulary"),
    ({"prompt": "hi", "max_tokens": 10 ** 6}, 400, "maximum context length"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {str(10 ** 9): 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ({"prompt": "hi", "response_format": {"type": "yaml"}}, 400, "response_format"),
    ({"prompt": "hi", "response_format": {"type": "json_schema"}}, 400, "json_schema is required"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
     400, "invalid json"),
    ({"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "exactly one"),
    ({"prompt": "hi", "structured_outputs": {"regex": "(a"}}, 400, "invalid regex"),
    ({"prompt": "hi", "structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, 400,
     "not both"),
])
def test_bad_requests_get_clear_errors(server, body, status, says):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    code, out = post(server[0] + path, body)
    assert code == status
    assert says in out["error"]["message"], out
    wait_idle(server[1], 10)      # nothing was submitted, or it ended


def wait_idle(srv, seconds):
    deadline = time.time() + seconds
    while not srv.worker.idle or srv.engine.has_work():
        assert time.time() < deadline, "a request still runs"
        time.sleep(0.05)


def test_malformed_json_and_the_openai_client_errors(server, client):
    code, out = post(server[0] + "/v1/completions", b"{not json")
    assert code == 400 and "not valid JSON" in out["error"]["message"]
    with pytest.raises(BadRequestError, match="temperature"):
        client.completions.create(model="smollm2-135m-instruct", prompt="hi", temperature=-2)
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])


def test_api_key(target_fp32):
    with serving(target_fp32, PlainDrafter(), api_key="sesame") as (url, _):
        code, out = post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert code == 401 and out["error"]["type"] == "authentication_error"
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
        assert ok.completions.create(model="smollm2-135m-instruct", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        with urllib.request.urlopen(url + "/health", timeout=10) as r:     # health needs no key
            assert r.status == 200 and json.loads(r.read()) == {"status": "ok", "compiled": False}   # eager here


def test_dropped_stream_cancels_its_request(server):
    url, srv = server
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": PROMPTS[3], "max_tokens": 480, "stream": True,
                                                        "ignore_eos": True, "temperature": 1}),
                 {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.close()                # the client goes away mid-stream (480 tokens would take over 10 s)
    wait_idle(srv, 5)
    assert srv.engine.cache.num_free == srv.engine.cache.num_slots
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    assert 'dspark:request_success_total{finished_reason="abort"}' in text


def test_models_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
    client.completions.create(model="smollm2-135m-instruct", prompt=PROMPTS[0], max_tokens=16, temperature=0)
    text = urllib.request.urlopen(server[0] + "/metrics", timeout=10).read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["dspark:spec_decode_num_draft_tokens_total"] > 0
    assert values["dspark:generation_tokens_total"] >= 16
    assert values["dspark:num_requests_running"] == 0


def test_prefix_caching_reuses_a_conversation_and_counts_it(target_fp32):
    msgs = [{"role": "user", "content": "Name three colours."}]
    with serving(target_fp32, load_drafter("ngram", target_fp32), prefix_caching=True) as (url, _):
        c = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        first = c.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=12, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        again = c.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=12, temperature=0)
        assert again.choices[0].message.content == first.choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
        # the next turn starts with the first's prompt and answer
        turn = msgs + [{"role": "assistant", "content": first.choices[0].message.content},
                       {"role": "user", "content": "And three more?"}]
        nxt = c.chat.completions.create(model="smollm2-135m-instruct", messages=turn, max_tokens=12, temperature=0)
        assert nxt.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    hits = again.usage.prompt_tokens_details.cached_tokens + nxt.usage.prompt_tokens_details.cached_tokens
    assert values["dspark:prefix_cache_hits_total"] == hits
    assert values["dspark:prefix_cache_queries_total"] == (2 * first.usage.prompt_tokens + nxt.usage.prompt_tokens)


def test_serve_flags_fail_before_loading_anything():
    from dspark.cli import main
    assert main(["serve", "--policy", "bogus"]) == 2
    assert main(["serve", "--port", "70000"]) == 2
    assert main(["serve", "--max-requests", "0"]) == 2


def test_bench_serving_runs_the_server_as_serve_does(capsys):
    """`dspark bench serving` on our server (engine on the main thread, HTTP and clients on others),
    beside the engine alone; also the check that --against-engine needs our own server."""
    from dspark.cli import main
    assert main(["bench", "serving", "--concurrency", "2", "--num-prompts", "3", "--max-new-tokens", "4",
                 "--drafter", "ngram", "--dtype", "fp32", "--against-engine", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = out["results"]
    assert [r["system"] for r in rows] == ["server", "engine", "server"]
    assert all(r["requests"] == 3 and 3 <= r["tokens"] <= 12 for r in rows)
    assert rows[1]["server_over_engine"] > 0
    assert main(["bench", "serving", "--endpoint", "http://127.0.0.1:9/v1", "--against-engine"]) == 2


def test_bench_serving_sends_each_level_prompts_of_its_own(monkeypatch):
    """Against any endpoint, every concurrency level gets prompts no other level sent: a server that
    saw a prompt before may copy its old answer (the n-gram lookup's history)."""
    from dspark.cli import main
    from dspark.evaluation import serving
    sent = []

    def fake(url, model, key, messages, c, *rest):
        sent.append([m[0]["content"] for m in messages])
        return {"concurrency": c, "total_tokens_per_second": 1.0, "per_user_tokens_per_second": 1.0}
    monkeypatch.setattr(serving, "_closed_loop", fake)
    monkeypatch.setattr(serving, "_first_model", lambda url, key: "m")
    assert main(["bench", "serving", "--endpoint", "http://127.0.0.1:9/v1", "--concurrency", "1,4,16",
                 "--num-prompts", "12"]) == 0
    assert [len(s) for s in sent] == [12, 12, 12] and len({t for s in sent for t in s}) == 36


def test_bench_serving_times_the_first_token_not_the_role_chunk():
    """A stream opens with the role alone: content "" (ours, vLLM) or null (llama.cpp's server);
    the time to the first token is that of the first chunk with text."""
    from dspark.evaluation.serving import _has_content
    role = b'{"choices":[{"index":0,"delta":{"role":"assistant","content":%s}}]}'
    assert not _has_content(role % b"null") and not _has_content(role % b'""')
    assert _has_content(b'{"choices":[{"index":0,"delta":{"content":"There"}}]}')
    assert not _has_content(b'{"choices":[],"usage":{"completion_tokens":3}}')
    assert not _has_content(b'{"content": "cut')


def test_sigterm_lets_requests_in_flight_finish():
    """`dspark serve` in a process of its own: SIGTERM mid-stream, the stream still ends with all its
    tokens and [DONE], and the server exits 0."""
    import os
    import signal
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "dspark.cli", "serve", "--port", "0", "--dtype", "fp32",
                             "--drafter", "plain", "--max-requests", "2", "--max-len", "256", "--threads", "2",
                             "--log-level", "warning"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = None
        for line in proc.stderr:
            if " on http://" in line:
                url = line.rsplit(" on ", 1)[1].strip()
                break
        assert url, "no banner"
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": PROMPTS[4], "max_tokens": 40, "stream": True,
                                                            "ignore_eos": True, "temperature": 0,
                                                            "stream_options": {"include_usage": True}}),
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        rest = resp.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")
        usage = [json.loads(x[6:]) for x in rest.splitlines() if '"usage"' in x][0]["usage"]
        assert usage["completion_tokens"] == 40
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()


def _reference_logprobs(target, prompt_ids, output_ids):
    """The target's log-softmax at each output position, from one forward over prompt + output."""
    import torch
    ids = list(prompt_ids) + list(output_ids)
    cache = target.model.new_cache(1, len(ids) + 1)
    rows = torch.arange(len(prompt_ids) - 1, len(ids) - 1)
    out = target.model(torch.tensor(ids), [(cache.allocate(), len(ids))], cache, logits_rows=rows)
    return torch.log_softmax(out.logits.float(), -1)


def test_completion_logprobs_are_the_targets_and_stream_as_whole(client, target_fp32):
    """Sampled (T = 1; n-gram drafts are verified by the target's own draws, so the seeded output is
    plain decoding's with that seed): each returned log probability is the target's own at that
    position (raw logits), the top ones are its most likely tokens with the sampled one added, the
    offsets run over the tokens' text, and a stream carries the same as the whole response."""
    tok = target_fp32.tokenizer
    ids = tok(PROMPTS[3])["input_ids"]
    params = SamplingParams(temperature=1.0, top_k=-1, seed=3)
    want, _ = generate_ids(target_fp32.model, ids, params, 24, PlainDrafter(), eos_ids=target_fp32.eos_token_ids)
    ref = _reference_logprobs(target_fp32, ids, want)
    r = client.completions.create(model="smollm2-135m-instruct", prompt=ids, max_tokens=24, temperature=1.0,
                                  seed=3, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert lp.tokens == [tok.decode([t]) for t in want] and len(want) == r.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for k, (t, got, top) in enumerate(zip(want, lp.token_logprobs, lp.top_logprobs)):
        assert got == pytest.approx(float(ref[k, t]), abs=1e-4), k
        best = ref[k].topk(3)
        for i, v in zip(best.indices.tolist(), best.values.tolist()):
            assert top[tok.decode([i])] == pytest.approx(v, abs=1e-4), k
        assert top[tok.decode([t])] == pytest.approx(got) and len(top) in (3, 4)
    stream = client.completions.create(model="smollm2-135m-instruct", prompt=ids, max_tokens=24,
                                       temperature=1.0, seed=3, logprobs=3, stream=True)
    parts = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    # the same tokens; the values to fp32 rounding (the n-gram drafter, which remembers the first
    # request, drafts differently, and a forward over other rows rounds differently)
    assert sum((p.tokens for p in parts), []) == lp.tokens
    assert sum((p.token_logprobs for p in parts), []) == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert sum((p.text_offset for p in parts), []) == lp.text_offset


def test_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_ask(client, target_fp32):
    """lm-evaluation-harness's loglikelihood request (token ids, echo, max_tokens 1, logprobs 1,
    temperature 0): the prompt's tokens come first with the target's log probabilities (the first
    with none), then the generated one; their sum over a continuation is the reference's."""
    tok = target_fp32.tokenizer
    context, continuation = tok("The capital of France is")["input_ids"], tok(" Paris.")["input_ids"]
    ids = context + continuation
    r = client.completions.create(model="smollm2-135m-instruct", prompt=ids, max_tokens=1, temperature=0,
                                  logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.tokens[:len(ids)] == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert r.choices[0].text.startswith(tok.decode(ids))
    ref = _reference_logprobs(target_fp32, ids[:1], ids[1:])
    want = [float(ref[k, t]) for k, t in enumerate(ids[1:])]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-4)
    assert sum(lp.token_logprobs[len(context):-1]) == pytest.approx(sum(want[len(context) - 1:]), abs=1e-3)
    for t, top in zip(ids[1:], lp.top_logprobs[1:len(ids)]):      # the most likely token and the given one
        assert tok.decode([t]) in top and 1 <= len(top) <= 2
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    stream = list(client.completions.create(model="smollm2-135m-instruct", prompt=ids, max_tokens=4,
                                            temperature=0, logprobs=1, echo=True, stream=True))
    first = stream[0].choices[0]        # the echo, with the prompt's log probabilities
    assert first.text == tok.decode(ids) and first.logprobs.token_logprobs[0] is None
    parts = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert sum((p.tokens for p in parts), [])[:len(ids) + 1] == lp.tokens
    assert sum((p.token_logprobs for p in parts), [])[1:len(ids)] == pytest.approx(lp.token_logprobs[1:len(ids)], abs=1e-4)
    assert sum((p.text_offset for p in parts), [])[:len(ids) + 1] == lp.text_offset


def test_penalties_give_plain_decodings_penalised_output(client, target_fp32):
    """presence / frequency penalties and vLLM's repetition_penalty reach the engine: greedy with
    them equals plain decoding with the same penalties, and differs from the output without."""
    tok = target_fp32.tokenizer
    ids = tok(PROMPTS[2])["input_ids"]
    pen = dict(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.3)
    want, _ = generate_ids(target_fp32.model, ids, SamplingParams(temperature=0, **pen), 32, PlainDrafter(),
                           eos_ids=target_fp32.eos_token_ids)
    r = client.completions.create(model="smollm2-135m-instruct", prompt=ids, max_tokens=32, temperature=0,
                                  presence_penalty=0.5, frequency_penalty=1.0, extra_body={"repetition_penalty": 1.3})
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert want != plain(target_fp32, ids, 32)
    the = tok(" the", add_special_tokens=False)["input_ids"][0]
    forced = client.completions.create(model="smollm2-135m-instruct", prompt=ids, max_tokens=6, temperature=0,
                                       logit_bias={str(the): 100})
    assert forced.choices[0].text == " the" * 6


def test_stop_token_ids_and_min_tokens(client, target_fp32):
    """vLLM's stop_token_ids end a choice at that token (kept, as vLLM keeps non-special ones);
    min_tokens keeps end-of-text away until that many tokens (greedy: plain decoding of the law with
    the stop tokens ruled out until then)."""
    tok = target_fp32.tokenizer
    ids = tok(PROMPTS[0])["input_ids"]
    want = plain(target_fp32, ids, 16)
    r = client.completions.create(model="smollm2-135m-instruct", prompt=ids, max_tokens=16, temperature=0,
                                  extra_body={"stop_token_ids": [want[5]]})
    cut = want.index(want[5]) + 1
    assert r.choices[0].text == tok.decode(want[:cut]) and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == cut
    msgs = [{"role": "user", "content": "Reply with one word: yes or no?"}]
    short = client.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=40, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20
    long = client.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=40, temperature=0,
                                          extra_body={"min_tokens": 20})
    assert long.usage.completion_tokens >= 20
    assert long.choices[0].message.content.startswith(short.choices[0].message.content)
    status, out = post(client.base_url.__str__().rstrip("/") + "/completions",
                       {"prompt": "hi", "stop_token_ids": [10 ** 9]})
    assert status == 400 and "stop_token_ids" in out["error"]["message"]


def test_chat_logprobs_greedy_and_cut_at_a_stop_string(client, target_fp32):
    """Chat log probabilities in the OpenAI shape (token, logprob, bytes, top_logprobs); at
    temperature 0 the sampled token is the most likely one; with a stop string they end at the
    token that completed it, and the usage counts the same tokens."""
    msgs = [{"role": "user", "content": "Count from one to ten in words, separated by commas."}]
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=32,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob) and c.logprob <= 0
        assert c.top_logprobs[1].logprob <= c.top_logprobs[0].logprob
        assert bytes(c.bytes).decode() == c.token
    text = r.choices[0].message.content
    shown = content[:-1] if r.choices[0].finish_reason == "stop" else content    # less the end-of-text token
    assert "".join(c.token for c in shown) == text and len(text) > 12
    stop = text[len(text) // 2:len(text) // 2 + 3]
    s = client.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=32, temperature=0,
                                       logprobs=True, stop=[stop])
    got = s.choices[0].logprobs.content
    assert s.choices[0].message.content == text[:text.index(stop)]
    assert len(got) == s.usage.completion_tokens
    joined = "".join(c.token for c in got)
    assert stop in joined and stop not in "".join(c.token for c in got[:-1])   # ends at the completing token
    assert [c.token for c in got] == [c.token for c in content[:len(got)]]
    assert [c.logprob for c in got] == pytest.approx([c.logprob for c in content[:len(got)]], abs=1e-4)
    plain_r = client.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=4, temperature=0)
    assert plain_r.choices[0].logprobs is None


@pytest.mark.parametrize("body, field", [
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "logprobs": -1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs requires logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_logprobs_requests_name_the_field(server, body, field):
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, out = post(server[0] + route, body)
    assert status == 400 and field in out["error"]["message"], out


def test_a_structured_request_builds_one_matcher_for_all_its_choices(client, monkeypatch):
    """Prompts times n choices under one grammar: one matcher built in the server, the others
    copies (a fresh matcher per choice held megabytes each: a request could exhaust memory)."""
    from dspark import structured
    built = []
    init = structured.GrammarState.__init__

    def counting(self, *a, **k):
        built.append(1)
        init(self, *a, **k)
    monkeypatch.setattr(structured.GrammarState, "__init__", counting)
    c = client.completions.create(model="smollm2-135m-instruct", prompt=["Is the sky blue? Answer:", "Is fire cold?"],
                                  max_tokens=8, n=4, temperature=1.0, seed=0,
                                  extra_body={"structured_outputs": {"choice": [" yes", " no", " maybe"]}})
    assert len(built) == 1 and len(c.choices) == 8
    assert all(ch.text in (" yes", " no", " maybe") and ch.finish_reason == "stop" for ch in c.choices)


def test_structured_outputs_match_their_schema_and_plain_decoding_under_it(client, target_fp32):
    from dspark.structured import GrammarSpec, grammar_state
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=48, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "person", "schema": schema}})
    out = json.loads(r.choices[0].message.content)
    assert set(out) == {"name", "age"} and isinstance(out["name"], str) and 0 <= out["age"] <= 150
    assert r.choices[0].finish_reason == "stop"
    # the same constraint on plain decoding gives the same tokens
    tok = target_fp32.tokenizer
    ids = tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    e = Engine(target_fp32.model, PlainDrafter(), max_requests=1, max_len=256, eos_ids=target_fp32.eos_token_ids)
    plain_req = e.add_request(ids, SamplingParams(temperature=0), 48,
                              grammar=grammar_state(target_fp32, GrammarSpec("json", schema).compile()))
    e.run()
    assert r.choices[0].message.content == tok.decode(plain_req.output_ids, skip_special_tokens=True)
    # streamed, and two seeded choices, each under its own matcher
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    chunks = client.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=48,
                                            temperature=0, response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    two = client.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=48, n=2, seed=3,
                                         temperature=1.0, response_format=fmt)
    for ch in two.choices:
        if ch.finish_reason == "stop":
            assert set(json.loads(ch.message.content)) == {"name", "age"}
    # vLLM's structured_outputs through the completions route; any JSON object through chat
    c = client.completions.create(model="smollm2-135m-instruct", prompt="Is the sky blue? Answer:", max_tokens=8,
                                  temperature=0, extra_body={"structured_outputs": {"choice": [" yes", " no"]}})
    assert c.choices[0].text in (" yes", " no") and c.choices[0].finish_reason == "stop"
    j = client.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=40, temperature=0.8,
                                       seed=1, response_format={"type": "json_object"})
    if j.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(j.choices[0].message.content), dict)
    else:
        assert j.choices[0].message.content.lstrip().startswith("{")


def test_tokenize_and_detokenize_as_vllm(server, client, target_fp32):
    tok = target_fp32.tokenizer
    code, out = post(server[0] + "/tokenize", {"prompt": "Hello there", "return_token_strs": True})
    assert code == 200 and out["tokens"] == tok("Hello there")["input_ids"] and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == server[1].engine.cache.max_len and len(out["token_strs"]) == out["count"]
    msgs = [{"role": "user", "content": "Name three colours."}]
    code, out = post(server[0] + "/tokenize", {"messages": msgs})
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=1, temperature=0)
    assert code == 200 and out["count"] == r.usage.prompt_tokens
    code, back = post(server[0] + "/detokenize", {"tokens": out["tokens"]})
    assert code == 200 and back["prompt"] == tok.decode(out["tokens"])
    for path, body, needle in [("/tokenize", {"prompt": "a", "messages": msgs}, "exactly one"),
                               ("/tokenize", {}, "exactly one"),
                               ("/detokenize", {"tokens": [10 ** 9]}, "vocabulary"),
                               ("/detokenize", {"tokens": [-1]}, "greater than or equal to 0"),
                               ("/tokenize", {"prompt": "a", "model": "other"}, "does not exist")]:
        code, out = post(server[0] + path, body)
        assert code in (400, 404) and needle in out["error"]["message"], out
