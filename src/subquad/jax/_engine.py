"""The chunk loops of subquad.jax: online-softmax forward, FlashAttention-2 backward, one custom_vjp.

Layout inside this module is grouped: query ``(B, T, K, G, H)``, key ``(B, S, K, H)``, value
``(B, S, K, Hv)``, scores ``(B, K, G, tq, tk)``, where the ``N = K * G`` query heads share ``K``
key/value heads (head ``n`` is ``(n // G, n % G)``, as ``jax.nn.dot_product_attention`` reshapes).

Chunks. Queries are cut into ``ceil(T / tq)`` row chunks and keys into ``ceil(S / tk)`` key chunks
of a fixed size (``lax`` loops need static shapes). When a length is not a multiple of its chunk,
the last chunk is moved back to end at the last row or key, so it overlaps the one before: its
rows are recomputed (the forward writes the same values twice), its keys already seen are masked
out ("fresh" keys only), and the backward masks the repeated rows too, so nothing counts twice and
nothing is padded or copied.

Memory. The forward keeps one ``(B, K, G, tq, tk)`` score chunk and ``(B, K, G, tq)`` running
max and sum with a ``(B, K, G, tq, Hv)`` accumulator per row chunk; the backward keeps a float32
``dq`` as large as ``q`` and per key chunk ``dk``/``dv`` chunks. No ``T x S`` array exists in the
compiled program unless the caller passes one (a full-size ``bias`` or ``mask``, or asks for the
gradient of such a bias, which has its shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero


@dataclass(frozen=True)
class Spec:
    """Everything static about a call: shapes, chunk sizes, options and callbacks."""

    B: int
    T: int
    S: int
    K: int
    G: int
    H: int
    Hv: int
    tq: int
    tk: int
    left: Optional[int]  # a row t sees keys >= t - left (None: no limit)
    right: Optional[int]  # ... and keys <= t + right (None: no limit; causal makes it <= 0)
    bias_shape: Optional[Tuple[int, int, int, int, int]]  # grouped (Bb, Kb, Gb, Tb, Sb)
    score_mod: Optional[Callable[..., Any]]  # (score, b, h, q_idx, kv_idx, *consts) -> score
    mask_mod: Optional[Callable[..., Any]]  # (b, h, q_idx, kv_idx, *mask_consts) -> bool
    stats: str = "float32"  # dtype of scores, softmax statistics and gradient accumulators

    @property
    def F(self) -> Any:
        return jnp.dtype(self.stats)

    @property
    def nq(self) -> int:
        return -(-self.T // self.tq)

    @property
    def nk(self) -> int:
        return -(-self.S // self.tk)


class Rows(NamedTuple):
    """The online-softmax state of one row chunk."""

    m: jax.Array  # running max (B, K, G, tq), -inf while a row has seen nothing
    l: jax.Array  # running sum of exp(score - m)
    acc: jax.Array  # running sum of exp(score - m) * v, (B, K, G, tq, Hv)


class Aux(NamedTuple):
    """The arrays that are not differentiated, or whose gradient the loops produce alongside."""

    bias: Optional[jax.Array]  # grouped 5-D
    mask: Optional[jax.Array]  # grouped 5-D bool
    q_lengths: Optional[jax.Array]  # (B,) int32
    kv_lengths: Optional[jax.Array]
    consts: Tuple[jax.Array, ...]  # arrays the score_mod closes over (closure-converted)
    mask_consts: Tuple[jax.Array, ...]  # arrays the mask_mod closes over
    scale: jax.Array  # 0-d, the stats dtype: a Python float or a traced (even differentiated) value


# ------------------------------------------------------------------ chunk geometry
def q_start(spec: Spec, i: jax.Array) -> jax.Array:
    return jnp.minimum(i * spec.tq, spec.T - spec.tq)


def kv_start(spec: Spec, j: jax.Array) -> jax.Array:
    return jnp.minimum(j * spec.tk, spec.S - spec.tk)


def kv_range(spec: Spec, i: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """Key chunks ``[lo, hi)`` that rows of chunk ``i`` can see (causal and window skip the rest)."""
    rows_lo = q_start(spec, i)
    rows_hi = jnp.minimum((i + 1) * spec.tq, spec.T)  # exclusive
    lo, hi = jnp.int32(0), jnp.int32(spec.nk)
    if spec.right is not None:  # keys <= row + right
        hi = jnp.clip(_cdiv(rows_hi + spec.right, spec.tk), 0, spec.nk)
    if spec.left is not None:  # keys >= row - left
        lo = jnp.clip((rows_lo - spec.left) // spec.tk, 0, spec.nk)
    return lo, hi


def q_range(spec: Spec, j: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """Row chunks ``[lo, hi)`` whose rows can see a fresh key of chunk ``j``."""
    keys_lo = j * spec.tk
    keys_hi = jnp.minimum((j + 1) * spec.tk, spec.S)  # exclusive
    lo, hi = jnp.int32(0), jnp.int32(spec.nq)
    if spec.right is not None:  # row >= key - right
        lo = jnp.clip((keys_lo - spec.right) // spec.tq, 0, spec.nq)
    if spec.left is not None:  # row <= key + left
        hi = jnp.clip(_cdiv(keys_hi + spec.left, spec.tq), 0, spec.nq)
    return lo, hi


def _cdiv(a: jax.Array, b: int) -> jax.Array:
    return -((-a) // b)


def _slice(x: jax.Array, start: jax.Array, size: int, axis: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _add_at(x: jax.Array, update: jax.Array, starts: Dict[int, Any]) -> jax.Array:
    """``x`` with ``update`` added at ``starts`` (axis -> offset; other axes from 0)."""
    index = tuple(jnp.asarray(starts.get(axis, 0), jnp.int32) for axis in range(x.ndim))
    current = lax.dynamic_slice(x, index, update.shape)
    return lax.dynamic_update_slice(x, current + update.astype(x.dtype), index)


def _broadcast_chunk(x: jax.Array, spec: Spec, qs: jax.Array, ks: jax.Array) -> jax.Array:
    """The ``(.., tq, tk)`` part of a grouped bias or mask whose last two dims are 1 or T, S."""
    if x.shape[3] != 1:
        x = _slice(x, qs, spec.tq, 3)
    if x.shape[4] != 1:
        x = _slice(x, ks, spec.tk, 4)
    return x


# ------------------------------------------------------------------ scores of one chunk
def _index_arrays(spec: Spec, qs: jax.Array, ks: jax.Array) -> Tuple[jax.Array, ...]:
    """FlexAttention's callback indices for one chunk, broadcastable to ``(B, N, tq, tk)``."""
    N = spec.K * spec.G
    b = jnp.arange(spec.B, dtype=jnp.int32).reshape(spec.B, 1, 1, 1)
    h = jnp.arange(N, dtype=jnp.int32).reshape(1, N, 1, 1)
    q_idx = (qs + jnp.arange(spec.tq, dtype=jnp.int32)).reshape(1, 1, spec.tq, 1)
    kv_idx = (ks + jnp.arange(spec.tk, dtype=jnp.int32)).reshape(1, 1, 1, spec.tk)
    return b, h, q_idx, kv_idx


