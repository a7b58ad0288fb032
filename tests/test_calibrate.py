"""Sequential Temperature Scaling and its metrics (training/calibrate.py)."""

import numpy as np
import pytest
import torch

from dspark.drafters.dspark import DSparkDrafter
from dspark.errors import UsageError
from dspark.training import calibrate as cal

from _tiny import as_target, tiny_drafter_model, tiny_target


def _synthetic(n=20000, g=5, over=3.0, seed=0):
    """Rollouts whose true conditional acceptance is sigmoid(u_k) while the head reports
    z_k = over * u_k (overconfident by a factor ``over``)."""
    rng = np.random.default_rng(seed)
    u = rng.normal(0.3, 1.2, size=(n, g))
    ok = rng.random((n, g)) < 1 / (1 + np.exp(-u))
    accepted = np.where(ok.all(1), g, (~ok).argmax(1))
    return cal.Rollouts(z=over * u, length=np.full(n, g), accepted=accepted,
                        domain=np.array(["math", "code"] * (n // 2)))


def test_metrics_against_hand_computed_values():
    pred = np.array([0.1, 0.1, 0.9, 0.9])
    y = np.array([0.0, 1.0, 1.0, 1.0])
    # bins: {0.1, 0.1} observed 0.5 -> |0.5 - 0.1| * 2; {0.9, 0.9} observed 1 -> 0.1 * 2
    assert cal.ece(pred, y, bins=20) == pytest.approx((0.4 * 2 + 0.1 * 2) / 4)
    assert cal.brier(pred, y) == pytest.approx((0.01 + 0.81 + 0.01 + 0.01) / 4)
    # positives score 0.1, 0.9, 0.9 against one negative at 0.1: pairs won 2, tied 1 -> 2.5 / 3
    assert cal.auroc(pred, y) == pytest.approx(2.5 / 3)
    assert np.isnan(cal.auroc(pred, np.ones(4)))
    assert cal.ece(np.array([1.0]), np.array([1.0])) == 0.0   # a prediction of exactly 1 has a bin


def test_sts_recovers_the_overconfidence_and_calibrates_every_position():
    fit, ev = _synthetic(seed=0), _synthetic(seed=1)
    temps = cal.fit_sts(fit)
    assert temps[0] == pytest.approx(3.0, rel=0.15)
    rep = cal.report(ev, temps)
    for r in rep:
        assert r["ece_after"] < r["ece_before"]
        if r["survival"] >= 0.05:
            assert r["ece_after"] < 0.02, r
        # temperature scaling is order-preserving at position 1, so AUROC does not move there
    assert rep[0]["auroc_after"] == pytest.approx(rep[0]["auroc_before"])
    assert [r["position"] for r in rep] == [1, 2, 3, 4, 5]


def _shifted(n=20000, g=4, shift=-1.0, seed=0):
    """Rollouts whose true conditional acceptance is sigmoid(u_k + shift) while the head reports
    z_k = u_k: overconfident by a constant, which no temperature removes."""
    rng = np.random.default_rng(seed)
    u = rng.normal(-0.5, 1.0, size=(n, g))
    ok = rng.random((n, g)) < 1 / (1 + np.exp(-(u + shift)))
    accepted = np.where(ok.all(1), g, (~ok).argmax(1))
    return cal.Rollouts(z=u, length=np.full(n, g), accepted=accepted, domain=np.array(["chat"] * n))


def test_shift_removes_a_constant_overconfidence_that_temperatures_cannot():
    fit, ev = _shifted(seed=0), _shifted(seed=1)
    sts = cal.report(ev, cal.fit_sts(fit))
    temps, shifts = cal.fit_sts_shift(fit)
    assert shifts[0] == pytest.approx(-1.0, abs=0.15) and temps[0] == pytest.approx(1.0, rel=0.2)
    rep = cal.report(ev, temps, shifts=shifts)
    assert sts[0]["ece_after"] > 0.03                       # temperature alone leaves it miscalibrated
    assert rep[0]["ece_after"] < 0.02 and rep[0]["shift"] == shifts[0]
    for r in rep:
        if r["survival"] >= 0.05:
            assert r["ece_after"] < 0.02, r
    assert "shift" in cal.markdown(rep)


def test_vectorised_ece_equals_ece():
    rng = np.random.default_rng(3)
    preds, y = rng.random((5, 300)), (rng.random(300) < 0.4).astype(float)
    assert cal._ece_many(preds, y, 20) == pytest.approx([cal.ece(p, y, 20) for p in preds])


def test_rollouts_round_trip_and_bad_files(tmp_path):
    splits = {"fit": _shifted(n=10, seed=0), "eval": _shifted(n=12, seed=1)}
    path = tmp_path / "ro.npz"
    cal.save_rollouts(path, splits, {"drafter": "x", "block_size": 4})
    back, meta = cal.load_rollouts(path)
    assert meta == {"drafter": "x", "block_size": 4}
    for name in splits:
        for f in ("z", "length", "accepted", "domain"):
            assert np.array_equal(getattr(back[name], f), getattr(splits[name], f))
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not an npz")
    with pytest.raises(UsageError, match="not a rollouts file"):
        cal.load_rollouts(bad)


def test_calibrated_head_keeps_temperature_one():
    fit = _synthetic(over=1.0, seed=2)
    temps = cal.fit_sts(fit)
    assert temps[0] == pytest.approx(1.0, rel=0.15)


def test_survivals_are_cumulative_products_and_stop_at_the_drafted_length():
    ro = cal.Rollouts(z=np.array([[0.0, 0.0, np.nan]]), length=np.array([2]), accepted=np.array([1]),
                      domain=np.array(["x"]))
    a = cal.survivals(ro, [1.0, 1.0, 1.0])
    assert a[0, 0] == pytest.approx(0.5) and a[0, 1] == pytest.approx(0.25) and np.isnan(a[0, 2])
    rows, y = ro.events(1)
    assert rows.tolist() == [True] and y.tolist() == [0.0]
    assert ro.events(2)[0].tolist() == [False]


def test_threshold_sweep_counts_verified_accepted_and_rejected_tokens():
    ro = cal.Rollouts(z=np.array([[2.0, -2.0, 2.0], [2.0, 2.0, 2.0]]), length=np.array([3, 3]),
                      accepted=np.array([3, 1]), domain=np.array(["a", "b"]))
    sw = cal.threshold_sweep(ro, [1.0, 1.0, 1.0], thresholds=[0.0, 0.5, 0.99])
    t0, t5, t99 = sw["all"]
    assert t0["accepted_per_step"] == pytest.approx(2.0) and t0["rejected_per_step"] == pytest.approx(1.0)
    # at 0.5 request a stops before its low-confidence 2nd token: verifies 1 (accepted); b verifies 3, accepts 1
    assert t5["accepted_per_step"] == pytest.approx(1.0) and t5["rejected_per_step"] == pytest.approx(1.0)
    assert t99["accepted_per_step"] == 0.0 and np.isnan(t99["acceptance_rate"])
    assert sw["a"][1]["acceptance_rate"] == 1.0 and sw["b"][1]["acceptance_rate"] == pytest.approx(1 / 3)


def test_collect_pairs_each_block_with_its_accepted_count_and_restores_temperatures():
    target = tiny_target(scale=3.0)
    drafter = DSparkDrafter(tiny_drafter_model(target, "dspark", "vanilla", scale=2.0), target)
    drafter.temps = torch.full_like(drafter.temps, 2.0)
    prompts = [[1, 2, 3], [2, 2], [4, 1, 1, 0]]
    ro = cal.collect(as_target(target), drafter, prompts, ["a", "b", "c"], blocks=30, max_new_tokens=40,
                     concurrency=2)
    assert len(ro) >= 30
    assert torch.all(drafter.temps == 2.0)
    assert (ro.accepted <= ro.length).all() and (ro.length >= 1).all() and ro.accepted.sum() > 0
    assert np.isfinite(ro.z[:, 0]).all()
    assert set(ro.domain.tolist()) <= {"a", "b", "c"}
    # raw logits: the head's own sigmoid(z) is what the drafter reports at temperature 1
    assert ((ro.z > -17) & (ro.z < 17))[np.isfinite(ro.z)].all()
    # acceptance recorded per block matches the engine's counters in total
    assert 0 < ro.accepted.mean() < ro.length.mean()


def test_collect_refuses_a_drafter_without_confidence_head():
    target = tiny_target(scale=3.0)
    drafter = DSparkDrafter(tiny_drafter_model(target, "dflash", "none"), target)
    with pytest.raises(UsageError, match="no confidence head"):
        cal.collect(as_target(target), drafter, [[1, 2]], ["a"], blocks=5)


def test_ece_floor_is_the_ece_of_perfect_calibration_and_shrinks_with_the_sample():
    rng = np.random.default_rng(4)
    pred = rng.uniform(0.1, 0.6, 4000)
    floor = cal.ece_floor(pred)
    # against outcomes truly drawn from pred, the measured ECE scatters around the floor
    seen = [cal.ece(pred, (rng.random(len(pred)) < pred).astype(float)) for _ in range(100)]
    assert floor == pytest.approx(np.mean(seen), rel=0.1)
    # a quarter of the events: about twice the floor (sampling noise ~ 1 / sqrt(n))
    assert 1.6 < cal.ece_floor(pred[:1000]) / floor < 2.4
    # confidences of 0 or 1 leave no room for noise
    assert cal.ece_floor(np.array([0.0, 1.0, 1.0])) == 0.0
