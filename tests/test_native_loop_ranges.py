"""Document masks, prefix-LM and key padding in the C++ tile loops (issue 56, item 4).

Each of :func:`subquad.mods.document` (keys' ids sorted), :func:`~subquad.mods.prefix_lm` and
:func:`~subquad.mods.key_padding` leaves each query row one range of keys; the loops take that
range per row (``ranges`` in ``_native_tiles.cpp``, ``segments.LoopMods.ranges``), intersected with
a band (causal, sliding windows) under :func:`~subquad.mods.and_masks`, and skip the blocks of keys
no row of a block sees. Checked against the float64 golden with the mask evaluated densely from
the mods themselves (outputs and the gradients of q, k and v, the suite's tolerance policy) on
awkward sizes, with per-batch ids and lengths, rows that see nothing, GQA and several segments of
keys; that both loops ran; which masks they leave to the per-tile path (ids not sorted, an
``or_masks``); and the time model's count of the keys they compute.
"""

from __future__ import annotations

import pytest
import torch

import subquad
import test_native
from conftest import assert_close_to_golden
from subquad import _time_model, mods
from subquad._backends import segments
from subquad._validate import make_inputs
from test_native_loop_mods import LOOPS
from test_native_loop_mods import _attention as loop_mods_attention

pytestmark = test_native.pytestmark  # a C++ compiler and ninja

DTYPES = (torch.bfloat16, torch.float32, torch.float16)


@pytest.fixture(params=DTYPES, ids=str)
def dtype(request):
    return request.param


@pytest.fixture
def loop(native_dir, monkeypatch, dtype):
    name = f"forward_segment_{LOOPS[dtype]}"
    return test_native.recorded_kernel(native_dir, monkeypatch, name, f"the native kernel was built without {name}")


def _sorted_ids(B, L, docs, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randint(0, docs, (B, L), generator=g), dim=-1).values


CASES = {
    # name: (query shape, key/value shape, the mask_mod of (B, Lq, Lk), chunk_size)
    "document, per-batch ids, head dim 59": (
        (2, 3, 300, 59),
        (2, 3, 300, 59),
        lambda B, lq, lk: mods.document(_sorted_ids(B, lq, 5, 1)),
        None,
    ),
    "document and causal, GQA 4/2, segments of 64 x 100": (
        (2, 4, 333, 64),
        (2, 2, 333, 64),
        lambda B, lq, lk: mods.and_masks(mods.causal(), mods.document(_sorted_ids(B, lq, 4, 2))),
        (64, 100),
    ),
    "document, shared ids, queries and keys of their own, some ids no key has": (
        (2, 2, 130, 111),
        (2, 2, 257, 111),
        lambda B, lq, lk: mods.document(
            torch.sort(torch.randint(0, 9, (lq,), generator=torch.Generator().manual_seed(3))).values,
            torch.sort(torch.randint(0, 6, (lk,), generator=torch.Generator().manual_seed(4))).values,
        ),
        None,
    ),
    "document and sliding window 30": (
        (1, 2, 600, 64),
        (1, 2, 600, 64),
        lambda B, lq, lk: mods.and_masks(mods.sliding_window(30), mods.document(_sorted_ids(B, lq, 3, 5))),
        None,
    ),
    "prefix-LM 100, 1100 keys": ((1, 2, 1100, 64), (1, 2, 1100, 64), lambda B, lq, lk: mods.prefix_lm(100), None),
    "prefix-LM per batch 0 and 333, segments of 128 x 200": (
        (2, 2, 400, 59),
        (2, 2, 400, 59),
        lambda B, lq, lk: mods.prefix_lm(torch.tensor([0, 333])),
        (128, 200),
    ),
    "key padding 0 and 77 (a batch entry sees nothing)": (
        (2, 2, 90, 64),
        (2, 2, 150, 64),
        lambda B, lq, lk: mods.key_padding(torch.tensor([0, 77])),
        None,
    ),
    "key padding, prefix-LM and causal together": (
        (2, 2, 260, 64),
        (2, 2, 260, 64),
        lambda B, lq, lk: mods.and_masks(mods.prefix_lm(50), mods.key_padding(torch.tensor([200, 260]))),
        None,
    ),
}


def _inputs(name, dtype, seed):
    shape_q, shape_kv, make, chunk = CASES[name]
    g = torch.Generator().manual_seed(seed)
    q, k, v = ((torch.randn(*s, generator=g) * 2).to(dtype).requires_grad_() for s in (shape_q, shape_kv, shape_kv))
    d_out = torch.randn(*shape_q, generator=g).to(dtype)
    return q, k, v, d_out, make(shape_q[0], shape_q[2], shape_kv[2]), chunk


def _keep(mask_mod, B, Hq, Lq, Lk):
    b = torch.arange(B).view(-1, 1, 1, 1)
    h = torch.arange(Hq).view(1, -1, 1, 1)
    i, j = torch.arange(Lq).view(1, 1, -1, 1), torch.arange(Lk).view(1, 1, 1, -1)
    return mask_mod(b, h, i, j).expand(B, Hq, Lq, Lk)


def _attention(q, k, v, keep):
    """test_native_loop_mods' reference attention, the hidden scores as a bias of -inf."""
    bias = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    return loop_mods_attention(q, k, v, bias)


