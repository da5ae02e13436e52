"""The public functions of ``subquad.jax``: signatures, docstrings, hand-off to :mod:`._call`."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Tuple, Union

import jax
import jax.numpy as jnp

from .._budget import format_bytes
from .._errors import ArgumentTypeError
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
        query, key, value: ``(B, T, N, H)``, ``(B, S, K, H)``, ``(B, S, K, Hv)``, or without ``B``;
            one floating dtype; ``N`` a multiple of ``K``.
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
        query_seq_lengths, key_value_seq_lengths: ``(B,)`` int32; rows/keys at or beyond are
            padding (padding rows give 0).
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

    Raises:
        ValueError / TypeError naming the argument (both also ``RuntimeError`` subclasses, as in
        subquad's PyTorch API); :class:`MemoryBudgetError` when no chunks fit ``memory_budget``;
        ``ImportError`` without JAX.
    """
    call = prepare(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size, score_mod=score_mod,
        mask_mod=mask_mod, chunk_size=chunk_size, memory_budget=memory_budget,
    )
    out, lse = call.run()
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
        query, key, value, bias, mask, scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
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
    """What :func:`attention` would do with these arguments: chunks, loops skipped, memory model."""
    options.pop("return_lse", None)
    names = (
        "scale", "is_causal", "query_seq_lengths", "key_value_seq_lengths", "local_window_size",
        "score_mod", "mask_mod", "chunk_size", "memory_budget",
    )
    unknown = set(options) - set(names)
    if unknown:
        raise ArgumentTypeError(f"explain() got unexpected keyword arguments {sorted(unknown)}; it takes attention()'s.")
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


