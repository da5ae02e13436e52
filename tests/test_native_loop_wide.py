"""The forward's and backward's tile loops in C++ for float32 and float16 inputs
(``forward_segment_f32``, ``backward_segment_f32`` in ``_native_tiles.cpp``,
``subquad._backends.segments``): bfloat16's loops, their products in float32 on FMA (float16
inputs converted exactly), on a CPU whose build targets AVX512F.

Checked against the float64 golden (outputs with the suite's tolerance policy, the lse to a few
float32 ulps) on tests/test_native_loop.py's awkward sizes and masks, rows that see nothing, a
soft cap, float16 inputs whose raw q·kᵀ overflows float16, gradients (the suite's policy; with a
learnable mask the per-tile backward), which calls take them, what ``auto`` does, memory within
budget, and their argument errors. Skipped where the kernel cannot be built or was built without
AVX512F.
"""

from __future__ import annotations

import pytest
import torch

import subquad
import test_native
from conftest import assert_close_to_golden, naive_attention, to64
from subquad import _native, mods
from test_native_loop import (
    CASES,
    MASKS,
    SCALES,
    _as64,
    _lse64,
    assert_memory_within_budget,
    assert_refused,
    assert_scale_matches_float64,
)

pytestmark = test_native.pytestmark  # a C++ compiler and ninja

WIDE = (torch.float32, torch.float16)


@pytest.fixture
def wide(native_dir, monkeypatch):
    """The native kernel with its float32 forward loop, its calls recorded."""
    why = "the native kernel was built without AVX512F: no float32 forward loop"
    return test_native.recorded_kernel(native_dir, monkeypatch, "forward_segment_f32", why)


def _inputs(name, dtype, seed):
    shape_q, shape_kv, kw, chunk = CASES[name]
    kw = dict(kw)
    ev = kw.pop("value_dim", shape_kv[-1])
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(*shape_q, generator=g) * 2).to(dtype)
    k = (torch.randn(*shape_kv, generator=g) * 2).to(dtype)
    v = (torch.randn(*shape_kv[:-1], ev, generator=g) * 2).to(dtype)
    return q.transpose(1, 2).contiguous().transpose(1, 2), k, v, kw, chunk  # a non-contiguous query


def _reference(q, k, v, dtype, **kw):
    """What the suite's policy compares with: float32 SDPA-like math rounded to the input dtype
    (float32: the float32 result itself)."""
    return naive_attention(q.float(), k.float(), v.float(), **kw).to(dtype)


