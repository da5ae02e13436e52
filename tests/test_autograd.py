"""Gradients: gradcheck in float64, float64 against autograd through the naive reference, half precision."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import subquad
from conftest import assert_close_to_golden, naive_attention, to64

PATHS = [
    pytest.param("fused", None, id="fused-whole"),
    pytest.param("fused", (5, 4), id="fused-5x4"),
    pytest.param("matmul", None, id="matmul-whole"),
    pytest.param("matmul", (5, 4), id="matmul-5x4"),
    pytest.param("auto", (3, 7), id="auto-3x7"),
]


def _leaf(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def _grads(fn, tensors, grad_out=None):
    tensors = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    out = fn(*tensors)
    g = (
        torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(7))
        if grad_out is None
        else grad_out
    )
    out.backward(g)
    return out, [t.grad for t in tensors]


def _call(backend, chunk, **kw):
    def fn(q, k, v, mask=None):
        try:
            return subquad.attention(q, k, v, attn_mask=mask, backend=backend, chunk_size=chunk, **kw)
        except NotImplementedError as e:
            pytest.skip(str(e))

    return fn


GRADCHECK_PATHS = [pytest.param("fused", (5, 4), id="fused-5x4"), pytest.param("matmul", (5, 4), id="matmul-5x4")]


@pytest.mark.parametrize("backend,chunk", GRADCHECK_PATHS)
@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(is_causal=True),
        dict(enable_gqa=True, heads=(4, 2)),
        dict(mask="bool"),
        dict(mask="float"),
        dict(mask="learnable"),
        dict(enable_gqa=True, heads=(4, 2), is_causal=True),
    ],
    ids=["plain", "causal", "gqa", "bool-mask", "float-mask", "bias-grad", "gqa-causal"],
)
def test_gradcheck(case, backend, chunk):
    case = dict(case)
    Hq, Hk = case.pop("heads", (2, 2))
    mask_kind = case.pop("mask", None)
    q, k, v = _leaf(1, Hq, 9, 4), _leaf(1, Hk, 11, 4), _leaf(1, Hk, 11, 4)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(9, 11) > 0.3
    elif mask_kind in ("float", "learnable"):
        mask = torch.randn(Hq, 9, 11, dtype=torch.float64).requires_grad_(mask_kind == "learnable")
    fn = _call(backend, chunk, **case)
    args = (q, k, v) if mask is None else (q, k, v, mask)
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("backend,chunk", PATHS)
@pytest.mark.parametrize(
    "shape",
    [
        (2, 3, 113, 203, 16, 16),
        (1, 2, 64, 17, 59, 59),
        (1, 1, 33, 40, 111, 111),
        (1, 2, 1, 30, 8, 8),
        (1, 2, 19, 23, 16, 7),
    ],
    ids=["113x203", "E59", "E111", "Lq1", "Ev!=E"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float64_gradients_match_golden(shape, backend, chunk, causal):
    B, H, Lq, Lk, E, Ev = shape
    tensors = [_leaf(B, H, Lq, E), _leaf(B, H, Lk, E), _leaf(B, H, Lk, Ev)]
    if backend == "fused" and Ev != E:  # the CPU flash kernel has one head dim: it must say so, not run
        with pytest.raises(NotImplementedError, match=rf"needs value's head dim Ev == E, got Ev={Ev}, E={E}"):
            subquad.attention(*tensors, backend=backend, chunk_size=chunk, is_causal=causal)
        return
    out, grads = _grads(_call(backend, chunk, is_causal=causal), tensors)
    ref_out, ref_grads = _grads(lambda q, k, v: naive_attention(q, k, v, is_causal=causal), tensors)
    assert_close_to_golden(out, ref_out)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert_close_to_golden(g, r, name=f"d{name}", floor=1e-11)


@pytest.mark.parametrize("backend,chunk", PATHS)
def test_gqa_and_mask_gradients(backend, chunk):
    q, k, v = _leaf(2, 6, 20, 8), _leaf(2, 2, 27, 8), _leaf(2, 2, 27, 8)
    bias = torch.randn(6, 1, 27, dtype=torch.float64).requires_grad_()  # broadcast over queries
    fn = lambda q, k, v, m: subquad.attention(q, k, v, attn_mask=m, enable_gqa=True, backend=backend, chunk_size=chunk)  # noqa: E731
    try:
        _out, grads = _grads(fn, [q, k, v, bias])
    except NotImplementedError as e:
        pytest.skip(str(e))
    _ref_out, ref_grads = _grads(
        lambda q, k, v, m: naive_attention(q, k, v, attn_mask=m, enable_gqa=True), [q, k, v, bias]
    )
    assert grads[3].shape == bias.shape
    for name, g, r in zip(["dq", "dk", "dv", "dbias"], grads, ref_grads):
        assert_close_to_golden(g, r, name=name, floor=1e-11)


def test_fully_masked_rows_have_zero_gradients():
    q, k, v = _leaf(1, 2, 6, 8), _leaf(1, 2, 9, 8), _leaf(1, 2, 9, 8)
    keep = torch.rand(6, 9) > 0.3
    keep[2] = False
    for backend in ("fused", "matmul"):
        _out, grads = _grads(
            lambda q, k, v: subquad.attention(q, k, v, attn_mask=keep, backend=backend, chunk_size=(2, 4)),  # noqa: B023 - _grads calls it at once
            [q, k, v],
        )
        _ref_out, ref_grads = _grads(lambda q, k, v: naive_attention(q, k, v, attn_mask=keep), [q, k, v])
        assert torch.isfinite(grads[0]).all() and torch.equal(grads[0][:, :, 2], torch.zeros_like(grads[0][:, :, 2]))
        for g, r in zip(grads, ref_grads):
            assert_close_to_golden(g, r, floor=1e-11)


@pytest.mark.parametrize("backend,chunk", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_low_precision_gradients(dtype, backend, chunk):
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(2, 2, 40, 32, generator=g) * s for s in (3, 3, 1)]
    low = [t.to(dtype).requires_grad_() for t in base]
    gold = [t.double().requires_grad_() for t in low]
    grad_out = torch.randn(2, 2, 40, 32, generator=g)
    fn = _call(backend, chunk, is_causal=True)
    _out, grads = _grads(fn, low, grad_out.to(dtype))
    _, ref_grads = _grads(lambda q, k, v: naive_attention(q, k, v, is_causal=True), low, grad_out.to(dtype))
    _, gold_grads = _grads(lambda q, k, v: naive_attention(q, k, v, is_causal=True), gold, grad_out.double())
    for name, t, r, gg in zip("qkv", grads, ref_grads, gold_grads):
        assert t.dtype == dtype
        assert_close_to_golden(t, gg, r, name=f"d{name}")


def test_dropout_backward_uses_the_same_masks():
    from subquad._tiles import dropout_scale
    from subquad._validate import make_inputs

    q, k, v = _leaf(1, 2, 12, 8), _leaf(1, 2, 20, 8), _leaf(1, 2, 20, 8)
    torch.manual_seed(3)
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())  # what subquad will draw from the same state
    inp = make_inputs(q, k, v, dropout_p=0.4)
    z = dropout_scale(inp, seed, 0, 12, 0, 20, torch.float64)

    def reference(q, k, v):
        p = torch.softmax((q @ k.transpose(-1, -2)) / 8**0.5, dim=-1)
        return (p * z) @ v

    for chunk in [None, (5, 7)]:
        torch.manual_seed(3)
        out, grads = _grads(lambda q, k, v: subquad.attention(q, k, v, dropout_p=0.4, chunk_size=chunk), [q, k, v])  # noqa: B023 - _grads calls it at once
        ref_out, ref_grads = _grads(reference, [q, k, v])
        assert_close_to_golden(out, ref_out)
        for g, r in zip(grads, ref_grads):
            assert_close_to_golden(g, r, floor=1e-11)


def test_no_grad_needed_saves_nothing():
    q = torch.randn(1, 2, 16, 8)
    out = subquad.attention(q, q, q)
    assert out.grad_fn is None and not out.requires_grad
    with torch.no_grad():
        out = subquad.attention(q.requires_grad_(), q, q)
    assert out.grad_fn is None


def test_only_some_inputs_require_grad():
    q, k, v = _leaf(1, 2, 10, 8), torch.randn(1, 2, 12, 8, dtype=torch.float64), _leaf(1, 2, 12, 8)
    out = subquad.attention(q, k, v, chunk_size=(3, 5))
    out.sum().backward()
    assert q.grad is not None and v.grad is not None and k.grad is None
    ref_q, ref_v = q.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
    naive_attention(ref_q, k, ref_v).sum().backward()
    assert_close_to_golden(q.grad, ref_q.grad, floor=1e-11)
    assert_close_to_golden(v.grad, ref_v.grad, floor=1e-11)


def test_double_backward_raises():
    q = _leaf(1, 1, 5, 4)
    out = subquad.attention(q, q, q, backend="matmul")
    # create_graph=True itself works (torch.func.grad runs the backward that way); differentiating
    # the gradient again raises instead of treating it as a constant.
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(g.sum(), q)


def test_sdpa_drop_in_gradients_match_torch():
    q, k, v = (torch.randn(2, 4, 33, 16, requires_grad=True) for _ in range(3))
    mask = torch.rand(33, 33) > 0.2
    ours = subquad.sdpa(q, k, v, attn_mask=mask, chunk_size=(8, 8))
    (gq, gk, gv) = torch.autograd.grad(ours.sum(), (q, k, v))
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    (tq, tk, tv) = torch.autograd.grad(theirs.sum(), (q, k, v))
    golden = naive_attention(*to64(q, k, v), attn_mask=mask)
    assert_close_to_golden(ours, golden, theirs)
    for a, b in zip((gq, gk, gv), (tq, tk, tv)):
        assert (a - b).abs().max() < 1e-4


@pytest.mark.parametrize("backend,chunk", PATHS)
def test_lse_is_differentiable_for_merging(backend, chunk):
    """Partial attentions merged by their lse (ring attention) get exact gradients through the lse."""
    q, k, v = _leaf(1, 2, 10, 8), _leaf(1, 2, 24, 8), _leaf(1, 2, 24, 8)
    keep = torch.rand(10, 24) > 0.3
    keep[4, :11] = False  # row 4 sees nothing in the first half: lse1 = -inf there

    def merged(q, k, v):
        o1, l1 = subquad.attention(
            q, k[:, :, :11], v[:, :, :11], attn_mask=keep[:, :11], return_lse=True, backend=backend, chunk_size=chunk
        )
        o2, l2 = subquad.attention(
            q, k[:, :, 11:], v[:, :, 11:], attn_mask=keep[:, 11:], return_lse=True, backend=backend, chunk_size=chunk
        )
        lse = torch.logaddexp(l1, l2)
        return o1 * (l1 - lse).exp().unsqueeze(-1) + o2 * (l2 - lse).exp().unsqueeze(-1)

    out, grads = _grads(merged, [q, k, v])
    ref_out, ref_grads = _grads(lambda q, k, v: naive_attention(q, k, v, attn_mask=keep), [q, k, v])
    assert_close_to_golden(out, ref_out)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert_close_to_golden(g, r, name=f"d{name}", floor=1e-11)


def test_gradient_of_lse_alone():
    q, k, v = _leaf(1, 2, 7, 4), _leaf(1, 2, 9, 4), _leaf(1, 2, 9, 4)
    fn = lambda q, k, v: subquad.attention(q, k, v, return_lse=True, chunk_size=(3, 4))[1]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8)
