"""``dspark bench serving``: closed-loop clients against an OpenAI-compatible endpoint.

At concurrency C, C client threads each keep one streaming chat request in flight (plain HTTP,
reading the server-sent events as they come) until ``num_prompts`` requests have run, the
datasets' prompts taken in turn (one of each, then the second of each, ...). Each concurrency
level gets prompts of its own (the next ``num_prompts`` of that order), and the untimed warm-up
the ones after the last level's: a server answering a prompt it answered before lets a drafter
that learns from its answers (the n-gram lookup's history) copy the old answer. Reported per
concurrency: total tokens/s (completion tokens over the wall time), per-user tokens/s (mean over
requests of tokens over latency), time to first token (median and 90th percentile) and latency.

``--endpoint URL`` measures any server (ours, vLLM, SGLang); without it the bench starts
`dspark serve` in this process on a free port, a fresh engine per run. ``--against-engine`` then
also runs the same prompts through the engine directly (`bench concurrency`'s closed loop: no
HTTP, no tokenizer round trip), alternating: server, engine, server, ... (``--repeats`` engine
runs), and reports the server's total tokens/s over the engine's: what the HTTP layer costs (on a small CPU, the client threads
run on the same cores as the engine).
"""

from __future__ import annotations

import http.client
import json
import statistics
import sys
import threading
import time

from urllib.parse import urlsplit

from ..errors import UsageError

WARMUP = 4      # prompts of the untimed warm-up, after every level's


def _stream_one(base_url: str, api_key: str | None, body: dict) -> tuple[int, float | None]:
    """One streaming chat request over plain HTTP: (completion tokens, seconds to the first content).
    A client this thin (no per-chunk objects, as vLLM's serving benchmark) leaves the machine to the
    server: the `openai` client's per-chunk parsing took a sixth of this 2-core VM at 16 clients."""
    url = urlsplit(base_url)
    if url.hostname is None:
        raise UsageError(f"no host in the endpoint URL {base_url!r} (e.g. http://127.0.0.1:8000/v1)")
    conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=600)
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    t0 = time.perf_counter()
    try:
        conn.request("POST", url.path.rstrip("/") + "/chat/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise UsageError(f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}")
        ttft, tokens = None, 0
        for line in resp:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            if ttft is None and _has_content(line[6:]):
                ttft = time.perf_counter() - t0
            if b'"usage"' in line:
                usage = json.loads(line[6:]).get("usage") or {}
                tokens = usage.get("completion_tokens", tokens)
            elif b'"error"' in line and b'"choices"' not in line:
                raise UsageError(f"stream error: {line[6:300].decode(errors='replace')}")
        return tokens, ttft
    finally:
        conn.close()


def _has_content(data: bytes) -> bool:
    """Whether a chat chunk carries text: servers open the stream with a chunk of the role alone,
    whose content is "" (ours, vLLM) or null (llama.cpp's server), sent before any token."""
    if b'"content"' not in data:
        return False
    try:
        chunk = json.loads(data)
    except ValueError:
        return False
    return any(isinstance(c, dict) and isinstance(c.get("delta"), dict) and c["delta"].get("content")
               for c in chunk.get("choices") or [])


