"""The built-in mods in the C++ tile loops (``_native_tiles.cpp``'s ``Mods``,
``subquad._backends.segments.loop_mods``): ALiBi (:func:`subquad.mods.alibi`) and bands of
diagonals (:func:`~subquad.mods.sliding_window`, :func:`~subquad.mods.local_window`, the causal
masks and their :func:`~subquad.mods.and_masks`), evaluated in the forward and backward loops
for bfloat16 (``forward_segment_bf16``) and float32 and float16 (``forward_segment_f32``) calls.

Checked against the float64 golden, the dense bias and mask built from the mods themselves
(outputs and the gradients of q, k and v, the suite's tolerance policy, a float32 reference
rounded to the inputs' dtype) on awkward sizes: Lq != Lk, lengths not divisible by the loops'
blocks, head dims 59, 64 and 111, GQA, several key segments, rows that see nothing, windows far
narrower than a block of keys; that the loops ran both passes (the recorded kernel); the bands
and ALiBi's shift against the callbacks for blocks of a longer sequence; which calls they refuse
and their argument errors. Skipped where the kernel cannot be built or lacks the loop.
"""

from __future__ import annotations

import pytest
import torch

import subquad
import test_native
from conftest import assert_close_to_golden, naive_attention
from subquad import _native, mods
from subquad._backends import segments
from subquad._inputs import Inputs
from test_native_loop import assert_refused
from test_native_loop_wide import avx2_build  # noqa: F401  (a fixture)

pytestmark = test_native.pytestmark  # a C++ compiler and ninja

BF16 = torch.bfloat16
DTYPES = (BF16, torch.float32, torch.float16)
LOOPS = {BF16: "bf16", torch.float32: "f32", torch.float16: "f32"}
"""The loops' suffix per input dtype (``forward_segment_bf16`` ...)."""


@pytest.fixture(params=DTYPES, ids=str)
def dtype(request):
    return request.param