@pytest.mark.parametrize("dtype", WIDE, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_the_wide_loop_matches_float64(wide, name, dtype):
    q, k, v, kw, chunk = _inputs(name, dtype, 21)
    out, lse = subquad.attention(q, k, v, backend="loops", chunk_size=chunk, return_lse=True, **kw)
    assert "forward_segment_f32" in wide.names and "exp2_rows_bf16" not in wide.names, wide.names
    assert out.dtype == dtype
    assert_close_to_golden(out, naive_attention(*to64(q, k, v), **kw), _reference(q, k, v, dtype, **kw))
    want = _lse64(q, k, v, **kw)
    err = (lse.double() - want).abs().max().item()  # float32 sums of up to 1000 terms: a few ulps of the lse
    assert err < 1e-6 * max(1.0, want.abs().max().item()) * 4, err


@pytest.mark.parametrize("dtype", WIDE, ids=str)
@pytest.mark.parametrize("scale", SCALES)
def test_any_scale_matches_float64(wide, scale, dtype):
    assert_scale_matches_float64(wide, dtype, scale, "forward_segment_f32", 4e-6)


@pytest.mark.parametrize("dtype", WIDE, ids=str)
@pytest.mark.parametrize("name", list(MASKS))
def test_masks_match_float64(wide, name, dtype):
    shape_q, shape_kv, make, kw = MASKS[name]
    g = torch.Generator().manual_seed(22)
    q = (torch.randn(*shape_q, generator=g) * 2).to(dtype)
    k, v = ((torch.randn(*shape_kv, generator=g) * 2).to(dtype) for _ in range(2))
    mask = make(g)
    out, lse = subquad.attention(q, k, v, attn_mask=mask, backend="loops", chunk_size=(64, 64), return_lse=True, **kw)
    assert "forward_segment_f32" in wide.names
    m64 = _as64(mask)
    ref = _reference(q, k, v, dtype, attn_mask=m64 if m64.dtype == torch.bool else m64.float(), **kw)
    assert_close_to_golden(out, naive_attention(*to64(q, k, v), attn_mask=m64, **kw), ref)
    want = _lse64(q, k, v, bias=m64, **kw)
    seen = torch.isfinite(want)
    assert bool(torch.isneginf(lse[~seen]).all()) and bool((out[~seen] == 0).all())
    err = (lse.double() - want)[seen].abs().max().item()
    assert err < 1e-6 * max(1.0, want[seen].abs().max().item()) * 4, err


@pytest.mark.parametrize("dtype", WIDE, ids=str)
def test_rows_that_see_nothing_give_zeros(wide, dtype):
    g = torch.Generator().manual_seed(23)
    q = torch.randn(1, 2, 50, 64, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 30, 64, generator=g).to(dtype) for _ in range(2))
    out, lse = subquad.attention(
        q, k, v, mask_mod=mods.causal_lower_right(50, 30), backend="loops", chunk_size=(16, 16), return_lse=True
    )
    assert "forward_segment_f32" in wide.names
    assert bool((out[:, :, :20] == 0).all()) and bool(torch.isneginf(lse[:, :, :20]).all())
    keep = torch.arange(30) <= torch.arange(50).view(-1, 1) - 20
    golden = naive_attention(*to64(q, k, v), attn_mask=keep)
    assert_close_to_golden(out[:, :, 20:], golden[:, :, 20:], _reference(q, k, v, dtype, attn_mask=keep)[:, :, 20:])


def test_float16_scores_that_overflow_float16_stay_exact(wide):
    # q·kᵀ of these float16 inputs reaches about 2^17, past float16's 65504: the products are
    # float32, so the softmax sees them as they are.
    g = torch.Generator().manual_seed(24)
    q = (torch.randn(1, 2, 70, 64, generator=g) * 60).half()
    k = (torch.randn(1, 2, 90, 64, generator=g) * 60).half()
    v = torch.randn(1, 2, 90, 64, generator=g).half()
    assert (q.float() @ k.float().transpose(-1, -2)).abs().max() > 65504
    out = subquad.attention(q, k, v, backend="loops", scale=1.0)
    assert "forward_segment_f32" in wide.names
    golden = naive_attention(*to64(q, k, v), scale=1.0)
    assert_close_to_golden(out, golden, naive_attention(q.float(), k.float(), v.float(), scale=1.0).half())


@pytest.mark.parametrize("dtype", WIDE, ids=str)
def test_a_soft_cap_runs_in_the_wide_loop(wide, dtype):
    g = torch.Generator().manual_seed(25)
    q, k, v = ((torch.randn(1, 4, 150, 64, generator=g) * 3).to(dtype) for _ in range(3))

    def cap(s, b, h, i, j):
        return 20.0 * torch.tanh(s / 20.0)

    plan = subquad.explain(q, k, v, score_mod=cap, backend="loops", is_causal=True)
    assert any("soft cap 20" in n for n in plan.notes), plan.notes
    wide.calls.clear()  # explain() may run (or run again) the time model's probes on the tiles
    out = subquad.attention(q, k, v, score_mod=cap, backend="loops", is_causal=True)
    assert wide.names and set(wide.names) == {"forward_segment_f32"}, wide.names  # no per-tile pass
    golden = naive_attention(*to64(q, k, v), is_causal=True, score_mod=cap)
    ref = naive_attention(q.float(), k.float(), v.float(), is_causal=True, score_mod=cap).to(dtype)
    assert_close_to_golden(out, golden, ref)


