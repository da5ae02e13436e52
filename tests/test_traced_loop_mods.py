"""Hand-written callbacks that tracing finds equal to a built-in take the C++ loops' path.

A ``score_mod`` whose traced graph is ALiBi (``score - slopes[h] * |q - kv|``, and the signed
``score + slopes[h] * (kv - q)`` under a causal mask) with slopes it captures, and a ``mask_mod``
whose traced formula is a band of diagonals (``kv <= q``, windows, ``|q - kv| <= W``), a prefix-LM
``(kv < P) | (kv <= q)`` or a key padding ``kv < n``, reach the loops as the built-ins do
(:mod:`subquad._graphs`: ``alibi_of``, ``formula_band``; ``segments.loop_mods``).

Checked on the structure alone (no kernel): the forms found and their slopes, shifts and bands in
the call's positions against the callbacks; the forms that are not equal (another coefficient or
sign, a signed one without a causal mask or with keys after the diagonal, learnable slopes, a
mask that is not a band) left to the per-tile path; ``explain()``'s note. With the native kernel:
outputs and the gradients of q, k and v against the float64 golden of the built-in equivalents
(the suite's tolerance policy) on awkward sizes in bfloat16 and float32, both loops recorded;
and the unequal forms computed off the loops, exactly as written.
"""

from __future__ import annotations

import functools

import pytest
import torch

import subquad
import test_native
from subquad import mods
from subquad._backends import segments
from subquad._inputs import Inputs
from subquad._traced import TracedMask, TracedScoreMod, normalize, score_mod_structure
from subquad._validate import make_inputs
from test_native_loop_mods import LOOPS as SUFFIX
from test_native_loop_mods import _attention, _check, two_threads  # noqa: F401  (a fixture)

LOOPS = "loops" if "loops" in getattr(subquad, "BACKENDS", ()) else "matmul"
"""The backend that runs the C++ loops (``matmul`` ran them before ``loops`` was its own)."""

CPU = torch.device("cpu")
SLOPES = mods.alibi_slopes(4)  # powers of two: the products are exact in float32
SLOPES3 = mods.alibi_slopes(3)


def _abs(slopes):
    return lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs()


def _signed(slopes):
    return lambda s, b, h, q, kv: s + slopes[h] * (kv - q)


class _Module:
    """ALiBi as an object holding its slopes (an ``nn.Module``-like callable)."""

    def __init__(self, slopes):
        self.slopes = slopes

    def __call__(self, s, b, h, q, kv):
        return s - self.slopes[h] * (q - kv)


def _partial_alibi(s, b, h, q, kv, slopes=None):
    return s + (-slopes)[h] * torch.abs(kv - q).to(s.dtype)


ALIBI_FORMS = {
    # name: (score_mod of slopes, signed, shift)
    "score - slopes[h] * (q - kv).abs()": (_abs, False, 0),
    "score - (kv - q).abs() * slopes[h]": (lambda t: lambda s, b, h, q, kv: s - (kv - q).abs() * t[h], False, 0),
    "score + (-slopes[h]) * torch.abs(q - kv).float()": (
        lambda t: lambda s, b, h, q, kv: s + (-t[h]) * torch.abs(q - kv).float(),
        False,
        0,
    ),
    "slopes[h] * (kv - q) + score": (lambda t: lambda s, b, h, q, kv: t[h] * (kv - q) + s, True, 0),
    "score + slopes[h] * (kv - q)": (_signed, True, 0),
    "score - slopes[h] * (q - kv), an object's slopes": (_Module, True, 0),
    "score - slopes[h] * |q - kv + 3|": (lambda t: lambda s, b, h, q, kv: s - t[h] * (q - kv + 3).abs(), False, 3),
    "score + slopes[h] * (kv - q - 5), bottom-right": (
        lambda t: lambda s, b, h, q, kv: s + t[h] * (kv - q - 5),
        True,
        5,
    ),
    "a partial's slopes, (-slopes)[h], float64": (
        lambda t: functools.partial(_partial_alibi, slopes=t.double()),
        False,
        0,
    ),
}