@pytest.fixture
def two_threads():
    """Two threads: the backward loop needs a task (batch entry and key head) per thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def loop(native_dir, monkeypatch, dtype):
    """The native kernel with the forward loop of ``dtype``, its calls recorded."""
    name = f"forward_segment_{LOOPS[dtype]}"
    return test_native.recorded_kernel(native_dir, monkeypatch, name, f"the native kernel was built without {name}")


CASES = {
    # name: (query shape, key/value shape, keyword arguments of (Lq, Lk, Hq), chunk_size)
    "ALiBi, 300 x 700": ((2, 4, 300, 64), (2, 4, 700, 64), lambda lq, lk, h: dict(score_mod=mods.alibi(h)), None),
    "ALiBi, causal, head dim 59": (
        (2, 3, 333, 59),
        (2, 3, 333, 59),
        lambda lq, lk, h: dict(score_mod=mods.alibi(h), is_causal=True),
        None,
    ),
    "ALiBi, causal bottom-right as a mask_mod, in segments of 200": (
        (1, 4, 150, 64),
        (1, 4, 610, 64),
        lambda lq, lk, h: dict(score_mod=mods.alibi(h), mask_mod=mods.causal_lower_right(lq, lk)),
        (64, 200),
    ),
    "ALiBi, GQA 8/2, head dim 111, slopes of one sign and another": (
        (1, 8, 130, 111),
        (1, 2, 257, 111),
        lambda lq, lk, h: dict(score_mod=mods.alibi(torch.linspace(-0.3, 0.5, h)), enable_gqa=True),
        None,
    ),
    "sliding window 37, 300 x 700": (
        (2, 2, 300, 64),
        (2, 2, 700, 64),
        lambda lq, lk, h: dict(mask_mod=mods.sliding_window(37)),
        None,
    ),
    "sliding window 50, causal, 1100 keys (blocks of keys skipped)": (
        (1, 2, 1100, 64),
        (1, 2, 1100, 64),
        lambda lq, lk, h: dict(mask_mod=mods.sliding_window(50, causal=True)),
        None,
    ),
    "sliding window 5 in segments of 48 x 100": (
        (1, 2, 211, 64),
        (1, 2, 211, 64),
        lambda lq, lk, h: dict(mask_mod=mods.sliding_window(5)),
        (48, 100),
    ),
    "local window left 20, right 5, offset 30, head dim 111": (
        (2, 2, 90, 111),
        (2, 2, 150, 111),
        lambda lq, lk, h: dict(mask_mod=mods.local_window(20, 5, offset=30)),
        None,
    ),
    "local window left 64 only, bottom-right": (
        (1, 2, 200, 64),
        (1, 2, 900, 64),
        lambda lq, lk, h: dict(mask_mod=mods.local_window(left=64, offset=lk - lq)),
        None,
    ),
    "local window right 3 only, offset -10 (rows 0-6 see nothing)": (
        (2, 2, 140, 59),
        (2, 2, 140, 59),
        lambda lq, lk, h: dict(mask_mod=mods.local_window(right=3, offset=-10)),
        (32, 64),
    ),
    "and_masks(causal, sliding window 40), GQA": (
        (2, 4, 400, 64),
        (2, 2, 400, 64),
        lambda lq, lk, h: dict(mask_mod=mods.and_masks(mods.causal(), mods.sliding_window(40)), enable_gqa=True),
        None,
    ),
    "and_masks(causal bottom-right, local window 100 before and 10 after)": (
        (1, 2, 250, 64),
        (1, 2, 600, 64),
        lambda lq, lk, h: dict(
            mask_mod=mods.and_masks(mods.causal_lower_right(lq, lk), mods.local_window(100, 10, offset=lk - lq))
        ),
        None,
    ),
    "sliding window 30 and is_causal": (
        (2, 2, 260, 64),
        (2, 2, 260, 64),
        lambda lq, lk, h: dict(mask_mod=mods.sliding_window(30), is_causal=True),
        None,
    ),
    "ALiBi in a causal window of 100, a bool attn_mask too": (
        (2, 4, 300, 64),
        (2, 4, 300, 64),
        lambda lq, lk, h: dict(
            score_mod=mods.alibi(h),
            mask_mod=mods.sliding_window(100, causal=True),
            attn_mask=torch.rand(lq, lk, generator=torch.Generator().manual_seed(3)) > 0.2,
        ),
        None,
    ),
}


def _inputs(name, dtype, seed):
    shape_q, shape_kv, make, chunk = CASES[name]
    g = torch.Generator().manual_seed(seed)
    q, k, v = ((torch.randn(*s, generator=g) * 2).to(dtype).requires_grad_() for s in (shape_q, shape_kv, shape_kv))
    d_out = torch.randn(*shape_q, generator=g).to(dtype)
    return q, k, v, d_out, make(shape_q[2], shape_kv[2], shape_q[1]), chunk


def _bias(kw, lq, lk, hq):
    """What the call's mods, ``attn_mask`` and ``is_causal`` add to its scaled scores on the whole
    ``Lq x Lk`` grid, built from the mods themselves in float64: ``(1, Hq, Lq, Lk)``, ALiBi's bias
    and -inf where a mask hides."""
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    h = torch.arange(hq).view(1, -1, 1, 1)
    i, j = torch.arange(lq).view(1, 1, -1, 1), torch.arange(lk).view(1, 1, 1, -1)
    bias = torch.zeros(1, hq, lq, lk, dtype=torch.float64)
    if kw.get("score_mod") is not None:
        bias = kw["score_mod"](bias, b, h, i, j).expand(1, hq, lq, lk)
    if kw.get("mask_mod") is not None:
        bias = bias.masked_fill(~kw["mask_mod"](b, h, i, j).expand(1, hq, lq, lk), float("-inf"))
    mask = kw.get("attn_mask")
    if mask is not None:
        bias = bias.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else bias + mask.double()
    if kw.get("is_causal"):
        bias = bias.masked_fill(j > i, float("-inf"))
    return bias


def _attention(q, k, v, bias):
    """Attention with ``bias`` added to the scaled scores, in the inputs' dtype, GQA by repeating
    the key heads; rows that see nothing give 0 and a gradient of 0 (no NaN to differentiate)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + bias.to(q.dtype)
    m = s.detach().amax(dim=-1, keepdim=True)
    p = torch.exp(s - m.masked_fill(torch.isneginf(m), 0.0))
    l = p.sum(dim=-1, keepdim=True)
    return (p / l.masked_fill(l == 0, 1.0)) @ v


