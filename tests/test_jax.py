"""subquad.jax against a float64 materialized reference (NumPy) and against jax.nn.dot_product_attention.

The golden is computed in NumPy float64 from the definition; subquad.jax runs in float64 (x64 on)
for the exactness checks, and in float32/bf16/fp16 against the golden with dtype tolerances.
"""

from __future__ import annotations

import functools
import inspect
import os
import subprocess
import sys
from typing import Any, Optional, Tuple

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

jax.config.update("jax_enable_x64", True)

import subquad.jax as sj  # noqa: E402
from subquad._budget import parse_budget  # noqa: E402
from subquad.jax import _engine  # noqa: E402
from subquad.jax._call import prepare  # noqa: E402

RNG = np.random.default_rng(1234)
JAX_F32_SOFTMAX = 2e-6
"""jax.nn.dot_product_attention takes its softmax in float32 even for float64 inputs: compare with it
to float32 accuracy, and with the float64 golden to 1e-12."""


def _jax_gives_nan_on_rows_that_see_nothing() -> bool:
    x = jnp.zeros((1, 1, 1, 8), jnp.float64)
    return bool(np.isnan(np.asarray(jax.nn.dot_product_attention(x, x, x, mask=jnp.zeros((1, 1, 1, 1), bool)))).any())


JAX_NAN_ROWS = _jax_gives_nan_on_rows_that_see_nothing()
"""Older JAX (0.6, what pip picks for Python 3.10) fills masked float64 scores with a float64 "large
negative" and takes the softmax in float32, where that is -inf: rows that see no key, padding rows
included, come out NaN. Newer JAX gives the mean of the values (padding rows 0), as
subquad.jax.dot_product_attention does; against an older JAX those rows are left out."""

JAX_HAS_RESIDUAL = "return_residual" in inspect.signature(jax.nn.dot_product_attention).parameters


# ------------------------------------------------------------------ references
def assert_close_to_jax(test: Any, want: Any, what: str) -> None:
    """assert_close with jax.nn.dot_product_attention's output, less its NaN rows on an older JAX (JAX_NAN_ROWS)."""
    test, want = np.asarray(test, np.float64), np.asarray(want, np.float64)
    if JAX_NAN_ROWS:
        nan_rows = np.isnan(want).all(-1, keepdims=True)
        test, want = np.where(nan_rows, 0.0, test), np.where(nan_rows, 0.0, want)
    assert_close(test, want, JAX_F32_SOFTMAX, what)


