"""Sharded calls: ring and all-to-all attention inside ``shard_map``, and the mesh wrapper around them.

Used by the rest of ``subquad.jax``: ``ring_attention``, ``ulysses_attention``, ``mesh_attention``,
``mesh_plan``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from .._errors import ArgumentError, ArgumentTypeError
from ._all_to_all import heads_to_seq, seq_to_heads
from ._call import DtypeError, grouped_4d, prepare
from ._engine import Aux
from ._layouts import check_divisible, check_layout, piece_count, reorder
from ._plan import (
    STRATEGIES,
    Shapes,
    ShardedPlan,
    choose,
    ring_memory,
    ring_steps,
    stats_itemsize,
    traffic,
    ulysses_memory,
)
from ._ring import Ring, ring

shard_map: Any = getattr(jax, "shard_map", None)
if shard_map is None:  # pragma: no cover - JAX before 0.6 keeps it in experimental
    from jax.experimental.shard_map import shard_map


def _axis_size(axis_name: Any, fn: str) -> int:
    try:
        if hasattr(lax, "axis_size"):
            return int(lax.axis_size(axis_name))
        return int(lax.psum(1, axis_name))  # JAX before 0.6: a constant under shard_map
    except (NameError, KeyError, ValueError, TypeError):
        raise ArgumentError(
            f"{fn} runs inside jax.shard_map over a mesh axis: axis_name={axis_name!r} is not bound here. "
            "Call it inside shard_map, or pass mesh= to subquad.jax.attention with globally sharded arrays."
        ) from None


def _four_d(query: Any, key: Any, value: Any) -> Tuple[Any, Any, Any, bool]:
    q, k, v = (jnp.asarray(x) for x in (query, key, value))
    squeeze = q.ndim == 3 and k.ndim == 3 and v.ndim == 3
    if squeeze:
        q, k, v = q[None], k[None], v[None]
    return q, k, v, squeeze


def _rows_and_columns(x: Any, name: str, full: Tuple[int, int, int, int], K: int, G: int, kind: str) -> Any:
    if x is None:
        return None
    x = jnp.asarray(x)
    if kind == "bias" and not jnp.issubdtype(x.dtype, jnp.floating):
        raise DtypeError(f"Expected bias to have a floating dtype (use mask for bool), got {x.dtype}.")
    if kind == "mask" and x.dtype != jnp.bool_:
        raise DtypeError(f"Expected mask to be bool (True = attend; additive masks go in bias), got {x.dtype}.")
    return grouped_4d(x, name, full, K, G)


def ring_setup(
    query: Any,
    key: Any,
    value: Any,
    *,
    P: int,
    axis_name: Any,
    is_causal: Any,
    bias: Any,
    mask: Any,
    score_mod: Any,
    mask_mod: Any,
    scale: Any,
    layout: Any,
    chunk_size: Any,
    memory_budget: Any,
    mesh_axes: Any = None,
) -> Tuple[Ring, Any, Any, Any, Aux, bool]:
    """Validate a ring call on this device's shards and describe it (the static ``Ring``)."""
    layout = check_layout(layout)
    q, k, v, squeeze = _four_d(query, key, value)
    # The whole shards first, so that errors show the shapes that were passed.
    whole = prepare(q, k, v, scale=scale, is_causal=is_causal)
    B, T, N, _ = q.shape
    S, K, G = k.shape[1], whole.spec.K, whole.spec.G
    check_divisible(layout, T * P, P, "query's sequence (all shards)")
    check_divisible(layout, S * P, P, "key's sequence (all shards)")
    runs = piece_count(layout)
    tq, tk = T // runs, S // runs
    # One block: a run of this device's rows x a run of some device's keys, at global positions.
    block = prepare(
        q[:, :tq],
        k[:, :tk],
        v[:, :tk],
        scale=scale,
        is_causal=is_causal,
        score_mod=score_mod,
        mask_mod=mask_mod,
        chunk_size=chunk_size,
        memory_budget=memory_budget,
        mesh_axes=frozenset([axis_name]) if mesh_axes is None else mesh_axes,
    )
    bias_g = _rows_and_columns(bias, "bias", (B, N, T, S * P), K, G, "bias")
    mask_g = _rows_and_columns(mask, "mask", (B, N, T, S * P), K, G, "mask")
    spec = dataclasses.replace(block.spec, bias_shape=None if bias_g is None else tuple(bias_g.shape))
    aux = block.aux._replace(bias=bias_g, mask=mask_g)
    return Ring(spec, axis_name, P, layout, T, S), q, k, v, aux, squeeze


