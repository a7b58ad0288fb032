"""`dspark simulate`: the simulator runs the engine's own policies to the engine's decisions; its
acceptance draws and step costs hold the statistics they were given; the command's outputs."""

import dataclasses
import json

import numpy as np
import pytest

from dspark.cli import main
from dspark.drafters.dspark import DSparkDrafter
from dspark.engine import Engine
from dspark.sampling import SamplingParams
from dspark.scheduling.base import Policy
from dspark.scheduling.costs import CostTable
from dspark.simulation.acceptance import AcceptanceModel, rate_for_tau
from dspark.simulation.costs import ModelShape, Roofline, StepShape, TableCosts, accelerator
from dspark.simulation.run import Scenario, make_sim_policy
from dspark.simulation.simulator import Job, Simulator

from _tiny import tiny_drafter_model, tiny_target


def _table() -> CostTable:
    # a step dearer with every verified token and request, so that the load-aware policies choose
    # several lengths; the drafter's call a tenth of a step
    requests, verified, contexts = [1, 2, 4], [0, 1, 2, 3], [8, 32]
    seconds = [[[0.010 * (1 + 0.3 * r) * (1 + 0.12 * v) + (0.001 * r if v else 0) for v in verified]
                for r in requests] for _ in contexts]
    draft = [[[0.001 * r if v else 0.0 for v in verified] for r in requests] for _ in contexts]
    return CostTable("tiny", requests, verified, contexts, seconds, draft=draft, context_row=1e-5,
                     prefill=[0.004, 0.0002])


class _Recorder(Policy):
    """The engine's policy, told the step costs the simulator prices (not the wall time), and
    recording its decisions and what the drafter proposed for a replay."""

    def __init__(self, inner: Policy, costs: TableCosts):
        self.inner, self.costs, self.name = inner, costs, inner.name
        self.uses_free_drafts = inner.uses_free_drafts
        self.steps: list[tuple] = []
        self.trace: dict[int, list] = {}
        self._step: dict = {}

    def wants_free(self, requests):
        return self.inner.wants_free(requests)

    def draft_lengths(self, requests, block_size, free=None):
        want = self.inner.draft_lengths(requests, block_size, free)
        self._step = {"ids": [r.id for r in requests], "contexts": [r.context for r in requests],
                      "want": list(want)}
        return want

    def verify_lengths(self, requests, proposals):
        lengths = self.inner.verify_lengths(requests, proposals)
        self._step["conf"] = [None if p.confidences is None else p.confidences.tolist() for p in proposals]
        self._step["verified"] = list(lengths)
        return lengths

    def observe(self, outcome):
        st, self._step = self._step, {}
        reqs = outcome.requests
        blocks = tuple(1 + o.verified for o in reqs)
        calls = [o.drafted for o in reqs if o.drafted]
        shape = StepShape(blocks, tuple(st.get("contexts", ())), outcome.forward_rows - sum(blocks),
                          drafting=len(calls), depth=sum(calls) / max(1, len(calls)), draft_rows=outcome.draft_rows)
        fwd, draft = self.costs.forward_seconds(shape), self.costs.draft_seconds(shape)
        for i, o in enumerate(reqs):
            if o.drafted:
                hidden = o.accepted if o.accepted < o.verified else o.verified
                self.trace.setdefault(o.request_id, []).append((st["conf"][i], hidden))
        self.steps.append((tuple(o.request_id for o in reqs), tuple(st.get("want", ())),
                           tuple(o.verified for o in reqs), tuple(o.accepted for o in reqs)))
        self.inner.observe(dataclasses.replace(outcome, seconds=fwd + draft, forward_seconds=fwd, draft_seconds=draft))


