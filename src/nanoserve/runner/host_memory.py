"""Keeps freed host memory in the process, so the CPU path's per-step tensors do not page-fault.

PyTorch's CPU allocator takes large tensors from glibc's malloc, which maps them fresh from
the kernel and unmaps them when freed; every step then pays a page fault (and the zeroing of
a page) per 4 KiB of each activation and gathered K/V page. Raising malloc's mmap and trim
thresholds makes freed blocks go back to the heap and be reused by the next step instead."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
KEEP_BYTES = 1 << 30  # a block up to this size comes from (and returns to) the heap

_applied = False


def keep_freed_memory() -> bool:
    """Apply the thresholds once per process; False where the C library is not glibc."""
    global _applied
    if _applied:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    _applied = bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, 2 * KEEP_BYTES))
    if not _applied:
        logger.debug("mallopt refused the heap thresholds; large tensors stay mmap'ed")
    return _applied


# The CPU's default KV cache: a quarter of the memory available at start-up, at most this.
# Its pages are mapped as they are first written, so an idle cache costs nothing.
MAX_DEFAULT_KV_BYTES = 4 << 30


def available_memory_bytes() -> int:
    """MemAvailable (Linux), else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_cpu_kv_bytes() -> int:
    """The CPU KV cache's default budget (``kv_cache_memory`` overrides it)."""
    return min(MAX_DEFAULT_KV_BYTES, available_memory_bytes() // 4)