@pytest.mark.parametrize("name", list(ALIBI_FORMS))
def test_tracing_finds_alibi_and_the_slopes_the_callback_holds(name):
    make, signed, shift = ALIBI_FORMS[name]
    for slopes in (SLOPES, torch.tensor([0.3, -0.7, 1.5, 0.0])):  # the same code again, other slopes
        fn = make(slopes)
        structure = score_mod_structure(fn, torch.float32, CPU)
        assert structure.kind == "additive" and structure.alibi is not None, structure
        found = TracedScoreMod(fn, structure, torch.float32).alibi
        assert found is not None and (found.signed, found.shift) == (signed, shift)
        assert torch.equal(found.slopes.float(), slopes)  # the slopes of this callback, not the cached one's


NOT_ALIBI = {
    "another coefficient: 2 * slopes[h]": lambda s, b, h, q, kv: s - 2 * SLOPES[h] * (q - kv).abs(),
    "a bias of the other sign": lambda s, b, h, q, kv: s + SLOPES[h] * (q - kv).abs(),
    "a distance 2q - kv": lambda s, b, h, q, kv: s - SLOPES[h] * (2 * q - kv).abs(),
    "a squared distance": lambda s, b, h, q, kv: s - SLOPES[h] * (q - kv) ** 2,
    "ALiBi plus a constant": lambda s, b, h, q, kv: s - SLOPES[h] * (q - kv).abs() + 1.0,
    "slopes indexed by the batch": lambda s, b, h, q, kv: s - SLOPES[b] * (q - kv).abs(),
    "a bfloat16 product": lambda s, b, h, q, kv: s - SLOPES.bfloat16()[h] * (q - kv).abs(),
    "slopes made inside the callback": lambda s, b, h, q, kv: s - torch.tensor([0.5, 0.25, 0.125, 1.0])[h] * (q - kv),
    "a plain distance bias": lambda s, b, h, q, kv: s - (q - kv).abs(),
    "ALiBi that also masks": lambda s, b, h, q, kv: torch.where(kv <= q, s - SLOPES[h] * (q - kv), float("-inf")),
    "ALiBi under a soft cap": lambda s, b, h, q, kv: 30.0 * torch.tanh((s - SLOPES[h] * (q - kv).abs()) / 30.0),
}


@pytest.mark.parametrize("name", list(NOT_ALIBI))
def test_other_biases_are_not_alibi(name):
    fn = NOT_ALIBI[name]
    assert score_mod_structure(fn, torch.float32, CPU).alibi is None
    inp, _ = normalize(make_inputs(*_qkv(), score_mod=fn, is_causal=True))
    assert segments.loop_mods(inp) is None


def _qkv(h=4, lq=40, lk=40):
    return torch.zeros(1, h, lq, 16), torch.zeros(1, h, lk, 16), torch.zeros(1, h, lk, 16)


def _call(h=4, **fields):
    """A normalized call of ``h`` heads, 40 x 40, with ``fields`` (callbacks, positions, causal flag)."""
    q = torch.zeros(1, h, 40, 16)
    inp, _ = normalize(Inputs(q, q, q, (1,), None, False, 0.25, 0.0).derive(**fields))
    return inp


@pytest.mark.parametrize("name", list(ALIBI_FORMS))
@pytest.mark.parametrize("q_offset, kv_offset, h_offset", [(0, 0, 0), (40, 3, 1), (0, 25, 0)])
def test_the_loops_alibi_is_the_callback_in_the_calls_positions(name, q_offset, kv_offset, h_offset):
    # A block of a longer sequence (ring attention's): the callback sees positions from the offsets.
    make, signed, shift = ALIBI_FORMS[name]
    fn = make(SLOPES)
    causal = dict(is_causal=True, causal_offset=q_offset - kv_offset + shift) if signed else {}
    inp = _call(h=3, score_mod=fn, q_offset=q_offset, kv_offset=kv_offset, h_offset=h_offset, **causal)
    found = segments.loop_mods(inp)
    assert found is not None and found.slopes is not None and found.slopes.dtype == torch.float32
    h, i, j = torch.arange(3).view(-1, 1, 1), torch.arange(40).view(1, -1, 1), torch.arange(40).view(1, 1, -1)
    got = -found.slopes.double().view(-1, 1, 1) * (i - j + found.alibi_shift).abs()
    want = fn(
        torch.zeros(1, 3, 40, 40, dtype=torch.float64), torch.zeros(()), h + h_offset, i + q_offset, j + kv_offset
    )
    seen = (j <= i + inp.causal_offset) if signed else torch.ones((), dtype=torch.bool)
    assert torch.equal(torch.where(seen, got, 0.0), torch.where(seen, want[0].double(), 0.0))


