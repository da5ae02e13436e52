"""Packed sequences (subquad.varlen_attention): each sequence attends only within itself.

Every case is checked against a float64 loop over the sequences (the materialized reference per
sequence), output, lse and gradients; tiles are counted to show that none crosses a boundary.
"""

from __future__ import annotations

import math

import pytest
import torch

import subquad
from conftest import assert_close_to_golden, naive_attention
from subquad import _buckets, _engine, mods
from subquad._tiles import TILES

f64 = torch.float64


def packed(lengths_q, lengths_k=None, Hq=4, Hk=None, E=8, Ev=None, dtype=f64, grad=False, seed=0):
    lengths_k = lengths_q if lengths_k is None else lengths_k
    Hk = Hq if Hk is None else Hk
    Ev = E if Ev is None else Ev
    g = torch.Generator().manual_seed(seed)
    cu_q = (
        torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
        if lengths_q
        else torch.zeros(1, dtype=torch.int32)
    )
    cu_k = (
        torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
        if lengths_k
        else torch.zeros(1, dtype=torch.int32)
    )
    q = torch.randn(int(cu_q[-1]), Hq, E, generator=g, dtype=dtype).requires_grad_(grad)
    k = torch.randn(int(cu_k[-1]), Hk, E, generator=g, dtype=dtype).requires_grad_(grad)
    v = torch.randn(int(cu_k[-1]), Hk, Ev, generator=g, dtype=dtype).requires_grad_(grad)
    return q, k, v, cu_q, cu_k


def visible(Lq, Lk, is_causal, alignment, window):
    """The (Lq, Lk) bool mask of one sequence (True = attend)."""
    off = Lk - Lq if alignment == "bottom_right" else 0
    i = torch.arange(Lq).view(-1, 1) + off
    j = torch.arange(Lk).view(1, -1)
    keep = torch.ones(Lq, Lk, dtype=torch.bool)
    if is_causal:
        keep &= j <= i
    if window is not None:
        left, right = window
        if left is not None:
            keep &= j >= i - left
        if right is not None:
            keep &= j <= i + right
    return keep


def reference(
    q,
    k,
    v,
    cu_q,
    cu_k,
    *,
    is_causal=False,
    alignment="top_left",
    window=None,
    score_mod=None,
    mask_mod=None,
    scale=None,
):
    """The packed call as a loop of materialized float64 attentions, one per sequence."""
    outs, lses = [], []
    for s in range(len(cu_q) - 1):
        a, b, c, d = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        qs, ks, vs = (t.transpose(0, 1).double() for t in (q[a:b], k[c:d], v[c:d]))
        keep = visible(b - a, d - c, is_causal, alignment, window)
        sm = None if score_mod is None else (lambda x, bb, h, i, j, s=s: score_mod(x, bb + s, h, i, j))
        mm = None if mask_mod is None else (lambda bb, h, i, j, s=s: mask_mod(bb + s, h, i, j))
        if d == c:
            o = torch.zeros(qs.shape[0], b - a, vs.shape[-1], dtype=f64)
            lse = torch.full((qs.shape[0], b - a), -math.inf, dtype=f64)
        else:
            o, lse = naive_attention(
                qs,
                ks,
                vs,
                attn_mask=keep,
                scale=scale,
                enable_gqa=qs.shape[0] != ks.shape[0],
                score_mod=sm,
                mask_mod=mm,
                return_lse=True,
            )
        outs.append(o.transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def check(q, k, v, cu_q, cu_k, grad=True, **kw):
    ref_kw = {n: kw[n] for n in ("is_causal", "alignment", "window", "score_mod", "mask_mod", "scale") if n in kw}
    out, lse = subquad.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    ref_in = [t.detach().double().requires_grad_(grad) for t in (q, k, v)]
    ref, ref_lse = reference(*ref_in, cu_q, cu_k, **ref_kw)
    assert out.shape == (q.shape[0], q.shape[1], v.shape[-1]) and lse.shape == q.shape[:2]
    assert_close_to_golden(out, ref.to(out.dtype) if out.dtype != f64 else ref.detach())
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "rows that see no key must have lse -inf"
    assert_close_to_golden(lse[finite].double(), ref_lse[finite].detach(), name="lse")
    if grad:
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), g)
        want = torch.autograd.grad(ref, ref_in, g.double())
        for name, a, b in zip("qkv", got, want):
            assert_close_to_golden(a, b, name=f"d{name}")


LENGTHS = {
    "one": [7],
    "several": [5, 9, 1, 16],
    "with-empty": [3, 0, 11, 0, 2],
    "length-1": [1, 1, 1],
    "odd": [13, 29, 7],
}


