"""score_mod / mask_mod: the built-ins of subquad.mods and hand-written callbacks.

Every result is checked against ``naive_attention`` on the materialized ``Lq x Lk`` grid in float64
(conftest), gradients against autograd through that materialized reference, and block skipping by
the engine's tile counter.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import subquad
from conftest import assert_close_to_golden, naive_attention, to64
from subquad import mods
from subquad._callbacks import EMPTY, FULL, PARTIAL
from subquad._tiles import TILES

f64 = torch.float64

# Small tiles force many tiles, ragged edges (Lq, Lk not multiples) and every block state.
PATHS = [
    pytest.param("matmul", (7, 5), id="matmul-7x5"),
    pytest.param("matmul", (16, 16), id="matmul-16"),
    pytest.param("matmul", None, id="matmul-whole"),
    pytest.param("fused", (7, 5), id="fused-7x5"),
    pytest.param("fused", (16, 16), id="fused-16"),
    pytest.param("fused", None, id="fused-whole"),
]
MATMUL_PATHS = [p for p in PATHS if p.values[0] == "matmul"]


def _qkv(B=2, Hq=3, Lq=29, Lk=37, E=8, Hk=None, dtype=f64, lead=None):
    lead = (B,) if lead is None else lead
    Hk = Hq if Hk is None else Hk
    return (
        torch.randn(*lead, Hq, Lq, E, dtype=dtype),
        torch.randn(*lead, Hk, Lk, E, dtype=dtype),
        torch.randn(*lead, Hk, Lk, E, dtype=dtype),
    )


def _sorted_ids(B, L, n_docs, generator=None):
    """Per-batch sorted document ids with random boundaries."""
    rows = []
    for _ in range(B):
        cuts = torch.randperm(L - 1, generator=generator)[: n_docs - 1] + 1
        row = torch.zeros(L, dtype=torch.long)
        row[cuts] = 1
        rows.append(row.cumsum(0))
    return torch.stack(rows)


def _materialize(mask_mod, B, H, Lq, Lk):
    b = torch.arange(B).view(-1, 1, 1, 1)
    h = torch.arange(H).view(1, -1, 1, 1)
    qi = torch.arange(Lq).view(1, 1, -1, 1)
    ki = torch.arange(Lk).view(1, 1, 1, -1)
    return mask_mod(b, h, qi, ki).expand(B, H, Lq, Lk)


def _builtin_masks(B, Lq, Lk):
    ids = _sorted_ids(B, max(Lq, Lk), 4)
    return {
        "causal": mods.causal(),
        "causal_lower_right": mods.causal_lower_right(Lq, Lk),
        "sliding_window": mods.sliding_window(4),
        "sliding_window_causal": mods.sliding_window(6, causal=True),
        "document": mods.document(ids[:, :Lq]) if Lq == Lk else mods.document(ids[:, :Lq], ids[:, :Lk]),
        "document_shared": mods.document(ids[0, :Lq], ids[0, :Lk]),
        "key_padding": mods.key_padding(torch.tensor([Lk - 9, 3][:B])),
        "prefix_lm": mods.prefix_lm(torch.tensor([5, 11][:B])),
        "prefix_lm_int": mods.prefix_lm(7),
        "and": mods.and_masks(mods.causal(), mods.document(ids[:, :Lq], ids[:, :Lk])),
        "or": mods.or_masks(mods.sliding_window(2), mods.key_padding(3)),
    }


MASK_NAMES = list(_builtin_masks(2, 10, 10))


# ----------------------------------------------------------------------------- built-in masks
@pytest.mark.parametrize("backend,chunk", PATHS)
@pytest.mark.parametrize("name", MASK_NAMES)
def test_builtin_mask_float64(name, backend, chunk):
    B, H, Lq, Lk = 2, 3, 29, 37
    q, k, v = _qkv(B, H, Lq, Lk)
    mm = _builtin_masks(B, Lq, Lk)[name]
    out = subquad.attention(q, k, v, mask_mod=mm, backend=backend, chunk_size=chunk)
    assert_close_to_golden(out, naive_attention(q, k, v, mask_mod=mm), name=f"{name} output")


@pytest.mark.parametrize("name", MASK_NAMES)
def test_builtin_mask_float32_auto(name):
    B, H, L = 2, 4, 45
    q, k, v = _qkv(B, H, L, L, E=16, dtype=torch.float32)
    mm = _builtin_masks(B, L, L)[name]
    out = subquad.attention(q, k, v, mask_mod=mm)
    golden = naive_attention(*to64(q, k, v), mask_mod=mm)
    assert_close_to_golden(out, golden, naive_attention(q, k, v, mask_mod=mm), name=name)


def test_mask_drawings():
    """The masks the docstrings draw."""

    def draw(mm, Lq=6, Lk=6):
        m = _materialize(mm, 1, 1, Lq, Lk)[0, 0]
        return ["".join("x" if x else "." for x in row) for row in m.tolist()]

    assert draw(mods.causal(), 4, 6) == ["x.....", "xx....", "xxx...", "xxxx.."]
    assert draw(mods.causal_lower_right(3, 6), 3, 6) == ["xxxx..", "xxxxx.", "xxxxxx"]
    assert draw(mods.causal_lower_right(5, 3), 5, 3) == ["...", "...", "x..", "xx.", "xxx"]
    assert draw(mods.sliding_window(1)) == ["xx....", "xxx...", ".xxx..", "..xxx.", "...xxx", "....xx"]
    assert draw(mods.sliding_window(2, causal=True)) == ["x.....", "xx....", "xxx...", ".xxx..", "..xxx.", "...xxx"]
    assert draw(mods.document(torch.tensor([0, 0, 0, 1, 1, 2]))) == [
        "xxx...",
        "xxx...",
        "xxx...",
        "...xx.",
        "...xx.",
        ".....x",
    ]
    assert draw(mods.key_padding(4)) == ["xxxx.."] * 6
    assert draw(mods.prefix_lm(3)) == ["xxx...", "xxx...", "xxx...", "xxxx..", "xxxxx.", "xxxxxx"]
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    assert draw(mods.and_masks(mods.causal(), mods.document(ids))) == [
        "x.....",
        "xx....",
        "xxx...",
        "...x..",
        "...xx.",
        "...xxx",
    ]
    assert draw(mods.or_masks(mods.sliding_window(1), mods.key_padding(2))) == [
        "xx....",
        "xxx...",
        "xxxx..",
        "xxxxx.",
        "xx.xxx",
        "xx..xx",
    ]


def test_causal_builtins_match_sdpa_alignments():
    q, k, v = _qkv(1, 2, 11, 19)
    ref_tl = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close_to_golden(subquad.attention(q, k, v, mask_mod=mods.causal(), chunk_size=4), ref_tl, floor=1e-10)
    lower_right = torch.ones(11, 19, dtype=torch.bool).tril(19 - 11)
    ref_br = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=lower_right)
    out = subquad.attention(q, k, v, mask_mod=mods.causal_lower_right(11, 19), chunk_size=4)
    assert_close_to_golden(out, ref_br, floor=1e-10)


# ----------------------------------------------------------------------------- block states are exact
@pytest.mark.parametrize("name", MASK_NAMES)
def test_block_state_is_exact(name):
    """EMPTY and FULL must never be wrong; PARTIAL must be a real mix for the analytic masks."""
    B, H, Lq, Lk = 2, 1, 23, 31
    mm = _builtin_masks(B, Lq, Lk)[name]
    dense = _materialize(mm, B, H, Lq, Lk)
    analytic = name not in ("document", "document_shared", "and", "key_padding", "prefix_lm")
    gen = torch.Generator().manual_seed(1)
    rects = [(0, Lq, 0, Lk)]
    for _ in range(300):
        qs, qe = sorted(torch.randint(0, Lq + 1, (2,), generator=gen).tolist())
        ks, ke = sorted(torch.randint(0, Lk + 1, (2,), generator=gen).tolist())
        if qe > qs and ke > ks:
            rects.append((qs, qe, ks, ke))
    for qs, qe, ks, ke in rects:
        tile = dense[:, :, qs:qe, ks:ke]
        state = mm.block_state(qs, qe, ks, ke)
        where = f"{name} rows [{qs},{qe}) keys [{ks},{ke})"
        if state == EMPTY:
            assert not tile.any(), f"{where}: EMPTY but some entries attend"
        elif state == FULL:
            assert tile.all(), f"{where}: FULL but some entries are masked"
        else:
            assert state in (PARTIAL, None), f"{where}: unknown state {state!r}"
            if analytic:
                assert tile.any() and not tile.all(), f"{where}: PARTIAL but the tile is uniform"


def test_combinators_defer_to_exact_evaluation_for_hand_written_parts():
    hand = lambda b, h, q, kv: (q + kv) % 3 != 0  # noqa: E731 - no block_state
    assert mods.and_masks(mods.causal(), hand).block_state(0, 4, 8, 12) == EMPTY
    assert mods.and_masks(mods.causal(), hand).block_state(8, 12, 0, 4) is None
    assert mods.or_masks(mods.causal(), hand).block_state(8, 12, 0, 4) == FULL
    assert mods.or_masks(mods.causal(), hand).block_state(0, 4, 8, 12) is None
    q, k, v = _qkv(1, 2, 21, 21)
    mm = mods.and_masks(mods.sliding_window(5), hand)
    for backend in ("matmul", "fused"):
        out = subquad.attention(q, k, v, mask_mod=mm, backend=backend, chunk_size=(4, 6))
        assert_close_to_golden(out, naive_attention(q, k, v, mask_mod=mm), name=backend)


class _Dilated:
    """The docs' example of a hand-written mask that declares its block structure."""

    def __init__(self, step):
        self.step = step

    def __call__(self, b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx) % self.step == 0)

    def block_state(self, qs, qe, ks, ke):
        return mods.EMPTY if ks > qe - 1 else mods.PARTIAL


