"""The benchmark commands run end to end on tiny settings and report what they promise."""

import json

from dspark.cli import main
from dspark.data import benchmark_names, load_prompts


def test_shipped_benchmarks():
    assert set(benchmark_names()) >= {"gsm8k", "humaneval", "mt-bench", "math500", "aime25", "mbpp",
                                      "livecodebench"}
    assert len(load_prompts("humaneval", 8)) == 8


def test_dataset_errors(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nope": 1}\n')
    assert main(["bench", "speed", "--datasets", str(bad), "--systems", "plain"]) == 2
    assert "turns" in capsys.readouterr().err
    assert main(["bench", "speed", "--datasets", "no-such-set", "--systems", "plain"]) == 2


def test_speed_bench_json(capsys):
    code = main(["bench", "speed", "--systems", "plain,ngram", "--datasets", "humaneval",
                 "--num-prompts", "1", "--max-new-tokens", "8", "--json"])
    assert code == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["system"]: r for r in res["results"]}
    assert set(rows) == {"plain", "ngram"}
    assert rows["plain"]["tokens"] > 0 and rows["ngram"]["speedup_vs_own_plain"] > 0
    assert main(["bench", "speed", "--systems", "warp-drive"]) == 2


def test_speed_bench_trained_drafter_with_policy(capsys, monkeypatch):
    """A trained drafter runs under a named verification policy, compared with our plain decoding."""
    code = main(["bench", "speed", "--systems", "plain,dspark@ema", "--datasets", "gsm8k",
                 "--num-prompts", "1", "--max-new-tokens", "8", "--json"])
    assert code == 0
    rows = {r["system"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]}
    assert rows["dspark@ema"]["greedy_identity_rate"] == 1.0
    assert rows["dspark@ema"]["speedup_vs_own_plain"] > 0
    for bad in ("dspark@warp", "hf-plain@prefix", "dspark@"):
        assert main(["bench", "speed", "--systems", bad]) == 2
    from dspark.scheduling.costs import CostTable
    monkeypatch.setattr(CostTable, "find", classmethod(lambda cls, key: None))
    assert main(["bench", "speed", "--systems", "dspark@prefix", "--num-prompts", "1"]) == 2
    assert "dspark profile" in capsys.readouterr().err


def test_concurrency_bench_json(capsys, tmp_path):
    png = tmp_path / "pareto.png"
    code = main(["bench", "concurrency", "--concurrency", "1,3", "--policies", "plain,mtp1,fixed,auto,auto-fresh",
                 "--fresh-costs", "--num-prompts", "3", "--max-new-tokens", "6", "--plot", str(png), "--json"])
    assert code == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]
    autos = ("auto", "auto-fresh")
    assert {(r["policy"], r["concurrency"]) for r in res} == {(p, c) for p in ("plain", "mtp1", "fixed") + autos
                                                             for c in (1, 3)}
    # auto starts from nothing: its first steps measure the step costs, counted in its own time; so
    # does auto-fresh beside it, on costs of its own
    for name in autos:
        auto = [r for r in res if r["policy"] == name]
        assert auto[0]["setup_steps"] > 0 and 0 < auto[0]["setup_seconds"] < auto[0]["wall_seconds"]
    assert all(r["setup_steps"] == 0 for r in res if r["policy"] not in autos)
    assert all(r["total_tokens_per_second"] > 0 and r["per_user_tokens_per_second"] > 0 for r in res)
    # the policy's decision time is measured per step, as a share of the step's wall time
    assert all(r["decision_ms_per_step"] >= 0 and 0 <= r["decision_share"] < 1 for r in res)
    assert png.stat().st_size > 1000
    assert main(["bench", "concurrency", "--policies", "bogus"]) == 2
    assert main(["bench", "concurrency", "--concurrency", "0"]) == 2