def _to_heads(x: jax.Array, spec: Spec) -> jax.Array:
    """Grouped ``(B, K, G, tq, tk)`` -> ``(B, N, tq, tk)``."""
    return x.reshape(spec.B, spec.K * spec.G, spec.tq, spec.tk)


def _from_heads(x: jax.Array, spec: Spec) -> jax.Array:
    x = jnp.broadcast_to(x, (spec.B, spec.K * spec.G, spec.tq, spec.tk))
    return x.reshape(spec.B, spec.K, spec.G, spec.tq, spec.tk)


def _modded(spec: Spec, s: jax.Array, bias_c: Optional[jax.Array], consts: Tuple[jax.Array, ...], qs: jax.Array, ks: jax.Array) -> jax.Array:
    """``score_mod(scale * q k^T + bias)`` of one chunk, float32, before masking."""
    if bias_c is not None:
        s = s + bias_c.astype(spec.F)
    if spec.score_mod is not None:
        s = _from_heads(spec.score_mod(_to_heads(s, spec), *_index_arrays(spec, qs, ks), *consts), spec).astype(spec.F)
    return s


def _keep(
    spec: Spec, aux: Aux, qs: jax.Array, ks: jax.Array, row_floor: Optional[jax.Array], key_floor: Optional[jax.Array]
) -> Optional[jax.Array]:
    """Which scores of the chunk count, broadcastable to ``(B, K, G, tq, tk)``; None: all of them.

    ``row_floor``/``key_floor``: rows/keys below these global positions were counted by the
    chunk before (the overlapping last chunk), so they are masked here.
    """
    q_idx = (qs + jnp.arange(spec.tq, dtype=jnp.int32))[:, None]
    kv_idx = (ks + jnp.arange(spec.tk, dtype=jnp.int32))[None, :]
    keep: Optional[jax.Array] = None

    def both(extra: jax.Array) -> jax.Array:
        return extra if keep is None else keep & extra

    if key_floor is not None:
        keep = both(kv_idx >= key_floor)
    if row_floor is not None:
        keep = both(q_idx >= row_floor)
    if spec.right is not None:
        keep = both(kv_idx <= q_idx + spec.right)
    if spec.left is not None:
        keep = both(kv_idx >= q_idx - spec.left)
    if aux.kv_lengths is not None:
        keep = both(kv_idx[None, None, None] < aux.kv_lengths[:, None, None, None, None])
    if aux.q_lengths is not None:
        keep = both(q_idx[None, None, None] < aux.q_lengths[:, None, None, None, None])
    if aux.mask is not None:
        keep = both(_broadcast_chunk(aux.mask, spec, qs, ks))
    if spec.mask_mod is not None:
        mm = spec.mask_mod(*_index_arrays(spec, qs, ks), *aux.mask_consts)
        keep = both(_from_heads(jnp.asarray(mm, dtype=bool), spec))
    return keep