@pytest.fixture
def two_threads():
    """Two threads: the backward loop needs a task (batch entry and key head) per thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _check_grads(q, k, v, d_out, out, grads, **kw):
    """The output and the gradients of (q, k, v) against float64 (the suite's policy; the
    reference: float32 autograd rounded to the inputs' dtype). Returns the rows that see a key."""
    dtype = q.dtype
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    kw64 = {n: (a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a) for n, a in kw.items()}
    golden = naive_attention(q64, k64, v64, **kw64)
    gold = torch.autograd.grad(golden, (q64, k64, v64), d_out.double())
    p32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    kw32 = {n: (a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a) for n, a in kw.items()}
    ref_out = naive_attention(*p32, **kw32)
    ref = torch.autograd.grad(ref_out, p32, d_out.float())
    assert_close_to_golden(out, golden.nan_to_num(0.0), ref_out.detach().nan_to_num(0.0).to(dtype))
    for n, got, g64, r in zip("qkv", grads, gold, ref):
        assert got.dtype == dtype and not bool(torch.isnan(got).any()), n
        assert_close_to_golden(got, g64.nan_to_num(0.0), r.nan_to_num(0.0).to(dtype), name=f"d{n}")
    return torch.isfinite(golden).all(dim=-1, keepdim=True)


@pytest.mark.parametrize(
    "shape, chunk, in_place",
    [
        ((1, 1, 300, 40), None, True),  # whole rows: size-1 dims whose strides the output may not share
        ((1, 1, 300, 40), (64, 300), True),  # blocks of rows of one head: each block contiguous in the output
        ((1, 3, 300, 40), (64, 300), False),  # blocks of rows of three heads: strided, their own accumulator
    ],
)
def test_float32_rows_accumulate_in_the_output(wide, two_threads, monkeypatch, shape, chunk, in_place):
    """Where a float32 call's rows are contiguous in its output, the loop accumulates in them
    (no buffer of the output's size to allocate and fault in per call); elsewhere in its own
    buffer. Both give the float64 result, forward and backward, rows that see no key included."""
    accumulators = []
    real = wide.real

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def forward_segment_f32(self, q, k, v, m, l, acc, *rest):
            accumulators.append(acc.data_ptr())
            return real.forward_segment_f32(q, k, v, m, l, acc, *rest)

    monkeypatch.setattr(wide, "kernel", Spy())
    g = torch.Generator().manual_seed(24)
    q, k, v = (torch.randn(shape, generator=g).requires_grad_() for _ in range(3))
    keep = torch.arange(300) <= torch.arange(300).view(-1, 1) - 40  # the first 40 rows see nothing
    out = subquad.attention(q, k, v, attn_mask=keep, backend="loops", chunk_size=chunk)
    assert accumulators, wide.names
    inside = [out.data_ptr() <= a < out.data_ptr() + out.numel() * 4 for a in accumulators]
    assert all(inside) if in_place else not any(inside), (inside, chunk)
    assert bool((out[:, :, :40] == 0).all())
    d_out = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    _check_grads(q, k, v, d_out, out, grads, attn_mask=keep)


@pytest.mark.parametrize("dtype", WIDE, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_the_wide_backward_loop_matches_float64(wide, two_threads, name, dtype):
    q, k, v, kw, chunk = _inputs(name, dtype, 28)
    for t in (q, k, v):
        t.requires_grad_()
    d_out = torch.randn(*q.shape[:-1], v.shape[-1], generator=torch.Generator().manual_seed(29)).to(dtype)
    out = subquad.attention(q, k, v, backend="loops", chunk_size=chunk, **kw)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    want = "backward_segment_f32" if q.shape[0] * k.shape[1] >= 2 else None  # a task per thread, else per tile
    assert want is None or want in wide.names, wide.names
    _check_grads(q, k, v, d_out, out, grads, **kw)


@pytest.mark.parametrize("dtype", WIDE, ids=str)
@pytest.mark.parametrize("name", list(MASKS))
def test_the_wide_backward_loop_reads_masks_in_place(wide, two_threads, name, dtype):
    shape_q, shape_kv, make, kw = MASKS[name]
    g = torch.Generator().manual_seed(30)
    q, k, v = ((torch.randn(*s, generator=g) * 2).to(dtype).requires_grad_() for s in (shape_q, shape_kv, shape_kv))
    mask = make(g)
    d_out = torch.randn(*shape_q, generator=g).to(dtype)
    out = subquad.attention(q, k, v, attn_mask=mask, backend="loops", chunk_size=(64, 64), **kw)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    assert "backward_segment_f32" in wide.names, wide.names
    seen = _check_grads(q, k, v, d_out, out, grads, attn_mask=_as64(mask), **kw)
    assert bool((grads[0][~seen.expand_as(grads[0])] == 0).all())  # rows that see nothing: no gradient


@pytest.mark.parametrize("dtype", WIDE, ids=str)
def test_the_wide_loops_run_a_soft_cap_with_its_derivative(wide, two_threads, dtype):
    g = torch.Generator().manual_seed(31)
    q, k, v = ((torch.randn(2, 4, 130, 64, generator=g) * 3).to(dtype).requires_grad_() for _ in range(3))
    d_out = torch.randn(2, 4, 130, 64, generator=g).to(dtype)

    def cap(s, b, h, i, j):
        return 20.0 * torch.tanh(s / 20.0)

    out = subquad.attention(q, k, v, score_mod=cap, backend="loops", is_causal=True)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    assert {"forward_segment_f32", "backward_segment_f32"} == set(wide.names), wide.names
    _check_grads(q, k, v, d_out, out, grads, is_causal=True, score_mod=cap)


@pytest.mark.parametrize("dtype", WIDE, ids=str)
def test_a_learnable_mask_takes_the_loops_forward_and_the_per_tile_backward(wide, two_threads, dtype):
    g = torch.Generator().manual_seed(26)
    q, k, v = (torch.randn(2, 4, 90, 59, generator=g).to(dtype).requires_grad_() for _ in range(3))
    mask = torch.randn(90, 90, generator=g).to(dtype).requires_grad_()
    out = subquad.attention(q, k, v, attn_mask=mask, backend="loops", chunk_size=(32, 48))
    d_out = torch.randn(out.shape, generator=g).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v, mask), d_out)
    assert "forward_segment_f32" in wide.names and "backward_segment_f32" not in wide.names, wide.names
    _check_grads(q, k, v, d_out, out, grads[:3], attn_mask=mask.detach())
    m64 = mask.detach().double().requires_grad_()
    golden = naive_attention(*(t.detach().double() for t in (q, k, v)), attn_mask=m64)
    (gold_mask,) = torch.autograd.grad(golden, m64, d_out.double())
    m32 = mask.detach().float().requires_grad_()
    (ref_mask,) = torch.autograd.grad(
        naive_attention(*(t.detach().float() for t in (q, k, v)), attn_mask=m32), m32, d_out.float()
    )
    assert_close_to_golden(grads[3], gold_mask, ref_mask.to(dtype), name="dmask")