@pytest.mark.parametrize("name", list(CASES))
def test_the_loops_run_each_rows_range_and_match_float64(loop, dtype, name):
    q, k, v, d_out, mask_mod, chunk = _inputs(name, dtype, 11)
    B, Hq, Lq, _ = q.shape
    gqa = q.shape[1] != k.shape[1]
    out = subquad.attention(q, k, v, mask_mod=mask_mod, backend="loops", chunk_size=chunk, enable_gqa=gqa)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    suffix = LOOPS[dtype]
    assert set(loop.names) >= {f"forward_segment_{suffix}", f"backward_segment_{suffix}"}, loop.names
    assert not {"exp2_rows_bf16", "softmax_grad_rows_bf16"} & set(loop.names)  # no per-tile pass
    keep = _keep(mask_mod, B, Hq, Lq, k.shape[2])
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    golden = _attention(q64, k64, v64, keep)
    gold = torch.autograd.grad(golden, (q64, k64, v64), d_out.double())
    p32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out = _attention(*p32, keep)
    ref = torch.autograd.grad(ref_out, p32, d_out.float())
    assert_close_to_golden(out, golden, ref_out.detach().to(dtype))
    for n, got, g64, r in zip("qkv", grads, gold, ref):
        assert_close_to_golden(got, g64, r.to(dtype), name=f"d{n}")
    blind = ~keep.any(dim=-1, keepdim=True)  # rows that see nothing: 0, no gradient
    assert bool((out[blind.expand_as(out)] == 0).all()) and bool((grads[0][blind.expand_as(grads[0])] == 0).all())


@pytest.mark.parametrize(
    "mask_mod",
    [
        mods.document(torch.tensor([0, 0, 1, 1, 0, 0] * 20)),  # a document in two ranges
        mods.or_masks(mods.causal(), mods.prefix_lm(10)),
    ],
    ids=["ids not sorted", "or_masks"],
)
def test_masks_of_more_than_one_range_stay_on_the_per_tile_path(loop, dtype, mask_mod):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, 2, 120, 64, generator=g).to(dtype) for _ in range(3))
    assert segments.loop_mods(make_inputs(q, k, v, mask_mod=mask_mod)) is None
    out = subquad.attention(q, k, v, mask_mod=mask_mod, backend="matmul")
    assert not any(n.startswith("forward_segment") for n in loop.names), loop.names
    refused = subquad.explain(q, k, v, mask_mod=mask_mod, allow_compile=False).rejected["loops"]
    assert "mask_mod the loops do not evaluate" in refused[0], refused
    keep = _keep(mask_mod, 3, 2, 120, 120)
    golden = _attention(q.double(), k.double(), v.double(), keep)
    assert_close_to_golden(out, golden, _attention(q.float(), k.float(), v.float(), keep).to(dtype))


def test_ids_of_another_batch_size_stay_on_the_per_tile_path():
    q = torch.zeros(3, 2, 120, 64)
    assert (
        segments.loop_mods(make_inputs(q, q, q, mask_mod=mods.document(torch.zeros(2, 120, dtype=torch.long)))) is None
    )


def test_the_time_model_counts_the_keys_of_each_rows_range():
    # Four documents of 512 under a causal mask: each block of 128 rows computes its document's keys
    # up to its diagonal (in blocks of 32), far fewer than the causal band alone.
    ranges = torch.tensor([[[d * 512, min(d * 512 + 512, i + 1)] for i in range(2048) for d in [i // 512]]])
    fraction = _time_model.ranges_fraction(2048, (0, None), ranges, 128, 32)
    causal = _time_model.band_fraction(2048, 2048, (0, None), 128, 32)
    dense = (ranges[0, :, 1] - ranges[0, :, 0]).sum().item() / 2048**2
    assert dense < fraction < 0.3 * causal
    # Rows that see nothing cost nothing; the band still limits a row's range.
    assert _time_model.ranges_fraction(64, (None, None), torch.zeros(1, 64, 2, dtype=torch.long), 128, 32) == 0.0
    wide = torch.tensor([[[0, 64]] * 64])
    assert _time_model.ranges_fraction(64, (0, 0), wide, 32, 32) == _time_model.band_fraction(64, 64, (0, 0), 32, 32)


def test_row_ranges_of_each_mask():
    q = torch.zeros(2, 1, 6, 4)
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 6, 6]])
    cases = [
        (mods.document(ids), [[[0, 2]] * 2 + [[2, 5]] * 3 + [[5, 6]], [[0, 4]] * 4 + [[4, 6]] * 2]),
        (
            mods.prefix_lm(torch.tensor([3, 0])),
            [[[0, 3]] * 3 + [[0, 4], [0, 5], [0, 6]], [[0, i + 1] for i in range(6)]],
        ),
        (mods.key_padding(torch.tensor([2, 6])), [[[0, 2]] * 6, [[0, 6]] * 6]),
        (mods.and_masks(mods.causal(), mods.key_padding(3)), [[[0, 3]] * 6] * 2),  # the band apart: causal
    ]
    for mask_mod, want in cases:
        found = segments.loop_mods(make_inputs(q, q, q, mask_mod=mask_mod))
        assert found is not None and found.ranges is not None, mask_mod
        assert found.ranges.expand(2, -1, -1).tolist() == want, mask_mod
    causal = segments.loop_mods(make_inputs(q, q, q, mask_mod=mods.and_masks(mods.causal(), mods.key_padding(3))))
    assert causal is not None and causal.window_lo == 0 and causal.window_hi is None


def test_ranges_are_read_again_when_the_ids_change_in_place():
    # A call's ranges are remembered (it asks for them several times); ids edited in place are new.
    q = torch.zeros(1, 1, 6, 4)
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    mask_mod = mods.document(ids)
    first = segments.loop_mods(make_inputs(q, q, q, mask_mod=mask_mod))
    assert first is not None and first.ranges is not None and first.ranges[0, :, 1].tolist() == [3, 3, 3, 6, 6, 6]
    mask_mod.q_ids[3:] = 0
    mask_mod.kv_ids[3:] = 0
    again = segments.loop_mods(make_inputs(q, q, q, mask_mod=mask_mod))
    assert again is not None and again.ranges is not None and again.ranges[0, :, 1].tolist() == [6] * 6
