"""One ``subquad.jax`` call: validated, its callbacks converted, its chunks chosen by the memory model.

Used by the rest of ``subquad.jax``: ``prepare`` (keyword-only after the arrays) -> ``Call``
(``run()``), ``memory_model``, ``grouped_4d``, ``DtypeError``, ``DEFAULT_CHUNKS``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, FrozenSet, Optional, Tuple, Union

import jax
import jax.numpy as jnp

from .._budget import format_bytes, parse_budget
from .._errors import ArgumentError, ArgumentTypeError, MemoryBudgetError
from . import _engine
from ._engine import Aux, Spec
from ._vma import vary, varying_axes


class DtypeError(ArgumentTypeError, ValueError):
    """A wrong dtype: a ``TypeError`` (and ``RuntimeError``) as in subquad's PyTorch API, and a
    ``ValueError`` as ``jax.nn.dot_product_attention`` raises it, so either ``except`` works."""


ChunkSize = Union[int, Tuple[int, int]]
Budget = Union[int, str]

DEFAULT_CHUNKS = (256, 512)
"""(query rows, keys) per chunk without a budget: the fastest on the CPUs measured (docs/jax.md)."""

_SMALLEST_CHUNK = 16


class Call:
    """One validated call: the static spec, the grouped arrays, and the memory model's figures."""

    def __init__(
        self, spec: Spec, q: Any, k: Any, v: Any, aux: Aux, squeeze: bool, dtype: Any, budget: Optional[int]
    ) -> None:
        self.spec, self.q_grouped, self.k, self.v_grouped, self.aux = spec, q, k, v, aux
        self.squeeze, self.dtype, self.budget = squeeze, dtype, budget
        self.forward_bytes = memory_model(spec, dtype, need_grad=False)
        self.backward_bytes = memory_model(spec, dtype, need_grad=True, bias_grad=spec.bias_shape is not None)

    def run(self, head: Any = 0) -> Tuple[Any, Any]:
        """``(out (B, T, N, Hv), lse (B, T, N))``; ``head``: the global index of head 0 (all-to-all)."""
        s = self.spec
        N = s.K * s.G
        if s.B * s.T * N * s.Hv == 0 or s.S == 0:
            out = jnp.zeros((s.B, s.T, N, s.Hv), self.dtype)
            lse = jnp.full((s.B, s.T, N), -jnp.inf, s.F)
        else:
            out5, lse4 = _engine.attention(s, self.q_grouped, self.k, self.v_grouped, self.aux, head)
            out = out5.reshape(s.B, s.T, N, s.Hv)
            lse = jnp.moveaxis(lse4.reshape(s.B, N, s.T), 1, 2)
        if self.squeeze:
            out, lse = out[0], lse[0]
        return out, lse

    def padding_rows(self) -> Optional[Any]:
        if self.aux.q_lengths is None:
            return None
        rows = jnp.arange(self.spec.T)[None, :] >= self.aux.q_lengths[:, None]
        rows = rows[..., None]
        return rows[0] if self.squeeze else rows

    def skipped_fraction(self) -> float:
        s = self.spec
        if s.nq == 0 or s.nk == 0:
            return 0.0
        lo, hi = _engine.kv_range(s, jnp.arange(s.nq, dtype=jnp.int32))  # all row chunks at once
        visible = jnp.broadcast_to(jnp.maximum(hi - lo, 0), (s.nq,)).sum()
        return 1.0 - int(visible) / (s.nq * s.nk)


def memory_model(spec: Spec, dtype: Any, need_grad: bool, bias_grad: bool = False) -> int:
    """Predicted temporary bytes of the compiled program (beyond its arguments and outputs).

    Per chunk: the ``(B, N, tq, tk)`` float32 scores and what is computed from them (XLA keeps a
    few such arrays alive at once: ``FWD_TILES`` in the forward, ``BWD_TILES`` in the backward,
    measured with ``memory_analysis()`` on CPU), the row state and the chunk slices. Per call: the
    float32 lse, and for the backward float32 ``dq``, ``dk``, ``dv``, ``delta`` and the saved
    output, plus a float32 bias gradient when the bias has one.
    """
    B, N, T, S, H, Hv, tq, tk = spec.B, spec.K * spec.G, spec.T, spec.S, spec.H, spec.Hv, spec.tq, spec.tk
    item: int = jnp.dtype(dtype).itemsize
    tile = 4 * B * N * tq * tk
    rows = 4 * B * N * tq * (Hv + 2) + item * B * (tq * N * H + 2 * tk * spec.K * (H + Hv))
    per_call = 4 * B * N * T * 2
    if not need_grad:
        return FWD_TILES * tile + 2 * rows + per_call + OVERHEAD
    grads = 4 * B * (T * N * (H + Hv) + S * spec.K * (H + Hv)) + 4 * B * N * T * 2
    if bias_grad and spec.bias_shape is not None:
        grads += 4 * math.prod(spec.bias_shape)
    return max(FWD_TILES * tile + 2 * rows + per_call, BWD_TILES * tile + 4 * rows + grads) + per_call + OVERHEAD