SIGNED_UNDER = {
    # name: (fields of the call, whether the loops take slopes[h] * (kv - q))
    "no mask": (dict(), False),
    "is_causal": (dict(is_causal=True), True),
    "a hand-written causal mask kv <= q": (dict(mask_mod=lambda b, h, q, kv: kv <= q), True),
    "causal bottom-right, more queries than keys": (dict(mask_mod=mods.causal_lower_right(60, 40)), True),
    "causal bottom-right, more keys than queries": (dict(mask_mod=mods.causal_lower_right(40, 60)), False),
    "a causal sliding window": (dict(mask_mod=mods.sliding_window(8, causal=True)), True),
    "a two-sided sliding window": (dict(mask_mod=mods.sliding_window(8)), False),
    "a hand-written window 0 <= q - kv < 8": (dict(mask_mod=lambda b, h, q, kv: (q - kv < 8) & (kv <= q)), True),
    "a hand-written window kv <= q + 1": (dict(mask_mod=lambda b, h, q, kv: kv <= q + 1), False),
    "prefix-LM": (dict(mask_mod=mods.prefix_lm(5)), False),
    "is_causal in a block whose keys come after": (dict(is_causal=True, q_offset=0, kv_offset=3), False),
    "is_causal in a block of later queries": (dict(is_causal=True, q_offset=40, kv_offset=0), True),
}


@pytest.mark.parametrize("name", list(SIGNED_UNDER))
def test_signed_alibi_takes_the_loops_only_where_no_key_lies_after_the_diagonal(name):
    # slopes[h] * (kv - q) is ALiBi's -slopes[h] * |q - kv| only where kv <= q.
    fields, taken = SIGNED_UNDER[name]
    found = segments.loop_mods(_call(score_mod=_signed(SLOPES), **fields))
    assert (found is not None) == taken, found
    assert found is None or found.slopes is not None
    assert segments.loop_mods(_call(score_mod=_abs(SLOPES), **fields)) is not None  # |q - kv|: everywhere


def test_learnable_or_too_few_slopes_stay_on_the_per_tile_path():
    learnable = SLOPES.clone().requires_grad_()
    assert segments.loop_mods(_call(score_mod=_abs(learnable))) is None
    assert segments.loop_mods(_call(score_mod=_abs(SLOPES[:2]))) is None


MASK_BANDS = {
    # name: (mask_mod, its band, the built-in it equals)
    "kv <= q (the causal flag)": (lambda b, h, q, kv: kv <= q, None, mods.causal()),
    "(q - kv < 8) & (kv <= q)": (lambda b, h, q, kv: (q - kv < 8) & (kv <= q), (0, 7), mods.sliding_window(7, True)),
    "(q - kv).abs() <= 5": (lambda b, h, q, kv: (q - kv).abs() <= 5, (-5, 5), mods.sliding_window(5)),
    "(kv >= q - 6) & (kv <= q + 2)": (
        lambda b, h, q, kv: (kv >= q - 6) & (kv <= q + 2),
        (-2, 6),
        mods.local_window(6, 2),
    ),
    "~(kv > q + 3)": (lambda b, h, q, kv: ~(kv > q + 3), (-3, None), mods.local_window(right=3)),
    "2 * kv <= 2 * q - 4": (lambda b, h, q, kv: 2 * kv <= 2 * q - 4, (2, None), mods.local_window(right=0, offset=-2)),
    "q - kv == 4": (lambda b, h, q, kv: q - kv == 4, (4, 4), mods.local_window(0, 0, offset=-4)),
}


def _loop_band(inp):
    """The band the loops compute for ``inp`` (call positions): its window and causal flag together."""
    found = segments.loop_mods(inp)
    assert found is not None, inp.mask_mod
    lo, hi = found.window_lo, found.window_hi
    if inp.is_causal:
        lo = -inp.causal_offset if lo is None else max(lo, -inp.causal_offset)
    return lo, hi


