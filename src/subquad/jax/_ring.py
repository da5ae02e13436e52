"""Ring attention inside ``shard_map``: K/V shards travel the ring of devices with ``lax.ppermute``.

Each device holds its shard of queries and of keys/values (``zigzag`` or ``contiguous``, see
:mod:`._layouts`). In ``P`` steps it attends its queries to the K/V shard in hand (its own first,
then its ring neighbours'), as blocks of the chunk loops of :mod:`._engine` placed at their global
positions, merging each block's rows into a running result by log-sum-exp; the K/V shard moves on
to the next device after each step but the last. The backward (FlashAttention-2, from the saved
output and global lse) sends dK/dV around the ring with K/V: after ``P`` steps each device's
dK/dV accumulator has collected every device's share and arrives home.

Blocks are pairs (query run, key run) of the two shards; a block that causal or a window hides
entirely is skipped (``lax.cond``), so with ``zigzag`` every device computes the same number of
blocks. Nothing of size ``T x S`` exists: per device, the shards, one K/V shard in flight, the
float32 accumulators of its rows and one block's chunks.

Used by the rest of ``subquad.jax``: ``Ring`` (the static description), ``ring``, ``block_counts``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, List, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ._engine import (
    Aux,
    Offsets,
    Spec,
    backward_block,
    block_visible,
    cotangents,
    forward,
    perturbed,
    softmax_terms,
    wanted_grads,
    zero_or_none,
)
from ._layouts import piece_count, piece_start, pieces
from ._vma import vary, varying_axes


@dataclass(frozen=True)
class Ring:
    """Everything static about a ring call: one block's spec, the ring and the shards' sizes."""

    spec: Spec  # one block: a run of query rows x a run of keys
    axis_name: Any
    P: int
    layout: str
    T: int  # query rows per device
    S: int  # keys per device

    @property
    def runs(self) -> int:
        return piece_count(self.layout)

    @property
    def blocks_per_step(self) -> int:
        return self.runs * self.runs


def _place(ring: Ring, u: Any, rank: Any, src: Any) -> Offsets:
    """Where block ``u`` of a step sits: this device's query run ``u // runs``, key run ``u % runs`` of ``src``."""
    a, b = u // ring.runs, u % ring.runs
    tq, tk = ring.spec.T, ring.spec.S
    return Offsets(
        rows=a * tq,
        keys=b * tk,
        q=piece_start(ring.layout, a, rank, tq, ring.P),
        kv=piece_start(ring.layout, b, src, tk, ring.P),
        head=jnp.int32(0),
    )


def _if_visible(spec: Spec, at: Offsets, run: Any, carry: Any) -> Any:
    """``run(carry)`` where causal or the window leave the block some score; else ``carry`` (skipped)."""
    visible = block_visible(spec, at.q - at.kv)
    if visible is True:  # no causal, no window: every block counts
        return run(carry)
    return lax.cond(visible, run, lambda c: c, carry)


def _send(ring: Ring, x: Any) -> Any:
    """``x`` moved one device on around the ring (device ``r`` receives device ``r-1``'s)."""
    P = ring.P
    return lax.ppermute(x, ring.axis_name, [(i, (i + 1) % P) for i in range(P)])


def _forward(ring: Ring, q: Any, k: Any, v: Any, aux: Aux) -> Tuple[Any, Any]:
    s = ring.spec
    rank = lax.axis_index(ring.axis_name)
    q5 = q.reshape(s.B, ring.T, s.K, s.G, s.H)
    axes = varying_axes(q, k, v, aux) | {ring.axis_name}
    acc = (jnp.zeros((s.B, ring.T, s.K, s.G, s.Hv), s.F), jnp.full((s.B, s.K, s.G, ring.T), -jnp.inf, s.F))

    def step(i: Any, carry: Any) -> Any:
        kc, vc, acc = carry
        src = (rank - i) % ring.P

        def block(u: Any, acc: Any) -> Any:
            at = _place(ring, u, rank, src)
            run = lambda a: forward(s, q5, kc, vc, aux, at, into=a)  # noqa: E731
            return _if_visible(s, at, run, acc)

        acc = lax.fori_loop(0, ring.blocks_per_step, block, acc)
        # The step counter is the same on every device, so all of them send, or none.
        kc, vc = lax.cond(i < ring.P - 1, lambda kv: _send(ring, kv), lambda kv: kv, (kc, vc))
        return kc, vc, acc

    _, _, (out, lse) = lax.fori_loop(0, ring.P, step, vary((k, v, acc), axes))
    return out.astype(q.dtype), lse


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring(spec: Ring, q: Any, k: Any, v: Any, aux: Aux) -> Tuple[Any, Any]:
    """``(out (B, T, K, G, Hv), lse (B, K, G, T))`` of this device's rows against every device's keys."""
    return _forward(spec, q, k, v, aux)


def _ring_fwd(spec: Ring, q: Any, k: Any, v: Any, aux: Any) -> Tuple[Any, Any]:
    aux_v, flags = perturbed(aux)
    qv, kv, vv = q.value, k.value, v.value
    out, lse = _forward(spec, qv, kv, vv, aux_v)
    return (out, lse), (qv, kv, vv, aux_v, out, lse, flags)


def _ring_bwd(ring: Ring, res: Any, cts: Any) -> Tuple[Any, ...]:
    q, k, v, aux, out, lse, flags = res
    s = ring.spec
    dout, dlse = (zero_or_none(c) for c in cts)
    if dout is None:
        dout = jnp.zeros(out.shape, out.dtype)
    rank = lax.axis_index(ring.axis_name)
    q5 = q.reshape(s.B, ring.T, s.K, s.G, s.H)
    delta, live_lse = softmax_terms(s, out, lse, dout, dlse)
    axes = varying_axes(q, k, v, aux, dout, delta) | {ring.axis_name}
    grads = wanted_grads(s, aux, flags, (s.B, ring.T, s.K, s.G, s.H), (s.B, ring.S, s.K, s.H), (s.B, ring.S, s.K, s.Hv))

    def step(i: Any, carry: Any) -> Any:
        kc, vc, grads = carry
        src = (rank - i) % ring.P

        def block(u: Any, g: Any) -> Any:
            at = _place(ring, u, rank, src)
            run = lambda g: backward_block(s, q5, kc, vc, aux, dout, delta, live_lse, g, at)  # noqa: E731
            return _if_visible(s, at, run, g)

        dq, dk, dv, *rest = lax.fori_loop(0, ring.blocks_per_step, block, grads)
        kc, vc = lax.cond(i < ring.P - 1, lambda kv: _send(ring, kv), lambda kv: kv, (kc, vc))
        # dK/dV of the keys in hand go on with them; after the last step they reach their owner.
        dk, dv = _send(ring, (dk, dv))
        return kc, vc, (dq, dk, dv, *rest)

    _, _, grads = lax.fori_loop(0, ring.P, step, vary((k, v, grads), axes))
    return cotangents(q, k, v, aux, grads)


ring.defvjp(_ring_fwd, _ring_bwd, symbolic_zeros=True)


def block_counts(ring: Ring, rank: int) -> List[int]:
    """Blocks device ``rank`` computes at each step (0: a step that causal or a window skips whole)."""
    counts = []
    for step in range(ring.P):
        src = (rank - step) % ring.P
        n = 0
        for _, qg, _ in pieces(ring.layout, ring.T, ring.P, rank):
            for _, kg, _ in pieces(ring.layout, ring.S, ring.P, src):
                n += bool(block_visible(ring.spec, qg - kg))
        counts.append(n)
    return counts
