"""The tile loop: query blocks against key segments, forward and backward.

For each block of ``q_chunk`` query rows the engine lists the key segments that can contribute
(causal tiles above the diagonal and tiles that a ``mask_mod`` hides everywhere are skipped, never
computed) and hands them to a chunk kernel (:mod:`subquad._kernels`). The output is written into a
preallocated tensor block by block, so peak memory is one block's working set whatever the number
of blocks.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor

from ._inputs import Inputs
from ._kernels import FusedCPUKernel, Grads, MatmulKernel, Segment, eval_mask_mod

Kernel = Union[MatmulKernel, FusedCPUKernel]

KERNELS = {"matmul": MatmulKernel(), "fused": FusedCPUKernel()}


class TileCounter:
    """Counts computed and skipped tiles; tests use it to check block skipping."""

    def __init__(self) -> None:
        self.computed = 0
        self.skipped = 0

    def reset(self) -> None:
        self.computed = 0
        self.skipped = 0


TILES = TileCounter()

# Block states a built-in mask_mod may report through ``mask_mod.block_state(qs, qe, ks, ke)``.
EMPTY, FULL, PARTIAL = 0, 1, 2


def _mask_mod_state(inp: Inputs, qs: int, qe: int, ks: int, ke: int) -> Tuple[int, Optional[Tensor]]:
    """The tile's state under ``mask_mod``, and the evaluated mask when it had to be evaluated."""
    mm = inp.mask_mod
    if mm is None:
        return FULL, None
    declared: Optional[Callable[[int, int, int, int], int]] = getattr(mm, "block_state", None)
    if declared is not None:
        state = declared(qs, qe, ks, ke)
        if state in (EMPTY, FULL, PARTIAL):
            return int(state), None
    # Exact for any callback: evaluate it on the tile's indices (elementwise, no matmul); the
    # result is handed on with the segment so that it is not evaluated twice.
    keep = eval_mask_mod(inp, qs, qe, ks, ke)
    if not bool(keep.any()):
        return EMPTY, None
    return (FULL, None) if bool(keep.all()) else (PARTIAL, keep)


def kv_segments(inp: Inputs, qs: int, qe: int, kv_chunk: int, coalesce: bool) -> Iterator[Segment]:
    """Key segments that query rows ``[qs, qe)`` must visit, in order, produced lazily.

    With ``coalesce``, neighbouring segments that need no generated mask are joined (the fused
    kernel's memory does not grow with the segment length).
    """
    pending: Optional[Segment] = None
    for ks in range(0, inp.Lk, kv_chunk):
        ke = min(ks + kv_chunk, inp.Lk)
        causal = "none"
        if inp.is_causal:
            if ks > qe - 1:
                TILES.skipped += (inp.Lk - ks + kv_chunk - 1) // kv_chunk
                break
            if ke - 1 > qs:
                causal = "diag" if ks == qs else "partial"
        state, keep = _mask_mod_state(inp, qs, qe, ks, ke)
        if state == EMPTY:
            TILES.skipped += 1
            continue
        seg = Segment(ks, ke, causal, state == PARTIAL, keep)
        TILES.computed += 1
        if not coalesce:
            yield seg
            continue
        if (
            pending is not None
            and pending.ke == seg.ks
            and not _needs_generated_mask(inp, pending)
            and not _needs_generated_mask(inp, seg)
        ):
            pending = Segment(pending.ks, seg.ke)
            continue
        if pending is not None:
            yield pending
        pending = seg
    if pending is not None:
        yield pending


def _needs_generated_mask(inp: Inputs, seg: Segment) -> bool:
    bool_or_cast = inp.attn_mask is not None and inp.attn_mask.dtype != inp.dtype
    additive = inp.score_mod is not None
    return seg.causal != "none" or seg.mask_mod or bool_or_cast or additive


def _nonempty(segments: Iterator[Segment]) -> Optional[Iterator[Segment]]:
    first = next(segments, None)
    return None if first is None else itertools.chain([first], segments)


def _row_blocks(Lq: int, q_chunk: int) -> List[Tuple[int, int]]:
    return [(qs, min(qs + q_chunk, Lq)) for qs in range(0, Lq, q_chunk)]


def forward(
    inp: Inputs, kernel_name: str, chunk: Tuple[int, int], seed: int, need_lse: bool
) -> Tuple[Tensor, Optional[Tensor]]:
    """Attention of the whole call, ``(out (B, Hq, Lq, Ev), lse (B, Hq, Lq) or None)``."""
    kernel = KERNELS[kernel_name]
    q_chunk, kv_chunk = chunk
    B, Hq, Lq = inp.B, inp.Hq, inp.Lq
    lse = torch.empty((B, Hq, Lq), dtype=inp.stats_dtype, device=inp.device) if need_lse else None
    coalesce = kernel_name == "fused"
    blocks = _row_blocks(Lq, q_chunk)
    if isinstance(kernel, FusedCPUKernel) and len(blocks) == 1:
        # One block of rows: the kernel's own output is the result, no copy.
        segs = _nonempty(kv_segments(inp, 0, Lq, kv_chunk, coalesce))
        if segs is not None:
            out, rows_lse = kernel.forward_rows(inp, 0, Lq, segs, None, seed)
            if lse is not None:
                lse.copy_(rows_lse)
            return out.to(inp.dtype), lse
    out = torch.empty((B, Hq, Lq, inp.Ev), dtype=inp.dtype, device=inp.device)
    for qs, qe in blocks:
        segs = _nonempty(kv_segments(inp, qs, qe, kv_chunk, coalesce))
        if segs is None:
            out[:, :, qs:qe].zero_()
            if lse is not None:
                lse[:, :, qs:qe].fill_(float("-inf"))
            continue
        result = kernel.forward_rows(inp, qs, qe, segs, out, seed)
        if lse is not None:
            lse[:, :, qs:qe].copy_(result[1] if isinstance(result, tuple) else result)
        del result
    return out, lse


def backward(
    inp: Inputs,
    kernel_name: str,
    chunk: Tuple[int, int],
    seed: int,
    grad_out: Tensor,
    out: Tensor,
    lse: Tensor,
    grads: Grads,
    grad_lse: Optional[Tensor] = None,
) -> None:
    """Accumulate the gradients of the whole call into ``grads``, block by block."""
    kernel = KERNELS[kernel_name]
    q_chunk, kv_chunk = chunk
    for qs, qe in _row_blocks(inp.Lq, q_chunk):
        segs = _nonempty(kv_segments(inp, qs, qe, kv_chunk, coalesce=kernel_name == "fused"))
        if segs is not None:
            kernel.backward_rows(inp, qs, qe, segs, grad_out, out, lse, seed, grads, grad_lse)


def whole_fused_backward(
    inp: Inputs, chunk: Tuple[int, int], grad_out: Tensor, out: Tensor, lse: Tensor
) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
    """``(dq, dk, dv)`` from one fused backward call, when the whole input is one tile.

    The kernel's own gradients are then the result: no accumulators beside them.
    """
    if chunk[0] < inp.Lq or inp.Lq == 0:
        return None
    segs = list(kv_segments(inp, 0, inp.Lq, chunk[1], coalesce=True))
    if len(segs) != 1 or (segs[0].ks, segs[0].ke) != (0, inp.Lk):
        return None
    return KERNELS["fused"].segment_backward(inp, 0, inp.Lq, segs[0], grad_out, out, lse)
