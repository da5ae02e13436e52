"""The seeds' own functions over subquad: ``subquad.compat.sub_quadratic`` (Birch-san's, in ComfyUI's
and AUTOMATIC1111's layouts) and ``subquad.compat.memory_efficient_attention`` (the seed package's
``efficient_dot_product_attention_pt`` / ``_jax``).

Goldens are float64 materializations of each function's *definition* (the seed package's chunking
returns 12 rows for 10 queries in chunks of 4 and counts overlapping keys twice; these goldens do
not), half precision is judged against a same-dtype naive reference, and the callbacks are
checked for the seed's calling convention (argument order, offsets, layouts, what each sees).
"""

from __future__ import annotations

import math

import pytest
import torch

import subquad
from conftest import assert_close_to_golden
from subquad._errors import ArgumentError, ArgumentTypeError
from subquad.compat import memory_efficient_attention as mea
from subquad.compat import sub_quadratic as sq

F64 = torch.float64


def randn(*shape, dtype=F64, grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out.shape, generator=g, dtype=F64).to(out.dtype)
    return torch.autograd.grad((out * weight).sum(), inputs)


# ============================================================================ sub_quadratic
def softmax_golden(q, k, v, mask=None):
    """``softmax(q kᵀ / sqrt(E) + mask) v`` in float64, ``(B*H, L, E)``; a float or bool mask."""
    s = q.double() @ k.double().transpose(1, 2) * q.shape[-1] ** -0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return torch.softmax(s, -1) @ v.double()


SQ_CASES = {
    # id: (B*H, Lq, Lk, E, Ev, query_chunk_size, kv_chunk_size, kv_chunk_size_min)
    "10x10-chunks-of-4": (6, 10, 10, 8, 8, 4, 4, None),
    "one-query": (3, 1, 17, 16, 16, 1024, None, None),
    "33x70-head-dim-59": (4, 33, 70, 59, 59, 8, None, None),
    "head-dim-1": (2, 10, 10, 1, 1, 4, 3, None),
    "kv-chunk-min-raises-sqrt": (2, 20, 50, 8, 5, 7, None, 16),
}


@pytest.mark.parametrize("layout", ["comfyui", "a1111"])
@pytest.mark.parametrize("case", list(SQ_CASES), ids=list(SQ_CASES))
def test_sub_quadratic_float64_matches_golden_with_gradients(case, layout):
    BH, Lq, Lk, E, Ev, qc, kc, kmin = SQ_CASES[case]
    q, k, v = randn(BH, Lq, E, grad=True), randn(BH, Lk, E, grad=True), randn(BH, Lk, Ev, grad=True)
    options = dict(query_chunk_size=qc, kv_chunk_size=kc, kv_chunk_size_min=kmin)
    if layout == "comfyui":
        out = sq.efficient_dot_product_attention(q, k.transpose(1, 2), v, **options)
    else:
        out = sq.efficient_dot_product_attention_a1111(q, k, v, **options)
    golden = softmax_golden(q, k, v)
    assert_close_to_golden(out, golden)
    # ComfyUI's own backward fails (an in-place exp on a tensor autograd needs); this one is exact.
    for name, g, want in zip("qkv", grads(out, (q, k, v)), grads(golden, (q, k, v))):
        assert_close_to_golden(g, want, name=f"d{name}")


