"""The longest wait between two tokens of greedy streams while one echo + logprobs request (four
prompts of about 1,900 tokens, top-20 log probabilities) is served beside them, through the HTTP
server on the bundled target, for each --score-chunk (the engine's scored prompt rows per step)
and --decoding-chunk (prompt tokens per step while others decode), side by side in one process.
Prints one JSON line per setting.

    python scripts/echo_gap.py --settings 256:512,1000000:2048 --streams 8
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request

from dspark.data import load_prompts
from dspark.drafters import load_drafter
from dspark.engine import Engine
from dspark.runtime.loading import load_target
from dspark.server import create_app, in_thread


def stream(url: str, prompt: str, tokens: int, stamps: list[float]) -> None:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())


def run(target, drafter, score_chunk: int, decoding_chunk: int, streams: int, tokens: int,
        echo_prompts: list[str]) -> dict:
    engine = Engine(target.model, drafter, max_requests=streams + len(echo_prompts), max_len=2400,
                    block_size=drafter.block_size, eos_ids=target.eos_token_ids, score_chunk=score_chunk,
                    decoding_chunk=decoding_chunk)
    with in_thread(create_app(target, engine)) as (url, _, _):
        prompts = load_prompts("mt-bench", streams)
        stamps: list[list[float]] = [[] for _ in prompts]
        threads = [threading.Thread(target=stream, args=(url, p, tokens, s)) for p, s in zip(prompts, stamps)]
        for t in threads:
            t.start()
        while min(len(s) for s in stamps) < 4:      # every stream decoding
            time.sleep(0.05)
        t0 = time.perf_counter()
        req = urllib.request.Request(url + "/v1/completions", headers={"content-type": "application/json"},
                                     data=json.dumps({"prompt": echo_prompts, "max_tokens": 1, "echo": True,
                                                      "logprobs": 20, "temperature": 0}).encode())
        with urllib.request.urlopen(req, timeout=900) as r:
            r.read()
        t1 = time.perf_counter()
        for t in threads:
            t.join()
    during = [b - a for s in stamps for a, b in zip(s, s[1:]) if t0 <= b and a <= t1]
    after = [b - a for s in stamps for a, b in zip(s, s[1:]) if a > t1]
    return {"score_chunk": score_chunk, "decoding_chunk": decoding_chunk, "echo_seconds": round(t1 - t0, 2),
            "longest_gap_during_echo_ms": round(1000 * max(during, default=0.0)),
            "median_gap_during_echo_ms": round(1000 * sorted(during)[len(during) // 2]) if during else None,
            "median_gap_after_ms": round(1000 * sorted(after)[len(after) // 2]) if after else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="256:512,1000000:2048", help="score_chunk:decoding_chunk pairs")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--drafter", default="auto")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(2)
    target = load_target(None)
    tok = target.tokenizer
    text = " ".join(load_prompts("livecodebench", 40))
    ids = tok(text)["input_ids"]
    echo = [tok.decode(ids[i * 1900:(i + 1) * 1900]) for i in range(4)]
    for pair in args.settings.split(","):
        sc, dc = (int(x) for x in pair.split(":"))
        print(json.dumps(run(target, load_drafter(args.drafter, target), sc, dc, args.streams, args.tokens, echo)),
              flush=True)


if __name__ == "__main__":
    main()