def test_the_loop_takes_float_calls_without_callbacks_or_dropout(wide):
    q = torch.randn(1, 2, 40, 32)
    subquad.attention(q, q, q, score_mod=lambda s, b, h, i, j: s * 0.5, backend="matmul")
    subquad.attention(q, q, q, mask_mod=lambda b, h, i, j: i % 4 == j % 4, backend="matmul")
    subquad.attention(q, q, q, dropout_p=0.3, backend="matmul")
    subquad.attention(q.double(), q.double(), q.double(), backend="matmul")
    subquad.attention(q, q, q, attn_mask=torch.zeros(40, 40, dtype=torch.float64), backend="matmul")
    with pytest.raises(NotImplementedError, match="float64: the loops run"):
        subquad.attention(q.double(), q.double(), q.double(), backend="loops")
    with pytest.raises(NotImplementedError, match="dropout"):
        subquad.attention(q, q, q, dropout_p=0.3, backend="loops")
    assert "forward_segment_f32" not in wide.names
    subquad.attention(q, q, q, backend="loops")
    subquad.attention(q.half(), q.half(), q.half(), is_causal=True, backend="loops")
    assert wide.names == ["forward_segment_f32"] * 2


def test_the_wide_loop_refuses_what_it_does_not_take(wide):
    kernel = wide.real
    q = torch.zeros(1, 2, 8, 16)
    m, l, acc = torch.zeros(16), torch.zeros(16), torch.zeros(16, 16)
    ok = (q, q, q, m, l, acc, 1.0, 0, 0, False, 0, None, 0.0)
    kernel.forward_segment_f32(*ok)
    kernel.forward_segment_f32(*((q.half(),) * 3 + ok[3:]))
    bad = {
        "bfloat16 q": (q.bfloat16(),) + ok[1:],
        "float64 k and v": ok[:1] + (q.double(),) * 2 + ok[3:],
        "float16 q with float32 k and v": (q.half(),) + ok[1:],
        "last dim strided": (torch.zeros(1, 2, 16, 8).transpose(-1, -2),) + ok[1:],
        "heads not a multiple": ok[:1] + (torch.zeros(1, 3, 8, 16),) * 2 + ok[3:],
        "acc too small": ok[:5] + (torch.zeros(16, 8),) + ok[6:],
        "mask of float64": ok[:-2] + (torch.zeros(1, 2, 8, 8, dtype=torch.float64), 0.0),
        "a negative soft cap": ok[:-1] + (-1.0,),
    }
    assert_refused(kernel.forward_segment_f32, bad)


