"""``dspark bench concurrency``: closed-loop clients through the engine, per policy.

At concurrency C, C clients each keep one request in flight: when a request ends its client sends
the next prompt, until ``num_prompts`` requests have run. Reported per (policy, concurrency):
total tokens/s (all new tokens over the wall time) and per-user tokens/s (mean over requests of
new tokens over that request's latency). At each concurrency the policies run at the same time in
one process, each with its own engine, drafter and clients, taking one engine step each in turn
(in a shuffled order every round); each is timed on its own steps only. A shared machine drifts
by more than the policies differ (repeated runs of one policy, one after another, differed by
13 %), and in turn every policy meets the same drift. Every run starts from a reset drafter: a drafter that learns from the requests it
served (the n-gram drafter's history) would otherwise draft the same prompts from their answers in
an earlier run.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable

import torch

from ..api import encode_prompt
from ..data import load_prompts
from ..drafters import load_drafter
from ..engine import Engine, Request
from ..runtime.loading import target_from_args
from ..sampling import SamplingParams
from ..scheduling.auto import AutoPolicy, learned_costs
from ..scheduling.costs import CostTable, table_key_for
from ..scheduling.learned import LearnedCosts, machine_id
from ..scheduling.load_aware import LoadAwarePolicy
from ..scheduling.policies import make_policy


class PaddedEngine(Engine):
    """The engine on the dense [batch, block] layout of padded verification: every request's block
    padded to the step's longest with copies of its anchor, computed and then rolled back like
    rejected drafts. Only to measure what the ragged layout saves ("NAME-padded")."""

    def _block_ids(self, anchor, proposal, width):
        ids = super()._block_ids(anchor, proposal, width)
        return ids + [anchor] * (width + 1 - len(ids))


def bench_policy(name: str, block: int, cost_table=None, learned: LearnedCosts | None = None, concurrency: int = 1):
    """A policy name, optionally with "-padded": the same policy on a padded (dense) layout. "auto"
    is what `dspark serve` runs: prefix on the profile's cost table where there is one, else on the
    step costs ``learned`` (shared by every concurrency of a bench, as by one server's lifetime);
    "auto-fresh" is auto on a machine that never ran this target and drafter (no table, nothing
    learned before), so that both start-ups run side by side."""
    padded = name.endswith("-padded")
    base = name[:-len("-padded")] if padded else name
    if base in ("auto", "auto-fresh"):
        if cost_table is not None and base == "auto":
            return make_policy("prefix", block, cost_table=cost_table), padded
        inner = make_policy("prefix", block)
        assert isinstance(inner, LoadAwarePolicy)
        policy = AutoPolicy(inner, learned or LearnedCosts("validation", block), concurrency)
        return policy, padded
    return make_policy(base, block, cost_table=cost_table), padded


def closed_loop(target, drafter, policy, prompts: list[list[int]], concurrency: int,
                max_new_tokens: int, params: SamplingParams, block_size: int,
                padded: bool = False, label: str | None = None, prefix_caching: bool = False,
                listen: Callable[[Engine], None] | None = None):
    """One policy's closed loop as a generator: it yields after every engine step and returns its
    result. Its clock counts only its own work (admissions, steps, collecting finished requests),
    so that loops advanced in turn (`interleave`) each see the time they used; a request's latency
    is the loop's clock from its admission to its end. ``listen(engine)``, before the first step:
    a caller's chance to add its step listener (`dspark bench steps`)."""
    max_len = max(len(p) for p in prompts) + max_new_tokens + block_size + 2
    engine = (PaddedEngine if padded else Engine)(target.model, drafter, policy, max_requests=concurrency,
                                                  max_len=max_len, block_size=block_size,
                                                  eos_ids=target.eos_token_ids, prefix_caching=prefix_caching)
    drafter.reset()
    if listen is not None:
        listen(engine)
    queue = list(prompts)
    live: list[tuple[Request, float]] = []   # (request, clock at admission)
    latency: list[tuple[int, float]] = []   # (output tokens, seconds) of each ended request
    clock = 0.0
    tokens = rounds = drafted = accepted = 0
    while queue or live:
        t0 = time.perf_counter()
        while queue and len(live) < concurrency:
            live.append((engine.add_request(queue.pop(0), params, max_new_tokens), clock))
        engine.step()
        now = clock + time.perf_counter() - t0
        still = []
        for r, start in live:
            if not r.done:
                still.append((r, start))
                continue
            tokens += len(r.output_ids)
            rounds += r.stats.num_rounds
            drafted += r.stats.num_draft_tokens
            accepted += r.stats.num_accepted_tokens
            latency.append((len(r.output_ids), now - start))
        live = still
        clock = now
        yield
    per_user = sum(n / s for n, s in latency if s > 0) / len(latency)
    # the auto policy's set-up: the steps it ran to measure the step costs (inside wall_seconds)
    setup = (policy.measuring_steps, policy.measuring_seconds) if isinstance(policy, AutoPolicy) else (0, 0.0)
    return _with_rates({"setup_steps": setup[0], "setup_seconds": setup[1], "policy": label or policy.name, "concurrency": concurrency, "requests": len(latency),
                        "tokens": tokens, "wall_seconds": clock, "rounds": rounds,
                        "step_seconds": engine.step_seconds, "decision_seconds": engine.policy_seconds,
                        "per_user_tokens_per_second": per_user, "engine_steps": engine.num_steps,
                        "num_draft_tokens": drafted, "num_accepted_tokens": accepted})


def interleave(loops: list, seed: int = 0) -> list[dict]:
    """Advance closed loops one engine step each in turn until all have ended; their results in the
    given order. A shared machine drifts by more than the policies differ: in turn, every policy
    runs through the same slow and fast spells. The order is shuffled every round (seeded): in a
    fixed cycle each loop would always follow the same other one, and a step runs slower after a
    heavy one (caches, clocks), which would tax one policy for its neighbour's work."""
    rng = random.Random(seed)
    results: list = [None] * len(loops)
    live = list(range(len(loops)))
    while live:
        order = list(live)
        rng.shuffle(order)
        for i in order:
            try:
                next(loops[i])
            except StopIteration as end:
                results[i] = end.value
                live.remove(i)
    return results


def run_closed_loop(*args, **kwargs) -> dict:
    """One policy's closed loop run alone to its end (`closed_loop`'s arguments)."""
    return interleave([closed_loop(*args, **kwargs)])[0]


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
              "engine_steps", "num_draft_tokens", "num_accepted_tokens", "setup_steps", "setup_seconds"):
        out[k] = sum(r.get(k, 0) for r in runs)
    out["per_user_tokens_per_second"] = sum(r["per_user_tokens_per_second"] * r["requests"] for r in runs) / out["requests"]
    out["repeats"] = len(runs)
    return _with_rates(out)


