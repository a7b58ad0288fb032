"""The held-out scaling curve of a training run: position-1 acceptance against answer positions seen.

Reads the ``heldout.jsonl`` that ``dspark train --eval-every N`` appends to (one record per
evaluation: the anchors trained on so far and, per source, the mean 1 - TV(p_d, p_t) and argmax
agreement at each block position on held-out text) and plots position-1 acceptance against the
distinct answer positions seen, log-log, one line per source and run. A straight line that keeps
falling in error (1 - acceptance) says more data and steps still pay.

    python scripts/scaling_curve.py RUN_DIR [RUN_DIR ...] --out docs/scaling_curve.png [--markdown table.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read(run: Path) -> list[dict]:
    path = run / "heldout.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no held-out signal (train with --eval-every N)")
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_step = {r["step"]: r for r in recs}          # a resumed run may repeat a step: keep the last
    return [by_step[s] for s in sorted(by_step)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", required=True)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = []
    for run in args.runs:
        recs = [r for r in read(run) if r["anchors_seen"] > 0]
        sources = sorted({s for r in recs for s in r["sources"]})
        for src in sources:
            xs = [r["anchors_seen"] for r in recs if src in r["sources"]]
            acc = [r["sources"][src]["accept"][0] for r in recs if src in r["sources"]]
            top = [r["sources"][src]["argmax"][0] for r in recs if src in r["sources"]]
            label = f"{run.name}: {src}"
            axes[0].loglog(xs, [1 - a for a in acc], marker=".", label=label)
            axes[1].semilogx(xs, acc, marker=".", label=label)
            if xs:
                rows.append((run.name, src, xs[-1], acc[-1], top[-1], recs[-1]["step"]))
    axes[0].set(xlabel="answer positions trained on (anchors)", ylabel="1 - position-1 acceptance (T = 1)",
                title="held-out error, log-log")
    axes[1].set(xlabel="answer positions trained on (anchors)", ylabel="position-1 acceptance (1 - TV)",
                title="held-out acceptance")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    table = ["| run | source | positions seen | step | position-1 acceptance (1 - TV) | argmax agreement |",
             "|---|---|---|---|---|---|"]
    table += [f"| {r} | {s} | {x:,} | {st} | {a:.3f} | {t:.3f} |" for r, s, x, a, t, st in rows]
    print("\n".join(table))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