def _qk(spec: Spec, qc: jax.Array, kc: jax.Array) -> jax.Array:
    """Unscaled ``q k^T`` of one chunk, ``(B, K, G, tq, tk)``."""
    return jnp.einsum("btkgh,bskh->bkgts", qc, kc, preferred_element_type=spec.F)


# ------------------------------------------------------------------ forward
def forward(spec: Spec, q: jax.Array, k: jax.Array, v: jax.Array, aux: Aux) -> Tuple[jax.Array, jax.Array]:
    """``(out (B, T, K, G, Hv) in q's dtype, lse (B, K, G, T) float32)``; rows that see no key: 0, -inf."""
    B, T, K, G, Hv, tq, tk = spec.B, spec.T, spec.K, spec.G, spec.Hv, spec.tq, spec.tk
    ragged_keys = spec.S % tk != 0

    def row_chunk(i: jax.Array, carry: Tuple[jax.Array, jax.Array]) -> Tuple[jax.Array, jax.Array]:
        out, lse = carry
        qs = q_start(spec, i)
        qc = _slice(q, qs, tq, 1)

        def key_chunk(j: jax.Array, st: Rows) -> Rows:
            ks = kv_start(spec, j)
            bias_c = None if aux.bias is None else _broadcast_chunk(aux.bias, spec, qs, ks)
            s = _modded(spec, _qk(spec, qc, _slice(k, ks, tk, 1)) * aux.scale, bias_c, aux.consts, qs, ks)
            keep = _keep(spec, aux, qs, ks, None, j * tk if ragged_keys else None)
            if keep is not None:
                s = jnp.where(keep, s, -jnp.inf)
            m_new = jnp.maximum(st.m, s.max(axis=-1))
            shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet stay at 0
            correction = jnp.exp(st.m - shift)
            p = jnp.exp(s - shift[..., None])
            l_new = st.l * correction + p.sum(axis=-1)
            pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), _slice(v, ks, tk, 1), preferred_element_type=spec.F)
            return Rows(m_new, l_new, st.acc * correction[..., None] + pv)

        start = Rows(
            jnp.full((B, K, G, tq), -jnp.inf, spec.F), jnp.zeros((B, K, G, tq), spec.F), jnp.zeros((B, K, G, tq, Hv), spec.F)
        )
        lo, hi = kv_range(spec, i)
        st = lax.fori_loop(lo, hi, key_chunk, start)
        seen = st.l > 0
        o = jnp.where(seen[..., None], st.acc / jnp.where(seen, st.l, 1.0)[..., None], 0.0)
        rows_lse = jnp.where(seen, st.m + jnp.log(jnp.where(seen, st.l, 1.0)), -jnp.inf)
        out = lax.dynamic_update_slice_in_dim(out, jnp.moveaxis(o, 3, 1).astype(out.dtype), qs, axis=1)
        lse = lax.dynamic_update_slice_in_dim(lse, rows_lse, qs, axis=3)
        return out, lse

    out = jnp.zeros((B, T, K, G, Hv), q.dtype)
    lse = jnp.full((B, K, G, T), -jnp.inf, spec.F)
    return lax.fori_loop(0, spec.nq, row_chunk, (out, lse))


