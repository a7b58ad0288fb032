"""``dspark simulate --validate``: the simulation against this machine.

On one small workload (prompts of the benchmarks interleaved, a fixed number of new tokens), in
one process:

1. the drafter's acceptance and confidences on the workload's prompts (`dspark eval`'s chain
   drafting, evaluation/acceptance.py), and each prompt's answer length;
2. at each concurrency: the step costs (`dspark profile`'s measurement, evaluation/profile.py, at
   contexts spanning the workload's, kept in memory: what `dspark serve` prices with is left as it
   was), then the measurement (`dspark bench concurrency`'s closed loops,
   evaluation/concurrency.py, the policies interleaved step by step), then the simulation of the
   same workload from the costs and the acceptance alone, policy by policy;

then the relative error of the simulated total and per-user tokens/s at every point. The last
stdout line is one JSON object: {"max_relative_error", "points", ...}.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ..api import encode_prompt
from ..data import load_prompts
from ..drafters import load_drafter
from ..errors import UsageError
from ..evaluation import profile as prof
from ..evaluation.acceptance import ConfidenceBins, run_drafter, summarize
from ..evaluation.concurrency import bench_policy, closed_loop, interleave
from ..runtime.loading import target_from_args
from ..sampling import SamplingParams
from .acceptance import AcceptanceModel
from .costs import TableCosts
from .run import Scenario
from .simulator import Job


def _workload(target, datasets: list[str], n: int) -> tuple[list[list[int]], list[str]]:
    """``n`` chat prompts, the datasets interleaved (so that every concurrency sees the mix)."""
    per = {d: load_prompts(d) for d in datasets}
    ids: list[list[int]] = []
    labels: list[str] = []
    i = 0
    while len(ids) < n:
        for d in datasets:
            if i < len(per[d]) and len(ids) < n:
                ids.append(encode_prompt(target.tokenizer, per[d][i], chat=True))
                labels.append(d)
        i += 1
        if all(i >= len(v) for v in per.values()) and len(ids) < n:
            raise UsageError(f"the datasets hold only {len(ids)} prompts; ask for fewer")
    return ids, labels


def _measure_acceptance(target, drafter, prompts, labels, datasets, new_tokens: int, block: int, args):
    """The drafter's acceptance and confidences on the workload's prompts, per benchmark (what
    `dspark eval` records), and each prompt's output length."""
    rows, outputs = [], [0] * len(prompts)
    for d in datasets:
        idx = [i for i, lab in enumerate(labels) if lab == d]
        if not idx:
            continue
        bins = ConfidenceBins(block)
        per = run_drafter(target, drafter, [prompts[i] for i in idx], max_new_tokens=new_tokens,
                          temperature=args.temperature, seed=args.seed, block=block, bins=bins)
        for i, p in zip(idx, per):
            outputs[i] = p["tokens"]
        row = {"drafter": drafter.name, "benchmark": d, **summarize(per, block)}
        if bins.to_json() is not None:
            row["confidence_bins"] = bins.to_json()
        rows.append(row)
    return AcceptanceModel.from_eval({"results": rows}, source="the workload's prompts"), outputs


def _policies(names: str | None) -> list[str]:
    """The policies --validate compares (plain, fixed and auto by default), checked."""
    policies = [p.strip() for p in (names or "plain,fixed,auto").split(",") if p.strip()]
    for p in policies:
        if p not in ("plain", "mtp1", "fixed", "auto") and not p.startswith("threshold"):
            raise UsageError(f"--validate compares plain, mtp1, fixed, threshold-X and auto, not {p!r}")
    return policies