def _check(q, k, v, d_out, out, grads, kw):
    """The output and the gradients of (q, k, v) against float64 attention with the mods' dense
    bias (:func:`_bias`), with the suite's policy: the reference is the same in float32, rounded
    to the inputs' dtype. Returns the rows that see a key, ``(B, Hq, Lq, 1)``."""
    bias = _bias(kw, q.shape[2], k.shape[2], q.shape[1])
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    golden = _attention(q64, k64, v64, bias)
    gold = torch.autograd.grad(golden, (q64, k64, v64), d_out.double())
    p32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out = _attention(*p32, bias)
    ref = torch.autograd.grad(ref_out, p32, d_out.float())
    assert_close_to_golden(out, golden, ref_out.detach().to(q.dtype))
    for n, got, g64, r in zip("qkv", grads, gold, ref):
        assert got.dtype == q.dtype and not bool(torch.isnan(got).any()), n
        assert_close_to_golden(got, g64, r.to(q.dtype), name=f"d{n}")
    return torch.isfinite(bias).any(dim=-1, keepdim=True).expand(q.shape[0], -1, -1, -1)


@pytest.mark.parametrize("name", list(CASES))
def test_the_loops_run_the_mods_and_match_float64(loop, two_threads, dtype, name):
    q, k, v, d_out, kw, chunk = _inputs(name, dtype, 41)
    out = subquad.attention(q, k, v, backend="loops", chunk_size=chunk, **kw)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    # Both passes in the loops: no per-tile pass of the native kernel, no tile of the mods' bias.
    suffix = LOOPS[dtype]
    assert set(loop.names) == {f"forward_segment_{suffix}", f"backward_segment_{suffix}"}, loop.names
    seen = _check(q, k, v, d_out, out, grads, kw)
    assert bool((out[~seen.expand_as(out)] == 0).all())  # rows that see nothing: 0, no gradient
    assert bool((grads[0][~seen.expand_as(grads[0])] == 0).all())


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=str)
def test_the_avx2_build_runs_the_mods(avx2_build, monkeypatch, two_threads, dtype):  # noqa: F811
    counting = test_native.Counting(avx2_build)
    monkeypatch.setitem(_native._LOADED, "module", counting)
    for name in ("ALiBi in a causal window of 100, a bool attn_mask too", "sliding window 5 in segments of 48 x 100"):
        q, k, v, d_out, kw, chunk = _inputs(name, dtype, 45)
        out = subquad.attention(q, k, v, backend="loops", chunk_size=chunk, **kw)
        grads = torch.autograd.grad(out, (q, k, v), d_out)
        assert {"forward_segment_f32", "backward_segment_f32"} == set(counting.names), counting.names
        _check(q, k, v, d_out, out, grads, kw)


def test_rows_outside_the_window_see_nothing(loop, two_threads, dtype):
    # local_window(right=3, offset=-10): row i sees keys j <= i - 7, so rows 0-6 see no key.
    q, k, v, _, kw, chunk = _inputs("local window right 3 only, offset -10 (rows 0-6 see nothing)", dtype, 42)
    out, lse = subquad.attention(q, k, v, backend="loops", chunk_size=chunk, return_lse=True, **kw)
    assert f"forward_segment_{LOOPS[dtype]}" in loop.names
    assert bool((out[:, :, :7] == 0).all()) and bool(torch.isneginf(lse[:, :, :7]).all())
    assert bool(torch.isfinite(lse[:, :, 7:]).all())


def _call(mask_mod=None, score_mod=None, h=4, **positions):
    q = torch.zeros(1, h, 40, 16)
    return Inputs(q, q, q, (1,), None, False, 0.25, 0.0).derive(mask_mod=mask_mod, score_mod=score_mod, **positions)