def _first_model(base_url: str, api_key: str | None) -> str:
    import urllib.error
    import urllib.request
    req = urllib.request.Request(base_url.rstrip("/") + "/models",
                                 headers={"authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise UsageError(f"cannot list the models of {base_url}: {e}; pass --model") from None


def _closed_loop(base_url: str, model: str, api_key: str | None, messages: list, concurrency: int,
                 max_tokens: int, temperature: float, seed: int) -> dict:
    todo = list(enumerate(messages))
    lock = threading.Lock()
    rows, errors = [], []

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i, msg = todo.pop(0)
            body = {"model": model, "messages": msg, "max_tokens": max_tokens, "temperature": temperature,
                    "seed": seed + i, "stream": True, "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            try:
                tokens, ttft = _stream_one(base_url, api_key, body)
            except Exception as e:      # noqa: BLE001 - reported, the run goes on
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                continue
            end = time.perf_counter() - t0
            with lock:
                rows.append((tokens, end if ttft is None else ttft, end))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise UsageError(f"{len(errors)} of {len(messages)} requests failed; first: {errors[0]}")
    ttfts = sorted(r[1] for r in rows)
    return {"concurrency": concurrency, "requests": len(rows), "tokens": sum(r[0] for r in rows),
            "wall_seconds": wall, "total_tokens_per_second": sum(r[0] for r in rows) / wall,
            "per_user_tokens_per_second": statistics.mean(r[0] / r[2] for r in rows),
            "ttft_p50_ms": 1e3 * ttfts[len(ttfts) // 2], "ttft_p90_ms": 1e3 * ttfts[int(0.9 * (len(ttfts) - 1))],
            "latency_mean_s": statistics.mean(r[2] for r in rows)}


def local_run(target, drafter, policy: str, max_requests: int, max_len: int, client,
              prefix_caching: bool = True):
    """`dspark serve` in this process on a free port, a fresh engine (``policy`` by name), as
    `dspark serve` runs it (the engine on this thread, HTTP on another); ``client(base_url)`` runs
    on a third thread."""
    from ..engine import serving_engine
    from ..server import create_app, in_thread
    drafter.reset()
    engine = serving_engine(target, drafter, policy, max_requests, max_len, prefix_caching)
    app = create_app(target, engine, engine_thread=False)
    worker = app.state.server.worker
    out: dict = {}
    with in_thread(app) as (url, _, _):
        def drive():
            try:
                out["result"] = client(url + "/v1")
            except Exception as e:      # noqa: BLE001 - raised below, on this thread
                out["error"] = e
            finally:
                worker.close()
        thread = threading.Thread(target=drive, name="dspark-bench-clients")
        thread.start()
        worker.run()
        thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def run_serving_bench(args) -> int:
    from ..data import load_prompts
    # the datasets in turn (prompt i from dataset i mod k), each from its first prompt on
    sets = [load_prompts(d) for d in [x.strip() for x in args.datasets.split(",") if x.strip()]]
    if not sets:
        raise UsageError("--datasets names no dataset")
    n, levels = args.num_prompts, len(args.concurrency)
    texts = [sets[i % len(sets)][(i // len(sets)) % len(sets[i % len(sets)])] for i in range(n * levels + WARMUP)]
    if n * levels + WARMUP > sum(map(len, sets)):
        print(f"dspark bench serving: {n * levels + WARMUP} prompts asked of {sum(map(len, sets))}: some repeat",
              file=sys.stderr)
    messages = [[{"role": "user", "content": t}] for t in texts]
    results = []
    if args.endpoint:
        if args.against_engine:
            raise UsageError("--against-engine runs our engine in this process: leave out --endpoint")
        model = args.model
        if model is None:
            model = _first_model(args.endpoint, args.api_key)
        for k, c in enumerate(args.concurrency):
            results.append({"system": "endpoint", **_closed_loop(args.endpoint, model, args.api_key,
                                                                  messages[k * n:(k + 1) * n], c,
                                                                  args.max_new_tokens, args.temperature, args.seed)})
            _report(results[-1])
    else:
        results = _local(args, messages, texts)
    if args.json:
        print(json.dumps({"endpoint": args.endpoint, "results": results}))
    return 0


def _local(args, messages, texts) -> list[dict]:
    from ..api import encode_prompt
    from ..drafters import load_drafter
    from ..runtime.loading import target_from_args
    from ..sampling import SamplingParams
    from ..engine import check_policy_name, serving_policy
    from .concurrency import run_closed_loop
    check_policy_name(args.policy)
    target = target_from_args(args)
    drafter = load_drafter(args.drafter, target)
    pname = args.policy if args.policy != "auto" else serving_policy(target, drafter, "auto")[0].name
    ids = [encode_prompt(target.tokenizer, t, chat=True) for t in texts]
    max_len = max(map(len, ids)) + args.max_new_tokens + drafter.block_size + 2
    results = []
    # untimed: the first requests of a process pay one-time costs (kernels for new shapes, first
    # touches of the caches) that would fall on whichever system ran first
    n = args.num_prompts
    local_run(target, drafter, pname, 2, max_len,
              lambda url: _closed_loop(url, target.name, None, messages[-WARMUP:], 2, min(16, args.max_new_tokens),
                                       args.temperature, args.seed), args.prefix_caching)
    for i, c in enumerate(args.concurrency):
        level, level_ids = messages[i * n:(i + 1) * n], ids[i * n:(i + 1) * n]
        runs = (["server", "engine"] * args.repeats + ["server"]) if args.against_engine else ["server"] * args.repeats
        got = []
        for system in runs:
            if system == "server":
                r = local_run(target, drafter, pname, c, max_len,
                              lambda url, c=c, level=level: _closed_loop(url, target.name, None, level, c,
                                                                         args.max_new_tokens, args.temperature,
                                                                         args.seed), args.prefix_caching)
            else:
                # the engine's own loop seeds every request alike; the server's requests each get seed + i
                policy, _ = serving_policy(target, drafter, pname, c)
                params = SamplingParams(temperature=args.temperature, seed=args.seed)
                e = run_closed_loop(target, drafter, policy, level_ids, c, args.max_new_tokens, params,
                                    drafter.block_size, prefix_caching=args.prefix_caching)
                r = {k: e[k] for k in ("concurrency", "requests", "tokens", "wall_seconds",
                                       "total_tokens_per_second", "per_user_tokens_per_second")}
            r = {"system": system, "drafter": drafter.name, "policy": pname, **r}
            got.append(r)
            _report(r)
        if args.against_engine:
            # each engine run against the mean of the server runs just before and after it
            for k in range(1, len(got), 2):
                got[k]["server_over_engine"] = (got[k - 1]["total_tokens_per_second"] + got[k + 1]["total_tokens_per_second"]) \
                    / 2 / got[k]["total_tokens_per_second"]
            tot = {sys_: sum(g["tokens"] for g in got if g["system"] == sys_) /
                   sum(g["wall_seconds"] for g in got if g["system"] == sys_) for sys_ in ("server", "engine")}
            print(f"concurrency {c:>3}: server / engine total tokens/s {tot['server'] / tot['engine']:.3f} over all runs "
                  f"(each engine run against its neighbours: "
                  f"{', '.join(format(g['server_over_engine'], '.3f') for g in got[1::2])})", file=sys.stderr)
        results.extend(got)
    return results


def _report(r: dict) -> None:
    line = (f"concurrency {r['concurrency']:>3} {r['system']:>8}: total {r['total_tokens_per_second']:.1f} tok/s, "
            f"per user {r['per_user_tokens_per_second']:.1f} tok/s")
    if "ttft_p50_ms" in r:
        line += f", TTFT p50 {r['ttft_p50_ms']:.0f} ms, p90 {r['ttft_p90_ms']:.0f} ms"
    print(line, file=sys.stderr)