@pytest.mark.parametrize("lengths", list(LENGTHS.values()), ids=list(LENGTHS))
@pytest.mark.parametrize(
    "backend,chunk",
    [("fused", None), ("fused", (4, 4)), ("matmul", (3, 5)), ("matmul", None)],
    ids=["fused-whole", "fused-4", "matmul-3x5", "matmul-whole"],
)
@pytest.mark.parametrize(
    "is_causal,alignment",
    [(False, "top_left"), (True, "top_left"), (True, "bottom_right")],
    ids=["full", "causal-tl", "causal-br"],
)
def test_matches_a_loop_over_the_sequences(lengths, backend, chunk, is_causal, alignment):
    q, k, v, cu_q, cu_k = packed(lengths, grad=True)
    check(q, k, v, cu_q, cu_k, is_causal=is_causal, alignment=alignment, backend=backend, chunk_size=chunk)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_query_and_key_lengths_differ_per_sequence(alignment, is_causal):
    # Some sequences have more queries than keys (bottom-right: their first rows see nothing).
    q, k, v, cu_q, cu_k = packed([4, 9, 2, 6], [9, 4, 0, 6], Hq=4, Hk=2, grad=True)
    check(q, k, v, cu_q, cu_k, is_causal=is_causal, alignment=alignment, enable_gqa=True, chunk_size=(3, 3))


@pytest.mark.parametrize("window", [(2, 0), (1, 3), (None, 1), (3, None), (0, 0)])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_windows(window, alignment):
    q, k, v, cu_q, cu_k = packed([12, 5, 20], [15, 5, 17], grad=True)
    check(q, k, v, cu_q, cu_k, window=window, alignment=alignment, chunk_size=(4, 4))
    check(q, k, v, cu_q, cu_k, window=window, alignment=alignment, is_causal=True, backend="matmul", chunk_size=(4, 4))


@pytest.mark.parametrize("E,Ev", [(1, 1), (59, 59), (111, 111), (16, 24)])
def test_head_dims(E, Ev):
    q, k, v, cu_q, cu_k = packed([6, 11], E=E, Ev=Ev, grad=True)
    check(q, k, v, cu_q, cu_k, is_causal=True)


def test_gqa_and_scale():
    q, k, v, cu_q, cu_k = packed([8, 3, 17], Hq=8, Hk=2, grad=True)
    check(q, k, v, cu_q, cu_k, enable_gqa=True, scale=0.37, is_causal=True, alignment="bottom_right")


def test_callbacks_see_the_sequence_index_and_positions_within_it():
    q, k, v, cu_q, cu_k = packed([6, 10, 4], grad=True)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=f64)
    per_sequence = torch.tensor([0.0, 1.0, -2.0], dtype=f64)  # a bias that depends on b alone

    def alibi(s, b, h, i, j):
        return s - slopes.to(s.dtype)[h] * (i - j).abs() + per_sequence.to(s.dtype)[b]

    prefix = torch.tensor([2, 7, 1])  # per-sequence prefix: keys < prefix[b] always visible, else causal

    def prefix_lm(b, h, i, j):
        return (j < prefix[b]) | (j <= i)

    check(q, k, v, cu_q, cu_k, score_mod=alibi, chunk_size=(3, 3))
    check(q, k, v, cu_q, cu_k, mask_mod=prefix_lm, chunk_size=(3, 3))
    check(q, k, v, cu_q, cu_k, score_mod=lambda s, b, h, i, j: 5.0 * torch.tanh(s / 5.0), mask_mod=prefix_lm)


def test_learnable_callback_tensors_get_their_gradient():
    q, k, v, cu_q, cu_k = packed([6, 10, 4])
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=f64, requires_grad=True)
    out = subquad.varlen_attention(q, k, v, cu_q, cu_k, score_mod=lambda s, b, h, i, j: s - slopes[h] * (i - j).abs())
    g = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, slopes, g)
    s2 = slopes.detach().clone().requires_grad_()
    ref, _ = reference(q, k, v, cu_q, cu_k, score_mod=lambda s, b, h, i, j: s - s2[h] * (i - j).abs())
    (want,) = torch.autograd.grad(ref, s2, g)
    assert_close_to_golden(got, want, name="dslopes")


