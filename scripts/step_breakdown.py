"""Where an engine step's time goes, per policy, at one concurrency: plain steps against steps in
which the policy drafted (the drafter's call, the target's forward, tokens verified and emitted,
and the survivals the policy expected to be accepted), beside the cost table's price of each step.

Closed-loop clients as in `dspark bench concurrency` (temperature 1, 64 new tokens each). First the
whole run by phase (steady: every slot decoding; prefill: some request prefilling; tail: slots
empty, nobody waiting), then the steady steps alone. Timings come from the engine's step records
(`Engine.add_step_listener`).

    .venv/bin/python scripts/step_breakdown.py --drafter dspark --concurrency 16 --policies plain,prefix,async
"""

import argparse

import torch

from dspark.api import encode_prompt
from dspark.data import load_prompts
from dspark.drafters import load_drafter
from dspark.engine import Engine
from dspark.runtime.loading import load_target
from dspark.sampling import SamplingParams
from dspark.scheduling.algorithm1 import survivals
from dspark.scheduling.policies import make_policy
from dspark.scheduling.costs import CostTable, table_key_for


def run(target, drafter, table, policy_name, prompts, C, new_tokens):
    """Every step of one policy's closed loop, from the engine's step records (Engine.add_step_listener)
    and the survivals the policy expected of the tokens it verified."""
    policy = make_policy(policy_name, drafter.block_size, cost_table=table)
    engine = Engine(target.model, drafter, policy, max_requests=C,
                    max_len=max(map(len, prompts)) + new_tokens + drafter.block_size + 2,
                    eos_ids=target.eos_token_ids)
    expected = [0.0]        # the policy's expected accepted tokens in the step running
    inner_verify = policy.verify_lengths

    def verify_lengths(requests, proposals):
        out = inner_verify(requests, proposals)
        if hasattr(policy, "profile"):
            prof = policy.profile.conditional()
            expected[0] += sum(sum(survivals(p, prof)[:n]) for p, n in zip(proposals, out))
        return out

    policy.verify_lengths = verify_lengths
    records = []
    engine.add_step_listener(records.append)
    steps, queue, live = [], list(prompts), []
    params = SamplingParams(temperature=1.0, seed=0)
    while queue or live:
        while queue and len(live) < C:
            live.append(engine.add_request(queue.pop(0), params, new_tokens))
        running = [r for r in live if r.status == "running" and r.ctx is not None]
        ctx = sum(len(r.ctx.tokens) for r in running) // max(1, len(running))
        before = sum(len(r.output_ids) for r in live)
        expected[0] = 0.0
        engine.step()
        rec = records[-1]
        blocks = [o for o in rec.requests if o.verified and not o.free and not o.forced]
        phase = ("prefill" if rec.prefill_tokens else "steady" if len(rec.requests) == C and not engine.waiting
                 else "tail")
        steps.append({"seconds": rec.seconds, "forward": rec.forward_seconds, "draft": rec.draft_seconds,
                      "drafting": sum(1 for o in rec.requests if o.drafted and not o.free),
                      "verified": sum(o.verified for o in blocks), "expected": expected[0],
                      "emitted": sum(len(r.output_ids) for r in live) - before, "context": ctx,
                      "phase": phase, "decoding": len(rec.requests)})
        live = [r for r in live if not r.done]
    return steps


def report_phases(name, steps):
    """Every step of the run by phase: where a policy's wall time and tokens went."""
    total = sum(s["seconds"] for s in steps)
    tokens = sum(s["emitted"] for s in steps)
    print(f"{name:7s} whole run: {len(steps)} steps, {total:.2f} s, {tokens} tokens, {tokens / total:.1f} tok/s")
    for phase in ("steady", "prefill", "tail"):
        rows = [s for s in steps if s["phase"] == phase]
        if not rows:
            continue
        sec = sum(s["seconds"] for s in rows)
        print(f"{name:7s}   {phase:8s} {len(rows):4d} steps ({sum(1 for s in rows if s['drafting'])} drafting), "
              f"{sec:6.2f} s, {sum(s['emitted'] for s in rows):5d} tokens, "
              f"drafter {sum(s['draft'] for s in rows):.2f} s, decoding rows {sum(s['decoding'] for s in rows) / len(rows):.1f}")


def report(name, steps, table, C):
    report_phases(name, steps)
    steps = [s for s in steps if s["phase"] == "steady"]
    for label, rows in (("plain steps", [s for s in steps if not s["drafting"]]),
                        ("drafting steps", [s for s in steps if s["drafting"]])):
        if not rows:
            continue
        n = len(rows)
        mean = {k: sum(s[k] for s in rows) / n for k in rows[0] if k != "phase"}
        price = sum(table.target_seconds(C, s["verified"] / C, s["context"])
                    + table.drafter_seconds(s["drafting"], max(1.0, s["verified"] / max(1, s["drafting"])),
                                            s["context"]) for s in rows) / n
        print(f"{name:7s} {label:15s} {n:4d}: {1e3 * mean['seconds']:6.1f} ms (forward {1e3 * mean['forward']:.1f}, "
              f"drafter {1e3 * mean['draft']:.1f}; table {1e3 * price:.1f}), requests drafting {mean['drafting']:.1f}, "
              f"verified {mean['verified']:.1f}, emitted {mean['emitted']:.2f}, expected accepted {mean['expected']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--policies", default="plain,prefix,async")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(None, dtype="bf16")
    drafter = load_drafter(args.drafter, target)
    table = CostTable.find(table_key_for(target, drafter))
    if table is None:
        raise SystemExit(f"no cost table for {args.drafter}: run `dspark profile --drafter {args.drafter}` first")
    prompts = [encode_prompt(target.tokenizer, p, chat=True)
               for d in ("humaneval", "gsm8k", "mt-bench", "mbpp") for p in load_prompts(d, args.num_prompts // 4)]
    for name in args.policies.split(","):
        report(name, run(target, drafter, table, name, prompts, args.concurrency, args.max_new_tokens),
               table, args.concurrency)


if __name__ == "__main__":
    main()