def _finish(out5: Any, lse4: Any, B: int, T: int, N: int, Hv: int, squeeze: bool) -> Tuple[Any, Any]:
    out = out5.reshape(B, T, N, Hv)
    lse = jnp.moveaxis(lse4.reshape(B, N, T), 1, 2)
    return (out[0], lse[0]) if squeeze else (out, lse)


def ring_attention(query: Any, key: Any, value: Any, *, axis_name: Any, **options: Any) -> Tuple[Any, Any]:
    """``(out, lse)`` of this device's rows (inside ``shard_map``), K/V shards passed around the ring."""
    P = _axis_size(axis_name, "ring_attention")
    r, q, k, v, aux, squeeze = ring_setup(query, key, value, P=P, axis_name=axis_name, **options)
    s = r.spec
    out5, lse4 = ring(r, q, k, v, aux)
    return _finish(out5, lse4, s.B, r.T, s.K * s.G, s.Hv, squeeze)


def ulysses_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    axis_name: Any,
    is_causal: Any,
    score_mod: Any,
    mask_mod: Any,
    scale: Any,
    layout: Any,
    chunk_size: Any,
    memory_budget: Any,
) -> Tuple[Any, Any]:
    """``(out, lse)`` of this device's rows (inside ``shard_map``) through two all-to-alls over heads."""
    P = _axis_size(axis_name, "ulysses_attention")
    layout = check_layout(layout)
    q, k, v, squeeze = _four_d(query, key, value)
    prepare(q, k, v, scale=scale, is_causal=is_causal)  # validation first: errors show the shapes that were passed
    N, K = q.shape[2], k.shape[2]
    if N % P or K % P:
        raise ArgumentError(
            f"ulysses_attention shards the heads over the {P} devices of axis {axis_name!r}: query heads N={N} and "
            f"key/value heads K={K} must both be multiples of {P}. Use ring_attention."
        )
    check_divisible(layout, q.shape[1] * P, P, "query's sequence (all shards)")
    check_divisible(layout, k.shape[1] * P, P, "key's sequence (all shards)")
    qh, kh, vh = (seq_to_heads(x, axis_name, P, layout) for x in (q, k, v))
    call = prepare(
        qh,
        kh,
        vh,
        scale=scale,
        is_causal=is_causal,
        score_mod=score_mod,
        mask_mod=mask_mod,
        chunk_size=chunk_size,
        memory_budget=memory_budget,
        mesh_axes=frozenset([axis_name]),
    )
    out, lse = call.run(head=lax.axis_index(axis_name) * (N // P))
    out = heads_to_seq(out, axis_name, P, layout)
    lse = heads_to_seq(lse[..., None], axis_name, P, layout)[..., 0]
    return (out[0], lse[0]) if squeeze else (out, lse)


# ------------------------------------------------------------------ the mesh wrapper
def _mesh_axis(mesh: Any, axis_name: Any) -> Tuple[Any, int]:
    names = getattr(mesh, "axis_names", None)
    if names is None or not hasattr(mesh, "shape"):
        raise ArgumentTypeError(f"Expected mesh to be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if axis_name is None:
        if len(names) != 1:
            raise ArgumentError(
                f"mesh has axes {tuple(names)}: pass axis_name= to say which one the sequence is sharded over."
            )
        axis_name = names[0]
    if axis_name not in names:
        raise ArgumentError(f"axis_name={axis_name!r} is not an axis of the mesh, whose axes are {tuple(names)}.")
    return axis_name, int(mesh.shape[axis_name])


def _layout_for(layout: Any, strategy: str, is_causal: bool) -> str:
    """The wrapper's arrays are in global order, so its shards are contiguous; the ring reorders
    them to zigzag (two ppermutes each way) where that balances causal work, or when asked to."""
    checked = None if layout is None else check_layout(layout)
    if strategy != "ring":
        return "contiguous"
    if checked is None:
        return "zigzag" if is_causal else "contiguous"
    return checked


def _shapes(query: Any, key: Any, value: Any, P: int) -> Shapes:
    q, k, v = (x if getattr(x, "ndim", 0) == 4 else jnp.asarray(x)[None] for x in (query, key, value))
    if not (q.ndim == k.ndim == v.ndim == 4):
        raise ArgumentError(
            f"Expected query, key and value to be (B, T, N, H), (B, S, K, H), (B, S, K, Hv), got {q.shape}, {k.shape}, {v.shape}."
        )
    B, T, N, H = q.shape
    return Shapes(
        B, T, k.shape[1], N, k.shape[2], H, v.shape[3], P, jnp.dtype(q.dtype).itemsize, stats_itemsize(q.dtype)
    )


def mesh_plan(
    query: Any,
    key: Any,
    value: Any,
    bias: Any,
    mask: Any,
    *,
    mesh: Any,
    axis_name: Any,
    strategy: Any,
    layout: Any,
    is_causal: Any,
    score_mod: Any,
    mask_mod: Any,
    scale: Any,
    chunk_size: Any,
    memory_budget: Any,
) -> ShardedPlan:
    """The strategy of a mesh call and each device's memory and bytes, from shapes alone."""
    axis_name, P = _mesh_axis(mesh, axis_name)
    s = _shapes(query, key, value, P)
    if strategy not in STRATEGIES:
        choose(s, strategy, False, False, False)  # raises, naming the strategies
    zigzag_if_ring = _layout_for(layout, "ring", bool(is_causal)) == "zigzag"
    chosen, rejected = choose(s, strategy, bias is not None, mask is not None, zigzag_if_ring)
    lay = _layout_for(layout, chosen, bool(is_causal))
    for name, n in (("query", s.T), ("key", s.S)):
        check_divisible(lay, n, P, f"{name}'s sequence ({n})")
    dtype = query.dtype
    shard = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    options = dict(
        is_causal=is_causal,
        score_mod=score_mod,
        mask_mod=mask_mod,
        scale=scale,
        chunk_size=chunk_size,
        memory_budget=memory_budget,
    )
    found: dict = {}

    def single(q: Any, k: Any, v: Any) -> Any:
        found["single"] = prepare(q, k, v, **options)
        return q

    jax.eval_shape(single, shard(s.B, s.T, s.N, s.H), shard(s.B, s.S, s.K, s.H), shard(s.B, s.S, s.K, s.Hv))
    single_bytes = (found["single"].forward_bytes, found["single"].backward_bytes)
    if chosen == "ring":
        fwd, bwd, steps, chunks = _ring_plan(s, P, axis_name, lay, options, bias, dtype)
    else:
        fwd, bwd, steps, chunks = _heads_plan(s, P, options, dtype)
    sent = traffic(s, chosen, chosen == "ring" and lay == "zigzag")
    return ShardedPlan(chosen, P, axis_name, lay, fwd, bwd, sent[0], sent[1], steps, rejected, chunks, single_bytes)


def _ring_plan(s: Any, P: int, axis_name: Any, lay: str, options: dict, bias: Any, dtype: Any) -> Tuple[Any, ...]:
    """Ring attention's ``(forward bytes, backward bytes, steps, chunks)`` per device, traced on
    shapes alone."""
    shard = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    found: dict = {}

    def trace(q: Any, k: Any, v: Any) -> Any:
        found["ring"] = ring_setup(
            q, k, v, P=P, axis_name=axis_name, bias=None, mask=None, layout=lay, mesh_axes=frozenset(), **options
        )[0]
        return q

    jax.eval_shape(
        trace, shard(s.B, s.T // P, s.N, s.H), shard(s.B, s.S // P, s.K, s.H), shard(s.B, s.S // P, s.K, s.Hv)
    )
    r: Ring = found["ring"]
    if bias is not None:
        r = dataclasses.replace(r, spec=dataclasses.replace(r.spec, bias_shape=tuple(bias.shape)))
    fwd, bwd = ring_memory(s, r, dtype)
    chunks = f"blocks of {r.spec.T} rows x {r.spec.S} keys, in chunks of {r.spec.tq} x {r.spec.tk}"
    return fwd, bwd, ring_steps(r), chunks


def _heads_plan(s: Any, P: int, options: dict, dtype: Any) -> Tuple[Any, ...]:
    """Ulysses' ``(forward bytes, backward bytes, steps, chunks)`` per device (its query heads of
    the whole sequence), traced on shapes alone."""
    shard = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    found: dict = {}

    def heads(q: Any, k: Any, v: Any) -> Any:
        found["heads"] = prepare(q, k, v, **options)
        return q

    jax.eval_shape(
        heads, shard(s.B, s.T, s.N // P, s.H), shard(s.B, s.S, s.K // P, s.H), shard(s.B, s.S, s.K // P, s.Hv)
    )
    spec = found["heads"].spec
    fwd, bwd = ulysses_memory(s, spec, dtype)
    return fwd, bwd, [], f"{s.N // P} query heads of the whole sequence per device, in chunks of {spec.tq} x {spec.tk}"


def _spec_for(x: Any, axis_name: Any, T: int, rows_dim: int) -> PartitionSpec:
    """Shard ``x`` along its rows dim when that dim is the whole sequence (else it is replicated)."""
    parts = [None] * x.ndim
    if x.shape[rows_dim] == T and T > 1:
        parts[rows_dim] = axis_name
    return PartitionSpec(*parts)


def mesh_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any,
    mask: Any,
    *,
    mesh: Any,
    axis_name: Any,
    strategy: Any,
    layout: Any,
    is_causal: Any,
    score_mod: Any,
    mask_mod: Any,
    scale: Any,
    chunk_size: Any,
    memory_budget: Any,
) -> Tuple[Any, Any]:
    """``(out, lse)`` of global arrays sharded over ``axis_name`` of ``mesh``: ``shard_map`` applied here."""
    options = dict(
        is_causal=is_causal,
        score_mod=score_mod,
        mask_mod=mask_mod,
        scale=scale,
        chunk_size=chunk_size,
        memory_budget=memory_budget,
    )
    plan = mesh_plan(
        query, key, value, bias, mask, mesh=mesh, axis_name=axis_name, strategy=strategy, layout=layout, **options
    )
    axis, P, lay = plan.axis_name, plan.devices, plan.layout
    squeeze = query.ndim == 3
    q, k, v = (x[None] if squeeze else x for x in (query, key, value))
    T = q.shape[1]
    extras = [x if x is None else jnp.asarray(x) for x in (bias, mask)]
    extras = [None if x is None else x.reshape((1,) * (4 - x.ndim) + x.shape) for x in extras]
    reorder_rows = plan.strategy == "ring" and lay == "zigzag" and P > 1
    present = [x is not None for x in extras]

    def local(q: Any, k: Any, v: Any, *given: Any) -> Tuple[Any, Any]:
        it = iter(given)
        bias, mask = (next(it) if there else None for there in present)
        if reorder_rows:
            q, k, v = (reorder(x, axis, P, 1, to_zigzag=True) for x in (q, k, v))
            bias, mask = (
                x if x is None or x.shape[2] == 1 else reorder(x, axis, P, 2, to_zigzag=True) for x in (bias, mask)
            )
        if plan.strategy == "ring":
            out, lse = ring_attention(q, k, v, axis_name=axis, bias=bias, mask=mask, layout=lay, **options)
        else:
            out, lse = ulysses_attention(q, k, v, axis_name=axis, layout="contiguous", **options)
        if reorder_rows:
            out, lse = (reorder(x, axis, P, 1, to_zigzag=False) for x in (out, lse))
        return out, lse

    seq = PartitionSpec(None, axis)
    arrays = [q, k, v] + [x for x in extras if x is not None]
    in_specs = (seq, seq, seq) + tuple(_spec_for(x, axis, T, 2) for x in arrays[3:])
    args = [_placed(x, mesh, spec) for x, spec in zip(arrays, in_specs)]
    out, lse = shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(seq, seq))(*args)
    return (out[0], lse[0]) if squeeze else (out, lse)


def _placed(x: Any, mesh: Any, spec: PartitionSpec) -> Any:
    """An array resharded to ``spec`` where the mesh's axes are explicit (shard_map checks it there)."""
    explicit = any(str(t).endswith("Explicit") for t in getattr(mesh, "axis_types", ()))
    reshard = getattr(jax.sharding, "reshard", None)
    if explicit and reshard is not None:
        return reshard(x, NamedSharding(mesh, spec))
    return x