def golden(q, k, v, bias=None, keep=None, scale=None, score_mod=None):
    """float64 NumPy attention from the definition; rows that see no key give 0 and lse -inf."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    _B, _T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    kk, vv = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, kk) * (1 / np.sqrt(H) if scale is None else scale)
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    if score_mod is not None:
        s = score_mod(s)
    if keep is not None:
        s = np.where(np.broadcast_to(keep, s.shape), s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isinf(m), 0, m)
    p = np.exp(s - m)
    ell = p.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnd->btnd", p / np.where(ell == 0, 1, ell), vv)
    lse = np.where(ell[..., 0] == 0, -np.inf, np.log(np.where(ell[..., 0] == 0, 1, ell[..., 0])) + m[..., 0])
    return out, np.moveaxis(lse, 1, 2)


def jref(q, k, v, bias=None, keep=None, scale=None):
    """The same definition in jnp (float64), for autodiff gradients."""
    _B, _T, N, H = q.shape
    G = N // k.shape[2]
    s = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, G, axis=2)) * (1 / np.sqrt(H) if scale is None else scale)
    if bias is not None:
        s = s + bias
    if keep is not None:
        s = jnp.where(keep, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(jnp.isnan(p), 0.0, p)
    return jnp.einsum("bnts,bsnd->btnd", p, jnp.repeat(v, G, axis=2))


def causal_keep(T: int, S: int) -> np.ndarray:
    return np.tril(np.ones((T, S), bool))


def randn(*shape: int, dtype: Any = np.float64) -> Any:
    return jnp.asarray(RNG.standard_normal(shape), dtype)


def qkv(
    B: int, T: int, S: int, N: int, K: int, H: int, Hv: Optional[int] = None, dtype: Any = np.float64
) -> Tuple[Any, Any, Any]:
    return randn(B, T, N, H, dtype=dtype), randn(B, S, K, H, dtype=dtype), randn(B, S, K, Hv or H, dtype=dtype)


def assert_close(test: Any, want: Any, atol: float, what: str = "") -> None:
    test, want = np.asarray(test, np.float64), np.asarray(want, np.float64)
    assert test.shape == want.shape, f"{what}: shape {test.shape} != {want.shape}"
    same_inf = np.isinf(want) & (test == want)
    err = np.where(same_inf, 0.0, np.abs(test - want))
    worst = np.unravel_index(np.nanargmax(np.where(np.isnan(err), np.inf, err)), err.shape) if err.size else ()
    assert not np.isnan(err).any() and (err.size == 0 or err.max() <= atol), (
        f"{what}: max error {err.max() if err.size else 0:.3e} > {atol:.1e} at {worst}: {test[worst] if err.size else ''} vs {want[worst] if err.size else ''}"
    )


# ------------------------------------------------------------------ forward and lse, float64
SIZES = [  # (B, T, S, N, K, H, chunk_size)
    pytest.param(1, 1, 1, 1, 1, 1, None, id="len1-dim1"),
    pytest.param(2, 113, 203, 4, 2, 59, (32, 48), id="113x203-gqa-dim59"),
    pytest.param(1, 113, 203, 2, 2, 111, (7, 5), id="113x203-dim111-tiny-chunks"),
    pytest.param(1, 64, 40, 2, 1, 256, (16, 16), id="mqa-dim256"),
    pytest.param(2, 50, 50, 3, 3, 8, None, id="one-chunk"),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B,T,S,N,K,H,chunk", SIZES)
def test_forward_and_lse_match_float64_golden(B, T, S, N, K, H, chunk, causal):
    q, k, v = qkv(B, T, S, N, K, H)
    out, lse = sj.attention(q, k, v, is_causal=causal, chunk_size=chunk, return_lse=True)
    want, want_lse = golden(q, k, v, keep=causal_keep(T, S) if causal else None)
    assert out.dtype == q.dtype and out.shape == (B, T, N, H)
    assert_close(out, want, 1e-12, "out")
    assert_close(lse, want_lse, 1e-12, "lse")


def test_value_head_dim_may_differ():
    q, k, _ = qkv(2, 30, 41, 4, 2, 16)
    v = randn(2, 41, 2, 9)
    out = sj.attention(q, k, v, chunk_size=(8, 16))
    assert_close(out, golden(q, k, v)[0], 1e-12, "out")


def test_unbatched_inputs_and_non_contiguous_views():
    q, k, v = qkv(1, 37, 29, 2, 2, 16)
    out = sj.attention(q[0], k[0], v[0], chunk_size=8)
    assert out.shape == (37, 2, 16)
    assert_close(out, golden(q, k, v)[0][0], 1e-12, "3-D")
    # transposed views: JAX arrays have no strides, but a transposed input must not confuse the layout
    qt = jnp.transpose(jnp.transpose(q, (0, 2, 1, 3)), (0, 2, 1, 3))
    assert_close(sj.attention(qt, k, v, chunk_size=8), golden(q, k, v)[0], 1e-12, "view")


@pytest.mark.parametrize("T,S", [(50, 30), (30, 50), (64, 64)])
def test_causal_is_top_left_aligned_like_jax(T, S):
    q, k, v = qkv(1, T, S, 2, 2, 16)
    out = sj.attention(q, k, v, is_causal=True, chunk_size=(16, 8))
    assert_close(out, golden(q, k, v, keep=causal_keep(T, S))[0], 1e-12, "causal")
    assert_close(out, jax.nn.dot_product_attention(q, k, v, is_causal=True), JAX_F32_SOFTMAX, "vs jax.nn")


BIAS_SHAPES = [(1, 4, 45, 70), (2, 1, 1, 70), (2, 4, 45, 1), (45, 70), (1, 1, 1, 1)]


@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bias_and_mask_of_broadcast_shapes(shape):
    q, k, v = qkv(2, 45, 70, 4, 2, 16)
    bias = randn(*shape)
    keep = RNG.random(shape) > 0.3
    out = sj.attention(q, k, v, bias, jnp.asarray(keep), chunk_size=(16, 32))
    assert_close(out, golden(q, k, v, bias, keep)[0], 1e-12, "out")
    assert_close_to_jax(
        sj.dot_product_attention(q, k, v, bias, jnp.asarray(keep)),
        jax.nn.dot_product_attention(q, k, v, bias, jnp.asarray(keep)),
        "drop-in",
    )


def test_fully_masked_rows_give_zero_and_minus_inf_lse():
    q, k, v = qkv(1, 40, 40, 2, 2, 8)
    keep = np.ones((1, 1, 40, 40), bool)
    keep[..., 3, :] = False
    keep[..., 20:30, :] = False
    out, lse = sj.attention(q, k, v, mask=jnp.asarray(keep), chunk_size=(16, 16), return_lse=True)
    assert np.all(np.asarray(out)[0, 20:30] == 0) and np.all(np.asarray(out)[0, 3] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[0, 20:30]))
    assert_close(out, golden(q, k, v, keep=keep)[0], 1e-12, "out")
    # the gradient of such rows is zero, not NaN
    g = jax.grad(lambda q: sj.attention(q, k, v, mask=jnp.asarray(keep), chunk_size=16).sum())(q)
    assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g)[0, 20:30] == 0)


@pytest.mark.skipif(
    not JAX_HAS_RESIDUAL or JAX_NAN_ROWS,
    reason="this JAX's dot_product_attention has no return_residual, or gives NaN on rows that see no key",
)
def test_drop_in_matches_jax_on_fully_masked_rows_and_padding():
    """JAX's large negative fill: a row that sees nothing averages all values; padding rows are 0."""
    q, k, v = qkv(2, 33, 47, 4, 2, 16)
    keep = np.ones((2, 1, 33, 47), bool)
    keep[0, :, 5, :] = False
    qlen = jnp.asarray([30, 33], jnp.int32)
    kvlen = jnp.asarray([47, 10], jnp.int32)
    args = dict(mask=jnp.asarray(keep), query_seq_lengths=qlen, key_value_seq_lengths=kvlen)
    out, res = sj.dot_product_attention(q, k, v, **args, return_residual=True)
    want, want_res = jax.nn.dot_product_attention(q, k, v, **args, return_residual=True)
    assert_close(out, want, JAX_F32_SOFTMAX, "out")
    np.testing.assert_allclose(np.asarray(res), np.asarray(want_res), rtol=1e-6)