FWD_TILES = 3
BWD_TILES = 6
OVERHEAD = 1 << 16


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import operator

            return operator.index(value)
        except TypeError:
            raise ArgumentTypeError(f"Expected {name} to be an int, got {value!r}.") from None
    return value


def _chunks(chunk_size: Optional[ChunkSize]) -> Optional[Tuple[int, int]]:
    if chunk_size is None:
        return None
    pair = (chunk_size, chunk_size) if not isinstance(chunk_size, (tuple, list)) else tuple(chunk_size)
    if len(pair) != 2:
        raise ArgumentError(f"Expected chunk_size to be an int or a pair (query rows, keys), got {chunk_size!r}.")
    tq, tk = (_as_int(c, "chunk_size") for c in pair)
    if tq < 1 or tk < 1:
        raise ArgumentError(f"Expected chunk_size >= 1, got {chunk_size!r}.")
    return tq, tk


def _window(local_window_size: Any) -> Optional[Tuple[int, int]]:
    if local_window_size is None:
        return None
    if isinstance(local_window_size, (tuple, list)):
        if len(local_window_size) != 2:
            raise ArgumentError(f"Expected local_window_size to be an int or (left, right), got {local_window_size!r}.")
        left, right = (_as_int(w, "local_window_size") for w in local_window_size)
    else:
        left = right = _as_int(local_window_size, "local_window_size")
    return left, right


def grouped_4d(x: Any, name: str, full: Tuple[int, int, int, int], K: int, G: int) -> Any:
    """Broadcastable ``(B, N, T, S)`` -> grouped 5-D ``(Bb, Kb, Gb, Tb, Sb)``, without copying."""
    if x.ndim > 4:
        raise ArgumentError(f"Expected {name} to have at most 4 dims (B, N, T, S), got shape {tuple(x.shape)}.")
    x = x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))
    for size, want, letter in zip(x.shape, full, "BNTS"):
        if size not in (1, want):
            raise ArgumentError(
                f"Expected {name} to broadcast to (B, N, T, S) = {full}: its {letter} dim is {size}, "
                f"needs 1 or {want} (shape {tuple(x.shape)})."
            )
    Bb, Nb, Tb, Sb = x.shape
    return x.reshape(Bb, K, G, Tb, Sb) if Nb != 1 else x.reshape(Bb, 1, 1, Tb, Sb)


def _lengths(x: Any, name: str, B: int) -> Optional[Any]:
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.shape != (B,) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ArgumentError(
            f"Expected {name} to be an int array of shape (B,) = ({B},), got {x.dtype} {tuple(x.shape)}."
        )
    return x.astype(jnp.int32)


def _convert(fn: Callable[..., Any], axes: FrozenSet[Any], *example: Any) -> Tuple[Callable[..., Any], Tuple[Any, ...]]:
    """Hoist every array a callback closes over into explicit trailing arguments.

    Under ``jit`` or ``grad`` those arrays are tracers of the caller's trace; the custom_vjp must
    receive them as arguments (float ones get gradients, integer ones such as document ids just
    travel). ``jax.closure_convert`` hoists only float tracers, so the callback is traced here
    into a jaxpr whose constants are all hoisted.

    Under ``shard_map`` a jaxpr replays with exactly the types it was traced with, so the chunk's
    arguments are traced and passed as varying over ``axes`` (the call's mesh axes).
    """
    closed = jax.make_jaxpr(fn)(*vary(example, axes))
    jaxpr, consts = closed.jaxpr, tuple(closed.consts)
    n_args = len(example)

    def converted(*args: Any) -> Any:
        return _eval_jaxpr(jaxpr, args[n_args:], *vary(args[:n_args], axes))[0]

    return converted, consts


def _eval_jaxpr(jaxpr: Any, consts: Any, *args: Any) -> Any:
    evaluate: Any = getattr(jax.core, "eval_jaxpr", None)
    if evaluate is None:  # pragma: no cover - newer JAX keeps it private
        from jax._src.core import eval_jaxpr as evaluate
    return evaluate(jaxpr, consts, *args)