@pytest.mark.parametrize("backend", ["matmul", "fused"])
def test_hand_written_block_state(backend):
    L, c = 40, 8
    q, k, v = _qkv(1, 2, L, L)
    mm = _Dilated(3)
    TILES.reset()
    out = subquad.attention(q, k, v, mask_mod=mm, backend=backend, chunk_size=c)
    assert_close_to_golden(out, naive_attention(q, k, v, mask_mod=mm))
    n = L // c
    assert TILES.skipped == n * (n - 1) // 2


def test_builtins_match_flex_attention():
    """Same signatures as FlexAttention: the built-ins run there unchanged and agree."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    B, H, L = 2, 2, 128
    q, k, v = _qkv(B, H, L, L, E=16, dtype=torch.float32)
    ids = torch.cat([torch.zeros(B, 50, dtype=torch.long), torch.ones(B, L - 50, dtype=torch.long)], 1)
    masks = [
        mods.causal(),
        mods.sliding_window(20, causal=True),
        mods.and_masks(mods.causal(), mods.document(ids)),
        mods.or_masks(mods.prefix_lm(torch.tensor([10, 30])), mods.key_padding(torch.tensor([3, 1]))),
    ]
    for mm in masks:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                bm = flex.create_block_mask(mm, B, H, L, L, device="cpu")
                ref = flex.flex_attention(q, k, v, score_mod=mods.alibi(H), block_mask=bm)
        except (NotImplementedError, RuntimeError) as e:  # a build whose flex cannot run on CPU eagerly
            pytest.skip(f"flex_attention unavailable on CPU here: {e}")
        out = subquad.attention(q, k, v, score_mod=mods.alibi(H), mask_mod=mm, chunk_size=32)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5, msg=lambda m: f"{mm!r}: {m}")  # noqa: B023 - called at once


# ----------------------------------------------------------------------------- block skipping
def _tiles_with_any(dense, Lq, Lk, qc, kc):
    n = 0
    for qs in range(0, Lq, qc):
        for ks in range(0, Lk, kc):
            n += bool(dense[..., qs : qs + qc, ks : ks + kc].any())
    return n


@pytest.mark.parametrize("name", MASK_NAMES + ["hand_written_document"])
def test_skipping_counts_tiles(name):
    """Exactly the tiles where the mask attends somewhere are computed (matmul: no coalescing)."""
    B, H, L, c = 2, 2, 64, 8
    ids = _sorted_ids(B, L, 5)
    if name == "hand_written_document":
        mm = lambda b, h, q_idx, kv_idx: ids[b, q_idx] == ids[b, kv_idx]  # noqa: E731
    else:
        mm = _builtin_masks(B, L, L)[name]
    q, k, v = _qkv(B, H, L, L)
    TILES.reset()
    subquad.attention(q, k, v, mask_mod=mm, backend="matmul", chunk_size=c)
    want = _tiles_with_any(_materialize(mm, B, H, L, L), L, L, c, c)
    n_tiles = (L // c) ** 2
    assert (TILES.computed, TILES.skipped) == (want, n_tiles - want), name


def test_causal_computes_about_half_and_window_its_fraction():
    L, c = 256, 16
    q, k, v = _qkv(1, 1, L, L, E=4)
    n = (L // c) ** 2
    TILES.reset()
    subquad.attention(q, k, v, mask_mod=mods.causal(), backend="matmul", chunk_size=c)
    assert TILES.computed == n // 2 + L // c // 2  # the lower triangle of tiles plus the diagonal
    TILES.reset()
    subquad.attention(q, k, v, mask_mod=mods.sliding_window(16), backend="matmul", chunk_size=c)
    assert TILES.computed <= 3 * (L // c)  # a band of three tiles per row
    TILES.reset()
    subquad.attention(q, k, v, mask_mod=mods.causal(), backend="fused", chunk_size=c)
    assert TILES.skipped == n // 2 - L // c // 2


class _CountingMask:
    """Delegates to a built-in and counts how often the mask itself is evaluated."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, b, h, q_idx, kv_idx):
        self.calls += 1
        return self.inner(b, h, q_idx, kv_idx)

    def block_state(self, *args):
        return self.inner.block_state(*args)


