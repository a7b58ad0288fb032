"""Where one request's decoding step goes, on the target alone (plain decoding, greedy): the
engine's step against the target's forward inside it, the forward's time by operator (torch's
profiler, self CPU time), and each weight shape's product against the machine's memory bandwidth
(what a one-row product is bound by: it streams its whole weight once).

    .venv/bin/python scripts/decode_breakdown.py --threads 2 [--compile [--kernels]]

Run it alone on the machine: every figure is a median or a best of several calls.
"""

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from dspark.api import encode_prompt
from dspark.data import load_prompts
from dspark.engine import Engine
from dspark.runtime import compiled
from dspark.runtime.linear import PackedWeight, dense, linear, pack
from dspark.runtime.loading import load_target
from dspark.sampling import SamplingParams


def engine_steps(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(median engine step, median target forward inside it) in seconds, over one request's decode."""
    forwards: list[float] = []
    inner = type(model).__call__

    def timed(self, *a, **k):
        t = time.perf_counter()
        out = inner(self, *a, **k)
        forwards.append(time.perf_counter() - t)
        return out
    type(model).__call__ = timed
    try:
        engine = Engine(model, max_requests=1, max_len=len(prompt) + new_tokens + 8)
        engine.add_request(prompt, SamplingParams(temperature=0.0), new_tokens)
        steps = []
        while engine.has_work():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
    finally:
        type(model).__call__ = inner
    return statistics.median(steps[2:]), statistics.median(forwards[2:])


def by_operator(model, prompt: list[int], new_tokens: int) -> list[tuple[str, float, int]]:
    """(operator, self CPU ms per step, calls per step) over one request's decode, most costly first."""
    engine = Engine(model, max_requests=1, max_len=len(prompt) + new_tokens + 8)
    engine.add_request(prompt, SamplingParams(temperature=0.0), new_tokens)
    engine.step()       # the prefill, left out
    steps = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_work():
            engine.step()
            steps += 1
    total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        total[e.key][0] += e.self_cpu_time_total / 1e3
        total[e.key][1] += e.count
    return sorted(((k, v[0] / steps, round(v[1] / steps)) for k, v in total.items()), key=lambda r: -r[1])


def bandwidth(threads: int) -> float:
    """GB/s of a sum over 270 MB of bf16 (the bundled target's weights: what one decoding step reads)."""
    x = torch.ones(135_000_000, dtype=torch.bfloat16)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * 2 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def products(model) -> list[tuple[str, tuple[int, int], float, float]]:
    """(name, weight shape, us per one-row product, GB/s) for each weight of a layer and the LM
    head, each product on distinct copies (about 110 MB of them) so that none comes from a cache."""
    layer = model.layers[0]
    out = []
    for name, w in (("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.gate_up), ("down", layer.down),
                    ("lm_head", pack(model.lm_head))):
        plain = dense(w)
        copies = max(2, int(110e6 // (plain.numel() * plain.element_size())))
        ws = [PackedWeight(plain.clone()) if isinstance(w, PackedWeight) else plain.clone() for _ in range(copies)]
        x = torch.randn(1, plain.shape[1]).to(plain.dtype)
        best = min(_timed(lambda x=x, ws=ws: [linear(x, c) for c in ws]) for _ in range(3)) / copies
        out.append((name, tuple(plain.shape), best * 1e6, plain.numel() * plain.element_size() / best / 1e9))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=12, help="operators listed")
    ap.add_argument("--compile", action="store_true",
                    help="the compiled one-request forward (runtime/compiled.py), as `dspark serve` runs it")
    ap.add_argument("--kernels", action="store_true",
                    help="with --compile: each kernel and library call inside the compiled graph in the "
                         "operator table (inductor's kernel profiling), not the graph as one entry")
    args = ap.parse_args()
    if args.kernels and not args.compile:
        ap.error("--kernels needs --compile")
    torch.set_num_threads(args.threads)
    target = load_target(None, dtype=args.dtype)
    if args.compile:
        if args.kernels:
            compiled.CONFIG = {**compiled.CONFIG, "cpp.enable_kernel_profile": True}
        print(target.model.compile())
    prompt = encode_prompt(target.tokenizer, load_prompts("gsm8k", 1)[0], chat=True)
    engine_steps(target.model, prompt, 32)      # warm-up
    runs = [engine_steps(target.model, prompt, args.max_new_tokens) for _ in range(3)]
    step, fwd = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    print(f"engine step {1e3 * step:.2f} ms ({1 / step:.1f} tok/s), of which the target's forward "
          f"{1e3 * fwd:.2f} ms, outside it {1e3 * (step - fwd):.2f} ms")
    ops = by_operator(target.model, prompt, args.max_new_tokens)
    whole = sum(r[1] for r in ops)
    print(f"by operator (self CPU, per step; profiled steps run slower: {whole:.2f} ms in all):")
    for name, ms, calls in ops[:args.top]:
        print(f"  {name:40s} {ms:6.2f} ms  {100 * ms / whole:4.1f} %  {calls:4d} calls")
    print(f"memory bandwidth (sum over 270 MB): {bandwidth(args.threads):.1f} GB/s")
    for name, shape, us, gbs in products(target.model):
        print(f"  one-row product {name:8s} {str(shape):14s} {us:7.0f} us  {gbs:5.1f} GB/s")


if __name__ == "__main__":
    main()