def _choose_chunks(
    T: int,
    S: int,
    forced: Optional[Tuple[int, int]],
    budget: Optional[int],
    make: Callable[[int, int], Spec],
    dtype: Any,
    need_bias_grad: bool,
) -> Spec:
    def fits(spec: Spec) -> bool:
        return budget is None or memory_model(spec, dtype, need_grad=True, bias_grad=need_bias_grad) <= budget

    if forced is not None:
        spec = make(min(forced[0], T), min(forced[1], S))
        if not fits(spec):
            need = memory_model(spec, dtype, need_grad=True, bias_grad=need_bias_grad)
            raise MemoryBudgetError(
                f"chunk_size={forced} needs about {format_bytes(need)} of temporaries for the forward and backward, "
                f"memory_budget is {format_bytes(budget or 0)}; pass a smaller chunk_size or leave it to the budget."
            )
        return spec
    tq, tk = min(DEFAULT_CHUNKS[0], T), min(DEFAULT_CHUNKS[1], S)
    while True:
        spec = make(tq, tk)
        if fits(spec):
            return spec
        if (tq <= _SMALLEST_CHUNK and tk <= _SMALLEST_CHUNK) or (tq == 1 and tk == 1):
            smallest = make(min(_SMALLEST_CHUNK, T), min(_SMALLEST_CHUNK, S))
            need = memory_model(smallest, dtype, need_grad=True, bias_grad=need_bias_grad)
            raise MemoryBudgetError(
                f"memory_budget={format_bytes(budget or 0)} is too small: even {smallest.tq}x{smallest.tk} chunks need "
                f"about {format_bytes(need)} (the float32 gradients and per-row statistics alone grow with T and S)."
            )
        if (tk >= tq and tk > _SMALLEST_CHUNK) or tq <= _SMALLEST_CHUNK:
            tk = max(1, tk // 2)
        else:
            tq = max(1, tq // 2)


def prepare(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    scale: Any = None,
    is_causal: Any = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    chunk_size: Any = None,
    memory_budget: Any = None,
    mesh_axes: FrozenSet[Any] = frozenset(),
) -> Call:
    """Validate a call (errors name the argument), convert its callbacks, choose its chunks.

    ``mesh_axes`` (ring and all-to-all attention): mesh axes that the chunks' positions vary over
    beyond the inputs' (the callbacks are traced with that type).
    """
    q, k, v, squeeze = _arrays(query, key, value)
    B, T, N, H = q.shape
    _, S, K, Hv = v.shape
    G = N // K if K else 1
    stats = jnp.promote_types(q.dtype, jnp.float32)
    scale = _scale(scale, H, stats)
    left, right = _band(is_causal, local_window_size)
    bias, mask = _bias_and_mask(bias, mask, (B, N, T, S), K, G)
    q_lengths = _lengths(query_seq_lengths, "query_seq_lengths", B)
    kv_lengths = _lengths(key_value_seq_lengths, "key_value_seq_lengths", B)
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise ArgumentTypeError(f"Expected {name} to be callable, got {type(fn).__name__}.")
    budget = None if memory_budget is None else parse_budget(memory_budget)
    forced = _chunks(chunk_size)

    def make(tq: int, tk: int, score: Any = None, masker: Any = None) -> Spec:
        return Spec(
            B=B,
            T=T,
            S=S,
            K=K,
            G=G,
            H=H,
            Hv=Hv,
            tq=max(tq, 0),
            tk=max(tk, 0),
            left=left,
            right=right,
            bias_shape=None if bias is None else tuple(bias.shape),
            score_mod=score,
            mask_mod=masker,
            stats=str(stats),
        )

    need_bias_grad = bias is not None  # a bias's gradient is built only when asked for; plan for it
    spec = _choose_chunks(T, S, forced, budget, make, q.dtype, need_bias_grad) if T * S > 0 else make(T, S)
    consts: Tuple[Any, ...] = ()
    mask_consts: Tuple[Any, ...] = ()
    score_fn = masker_fn = None
    if spec.tq > 0 and spec.tk > 0:
        index = _engine.index_arrays(spec, jnp.int32(0), jnp.int32(0))
        axes = varying_axes(q, k, v, bias, mask, scale) | frozenset(mesh_axes)
        if score_mod is not None:
            example = jnp.zeros((B, N, spec.tq, spec.tk), spec.F)
            score_fn, consts = _convert(_checked_score_mod(score_mod, example.shape), axes, example, *index)
        if mask_mod is not None:
            masker_fn, mask_consts = _convert(_checked_mask_mod(mask_mod, (B, N, spec.tq, spec.tk)), axes, *index)
    spec = make(spec.tq, spec.tk, score_fn, masker_fn)
    aux = Aux(bias, mask, q_lengths, kv_lengths, consts, mask_consts, scale)
    return Call(spec, q.reshape(B, T, K, G, H), k, v, aux, squeeze, q.dtype, budget)


def _arrays(query: Any, key: Any, value: Any) -> Tuple[Any, Any, Any, bool]:
    """``query``, ``key`` and ``value`` as ``(B, T, N, H)``, ``(B, S, K, H)``, ``(B, S, K, Hv)``
    arrays of one floating dtype, N a multiple of K, and whether they came without B."""
    arrays = []
    for name, x in (("query", query), ("key", key), ("value", value)):
        try:
            x = jnp.asarray(x)
        except TypeError:
            raise ArgumentTypeError(f"Expected {name} to be an array, got {type(x).__name__}.") from None
        arrays.append(x)
    q, k, v = arrays
    if q.ndim not in (3, 4) or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ArgumentError(
            f"Expected query, key and value to be (B, T, N, H), (B, S, K, H), (B, S, K, Hv) or without B, all with the "
            f"same number of dims; got query {tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}."
        )
    for name, x in (("query", q), ("key", k), ("value", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise DtypeError(f"Expected {name} to have a floating dtype, got {x.dtype}.")
    if not (q.dtype == k.dtype == v.dtype):
        raise DtypeError(f"Expected query, key and value to have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    squeeze = q.ndim == 3
    if squeeze:
        q, k, v = q[None], k[None], v[None]
    B, _, N, H = q.shape
    K = k.shape[2]
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[3] != H:
        raise ArgumentError(
            f"Expected key (B, S, K, H) and value (B, S, K, Hv) to match query (B, T, N, H) = {tuple(q.shape)}; "
            f"got key {tuple(k.shape)}, value {tuple(v.shape)}."
        )
    if (K == 0 and N != 0) or (K != 0 and N % K != 0):
        raise ArgumentError(f"The number of query heads must be a multiple of key/value heads, got N={N} and K={K}.")
    return q, k, v, squeeze


def _scale(scale: Any, H: int, stats: Any) -> Any:
    """``scale`` (default ``1/sqrt(H)``) as a 0-d array of the statistics' dtype: under jit it may
    be a tracer, under grad it gets a gradient."""
    if scale is None:
        scale = 1.0 / math.sqrt(H) if H > 0 else 1.0
    if isinstance(scale, bool) or not (isinstance(scale, (int, float)) or getattr(scale, "shape", None) == ()):
        raise ArgumentTypeError(f"Expected scale to be a float, a 0-d array (it may be traced) or None, got {scale!r}.")
    return jnp.asarray(scale, stats)


def _band(is_causal: Any, local_window_size: Any) -> Tuple[Optional[int], Optional[int]]:
    """``(left, right)``: how far before and after its own position a query sees (None: no
    limit), from ``local_window_size`` and ``is_causal``."""
    if not isinstance(is_causal, bool):
        raise ArgumentTypeError(f"Expected is_causal to be a bool, got {is_causal!r}.")
    window = _window(local_window_size)
    left = None if window is None else window[0]
    right = None if window is None else window[1]
    if is_causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _bias_and_mask(
    bias: Any, mask: Any, full: Tuple[int, int, int, int], K: int, G: int
) -> Tuple[Optional[Any], Optional[Any]]:
    """A floating ``bias`` and a bool ``mask`` (None: none) checked and grouped (:func:`grouped_4d`)."""
    if bias is not None:
        bias = jnp.asarray(bias)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise DtypeError(f"Expected bias to have a floating dtype (use mask for bool), got {bias.dtype}.")
        bias = grouped_4d(bias, "bias", full, K, G)
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise DtypeError(f"Expected mask to be bool (True = attend; additive masks go in bias), got {mask.dtype}.")
        mask = grouped_4d(mask, "mask", full, K, G)
    return bias, mask


def _checked_score_mod(fn: Callable[..., Any], shape: Tuple[int, ...]) -> Callable[..., Any]:
    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        out = jnp.asarray(fn(score, b, h, q_idx, kv_idx))
        try:
            return jnp.broadcast_to(out, shape)
        except ValueError:
            raise ArgumentError(
                f"score_mod returned shape {tuple(out.shape)}, which does not broadcast to the chunk's scores {shape} "
                "(B, N, tq, tk); index with the b, h, q_idx, kv_idx arrays it receives."
            ) from None

    return score_mod


def _checked_mask_mod(fn: Callable[..., Any], shape: Tuple[int, ...]) -> Callable[..., Any]:
    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        out = jnp.asarray(fn(b, h, q_idx, kv_idx))
        if out.dtype != jnp.bool_:
            raise ArgumentTypeError(f"mask_mod must return bool (True = attend), got {out.dtype}.")
        try:
            return jnp.broadcast_to(out, shape)
        except ValueError:
            raise ArgumentError(
                f"mask_mod returned shape {tuple(out.shape)}, which does not broadcast to the chunk {shape} (B, N, tq, tk)."
            ) from None

    return mask_mod
