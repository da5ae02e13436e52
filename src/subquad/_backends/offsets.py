"""Half-precision products offset by each row's maximum so far (the ``matmul`` tiles, bfloat16 on
a CPU with AVX512-BF16 or AMX): the operand with its offset column, the first offsets of a row
block, and when a row's product is computed again."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .._inputs import Inputs
from .._tiles import Segment
from .scratch import Scratch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

PARTIAL_REDO_BATCHES = 16
PARTIAL_REDO_SHARE = 8
"""A tile whose offsets moved too far in at most this many of its batch entries (heads), and in
at most 1/``PARTIAL_REDO_SHARE`` of its rows, computes those rows again; otherwise the whole tile."""

OFFSET_DRIFT = 2.0 * LOG2E
"""How far (in log2 units: 2 in score units) a row's maximum may lie from the offset of its
half-precision product before the product is redone with a new offset: within it, the entries
the softmax weighs most are rounded to 2^-7 (in log2 units) or better. With 1.0 (in score units)
nearly every tile of 1x8x4096x64 was computed twice: among thousands of rows one always moves."""

FIRST_OFFSET_MARGIN = 0.5 * LOG2E
"""Added to a row block's first offsets (log2 units; 0.5 in score units) where the first tile has
no mask. A sample's maximum lies at or below the tile's, so with the margin a row's maximum may
lie up to the margin + :data:`OFFSET_DRIFT` above its sample's before the row is computed again.
(In a masked tile the sample may hold keys a row does not see, its maximum above the row's: a
margin there redid 72 rows of a causal call's first, diagonal, tile instead of 29.) 1x8x4096x64
bf16, seeds 0-4: 37-49 rows computed again instead of 108-158 (causal, seeds 0-2: 63-74 instead
of 82-99); in-process pairs measured 0.94-0.98x the time (two threads; causal 0.96x) and 1.00x
(1x8x2048x64, one thread). Over 24 calls of 1x4x1024x64 (scores ~1-16, causal or not) the
largest error against float64 did not change and the mean error rose 0.4%. A margin of 1.0 (then
on masked first tiles too) cut the rows to 24-36 and raised the mean error 1.9%."""


class OffsetOperand:
    """A half-precision GEMM operand ``a`` (batch, rows, E) with one more column for each row's
    offset: a product is ``alpha · [a, -o/alpha] @ [b, 1]ᵀ = alpha · a @ bᵀ - o``.

    The GEMM accumulates in float32 and rounds its result once, to the operands' dtype (8
    significant bits for bfloat16): with the offset inside, what it rounds is each value's
    distance to its row's offset, so the entries near it (those the softmax weighs) keep an
    absolute error of 2^-9 of that distance, not of their magnitude (scores of 40 would
    otherwise be off by 0.06, 6% once exponentiated). Both operands are contiguous copies (a
    bfloat16 GEMM on strided tiles ran 35% slower here), the offset column costs one more step
    of the reduction (E + 1), and ``alpha`` is applied in float32 before the rounding.
    """

    def __init__(self, a: Tensor, alpha: float) -> None:
        batch, rows, e = a.shape
        self.e, self.alpha = e, alpha
        # torch's CPU bfloat16 baddbmm writes nothing when alpha is 0 in float32 (torch 2.13: the
        # output keeps what it held). An alpha below float32's smallest normal (a scale of 0, or
        # one that underflows) makes every product 0 or far below what a softmax tells from 0:
        # such products are 0 here, and so are their offsets.
        self.vanishes = abs(alpha) < torch.finfo(torch.float32).tiny
        self.rows = torch.empty((batch, rows, e + 1), dtype=a.dtype, device=a.device)
        self.rows[..., :e].copy_(a)

    def set_offset(self, off: Tensor) -> Tensor:
        """Set each row's offset from ``off`` (batch, rows), values near its largest: rounded to
        the operands' dtype, 0 where not finite. Returns the offsets the products subtract, in
        ``off``'s dtype, ``(batch, rows, 1)``.

        The column holds ``off / alpha``: 0 where the products vanish (:attr:`vanishes`), and
        where it overflows the operands' dtype (an ``alpha`` just above float32's smallest normal
        with an offset far from 0: the lse of the backward), as ``alpha · a @ bᵀ`` is then nearly 0.
        """
        finite = torch.nan_to_num(off, nan=0.0, posinf=0.0, neginf=0.0)
        col = torch.zeros_like(finite) if self.vanishes else finite.div(self.alpha)
        col = torch.nan_to_num(col.to(self.rows.dtype), nan=0.0, posinf=0.0, neginf=0.0)
        self.rows[..., self.e].copy_(col.neg())
        return col.to(off.dtype).mul_(self.alpha).unsqueeze(-1)

    def product(self, b_ext: Tensor, out: Tensor) -> Tensor:
        """``alpha · a @ bᵀ - offset`` for ``b_ext = [b, 1]`` from :meth:`operand`, rounded once,
        written to ``out``."""
        if self.vanishes:
            return out.zero_()
        return torch.baddbmm(out, self.rows, b_ext.transpose(1, 2), beta=0.0, alpha=self.alpha, out=out)

    def rows_product(self, b_ext: Tensor, batch: int, rows: Tensor) -> Tensor:
        """:meth:`product` for some ``rows`` of one ``batch`` entry only, as a new tensor."""
        a = self.rows[batch].index_select(0, rows)
        if self.vanishes:
            return a.new_zeros(rows.numel(), b_ext.shape[1])
        return torch.addmm(a.new_empty(rows.numel(), b_ext.shape[1]), a, b_ext[batch].t(), beta=0.0, alpha=self.alpha)

    def operand(self, b: Tensor, scratch: Scratch) -> Tensor:
        """``[b, 1]`` (batch, n, E + 1), in a scratch buffer."""
        batch, n, e = b.shape
        b_ext = scratch.get("operand", (batch, n, e + 1), self.rows.dtype)
        b_ext[..., :e].copy_(b)
        b_ext[..., e].fill_(1.0)
        return b_ext


def sampled_max(q_op: OffsetOperand, k_t: Tensor) -> Tensor:
    """The rows' largest score over a sample of the keys (every ``kn // 128``-th), float32: a
    row block's first offsets, so that its first tile is rarely computed twice."""
    step = max(1, k_t.shape[1] // _OFFSET_SAMPLE_KEYS)
    sample = torch.bmm(q_op.rows[..., : q_op.e], k_t[:, ::step].transpose(1, 2))
    return sample.amax(dim=-1).float().mul_(q_op.alpha)


_OFFSET_SAMPLE_KEYS = 128


def first_offsets(inp: Inputs, seg: Segment, q_op: OffsetOperand, k_t: Tensor, m_run: Tensor, off: Tensor) -> Tensor:
    """The offsets of a tile: ``off`` (the rows' maximum so far), or, in a row block's first tile
    (or while no row has seen a key), the maximum over a sample of its keys, plus
    :data:`FIRST_OFFSET_MARGIN` where every row sees every key of the tile."""
    if seg.ks == 0 or bool(torch.isneginf(m_run).all()):
        # A sample of keys every row sees has its maximum at or below the tile's; a masked
        # tile's may lie above a row's (keys that row does not see): no margin there.
        sees_all = inp.attn_mask is None and seg.causal == "none" and not seg.needs_mask_mod
        return q_op.set_offset(sampled_max(q_op, k_t).add_(FIRST_OFFSET_MARGIN if sees_all else 0.0))
    return off


def far_rows(m_tile: Tensor, m_run: Tensor, off: Tensor) -> Tuple[Tensor, Tensor, Optional[List[int]]]:
    """``(moved, far, batches)``: the rows whose maximum rose in this tile, those of them whose
    maximum lies more than :data:`OFFSET_DRIFT` from its offset, and the batch entries that hold
    them; ``batches`` is None when the whole tile is to be computed again (too many)."""
    moved = m_tile > m_run
    far = moved & ((m_tile - off.squeeze(-1)).abs() > OFFSET_DRIFT)
    if not bool(far.any()):
        return moved, far, []
    return moved, far, redo_batches(far, int(far.sum()))


def redo_batches(far: Tensor, n_far: int) -> Optional[List[int]]:
    """The batch entries that hold the ``n_far`` rows ``far`` marks, whose products are computed
    again (``[]`` for none), or None when the whole tile is (too many)."""
    if n_far == 0:
        return []
    batches = far.any(dim=-1).nonzero().squeeze(1).tolist()
    if len(batches) > PARTIAL_REDO_BATCHES or n_far * PARTIAL_REDO_SHARE > far.numel():
        return None
    return batches


def exp_(t: Tensor) -> Tensor:
    """``t.exp_()``, computed as ``2^(t·log2 e)`` below float64: PyTorch's CPU ``exp2`` runs 3-4x
    faster than its ``exp`` (0.18 vs 0.64 ns per element on the 2-core CPU), and the exponent's
    extra rounding (2^-24 relative) is far below what float32 statistics resolve."""
    if t.dtype == torch.float64:
        return t.exp_()
    return t.mul_(LOG2E).exp2_()