@pytest.mark.parametrize("window", [3, (5, 0), (0, 7), (20, 2)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_local_window_and_lengths_match_jax(window, causal):
    q, k, v = qkv(2, 61, 61, 2, 1, 16)
    lengths = dict(
        query_seq_lengths=jnp.asarray([61, 40], jnp.int32), key_value_seq_lengths=jnp.asarray([50, 61], jnp.int32)
    )
    out = sj.dot_product_attention(q, k, v, is_causal=causal, local_window_size=window, **lengths)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=window, **lengths)
    assert_close_to_jax(out, want, "out")
    # chunks outside the window are skipped, not computed
    small = prepare(q, k, v, is_causal=causal, local_window_size=window, chunk_size=8)
    assert small.skipped_fraction() > 0.4


def test_causal_skips_chunks_above_the_diagonal():
    q, k, v = qkv(1, 256, 256, 1, 1, 8)
    call = prepare(q, k, v, is_causal=True, chunk_size=32)
    ranges = [tuple(int(x) for x in _engine.kv_range(call.spec, jnp.int32(i))) for i in range(8)]
    assert ranges == [(0, i + 1) for i in range(8)]
    assert call.skipped_fraction() == pytest.approx(1 - 36 / 64)
    rows = [tuple(int(x) for x in _engine.q_range(call.spec, jnp.int32(j))) for j in range(8)]
    assert rows == [(j, 8) for j in range(8)]


# ------------------------------------------------------------------ gradients
def _grads(fn, *args):
    return jax.grad(lambda *a: (fn(*a) * COT).sum(), argnums=tuple(range(len(args))))(*args)


COT = None


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B,T,S,N,K,H,chunk", SIZES[:4])
def test_gradients_match_autodiff_of_the_reference(B, T, S, N, K, H, chunk, causal):
    global COT
    q, k, v = qkv(B, T, S, N, K, H)
    COT = randn(B, T, N, H)
    keep = causal_keep(T, S) if causal else None
    got = _grads(lambda q, k, v: sj.attention(q, k, v, is_causal=causal, chunk_size=chunk), q, k, v)
    want = _grads(lambda q, k, v: jref(q, k, v, keep=keep), q, k, v)
    for name, a, b in zip("qkv", got, want):
        assert_close(a, b, 1e-10, f"d{name}")


@pytest.mark.parametrize("shape", [(1, 4, 45, 70), (2, 1, 1, 70), (45, 70)], ids=lambda s: "x".join(map(str, s)))
def test_bias_gradient_has_the_bias_shape(shape):
    global COT
    q, k, v = qkv(2, 45, 70, 4, 2, 16)
    bias = randn(*shape)
    keep = jnp.asarray(RNG.random((2, 1, 45, 70)) > 0.2)
    COT = randn(2, 45, 4, 16)
    got = _grads(lambda q, k, v, b: sj.attention(q, k, v, b, keep, chunk_size=(16, 32)), q, k, v, bias)
    want = _grads(lambda q, k, v, b: jref(q, k, v, b, keep), q, k, v, bias)
    for name, a, b in zip(["q", "k", "v", "bias"], got, want):
        assert_close(a, b, 1e-10, f"d{name}")


def test_check_grads_in_float64():
    from jax.test_util import check_grads

    q, k, v = qkv(1, 9, 11, 2, 1, 4)
    bias = randn(1, 2, 9, 11)
    check_grads(
        lambda q, k, v, b: sj.attention(q, k, v, b, is_causal=True, chunk_size=(4, 3)),
        (q, k, v, bias),
        order=1,
        modes=["rev"],
    )


def test_lse_is_differentiable():
    q, k, v = qkv(1, 20, 33, 2, 2, 8)
    w = randn(1, 20, 2)

    def loss(q, k):
        out, lse = sj.attention(q, k, v, chunk_size=(8, 8), return_lse=True)
        return (lse * w).sum() + out.sum()

    def ref_loss(q, k):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(8)
        lse = jnp.moveaxis(jax.nn.logsumexp(s, -1), 1, 2)
        return (lse * w).sum() + jref(q, k, v).sum()

    for a, b in zip(jax.grad(loss, (0, 1))(q, k), jax.grad(ref_loss, (0, 1))(q, k)):
        assert_close(a, b, 1e-10, "grad through lse")


def test_jit_vmap_and_grad_of_vmap():
    q, k, v = qkv(3, 40, 40, 2, 2, 8)  # vmap over the leading axis of unbatched (T, N, H) inputs
    f = functools.partial(sj.attention, is_causal=True, chunk_size=16)
    batched = jax.jit(jax.vmap(f))(q, k, v)
    assert_close(batched, golden(q, k, v, keep=causal_keep(40, 40))[0], 1e-12, "vmap")
    g = jax.grad(lambda q: jax.vmap(f)(q, k, v).sum())(q)
    gr = jax.grad(lambda q: jref(q, k, v, keep=causal_keep(40, 40)).sum())(q)
    assert_close(g, gr, 1e-10, "grad of vmap")
    # per-example gradients: vmap of grad
    per = jax.vmap(jax.grad(lambda q, k, v: f(q, k, v).sum()))(q, k, v)
    assert_close(per, gr, 1e-10, "vmap of grad")


# ------------------------------------------------------------------ callbacks
def alibi_np(N: int):
    slopes = 2.0 ** (-8.0 * np.arange(1, N + 1) / N)

    def mod(s):
        T, S = s.shape[-2:]
        return s + slopes[None, :, None, None] * (np.arange(S)[None, :] - np.arange(T)[:, None])

    return slopes, mod


def test_score_mod_alibi_and_mask_mod_sliding_window_use_global_positions():
    q, k, v = qkv(2, 70, 70, 4, 2, 16)
    slopes, mod = alibi_np(4)
    sl = jnp.asarray(slopes)

    def score_mod(s, b, h, qi, ki):
        return s + sl[h] * (ki - qi)

    def mask_mod(b, h, qi, ki):
        return (ki <= qi) & (qi - ki < 20)

    out = sj.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, chunk_size=(16, 24))
    i, j = np.arange(70)[:, None], np.arange(70)[None, :]
    assert_close(out, golden(q, k, v, keep=(j <= i) & (i - j < 20), score_mod=mod)[0], 1e-12, "alibi+window")


