"""Accelerator checks: the same contracts on CUDA (and MPS) when one is present; skipped elsewhere.

No accelerator was available while these were written: they state what must hold there and are
meant to be run first on a machine that has one (``python -m pytest -m gpu``).
"""

from __future__ import annotations

import platform
from typing import Optional, Tuple

import pytest
import torch
import torch.nn.functional as F

import subquad
from conftest import assert_close_to_golden, naive_attention, to64

DEVICES = []
if torch.cuda.is_available():
    DEVICES.append("cuda")
if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
    DEVICES.append("mps")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not DEVICES, reason="needs a CUDA or MPS device")]


def macos_version() -> Tuple[int, ...]:
    """``(14, 2)`` for macOS 14.2; ``()`` off macOS. Compared as numbers: "9.0" > "14.0" as text."""
    release = platform.mac_ver()[0]
    return tuple(int(part) for part in release.split(".") if part.isdigit())


def unsupported_dtype(device: str, dtype: torch.dtype) -> Optional[str]:
    """Why ``device`` cannot run ``dtype`` here, or None: MPS takes bfloat16 from macOS 14 on."""
    if device == "mps" and dtype == torch.bfloat16 and macos_version() < (14,):
        return f"MPS has no bfloat16 before macOS 14 (this is macOS {platform.mac_ver()[0] or 'unknown'})"
    return None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend,chunk", [("auto", None), ("matmul", (64, 96)), ("matmul", None)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_matches_golden(device, dtype, backend, chunk, causal):
    why = unsupported_dtype(device, dtype)
    if why:
        pytest.skip(why)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 64, generator=g) * 3 for _ in range(3))
    q, k, v = (t.to(device, dtype) for t in (q, k, v))
    out = subquad.attention(q, k, v, is_causal=causal, backend=backend, chunk_size=chunk)
    golden = naive_attention(*to64(q.cpu(), k.cpu(), v.cpu()), is_causal=causal)
    # The reference is what torch's SDPA computes for half inputs: float32 scores, the output
    # rounded once. A same-dtype naive reference rounds the scores too, and hid tiles 10x less exact.
    reference = naive_attention(*(t.cpu().float() for t in (q, k, v)), is_causal=causal).to(dtype)
    assert out.device.type == device and out.dtype == dtype
    assert_close_to_golden(out.cpu(), golden, reference)


@pytest.mark.parametrize("device", DEVICES)
def test_gqa_mask_and_gradients(device):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 8, 200, 32, generator=g).to(device).requires_grad_()
    k = torch.randn(1, 2, 250, 32, generator=g).to(device).requires_grad_()
    v = torch.randn(1, 2, 250, 32, generator=g).to(device).requires_grad_()
    mask = (torch.rand(200, 250, generator=g) > 0.2).to(device)
    out = subquad.attention(q, k, v, attn_mask=mask, enable_gqa=True, chunk_size=(64, 64))
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    golden = naive_attention(q64, k64, v64, attn_mask=mask.cpu(), enable_gqa=True)
    golden_grads = torch.autograd.grad(golden.square().sum(), (q64, k64, v64))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert_close_to_golden(out.cpu(), golden, ref.cpu())
    for name, a, gold, b in zip("qkv", grads, golden_grads, ref_grads):
        assert_close_to_golden(a.cpu(), gold, b.cpu(), name=f"d{name}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the allocator's peak)")
