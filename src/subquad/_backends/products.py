"""What the half-precision GEMMs do natively, asked once per process: whether the tiles (and the
fused CPU kernel) can multiply bfloat16 or float16 operands at speed on this CPU, or must convert
them to float32 first; and whether a GPU writes float32 products from half operands in one GEMM
(:func:`widening_products`). :func:`product` is the tiles' one GEMM call."""

from __future__ import annotations

import math
import time
from typing import Dict, Optional

import torch
from torch import Tensor
from torch.utils import _python_dispatch

HALF_PRODUCTS_MIN_HEAD_DIM = 32
"""The smallest head dim whose tiles take bfloat16 products. A bfloat16 product rounds each score
(minus its row's offset) to 8 bits, which puts an error of about 2e-3 into the forward's lse (a
float32 product: 1e-6; the fused kernel: 5e-5) and so into every P of the backward; with many
dimensions the gradients' own rounding dominates, with few it does not: head dim 1 (2x2x40x50,
scores up to ~15) gave dQ 2.4x SDPA's bfloat16 error against float64 (float32 products: 1.0x). And
at head dims below 32 the products are a small share of a tile's time: 1x8x2048xE bfloat16, two
threads, float32 / bfloat16 products 1.13 (E = 1), 1.00 (8), 0.74 (16), 0.83 (32), 0.98 (64)."""


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


def product(a: Tensor, b: Tensor, out: Tensor, alpha: float = 1.0) -> Tensor:
    """``alpha · a @ b`` written into ``out``; half-precision operands with a float32 ``out`` in
    one widening GEMM (:func:`widening_products`; ``beta=0`` ignores what ``out`` held)."""
    if a.dtype == out.dtype:
        return torch.bmm(a, b, out=out) if alpha == 1.0 else torch.baddbmm(out, a, b, beta=0.0, alpha=alpha, out=out)
    return torch.baddbmm(out, a, b, beta=0.0, alpha=alpha, out_dtype=out.dtype, out=out)


def widening_products(device: torch.device) -> bool:
    """Whether ``device`` multiplies float16/bfloat16 operands into a float32 result in one GEMM
    (``torch.baddbmm(..., out_dtype=torch.float32)``: CUDA, torch 2.8 on). The tiles then keep
    half-precision operands (no tile of keys or values converted) and get float32 scores, with
    float32 accumulation, from the tensor cores. Asked once per device type, by computing a small
    product exactly as the tiles do (``beta=0`` over a buffer of NaNs, an ``alpha``); any error or
    a wrong result means no. CPUs have no such kernel (they take :func:`native_bf16_products`),
    and MPS is left out until a Mac can check its rounding."""
    kind = device.type
    if kind != "cuda":
        return False
    if kind not in _WIDENING:
        _WIDENING[kind] = _widening_works(device)
    return _WIDENING[kind]


_WIDENING: Dict[str, bool] = {}


def _widening_works(device: torch.device) -> bool:
    try:
        with _python_dispatch._disable_current_modes():  # real tensors under a FakeTensorMode
            a = torch.arange(6, dtype=torch.float16, device=device).reshape(1, 2, 3)
            b = torch.ones(1, 3, 2, dtype=torch.float16, device=device)
            out = torch.full((1, 2, 2), math.nan, device=device)
            torch.baddbmm(out, a, b, beta=0.0, alpha=0.5, out_dtype=torch.float32, out=out)
            expected = torch.tensor([[[1.5, 1.5], [6.0, 6.0]]], device=device)
            return bool(torch.equal(out, expected))
    except (RuntimeError, NotImplementedError, TypeError, AssertionError):  # AssertionError: torch without CUDA
        return False
