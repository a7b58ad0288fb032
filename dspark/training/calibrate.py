"""``dspark calibrate``: Sequential Temperature Scaling of the confidence head (SPEC section 3).

1. Rollouts: the target generates at temperature 1 on held-out prompts while the drafter proposes
   full blocks (fixed policy); every verified block records the raw confidence logit z_k of each
   position and how many draft tokens survived. Two prompt-disjoint splits: fit and evaluation.
2. STS: for k = 1..gamma in order, one temperature T_k (grid search) minimises the ECE (20
   equal-width bins) of the prefix survival a_k = prod_{i<=k} sigmoid(z_i / T_i) against the event
   "tokens 1..k all accepted", T_1..T_{k-1} kept fixed. Optionally (``--shift``, not the paper's
   method) each position also gets a logit shift b_k, c_k = sigmoid(z_k / T_k + b_k), the pair
   fitted left to right by the log-likelihood of the same events: a head that is over- or
   under-confident by a constant (e.g. trained on text sampled at another temperature than the one
   it serves) is miscalibrated in a way no temperature fixes.
3. Report ECE, AUROC and Brier per position before (T = 1) and after, on the evaluation split; a
   reliability diagram; the threshold sweep (accepted / rejected tokens per step and acceptance
   rate against a threshold on the calibrated c_k, per domain).

The temperatures (and shifts) go into the drafter's config.json (``sts_temperatures``,
``sts_shifts``); the serving drafter applies them to each confidence logit. Calibrated on greedy
rollouts (``--regime greedy``) they go to ``sts_greedy_temperatures`` / ``sts_greedy_shifts``,
which the drafter applies to greedy requests: acceptance, and so the confidence a head should
report, differs between the regimes. Rollouts can be saved
and reused (``--rollouts``) to compare fits without generating again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..engine import Engine, Request
from ..errors import UsageError
from ..sampling import SamplingParams
from ..scheduling.policies import FixedPolicy

TEMPERATURE_GRID = np.unique(np.concatenate([np.geomspace(0.05, 20.0, 241), [1.0]]))
SHIFT_GRID = np.linspace(-3.0, 3.0, 121)


@dataclass
class Rollouts:
    """One row per verified block: raw confidence logits z [N, g] (nan beyond the drafted
    length), draft length [N], accepted count [N], domain [N]."""

    z: np.ndarray
    length: np.ndarray
    accepted: np.ndarray
    domain: np.ndarray

    def __len__(self) -> int:
        return len(self.length)

    def events(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows drafted at least k + 1 tokens, whether tokens 1..k+1 all survived) for 0-based k."""
        rows = self.length > k
        return rows, (self.accepted[rows] > k).astype(np.float64)


class _Recorder(FixedPolicy):
    """Fixed block; remembers each request's verified proposal so the caller can pair it with the
    number of tokens the target accepted in the same step."""

    name = "fixed"

    def __init__(self, block: int):
        super().__init__(block)
        self.pending: list[tuple[int, torch.Tensor, int]] = []    # (request id, confidences, accepted)
        self._confs: dict[int, torch.Tensor] = {}

    def verify_lengths(self, requests, proposals):
        self._confs = {r.id: p.confidences.double().clone() for r, p in zip(requests, proposals)
                       if len(p) and p.confidences is not None}
        return super().verify_lengths(requests, proposals)

    def observe(self, outcome) -> None:
        for o in outcome.requests:
            conf = self._confs.pop(o.request_id, None)
            if conf is not None and o.speculated:
                self.pending.append((o.request_id, conf, o.accepted))
        super().observe(outcome)