@pytest.mark.parametrize("name", list(MASK_BANDS))
@pytest.mark.parametrize("q_offset, kv_offset", [(0, 0), (40, 0), (7, 19)])
def test_a_traced_band_is_the_builtins_in_the_calls_positions(name, q_offset, kv_offset):
    # A block of a longer sequence: the callbacks see positions from the offsets, the loops the call's own.
    fn, band, builtin = MASK_BANDS[name]
    inp = _call(mask_mod=fn, q_offset=q_offset, kv_offset=kv_offset)
    if band is not None:
        assert isinstance(inp.mask_mod, TracedMask) and segments.mask_band(inp.mask_mod) == band
    lo, hi = _loop_band(inp)
    assert (lo, hi) == _loop_band(_call(mask_mod=builtin, q_offset=q_offset, kv_offset=kv_offset))
    i, j = torch.arange(40).view(-1, 1), torch.arange(40).view(1, -1)
    low, high = float("-inf") if lo is None else lo, float("inf") if hi is None else hi
    assert torch.equal((low <= i - j) & (i - j <= high), fn(0, 0, i + q_offset, j + kv_offset))


RANGES = {
    "prefix-LM (kv < 9) | (kv <= q)": (lambda b, h, q, kv: (kv < 9) | (kv <= q), mods.prefix_lm(9)),
    "prefix-LM (q >= kv) | (kv <= 8)": (lambda b, h, q, kv: (q >= kv) | (kv <= 8), mods.prefix_lm(9)),
    "key padding kv < 30": (lambda b, h, q, kv: kv < 30, mods.key_padding(30)),
    "(kv < 30) & (kv <= q)": (
        lambda b, h, q, kv: (kv < 30) & (kv <= q),
        mods.and_masks(mods.causal(), mods.key_padding(30)),
    ),
    "prefix-LM in a window of 10": (
        lambda b, h, q, kv: ((kv < 12) | (kv <= q)) & ((q - kv).abs() <= 10),
        mods.and_masks(mods.prefix_lm(12), mods.sliding_window(10)),
    ),
}


@pytest.mark.parametrize("name", list(RANGES))
@pytest.mark.parametrize("q_offset, kv_offset", [(0, 0), (7, 3)])
def test_traced_prefixes_and_paddings_give_the_builtins_ranges(name, q_offset, kv_offset):
    fn, builtin = RANGES[name]
    found = segments.loop_mods(_call(mask_mod=fn, q_offset=q_offset, kv_offset=kv_offset))
    want = segments.loop_mods(_call(mask_mod=builtin, q_offset=q_offset, kv_offset=kv_offset))
    assert found is not None and want is not None and found.ranges is not None
    assert (found.window_lo, found.window_hi) == (want.window_lo, want.window_hi)
    assert torch.equal(found.ranges, want.ranges)


NOT_BANDS = {
    "outside a window: (q - kv).abs() >= 3": lambda b, h, q, kv: (q - kv).abs() >= 3,
    "a slope other than 1: kv <= 2 * q": lambda b, h, q, kv: kv <= 2 * q,
    "queries alone: q < 20": lambda b, h, q, kv: q < 20,
    "keys from 5 on: kv >= 5": lambda b, h, q, kv: kv >= 5,
    "an or that is not prefix-LM": lambda b, h, q, kv: (kv < 5) | (q - kv < 3),
    "a prefix with the diagonal shifted": lambda b, h, q, kv: (kv < 5) | (kv <= q + 1),
    "never true: kv < kv": lambda b, h, q, kv: kv < kv,
    "per batch entry": lambda b, h, q, kv: (kv <= q) & (b == 0),
}


@pytest.mark.parametrize("name", list(NOT_BANDS))
def test_masks_that_are_not_bands_stay_on_the_per_tile_path(name):
    inp = _call(mask_mod=NOT_BANDS[name])
    assert segments.loop_mods(inp) is None, inp.mask_mod


