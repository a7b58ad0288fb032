"""What the engine tells a policy after each step (scheduling.base.StepOutcome), and what policies
keep of requests: per request drafted / verified / accepted equal to what the engine's stats count,
the step's time, which requests ended; each policy's per-request state made as requests come and
dropped as they go, none of it in the drafter's DraftContext.state; no import cycle in scheduling/."""

import ast
from pathlib import Path

import pytest

from dspark.drafters import HybridDrafter, NgramDrafter
from dspark.drafters.dspark import DSparkDrafter
from dspark.engine import Engine
from dspark.sampling import SamplingParams
from dspark.scheduling.base import RequestStates, StepOutcome
from dspark.scheduling.costs import CostTable
from dspark.scheduling.policies import make_policy

from _tiny import tiny_drafter_model, tiny_target

# the keys policies used to keep in the drafter's context before they had states of their own
OLD_POLICY_KEYS = {"_ema", "_ema_seen", "_backlog", "_free", "_free_idle", "_last_verified", "_verified_history",
                   "_free_pending", "_profile_seen"}


def _table():
    return CostTable("tiny", requests=[1, 4, 8], verified=[0, 1, 3], contexts=[8, 32],
                     seconds=[[[1.0, 1.05, 1.15], [1.3, 1.4, 1.6], [1.6, 1.8, 2.2]]] * 2,
                     draft=[[[0, 0.03, 0.04], [0, 0.05, 0.07], [0, 0.08, 0.1]]] * 2)


def _run(name: str):
    """A seeded run of 6 requests over 3 slots (one cancelled mid-run) with the hybrid drafter;
    returns (engine, requests, the outcomes the policy was handed, its decisions per step)."""
    target = tiny_target(scale=3.0)
    hybrid = HybridDrafter(NgramDrafter(block_size=3, history_tokens=0),
                           DSparkDrafter(tiny_drafter_model(target, scale=2.0), target), min_match=1)
    policy = make_policy(name, 3, cost_table=_table())
    outcomes: list[StepOutcome] = []
    decisions: list[dict] = []
    observe, verify = policy.observe, policy.verify_lengths

    def verify_lengths(requests, proposals):
        lengths = verify(requests, proposals)
        decisions.append({r.id: (len(p), min(n, len(p)), p.free) for r, p, n in zip(requests, proposals, lengths)})
        return lengths

    policy.observe = lambda o: (outcomes.append(o), observe(o))[1]
    policy.verify_lengths = verify_lengths
    engine = Engine(target, hybrid, policy, max_requests=3, block_size=3, max_len=64)
    prompts = [[1, 3, 2, 4], [2, 0, 1, 2, 0, 1, 4], [4, 4, 3], [1, 2, 1, 2, 1, 2], [3, 0, 3, 0, 2], [0, 1, 2, 3]]
    reqs = [engine.add_request(p, SamplingParams(temperature=1.0, seed=i), 12 + 2 * i) for i, p in enumerate(prompts)]
    calls = 0
    while engine.has_work():
        engine.step()
        calls += 1
        if calls == 4:
            engine.cancel(reqs[1])
    return engine, reqs, outcomes, decisions, calls


@pytest.mark.parametrize("name", ["fixed", "threshold-0.5", "ema", "prefix", "async"])
def test_policies_receive_the_typed_step_outcome_the_stats_count(name):
    engine, reqs, outcomes, decisions, calls = _run(name)
    assert len(outcomes) == calls                         # every step, also those that prefilled
    assert sum(o.seconds for o in outcomes) == pytest.approx(engine.step_seconds)
    assert any(o.decode_only for o in outcomes) and not all(o.decode_only for o in outcomes)
    ended = [i for o in outcomes for i in o.ended]
    assert sorted(ended) == sorted(r.id for r in reqs)    # each request ends once, the cancelled one too
    assert reqs[1].status == "cancelled"
    by_id = {r.id: r for r in reqs}
    gone = set()
    for o in outcomes:
        verified = [x for x in o.requests]
        assert not gone & {x.request_id for x in verified}    # nothing of a request after it ended
        gone |= set(o.ended)
    per = {r.id: [x for o in outcomes for x in o.requests if x.request_id == r.id] for r in reqs}
    for rid, got in per.items():
        s = by_id[rid].stats
        drafts = [x for x in got if x.speculated]
        assert len(drafts) == s.num_drafts
        assert sum(x.verified for x in drafts) == s.num_draft_tokens
        assert sum(x.accepted for x in drafts) == s.num_accepted_tokens
        positions = [sum(1 for x in drafts if x.accepted > k) for k in range(len(s.accepted_per_position))]
        assert positions == s.accepted_per_position
        assert all(0 <= x.accepted <= x.verified <= x.drafted for x in got)
        assert len(got) == s.num_rounds
    # what the policy decided, as the target verified it (no grammar here: nothing replaced)
    steps = [o for o in outcomes if o.requests]
    assert len(steps) == len(decisions)
    for o, d in zip(steps, decisions):
        assert {x.request_id: (x.drafted, x.verified, x.free) for x in o.requests} == d
    assert sum(x.accepted for o in outcomes for x in o.requests) > 0
    assert any(x.free and x.verified for o in outcomes for x in o.requests)   # the lookup served some


@pytest.mark.parametrize("name", ["ema", "prefix", "async"])
def test_policy_state_comes_and_goes_with_requests_and_stays_out_of_the_draft_context(name):
    engine, reqs, outcomes, _, _ = _run(name)
    policy = engine.policy
    assert isinstance(policy.states, RequestStates) and len(policy.states) == 0   # every request ended
    assert max(len({x.request_id for x in o.requests}) for o in outcomes) == 3    # and there were some
    for r in reqs:
        if r.ctx is not None:
            assert not OLD_POLICY_KEYS & set(r.ctx.state), r.ctx.state


def test_request_states_are_made_on_first_use_and_dropped():
    from dataclasses import dataclass

    @dataclass
    class S:
        n: int = 0

    states = RequestStates(S)
    assert states.get(7) is None and 7 not in states
    states[7].n += 2
    states[7].n += 1
    assert states.get(7) == S(3) and len(states) == 1
    states.drop([7, 8])
    assert len(states) == 0 and states[7] == S(0)


def test_scheduling_imports_no_cycle_and_nothing_above_it():
    """scheduling/ modules import one another without a cycle, and nothing of the engine, drafters
    or server (policies see requests only through what the engine hands them)."""
    root = Path(__file__).resolve().parents[1] / "dspark" / "scheduling"
    graph = {}
    for f in root.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                deps.add(node.module.split(".")[0])
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                assert node.module in ("errors", "runtime.linear", "runtime.loading"), (f.name, node.module)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and not node.module:
                deps.update(a.name for a in node.names)
        graph[f.stem] = deps
    done: set = set()

    def visit(m, path):
        assert m not in path, f"import cycle: {' -> '.join(path + [m])}"
        if m in done or m not in graph:
            return
        for d in graph[m]:
            visit(d, path + [m])
        done.add(m)

    for m in graph:
        visit(m, [])
