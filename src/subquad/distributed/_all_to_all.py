"""The all-to-all strategy ("Ulysses", DeepSpeed): sequence shards become head shards and back.

Used by the rest of ``subquad.distributed``: ``run_ulysses``, ``SeqToHeads``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from .. import _call
from .._inputs import BlockPositions
from ._agreement import Call
from ._group import STATS, Group, torch_distributed
from ._layouts import pieces

_NO_ALL_TO_ALL: Set[str] = set()
"""Backends that refused ``all_to_all`` in this process (gloo before torch 2.10): they exchange in pairs."""

_PAIRS_TAG = 3


def _all_to_all(g: Group, send: List[Tensor], recv: List[Tensor]) -> None:
    dist = torch_distributed()
    send = [t.contiguous() for t in send]
    backend = str(dist.get_backend(g.handle))
    if backend not in _NO_ALL_TO_ALL:
        try:
            dist.all_to_all(recv, send, group=g.handle)
        except RuntimeError as e:
            # Raised on every rank before anything is sent ("Backend gloo does not support
            # alltoall"), so all ranks fall back together.
            if "does not support alltoall" not in str(e):
                raise
            _NO_ALL_TO_ALL.add(backend)
    if backend in _NO_ALL_TO_ALL:
        ops = [
            dist.P2POp(dist.isend, t, g.global_rank(r), g.handle, _PAIRS_TAG) for r, t in enumerate(send) if r != g.rank
        ]
        ops += [
            dist.P2POp(dist.irecv, t, g.global_rank(r), g.handle, _PAIRS_TAG) for r, t in enumerate(recv) if r != g.rank
        ]
        works = dist.batch_isend_irecv(ops) if ops else []
        recv[g.rank].copy_(send[g.rank])
        for w in works:
            w.wait()
    STATS.bytes_sent += sum(t.numel() * t.element_size() for r, t in enumerate(send) if r != g.rank)


def _seq_to_heads(g: Group, x: Tensor, layout: str, lengths: Sequence[int]) -> Tensor:
    """``(B, H, L/P, D)`` sequence shards -> ``(B, H/P, L, D)``: this rank's heads, the whole sequence."""
    B, H, _, D = x.shape
    h = H // g.size
    send = list(x.split(h, dim=1))
    recv = [x.new_empty((B, h, lengths[r], D)) for r in range(g.size)]
    _all_to_all(g, send, recv)
    out = x.new_empty((B, h, sum(lengths), D))
    for r in range(g.size):
        for local, start, n in pieces(layout, lengths, r):
            out[:, :, start : start + n].copy_(recv[r][:, :, local : local + n])
    return out


def _heads_to_seq(g: Group, x: Tensor, layout: str, lengths: Sequence[int]) -> Tensor:
    """The inverse of :func:`_seq_to_heads`: ``(B, H/P, L, D)`` -> ``(B, H, L/P, D)``."""
    B, h, _, D = x.shape
    send = []
    for r in range(g.size):
        runs = pieces(layout, lengths, r)
        send.append(torch.cat([x[:, :, s : s + n] for _, s, n in runs], 2) if runs else x[:, :, :0])
    recv = [x.new_empty((B, h, lengths[g.rank], D)) for _ in range(g.size)]
    _all_to_all(g, send, recv)
    return torch.cat(recv, 1)


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, g: Group, layout: str, lengths: List[int], inverse: bool) -> Tensor:
        ctx.args = (g, layout, lengths, inverse)
        return (_heads_to_seq if inverse else _seq_to_heads)(g, x, layout, lengths)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], None, None, None, None]:
        g, layout, lengths, inverse = ctx.args
        return (
            (_seq_to_heads if inverse else _heads_to_seq)(g, grad.contiguous(), layout, lengths),
            None,
            None,
            None,
            None,
        )


def run_ulysses(call: Call, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
    g, P = call.g, call.g.size
    qh = SeqToHeads.apply(q, g, call.layout, call.q_lengths, False)
    kh = SeqToHeads.apply(k, g, call.layout, call.kv_lengths, False)
    vh = SeqToHeads.apply(v, g, call.layout, call.kv_lengths, False)
    block = BlockPositions(0, 0, (call.Lq, call.Lk), h_offset=g.rank * (q.shape[1] // P))
    out, lse, _ = _call.attention_block(
        qh,
        kh,
        vh,
        block,
        attn_mask=None,
        is_causal=call.is_causal,
        score_mod=call.score_mod,
        mask_mod=call.mask_mod,
        scale=call.scale,
        enable_gqa=call.enable_gqa,
        memory_budget=call.budget,
    )
    del qh, kh, vh
    out = SeqToHeads.apply(out, g, call.layout, call.q_lengths, True)
    lse = SeqToHeads.apply(lse.unsqueeze(-1), g, call.layout, call.q_lengths, True).squeeze(-1)
    return out, lse
