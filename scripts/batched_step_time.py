"""Time of one engine step with many requests decoding at once (plain decoding, the regeneration
settings: temperature 0.7, top-p 0.8, top-k 20), on training prompts of mixed lengths.

Compares runtime versions: run it from two checkouts in turn, with PYTHONPATH pointing at each,
a few times alternately (the machine drifts), e.g.

    for d in old new old new; do PYTHONPATH=$d .venv/bin/python scripts/batched_step_time.py \
        --prompts <work>/prompts/train.jsonl; done
"""

import argparse
import json
import time

import torch

import dspark
from dspark.api import encode_prompt
from dspark.engine import Engine
from dspark.runtime.loading import load_target
from dspark.sampling import SamplingParams
from dspark.scheduling.policies import PlainPolicy


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True, help="prompts JSONL with a 'prompt' field (dspark prepare's)")
    ap.add_argument("--skip", type=int, default=2000, help="start at this prompt")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=6, help="steps before timing (the prefill among them)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tgt = load_target(dtype="bf16")
    with open(a.prompts) as f:
        rows = [json.loads(line) for line in f][a.skip:a.skip + a.requests]
    eng = Engine(tgt.model, None, PlainPolicy(), max_requests=a.requests, block_size=0, max_len=898,
                 eos_ids=tgt.eos_token_ids)
    for i, r in enumerate(rows):
        ids = encode_prompt(tgt.tokenizer, r["prompt"], chat=True)[:512]
        eng.add_request(ids, SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=i), 384)
    for _ in range(a.warmup):
        eng.step()
    t = time.perf_counter()
    for _ in range(a.steps):
        eng.step()
    ms = (time.perf_counter() - t) / a.steps * 1000
    print(json.dumps({"dspark": dspark.__file__, "requests": len(rows), "ms_per_step": round(ms, 1)}))


if __name__ == "__main__":
    main()
