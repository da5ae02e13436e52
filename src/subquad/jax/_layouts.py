"""How a sequence is cut into device shards: ``zigzag`` and ``contiguous`` (as ``subquad.distributed``).

* ``zigzag`` (default): the sequence is cut into ``2P`` equal chunks and device ``r`` holds
  chunks ``r`` and ``2P-1-r``, so that every device does the same causal work;
* ``contiguous``: device ``r`` holds the ``r``-th of ``P`` equal runs.

Used by the rest of ``subquad.jax``: ``LAYOUTS``, ``check_layout``, ``piece_count``,
``piece_start``, ``pieces``, ``shard``, ``unshard``, ``reorder``, ``to_natural``, ``from_natural``.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._errors import ArgumentError

LAYOUTS = ("zigzag", "contiguous")
"""The ``layout=`` values: ``"zigzag"`` (device ``r`` holds chunks ``r`` and ``2P-1-r`` of ``2P``:
equal causal work) and ``"contiguous"`` (device ``r`` holds the ``r``-th run of positions)."""


def check_layout(layout: object) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ArgumentError(f"Unknown layout={layout!r}; expected one of {', '.join(map(repr, LAYOUTS))}.")
    return layout


def piece_count(layout: str) -> int:
    """How many runs of global positions a shard holds."""
    return 2 if layout == "zigzag" else 1


def piece_start(layout: str, piece: Any, rank: Any, length: int, P: int) -> Any:
    """The global position of run ``piece`` of device ``rank``'s shard (runs of ``length``); may be traced."""
    if layout == "contiguous":
        return rank * length
    return jnp.where(piece == 0, rank, 2 * P - 1 - rank) * length


def pieces(layout: str, local: int, P: int, rank: int) -> List[Tuple[int, int, int]]:
    """The runs a shard of ``local`` positions holds: ``(local start, global start, length)``."""
    if layout == "contiguous":
        return [(0, rank * local, local)]
    c = local // 2
    return [(0, rank * c, c), (c, (2 * P - 1 - rank) * c, c)]


def _order(layout: str, total: int, P: int) -> np.ndarray:
    """Global positions in shard order: the shards one after another (device 0's first)."""
    local = total // P
    return np.concatenate(
        [np.arange(g, g + n) for r in range(P) for _, g, n in pieces(layout, local, P, r)] or [np.zeros(0, np.int64)]
    )


def check_divisible(layout: str, length: int, P: int, name: str) -> None:
    parts = P * piece_count(layout)
    if length % parts:
        fix = " Pad the sequence, or use layout='contiguous'." if layout == "zigzag" else " Pad the sequence."
        raise ArgumentError(
            f"layout={layout!r} cuts the sequence into {parts} equal parts for {P} devices, but {name} has "
            f"{length} positions, not a multiple of {parts}.{fix}"
        )


def shard(x: Any, num_shards: int, *, layout: str = "zigzag", axis: int = 1) -> Any:
    """The whole array ``x`` reordered along ``axis`` so that its ``num_shards`` equal contiguous
    parts are the devices' shards in ``layout`` (shard it with ``PartitionSpec(None, "seq")``).

    Equal to (``zigzag``; ``contiguous`` is the identity)::

        chunks = jnp.split(x, 2 * P, axis)
        jnp.concatenate([c for r in range(P) for c in (chunks[r], chunks[2 * P - 1 - r])], axis)
    """
    layout = check_layout(layout)
    x = jnp.asarray(x)
    check_divisible(layout, x.shape[axis], num_shards, f"x.shape[{axis}]")
    if layout == "contiguous":
        return x
    return jnp.take(x, jnp.asarray(_order(layout, x.shape[axis], num_shards)), axis=axis)


def unshard(x: Any, num_shards: int, *, layout: str = "zigzag", axis: int = 1) -> Any:
    """The inverse of :func:`shard`: the shards, one after another along ``axis``, in global order."""
    layout = check_layout(layout)
    x = jnp.asarray(x)
    check_divisible(layout, x.shape[axis], num_shards, f"x.shape[{axis}]")
    if layout == "contiguous":
        return x
    return jnp.take(x, jnp.asarray(np.argsort(_order(layout, x.shape[axis], num_shards))), axis=axis)


def to_natural(x: Any, layout: str, P: int, axis: int) -> Any:
    """A whole sequence gathered in shard order (all-to-all) -> global order (a static permutation)."""
    if layout == "contiguous":
        return x
    return jnp.take(x, jnp.asarray(np.argsort(_order(layout, x.shape[axis], P))), axis=axis)


def from_natural(x: Any, layout: str, P: int, axis: int) -> Any:
    if layout == "contiguous":
        return x
    return jnp.take(x, jnp.asarray(_order(layout, x.shape[axis], P)), axis=axis)


def reorder(x: Any, axis_name: Any, P: int, axis: int, to_zigzag: bool) -> Any:
    """Inside ``shard_map``: this device's contiguous shard -> its zigzag shard (or back).

    Contiguous device ``r`` holds chunks ``2r, 2r+1`` of ``2P``; zigzag device ``d`` holds
    ``d, 2P-1-d``. Each device sends its two halves with two ``ppermute``\\ s (half of the shard
    stays where it is only on the devices whose chunk is a fixed point).
    """
    if P == 1:
        return x
    d = lax.axis_index(axis_name)
    even = d % 2 == 0

    def dest(c: int) -> int:  # the zigzag device of chunk c
        return c if c < P else 2 * P - 1 - c

    first, second = jnp.split(x, 2, axis=axis)
    if to_zigzag:
        got_even = lax.ppermute(first, axis_name, [(r, dest(2 * r)) for r in range(P)])
        got_odd = lax.ppermute(second, axis_name, [(r, dest(2 * r + 1)) for r in range(P)])
        # Device d's even chunk is d when d is even (its first slot), else 2P-1-d (its second).
        return jnp.concatenate([jnp.where(even, got_even, got_odd), jnp.where(even, got_odd, got_even)], axis=axis)
    mine_even = jnp.where(even, first, second)  # the chunk of even index this device holds
    mine_odd = jnp.where(even, second, first)
    src_even = [(r, (r if r % 2 == 0 else 2 * P - 1 - r) // 2) for r in range(P)]
    src_odd = [(r, (2 * P - 1 - r if r % 2 == 0 else r) // 2) for r in range(P)]
    return jnp.concatenate(
        [lax.ppermute(mine_even, axis_name, src_even), lax.ppermute(mine_odd, axis_name, src_odd)], axis=axis
    )
