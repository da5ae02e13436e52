"""Peak memory of one call, honestly: CUDA's allocator peak, or the process's RSS high-water mark.

CUDA: ``max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was allocated
before. CPU: ``VmHWM`` after writing ``5`` to ``/proc/self/clear_refs``, minus the RSS before (the
worker runs with ``MALLOC_MMAP_THRESHOLD_=131072`` so that freed tensors leave the process).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from typing import Optional

import torch

from .. import _settings as settings


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class CudaPeak:
    """Peak of the CUDA caching allocator's allocated bytes during a call, above the start."""

    method = "cuda max_memory_allocated"

    def __init__(self, device: torch.device):
        self.device = device
        self.base = 0

    def start(self) -> None:
        synchronize(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self) -> int:
        synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base


def _malloc_trim() -> None:
    """Hand free heap pages back to the OS (glibc), so that a call reusing them shows in RSS."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL(None).malloc_trim(0)


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


def status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    raise OSError(f"{key} not in /proc/self/status")


class RssPeak:
    """Peak resident set size during a call, above the RSS at its start (Linux)."""

    method = "cpu VmHWM - VmRSS"

    def __init__(self):
        self.base = 0

    @staticmethod
    def available() -> Optional[str]:
        """None when usable, else why not."""
        try:
            status_bytes("VmHWM")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError as exc:
            return f"cannot reset the RSS high-water mark: {exc}"
        return None

    def start(self) -> None:
        gc.collect(1)  # young cycles only: a full collection costs ~0.2 s with torch loaded
        _malloc_trim()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5 resets VmHWM to the current RSS
        self.base = status_bytes("VmRSS")

    def stop(self) -> int:
        return max(0, status_bytes("VmHWM") - self.base)


def memory_meter(device: torch.device):
    """A meter with start()/stop() -> bytes, or a string saying why there is none."""
    if device.type == "cuda":
        return CudaPeak(device)
    if device.type == "cpu":
        return RssPeak.available() or RssPeak()
    return f"no peak-memory counter on {device.type}"


# ------------------------------------------------------------------------------ errors