def collect(target, drafter, prompts: list[list[int]], domains: list[str], *, blocks: int, max_new_tokens: int = 256, concurrency: int = 16,
            seed: int = 0, progress=None, temperature: float = 1.0) -> Rollouts:
    """Roll out token-id prompts (closed loop at ``concurrency``, at ``temperature``: 0 for the
    greedy regime; seed + prompt index) until ``blocks`` blocks were verified; prompts longer than
    1,024 tokens are skipped."""
    if getattr(drafter, "model", None) is None or getattr(drafter.model, "confidence", None) is None:
        raise UsageError(f"drafter {drafter.name!r} has no confidence head to calibrate")
    g = drafter.block_size
    saved = drafter.temps, drafter.shifts, drafter.greedy_temps, drafter.greedy_shifts
    drafter.temps, drafter.shifts = torch.ones_like(saved[0]), torch.zeros_like(saved[1])   # raw: z = logit(c)
    drafter.greedy_temps, drafter.greedy_shifts = drafter.temps, drafter.shifts
    keep = [i for i, p in enumerate(prompts) if 0 < len(p) <= 1024]
    if not keep:
        raise UsageError("no usable prompt (all empty or longer than 1,024 tokens)")
    policy = _Recorder(g)
    max_len = max(len(prompts[i]) for i in keep) + max_new_tokens + g + 2
    engine = Engine(target.model, drafter, policy, max_requests=concurrency, max_len=max_len, block_size=g,
                    eos_ids=target.eos_token_ids)
    length: list[int]
    live: list[tuple[Request, int]]
    z, length, accepted, domain = [], [], [], []
    queue, live = list(keep), []
    try:
        while (queue or live) and len(length) < blocks:
            while queue and len(live) < concurrency:
                i = queue.pop(0)
                req = engine.add_request(prompts[i], SamplingParams(temperature=temperature, seed=seed + i), max_new_tokens,
                                         exact_seed=False)
                live.append((req, i))
            policy.pending.clear()
            engine.step()
            owner = {r.id: i for r, i in live}
            for rid, conf, acc in policy.pending:
                n = len(conf)
                c = conf.clamp(1e-7, 1 - 1e-7)
                row = np.full(g, np.nan)
                row[:n] = torch.log(c / (1 - c)).numpy()
                z.append(row)
                length.append(n)
                accepted.append(acc)
                i = owner[rid]
                domain.append(domains[i])
            if progress is not None:
                progress(min(len(length), blocks))
            live = [(r, i) for r, i in live if not r.done]
    finally:
        for r, _ in live:
            engine.cancel(r)
        drafter.temps, drafter.shifts, drafter.greedy_temps, drafter.greedy_shifts = saved
    if not length:
        raise UsageError("the rollouts verified no block (prompts too long or max-new-tokens too small)")
    return Rollouts(np.array(z), np.array(length), np.array(accepted), np.array(domain))


def save_rollouts(path, splits: dict[str, Rollouts], meta: dict) -> None:
    """Both splits and what recorded them in one .npz (written atomically, read without pickle)."""
    import json
    import os
    arrays = {f"{name}.{f}": getattr(ro, f) for name, ro in splits.items()
              for f in ("z", "length", "accepted", "domain")}
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as fh:
        np.savez(fh, meta=np.array(json.dumps(meta)), **arrays)
    os.replace(tmp, path)


def load_rollouts(path) -> tuple[dict[str, Rollouts], dict]:
    import json
    try:
        with np.load(path, allow_pickle=False) as d:
            meta = json.loads(str(d["meta"]))
            splits = {name: Rollouts(*(d[f"{name}.{f}"] for f in ("z", "length", "accepted", "domain")))
                      for name in ("fit", "eval")}
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--rollouts {path}: not a rollouts file written by dspark calibrate ({e})") from None
    return splits, meta


