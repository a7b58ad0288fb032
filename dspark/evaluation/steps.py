"""``dspark bench steps``: where an engine step's time goes, per policy, at one concurrency.

The closed loop of `dspark bench concurrency` (the policies in turn, one engine step each), with
every step's record read through the engine's public hook (``Engine.add_step_listener``): its wall
time and the parts the engine timed (the target's forward, the drafter's call, the policy's
decisions), the requests decoding, drafting and what the target verified and accepted of them.

Reported per policy: the whole run by phase (steady: every slot decoding and nobody waiting;
prefill: a prompt prefilled in the step; tail: the rest), then the steady steps split into those
where nothing was drafted and those where a drafter ran, beside the price the cost table of
`dspark profile` puts on them where there is one. ``--json`` adds every step: the decisions that
explain a policy's total.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..engine import Engine
from ..sampling import SamplingParams
from ..scheduling.auto import learned_costs
from ..scheduling.base import StepOutcome
from ..scheduling.costs import CostTable, table_key_for
from .concurrency import _bench_prompts, bench_policy, bench_setup, closed_loop, interleave


@dataclass(frozen=True)
class StepRow:
    """One engine step of a policy's run, as the bench reports it."""

    index: int
    phase: str              # steady, prefill or tail
    seconds: float          # the step's wall time
    forward: float          # of which the target's forward
    draft: float            # the drafter's call
    policy: float           # the policy's decisions
    decoding: int           # requests decoding
    drafting: int           # of which the drafter drafted for (lookup blocks not counted)
    free: int               # of which verified a lookup's block (no drafter call)
    verified: int           # drafted tokens the target verified
    accepted: int           # of which it accepted
    emitted: int            # tokens the decoding requests emitted (accepted + one each)
    prefill: int            # prompt tokens prefilled
    context: int            # mean context of the requests decoding after it


def step_row(rec: StepOutcome, engine: Engine, concurrency: int) -> StepRow:
    """A step's row from its record and the engine's queue after it."""
    blocks = [o for o in rec.requests if o.verified and not o.forced]
    contexts = [len(r.ctx.tokens) for r in engine.running if r.ctx is not None]
    phase = ("prefill" if rec.prefill_tokens else
             "steady" if len(rec.requests) == concurrency and not engine.waiting else "tail")
    return StepRow(rec.index, phase, rec.seconds, rec.forward_seconds, rec.draft_seconds, rec.policy_seconds,
                   len(rec.requests), sum(1 for o in rec.requests if o.drafted and not o.free),
                   sum(1 for o in blocks if o.free), sum(o.verified for o in blocks),
                   sum(o.accepted for o in blocks), sum(o.accepted + 1 for o in rec.requests), rec.prefill_tokens,
                   sum(contexts) // max(1, len(contexts)))


def log_steps(engine: Engine, path) -> Callable[[], None]:
    """Append every step's record (``StepOutcome`` as JSON, with the wall-clock time it ended) to
    ``path``, one line a step, for as long as the engine runs: `dspark serve --step-log` (what the
    policy decided and what each step cost, under the load the server really had). Returns the
    function that stops it."""
    f = open(path, "a", buffering=1)

    def write(rec: StepOutcome) -> None:
        f.write(json.dumps({"time": round(time.time(), 4), **asdict(rec)}) + "\n")

    remove = engine.add_step_listener(write)

    def stop() -> None:
        remove()
        f.close()
    return stop


def summary(rows: list[StepRow], table: CostTable | None, concurrency: int) -> dict:
    """The run by phase, and its steady steps without and with a drafter call (means per step;
    ``table_seconds``: the cost table's price of such a step, where there is a table)."""
    out: dict = {"phases": {}, "steady": {}}
    for phase in ("steady", "prefill", "tail"):
        got = [r for r in rows if r.phase == phase]
        if got:
            out["phases"][phase] = {"steps": len(got), "seconds": sum(r.seconds for r in got),
                                    "emitted": sum(r.emitted for r in got),
                                    "drafter_seconds": sum(r.draft for r in got),
                                    "steps_drafting": sum(1 for r in got if r.drafting)}
    steady = [r for r in rows if r.phase == "steady"]
    for label, got in (("plain", [r for r in steady if not r.drafting]),
                       ("drafting", [r for r in steady if r.drafting])):
        if not got:
            continue
        n = len(got)
        mean = {k: sum(getattr(r, k) for r in got) / n
                for k in ("seconds", "forward", "draft", "policy", "drafting", "free", "verified", "accepted",
                          "emitted")}
        out["steady"][label] = {"steps": n, **mean}
        if table is not None:
            out["steady"][label]["table_seconds"] = sum(
                table.target_seconds(concurrency, r.verified / concurrency, r.context)
                + (table.drafter_seconds(r.drafting, max(1.0, r.verified / r.drafting), r.context)
                   if r.drafting else 0.0) for r in got) / n
    return out


def _report(name: str, s: dict) -> None:
    for phase, p in s["phases"].items():
        print(f"{name:>8} {phase:8s} {p['steps']:5d} steps ({p['steps_drafting']} drafting), {p['seconds']:7.2f} s, "
              f"{p['emitted']:6d} tokens, drafter {p['drafter_seconds']:.2f} s", file=sys.stderr)
    for label, m in s["steady"].items():
        price = f"; table {1e3 * m['table_seconds']:.1f}" if "table_seconds" in m else ""
        print(f"{name:>8} steady {label:9s} {m['steps']:5d}: {1e3 * m['seconds']:6.1f} ms (forward "
              f"{1e3 * m['forward']:.1f}, drafter {1e3 * m['draft']:.1f}, policy {1e3 * m['policy']:.2f}{price}); "
              f"drafting {m['drafting']:.1f}, lookups {m['free']:.1f}, verified {m['verified']:.1f}, "
              f"accepted {m['accepted']:.1f}, emitted {m['emitted']:.1f}", file=sys.stderr)


def run_steps_bench(args) -> int:
    policies, target, drafters, block = bench_setup(args)
    drafter = drafters[policies[0]]
    table = CostTable.find(table_key_for(target, drafter), warn=False)
    learned = learned_costs(target, drafter) if any(p.startswith("auto") for p in policies) else None
    prompts = _bench_prompts(target, args.datasets, args.num_prompts)
    params = SamplingParams(temperature=args.temperature, seed=args.seed)
    C = args.concurrency
    rows: dict[str, list[StepRow]] = {name: [] for name in policies}
    loops = []
    for name in policies:
        fresh = name.startswith("auto-fresh")    # as on a new machine: no table, nothing learned
        policy, padded = bench_policy(name, block, None if fresh else table, None if fresh else learned, C)

        def listen(engine: Engine, got=rows[name]) -> None:
            engine.add_step_listener(lambda rec: got.append(step_row(rec, engine, C)))
        loops.append(closed_loop(target, drafters[name], policy, prompts, C, args.max_new_tokens, params, block,
                                 padded=padded, label=name, listen=listen))
    results = dict(zip(policies, interleave(loops)))
    report = {}
    for name in policies:
        s = summary(rows[name], table, C)
        _report(name, s)
        report[name] = {"total_tokens_per_second": results[name]["total_tokens_per_second"], **s,
                        **({"steps": [asdict(r) for r in rows[name]]} if args.json else {})}
        print(f"{name:>8} total {results[name]['total_tokens_per_second']:.1f} tok/s", file=sys.stderr)
    if args.json:
        print(json.dumps({"drafter": drafter.name, "concurrency": C, "cost_table": table is not None,
                          "policies": report}))
    return 0
