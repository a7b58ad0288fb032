"""The cost table: profiling real engine steps, interpolation, save / load, clear errors."""

from pathlib import Path

import tempfile

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dspark.drafters import NgramDrafter
from dspark.errors import DsparkError
from dspark.runtime.loading import Target
from dspark.runtime.model import Decoder
from dspark.evaluation import profile as prof
from dspark.scheduling import costs


def _target():
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)).eval()
    return Target("tiny", Path("tiny"), Decoder.from_hf(hf), None)


def test_profile_save_load_lookup(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    target = _target()
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 7, 8]]
    table = prof.profile(target, NgramDrafter(block_size=3), prompts, requests=(3, 1), verified=(3, 0, 2),
                        contexts=(32, 16), repeats=2)
    assert (table.requests, table.verified, table.contexts) == ([1, 3], [0, 2, 3], [16, 32])   # axes sorted
    assert len(table.seconds) == 2 and len(table.seconds[0]) == 2 and len(table.seconds[0][0]) == 3
    assert all(s > 0 for c in table.seconds for r in c for s in r)
    path = table.save()
    assert path == costs.table_path(table.key)
    again = costs.CostTable.find(table.key)
    assert again.seconds == table.seconds
    # the prices: the measurements fitted non-decreasing (see the test below), interpolated
    # between grid points and clamped outside
    priced = [[again.step_seconds(R, v, 16) for v in table.verified] for R in table.requests]
    assert all(a <= b + 1e-12 for row in priced for a, b in zip(row, row[1:]))
    s00, s02 = priced[0][0], priced[0][1]
    assert min(s00, s02) <= again.step_seconds(1, 1, 16) <= max(s00, s02)
    assert again.step_seconds(99, 0, 16) == pytest.approx(priced[1][0])
    # the drafter's share of each step was measured too (none in plain steps), and survives the round trip
    assert again.draft == table.draft
    assert table.context_row == 0.0 == again.context_row      # the n-gram drafter reads no features
    assert all(r[0] == 0 and all(0 < d < s for d, s in zip(r[1:], sr[1:]))
               for c, sc in zip(table.draft, table.seconds) for r, sr in zip(c, sc))
    import json
    old = table.to_json()
    del old["draft"]
    path.write_text(json.dumps(old))
    with pytest.raises(DsparkError, match="older dspark"):
        costs.CostTable.load(path)
    assert costs.CostTable.find(table.key) is None      # found, but as good as missing (a warning says why)
    bad = table.to_json()
    bad["verified"] = [0, 3, 2]
    path.write_text(json.dumps(bad))
    with pytest.raises(DsparkError, match="malformed"):
        costs.CostTable.load(path)
    path.write_text("{ not json")
    with pytest.raises(DsparkError, match="dspark profile"):
        costs.CostTable.find(table.key)
    assert costs.CostTable.find("no|such|table|key") is None


def test_profile_runs_drafters_that_read_target_features():
    # a trained drafter needs the engine to hand it the target's feature rows; the profiling wrapper
    # must pass its feature layers on (it once hid them and the drafter fell out of step)
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from _tiny import tiny_drafter_model, tiny_target
    from dspark.drafters.dspark import DSparkDrafter
    decoder = tiny_target(scale=3.0)
    target = Target("tiny", Path("tiny"), decoder, None)
    drafter = DSparkDrafter(tiny_drafter_model(decoder, "dspark", "vanilla"), decoder)
    table = prof.profile(target, drafter, [[1, 2, 3, 4]], requests=(1, 2), verified=(0, 1, 3), contexts=(8,),
                        repeats=1)
    assert all(s > 0 for c in table.seconds for r in c for s in r)
    # what taking in one context row costs the drafter: a first call after a prefill of 256 tokens
    # a request against its next calls (the median of 3: one pair of timed calls can come out equal
    # on a busy machine, and the estimate is clamped at 0)
    row = prof.context_row_seconds(target, drafter, [[1, 2, 3, 4]], requests=2, context=256, repeats=3)
    assert 0 < row < 0.01
    assert costs.CostTable.load(costs.CostTable(**{**table.to_json(), "context_row": row}).save(
        Path(tempfile.mkdtemp()) / "t.json")).context_row == row


