"""The auto policy at several verification hurdles side by side with plain decoding and the whole
block, in one process: each run goes through the bench's levels in turn (default 1, 8, 32 requests),
every policy one engine step at a time (as `dspark bench concurrency` interleaves them), each hurdle's
auto learning from the levels before it on its own fresh cost store (as `--fresh-costs`).

    python scripts/hurdle_sweep.py --hurdles 1.0,1.25 --runs 3

Prints per run and level auto / plain and auto / fixed for each hurdle (accept length), then the
means over runs."""

from __future__ import annotations

import argparse
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
    ap.add_argument("--hurdles", default="1.0,1.25", help="AutoPolicy hurdles, each a policy of its own")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--drafter", default="ngram+dspark")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target = load_target(dtype="auto")
    texts = [t for d in ("humaneval", "gsm8k", "mt-bench") for t in load_prompts(d)][:a.num_prompts]
    prompts = [encode_prompt(target.tokenizer, t, chat=True) for t in texts]
    hurdles = [float(x) for x in a.hurdles.split(",")]
    levels = [int(x) for x in a.concurrency.split(",")]
    params = SamplingParams(temperature=0)
    ratios: dict = {}
    for run in range(a.runs):
        stores = {h: LearnedCosts(f"hurdle {h}", 7) for h in hurdles}
        for c in levels:
            loops = [closed_loop(target, load_drafter(a.drafter, target), bench_policy(name, 7)[0], prompts, c,
                                 a.max_new_tokens, params, 7, label=name) for name in ("plain", "fixed")]
            for h in hurdles:
                auto = bench_policy("auto", 7, None, stores[h], c)[0]
                auto.inner.cost.hurdle = h
                loops.append(closed_loop(target, load_drafter(a.drafter, target), auto, prompts, c,
                                         a.max_new_tokens, params, 7, label=f"hurdle {h}"))
            res = interleave(loops, seed=run)
            plain, fixed = res[0]["total_tokens_per_second"], res[1]["total_tokens_per_second"]
            cells = []
            for h, r in zip(hurdles, res[2:]):
                tps = r["total_tokens_per_second"]
                ratios.setdefault((c, h), []).append((tps / plain, tps / fixed))
                cells.append(f"hurdle {h}: {tps / plain:.3f} / {tps / fixed:.3f} ({r['accept_length']:.2f})")
            print(f"run {run + 1}, {c} requests, auto / plain / auto / fixed: " + ", ".join(cells), flush=True)
    print("means over runs, auto / plain / auto / fixed:")
    for c in levels:
        print(f"  {c} requests: " + ", ".join(
            f"hurdle {h} {statistics.mean(p for p, _ in ratios[(c, h)]):.3f} / "
            f"{statistics.mean(f for _, f in ratios[(c, h)]):.3f}" for h in hurdles))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
