"""Peak memory of one call, honestly: CUDA's allocator peak, or the process's RSS high-water mark.

The meters themselves (``CudaPeak``, ``RssPeak``, ``status_bytes``, ``synchronize``) are
``subquad._meters``, which the ComfyUI node "Which attention? (subquad)" reads too; this module
re-exports them, chooses one per device (``memory_meter``) and steadies glibc's allocator for the
timing process (``steady_malloc``).
"""

from __future__ import annotations

import ctypes
import os

import torch

from .. import _settings as settings
from .._meters import CudaPeak, RssPeak
from .._meters import status_bytes as status_bytes
from .._meters import synchronize as synchronize

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
STEADY_MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its moving threshold (64-bit)


def steady_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds (32 MiB and 64 MiB) for the timing process; returns
    whether they were set (False without glibc, where the environment already sets them, or with
    ``SUBQUAD_BENCH_STEADY_MALLOC=0``).

    Left to itself, glibc raises its mmap threshold to the size of each large block freed, so
    whether a 4-16 MiB score matrix comes from the heap (pages already there) or from a fresh
    mmap (a page fault per 4 KiB, every call) depends on what the process freed before. Two
    identical ``subquad bench`` runs, each in a fresh process, timed ``naive`` and ``sdpa-math`` up
    to 1.4x apart that way, and ``--compare`` called it a regression. Fixed at the threshold a
    long-running process converges to, every run times the steady state."""
    if not settings.switch("SUBQUAD_BENCH_STEADY_MALLOC"):  # asked not to (the test suite)
        return False
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, 2 * STEADY_MMAP_THRESHOLD)
    )


def memory_meter(device: torch.device):
    """A meter with start()/stop() -> bytes, or a string saying why there is none."""
    if device.type == "cuda":
        return CudaPeak(device)
    if device.type == "cpu":
        return RssPeak.available() or RssPeak()
    return f"no peak-memory counter on {device.type}"