def test_full_tiles_do_not_evaluate_the_mask():
    L, c = 64, 8
    q, k, v = _qkv(1, 1, L, L, E=4)
    mm = _CountingMask(mods.sliding_window(12))
    subquad.attention(q, k, v, mask_mod=mm, backend="matmul", chunk_size=c)
    partial = sum(
        mods.sliding_window(12).block_state(qs, qs + c, ks, ks + c) == PARTIAL
        for qs, ks in itertools.product(range(0, L, c), repeat=2)
    )
    assert mm.calls == partial


# ----------------------------------------------------------------------------- score_mods
@pytest.mark.parametrize("backend,chunk", PATHS)
@pytest.mark.parametrize("slopes", ["standard", "random"])
def test_alibi_float64(slopes, backend, chunk):
    B, H, Lq, Lk = 2, 3, 29, 37
    q, k, v = _qkv(B, H, Lq, Lk)
    s = mods.alibi_slopes(H, dtype=f64) if slopes == "standard" else torch.rand(H, dtype=f64)
    sm = mods.alibi(s)
    for mm in (None, mods.causal()):
        out = subquad.attention(q, k, v, score_mod=sm, mask_mod=mm, backend=backend, chunk_size=chunk)
        assert_close_to_golden(out, naive_attention(q, k, v, score_mod=sm, mask_mod=mm))


@pytest.mark.parametrize("backend,chunk", PATHS)
def test_alibi_float32_causal_matches_materialized_sdpa(backend, chunk):
    H, L = 4, 50
    q, k, v = _qkv(1, H, L, L, E=16, dtype=torch.float32)
    sm = mods.alibi(H)
    i = torch.arange(L)
    bias = -(i[:, None] - i[None, :]).abs() * mods.alibi_slopes(H).view(-1, 1, 1)
    bias = bias.masked_fill(i[None, :] > i[:, None], float("-inf"))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    golden = naive_attention(*to64(q, k, v), score_mod=sm, is_causal=True)
    out = subquad.attention(q, k, v, score_mod=sm, is_causal=True, backend=backend, chunk_size=chunk)
    assert_close_to_golden(out, golden, ref)


@pytest.mark.parametrize("backend,chunk", MATMUL_PATHS)
def test_hand_written_score_mods(backend, chunk):
    B, H, Lq, Lk = 2, 3, 29, 37
    q, k, v = _qkv(B, H, Lq, Lk)
    table = torch.randn(H, Lq + Lk - 1, dtype=f64)
    off = Lk - 1
    rel = lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx - kv_idx + off]  # noqa: E731
    softcap = lambda score, b, h, q_idx, kv_idx: 5.0 * torch.tanh(score / 5.0)  # noqa: E731
    per_batch = torch.randn(B, dtype=f64)
    batch_temp = lambda score, b, h, q_idx, kv_idx: score * per_batch[b].exp()  # noqa: E731
    for sm in (rel, softcap, batch_temp):
        out = subquad.attention(q, k, v, score_mod=sm, backend=backend, chunk_size=chunk)
        assert_close_to_golden(out, naive_attention(q, k, v, score_mod=sm))


def test_score_mod_masking_with_minus_inf():
    """A score_mod may mask by returning -inf (FlexAttention allows it); fully masked rows give 0."""
    q, k, v = _qkv(1, 2, 17, 17)
    sm = lambda s, b, h, q_idx, kv_idx: torch.where((q_idx % 5 == 0) | (kv_idx <= q_idx), s, float("-inf"))  # noqa: E731
    out = subquad.attention(q, k, v, score_mod=sm, backend="matmul", chunk_size=(4, 3))
    assert_close_to_golden(out, naive_attention(q, k, v, score_mod=sm))