@pytest.mark.parametrize("name", ["prefix", "async", "threshold-0.5", "auto-fresh"])
def test_the_simulator_runs_the_engines_policy_to_the_same_decisions(name):
    """One policy class through the engine (a tiny target and DSpark drafter, its step times
    replaced by the costs') and through the simulator (the engine run's own proposals replayed):
    the same requests decode in the same order, and every draft length, verification length and
    accepted count is the same, step by step."""
    target = tiny_target(scale=3.0)
    drafter = DSparkDrafter(tiny_drafter_model(target, block=3, scale=2.0), target)
    costs = TableCosts(_table())
    rec = _Recorder(make_sim_policy(name, costs, 3, 3), costs)
    engine = Engine(target, drafter, rec, max_requests=3, block_size=3, max_len=48)
    prompts = [[1, 2, 3, 4, 1, 2], [3, 1], [2, 2, 4, 1, 3, 3, 1, 2, 4, 4], [4, 3, 2], [1, 4, 2, 3, 1]]
    outs = [14, 9, 17, 6, 12]
    reqs = [engine.add_request(p, SamplingParams(temperature=1.0, seed=i), n, stop_ids=())
            for i, (p, n) in enumerate(zip(prompts, outs))]
    engine.run()
    assert [len(r.output_ids) for r in reqs] == outs
    # (the auto policy, new to the costs, spends these few steps measuring them: plain and whole blocks)
    assert len({v for step in rec.steps for v in step[2]}) >= (2 if name == "auto-fresh" else 3), \
        "too few verification lengths to compare"

    index = {r.id: i for i, r in enumerate(reqs)}
    trace = {index[k]: list(v) for k, v in rec.trace.items()}

    def replay(r, n):
        conf, hidden = trace[r.id].pop(0)
        assert len(conf) == n
        return conf, hidden

    sim = Simulator(make_sim_policy(name, costs, 3, 3), costs, AcceptanceModel.describe_spec("rate=0.5"), block=3,
                    max_requests=3, decisions=False, draws=replay, record=True)
    for p, n in zip(prompts, outs):
        sim.add(Job(len(p), n))
    while sim.has_work():
        sim.step()
    engine_steps = [(tuple(index[i] for i in ids), want, verified, acc) for ids, want, verified, acc in rec.steps]
    sim_steps = [(s.requests, s.want, s.verified, s.accepted) for s in sim.records]
    assert sim_steps == engine_steps
    assert all(not v for v in trace.values())      # every proposal replayed


def test_described_acceptance_draws_hold_their_rate_and_auroc():
    model = AcceptanceModel.describe_spec("tau=4.0,block=5,auroc=0.8")
    law = model.pooled
    assert law.tau == pytest.approx(4.0, abs=1e-6)
    rate = rate_for_tau(4.0, 5)
    import random
    rng = random.Random(0)
    conf, ok = [], []
    for _ in range(4000):
        c, n = law.draw(5, rng)
        conf.append(c[0])
        ok.append(n > 0)
    conf, ok = np.array(conf), np.array(ok)
    assert ok.mean() == pytest.approx(rate, abs=0.03)
    pos, neg = conf[ok], conf[~ok]
    auroc = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert auroc == pytest.approx(0.8, abs=0.03)
    assert conf.mean() == pytest.approx(rate, abs=0.03)       # calibrated