@pytest.mark.parametrize(
    "Lq, Lk, query_chunk_size, kv_chunk_size, kv_chunk_size_min, tiles",
    [
        (30, 50, 1024, None, None, (30, 7)),  # int(sqrt(50))
        (30, 50, 8, None, 16, (8, 16)),  # raised to the minimum
        (30, 50, 8, 20, 30, (8, 30)),  # the minimum applies even to a given kv_chunk_size, as the original
        (30, 50, 8, 0, None, (8, 7)),  # 0 means sqrt there (`kv_chunk_size or ...`)
        (30, 50, 8, 100, None, (8, 50)),  # at most Lk
        (30, 50, 8, None, 100, (8, 50)),
        (1, 1, 1024, None, None, (1, 1)),
    ],
)
def test_sub_quadratic_chunk_sizes_are_the_originals(
    monkeypatch, Lq, Lk, query_chunk_size, kv_chunk_size, kv_chunk_size_min, tiles
):
    seen = []
    real = subquad.attention

    def spy(*args, **kwargs):
        seen.append(kwargs["chunk_size"])
        return real(*args, **kwargs)

    monkeypatch.setattr(subquad, "attention", spy)
    q, k, v = randn(2, Lq, 4), randn(2, Lk, 4), randn(2, Lk, 4)
    out = sq.efficient_dot_product_attention(
        q, k.transpose(1, 2), v, query_chunk_size, kv_chunk_size, kv_chunk_size_min
    )
    assert seen == [tiles]
    assert_close_to_golden(out, softmax_golden(q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("upcast", [False, True], ids=["as-is", "upcast"])
def test_sub_quadratic_half_precision(dtype, upcast):
    q, k, v = randn(4, 37, 40, dtype=dtype), randn(4, 45, 40, dtype=dtype), randn(4, 45, 40, dtype=dtype)
    out = sq.efficient_dot_product_attention(q, k.transpose(1, 2), v, 16, 9, upcast_attention=upcast)
    assert out.dtype == dtype
    s = (q @ k.transpose(1, 2)) * 40**-0.5  # the same-dtype naive reference, float32 softmax
    naive = torch.softmax(s.float(), -1).to(dtype) @ v
    assert_close_to_golden(out, softmax_golden(q, k, v), naive)


def test_upcast_attention_computes_in_float32(monkeypatch):
    seen = []
    real = subquad.attention

    def spy(query, key, value, **kwargs):
        seen.append((query.dtype, key.dtype, value.dtype))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(subquad, "attention", spy)
    q, k, v = (randn(2, 9, 8, dtype=torch.float16) for _ in range(3))
    out = sq.efficient_dot_product_attention(q, k.transpose(1, 2), v, upcast_attention=True)
    assert seen == [(torch.float32,) * 3] and out.dtype == torch.float16
    # float64 is not "upcast" to float32.
    sq.efficient_dot_product_attention(randn(2, 9, 8), randn(2, 8, 9), randn(2, 9, 8), upcast_attention=True)
    assert seen[-1] == (F64,) * 3


def test_a1111_upcast_query_and_key_with_half_value():
    # AUTOMATIC1111 upcasts q and k itself and passes a half value; the output is in value's dtype.
    q, k = randn(3, 21, 16, dtype=torch.float32), randn(3, 13, 16, dtype=torch.float32)
    v = randn(3, 13, 16, dtype=torch.float16)
    out = sq.efficient_dot_product_attention_a1111(q, k, v, 8)
    assert out.dtype == torch.float16
    naive = (torch.softmax(q @ k.transpose(1, 2) * 0.25, -1) @ v.float()).half()
    assert_close_to_golden(out, softmax_golden(q, k, v), naive)


@pytest.mark.parametrize(
    "shape", [(4, 10, 13), (1, 10, 13), (4, 1, 13), (10, 13)], ids=["per-head", "shared", "per-key", "2-D"]
)
def test_comfyui_mask_is_added(shape):
    q, k, v = randn(4, 10, 8, grad=True), randn(4, 13, 8, grad=True), randn(4, 13, 6, grad=True)
    mask = torch.randn(shape, dtype=F64)
    mask = mask.masked_fill(torch.rand(shape) < 0.3, float("-inf"))
    out = sq.efficient_dot_product_attention(q, k.transpose(1, 2), v, 4, 5, mask=mask)
    golden = torch.nan_to_num(softmax_golden(q, k, v, mask))  # the original: NaN where a row sees nothing
    assert_close_to_golden(out, golden)
    bool_mask = torch.rand(4, 10, 13) < 0.7
    out = sq.efficient_dot_product_attention(q, k.transpose(1, 2), v, 4, 5, mask=bool_mask)
    assert_close_to_golden(out, torch.nan_to_num(softmax_golden(q, k, v, bool_mask)))


def test_sub_quadratic_refusals():
    q, k, v = randn(2, 10, 8), randn(2, 6, 8), randn(2, 6, 8)
    f, a1111 = sq.efficient_dot_product_attention, sq.efficient_dot_product_attention_a1111
    with pytest.raises(ArgumentError, match=r"AUTOMATIC1111's layout.*efficient_dot_product_attention_a1111"):
        f(q, k, v)
    with pytest.raises(ArgumentError, match=r"ComfyUI's layout.*call efficient_dot_product_attention"):
        a1111(q, k.transpose(1, 2), v)
    with pytest.raises(ArgumentError, match=r"B\*H = 2"):
        f(q, randn(3, 8, 6), randn(3, 6, 8))
    with pytest.raises(ArgumentError, match=r"query to be 3-D \(B\*H, Lq, E\)"):
        f(q[None], k.transpose(1, 2), v)
    with pytest.raises(ArgumentTypeError, match=r"key_t to be a torch\.Tensor"):
        f(q, k.transpose(1, 2).numpy(), v)
    with pytest.raises(ArgumentError, match="query_chunk_size >= 1, got 0"):
        f(q, k.transpose(1, 2), v, 0)
    with pytest.raises(ArgumentTypeError, match="query_chunk_size to be an int, got True"):
        f(q, k.transpose(1, 2), v, True)
    with pytest.raises(ArgumentError, match="kv_chunk_size >= 0, got -1"):
        f(q, k.transpose(1, 2), v, 4, -1)
    with pytest.raises(ArgumentTypeError, match=r"kv_chunk_size_min to be an int, got 2\.5"):
        f(q, k.transpose(1, 2), v, 4, None, 2.5)
    with pytest.raises(ArgumentTypeError, match="upcast_attention to be a bool"):
        f(q, k.transpose(1, 2), v, upcast_attention="yes")
    with pytest.raises(ArgumentTypeError, match="use_checkpoint to be a bool"):
        a1111(q, k, v, use_checkpoint=None)


def test_budget_error_names_the_chunk_sizes(monkeypatch):
    def too_big(*args, **kwargs):
        raise subquad.MemoryBudgetError("chunk_size=(8, 6) does not fit")

    monkeypatch.setattr(subquad, "attention", too_big)
    q, k, v = randn(2, 10, 8), randn(2, 6, 8), randn(2, 6, 8)
    with pytest.raises(
        subquad.MemoryBudgetError, match=r"query_chunk_size=8 and kv_chunk_size=None.*smaller chunk sizes"
    ):
        sq.efficient_dot_product_attention(q, k.transpose(1, 2), v, 8)
    with pytest.raises(
        subquad.MemoryBudgetError, match=r"query_chunk_size=8 and key_chunk_size=4096.*smaller chunk sizes"
    ):
        mea.efficient_dot_product_attention_pt(randn(10, 2, 8), randn(6, 2, 8), randn(6, 2, 8), query_chunk_size=8)


# ============================================================================ memory_efficient_attention
def seed_golden(q, k, v, mask=None, bias=None, dtype=F64):
    """The seed's definition in ``dtype`` (float32 softmax for half): ``[batch..., L, H, E]``, mask and
    bias ``[batch..., H, Lq, Lk]``, masked scores ``finfo(dtype).min`` (a dead row averages the values)."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    s = torch.einsum("...qhd,...khd->...qhk", q / math.sqrt(q.shape[-1]), k)
    if bias is not None:
        s = s + bias.to(dtype).transpose(-3, -2)
    if mask is not None:
        s = torch.where(mask.transpose(-3, -2), s, torch.finfo(dtype).min)
    p = torch.softmax(s.float() if dtype in (torch.float16, torch.bfloat16) else s, -1).to(dtype)
    return torch.einsum("...qhk,...khf->...qhf", p, v)


PT_CASES = {
    # id: (batch, Lq, Lk, H, E, Ev, query_chunk_size, key_chunk_size)
    "10-in-chunks-of-4": ((2,), 10, 10, 2, 8, 8, 4, 4),  # the seed returns 12 rows here
    "16-keys-in-chunks-of-6": ((2,), 16, 16, 2, 8, 8, 6, 6),  # the seed counts keys 12..15 twice
    "16-in-chunks-of-4": ((1,), 16, 16, 3, 8, 8, 4, 4),
    "one-query": ((2,), 1, 9, 2, 8, 8, 4, 4),
    "13x29-head-dim-59": ((2,), 13, 29, 2, 59, 7, 5, 8),
    "head-dim-1": ((), 10, 7, 3, 1, 1, 4, 3),
    "two-batch-dims": ((2, 3), 9, 11, 2, 8, 8, 4, 5),
}


def pt_inputs(batch, Lq, Lk, H, E, Ev, dead_row=True):
    q, k, v = (
        randn(*batch, Lq, H, E, grad=True),
        randn(*batch, Lk, H, E, grad=True),
        randn(*batch, Lk, H, Ev, grad=True),
    )
    mask = torch.rand(*batch, H, Lq, Lk) < 0.6
    if dead_row:
        mask[(0,) * len(batch) + (0, Lq // 2)] = False  # one row sees no key: the seed averages the values
    bias = randn(*batch[1:], H, 1 if Lq > 1 else Lq, Lk, grad=True)  # broadcast over a batch dim and the rows
    return q, k, v, mask, bias


@pytest.mark.parametrize("extras", ["none", "mask", "bias", "mask+bias"])
@pytest.mark.parametrize("case", list(PT_CASES), ids=list(PT_CASES))
def test_pt_float64_matches_the_definition_with_gradients(case, extras):
    batch, Lq, Lk, H, E, Ev, qc, kc = PT_CASES[case]
    q, k, v, mask, bias = pt_inputs(batch, Lq, Lk, H, E, Ev)
    mask = mask if "mask" in extras else None
    bias = bias if "bias" in extras else None
    out = mea.efficient_dot_product_attention_pt(q, k, v, mask, bias, qc, kc)
    golden = seed_golden(q, k, v, mask, bias)
    assert out.shape == (*batch, Lq, H, Ev)
    assert_close_to_golden(out, golden)
    inputs = [q, k, v] + ([bias] if bias is not None else [])
    for name, g, want in zip(["dq", "dk", "dv", "dbias"], grads(out, inputs), grads(golden, inputs)):
        assert_close_to_golden(g, want, name=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("extras", ["none", "mask+bias"])
def test_pt_half_precision(dtype, extras):
    q, k, v, mask, bias = pt_inputs((2,), 21, 18, 2, 32, 32)
    q, k, v = (t.detach().to(dtype) for t in (q, k, v))
    mask, bias = (mask, bias.detach().to(dtype)) if extras != "none" else (None, None)
    out = mea.efficient_dot_product_attention_pt(q, k, v, mask, bias, 8, 5)
    assert out.dtype == dtype
    assert_close_to_golden(out, seed_golden(q, k, v, mask, bias), seed_golden(q, k, v, mask, bias, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
def test_fully_masked_row_averages_the_values(dtype):
    """``where(mask, s, finfo.min)``: a row with no visible key is a uniform softmax over all keys,
    in the output and in its gradient (dv = 1/Lk of the row's gradient, dq = 0)."""
    q, k, v = (randn(1, 12, 2, 8, dtype=dtype, grad=True) for _ in range(3))
    mask = torch.ones(1, 2, 12, 12, dtype=torch.bool)
    mask[0, 1, 5] = False
    out = mea.efficient_dot_product_attention_pt(q, k, v, mask, None, 4, 5)
    torch.testing.assert_close(out[0, 5, 1], v[0, :, 1].mean(0))
    g_out = torch.zeros_like(out)
    g_out[0, 5, 1] = 1.0
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g_out)
    torch.testing.assert_close(dv[0, :, 1], torch.full((12, 8), 1 / 12, dtype=dtype))
    assert dq.abs().max() == 0 and dk.abs().max() == 0

    # The seed's own test builds its masks by hand in weights_calc_fn with finfo.min: the same row.
    def weights_calc_fn(q_offset, k_offset, w, data):
        qn, kn = w.shape[-3], w.shape[-1]
        chunk = data[..., q_offset : q_offset + qn, k_offset : k_offset + kn]
        return torch.where(chunk.transpose(-3, -2), w, torch.finfo(w.dtype).min)

    by_hand = mea.efficient_dot_product_attention_pt(
        q, k, v, None, None, 4, 5, weights_calc_fn=weights_calc_fn, calc_fn_data=mask
    )
    torch.testing.assert_close(by_hand, out)
    assert_close_to_golden(
        grads(by_hand, (q, v))[1],
        grads(seed_golden(q, k, v, mask), (q, v))[1].to(dtype),
        floor=1e-6 if dtype == torch.float32 else None,
        name="dv",
    )


def test_callbacks_calling_convention():
    """Argument order, offsets (q an int, k a 0-d int64 tensor), the chunks' layout and what each
    callback sees: bias_calc_fn the scores before the bias, mask_calc_fn after it, weights_calc_fn
    after the mask (finfo.min), all per (query chunk, key chunk) of at most 4 x 3."""
    torch.manual_seed(0)
    Lq, Lk, H, E = 10, 7, 3, 8
    q, k, v = randn(2, Lq, H, E), randn(2, Lk, H, E), randn(2, Lk, H, 5)
    mask = torch.rand(2, H, Lq, Lk) < 0.7
    bias = randn(2, H, 1, Lk)  # broadcast over the rows: its chunk keeps that
    scores = torch.einsum("...qhd,...khd->...qhk", q / math.sqrt(E), k)
    data = object()
    seen = {"bias": [], "mask": [], "weights": []}

    def tile(t, q0, qn, k0, kn):  # scores [.., q, H, k] at the tile
        return t[..., q0 : q0 + qn, :, k0 : k0 + kn]

    def bias_calc_fn(q_offset, k_offset, bias_chunk, attn_weights, calc_fn_data):
        assert calc_fn_data is data
        assert isinstance(q_offset, int) and k_offset.dtype == torch.int64 and k_offset.dim() == 0
        qn, kn = attn_weights.shape[-3], attn_weights.shape[-1]
        seen["bias"].append((q_offset, int(k_offset), qn, kn))
        k0 = int(k_offset)
        assert torch.equal(bias_chunk, bias[..., k0 : k0 + kn])
        torch.testing.assert_close(attn_weights, tile(scores, q_offset, qn, k0, kn))
        return bias_chunk * 2.0

    def mask_calc_fn(q_offset, k_offset, mask_chunk, attn_weights, calc_fn_data):
        qn, kn, k0 = attn_weights.shape[-3], attn_weights.shape[-1], int(k_offset)
        seen["mask"].append((q_offset, k0, qn, kn))
        assert torch.equal(mask_chunk, mask[..., q_offset : q_offset + qn, k0 : k0 + kn])
        torch.testing.assert_close(attn_weights, tile(scores + 2 * bias.transpose(-3, -2), q_offset, qn, k0, kn))
        return mask_chunk

    def weights_calc_fn(q_offset, k_offset, attn_weights, calc_fn_data):
        qn, kn, k0 = attn_weights.shape[-3], attn_weights.shape[-1], int(k_offset)
        seen["weights"].append((q_offset, k0, qn, kn))
        full = torch.where(mask.transpose(-3, -2), scores + 2 * bias.transpose(-3, -2), torch.finfo(F64).min)
        torch.testing.assert_close(attn_weights, tile(full, q_offset, qn, k0, kn))
        return attn_weights

    with torch.no_grad():
        out = mea.efficient_dot_product_attention_pt(
            q,
            k,
            v,
            mask,
            bias,
            4,
            3,
            bias_calc_fn=bias_calc_fn,
            mask_calc_fn=mask_calc_fn,
            weights_calc_fn=weights_calc_fn,
            calc_fn_data=data,
        )
    grid = sorted((q0, k0, min(4, Lq - q0), min(3, Lk - k0)) for q0 in range(0, Lq, 4) for k0 in range(0, Lk, 3))
    for name, calls in seen.items():
        assert sorted(calls) == grid, name
    assert_close_to_golden(out, seed_golden(q, k, v, mask, 2 * bias))


def test_each_callback_kind_with_calc_fn_data_and_gradients():
    """The seed's recipes: a bias table sliced per chunk from calc_fn_data (it gets its gradient),
    a causal mask computed from the offsets, and both applied by hand in weights_calc_fn."""
    Lq, Lk, H = 11, 11, 2
    q, k, v = randn(2, Lq, H, 8, grad=True), randn(2, Lk, H, 8, grad=True), randn(2, Lk, H, 8, grad=True)
    table = randn(2, H, Lq, Lk, grad=True)
    causal = torch.ones(Lq, Lk, dtype=torch.bool).tril().expand(2, H, Lq, Lk)

    def bias_calc_fn(q_offset, k_offset, bias_chunk, w, data):
        assert bias_chunk is None
        return data[..., q_offset : q_offset + w.shape[-3], k_offset : k_offset + w.shape[-1]]

    def mask_calc_fn(q_offset, k_offset, mask_chunk, w, data):
        rows = q_offset + torch.arange(w.shape[-3])
        keys = k_offset + torch.arange(w.shape[-1])
        return (keys[None, :] <= rows[:, None])[None]  # [H=1, q, k]

    def weights_calc_fn(q_offset, k_offset, w, data):
        chunk = (slice(q_offset, q_offset + w.shape[-3]), slice(k_offset, k_offset + w.shape[-1]))
        w = w + data[0][..., chunk[0], chunk[1]].transpose(-3, -2)
        return torch.where(data[1][..., chunk[0], chunk[1]].transpose(-3, -2), w, torch.finfo(w.dtype).min)

    golden = seed_golden(q, k, v, causal, table)
    inputs = (q, k, v, table)
    golden_grads = grads(golden, inputs)
    runs = {
        "bias+mask callbacks": dict(bias_calc_fn=bias_calc_fn, mask_calc_fn=mask_calc_fn, calc_fn_data=table),
        "weights callback": dict(weights_calc_fn=weights_calc_fn, calc_fn_data=(table, causal)),
    }
    for name, options in runs.items():
        out = mea.efficient_dot_product_attention_pt(q, k, v, None, None, 4, 3, **options)
        assert_close_to_golden(out, golden, name=name)
        for label, g, want in zip(["dq", "dk", "dv", "dtable"], grads(out, inputs), golden_grads):
            assert_close_to_golden(g, want, name=f"{name}: {label}")


def test_pt_refusals():
    q, k, v = randn(2, 10, 3, 8), randn(2, 7, 3, 8), randn(2, 7, 3, 5)
    f = mea.efficient_dot_product_attention_pt
    with pytest.raises(ArgumentTypeError, match=r"query to be a torch\.Tensor"):
        f(q.numpy(), k, v)
    with pytest.raises(ArgumentError, match=r"key to be \[batch..., L, H, E\] \(at least 3 dims\)"):
        f(q, k[0, 0], v)
    with pytest.raises(ArgumentError, match="H=3, E=8"):
        f(q, randn(2, 7, 2, 8), v)
    with pytest.raises(ArgumentError, match="one Lk"):
        f(q, k, randn(2, 6, 3, 5))
    with pytest.raises(ArgumentError, match="do not broadcast"):
        f(q, randn(3, 7, 3, 8), randn(3, 7, 3, 5))
    with pytest.raises(ArgumentTypeError, match="mask to be a bool tensor"):
        f(q, k, v, torch.ones(3, 10, 7))
    with pytest.raises(ArgumentTypeError, match="bias to be a floating-point tensor"):
        f(q, k, v, None, torch.ones(3, 10, 7, dtype=torch.int64))
    with pytest.raises(ArgumentError, match=r"mask \[batch..., H, Lq, Lk\].*got shape \(3, 10, 6\)"):
        f(q, k, v, torch.ones(3, 10, 6, dtype=torch.bool))
    with pytest.raises(ArgumentError, match=r"batch dims .* bias .* do not broadcast"):
        f(q, k, v, None, randn(4, 3, 10, 7))
    with pytest.raises(ArgumentError, match="key_chunk_size >= 1, got 0"):
        f(q, k, v, key_chunk_size=0)
    with pytest.raises(ArgumentTypeError, match="query_chunk_size to be an int, got '4'"):
        f(q, k, v, query_chunk_size="4")
    with pytest.raises(ArgumentTypeError, match="mask_calc_fn to be None or callable"):
        f(q, k, v, mask_calc_fn=3)
    with pytest.raises(ArgumentError, match=r"bias_calc_fn returned .* \(at least 3 dims\)"):
        f(q, k, v, bias_calc_fn=lambda qo, ko, b, w, d: torch.zeros(w.shape[-3], w.shape[-1], dtype=F64))

    def raising(*args):
        raise KeyError("from the callback")

    with pytest.raises(KeyError, match="from the callback"):
        f(q, k, v, weights_calc_fn=raising)


def test_pt_empty_lengths():
    out = mea.efficient_dot_product_attention_pt(randn(2, 0, 3, 8), randn(2, 5, 3, 8), randn(2, 5, 3, 4))
    assert out.shape == (2, 0, 3, 4)
    out = mea.efficient_dot_product_attention_pt(randn(2, 4, 3, 8), randn(2, 0, 3, 8), randn(2, 0, 3, 4))
    assert out.shape == (2, 4, 3, 4) and out.abs().max() == 0


# ============================================================================ the JAX variant
@pytest.fixture
def jax64():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)  # as tests/test_jax.py: float64 goldens
    return jax


def jax_golden(q, k, v, mask=None, bias=None):
    import jax
    import jax.numpy as jnp

    s = jnp.einsum("...qhd,...khd->...qhk", q / math.sqrt(q.shape[-1]), k)
    if bias is not None:
        s = s + jnp.swapaxes(bias, -3, -2)
    if mask is not None:
        s = jnp.where(jnp.swapaxes(mask, -3, -2), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("...qhk,...khf->...qhf", jax.nn.softmax(s, -1), v)


def jax_inputs(batch, Lq, Lk, H, E, Ev):
    import jax.numpy as jnp

    q, k, v, mask, bias = pt_inputs(batch, Lq, Lk, H, E, Ev)
    return [jnp.asarray(t.detach().numpy()) for t in (q, k, v, mask, bias)]


def jax_vjp(jax, fn, *args):
    """``fn(*args)`` and its gradients for a fixed random cotangent: one forward, one backward."""
    out, pull = jax.vjp(fn, *args)
    cotangent = jax.numpy.asarray(torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64).numpy())
    return out, pull(cotangent)


def close(test, want, tol=1e-12, what="output"):
    import numpy as np

    test, want = np.asarray(test, np.float64), np.asarray(want, np.float64)
    assert test.shape == want.shape, f"{what}: {test.shape} != {want.shape}"
    err = float(np.abs(test - want).max()) if test.size else 0.0
    assert err <= tol * max(float(np.abs(want).max()) if want.size else 1.0, 1.0), f"{what}: error {err:.3e}"


@pytest.mark.parametrize(
    "case, extras",
    [("10-in-chunks-of-4", "none"), ("16-keys-in-chunks-of-6", "mask+bias"), ("two-batch-dims", "mask+bias")],
)
def test_jax_float64_matches_the_definition_with_gradients(jax64, case, extras):
    batch, Lq, Lk, H, E, Ev, qc, kc = PT_CASES[case]
    q, k, v, mask, bias = jax_inputs(batch, Lq, Lk, H, E, Ev)
    mask, bias = (mask, bias) if extras != "none" else (None, None)
    with_bias = (lambda q, k, v, b: (q, k, v, mask, b)) if bias is not None else (lambda q, k, v: (q, k, v, mask, None))
    args = (q, k, v) if bias is None else (q, k, v, bias)

    def ours(*a):
        return mea.efficient_dot_product_attention_jax(*with_bias(*a), query_chunk_size=qc, key_chunk_size=kc)

    out, got = jax_vjp(jax64, ours, *args)
    golden, want = jax_vjp(jax64, lambda *a: jax_golden(*with_bias(*a)), *args)
    close(out, golden)
    for name, g, w in zip(["dq", "dk", "dv", "dbias"], got, want):
        close(g, w, what=name)


def test_jax_callbacks_offsets_jit_and_gradients(jax64):
    """Callbacks get traced offsets that slice with dynamic_slice; every (query chunk, key chunk)
    offset pair is visited (the last chunk of 10 rows in 4s starts at 6, its overlap masked), under
    jit with the callbacks static, and calc_fn_data gets its gradient."""
    from jax import lax

    q, k, v, mask, _bias = jax_inputs((2,), 10, 7, 3, 8, 5)
    table = jax64.numpy.asarray(randn(2, 3, 10, 7).numpy())
    seen = set()

    def bias_calc_fn(q_offset, k_offset, bias_chunk, w, data):
        qn, kn = w.shape[-3], w.shape[-1]
        jax64.debug.callback(lambda a, b: seen.add((int(a), int(b), qn, kn)), q_offset, k_offset)
        return lax.dynamic_slice(data, (0, 0, q_offset, k_offset), (2, 3, qn, kn))

    def mask_calc_fn(q_offset, k_offset, mask_chunk, w, data):
        return lax.dynamic_slice(mask, (0, 0, q_offset, k_offset), (2, 3, w.shape[-3], w.shape[-1]))

    static = ("bias_calc_fn", "mask_calc_fn", "query_chunk_size", "key_chunk_size")
    f = jax64.jit(mea.efficient_dot_product_attention_jax, static_argnames=static)
    options = dict(query_chunk_size=4, key_chunk_size=3, bias_calc_fn=bias_calc_fn, mask_calc_fn=mask_calc_fn)
    out, (got,) = jax_vjp(jax64, lambda t: f(q, k, v, calc_fn_data=t, **options), table)
    golden, (want,) = jax_vjp(jax64, lambda t: jax_golden(q, k, v, mask, t), table)
    close(out, golden)
    close(got, want, what="d calc_fn_data")
    assert seen == {(q0, k0, 4, 3) for q0 in (0, 4, 6) for k0 in (0, 3, 4)}


def test_jax_fully_masked_row_and_precision(jax64):
    jnp = jax64.numpy
    q, k, v, _, _ = jax_inputs((1,), 12, 12, 2, 8, 8)
    mask = jnp.ones((1, 2, 12, 12), bool).at[0, 1, 5].set(False)
    f = mea.efficient_dot_product_attention_jax
    out, pull = jax64.vjp(lambda v: f(q, k, v, mask, None, jax64.lax.Precision.HIGHEST, 4, 5), v)
    close(out, jax_golden(q, k, v, mask))
    close(out[0, 5, 1], v[0, :, 1].mean(0), what="the dead row")
    (dv,) = pull(jnp.zeros(out.shape).at[0, 5, 1].set(1.0))
    close(dv[0, :, 1], jnp.full((12, 8), 1 / 12), what="dv of the dead row")
    for precision in (None, (jax64.lax.Precision.HIGH,) * 2):
        close(f(q, k, v, mask, None, precision, 4, 5), out, what=f"precision={precision}")


def test_jax_refusals(jax64):
    jnp = jax64.numpy
    q, k, v, mask, bias = jax_inputs((2,), 6, 5, 2, 4, 4)
    f = mea.efficient_dot_product_attention_jax
    with pytest.raises(ArgumentTypeError, match="mask to be bool"):
        f(q, k, v, mask.astype(jnp.float32))
    with pytest.raises(ArgumentTypeError, match="bias to have a floating dtype"):
        f(q, k, v, None, bias.astype(jnp.int32))
    with pytest.raises(ArgumentError, match="H=2, E=4"):
        f(q, k[..., :3], v)
    with pytest.raises(NotImplementedError, match="one precision"):
        f(q, k, v, precision=(jax64.lax.Precision.HIGH, jax64.lax.Precision.HIGHEST))
    with pytest.raises(ArgumentError, match="precision='fastest' is not a matmul precision"):
        f(q, k, v, precision="fastest")
    with pytest.raises(ArgumentTypeError, match=r"precision to be None, a jax\.lax\.Precision"):
        f(q, k, v, precision=3)
    with pytest.raises(ArgumentError, match="query_chunk_size >= 1"):
        f(q, k, v, query_chunk_size=-2)
