"""Prefix caching: a new request whose prompt starts like what a free cache slot still holds takes
that slot and prefills only the rest.

A finished request leaves its keys and values in its slot (freeing a slot erases nothing). This
index remembers which tokens those entries are, and, for drafters that condition on target features,
the features of the same positions, so that the drafter sees a reused prefix exactly as a prefilled
one. It is vLLM's automatic prefix caching at the granularity of llama.cpp's server (one cached
sequence per free slot, matched on the longest common prefix): a shared system prompt, a few-shot
preamble or a conversation's earlier turns are computed once. The keys and values are the same
computation on the same tokens, so the output's distribution does not change.

A request that asks for its prompt's log probabilities needs every prompt row and takes no prefix.
At least the prompt's last token is always run: its logits give the first output token.
"""

from __future__ import annotations

import numpy as np
import torch


class PrefixCache:
    def __init__(self, num_slots: int, max_len: int, *, min_match: int = 16):
        self.max_len = max_len
        self.min_match = max(1, min_match)
        self.held: list[np.ndarray] = [np.empty(0, np.int64)] * num_slots   # tokens of a free slot's entries
        self.features: torch.Tensor | None = None   # [slots, max_len, width], allocated with the first features
        self.queries = 0     # prompt tokens of the requests that could take a prefix
        self.hits = 0        # of which found in a slot

    def choose(self, free: list[int], prompt: list[int], reusable: bool = True) -> tuple[int, int]:
        """(slot, how many of the prompt's first tokens its entries already hold) for a new request:
        the free slot with the longest common prefix when that is at least ``min_match`` tokens, else
        the lowest free slot (requests in a compact range of slots batch their attention best) and 0."""
        best, best_n = min(free), 0
        if reusable:
            self.queries += len(prompt)
            p = np.asarray(prompt[:-1], dtype=np.int64)     # the last prompt token always runs
            for slot in free:
                held = self.held[slot]
                m = min(len(held), len(p))
                if m <= best_n:
                    continue
                diff = np.flatnonzero(held[:m] != p[:m])
                n = int(diff[0]) if diff.size else m
                if n > best_n or (n == best_n and slot < best):
                    best, best_n = slot, n
            if best_n < self.min_match:
                best, best_n = min(free), 0
            self.hits += best_n
        self.held[best] = np.empty(0, np.int64)     # the slot's entries are now the new request's
        return best, best_n

    def keep(self, slot: int, tokens: list[int]) -> None:
        """A request left its slot holding the keys and values of these tokens."""
        self.held[slot] = np.asarray(tokens[:self.max_len], dtype=np.int64)

    def store_features(self, slot: int, pos: int, feats: torch.Tensor) -> None:
        """Target features of positions pos .. of slot's sequence (kept for the slot's next user)."""
        if self.features is None:
            self.features = torch.empty(len(self.held), self.max_len, feats.shape[-1], dtype=feats.dtype,
                                        device=feats.device)
        self.features[slot, pos:pos + feats.shape[0]] = feats

    def prefix_features(self, slot: int, n: int) -> list[torch.Tensor]:
        """The stored features of slot's first n positions, as the list the drafter's context takes
        (a view: the slot's new user writes only the rows after them)."""
        if n == 0 or self.features is None:
            return []
        return [self.features[slot, :n]]