def test_document_mask_closing_over_an_array_under_jit():
    q, k, v = qkv(1, 60, 60, 2, 2, 8)
    docs = jnp.asarray(np.repeat(np.arange(4), 15))

    @jax.jit
    def run(q, k, v, docs):
        return sj.attention(q, k, v, mask_mod=lambda b, h, qi, ki: docs[qi] == docs[ki], chunk_size=16)

    keep = np.asarray(docs)[:, None] == np.asarray(docs)[None, :]
    assert_close(run(q, k, v, docs), golden(q, k, v, keep=keep)[0], 1e-12, "documents")


def test_gradient_of_an_array_the_score_mod_closes_over():
    q, k, v = qkv(1, 30, 30, 2, 2, 8)
    table = randn(30, 30)

    def loss(table, q):
        return (
            sj.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: jnp.tanh(s) * 3 + table[qi, ki], chunk_size=(8, 16))
            ** 2
        ).sum()

    def ref_loss(table, q):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(8)
        s = jnp.tanh(s) * 3 + table
        return (jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(s, -1), v) ** 2).sum()

    for name, a, b in zip(["table", "q"], jax.grad(loss, (0, 1))(table, q), jax.grad(ref_loss, (0, 1))(table, q)):
        assert_close(a, b, 1e-10, f"d{name}")


