"""Edge cases the property fuzz met (issue 54), with their neighbours, against float64.

- Scales of 0 and scales that underflow: SDPA then gives the mean of the visible values. The
  bfloat16 tiles with bfloat16 products hold each row's offset as ``offset / scale`` and ran a
  GEMM whose ``alpha`` is the scale; both are covered in every dtype, head dims from 1 to 256 and
  on every backend, with those products faked on and off (tests/_machine.py).
- torch's fused kernels apply their causal flag as ``-inf`` scores before they scale them: a scale
  that is 0 in their float32 arithmetic (1e-46) made NaN there.
- Calls with an empty dim (batch, extra leading batch dims, heads, lengths, head dims) combined
  with masks of every rank, callbacks and forced tiles: what SDPA gives (an empty output of the
  right shape, zeros, or the mean of v), and its gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import subquad
from _machine import fake_cpu
from conftest import assert_close_to_golden, naive_attention, to64

F64 = torch.float64
BF16 = torch.bfloat16


def _rand(*shape, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64).to(dtype)


def _grads(out, inputs, weights):
    """The gradients of ``(out * weights).sum()`` for ``inputs`` (zeros for those it does not reach)."""
    return torch.autograd.grad(out, inputs, weights, allow_unused=True, materialize_grads=True)


# ------------------------------------------------------------------------ what the fuzz found


def test_scale_0_in_bfloat16_tiles_with_bfloat16_products_gives_the_mean_of_v(monkeypatch):
    """The fuzz's first case: the offsets were ``offset / 0`` and torch's CPU bfloat16 GEMM
    writes nothing when its ``alpha`` is 0: NaN everywhere."""
    fake_cpu(monkeypatch, "avx512-bf16")
    q = k = v = _rand(1, 1, 40, 32, dtype=BF16).requires_grad_()
    out = subquad.attention(q, k, v, scale=0.0, backend="matmul")
    golden = v.detach().double().mean(dim=-2, keepdim=True).expand(1, 1, 40, 32)
    assert_close_to_golden(out, golden, naive_attention(q.detach(), k.detach(), v.detach(), scale=0.0))
    (dq,) = torch.autograd.grad(out, q, torch.ones_like(out))
    q64 = to64(q)[0].requires_grad_()
    (want,) = torch.autograd.grad(naive_attention(q64, q64, q64, scale=0.0), q64, torch.ones(1, 1, 40, 32, dtype=F64))
    assert_close_to_golden(dq, want, floor=2e-2, name="dq")


def test_an_empty_5d_call_with_a_4d_mask_gives_an_empty_output():
    """The second: batch dims (0, 0) and a mask that broadcasts in one of them (an IndexError)."""
    q = _rand(0, 0, 1, 0, 1)
    mask = _rand(0, 1, 0, 0)
    out = subquad.attention(q, q, q, attn_mask=mask)
    assert out.shape == F.scaled_dot_product_attention(q, q, q, attn_mask=mask).shape == (0, 0, 1, 0, 1)


def test_an_empty_batch_with_a_score_mod_and_forced_tiles_gives_an_empty_output():
    """The third: the planner timed the score_mod on a probe of ``64k // (B·H·Lk)`` rows (B = 0)."""
    q, k = _rand(0, 1, 124, 1), _rand(0, 1, 103, 1)
    out = subquad.attention(q, k, k, score_mod=subquad.mods.alibi(subquad.mods.alibi_slopes(1)), chunk_size=1)
    assert out.shape == (0, 1, 124, 1)


def test_causal_bfloat16_with_a_scale_that_is_0_in_float32_on_the_fused_kernel(monkeypatch):
    """Found by the fuzz (4000 examples, seed 0): scale 1e-46 is positive, but 0 in the fused
    kernel's float32 arithmetic, where its causal flag made NaN (-inf scores times 0)."""
    fake_cpu(monkeypatch, "avx2")
    q, k = _rand(2, 1, 1, 32, dtype=BF16), _rand(2, 1, 2, 32, dtype=BF16, seed=1)
    out = subquad.attention(q, k, k, is_causal=True, scale=1e-46)
    assert_close_to_golden(out, k[:, :, :1].double(), naive_attention(q, k, k, is_causal=True, scale=1e-46))


# ------------------------------------------------------------------- scales of 0 and underflowing

