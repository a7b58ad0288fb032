"""The target's product shapes on the three paths runtime/linear.py chooses between, in one process:
oneDNN packed weights, ``F.linear`` on the plain weight, and the dense path (one row as a
matrix-vector product, a few as ``w @ x.T``). Per shape and row count, the best of 5 timings of a
loop of calls (a microbenchmark: the weight stays in cache, unlike in a forward; whole forwards are
scripts/forward_time.py). Also, per shape, how many of 40 rows with 5 % subnormal inputs get other
bits when multiplied alone on the packed weight than inside the block of 40 (what ``rows_alike``
is for).

    .venv/bin/python scripts/linear_time.py --rows 1,8

``--fp32``: the fp32 kernels ``linear`` chooses between instead (``F.linear`` and ``w @ x.T``, which
``transposed_faster`` times once per shape, and the packed fp32 weight), beside ``F.linear`` in bf16:

    .venv/bin/python scripts/linear_time.py --fp32 --rows 1,8
"""

import argparse
import time

import torch
import torch.nn.functional as F

from dspark.runtime.linear import PackedWeight, dense, linear
from dspark.runtime.loading import load_target


def best_us(f, calls: int) -> float:
    for _ in range(5):
        f()
    out = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        out.append((time.perf_counter() - t) / calls)
    return min(out) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8", help="row counts, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fp32", action="store_true", help="time the fp32 kernels (and bf16 F.linear) instead")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.fp32:
        return fp32_table([int(r) for r in a.rows.split(",")])
    model = load_target(dtype="bf16").model
    lw = model.layers[0]
    weights = {"qkv": lw.qkv, "o": lw.o, "gate_up": lw.gate_up, "down": lw.down, "lm_head": model.lm_head}
    g = torch.Generator().manual_seed(0)
    warm, x0 = PackedWeight(dense(lw.gate_up).contiguous()), torch.randn(8, lw.gate_up.shape[1]).bfloat16()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.0:      # the first timings ran slow without it
        linear(x0, warm)
    for name, w in weights.items():
        plain = dense(w).contiguous()
        packed = PackedWeight(plain)
        calls = 10 if plain.shape[0] > 10000 else 100
        cells = []
        for rows in (int(r) for r in a.rows.split(",")):
            x = torch.randn(rows, plain.shape[1], generator=g).bfloat16()
            t = [best_us(lambda: linear(x, packed), calls), best_us(lambda: F.linear(x, plain), calls),
                 best_us(lambda: linear(x, plain), calls)]
            cells.append(f"{rows} rows: packed {t[0]:.0f} / F.linear {t[1]:.0f} / dense path {t[2]:.0f} us")
        x = torch.randn(40, plain.shape[1], generator=g)
        x[torch.rand(40, plain.shape[1], generator=g) < 0.05] = 1e-39
        x = x.bfloat16()
        block = linear(x, packed)
        differ = sum(not torch.equal(linear(x[i:i + 1], packed)[0], block[i]) for i in range(40))
        print(f"{name} {tuple(plain.shape)}: " + "; ".join(cells) + f"; rows differing alone {differ}/40")


def fp32_table(rows_list: list[int]) -> None:
    from dspark.runtime.linear import transposed_faster
    model = load_target(dtype="fp32").model
    lw = model.layers[0]
    weights = {"qkv": lw.qkv, "o": lw.o, "gate_up": lw.gate_up, "down": lw.down, "lm_head": model.lm_head}
    g = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        w = dense(w).contiguous()
        wb, p = w.bfloat16(), PackedWeight(w)
        calls = 5 if w.shape[0] > 10000 else 50
        cells = []
        for rows in rows_list:
            x = torch.randn(rows, w.shape[1], generator=g)
            xb = x.bfloat16()
            t = [best_us(lambda x=x, w=w: F.linear(x, w), calls), best_us(lambda x=x, w=w: torch.matmul(w, x.t()), calls),
                 best_us(lambda x=x, p=p: linear(x, p), calls), best_us(lambda xb=xb, wb=wb: F.linear(xb, wb), calls)]
            cells.append(f"{rows} rows: F.linear {t[0]:.0f} / w @ x.T {t[1]:.0f} / packed {t[2]:.0f} / "
                         f"bf16 F.linear {t[3]:.0f} us")
        chosen = "w @ x.T" if transposed_faster(tuple(w.shape), torch.get_num_threads()) else "F.linear"
        print(f"{name} {tuple(w.shape)}: " + "; ".join(cells) + f"; linear() takes {chosen} for 2 - 256 rows")


if __name__ == "__main__":
    main()
