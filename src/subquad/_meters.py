"""Memory of one call, measured honestly: CUDA's allocator peak, the process's RSS high-water mark,
or (MPS, which keeps no peak) the driver's memory after the call.

CUDA: ``max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was allocated
before. CPU: ``VmHWM`` after writing ``5`` to ``/proc/self/clear_refs``, minus the RSS before
(Linux; the processes that measure run with ``MALLOC_MMAP_THRESHOLD_=131072`` so that freed
tensors leave the process). MPS: ``driver_allocated_memory`` after the call, minus the same after emptying the cache.

Shared by ``subquad bench`` (``bench/meters.py`` re-exports these names) and the ComfyUI node
"Which attention? (subquad)" (through ``_for_wings``). The rest of the package may use
``synchronize``, ``status_bytes``, ``CudaPeak``, ``RssPeak`` and ``MpsAfter``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from typing import Optional

import torch


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


def status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    raise OSError(f"{key} not in /proc/self/status")


class RssPeak:
    """Peak resident set size during a call, above the RSS at its start (Linux)."""

    method = "cpu VmHWM - VmRSS"

    def __init__(self) -> None:
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


class MpsAfter:
    """The MPS driver's memory after a call, above its memory at the start with the cache emptied:
    not a peak (MPS keeps no peak counter), so a call that frees what it took reads low."""

    method = "mps driver_allocated_memory after the call"

    def __init__(self) -> None:
        self.base = 0

    def start(self) -> None:
        torch.mps.synchronize()
        torch.mps.empty_cache()
        self.base = int(torch.mps.driver_allocated_memory())

    def stop(self) -> int:
        torch.mps.synchronize()
        return max(0, int(torch.mps.driver_allocated_memory()) - self.base)
