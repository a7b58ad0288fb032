"""Prompt lookup (n-gram) drafting: copy what followed the last occurrence of the current suffix.

Like vLLM's ``ngram`` method and HF's ``prompt_lookup_num_tokens``: the drafter looks for the
longest suffix of the sequence (``max_ngram`` down to ``min_ngram`` tokens) that occurred
earlier, and proposes the tokens that followed its most recent occurrence among those whose next
token is the most frequent one after that suffix (a vote between earlier occurrences). A match of a single
token is weak evidence, so it proposes at most ``weak_match_tokens`` tokens then (verifying a
token costs a little even when the forward is bound by reading weights). The proposal is a
deterministic choice (point masses), so verification uses ``probs=None``.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import DraftContext, Drafter, Proposal


def lookup(tokens: np.ndarray, num_tokens: int, max_ngram: int = 5, min_ngram: int = 1,
           rule: str = "vote") -> tuple[np.ndarray, int]:
    """(continuation of the chosen earlier match of the longest matching suffix, its length).

    rule "vote": among the earlier occurrences of the suffix, the most recent one whose next token
    is the most frequent next token wins; "first": the earliest occurrence (HF's prompt lookup)."""
    n_tok = tokens.shape[0]
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = tokens[n_tok - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:n_tok - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            if rule == "first":
                start = int(hits[0]) + n
                return tokens[start:start + num_tokens], n
            hit = hits[-1]
            if hits.size > 1:
                nxt = tokens[hits + n]
                values, counts = np.unique(nxt, return_counts=True)
                winners = values[counts == counts.max()]
                hit = hits[np.flatnonzero(np.isin(nxt, winners))[-1]]
            start = int(hit) + n
            return tokens[start:start + num_tokens], n
    return tokens[:0], 0


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, block_size: int = 10, max_ngram: int = 5, min_ngram: int = 1,
                 weak_match_tokens: int = 5, rule: str = "vote"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if rule not in ("vote", "first"):
            raise ValueError(f"unknown lookup rule {rule!r}")
        self.rule = rule
        self.block_size = block_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.weak_match_tokens = weak_match_tokens

    def propose(self, contexts: list[DraftContext]) -> list[Proposal]:
        out = []
        for ctx in contexts:
            if ctx.num_draft <= 0:
                out.append(Proposal.empty())
                continue
            toks = np.asarray(ctx.tokens, dtype=np.int64)
            cont, n = lookup(toks, ctx.num_draft, self.max_ngram, self.min_ngram, self.rule)
            if n == 1:
                cont = cont[:self.weak_match_tokens]
            out.append(Proposal(torch.from_numpy(cont.copy())))
        return out
