"""Short packed sequences in shared tiles: one batched product per bucket, not one call per sequence.

A packed call runs its sequences one at a time (:func:`subquad._engine.forward`), which costs
tens of microseconds of Python and dispatch per sequence: for a thousand sequences of a few
tokens that is more than the arithmetic, and a per-sequence SDPA loop was faster. Here sequences
of at most :data:`SHORT_SCORES` scores and :data:`SHORT_ROWS` rows are grouped by their lengths
rounded up (:func:`padded`: to a power of two up to 8, then to a multiple of 8), gathered into a
padded batch ``(n, Hq, Lb, E)``
with a mask that keeps each sequence's own keys (and its causal alignment), and computed with
two matmuls and a float32 softmax: the matmul path's arithmetic on a tile holding many sequences.
A batch takes at most :data:`BATCH_BYTES`, and never more than the budget (the plan's predicted
peak counts it); calls that reach the engine without a budget batch within what their planned
tiles were predicted to need.

Only plain packed calls take buckets (``Inputs.short_sequences_share_tiles``: no ``score_mod``,
``mask_mod``, window, mask or dropout); the others, the backward and longer sequences keep their
per-sequence tiles.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ._backends.offsets import LN2, LOG2E
from ._inputs import Inputs
from ._tiles import TILES

SHORT_SCORES = 4096
"""Sequences of at most this many scores over all heads (``Hq * Lq_s * Lk_s``) and at most
:data:`SHORT_ROWS` rows share tiles: one head of 64 x 64, eight of 8 x 8. Measured on 1024
sequences of 1-64 tokens (one thread): one head 120 -> 52 ms; eight heads 278 ms per sequence,
257 ms with sequences up to 16 x 16 shared, 571 ms with those up to 64 x 64 (gathering and padding
them costs more than a call each)."""

SHORT_ROWS = 64
"""Sequences of more query rows over all heads (``Hq * Lq_s``) keep one kernel call each: 512
sequences of L tokens, shared / one kernel call each / a per-sequence SDPA loop (one thread,
lengths that need no padding): 8 heads x 8 tokens 0.82 / 0.87 / 1; 8 x 16 1.24 / 0.91 / 1;
4 x 16 0.87 / 0.93 / 1; 4 x 32 1.06 / 0.82 / 1; 2 x 32 0.81 / 0.82 / 1; 1 x 64 0.69 / 0.77 / 1."""

BATCH_BYTES = 4 << 20
"""What one batch of a bucket may take (within the budget; the plan's predicted peak counts it)."""


def buckets(inp: Inputs, tiles: Tuple[int, int]) -> Dict[Tuple[int, int], List[int]]:
    """Short sequences that fit one of the planned ``tiles``, by their padded lengths:
    ``{(Lb, Kb): [sequence, ...]}`` (a sequence of several tiles keeps its own)."""
    p = inp.packed
    assert p is not None
    out: Dict[Tuple[int, int], List[int]] = {}
    for s in range(p.n):
        qs, qe, ks, ke = p.rows(s)
        lq, lk = qe - qs, ke - ks
        if lq == 0 or inp.Hq * lq * lk > SHORT_SCORES or inp.Hq * lq > SHORT_ROWS or lq > tiles[0] or lk > tiles[1]:
            continue
        out.setdefault((padded(lq), padded(max(lk, 1))), []).append(s)
    return out


def padded(n: int) -> int:
    """The length a bucket pads ``n`` to: a power of two up to 8, then a multiple of 8 (padded to
    64, 512 sequences of 45 tokens, two heads, ran 1.5x slower shared than one kernel call each)."""
    return 1 << (n - 1).bit_length() if n <= 8 else -(-n // 8) * 8


def sequence_bytes(inp: Inputs, Lb: int, Kb: int) -> int:
    """What one padded sequence adds to a bucket's batch: gathered rows, keys and values, its
    scores (float32, the softmax in place), its mask and its output before it is scattered."""
    st = inp.stats_itemsize
    n = inp.Hq * Lb * (inp.E + inp.Ev) * st + inp.Hk * Kb * (inp.E + inp.Ev) * st
    n += inp.Hq * Lb * Kb * st + Lb * Kb + inp.Hq * Lb * inp.Ev * st
    return n + 16 * (Lb + Kb)  # index vectors


def run_bucket(
    inp: Inputs, seqs: List[int], padded: Tuple[int, int], limit: int, out: Tensor, lse: Optional[Tensor]
) -> None:
    """Attention of sequences ``seqs`` (padded to ``padded``), written into their rows of ``out``
    ``(1, Hq, total, Ev)`` and ``lse`` ``(1, Hq, total)``, in batches of at most ``limit`` bytes
    (:func:`sequence_bytes` each; one sequence at least)."""
    Lb, Kb = padded
    TILES.computed += len(seqs)  # each sequence's one tile, computed in a shared batch
    per = max(1, limit // sequence_bytes(inp, Lb, Kb))
    for i in range(0, len(seqs), per):
        _run(inp, seqs[i : i + per], Lb, Kb, out, lse)


def _run(inp: Inputs, seqs: List[int], Lb: int, Kb: int, out: Tensor, lse: Optional[Tensor]) -> None:
    p = inp.packed
    assert p is not None
    dev, sdt = inp.device, inp.stats_dtype
    rows = torch.tensor([p.rows(s) for s in seqs], dtype=torch.int64, device=dev)
    qs, qe, ks, ke = rows.unbind(1)
    lq, lk = qe - qs, ke - ks
    i = torch.arange(Lb, device=dev)
    j = torch.arange(Kb, device=dev)
    # Padded rows and keys repeat a real one (their results are discarded, their keys masked).
    q_idx = qs[:, None] + torch.minimum(i[None], (lq - 1)[:, None])
    k_idx = (ks[:, None] + torch.minimum(j[None], (lk - 1).clamp(min=0)[:, None])).clamp(max=inp.Lk - 1)
    keep = j[None, None, :] < lk[:, None, None]  # (n, 1, Kb): a sequence's own keys
    if inp.is_causal:
        offsets = torch.tensor([inp.causal_offset + p.offset(s) for s in seqs], device=dev)
        keep = keep & (j[None, None, :] <= i[None, :, None] + offsets[:, None, None])  # (n, Lb, Kb)
    n, G, Hk, E, Ev = len(seqs), inp.G, inp.Hk, inp.E, inp.Ev
    # Whole rows gathered from the caller's (total, H, E) layout; the heads sharing a key head
    # become rows of one product, (n, Hk, G*Lb, E).
    q = _gather(inp.query, q_idx, sdt).view(n, Lb, Hk, G, E).permute(0, 2, 3, 1, 4).reshape(n, Hk, G * Lb, E)
    k = _gather(inp.key, k_idx, sdt).view(n, Kb, Hk, E).transpose(1, 2)
    v = _gather(inp.value, k_idx, sdt).view(n, Kb, Hk, Ev).transpose(1, 2)
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(inp.scale * LOG2E)  # log2 units: exp2 needs no multiply
    hidden = ~keep.unsqueeze(1).unsqueeze(1)  # (n, 1, 1, Lb or 1, Kb) against (n, Hk, G, Lb, Kb)
    s.view(n, Hk, G, Lb, Kb).masked_fill_(hidden, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = m.masked_fill(m == float("-inf"), 0.0)  # rows that see no key: output 0, lse -inf
    pr = s.sub_(m).exp2_()
    l = pr.sum(dim=-1, keepdim=True)
    o = torch.matmul(pr, v).div_(l.masked_fill(l == 0, 1.0))
    # The real rows back into their places, in the (total, Hq, ·) layout of out and lse.
    valid = (i[None] < lq[:, None]).reshape(-1)
    at = q_idx.reshape(-1)[valid]
    rows = o.view(n, Hk, G, Lb, Ev).permute(0, 3, 1, 2, 4).reshape(n * Lb, inp.Hq, Ev)[valid]
    out[0].transpose(0, 1).index_copy_(0, at, rows.to(out.dtype))
    if lse is not None:
        row_lse = (m + l.log2()).mul_(LN2).view(n, Hk, G, Lb).permute(0, 3, 1, 2).reshape(n * Lb, inp.Hq)[valid]
        lse[0].transpose(0, 1).index_copy_(0, at, row_lse.to(lse.dtype))


def _gather(t: Tensor, idx: Tensor, dtype: torch.dtype) -> Tensor:
    """Rows ``idx`` (any shape) of a packed ``(1, H, total, ·)`` tensor, as ``(idx.numel(), H, ·)``."""
    return t[0].transpose(0, 1).index_select(0, idx.reshape(-1)).to(dtype)
