"""The compiled one-request forward (runtime/compiled.py) against the eager one, side by side in one
process (and the compiled one checking all of its guards against only those that tell its graphs
apart): one request decoding a row and verifying a block of 8 at a context of about 300 tokens,
the three paths alternated in rounds (median per path), plus how far the eager and compiled logits
are apart over a greedy decode.

    .venv/bin/python scripts/compiled_time.py --threads 2

Run it alone on the machine; building the two graphs takes 1 - 2 minutes on 2 cores.
"""

import argparse
import json
import statistics
import time

import torch

from dspark.runtime.loading import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target, "bf16")
    model = target.model
    compiled, message = model.build_graphs()
    if compiled.disabled:
        raise SystemExit(f"error: {message}")
    ids = torch.tensor(target.tokenizer("Write a story about a dragon who learns to code in Python.")["input_ids"])

    def use(on: bool) -> None:
        model.use_graphs(compiled if on else None)

    # how far apart: a greedy decode of 64 tokens on each path, logits compared step by step
    runs = {}
    for on in (False, True):
        use(on)
        cache = model.new_cache(1, 256)
        out = model.forward(ids, [(0, len(ids))], cache, logits_rows="last")
        toks, logits = [], []
        for _ in range(64):
            toks.append(int(out.logits[-1].argmax()))
            logits.append(out.logits[-1].float())
            out = model.forward(torch.tensor([toks[-1]]), [(0, 1)], cache)
        runs[on] = (toks, torch.stack(logits))
    same = sum(a == b for a, b in zip(runs[False][0], runs[True][0]))
    diff = (runs[False][1] - runs[True][1]).abs().max().item()

    # three paths: eager, compiled checking every guard, compiled checking only the guards that
    # tell its graphs apart (what warm_up leaves on: CompiledForward.warm)
    paths = ("eager", "compiled, all guards", "compiled")
    times: dict[tuple[str, int], list[float]] = {(p, n): [] for p in paths for n in (1, 8)}
    for _ in range(args.rounds):
        for path in paths:
            use(path != "eager")
            compiled.warm = path == "compiled"
            cache = model.new_cache(1, args.context + 64)
            model.forward(torch.zeros(args.context, dtype=torch.long), [(0, args.context)], cache, logits_rows=None)
            for n, calls in ((1, 40), (8, 10)):
                t = time.perf_counter()
                for _ in range(calls):
                    model.forward(torch.arange(n), [(0, n)], cache)
                    cache.truncate(0, args.context)
                times[(path, n)].append((time.perf_counter() - t) / calls)
    use(True)
    compiled.warm = True
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    result = {"compile": message, "greedy_tokens_equal": f"{same}/64", "max_logit_diff": diff,
              "ms": {f"{p} {n} row{'s' if n > 1 else ''}": round(v, 2) for (p, n), v in med.items()},
              "speedup_1_row": round(med[("eager", 1)] / med[("compiled", 1)], 3),
              "speedup_8_rows": round(med[("eager", 8)] / med[("compiled", 8)], 3),
              "guards_1_row": round(med[("compiled, all guards", 1)] / med[("compiled", 1)], 3),
              "guards_8_rows": round(med[("compiled, all guards", 8)] / med[("compiled", 8)], 3)}
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