def test_explain_says_a_hand_written_alibi_is_alibi():
    q = torch.zeros(1, 4, 64, 16)
    plain = subquad.explain(q, q, q, score_mod=mods.alibi(SLOPES), is_causal=True)
    hand = subquad.explain(q, q, q, score_mod=_abs(SLOPES), is_causal=True)
    signed = subquad.explain(q, q, q, score_mod=_signed(SLOPES), is_causal=True)
    assert "(traced)" not in str(plain)
    note = "score + bias (traced), the bias ALiBi's -slopes[h] * |q_idx - kv_idx| with slopes [0.25, 0.0625, 0.015625"
    assert note in str(hand), str(hand)
    assert "ALiBi with slopes [0.25, 0.0625" in str(signed) and "under a causal mask" in str(signed), str(signed)


# ------------------------------------------------------------------ with the native kernel (a C++ compiler and ninja)
@pytest.fixture(params=(torch.bfloat16, torch.float32), ids=str)
def dtype(request):
    return request.param


@pytest.fixture
def loop(native_dir, monkeypatch, dtype):
    """The native kernel with the forward loop of ``dtype``, its calls recorded."""
    name = f"forward_segment_{SUFFIX[dtype]}"
    return test_native.recorded_kernel(native_dir, monkeypatch, name, f"the native kernel was built without {name}")


def _shifted_alibi(slopes, shift):
    return lambda s, b, h, q, kv: s - slopes.double()[h] * (q - kv + shift).abs()


CASES = {
    # name: (query shape, key/value shape, the call's callbacks of (Lq, Lk), the built-ins they equal, chunk)
    "ALiBi |q - kv|, 300 x 700, head dim 59": (
        (2, 4, 300, 59),
        (2, 4, 700, 59),
        lambda lq, lk: dict(score_mod=_abs(SLOPES)),
        lambda lq, lk: dict(score_mod=mods.alibi(SLOPES)),
        None,
    ),
    "slopes[h] * (kv - q), is_causal, 333 x 333, 3 heads": (
        (2, 3, 333, 64),
        (2, 3, 333, 64),
        lambda lq, lk: dict(score_mod=_signed(SLOPES3), is_causal=True),
        lambda lq, lk: dict(score_mod=mods.alibi(SLOPES3), is_causal=True),
        None,
    ),
    "an object's slopes[h] * (q - kv), a hand-written causal mask, 300 x 200": (
        (1, 4, 300, 64),
        (1, 4, 200, 64),
        lambda lq, lk: dict(score_mod=_Module(SLOPES), mask_mod=lambda b, h, q, kv: kv <= q),
        lambda lq, lk: dict(score_mod=mods.alibi(SLOPES), mask_mod=mods.causal()),
        None,
    ),
    "flash-attn's bottom-right ALiBi, 150 x 610, segments of 64 x 200": (
        (1, 4, 150, 59),
        (1, 4, 610, 59),
        lambda lq, lk: dict(
            score_mod=lambda s, b, h, q, kv: s + SLOPES[h] * (kv - q - (lk - lq)),
            mask_mod=mods.causal_lower_right(lq, lk),
        ),
        lambda lq, lk: dict(score_mod=_shifted_alibi(SLOPES, lk - lq), mask_mod=mods.causal_lower_right(lq, lk)),
        (64, 200),
    ),
    "ALiBi in (q - kv).abs() <= 40, 300 x 700": (
        (2, 2, 300, 64),
        (2, 2, 700, 64),
        lambda lq, lk: dict(score_mod=_abs(SLOPES[:2]), mask_mod=lambda b, h, q, kv: (q - kv).abs() <= 40),
        lambda lq, lk: dict(score_mod=mods.alibi(SLOPES[:2]), mask_mod=mods.sliding_window(40)),
        None,
    ),
    "(q - kv < 50) & (kv <= q), 1100 keys": (
        (1, 2, 1100, 64),
        (1, 2, 1100, 64),
        lambda lq, lk: dict(mask_mod=lambda b, h, q, kv: (q - kv < 50) & (kv <= q)),
        lambda lq, lk: dict(mask_mod=mods.sliding_window(49, causal=True)),
        None,
    ),
    "(kv >= q - 20) & (kv <= q + 5), head dim 59, 90 x 150": (
        (2, 2, 90, 59),
        (2, 2, 150, 59),
        lambda lq, lk: dict(mask_mod=lambda b, h, q, kv: (kv >= q - 20) & (kv <= q + 5)),
        lambda lq, lk: dict(mask_mod=mods.local_window(20, 5)),
        None,
    ),
    "prefix-LM (kv < 100) | (kv <= q) with ALiBi, 400 x 400": (
        (1, 4, 400, 64),
        (1, 4, 400, 64),
        lambda lq, lk: dict(score_mod=_abs(SLOPES), mask_mod=lambda b, h, q, kv: (kv < 100) | (kv <= q)),
        lambda lq, lk: dict(score_mod=mods.alibi(SLOPES), mask_mod=mods.prefix_lm(100)),
        None,
    ),
    "(kv < 250) & (kv <= q), 333 x 333": (
        (2, 2, 333, 64),
        (2, 2, 333, 64),
        lambda lq, lk: dict(mask_mod=lambda b, h, q, kv: (kv < 250) & (kv <= q)),
        lambda lq, lk: dict(mask_mod=mods.and_masks(mods.causal(), mods.key_padding(250))),
        None,
    ),
}


