"""The small learning-rate sweep every recipe gets before its full run (same data, same schedule).

Two scores, one per mode:

- ``--heldout <work>/prompts/heldout.jsonl`` (the pick the committed drafters follow): every run is
  a full run, and each is scored by its accepted length tau on held-out prompts (the last
  ``--per-domain`` prompts of each domain of ``dspark prepare``'s held-out split, written to
  ``<out>/dev.jsonl``; `dspark eval`, temperature 1, seed 0, 256 new tokens, all runs in one
  process). Higher is better; the bootstrap ratios between runs are printed by `dspark eval`.
- ``--steps N``: `dspark train` runs the full run's schedule (warmup and cosine span the whole
  run) and stops after N steps, scored by the recipe's own training loss over the last
  ``--window`` steps: within the first epoch every batch is new to the drafter (progressive
  validation, free). Cheap, but a long schedule stopped early compares rates at their peak,
  which favours the higher ones: on 4,712 answers (884-step schedule) it chose 4e-3 for DSpark,
  whose full run then ended below the full run at 1e-3 in benchmark tau.

Runs are resumable (rerun the same command: finished runs are read, cut ones resume from their
checkpoints) and ``--parallel N`` runs N at once with 2 / N threads each (``--threads`` to set it).

    .venv/bin/python scripts/lr_sweep.py --work <work> --out <folder> --recipes dspark,dflash \\
        --lrs 1e-3,2e-3 --heldout <work>/prompts/heldout.jsonl --epochs 4 --batch-size 8 --anchors 64
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


def dev_set(heldout: Path, per_domain: int, out: Path) -> int:
    """The last ``per_domain`` held-out prompts of each domain, as an eval JSONL; returns its size."""
    rows = [json.loads(line) for line in heldout.read_text().splitlines() if line.strip()]
    domains = sorted({r["domain"] for r in rows})
    picked = [r for d in domains for r in [x for x in rows if x["domain"] == d][-per_domain:]]
    out.write_text("".join(json.dumps({"turns": [r["prompt"]]}) + "\n" for r in picked))
    return len(picked)


def train_all(a, runs, threads: int) -> None:
    full = a.heldout is not None
    todo = [x for x in runs if not (x[2] / "model.safetensors").is_file()] if full else \
        [x for x in runs if len(history(x[2])) < a.steps]
    live: list = []
    while todo or live:
        while todo and len(live) < a.parallel:
            r, lr, folder = todo.pop(0)
            cmd = [sys.executable, "-m", "dspark.cli", "train", "--recipe", r, "--lr", lr, "--work", a.work,
                   "--out", str(folder), "--epochs", str(a.epochs), "--batch-size", str(a.batch_size),
                   "--anchors", str(a.anchors), "--save-every", "10", "--threads", str(threads)]
            cmd += [] if full else ["--max-steps", str(a.steps)]
            folder.mkdir(parents=True, exist_ok=True)
            log = open(folder / "sweep.log", "a")
            print(f"start {r} lr {lr}", file=sys.stderr, flush=True)
            live.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), r, lr, folder))
        time.sleep(5)
        for p in [x for x in live if x[0].poll() is not None]:
            live.remove(p)
            if p[0].returncode:
                raise SystemExit(f"{p[1]} lr {p[2]} failed (exit {p[0].returncode}): see {p[3]}/sweep.log")


def score_by_loss(a, runs) -> list[dict]:
    rows = []
    for r, lr, folder in runs:
        h = [x for x in history(folder) if a.steps - a.window < x["step"] <= a.steps]
        mean = lambda k: sum(x[k] for x in h) / len(h) if h and all(k in x for x in h) else math.nan  # noqa: E731
        rows.append({"recipe": r, "lr": float(lr), "loss": mean("loss"), "accept": mean("accept"), "steps": len(h)})
    return rows


def score_by_heldout_tau(a, runs) -> list[dict]:
    dev = Path(a.out) / "dev.jsonl"
    n = dev_set(Path(a.heldout), a.per_domain, dev)
    cmd = [sys.executable, "-m", "dspark.cli", "eval", "--drafters", ",".join(str(x[2]) for x in runs),
           "--dataset", str(dev), "--num-prompts", str(n), "--max-new-tokens", str(a.max_new_tokens),
           "--temperature", "1", "--seed", "0", "--concurrency", "16", "--threads", str(a.threads or 2), "--json"]
    print(f"held-out tau of {len(runs)} runs on {n} prompts ({dev})", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    tau = {r["drafter"]: r["tau"] for r in json.loads(done.stdout.strip().splitlines()[-1])["results"]}
    return [{"recipe": r, "lr": float(lr), "tau": tau[str(folder)]} for r, lr, folder in runs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", required=True, help="pipeline folder (its cache/train is read)")
    ap.add_argument("--out", required=True, help="one sub-folder per run goes here")
    ap.add_argument("--recipes", default="dspark,dflash,dflash-5,eagle3,dspark-rnn")
    ap.add_argument("--lrs", default="1e-3,2e-3,4e-3")
    ap.add_argument("--heldout", default=None, help="held-out prompts (prepare's heldout.jsonl): full runs "
                                                    "scored by held-out tau")
    ap.add_argument("--per-domain", type=int, default=16, help="held-out prompts per domain (with --heldout)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="with --heldout")
    ap.add_argument("--steps", type=int, default=80, help="without --heldout: stop each run here")
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--epochs", type=float, required=True, help="the full run's epochs (its schedule)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per run (default: 2 / --parallel)")
    a = ap.parse_args()
    if a.heldout and not Path(a.heldout).is_file():
        ap.error(f"--heldout {a.heldout}: no such file (dspark prepare writes <work>/prompts/heldout.jsonl)")
    recipes = [r for r in a.recipes.split(",") if r]
    lrs = [x for x in a.lrs.split(",") if x]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(r, lr, out / f"{r}-lr{lr}") for r in recipes for lr in lrs]
    threads = a.threads or max(1, 2 // a.parallel)
    train_all(a, runs, threads)
    if a.heldout:
        rows, key, head = score_by_heldout_tau(a, runs), "tau", "held-out tau"
        best_of = lambda mine: max(mine, key=lambda x: x["tau"])  # noqa: E731
    else:
        rows, key, head = score_by_loss(a, runs), "loss", f"loss (last {a.window} of {a.steps} steps)"
        # a run without steps never wins
        best_of = lambda mine: min(mine, key=lambda x: (math.isnan(x["loss"]), x["loss"]))  # noqa: E731
    print(f"| recipe | lr | {head} | best |")
    print("|---|---|---|---|")
    for r in recipes:
        mine = [x for x in rows if x["recipe"] == r]
        best = best_of(mine)
        for x in mine:
            print(f"| {r} | {x['lr']:g} | {x[key]:.4f} | {'yes' if x is best else ''} |")
    clean = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in x.items()} for x in rows]
    print(json.dumps({"score": key, "steps": None if a.heldout else a.steps, "runs": clean}))


if __name__ == "__main__":
    main()
