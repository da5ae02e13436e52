"""Which strategy a call takes, and this rank's memory and traffic (``DistributedPlan``).

Used by the rest of ``subquad.distributed``: ``DistributedPlan``, ``plan_call``, ``ulysses_reasons``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

from .. import _call
from .._budget import format_bytes
from .._errors import ArgumentError
from .._inputs import BlockPositions
from ._agreement import Call
from ._ring import mask_block, ring_blocks, split_block


@dataclasses.dataclass
class DistributedPlan:
    """What :func:`attention` runs on this rank: the strategy, memory and traffic, and why.

    ``per_rank_peak_bytes`` is this rank's predicted peak beyond its input shards and output:
    the transfer buffers and accumulators of the strategy plus the largest block's own peak
    (within ``memory_budget``). ``bytes_sent`` is what this rank sends, forward (and backward).
    """

    strategy: str
    world_size: int
    rank: int
    layout: str
    per_rank_peak_bytes: int
    bytes_sent_forward: int
    bytes_sent_backward: int
    steps: List[int]
    rejected: Dict[str, List[str]]
    block: Any = None

    def __str__(self) -> str:
        lines = [
            f"subquad.distributed: {self.strategy} over {self.world_size} ranks (this is rank {self.rank}), layout={self.layout}",
            f"  per-rank peak: ≈{format_bytes(self.per_rank_peak_bytes)} beyond the shards and output",
            f"  sent per rank: {format_bytes(self.bytes_sent_forward)} forward, {format_bytes(self.bytes_sent_backward)} backward",
        ]
        if self.strategy == "ring":
            lines.append(f"  ring steps: attention calls per step {self.steps} (0 = masked step, skipped)")
        for name, reasons in self.rejected.items():
            lines.append(f"  not {name}: {'; '.join(reasons)}")
        if self.block is not None:
            lines.append("  largest block: " + str(self.block).replace("\n", "\n  "))
        return "\n".join(lines)


def ulysses_reasons(call: Call, Hq: int, Hk: int) -> List[str]:
    P = call.g.size
    reasons = []
    if Hq % P or Hk % P:
        reasons.append(f"the heads (query {Hq}, key/value {Hk}) are not divisible by the {P} ranks")
    if call.attn_mask is not None:
        reasons.append("attn_mask: each rank would need the mask rows of every rank (Lq x Lk); use a mask_mod")
    return reasons


def _traffic(call: Call, q: Tensor, k: Tensor, v: Tensor, strategy: str) -> Tuple[int, int]:
    """Bytes this rank sends, forward and backward."""
    P, r = call.g.size, call.g.rank
    it = q.element_size()
    acc = 4 if q.dtype in (torch.float16, torch.bfloat16) else it
    B, Hq, Hk, E, Ev = q.shape[0], q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]
    if strategy == "ring":
        held = [call.kv_lengths[(r - s) % P] for s in range(P)]
        fwd = sum(held[: P - 1]) * B * Hk * (E + Ev) * it
        bwd = fwd + sum(held) * B * Hk * (E + Ev) * acc
        return fwd, bwd
    share = (P - 1) / P
    lq, lk = call.q_lengths[r], call.kv_lengths[r]
    fwd = int(share * (B * Hq * lq * (E + Ev + 1) * it + B * Hk * lk * (E + Ev) * it))
    return fwd, 2 * fwd


def plan_call(call: Call, q: Tensor, k: Tensor, v: Tensor, strategy: str, need_grad: bool) -> DistributedPlan:
    """The strategy for ``strategy='auto'`` (fewer bytes sent; ring on a tie) and its memory model."""
    P = call.g.size
    Hq, Hk = q.shape[1], k.shape[1]
    rejected: Dict[str, List[str]] = {}
    u_reasons = ulysses_reasons(call, Hq, Hk)
    if strategy == "auto":
        if u_reasons:
            rejected["ulysses"] = u_reasons
            strategy = "ring"
        else:
            ring_bytes, uly_bytes = _traffic(call, q, k, v, "ring")[0], _traffic(call, q, k, v, "ulysses")[0]
            strategy = "ulysses" if uly_bytes < ring_bytes else "ring"
            loser = "ring" if strategy == "ulysses" else "ulysses"
            rejected[loser] = [
                f"sends {format_bytes(max(ring_bytes, uly_bytes))} per rank forward, "
                f"{strategy} {format_bytes(min(ring_bytes, uly_bytes))}"
                + (" (a tie goes to the ring)" if ring_bytes == uly_bytes else "")
            ]
    elif strategy == "ulysses" and u_reasons:
        raise ArgumentError(
            "strategy='ulysses' cannot run this call: " + "; ".join(u_reasons) + ". Use strategy='ring'."
        )
    fwd, bwd = _traffic(call, q, k, v, strategy)
    B, E, Ev, it = q.shape[0], q.shape[-1], v.shape[-1], q.element_size()
    sit = 8 if q.dtype == torch.float64 else 4
    lq = call.q_lengths[call.g.rank]
    steps: List[int] = []
    block_plan = None
    if strategy == "ring":
        steps = [
            sum(
                1
                for b in ring_blocks(call, (call.g.rank - s) % P)
                for _ in split_block(call, b, call.sub_rows, 1 << 62)
            )
            for s in range(P)
        ]
        longest = max(call.kv_lengths)
        kv_buf = B * Hk * longest * (E + Ev)
        peak = kv_buf * it + B * Hq * lq * (Ev + 1) * sit + B * Hq * lq * (Ev * it + sit)
        if need_grad:
            peak += B * Hq * lq * E * sit + 3 * kv_buf * sit + B * Hq * lq * E * it + kv_buf * it
        block_plan = _largest_block_plan(call, q, k, v, need_grad)
    else:
        h_q, h_k = Hq // P, Hk // P
        whole = B * h_q * call.Lq * (E + Ev + 1) * it + B * h_k * call.Lk * (E + Ev) * it
        peak = 2 * whole
        if need_grad:
            peak += 2 * whole
        block_plan = _ulysses_block_plan(call, q, k, v, need_grad)
    if block_plan is not None:
        peak += block_plan.predicted_peak_bytes
    return DistributedPlan(
        strategy,
        P,
        call.g.rank,
        call.layout,
        int(peak),
        int(fwd),
        int(bwd) if need_grad else 0,
        steps,
        rejected,
        block_plan,
    )


def _largest_block_plan(call: Call, q: Tensor, k: Tensor, v: Tensor, need_grad: bool) -> Any:
    best = None
    for s in range(call.g.size):
        src = (call.g.rank - s) % call.g.size
        for b in ring_blocks(call, src):
            size = (b.q[1] - b.q[0]) * (b.kv[1] - b.kv[0])
            if best is None or size > best[0]:
                best = (size, b, src)
    if best is None:
        return None
    _, b, src = best
    qb = q[:, :, b.q[0] : b.q[1]].detach()
    shape_k, shape_v = list(k.shape), list(v.shape)
    shape_k[2] = shape_v[2] = b.kv[1] - b.kv[0]
    kb = torch.zeros(1, dtype=k.dtype, device=k.device).expand(shape_k)
    vb = torch.zeros(1, dtype=v.dtype, device=v.device).expand(shape_v)
    if need_grad:
        qb, kb, vb = (t.detach().requires_grad_() for t in (qb, kb, vb))
    with torch.enable_grad() if need_grad else torch.no_grad():
        m = mask_block(call.attn_mask, b)
        return _call.explain(
            qb,
            kb,
            vb,
            attn_mask=m,
            is_causal=b.is_causal,
            score_mod=call.score_mod,
            mask_mod=call.mask_mod,
            scale=call.scale,
            enable_gqa=call.enable_gqa,
            memory_budget=call.budget,
            return_lse=True,
            allow_compile=False,
            block=b.positions,
        )


def _ulysses_block_plan(call: Call, q: Tensor, k: Tensor, v: Tensor, need_grad: bool) -> Any:
    P = call.g.size
    sq, sk, sv = list(q.shape), list(k.shape), list(v.shape)
    sq[1] //= P
    sk[1] //= P
    sv[1] //= P
    sq[2], sk[2], sv[2] = call.Lq, call.Lk, call.Lk
    qb, kb, vb = (torch.zeros(1, dtype=t.dtype, device=t.device).expand(s) for t, s in ((q, sq), (k, sk), (v, sv)))
    if need_grad:
        qb, kb, vb = (t.detach().requires_grad_() for t in (qb, kb, vb))
    with torch.enable_grad() if need_grad else torch.no_grad():
        return _call.explain(
            qb,
            kb,
            vb,
            is_causal=call.is_causal,
            score_mod=call.score_mod,
            mask_mod=call.mask_mod,
            scale=call.scale,
            enable_gqa=call.enable_gqa,
            memory_budget=call.budget,
            return_lse=True,
            allow_compile=False,
            block=BlockPositions(0, 0, (call.Lq, call.Lk), h_offset=call.g.rank * (q.shape[1] // P)),
        )