# (dtype, the CPU it runs on): bfloat16 on one with bfloat16 products (the offset tiles from head
# dim 32) and on one without (float32 products).
DTYPES = {
    "bfloat16-bf16-products": (BF16, "avx512-bf16"),
    "bfloat16-float32-products": (BF16, "avx2"),
    "float16": (torch.float16, "avx2"),
    "float32": (torch.float32, "avx2"),
    "float64": (F64, "avx2"),
}
HEAD_DIMS = (1, 31, 32, 59, 64, 111, 256)
ROUTES = {
    "auto": {},
    "fused": {"backend": "fused"},
    "matmul": {"backend": "matmul"},
    "sdpa": {"backend": "sdpa"},
    "auto-tiles-4": {"chunk_size": 4},
    "fused-tiles-3x2": {"backend": "fused", "chunk_size": (3, 2)},
    "matmul-tiles-3x2": {"backend": "matmul", "chunk_size": (3, 2)},
}
UNDERFLOWING = {
    "-0": -0.0,
    "1e-30": 1e-30,
    "2e-38": 2e-38,  # float32's smallest normal is 1.2e-38
    "1e-45": 1e-45,  # float32's smallest subnormal is 1.4e-45
    "1e-46": 1e-46,  # 0 in float32
    "-1e-40": -1e-40,
    "1e-300": 1e-300,  # 0 in float32, not in float64
}