BANDS = {
    "causal": mods.causal(),
    "causal bottom-right": mods.causal_lower_right(40, 60),
    "sliding window 3": mods.sliding_window(3),
    "sliding window 3, causal": mods.sliding_window(3, causal=True),
    "local window 2, 1, offset 5": mods.local_window(2, 1, offset=5),
    "local window, left only": mods.local_window(left=4),
    "local window, right only": mods.local_window(right=0, offset=-3),
    "and_masks(causal, local window 6, 6, offset 2)": mods.and_masks(mods.causal(), mods.local_window(6, 6, offset=2)),
    "and_masks of three, nested": mods.and_masks(
        mods.sliding_window(8), mods.and_masks(mods.causal_lower_right(10, 12), mods.local_window(right=5))
    ),
}


@pytest.mark.parametrize("name", list(BANDS))
@pytest.mark.parametrize("q_offset, kv_offset", [(0, 0), (40, 0), (7, 19)])
def test_the_loops_band_is_the_masks_in_the_calls_positions(name, q_offset, kv_offset):
    # A block of a longer sequence (ring attention's): the callbacks see positions from the
    # offsets, the loops the call's own (query i sees key j where lo <= i - j <= hi).
    mask_mod = BANDS[name]
    found = segments.loop_mods(_call(mask_mod, q_offset=q_offset, kv_offset=kv_offset))
    assert found is not None
    i, j = torch.arange(40).view(-1, 1), torch.arange(40).view(1, -1)
    lo = float("-inf") if found.window_lo is None else found.window_lo
    hi = float("inf") if found.window_hi is None else found.window_hi
    want = mask_mod(torch.zeros(()), torch.zeros(()), i + q_offset, j + kv_offset)
    assert torch.equal((lo <= i - j) & (i - j <= hi), want)


@pytest.mark.parametrize("q_offset, kv_offset, h_offset", [(0, 0, 0), (40, 3, 2), (0, 25, 5)])
def test_alibis_slopes_and_shift_are_the_callbacks_in_the_calls_positions(q_offset, kv_offset, h_offset):
    slopes = torch.tensor([0.5, 0.25, -0.125, 1.0, 0.0625, 2.0, 0.75, 0.3], dtype=torch.float64)
    score_mod = mods.alibi(slopes)
    found = segments.loop_mods(
        _call(score_mod=score_mod, h=3, q_offset=q_offset, kv_offset=kv_offset, h_offset=h_offset)
    )
    assert found is not None and found.slopes is not None and found.slopes.dtype == torch.float32
    h, i, j = torch.arange(3).view(-1, 1, 1), torch.arange(40).view(1, -1, 1), torch.arange(40).view(1, 1, -1)
    got = -found.slopes.double().view(-1, 1, 1) * (i - j + found.alibi_shift).abs()
    want = score_mod(
        torch.zeros(1, 3, 40, 40, dtype=torch.float64), torch.zeros(()), h + h_offset, i + q_offset, j + kv_offset
    )
    assert torch.allclose(got, want[0], rtol=1e-7, atol=0.0)  # the slopes rounded to float32 alone


