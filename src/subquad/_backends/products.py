"""What the half-precision GEMMs do natively, asked once per process: whether the tiles (and the
fused CPU kernel) can multiply bfloat16 or float16 operands at speed on this CPU, or must convert
them to float32 first; and whether a GPU writes float32 products from half operands in one GEMM
(:func:`widening_products`). :func:`product` is the tiles' one GEMM call."""

from __future__ import annotations

import math
import platform
import time
from typing import Dict, NamedTuple, Optional

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


class CpuFeatures(NamedTuple):
    """The CPU's units that subquad's choices depend on, from torch's own probes (asked once per
    process by :func:`cpu_features`). Tests state the machine they assume by replacing this record
    (tests/_machine.py), never by reading the CPU they happen to run on."""

    amx_tiles: bool
    """AMX tiles: torch's fused CPU kernel multiplies bfloat16 on them (oneDNN's brgemm)."""
    avx512_bf16: bool
    """AVX512-BF16 dot products (bfloat16 operands, float32 sums)."""


def cpu_features() -> CpuFeatures:
    """This CPU's :class:`CpuFeatures`, asked once per process."""
    global _CPU
    if _CPU is None:
        _CPU = CpuFeatures(
            amx_tiles=_torch_probe("_is_amx_tile_supported"), avx512_bf16=_torch_probe("_is_avx512_bf16_supported")
        )
    return _CPU


_CPU: Optional[CpuFeatures] = None


def _torch_probe(name: str) -> bool:
    return bool(getattr(torch.cpu, name, lambda: False)())


def native_bf16_products() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX512-BF16): its bfloat16 GEMM then
    runs several times faster than its float32 one (:func:`cpu_features`)."""
    cpu = cpu_features()
    return cpu.amx_tiles or cpu.avx512_bf16


def native_fp16_products() -> bool:
    """Whether this CPU's float16 GEMM runs at its float32 speed or better: where it is emulated
    the CPU flash kernel's float16 backward runs several times slower than its float32 one
    (docs/benchmarks/half.md). On x86 it is read off the CPU's
    flags, as torch's own dispatch decides it (oneDNN's float16 GEMM needs AVX512-FP16 or
    AMX-FP16); elsewhere the two GEMMs are timed once per process, interleaved, and the verdict
    needs a :data:`FP16_EMULATED_SLOWDOWN` gap, far outside timing noise."""
    global _NATIVE_FP16
    if _NATIVE_FP16 is None:
        known = _x86_fp16_gemm()
        if known is None:
            with _python_dispatch._disable_current_modes():  # real tensors under a FakeTensorMode
                known = _fp16_gemm_slowdown() < FP16_EMULATED_SLOWDOWN
        _NATIVE_FP16 = known
    return _NATIVE_FP16


_NATIVE_FP16: Optional[bool] = None
FP16_EMULATED_SLOWDOWN = 3.0
"""A float16 GEMM this many times slower than the float32 one is taken for emulated."""


def _x86_fp16_gemm() -> Optional[bool]:
    """Whether an x86 CPU has AVX512-FP16 or AMX-FP16 (torch's ``use_mkldnn_fp16_matmul``); None
    off x86, or where the flags cannot be read."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if _torch_probe("_is_amx_fp16_supported"):
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else "avx512_fp16" in flags.split()


def _fp16_gemm_slowdown() -> float:
    """The float16 GEMM's time over the float32 one's: each the best of rounds that alternate
    between them, so that a busy spell slows both."""
    a = {dtype: torch.ones(4, 64, 64, dtype=dtype) for dtype in (torch.float32, torch.float16)}
    best = dict.fromkeys(a, math.inf)
    for x in a.values():
        torch.bmm(x, x)  # the first call picks the kernel
    for _ in range(5):
        for dtype, x in a.items():
            t0 = time.perf_counter()
            torch.bmm(x, x)
            best[dtype] = min(best[dtype], time.perf_counter() - t0)
    return max(best[torch.float16], 1e-9) / max(best[torch.float32], 1e-9)


def describe_cpu() -> str:
    """What ``subquad info`` says of the CPU's units: those its choices depend on."""
    cpu = cpu_features()
    units = [name for name, has in (("AMX tiles", cpu.amx_tiles), ("AVX512-BF16", cpu.avx512_bf16)) if has]
    bf16 = "bfloat16 products native" if native_bf16_products() else "bfloat16 products on float32"
    fp16 = "float16 GEMMs native" if native_fp16_products() else "float16 GEMMs emulated (run on float32 copies)"
    return f"{', '.join(units) or 'neither AMX nor AVX512-BF16'}; {bf16}; {fp16}"


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (torch's fused CPU kernel then multiplies bfloat16 on them)."""
    return cpu_features().amx_tiles


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
