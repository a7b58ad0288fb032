"""The held-out table of training runs: per run, its first and last held-out signal, per group
(source, or the target's answers of one regime) and block position, as 1 - TV (acceptance at
temperature 1) and argmax agreement (greedy), teacher-forced; "tau" is 1 + sum_k prod_{j<=k} a_j,
the accepted length were the positions independent.

    python scripts/regime_table.py RUN [RUN ...]
"""
import json
import sys
from pathlib import Path


def tau(accept: list[float]) -> float:
    out, run = 1.0, 1.0
    for a in accept:
        run *= a
        out += run
    return out


def main(runs: list[str]) -> None:
    for run in runs:
        recs = [json.loads(line) for line in (Path(run) / "heldout.jsonl").read_text().splitlines() if line]
        first, last = recs[0], recs[-1]
        print(f"\n{run}: step {first['step']} -> {last['step']}")
        print("| held-out rows | metric | step | " + " | ".join(f"pos {k}" for k in range(1, 8)) + " | tau |")
        print("|---|---|---|" + "---|" * 8)
        for group in sorted(last["sources"]):
            for metric in ("argmax", "accept"):
                for rec in (first, last):
                    v = rec["sources"][group][metric]
                    print(f"| {group} ({rec['sources'][group]['rows']} anchors) | {metric} | {rec['step']} | "
                          + " | ".join(f"{x:.3f}" for x in v) + f" | {tau(v):.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
