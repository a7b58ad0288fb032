"""Preallocated key/value cache: one slot per request, append, roll back, free.

Layout per layer: ``[slots, kv_heads, max_len, head_dim]`` so that a slot's first ``n`` entries
are one strided view ``k[slot, :, :n]`` that attention reads without a copy. Lengths are plain
Python ints: rolling back rejected draft tokens is one assignment, nothing is erased.
"""

from __future__ import annotations

import math
import mmap

import torch

from ..errors import DsparkError


class CacheFullError(DsparkError):
    """No free slot, or a request outgrew its slot."""


# Batch-invariant attention reads a row's keys up to a multiple of this (runtime.invariant), so a
# slot is allocated in whole buckets: the entries past max_len are never written and always masked.
KEY_BUCKET = 16


def zeros(shape: tuple[int, ...], count: int, dtype: torch.dtype, device: str | torch.device) -> list[torch.Tensor]:
    """``count`` zero tensors of ``shape``. On a CPU each is an anonymous memory map, whose pages
    the system hands out zeroed when first written: a server's cache for 16 requests of 2,048
    tokens of the bundled target is 1.5 GB, of which a short request touches a few MB, where
    ``torch.zeros`` writes, and so commits, all of it at start. Each its own mapping, not views of
    one block: a compiled graph's inputs that share storage are guarded on how they alias."""
    if torch.device(device).type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
    n = math.prod(shape)
    size = n * torch.empty((), dtype=dtype).element_size()
    if not size:
        return [torch.zeros(shape, dtype=dtype) for _ in range(count)]
    return [torch.frombuffer(mmap.mmap(-1, size), dtype=dtype, count=n).view(shape) for _ in range(count)]


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, num_slots: int,
                 max_len: int, dtype: torch.dtype, device: str | torch.device = "cpu"):
        shape = (num_slots, num_kv_heads, -(-max_len // KEY_BUCKET) * KEY_BUCKET, head_dim)
        # plain tensors even when made in inference mode (a drafter's cache made at its first
        # round): the compiled forwards' graphs are guarded on which kind their inputs are
        with torch.inference_mode(False):
            self.k = zeros(shape, num_layers, dtype, device)
            self.v = zeros(shape, num_layers, dtype, device)
        self.max_len = max_len
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))   # descending: pop() is the lowest

    @property
    def num_slots(self) -> int:
        return len(self.lengths)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_slots(self) -> list[int]:
        return list(self._free)

    def allocate(self, slot: int | None = None, length: int = 0) -> int:
        """The lowest free slot (or this free ``slot``): the requests of a step stay in a compact
        range of slots, which their batched attention reads as one view (runtime/attention.py).
        ``length``: how many of the entries the slot holds are kept (a reused prefix), else none."""
        if not self._free:
            raise CacheFullError("KV cache has no free slot")
        if slot is None:
            slot = self._free[-1]
        elif slot not in self._free:
            raise ValueError(f"slot {slot} is not free")
        if not 0 <= length <= self.max_len:
            raise ValueError(f"cannot keep {length} entries of a slot of {self.max_len}")
        self._free.remove(slot)
        self.lengths[slot] = length
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} is already free")
        self.lengths[slot] = 0
        self._free.append(slot)
        self._free.sort(reverse=True)

    def exchange(self, a: int, b: int, out: int, into: int) -> None:
        """Between two free slots: a's first ``out`` entries go to b and b's first ``into`` come to a,
        nothing erased (so ``into=0`` copies a to b, ``out=0`` b to a). Prefix caching moves cached
        sequences between free slots with it; their lengths stay 0."""
        if a == b or a not in self._free or b not in self._free:
            raise ValueError(f"slots {a} and {b} must be two free slots")
        for cache in (self.k, self.v):
            for t in cache:
                moved = t[a, :, :out].clone()
                t[a, :, :into] = t[b, :, :into]
                t[b, :, :out] = moved

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Give ``dst`` the first n entries of ``src`` (a shared prefix; dst's length becomes n)."""
        if not 0 <= n <= self.lengths[src]:
            raise ValueError(f"slot {src} holds {self.lengths[src]} entries, not {n}")
        for k, v in zip(self.k, self.v):
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]
        self.lengths[dst] = n

    def truncate(self, slot: int, length: int) -> None:
        """Keep the first ``length`` entries of ``slot`` (roll back rejected tokens)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {length}")
        self.lengths[slot] = length

    def check_room(self, slot: int, extra: int) -> None:
        if self.lengths[slot] + extra > self.max_len:
            raise CacheFullError(
                f"sequence needs {self.lengths[slot] + extra} cache entries, slot holds {self.max_len}")