# ------------------------------------------------------------------ backward
def backward(
    spec: Spec, q: jax.Array, k: jax.Array, v: jax.Array, aux: Aux, out: jax.Array, lse: jax.Array,
    dout: Optional[jax.Array], dlse: Optional[jax.Array], want_bias: bool, want_consts: Tuple[bool, ...], want_scale: bool,
) -> Tuple[jax.Array, jax.Array, jax.Array, Optional[jax.Array], Tuple[Optional[jax.Array], ...], Optional[jax.Array]]:
    """FlashAttention-2: for each key chunk, for each row chunk that sees it, recompute the
    probabilities from the saved lse and accumulate ``dq`` (float32, all rows), ``dk``/``dv``
    (float32, per key chunk), and the gradients of the bias and of the score_mod's captured arrays.

    ``dout``/``dlse`` None: that output's cotangent is zero. d lse / d score = p, so an lse
    cotangent adds ``p * dlse`` to the score gradient.
    """
    B, T, S, K, G, H, Hv, tq, tk = spec.B, spec.T, spec.S, spec.K, spec.G, spec.H, spec.Hv, spec.tq, spec.tk
    ragged_rows, ragged_keys = T % tq != 0, S % tk != 0
    if dout is None:
        dout = jnp.zeros(out.shape, out.dtype)
    # delta = rowsum(dO * O) = sum_j p_ij dp_ij; an lse cotangent enters with the opposite sign.
    delta = jnp.einsum("btkgd,btkgd->bkgt", dout.astype(spec.F), out.astype(spec.F))
    if dlse is not None:
        delta = delta - dlse
    live_lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # rows that saw nothing: p = exp(-inf) = 0
    consts = aux.consts

    def key_chunk(j: jax.Array, carry: Tuple[Any, ...]) -> Tuple[Any, ...]:
        dq, dk, dv, dbias, dconsts, dscale = carry
        ks = kv_start(spec, j)
        kc, vc = _slice(k, ks, tk, 1), _slice(v, ks, tk, 1)

        def row_chunk(i: jax.Array, c: Tuple[Any, ...]) -> Tuple[Any, ...]:
            dq, dkc, dvc, dbias, dconsts, dscale = c
            qs = q_start(spec, i)
            qc, doc = _slice(q, qs, tq, 1), _slice(dout, qs, tq, 1)
            bias_c = None if aux.bias is None else _broadcast_chunk(aux.bias, spec, qs, ks)
            raw = _qk(spec, qc, kc)
            s, pullback = jax.vjp(lambda s0, b0, c0: _modded(spec, s0, b0, c0, qs, ks), raw * aux.scale, bias_c, consts)
            p = jnp.exp(s - _slice(live_lse, qs, tq, 3)[..., None])
            keep = _keep(spec, aux, qs, ks, i * tq if ragged_rows else None, j * tk if ragged_keys else None)
            if keep is not None:
                p = jnp.where(keep, p, 0.0)
            dvc = dvc + jnp.einsum("bkgts,btkgd->bskd", p.astype(v.dtype), doc, preferred_element_type=spec.F)
            dp = jnp.einsum("btkgd,bskd->bkgts", doc, vc, preferred_element_type=spec.F)
            ds = p * (dp - _slice(delta, qs, tq, 3)[..., None])
            ds_pre, dbias_c, dconsts_c = pullback(ds)
            if want_scale:
                dscale = dscale + (ds_pre * raw).sum()
            ds_pre = (ds_pre * aux.scale).astype(q.dtype)
            dq = _add_at(dq, jnp.einsum("bkgts,bskh->btkgh", ds_pre, kc, preferred_element_type=spec.F), {1: qs})
            dkc = dkc + jnp.einsum("bkgts,btkgh->bskh", ds_pre, qc, preferred_element_type=spec.F)
            if want_bias:
                # The chunk's gradient is already reduced to the bias's broadcast dims.
                dbias = _add_at(dbias, dbias_c, {3: qs if dbias.shape[3] != 1 else 0, 4: ks if dbias.shape[4] != 1 else 0})
            dconsts = tuple(None if a is None else a + d.astype(a.dtype) for a, d in zip(dconsts, dconsts_c))
            return dq, dkc, dvc, dbias, dconsts, dscale

        lo, hi = q_range(spec, j)
        start = (dq, jnp.zeros((B, tk, K, H), spec.F), jnp.zeros((B, tk, K, Hv), spec.F), dbias, dconsts, dscale)
        dq, dkc, dvc, dbias, dconsts, dscale = lax.fori_loop(lo, hi, row_chunk, start)
        # Keys of an overlapping last chunk that the chunk before counted got zero here: adding is exact.
        return dq, _add_at(dk, dkc, {1: ks}), _add_at(dv, dvc, {1: ks}), dbias, dconsts, dscale

    dbias0 = jnp.zeros(spec.bias_shape, spec.F) if want_bias and spec.bias_shape is not None else None
    dconsts0 = tuple(jnp.zeros(c.shape, jnp.promote_types(c.dtype, spec.F)) if want else None for c, want in zip(consts, want_consts))
    start = (jnp.zeros((B, T, K, G, H), spec.F), jnp.zeros((B, S, K, H), spec.F), jnp.zeros((B, S, K, Hv), spec.F), dbias0, dconsts0, jnp.zeros((), spec.F))
    dq, dk, dv, dbias, dconsts, dscale = lax.fori_loop(0, spec.nk, key_chunk, start)
    return dq, dk, dv, dbias, dconsts, (dscale if want_scale else None)


