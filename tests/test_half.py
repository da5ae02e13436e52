"""Half precision through the tiles at the speed of the hardware (issue 29).

On a CPU with AVX512-BF16 or AMX the ``matmul`` tiles run their products as bfloat16 GEMMs, each
offset by its rows' maximum (or the lse, or D) so that what the GEMM rounds is small where the
softmax looks; elsewhere they run float32 products. Both paths are forced here whatever this
machine has (a bfloat16 GEMM runs everywhere, emulated where the CPU lacks the instructions),
and each is held to the float64 golden with the suite's tolerance policy, against the float32-score
reference that torch's SDPA follows.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _python_dispatch
from torch.utils import _pytree as pytree

import subquad
from _devices import OpRecorder
from _machine import fake_cpu
from conftest import assert_close_to_golden, float32_scores_reference, naive_attention, to64
from subquad import _time_model
from subquad._backends import matmul
from subquad._backends import products as cpu_products

BF16 = torch.bfloat16


@pytest.fixture(params=[True, False], ids=["bf16-products", "float32-products"])
def products(request, monkeypatch):
    """Run the tiles with bfloat16 products (as on a CPU with AVX512-BF16/AMX) or float32 ones."""
    fake_cpu(monkeypatch, "avx512-bf16" if request.param else "avx2")
    return request.param


def _inputs(shape_q, shape_kv, magnitude, seed, *, transpose=False):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(*shape_q, generator=g) * magnitude).to(BF16)
    k, v = ((torch.randn(*shape_kv, generator=g) * magnitude).to(BF16) for _ in range(2))
    if transpose:  # non-contiguous (B, L, H, E) storage seen as (B, H, L, E)
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return q, k, v


CASES = {
    "plain": dict(kw={}, chunk=(64, 96)),
    "causal": dict(kw={"is_causal": True}, chunk=(64, 64)),
    "lq-ne-lk": dict(kw={}, chunk=(32, 64), lq=37),
    "bool-mask": dict(kw={"mask": True}, chunk=(64, 96)),
    "alibi-float-mask": dict(kw={"alibi": True}, chunk=(64, 96)),
    "softcap": dict(kw={"score_mod": lambda s, b, h, qi, ki: 20 * torch.tanh(s / 20)}, chunk=(64, 96)),
    "gqa": dict(kw={"enable_gqa": True}, chunk=(48, 80), hk=2),
    "one-tile": dict(kw={}, chunk=None),
}


def _case(name, magnitude, seed=0):
    c = CASES[name]
    lq, lk, e = c.get("lq", 150), 150, 59
    hk = c.get("hk", 4)
    q, k, v = _inputs((1, 4, lq, e), (1, hk, lk, e), magnitude, seed, transpose=name == "plain")
    kw = dict(c["kw"])
    if kw.pop("mask", False):
        g = torch.Generator().manual_seed(seed + 1)
        kw["attn_mask"] = torch.rand(lq, lk, generator=g) > 0.3
    if kw.pop("alibi", False):
        slopes = torch.tensor([2.0 ** -(i + 1) for i in range(4)]).view(4, 1, 1)
        dist = (torch.arange(lk).view(1, -1) - torch.arange(lq).view(-1, 1)).abs().float()
        kw["attn_mask"] = (-slopes * dist).to(BF16)
    return q, k, v, kw, c["chunk"]


@pytest.mark.parametrize("magnitude", [1.0, 4.0], ids=["scores~1", "scores~16"])
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_tiles_forward_and_gradients_match_float64(products, name, magnitude):
    check_case_against_float64(name, magnitude)


def check_case_against_float64(name, magnitude):
    """The tiles' output and gradients on a case of ``CASES``, against float64 (also run with the
    native kernel, tests/test_native.py)."""
    q, k, v, kw, chunk = _case(name, magnitude)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = subquad.attention(q, k, v, backend="matmul", chunk_size=chunk, **kw)
    g = torch.Generator().manual_seed(7)
    d_out = torch.randn(out.shape, generator=g).to(BF16)
    grads = torch.autograd.grad(out, (q, k, v), d_out)

    def reference(dtype):
        ts = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        extra = {n: (m.to(dtype) if torch.is_tensor(m) and m.is_floating_point() else m) for n, m in kw.items()}
        o = naive_attention(*ts, **extra)
        return o, torch.autograd.grad(o, ts, d_out.to(dtype))

    golden, golden_grads = reference(torch.float64)
    ref32, ref32_grads = reference(torch.float32)
    assert_close_to_golden(out, golden, ref32.to(BF16))
    for n, got, gold, ref in zip("qkv", grads, golden_grads, ref32_grads):
        assert_close_to_golden(got, gold, ref.to(BF16), name=f"d{n}")


def test_bf16_products_are_bf16_gemms_and_float32_products_are_not(monkeypatch):
    q, k, v, kw, chunk = _case("causal", 1.0)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for native, want in [(True, BF16), (False, torch.float32)]:
        fake_cpu(monkeypatch, "avx512-bf16" if native else "avx2")
        with OpRecorder() as rec:
            out = subquad.attention(q, k, v, backend="matmul", chunk_size=chunk, **kw)
            out.backward(torch.ones_like(out))
        products = rec.named("aten.bmm", "aten.baddbmm")
        assert len(products) >= 5, "the forward and the backward ran no matmul"
        assert {op.out_dtypes for op in products} == {(want,)}, (native, {op.out_dtypes for op in products})


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["float32", "bfloat16"])
def test_raw_scores_are_exponentiated_in_log2_units(products, dtype):
    # Without a score_mod or a float mask the forward's products carry log2 e in their scale, so no
    # pass over a tile multiplies before exp2; a score_mod needs the scores themselves and keeps it.
    g = torch.Generator().manual_seed(5)
    q, k, v = ((torch.randn(1, 2, 64, 32, generator=g) * 2).to(dtype) for _ in range(3))
    tile = (2, 32, 64)  # (B * Hk, G * rows, keys) for tiles of 32 x 64
    for score_mod, multiplies in [(None, False), (lambda s, b, h, i, j: s * 1.0, True)]:
        with OpRecorder() as rec:
            out, lse = subquad.attention(
                q, k, v, backend="matmul", chunk_size=(32, 64), score_mod=score_mod, return_lse=True
            )
        on_tiles = [op.name for op in rec.ops if tile in op.out_shapes]
        assert any(n.startswith("aten.exp2") for n in on_tiles), on_tiles
        assert any(n.startswith("aten.mul") for n in on_tiles) == multiplies, on_tiles
        scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(32)
        assert_close_to_golden(out, torch.softmax(scores, -1) @ v.double(), float32_scores_reference(q, k, v))
        torch.testing.assert_close(
            lse.double(), torch.logsumexp(scores, -1), atol=2e-2 if dtype == BF16 else 1e-5, rtol=0
        )


def test_offsets_keep_large_scores_exact(monkeypatch):
    # q·kᵀ around 60 with a spread of a few units: rounding the raw scores to bfloat16 would move
    # each by up to 0.25 (25% once exponentiated); offset by the rows' maxima, the tiles stay at
    # the float32-score reference's error.
    g = torch.Generator().manual_seed(3)
    base = torch.randn(1, 2, 1, 64, generator=g)
    q = (base * 4 + torch.randn(1, 2, 200, 64, generator=g) * 0.3).to(BF16)
    k = (base * 4 + torch.randn(1, 2, 300, 64, generator=g) * 0.3).to(BF16)
    v = torch.randn(1, 2, 300, 64, generator=g).to(BF16)
    scores = (q.double() @ k.double().transpose(-1, -2)) / 8
    assert scores.min() > 40, "the case needs large raw scores"
    fake_cpu(monkeypatch, "avx512-bf16")
    out = subquad.attention(q, k, v, backend="matmul", chunk_size=(64, 64))
    golden = naive_attention(*to64(q, k, v))
    assert_close_to_golden(out, golden, float32_scores_reference(q, k, v), fudge=2.0)
    rounded = torch.softmax((scores.to(BF16).double()), dim=-1) @ v.double()
    assert (rounded - golden).abs().max() > 4 * (out.double() - golden).abs().max(), "the case does not need offsets"


def test_a_row_whose_maximum_jumps_late_is_recomputed(monkeypatch):
    # Small scores in the first tiles, one large score in the last: the row's offset must follow.
    fake_cpu(monkeypatch, "avx512-bf16")
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 1, 8, 64, generator=g).to(BF16)
    k = torch.randn(1, 1, 256, 64, generator=g).mul(0.1).to(BF16)
    k[0, 0, 250] = (q[0, 0, 3].float() * 3).to(BF16)  # q·k ≈ 3·|q|² ≈ 190, scaled ≈ 24
    v = torch.randn(1, 1, 256, 64, generator=g).to(BF16)
    products, offsets = [], []
    product, set_offset = matmul.OffsetOperand.product, matmul.OffsetOperand.set_offset
    monkeypatch.setattr(matmul.OffsetOperand, "product", lambda self, *a: products.append(1) or product(self, *a))
    monkeypatch.setattr(
        matmul.OffsetOperand, "set_offset", lambda self, off: offsets.append(off.clone()) or set_offset(self, off)
    )
    out = subquad.attention(q, k, v, backend="matmul", chunk_size=(8, 64))
    assert len(products) == 5, "4 tiles, and the last computed again for row 3's jump"
    assert offsets[-1][0, 3] > 20
    golden = naive_attention(*to64(q, k, v))
    assert_close_to_golden(out, golden, float32_scores_reference(q, k, v))


@pytest.mark.parametrize("gap,masked,redone", [(2.3, False, 0), (2.8, False, 1), (2.3, True, 1)])
def test_first_offsets_leave_a_margin_above_the_sampled_maximum(monkeypatch, gap, masked, redone):
    # One tile of 512 keys; its first offsets come from every 4th key. Row 0's largest score
    # (`gap`, on an unsampled key) lies more than OFFSET_DRIFT (2) above the sample's largest (0):
    # with the margin (0.5) a gap of 2.3 is still close enough to the offset, one of 2.8 is not.
    # A tile with a mask (here one hiding nothing) gets no margin: its sample may hold hidden keys.
    fake_cpu(monkeypatch, "avx512-bf16")
    g = torch.Generator().manual_seed(5)
    q = torch.zeros(1, 1, 8, 64, dtype=BF16)
    q[0, 0, 0, 0] = 8.0  # row 0's score with key j is k[j, 0] (scale 1/8)
    k = torch.zeros(1, 1, 512, 64, dtype=BF16)
    k[0, 0, 1, 0] = gap
    v = torch.randn(1, 1, 512, 64, generator=g).to(BF16)
    rows = []
    addmm = torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **kw: rows.append(a[1].shape[0]) or addmm(*a, **kw))
    mask = torch.ones(8, 512, dtype=torch.bool) if masked else None
    out = subquad.attention(q, k, v, attn_mask=mask, backend="matmul", chunk_size=(8, 512))
    assert sum(rows) == redone
    golden = naive_attention(*to64(q, k, v))
    assert_close_to_golden(out, golden, float32_scores_reference(q, k, v))


def test_exp_helper_is_exp():
    x = torch.linspace(-80, 0, 10001)
    got = matmul.exp_(x.clone())
    want = x.double().exp()
    # exp2(x·log2 e): the product's rounding (2^-24 of |x|·log2 e) dominates far from 0, where
    # the weights are negligible; near 0 it is float32's own exp accuracy.
    rel = (got.double() - want).abs() / want
    assert (rel <= 2.5e-7 + 1e-7 * x.double().abs()).all(), rel.max()
    x64 = torch.linspace(-80, 0, 101, dtype=torch.float64)
    assert torch.equal(matmul.exp_(x64.clone()), x64.exp())


def test_scratch_reuses_its_buffers():
    s = matmul.Scratch(torch.device("cpu"))
    a = s.get("s", (2, 3, 4), torch.float32)
    b = s.get("s", (2, 3, 2), torch.float32)
    assert b.is_contiguous() and b.data_ptr() == a.data_ptr()
    c = s.get("s", (2, 3, 8), torch.float32)
    assert c.shape == (2, 3, 8)
    assert s.get("s", (1,), BF16).dtype == BF16


class _NewStorages(_python_dispatch.TorchDispatchMode):
    """Counts the tensors of at least ``min_bytes`` that aten ops create (not views, not outputs
    written into an argument)."""

    def __init__(self, min_bytes):
        super().__init__()
        self.min_bytes, self.count = min_bytes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        given = {
            t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        result = func(*args, **kwargs)
        for t in pytree.tree_leaves(result):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.count += t.untyped_storage().nbytes() >= self.min_bytes
        return result


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "fwd+bwd"])
def test_tile_buffers_are_allocated_once_per_pass_not_per_tile_or_row_block(products, backward):
    # Each tile's product with v, its keys' and values' GEMM operands and the backward's dK / dV
    # tiles used to be new tensors, and each row block had its own scratch: with a small fixed
    # mmap threshold every one came back as page faults (81,000 per bf16 call of 1x8x4096x64,
    # then 31,000). Now a pass allocates what its tiles need once: more row blocks or more key
    # tiles add no allocation as large as a tile of values.
    def allocations(lq, lk):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 4, lq, 64, generator=g).to(BF16).requires_grad_(backward)
        k, v = (torch.randn(1, 4, lk, 64, generator=g).to(BF16).requires_grad_(backward) for _ in range(2))
        d_out = torch.randn(1, 4, lq, 64, generator=g).to(BF16)

        def call():
            out = subquad.attention(q, k, v, backend="matmul", chunk_size=(128, 128))
            if backward:
                out.backward(d_out)

        call()  # plans and probes
        with _NewStorages(4 * 128 * 64 * 2) as seen:  # a tile of values in bf16
            call()
        return seen.count

    base = allocations(256, 512)
    assert allocations(256, 2048) == base, "a key tile allocates"
    # More row blocks: a block's own state is per block (the forward's accumulator, query operand
    # and sampled first offsets; the backward's D, dQ accumulator and two offset operands), never
    # a tile's buffers.
    per_block = (allocations(512, 512) - base) / 2
    assert allocations(1024, 512) - base == 6 * per_block
    assert per_block <= (10 if backward else 3), per_block


# ----------------------------------------------------------------- the time model per dtype
@pytest.mark.parametrize(
    "native,dtype,want",
    [
        (True, BF16, BF16),
        (False, BF16, torch.float32),
        (True, torch.float16, torch.float32),
        (True, torch.float32, torch.float32),
    ],
)
def test_time_model_times_the_products_the_tiles_run(monkeypatch, native, dtype, want):
    fake_cpu(monkeypatch, "avx512-bf16" if native else "avx2")
    monkeypatch.setattr(_time_model, "_RATES", {})
    timed = []
    monkeypatch.setattr(_time_model, "_measure_rates", lambda device, dt: timed.append(dt) or (1e11, 1e-9))
    _time_model._device_rates(torch.device("cpu"), dtype)
    assert timed == [want]


def test_explain_predicts_bf16_from_its_own_rate(monkeypatch):
    # Rates injected: bfloat16 GEMMs 3x float32's; the prediction follows the call's dtype.
    fake_cpu(monkeypatch, "avx512-bf16")
    monkeypatch.setattr(_time_model, "_RATES", {("cpu", torch.float32): (1e11, 1e-9), ("cpu", BF16): (3e11, 1e-9)})
    monkeypatch.setattr(_time_model, "backend_seconds", lambda device, dtype, backend: None)
    q32 = torch.empty(1, 8, 4096, 64)
    t32 = subquad.explain(q32, q32, q32, backend="matmul").predicted_seconds
    qb = q32.to(BF16)
    tb = subquad.explain(qb, qb, qb, backend="matmul").predicted_seconds
    scores = 8 * 4096 * 4096
    assert math.isclose(t32 - tb, 2 * scores * 128 * (1 / 1e11 - 1 / 3e11), rel_tol=0.01)


# ----------------------------------------------------------------- the fused kernel's tiled backward
@pytest.mark.parametrize("dtype", [torch.float16, BF16], ids=str)
def test_tiled_fused_backward_rounds_its_gradients_once(monkeypatch, dtype):
    # flash-attn's criterion (fp16 gradients within 3x PyTorch's error against float32) failed by
    # one ulp of dV: each tile's dV came back from the kernel rounded to fp16 before the tiles
    # were summed. GQA 8/2 heads, head dim 59, ALiBi, a local window, 64x64 tiles.
    fake_cpu(monkeypatch, "avx2")  # bf16 as on a CPU without native products
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 8, 312, 59, generator=g)
    k, v = (torch.randn(1, 2, 156, 59, generator=g) for _ in range(2))
    d_out = torch.randn(1, 8, 312, 59, generator=g)
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(8)]).view(8, 1, 1)
    rel = torch.arange(156).view(1, -1) - torch.arange(312).view(-1, 1)
    bias = (-slopes * rel.abs()).masked_fill((rel < -32) | (rel > 16), float("-inf"))

    def grads(dt):
        ts = [t.to(dt).requires_grad_() for t in (q, k, v)]
        out = subquad.attention(*ts, attn_mask=bias, enable_gqa=True, backend="fused", chunk_size=(64, 64))
        return torch.autograd.grad(out, ts, d_out.to(dt))

    def torch_grads(dt):
        ts = [t.to(dt).requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*ts, attn_mask=bias.to(dt), enable_gqa=True)
        return torch.autograd.grad(out, ts, d_out.to(dt))

    test, ref32, pt = grads(dtype), torch_grads(torch.float32), torch_grads(dtype)
    for n, got, r32, by_torch in zip("qkv", test, ref32, pt):
        err = (got.float() - r32).abs().max()
        torch_err = (by_torch.float() - r32).abs().max()
        once = (r32.to(dtype).float() - r32).abs().max()
        # flash-attn asks for 3x; rounded once, the tiles match PyTorch (before: dV 2.7x in fp16).
        assert err <= 1.5 * torch_err, f"d{n}: {err:.5f} against PyTorch's {torch_err:.5f} ({once:.5f} rounded once)"


# ------------------------------------------------------- float16 where the CPU emulates its GEMMs
def _kernel_dtypes(monkeypatch):
    """Record the dtype of the query each call of the CPU flash kernels (forward and backward) gets."""
    from subquad._backends import fused

    fused.cpu_flash_unavailable_reason()  # the kernel's availability probe (float64) runs before the spy
    real = fused._cpu_flash_ops()
    seen = []

    def spy(op, position, kind):
        def run(*args, **kwargs):
            seen.append((kind, args[position].dtype))
            return op(*args, **kwargs)

        return run

    monkeypatch.setattr(fused, "_cpu_flash_ops", lambda: (spy(real[0], 0, "fwd"), spy(real[1], 1, "bwd")))
    return seen


def _assert_kernel_dtypes(seen, native):
    """Emulated float16: every kernel call on float32 copies. Native: the forward in float16 (a
    tiled backward takes float32 copies either way, so that its gradients are rounded once)."""
    assert seen, "no kernel call"
    if native:
        assert {dt for kind, dt in seen if kind == "fwd"} == {torch.float16}, seen
    else:
        assert {dt for _, dt in seen} == {torch.float32}, seen


def _fp16_calls():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 150, 59, generator=g).half()
    k, v = (torch.randn(2, 2, 170, 59, generator=g).half() for _ in range(2))
    mask = torch.randn(1, 4, 150, 170, generator=g).half()
    k4, v4 = (torch.randn(2, 4, 170, 59, generator=g).half() for _ in range(2))
    lengths = torch.tensor([0, 40, 41, 150], dtype=torch.int32)
    return {
        "whole": (q, k4, v4, {}),
        "whole-gqa": (q, k, v, dict(enable_gqa=True)),
        "causal-tiles": (q, k, v, dict(enable_gqa=True, is_causal=True, chunk_size=(64, 64))),
        "float-mask-tiles": (q, k, v, dict(enable_gqa=True, attn_mask=mask, chunk_size=(64, 96))),
        "packed": (q[0].transpose(0, 1), k[0, :, :150].transpose(0, 1), v[0, :, :150].transpose(0, 1), lengths),
    }


@pytest.mark.parametrize("native", [False, True], ids=["emulated-fp16", "native-fp16"])
@pytest.mark.parametrize("call", ["whole", "whole-gqa", "causal-tiles", "float-mask-tiles", "packed"])
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
def test_float16_kernels_run_on_float32_copies_where_the_cpu_emulates_float16(monkeypatch, native, call, grad):
    # Without AVX512-FP16/AMX-FP16 a float16 GEMM is emulated (26x float32's time on the 2-core
    # CPU) and torch's flash kernel in float16 ran 1.3-2.3x its float32 forward and 7.6x its
    # backward; on float32 copies it runs at float32 speed, and rounds once.
    monkeypatch.setattr(cpu_products, "_NATIVE_FP16", native)
    seen = _kernel_dtypes(monkeypatch)
    q, k, v, kw = _fp16_calls()[call]
    ts = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
    if call == "packed":
        out = subquad.varlen_attention(*ts, kw, kw, is_causal=True, enable_gqa=True)
        golden = torch.cat(
            [
                naive_attention(
                    *(t[s:e].transpose(0, 1).double() for t in ts), is_causal=True, enable_gqa=True
                ).transpose(0, 1)
                for s, e in zip(kw[:-1].tolist(), kw[1:].tolist())
            ]
        )
    else:
        out = subquad.attention(*ts, backend="fused", **kw)
        ref_kw = {n: x for n, x in kw.items() if n != "chunk_size"}
        golden = naive_attention(
            *to64(*ts), **{n: (x.double() if isinstance(x, torch.Tensor) else x) for n, x in ref_kw.items()}
        )
    assert out.dtype == torch.float16
    assert_close_to_golden(out, golden, golden.to(torch.float16), fudge=2.0)
    if grad:
        d_out = torch.randn_like(out)
        got = torch.autograd.grad(out, ts, d_out)
        ref = [t.detach().double().requires_grad_() for t in ts]
        if call == "packed":
            want = torch.autograd.grad(
                torch.cat(
                    [
                        naive_attention(
                            *(t[s:e].transpose(0, 1) for t in ref), is_causal=True, enable_gqa=True
                        ).transpose(0, 1)
                        for s, e in zip(kw[:-1].tolist(), kw[1:].tolist())
                    ]
                ),
                ref,
                d_out.double(),
            )
        else:
            want = torch.autograd.grad(
                naive_attention(
                    *ref, **{n: (x.double() if isinstance(x, torch.Tensor) else x) for n, x in ref_kw.items()}
                ),
                ref,
                d_out.double(),
            )
        for n, g_, w in zip("qkv", got, want):
            assert g_.dtype == torch.float16
            assert_close_to_golden(g_, w, w.to(torch.float16), fudge=3.0, name=f"d{n}")
    _assert_kernel_dtypes(seen, native)


@pytest.mark.parametrize("native", [False, True], ids=["emulated-fp16", "native-fp16"])
def test_the_sdpa_fast_path_runs_float16_on_float32_copies_where_emulated(monkeypatch, native):
    # subquad.sdpa's fast path calls the kernel (and torch's SDPA, for small calls) on the
    # caller's tensors: in float32 copies where float16 is emulated, the output in float16.
    monkeypatch.setattr(cpu_products, "_NATIVE_FP16", native)
    seen = _kernel_dtypes(monkeypatch)
    g = torch.Generator().manual_seed(4)
    for lq, lk in ((300, 700), (16, 16), (1, 512)):
        q = torch.randn(1, 8, lq, 64, generator=g).half()
        k, v = (torch.randn(1, 8, lk, 64, generator=g).half() for _ in range(2))
        golden = naive_attention(*to64(q, k, v))
        for _ in range(2):  # the second call takes the cached fast path
            out = subquad.sdpa(q, k, v)
            assert out.dtype == torch.float16
            assert_close_to_golden(out, golden, golden.half(), fudge=2.0)
    _assert_kernel_dtypes(seen, native)


def test_float16_gemm_verdict_is_a_wide_gap_timed_on_real_tensors(monkeypatch):
    # Where the CPU's flags do not say (off x86), the two GEMMs are timed.
    from torch._subclasses.fake_tensor import FakeTensor

    from _devices import fake_tensors

    monkeypatch.setattr(cpu_products, "_x86_fp16_gemm", lambda: None)
    for slowdown, native in ((23.4, False), (1.1, True), (0.4, True)):
        monkeypatch.setattr(cpu_products, "_NATIVE_FP16", None)
        monkeypatch.setattr(cpu_products, "_fp16_gemm_slowdown", lambda s=slowdown: s)
        assert cpu_products.native_fp16_products() is native
    made = []
    monkeypatch.setattr(cpu_products, "_NATIVE_FP16", None)
    monkeypatch.setattr(cpu_products, "_fp16_gemm_slowdown", lambda: made.append(torch.ones(1)) or 1.0)
    with fake_tensors():
        cpu_products.native_fp16_products()
        cpu_products.native_fp16_products()  # asked once per process
    assert len(made) == 1 and not isinstance(made[0], FakeTensor)
    assert cpu_products._fp16_gemm_slowdown is not None and cpu_products._x86_fp16_gemm() is None


@pytest.mark.parametrize(
    "machine,amx_fp16,flags,want",
    [
        ("x86_64", False, "fpu avx2 avx512f avx512_bf16", False),  # AMD EPYC (Zen 4)
        ("x86_64", False, "fpu avx512f avx512_bf16 avx512_fp16 amx_tile", True),  # Intel Sapphire Rapids
        ("x86_64", True, "fpu avx2", True),  # AMX-FP16, as torch probes it
        ("AMD64", False, None, None),  # no /proc/cpuinfo (Windows): timed
        ("aarch64", False, "fp asimd fphp asimdhp", None),  # Arm: timed
    ],
)
def test_float16_gemm_verdict_on_x86_reads_the_flags(monkeypatch, tmp_path, machine, amx_fp16, flags, want):
    # On x86 the verdict is torch's own rule (AVX512-FP16 or AMX-FP16), not a timing that a busy
    # machine can swing; the timing is left to CPUs whose flags do not say.
    import builtins
    import platform

    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: amx_fp16, raising=False)
    cpuinfo = tmp_path / "cpuinfo"
    if flags is not None:
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    real_open = builtins.open
    monkeypatch.setattr(
        builtins, "open", lambda path, *a, **kw: real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **kw)
    )
    assert cpu_products._x86_fp16_gemm() is want


def test_small_head_dims_take_float32_products(monkeypatch):
    # Below HALF_PRODUCTS_MIN_HEAD_DIM a bfloat16 product's rounding of the scores (an lse off by
    # ~2e-3) would dominate the gradients' error: head dim 1 gave dQ 2.4x SDPA's error with them.
    fake_cpu(monkeypatch, "avx512-bf16")
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(2, 2, 40, 1, generator=g) * 2).to(BF16)
    k, v = ((torch.randn(2, 2, 50, 1, generator=g) * 2).to(BF16) for _ in range(2))
    d_out = torch.randn(2, 2, 40, 1, generator=g).to(BF16)
    for e, want in [(1, torch.float32), (matmul.HALF_PRODUCTS_MIN_HEAD_DIM, BF16)]:
        x = torch.zeros(1, 1, 8, e, dtype=BF16)
        with OpRecorder() as rec:
            subquad.attention(x, x, x, backend="matmul")
        assert {op.out_dtypes for op in rec.named("aten.bmm", "aten.baddbmm")} == {(want,)}, e

    def grads(fn, *ts):
        ts = [t.detach().requires_grad_() for t in ts]
        return torch.autograd.grad(fn(*ts), ts, d_out.to(ts[0].dtype))

    golden = grads(F.scaled_dot_product_attention, *to64(q, k, v))
    ours = grads(lambda *t: subquad.attention(*t, backend="matmul", chunk_size=(16, 24)), q, k, v)
    sdpa = grads(F.scaled_dot_product_attention, q, k, v)
    for n, got, ref, gold in zip("qkv", ours, sdpa, golden):
        err, ref_err = ((t.double() - gold).abs().max().item() for t in (got, ref))
        assert err <= 1.5 * ref_err, (n, err, ref_err)