# ----------------------------------------------------------------------------- combinations
@pytest.mark.parametrize("backend,chunk", PATHS)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_with_attn_mask(kind, backend, chunk):
    B, H, Lq, Lk = 2, 3, 29, 37
    q, k, v = _qkv(B, H, Lq, Lk)
    am = torch.rand(B, 1, Lq, Lk) > 0.3 if kind == "bool" else torch.randn(1, H, Lq, Lk, dtype=f64)
    kw = dict(attn_mask=am, mask_mod=mods.sliding_window(8), score_mod=mods.alibi(mods.alibi_slopes(H, f64)))
    out = subquad.attention(q, k, v, backend=backend, chunk_size=chunk, **kw)
    assert_close_to_golden(out, naive_attention(q, k, v, **kw))


@pytest.mark.parametrize("backend,chunk", PATHS)
def test_with_is_causal(backend, chunk):
    B, H, L = 2, 3, 33
    q, k, v = _qkv(B, H, L, L)
    ids = _sorted_ids(B, L, 3)
    kw = dict(is_causal=True, mask_mod=mods.document(ids), score_mod=mods.alibi(mods.alibi_slopes(H, f64)))
    out = subquad.attention(q, k, v, backend=backend, chunk_size=chunk, **kw)
    assert_close_to_golden(out, naive_attention(q, k, v, **kw))


@pytest.mark.parametrize("backend,chunk", PATHS)
def test_gqa_heads_are_query_heads(backend, chunk):
    Hq, Hk, L = 6, 2, 31
    q, k, v = _qkv(2, Hq, L, L, Hk=Hk)
    slopes = mods.alibi_slopes(Hq, f64)
    head_mask = lambda b, h, q_idx, kv_idx: (h % 2 == 0) | (kv_idx <= q_idx)  # noqa: E731
    kw = dict(enable_gqa=True, score_mod=mods.alibi(slopes), mask_mod=mods.and_masks(mods.sliding_window(9), head_mask))
    out = subquad.attention(q, k, v, backend=backend, chunk_size=chunk, **kw)
    assert_close_to_golden(out, naive_attention(q, k, v, **kw))


@pytest.mark.parametrize("backend,chunk", PATHS)
def test_scale_and_leading_batch_dims(backend, chunk):
    lead, H, L = (2, 3), 2, 27
    q, k, v = _qkv(lead=lead, Hq=H, Lq=L, Lk=L)
    ids = _sorted_ids(6, L, 3)  # b indexes the flattened batch dims: 2 x 3 = 6
    kw = dict(scale=0.3, mask_mod=mods.document(ids), score_mod=mods.alibi(mods.alibi_slopes(H, f64)))
    out = subquad.attention(q, k, v, backend=backend, chunk_size=chunk, **kw)
    assert_close_to_golden(out, naive_attention(q, k, v, **kw))


def test_fully_masked_rows_are_zero_with_minus_inf_lse():
    q, k, v = _qkv(2, 2, 12, 10)
    for mm in (mods.key_padding(torch.tensor([0, 4])), mods.causal_lower_right(12, 10)):
        for backend in ("matmul", "fused"):
            out, lse = subquad.attention(q, k, v, mask_mod=mm, backend=backend, chunk_size=(5, 3), return_lse=True)
            ref_out, ref_lse = naive_attention(q, k, v, mask_mod=mm, return_lse=True)
            assert_close_to_golden(out, ref_out, name=f"{mm!r} {backend} out")
            assert_close_to_golden(lse, ref_lse, name=f"{mm!r} {backend} lse")


# ----------------------------------------------------------------------------- dropout
def test_dropout_with_callbacks_is_reproducible_and_respects_the_mask():
    B, H, L = 1, 2, 40
    q, k, v = _qkv(B, H, L, L, dtype=torch.float32)
    v[..., 30:, :] = 1e4  # keys outside the window must never leak, whichever weights survive
    kw = dict(dropout_p=0.3, mask_mod=mods.sliding_window(5, causal=True), score_mod=mods.alibi(H), chunk_size=(7, 5))
    torch.manual_seed(3)
    a = subquad.attention(q, k, v, **kw)
    torch.manual_seed(3)
    b = subquad.attention(q, k, v, **kw)
    torch.manual_seed(4)
    c = subquad.attention(q, k, v, **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert a[..., :30, :].abs().max() < 100


def test_dropout_with_callbacks_is_unbiased():
    B, H, L, n = 1, 2, 24, 300
    q, k, _ = _qkv(B, H, L, L, dtype=torch.float32)
    v = torch.ones(B, H, L, 1)
    kw = dict(mask_mod=mods.causal(), score_mod=mods.alibi(H), chunk_size=(5, 7))
    mean = sum(subquad.attention(q, k, v, dropout_p=0.5, **kw) for _ in range(n)) / n
    # Each output is sum_j p_j z_j with E[z] = 1: the mean tends to 1 (std of the mean <= 1/sqrt(n)).
    assert (mean - 1).abs().mean() < 0.05


# ----------------------------------------------------------------------------- gradients
def _grads(out, inputs):
    # torch.randn, not randn_like: torch 2.9's randn_like takes no generator
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype).to(out.device)
    return torch.autograd.grad(out, inputs, cot)


