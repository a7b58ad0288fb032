"""``dspark bench concurrency``: closed-loop clients through the engine, per policy.

At concurrency C, C clients each keep one request in flight: when a request ends its client sends
the next prompt, until ``num_prompts`` requests have run. Reported per (policy, concurrency):
total tokens/s (all new tokens over the wall time) and per-user tokens/s (mean over requests of
new tokens over that request's latency, queueing included). Policies run side by side in one
process, interleaved per concurrency level. Every run starts from a reset drafter: a drafter that
learns from the requests it served (the n-gram drafter's history) would otherwise draft the same
prompts from their answers in an earlier run.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ..api import encode_prompt
from ..data import load_prompts
from ..drafters import load_drafter
from ..engine import Engine
from ..runtime.loading import load_target
from ..sampling import SamplingParams
from ..scheduling.policies import make_policy
from ..scheduling.sps import CostTable, table_key_for


def _policy(name: str, block: int, cost_table=None):
    """A policy name, optionally with "-padded": the same policy on a padded (dense) layout."""
    padded = name.endswith("-padded")
    return make_policy(name[:-len("-padded")] if padded else name, block, cost_table=cost_table), padded


def run_closed_loop(target, drafter, policy, prompts: list[list[int]], concurrency: int,
                    max_new_tokens: int, params: SamplingParams, block_size: int,
                    padded: bool = False, label: str | None = None, cost_table=None) -> dict:
    max_len = max(len(p) for p in prompts) + max_new_tokens + block_size + 2
    engine = Engine(target.model, drafter, policy, max_requests=concurrency, max_len=max_len,
                    block_size=block_size, eos_ids=target.eos_token_ids, padded=padded,
                    cost_table=cost_table)
    drafter.reset()
    queue = list(prompts)
    live, done = [], []
    t0 = time.perf_counter()
    while queue or live:
        while queue and len(live) < concurrency:
            live.append(engine.add_request(queue.pop(0), params, max_new_tokens))
        engine.step()
        still = []
        for r in live:
            (done if r.done else still).append(r)
        live = still
    wall = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in done)
    per_user = sum(len(r.output_ids) / r.stats.seconds for r in done if r.stats.seconds > 0) / len(done)
    drafted = sum(r.stats.num_draft_tokens for r in done)
    accepted = sum(r.stats.num_accepted_tokens for r in done)
    rounds = sum(r.stats.num_rounds for r in done)
    return _with_rates({"policy": label or policy.name, "concurrency": concurrency, "requests": len(done),
                        "tokens": tokens, "wall_seconds": wall, "rounds": rounds,
                        "step_seconds": engine.step_seconds, "decision_seconds": engine.policy_seconds,
                        "per_user_tokens_per_second": per_user, "engine_steps": engine.num_steps,
                        "num_draft_tokens": drafted, "num_accepted_tokens": accepted})


def _with_rates(out: dict) -> dict:
    """Fill the rates derived from a result's totals (one run or the sum of repeats)."""
    out["total_tokens_per_second"] = out["tokens"] / out["wall_seconds"]
    out["decision_ms_per_step"] = 1000 * out["decision_seconds"] / max(1, out["engine_steps"])
    out["decision_share"] = out["decision_seconds"] / out["step_seconds"] if out["step_seconds"] else 0.0
    out["accept_length"] = (out["tokens"] - out["requests"]) / out["rounds"] if out["rounds"] else 0.0
    return out


def combine_runs(runs: list[dict]) -> dict:
    """Repeats of one (policy, concurrency) as one result: totals over all of them."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    for k in ("requests", "tokens", "wall_seconds", "rounds", "step_seconds", "decision_seconds",
              "engine_steps", "num_draft_tokens", "num_accepted_tokens"):
        out[k] = sum(r[k] for r in runs)
    out["per_user_tokens_per_second"] = sum(r["per_user_tokens_per_second"] * r["requests"] for r in runs) / out["requests"]
    out["repeats"] = len(runs)
    return _with_rates(out)


def run_concurrency_bench(args) -> int:
    levels = args.concurrency
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        _policy(p, args.block)  # validate names before loading anything
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    drafter = load_drafter(args.drafter, target, block_size=args.block)
    block = args.block or drafter.block_size
    # the cost table of this (target, drafter, dtype, device); warns and names `dspark profile` if absent
    cost_table = CostTable.find(table_key_for(target, drafter))
    texts = []
    for d in [x.strip() for x in args.datasets.split(",") if x.strip()]:
        texts.extend(load_prompts(d))
    if args.num_prompts > len(texts):
        texts = (texts * (args.num_prompts // len(texts) + 1))
    texts = texts[:args.num_prompts]
    prompts = [encode_prompt(target.tokenizer, t, chat=True) for t in texts]
    params = SamplingParams(temperature=args.temperature, seed=args.seed)
    results = []
    for c in levels:
        runs: dict[str, list] = {name: [] for name in policies}
        for rep in range(args.repeats):
            # a shared machine drifts: every repeat runs the policies in the reverse order of the
            # previous one, so that a slow spell does not land on the same policies every time
            for name in (policies if rep % 2 == 0 else policies[::-1]):
                policy, padded = _policy(name, block, cost_table)
                runs[name].append(run_closed_loop(target, drafter, policy, prompts, c, args.max_new_tokens,
                                                  params, block, padded=padded, label=name, cost_table=cost_table))
        for name in policies:
            res = combine_runs(runs[name])
            results.append(res)
            print(f"concurrency {c:>3} {name:>6}: total {res['total_tokens_per_second']:.1f} tok/s, "
                  f"per user {res['per_user_tokens_per_second']:.1f} tok/s, "
                  f"accept length {res['accept_length']:.2f}, "
                  f"decision {res['decision_ms_per_step']:.3f} ms/step ({100 * res['decision_share']:.2f}% of a step)",
                  file=sys.stderr)
    lines = ["| policy | concurrency | total tok/s | per-user tok/s | accept length | decision ms/step (% of step) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['policy']} | {r['concurrency']} | {r['total_tokens_per_second']:.1f} | "
                     f"{r['per_user_tokens_per_second']:.1f} | {r['accept_length']:.2f} | "
                     f"{r['decision_ms_per_step']:.3f} ({100 * r['decision_share']:.2f}%) |")
    print("\n".join(lines))
    if args.plot:
        _pareto_plot(results, args.plot)
    if args.json:
        print(json.dumps({"drafter": drafter.name, "dtype": args.dtype, "threads": torch.get_num_threads(),
                          "results": results}))
    return 0


def _pareto_plot(results, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name in dict.fromkeys(r["policy"] for r in results):
        rs = [r for r in results if r["policy"] == name]
        xs = [r["total_tokens_per_second"] for r in rs]
        ys = [r["per_user_tokens_per_second"] for r in rs]
        ax.plot(xs, ys, marker="o", label=name)
        for r, x, y in zip(rs, xs, ys):
            ax.annotate(str(r["concurrency"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("total tokens/s")
    ax.set_ylabel("tokens/s per user")
    ax.set_title("Throughput vs per-user speed (labels: concurrency)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