# ------------------------------------------------------------------ low precision
@pytest.mark.parametrize(
    "dtype,atol", [(jnp.float32, 2e-6), (jnp.bfloat16, 3e-2), (jnp.float16, 4e-3)], ids=["fp32", "bf16", "fp16"]
)
def test_low_precision_dtypes(dtype, atol):
    q, k, v = qkv(1, 77, 131, 4, 2, 32, dtype=dtype)
    out = sj.attention(q, k, v, is_causal=True, chunk_size=(32, 64))
    assert out.dtype == dtype
    want = golden(q, k, v, keep=causal_keep(77, 131))[0]
    xla = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    err_xla = float(np.abs(np.asarray(xla, np.float64) - want).max())
    assert_close(out, want, max(atol, 2 * err_xla), str(dtype))
    g = jax.grad(lambda q: sj.attention(q, k, v, is_causal=True, chunk_size=(32, 64)).astype(jnp.float32).sum())(q)
    assert g.dtype == dtype and np.all(np.isfinite(np.asarray(g, np.float32)))


# ------------------------------------------------------------------ memory: measured from the compiled program
def _temp_bytes(fn, *shapes):
    return jax.jit(fn).lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def _forward(**options):
    return lambda q, k, v: sj.attention(q, k, v, **options)


def _loss(**options):
    return jax.grad(lambda q, k, v: sj.attention(q, k, v, **options).sum(), (0, 1, 2))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_compiled_temp_memory_grows_linearly_not_quadratically(causal):
    temps = {}
    for T in (2048, 8192):
        x = jax.ShapeDtypeStruct((1, T, 4, 64), jnp.float32)
        temps[T] = (
            _temp_bytes(_forward(is_causal=causal, chunk_size=256), x, x, x),
            _temp_bytes(_loss(is_causal=causal, chunk_size=256), x, x, x),
        )
        scores = 4 * 4 * T * T
        assert temps[T][0] < scores / 8 and temps[T][1] < scores / 4, (T, temps[T], scores)
    # What grows with T is a few row-sized buffers, not chunks: per added query row at most 1.5
    # output rows (XLA keeps the output as a loop carry) forward, 4 forward+backward (float32 dq,
    # dk, dv accumulators, the saved output); the scores would add 4 * N * T bytes per row.
    row = 4 * 4 * 64  # one float32 output row, (N, H) = (4, 64)
    added = 8192 - 2048
    assert temps[8192][0] - temps[2048][0] <= 1.5 * row * added, temps
    assert temps[8192][1] - temps[2048][1] <= 4 * row * added, temps