@pytest.mark.parametrize("chunk", [(7, 5), (16, 16), None], ids=["7x5", "16", "whole"])
def test_learnable_alibi_slopes_gradient(chunk):
    B, H, Lq, Lk = 2, 4, 23, 29
    q, k, v = (t.requires_grad_() for t in _qkv(B, H, Lq, Lk, Hk=2))
    slopes = mods.alibi_slopes(H, f64).requires_grad_()
    kw = dict(enable_gqa=True, score_mod=mods.alibi(slopes), mask_mod=mods.causal_lower_right(Lq, Lk))
    plan = subquad.explain(q, k, v, chunk_size=chunk, **kw)
    # The fused forward takes the bias; the matmul backward pulls dS back into the slopes.
    assert (plan.backend, plan.backward_backend) == ("fused", "matmul")
    got = _grads(subquad.attention(q, k, v, chunk_size=chunk, **kw), (q, k, v, slopes))
    want = _grads(naive_attention(q, k, v, **kw), (q, k, v, slopes))
    for g, w, name in zip(got, want, ("dq", "dk", "dv", "dslopes")):
        assert_close_to_golden(g, w, name=name, floor=1e-11)


@pytest.mark.parametrize("chunk", [(7, 5), None], ids=["7x5", "whole"])
def test_relative_bias_table_gradient(chunk):
    B, H, Lq, Lk = 2, 3, 21, 26
    q, k, v = (t.requires_grad_() for t in _qkv(B, H, Lq, Lk))
    table = torch.randn(H, Lq + Lk - 1, dtype=f64, requires_grad=True)
    off = Lk - 1

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + off]

    ids = _sorted_ids(B, Lk, 3)
    kw = dict(score_mod=rel_bias, mask_mod=mods.document(ids[:, :Lq], ids))
    got = _grads(subquad.attention(q, k, v, chunk_size=chunk, **kw), (q, k, v, table))
    want = _grads(naive_attention(q, k, v, **kw), (q, k, v, table))
    for g, w, name in zip(got, want, ("dq", "dk", "dv", "dtable")):
        assert_close_to_golden(g, w, name=name, floor=1e-11)


def test_module_parameter_gradient():
    """A score_mod that is an nn.Module: its parameters receive gradients."""

    class Temperature(torch.nn.Module):
        def __init__(self, H):
            super().__init__()
            self.log_t = torch.nn.Parameter(torch.zeros(H, dtype=f64))

        def forward(self, score, b, h, q_idx, kv_idx):
            return score * self.log_t[h].exp()

    H = 3
    mod = Temperature(H)
    with torch.no_grad():
        mod.log_t.copy_(torch.randn(H))
    q, k, v = (t.requires_grad_() for t in _qkv(1, H, 19, 19))
    got = _grads(subquad.attention(q, k, v, score_mod=mod, mask_mod=mods.causal(), chunk_size=6), (q, mod.log_t))
    want = _grads(naive_attention(q, k, v, score_mod=mod, mask_mod=mods.causal()), (q, mod.log_t))
    assert_close_to_golden(got[0], want[0], name="dq", floor=1e-11)
    assert_close_to_golden(got[1], want[1], name="dlog_t", floor=1e-11)


def test_gradient_when_only_captured_tensors_require_grad():
    H = 2
    q, k, v = _qkv(1, H, 19, 19)
    slopes = mods.alibi_slopes(H, f64).requires_grad_()
    got = _grads(subquad.attention(q, k, v, score_mod=mods.alibi(slopes), is_causal=True, chunk_size=6), (slopes,))
    want = _grads(naive_attention(q, k, v, score_mod=mods.alibi(slopes), is_causal=True), (slopes,))
    assert_close_to_golden(got[0], want[0], name="dslopes", floor=1e-11)


@pytest.mark.parametrize("backend,chunk", [("fused", (7, 5)), ("fused", None), ("matmul", (7, 5))])
def test_qkv_gradients_with_fixed_alibi_and_masks(backend, chunk):
    B, H, L = 2, 2, 25
    q, k, v = (t.requires_grad_() for t in _qkv(B, H, L, L))
    kw = dict(score_mod=mods.alibi(mods.alibi_slopes(H, f64)), mask_mod=mods.prefix_lm(torch.tensor([4, 9])))
    got = _grads(subquad.attention(q, k, v, backend=backend, chunk_size=chunk, **kw), (q, k, v))
    want = _grads(naive_attention(q, k, v, **kw), (q, k, v))
    for g, w, name in zip(got, want, ("dq", "dk", "dv")):
        assert_close_to_golden(g, w, name=name, floor=1e-11)


def test_learnable_slopes_float32_gradient():
    H, L = 2, 40
    q, k, v = _qkv(1, H, L, L, E=16, dtype=torch.float32)
    q.requires_grad_()
    slopes = torch.tensor([0.5, 0.1], requires_grad=True)
    out = subquad.attention(q, k, v, score_mod=mods.alibi(slopes), is_causal=True, chunk_size=16)
    (g,) = _grads(out, (slopes,))
    s64 = slopes.detach().double().requires_grad_()
    (w,) = _grads(naive_attention(*to64(q, k, v), score_mod=mods.alibi(s64), is_causal=True), (s64,))
    s32 = slopes.detach().clone().requires_grad_()
    (r,) = _grads(naive_attention(q, k, v, score_mod=mods.alibi(s32), is_causal=True), (s32,))
    assert_close_to_golden(g, w, r, name="dslopes")


# ----------------------------------------------------------------------------- errors
def test_score_mod_wrong_shape():
    q, k, v = _qkv(1, 2, 9, 12)
    bad = lambda s, b, h, q_idx, kv_idx: s.transpose(-1, -2)  # noqa: E731
    with pytest.raises(ValueError, match=r"score_mod returned shape .* expected the score tile's shape"):
        subquad.attention(q, k, v, score_mod=bad, chunk_size=(4, 5))


@pytest.mark.parametrize("result", ["int", "bool", "list"])
def test_score_mod_wrong_dtype(result):
    q, k, v = _qkv(1, 2, 9, 12)
    make = {
        "int": lambda s: s.long(),
        "bool": lambda s: s > 0,
        "list": lambda s: s.tolist(),
    }[result]
    with pytest.raises(TypeError, match="score_mod must return"):
        subquad.attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: make(s), chunk_size=4)


