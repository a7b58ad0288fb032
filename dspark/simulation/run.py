"""``dspark simulate``: a serving deployment's frontier (per-user tokens/s against total tokens/s)
per policy, predicted from step costs, a drafter's acceptance and a workload; the largest load
that meets a per-user speed target (SLA) and the throughput there; ``--validate`` checks the
predictions against `dspark bench concurrency` on this machine (validate.py)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from ..errors import UsageError
from ..scheduling.auto import AutoPolicy
from ..scheduling.base import Policy
from ..scheduling.learned import LearnedCosts
from ..scheduling.load_aware import LoadAwarePolicy
from ..scheduling.policies import POLICY_NAMES, make_policy
from .acceptance import AcceptanceModel
from .costs import ModelShape, Roofline, StepCosts, TableCosts, accelerator
from .simulator import Job, Simulator, closed_loop, open_loop

SIM_POLICIES = POLICY_NAMES + ("auto", "auto-fresh")


def make_sim_policy(name: str, costs: StepCosts, block: int, max_requests: int) -> Policy:
    """The engine's policy of that name, pricing with the costs' table: ``auto`` is what `dspark
    serve` runs where `dspark profile` measured a table (prefix on it); ``auto-fresh`` the auto
    policy on a machine that measured nothing (it learns the simulated step costs as it runs)."""
    if name == "auto":
        policy = make_policy("prefix", block, cost_table=costs.table)
    elif name == "auto-fresh":
        inner = make_policy("prefix", block)
        assert isinstance(inner, LoadAwarePolicy)
        policy = AutoPolicy(inner, LearnedCosts("simulation", block), max_requests)
    else:
        policy = make_policy(name, block, cost_table=costs.table)
    policy.name = name
    return policy


@dataclass
class Scenario:
    """What a simulation runs: step costs, a drafter's acceptance (and MTP-1's), a workload."""

    costs: StepCosts
    acceptance: AcceptanceModel
    jobs: list[Job]                 # the workload's requests, cycled as a level needs
    block: int = 7
    mtp1_acceptance: AcceptanceModel | None = None
    max_requests: int = 0           # cache slots (0: the level's concurrency)
    decisions: bool = True
    seed: int = 0
    prefill: bool = True            # False: prompts prefilled elsewhere (disaggregated)

    def run(self, policy: str, concurrency: int | None = None, rate: float | None = None,
            num_requests: int | None = None, max_requests: int | None = None) -> dict:
        """One point: a closed loop at ``concurrency`` or an open loop at ``rate``."""
        slots = max_requests or self.max_requests or concurrency or 256
        n = num_requests or max(32, 4 * (concurrency or slots))
        jobs = [self.jobs[i % len(self.jobs)] for i in range(n)]
        acc = self.mtp1_acceptance if policy == "mtp1" and self.mtp1_acceptance else self.acceptance
        sim = Simulator(make_sim_policy(policy, self.costs, self.block, slots), self.costs, acc,
                        block=self.block, max_requests=slots, seed=self.seed, decisions=self.decisions,
                        prefill=self.prefill)
        if rate is not None:
            out = open_loop(sim, jobs, rate, self.seed)
        elif concurrency:
            out = closed_loop(sim, jobs, concurrency)
        else:
            raise UsageError("a point needs a concurrency or a rate")
        out["policy"] = policy
        return out


def sla_point(scen: Scenario, policy: str, sla: float, points: list[dict], num_requests: int | None) -> dict:
    """The largest concurrency whose per-user tokens/s meets ``sla`` (bisected between the swept
    levels around it), and its total tokens/s; concurrency 0 where even one request misses it."""
    ok = [p for p in points if p["per_user_tokens_per_second"] >= sla]
    if not ok:
        return {"policy": policy, "sla": sla, "max_concurrency": 0, "total_tokens_per_second": 0.0}
    best = max(ok, key=lambda p: p["concurrency"])
    above = [p for p in points if p["concurrency"] > best["concurrency"]]
    if above:
        lo, hi = best["concurrency"], min(p["concurrency"] for p in above)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            got = scen.run(policy, mid, num_requests=num_requests)
            if got["per_user_tokens_per_second"] >= sla:
                lo, best = mid, got
            else:
                hi = mid
    return {"policy": policy, "sla": sla, "max_concurrency": best["concurrency"],
            "total_tokens_per_second": best["total_tokens_per_second"],
            "per_user_tokens_per_second": best["per_user_tokens_per_second"]}


def pareto_plot(results: list[dict], path: str, sla: list[float] | None = None, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name in dict.fromkeys(r["policy"] for r in results):
        rs = sorted((r for r in results if r["policy"] == name), key=lambda r: r["concurrency"])
        xs = [r["total_tokens_per_second"] for r in rs]
        ys = [r["per_user_tokens_per_second"] for r in rs]
        ax.plot(xs, ys, marker="o", label=name)
        for r, x, y in zip(rs, xs, ys):
            ax.annotate(f"{r['concurrency']:.0f}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    for speed in sla or []:
        ax.axhline(speed, color="grey", ls="--", lw=1)
        ax.annotate(f"SLA {speed:g} tok/s per user", (1, speed), xycoords=("axes fraction", "data"),
                    textcoords="offset points", xytext=(-4, 3), ha="right", fontsize=8, color="grey")
    ax.set_xlabel("total tokens/s")
    ax.set_ylabel("tokens/s per user")
    ax.set_title(title or "Simulated frontier (labels: concurrency)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(results: list[dict], key: str = "concurrency") -> str:
    lines = [f"| policy | {key} | total tok/s | per-user tok/s | accept length | TTFT p50 s | latency p90 s |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['policy']} | {r[key]:g} | {r['total_tokens_per_second']:.1f} | "
                     f"{r['per_user_tokens_per_second']:.1f} | {r['accept_length']:.2f} | "
                     f"{r['ttft_seconds']['p50']:.3f} | {r['latency_seconds']['p90']:.3f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- the command
def _costs(args) -> tuple[StepCosts, object]:
    """(the step costs, the loaded target or None) from --cost-table, --hardware, or the profile of
    --target / --drafter."""
    from ..scheduling.costs import CostTable
    if args.hardware:
        if not args.model:
            raise UsageError("--hardware needs --model (a preset, a config.json or a folder holding one)")
        target = ModelShape.load(args.model)
        if args.drafter_model:
            drafter = ModelShape.load(args.drafter_model)
        else:
            cfg = _config(args.model)
            if cfg is None:
                raise UsageError("a --model given by its roofline fields needs --drafter-model")
            drafter = ModelShape.from_config(cfg, f"{args.drafter_layers}-layer DSpark drafter",
                                             layers=args.drafter_layers, markov_rank=args.markov_rank)
        acc = accelerator(args.hardware, step_overhead=_ms(args.step_overhead_ms),
                          drafter_overhead=_ms(args.drafter_overhead_ms))
        return Roofline(acc, target, drafter, contexts=tuple(args.contexts)), None
    if args.cost_table:
        return TableCosts(CostTable.load(args.cost_table)), None
    from ..drafters import load_drafter
    from ..runtime.loading import target_from_args
    from ..scheduling.costs import table_key_for, table_path
    loaded = target_from_args(args)
    key = table_key_for(loaded, load_drafter(args.drafter, loaded))
    table = CostTable.find(key, warn=False)
    if table is None:
        raise UsageError(f"no cost table for {key}: run `dspark profile --drafter {args.drafter}` first (it "
                         f"writes {table_path(key)}), or give --cost-table or --hardware")
    return TableCosts(table), loaded


def _ms(x: float | None) -> float | None:
    return None if x is None else x / 1000.0


def _config(spec: str) -> dict | None:
    from .costs import MODELS
    if spec in MODELS:
        return MODELS[spec]
    from pathlib import Path
    p = Path(spec)
    p = p / "config.json" if p.is_dir() else p
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return d if "hidden_size" in d else None


def _jobs(args, acceptance: AcceptanceModel, target) -> list[Job]:
    if args.prompt_tokens:
        labels = acceptance.benchmarks or [""]
        return [Job(args.prompt_tokens, args.output_tokens, labels[i % len(labels)]) for i in range(len(labels))]
    from ..api import encode_prompt
    from ..data import load_prompts
    if target is None:
        from ..runtime.loading import target_from_args
        target = target_from_args(args)
    names = [d.strip() for d in args.datasets.split(",") if d.strip()]
    per = {d: [len(encode_prompt(target.tokenizer, t, chat=True)) for t in load_prompts(d, args.dataset_prompts)]
           for d in names}
    jobs: list[Job] = []
    for i in range(max(len(v) for v in per.values())):     # interleaved, so that any prefix is a mix
        jobs.extend(Job(v[i], args.output_tokens, d) for d, v in per.items() if i < len(v))
    return jobs


def run_simulate(args) -> int:
    args.policies = args.policies or "plain,mtp1,fixed,auto"
    args.concurrency = args.concurrency or [1, 2, 4, 8, 16, 32, 64, 128]
    args.output_tokens = args.output_tokens or 256
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in SIM_POLICIES and not p.startswith("threshold-"):
            raise UsageError(f"unknown policy {p!r}; choose from {', '.join(SIM_POLICIES)} or threshold-X")
    if args.rate and args.sla:
        raise UsageError("--sla applies to a --concurrency sweep")
    acceptance = AcceptanceModel.load(args.acceptance, args.num_draft)
    mtp1 = AcceptanceModel.load(args.mtp1_acceptance, 1) if args.mtp1_acceptance else None
    costs, target = _costs(args)
    jobs = _jobs(args, acceptance, target)
    scen = Scenario(costs, acceptance, jobs, args.num_draft, mtp1, args.max_requests, not args.no_decisions, args.seed,
                    prefill=not args.disaggregated_prefill)
    results = []
    for name in policies:
        for level in (args.rate or args.concurrency):
            res = (scen.run(name, rate=level, num_requests=args.num_prompts) if args.rate
                   else scen.run(name, level, num_requests=args.num_prompts))
            results.append(res)
            print(f"{name:>10} {'rate' if args.rate else 'concurrency'} {level:g}: total "
                  f"{res['total_tokens_per_second']:.1f} tok/s, per user {res['per_user_tokens_per_second']:.1f} tok/s, "
                  f"accept length {res['accept_length']:.2f}", file=sys.stderr)
    sla = []
    for target_speed in args.sla or []:
        for name in policies:
            sla.append(sla_point(scen, name, target_speed, [r for r in results if r["policy"] == name],
                                 args.num_prompts))
    print(markdown(results, "rate" if args.rate else "concurrency"))
    if sla:
        print("\n| policy | SLA tok/s per user | largest concurrency | total tok/s there |\n|---|---|---|---|")
        for s in sla:
            print(f"| {s['policy']} | {s['sla']:g} | {s['max_concurrency']} | {s['total_tokens_per_second']:.1f} |")
    if args.plot:
        pareto_plot(results, args.plot, args.sla or [])
        print(f"plot written to {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps({"costs": costs.describe(), "acceptance": acceptance.describe(),
                          "mtp1_acceptance": mtp1.describe() if mtp1 else None,
                          "workload": {"requests": len(jobs), "prompt_tokens_mean": sum(j.prompt for j in jobs) / len(jobs),
                                       "output_tokens": args.output_tokens},
                          "results": results, "sla": sla}))
    return 0
