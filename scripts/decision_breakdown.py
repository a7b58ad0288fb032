"""Where a confidence policy's decision time goes: wall time per engine step of its draft and verify
decisions and of the parts inside them (the depth search, Algorithm 1, noting the proposals, ...),
with how often each runs. A diagnostic outside the package; it wraps the methods and functions by
name (parts a commit lacks are skipped).

Closed-loop clients as in `dspark bench concurrency` (the committed DSpark drafter, temperature 1,
the cost table `dspark profile --drafter dspark ...` measured on this machine):

    .venv/bin/python scripts/decision_breakdown.py --policy prefix --concurrency 2 --num-prompts 16
"""

import argparse
import collections
import time

import torch

from dspark.api import encode_prompt
from dspark.data import load_prompts
from dspark.drafters import load_drafter
from dspark.evaluation import concurrency as conc
from dspark.runtime.loading import load_target
from dspark.sampling import SamplingParams
from dspark.scheduling import asynchronous, load_aware, prefix
from dspark.scheduling.costs import CostTable, table_key_for

METHODS = ["draft_lengths", "verify_lengths", "_draft_depth", "_depth", "_refresh", "_learn", "_with_free",
           "_note_proposals", "_schedule", "_expect", "_settle_free", "_unchanged_since_no", "_probe", "_record",
           "backlog"]
# looked up in the modules that call them (prefix.py, asynchronous.py, load_aware.py)
FUNCTIONS = ["prefix_schedule", "survivals", "sorted_candidates", "drafted", "context_length"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="prefix")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(None, dtype="bf16")
    drafter = load_drafter("dspark", target)
    table = CostTable.find(table_key_for(target, drafter))
    texts = [t for d in ("humaneval", "gsm8k", "mt-bench") for t in load_prompts(d)][:args.num_prompts]
    prompts = [encode_prompt(target.tokenizer, t, chat=True) for t in texts]
    policy, _ = conc.bench_policy(args.policy, drafter.block_size, table)
    seconds, calls = collections.Counter(), collections.Counter()

    def wrap(owner, name):
        if not hasattr(owner, name):
            return
        inner = getattr(owner, name)

        def timed(*a, **k):
            t = time.perf_counter()
            out = inner(*a, **k)
            seconds[name] += time.perf_counter() - t
            calls[name] += 1
            return out
        setattr(owner, name, timed)

    for name in METHODS:
        wrap(policy, name)
    for module in (prefix, asynchronous, load_aware):
        for name in FUNCTIONS:
            wrap(module, name)
    res = conc.run_closed_loop(target, drafter, policy, prompts, args.concurrency, args.max_new_tokens,
                               SamplingParams(temperature=1.0, seed=0), drafter.block_size)
    steps = res["engine_steps"]
    print(f"{args.policy} at {args.concurrency} requests: {steps} steps, {1e3 * res['step_seconds'] / steps:.2f} ms a "
          f"step, decisions {1e3 * res['decision_seconds'] / steps:.3f} ms a step (the wrappers add ~1 us a call)")
    for name, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"{name:22s} {1e3 * s / steps:.4f} ms/step  calls/step {calls[name] / steps:.2f}  "
              f"us/call {1e6 * s / calls[name]:.1f}")


if __name__ == "__main__":
    main()
