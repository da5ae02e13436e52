"""Ring attention: K/V shards travel around the ring; each step is bounded-memory subquad calls.

Used by the rest of ``subquad.distributed``: ``Ring`` (the autograd Function), ``Block``,
``ring_blocks``, ``split_block``, ``mask_block``, ``block_states_of``, ``sub_block_caps``,
``SUB_BLOCK_BYTES``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import _call
from .._autograd import backward_grads
from .._callbacks import EMPTY, declared_states
from .._inputs import BlockPositions
from .._traced import TracedMask, mask_mod_structure
from ._agreement import Call
from ._group import STATS, Group, torch_distributed


@dataclasses.dataclass(frozen=True)
class Block:
    """One attention call of a ring step: local query rows x local key rows of the K/V in hand."""

    q: Tuple[int, int]
    kv: Tuple[int, int]
    positions: BlockPositions
    is_causal: bool
    mask_cols: Optional[Tuple[int, int]]


def ring_blocks(call: Call, src: int) -> List[Block]:
    """The calls that attend this rank's queries to rank ``src``'s keys; masked blocks are left out.

    With no position-dependent argument (mask, callbacks), neighbouring runs that are entirely
    visible are joined into one call (attention does not depend on the order of its keys).
    """
    rank = call.g.rank
    total = (call.Lq, call.Lk)
    q_runs = call.q_pieces(rank)
    pairs: List[Tuple[Tuple[int, int, int], Tuple[int, int, int], str]] = []
    for qp in q_runs:
        for kp in call.kv_pieces(src):
            state = "full"
            if call.is_causal:
                _, qg, qn = qp
                _, kg, kn = kp
                if kg > qg + qn - 1:
                    state = "none"
                elif kg + kn - 1 > qg:
                    state = "partial"
            pairs.append((qp, kp, state))

    def block(qp: Tuple[int, int, int], kp: Tuple[int, int, int], state: str) -> Block:
        (ql, qg, qn), (kl, kg, kn) = qp, kp
        return Block(
            (ql, ql + qn),
            (kl, kl + kn),
            BlockPositions(qg, kg, total, causal_offset=qg - kg),
            state == "partial",
            (kg, kg + kn) if call.attn_mask is not None else None,
        )

    if call.positional:
        return [block(qp, kp, s) for qp, kp, s in pairs if s != "none"]
    out: List[Block] = []
    for qp in q_runs:
        mine = [(kp, s) for q_, kp, s in pairs if q_ is qp and s != "none"]
        if not mine:
            continue
        kv_runs = [kp for kp, _ in mine]
        joinable = all(s == "full" for _, s in mine) and all(a[0] + a[2] == b[0] for a, b in zip(kv_runs, kv_runs[1:]))
        if joinable:
            ql, qg, qn = qp
            span = (kv_runs[0][0], kv_runs[-1][0] + kv_runs[-1][2])
            prev = out[-1] if out else None
            if prev is not None and not prev.is_causal and prev.kv == span and prev.q[1] == ql:
                out[-1] = dataclasses.replace(prev, q=(prev.q[0], ql + qn))  # the next run of rows, same keys
            else:
                out.append(Block((ql, ql + qn), span, BlockPositions(qg, kv_runs[0][1], total), False, None))
        else:
            out.extend(block(qp, kp, s) for kp, s in mine)
    return out


SUB_BLOCK_BYTES = 2 << 20
"""A ring block runs as calls whose query rows (and, in the backward, keys) take at most about
this much, or an eighth of the shard: a call's output and gradients are new tensors of its size,
merged into the accumulators, so the transient memory stays a fraction of the shard."""


def sub_block_caps(B: int, Hq: int, Hk: int, Lq: int, E: int, Ev: int) -> Tuple[int, int]:
    target = max(SUB_BLOCK_BYTES, B * Hq * Lq * max(E, Ev) * 4 // 8)
    rows = max(16, target // max(1, B * Hq * max(E, Ev) * 4))
    cols = max(16, target // max(1, B * Hk * max(E, Ev) * 4))
    return rows, cols


def split_block(call: Call, b: Block, rows_cap: int, cols_cap: int) -> Iterator[Block]:
    """The block as calls of at most ``rows_cap`` query rows x ``cols_cap`` keys.

    Parts that the causal mask or the ``mask_mod``'s declared block state hides entirely are
    left out; parts entirely below the diagonal run without the causal mask.
    """
    p = b.positions
    # What the mask_mod declares of every part, read to the host once per block (per part, a
    # document mask's ids on a GPU would make the host wait for the device each time).
    qn, kn = b.q[1] - b.q[0], b.kv[1] - b.kv[0]
    rows_cap, cols_cap = max(1, min(rows_cap, qn)), max(1, min(cols_cap, kn))  # the same parts; no huge blocks
    grid = (
        call.block_states(p.q_offset, p.q_offset + qn, rows_cap, p.kv_offset, p.kv_offset + kn, cols_cap)
        if call.block_states is not None
        else None
    )
    for i, r0 in enumerate(range(b.q[0], b.q[1], rows_cap)):
        r1 = min(r0 + rows_cap, b.q[1])
        qg = p.q_offset + (r0 - b.q[0])
        for j, c0 in enumerate(range(b.kv[0], b.kv[1], cols_cap)):
            c1 = min(c0 + cols_cap, b.kv[1])
            kg = p.kv_offset + (c0 - b.kv[0])
            causal = b.is_causal
            if causal:
                if kg > qg + (r1 - r0) - 1:
                    continue
                if kg + (c1 - c0) - 1 <= qg:
                    causal = False
            if grid is not None and grid[i][j] == EMPTY:
                continue
            cols = None if b.mask_cols is None else (b.mask_cols[0] + c0 - b.kv[0], b.mask_cols[0] + c1 - b.kv[0])
            pos = BlockPositions(qg, kg, p.total_lengths, causal_offset=qg - kg, h_offset=p.h_offset)
            yield Block((r0, r1), (c0, c1), pos, causal, cols)


def block_states_of(mask_mod: Any, device: torch.device) -> Optional[Callable[..., Optional[List[List[int]]]]]:
    """What the mask_mod declares of a grid of blocks of global positions, when it declares anything:
    ``states(qs, qe, q_block, ks, ke, kv_block)`` gives the grid as lists (EMPTY, FULL, PARTIAL, or
    UNKNOWN), with one device -> host transfer for the whole grid."""
    if mask_mod is None:
        return None
    source = mask_mod
    if getattr(mask_mod, "block_states", None) is None and getattr(mask_mod, "block_state", None) is None:
        found = mask_mod_structure(mask_mod, device)
        if found.kind == "general":
            return None
        source = TracedMask(mask_mod, found)

    def states(qs: int, qe: int, q_block: int, ks: int, ke: int, kv_block: int) -> Optional[List[List[int]]]:
        got = declared_states(source, qs, qe, q_block, ks, ke, kv_block)
        return None if got is None else got.tolist()

    return states


def mask_block(mask: Optional[Tensor], b: Block) -> Optional[Tensor]:
    if mask is None:
        return None
    m = mask
    if m.shape[-2] != 1:
        m = m[..., b.q[0] : b.q[1], :]
    if m.shape[-1] != 1 and b.mask_cols is not None:
        m = m[..., b.mask_cols[0] : b.mask_cols[1]]
    return m


def _merge(acc_out: Tensor, acc_lse: Tensor, rows: Tuple[int, int], out: Tensor, lse: Tensor) -> None:
    """Fold a partial result over some keys into the running one: exact, by the log-sum-exp."""
    a_out, a_lse = acc_out[:, :, rows[0] : rows[1]], acc_lse[:, :, rows[0] : rows[1]]
    lse = lse.to(a_lse.dtype)
    new = torch.logaddexp(a_lse, lse)
    ref = new.masked_fill(new == float("-inf"), 0.0)  # rows that still see nothing stay 0
    a_out.mul_(torch.exp(a_lse - ref).unsqueeze(-1))
    a_out.add_(out.to(a_out.dtype).mul_(torch.exp(lse - ref).unsqueeze(-1)))
    a_lse.copy_(new)


class _Transfer:
    """Tensors in flight to the next rank and from the previous one (``batch_isend_irecv``)."""

    def __init__(self, g: Group, send: Sequence[Tensor], recv: Sequence[Tensor], tag: int) -> None:
        dist = torch_distributed()
        self.send = [t.contiguous() for t in send]  # alive until the sends complete
        self.recv = list(recv)
        ops = [dist.P2POp(dist.isend, t, g.next, g.handle, tag) for t in self.send]
        ops += [dist.P2POp(dist.irecv, t, g.prev, g.handle, tag) for t in self.recv]
        self.works = dist.batch_isend_irecv(ops) if ops else []
        STATS.bytes_sent += sum(t.numel() * t.element_size() for t in self.send)

    def wait(self) -> List[Tensor]:
        for w in self.works:
            w.wait()
        self.send = []
        return self.recv


_KV_TAG, _GRAD_TAG = 1, 2


def _kv_buffers(like_k: Tensor, like_v: Tensor, length: int) -> List[Tensor]:
    ks, vs = list(like_k.shape), list(like_v.shape)
    ks[-2] = vs[-2] = length
    return [like_k.new_empty(ks), like_v.new_empty(vs)]


def _ring_forward(call: Call, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of this rank's queries against every rank's keys, in ``P`` ring steps."""
    g = call.g
    B, Hq, Lq = q.shape[0], q.shape[1], q.shape[2]
    Ev = v.shape[-1]
    stats_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    acc_out = torch.zeros((B, Hq, Lq, Ev), dtype=stats_dtype, device=q.device)
    acc_lse = torch.full((B, Hq, Lq), float("-inf"), dtype=stats_dtype, device=q.device)
    kv = [k, v]
    for step in range(g.size):
        src = (g.rank - step) % g.size
        transfer = None
        if step < g.size - 1:
            transfer = _Transfer(g, kv, _kv_buffers(k, v, call.kv_lengths[(src - 1) % g.size]), _KV_TAG)
        parts = [part for b in ring_blocks(call, src) for part in split_block(call, b, call.sub_rows, 1 << 62)]
        if not parts:
            STATS.skipped_steps += 1
        for b in parts:
            with torch.no_grad():
                o, l = _run_block(call, b, q, kv, mask)
            _merge(acc_out, acc_lse, b.q, o, l)
            STATS.blocks += 1
            del o, l
        if transfer is not None:
            kv = transfer.wait()
    return acc_out.to(q.dtype), acc_lse