# ------------------------------------------------------------------------------ metrics
def ece(pred: np.ndarray, y: np.ndarray, bins: int = 20) -> float:
    """Expected calibration error with equal-width bins on [0, 1]."""
    if len(pred) == 0:
        return float("nan")
    idx = np.minimum((pred * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            total += m.sum() * abs(y[m].mean() - pred[m].mean())
    return total / len(pred)


def auroc(pred: np.ndarray, y: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted half); nan with one class only."""
    from scipy.stats import rankdata
    pos = y > 0.5
    n1, n0 = int(pos.sum()), int((~pos).sum())
    if n1 == 0 or n0 == 0:
        return float("nan")
    ranks = rankdata(pred)
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def ece_floor(pred: np.ndarray, bins: int = 20, draws: int = 200, seed: int = 0) -> float:
    """The ECE a perfectly calibrated predictor shows on this many events: the mean ECE of
    ``pred`` against outcomes drawn from ``pred`` itself (seeded). Finite samples put a floor
    under any measured ECE (about 1.7 % for 5,000 events near 0.3 with 20 bins): a measured ECE
    near its floor is within noise of perfect calibration."""
    if len(pred) == 0:
        return float("nan")
    rng = np.random.default_rng(seed)
    draws_y = (rng.random((draws, len(pred))) < pred[None]).astype(np.float64)
    idx = np.minimum((pred * bins).astype(int), bins - 1)
    count = np.bincount(idx, minlength=bins)
    want = np.bincount(idx, weights=pred, minlength=bins)
    got = np.stack([np.bincount(idx, weights=y, minlength=bins) for y in draws_y])
    return float((np.abs(got - want[None]).sum(1) / count.sum()).mean())


def brier(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((pred - y) ** 2)) if len(pred) else float("nan")


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def calibrated(z: np.ndarray, temps, shifts=None) -> np.ndarray:
    """c = sigmoid(z / T + b) per position (b = 0 without shifts)."""
    b = 0.0 if shifts is None else np.asarray(shifts, dtype=np.float64)[None, :]
    return _sigmoid(z / np.asarray(temps, dtype=np.float64)[None, :] + b)


def survivals(ro: Rollouts, temps, shifts=None) -> np.ndarray:
    """Prefix survivals a [N, g] (nan beyond each block's length) under per-position temperatures
    (and shifts)."""
    c = calibrated(ro.z, temps, shifts)
    return np.cumprod(np.nan_to_num(c, nan=0.0), axis=1) + np.where(np.isnan(ro.z), np.nan, 0.0)


def _ece_many(preds: np.ndarray, y: np.ndarray, bins: int) -> np.ndarray:
    """``ece`` of each row of preds [M, n] against y [n], in one pass."""
    M, n = preds.shape
    idx = np.minimum((preds * bins).astype(int), bins - 1) + bins * np.arange(M)[:, None]
    diff = np.bincount(idx.ravel(), weights=np.broadcast_to(y, preds.shape).ravel(), minlength=M * bins)
    diff -= np.bincount(idx.ravel(), weights=preds.ravel(), minlength=M * bins)
    return np.abs(diff).reshape(M, bins).sum(1) / n


def _nll_many(preds: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Mean negative log-likelihood of y under each row of preds [M, n]."""
    p = np.clip(preds, 1e-9, 1 - 1e-9)
    return -(y * np.log(p) + (1 - y) * np.log1p(-p)).mean(1)


def _fit_sequential(ro: Rollouts, bins: int, grid, shift_grid, score: str = "ece") -> tuple[list[float], list[float]]:
    """Positions left to right: (T_k, b_k) on the grids minimising the score (ECE, or the negative
    log-likelihood) of a_k against the survival events, earlier positions kept fixed."""
    temps: list[float] = []
    shifts: list[float] = []
    prev = np.ones(len(ro))
    for k in range(ro.z.shape[1]):
        rows, y = ro.events(k)
        best = (np.inf, 1.0, 0.0)
        if rows.any():
            zk, pk = ro.z[rows, k], prev[rows]
            for t in grid:
                a = pk[None] * _sigmoid(zk[None] / t + shift_grid[:, None])
                scores = _ece_many(a, y, bins) if score == "ece" else _nll_many(a, y)
                i = int(np.argmin(scores))
                if scores[i] < best[0]:
                    best = (float(scores[i]), float(t), float(shift_grid[i]))
        temps.append(best[1])
        shifts.append(best[2])
        prev = prev * _sigmoid(np.nan_to_num(ro.z[:, k]) / best[1] + best[2])
    return temps, shifts


def fit_sts(ro: Rollouts, bins: int = 20, grid=TEMPERATURE_GRID) -> list[float]:
    """Sequential Temperature Scaling: T_k minimising the ECE of a_k, positions left to right."""
    return _fit_sequential(ro, bins, grid, np.zeros(1))[0]


def fit_sts_shift(ro: Rollouts, bins: int = 20, grid=TEMPERATURE_GRID[::4],
                  shift_grid=SHIFT_GRID) -> tuple[list[float], list[float]]:
    """A temperature and a logit shift per position, left to right, fitted by the negative
    log-likelihood of a_k (Platt scaling made sequential). Not by the ECE: with two parameters the
    ECE is minimised by flattening every confidence towards the base rate (T -> the grid's top),
    which is calibrated and useless to a scheduler."""
    return _fit_sequential(ro, bins, grid, shift_grid, score="nll")


def report(ro: Rollouts, temps, bins: int = 20, shifts=None) -> list[dict]:
    """Per position: mean survival, ECE / AUROC / Brier of a_k before (T = 1) and after STS."""
    before, after = survivals(ro, [1.0] * ro.z.shape[1]), survivals(ro, temps, shifts)
    out = []
    for k in range(ro.z.shape[1]):
        rows, y = ro.events(k)
        b, a = before[rows, k], after[rows, k]
        out.append({"position": k + 1, "blocks": int(rows.sum()), "survival": float(y.mean()) if len(y) else 0.0,
                    "temperature": float(temps[k]), "shift": float(shifts[k]) if shifts is not None else 0.0,
                    "ece_before": ece(b, y, bins), "ece_after": ece(a, y, bins), "ece_floor": ece_floor(a, bins),
                    "auroc_before": auroc(b, y), "auroc_after": auroc(a, y),
                    "brier_before": brier(b, y), "brier_after": brier(a, y)})
    return out


def threshold_sweep(ro: Rollouts, temps, thresholds=None, shifts=None) -> dict:
    """Per domain and threshold t: verify up to the first calibrated c_k < t; accepted and rejected
    (verified but wasted) tokens per step and the acceptance rate of verified tokens."""
    thresholds = np.linspace(0.0, 0.95, 20) if thresholds is None else np.asarray(thresholds)
    c = calibrated(ro.z, temps, shifts)
    c = np.where(np.isnan(ro.z), -1.0, c)
    out = {}
    for dom in ["all"] + sorted(set(ro.domain.tolist())):
        m = np.ones(len(ro), bool) if dom == "all" else ro.domain == dom
        rows = []
        for t in thresholds:
            below = c[m] < t
            verified = np.where(below.any(1), below.argmax(1), c.shape[1])
            acc = np.minimum(ro.accepted[m], verified)
            rows.append({"threshold": float(t), "accepted_per_step": float(acc.mean()),
                         "rejected_per_step": float((verified - acc).mean()),
                         "acceptance_rate": float(acc.sum() / verified.sum()) if verified.sum() else float("nan")})
        out[dom] = rows
    return out


# ------------------------------------------------------------------------------ figures
def plot_reliability(ro: Rollouts, temps, path, bins: int = 20, shifts=None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    g = ro.z.shape[1]
    shown = sorted({0, g // 3, (2 * g) // 3, g - 1})
    fig, axes = plt.subplots(1, len(shown), figsize=(3.2 * len(shown), 3.4), squeeze=False)
    for ax, k in zip(axes[0], shown):
        rows, y = ro.events(k)
        after = "after STS" + (" + shift" if shifts is not None else "")
        for label, t, b, style in (("before", [1.0] * g, None, "o--"), (after, temps, shifts, "s-")):
            a = survivals(ro, t, b)[rows, k]
            idx = np.minimum((a * bins).astype(int), bins - 1)
            xs = [a[idx == b].mean() for b in range(bins) if (idx == b).sum() >= 5]
            ys = [y[idx == b].mean() for b in range(bins) if (idx == b).sum() >= 5]
            ax.plot(xs, ys, style, ms=3, label=f"{label} (ECE {100 * ece(a, y, bins):.1f}%)")
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8)
        ax.set_title(f"position {k + 1}")
        ax.set_xlabel("predicted prefix survival")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("observed survival")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(sweep: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    keys = (("accepted_per_step", "accepted tokens / step"), ("rejected_per_step", "rejected tokens / step"),
            ("acceptance_rate", "acceptance rate"))
    for dom, rows in sweep.items():
        xs = [r["threshold"] for r in rows]
        for ax, (key, label) in zip(axes, keys):
            ax.plot(xs, [r[key] for r in rows], marker=".", label=dom, lw=2 if dom == "all" else 1)
            ax.set_ylabel(label)
            ax.set_xlabel("confidence threshold")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(rep: list[dict]) -> str:
    def pct(x):
        return "-" if x != x else f"{100 * x:.1f}%"

    def f3(x):
        return "-" if x != x else f"{x:.3f}"
    lines = ["| position | blocks | survival | T | shift | ECE before | ECE after | ECE floor | AUROC before | "
             "AUROC after | Brier before | Brier after |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep:
        lines.append(f"| {r['position']} | {r['blocks']} | {r['survival']:.3f} | {r['temperature']:.2f} | "
                     f"{r.get('shift', 0.0):+.2f} | "
                     f"{pct(r['ece_before'])} | {pct(r['ece_after'])} | {pct(r.get('ece_floor', float('nan')))} | "
                     f"{f3(r['auroc_before'])} | "
                     f"{f3(r['auroc_after'])} | {f3(r['brier_before'])} | {f3(r['brier_after'])} |")
    return "\n".join(lines)


def split_rows(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """Prompt-disjoint fit / evaluation halves (alternating, so both see every domain)."""
    if len(rows) < 2:
        raise UsageError("calibration needs at least 2 held-out prompts")
    return rows[0::2], rows[1::2]

