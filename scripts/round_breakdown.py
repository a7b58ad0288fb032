"""Where one request's speculative round goes: the drafter's call (its backbone pass, and the rest:
the sequential head, sampling, the block's probabilities), the target's verification forward, the
verification itself and the rest of the engine step; per round, medians over the rounds of 8
prompts (gsm8k and mt-bench, greedy, the target compiled as `dspark serve` runs it).

The drafter runs twice in one process, its pass compiled (what `dspark serve` loads) and eager,
the two alternated prompt by prompt, so that the difference is read side by side:

    .venv/bin/python scripts/round_breakdown.py --drafter dspark --threads 2

Run it alone on the machine.
"""

import argparse
import statistics
import time
from collections import defaultdict

import torch

from dspark.api import encode_prompt
from dspark.data import load_prompts
from dspark.drafters import load_drafter
from dspark.drafters.dspark import DSparkDrafter
from dspark.engine import Engine
from dspark.runtime.loading import load_target
from dspark.sampling import SamplingParams


def timed(times: dict, label: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        times[label].append(time.perf_counter() - t)
        return out
    return wrapper


def run(target, drafter, prompts: list[list[int]], new_tokens: int, times: dict) -> tuple[int, int]:
    """Every prompt through an engine of one request; the phases' times into ``times``; (drafted,
    accepted) tokens."""
    engine = Engine(target.model, drafter, max_requests=1, max_len=max(map(len, prompts)) + new_tokens + 16)
    for label, name in (("draft", "_draft"), ("target forward", "_forward"), ("verify", "_verify")):
        setattr(engine, name, timed(times, label, getattr(engine, name)))
    inner = drafter._forward if isinstance(drafter, DSparkDrafter) else None
    if inner is not None:
        drafter._forward = timed(times, "drafter backbone", inner)
    drafted = accepted = 0
    try:
        for ids in prompts:
            req = engine.add_request(ids, SamplingParams(temperature=0.0), new_tokens)
            before = {k: len(v) for k, v in times.items()}
            engine.step()           # the prefill, left out
            for k, v in times.items():
                del v[before.get(k, 0):]
            while engine.has_work():
                t = time.perf_counter()
                engine.step()
                times["round"].append(time.perf_counter() - t)
            drafted += req.stats.num_draft_tokens
            accepted += req.stats.num_accepted_tokens
    finally:
        if inner is not None:
            del drafter._forward
    return drafted, accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(None, dtype="bf16")
    eager = load_drafter(args.drafter, target)         # loaded before the target compiles: stays eager
    print(target.model.compile())
    compiled = load_drafter(args.drafter, target)      # loaded after: its pass compiled too
    prompts = [encode_prompt(target.tokenizer, p, chat=True)
               for p in load_prompts("gsm8k", 4) + load_prompts("mt-bench", 4)]
    run(target, compiled, prompts[:1], 32, defaultdict(list))     # warm-up
    run(target, eager, prompts[:1], 32, defaultdict(list))
    times: dict[str, dict] = {"compiled": defaultdict(list), "eager": defaultdict(list)}
    counts = {"compiled": [0, 0], "eager": [0, 0]}
    for _ in range(args.repeats):
        for ids in prompts:
            for name, drafter in (("compiled", compiled), ("eager", eager)):
                d, a = run(target, drafter, [ids], args.max_new_tokens, times[name])
                counts[name][0] += d
                counts[name][1] += a
    labels = ["round", "draft", "drafter backbone", "target forward", "verify"]
    print(f"ms per round, median over {len(times['compiled']['round'])} rounds (drafter pass compiled / eager):")
    for label in labels:
        if times["compiled"][label]:
            c, e = (1e3 * statistics.median(times[n][label]) for n in ("compiled", "eager"))
            print(f"  {label:18s} {c:6.2f} / {e:6.2f}")
    for name in ("compiled", "eager"):
        d, a = counts[name]
        t = times[name]
        tokens = len(t["round"]) + a
        print(f"  {name}: drafted {d}, accepted {a}; {tokens / sum(t['round']):.1f} tokens/s over the rounds")


if __name__ == "__main__":
    main()
