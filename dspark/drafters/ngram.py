"""Prompt lookup (n-gram) drafting: copy what followed the last occurrence of the current suffix.

Like vLLM's ``ngram`` method and HF's ``prompt_lookup_num_tokens``: the drafter looks for the
longest suffix of the sequence (``max_ngram`` down to ``min_ngram`` tokens) that occurred
earlier, and proposes the tokens that followed its most recent occurrence. The proposal is a
deterministic choice (point masses), so verification uses ``probs=None``.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import DraftContext, Drafter, Proposal


def lookup(tokens: np.ndarray, num_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> np.ndarray:
    """Continuation of the most recent earlier match of the longest matching suffix."""
    n_tok = tokens.shape[0]
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = tokens[n_tok - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:n_tok - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + num_tokens]
    return tokens[:0]


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, block_size: int = 10, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.block_size = block_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, contexts: list[DraftContext]) -> list[Proposal]:
        out = []
        for ctx in contexts:
            if ctx.num_draft <= 0:
                out.append(Proposal.empty())
                continue
            toks = np.asarray(ctx.tokens, dtype=np.int64)
            cont = lookup(toks, ctx.num_draft, self.max_ngram, self.min_ngram)
            out.append(Proposal(torch.from_numpy(cont.copy())))
        return out