def _check_scale(monkeypatch, dtype_name, E, scale, route, Lq=5, Lk=7, **kw):
    dtype, cpu = DTYPES[dtype_name]
    fake_cpu(monkeypatch, cpu)
    q, k, v = (
        _rand(1, 2, Lq, E, dtype=dtype, seed=1),
        _rand(1, 2, Lk, E, dtype=dtype, seed=2),
        _rand(1, 2, Lk, E, dtype=dtype, seed=3),
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = subquad.attention(q, k, v, scale=scale, **kw, **ROUTES[route])
    q64, k64, v64 = (t.requires_grad_() for t in to64(q, k, v))
    golden = naive_attention(q64, k64, v64, scale=scale, **kw)
    q1, k1, v1 = (t.detach().requires_grad_() for t in (q, k, v))
    reference = None if dtype == F64 else naive_attention(q1, k1, v1, scale=scale, **kw)
    floor = 1e-12 if dtype == F64 else None
    assert_close_to_golden(out, golden, reference, floor=floor)
    weights = _rand(*golden.shape, seed=4)
    got = _grads(out, (q, k, v), weights.to(dtype))
    want = _grads(golden, (q64, k64, v64), weights)
    refs = (None,) * 3 if reference is None else _grads(reference, (q1, k1, v1), weights.to(dtype))
    for name, a, b, r in zip("qkv", got, want, refs):
        assert_close_to_golden(a, b, r, floor=1e-10 if dtype == F64 else None, name=f"d{name}")


@pytest.mark.parametrize("route", [r for r in ROUTES if r != "sdpa"])
@pytest.mark.parametrize("E", HEAD_DIMS, ids=lambda e: f"E{e}")
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_scale_0_gives_the_mean_of_v(monkeypatch, dtype_name, E, route):
    _check_scale(monkeypatch, dtype_name, E, 0.0, route)


@pytest.mark.parametrize("route", ["auto", "matmul", "fused-tiles-3x2", "matmul-tiles-3x2"])
@pytest.mark.parametrize("E", (1, 32, 111), ids=lambda e: f"E{e}")
@pytest.mark.parametrize("scale", UNDERFLOWING.values(), ids=UNDERFLOWING.keys())
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_scales_that_underflow_give_the_mean_of_v(monkeypatch, dtype_name, scale, E, route):
    _check_scale(monkeypatch, dtype_name, E, scale, route)


@pytest.mark.parametrize("route", ["auto", "fused", "fused-tiles-3x2", "matmul-tiles-3x2", "sdpa"])
@pytest.mark.parametrize("scale", {"0": 0.0, **UNDERFLOWING}.values(), ids={"0": 0.0, **UNDERFLOWING}.keys())
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_causal_with_a_scale_that_is_not_positive_in_float32(monkeypatch, dtype_name, scale, route):
    """torch's fused kernels apply their causal flag as -inf scores and then scale them: a scale
    of 0 in their arithmetic (1e-46 and 1e-300 in float32) made NaN. The mask goes into a bias
    then; a forced ``sdpa`` backend (torch's kernels only) says why it cannot run the call."""
    try:
        _check_scale(monkeypatch, dtype_name, 32, scale, route, Lq=7, Lk=7, is_causal=True)
    except NotImplementedError as e:
        assert route == "sdpa" and "not positive" in str(e), e


def test_scale_0_with_masks_averages_the_visible_values(monkeypatch):
    """With scale 0 each row's output is the mean of the values it sees (SDPA's), 0 where none."""
    fake_cpu(monkeypatch, "avx512-bf16")
    q, k, v = (
        _rand(2, 2, 9, 32, dtype=BF16),
        _rand(2, 2, 11, 32, dtype=BF16, seed=1),
        _rand(2, 2, 11, 32, dtype=BF16, seed=2),
    )
    keep = torch.rand(2, 1, 9, 11, generator=torch.Generator().manual_seed(3)) > 0.5
    keep[:, :, 4] = False
    for kw in ({"attn_mask": keep}, {"is_causal": True}, {"mask_mod": subquad.mods.sliding_window(2)}):
        for route in ("matmul", "matmul-tiles-3x2", "auto"):
            out = subquad.attention(q, k, v, scale=0.0, **kw, **ROUTES[route])
            golden = naive_attention(*to64(q, k, v), scale=0.0, **kw)
            assert_close_to_golden(out, golden, naive_attention(q, k, v, scale=0.0, **kw), name=f"{route} {sorted(kw)}")


# ------------------------------------------------------------------------------- empty dims

# (query, key, value shapes): one dim (or a leading batch dim) of size 0.
EMPTY = {
    "B=0": ((0, 2, 3, 4), (0, 2, 5, 4), (0, 2, 5, 4)),
    "B=0-kv-shared": ((0, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4)),
    "H=0": ((2, 0, 3, 4), (2, 0, 5, 4), (2, 0, 5, 4)),
    "Lq=0": ((2, 2, 0, 4), (2, 2, 5, 4), (2, 2, 5, 4)),
    "Lk=0": ((2, 2, 3, 4), (2, 2, 0, 4), (2, 2, 0, 4)),
    "E=0": ((2, 2, 3, 0), (2, 2, 5, 0), (2, 2, 5, 3)),
    "Ev=0": ((2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 0)),
    "E=Ev=0": ((2, 2, 3, 0), (2, 2, 5, 0), (2, 2, 5, 0)),
    "lead=0x2": ((0, 2, 2, 3, 4), (0, 2, 2, 5, 4), (0, 2, 2, 5, 4)),
    "lead=2x0": ((2, 0, 2, 3, 4), (2, 0, 2, 5, 4), (2, 0, 2, 5, 4)),
    "lead=0x0-Lq=0": ((0, 0, 1, 0, 1), (0, 0, 1, 0, 1), (0, 0, 1, 0, 1)),
    "lead=0x2-kv-shared": ((0, 2, 2, 3, 4), (1, 2, 2, 5, 4), (1, 2, 2, 5, 4)),
}


def _mask_shapes(scores):
    """Masks of every rank up to the scores' (and one above, which SDPA rejects): ``full`` has the
    scores' trailing dims, ``keys`` keeps the last and broadcasts the others (size 1)."""
    shapes = {}
    for rank in range(1, len(scores) + 2):
        full = scores[-rank:] if rank <= len(scores) else (1, *scores)
        shapes[f"{rank}d-full"] = full
        if rank > 1:
            shapes[f"{rank}d-keys"] = (*(1,) * (rank - 1), full[-1])
    return shapes


def _scores_shape(case):
    (*lead_q, Hq, Lq, _), (*lead_k, _, Lk, _), _ = EMPTY[case]
    return (*torch.broadcast_shapes(tuple(lead_q), tuple(lead_k)), Hq, Lq, Lk)


MASKED_CASES = [
    pytest.param(case, mask, id=f"{case}-{mask or 'no-mask'}")
    for case in EMPTY
    for mask in (None, *_mask_shapes(_scores_shape(case)))
]


def _empty_inputs(case, mask=None, kind="bool"):
    """``q, k, v`` of ``case`` requiring grad, and a mask of shape ``mask`` (``None``: none)."""
    q, k, v = (_rand(*shape, seed=i).requires_grad_() for i, shape in enumerate(EMPTY[case]))
    if mask is None:
        return q, k, v, None
    g = torch.Generator().manual_seed(5)
    if kind == "bool":
        m = torch.rand(mask, generator=g) > 0.3
    else:
        m = torch.randn(mask, generator=g, dtype=F64).masked_fill(torch.rand(mask, generator=g) > 0.7, float("-inf"))
        m.requires_grad_()
    return q, k, v, m


def _sdpa(q, k, v, mask, **kw):
    """torch's SDPA in float64, a 1-D mask taken as the 2-D one it broadcasts to (SDPA rejects
    it with an IndexError; subquad broadcasts it, tests/test_attention.py)."""
    if mask is not None and mask.dim() == 1:
        mask = mask.expand(q.shape[-2], mask.shape[-1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)


def _attend(fn, route, *args, **kw):
    """``fn(*args, **kw)``, or ``None`` where a forced fused kernel refuses the call for what it
    cannot run whatever the sizes (value head dims other than E, a mask that requires grad,
    batch dims that broadcast): it says so."""
    try:
        return fn(*args, **kw)
    except NotImplementedError as e:
        assert route.startswith(("fused", "sdpa")), e
        return None


def _assert_matches(out, inputs, expected, name):
    """``out`` and its gradients for ``inputs`` equal ``expected``'s (float64: to rounding)."""
    assert out.shape == expected.shape, f"{name}: shape {tuple(out.shape)} != SDPA's {tuple(expected.shape)}"
    assert_close_to_golden(out, expected, floor=1e-12, name=name)
    weights = _rand(*out.shape, seed=6)
    got = _grads(out, inputs, weights)
    want = _grads(expected, inputs, weights)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, f"{name}: gradient {i} shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert_close_to_golden(a, b, floor=1e-10, name=f"{name}: gradient {i}")


EMPTY_ROUTES = {
    "auto": {},
    "fused": {"backend": "fused"},
    "matmul": {"backend": "matmul"},
    "sdpa": {"backend": "sdpa"},
    "matmul-tiles-1": {"backend": "matmul", "chunk_size": 1},
    "auto-tiles-3x2": {"chunk_size": (3, 2)},
}


@pytest.mark.parametrize("route", EMPTY_ROUTES)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("case,mask", MASKED_CASES)
def test_empty_dims_with_masks_of_every_rank_match_sdpa(case, mask, kind, route):
    q, k, v, m = _empty_inputs(case, _mask_shapes(_scores_shape(case)).get(mask), kind)
    inputs = [t for t in (q, k, v, m) if t is not None and t.requires_grad]
    if m is not None and m.dim() > q.dim():
        # SDPA raises for these (the output cannot take the broadcast), except where it has no
        # score to add them to (an empty batch, Lk = 0); subquad raises wherever.
        with pytest.raises(RuntimeError, match="does not broadcast to the scores' shape"):
            subquad.attention(q, k, v, attn_mask=m, **EMPTY_ROUTES[route])
        return
    expected = _sdpa(q, k, v, m)
    out = _attend(subquad.attention, route, q, k, v, attn_mask=m, **EMPTY_ROUTES[route])
    if out is not None:
        _assert_matches(out, inputs, expected, f"{case} {mask} {kind} {route}")


CALLBACKS = {
    "alibi": {"score_mod": subquad.mods.alibi(subquad.mods.alibi_slopes(2))},
    "lambda": {"score_mod": lambda s, b, h, i, j: s * 0.5 + (i - j) / 4},
    "mask_mod": {"mask_mod": lambda b, h, i, j: j <= i + 1},
    "causal-mod": {"mask_mod": subquad.mods.causal()},
    "both+bool-mask": {"score_mod": lambda s, b, h, i, j: s + h, "mask_mod": lambda b, h, i, j: j != i},
}
CALLBACK_ROUTES = {
    "auto": {},
    "matmul": {"backend": "matmul"},
    "auto-tiles-1": {"chunk_size": 1},
    "matmul-tiles-3x2": {"backend": "matmul", "chunk_size": (3, 2)},
    "fused-tiles-3x2": {"backend": "fused", "chunk_size": (3, 2)},
}


@pytest.mark.parametrize("route", CALLBACK_ROUTES)
@pytest.mark.parametrize("callbacks", CALLBACKS)
@pytest.mark.parametrize("case", EMPTY)
def test_empty_dims_with_callbacks_match_the_reference(case, callbacks, route):
    """score_mods and mask_mods on empty calls: the float64 reference's output and gradients (an
    explicit scale: the reference's default is 1/sqrt(E), undefined at E = 0)."""
    kw = CALLBACKS[callbacks]
    mask = (1, 1, 1, _scores_shape(case)[-1]) if callbacks == "both+bool-mask" else None
    q, k, v, m = _empty_inputs(case, mask)
    inputs = [q, k, v]
    out = _attend(subquad.attention, route, q, k, v, attn_mask=m, scale=0.5, **kw, **CALLBACK_ROUTES[route])
    if out is None:
        return
    expected = naive_attention(q, k, v, attn_mask=m, scale=0.5, **kw)
    _assert_matches(out, inputs, expected, f"{case} {callbacks} {route}")


SDPA_MASKS = [None, "2d-full", "4d-keys"]


@pytest.mark.parametrize("mask", SDPA_MASKS, ids=lambda m: m or "no-mask")
@pytest.mark.parametrize("case", EMPTY)
def test_empty_dims_through_subquad_sdpa(case, mask):
    """The drop-in's defaults (its own scale, a float mask, is_causal) on the same calls."""
    q, k, v, m = _empty_inputs(case, _mask_shapes(_scores_shape(case)).get(mask), "float")
    inputs = [t for t in (q, k, v, m) if t is not None]
    for kw in ({"attn_mask": m}, {"is_causal": True}) if m is not None else ({}, {"is_causal": True}):
        expected = _sdpa(q, k, v, kw.get("attn_mask"), is_causal=kw.get("is_causal", False))
        _assert_matches(subquad.sdpa(q, k, v, **kw), inputs, expected, f"{case} {mask} {sorted(kw)}")