@pytest.mark.parametrize("backend", ["matmul", "fused"])
@pytest.mark.parametrize("result", ["int", "float", "none"])
def test_mask_mod_non_bool(result, backend):
    q, k, v = _qkv(1, 2, 9, 12)
    make = {
        "int": lambda q_idx, kv_idx: q_idx - kv_idx,
        "float": lambda q_idx, kv_idx: (q_idx >= kv_idx).float(),
        "none": lambda q_idx, kv_idx: None,
    }[result]
    with pytest.raises(TypeError, match=r"mask_mod must return a bool tensor"):
        subquad.attention(
            q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: make(q_idx, kv_idx), backend=backend, chunk_size=4
        )


def test_mask_mod_wrong_shape():
    q, k, v = _qkv(1, 2, 9, 12)
    bad = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx).transpose(-1, -2)  # noqa: E731
    with pytest.raises(ValueError, match=r"mask_mod returned shape .* does not broadcast"):
        subquad.attention(q, k, v, mask_mod=bad, chunk_size=(4, 5))


def test_general_score_mod_cannot_be_forced_fused():
    q, k, v = _qkv(1, 2, 9, 12)
    with pytest.raises(
        NotImplementedError, match=r"score_mod is not score \+ bias \(the score goes through aten.mul.Tensor\)"
    ):
        subquad.attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s * 2, backend="fused")


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: mods.sliding_window(-1), "window to be an int >= 0"),
        (lambda: mods.sliding_window(2.5), "window to be an int >= 0"),
        (lambda: mods.causal_lower_right(-1, 4), "q_len to be an int >= 0"),
        (lambda: mods.document(torch.rand(5)), "integer tensor of shape"),
        (lambda: mods.document(torch.zeros(2, 5, dtype=torch.long), torch.zeros(3, 5, dtype=torch.long)), "batch size"),
        (lambda: mods.key_padding(torch.tensor([3, -1])), "lengths >= 0"),
        (lambda: mods.key_padding(torch.ones(2, 2, dtype=torch.long)), "integer tensor of shape"),
        (lambda: mods.prefix_lm(-2), "prefix_len >= 0"),
        (lambda: mods.and_masks(), "at least one mask_mod"),
        (lambda: mods.or_masks(mods.causal(), 3), "not a mask_mod callable"),
        (lambda: mods.alibi(torch.ones(2, 2)), "1-D float tensor"),
        (lambda: mods.alibi_slopes(0), "positive int"),
    ],
)
def test_constructor_errors(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ----------------------------------------------------------------------------- alibi slopes
def test_alibi_slopes_standard_values():
    assert torch.equal(mods.alibi_slopes(8, f64), torch.tensor([2.0**-i for i in range(1, 9)], dtype=f64))
    assert torch.equal(mods.alibi_slopes(4, f64), torch.tensor([2.0 ** (-2 * i) for i in range(1, 5)], dtype=f64))
    # Non-powers of two: the 8 slopes of 8 heads, then the odd-exponent slopes of 16 heads.
    s12 = mods.alibi_slopes(12, f64)
    want = [2.0**-i for i in range(1, 9)] + [2.0 ** -(i - 0.5) for i in range(1, 5)]
    assert torch.allclose(s12, torch.tensor(want, dtype=f64), rtol=1e-15, atol=0)
    assert mods.alibi_slopes(1).tolist() == [2.0**-8]
    assert mods.alibi(6).slopes.shape == (6,)


def test_alibi_additive_bias_is_its_score_mod():
    """The fused path uses additive_bias; the matmul path calls the mod: they must agree."""
    H = 5
    sm = mods.alibi(torch.rand(H, dtype=f64))
    b = torch.arange(2).view(-1, 1, 1, 1)
    h = torch.arange(H).view(1, -1, 1, 1)
    qi = torch.arange(40, 47).view(1, 1, -1, 1)
    ki = torch.arange(3, 14).view(1, 1, 1, -1)
    score = torch.randn(2, H, 7, 11, dtype=f64)
    bias = sm.additive_bias(b, h, qi, ki)
    torch.testing.assert_close(sm(score, b, h, qi, ki), score + bias, rtol=1e-14, atol=1e-14)
    buf = torch.empty(1, H, 7, 11, dtype=f64)
    assert sm.additive_bias(b, h, qi, ki, out=buf) is buf and torch.equal(buf, bias.expand_as(buf))


def test_public_names():
    for name in mods.__all__:
        obj = getattr(mods, name)
        if callable(obj):
            assert obj.__doc__, f"mods.{name} has no docstring"


GLOBAL_TABLE = torch.zeros(2, 41, dtype=torch.float64)


def _global_rel_bias(score, b, h, q_idx, kv_idx):
    return score + GLOBAL_TABLE[h, q_idx - kv_idx + 20]


def test_gradient_reaches_a_module_level_tensor():
    global GLOBAL_TABLE
    GLOBAL_TABLE = torch.randn(2, 41, dtype=f64).requires_grad_()
    q, k, v = _qkv(1, 2, 17, 21)
    got = torch.autograd.grad(
        subquad.attention(q, k, v, score_mod=_global_rel_bias, chunk_size=(5, 6)).sum(), GLOBAL_TABLE
    )[0]
    want = torch.autograd.grad(naive_attention(q, k, v, score_mod=_global_rel_bias).sum(), GLOBAL_TABLE)[0]
    assert_close_to_golden(got, want, name="dtable", floor=1e-11)


@pytest.mark.parametrize("backend", ["auto", "matmul"])
def test_score_mod_that_promotes_the_dtype_is_cast_back(backend):
    # A float64 table captured with float32 inputs promotes the scores; FlexAttention casts back.
    q, k, v = _qkv(1, 2, 9, 11, dtype=torch.float32)
    table = torch.randn(9, 11, dtype=f64)
    mod = lambda s, b, h, qi, ki: s + table[qi, ki]  # noqa: E731
    out = subquad.attention(q, k, v, score_mod=mod, backend=backend)
    golden = naive_attention(*to64(q, k, v), score_mod=mod)
    assert out.dtype == torch.float32
    assert_close_to_golden(
        out, golden, naive_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + table.float()[qi, ki])
    )


