"""The small learning-rate sweep every recipe gets before its full run (same data, same schedule).

For each recipe and learning rate, `dspark train` runs the full run's schedule (same epochs, batch,
anchors: warmup and cosine span the whole run) and stops after ``--steps`` steps. The score is
the recipe's own training loss averaged over the last ``--window`` steps: while the run is still
in its first epoch (keep ``--steps`` below one epoch) every batch is one the drafter has not
trained on, so that average is a held-out estimate (progressive validation) and costs nothing extra. Lower is better; the mean
1 - TV is shown beside it where the recipe logs it (DFlash's CE-only loss does not compute p_t).

Caution: a long schedule stopped early compares rates at their peak, which favours the higher ones. On 4,712
answers (884-step schedule) this sweep chose 4e-3 for DSpark, and the full DSpark run at 4e-3 ended below
DFlash at 1e-3 in benchmark tau, while the full run at 1e-3 beat both.

Runs are resumable (rerun the same command: finished runs are read, cut ones resume from their
checkpoints) and ``--parallel N`` runs N at once with 2 / N threads each (``--threads`` to set it).

    .venv/bin/python scripts/lr_sweep.py --work <work> --out <folder> --recipes dspark,dflash,dflash-5,eagle3,dspark-rnn \\
        --lrs 1e-3,2e-3,4e-3 --steps 80 --epochs 1.5 --batch-size 8 --anchors 64 --parallel 2
"""

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path


def history(run: Path) -> list:
    f = run / "checkpoint" / "trainer_state.json"
    return json.loads(f.read_text())["history"] if f.is_file() else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", required=True, help="pipeline folder (its cache/train is read)")
    ap.add_argument("--out", required=True, help="one sub-folder per run goes here")
    ap.add_argument("--recipes", default="dspark,dflash,dflash-5,eagle3,dspark-rnn")
    ap.add_argument("--lrs", default="1e-3,2e-3,4e-3")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--epochs", type=float, required=True, help="the full run's epochs (its schedule)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per run (default: 2 / --parallel)")
    a = ap.parse_args()
    recipes = [r for r in a.recipes.split(",") if r]
    lrs = [x for x in a.lrs.split(",") if x]
    out = Path(a.out)
    runs = [(r, lr, out / f"{r}-lr{lr}") for r in recipes for lr in lrs]
    todo = [x for x in runs if len(history(x[2])) < a.steps]
    threads = a.threads or max(1, 2 // a.parallel)
    live: list = []
    while todo or live:
        while todo and len(live) < a.parallel:
            r, lr, folder = todo.pop(0)
            cmd = [sys.executable, "-m", "dspark.cli", "train", "--recipe", r, "--lr", lr, "--work", a.work,
                   "--out", str(folder), "--epochs", str(a.epochs), "--batch-size", str(a.batch_size),
                   "--anchors", str(a.anchors), "--max-steps", str(a.steps), "--save-every", "10",
                   "--threads", str(threads)]
            folder.mkdir(parents=True, exist_ok=True)
            log = open(folder / "sweep.log", "a")
            print(f"start {r} lr {lr}", file=sys.stderr, flush=True)
            live.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), r, lr, folder))
        time.sleep(5)
        for p in [x for x in live if x[0].poll() is not None]:
            live.remove(p)
            if p[0].returncode:
                raise SystemExit(f"{p[1]} lr {p[2]} failed (exit {p[0].returncode}): see {p[3]}/sweep.log")
    rows = []
    for r, lr, folder in runs:
        h = [x for x in history(folder) if a.steps - a.window < x["step"] <= a.steps]
        mean = lambda k: sum(x[k] for x in h) / len(h) if h and all(k in x for x in h) else math.nan  # noqa: E731
        rows.append({"recipe": r, "lr": float(lr), "loss": mean("loss"), "accept": mean("accept"), "steps": len(h)})
    print("| recipe | lr | loss (last %d of %d steps) | mean 1 - TV | best |" % (a.window, a.steps))
    print("|---|---|---|---|---|")
    for r in recipes:
        mine = [x for x in rows if x["recipe"] == r]
        best = min(mine, key=lambda x: (math.isnan(x["loss"]), x["loss"]))   # a run without steps never wins
        for x in mine:
            acc = "-" if math.isnan(x["accept"]) else f"{x['accept']:.4f}"
            print(f"| {r} | {x['lr']:g} | {x['loss']:.4f} | {acc} | {'yes' if x is best else ''} |")
    clean = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in x.items()} for x in rows]
    print(json.dumps({"steps": a.steps, "window": a.window, "runs": clean}))


if __name__ == "__main__":
    main()
