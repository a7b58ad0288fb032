"""Greedy identity checks: where two outputs first differ, and how close the target's top-2
logits are there (a near tie flips under different rounding, e.g. bf16 or another batch shape)."""

from __future__ import annotations

import torch


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def top2_gap(model, ids: list[int]) -> float:
    """Gap between the target's two largest logits for the token after ``ids``."""
    cache = model.new_cache(1, len(ids) + 1)
    out = model(torch.tensor(ids), [(cache.allocate(), len(ids))], cache, logits_rows="last")
    top = out.logits[0].float().topk(2).values
    return float(top[0] - top[1])
