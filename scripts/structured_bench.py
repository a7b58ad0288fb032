"""Structured outputs side by side in one process: JSON under a schema, greedy, batch 1, each system
decoding every prompt in turn (interleaved per prompt), on the bundled target.

Systems: plain decoding without the grammar (what the grammar's masks cost per token), plain decoding
under the grammar, and speculative decoding under it with each drafter. Reported: tokens/s, accept
length, the share of outputs that parse as JSON valid under the schema's required keys, and
greedy identity with plain decoding under the grammar.

    .venv/bin/python scripts/structured_bench.py --drafters ngram,dspark,ngram+dspark --max-new-tokens 96
"""

import argparse
import json
import statistics

import torch

import dspark
from dspark.drafters import load_drafter
from dspark.runtime.loading import load_target

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "category", "price", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "category": {"type": "string", "enum": ["food", "tool", "toy", "book", "clothing"]},
                         "price": {"type": "number", "minimum": 0},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4}}}
THINGS = ["a hammer", "a chocolate cake", "a children's picture book about trains", "a wool winter hat",
          "a wooden toy train", "a cookbook of Italian recipes", "a pair of running shoes", "a screwdriver set"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", default="ngram,dspark,ngram+dspark")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("smollm2-135m-instruct", dtype=args.dtype)
    spec = dspark.GrammarSpec("json", SCHEMA)
    greedy = dspark.SamplingParams(temperature=0)
    systems = [("plain, no grammar", "plain", None), ("plain", "plain", spec)] + \
              [(d, d, spec) for d in args.drafters.split(",")]
    drafters = {name: load_drafter(d, target) for name, d, _ in systems}
    prompts = [f"Describe {t} as a product listing in JSON with a name, a category, a price and tags."
               for t in THINGS[:args.num_prompts]]
    dspark.generate(prompts[0], target=target, drafter=drafters["plain"], chat=True, max_new_tokens=8,
                    sampling=greedy, structured=spec)        # untimed: first-call costs
    runs = {name: [] for name, _, _ in systems}
    for p in prompts:
        for name, _, s in systems:
            runs[name].append(dspark.generate(p, target=target, drafter=drafters[name], chat=True,
                                              max_new_tokens=args.max_new_tokens, sampling=greedy, structured=s))
    base = runs["plain"]
    plain_tps = sum(r.num_tokens for r in base) / sum(r.seconds for r in base)
    print(f"| system | tokens/s | vs plain under the grammar | accept length | valid JSON | identical to plain |")
    print("|---|---|---|---|---|---|")
    for name, _, s in systems:
        rs = runs[name]
        tps = sum(r.num_tokens for r in rs) / sum(r.seconds for r in rs)
        valid = 0
        for r in rs:
            try:
                obj = json.loads(r.text)
                valid += isinstance(obj, dict) and set(obj) == set(SCHEMA["required"])
            except ValueError:
                pass
        same = "-" if name == "plain" or s is None else \
            f"{statistics.mean(a.token_ids == b.token_ids for a, b in zip(rs, base)):.0%}"
        print(f"| {name} | {tps:.1f} | {tps / plain_tps:.2f}x | {statistics.mean(r.accept_length for r in rs):.2f} | "
              f"{valid}/{len(rs)} | {same} |", flush=True)


if __name__ == "__main__":
    main()
