"""The Triton kernels of the CUDA tiles (subquad._backends.triton_passes), run here in Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1``, set before Triton is imported, in a child
process): each against the eager passes it replaces, computed in float64, at awkward row lengths
(1, below, at and across a step of the kernel's row loop) and with rows that see nothing.

On a GPU the same kernels run compiled: tests/test_gpu.py checks whole calls there. Skipped
where Triton is not installed (CI installs it).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (pip install triton)")

_CHILD = textwrap.dedent(
    """
    import math
    import torch
    from subquad._backends import triton_passes as tp

    LOG2E = 1 / math.log(2)
    g = torch.Generator().manual_seed(0)
    worst = {}

    def note(name, got, want, tol):
        err = (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
        worst[name] = max(worst.get(name, 0.0), err)
        assert err <= tol, (name, err, tol)

    for half in (torch.float16, torch.bfloat16):
        for n in (1, 7, 1024, 1500, 2500):
            for unit in (1.0, LOG2E):
                rows, ev = 6, 19
                s = torch.randn(rows, n, generator=g) * 4
                s[1] = float("-inf")  # a row that sees nothing in this tile
                s[2, : n // 2] = float("-inf")
                m = torch.randn(rows, generator=g)
                m[1] = float("-inf")  # ... and has seen nothing before it
                m[3] = float("-inf")  # a row whose first visible tile this is
                l = torch.rand(rows, generator=g) + 0.5
                l[1] = l[3] = 0.0
                acc = torch.randn(rows, ev, generator=g)
                acc[1] = acc[3] = 0.0
                # The eager passes in float64.
                m_new = torch.maximum(m.double(), s.double().amax(-1))
                ref = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
                p_want = torch.exp2((s.double() - ref[:, None]) * unit)
                corr = torch.exp2((m.double() - ref) * unit)
                l_want = l.double() * corr + p_want.sum(-1)
                acc_want = acc.double() * corr[:, None]
                p = torch.full((rows, n), float("nan"), dtype=half)
                tp.softmax_rows(s, p, m, l, acc, unit)
                assert torch.equal(m.double(), m_new), (m, m_new)
                # One rounding: half an ulp, or for bfloat16 a whole one (the interpreter casts to
                # bfloat16 toward zero; compiled Triton rounds to nearest).
                eps = 2 ** -7 if half == torch.bfloat16 else 2 ** -11
                note("p", p, p_want, eps)
                note("l", l, l_want, 2e-5)  # a float32 sum, as the eager pass takes it
                note("acc", acc, acc_want, 1e-6)
                assert p[1].eq(0).all() and p[2, : n // 2].eq(0).all()

                # Backward: p = 2^((s - lse)·unit), dS = p (dP - D), scaled when rounded.
                lse = s.amax(-1) + torch.rand(rows, generator=g)  # at least each row's largest: p <= 1
                lse[1] = 0.0  # a row that sees nothing: its lse reads 0, its scores are -inf
                dp = torch.randn(rows, n, generator=g)
                d = torch.randn(rows, generator=g)
                pb_want = torch.exp2((s.double() - lse.double()[:, None]) * unit)
                ds_want = pb_want * (dp.double() - d.double()[:, None])
                p_h = torch.full((rows, n), float("nan"), dtype=half)
                ds_h = torch.full((rows, n), float("nan"), dtype=half)
                tp.softmax_grad_rows(s, dp, p_h, ds_h, lse, d, 0.125, unit)
                note("p (backward)", p_h, pb_want, eps)
                note("dS rounded and scaled", ds_h, ds_want * 0.125, eps)
                dp_copy = dp.clone()
                tp.softmax_grad_rows(s, dp_copy, p_h, dp_copy, lse, d, 0.125, unit)  # dS over dP, float32
                note("dS in float32", dp_copy, ds_want, 1e-6)
                assert p_h[1].eq(0).all() and dp_copy[1].eq(0).all()
    print("worst", worst)
    """
)


def test_the_triton_passes_compute_the_eager_passes():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "worst" in done.stdout


_CALLS_CHILD = textwrap.dedent(
    """
    import torch
    import subquad
    from subquad._inputs import Inputs
    from subquad._backends import matmul, triton_passes
    from conftest import assert_close_to_golden, naive_attention, to64

    # CUDA's choices on CPU tensors (tests/_devices.as_device), its widening GEMM by its definition,
    # and the Triton passes in the interpreter.
    Inputs.device_type = property(lambda self: "cuda")
    matmul.widening_products = lambda device: True
    exact = matmul.product

    def widening(a, b, out, alpha=1.0):
        if a.dtype == out.dtype:
            return exact(a, b, out, alpha)
        return torch.baddbmm(out, a.float(), b.float(), beta=0.0, alpha=alpha, out=out)

    matmul.product = widening
    calls = []
    real_fwd, real_bwd = triton_passes.softmax_rows, triton_passes.softmax_grad_rows
    triton_passes.softmax_rows = lambda *a: calls.append("fwd") or real_fwd(*a)
    triton_passes.softmax_grad_rows = lambda *a: calls.append("bwd") or real_bwd(*a)
    on = lambda inp: inp.dropout_p == 0.0
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        for case in ("plain", "alibi-causal", "float-mask-grad"):
            q, k, v = ((torch.randn(1, 4, 70, 40, generator=g) * 2).to(dtype) for _ in range(3))
            slopes = subquad.mods.alibi_slopes(4)
            mask = torch.randn(70, 70, generator=g)
            def run(x, mask_dtype, passes):
                triton_passes.enabled = on if passes else (lambda inp: False)
                x = [t.detach().clone().requires_grad_() for t in x]
                kw = {}
                leaves = list(x)
                if case == "alibi-causal":
                    kw = dict(score_mod=lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki), mask_mod=lambda b, h, qi, ki: ki <= qi)
                elif case == "float-mask-grad":
                    m = mask.to(mask_dtype).requires_grad_()
                    kw = dict(attn_mask=m)
                    leaves.append(m)
                out = subquad.attention(*x, backend="matmul", chunk_size=(32, 48), **kw)
                d_out = torch.ones_like(out) * 0.1 + out.detach() * 0.5
                return [out, *torch.autograd.grad(out, leaves, d_out)]
            calls.clear()
            got = run((q, k, v), dtype, True)
            assert "fwd" in calls and "bwd" in calls, calls
            eager = run((q, k, v), dtype, False)  # the eager passes on the same products
            want = run(to64(q, k, v), torch.float64, False)
            for name, a, gold, b in zip(("output", "dq", "dk", "dv", "dmask"), got, want, eager):
                assert a.dtype == b.dtype
                assert_close_to_golden(a.detach(), gold.detach(), b.detach(), name=f"{case} {dtype} {name}")
    print("calls ok")
    """
)


def test_cuda_tile_calls_through_the_triton_passes_match_the_eager_passes():
    # The whole tile loop with the kernels (in the interpreter) wired in: forward, backward, a
    # score_mod's pullback and a float mask's gradient (dS kept in float32 for them).
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _CALLS_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "calls ok" in done.stdout
