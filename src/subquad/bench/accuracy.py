"""How close an implementation's output is to the truth, cheaply: ``sampled_errors`` checks a
sample of query rows (and of dQ rows with backward) against float64 references computed for those
rows only. Used by ``measure`` (re-exported there as ``measure.sampled_errors``)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .cases import SOFTCAP, WINDOW, BenchInputs


def _sample(n: int, k: int, gen: torch.Generator) -> list[int]:
    """Up to ``k`` distinct indices in [0, n), always including the first and the last."""
    picks = {0, n - 1}
    if n > 2:
        picks.update(torch.randperm(n - 2, generator=gen)[: max(0, k - 2)].add(1).tolist())
    return sorted(picks)


def _host64(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64 on the CPU, moved there first: MPS has no float64 (``.double()`` on an
    MPS tensor raises)."""
    return t.detach().cpu().double()


def sampled_errors(
    inputs: BenchInputs,
    out: torch.Tensor,
    grad_query: Optional[torch.Tensor] = None,
    *,
    heads: int = 4,
    rows: int = 8,
    seed: int = 0,
) -> tuple[float, Optional[float]]:
    """Relative error ‖out − ref‖ / ‖ref‖ over a sample of (batch, head) pairs and query rows,
    with ``ref`` computed in float64 on the CPU for those rows only (a row of attention needs
    only its own query, so this costs rows·Lk·E instead of Lq·Lk·E). With ``grad_query`` the
    same for dQ, whose row i likewise depends only on query row i and dO row i."""
    case = inputs.case
    gen = torch.Generator().manual_seed(seed)
    flat = _sample(case.batch * case.heads, heads, gen)
    row_idx = torch.tensor(_sample(case.q_len, rows, gen))
    j = torch.arange(case.kv_len).view(1, -1)
    i = row_idx.view(-1, 1)
    err = [0.0, 0.0]
    ref_norm = [0.0, 0.0]
    for bh in flat:
        b, h = divmod(bh, case.heads)
        q = _host64(inputs.query[b, h, row_idx.to(inputs.query.device)])
        k = _host64(inputs.key[b, h])
        v = _host64(inputs.value[b, h])
        q.requires_grad_(grad_query is not None)
        scores = q @ k.T * inputs.scale
        if case.mask == "softcap":
            scores = SOFTCAP * torch.tanh(scores / SOFTCAP)
        if case.causal:
            scores = scores.masked_fill(j > i, float("-inf"))
        if case.mask == "window":
            scores = scores.masked_fill(j < i - WINDOW, float("-inf"))
        if case.mask == "document" and inputs.doc_ids is not None:  # make_inputs made them
            ids = inputs.doc_ids.cpu()
            scores = scores.masked_fill(ids[row_idx].view(-1, 1) != ids[: case.kv_len].view(1, -1), float("-inf"))
        if case.mask == "key-padding" and inputs.kv_lengths is not None:
            scores = scores.masked_fill(j >= int(inputs.kv_lengths[b]), float("-inf"))
        if case.mask == "alibi" and inputs.slopes is not None:
            scores = scores + float(inputs.slopes[h]) * (j - i).double()
        ref = scores.softmax(dim=-1) @ v
        got = _host64(out[b, h, row_idx.to(out.device)])
        err[0] += float((got - ref.detach()).square().sum())
        ref_norm[0] += float(ref.detach().square().sum())
        if grad_query is not None and inputs.grad_out is not None:
            d_out = _host64(inputs.grad_out[b, h, row_idx.to(out.device)])
            (ref_dq,) = torch.autograd.grad(ref, q, d_out)
            got_dq = _host64(grad_query[b, h, row_idx.to(grad_query.device)])
            err[1] += float((got_dq - ref_dq).square().sum())
            ref_norm[1] += float(ref_dq.square().sum())

    def rel(e, r):
        return math.sqrt(e / r) if r > 0 else math.sqrt(e)

    return rel(err[0], ref_norm[0]), rel(err[1], ref_norm[1]) if grad_query is not None else None