@pytest.mark.parametrize("budget", ["24MiB", "48MiB", "96MiB"])
def test_budget_holds_in_the_compiled_program(budget):
    x = jax.ShapeDtypeStruct((1, 4096, 4, 64), jnp.float32)
    limit = parse_budget(budget)
    for causal in (False, True):
        fwd = _temp_bytes(_forward(is_causal=causal, memory_budget=budget), x, x, x)
        bwd = _temp_bytes(_loss(is_causal=causal, memory_budget=budget), x, x, x)
        assert fwd <= limit and bwd <= limit, (budget, causal, fwd, bwd)


def test_memory_model_is_an_upper_bound_of_the_compiled_temporaries():
    for T, S, N, K, H, chunk in [
        (1024, 1024, 8, 8, 64, (128, 256)),
        (3000, 1000, 4, 1, 32, (512, 512)),
        (4096, 4096, 8, 2, 128, None),
    ]:
        q = jnp.zeros((1, T, N, H), jnp.float32)
        kv = jnp.zeros((1, S, K, H), jnp.float32)
        call = prepare(q, kv, kv, is_causal=True, chunk_size=chunk)
        xq, xk = jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(kv.shape, kv.dtype)
        fwd = _temp_bytes(_forward(is_causal=True, chunk_size=chunk), xq, xk, xk)
        bwd = _temp_bytes(_loss(is_causal=True, chunk_size=chunk), xq, xk, xk)
        assert fwd <= call.forward_bytes and bwd <= call.backward_bytes, (
            T,
            S,
            chunk,
            fwd,
            call.forward_bytes,
            bwd,
            call.backward_bytes,
        )


def test_budget_too_small_raises():
    q, k, v = qkv(1, 4096, 4096, 8, 8, 64, dtype=np.float32)
    with pytest.raises(sj.MemoryBudgetError, match="too small"):
        sj.attention(q, k, v, memory_budget="1MiB")
    with pytest.raises(sj.MemoryBudgetError, match="chunk_size"):
        sj.attention(q, k, v, chunk_size=4096, memory_budget="64MiB")


