"""The public functions of ``subquad.jax``: signatures, docstrings, hand-off to :mod:`._call`."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Tuple, Union

import jax
import jax.numpy as jnp

from .._budget import format_bytes
from .._errors import ArgumentError, ArgumentTypeError
from . import _sharded
from ._call import Budget, ChunkSize, prepare


def attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Optional[Any] = None,
    mask: Optional[Any] = None,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    query_seq_lengths: Optional[Any] = None,
    key_value_seq_lengths: Optional[Any] = None,
    local_window_size: Optional[Union[int, Tuple[int, int]]] = None,
    score_mod: Optional[Callable[..., Any]] = None,
    mask_mod: Optional[Callable[..., Any]] = None,
    chunk_size: Optional[ChunkSize] = None,
    memory_budget: Optional[Budget] = None,
    return_lse: bool = False,
    mesh: Optional[Any] = None,
    axis_name: Optional[Any] = None,
    strategy: str = "auto",
    layout: Optional[str] = None,
) -> Any:
    """Exact attention in chunks of queries and keys; ``(B, T, N, Hv)`` (and lse ``(B, T, N)``).

    Equal to (``G = N // K``; float32 softmax)::

        s = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, G, axis=2)) * scale + bias
        s = score_mod(s, b, h, q_idx, kv_idx)                      # FlexAttention's convention
        keep = mask & mask_mod(b, h, q_idx, kv_idx) & causal & window & lengths
        s = jnp.where(keep, s, -jnp.inf)
        out = jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(s, -1), jnp.repeat(v, G, axis=2))
        lse = jax.nn.logsumexp(s, -1)                              # (B, N, T), returned as (B, T, N)

    except that a row that sees no key gives 0 (lse ``-inf``), not NaN.

    Args:
        query: ``(B, T, N, H)``, or ``(T, N, H)`` without the batch axis.
        key: ``(B, S, K, H)`` (or ``(S, K, H)``); ``N`` a multiple of ``K`` (GQA when ``K < N``).
        value: ``(B, S, K, Hv)`` (or ``(S, K, Hv)``); one floating dtype for all three.
        bias: added to the scaled scores; broadcastable to ``(B, N, T, S)`` (at most 4 dims,
            each 1 or full). Differentiable: its gradient has its shape.
        mask: bool, True = attend; broadcastable to ``(B, N, T, S)``.
        scale: multiplies ``q k^T``; default ``1 / sqrt(H)``. A float or a 0-d array, which may
            be traced under ``jit`` and gets its gradient under ``grad``.
        is_causal: row ``t`` sees keys ``<= t`` (top-left aligned when ``T != S``, as JAX)::

                     keys ->
            rows   [x . . . .]
                   [x x . . .]
                   [x x x . .]

            Key chunks above the diagonal are skipped, not computed.
        query_seq_lengths: ``(B,)`` int32; query rows at or beyond it are padding (they give 0).
        key_value_seq_lengths: ``(B,)`` int32; keys at or beyond it are padding (never attended).
        local_window_size: ``w`` or ``(left, right)``: row ``t`` sees keys in
            ``[t - left, t + right]``; chunks outside are skipped.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, called once per chunk with
            ``score`` ``(B, N, tq, tk)`` float32 and int32 index arrays broadcastable to it
            (``b (B,1,1,1)``, ``h (1,N,1,1)``, ``q_idx (1,1,tq,1)``, ``kv_idx (1,1,1,tk)``), global
            positions. Arrays it closes over get gradients (``jax.closure_convert``).
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``, same indices, True = attend.
        chunk_size: ``tq`` or ``(tq, tk)``; default: the largest chunks the budget allows, at most
            ``DEFAULT_CHUNKS``. A forced chunk that the budget cannot hold raises.
        memory_budget: bytes (int) or a string such as ``"64MiB"`` for the compiled program's
            temporary memory of the forward and backward (``memory_analysis().temp_size_in_bytes``)
            as the memory model predicts it; None: no limit.
        return_lse: also return the log-sum-exp ``(B, T, N)`` float32 (differentiable).
        mesh: a ``jax.sharding.Mesh``: the arrays are global, sharded (or to be sharded) along
            the sequence over its axis ``axis_name`` (default: the mesh's only axis), and the call
            runs on every device with ``jax.shard_map``: ``strategy="ring"`` (:func:`ring_attention`),
            ``"ulysses"`` (:func:`ulysses_attention`) or ``"auto"``, the one that sends fewer bytes
            (:func:`explain` says which and why). ``layout``: how the ring cuts the sequence;
            default ``"zigzag"`` for causal calls (the shards are reordered there and back: two
            ``ppermute`` s each way), else ``"contiguous"``. ``bias``/``mask`` are sharded by rows;
            ``query_seq_lengths``, ``key_value_seq_lengths`` and ``local_window_size`` are not
            available with a mesh (use ``mask_mod``).

    Raises:
        ValueError / TypeError: invalid arguments, naming the argument (both also ``RuntimeError``
            subclasses, as in subquad's PyTorch API).
        MemoryBudgetError: no chunks fit ``memory_budget``, or a forced ``chunk_size`` does not.
        ImportError: JAX is not installed (``pip install 'subquad[jax]'``).
    """
    if mesh is not None:
        for name, given in (
            ("query_seq_lengths", query_seq_lengths),
            ("key_value_seq_lengths", key_value_seq_lengths),
            ("local_window_size", local_window_size),
        ):
            if given is not None:
                raise NotImplementedError(
                    f"{name} is not available with mesh=; express it as a mask_mod (global positions)."
                )
        out, lse = _sharded.mesh_attention(
            query,
            key,
            value,
            bias,
            mask,
            mesh=mesh,
            axis_name=axis_name,
            strategy=strategy,
            layout=layout,
            is_causal=is_causal,
            score_mod=score_mod,
            mask_mod=mask_mod,
            scale=scale,
            chunk_size=chunk_size,
            memory_budget=memory_budget,
        )
        return (out, lse) if return_lse else out
    if axis_name is not None or strategy != "auto" or layout is not None:
        raise ArgumentError(
            "axis_name, strategy and layout go with mesh=; inside shard_map call subquad.jax.ring_attention or ulysses_attention."
        )
    call = prepare(
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        score_mod=score_mod,
        mask_mod=mask_mod,
        chunk_size=chunk_size,
        memory_budget=memory_budget,
    )
    out, lse = call.run()
    return (out, lse) if return_lse else out


def ring_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    axis_name: Any,
    is_causal: bool = False,
    bias: Optional[Any] = None,
    mask: Optional[Any] = None,
    score_mod: Optional[Callable[..., Any]] = None,
    mask_mod: Optional[Callable[..., Any]] = None,
    scale: Optional[float] = None,
    layout: str = "zigzag",
    chunk_size: Optional[ChunkSize] = None,
    memory_budget: Optional[Budget] = None,
    return_lse: bool = False,
) -> Any:
    """Exact attention of a sequence sharded over the mesh axis ``axis_name``, inside ``jax.shard_map``.

    Each device passes its shards: ``query (B, T/P, N, H)``, ``key (B, S/P, K, H)``, ``value
    (B, S/P, K, Hv)`` in ``layout`` (see :func:`shard`) -> ``out (B, T/P, N, Hv)`` (and lse
    ``(B, T/P, N)``), its rows of the whole attention. Equal, up to rounding, to::

        whole = lambda x: unshard(jax.lax.all_gather(x, axis_name, axis=1, tiled=True), P, layout=layout)
        out = shard(attention(whole(query), whole(key), whole(value), ...), P, layout=layout)  # this device's part

    without gathering anything: in ``P`` steps each device attends its queries to the K/V shard in
    hand, which then moves on around the ring (``lax.ppermute``); each step runs the chunk loops of
    :func:`attention` on blocks at their global positions and merges them by log-sum-exp. Blocks
    that ``is_causal`` hides entirely are skipped; ``layout="zigzag"`` (device ``r`` holds chunks
    ``r`` and ``2P-1-r`` of ``2P``) gives every device the same causal work, ``"contiguous"``
    (device ``r`` holds the ``r``-th run) leaves device ``P-1`` the most. The backward sends
    dK/dV around the ring with K/V (FlashAttention-2, from the saved output and lse).

    Args:
        axis_name: the ``shard_map`` mesh axis the sequence is sharded over.
        bias: this device's rows of a ``(B, N, T, S)`` bias (added): ``(B, N, T/P, S)`` with the
            key columns in global order; each dim 1 or full.
        mask: this device's rows of a bool ``(B, N, T, S)`` mask (True = attend), as ``bias``.
        score_mod: as in :func:`attention`, called with **global** positions, so ALiBi, sliding
            windows and document masks are exact across shards.
        mask_mod: as in :func:`attention`, with global positions too.
        chunk_size: for each block's chunks, as in :func:`attention`.
        memory_budget: for each block's chunks, as in :func:`attention`.

    The other arguments are :func:`attention`'s (causal is top-left aligned in global positions).

    Raises:
        ValueError: naming the argument: ``axis_name`` not bound (called outside ``shard_map``),
            an unknown ``layout``, ``zigzag`` shards of odd length, and :func:`attention`'s checks.
    """
    out, lse = _sharded.ring_attention(
        query,
        key,
        value,
        axis_name=axis_name,
        is_causal=is_causal,
        bias=bias,
        mask=mask,
        score_mod=score_mod,
        mask_mod=mask_mod,
        scale=scale,
        layout=layout,
        chunk_size=chunk_size,
        memory_budget=memory_budget,
    )
    return (out, lse) if return_lse else out


def ulysses_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    axis_name: Any,
    is_causal: bool = False,
    score_mod: Optional[Callable[..., Any]] = None,
    mask_mod: Optional[Callable[..., Any]] = None,
    scale: Optional[float] = None,
    layout: str = "zigzag",
    chunk_size: Optional[ChunkSize] = None,
    memory_budget: Optional[Budget] = None,
    return_lse: bool = False,
) -> Any:
    """:func:`ring_attention`'s result through two all-to-alls over heads ("Ulysses"), inside ``shard_map``.

    The sequence shards become head shards (the whole sequence for ``N/P`` query heads and ``K/P``
    key/value heads), each device runs :func:`attention` on its heads (callbacks see global
    positions and head indices), and one all-to-all brings the output back. Needs ``N`` and ``K``
    divisible by ``P``; no ``bias``/``mask`` (each device would need every device's rows: use a
    ``mask_mod``). Per device it holds its heads of the whole sequence, and sends about
    ``(P-1)/P`` of its shards instead of the ring's ``P-1`` K/V shards.

    Raises:
        ValueError: naming the argument: heads not divisible by ``P``, ``axis_name`` not bound,
            and :func:`ring_attention`'s checks.
    """
    out, lse = _sharded.ulysses_attention(
        query,
        key,
        value,
        axis_name=axis_name,
        is_causal=is_causal,
        score_mod=score_mod,
        mask_mod=mask_mod,
        scale=scale,
        layout=layout,
        chunk_size=chunk_size,
        memory_budget=memory_budget,
    )
    return (out, lse) if return_lse else out


def dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Optional[Any] = None,
    mask: Optional[Any] = None,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    query_seq_lengths: Optional[Any] = None,
    key_value_seq_lengths: Optional[Any] = None,
    local_window_size: Optional[Union[int, Tuple[int, int]]] = None,
    implementation: Optional[str] = None,
    return_residual: bool = False,
) -> Any:
    """A drop-in for ``jax.nn.dot_product_attention``: same signature, layout and results, in chunks.

    Semantics are JAX's ``implementation="xla"`` path: GQA when ``N`` is a multiple of ``K``, bool
    ``mask`` True = attend, ``bias`` added, causal top-left aligned, ``local_window_size`` and
    sequence lengths as masks, padding query rows give 0. Where JAX fills masked scores with a
    large negative number, a row whose every key is masked gets the mean of all ``S`` values (and
    a residual of that number plus ``log S``); this function reproduces that. :func:`attention`
    gives 0 and ``-inf`` there instead. ``implementation`` must be None or ``"xla"``: the chunks
    are plain XLA ops (for cuDNN, call JAX's own function).
    """
    if implementation not in (None, "xla"):
        raise NotImplementedError(
            f"subquad.jax.dot_product_attention computes in chunks with XLA ops; implementation={implementation!r} "
            "is not available here (call jax.nn.dot_product_attention for cuDNN)."
        )
    call = prepare(
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
    )
    out, lse = call.run()
    # JAX's masked scores are -0.7 * float32 max, not -inf: a row that sees nothing averages all values.
    large_negative = -0.7 * float(jnp.finfo(jnp.float32).max)
    dead = lse == -jnp.inf  # (..., T, N)
    padding = call.padding_rows()  # (..., T, 1) or None: JAX zeroes these rows after the softmax
    average = dead if padding is None else dead & ~padding
    S = call.spec.S
    if S > 0 and call.spec.T > 0:
        mean_v = jnp.repeat(call.v_grouped.mean(axis=1), call.spec.G, axis=1)  # (B, N, Hv)
        if call.squeeze:
            mean_v = mean_v[0]
        out = jnp.where(average[..., None], jnp.expand_dims(mean_v, -3).astype(out.dtype), out)
        lse = jnp.where(dead, large_negative + math.log(S), lse)
    if return_residual:
        return out, jax.lax.stop_gradient(lse.astype(key.dtype))
    return out


def explain(
    query: Any,
    key: Any,
    value: Any,
    bias: Optional[Any] = None,
    mask: Optional[Any] = None,
    **options: Any,
) -> str:
    """What :func:`attention` would do with these arguments: chunks, loops skipped, memory model.

    With ``mesh=``: the strategy (and why the other was not taken), the layout, each device's
    predicted temporaries and the bytes it sends, forward and backward.
    """
    options.pop("return_lse", None)
    if options.get("mesh") is not None:
        sharded = (
            "mesh",
            "axis_name",
            "strategy",
            "layout",
            "is_causal",
            "score_mod",
            "mask_mod",
            "scale",
            "chunk_size",
            "memory_budget",
        )
        unknown = set(options) - set(sharded)
        if unknown:
            raise ArgumentTypeError(f"explain(mesh=...) got unexpected keyword arguments {sorted(unknown)}.")
        given = {name: options.get(name) for name in sharded}
        given["strategy"] = options.get("strategy", "auto")
        given["is_causal"] = options.get("is_causal", False)
        return str(_sharded.mesh_plan(query, key, value, bias, mask, **given))
    names = (
        "scale",
        "is_causal",
        "query_seq_lengths",
        "key_value_seq_lengths",
        "local_window_size",
        "score_mod",
        "mask_mod",
        "chunk_size",
        "memory_budget",
    )
    unknown = set(options) - set(names)
    if unknown:
        raise ArgumentTypeError(
            f"explain() got unexpected keyword arguments {sorted(unknown)}; it takes attention()'s."
        )
    call = prepare(query, key, value, bias, mask, **options)
    s = call.spec
    lines = [
        f"subquad.jax: B={s.B} T={s.T} S={s.S} N={s.K * s.G} K={s.K} H={s.H} Hv={s.Hv}, {call.dtype}",
        f"  chunks: {s.tq} query rows x {s.tk} keys ({s.nq} x {s.nk} chunks)",
        f"  skipped: {call.skipped_fraction():.0%} of the chunk pairs (causal / window)",
        f"  memory model: forward {format_bytes(call.forward_bytes)}, forward+backward {format_bytes(call.backward_bytes)}"
        f" of temporaries (materialized scores would take {format_bytes(4 * s.B * s.K * s.G * s.T * s.S)})",
    ]
    if call.budget is not None:
        lines.append(f"  budget: {format_bytes(call.budget)}")
    return "\n".join(lines)
