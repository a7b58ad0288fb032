"""Choose the n-gram / trained hybrid's ``min_match`` on held-out prompts.

Batch 1, greedy, side by side in one process (prompt by prompt, every system in turn): plain
decoding, the trained drafter alone, the n-gram drafter alone and ``ngram+NAME`` at each
``min_match``. Prints tokens/s, speed-up over plain, accept length (tokens per target forward)
and the share of rounds the lookup served, per system.

    .venv/bin/python scripts/hybrid_sweep.py --prompts <work>/dev.jsonl --drafter dspark --min-match 1,2,3,4,5
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from dspark.api import encode_prompt
from dspark.data import load_prompts
from dspark.drafters import HybridDrafter, NgramDrafter, PlainDrafter, load_drafter
from dspark.generation import generate_ids
from dspark.runtime.loading import load_target
from dspark.sampling import SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", required=True, help="JSONL of {'turns': [...]} (held out from the benchmarks)")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--min-match", default="1,2,3,4,5")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(None, dtype="bf16")
    model = load_drafter(args.drafter, target)
    systems = {"plain": PlainDrafter(), args.drafter: model, "ngram": NgramDrafter()}
    for m in (int(x) for x in args.min_match.split(",")):
        systems[f"ngram+{args.drafter} (min {m})"] = HybridDrafter(NgramDrafter(), model, min_match=m)
    prompts = [encode_prompt(target.tokenizer, p, chat=True) for p in load_prompts(args.prompts, args.num_prompts)]
    eos = target.eos_token_ids
    stats = {s: [0, 0.0, 0] for s in systems}      # tokens, seconds, rounds after the first token
    warm = encode_prompt(target.tokenizer, "Say hello.", chat=True)
    for d in systems.values():
        generate_ids(target.model, warm, SamplingParams(temperature=0.0), 16, d, eos_ids=eos)
        d.reset()
    for i, ids in enumerate(prompts):
        for s, d in systems.items():
            new, st = generate_ids(target.model, ids, SamplingParams(temperature=args.temperature, seed=i),
                                   args.max_new_tokens, d, eos_ids=eos)
            acc = stats[s]
            acc[0] += len(new)
            acc[1] += st.seconds
            acc[2] += st.num_rounds
        print(f"[{i + 1}/{len(prompts)}] " + ", ".join(f"{s} {v[0] / v[1]:.1f}" for s, v in stats.items()),
              file=sys.stderr)
    plain = stats["plain"][0] / stats["plain"][1]
    rows = []
    for s, (tok, sec, rounds) in stats.items():
        d = systems[s]
        served = d.served[0] / max(1, sum(d.served)) if isinstance(d, HybridDrafter) else None
        rows.append({"system": s, "tokens_per_second": tok / sec, "speedup": tok / sec / plain,
                     "accept_length": (tok - len(prompts)) / max(1, rounds), "lookup_share": served})
        print(f"| {s} | {tok / sec:.1f} | {tok / sec / plain:.2f}x | {rows[-1]['accept_length']:.2f} | "
              f"{'-' if served is None else f'{served:.0%}'} |")
    print(json.dumps({"results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