def say(msg: str) -> None:
    """A line of progress on stderr, with the time."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _point(name: str, c: int, m: dict, s: dict, say) -> dict:
    """A policy at a concurrency: measured (m) against simulated (s), and their relative errors."""
    keys = ("total_tokens_per_second", "per_user_tokens_per_second", "accept_length")
    say(f"   {name:>6} at {c:>3}: total {m['total_tokens_per_second']:.1f} measured, "
        f"{s['total_tokens_per_second']:.1f} simulated; per user {m['per_user_tokens_per_second']:.1f} / "
        f"{s['per_user_tokens_per_second']:.1f}; accept length {m['accept_length']:.2f} / {s['accept_length']:.2f}")
    return {"policy": name, "concurrency": c, "measured": {k: m[k] for k in keys},
            "simulated": {k: s[k] for k in keys},
            "relative_error": {k: abs(s[k] - m[k]) / m[k] for k in keys[:2]}}


def _table(points: list[dict]) -> str:
    lines = ["| policy | concurrency | total tok/s measured | simulated | error | per-user measured | simulated | error |",
             "|---|---|---|---|---|---|---|---|"]
    for p in points:
        m, s, e = p["measured"], p["simulated"], p["relative_error"]
        lines.append(f"| {p['policy']} | {p['concurrency']} | {m['total_tokens_per_second']:.1f} | "
                     f"{s['total_tokens_per_second']:.1f} | {100 * e['total_tokens_per_second']:.1f} % | "
                     f"{m['per_user_tokens_per_second']:.1f} | {s['per_user_tokens_per_second']:.1f} | "
                     f"{100 * e['per_user_tokens_per_second']:.1f} % |")
    return "\n".join(lines)


def run_validation(args) -> int:
    policies = _policies(args.policies)
    levels = args.concurrency or [1, 4, 16, 32]
    new_tokens = args.output_tokens or 64
    n = args.num_prompts or 32
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    target = target_from_args(args)
    drafters = {name: load_drafter(args.drafter, target) for name in policies}
    drafter = drafters[policies[0]]
    block = min(args.num_draft, drafter.block_size)
    prompts, labels = _workload(target, datasets, n)
    params = SamplingParams(temperature=args.temperature, seed=args.seed)

    # contexts spanning the workload's (a step's attention grows with them): from its shortest
    # prompt to its longest prompt and answer, four apart
    lo, hi = min(len(p) for p in prompts), max(len(p) for p in prompts) + new_tokens
    contexts = sorted({max(16, round(lo + k * (hi - lo) / 3)) for k in range(4)})

    def profile(c: int):
        """The cost table up to c requests, measured now: the machine's speed drifts by more than
        the policies differ within minutes, so each concurrency is measured right after its table."""
        requests = sorted({r for r in (1, 2, 4, 8, 16, 32, 64, 128) if r < c} | {c})
        return prof.profile(target, drafter, prompts[:12], requests, (0, 1, 2, 3, 5, block), contexts, repeats=3,
                            temperature=args.temperature)

    say(f"1/3 the drafter's acceptance and confidences on the workload's prompts ({target.name}, {drafter.name}, "
        f"{torch.get_num_threads()} threads)")
    acceptance, outputs = _measure_acceptance(target, drafter, prompts, labels, datasets, new_tokens, block, args)
    jobs = [Job(len(p), max(1, o), lab) for p, o, lab in zip(prompts, outputs, labels)]

    points, tables = [], []
    for c in levels:
        say(f"2/3 concurrency {c}: the cost table (`dspark profile`, contexts {contexts})")
        table = profile(c)
        tables.append(TableCosts(table).describe())
        scen = Scenario(TableCosts(table), acceptance, jobs, block, seed=args.seed)
        say(f"2/3 concurrency {c}: measuring {', '.join(policies)} interleaved, then simulating them")
        loops = []
        for name in policies:
            policy, _ = bench_policy(name, block, table, None, c)
            loops.append(closed_loop(target, drafters[name], policy, prompts, c, new_tokens, params, block,
                                     label=name))
        measured = interleave(loops, seed=args.seed)
        for name, m in zip(policies, measured):
            points.append(_point(name, c, m, scen.run(name, c, num_requests=len(jobs), max_requests=c), say))
    say("3/3 done")
    print(_table(points))
    worst = max(max(p["relative_error"].values()) for p in points)
    print(f"max relative error {100 * worst:.1f} % over {2 * len(points)} figures", file=sys.stderr)
    print(json.dumps({"max_relative_error": worst, "target": target.name, "drafter": drafter.name,
                      "dtype": args.dtype, "threads": torch.get_num_threads(), "temperature": args.temperature,
                      "prompts": len(prompts), "new_tokens": new_tokens, "acceptance": acceptance.describe(),
                      "cost_tables": tables, "points": points}))
    return 0
