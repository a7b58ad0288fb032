"""One `dspark bench` command on this checkout and on another commit's, side by side.

The two checkouts' runs alternate (this, other, other, this, ...), each alone on the machine, in
one script, so that both see the same hours of a drifting VM; each cell is the median over the
rounds and the ratio is this checkout's over the other's. Accept lengths are reported beside the
speeds: where they differ, the two commits drafted differently (their committed drafters), and the
speed ratio mixes runtime and drafter. The other commit is checked out into a temporary git
worktree and imported ahead of the installed package (PYTHONPATH), with the same virtual
environment; the bench's arguments must mean the same on both commits.

    python scripts/bench_against.py --against ab3f074 --rounds 2 -- speed --systems plain,dspark@prefix,ngram+dspark --threads 2
    python scripts/bench_against.py --against ab3f074 -- concurrency --drafter ngram+dspark --policies plain,fixed --concurrency 1,8,32
    python scripts/bench_against.py --against ab3f074 -- serving --drafter plain --concurrency 1,16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METRICS = ("tokens_per_second", "total_tokens_per_second", "ttft_p50_ms", "accept_length")


def run_bench(checkout: Path, bench: list[str]) -> list[dict]:
    """The bench's JSON rows, run with ``checkout``'s package."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    code = "import sys; from dspark.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, "bench", *bench, "--json"], env=env, cwd=checkout,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench failed on {checkout}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["results"]


def key(row: dict) -> tuple:
    return (row.get("system") or row.get("policy"), row.get("concurrency"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="the other commit (any git revision)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="after --: the `dspark bench` arguments")
    args = ap.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        ap.error("give the bench after --, e.g. -- speed --systems plain,ngram")
    rev = subprocess.run(["git", "rev-parse", "--short", args.against], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    runs: dict[str, list[list[dict]]] = {head: [], rev: []}
    with tempfile.TemporaryDirectory(prefix="dspark-against-") as tmp:
        other = Path(tmp) / rev
        subprocess.run(["git", "worktree", "add", "--detach", str(other), rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for i in range(args.rounds):
                order = [(head, ROOT), (rev, other)]
                for name, path in (order if i % 2 == 0 else order[::-1]):
                    print(f"round {i + 1}: {name}", file=sys.stderr)
                    runs[name].append(run_bench(path, bench))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, capture_output=True)
    table = []
    for row in runs[head][0]:
        k = key(row)
        for m in METRICS:
            if m not in row:
                continue
            mine = [r[m] for rs in runs[head] for r in rs if key(r) == k]
            theirs = [r[m] for rs in runs[rev] for r in rs if key(r) == k and m in r]
            if not theirs:
                continue
            a, b = statistics.median(mine), statistics.median(theirs)
            table.append({"row": k[0], "concurrency": k[1], "metric": m, head: a, rev: b,
                          "ratio": a / b if b else None, "runs": {head: mine, rev: theirs}})
    print(f"| row | concurrency | metric | {head} | {rev} | {head} / {rev} |\n|---|---|---|---|---|---|")
    for t in table:
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.3f}"
        print(f"| {t['row']} | {t['concurrency'] or '-'} | {t['metric']} | {t[head]:.1f} | {t[rev]:.1f} | {ratio} |")
    if args.json:
        print(json.dumps({"bench": bench, "head": head, "against": rev, "rounds": args.rounds, "table": table}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