def bench_setup(args) -> tuple[list[str], object, dict, int]:
    """(the policies by name, the target, a drafter per policy, the draft length) of a closed-loop
    bench's arguments; the names are checked before anything is loaded. One drafter per policy:
    the policies' loops run in turn, and a drafter holds its requests' state."""
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        bench_policy(p, args.num_draft)
    target = target_from_args(args)
    drafters = {name: load_drafter(args.drafter, target, num_draft=args.num_draft) for name in policies}
    return policies, target, drafters, args.num_draft or drafters[policies[0]].block_size


def run_concurrency_bench(args) -> int:
    levels = args.concurrency
    policies, target, drafters, block = bench_setup(args)
    drafter = drafters[policies[0]]
    # the cost table of this (target, drafter, dtype, device); warns and names `dspark profile` if absent
    cost_table = CostTable.find(table_key_for(target, drafter), warn=any(p.split("-")[0] in ("prefix", "async")
                                                                            for p in policies))
    # by base name, so that NAME-padded runs on NAME's costs
    bases = {name: name.removesuffix("-padded") for name in policies}
    key = f"{table_key_for(target, drafter)}|{machine_id()}"
    # auto: --fresh-costs as on a machine that never ran this target and drafter (no profile table,
    # nothing learned before; what it learns stays in memory); auto-fresh always so, beside auto
    def fresh() -> LearnedCosts:    # costs of its own, learned from nothing
        return LearnedCosts(key, block, call_block=drafter.call_block_size)
    costs = {"auto": (fresh() if args.fresh_costs else learned_costs(target, drafter))
             if "auto" in bases.values() else None,
             "auto-fresh": fresh() if "auto-fresh" in bases.values() else None}
    learned = costs["auto"]
    prompts = _bench_prompts(target, args.datasets, args.num_prompts)
    params = SamplingParams(temperature=args.temperature, seed=args.seed)
    results = []
    for c in levels:
        runs: dict[str, list] = {name: [] for name in policies}
        for _ in range(args.repeats):
            loops = []
            for name in policies:
                base = bases[name]
                table = None if base == "auto-fresh" or (base == "auto" and args.fresh_costs) else cost_table
                policy, padded = bench_policy(name, block, table, costs.get(base), c)
                loops.append(closed_loop(target, drafters[name], policy, prompts, c, args.max_new_tokens,
                                         params, block, padded=padded, label=name))
            for name, res in zip(policies, interleave(loops)):
                runs[name].append(res)
            if learned is not None:
                learned.save()
        for name in policies:
            res = combine_runs(runs[name])
            results.append(res)
            print(f"concurrency {c:>3} {name:>6}: total {res['total_tokens_per_second']:.1f} tok/s, "
                  f"per user {res['per_user_tokens_per_second']:.1f} tok/s, "
                  f"accept length {res['accept_length']:.2f}, "
                  f"decision {res['decision_ms_per_step']:.3f} ms/step ({100 * res['decision_share']:.2f}% of a step)"
                  + (f", set-up {res['setup_seconds']:.2f} s in {res['setup_steps']} measuring steps (counted)"
                     if res["setup_steps"] else ""),
                  file=sys.stderr)
    print(_table(results))
    if args.plot:
        _pareto_plot(results, args.plot)
    if args.json:
        print(json.dumps({"drafter": drafter.name, "dtype": args.dtype, "threads": torch.get_num_threads(),
                          "results": results}))
    return 0


def _bench_prompts(target, datasets: str, n: int) -> list[list[int]]:
    """n chat-templated prompts from the comma-separated benchmarks, in turn (repeated if fewer)."""
    texts = []
    for d in [x.strip() for x in datasets.split(",") if x.strip()]:
        texts.extend(load_prompts(d))
    if n > len(texts):
        texts = (texts * (n // len(texts) + 1))
    return [encode_prompt(target.tokenizer, t, chat=True) for t in texts[:n]]


def _table(results: list[dict]) -> str:
    lines = ["| policy | concurrency | total tok/s | per-user tok/s | accept length | decision ms/step (% of step) "
             "| set-up s (steps) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['policy']} | {r['concurrency']} | {r['total_tokens_per_second']:.1f} | "
                     f"{r['per_user_tokens_per_second']:.1f} | {r['accept_length']:.2f} | "
                     f"{r['decision_ms_per_step']:.3f} ({100 * r['decision_share']:.2f}%) | "
                     f"{r['setup_seconds']:.2f} ({r['setup_steps']}) |")
    return "\n".join(lines)


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
