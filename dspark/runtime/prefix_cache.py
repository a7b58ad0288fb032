"""Prefix caching: a new request whose prompt starts like what a cache slot already holds prefills
only the rest (taking that slot if it is free, copying its entries if a request in flight owns it).

A finished request leaves its keys and values in its slot (freeing a slot erases nothing). This
index remembers which tokens those entries are, and, for drafters that condition on target features,
the features of the same positions, so that the drafter sees a reused prefix exactly as a prefilled
one. It is vLLM's automatic prefix caching at the granularity of llama.cpp's server (one cached
sequence per free slot, matched on the longest common prefix), plus copies from the slots of
requests in flight: a shared system prompt, a few-shot preamble, a conversation's earlier turns or
the n choices of one prompt are computed once. The keys and values are the same
computation on the same tokens, so the output's distribution does not change.

A request that asks for its prompt's log probabilities needs every prompt row and takes no prefix.
At least the prompt's last token is always run: its logits give the first output token.
"""

from __future__ import annotations

from collections.abc import Sequence

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

    def choose(self, free: list[int], prompt: list[int], reusable: bool = True,
               running: Sequence = ()) -> tuple[int, int, int | None] | None:
        """Where a new request goes: (slot, how many of the prompt's first tokens are there already,
        the slot to copy those entries from or None), or None to wait a step.

        ``running``: (slot, the tokens of its computed entries, its prompt if it is still prefilling
        else None) of each request in flight. The longest common prefix of at least ``min_match``
        tokens wins: in a free slot the request takes that slot; in a request in flight's slot its
        entries are copied into the lowest free slot (a copy costs far less than a prefill). When a
        request still prefilling will hold ``min_match`` more of the prompt than any slot now does
        (n choices of one prompt, a burst behind one system prompt), None: the request waits for
        that prefill instead of repeating it. No prefix: the lowest free slot (requests in a
        compact range of slots batch their attention best) and 0."""
        lowest = min(free)
        if not reusable:
            self.held[lowest] = np.empty(0, np.int64)
            return lowest, 0, None
        p = np.asarray(prompt[:-1], dtype=np.int64)     # the last prompt token always runs
        best = (0, lowest, None)                        # (tokens, slot, source)
        for slot in free:
            n = _common(self.held[slot], p)
            if n > best[0] or (n == best[0] and n and slot < best[1]):
                best = (n, slot, None)
        pending = 0
        for slot, computed, prefilling in running:
            n = _common(computed[:len(p)], p)
            if n > best[0]:
                best = (n, lowest, slot)
            if prefilling is not None:
                pending = max(pending, _common(prefilling[:len(p)], p))
        if pending >= best[0] + self.min_match:
            return None
        n, slot, source = best if best[0] >= self.min_match else (0, lowest, None)
        self.queries += len(prompt)
        self.hits += n
        self.held[slot] = np.empty(0, np.int64)     # the slot's entries are now the new request's
        return slot, n, source

    def keep(self, slot: int, tokens: list[int]) -> None:
        """A request left its slot holding the keys and values of these tokens."""
        self.held[slot] = np.asarray(tokens[:self.max_len], dtype=np.int64)

    def store_features(self, slot: int, pos: int, feats: torch.Tensor) -> None:
        """Target features of positions pos .. of slot's sequence (kept for the slot's next user)."""
        if self.features is None:
            self.features = torch.empty(len(self.held), self.max_len, feats.shape[-1], dtype=feats.dtype,
                                        device=feats.device)
        self.features[slot, pos:pos + feats.shape[0]] = feats

    def copy_features(self, src: int, dst: int, n: int) -> None:
        if self.features is not None and n:
            self.features[dst, :n] = self.features[src, :n]

    def prefix_features(self, slot: int, n: int) -> list[torch.Tensor]:
        """The stored features of slot's first n positions, as the list the drafter's context takes
        (a view: the slot's new user writes only the rows after them)."""
        if n == 0 or self.features is None:
            return []
        return [self.features[slot, :n]]


def _common(a, b: np.ndarray) -> int:
    """Length of the common prefix of two token sequences."""
    m = min(len(a), len(b))
    if m == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:m], dtype=np.int64) != b[:m])
    return int(diff[0]) if diff.size else m
