"""The ``matmul`` forward's tile loop in C++ (:mod:`subquad._native`, a CPU with AVX512-BF16):
bfloat16 calls without ``score_mod``, ``mask_mod`` or dropout, causal or not, with or without an
``attn_mask`` (read in place, a row at a time).

The eager loop (and the native kernel's per-tile passes) runs each tile over all heads at once:
an 8 x 512 x 512 tile of products is 4 MiB of bfloat16, written by one GEMM and read by the
next pass through the cache the cores share, where a neighbour's memory traffic evicts it
(``bench_neighbour.py``: 1.30-1.40x slower with a neighbour, the fused kernel 1.04-1.11x). Here
each thread takes 128 rows of one head at a time and, per 512 keys, computes their scores in
float32 (vdpbf16ps: bfloat16 operands, float32 accumulation), the online softmax, ``p`` rounded
to bfloat16 and its product with v, all in its own core's cache (256 KiB of scores). The scores
are float32 before the softmax, as in torch's fused kernel, so no product is offset or computed
again (:mod:`subquad._backends.offsets`), and the lse is as exact as the fused kernel's.

Per segment of keys (the planner's ``kv_chunk``) a call copies its keys and values into the
pairs the instruction reads (``B·Hk·kn·(E + Ev)`` bfloat16, padded): :func:`segment_bytes`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Iterable, Optional

import torch
from torch import Tensor

from .._inputs import Inputs
from .._native import tile_kernel
from .._tiles import NEG_INF, RowState, Segment, finish_rows
from .base import unit_stride
from .offsets import LOG2E
from .products import amx_tiles

MASK_DTYPES = (torch.bool, torch.float32, torch.bfloat16, torch.float16)
"""The ``attn_mask`` dtypes the loop reads in place (a float64 mask takes the per-tile path)."""

ROWS, KEYS = 128, 512
"""A task's rows and keys per step in ``_native_tiles.cpp`` (``kSegmentRows``, ``kSegmentKeys``)."""


def segment_kernel(inp: Inputs) -> Optional[ModuleType]:
    """The native kernel where it runs this call's forward loop: a CPU build with AVX512-BF16,
    bfloat16 inputs, no dropout, ``score_mod`` or ``mask_mod`` (one that declares itself causal
    runs as ``is_causal``), an ``attn_mask`` of :data:`MASK_DTYPES` if any; else None."""
    if inp.device_type != "cpu" or inp.dtype != torch.bfloat16 or inp.dropout_p > 0.0:
        return None
    if inp.score_mod is not None or inp.mask_mod is not None:
        return None
    if inp.attn_mask is not None and inp.attn_mask.dtype not in MASK_DTYPES:
        return None
    kernel = tile_kernel()
    return kernel if kernel is not None and hasattr(kernel, "forward_segment_bf16") else None


LOOP_BEFORE_FUSED_SCORES = 1 << 21
"""``auto`` takes the loop before the fused kernel from this many scores (``B·Hq·Lq·Lk``) on.
Bfloat16, two threads, 2-core CPU (AVX512-BF16, no AMX), the loop's time over the fused
kernel's, both through the full path: 1x8xLx64 at L = 256 (2^19 scores) 1.29, 512 (2^21) 0.81,
1024 0.69, 2048 0.64; 4x8x4096x40 0.71; 2x10x4096x64 against 77 keys (2^22.6) 0.82; a decode
step and calls of 16 tokens 0.4 and 7.0 (the fused kernel's fast path skips planning)."""


def before_fused(inp: Inputs) -> bool:
    """Whether ``auto`` takes the loop before the fused kernel: an inference call the loop takes
    (:func:`segment_kernel`), of :data:`LOOP_BEFORE_FUSED_SCORES` scores or more, not packed, on
    a CPU without AMX (where torch's kernel multiplies on AMX tiles; not measured here)."""
    if inp.requires_grad or inp.packed is not None or segment_kernel(inp) is None or amx_tiles():
        return False
    return inp.n_groups * inp.B * inp.Hq * inp.Lq * inp.Lk >= LOOP_BEFORE_FUSED_SCORES


def segment_bytes(inp: Inputs, qc: int, kc: int) -> int:
    """What a segment's call adds to the row block's state: the keys and values in pairs,
    :func:`thread_bytes`, and dense copies of inputs whose last dim is strided."""
    pad = -(-kc // 32) * 32
    n = inp.B * inp.Hk * pad * (2 * -(-inp.E // 2) + 16 * -(-inp.Ev // 16)) * 2
    if inp.q.stride(-1) != 1:
        n += inp.B * inp.Hq * qc * inp.E * 2
    n += sum(inp.B * inp.Hk * kc * t.shape[-1] * 2 for t in (inp.k, inp.v) if t.stride(-1) != 1)
    return n + thread_bytes(inp)


def thread_bytes(inp: Inputs) -> int:
    """Each thread's buffers: a task's scores and ``p``, its query rows and ``p·v``."""
    return torch.get_num_threads() * ROWS * (KEYS * 6 + 2 * inp.E + 4 * inp.Ev + 80)


def tile_bytes(inp: Inputs, qc: int, kc: int) -> int:
    """The planner's tile size for the loop: a row block's accumulator and the threads' buffers;
    not the segment's keys and values, which every task reads from the shared cache whatever the
    segment's length. Longer segments cost fewer calls and copies: whole key rows took 0.80-0.91x
    the time of 512 x 1024 tiles (bfloat16, two threads, medians of 7: 1x8x4096x64 143 against
    155 ms, 4x8x4096x40 480 against 545, 1x8x2048x64 42 against 47); row blocks of 1024 rows
    ran as fast as all 4096 at once (143.6 against 143.1 ms)."""
    return inp.B * inp.Hq * qc * inp.Ev * inp.stats_itemsize + thread_bytes(inp)


def forward_rows(inp: Inputs, qs: int, qe: int, segments: Iterable[Segment], out: Tensor, kernel: ModuleType) -> Tensor:
    """:meth:`Matmul.forward_rows <subquad._backends.matmul.Matmul.forward_rows>` for rows
    ``[qs, qe)`` with the C++ loop: writes ``out`` and returns the lse ``(B, Hq, qn)``."""
    B, Hq, qn = inp.B, inp.Hq, qe - qs
    rows = B * Hq * qn
    m = torch.full((rows,), NEG_INF, dtype=torch.float32)
    l = torch.zeros(rows, dtype=torch.float32)
    acc = torch.zeros((rows, inp.Ev), dtype=torch.float32)
    q = unit_stride(inp.q[:, :, qs:qe])
    alpha = inp.scale * LOG2E  # scores in log2 units: exp2 needs no multiply
    for seg in segments:
        causal = inp.is_causal and seg.causal != "none"
        k, v = (unit_stride(t[:, :, seg.ks : seg.ke]) for t in (inp.k, inp.v))
        mask = None if inp.attn_mask is None else inp.mask_tile(qs, qe, seg.ks, seg.ke).expand(B, Hq, qn, -1)
        kernel.forward_segment_bf16(q, k, v, m, l, acc, alpha, qs, seg.ks, causal, inp.causal_offset, mask)
    return finish_rows(inp, qs, qe, RowState(m, l, acc), out, log2=True)
