"""Tile-sized buffers that a pass of the ``matmul`` tiles reuses instead of allocating anew.

A fresh tensor of several MiB costs page faults on every allocation, about as much as one pass
over it; with a small fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_=131072``) every freed buffer
goes back to the OS, and so does every buffer a GEMM allocates for a strided operand. One
:class:`Scratch` serves a whole forward or backward (:func:`call_buffers`): bf16 forward
1x8x4096x64 went from about 81,000 page faults to 31,000 under that threshold.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import Tensor


class Scratch:
    """Named tile-sized buffers, each grown to the largest shape asked of it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: Dict[str, Tensor] = {}

    def get(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A contiguous tensor of ``shape`` (its contents are whatever the last use left)."""
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(n, dtype=dtype, device=self.device)
            self._buffers[name] = buf
        return buf[:n].view(shape)

    def copy(self, name: str, t: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
        """``t`` (cast to ``dtype``) copied into the buffer ``name``."""
        return self.get(name, tuple(t.shape), t.dtype if dtype is None else dtype).copy_(t)

    def contiguous(self, t: Tensor, name: str) -> Tensor:
        """``t``, or a contiguous copy of it in the buffer ``name``: torch's bfloat16 GEMM copies a
        strided operand (a tile of keys or values is a view) into a fresh buffer of its own."""
        return t if t.is_contiguous() else self.copy(name, t)

    def widened(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        """``t`` in ``dtype`` (the accumulators'), through a buffer rather than a new tensor."""
        return t if t.dtype == dtype else self.copy("widened", t, dtype)


_CALL = threading.local()


@contextlib.contextmanager
def call_buffers() -> Iterator[None]:
    """The scratch of one forward or backward, shared by its row blocks, on this thread; a call
    inside it (from a callback, say) gets its own. Freed when the pass ends."""
    outer = getattr(_CALL, "scratch", None)
    _CALL.scratch = {}
    try:
        yield
    finally:
        _CALL.scratch = outer


def pass_scratch(device: torch.device) -> Scratch:
    """The scratch of the pass this thread runs (:func:`call_buffers`), else a new one."""
    shared: Optional[Dict[torch.device, Scratch]] = getattr(_CALL, "scratch", None)
    if shared is None:
        return Scratch(device)
    if device not in shared:
        shared[device] = Scratch(device)
    return shared[device]