def test_score_mod_returning_integers_raises():
    q, k, v = _qkv(1, 2, 9, 9, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"score_mod must return floating-point scores .* got torch.int64"):
        subquad.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s.long(), backend="matmul")


# ----------------------------------------------------------------------------- captured tensors, every idiom
class _Holder:
    def __init__(self, t):
        self.t = t

    def method(self, score, b, h, q_idx, kv_idx):
        return score + self.t[q_idx, kv_idx]


class _BiasModule(torch.nn.Module):
    def __init__(self, S):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(S, S, dtype=f64))
        self.unused = torch.nn.Linear(3, 3).double()

    def forward(self, score, b, h, q_idx, kv_idx):
        return score + self.bias[q_idx, kv_idx]


def _idioms(S):
    """(name, score_mod, leaf tensors whose gradients are checked) for every way of capturing."""
    import functools

    t = torch.randn(S, S, dtype=f64, requires_grad=True)
    param = torch.randn(S, S, dtype=f64, requires_grad=True)
    view = param[:, :]  # a view of a tensor that is captured as well
    scale = torch.tensor(0.7, dtype=f64, requires_grad=True)
    derived = param * scale  # a tensor derived from a captured parameter
    module = _BiasModule(S)
    nested = {"tables": [torch.randn(S, S, dtype=f64, requires_grad=True)]}
    return [
        ("closure", lambda s, b, h, qi, ki: s + t[qi, ki], [t]),
        ("partial", functools.partial(lambda s, b, h, qi, ki, t: s + t[qi, ki], t=t), [t]),
        ("bound-method", _Holder(t).method, [t]),
        ("module", module, [module.bias]),
        ("nested-container", lambda s, b, h, qi, ki: s + nested["tables"][0][qi, ki], nested["tables"]),
        ("param-and-its-view", lambda s, b, h, qi, ki: s + param[qi, ki] + 0.5 * view[qi, ki], [param]),
        (
            "module-and-derived",
            lambda s, b, h, qi, ki: module(s, b, h, qi, ki) + derived[qi, ki],
            [module.bias, param, scale],
        ),
        ("derived-and-source", lambda s, b, h, qi, ki: s + derived[qi, ki] * param[qi, ki], [param, scale]),
    ]


@pytest.mark.parametrize("name", [i[0] for i in _idioms(4)])
@pytest.mark.parametrize(
    "backend,chunk", [("auto", (7, 5)), ("matmul", None), ("auto", None)], ids=["7x5", "whole-matmul", "planned"]
)
def test_captured_tensor_gradients_whatever_the_idiom(name, backend, chunk):
    S = 40
    _, score_mod, leaves = next(i for i in _idioms(S) if i[0] == name)
    q, k, v = (torch.randn(1, 2, S, 8, dtype=f64, requires_grad=True) for _ in range(3))
    inputs = (q, k, v, *leaves)

    def grads(out):  # the graph of a derived tensor outside the call is shared by every backward here
        return torch.autograd.grad(out, inputs, torch.ones_like(out) * 0.3, retain_graph=True)

    got = grads(subquad.attention(q, k, v, score_mod=score_mod, backend=backend, chunk_size=chunk))
    want = grads(naive_attention(q, k, v, score_mod=score_mod))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is not None, f"gradient {i} dropped"
        assert_close_to_golden(g, w, name=f"grad {i}", floor=1e-11)


def test_backward_through_derived_tensors_accumulates_like_autograd():
    S = 24
    module = _BiasModule(S)
    derived = module.bias * 2
    q, k, v = (torch.randn(1, 2, S, 8, dtype=f64) for _ in range(3))
    mod = lambda s, b, h, qi, ki: module(s, b, h, qi, ki) + derived[qi, ki]  # noqa: E731
    subquad.attention(q, k, v, score_mod=mod, chunk_size=(5, 7)).sum().backward(retain_graph=True)
    got = module.bias.grad.clone()
    module.bias.grad = None
    naive_attention(q, k, v, score_mod=mod).sum().backward()
    assert_close_to_golden(got, module.bias.grad, floor=1e-11)
    assert module.unused.weight.grad is None  # only what the callback reads gets a gradient


def test_only_tensors_the_callback_reads_get_gradients():
    S = 16
    module = _BiasModule(S)
    q = torch.randn(1, 2, S, 8, dtype=f64)
    subquad.attention(q, q, q, score_mod=module.forward, chunk_size=5).sum().backward()
    assert module.bias.grad is not None
    assert module.unused.weight.grad is None and module.unused.bias.grad is None


def test_a_tensor_read_only_on_later_tiles_raises_instead_of_dropping_its_gradient():
    S = 32
    late = torch.randn(S, S, dtype=f64, requires_grad=True)

    def branchy(score, b, h, q_idx, kv_idx):
        if int(q_idx.min()) >= 8 and int(q_idx.max()) < S - 1:  # data-dependent control flow
            return score + late[q_idx, kv_idx]
        return score

    q = torch.randn(1, 1, S, 8, dtype=f64, requires_grad=True)
    out = subquad.attention(q, q, q, score_mod=branchy, chunk_size=8)
    from subquad._callbacks import UncapturedGradientError

    with pytest.raises(UncapturedGradientError, match="probe of the callback"):
        out.sum().backward()


# ----------------------------------------------------------------------------- user-written callbacks, by structure
SLOPES4 = mods.alibi_slopes(4, f64)


def _user_alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPES4[h] * (q_idx - kv_idx)