def test_eval_statistics_feed_the_draws():
    """An eval row's confidence bins: each position's draws take the bins' confidences at the bins'
    acceptance; benchmarks apart, pooled for others."""
    count = [[0] * 20 for _ in range(2)]
    acc = [[0] * 20 for _ in range(2)]
    total = [[0.0] * 20 for _ in range(2)]
    count[0][18], acc[0][18], total[0][18] = 300, 270, 300 * 0.9     # position 1: confident, right
    count[0][2], acc[0][2], total[0][2] = 100, 10, 100 * 0.1
    count[1][10], acc[1][10], total[1][10] = 280, 140, 280 * 0.5
    row = {"drafter": "d", "benchmark": "gsm8k", "acceptance_conditional": [0.7, 0.5],
           "acceptance_unconditional": [0.7, 0.35], "drafts": 400,
           "confidence_bins": {"count": count, "accepted": acc, "confidence_sum": total}}
    other = dict(row, benchmark="mt-bench", confidence_bins=None, acceptance_conditional=[0.2, 0.1],
                 acceptance_unconditional=[0.2, 0.02])
    del other["confidence_bins"]
    model = AcceptanceModel.from_eval({"results": [row, other]})
    import random
    rng = random.Random(1)
    draws = [model.law("gsm8k").draw(2, rng) for _ in range(3000)]
    firsts = np.array([d[0][0] for d in draws])
    assert set(np.round(firsts, 3)) == {0.9, 0.1}
    assert np.mean([d[1] >= 1 for d in draws]) == pytest.approx(0.7, abs=0.03)
    assert np.mean([d[1] == 2 for d in draws]) == pytest.approx(0.35, abs=0.03)
    assert model.law("mt-bench").draw(2, rng)[0] is None         # no confidence head there
    assert model.pooled.confidences is False                     # not every benchmark has them
    assert model.law("humaneval") is model.pooled


def test_roofline_is_bandwidth_bound_at_one_request_and_compute_bound_at_many():
    acc = accelerator("h200")
    target = ModelShape.load("qwen3-32b")
    assert target.weight_bytes == pytest.approx(2 * 32.0e9, rel=0.03)      # Qwen3-32B without its input embedding
    roof = Roofline(acc, target, ModelShape.from_config({"hidden_size": 5120, "num_hidden_layers": 64,
                                                         "num_attention_heads": 64, "num_key_value_heads": 8,
                                                         "head_dim": 128, "intermediate_size": 25600,
                                                         "vocab_size": 151936}, layers=2, markov_rank=256))
    one = roof.forward_seconds(StepShape((1,), (1024,)))
    assert one == pytest.approx(acc.step_overhead + target.weight_bytes / (acc.memory_bandwidth * 0.8), rel=0.05)
    # one more verified token per request: nearly free at one request, a full share of the products at 512
    assert roof.forward_seconds(StepShape((2,), (1024,))) < 1.01 * one
    many = roof.forward_seconds(StepShape((8,) * 512, (1024,) * 512))
    assert many == pytest.approx(roof.forward_seconds(StepShape((4,) * 512, (1024,) * 512)) * 2, rel=0.15)
    t = roof.table     # what the policies price with: non-decreasing in requests and tokens
    g = np.array(t.seconds)
    assert (np.diff(g, axis=1) >= 0).all() and (np.diff(g, axis=2) >= 0).all()


def test_plain_decoding_is_priced_step_by_step():
    """A closed loop of plain decoding on the table: every request emits one token a step, so the
    clock is the sum of the table's step prices and the counts follow."""
    table = _table()
    costs = TableCosts(table)
    scen = Scenario(costs, AcceptanceModel.describe_spec("rate=0.5"), [Job(6, 5, "x")], block=3, decisions=False)
    res = scen.run("plain", concurrency=2, num_requests=2)
    a, b = table.prefill_fit()
    expected = (a + 12 * b) + 4 * table.target_seconds(2, 0, 8)       # a prefill step, then 4 decoding steps
    assert res["wall_seconds"] == pytest.approx(expected, rel=1e-9)
    assert res["tokens"] == 10 and res["engine_steps"] == 5 and res["accept_length"] == 1.0
    assert res["total_tokens_per_second"] == pytest.approx(10 / expected)