REFUSED = {
    "a hand-written window": dict(mask_mod=lambda b, h, i, j: (i - j).abs() <= 8),
    "and_masks(causal, a document whose keys lie in two ranges)": dict(
        mask_mod=mods.and_masks(mods.causal(), mods.document([0] * 10 + [1] * 20 + [0] * 10))
    ),
    "or_masks of two windows": dict(mask_mod=mods.or_masks(mods.sliding_window(2), mods.local_window(0, 0, offset=9))),
    "or_masks(prefix-LM, a window)": dict(mask_mod=mods.or_masks(mods.prefix_lm(5), mods.sliding_window(3))),
    "ALiBi of too few slopes": dict(score_mod=mods.alibi(torch.ones(2))),
    "ALiBi of learnable slopes": dict(score_mod=mods.alibi(torch.ones(4, requires_grad=True))),
    "a hand-written bias": dict(score_mod=lambda s, b, h, i, j: s - (i - j).abs()),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_the_loops_refuse_other_callbacks(name):
    assert segments.loop_mods(_call(**REFUSED[name])) is None


def test_learnable_slopes_take_the_per_tile_path_and_get_their_gradient(native_dir, monkeypatch, two_threads):
    loop = test_native.recorded_kernel(native_dir, monkeypatch, "forward_segment_f32", "no float32 loop")
    g = torch.Generator().manual_seed(43)
    q, k, v = (torch.randn(2, 4, 70, 32, generator=g).requires_grad_() for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], requires_grad=True)
    with pytest.raises(NotImplementedError, match="a score_mod or mask_mod the loops do not evaluate"):
        subquad.attention(q, k, v, score_mod=mods.alibi(slopes), is_causal=True, backend="loops")
    out = subquad.attention(q, k, v, score_mod=mods.alibi(slopes), is_causal=True)
    out.sum().backward()
    assert "forward_segment_f32" not in loop.names and "backward_segment_f32" not in loop.names
    s64 = slopes.detach().double().requires_grad_()
    golden = naive_attention(*(t.detach().double() for t in (q, k, v)), is_causal=True, score_mod=mods.alibi(s64))
    golden.sum().backward()
    assert slopes.grad is not None and torch.allclose(slopes.grad.double(), s64.grad, rtol=1e-4, atol=1e-6)


def test_without_mods_the_loops_read_as_before(loop, dtype):
    # The mods' arguments are optional: a call of the old arguments, and one with them all open,
    # give the same result bit for bit.
    kernel, suffix = loop.real, LOOPS[dtype]
    g = torch.Generator().manual_seed(44)
    q, k, v = (torch.randn(1, 2, 50, 32, generator=g).to(dtype) for _ in range(3))
    outs = []
    for extra in ((), (None, None, None, 0)):
        m, l, acc = torch.full((100,), float("-inf")), torch.zeros(100), torch.zeros(100, 32)
        getattr(kernel, f"forward_segment_{suffix}")(q, k, v, m, l, acc, 0.25, 0, 0, True, 0, None, 0.0, *extra)
        outs.append(acc)
    assert torch.equal(outs[0], outs[1])


def test_the_loops_refuse_bad_slopes(loop, dtype):
    kernel, suffix = loop.real, LOOPS[dtype]
    q = torch.zeros(1, 2, 8, 16, dtype=dtype)
    m, l, acc = torch.zeros(16), torch.zeros(16), torch.zeros(16, 16)
    ok = (q, q, q, m, l, acc, 1.0, 0, 0, False, 0, None, 0.0, 2, -3)
    forward = getattr(kernel, f"forward_segment_{suffix}")
    forward(*ok, torch.ones(2), 5)
    bad = {
        "slopes of too few heads": ok + (torch.ones(1), 0),
        "float64 slopes": ok + (torch.ones(2, dtype=torch.float64), 0),
        "2-D slopes": ok + (torch.ones(1, 2), 0),
    }
    assert_refused(forward, bad)
    rows, dq = torch.zeros(16), torch.zeros(1, 2, 8, 16)
    back = (q, q, q, q, rows, rows, dq, dq.clone(), dq.clone(), 1.0, 0.25, 0, 0, False, 0, None, 0.0, None, None)
    backward = getattr(kernel, f"backward_segment_{suffix}")
    backward(*back, torch.ones(2), 0)
    assert_refused(backward, {"slopes of too few heads": back + (torch.ones(3), 0)})


def test_auto_plans_the_loops_for_the_mods(loop, dtype):
    # backend="loops": the whole call in the loops, planned in whole rows as a plain call.
    q = torch.zeros(1, 4, 600, 64, dtype=dtype)
    plain = subquad.explain(q, q, q, is_causal=True, backend="loops")
    for kw in (dict(score_mod=mods.alibi(4), is_causal=True), dict(mask_mod=mods.sliding_window(64, causal=True))):
        plan = subquad.explain(q, q, q, backend="loops", **kw)
        assert plan.chunk_size == plain.chunk_size, (kw, plan.chunk_size, plain.chunk_size)
    assert _native.tile_kernel() is not None
