"""Characterization record of the scheduling policies: every decision each policy takes on a seeded
tiny-target run through the Engine, written as JSON, so that a refactor of dspark/scheduling can
show it decides the same lengths for the same inputs (run it before and after, compare the files).

Each run: a tiny random target (tests/_tiny.py), a tiny DSpark drafter (confidences) or the hybrid
n-gram + DSpark drafter (free lookup drafts), 8 requests over 4 slots (queueing, joins, leaves, one
cancelled between steps), temperature 1 and greedy. Policies: plain, mtp1, fixed, threshold-0.5,
ema, prefix and async, without a cost table, with one where drafting pays at first
and with one where it does not. Step times are not the wall clock (which
would make the cost model's corrections, and so the decisions, differ from run to run): the
engine's clock is replaced by one that each step advances by a price of what it verified.

    .venv/bin/python scripts/policy_decisions.py /tmp/before.json
    .venv/bin/python scripts/policy_decisions.py /tmp/after.json && cmp /tmp/before.json /tmp/after.json
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import dspark.engine as engine_module  # noqa: E402
from dspark.drafters.dspark import DSparkDrafter  # noqa: E402
from dspark.drafters.hybrid import HybridDrafter  # noqa: E402
from dspark.drafters.ngram import NgramDrafter  # noqa: E402
from dspark.sampling import SamplingParams  # noqa: E402
from dspark.scheduling.policies import make_policy  # noqa: E402

from _tiny import tiny_drafter_model, tiny_target  # noqa: E402

try:
    from dspark.scheduling.costs import CostTable
except ImportError:             # before the split of dspark/scheduling
    from dspark.scheduling.sps import CostTable

CLOCK = [0.0]
engine_module.time = SimpleNamespace(perf_counter=lambda: CLOCK[0])   # type: ignore[assignment]


def cost_table(kind):
    """"cheap": drafting pays at first (the fake clock then says it costs more than the table);
    "dear": a drafter call costs more than it returns (probes, plain steps, free drafts only)."""
    if kind == "cheap":
        return CostTable("tiny", requests=[1, 4, 8], verified=[0, 1, 3], contexts=[8, 32],
                         seconds=[[[1.0, 1.05, 1.15], [1.3, 1.4, 1.6], [1.6, 1.8, 2.2]]] * 2,
                         draft=[[[0, 0.03, 0.04], [0, 0.05, 0.07], [0, 0.08, 0.1]]] * 2, context_row=0.002)
    return CostTable("tiny", requests=[1, 4, 8], verified=[0, 1, 3], contexts=[8, 32],
                     seconds=[[[1.0, 1.6, 1.7], [1.3, 2.0, 2.2], [1.6, 2.5, 2.9]]] * 2,
                     draft=[[[0, 0.5, 0.55], [0, 0.6, 0.65], [0, 0.8, 0.9]]] * 2, context_row=0.01)


class Recorder:
    """Wraps a policy: records its decisions and advances the fake clock by a price of each step."""

    def __init__(self, policy, index):
        self.policy, self.index, self.steps = policy, index, []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def draft_lengths(self, requests, block_size, *args, **kwargs):
        want = self.policy.draft_lengths(requests, block_size, *args, **kwargs)
        self.steps.append({"ids": [self.index[r.id] for r in requests], "draft": list(want)})
        return want

    def verify_lengths(self, requests, proposals):
        lengths = self.policy.verify_lengths(requests, proposals)
        self.steps[-1].update(proposed=[len(p) for p in proposals], free=[int(p.free) for p in proposals],
                              verify=[int(n) for n in lengths])
        drafting = sum(1 for p in proposals if len(p) and not p.free)
        CLOCK[0] += 1.0 + 0.3 * len(requests) + 0.07 * sum(lengths) + (0.2 + 0.02 * drafting if drafting else 0)
        return lengths


def run(policy_name, drafter_kind, table):
    target = tiny_target(scale=3.0)
    model = DSparkDrafter(tiny_drafter_model(target, scale=2.0), target)
    drafter = model if drafter_kind == "dspark" else HybridDrafter(
        NgramDrafter(block_size=3, history_tokens=0), model, min_match=1)
    policy = make_policy(policy_name, 3, cost_table=table)
    index: dict = {}
    rec = Recorder(policy, index)
    eng = engine_module.Engine(target, drafter, rec, max_requests=4, block_size=3, max_len=128, cost_table=table)
    prompts = [[1, 3, 2, 4], [2, 0, 1, 2, 0, 1, 4], [4, 4, 3], [1, 2, 1, 2, 1, 2], [3, 0, 3, 0, 2],
               [0, 1, 2, 3, 4, 0, 1], [2, 2, 2, 1], [4, 3, 2, 1, 0, 4, 3]]
    reqs = []

    def add(i):
        params = SamplingParams(temperature=0.0 if i % 3 == 2 else 1.0, seed=100 + i)
        r = eng.add_request(prompts[i], params, 30 + 7 * (i % 4))
        index[r.id] = i
        reqs.append(r)

    for i in range(5):
        add(i)
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        if steps == 3:
            add(5)
            add(6)
        if steps == 6:
            eng.cancel(reqs[1])
        if steps == 9:
            add(7)
    internals = {"ratio": getattr(policy, "_ratio", None), "probe_scale": getattr(policy, "probe_scale", None)}
    for name in ("profile", "free_profile"):
        prof = getattr(policy, name, None)
        if prof is not None:
            internals[name] = [prof.tries, prof.hits]
    cost = getattr(policy, "cost", None)
    if cost is not None:
        internals["cost"] = [cost.extra_scale, cost.since_plain, cost.pace]
    return {"steps": rec.steps, "outputs": [r.output_ids for r in reqs],
            "stats": [[r.stats.num_drafts, r.stats.num_draft_tokens, r.stats.num_accepted_tokens,
                       r.stats.accepted_per_position] for r in reqs],
            "internals": internals}


def main():
    torch.set_num_threads(1)
    out = {}
    for drafter_kind in ("dspark", "hybrid"):
        for table in ("no-table", "cheap", "dear"):
            for name in ("plain", "mtp1", "fixed", "threshold-0.5", "ema", "prefix", "async"):
                key = f"{name}|{drafter_kind}|{table}"
                out[key] = run(name, drafter_kind, None if table == "no-table" else cost_table(table))
                s = out[key]["steps"]
                print(f"{key:32s} steps {len(s):3d}  drafted {sum(sum(x['draft']) for x in s):4d}  "
                      f"verified {sum(sum(x.get('verify', [])) for x in s):4d}", flush=True)
    Path(sys.argv[1]).write_text(json.dumps(out, indent=None, sort_keys=True))


if __name__ == "__main__":
    main()