def test_the_wide_backward_loop_refuses_bad_arguments(wide):
    kernel = wide.real
    q = torch.zeros(1, 2, 8, 16)
    rows, dq = torch.zeros(16), torch.zeros(1, 2, 8, 16)
    ok = (q, q, q, q, rows, rows, dq, dq.clone(), dq.clone(), 1.0, 0.25, 0, 0, False, 0, None, 0.0)
    kernel.backward_segment_f32(*ok)
    kernel.backward_segment_f32(*((q.half(),) * 4 + ok[4:-1] + (30.0,)))
    bad = {
        "bfloat16 dout": ok[:3] + (q.bfloat16(),) + ok[4:],
        "float16 dout with float32 q, k, v": ok[:3] + (q.half(),) + ok[4:],
        "dout of another length": ok[:3] + (torch.zeros(1, 2, 9, 16),) + ok[4:],
        "lse of too few rows": ok[:4] + (torch.zeros(8),) + ok[5:],
        "float16 dq": ok[:6] + (dq.half(),) + ok[7:],
        "dk of another shape": ok[:7] + (torch.zeros(1, 2, 9, 16),) + ok[8:],
        "mask of another shape": ok[:-2] + (torch.ones(1, 1, 8, 8, dtype=torch.bool), 0.0),
        "a negative soft cap": ok[:-1] + (-1.0,),
    }
    assert_refused(kernel.backward_segment_f32, bad)


def test_auto_runs_the_wide_loop_where_it_takes_it(wide, two_threads):
    # On a CPU whose build has 16 float lanes and no AMX (the fixture's; what auto takes on each
    # CPU: tests/test_cpus.py), a large float32 call runs the forward loop.
    q, k, v = (torch.randn(1, 8, 1024, 64) for _ in range(3))
    plan = subquad.explain(q, k, v)
    assert plan.backend == "loops" and any("forward loop in C++" in n for n in plan.notes), plan
    out = subquad.attention(q, k, v)
    assert wide.names and set(wide.names) == {"forward_segment_f32"}, wide.names
    torch.testing.assert_close(out, naive_attention(*to64(q, k, v)).float(), rtol=2e-5, atol=2e-6)


def test_measured_peak_within_budget_and_prediction_honest(wide, native_dir):
    # backend="matmul": the loops wherever the probe process's CPU has them (the CI reruns it as others)
    cases = [
        dict(shape=[1, 8, 4096, 4096, 64], budget="16MiB", dtype="float32", backend="matmul"),
        dict(shape=[1, 8, 2048, 2048, 64], budget="16MiB", dtype="float16", backend="matmul", mask="causal"),
        dict(shape=[2, 8, 1024, 1024, 40], budget="8MiB", dtype="float32", backend="matmul", mask="float"),
    ]
    assert_memory_within_budget(cases, native_dir)