# ------------------------------------------------------------------ errors and edges
@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda q, k, v: sj.attention(q[0, 0], k, v), ValueError, "same number of dims"),
        (lambda q, k, v: sj.attention(q, k.astype(jnp.float32), v), TypeError, "one dtype"),
        (
            lambda q, k, v: sj.attention(q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32)),
            TypeError,
            "floating",
        ),
        (lambda q, k, v: sj.attention(q, k[..., :3], v), ValueError, "match query"),
        (lambda q, k, v: sj.attention(q[:, :, :3], k, v), ValueError, "multiple of key/value heads"),
        (lambda q, k, v: sj.attention(q, k, v, mask=jnp.ones((1, 1, 10, 12))), TypeError, "bool"),
        (lambda q, k, v: sj.attention(q, k, v, bias=jnp.ones((1, 3, 10, 12))), ValueError, "bias to broadcast"),
        (lambda q, k, v: sj.attention(q, k, v, bias=jnp.ones((1, 1, 1, 10, 12))), ValueError, "at most 4 dims"),
        (lambda q, k, v: sj.attention(q, k, v, chunk_size=0), ValueError, "chunk_size >= 1"),
        (lambda q, k, v: sj.attention(q, k, v, chunk_size=(1, 2, 3)), ValueError, "pair"),
        (lambda q, k, v: sj.attention(q, k, v, memory_budget="lots"), ValueError, "memory_budget"),
        (lambda q, k, v: sj.attention(q, k, v, local_window_size=(1, 2, 3)), ValueError, "local_window_size"),
        (
            lambda q, k, v: sj.attention(q, k, v, query_seq_lengths=jnp.ones(3, jnp.int32)),
            ValueError,
            "query_seq_lengths",
        ),
        (lambda q, k, v: sj.attention(q, k, v, is_causal=1), TypeError, "is_causal"),
        (lambda q, k, v: sj.attention(q, k, v, score_mod=3), TypeError, "score_mod"),
        (
            lambda q, k, v: sj.attention(q, k, v, score_mod=lambda s, b, h, i, j: s[..., :3]),
            ValueError,
            "score_mod returned",
        ),
        (
            lambda q, k, v: sj.attention(q, k, v, mask_mod=lambda b, h, i, j: i - j),
            TypeError,
            "mask_mod must return bool",
        ),
        (lambda q, k, v: sj.dot_product_attention(q, k, v, implementation="cudnn"), NotImplementedError, "cudnn"),
        (lambda q, k, v: sj.explain(q, k, v, causal=True), TypeError, "unexpected keyword"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_bad_arguments_raise_clear_errors(make, exc, match):
    q, k, v = qkv(1, 10, 12, 4, 2, 8)
    with pytest.raises(exc, match=match):
        make(q, k, v)


@pytest.mark.parametrize("shape", [(0, 5, 2, 8), (2, 0, 2, 8), (2, 5, 0, 8)], ids=["B0", "T0", "N0"])
def test_empty_inputs_give_empty_outputs(shape):
    q = jnp.zeros(shape)
    k = v = jnp.zeros((shape[0], 7, shape[2], 8))
    out, lse = sj.attention(q, k, v, return_lse=True)
    assert out.shape == shape and lse.shape == shape[:3]


def test_no_keys_give_zero_rows():
    q = randn(1, 4, 2, 8)
    k = v = jnp.zeros((1, 0, 2, 8))
    out, lse = sj.attention(q, k, v, return_lse=True)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


def test_explain_names_chunks_and_memory():
    q, k, v = qkv(1, 4096, 4096, 8, 8, 64, dtype=np.float32)
    text = sj.explain(q, k, v, is_causal=True, memory_budget="64MiB")
    assert "chunks" in text and "budget: 64.0 MiB" in text and "skipped" in text


def test_import_subquad_does_not_import_jax():
    pytest.importorskip("torch")  # `import subquad` is the torch face (tests/test_packaging.py: without torch)
    code = "import sys, subquad; assert 'jax' not in sys.modules, 'jax imported'; print('ok')"
    env = dict(os.environ)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_score_mod_closing_over_int_and_float_tracers_under_jit_and_grad():
    """Document ids (int) travel as arguments; a float weight gets its gradient."""
    q, k, v = qkv(1, 32, 32, 2, 2, 8)
    docs = jnp.asarray(np.repeat(np.arange(4), 8))
    same = np.asarray(docs)[:, None] == np.asarray(docs)[None, :]

    @jax.jit
    def loss(q, w, docs):
        mod = lambda s, b, h, i, j: jnp.where(docs[i] == docs[j], s * w, s - 1.0)  # noqa: E731
        return (sj.attention(q, k, v, score_mod=mod, chunk_size=8) ** 2).sum()

    def ref_loss(q, w):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(8)
        s = jnp.where(same, s * w, s - 1.0)
        return (jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(s, -1), v) ** 2).sum()

    w = jnp.asarray(1.7)
    assert_close(loss(q, w, docs), ref_loss(q, w), 1e-10, "loss")
    for name, a, b in zip(["q", "w"], jax.grad(loss, (0, 1))(q, w, docs), jax.grad(ref_loss, (0, 1))(q, w)):
        assert_close(a, b, 1e-10, f"d{name}")


