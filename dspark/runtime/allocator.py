"""Host memory allocator settings for decoding on CPUs.

Each decoding step allocates the same handful of large temporaries (logits and probabilities over
the vocabulary: 8 rows x 49k tokens of fp32 is 1.5 MB). glibc serves allocations above its mmap
threshold (128 KB at start) with fresh ``mmap`` pages and unmaps them when freed, so every step
pays a page fault per 4 KB of every such tensor, which can take longer than the softmax that
fills it. Raising the mmap threshold to its maximum
(32 MB on 64-bit glibc) and keeping freed heap memory (trim threshold) makes those buffers reuse
the same, already mapped, heap memory: what tcmalloc or jemalloc preloaded would do, without a
preload. The process keeps up to the trim threshold of freed memory mapped; weights and caches
(larger than 32 MB) are mapped and released as before.

Kept freed memory is handed back to the system (``release_memory``: glibc's ``malloc_trim``)
where a process stops needing it: after a target is loaded (the loader's temporaries: 340 MB for
the bundled target) and when a server goes idle after serving (a heavy request's temporaries).

Only on Linux with glibc; ``DSPARK_MALLOC=default`` leaves the allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 256 * 1024 * 1024

_done = False


def tune_allocator() -> bool:
    """Apply the settings once per process; True if they are in effect."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux") or os.environ.get("DSPARK_MALLOC", "") == "default":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):   # not glibc (e.g. musl): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    _done = ok
    return ok


def release_memory() -> bool:
    """Hand the heap's free memory back to the system (glibc's ``malloc_trim(0)``); True if it
    released any. Takes milliseconds (it walks the heap): after loading, or when idle."""
    if not sys.platform.startswith("linux") or os.environ.get("DSPARK_MALLOC", "") == "default":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):   # not glibc
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))
