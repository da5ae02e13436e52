"""The calls into subquad: batches, packed sequences, and one sequence at a time.

Every path gives flash-attn's layouts: ``out (B, Sq, Hq, Ev)`` / ``(total_q, Hq, Ev)`` and
``lse (B, Hq, Sq)`` / ``(Hq, total_q)``, the lse in flash-attn's convention
(:func:`~._semantics.finish_lse`). Nothing ``Sq x Sk`` is formed: windows are subquad masks whose
empty tiles are skipped, softcap and ALiBi a ``score_mod`` evaluated per tile.

Used by the rest of the package: :func:`dense`, :func:`packed`, :func:`per_sequence`.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

import subquad

from ._semantics import Semantics, dense_mask, finish_lse, score_mod

Result = Tuple[Tensor, Optional[Tensor]]


def dense(q: Tensor, k: Tensor, v: Tensor, sem: Semantics, want_lse: bool) -> Result:
    """``q (B, Sq, Hq, D)``, ``k (B, Sk, Hk, D)``, ``v (B, Sk, Hk, Dv)`` -> ``out (B, Sq, Hq, Dv)``, ``lse (B, Hq, Sq)``."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    result = subquad.attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        mask_mod=dense_mask(sem, seqlen_q, seqlen_k),
        score_mod=score_mod(sem, seqlen_k - seqlen_q),
        scale=sem.scale,
        enable_gqa=q.shape[2] != k.shape[2],
        dropout_p=sem.dropout_p,
        return_lse=want_lse,
    )
    out, lse = result if isinstance(result, tuple) else (result, None)
    # flash-attn's layout; subquad's tiles usually write (B, Sq, Hq, Ev) already (then no copy).
    out = out.transpose(1, 2).contiguous()
    if lse is None:
        return out, None
    diag = torch.arange(seqlen_q, device=lse.device) + (seqlen_k - seqlen_q)
    slopes = None if sem.alibi is None else sem.alibi[:, :, None]
    return out, finish_lse(lse, sem, slopes, diag)


def packed(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Sequence[int],
    cu_k: Sequence[int],
    sem: Semantics,
    want_lse: bool,
    *,
    seqused_k: Optional[Sequence[int]] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
) -> Result:
    """Packed sequences ``q (total_q, Hq, D)``, ``k (total_k, Hk, D)`` -> ``out (total_q, Hq, Dv)``, ``lse (Hq, total_q)``.

    Sequence ``s``: rows ``cu_q[s]:cu_q[s+1]``, keys from ``cu_k[s]``, ``seqused_k[s]`` of them
    (default: up to ``cu_k[s+1]``); ``sem.alibi`` has one row per sequence.
    """
    n = len(cu_q) - 1
    used = [cu_k[s + 1] - cu_k[s] for s in range(n)] if seqused_k is None else list(seqused_k)
    rows = [cu_q[s + 1] - cu_q[s] for s in range(n)]
    device = q.device
    offset = torch.tensor([used[s] - rows[s] for s in range(n)], dtype=torch.long, device=device)
    result = subquad.varlen_attention(
        q,
        k,
        v,
        _offsets(cu_q, device),
        _offsets(cu_k, device),
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        seqused_k=None if seqused_k is None else torch.tensor(used, dtype=torch.int32, device=device),
        is_causal=sem.causal,
        alignment="bottom_right",
        window=None if sem.causal else sem.window,
        score_mod=score_mod(sem, offset),
        scale=sem.scale,
        enable_gqa=q.shape[1] != k.shape[1],
        dropout_p=sem.dropout_p,
        return_lse=want_lse,
    )
    out, lse = result if isinstance(result, tuple) else (result, None)
    if lse is None:
        return out, None
    seq = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(rows, device=device))
    diag = torch.arange(q.shape[0], device=device) - _offsets(cu_q, device)[seq] + offset[seq]
    slopes = None if sem.alibi is None else sem.alibi[seq].t()
    return out, finish_lse(lse.t(), sem, slopes, diag).contiguous()


def per_sequence(
    queries: Sequence[Tensor], keys: Callable[[int], Tuple[Tensor, Tensor]], sem: Semantics, want_lse: bool
) -> Tuple[List[Tensor], List[Tensor]]:
    """Sequence ``s``'s ``queries[s] (Sq_s, Hq, D)`` against ``keys(s) -> (k (Sk_s, Hk, D), v)``, one at a time.

    ``keys`` is called once per sequence, so only one sequence's keys (a gather of its cache
    pages) exist at a time. Returns the outputs ``(Sq_s, Hq, Dv)`` and lse ``(Hq, Sq_s)`` per sequence.
    """
    outs: List[Tensor] = []
    lses: List[Tensor] = []
    for s, q in enumerate(queries):
        k, v = keys(s)
        out, lse = dense(q[None], k[None], v[None], sem.sequence(s), want_lse)
        outs.append(out[0])
        if lse is not None:
            lses.append(lse[0])
    return outs, lses


def _offsets(cu: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor(list(cu), dtype=torch.int32, device=device)
