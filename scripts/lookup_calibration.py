"""How well the prefix policy's survivals price what the target accepts, per kind of proposal: the
trained drafter's (calibrated confidences) and the n-gram lookup's by the length of the suffix it
matched (learnt per strength, `FreeProfiles`). Runs `auto` (learning its step costs) beside `fixed`
as `dspark bench concurrency` does, greedy, and prints, per kind and position, how often a
verified token was accepted against the survival auto priced it at when it chose.

    python scripts/lookup_calibration.py --concurrency 1,8
"""

from __future__ import annotations

import argparse
import collections

import numpy as np
import torch

from dspark.api import encode_prompt
from dspark.data import load_prompts
from dspark.drafters import load_drafter
from dspark.evaluation.concurrency import bench_policy, closed_loop, interleave
from dspark.runtime.loading import load_target
from dspark.sampling import SamplingParams
from dspark.scheduling.algorithm1 import survivals
from dspark.scheduling.learned import LearnedCosts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--drafter", default="ngram+dspark")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target = load_target(dtype="bf16")
    texts = [t for d in ("humaneval", "gsm8k", "mt-bench") for t in load_prompts(d)][:a.num_prompts]
    prompts = [encode_prompt(target.tokenizer, t, chat=True) for t in texts]
    learned = LearnedCosts("lookup_calibration", 7)
    # kind -> per position [verified, accepted, survival priced]
    stats: dict = collections.defaultdict(lambda: np.zeros((8, 3)))
    for c in [int(x) for x in a.concurrency.split(",")]:
        fixed, _ = bench_policy("fixed", 7)
        auto, _ = bench_policy("auto", 7, None, learned, c)
        inner, pending = auto.inner, {}
        verify_lengths, observe = auto.verify_lengths, auto.observe

        def verify(requests, proposals, verify_lengths=verify_lengths, inner=inner, pending=pending):
            out = verify_lengths(requests, proposals)
            prof = inner.profile.conditional()
            for r, p, n in zip(requests, proposals, out):
                if len(p) and n:
                    kind = f"lookup, {min(p.evidence, 4)}{'+' if p.evidence >= 4 else ''}-token match" if p.free else "drafter"
                    pending[r.id] = (kind, survivals(p, inner.free_profile.conditional(p.evidence) if p.free else prof))
            return out

        def seen(o, observe=observe, pending=pending):
            for ro in o.requests:
                got = pending.pop(ro.request_id, None)
                if got is not None and ro.verified:
                    st = stats[got[0]]
                    for k in range(min(ro.verified, 7)):
                        st[k] += (1, k < ro.accepted, got[1][k])
            observe(o)
        auto.verify_lengths, auto.observe = verify, seen
        res = interleave([closed_loop(target, load_drafter(a.drafter, target), p, prompts, c, a.max_new_tokens,
                                      SamplingParams(temperature=0), 7, label=p.name) for p in (fixed, auto)])
        print(f"concurrency {c}: " + ", ".join(f"{r['policy']} {r['total_tokens_per_second']:.1f} tok/s "
                                                 f"(accept length {r['accept_length']:.2f})" for r in res))
    print("kind | position: accepted / priced (verified)")
    for kind in sorted(stats):
        st = stats[kind]
        cells = [f"{st[k, 1] / st[k, 0]:.2f} / {st[k, 2] / st[k, 0]:.2f} ({int(st[k, 0])})" for k in range(7) if st[k, 0]]
        print(f"{kind} | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
