"""One layer's attention of R segments of N new rows each against C cached keys (SmolLM2's heads:
9 query heads, 3 KV heads of 64), per segment (``attend``, one call each) and batched over the
slots (``SlotBatch``), with the rows in slot order (read in place) and with one segment's rows laid
out last (gathered and scattered, as when a request joins the running list in a freed slot), and in
every fourth slot (their keys and values gathered, as for the few requests of a step that verify a
block among many decoding ones), in one process; best of 5 timings of a loop of calls (a
microbenchmark: the cache stays warm). Also the largest difference between the paths' outputs.

    .venv/bin/python scripts/attention_time.py --shapes 1x1,4x1,4x2,32x1,32x2 --context 256
"""

import argparse

import torch

from dspark.runtime.attention import SlotBatch, attend
from linear_time import best_us   # scripts/linear_time.py, beside this one


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2x1,4x1,4x2,8x1,16x1,32x1,32x2,32x8", help="RxN: segments x new rows")
    ap.add_argument("--context", type=int, default=256, help="cached keys per segment before its rows")
    ap.add_argument("--ragged", action="store_true", help="contexts spread over context +- 25 %%")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    H, Hkv, hd = 9, 3, 64
    g = torch.Generator().manual_seed(0)
    for shape in a.shapes.split(","):
        R, n = (int(x) for x in shape.split("x"))
        span = a.context // 4 if a.ragged else 0
        starts = [a.context + int(x) for x in torch.randint(-span, span + 1, (R,), generator=g)]
        L = max(starts) + n
        kc, vc = torch.randn(R, Hkv, L, hd, generator=g), torch.randn(R, Hkv, L, hd, generator=g)
        q = torch.randn(R * n, H, hd, generator=g)
        tri = None if n == 1 else torch.full((n, n), float("-inf")).triu_(1)
        out = torch.empty(R * n, H * hd)

        def per_segment():
            for i, s in enumerate(starts):
                attend(q[i * n:(i + 1) * n], kc[i, :, :s + n], vc[i, :, :s + n], tri, out[i * n:(i + 1) * n])

        batch = SlotBatch.of([(i, n) for i in range(R)], starts, [i * n for i in range(R)], "cpu")

        def batched():
            batch.attend(q, kc, vc, None, out)

        per_segment()
        ref = out.clone()
        line = f"{shape}: per segment {best_us(per_segment, a.calls):.0f} us"
        if batch is None:
            print(line + " (one segment: not batched)")
            continue
        batched()
        diff = (out - ref).abs().max().item()
        line += f", batched {best_us(batched, a.calls):.0f} us (max difference {diff:.1e})"
        # the same segments with the first one's rows laid out last
        order = list(range(1, R)) + [0]
        rows = torch.cat([torch.arange(i * n, (i + 1) * n) for i in order])
        moved = SlotBatch.of([(i, n) for i in order], [starts[i] for i in order], [j * n for j in range(R)], "cpu")
        assert moved is not None and moved.dense is None   # R >= 2 segments, not in slot order
        qm = q[rows].contiguous()

        def batched_moved():
            moved.attend(qm, kc, vc, None, out)

        batched_moved()
        diff = (out - ref[rows]).abs().max().item()
        line += f", out of slot order {best_us(batched_moved, a.calls):.0f} us (max difference {diff:.1e})"
        # the same segments in slots 0, 4, 8, ...: too spread to read in place
        ks, vs = kc.new_zeros(4 * R, Hkv, L, hd), vc.new_zeros(4 * R, Hkv, L, hd)
        ks[::4], vs[::4] = kc, vc
        spread = SlotBatch.of([(4 * i, n) for i in range(R)], starts, [i * n for i in range(R)], "cpu")
        assert spread is not None and spread.index is not None

        def batched_spread():
            spread.attend(q, ks, vs, None, out)

        batched_spread()
        diff = (out - ref).abs().max().item()
        print(line + f", every fourth slot {best_us(batched_spread, a.calls):.0f} us (max difference {diff:.1e})")


if __name__ == "__main__":
    main()
