"""Which strategy a sharded call takes, and each device's memory and traffic (``ShardedPlan``).

Used by the rest of ``subquad.jax``: ``STRATEGIES``, ``Shapes``, ``ShardedPlan``, ``ulysses_reasons``,
``traffic``, ``choose``, ``ring_memory``, ``ulysses_memory``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import jax.numpy as jnp

from .._budget import format_bytes
from .._errors import ArgumentError
from ._call import memory_model
from ._engine import Spec
from ._ring import Ring, block_counts

STRATEGIES = ("auto", "ring", "ulysses")
"""The ``strategy=`` values of ``attention(..., mesh=...)``: ``"ring"`` (K/V shards around the
ring), ``"ulysses"`` (all-to-all over heads) or ``"auto"`` (the one that sends fewer bytes)."""


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The global call: ``(B, T, N, H)`` query, ``(B, S, K, H)`` key, ``(B, S, K, Hv)`` value over ``P`` devices."""

    B: int
    T: int
    S: int
    N: int
    K: int
    H: int
    Hv: int
    P: int
    itemsize: int
    stats_itemsize: int  # float32 (float64 for float64 inputs): accumulators, lse

    @property
    def kv_shard(self) -> int:
        return self.B * (self.S // self.P) * self.K * (self.H + self.Hv) * self.itemsize


@dataclasses.dataclass
class ShardedPlan:
    """What a sharded call runs on each device: the strategy, memory and traffic, and why.

    ``forward_bytes``/``backward_bytes``: predicted temporaries of one device's compiled program
    (forward, forward+backward) beyond its shards and outputs: the K/V buffers in flight, the
    accumulators of its rows and one block's chunks (ring), or its heads of the whole sequence
    (all-to-all). ``sent_forward``/``sent_backward``: bytes each device sends.
    """

    strategy: str
    devices: int
    axis_name: object
    layout: str
    forward_bytes: int
    backward_bytes: int
    sent_forward: int
    sent_backward: int
    steps: List[int]
    rejected: Dict[str, List[str]]
    chunks: str
    single_device_bytes: Tuple[int, int]

    def __str__(self) -> str:
        fwd1, bwd1 = self.single_device_bytes
        lines = [
            f"subquad.jax: {self.strategy} over {self.devices} devices (mesh axis {self.axis_name!r}), layout={self.layout}",
            f"  per device: temporaries ≈{format_bytes(self.forward_bytes)} forward, ≈{format_bytes(self.backward_bytes)}"
            f" forward+backward (one device, whole sequence, as modelled: {format_bytes(fwd1)}, {format_bytes(bwd1)})",
            f"  sent per device: {format_bytes(self.sent_forward)} forward, {format_bytes(self.sent_backward)} backward",
        ]
        if self.strategy == "ring":
            lines.append(
                f"  ring steps: blocks computed per step on device 0 {self.steps} (0 = a masked step, skipped)"
            )
        lines.append(f"  chunks: {self.chunks}")
        for name, reasons in self.rejected.items():
            lines.append(f"  not {name}: {'; '.join(reasons)}")
        return "\n".join(lines)


def ulysses_reasons(s: Shapes, has_bias: bool, has_mask: bool) -> List[str]:
    reasons = []
    if s.N % s.P or s.K % s.P:
        reasons.append(f"the heads (query {s.N}, key/value {s.K}) are not divisible by the {s.P} devices")
    for name, given in (("bias", has_bias), ("mask", has_mask)):
        if given:
            reasons.append(
                f"{name}: each device would need the {name} rows of every device (T x S); use a score_mod/mask_mod"
            )
    return reasons


def traffic(s: Shapes, strategy: str, reorder: bool) -> Tuple[int, int]:
    """Bytes each device sends, forward and backward (``reorder``: to the zigzag layout and back)."""
    P, it = s.P, s.itemsize
    Tl, Sl = s.T // P, s.S // P
    q_shard, out_shard = s.B * Tl * s.N * s.H * it, s.B * Tl * s.N * (s.Hv * it + s.stats_itemsize)
    if strategy == "ring":
        fwd = (P - 1) * s.kv_shard
        grads = P * s.B * Sl * s.K * (s.H + s.Hv) * s.stats_itemsize
        bwd = fwd + grads
        if reorder and P > 1:  # each device sends both halves of q, k, v forward, of the output back
            fwd += q_shard + s.kv_shard + out_shard
            bwd += q_shard + s.kv_shard + out_shard
        return fwd, bwd
    share = (P - 1) / P
    fwd = int(share * (q_shard + s.kv_shard + out_shard))
    return fwd, 2 * fwd


def choose(s: Shapes, strategy: str, has_bias: bool, has_mask: bool, reorder: bool) -> Tuple[str, Dict[str, List[str]]]:
    """``strategy='auto'``: the one that sends fewer bytes forward (the ring on a tie)."""
    if strategy not in STRATEGIES:
        raise ArgumentError(f"Unknown strategy={strategy!r}; expected one of {', '.join(map(repr, STRATEGIES))}.")
    reasons = ulysses_reasons(s, has_bias, has_mask)
    if strategy == "ulysses" and reasons:
        raise ArgumentError("strategy='ulysses' cannot run this call: " + "; ".join(reasons) + ". Use strategy='ring'.")
    if strategy != "auto":
        return strategy, {}
    if reasons:
        return "ring", {"ulysses": reasons}
    ring_bytes, uly_bytes = traffic(s, "ring", reorder)[0], traffic(s, "ulysses", False)[0]
    chosen = "ulysses" if uly_bytes < ring_bytes else "ring"
    loser = "ring" if chosen == "ulysses" else "ulysses"
    tie = " (a tie goes to the ring)" if ring_bytes == uly_bytes else ""
    return chosen, {
        loser: [
            f"sends {format_bytes(max(ring_bytes, uly_bytes))} per device forward, {chosen} {format_bytes(min(ring_bytes, uly_bytes))}{tie}"
        ]
    }


def ring_memory(s: Shapes, ring: Ring, dtype: object) -> Tuple[int, int]:
    """Per-device temporaries of the ring, forward and forward+backward."""
    Tl, Sl, F = s.T // s.P, s.S // s.P, s.stats_itemsize
    rows = s.B * Tl * s.N * (s.Hv + 1) * F  # the running output and lse
    fwd = 2 * s.kv_shard + rows + memory_model(ring.spec, dtype, need_grad=False)
    grads = (
        s.B * Tl * s.N * (s.H + 2) * F + 2 * s.B * Sl * s.K * (s.H + s.Hv) * F
    )  # dq, delta, lse; dK/dV and the one in flight
    bwd = (
        2 * s.kv_shard
        + 2 * rows
        + grads
        + memory_model(ring.spec, dtype, need_grad=True, bias_grad=ring.spec.bias_shape is not None)
    )
    return int(fwd), int(bwd)


def ulysses_memory(s: Shapes, spec: Optional[Spec], dtype: object) -> Tuple[int, int]:
    """Per-device temporaries of the all-to-all strategy: its heads of the whole sequence, twice (gathered, reordered)."""
    it = s.itemsize
    heads = s.B * (s.T * (s.N // s.P) * (s.H + s.Hv) + s.S * (s.K // s.P) * (s.H + s.Hv)) * it
    engine = (
        (0, 0)
        if spec is None
        else (memory_model(spec, dtype, need_grad=False), memory_model(spec, dtype, need_grad=True))
    )
    return int(2 * heads + engine[0]), int(4 * heads + engine[1])


def stats_itemsize(dtype: Any) -> int:
    return jnp.dtype(jnp.promote_types(dtype, jnp.float32)).itemsize


def ring_steps(ring: Ring) -> List[int]:
    return block_counts(ring, 0)
