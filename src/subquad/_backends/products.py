"""What this CPU's half-precision GEMMs do natively, asked once per process: whether the tiles
(and the fused CPU kernel) can multiply bfloat16 or float16 operands at speed, or must convert
them to float32 first."""

from __future__ import annotations

import math
import time
from typing import Optional

import torch
from torch.utils import _python_dispatch


def native_bf16_products() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX512-BF16): its bfloat16 GEMM then
    runs at 2-3x (AVX512-BF16) to 10x (AMX) its float32 rate. Asked once per process."""
    global _NATIVE_BF16
    if _NATIVE_BF16 is None:
        probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
        _NATIVE_BF16 = any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)
    return _NATIVE_BF16


_NATIVE_BF16: Optional[bool] = None


def native_fp16_products() -> bool:
    """Whether this CPU's float16 GEMM runs at its float32 speed or better (AVX512-FP16, AMX-FP16,
    Arm's FP16 arithmetic). torch has no query for all of these, so the two GEMMs are timed once
    per process on a small product: where float16 is emulated it ran 26x slower than float32 on
    the 2-core CPU (AVX512-BF16, no FP16), and the CPU flash kernel's float16 backward 7.6x
    slower than its float32 one. The verdict needs a 3x gap, far outside timing noise."""
    global _NATIVE_FP16
    if _NATIVE_FP16 is None:
        with _python_dispatch._disable_current_modes():  # real tensors under a FakeTensorMode
            _NATIVE_FP16 = _fp16_gemm_slowdown() < FP16_EMULATED_SLOWDOWN
    return _NATIVE_FP16


_NATIVE_FP16: Optional[bool] = None
FP16_EMULATED_SLOWDOWN = 3.0
"""A float16 GEMM this many times slower than the float32 one is taken for emulated."""


def _fp16_gemm_slowdown() -> float:
    times = {}
    for dtype in (torch.float32, torch.float16):
        a = torch.ones(4, 64, 64, dtype=dtype)
        torch.bmm(a, a)  # the first call picks the kernel
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            torch.bmm(a, a)
            best = min(best, time.perf_counter() - t0)
        times[dtype] = max(best, 1e-9)
    return times[torch.float16] / times[torch.float32]


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (torch's fused CPU kernel then multiplies bfloat16 on them)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