def test_dropout_is_reproducible_and_its_backward_consistent():
    q, k, v, cu_q, cu_k = packed([5, 8, 3], Hq=2, E=4, grad=True)

    def f(q, k, v):
        torch.manual_seed(7)
        return subquad.varlen_attention(q, k, v, cu_q, cu_k, dropout_p=0.3, is_causal=True, chunk_size=(2, 3))

    a, b = f(q, k, v), f(q, k, v)
    assert torch.equal(a, b)
    assert not torch.allclose(a, subquad.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True))
    # fast_mode checks the Jacobian along random directions (a few calls, not one per input
    # element): a backward that drew another dropout mask than its forward fails it all the same.
    assert torch.autograd.gradcheck(f, (q, k, v), atol=1e-8, fast_mode=True)
    ones = subquad.varlen_attention(q, k, v, cu_q, cu_k, dropout_p=1.0)
    assert torch.equal(ones, torch.zeros_like(ones))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_half_and_single_precision(dtype):
    q, k, v, cu_q, cu_k = packed([33, 7, 60], dtype=dtype)
    out = subquad.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True)
    ref, _ = reference(q, k, v, cu_q, cu_k, is_causal=True)
    same_dtype = torch.cat(
        [
            naive_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True).transpose(0, 1)
            for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist())
        ]
    )
    assert out.dtype == dtype
    assert_close_to_golden(out, ref, same_dtype)


def test_no_tile_crosses_a_sequence_boundary():
    lengths = [16, 8, 24]
    q, k, v, cu_q, cu_k = packed(lengths, dtype=torch.float32)
    TILES.reset()
    subquad.varlen_attention(q, k, v, cu_q, cu_k, chunk_size=(8, 8), backend="matmul")
    # Per sequence (L/8)^2 tiles, nothing between sequences: 4 + 1 + 9, none skipped.
    assert (TILES.computed, TILES.skipped) == (14, 0)
    TILES.reset()
    subquad.varlen_attention(q, k, v, cu_q, cu_k, chunk_size=(8, 8), backend="matmul", is_causal=True)
    assert (TILES.computed, TILES.skipped) == (3 + 1 + 6, 1 + 0 + 3)


def test_output_layout_and_explain():
    q, k, v, cu_q, cu_k = packed([100, 28, 0, 1], Hq=4, dtype=torch.float32)
    out = subquad.varlen_attention(q, k, v, cu_q, cu_k)
    assert out.is_contiguous() and out.shape == (129, 4, 8)
    plan = subquad.varlen_explain(q, k, v, cu_q, cu_k, is_causal=True, alignment="bottom_right", memory_budget="1MiB")
    text = str(plan)
    assert "4 packed sequences (longest Lq=100, Lk=100; 129 x 129 rows in all)" in text
    assert "causal (bottom-right per sequence)" in text
    assert "not sdpa:" in text and plan.backend in ("fused", "matmul")
    assert plan.predicted_peak_bytes <= 1 << 20
    with pytest.raises(NotImplementedError, match="packed sequences run in tiles, one sequence at a time"):
        subquad.varlen_attention(q, k, v, cu_q, cu_k, backend="sdpa")


def test_budget_plans_for_the_longest_sequence():
    q, k, v, cu_q, cu_k = packed([512, 64, 256], Hq=4, E=64, dtype=torch.float32)
    plan = subquad.varlen_explain(q, k, v, cu_q, cu_k, memory_budget="1MiB", backend="matmul")
    assert plan.chunk_size is not None and plan.chunk_size[0] * plan.chunk_size[1] < 512 * 512
    out = subquad.varlen_attention(q, k, v, cu_q, cu_k, memory_budget="1MiB", backend="matmul")
    ref, _ = reference(q, k, v, cu_q, cu_k)
    assert (out.double() - ref).abs().max().item() < 1e-5
    with pytest.raises(subquad.MemoryBudgetError, match=r"memory_budget=.* is too small for 3 packed sequences"):
        subquad.varlen_attention(q, k, v, cu_q, cu_k, memory_budget="1KiB")


