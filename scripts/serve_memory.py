"""Resident memory of `dspark serve`'s start-up, step by step (imports, the target, the drafter, the
engine with its KV cache, the app), read from /proc/self/statm: docs/limits.md's memory table.

    python scripts/serve_memory.py --drafter auto --max-requests 16 --max-len 2048
"""

from __future__ import annotations

import argparse
import os


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--max-requests", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=2048)
    args = ap.parse_args()
    print(f"python: {resident_mb():.0f} MB")
    import dspark.server
    from dspark.drafters import load_drafter
    from dspark.engine import Engine
    from dspark.runtime.loading import load_target
    print(f"torch and dspark imported: {resident_mb():.0f} MB")
    target = load_target(None)
    print(f"the target: {resident_mb():.0f} MB")
    drafter = load_drafter(args.drafter, target)
    print(f"the drafter ({args.drafter}): {resident_mb():.0f} MB")
    engine = Engine(target.model, drafter, max_requests=args.max_requests, max_len=args.max_len,
                    block_size=drafter.block_size, eos_ids=target.eos_token_ids, isolate_failures=True)
    cache = sum(t.numel() * t.element_size() for part in (engine.cache.k, engine.cache.v)
                for t in (part if isinstance(part, list) else [part])) / 2 ** 20
    print(f"the engine: {resident_mb():.0f} MB (KV cache {cache:.0f} MB)")
    dspark.server.create_app(target, engine)
    print(f"the app: {resident_mb():.0f} MB")


if __name__ == "__main__":
    main()