def _run_block(call: Call, b: Block, q: Tensor, kv: Sequence[Tensor], mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of one block through subquad's tiles, without a graph (the ring has its own backward)."""
    qb = q.detach()[:, :, b.q[0] : b.q[1]]
    kb, vb = (t.detach()[:, :, b.kv[0] : b.kv[1]] for t in kv)
    m = mask_block(mask, b)
    out, lse, _ = _call.attention_block(
        qb,
        kb,
        vb,
        b.positions,
        attn_mask=None if m is None else m.detach(),
        is_causal=b.is_causal,
        score_mod=call.score_mod,
        mask_mod=call.mask_mod,
        scale=call.scale,
        enable_gqa=call.enable_gqa,
        memory_budget=call.budget,
        captured=(),
    )
    return out, lse


def _block_grads(
    call: Call,
    b: Block,
    q: Tensor,
    kv: Sequence[Tensor],
    mask: Optional[Tensor],
    grad_out: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_lse: Optional[Tensor],
    want_mask: bool,
    captured: Sequence[Tensor],
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], List[Tensor]]:
    """dQ of the block's rows, dK/dV of its keys (and dmask, d captured) from the *global* out and lse.

    FlashAttention-2's backward needs only ``P = exp(S - lse)`` and ``D = rowsum(dO * O)``: with
    the global lse and output, the block's share of the gradients comes out directly.
    """
    rows = slice(b.q[0], b.q[1])
    qb = q[:, :, rows].detach().requires_grad_()
    kb = kv[0][:, :, b.kv[0] : b.kv[1]].detach().requires_grad_()
    vb = kv[1][:, :, b.kv[0] : b.kv[1]].detach().requires_grad_()
    mb = mask_block(mask, b)
    if mb is not None and want_mask:
        mb = mb.detach().requires_grad_()
    with torch.enable_grad():
        inp, _, budget, plan, _ = _call.prepare(
            qb,
            kb,
            vb,
            attn_mask=mb,
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
    kernel = plan.backward_backend or plan.backend
    if kernel not in ("fused", "loops", "matmul"):
        kernel = "matmul"
    chunk = plan.backward_chunk_size or plan.chunk_size or (max(inp.Lq, 1), max(inp.Lk, 1))
    dq, dk, dv, dmask, dcap = backward_grads(
        inp,
        kernel,
        chunk,
        0,
        budget,
        grad_out[:, :, rows],
        out[:, :, rows],
        lse[:, :, rows],
        None if grad_lse is None else grad_lse[:, :, rows],
        wanted=(True, True, True, want_mask),
        captured=captured,
    )
    assert dq is not None and dk is not None and dv is not None
    return dq, dk, dv, dmask, dcap


class Ring(torch.autograd.Function):
    """Ring attention with its own backward: dK/dV travel around the ring with K/V."""

    @staticmethod
    def forward(
        ctx: Any, call: Call, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], *captured: Tensor
    ) -> Tuple[Tensor, Tensor]:
        out, lse = _ring_forward(call, q, k, v, mask)
        ctx.save_for_backward(q, k, v, mask, out, lse, *captured)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx: Any, grad_out: Optional[Tensor], grad_lse: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        q, k, v, mask, out, lse, *captured = ctx.saved_tensors
        call: Call = ctx.call
        g = call.g
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if grad_lse is not None:
            grad_lse = grad_lse.masked_fill(torch.isneginf(lse), 0.0)
        want_mask = bool(ctx.needs_input_grad[4]) and mask is not None
        acc_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dmask = torch.zeros(mask.shape, dtype=lse.dtype, device=q.device) if want_mask else None
        dcaptured = [torch.zeros_like(c) for c in captured]
        kv = [k, v]
        incoming: Optional[_Transfer] = None  # the dK/dV accumulator of the next keys, on its way
        for step in range(g.size):
            src = (g.rank - step) % g.size
            transfer = None
            if step < g.size - 1:
                transfer = _Transfer(g, kv, _kv_buffers(k, v, call.kv_lengths[(src - 1) % g.size]), _KV_TAG)
            # The accumulator of the keys in hand: this rank's own keys start from zero, the others
            # arrive with what the previous ranks added. Waiting for it here (not after the compute)
            # keeps one accumulator alive instead of two; the K/V transfer still overlaps.
            if incoming is None:
                dkv = [torch.zeros(t.shape, dtype=acc_dtype, device=t.device) for t in kv]
            else:
                dkv = incoming.wait()
                incoming = None
            parts = (
                part for b in ring_blocks(call, src) for part in split_block(call, b, call.sub_rows, call.sub_cols)
            )
            for b in parts:
                gq, gk, gv, gm, gc = _block_grads(
                    call, b, q, kv, mask, grad_out, out, lse, grad_lse, want_mask, captured
                )
                dq[:, :, b.q[0] : b.q[1]] += gq
                dkv[0][:, :, b.kv[0] : b.kv[1]] += gk
                dkv[1][:, :, b.kv[0] : b.kv[1]] += gv
                if dmask is not None and gm is not None:
                    target = dmask
                    if target.shape[-2] != 1:
                        target = target[..., b.q[0] : b.q[1], :]
                    if target.shape[-1] != 1 and b.mask_cols is not None:
                        target = target[..., b.mask_cols[0] : b.mask_cols[1]]
                    target += gm
                for acc, gc_ in zip(dcaptured, gc):
                    acc += gc_
                del gq, gk, gv, gm, gc
            # Send the accumulator on; after the last step it reaches the rank that owns these keys.
            arriving = [t.to(acc_dtype) for t in _kv_buffers(k, v, call.kv_lengths[(src - 1) % g.size])]
            incoming = _Transfer(g, dkv, arriving, _GRAD_TAG)
            del dkv
            if transfer is not None:
                kv = transfer.wait()
                transfer = None
        assert incoming is not None
        dk, dv = incoming.wait()
        grads = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)]
        return (
            None,
            *[gr if ctx.needs_input_grad[i + 1] else None for i, gr in enumerate(grads)],
            None if dmask is None else dmask.to(mask.dtype),
            *[d if ctx.needs_input_grad[5 + i] else None for i, d in enumerate(dcaptured)],
        )