def _inputs(shape_q, shape_kv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = ((torch.randn(*s, generator=g) * 2).to(dtype).requires_grad_() for s in (shape_q, shape_kv, shape_kv))
    return q, k, v, torch.randn(*shape_q, generator=g).to(dtype)


@test_native.pytestmark
@pytest.mark.parametrize("name", list(CASES))
def test_hand_written_builtins_run_in_the_loops_and_match_float64(loop, two_threads, dtype, name):  # noqa: F811
    shape_q, shape_kv, call, builtin, chunk = CASES[name]
    q, k, v, d_out = _inputs(shape_q, shape_kv, dtype, 51)
    lq, lk = shape_q[2], shape_kv[2]
    out = subquad.attention(q, k, v, backend=LOOPS, chunk_size=chunk, **call(lq, lk))
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    # Both passes in the loops: no per-tile pass, no tile of the callbacks.
    assert set(loop.names) == {f"forward_segment_{SUFFIX[dtype]}", f"backward_segment_{SUFFIX[dtype]}"}, loop.names
    _check(q, k, v, d_out, out, grads, builtin(lq, lk))


NOT_EQUAL = {
    # name: (the call's callbacks of (Lq, Lk), query length, key length)
    "slopes[h] * (kv - q) without a causal mask": (lambda lq, lk: dict(score_mod=_signed(SLOPES)), 130, 200),
    "slopes[h] * (kv - q) under a bottom-right causal mask of more keys": (
        lambda lq, lk: dict(score_mod=_signed(SLOPES), mask_mod=mods.causal_lower_right(lq, lk)),
        130,
        200,
    ),
    "learnable slopes": (
        lambda lq, lk: dict(score_mod=_abs(SLOPES.clone().requires_grad_()), is_causal=True),
        130,
        130,
    ),
    "2 * slopes[h] * |q - kv|": (
        lambda lq, lk: dict(score_mod=NOT_ALIBI["another coefficient: 2 * slopes[h]"]),
        130,
        200,
    ),
    "a mask that is not a band: (q - kv).abs() >= 3": (
        lambda lq, lk: dict(mask_mod=lambda b, h, q, kv: (q - kv).abs() >= 3),
        130,
        200,
    ),
}


@test_native.pytestmark
@pytest.mark.parametrize("name", list(NOT_EQUAL))
def test_unequal_forms_run_off_the_loops_as_written(native_dir, monkeypatch, two_threads, name):  # noqa: F811
    loop = test_native.recorded_kernel(native_dir, monkeypatch, "forward_segment_f32", "no float32 loop")
    call, lq, lk = NOT_EQUAL[name]
    q, k, v, d_out = _inputs((2, 4, lq, 59), (2, 4, lk, 59), torch.float32, 52)
    kw = call(lq, lk)
    assert segments.loop_mods(normalize(make_inputs(q, k, v, **kw))[0]) is None
    out = subquad.attention(q, k, v, backend="matmul", **kw)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    assert not any(n.startswith(("forward_segment", "backward_segment")) for n in loop.names), loop.names
    _check(q, k, v, d_out, out, grads, kw)  # the callbacks themselves, densely in float64
