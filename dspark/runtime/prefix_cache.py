"""Prefix caching: a new request whose prompt starts like what a cache slot already holds prefills
only the rest (its entries brought to the lowest free slot from the free slot that holds them, or
copied from a request in flight's slot).

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
from typing import NamedTuple

import numpy as np
import torch


class Move(NamedTuple):
    """Entries to move between the new request's slot and another free slot before it starts, in
    place (nothing is erased): the slot's first ``out`` entries go to ``other``, ``other``'s first
    ``into`` come to the slot."""
    other: int
    out: int
    into: int


class Placement(NamedTuple):
    slot: int                   # where the request goes: always the lowest free slot
    cached: int                 # how many of the prompt's first tokens are there once ``moves`` are done
    source: int | None          # a request in flight's slot to copy those entries from, or None
    moves: tuple[Move, ...]     # to make first, in order


class PrefixCache:
    def __init__(self, num_slots: int, max_len: int, *, min_match: int = 16):
        self.max_len = max_len
        self.min_match = max(1, min_match)
        self.held: list[np.ndarray] = [np.empty(0, np.int64)] * num_slots   # tokens of a free slot's entries
        self.prompt_len = [0] * num_slots   # how many of them were the prompt of the request that left them
        self.used = [-1] * num_slots        # when a request left them (least recently used goes first)
        self._clock = 0
        self.features: torch.Tensor | None = None   # [slots, max_len, width], allocated with the first features
        self.queries = 0     # prompt tokens of the requests that could take a prefix
        self.hits = 0        # of which found in a slot

    def choose(self, free: list[int], prompt: list[int], reusable: bool = True,
               running: Sequence = ()) -> Placement | None:
        """Where a new request goes, how much of its prompt is there already and what to move
        first, or None to wait a step.

        The request always takes the lowest free slot, so the requests of a step stay in a compact
        range of slots that their batched attention reads as one view. The free slots are the
        cache, one sequence each as llama.cpp's server slots. ``running``: (slot, the tokens of
        its computed entries, its prompt if it is still prefilling else None) of each request in
        flight. The longest common prefix of at least ``min_match`` tokens wins. Found in another
        free slot, it comes to the lowest: when it covers that slot's prompt, the two slots
        exchange their entries (the old continuation of the same prompt is dropped); when it is a
        shared preamble only, it is copied and the other sequence stays. Found in a request in
        flight's slot, it is copied (a copy costs far less than a prefill). Whatever the lowest
        slot held that the request would overwrite moves to the free slot used least recently, so
        that prompts seen one at a time (a benchmark's, a client's retries) are all still there
        for a burst that brings them back. When a request still prefilling will hold
        ``min_match`` more of the prompt than any slot now does (n choices of one prompt, a burst
        behind one system prompt), None: the request waits for that prefill instead of repeating
        it."""
        home = min(free)
        p = np.asarray(prompt[:-1], dtype=np.int64)     # the last prompt token always runs
        best = (0, home, None)                          # (tokens, slot, source)
        pending = 0
        if reusable:
            for slot in free:
                n = _common(self.held[slot], p)
                if n > best[0] or (n == best[0] and n and slot < best[1]):
                    best = (n, slot, None)
            for slot, computed, prefilling in running:
                n = _common(computed[:len(p)], p)
                if n > best[0]:
                    best = (n, home, slot)
                if prefilling is not None:
                    pending = max(pending, _common(prefilling[:len(p)], p))
        if pending >= best[0] + self.min_match:
            return None
        n, found, source = best if best[0] >= self.min_match else (0, home, None)
        same_prompt = n > 0 and source is None and n >= self.prompt_len[found] - 1
        moves: list[Move] = []
        if found != home and same_prompt:
            moves.append(self._move(home, found, out=len(self.held[home]), into=n))
            self.held[home], self.held[found] = self.held[found], self.held[home]
            self.used[home], self.used[found] = self.used[found], self.used[home]
            self.prompt_len[home], self.prompt_len[found] = self.prompt_len[found], self.prompt_len[home]
        else:
            if not (found == home and same_prompt):     # the lowest slot's sequence would be overwritten
                moves += self._save(home, [s for s in free if s not in (home, found)])
            if found != home:
                moves.append(self._move(home, found, out=0, into=n))
        if reusable:
            self.queries += len(prompt)
            self.hits += n
        self.held[home] = np.empty(0, np.int64)     # the slot's entries are now the new request's
        return Placement(home, n, source, tuple(moves))

    def _save(self, slot: int, others: list[int]) -> list[Move]:
        """Copy ``slot``'s sequence to the free slot of ``others`` used least recently, if it is
        more recent than that slot's and long enough to be matched."""
        if len(self.held[slot]) < self.min_match or not others:
            return []
        lru = min(others, key=lambda s: self.used[s])
        if self.used[lru] >= self.used[slot]:
            return []
        self.held[lru] = self.held[slot]
        self.used[lru], self.prompt_len[lru] = self.used[slot], self.prompt_len[slot]
        return [self._move(slot, lru, out=len(self.held[slot]), into=0)]

    def _move(self, slot: int, other: int, out: int, into: int) -> Move:
        """The features' part of a Move (the caller moves the held tokens)."""
        if self.features is not None:
            moved = self.features[slot, :out].clone()
            self.features[slot, :into] = self.features[other, :into]
            self.features[other, :out] = moved
        return Move(other, out, into)

    def keep(self, slot: int, tokens: list[int], prompt_len: int | None = None) -> None:
        """A request left its slot holding the keys and values of these tokens, the first
        ``prompt_len`` of them its prompt (default: all)."""
        self.held[slot] = np.asarray(tokens[:self.max_len], dtype=np.int64)
        self.prompt_len[slot] = len(self.held[slot]) if prompt_len is None else min(prompt_len, len(self.held[slot]))
        self._clock += 1
        self.used[slot] = self._clock

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