def test_simulate_command_worked_example_shape(tmp_path, capsys):
    """A described GPU, the paper's acceptance: under a strict per-user target the one-token
    drafter serves no load, the prefix scheduler still serves many; JSON and plot written."""
    png = tmp_path / "pareto.png"
    code = main(["simulate", "--hardware", "h200", "--model", "qwen3-32b", "--acceptance", "paper-qwen3-8b",
                 "--mtp1-acceptance", "rate=0.85", "--prompt-tokens", "1024", "--output-tokens", "64",
                 "--disaggregated-prefill", "--no-decisions", "--policies", "mtp1,auto",
                 "--concurrency", "1,8,32", "--num-prompts", "32", "--sla", "100", "--plot", str(png), "--json"])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out.strip().splitlines()[-1])
    sla = {s["policy"]: s for s in data["sla"]}
    assert sla["mtp1"]["max_concurrency"] == 0
    assert sla["auto"]["max_concurrency"] >= 8 and sla["auto"]["total_tokens_per_second"] > 800
    assert {r["policy"] for r in data["results"]} == {"mtp1", "auto"}
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("args, message", [
    (["--hardware", "h200"], "--hardware needs --model"),
    (["--hardware", "tpu9", "--model", "qwen3-32b"], "accelerator 'tpu9'"),
    (["--hardware", "h200", "--model", "qwen3-32b", "--acceptance", "tau=9,block=7"], "tau must be in"),
    (["--hardware", "h200", "--model", "qwen3-32b", "--acceptance", "rate=0.5,auroc=0.4"], "auroc must be"),
    (["--hardware", "h200", "--model", "qwen3-32b", "--policies", "plain,greedy"], "unknown policy 'greedy'"),
    (["--cost-table", "/nonexistent.json"], "cannot read cost table"),
])
def test_simulate_bad_input_is_a_clear_error(args, message, capsys):
    code = main(["simulate", "--prompt-tokens", "16", "--output-tokens", "8", "--concurrency", "1", *args])
    assert code in (1, 2)
    assert message in capsys.readouterr().err


def test_eval_records_confidence_bins():
    from dspark.evaluation.acceptance import ConfidenceBins, run_drafter
    from _tiny import as_target
    target = tiny_target(scale=3.0)
    drafter = DSparkDrafter(tiny_drafter_model(target, block=3, scale=2.0), target)
    bins = ConfidenceBins(3)
    per = run_drafter(as_target(target), drafter, [[1, 2, 3], [4, 1]], max_new_tokens=12, temperature=1.0, seed=0,
                      block=3, bins=bins)
    got = bins.to_json()
    count, acc = np.array(got["count"]), np.array(got["accepted"])
    drafts = sum(p["drafts"] for p in per)
    assert count[0].sum() == drafts                                  # every block reaches position 1
    assert acc[0].sum() == sum(p["per_position"][0] for p in per)
    assert count[1].sum() == acc[0].sum()                            # position 2 reached when 1 was accepted
    assert (acc <= count).all()
    total = np.array(got["confidence_sum"])
    mean = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
    lo = np.arange(20) / 20
    assert ((mean >= lo - 1e-9) & (mean <= lo + 0.05 + 1e-9) | (count == 0)).all()   # each bin's own confidences


def test_open_loop_queues_requests_when_they_arrive_faster_than_served():
    """Poisson arrivals: at a low rate requests rarely overlap (latency near a lone request's, about
    one request in flight); past the slots' capacity they queue (latency grows, the slots stay full)."""
    costs = TableCosts(_table())
    scen = Scenario(costs, AcceptanceModel.describe_spec("rate=0.6,auroc=0.8"), [Job(8, 20, "x")], block=3,
                    max_requests=4, decisions=False)
    lone = scen.run("fixed", concurrency=1, num_requests=8)
    slow = scen.run("fixed", rate=0.5, num_requests=40)
    fast = scen.run("fixed", rate=200.0, num_requests=40)
    assert slow["requests"] == fast["requests"] == 40
    assert slow["latency_seconds"]["p50"] == pytest.approx(lone["latency_seconds"]["p50"], rel=0.5)
    assert slow["concurrency"] < 1.5 < 3.5 < fast["concurrency"] <= 4
    assert fast["latency_seconds"]["p90"] > 3 * slow["latency_seconds"]["p90"]
