"""Every engine step of the `auto` policy beside plain decoding (``--others``: the bench's other
policies, e.g. plain,fixed, each step of theirs recorded too), as `dspark bench concurrency
--fresh-costs` runs them (interleaved, one learned-cost store shared by the levels), with the seconds
the auto policy's prices predicted for each step (context priced at 128) and what it measured.

    python scripts/auto_steps.py --concurrency 1,8,32 --json steps.json

Prints each level's tokens/s and, for the last level's decoding steps at the most requests, the
measured and predicted seconds grouped by the tokens verified beyond the anchors."""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from dspark.api import encode_prompt
from dspark.data import load_prompts
from dspark.drafters import load_drafter
from dspark.evaluation.concurrency import bench_policy, closed_loop, interleave
from dspark.runtime.loading import load_target
from dspark.sampling import SamplingParams
from dspark.scheduling.learned import LearnedCosts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--drafter", default="ngram+dspark")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="auto (the CLI's default), bf16 or fp32")
    ap.add_argument("--others", default="plain",
                    help="the policies run beside auto, in the bench's order before it (e.g. plain,fixed)")
    ap.add_argument("--json", default=None, help="write every step here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target = load_target(dtype=a.dtype)
    texts = [t for d in ("humaneval", "gsm8k", "mt-bench") for t in load_prompts(d)][:a.num_prompts]
    prompts = [encode_prompt(target.tokenizer, t, chat=True) for t in texts]
    learned, steps = LearnedCosts("auto_steps", 7), []
    levels = [int(x) for x in a.concurrency.split(",")]
    others = [o.strip() for o in a.others.split(",") if o.strip()]

    def recorded(policy, name, c, extra=lambda o: {}):
        """``policy`` with every step it observes appended to ``steps`` (``extra``: more fields)."""
        base = policy.observe

        def observe(o):
            steps.append({"policy": name, "concurrency": c, "requests": len(o.requests),
                          "verified": sum(r.verified for r in o.requests),
                          "accepted": sum(r.accepted for r in o.requests), "seconds": o.seconds,
                          "decode_only": o.decode_only, "forward_rows": o.forward_rows,
                          "forward_seconds": o.forward_seconds, "draft_seconds": o.draft_seconds, **extra(o)})
            base(o)
        policy.observe = observe
        return policy

    for c in levels:
        auto, _ = bench_policy("auto", 7, None, learned, c)

        def priced(o, auto=auto):
            # read before the policy observes the step (its prices then change)
            calls = [r.drafted for r in o.requests if r.drafted and not r.free]
            pred = (auto.inner.cost.seconds(len(o.requests), sum(r.verified for r in o.requests), 128, len(calls),
                                            sum(calls) / max(1, len(calls)))
                    if auto.inner.cost.table is not None and o.requests else None)
            return {"predicted": pred, "measuring": auto.measuring is not None, "drafter_calls": len(calls)}
        loops = [closed_loop(target, load_drafter(a.drafter, target), recorded(bench_policy(name, 7)[0], name, c), prompts,
                             c, a.max_new_tokens, SamplingParams(temperature=0), 7, label=name) for name in others]
        loops.append(closed_loop(target, load_drafter(a.drafter, target), recorded(auto, "auto", c, priced), prompts,
                                 c, a.max_new_tokens, SamplingParams(temperature=0), 7, label="auto"))
        res = interleave(loops)
        print(f"concurrency {c}: " + ", ".join(f"{r['policy']} {r['total_tokens_per_second']:.1f} tok/s"
                                               for r in res)
              + f" (auto: accept length {res[-1]['accept_length']:.2f}, {res[-1]['setup_steps']} measuring steps)")
    top = max(s["requests"] for s in steps if s["concurrency"] == levels[-1])
    last = [s for s in steps if s["policy"] == "auto" and s["concurrency"] == levels[-1] and s["decode_only"] and s["requests"] >= top - 2
            and s["predicted"] is not None]
    print(f"decoding steps of {top - 2}-{top} requests at concurrency {levels[-1]}: verified -> steps, measured / predicted ms;"
          " of the measured, the forward and the drafter's call (medians)")
    for lo, hi in ((0, 0), (1, 5), (6, 20), (21, 10 ** 6)):
        g = [s for s in last if lo <= s["verified"] <= hi]
        if g:
            print(f"  {lo}-{hi if hi < 10 ** 6 else 'more'}: {len(g)} steps, {1e3 * statistics.median(s['seconds'] for s in g):.0f}"
                  f" / {1e3 * statistics.median(s['predicted'] for s in g):.0f}; forward"
                  f" {1e3 * statistics.median(s['forward_seconds'] for s in g):.0f}, drafter"
                  f" {1e3 * statistics.median(s['draft_seconds'] for s in g):.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(steps, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
