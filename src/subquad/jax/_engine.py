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

from ._vma import match, vary, varying_axes


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


class Offsets(NamedTuple):
    """Where a block of a longer sequence sits (ring attention runs the loops on such blocks).

    ``rows``/``keys``: the block's first row in ``q`` (and the output, lse, ``dq``, the bias's and
    mask's rows) and first key in ``k``/``v`` (and ``dk``/``dv``); ``q``/``kv``: their global
    positions (causal, window, lengths, callbacks; the bias's and mask's columns are global key
    positions); ``head``: the global index of head 0 (callbacks' ``h``). 0-d int32 arrays, which
    may be traced (a device's place on the ring); ``None`` instead of an ``Offsets``: all zero.
    """

    rows: Any
    keys: Any
    q: Any
    kv: Any
    head: Any


_ORIGIN = Offsets(0, 0, 0, 0, 0)


def _place(at: Optional[Offsets]) -> Offsets:
    return _ORIGIN if at is None else at


# ------------------------------------------------------------------ chunk geometry
def q_start(spec: Spec, i: jax.Array) -> jax.Array:
    return jnp.minimum(i * spec.tq, spec.T - spec.tq)


def kv_start(spec: Spec, j: jax.Array) -> jax.Array:
    return jnp.minimum(j * spec.tk, spec.S - spec.tk)


