"""glibc allocator settings for CPU serving.

By default glibc serves allocations above a (dynamic) threshold with fresh mmap()s and returns
them to the kernel on free, so every large activation or KV gather buffer page-faults its way in
again, step after step: measured on small-llava, a 7 MB gather took 4.6 ms instead of 0.5 ms and
a batch-32 decode step 225 ms instead of 143 ms. Raising the mmap and trim thresholds keeps
freed memory in the heap for reuse; the process keeps its peak footprint, which a server wants.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_memory(mmap_threshold: int = 1 << 30, trim_threshold: int = 1 << 31) -> bool:
    """Apply once per process; False where this is not glibc (nothing changes then)."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _done = bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
        )
    except (OSError, AttributeError):
        log.debug("mallopt unavailable; keeping the default allocator settings")
    return _done