def _bad(**change):
    q, k, v, cu_q, cu_k = packed([3, 4])
    args = dict(query=q, key=k, value=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    args.update(change)
    return args


@pytest.mark.parametrize(
    "change,error,match",
    [
        (
            dict(cu_seqlens_q=torch.tensor([1, 3, 7], dtype=torch.int32)),
            ValueError,
            r"cu_seqlens_q to start at 0 and never decrease",
        ),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 3, 7], dtype=torch.int32)), ValueError, "never decrease"),
        (
            dict(cu_seqlens_k=torch.tensor([0, 3, 6], dtype=torch.int32)),
            ValueError,
            r"cu_seqlens_k\[-1\] == 7 \(the packed length of key\), got 6",
        ),
        (dict(cu_seqlens_q=torch.tensor([0.0, 3.0, 7.0])), TypeError, "cu_seqlens_q to be a 1-D int32"),
        (dict(cu_seqlens_q=torch.tensor([[0, 3, 7]], dtype=torch.int32)), TypeError, "cu_seqlens_q to be a 1-D int32"),
        (
            dict(cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32)),
            ValueError,
            "same number of sequences, got 2 and 1",
        ),
        (dict(max_seqlen_q=3), ValueError, r"max_seqlen_q=3 is smaller than the longest sequence \(4 tokens\)"),
        (
            dict(query=torch.randn(1, 7, 4, 8, dtype=f64)),
            ValueError,
            r"query of packed sequences to be \(total, H, E\): 3 dims",
        ),
        (dict(alignment="bottom-right"), ValueError, "Unknown alignment='bottom-right'"),
        (dict(window=(1, -1)), ValueError, r"window = \(left, right\) with ints >= 0 or None"),
        (dict(window=3), ValueError, r"window to be None or \(left, right\)"),
    ],
)
def test_bad_arguments_name_themselves(change, error, match):
    args = _bad(**change)
    with pytest.raises(error, match=match):
        subquad.varlen_attention(
            **{n: args.pop(n) for n in ("query", "key", "value", "cu_seqlens_q", "cu_seqlens_k")}, **args
        )


def test_window_masks_equal_mods_local_window():
    # The window is mods.local_window per sequence; its block states skip tiles outside the band.
    q, k, v, cu_q, cu_k = packed([64], dtype=torch.float32)
    TILES.reset()
    subquad.varlen_attention(q, k, v, cu_q, cu_k, window=(8, 0), chunk_size=(16, 16), backend="matmul")
    # Of 4 x 4 tiles, only the diagonal and the one below it hold keys within 8 of a row: 7 run, 9 skipped.
    assert (TILES.computed, TILES.skipped) == (7, 9)
    m = mods.local_window(2, 1, offset=2)
    keep = m(None, None, torch.arange(4).view(1, 1, 4, 1), torch.arange(6).view(1, 1, 1, 6))[0, 0]
    assert torch.equal(keep, visible(4, 6, False, "bottom_right", (2, 1)))


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_seqused_k_uses_the_first_keys_of_each_block(alignment):
    # Key blocks of 10 (a padded or cached layout), of which each sequence uses a prefix.
    q, k, v, cu_q, cu_k = packed([4, 7, 3, 1], [10, 10, 10, 10], grad=True)
    used = torch.tensor([10, 3, 0, 6], dtype=torch.int32)
    out, _lse = subquad.varlen_attention(
        q, k, v, cu_q, cu_k, seqused_k=used, is_causal=True, alignment=alignment, return_lse=True, chunk_size=(2, 4)
    )
    keep = torch.cat([torch.arange(s * 10, s * 10 + int(n)) for s, n in enumerate(used)])
    cu_used = torch.tensor([0, *used.cumsum(0).tolist()], dtype=torch.int32)
    ref, _ref_lse = reference(q, k[keep], v[keep], cu_q, cu_used, is_causal=True, alignment=alignment)
    assert_close_to_golden(out, ref.detach())
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for name, a, b in zip("qkv", got, want):
        assert_close_to_golden(a, b, name=f"d{name}")
    with pytest.raises(ValueError, match=r"seqused_k\[1\] = 11 is outside \[0, 10\]"):
        subquad.varlen_attention(q, k, v, cu_q, cu_k, seqused_k=torch.tensor([1, 11, 0, 0], dtype=torch.int32))


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_short_sequences_share_tiles(monkeypatch, alignment):
    # Sequences of a few tokens run as padded batches per bucket (issue 29: one call per sequence
    # made 1024 short sequences slower than a per-sequence SDPA loop), with the per-sequence
    # semantics: causal alignment, GQA, lse -inf where nothing is seen, different key lengths.
    ran = []
    run = _buckets.run_bucket
    monkeypatch.setattr(_engine, "run_bucket", lambda inp, seqs, *a: ran.extend(seqs) or run(inp, seqs, *a))
    g = torch.Generator().manual_seed(9)
    lengths_q = torch.randint(0, 20, (60,), generator=g).tolist() + [70]  # the last is too long to share
    lengths_k = [max(0, n + int(d)) for n, d in zip(lengths_q, torch.randint(-3, 4, (61,), generator=g))]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, Hq=4, Hk=2, E=16)
    check(q, k, v, cu_q, cu_k, grad=False, is_causal=True, alignment=alignment, enable_gqa=True)
    short = [
        s
        for s, (a, b) in enumerate(zip(lengths_q, lengths_k))
        if 0 < a and 4 * a * b <= _buckets.SHORT_SCORES and 4 * a <= _buckets.SHORT_ROWS
    ]
    assert sorted(ran) == short and 60 not in ran