def kv_range(spec: Spec, i: jax.Array, shift: Any = 0) -> Tuple[jax.Array, jax.Array]:
    """Key chunks ``[lo, hi)`` that rows of chunk ``i`` can see (causal and window skip the rest).

    ``shift``: the block's global row position minus its global key position (0 on one device).
    """
    rows_lo = q_start(spec, i) + shift
    rows_hi = jnp.minimum((i + 1) * spec.tq, spec.T) + shift  # exclusive
    lo, hi = jnp.int32(0), jnp.int32(spec.nk)
    if spec.right is not None:  # keys <= row + right
        hi = jnp.clip(_cdiv(rows_hi + spec.right, spec.tk), 0, spec.nk)
    if spec.left is not None:  # keys >= row - left
        lo = jnp.clip((rows_lo - spec.left) // spec.tk, 0, spec.nk)
    return lo, hi


def q_range(spec: Spec, j: jax.Array, shift: Any = 0) -> Tuple[jax.Array, jax.Array]:
    """Row chunks ``[lo, hi)`` whose rows can see a fresh key of chunk ``j`` (``shift`` as above)."""
    keys_lo = j * spec.tk - shift
    keys_hi = jnp.minimum((j + 1) * spec.tk, spec.S) - shift  # exclusive
    lo, hi = jnp.int32(0), jnp.int32(spec.nq)
    if spec.right is not None:  # row >= key - right
        lo = jnp.clip((keys_lo - spec.right) // spec.tq, 0, spec.nq)
    if spec.left is not None:  # row <= key + left
        hi = jnp.clip(_cdiv(keys_hi + spec.left, spec.tq), 0, spec.nq)
    return lo, hi


def block_visible(spec: Spec, shift: Any) -> Any:
    """Whether any row of a block can see any of its keys through causal and window (a bool, maybe traced)."""
    visible: Any = spec.T > 0 and spec.S > 0  # Python bools while shift is a Python int
    if spec.right is not None:  # the last row sees the first key
        visible = visible & (0 <= spec.T - 1 + shift + spec.right)
    if spec.left is not None:  # the first row sees the last key
        visible = visible & (spec.S - 1 >= shift - spec.left)
    return visible


def _cdiv(a: jax.Array, b: int) -> jax.Array:
    return -((-a) // b)


def _slice(x: jax.Array, start: jax.Array, size: int, axis: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _add_at(x: jax.Array, update: jax.Array, starts: Dict[int, Any]) -> jax.Array:
    """``x`` with ``update`` added at ``starts`` (axis -> offset; other axes from 0)."""
    index = tuple(jnp.asarray(starts.get(axis, 0), jnp.int32) for axis in range(x.ndim))
    current = lax.dynamic_slice(x, index, update.shape)
    return lax.dynamic_update_slice(x, current + update.astype(x.dtype), index)


def _broadcast_chunk(x: jax.Array, spec: Spec, qs: jax.Array, ks: jax.Array, at: Offsets) -> jax.Array:
    """The ``(.., tq, tk)`` part of a grouped bias or mask whose last two dims are 1 or full."""
    if x.shape[3] != 1:
        x = _slice(x, at.rows + qs, spec.tq, 3)
    if x.shape[4] != 1:
        x = _slice(x, at.kv + ks, spec.tk, 4)
    return x


# ------------------------------------------------------------------ scores of one chunk
def index_arrays(spec: Spec, qs: Any, ks: Any, at: Optional[Offsets] = None) -> Tuple[jax.Array, ...]:
    """FlexAttention's callback indices for one chunk (global), broadcastable to ``(B, N, tq, tk)``."""
    at = _place(at)
    N = spec.K * spec.G
    b = jnp.arange(spec.B, dtype=jnp.int32).reshape(spec.B, 1, 1, 1)
    h = (at.head + jnp.arange(N, dtype=jnp.int32)).reshape(1, N, 1, 1)
    q_idx = (at.q + qs + jnp.arange(spec.tq, dtype=jnp.int32)).reshape(1, 1, spec.tq, 1)
    kv_idx = (at.kv + ks + jnp.arange(spec.tk, dtype=jnp.int32)).reshape(1, 1, 1, spec.tk)
    return b, h, q_idx, kv_idx


def _to_heads(x: jax.Array, spec: Spec) -> jax.Array:
    """Grouped ``(B, K, G, tq, tk)`` -> ``(B, N, tq, tk)``."""
    return x.reshape(spec.B, spec.K * spec.G, spec.tq, spec.tk)


def _from_heads(x: jax.Array, spec: Spec) -> jax.Array:
    x = jnp.broadcast_to(x, (spec.B, spec.K * spec.G, spec.tq, spec.tk))
    return x.reshape(spec.B, spec.K, spec.G, spec.tq, spec.tk)


def _modded(
    spec: Spec,
    s: jax.Array,
    bias_c: Optional[jax.Array],
    consts: Tuple[jax.Array, ...],
    qs: jax.Array,
    ks: jax.Array,
    at: Offsets,
) -> jax.Array:
    """``score_mod(scale * q k^T + bias)`` of one chunk, float32, before masking."""
    if bias_c is not None:
        s = s + bias_c.astype(spec.F)
    if spec.score_mod is not None:
        s = _from_heads(spec.score_mod(_to_heads(s, spec), *index_arrays(spec, qs, ks, at), *consts), spec).astype(
            spec.F
        )
    return s


def _keep(
    spec: Spec,
    aux: Aux,
    qs: jax.Array,
    ks: jax.Array,
    row_floor: Optional[jax.Array],
    key_floor: Optional[jax.Array],
    at: Offsets,
) -> Optional[jax.Array]:
    """Which scores of the chunk count, broadcastable to ``(B, K, G, tq, tk)``; None: all of them.

    ``row_floor``/``key_floor``: rows/keys of the block below these were counted by the chunk
    before (the overlapping last chunk), so they are masked here.
    """
    local_q = (qs + jnp.arange(spec.tq, dtype=jnp.int32))[:, None]
    local_kv = (ks + jnp.arange(spec.tk, dtype=jnp.int32))[None, :]
    q_idx, kv_idx = local_q + at.q, local_kv + at.kv  # global positions
    keep: Optional[jax.Array] = None

    def both(extra: jax.Array) -> jax.Array:
        return extra if keep is None else keep & extra

    if key_floor is not None:
        keep = both(local_kv >= key_floor)
    if row_floor is not None:
        keep = both(local_q >= row_floor)
    if spec.right is not None:
        keep = both(kv_idx <= q_idx + spec.right)
    if spec.left is not None:
        keep = both(kv_idx >= q_idx - spec.left)
    if aux.kv_lengths is not None:
        keep = both(kv_idx[None, None, None] < aux.kv_lengths[:, None, None, None, None])
    if aux.q_lengths is not None:
        keep = both(q_idx[None, None, None] < aux.q_lengths[:, None, None, None, None])
    if aux.mask is not None:
        keep = both(_broadcast_chunk(aux.mask, spec, qs, ks, at))
    if spec.mask_mod is not None:
        mm = spec.mask_mod(*index_arrays(spec, qs, ks, at), *aux.mask_consts)
        keep = both(_from_heads(jnp.asarray(mm, dtype=bool), spec))
    return keep


def _qk(spec: Spec, qc: jax.Array, kc: jax.Array) -> jax.Array:
    """Unscaled ``q k^T`` of one chunk, ``(B, K, G, tq, tk)``."""
    return jnp.einsum("btkgh,bskh->bkgts", qc, kc, preferred_element_type=spec.F)


# ------------------------------------------------------------------ forward
def forward(
    spec: Spec,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    aux: Aux,
    at: Optional[Offsets] = None,
    into: Optional[Tuple[jax.Array, jax.Array]] = None,
) -> Tuple[jax.Array, jax.Array]:
    """``(out (B, T, K, G, Hv) in q's dtype, lse (B, K, G, T) float32)``; rows that see no key: 0, -inf.

    ``at``/``into`` (ring attention): the block sits at ``at`` in longer ``q``/``k``/``v``, and its
    rows are merged by their log-sum-exp into ``into = (out, lse)``, the running result of the
    keys seen so far (float32 or float64), which is returned updated.
    """
    B, T, K, G, Hv, tq, tk = spec.B, spec.T, spec.K, spec.G, spec.Hv, spec.tq, spec.tk
    ragged_keys, ragged_rows = spec.S % tk != 0, spec.T % tq != 0
    place = _place(at)
    shift = place.q - place.kv
    axes = varying_axes(q, k, v, aux, at, into)

    def row_chunk(i: jax.Array, carry: Tuple[jax.Array, jax.Array]) -> Tuple[jax.Array, jax.Array]:
        out, lse = carry
        qs = q_start(spec, i)
        qc = _slice(q, place.rows + qs, tq, 1)

        def key_chunk(j: jax.Array, st: Rows) -> Rows:
            ks = kv_start(spec, j)
            bias_c = None if aux.bias is None else _broadcast_chunk(aux.bias, spec, qs, ks, place)
            s = _modded(
                spec, _qk(spec, qc, _slice(k, place.keys + ks, tk, 1)) * aux.scale, bias_c, aux.consts, qs, ks, place
            )
            keep = _keep(spec, aux, qs, ks, None, j * tk if ragged_keys else None, place)
            if keep is not None:
                s = jnp.where(keep, s, -jnp.inf)
            m_new = jnp.maximum(st.m, s.max(axis=-1))
            shift_m = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet stay at 0
            correction = jnp.exp(st.m - shift_m)
            p = jnp.exp(s - shift_m[..., None])
            l_new = st.l * correction + p.sum(axis=-1)
            vc = _slice(v, place.keys + ks, tk, 1)
            pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), vc, preferred_element_type=spec.F)
            return Rows(m_new, l_new, st.acc * correction[..., None] + pv)

        start = Rows(
            jnp.full((B, K, G, tq), -jnp.inf, spec.F),
            jnp.zeros((B, K, G, tq), spec.F),
            jnp.zeros((B, K, G, tq, Hv), spec.F),
        )
        lo, hi = kv_range(spec, i, shift)
        st = lax.fori_loop(lo, hi, key_chunk, vary(start, axes))
        seen = st.l > 0
        o = jnp.where(seen[..., None], st.acc / jnp.where(seen, st.l, 1.0)[..., None], 0.0)
        rows_lse = jnp.where(seen, st.m + jnp.log(jnp.where(seen, st.l, 1.0)), -jnp.inf)
        o = jnp.moveaxis(o, 3, 1)  # (B, tq, K, G, Hv)
        r0 = place.rows + qs
        if into is not None:
            o, rows_lse = _merge(_slice(out, r0, tq, 1), _slice(lse, r0, tq, 3), o, rows_lse)
            if ragged_rows:  # rows the chunk before already merged keep their value
                fresh = qs + jnp.arange(tq) >= i * tq
                o = jnp.where(fresh[:, None, None, None], o, _slice(out, r0, tq, 1))
                rows_lse = jnp.where(fresh, rows_lse, _slice(lse, r0, tq, 3))
        out = lax.dynamic_update_slice_in_dim(out, o.astype(out.dtype), r0, axis=1)
        lse = lax.dynamic_update_slice_in_dim(lse, rows_lse.astype(lse.dtype), r0, axis=3)
        return out, lse

    first = into
    if first is None:  # (``into`` stays None: row_chunk reads it)
        first = (jnp.zeros((B, T, K, G, Hv), q.dtype), jnp.full((B, K, G, T), -jnp.inf, spec.F))
    result: Tuple[jax.Array, jax.Array] = lax.fori_loop(0, spec.nq, row_chunk, vary(first, axes))
    return result


def _merge(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """Two partial results over disjoint keys, merged exactly: ``out (B, t, K, G, Hv)``, ``lse (B, K, G, t)``."""
    lse = jnp.logaddexp(lse_a, lse_b)
    ref = jnp.where(lse == -jnp.inf, 0.0, lse)  # rows that still see nothing stay 0

    def weight(x: jax.Array) -> jax.Array:
        return jnp.moveaxis(jnp.exp(x - ref), 3, 1)[..., None]

    return out_a * weight(lse_a) + out_b.astype(out_a.dtype) * weight(lse_b), lse


# ------------------------------------------------------------------ backward
Grads = Tuple[
    jax.Array, jax.Array, jax.Array, Optional[jax.Array], Tuple[Optional[jax.Array], ...], Optional[jax.Array]
]
"""``(dq (B, T, K, G, H), dk, dv, dbias, dconsts, dscale)``, float32 (float64); None: not wanted."""


def softmax_terms(
    spec: Spec, out: jax.Array, lse: jax.Array, dout: jax.Array, dlse: Optional[jax.Array]
) -> Tuple[jax.Array, jax.Array]:
    """``delta = rowsum(dO * O) - dlse`` and the lse with ``+inf`` where a row saw nothing (so p = 0).

    ``dlse`` None: the lse's cotangent is zero. d lse / d score = p, so an lse cotangent adds
    ``p * dlse`` to the score gradient.
    """
    # delta = rowsum(dO * O) = sum_j p_ij dp_ij; an lse cotangent enters with the opposite sign.
    delta = jnp.einsum("btkgd,btkgd->bkgt", dout.astype(spec.F), out.astype(spec.F))
    if dlse is not None:
        delta = delta - jnp.where(lse == -jnp.inf, 0.0, dlse)
    return delta, jnp.where(lse == -jnp.inf, jnp.inf, lse)


def backward_block(
    spec: Spec,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    aux: Aux,
    dout: jax.Array,
    delta: jax.Array,
    live_lse: jax.Array,
    grads: Grads,
    at: Optional[Offsets] = None,
) -> Grads:
    """FlashAttention-2: for each key chunk, for each row chunk that sees it, recompute the
    probabilities from the saved lse and add to ``grads`` the block's ``dq`` (rows), ``dk``/``dv``
    (keys, accumulated per key chunk), and the gradients of the bias and of the score_mod's
    captured arrays. ``at`` places the block in longer arrays (ring attention), as in :func:`forward`.
    """
    tq, tk, K, H, Hv = spec.tq, spec.tk, spec.K, spec.H, spec.Hv
    ragged_rows, ragged_keys = spec.T % tq != 0, spec.S % tk != 0
    place = _place(at)
    shift = place.q - place.kv
    consts = aux.consts
    want_scale = grads[5] is not None
    axes = varying_axes(q, k, v, aux, dout, delta, grads, at)

    def key_chunk(j: jax.Array, carry: Grads) -> Grads:
        dq, dk, dv, dbias, dconsts, dscale = carry
        ks = kv_start(spec, j)
        kc, vc = _slice(k, place.keys + ks, tk, 1), _slice(v, place.keys + ks, tk, 1)

        def row_chunk(i: jax.Array, c: Tuple[Any, ...]) -> Tuple[Any, ...]:
            dq, dkc, dvc, dbias, dconsts, dscale = c
            qs = q_start(spec, i)
            r0 = place.rows + qs
            qc, doc = _slice(q, r0, tq, 1), _slice(dout, r0, tq, 1)
            bias_c = None if aux.bias is None else _broadcast_chunk(aux.bias, spec, qs, ks, place)
            raw = _qk(spec, qc, kc)
            s, pullback = jax.vjp(
                lambda s0, b0, c0: _modded(spec, s0, b0, c0, qs, ks, place), raw * aux.scale, bias_c, consts
            )
            p = jnp.exp(s - _slice(live_lse, r0, tq, 3)[..., None])
            keep = _keep(spec, aux, qs, ks, i * tq if ragged_rows else None, j * tk if ragged_keys else None, place)
            if keep is not None:
                p = jnp.where(keep, p, 0.0)
            dvc = dvc + jnp.einsum("bkgts,btkgd->bskd", p.astype(v.dtype), doc, preferred_element_type=spec.F)
            dp = jnp.einsum("btkgd,bskd->bkgts", doc, vc, preferred_element_type=spec.F)
            ds = p * (dp - _slice(delta, r0, tq, 3)[..., None])
            ds_pre, dbias_c, dconsts_c = pullback(ds)
            if want_scale:
                dscale = dscale + (ds_pre * raw).sum()
            ds_pre = (ds_pre * aux.scale).astype(q.dtype)
            dq = _add_at(dq, jnp.einsum("bkgts,bskh->btkgh", ds_pre, kc, preferred_element_type=spec.F), {1: r0})
            dkc = dkc + jnp.einsum("bkgts,btkgh->bskh", ds_pre, qc, preferred_element_type=spec.F)
            if dbias is not None:
                # The chunk's gradient is already reduced to the bias's broadcast dims.
                at_rows = r0 if dbias.shape[3] != 1 else 0
                at_cols = place.kv + ks if dbias.shape[4] != 1 else 0
                dbias = _add_at(dbias, dbias_c, {3: at_rows, 4: at_cols})
            dconsts = tuple(None if a is None else a + d.astype(a.dtype) for a, d in zip(dconsts, dconsts_c))
            return dq, dkc, dvc, dbias, dconsts, dscale

        lo, hi = q_range(spec, j, shift)
        chunk = vary((jnp.zeros((spec.B, tk, K, H), spec.F), jnp.zeros((spec.B, tk, K, Hv), spec.F)), axes)
        dq, dkc, dvc, dbias, dconsts, dscale = lax.fori_loop(lo, hi, row_chunk, (dq, *chunk, dbias, dconsts, dscale))
        # Keys of an overlapping last chunk that the chunk before counted got zero here: adding is exact.
        k0 = place.keys + ks
        return dq, _add_at(dk, dkc, {1: k0}), _add_at(dv, dvc, {1: k0}), dbias, dconsts, dscale

    result: Grads = lax.fori_loop(0, spec.nk, key_chunk, vary(grads, axes))
    return result


# ------------------------------------------------------------------ the differentiable op
def zero_or_none(x: Any) -> Any:
    return None if isinstance(x, SymbolicZero) else x


def perturbed(aux: Any) -> Tuple[Aux, Tuple[Any, ...]]:
    """A custom VJP's ``aux`` (with ``symbolic_zeros``) as values, and which parts are differentiated.

    Which of bias, scale and the captured arrays are differentiated decides, statically, what the
    backward accumulates: a full-size bias gradient is T x S, never built unless asked for. The
    flags travel as residuals (an array, or None).
    """
    values = Aux._make(getattr(a, "value", a) if not isinstance(a, tuple) else tuple(c.value for c in a) for a in aux)
    want_bias = aux.bias is not None and aux.bias.perturbed
    want_consts = tuple(jnp.zeros(()) if c.perturbed else None for c in aux.consts)
    flags = (jnp.zeros(()) if want_bias else None, want_consts, jnp.zeros(()) if aux.scale.perturbed else None)
    return values, flags


def wanted_grads(spec: Spec, aux: Aux, flags: Tuple[Any, ...], dq_shape: Any, dk_shape: Any, dv_shape: Any) -> Grads:
    """Zero accumulators for the gradients the flags of :func:`perturbed` ask for (None for the others)."""
    bias_flag, consts_flags, scale_flag = flags
    dbias = jnp.zeros(spec.bias_shape, spec.F) if bias_flag is not None and spec.bias_shape is not None else None
    dconsts = tuple(
        jnp.zeros(c.shape, jnp.promote_types(c.dtype, spec.F)) if f is not None else None
        for c, f in zip(aux.consts, consts_flags)
    )
    dq, dk, dv = (jnp.zeros(shape, spec.F) for shape in (dq_shape, dk_shape, dv_shape))
    return dq, dk, dv, dbias, dconsts, jnp.zeros((), spec.F) if scale_flag is not None else None


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(
    spec: Spec, q: jax.Array, k: jax.Array, v: jax.Array, aux: Aux, head: Any = 0
) -> Tuple[jax.Array, jax.Array]:
    """The differentiable call; ``head``: the global index of head 0 for the callbacks (all-to-all)."""
    return forward(spec, q, k, v, aux, _heads_at(head))


def _heads_at(head: Any) -> Optional[Offsets]:
    return None if isinstance(head, int) and head == 0 else Offsets(0, 0, 0, 0, head)


def _attention_fwd(spec: Spec, q: Any, k: Any, v: Any, aux: Any, head: Any) -> Tuple[Any, Any]:
    aux_v, flags = perturbed(aux)
    head = getattr(head, "value", head)
    out, lse = forward(spec, q.value, k.value, v.value, aux_v, _heads_at(head))
    return (out, lse), (q.value, k.value, v.value, aux_v, out, lse, flags, head)


def _attention_bwd(spec: Spec, res: Any, cts: Any) -> Tuple[Any, ...]:
    q, k, v, aux, out, lse, flags, head = res
    dout, dlse = (zero_or_none(c) for c in cts)
    if dout is None:
        dout = jnp.zeros(out.shape, out.dtype)
    delta, live_lse = softmax_terms(spec, out, lse, dout, dlse)
    grads = vary(wanted_grads(spec, aux, flags, q.shape, k.shape, v.shape), varying_axes(q, k, v, aux, delta, dout))
    grads = backward_block(spec, q, k, v, aux, dout, delta, live_lse, grads, _heads_at(head))
    return (*cotangents(q, k, v, aux, grads), None)


def cotangents(q: jax.Array, k: jax.Array, v: jax.Array, aux: Aux, grads: Grads) -> Tuple[Any, ...]:
    """The gradients as a custom VJP returns them: each in its primal's dtype and (under
    ``shard_map``) its type, summed over the devices for an array that they all hold alike."""
    dq, dk, dv, dbias, dconsts, dscale = grads
    # Aux's structure with None where nothing is differentiated (a cotangent, not values).
    daux = Aux._make(
        (
            None if dbias is None or aux.bias is None else match(dbias.astype(aux.bias.dtype), aux.bias),
            None,
            None,
            None,
            tuple(None if d is None else match(d.astype(c.dtype), c) for d, c in zip(dconsts, aux.consts)),
            tuple(None for _ in aux.mask_consts),
            None if dscale is None else match(dscale, aux.scale),
        )
    )
    return (
        match(dq.astype(q.dtype).reshape(q.shape), q),
        match(dk.astype(k.dtype), k),
        match(dv.astype(v.dtype), v),
        daux,
    )


attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