def test_training_peak_within_budget_and_prediction_honest(wide, native_dir):
    # Both loops, two threads (a task per thread), gradients included.
    # backend="matmul": the loops wherever the probe process's CPU has them (the CI reruns it as others)
    cases = [
        dict(shape=[1, 8, 2048, 2048, 64], budget="32MiB", dtype="float32", backend="matmul", grad=True),
        dict(shape=[2, 4, 1024, 1024, 64], budget="24MiB", dtype="float16", backend="matmul", grad=True, mask="causal"),
        dict(shape=[2, 8, 1024, 1024, 40], budget="32MiB", dtype="float32", backend="matmul", grad=True, mask="float"),
    ]
    assert_memory_within_budget(cases, native_dir, OMP_NUM_THREADS="2")


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory):
    """The kernel built without AVX512 (``SUBQUAD_NATIVE_FLAGS=-mno-avx512f``): the float32 loops
    on 256-bit FMA, as on CPUs with AVX2 alone. Skipped off x86-64 or without AVX2 and FMA."""
    flags = _native._cpu_signature()
    if not ("avx2" in flags and " fma" in flags):
        pytest.skip("the CPU has no AVX2 with FMA")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SUBQUAD_NATIVE_FLAGS", "-mno-avx512f")
        mp.setenv("SUBQUAD_NATIVE_DIR", str(tmp_path_factory.mktemp("avx2")))
        try:
            module = _native.build()
        except Exception as e:
            pytest.skip(f"the AVX2 build failed here ({type(e).__name__}: {str(e)[:300]})")
    module = getattr(module, "real", module)  # the build itself, not a SUBQUAD_TEST_CPU machine's view of it
    if not hasattr(module, "forward_segment_f32") or hasattr(module, "forward_segment_bf16"):
        pytest.skip("the compiler did not give an AVX2 build with the float32 loops")
    return module


@pytest.mark.parametrize("dtype", WIDE, ids=str)
def test_the_avx2_build_runs_both_loops(avx2_build, monkeypatch, two_threads, dtype):
    counting = test_native.Counting(avx2_build)
    monkeypatch.setitem(_native._LOADED, "module", counting)
    g = torch.Generator().manual_seed(32)
    q = (torch.randn(2, 4, 150, 59, generator=g) * 2).to(dtype).requires_grad_()
    k, v = ((torch.randn(2, 2, 530, 59, generator=g) * 2).to(dtype).requires_grad_() for _ in range(2))
    mask = torch.randn(150, 530, generator=g).to(dtype)
    d_out = torch.randn(2, 4, 150, 59, generator=g).to(dtype)
    kw = dict(attn_mask=mask, enable_gqa=True)
    out = subquad.attention(q, k, v, backend="loops", chunk_size=(64, 300), **kw)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    assert {"forward_segment_f32", "backward_segment_f32"} == set(counting.names), counting.names
    _check_grads(q, k, v, d_out, out, grads, **kw)
    assert avx2_build.float_lanes == 8  # auto leaves these loops to backend="loops" (tests/test_cpus.py)


@pytest.mark.parametrize("dtype", WIDE, ids=str)
def test_the_time_model_probes_the_loop_in_blocks_of_its_size(wide, dtype):
    # The loops take whole rows, keys in one call: the probe times blocks of _LOOP_PROBE_SHAPE's
    # rows with all their keys per call (blocks of 256 rows in calls of 512 keys had predicted
    # the float32 forward 1x8x4096x64 at 0.60x its time).
    from subquad import _time_model

    bh, nq, _, e = _time_model._LOOP_PROBE_SHAPE
    before = len(wide.calls)
    per_score, per_row = _time_model._measure_backend(torch.device("cpu"), dtype, "loops")
    calls = wide.calls[before:]
    assert calls and all(c == ("forward_segment_f32", (1, bh, nq, e)) for c in calls), calls[:3]
    assert per_score > 0 and per_row >= 0
