"""The all-to-all strategy ("Ulysses") inside ``shard_map``: sequence shards become head shards and back.

``lax.all_to_all`` turns each device's ``(B, T/P, N, H)`` shard into ``(B, T, N/P, H)``: the whole
sequence (put back in global order) for its ``N/P`` heads (and ``K/P`` key/value heads, so GQA
groups stay whole). Each device runs the single-device chunk loops on its heads, with the
callbacks seeing global head indices, and one more all-to-all brings the output (and lse) back to
sequence shards. JAX differentiates through the all-to-alls (their transpose is an all-to-all).

Used by the rest of ``subquad.jax``: ``seq_to_heads``, ``heads_to_seq``.
"""

from __future__ import annotations

from typing import Any

from jax import lax

from ._layouts import from_natural, to_natural


def seq_to_heads(x: Any, axis_name: Any, P: int, layout: str) -> Any:
    """``(B, T/P, N, D)`` sequence shards (in ``layout``) -> ``(B, T, N/P, D)`` in global order."""
    if P == 1:
        return x
    whole = lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)
    return to_natural(whole, layout, P, axis=1)


def heads_to_seq(x: Any, axis_name: Any, P: int, layout: str) -> Any:
    """The inverse of :func:`seq_to_heads`: ``(B, T, N/P, D)`` -> ``(B, T/P, N, D)``."""
    if P == 1:
        return x
    x = from_natural(x, layout, P, axis=1)
    return lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)