def test_a_drafter_call_is_priced_whole():
    """A step in which some requests draft = the target's part of a step at that many verified
    tokens + the drafter's call for the requests that drafted, never a fraction of a call."""
    t = costs.CostTable("tiny", requests=[1, 8], verified=[0, 1, 3], contexts=[8],
                      seconds=[[[1.0, 1.3, 1.6], [2.0, 3.0, 3.5]]], draft=[[[0, 0.3, 0.35], [0, 0.8, 0.9]]])
    assert t.target_seconds(8, 1, 8) == pytest.approx(2.2)
    assert t.target_seconds(8, 0.5, 8) == pytest.approx(2.1)
    assert t.drafter_seconds(1, 3, 8) == pytest.approx(0.35)
    assert t.drafter_seconds(1, 0.5, 8) == pytest.approx(0.3)    # half a token still costs a call
    assert t.drafter_seconds(0, 2, 8) == 0 and t.drafter_seconds(3, 0, 8) == 0
    assert t.step_seconds(8, 1, 8) == pytest.approx(t.target_seconds(8, 1, 8) + t.drafter_seconds(8, 1, 8))


def test_interpolation_is_bilinear_and_clamped():
    """Between grid points the table interpolates linearly along each axis (numpy's interp row by
    row, then across rows, as the reference), and clamps outside the measured range."""
    np = pytest.importorskip("numpy")
    grid = [[[1.0, 1.5, 2.5, 4.0], [2.0, 2.2, 3.0, 5.5], [4.0, 5.0, 7.0, 9.0]]]
    t = costs.CostTable("tiny", requests=[1, 4, 16], verified=[0, 1, 3, 7], contexts=[64], seconds=grid,
                      draft=[[[0.0] * 4] * 3])
    rng = np.random.default_rng(0)
    for R, v in zip(rng.uniform(-2, 20, 300), rng.uniform(-1, 9, 300)):
        rows = [np.interp(v, t.verified, row) for row in grid[0]]
        assert t.step_seconds(R, v, 64) == pytest.approx(float(np.interp(R, t.requests, rows)))
    assert t.step_seconds(4, 3, 10_000) == 3.0 and t.step_seconds(100, 100, 1) == 9.0


def test_isotonic_fit_equals_scipy():
    np = pytest.importorskip("numpy")
    optimize = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(1)
    for n in (1, 2, 6, 30):
        for _ in range(20):
            y = np.cumsum(rng.normal(0.2, 1.0, n))
            np.testing.assert_allclose(costs.isotonic(y), optimize.isotonic_regression(y).x, atol=1e-12)


def test_prices_never_fall_with_more_rows_and_keep_the_measurements():
    """A noisy cell (a plain step of 2 requests measured dearer than their MTP-1 step, and than 4
    requests' plain step) is priced by the fit non-decreasing along requests and verified tokens;
    monotone measurements are priced as measured; the saved table keeps what was measured."""
    np = pytest.importorskip("numpy")
    step = [[[21.0, 26.6, 24.8], [28.7, 29.7, 32.2], [25.7, 36.4, 45.0]]]
    draft = [[[0.0, 2.9, 3.1], [0.0, 3.7, 4.3], [0.0, 5.0, 4.7]]]
    t = costs.CostTable("tiny", requests=[1, 2, 4], verified=[0, 1, 2], contexts=[8], seconds=step, draft=draft)
    target = np.array([[t.target_seconds(R, v, 8) for v in (0, 1, 2)] for R in (1, 2, 4)])
    calls = np.array([[t.drafter_seconds(R, v, 8) for v in (1, 2)] for R in (1, 2, 4)])
    for g in (target, calls):
        assert (np.diff(g, axis=0) >= -1e-12).all() and (np.diff(g, axis=1) >= -1e-12).all()
    assert t.target_seconds(2, 0, 8) < 28.7 and t.step_seconds(2, 1, 8) == pytest.approx(
        t.target_seconds(2, 1, 8) + t.drafter_seconds(2, 1, 8))
    assert t.to_json()["seconds"] == step and t.to_json()["draft"] == draft
    fine = [[[1.0, 1.3, 1.6], [2.0, 3.0, 3.5], [2.5, 3.1, 4.0]]]
    u = costs.CostTable("tiny", requests=[1, 2, 4], verified=[0, 1, 2], contexts=[8], seconds=fine)
    assert [[u.step_seconds(R, v, 8) for v in (0, 1, 2)] for R in (1, 2, 4)] == fine[0]