@pytest.mark.parametrize(
    "name,score_mod,kind",
    [
        ("alibi", _user_alibi, "score + bias"),
        ("table", lambda s, b, h, qi, ki: s + 0.01 * (qi - ki).abs().to(s.dtype), "score + bias"),
        ("where-mask", lambda s, b, h, qi, ki: torch.where(ki <= qi, s, float("-inf")), "where(cond, score, -inf)"),
        (
            "masked-where-bias",
            lambda s, b, h, qi, ki: torch.where(ki <= qi, s - 0.1 * (qi - ki), float("-inf")),
            "score + bias",
        ),
        ("clamp", lambda s, b, h, qi, ki: s.clamp(max=0.5), "not additive: the score goes through aten.clamp"),
        (
            "data-dependent",
            lambda s, b, h, qi, ki: s + 1 if bool(s.max() > 0) else s,
            "not additive: it could not be traced",
        ),
        ("identity", lambda s, b, h, qi, ki: s, "returns the score unchanged"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_user_score_mods_run_as_what_their_structure_is(name, score_mod, kind):
    q, k, v = _qkv(1, 4, 40, 37)
    plan = subquad.explain(q, k, v, score_mod=score_mod, chunk_size=(8, 8))
    assert any(kind in n for n in plan.notes), plan.notes
    fused = "not additive" not in kind
    assert plan.backend == ("fused" if fused else "matmul")
    TILES.reset()
    out = subquad.attention(q, k, v, score_mod=score_mod, chunk_size=(8, 8))
    assert_close_to_golden(out, naive_attention(q, k, v, score_mod=score_mod))
    if "where" in name:  # the mask part skips tiles above the diagonal
        assert TILES.skipped == sum(range(5))


def test_user_additive_score_mod_with_learnable_tensors_trains_exactly():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 4, 33, 33))
    slopes = mods.alibi_slopes(4, f64).requires_grad_()
    mod = lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki).abs()  # noqa: E731
    plan = subquad.explain(q, k, v, score_mod=mod, is_causal=True, chunk_size=(8, 8))
    assert (plan.backend, plan.backward_backend) == ("fused", "matmul")
    got = _grads(subquad.attention(q, k, v, score_mod=mod, is_causal=True, chunk_size=(8, 8)), (q, k, v, slopes))
    want = _grads(naive_attention(q, k, v, score_mod=mod, is_causal=True), (q, k, v, slopes))
    for g, w, what in zip(got, want, ("dq", "dk", "dv", "dslopes")):
        assert_close_to_golden(g, w, name=what, floor=1e-11)


def test_structure_is_traced_once_per_callback(monkeypatch):
    from subquad import _traced

    calls = []
    real = _traced._trace_structure
    monkeypatch.setattr(_traced, "_trace_structure", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(_traced, "_STRUCTURES", type(_traced._STRUCTURES)())
    q, k, v = _qkv(1, 4, 16, 16)
    for scale in (0.1, 0.1, 0.2):  # a new lambda each time, as in a model's forward
        table = torch.randn(16, 16, dtype=f64)  # a new tensor of the same kind each time
        subquad.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + scale * table[qi, ki])  # noqa: B023 - a fresh closure each time is the point
    # The same code with a new tensor of the same dtype and rank is the same structure; the
    # float it captured is part of the key (it could steer Python control flow).
    assert len(calls) == 2


@pytest.mark.parametrize("backend", ["matmul", "fused"])
def test_user_mask_mods_get_square_tiles_that_skip(backend):
    q, k, v = _qkv(1, 2, 2048, 2048, dtype=torch.float32)
    mask = lambda b, h, qi, ki: (ki <= qi) & (qi - ki <= 40)  # noqa: E731
    plan = subquad.explain(q, k, v, mask_mod=mask, backend=backend)
    qc, kc = plan.chunk_size
    assert qc == kc < 2048, plan  # whole key rows would compute every tile of a row
    TILES.reset()
    out = subquad.attention(q, k, v, mask_mod=mask, backend=backend)
    n = 2048 // qc
    assert (TILES.computed, TILES.skipped) == (2 * n - 1, n * n - (2 * n - 1))
    assert_close_to_golden(out, naive_attention(*to64(q, k, v), mask_mod=mask), naive_attention(q, k, v, mask_mod=mask))


@pytest.mark.parametrize(
    "mask,builtin",
    [
        (lambda b, h, qi, ki: ki <= qi, mods.causal()),
        (lambda b, h, qi, ki: qi >= ki + 0, mods.causal()),
        (lambda b, h, qi, ki: (ki <= qi) & (qi - ki <= 9), mods.sliding_window(9, causal=True)),
        (lambda b, h, qi, ki: (qi - ki).abs() <= 9, mods.sliding_window(9)),
        (lambda b, h, qi, ki: (ki < 5) | (ki <= qi), mods.prefix_lm(5)),
        (lambda b, h, qi, ki: ki <= qi + 7, mods.causal_lower_right(30, 37)),
    ],
    ids=["causal", "causal-ge", "causal-window", "abs-window", "prefix", "offset"],
)
def test_user_mask_mods_of_positions_get_the_builtins_block_states(mask, builtin):
    q, k, v = _qkv(1, 2, 30, 37)
    calls = []
    counted = lambda b, h, qi, ki: calls.append(1) or mask(b, h, qi, ki)  # noqa: E731
    for fn in (counted, builtin):
        TILES.reset()
        out = subquad.attention(q, k, v, mask_mod=fn, chunk_size=(4, 4))
        assert_close_to_golden(out, naive_attention(q, k, v, mask_mod=builtin))
        if fn is counted:
            user_tiles, evaluated = (TILES.computed, TILES.skipped), len(calls)
        else:
            assert user_tiles == (TILES.computed, TILES.skipped)
    # Evaluated only on tiles the formula leaves partial (and once when traced): never on
    # tiles it knows are empty or full.
    assert evaluated < user_tiles[0]
    if "causal" in repr(subquad.explain(q, k, v, mask_mod=builtin).shape):
        assert "causal" in subquad.explain(q, k, v, mask_mod=counted).shape
