"""Time of one target forward over a ragged batch: R requests with C cached tokens each, N new
tokens per request (N = 1: decoding rows; N > 1: verification blocks), logits for every row.

Compares runtime versions: run it from two checkouts in turn, with PYTHONPATH pointing at each,
a few times alternately (the machine drifts), e.g.

    for d in old new old new; do PYTHONPATH=$d .venv/bin/python scripts/forward_time.py; done
"""

import argparse
import time

import torch

from dspark.runtime.loading import load_target


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x1,1x8,8x8,32x1,32x8", help="RxN pairs: requests x new tokens")
    ap.add_argument("--context", type=int, default=256, help="cached tokens per request")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_target(dtype=args.dtype).model
    g = torch.Generator().manual_seed(0)
    out = []
    for shape in args.shapes.split(","):
        r, n = (int(x) for x in shape.split("x"))
        cache = model.new_cache(r, args.context + n + 1)
        slots = [cache.allocate() for _ in range(r)]
        for s in slots:
            model(torch.randint(0, 1000, (args.context,), generator=g), [(s, args.context)], cache, logits_rows=None)
        ids = torch.randint(0, 1000, (r * n,), generator=g)
        times = []
        for i in range(args.repeats + 1):   # the first call warms up and is not counted
            t0 = time.perf_counter()
            model(ids, [(s, n) for s in slots], cache, logits_rows="all")
            if i:
                times.append(time.perf_counter() - t0)
            for s in slots:
                cache.truncate(s, args.context)
        out.append(f"{r}x{n}: {1000 * sorted(times)[len(times) // 2]:.1f} ms")
    print(", ".join(out))


if __name__ == "__main__":
    main()