def test_shared_tiles_stay_within_the_planned_memory(monkeypatch):
    batches = []
    real = _buckets._run
    monkeypatch.setattr(_buckets, "_run", lambda inp, seqs, *a: batches.append(len(seqs)) or real(inp, seqs, *a))
    q, k, v, cu_q, cu_k = packed([32] * 200, Hq=2, E=64, dtype=torch.float32)
    out = subquad.varlen_attention(q, k, v, cu_q, cu_k, memory_budget="4MiB")
    ref, _ = reference(q, k, v, cu_q, cu_k)
    assert_close_to_golden(out, ref.float(), floor=1e-5)
    # 200 sequences of 32 x 32, 2 heads: about 90 KiB each, so a 4 MiB budget takes several batches.
    assert len(batches) > 1 and max(batches) < 200 and sum(batches) == 200, batches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_sequences_of_one_tile_call_the_kernel_directly(monkeypatch, dtype, alignment):
    # A plain packed call on the fused kernel runs each sequence that fits one planned tile as one
    # kernel call (issue 29: planning a call per sequence made 8-head packed attention slower than
    # a per-sequence SDPA loop). It must compute what the per-sequence calls computed, bit for
    # bit, forward and backward; sequences of no key, a diagonal not top-left (bottom right with
    # Lq != Lk) and longer than a tile keep their own tiles.
    lengths_q = [0, 1, 5, 30, 64, 40, 17, 3, 200, 33]
    lengths_k = [3, 1, 5, 30, 64, 37, 17, 0, 200, 36]
    took = []
    real = _engine._one_kernel
    monkeypatch.setattr(_engine, "_one_kernel", lambda *a: _noted(took, a[2], real(*a)))
    kw = dict(is_causal=True, alignment=alignment, enable_gqa=True, backend="fused", chunk_size=(64, 64))

    def run():
        q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, Hq=8, Hk=2, E=32, dtype=dtype, grad=True)
        out, lse = subquad.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **kw)
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        return out, lse, grads

    torch.manual_seed(0)
    new = run()
    # Equal lengths within a tile (any alignment); with a top-left diagonal, every sequence with
    # keys within a tile. The forward shares the tiles of sequences 1 and 2 (8 heads of 1 and 5
    # rows), the backward has no shared tiles.
    direct = [1, 2, 3, 4, 6] if alignment == "bottom_right" else [1, 2, 3, 4, 5, 6, 9]
    assert took == direct[2:] + direct, took
    monkeypatch.setattr(_engine, "_fused_sequences", lambda *a: None)
    torch.manual_seed(0)
    old = run()
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])
    for a, b in zip(new[2], old[2]):
        assert torch.equal(a, b)
    if dtype == torch.float32:  # and right: float64 through the same path, against the reference
        monkeypatch.undo()
        q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, Hq=8, Hk=2, E=32, grad=True)
        check(q, k, v, cu_q, cu_k, **kw)


def _noted(into, s, causal):
    if causal is not None:
        into.append(s)
    return causal


@pytest.mark.parametrize("backend,chunk", [("fused", None), ("fused", (2, 4)), ("matmul", None)])
def test_gradients_write_every_row_once(monkeypatch, backend, chunk):
    # A packed backward starts from unfilled accumulators (zero-filling them cost 10% of the time
    # of 1024 short sequences): every row must be written, including keys past seqused_k, keys of
    # a sequence without queries and queries of one without keys. Unfilled memory is NaN here.
    real = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: real(*a, **kw).fill_(math.nan))
    q, k, v, cu_q, cu_k = packed([4, 0, 7, 3, 1], [10, 10, 10, 10, 10], grad=True)
    used = torch.tensor([10, 5, 3, 0, 6], dtype=torch.int32)
    out = subquad.varlen_attention(
        q, k, v, cu_q, cu_k, seqused_k=used, is_causal=True, backend=backend, chunk_size=chunk
    )
    keep = torch.cat([torch.arange(s * 10, s * 10 + int(n)) for s, n in enumerate(used)])
    cu_used = torch.tensor([0, *used.cumsum(0).tolist()], dtype=torch.int32)
    ref, _ = reference(q, k[keep], v[keep], cu_q, cu_used, is_causal=True)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for name, a, b in zip("qkv", got, want):
        assert_close_to_golden(a, b, name=f"d{name}")