def test_cuda_peak_within_budget():
    q, k, v = (torch.randn(1, 8, 8192, 64, device="cuda") for _ in range(3))
    budget = 64 << 20
    plan = subquad.explain(q, k, v, memory_budget=budget, backend="matmul")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = subquad.attention(q, k, v, memory_budget=budget, backend="matmul")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    out_bytes = out.numel() * out.element_size()
    assert peak <= budget + out_bytes, (peak, plan)
    assert plan.predicted_peak_bytes >= 0.8 * (peak - out_bytes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention's Triton kernel)")
def test_cuda_callbacks_through_compiled_flex_and_the_tiles():
    # Inference with callbacks takes the compiled path on CUDA (sdpa refuses callbacks); with
    # gradients, the tiles. Both must match the reference, and the flex call stay in budget.
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 8, 2048, 64, generator=g).to("cuda", torch.float16) for _ in range(3))
    slopes = subquad.mods.alibi_slopes(8, device="cuda")
    kw = dict(score_mod=lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki), mask_mod=lambda b, h, qi, ki: ki <= qi)
    with torch.no_grad():
        plan = subquad.explain(q, k, v, allow_compile=True, memory_budget="256MiB", **kw)
        assert plan.backend == "flex", plan
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = subquad.attention(q, k, v, allow_compile=True, memory_budget="256MiB", **kw)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
    assert peak <= 256 << 20, (peak, plan)
    cpu_slopes = slopes.cpu().double()
    golden = naive_attention(
        *to64(q.cpu(), k.cpu(), v.cpu()),
        score_mod=lambda s, b, h, qi, ki: s - cpu_slopes[h] * (qi - ki),
        mask_mod=kw["mask_mod"],
    )
    assert (out.cpu().double() - golden).abs().max().item() < 5e-3
    qg = q.float().requires_grad_()
    out = subquad.attention(qg, k.float(), v.float(), allow_compile=True, **kw)
    assert subquad.explain(qg, k.float(), v.float(), allow_compile=True, **kw).backend == "matmul"
    (dq,) = torch.autograd.grad(out.square().sum(), qg)
    assert torch.isfinite(dq).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (its widening half-precision GEMMs)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("callbacks", [False, True], ids=["plain", "alibi-causal"])
def test_cuda_half_tiles_take_widening_products(dtype, callbacks):
    # On CUDA the tiles multiply half-precision operands into float32 scores (no float32 copies of
    # q, k and v); forward and gradients must stay as exact as SDPA's against float64, also with a
    # score_mod (the calls CUDA sends to the tiles in training) and rows whose raw q·kᵀ leaves fp16.
    from subquad._backends.products import widening_products

    if not widening_products(torch.device("cuda")):
        pytest.skip(f"torch {torch.__version__} has no out_dtype GEMM on CUDA (torch 2.8 on)")
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(1, 4, 333, 59, generator=g) * 3 for _ in range(3)]
    base[0][0, 0, :4] *= 1000  # |q·k| beyond fp16's 65504 for these rows; the scale brings it back
    grad = torch.randn(1, 4, 333, 59, generator=g)
    slopes = subquad.mods.alibi_slopes(4, device="cuda")
    kw = dict(score_mod=lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki), mask_mod=lambda b, h, qi, ki: ki <= qi)
    kw = kw if callbacks else {}
    xs = [t.to("cuda", dtype).requires_grad_() for t in base]
    out = subquad.attention(*xs, backend="matmul", chunk_size=(128, 96), **kw)
    got = [out, *torch.autograd.grad(out, xs, grad.to("cuda", dtype))]
    x64 = [t.double().requires_grad_() for t in base]
    cpu_slopes = slopes.cpu().double()
    kw64 = dict(score_mod=lambda s, b, h, qi, ki: s - cpu_slopes[h] * (qi - ki), mask_mod=kw["mask_mod"]) if kw else {}
    golden = naive_attention(*x64, **kw64)
    want = [golden, *torch.autograd.grad(golden, x64, grad.double())]
    # SDPA's half-precision error on the same inputs (ALiBi and causal as a float mask).
    xr = [t.to("cuda", dtype).requires_grad_() for t in base]
    mask = None
    if kw:
        i = torch.arange(333, device="cuda")
        bias = -slopes.view(4, 1, 1) * (i.view(-1, 1) - i.view(1, -1))
        mask = bias.masked_fill(i.view(1, -1) > i.view(-1, 1), float("-inf")).to(dtype)
    ref = F.scaled_dot_product_attention(*xr, attn_mask=mask)
    refs = [ref, *torch.autograd.grad(ref, xr, grad.to("cuda", dtype))]
    for name, a, gold, b in zip(("output", "dq", "dk", "dv"), got, want, refs):
        assert a.dtype == dtype
        assert_close_to_golden(a.detach().cpu(), gold.detach(), b.detach().cpu(), name=name)
