"""The committed drafter's scaling across its training stages: a held-out figure against anchors seen.

Reads a CSV of stages (``stage,anchors_m,layers,commit`` and one column per figure, e.g. ``dev_tau``;
lines starting with # are comments). For each figure named in ``--columns`` it fits
y = a + b * log10(anchors) by least squares, prints the fit and where the fitted line reaches that
figure's ``--targets`` entry, and plots the stages with the line (semi-log), one panel per figure.
The per-run curve of one stage's held-out signal is scripts/scaling_curve.py.

    python scripts/stage_curve.py docs/drafter_stages.csv --targets 1.91 --out docs/stage_curve.png \\
        --compare docs/dflash_stages.csv --compare-label "DFlash, the same stages"
    python scripts/stage_curve.py docs/drafter_stages_benchmarks.csv --columns fp_t0,fp_t1,tau_t1 \\
        --targets 0.55,0.45,1.8 --ylabels "first-position acceptance, T = 0;... T = 1;macro tau, T = 1" --out PNG

``--compare`` draws a second lineage's stages (same CSV columns) beside the first, outside the fit.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
from pathlib import Path


def read(path: Path, columns: list[str], min_rows: int = 2) -> list[dict]:
    """The stages of a CSV: stage, anchors (not millions), layers and each of ``columns`` as floats."""
    if not path.is_file():
        raise SystemExit(f"{path}: no such file")
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    if len(rows) < min_rows:
        raise SystemExit(f"{path}: needs at least {min_rows} stages, found {len(rows)}")
    out = []
    for n, r in enumerate(rows, 1):
        try:
            row = {"stage": r["stage"], "anchors": float(r["anchors_m"]) * 1e6, "layers": int(r["layers"])}
            for c in columns:
                row[c] = float(r[c])
        except (KeyError, TypeError, ValueError) as e:
            raise SystemExit(f"{path}: stage row {n}: needs stage, anchors_m, layers, {', '.join(columns)} "
                             f"({e!r})") from None
        if row["anchors"] <= 0:
            raise SystemExit(f"{path}: stage row {n}: anchors_m must be positive")
        out.append(row)
    if min_rows >= 2 and len({r["anchors"] for r in out}) < 2:
        raise SystemExit(f"{path}: a fit needs stages at two or more anchor counts")
    return out


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b * log10(x)."""
    lx = [math.log10(x) for x in xs]
    mx, my = sum(lx) / len(lx), sum(ys) / len(ys)
    b = sum((u - mx) * (v - my) for u, v in zip(lx, ys)) / sum((u - mx) ** 2 for u in lx)
    return my - b * mx, b


def split(text: str | None, n: int, what: str, sep: str = ",") -> list[str] | None:
    if text is None:
        return None
    parts = [p.strip() for p in text.split(sep)]
    if len(parts) != n:
        raise SystemExit(f"--{what}: {len(parts)} entries for {n} columns")
    return parts


def panel(ax, rows, other, column, target, a, b, reach, args, ylabel) -> None:
    for layers in sorted({r["layers"] for r in rows}):
        sel = [r for r in rows if r["layers"] == layers]
        ax.semilogx([r["anchors"] for r in sel], [r[column] for r in sel], "o", label=f"{args.name}, {layers} layers")
        for r in sel:
            ax.annotate(r["stage"], (r["anchors"], r[column]), textcoords="offset points", xytext=(4, -10), fontsize=7)
    if other:
        ax.semilogx([r["anchors"] for r in other], [r[column] for r in other], "s", mfc="none", label=args.compare_label)
        for r in other:
            ax.annotate(r["stage"], (r["anchors"], r[column]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    seen = [r["anchors"] for r in rows + other]
    lo, hi = min(seen) * 0.8, (max(reach, max(seen)) * 1.3 if math.isfinite(reach) else max(seen) * 3)
    xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]      # the fitted line, evenly in log
    ax.semilogx(xs, [a + b * math.log10(x) for x in xs], "--", color="grey", label=f"fit: {b:+.3g} per tenfold")
    ax.axhline(target, color="red", lw=0.8, label=args.label or f"target {target}")
    ax.set(xlabel="anchors trained on since the first run", ylabel=ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", type=Path)
    ap.add_argument("--columns", default="dev_tau", help="the figures to fit, comma-separated (one panel each)")
    ap.add_argument("--targets", "--target", default="1.8",
                    help="each figure's target, where its fitted line is extrapolated to (comma-separated)")
    ap.add_argument("--ylabels", default=None, help="each panel's axis label (separated by ';')")
    ap.add_argument("--label", default=None, help="legend of the target line, every panel's (default: 'target X', each panel's own)")
    ap.add_argument("--title", default="the committed drafters, stage by stage")
    ap.add_argument("--out", default=None, help="PNG to write")
    ap.add_argument("--name", default="DSpark", help="the fitted lineage's name in the legend")
    ap.add_argument("--compare", type=Path, default=None, help="another lineage's CSV, plotted beside, not fitted")
    ap.add_argument("--compare-label", default="compared lineage")
    args = ap.parse_args()
    columns = [c.strip() for c in args.columns.split(",") if c.strip()]
    try:
        targets = [float(t) for t in split(args.targets, len(columns), "targets") or []]
    except ValueError as e:
        raise SystemExit(f"--targets: {e}") from None
    default_labels = {"dev_tau": "held-out tau (48 dev prompts, T = 1)"}
    ylabels = split(args.ylabels, len(columns), "ylabels", ";") or [default_labels.get(c, c) for c in columns]
    rows = read(args.csv, columns)
    other = read(args.compare, columns, min_rows=1) if args.compare else []
    fits = []
    for column, target in zip(columns, targets):
        a, b = fit([r["anchors"] for r in rows], [r[column] for r in rows])
        reach = 10 ** ((target - a) / b) if b > 0 else math.inf
        fits.append((a, b, reach))
        print(f"{column} = {a:.3f} + {b:.3f} * log10(anchors): {b:+.3f} per tenfold anchors; "
              f"the line reaches {target} at {reach / 1e6:.1f} M anchors")
    if args.out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        ncols = min(2, len(columns))
        nrows = math.ceil(len(columns) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.2 * nrows), squeeze=False)
        for ax, column, target, (a, b, reach), ylabel in zip(axes.flat, columns, targets, fits, ylabels):
            panel(ax, rows, other, column, target, a, b, reach, args, ylabel)
        for ax in list(axes.flat)[len(columns):]:
            ax.set_visible(False)
        fig.suptitle(args.title)
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
