"""subquad.sdpa as a drop-in for torch's SDPA: exception classes, scalars, empty inputs, batch
broadcasting, torch's CausalBias masks and the autograd transforms (batched grads, torch.func)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import subquad
from conftest import assert_close_to_golden, naive_attention
from subquad.integrations.patch import ORIGINAL_SDPA

f64 = torch.float64
PATHS = [
    pytest.param("auto", None, id="auto"),
    pytest.param("fused", (7, 5), id="fused-7x5"),
    pytest.param("fused", (8, 8), id="fused-8"),
    pytest.param("matmul", (7, 5), id="matmul-7x5"),
    pytest.param("matmul", None, id="matmul-whole"),
]


def _t(*shape, dtype=f64, grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def _lower_right(Lq, Lk):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that Lq > Lk gives NaN in its fused kernels
        return causal_lower_right(Lq, Lk)


def _torch_sdpa_grads(q, k, v, **kw):
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = ORIGINAL_SDPA(q2, k2, v2, **kw)
    out.square().sum().backward()
    return out, (q2.grad, k2.grad, v2.grad)


# ----------------------------------------------------------------- exception classes
def _bad_calls():
    q, k = _t(2, 4, 8, 16), _t(2, 4, 8, 16)
    return [
        pytest.param((q, k.float(), k), {}, TypeError, "same dtype", id="dtype"),
        pytest.param((_t(16), _t(16), _t(16)), {}, ValueError, "at least 2 dims", id="1-D"),
        pytest.param(
            (q, k, k),
            dict(attn_mask=torch.ones(8, 8, dtype=torch.bool), is_causal=True),
            ValueError,
            "Explicit attn_mask should not be set when is_causal=True",
            id="mask-and-causal",
        ),
        pytest.param((q, _t(2, 4, 8, 8), k), {}, ValueError, r"key.shape\[-1\]", id="head-dim"),
        pytest.param((q, _t(2, 3, 8, 16), _t(2, 3, 8, 16)), dict(enable_gqa=True), ValueError, "multiple", id="gqa"),
        pytest.param((q, k, k), dict(attn_mask=torch.ones(7, 8)), ValueError, "does not broadcast", id="mask-shape"),
    ]


@pytest.mark.parametrize("args,kwargs,cls,message", _bad_calls())
def test_errors_are_runtime_errors_like_sdpa_and_keep_their_messages(args, kwargs, cls, message):
    with (
        pytest.raises(RuntimeError),  # what torch's SDPA raises for the same call
        torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH),
    ):
        ORIGINAL_SDPA(*args, **kwargs)
    for caught in (RuntimeError, cls):  # code written for SDPA catches RuntimeError
        with pytest.raises(caught, match=message):
            subquad.sdpa(*args, **kwargs)


def _torch_test_masks():
    # The variants of torch's test_scaled_dot_product_attention that pass both a mask and is_causal.
    for input_dim in (3, 4):
        for mask_dim in (2, 3, 4)[: input_dim - 1]:
            for dropout_p in (0.0, 0.2, 0.5):
                for tiled in (False, True):
                    yield pytest.param(
                        input_dim,
                        mask_dim,
                        dropout_p,
                        tiled,
                        id=f"{input_dim}d-mask{mask_dim}d-p{dropout_p}-{'tiled' if tiled else 'default'}",
                    )


@pytest.mark.parametrize("input_dim,mask_dim,dropout_p,tiled", list(_torch_test_masks()))
def test_mask_with_is_causal_raises_torchs_text(input_dim, mask_dim, dropout_p, tiled):
    shape = (2, 3, 5, 8)[4 - input_dim :]
    q = _t(*shape)
    batch = shape[:-2]
    mask = torch.ones(batch[len(batch) - (mask_dim - 2) :] + (5, 5), dtype=torch.bool)
    assert mask.dim() == mask_dim
    text = "Explicit attn_mask should not be set when is_causal=True"
    with (
        torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH),
        pytest.raises(RuntimeError, match=text),  # torch's documented behaviour (its math path)
    ):
        ORIGINAL_SDPA(q, q, q, attn_mask=mask, dropout_p=dropout_p, is_causal=True)
    kw = dict(chunk_size=(2, 3)) if tiled else {}
    with pytest.raises(RuntimeError, match=text):
        subquad.sdpa(q, q, q, attn_mask=mask, dropout_p=dropout_p, is_causal=True, **kw)


def test_unsupported_tensor_kinds_name_the_argument():
    q = _t(1, 2, 5, 8)
    jagged = torch.nested.nested_tensor([torch.randn(3, 2, 8), torch.randn(5, 2, 8)], layout=torch.jagged)
    # (Nested tensors are taken as SDPA takes them, (B, H, j, E): tests/test_nested.py.)
    with pytest.raises(ValueError, match=r"Expected query to be a jagged nested tensor \(B, H, j, E\)"):
        subquad.sdpa(jagged, jagged, jagged)
    with pytest.raises(
        TypeError, match="Expected query, key and value to be all nested tensors or none, got key Tensor"
    ):
        subquad.sdpa(jagged.transpose(1, 2), q, q)
    with pytest.raises(NotImplementedError, match="query is a nested tensor, which this call does not take"):
        subquad.varlen_attention(
            jagged, jagged, jagged, torch.tensor([0, 8], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32)
        )
    with pytest.raises(TypeError, match=r"Expected key to be a dense \(strided\) tensor, got layout torch\.sparse_coo"):
        subquad.sdpa(q, q.to_sparse(), q)
    with pytest.raises(
        TypeError, match=r"Expected attn_mask to be a dense \(strided\) tensor, got a torch\.sparse_coo one"
    ):
        subquad.sdpa(q, q, q, attn_mask=(torch.rand(5, 5) > 0.5).to_sparse())


@pytest.mark.parametrize("value", ["no", 1, 0, None, np.bool_(True)])
@pytest.mark.parametrize("flag", ["enable_gqa", "is_causal"])
def test_flags_must_be_bools_as_in_sdpa(flag, value):
    q = _t(1, 2, 4, 8)
    with pytest.raises(TypeError, match=f"{flag} to be a bool"):
        subquad.sdpa(q, q, q, **{flag: value})
    with pytest.raises(TypeError):
        ORIGINAL_SDPA(q, q, q, **{flag: value})


def test_budget_too_large_names_the_argument():
    q = _t(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"memory_budget='1e400' is not a usable number"):
        subquad.attention(q, q, q, memory_budget="1e400")
    assert subquad.explain(q, q, q, memory_budget=10**30).budget_bytes == 2**63 - 1


@pytest.mark.parametrize("scale", [np.float32(0.3), np.float64(0.3), torch.tensor(0.3), 0.3])
def test_scale_accepts_what_sdpa_accepts(scale):
    q, k, v = _t(1, 2, 9, 8), _t(1, 2, 11, 8), _t(1, 2, 11, 8)
    out = subquad.sdpa(q, k, v, scale=scale)
    assert_close_to_golden(out, naive_attention(q, k, v, scale=float(scale)), floor=1e-6)


@pytest.mark.parametrize("p", [np.float32(0.25), torch.tensor(0.25), 1, 1.0])
def test_dropout_accepts_what_sdpa_accepts(p):
    q = _t(1, 2, 9, 8)
    out = subquad.sdpa(q, q, q, dropout_p=p)
    if float(p) == 1.0:  # everything dropped: SDPA's output is 0 too
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.equal(ORIGINAL_SDPA(q, q, q, dropout_p=p), torch.zeros_like(out))
    else:
        assert out.shape == q.shape and torch.isfinite(out).all()


def test_dropout_one_has_zero_gradients():
    q = _t(1, 2, 9, 8, grad=True)
    subquad.attention(q, q, q, dropout_p=1.0).sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


# ----------------------------------------------------------------- empty inputs
EMPTY = [
    pytest.param((2, 0, 5, 5, 8), id="zero-heads"),
    pytest.param((0, 2, 5, 5, 8), id="zero-batch"),
    pytest.param((1, 2, 0, 5, 8), id="zero-Lq"),
    pytest.param((1, 2, 5, 0, 8), id="zero-Lk"),
    pytest.param((1, 2, 5, 5, 0), id="zero-E"),
]


@pytest.mark.parametrize("shape", EMPTY)
@pytest.mark.parametrize("callbacks", [False, True], ids=["plain", "callbacks"])
@pytest.mark.parametrize("backend", ["auto", "matmul"])
def test_empty_inputs_match_sdpa(shape, callbacks, backend):
    B, H, Lq, Lk, E = shape
    q, k, v = _t(B, H, Lq, E, grad=True), _t(B, H, Lk, E, grad=True), _t(B, H, Lk, 3, grad=True)
    kw = dict(mask_mod=lambda b, h, i, j: i >= j, score_mod=lambda s, b, h, i, j: s * 0.5) if callbacks else {}
    out, lse = subquad.attention(q, k, v, backend=backend, return_lse=True, **kw)
    ref = ORIGINAL_SDPA(q, k, v)
    assert out.shape == ref.shape and lse.shape == ref.shape[:-1]
    if E > 0 or Lk == 0:
        assert torch.equal(out, ref) if ref.numel() else True
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape
        assert torch.equal(t.grad, torch.zeros_like(t)) or E == 0


def test_zero_heads_with_gqa():
    q, k = _t(2, 0, 5, 8), _t(2, 0, 5, 8)
    assert subquad.sdpa(q, k, k, enable_gqa=True).shape == (2, 0, 5, 8)


# ----------------------------------------------------------------- batch broadcasting
BROADCASTS = [
    pytest.param((3, 4), (1, 2), True, id="kv-batch-1-gqa"),
    pytest.param((1, 4), (3, 4), False, id="q-batch-1"),
    pytest.param((3, 2), (1, 2), False, id="kv-batch-1"),
]


@pytest.mark.parametrize("backend,chunk", PATHS)
@pytest.mark.parametrize("qb,kb,gqa", BROADCASTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_batch_dims_broadcast_like_sdpa(qb, kb, gqa, backend, chunk, causal):
    q, k, v = _t(*qb, 19, 8, grad=True), _t(*kb, 23, 8, grad=True), _t(*kb, 23, 8, grad=True)
    out = subquad.attention(q, k, v, enable_gqa=gqa, is_causal=causal, backend=backend, chunk_size=chunk)
    ref, grads = _torch_sdpa_grads(q, k, v, enable_gqa=gqa, is_causal=causal)
    assert_close_to_golden(out, ref)
    out.square().sum().backward()
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert t.grad.shape == t.shape
        assert_close_to_golden(t.grad, g, name=f"d{name}")


@pytest.mark.parametrize("backend,chunk", PATHS)
def test_five_dim_partial_broadcast_runs_in_groups(backend, chunk):
    # key/value vary along the second batch dim only and the mask along the first only: the
    # batch cannot be folded into one dim as a view, so the call runs in groups.
    q = _t(2, 3, 2, 11, 8, grad=True)
    k, v = _t(1, 3, 2, 13, 8, grad=True), _t(1, 3, 2, 13, 8, grad=True)
    mask = torch.rand(2, 1, 1, 11, 13) > 0.3
    plan = subquad.explain(q, k, v, attn_mask=mask, backend=backend, chunk_size=chunk)
    assert any("groups" in n for n in plan.notes)
    out, lse = subquad.attention(q, k, v, attn_mask=mask, backend=backend, chunk_size=chunk, return_lse=True)
    ref, grads = _torch_sdpa_grads(q, k, v, attn_mask=mask)
    assert_close_to_golden(out, ref)
    _, ref_lse = naive_attention(q.detach(), k.detach(), v.detach(), attn_mask=mask, return_lse=True)
    assert_close_to_golden(lse, ref_lse, name="lse")
    out.square().sum().backward()
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert_close_to_golden(t.grad, g, name=f"d{name}")


def test_groups_see_the_global_batch_index():
    q, k = _t(2, 3, 2, 11, 8), _t(1, 3, 2, 13, 8)
    mask = torch.rand(2, 1, 1, 11, 13) > 0.3
    seen = []

    def score_mod(s, b, h, i, j):
        # (subquad traces a new score_mod once with fake tensors: their values are symbolic)
        seen.extend(x for x in b.flatten().tolist() if type(x) is int)
        return s + b  # depends on the flattened batch index

    out = subquad.attention(q, k, k, attn_mask=mask, score_mod=score_mod, backend="matmul")
    assert sorted(set(seen)) == list(range(6))
    ref = naive_attention(q, k, k, attn_mask=mask, score_mod=lambda s, b, h, i, j: s + b)
    assert_close_to_golden(out, ref)


# ----------------------------------------------------------------- torch's CausalBias masks
CAUSAL_SHAPES = [pytest.param(13, 13, id="square"), pytest.param(9, 17, id="Lq<Lk"), pytest.param(17, 9, id="Lq>Lk")]


@pytest.mark.parametrize("backend,chunk", PATHS)
@pytest.mark.parametrize("Lq,Lk", CAUSAL_SHAPES)
@pytest.mark.parametrize("make", [causal_upper_left, _lower_right], ids=["upper-left", "lower-right"])
def test_causal_bias_masks_as_in_sdpa(make, Lq, Lk, backend, chunk):
    q, k, v = _t(2, 3, Lq, 8, grad=True), _t(2, 3, Lk, 8, grad=True), _t(2, 3, Lk, 8, grad=True)
    mask = make(Lq, Lk)
    out, lse = subquad.attention(q, k, v, attn_mask=mask, backend=backend, chunk_size=chunk, return_lse=True)
    dense = mask._materialize()
    golden, golden_lse = naive_attention(q.detach(), k.detach(), v.detach(), attn_mask=dense, return_lse=True)
    assert_close_to_golden(out, golden)
    assert_close_to_golden(lse, golden_lse, name="lse")
    _ref, grads = _torch_sdpa_grads(q, k, v, attn_mask=dense)
    out.square().sum().backward()
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert_close_to_golden(t.grad, g, name=f"d{name}")
    # and the same as torch's SDPA given the same object
    assert_close_to_golden(subquad.sdpa(q, k, v, attn_mask=mask), ORIGINAL_SDPA(q, k, v, attn_mask=mask).detach())


def test_causal_bias_lower_right_skips_tiles():
    q, k = _t(1, 1, 64, 8), _t(1, 1, 256, 8)
    from subquad._tiles import TILES

    TILES.reset()
    subquad.attention(q, k, k, attn_mask=_lower_right(64, 256), chunk_size=(16, 16), backend="fused")
    # Bottom-right causal, offset 192: row block r (rows 16r..16r+15) sees keys up to 16r + 207,
    # so it computes key blocks 0..12+r and skips the other 3-r of the 16.
    assert (TILES.computed, TILES.skipped) == (sum(13 + r for r in range(4)), sum(3 - r for r in range(4)))


def test_causal_bias_errors():
    q, k = _t(1, 2, 6, 8), _t(1, 2, 9, 8)
    for mask in (causal_upper_left(6, 9), _lower_right(6, 9)):
        # torch's own test: assertRaisesRegex(ValueError, "CausalBias should not be used with causal=True")
        with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
            ORIGINAL_SDPA(q, k, k, attn_mask=mask, is_causal=True)
        with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
            subquad.sdpa(q, k, k, attn_mask=mask, is_causal=True)
    with pytest.raises(RuntimeError, match=r"causal_lower_right\(6, 8\), but the call has Lq=6 .* Lk=9"):
        subquad.sdpa(q, k, k, attn_mask=causal_lower_right(6, 8))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_causal_bias_under_torch_compile(backend):
    q, k = _t(1, 2, 6, 8, dtype=torch.float32, grad=True), _t(1, 2, 9, 8, dtype=torch.float32, grad=True)
    for mask in (causal_upper_left(6, 9), causal_lower_right(6, 9)):
        torch._dynamo.reset()
        f = torch.compile(lambda q, k, v: subquad.sdpa(q, k, v, attn_mask=mask), backend=backend, fullgraph=True)  # noqa: B023 - compiled and called in this iteration
        out = f(q, k, k)
        ref = ORIGINAL_SDPA(q, k, k, attn_mask=mask._materialize())
        assert (out - ref).abs().max().item() < 1e-5
        g = torch.autograd.grad(out.sum(), q)[0]
        g_ref = torch.autograd.grad(ref.sum(), q)[0]
        assert (g - g_ref).abs().max().item() < 1e-5


# ----------------------------------------------------------------- autograd transforms
def _f(q, k, v):
    return subquad.attention(q, k, v, is_causal=True, chunk_size=(3, 3))


def _ref(q, k, v):
    return naive_attention(q, k, v, is_causal=True)


@pytest.fixture
def qkv_grad():
    return tuple(_t(1, 2, 7, 4, grad=True) for _ in range(3))


def test_gradcheck_with_its_batched_check(qkv_grad):
    assert torch.autograd.gradcheck(_f, qkv_grad, check_batched_grad=True)
    fused = lambda q, k, v: subquad.attention(q, k, v, backend="fused")  # noqa: E731
    assert torch.autograd.gradcheck(fused, qkv_grad, check_batched_grad=True)


def test_is_grads_batched(qkv_grad):
    out = _f(*qkv_grad)
    V = torch.randn(5, *out.shape, dtype=f64)
    got = torch.autograd.grad(out, qkv_grad, V, is_grads_batched=True)
    want = torch.autograd.grad(_ref(*qkv_grad), qkv_grad, V, is_grads_batched=True)
    for g, w in zip(got, want):
        assert_close_to_golden(g, w)


def test_torch_func_grad_jacrev_and_vmap(qkv_grad):
    q, k, v = qkv_grad
    for g, w in zip(
        torch.func.grad(lambda *a: _f(*a).sum(), argnums=(0, 1, 2))(q, k, v),
        torch.func.grad(lambda *a: _ref(*a).sum(), argnums=(0, 1, 2))(q, k, v),
    ):
        assert_close_to_golden(g, w)
    for g, w in zip(
        torch.func.jacrev(_f, argnums=(0, 1, 2))(q, k, v), torch.func.jacrev(_ref, argnums=(0, 1, 2))(q, k, v)
    ):
        assert_close_to_golden(g, w)
    qs = _t(3, 1, 2, 7, 4)
    assert_close_to_golden(
        torch.func.vmap(_f, in_dims=(0, None, None))(qs, k.detach(), v.detach()),
        torch.func.vmap(_ref, in_dims=(0, None, None))(qs, k.detach(), v.detach()),
    )
    per_sample = torch.func.vmap(torch.func.grad(lambda *a: _f(*a).sum()), in_dims=(0, None, None))
    per_sample_ref = torch.func.vmap(torch.func.grad(lambda *a: _ref(*a).sum()), in_dims=(0, None, None))
    assert_close_to_golden(per_sample(qs, k.detach(), v.detach()), per_sample_ref(qs, k.detach(), v.detach()))


def test_vmap_with_dropout_follows_randomness():
    q = _t(4, 1, 2, 9, 8)
    with pytest.raises(RuntimeError, match="random"):
        torch.func.vmap(lambda x: subquad.attention(x, x, x, dropout_p=0.5))(q)
    same = torch.func.vmap(lambda x: subquad.attention(x, x, x, dropout_p=0.5), randomness="same")(
        q[:1].expand(4, -1, -1, -1, -1)
    )
    assert torch.equal(same[0], same[1])
    different = torch.func.vmap(lambda x: subquad.attention(x, x, x, dropout_p=0.5), randomness="different")(
        q[:1].expand(4, -1, -1, -1, -1)
    )
    assert not torch.equal(different[0], different[1])