def test_concurrency_repeats_report_totals(capsys):
    from dspark.evaluation.concurrency import combine_runs
    a = {"policy": "p", "concurrency": 2, "requests": 2, "tokens": 20, "wall_seconds": 2.0, "rounds": 9,
         "step_seconds": 1.8, "decision_seconds": 0.018, "engine_steps": 9, "num_draft_tokens": 0,
         "num_accepted_tokens": 0, "per_user_tokens_per_second": 6.0}
    b = dict(a, tokens=10, wall_seconds=3.0, rounds=4, requests=1, step_seconds=2.7, engine_steps=4,
             decision_seconds=0.0, per_user_tokens_per_second=3.0)
    c = combine_runs([a, b])
    assert c["total_tokens_per_second"] == 30 / 5.0 and c["repeats"] == 2
    assert c["per_user_tokens_per_second"] == (6.0 * 2 + 3.0) / 3
    assert c["accept_length"] == (30 - 3) / 13 and abs(c["decision_share"] - 0.018 / 4.5) < 1e-12
    assert main(["bench", "concurrency", "--concurrency", "2", "--policies", "plain,mtp1", "--repeats", "2",
                 "--num-prompts", "2", "--max-new-tokens", "4", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]
    assert [(r["policy"], r["repeats"], r["requests"]) for r in res] == [("plain", 2, 4), ("mtp1", 2, 4)]
    assert main(["bench", "concurrency", "--repeats", "0"]) == 2


def test_concurrency_runs_start_from_a_reset_drafter(target_fp32, bench_prompts, monkeypatch):
    """The n-gram drafter remembers the requests it served; a bench run that sends the same
    prompts again must not draft them from their answers in an earlier run."""
    from dspark.drafters.ngram import NgramDrafter
    from dspark.evaluation.concurrency import run_closed_loop
    from dspark.sampling import SamplingParams
    from dspark.scheduling.policies import make_policy
    drafter = NgramDrafter(block_size=7)
    prompts, params = bench_prompts[:3], SamplingParams(temperature=0)
    keys = ("tokens", "rounds", "num_draft_tokens", "num_accepted_tokens")

    def run():
        res = run_closed_loop(target_fp32, drafter, make_policy("fixed", 7), prompts, 2, 24, params, 7)
        return [res[k] for k in keys]

    first, second = run(), run()
    assert len(drafter.history) > 0 and first == second
    monkeypatch.setattr(drafter, "reset", lambda: None)   # what the bench did before: the history carries over
    carried = run()
    assert carried[3] > first[3]


def test_interleaved_policies_match_their_runs_alone_and_time_only_their_own_steps(target_fp32, bench_prompts):
    """Policies advanced in turn (one engine step each) decode exactly what they decode alone,
    each with its own drafter, and each loop's clock leaves out the time spent in the others."""
    import time
    from dspark.drafters.ngram import NgramDrafter
    from dspark.evaluation.concurrency import closed_loop, interleave, run_closed_loop
    from dspark.sampling import SamplingParams
    from dspark.scheduling.policies import make_policy
    prompts, params = bench_prompts[:3], SamplingParams(temperature=0)
    keys = ("tokens", "requests", "rounds", "engine_steps", "num_draft_tokens", "num_accepted_tokens")

    def loop(name):
        return closed_loop(target_fp32, NgramDrafter(block_size=7), make_policy(name, 7), prompts, 2, 16, params, 7)

    alone = {n: run_closed_loop(target_fp32, NgramDrafter(block_size=7), make_policy(n, 7), prompts, 2, 16,
                                params, 7) for n in ("fixed", "plain")}
    pause, steps = 0.05, []

    def elsewhere():                      # another loop's work: time that is not the policies'
        for _ in range(40):
            time.sleep(pause)
            steps.append(1)
            yield
        return "other"

    t0 = time.perf_counter()
    fixed, plain, other = interleave([loop("fixed"), loop("plain"), elsewhere()])
    elapsed = time.perf_counter() - t0
    assert other == "other" and fixed["policy"] == "fixed" and plain["policy"] == "plain"
    for name, res in (("fixed", fixed), ("plain", plain)):
        assert [res[k] for k in keys] == [alone[name][k] for k in keys]
        assert res["per_user_tokens_per_second"] > 0
    assert fixed["engine_steps"] < plain["engine_steps"]      # drafting took fewer steps
    assert fixed["wall_seconds"] + plain["wall_seconds"] <= elapsed - pause * len(steps) + 0.05


def test_steps_bench_reads_every_step_from_the_hook(capsys):
    """`dspark bench steps`: one row per engine step, numbered as the engine numbered them; plain
    decoding drafts nothing, the fixed block verifies drafts and accepts no more than it verified;
    the steady steps' means come from the same rows."""
    code = main(["bench", "steps", "--drafter", "ngram", "--concurrency", "2", "--policies", "plain,fixed",
                 "--num-prompts", "4", "--max-new-tokens", "12", "--json"])
    assert code == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["policies"]
    for name in ("plain", "fixed"):
        steps = res[name]["steps"]
        assert [s["index"] for s in steps] == list(range(1, len(steps) + 1))
        assert sum(s["prefill"] for s in steps) > 0 and res[name]["total_tokens_per_second"] > 0
        assert all(0 <= s["forward"] <= s["seconds"] for s in steps)
        phases = res[name]["phases"]
        assert sum(p["steps"] for p in phases.values()) == len(steps)
    assert all(s["verified"] == 0 and s["drafting"] == 0 for s in res["plain"]["steps"])
    fixed = res["fixed"]["steps"]
    assert sum(s["verified"] for s in fixed) > 0
    assert all(s["accepted"] <= s["verified"] for s in fixed)
    assert main(["bench", "steps", "--policies", "bogus"]) == 2


def test_padded_layout_gives_the_same_outputs():
    """The bench's padded (dense) layout computes dummy rows and rolls them back: same outputs,
    more rows."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dspark.drafters.ngram import NgramDrafter
    from dspark.engine import Engine
    from dspark.evaluation.concurrency import PaddedEngine
    from dspark.runtime.model import Decoder
    from dspark.sampling import SamplingParams
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=11, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(4.0)
    target = Decoder.from_hf(m)
    outs, rows = [], []
    for cls in (Engine, PaddedEngine):
        engine = cls(target, NgramDrafter(block_size=4), max_requests=4, max_len=64)
        seen: list[int] = []
        engine.add_step_listener(lambda rec, seen=seen: seen.append(rec.forward_rows))
        reqs = [engine.add_request([1 + i, 2, 3, 1 + i, 2], SamplingParams(temperature=0), 20) for i in range(4)]
        engine.run()
        outs.append([r.output_ids for r in reqs])
        rows.append(sum(seen))
    assert outs[0] == outs[1]
    assert rows[1] > rows[0]


def test_step_log_writes_every_step_as_a_json_line(tmp_path):
    """`dspark serve --step-log FILE`: one JSON line per engine step, in order, with what it drafted,
    verified and accepted and what it cost; nothing more once stopped."""
    from dspark.drafters.ngram import NgramDrafter
    from dspark.engine import Engine
    from dspark.evaluation.steps import log_steps
    from dspark.sampling import SamplingParams
    from tests._tiny import tiny_target
    engine = Engine(tiny_target(vocab=11), NgramDrafter(block_size=4), max_requests=4, max_len=64)
    path = tmp_path / "steps.jsonl"
    stop = log_steps(engine, path)
    for i in range(3):
        engine.add_request([1 + i, 2, 3, 1 + i, 2, 3], SamplingParams(temperature=0), 16)
    engine.run()
    stop()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["index"] for x in lines] == list(range(1, len(lines) + 1)) and len(lines) > 3
    assert sum(x["prefill_tokens"] for x in lines) == 18
    assert all(0 <= x["forward_seconds"] <= x["seconds"] and x["time"] > 0 for x in lines)
    outs = [o for x in lines for o in x["requests"]]
    assert sum(o["verified"] for o in outs) > 0 and all(o["accepted"] <= o["verified"] for o in outs)
    engine.add_request([5, 6, 7], SamplingParams(temperature=0), 4)
    engine.run()
    assert len(path.read_text().splitlines()) == len(lines)