# ------------------------------------------------------------------ the differentiable op
def _zero_or_none(x: Any) -> Any:
    return None if isinstance(x, SymbolicZero) else x


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(spec: Spec, q: jax.Array, k: jax.Array, v: jax.Array, aux: Aux) -> Tuple[jax.Array, jax.Array]:
    return forward(spec, q, k, v, aux)


def _attention_fwd(spec: Spec, q: Any, k: Any, v: Any, aux: Any) -> Tuple[Any, Any]:
    qv, kv, vv = q.value, k.value, v.value
    aux_v = Aux(*(getattr(a, "value", a) if not isinstance(a, tuple) else tuple(c.value for c in a) for a in aux))
    out, lse = forward(spec, qv, kv, vv, aux_v)
    # Which of bias and the captured arrays are differentiated decides, statically, what the
    # backward accumulates: a full-size bias gradient is T x S, never built unless asked for.
    want_bias = aux.bias is not None and aux.bias.perturbed
    want_consts = tuple(jnp.zeros(()) if c.perturbed else None for c in aux.consts)
    want_scale = aux.scale.perturbed
    flags = (jnp.zeros(()) if want_bias else None, want_consts, jnp.zeros(()) if want_scale else None)
    return (out, lse), (qv, kv, vv, aux_v, out, lse, flags)


def _attention_bwd(spec: Spec, res: Any, cts: Any) -> Tuple[Any, ...]:
    q, k, v, aux, out, lse, (bias_flag, consts_flags, scale_flag) = res
    dout, dlse = (_zero_or_none(c) for c in cts)
    want_bias, want_consts = bias_flag is not None, tuple(f is not None for f in consts_flags)
    want_scale = scale_flag is not None
    dq, dk, dv, dbias, dconsts, dscale = backward(spec, q, k, v, aux, out, lse, dout, dlse, want_bias, want_consts, want_scale)
    daux = Aux(
        None if dbias is None else dbias.astype(aux.bias.dtype),
        None,
        None,
        None,
        tuple(None if d is None else d.astype(c.dtype) for d, c in zip(dconsts, aux.consts)),
        tuple(None for _ in aux.mask_consts),
        dscale,
    )
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), daux


attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
