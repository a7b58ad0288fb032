"""The committed drafter's scaling across its training stages: held-out tau against anchors seen.

Reads a CSV of stages (``stage,anchors_m,layers,dev_tau,commit``; lines starting with # are
comments), fits tau = a + b * log10(anchors) by least squares, prints the fit and where the fitted
line reaches ``--target``, and plots the stages with the line (semi-log). The per-run curve of one
stage's held-out signal is scripts/scaling_curve.py.

    python scripts/stage_curve.py docs/drafter_stages.csv --target 1.91 --out docs/stage_curve.png \
        --compare docs/dflash_stages.csv --compare-label "DFlash, the same stages"

``--compare`` draws a second lineage's stages (same CSV columns) beside the first, outside the fit.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
from pathlib import Path


def read(path: Path, min_rows: int = 2) -> list[dict]:
    if not path.is_file():
        raise SystemExit(f"{path}: no such file")
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    if len(rows) < min_rows:
        raise SystemExit(f"{path}: needs at least {min_rows} stages, found {len(rows)}")
    out = []
    for n, r in enumerate(rows, 1):
        try:
            out.append({"stage": r["stage"], "anchors": float(r["anchors_m"]) * 1e6, "layers": int(r["layers"]),
                        "tau": float(r["dev_tau"])})
        except (KeyError, TypeError, ValueError) as e:
            raise SystemExit(f"{path}: stage row {n}: needs stage, anchors_m, layers, dev_tau ({e!r})") from None
        if out[-1]["anchors"] <= 0:
            raise SystemExit(f"{path}: stage row {n}: anchors_m must be positive")
    if min_rows >= 2 and len({r["anchors"] for r in out}) < 2:
        raise SystemExit(f"{path}: a fit needs stages at two or more anchor counts")
    return out


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b * log10(x)."""
    lx = [math.log10(x) for x in xs]
    mx, my = sum(lx) / len(lx), sum(ys) / len(ys)
    b = sum((u - mx) * (v - my) for u, v in zip(lx, ys)) / sum((u - mx) ** 2 for u in lx)
    return my - b * mx, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", type=Path)
    ap.add_argument("--target", type=float, default=1.8, help="tau the fitted line is extrapolated to")
    ap.add_argument("--label", default=None, help="legend of the target line (default: 'target TAU')")
    ap.add_argument("--out", default=None, help="PNG to write")
    ap.add_argument("--name", default="DSpark", help="the fitted lineage's name in the legend")
    ap.add_argument("--compare", type=Path, default=None, help="another lineage's CSV, plotted beside, not fitted")
    ap.add_argument("--compare-label", default="compared lineage")
    args = ap.parse_args()
    rows = read(args.csv)
    other = read(args.compare, min_rows=1) if args.compare else []
    a, b = fit([r["anchors"] for r in rows], [r["tau"] for r in rows])
    reach = 10 ** ((args.target - a) / b) if b > 0 else math.inf
    print(f"tau = {a:.3f} + {b:.3f} * log10(anchors): +{b:.3f} per tenfold anchors; "
          f"the line reaches {args.target} at {reach / 1e6:.1f} M anchors")
    if args.out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for layers in sorted({r["layers"] for r in rows}):
            sel = [r for r in rows if r["layers"] == layers]
            ax.semilogx([r["anchors"] for r in sel], [r["tau"] for r in sel], "o", label=f"{args.name}, {layers} layers")
            for r in sel:
                ax.annotate(r["stage"], (r["anchors"], r["tau"]), textcoords="offset points", xytext=(4, -10), fontsize=7)
        if other:
            ax.semilogx([r["anchors"] for r in other], [r["tau"] for r in other], "s", mfc="none",
                        label=args.compare_label)
            for r in other:
                ax.annotate(r["stage"], (r["anchors"], r["tau"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
        seen = [r["anchors"] for r in rows + other]
        lo, hi = min(seen) * 0.8, (max(reach, max(seen)) * 1.3 if math.isfinite(reach) else max(seen) * 3)
        xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]      # the fitted line, evenly in log
        ax.semilogx(xs, [a + b * math.log10(x) for x in xs], "--", color="grey", label=f"fit: +{b:.2f} per tenfold")
        ax.axhline(args.target, color="red", lw=0.8, label=args.label or f"target {args.target}")
        ax.set(xlabel="anchors trained on since the first run", ylabel="held-out tau (48 dev prompts, T = 1)",
               title="the committed drafters, stage by stage")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
