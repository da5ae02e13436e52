"""subquad.attention / subquad.sdpa against float64 golden references, on every path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import subquad
from conftest import assert_close_to_golden, naive_attention, to64

PATHS = [
    pytest.param("auto", None, id="auto"),
    pytest.param("fused", None, id="fused-whole"),
    pytest.param("fused", (7, 5), id="fused-7x5"),
    pytest.param("matmul", None, id="matmul-whole"),
    pytest.param("matmul", (7, 5), id="matmul-7x5"),
    pytest.param("matmul", (1, 3), id="matmul-1x3"),
]


def _rand(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


def _call(q, k, v, backend, chunk, **kw):
    try:
        return subquad.attention(q, k, v, backend=backend, chunk_size=chunk, **kw)
    except NotImplementedError as e:
        pytest.skip(f"{backend} refuses: {e}")


# ----------------------------------------------------------------- float64: exact to ~1e-12
SHAPES = [
    pytest.param((1, 1, 1, 1, 8, 8), id="L1"),
    pytest.param((2, 3, 113, 203, 16, 16), id="113x203"),
    pytest.param((1, 2, 64, 17, 59, 59), id="E59-Lq>Lk"),
    pytest.param((1, 2, 33, 40, 111, 111), id="E111"),
    pytest.param((1, 1, 20, 31, 256, 256), id="E256"),
    pytest.param((2, 2, 9, 12, 1, 1), id="E1"),
    pytest.param((1, 2, 19, 23, 16, 7), id="Ev!=E"),
]


@pytest.mark.parametrize("backend,chunk", PATHS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float64_matches_golden(shape, backend, chunk, causal):
    B, H, Lq, Lk, E, Ev = shape
    q, k, v = _rand(B, H, Lq, E), _rand(B, H, Lk, E), _rand(B, H, Lk, Ev)
    if backend == "fused" and Ev != E:  # the CPU flash kernel has one head dim: it must say so, not run
        with pytest.raises(NotImplementedError, match=rf"needs value's head dim Ev == E, got Ev={Ev}, E={E}"):
            subquad.attention(q, k, v, backend=backend, chunk_size=chunk, is_causal=causal)
        return
    out = _call(q, k, v, backend, chunk, is_causal=causal)
    assert_close_to_golden(out, naive_attention(q, k, v, is_causal=causal))


@pytest.mark.parametrize("backend,chunk", PATHS)
def test_matches_torch_sdpa_float32(backend, chunk):
    q, k, v = (
        _rand(2, 4, 70, 32, dtype=torch.float32),
        _rand(2, 4, 90, 32, dtype=torch.float32),
        _rand(2, 4, 90, 32, dtype=torch.float32),
    )
    out = _call(q, k, v, backend, chunk)
    ref = F.scaled_dot_product_attention(q, k, v)
    golden = naive_attention(*to64(q, k, v))
    assert_close_to_golden(out, golden, ref)


# ----------------------------------------------------------------- masks of every broadcast shape
MASK_SHAPES = [
    pytest.param((13, 17), id="LqxLk"),
    pytest.param((17,), id="Lk"),
    pytest.param((1, 17), id="1xLk"),
    pytest.param((13, 1), id="Lqx1"),
    pytest.param((3, 13, 17), id="HxLqxLk"),
    pytest.param((2, 1, 1, 17), id="Bx1x1xLk"),
    pytest.param((2, 3, 13, 17), id="full"),
    pytest.param((1, 1, 1, 1), id="scalar4d"),
]


@pytest.mark.parametrize("backend,chunk", PATHS)
@pytest.mark.parametrize("mask_shape", MASK_SHAPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks(mask_shape, kind, backend, chunk):
    q, k, v = _rand(2, 3, 13, 8), _rand(2, 3, 17, 8), _rand(2, 3, 17, 8)
    if kind == "bool":
        mask = torch.rand(mask_shape) > 0.4
    else:
        mask = _rand(*mask_shape).masked_fill(torch.rand(mask_shape) > 0.7, float("-inf"))
    out = _call(q, k, v, backend, chunk, attn_mask=mask)
    assert_close_to_golden(out, naive_attention(q, k, v, attn_mask=mask))
    if mask.dim() >= 2:  # SDPA itself rejects 1-D masks; subquad broadcasts them
        assert_close_to_golden(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), floor=1e-10)


@pytest.mark.parametrize("backend,chunk", PATHS)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_give_zero_and_lse_minus_inf(kind, backend, chunk):
    q, k, v = _rand(1, 2, 9, 8), _rand(1, 2, 11, 8), _rand(1, 2, 11, 8)
    keep = torch.rand(9, 11) > 0.3
    keep[2] = False
    keep[7] = False
    mask = keep if kind == "bool" else torch.zeros(9, 11, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    out, lse = _call(q, k, v, backend, chunk, attn_mask=mask, return_lse=True)
    assert torch.equal(out[:, :, [2, 7]], torch.zeros_like(out[:, :, [2, 7]]))
    assert torch.isneginf(lse[:, :, [2, 7]]).all()
    ref_out, ref_lse = naive_attention(q, k, v, attn_mask=mask, return_lse=True)
    assert_close_to_golden(out, ref_out)
    assert_close_to_golden(lse, ref_lse, name="lse")
    assert_close_to_golden(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), floor=1e-10)


@pytest.mark.parametrize("backend,chunk", PATHS)
def test_return_lse(backend, chunk):
    q, k, v = _rand(2, 2, 21, 16), _rand(2, 2, 30, 16), _rand(2, 2, 30, 16)
    out, lse = _call(q, k, v, backend, chunk, return_lse=True)
    ref_out, ref_lse = naive_attention(q, k, v, return_lse=True)
    assert lse.shape == (2, 2, 21) and lse.dtype == torch.float64
    assert_close_to_golden(out, ref_out)
    assert_close_to_golden(lse, ref_lse, name="lse")
    q32, k32, v32 = (t.float() for t in (q, k, v))
    _, lse32 = _call(q32, k32, v32, backend, chunk, return_lse=True)
    assert lse32.dtype == torch.float32


def test_lse_merges_partial_attentions():
    """Two calls over disjoint key halves merge exactly into the full attention (ring attention)."""
    q, k, v = _rand(1, 2, 10, 8), _rand(1, 2, 24, 8), _rand(1, 2, 24, 8)
    o1, l1 = subquad.attention(q, k[:, :, :11], v[:, :, :11], return_lse=True)
    o2, l2 = subquad.attention(q, k[:, :, 11:], v[:, :, 11:], return_lse=True)
    lse = torch.logaddexp(l1, l2)
    merged = o1 * (l1 - lse).exp().unsqueeze(-1) + o2 * (l2 - lse).exp().unsqueeze(-1)
    assert_close_to_golden(merged, naive_attention(q, k, v))


# ----------------------------------------------------------------- layout: batch dims, GQA, views
@pytest.mark.parametrize("backend,chunk", PATHS)
def test_leading_batch_dims(backend, chunk):
    q, k, v = _rand(2, 3, 4, 10, 8), _rand(2, 3, 4, 12, 8), _rand(2, 3, 4, 12, 8)
    mask = torch.rand(3, 1, 10, 12) > 0.3
    out = _call(q, k, v, backend, chunk, attn_mask=mask)
    assert out.shape == (2, 3, 4, 10, 8)
    assert_close_to_golden(out, naive_attention(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("backend,chunk", PATHS)
def test_three_and_two_dim_inputs(backend, chunk):
    q, k, v = _rand(3, 10, 8), _rand(3, 12, 8), _rand(3, 12, 8)
    assert_close_to_golden(_call(q, k, v, backend, chunk), naive_attention(q, k, v))
    q2, k2, v2 = _rand(10, 8), _rand(12, 8), _rand(12, 8)
    out = _call(q2, k2, v2, backend, chunk, is_causal=True)
    assert out.shape == (10, 8)
    assert_close_to_golden(out, F.scaled_dot_product_attention(q2, k2, v2, is_causal=True), floor=1e-10)


@pytest.mark.parametrize("backend,chunk", PATHS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa(backend, chunk, causal):
    q, k, v = _rand(2, 8, 15, 16), _rand(2, 2, 19, 16), _rand(2, 2, 19, 16)
    mask = None if causal else torch.rand(8, 15, 19) > 0.3
    out = _call(q, k, v, backend, chunk, enable_gqa=True, is_causal=causal, attn_mask=mask)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=causal, attn_mask=mask)
    assert_close_to_golden(out, ref, floor=1e-10)
    assert_close_to_golden(out, naive_attention(q, k, v, enable_gqa=True, is_causal=causal, attn_mask=mask))


@pytest.mark.parametrize("backend,chunk", PATHS)
def test_non_contiguous_inputs(backend, chunk):
    q = _rand(2, 17, 3, 16).transpose(1, 2)  # (B, H, L, E) view of (B, L, H, E)
    k = _rand(2, 16, 25, 3).permute(0, 3, 2, 1)  # (B, H, L, E) with E strided
    v = _rand(2, 3, 25, 32)[..., ::2]
    mask = (torch.rand(17, 50) > 0.3)[:, ::2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous() or mask.is_contiguous())
    out = _call(q, k, v, backend, chunk, attn_mask=mask)
    assert_close_to_golden(out, naive_attention(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("backend,chunk", PATHS)
def test_scale_and_causal_lq_ne_lk(backend, chunk):
    for Lq, Lk in [(5, 12), (12, 5)]:
        q, k, v = _rand(1, 2, Lq, 8), _rand(1, 2, Lk, 8), _rand(1, 2, Lk, 8)
        out = _call(q, k, v, backend, chunk, is_causal=True, scale=0.3)
        assert_close_to_golden(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3), floor=1e-10)


@pytest.mark.parametrize("backend,chunk", PATHS)
def test_empty_lengths(backend, chunk):
    Ev = 8 if backend == "fused" else 4  # the fused kernel has one head dim for keys and values
    q, k, v = _rand(2, 3, 0, 8), _rand(2, 3, 5, 8), _rand(2, 3, 5, Ev)
    out = _call(q, k, v, backend, chunk)
    assert out.shape == (2, 3, 0, Ev)
    q, k, v = _rand(2, 3, 4, 8), _rand(2, 3, 0, 8), _rand(2, 3, 0, 8)
    out, lse = _call(q, k, v, backend, chunk, return_lse=True)
    assert torch.equal(out, torch.zeros(2, 3, 4, 8, dtype=torch.float64))
    assert torch.isneginf(lse).all()


# ----------------------------------------------------------------- low precision
@pytest.mark.parametrize("backend,chunk", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_low_precision_large_logits(dtype, backend, chunk, causal):
    g = torch.Generator().manual_seed(1)
    # Logits in the hundreds: fp16 scores would overflow if not kept in float32.
    q = (torch.randn(2, 3, 37, 64, generator=g) * 8).to(dtype)
    k = (torch.randn(2, 3, 45, 64, generator=g) * 8).to(dtype)
    v = torch.randn(2, 3, 45, 64, generator=g).to(dtype)
    mask = None if causal else torch.rand(37, 45, generator=g) > 0.2
    out = _call(q, k, v, backend, chunk, is_causal=causal, attn_mask=mask)
    assert out.dtype == dtype
    golden = naive_attention(*to64(q, k, v), is_causal=causal, attn_mask=mask)
    reference = naive_attention(q, k, v, is_causal=causal, attn_mask=mask)
    assert_close_to_golden(out, golden, reference)


# ----------------------------------------------------------------- dropout
@pytest.mark.parametrize("chunk", [None, (5, 7)])
def test_dropout_is_unbiased_and_reproducible(chunk):
    q, k, v = _rand(1, 2, 8, 8), _rand(1, 2, 64, 8), _rand(1, 2, 64, 8)
    ref = naive_attention(q, k, v)
    torch.manual_seed(5)
    a = subquad.attention(q, k, v, dropout_p=0.3, chunk_size=chunk)
    torch.manual_seed(5)
    b = subquad.attention(q, k, v, dropout_p=0.3, chunk_size=chunk)
    assert torch.equal(a, b), "the same RNG state must give the same dropout masks"
    assert not torch.allclose(a, ref), "dropout changed nothing"
    mean = torch.stack([subquad.attention(q, k, v, dropout_p=0.3, chunk_size=chunk) for _ in range(400)]).mean(0)
    # E[dropout(P) V] = P V; the sample mean of 400 draws is within a few standard errors.
    assert (mean - ref).abs().max() < 0.08, (mean - ref).abs().max()


def test_dropout_mask_independent_of_tiling():
    q, k, v = _rand(1, 2, 12, 8), _rand(1, 2, 30, 8), _rand(1, 2, 30, 8)
    outs = []
    for chunk in [None, (5, 7), (1, 1)]:
        torch.manual_seed(11)
        outs.append(subquad.attention(q, k, v, dropout_p=0.5, chunk_size=chunk, backend="matmul"))
    assert_close_to_golden(outs[1], outs[0])
    assert_close_to_golden(outs[2], outs[0])


def test_dropout_keep_rate():
    from subquad._tiles import dropout_scale
    from subquad._validate import make_inputs

    inp = make_inputs(_rand(2, 4, 64, 8), _rand(2, 4, 256, 8), _rand(2, 4, 256, 8), dropout_p=0.25)
    z = dropout_scale(inp, 1234, 0, 64, 0, 256, torch.float64)
    kept = (z > 0).double().mean().item()
    assert abs(kept - 0.75) < 0.01, kept
    assert torch.allclose(z[z > 0], torch.full_like(z[z > 0], 1 / 0.75))


# ----------------------------------------------------------------- sdpa drop-in
def test_sdpa_signature_matches_torch():
    import inspect

    ours = list(inspect.signature(subquad.sdpa).parameters)[:8]
    theirs = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    assert ours == theirs


def test_sdpa_positional_and_options():
    q, k, v = _rand(1, 2, 10, 8), _rand(1, 2, 10, 8), _rand(1, 2, 10, 8)
    mask = torch.rand(10, 10) > 0.5
    out = subquad.sdpa(q, k, v, mask, 0.0, False, 0.5, False, chunk_size=(3, 4), memory_budget="64MiB")
    assert_close_to_golden(out, F.scaled_dot_product_attention(q, k, v, mask, scale=0.5), floor=1e-10)
    with pytest.raises(TypeError, match="return_lse"):
        subquad.sdpa(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="bogus"):
        subquad.sdpa(q, k, v, bogus=1)


def test_fused_tile_skipping_counts_causal():
    from subquad._tiles import TILES

    q, k, v = _rand(1, 1, 64, 8), _rand(1, 1, 64, 8), _rand(1, 1, 64, 8)
    TILES.reset()
    subquad.attention(q, k, v, is_causal=True, chunk_size=(16, 16), backend="matmul")
    # 4 x 4 tiles, 6 above the diagonal are never computed.
    assert (TILES.computed, TILES.skipped) == (10, 6)


# ----------------------------------------------------------------- issue 10: silent errors fixed
@pytest.mark.parametrize("backend,chunk", PATHS)
def test_causal_with_a_mask_that_hides_every_visible_key_of_a_row(backend, chunk):
    # Row 0 of the diagonal tile sees only key 0 (causal), which the mask hides: the fused
    # kernel reports lse 0 for it unless the check accounts for the causal part.
    q = k = v = _rand(1, 1, 8, 16)
    dense = torch.ones(8, 8, dtype=torch.bool).tril() & ~torch.eye(8, dtype=torch.bool)
    golden, golden_lse = naive_attention(q, k, v, attn_mask=dense, return_lse=True)
    for kw in (
        dict(is_causal=True, mask_mod=lambda b, h, i, j: i != j),
        dict(attn_mask=~torch.eye(8, dtype=torch.bool), mask_mod=subquad.mods.causal()),
    ):
        out, lse = _call(q, k, v, backend, chunk or (4, 4), return_lse=True, **kw)
        assert_close_to_golden(out, golden)
        assert_close_to_golden(lse, golden_lse, name="lse")
        assert lse[0, 0, 0].item() == float("-inf")


def test_causal_with_a_mask_on_the_planners_tiles():
    q, k, v = (_rand(1, 4, 2048, 64, dtype=torch.float32) for _ in range(3))
    mask = ~torch.eye(2048, dtype=torch.bool)
    plan = subquad.explain(q, k, v, attn_mask=mask, mask_mod=subquad.mods.causal(), memory_budget="2MiB")
    assert plan.backend == "fused" and plan.chunk_size[0] < 2048
    out = subquad.attention(q, k, v, attn_mask=mask, mask_mod=subquad.mods.causal(), memory_budget="2MiB")
    golden = naive_attention(*to64(q, k, v), attn_mask=mask & torch.ones(2048, 2048, dtype=torch.bool).tril())
    assert_close_to_golden(
        out, golden, naive_attention(q, k, v, attn_mask=mask & torch.ones(2048, 2048, dtype=torch.bool).tril())
    )


@pytest.mark.parametrize("backend,chunk", PATHS)
@pytest.mark.parametrize("scale", [0.0, -0.5], ids=["scale0", "negative"])
def test_causal_with_nonpositive_scale(backend, chunk, scale):
    q, k, v = _rand(2, 3, 13, 8), _rand(2, 3, 17, 8), _rand(2, 3, 17, 8)
    out, lse = _call(q, k, v, backend, chunk, is_causal=True, scale=scale, return_lse=True)
    golden, golden_lse = naive_attention(q, k, v, is_causal=True, scale=scale, return_lse=True)
    assert_close_to_golden(out, golden)
    assert_close_to_golden(lse, golden_lse, name="lse")


def test_causal_with_nonpositive_scale_backward():
    q, k, v = (_rand(1, 2, 13, 8).requires_grad_() for _ in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: subquad.attention(q, k, v, is_causal=True, scale=-0.3), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_with_a_float32_mask_keep_the_mask_in_float32(dtype):
    q, k, v = (_rand(1, 2, 64, 16, dtype=torch.float32).to(dtype) for _ in range(3))
    mask = torch.randn(64, 64) * 3
    _golden_out, golden_lse = naive_attention(*to64(q, k, v), attn_mask=mask.double(), return_lse=True)
    errs = {}
    for backend in ("fused", "matmul"):
        _out, lse = subquad.attention(q, k, v, attn_mask=mask, return_lse=True, backend=backend)
        errs[backend] = (lse.double() - golden_lse).abs().max().item()
    # Rounding the mask to 8 bits of mantissa gave 4e-2 on the fused path; the matmul path is ~1e-6.
    assert errs["fused"] < 1e-3, errs