def test_bench_cli_runs_the_jax_preset(tmp_path, capsys):
    pytest.importorskip("torch")  # `subquad bench` is a torch program, its JAX presets included
    from subquad.bench import cli

    assert (
        cli.main(
            [
                "--framework",
                "jax",
                "--preset",
                "jax-quick",
                "--impl",
                "subquad-jax",
                "--seconds",
                "0.01",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    text = (tmp_path / "results.txt").read_text()
    assert "subquad-jax" in text and "1x1024x4x64 causal train" in text
    with pytest.raises(SystemExit):
        cli.main(["--framework", "jax", "--shape", "1,8,128,64"])
    with pytest.raises(SystemExit):
        cli.main(["--framework", "jax", "--impl", "flash"])


def test_scale_may_be_traced_and_differentiated():
    q, k, v = qkv(1, 33, 21, 2, 1, 8)

    @jax.jit
    def loss(q, scale):
        return (sj.attention(q, k, v, scale=scale, is_causal=True, chunk_size=(8, 8)) ** 2).sum()

    def ref_loss(q, scale):
        return (jref(q, k, v, keep=causal_keep(33, 21), scale=scale) ** 2).sum()

    scale = jnp.asarray(0.37)
    assert_close(loss(q, scale), ref_loss(q, scale), 1e-12, "loss")
    for name, a, b in zip(["q", "scale"], jax.grad(loss, (0, 1))(q, scale), jax.grad(ref_loss, (0, 1))(q, scale)):
        assert_close(a, b, 1e-10, f"d{name}")
    with pytest.raises(TypeError, match="scale"):
        sj.attention(q, k, v, scale=jnp.ones(2))


def test_dtype_errors_are_value_errors_too_as_in_jax():
    q, k, v = qkv(1, 10, 12, 4, 2, 8)
    cases = [dict(mask=jnp.ones((1, 1, 10, 12))), dict(key=k.astype(jnp.float32))]
    for case in cases:
        args = dict(query=q, key=case.get("key", k), value=v)
        mask = case.get("mask")
        with pytest.raises(ValueError):  # what jax.nn raises for the same input
            jax.nn.dot_product_attention(**args, mask=mask)
        with pytest.raises(ValueError):
            sj.dot_product_attention(**args, mask=mask)
        with pytest.raises(TypeError):  # subquad's convention for a wrong dtype
            sj.dot_product_attention(**args, mask=mask)


def test_vmap_over_an_array_the_score_mod_closes_over():
    q = randn(16, 2, 8)
    tables = randn(3, 16, 16)

    def f(t):
        return sj.attention(q, q, q, score_mod=lambda s, b, h, i, j: s + t[i, j], chunk_size=4)

    def ref(t):
        s = jnp.einsum("tnh,snh->nts", q, q) / np.sqrt(8) + t
        return jnp.einsum("nts,snd->tnd", jax.nn.softmax(s, -1), q)

    assert_close(jax.vmap(f)(tables), jax.vmap(ref)(tables), 1e-12, "vmap over the table")
    per_table = jax.vmap(jax.grad(lambda t: f(t).sum()))(tables)
    assert_close(per_table, jax.vmap(jax.grad(lambda t: ref(t).sum()))(tables), 1e-10, "per-table gradients")