def test_nearest_context_column_and_one_steps_pricer():
    """The context column is the nearest measured context (the lower one on a tie), and the pricer
    of one step's drafting (Algorithm 1's) prices every extra exactly as CostModel.seconds, also
    after the online corrections moved pace and rho, and an array of extras alike."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(2)
    contexts = [64, 256, 1024]
    seconds = rng.uniform(0.01, 0.05, (3, 3, 4)).tolist()
    draft = rng.uniform(0.0, 0.005, (3, 3, 4)).tolist()
    t = costs.CostTable("tiny", requests=[1, 4, 16], verified=[0, 1, 3, 7], contexts=contexts,
                      seconds=seconds, draft=draft, context_row=1e-5)
    for c in [0, 64, 100, 160, 161, 640, 641, 5000]:
        want = min(range(3), key=lambda i: abs(contexts[i] - c))
        assert t.context_column(c) == want, c
    model = costs.CostModel(t)
    for step in range(60):          # plain and drafting steps, measured off the table
        extra = 0 if step % 3 == 0 else int(rng.integers(1, 20))
        drafting, rows = (0, 0) if extra == 0 else (4, 2)
        model.expect(4, extra, 300, drafting, 3.0, rows)
        base, more = model.parts(4, extra, 300, drafting, 3.0, rows)
        model.observe(1.3 * base + rng.uniform(0.5, 1.5) * more)
    assert model.extra_scale != 1.0 and model.pace != 1.0
    for R, ctx, drafting, depth, rows in [(1, 80, 1, 7.0, 0), (4, 300, 3, 2.5, 6), (16, 2000, 0, 0.0, 0)]:
        price = model.pricer(R, ctx, drafting, depth, rows)
        for extra in [0, 1, 2.5, 7, 30, 200]:
            assert price(extra) == model.seconds(R, extra, ctx, drafting, depth, rows)
        many = np.array([0, 1, 2.5, 7, 30, 200])         # an array of extras, priced in one call
        assert price(many) == pytest.approx([model.seconds(R, e, ctx, drafting, depth, rows) for e in many], rel=1e-12)


def test_the_pace_is_measured_against_the_table_in_use():
    """The auto policy replaces its table as it learns: the machine's pace (measured / priced plain
    steps) is read against the new table, not kept as a ratio to the old one, whose error would
    otherwise scale every price, and the drafting ratio learned through it, until eight plain steps
    pass."""
    first = costs.CostTable("tiny", requests=[1, 32], verified=[0, 1], contexts=[64],
                            seconds=[[[0.01, 0.02], [0.3, 0.6]]])      # 32 requests priced from prefills
    model = costs.CostModel(first)
    for _ in range(3):
        model.expect(32, 0, 64, 0, 0.0)
        model.observe(0.04)                  # plain steps of 32 requests run at 40 ms
    assert model.pace == pytest.approx(0.04 / 0.3)
    model.table = costs.CostTable("tiny", requests=[1, 32], verified=[0, 1], contexts=[64],
                                  seconds=[[[0.01, 0.02], [0.04, 0.08]]])   # rebuilt from those steps
    assert model.pace == pytest.approx(1.0)
    assert model.seconds(32, 0, 64) == pytest.approx(0.04)
    # a drafting step that runs as the new table says teaches rho nothing
    model.expect(32, 32, 64, None, 1.0)
    model.observe(0.08)
    assert model.extra_scale == pytest.approx(1.0)
