"""Time of one target forward over a ragged batch: R requests with C cached tokens each, N new
tokens per request (N = 1: decoding rows; N > 1: verification blocks), logits for every row.

``--against DIR`` compares this checkout's runtime with another checkout's (DIR holds its
``dspark`` package, e.g. a git worktree) in ONE process: both decoders load the same target and
run each shape alternately, call by call, so that the machine's drift lands on both alike (runs of
one version after the other drifted by 10 % here). Reports medians and the ratio other / this.

    .venv/bin/python scripts/forward_time.py --against /work/dev

``--invariant`` compares this checkout's default runtime with its batch-invariant mode
(``--batch-invariant``, runtime/invariant.py) the same way: "other" is the invariant one.
"""

import argparse
import importlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from dspark.runtime.loading import load_target


def load_other(checkout: Path, dtype: str):
    """The target loaded by another checkout's package, imported under another name."""
    src = checkout / "dspark"
    if not (src / "runtime" / "model.py").is_file():
        raise SystemExit(f"--against {checkout}: no dspark/runtime/model.py there")
    tmp = Path(tempfile.mkdtemp(prefix="dspark_other_"))
    shutil.copytree(src, tmp / "dspark_other", ignore=shutil.ignore_patterns("__pycache__", "checkpoints"))
    sys.path.insert(0, str(tmp))
    return importlib.import_module("dspark_other.runtime.loading").load_target(dtype=dtype).model


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x1,1x8,8x8,32x1,32x8",
                    help="RxN pairs: requests x new tokens; joined by + for a mixed step (31x1+1x8)")
    ap.add_argument("--context", type=int, default=256, help="cached tokens per request")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", type=Path, help="another checkout whose runtime runs alternately with this one")
    ap.add_argument("--invariant", action="store_true", help="other = this runtime in batch-invariant mode")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = {"this": load_target(dtype=args.dtype).model}
    if args.against:
        models["other"] = load_other(args.against, args.dtype)
    elif args.invariant:
        models["other"] = load_target(dtype=args.dtype, batch_invariant=True).model
    g = torch.Generator().manual_seed(0)
    out = []
    for shape in args.shapes.split(","):
        # new tokens per request, in slot order: "4x1+1x8" = four decoding rows, then a block of 8
        news = [int(n) for part in shape.split("+") for r, n in [part.split("x")] for _ in range(int(r))]
        r = len(news)
        ctx_ids = torch.randint(0, 1000, (args.context,), generator=g)
        ids = torch.randint(0, 1000, (sum(news),), generator=g)
        runs = {}
        for name, model in models.items():
            cache = model.new_cache(r, args.context + max(news) + 1)
            slots = [cache.allocate() for _ in range(r)]
            for s in slots:
                model(ctx_ids, [(s, args.context)], cache, logits_rows=None)
            runs[name] = (model, cache, slots, [])
        for i in range(args.repeats + 1):   # the first call warms up and is not counted
            for model, cache, slots, times in runs.values():
                t0 = time.perf_counter()
                model(ids, list(zip(slots, news)), cache, logits_rows="all")
                if i:
                    times.append(time.perf_counter() - t0)
                for s in slots:
                    cache.truncate(s, args.context)
        med = {name: sorted(v[3])[len(v[3]) // 2] for name, v in runs.items()}
        cell = f"{shape}: {1000 * med['this']:.1f} ms"
        if "other" in med:
            cell += f" / other {1000 * med['other']:.1f} ms ({med['other'] / med['this']:.3f})"
        out.append(cell)
    print(", ".join(out))


if __name__ == "__main__":
    main()
