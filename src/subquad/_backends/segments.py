"""The ``matmul`` forward's and backward's tile loops in C++ (:mod:`subquad._native`, a CPU with
AVX512-BF16): bfloat16 calls without ``mask_mod`` or dropout, without a ``score_mod`` other than a
soft cap ``c * tanh(score / c)`` (found by tracing; the loops apply it and its derivative), causal
or not, with or without an ``attn_mask`` (read in place, a row at a time).

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
pairs the instruction reads (``B·Hk·kn·(E + Ev)`` bfloat16, padded; the keys transposed, each
row 16 pairs longer so that a product's rows do not share a cache set): :func:`segment_bytes`.
Where the loops run a call, the planner's ceiling on a tile is :data:`TILE_TARGET` (whole rows:
each call copies its keys again). Per row of a block, the softmax reads the float32 products
once for their maximum and once for ``2^(x·scale - max)`` (one FMA; 16 lanes, and bfloat16's
``p`` rounded by ``vcvtne2ps2bf16``, 32 at a time).

A plain packed call (no callback, mask, window or dropout) runs all of its sequences through
the forward loop in one kernel call per group of consecutive sequences (:func:`forward_packed`):
no Python, gathering or padding per sequence; in training its backward is a fused-kernel call
per sequence.

Float32 and float16 calls run the same loops (``forward_segment_f32``, ``backward_segment_f32``,
a build for AVX512F, or AVX2 with FMA) with float32 operands: keys copied transposed (each row
16 floats longer than the keys) and values as they lie,
float16 converted exactly on the way (``B·Hk·kn·(E + Ev)`` float32, padded), every product on FMA
with float32 accumulation, ``p`` and ``dS`` kept in float32 (the forward's ``p`` over its own
scores). So a float16 call costs no conversion of a tile and no offset, and its scores cannot
overflow (they are float32 from the products on), as float32's. On this CPU the float32 products
ran at about 55 GFLOP/s per core, 85% of the forward's time (``perf``), where torch's float16
``bmm`` has no fast kernel (23-26x its float32 time).

The backward (:func:`backward_rows`) runs FlashAttention-2's per block of 128 rows and 128 keys:
``s = q·kᵀ`` and ``dp = dO·vᵀ`` in float32; ``p = exp(s - lse)`` and ``ds = scale·p∘(dp - D)``,
each rounded once to bfloat16 (float32 and float16 inputs: kept in float32); ``dV += pᵀ·dO``,
``dK += dsᵀ·q`` and ``dQ += ds·k`` in float32. A task is one batch entry and key head with all of
its query heads, so that dQ, dK and dV each have one writer and the gradients are added into in
place; a segment's keys and values are copied into three layouts (:func:`backward_bytes`).
Against the per-tile backward (bfloat16 products of offset scores, whose P carries the forward's
2e-3 lse error), its S is exact to float32 and nothing is computed twice.
"""

from __future__ import annotations

from types import ModuleType
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch import Tensor

from .._inputs import Inputs
from .._native import tile_kernel
from .._tiles import NEG_INF, Grads, RowState, Segment, add_into, finish_rows
from .base import unit_stride
from .offsets import LN2, LOG2E
from .products import amx_tiles

MASK_DTYPES = (torch.bool, torch.float32, torch.bfloat16, torch.float16)
"""The ``attn_mask`` dtypes the loop reads in place (a float64 mask takes the per-tile path)."""

ROWS, KEYS = 128, 512
"""A task's rows and keys per step in ``_native_tiles.cpp`` (``kSegmentRows``, ``kSegmentKeys``)."""


WIDE_DTYPES = (torch.float32, torch.float16)
"""Input dtypes the loop runs with float32 products (``forward_segment_f32``: FMA, float16
converted exactly); bfloat16 runs on ``forward_segment_bf16`` (vdpbf16ps)."""


def segment_kernel(inp: Inputs) -> Optional[ModuleType]:
    """The native kernel where it runs this call's forward loop: a CPU build with AVX512F or AVX2
    and FMA (float32 and float16 inputs) or AVX512-BF16 (bfloat16), no dropout, no ``mask_mod`` (one
    that declares itself causal runs as ``is_causal``), no ``score_mod`` but a soft cap
    (:func:`softcap`), an ``attn_mask`` of :data:`MASK_DTYPES` if any; else None."""
    if inp.device_type != "cpu" or inp.dropout_p > 0.0:
        return None
    if inp.mask_mod is not None or (inp.score_mod is not None and not softcap(inp)):
        return None
    if inp.attn_mask is not None and inp.attn_mask.dtype not in MASK_DTYPES:
        return None
    kernel = tile_kernel()
    return kernel if kernel is not None and hasattr(kernel, _FORWARD.get(inp.dtype, "")) else None


_FORWARD = {
    torch.bfloat16: "forward_segment_bf16",
    torch.float32: "forward_segment_f32",
    torch.float16: "forward_segment_f32",
}
"""The kernel's forward loop per input dtype."""
_BACKWARD = {dt: name.replace("forward", "backward") for dt, name in _FORWARD.items()}
"""And its backward loop."""
_PACKED = {dt: name.replace("segment", "packed") for dt, name in _FORWARD.items()}
"""And its forward over packed sequences (``forward_packed``: one loop call per sequence, in C++)."""


def softcap(inp: Inputs) -> float:
    """The cap ``c`` of a ``score_mod`` that tracing found to be ``c * tanh(score / c)``
    (:class:`~subquad._traced.TracedScoreMod`), which the loops apply themselves; else 0."""
    cap = getattr(inp.score_mod, "softcap", None)
    return float(cap) if isinstance(cap, float) and cap > 0 else 0.0


LOOP_BEFORE_FUSED_SCORES = 1 << 19
"""``auto`` takes the loop before the fused kernel from this many scores (``B·Hq·Lq·Lk``) on.
Bfloat16, two threads, 2-core CPU (AVX512-BF16, no AMX), ``bench_loop_sizes.py --dtype bfloat16
--rounds 7`` on the loops of 2026-12-04 21:00 (skewed pairs, the 16-lane softmax, whole rows),
per-round ratios, median [min-max]: 1x8xLx64 at L = 128 (2^17 scores) 1.28 [1.27-1.34], 256
(2^19) 0.84 [0.81-0.84], 512 0.58, 1024 0.53, 2048 0.49, 4096 0.47, causal 1024 0.42;
4x8x4096x40 0.48; 2x10x4096x64 against 77 keys 0.57 (``docs/benchmarks/loop-sizes-bfloat16-fast.json``).
Before those loops (2^21 then): 1x8xLx64 at L = 256 (2^19 scores) 1.29, 512 (2^21) 0.81,
1024 0.69, 2048 0.64; 4x8x4096x40 0.71; 2x10x4096x64 against 77 keys (2^22.6) 0.82; a decode
step and calls of 16 tokens 0.4 and 7.0 (the fused kernel's fast path skips planning). Forward +
backward with both loops (``bench_loop_sizes.py --backward``, the final kernel): 1x8xLx64 at
L = 128 0.66, 256 0.72, 512 0.71, 1024 0.88, 2048 0.71, causal 1024 0.73; 4x8x4096x40 0.65;
2x10x4096x64 against 77 keys 0.67."""


WIDE_LOOP_BEFORE_FUSED_SCORES = 1 << 23
"""The same for float32 calls, inference and training (also needing :data:`WIDE_LOOP_MIN_KEYS`
keys). The loops' time over the fused kernel's, two threads, the same CPU, ``bench_loop_sizes.py
--dtype`` (per-round ratios, median [min-max]). On the loops of 2026-12-04 21:00 (7 rounds,
``loop-sizes-float32-fast.json``): 1x8xLx64 at L = 256 1.23, 512 (2^21) 0.97 [0.85-1.02], 1024
0.98 [0.97-1.00], 2048 0.91, 4096 0.89, causal 1024 0.78, 4x8x4096x40 0.81, 2x10x4096x64 against
77 keys 0.87. Before them:

- inference, 7 rounds: float32 1x8xLx64 at L = 512 (2^21 scores) 1.08 [0.97-1.15], 1024 0.85,
  2048 0.96, 4096 0.93, causal 1024 0.91, 4x8x4096x40 0.91, 2x10x4096x64 against 77 keys 0.98
  [0.87-1.06] (1.12 [0.86-1.25] in an earlier run); float16 1.02, 0.85, 0.92, 0.86, 0.93, 0.90
  and 0.88 (the fused kernel converts float16 to float32);
- forward + backward, 3 rounds: float32 at L = 512 0.90, 1024 0.95, 2048 0.94, 4096 0.95, causal
  1024 0.83, 4x8x4096x40 0.90, 77 keys 1.01; float16 0.90, 0.83, 0.92, 0.93, 0.80, 0.91, 0.95.

Below 2^21 scores the fused kernel is faster (inference 1.2-1.9x from 2^17 to 2^19 scores, 5-12x
on tiny calls and decode steps)."""
HALF_LOOP_BEFORE_FUSED_SCORES = 1 << 22
"""The same for float16 calls (the fused kernel converts float16 to float32). On the loops of
2026-12-04 21:00 (7 rounds, ``loop-sizes-float16-fast.json``): 1x8xLx64 at L = 256 1.19, 512
(2^21) 0.95 [0.94-0.98], 1024 0.88, 2048 0.85, 4096 0.86, causal 1024 0.72, 4x8x4096x40 0.85,
Stable Diffusion 1.5's cross-attention 2x10x4096x64 against 77 keys (2^22.6) 0.77 [0.75-0.77]."""
WIDE_LOOP_MIN_KEYS = 512
"""A float32 call with fewer keys than one of the loop's blocks spreads each block's per-row work
(the accumulator's correction, the row's maximum and sum) over few scores. Set when the fused
kernel was faster at 77 keys (above); on the loops of 2026-12-04 (5 rounds, the accumulator in
the output, ``bench_loop_sizes.py --cases hosts``) 77 keys take 0.81-0.97x its time for inference
and 0.88-0.96x for training, but 128 and 256 keys at 2^22 scores 1.01-1.06x: kept, as the
cross-attention it leaves to the fused kernel is a few percent of Stable Diffusion's attention."""
WIDE_LOOP_MAX_HEAD_DIM = 384
"""A float32 call with a wider head leaves the loops to the fused kernel: both run at the FMA
units' peak there, the fused kernel's GEMMs a little ahead. The VAE decoder's one-head attention
(1x1x4096x512) took 1.03x and 1.05x its time in the loop (per-round medians of the two runs on
file, rounds 0.99-1.07x), head dims 128 to 384 0.92-0.96x (``loop-sizes-hosts-float32.json``,
``loop-sizes-head-dims-float32.json``)."""


WIDE_LOOP_MIN_LANES = 16
"""``auto`` takes the float32 loops where the kernel was built for AVX512F (16 float lanes), not
for AVX2 (8): that build (``SUBQUAD_NATIVE_FLAGS=-mno-avx512f`` on this CPU, torch limited to
AVX2 by ``ATEN_CPU_CAPABILITY=avx2`` and ``MKL_ENABLE_INSTRUCTIONS=AVX2``) took 1.3-2.0x the fused
kernel's time from 1x8x2048x64 on (0.98x at 1024, 0.74x causal), though 0.75x the eager tiles'
(1x8x2048x64: 146 against 194 ms): it serves ``backend="matmul"``."""


def fast_kernel(inp: Inputs) -> Optional[ModuleType]:
    """The native kernel where its forward loop takes the call (:func:`segment_kernel`) and was
    measured faster than torch's fused kernel: a CPU without AMX (where torch's kernel multiplies
    on AMX tiles; not measured here), and for float32 and float16 a build of
    :data:`WIDE_LOOP_MIN_LANES` lanes. Else None."""
    kernel = segment_kernel(inp)
    if kernel is None or amx_tiles():
        return None
    if inp.dtype in WIDE_DTYPES and getattr(kernel, "float_lanes", 0) < WIDE_LOOP_MIN_LANES:
        return None
    return kernel


PACKED_GAIN = "0.87-0.95x its time (1024 sequences of 1-64 tokens, float32, one thread)"
"""What :func:`forward_packed` measured against the fused kernel's calls per sequence
(``bench_before_after.py --only packed``, one thread, 5 rounds, the ratios to a per-sequence SDPA
loop before and after): 1024 sequences of 1-64 tokens, one head 0.60 -> 0.55, eight heads 0.81
-> 0.74 (0.85 -> 0.74 in the full run), causal fwd+bwd 0.81 -> 0.77; 16 x 512 causal fwd+bwd
0.67 -> 0.63."""


def packed_kernel(inp: Inputs) -> Optional[ModuleType]:
    """The native kernel where it runs a packed call's forward whole (:func:`forward_packed`): a
    plain packed call (``Inputs.short_sequences_share_tiles``) of :func:`fast_kernel`. Else None."""
    if inp.packed is None or not inp.short_sequences_share_tiles:
        return None
    return _with_packed(inp, fast_kernel(inp))


def _with_packed(inp: Inputs, kernel: Optional[ModuleType]) -> Optional[ModuleType]:
    return kernel if kernel is not None and hasattr(kernel, _PACKED[inp.dtype]) else None


def before_fused(inp: Inputs, need_grad: bool, packed: bool = False) -> bool:
    """Whether ``auto`` takes the loop before the fused kernel.

    ``packed``: ``inp`` is a packed call's planning view (its longest sequences, ``packed=None``):
    where :func:`packed_kernel` runs its forward (a plain call: no ``score_mod``, ``mask_mod``,
    window, mask or dropout); in training the planner gives its backward to the fused kernel, a
    call per sequence as before. Else a call of :func:`fast_kernel` (with ``need_grad``,
    its backward too: :func:`backward_kernel`) of :data:`LOOP_BEFORE_FUSED_SCORES` scores or more
    in bfloat16, of :data:`WIDE_LOOP_BEFORE_FUSED_SCORES` in float32 (with
    :data:`WIDE_LOOP_MIN_KEYS` keys or more and heads of :data:`WIDE_LOOP_MAX_HEAD_DIM` at most)
    and of :data:`HALF_LOOP_BEFORE_FUSED_SCORES` in float16."""
    if packed:
        plain = inp.score_mod is None and inp.mask_mod is None and inp.attn_mask is None and inp.dropout_p == 0.0
        return plain and _with_packed(inp, fast_kernel(inp)) is not None
    if inp.packed is not None or fast_kernel(inp) is None:
        return False
    if need_grad and backward_kernel(inp) is None:
        return False
    scores = inp.n_groups * inp.B * inp.Hq * inp.Lq * inp.Lk
    if inp.dtype == torch.float32 and (inp.Lk < WIDE_LOOP_MIN_KEYS or max(inp.E, inp.Ev) > WIDE_LOOP_MAX_HEAD_DIM):
        return False
    return scores >= _BEFORE_FUSED_SCORES[inp.dtype]


_BEFORE_FUSED_SCORES = {
    torch.bfloat16: LOOP_BEFORE_FUSED_SCORES,
    torch.float32: WIDE_LOOP_BEFORE_FUSED_SCORES,
    torch.float16: HALF_LOOP_BEFORE_FUSED_SCORES,
}


def before_fused_note(inp: Inputs, need_grad: bool, packed: bool = False) -> str:
    """What ``explain()`` says of a plan that takes the loops before the fused kernel."""
    if packed:
        return (
            "a packed call's sequences through the tiles' forward loop in C++ (native kernel), one kernel call per "
            f"group of sequences, before a fused kernel call per sequence: {PACKED_GAIN} on an AMD EPYC"
        )
    loops = "forward and backward loops" if need_grad else "forward loop"
    if inp.dtype == torch.bfloat16:
        gain = "0.65-0.88x its time for forward + backward" if need_grad else "0.42-0.84x its time"
        return (
            f"the tiles' {loops} in C++ (native kernel, AVX512-BF16, no AMX) before the fused kernel: {gain} "
            "from 2^19 bfloat16 scores on an AMD EPYC"
        )
    gain = "0.80-0.95x its time for forward + backward" if need_grad else "0.72-0.98x its time"
    return (
        f"the tiles' {loops} in C++ (native kernel, float32 products on AVX512F, no AMX) before the fused kernel: "
        f"{gain} from 2^23 float32 or 2^22 float16 scores on an AMD EPYC"
    )


def segment_bytes(inp: Inputs, qc: int, kc: int) -> int:
    """What a segment's call adds to the row block's state: the keys and values in the layouts
    the products read, :func:`thread_bytes`, and dense copies of inputs whose last dim is
    strided."""
    pad = -(-kc // 32) * 32
    if inp.dtype in WIDE_DTYPES:  # float32: keys transposed (rows 16 longer), values padded to 16 columns
        n = inp.B * inp.Hk * ((pad + 16) * inp.E + pad * 16 * -(-inp.Ev // 16)) * 4
    else:  # bfloat16 pairs (the keys' rows 16 pairs longer)
        n = inp.B * inp.Hk * ((pad + 16) * 2 * -(-inp.E // 2) + pad * 16 * -(-inp.Ev // 16)) * 2
    if inp.q.stride(-1) != 1:
        n += inp.B * inp.Hq * qc * inp.E * inp.itemsize
    n += sum(inp.B * inp.Hk * kc * t.shape[-1] * inp.itemsize for t in (inp.k, inp.v) if t.stride(-1) != 1)
    return n + thread_bytes(inp, kc)


def thread_bytes(inp: Inputs, kc: int = KEYS) -> int:
    """Each thread's buffers for a segment of ``kc`` keys: a task's float32 scores and its ``p``
    (in the products' type) over at most :data:`KEYS` keys, its query rows and ``p·v``."""
    op = 4 if inp.dtype in WIDE_DTYPES else 2
    keys = min(KEYS, -(-max(kc, 1) // 32) * 32)
    return torch.get_num_threads() * ROWS * (keys * (4 + op) + op * inp.E + 4 * inp.Ev + 80)


def tile_bytes(inp: Inputs, qc: int, kc: int) -> int:
    """The planner's tile size for the loop: a row block's accumulator and the threads' buffers;
    not the segment's keys and values, which every task reads from the shared cache whatever the
    segment's length. Longer segments cost fewer calls and copies: whole key rows took 0.80-0.91x
    the time of 512 x 1024 tiles (bfloat16, two threads, medians of 7: 1x8x4096x64 143 against
    155 ms, 4x8x4096x40 480 against 545, 1x8x2048x64 42 against 47). So do more rows per call:
    :data:`TILE_TARGET`."""
    return inp.B * inp.Hq * qc * inp.Ev * inp.stats_itemsize + thread_bytes(inp)


TILE_TARGET = 32 << 20
"""The planner's ceiling on :func:`tile_bytes` where the loops run a call (the eager tiles' is
4 MiB, the scores a tile's passes stream): the accumulator is not streamed, and each call copies
its keys and values again and ends with its threads waiting on the last task
(:meth:`Matmul.tile_target <subquad._backends.matmul.Matmul.tile_target>`). Whole rows (one
call) against row blocks of 1024, bfloat16, two threads, medians of 7 (a 2-core AMD EPYC, the
loops of issue 29): 1x8x4096x64 105.7 against 117.6 ms (float32 184.4 against 202.8),
4x8x4096x40 307 against 320, 1x8x8192x64 403 (blocks of 4096) against 426, 1x8x2048x64 28.9
against 29.8."""


def forward_rows(inp: Inputs, qs: int, qe: int, segments: Iterable[Segment], out: Tensor, kernel: ModuleType) -> Tensor:
    """:meth:`Matmul.forward_rows <subquad._backends.matmul.Matmul.forward_rows>` for rows
    ``[qs, qe)`` with the C++ loop: writes ``out`` and returns the lse ``(B, Hq, qn)``."""
    B, Hq, qn = inp.B, inp.Hq, qe - qs
    rows = B * Hq * qn
    m = torch.full((rows,), NEG_INF, dtype=torch.float32)
    l = torch.zeros(rows, dtype=torch.float32)
    dest = out[:, :, qs:qe]
    if dest.dtype == torch.float32 and dest.is_contiguous():  # the output's own rows accumulate
        acc = dest.view(rows, inp.Ev).zero_()  # (one buffer of B·Hq·qn·Ev fewer to fault in)
    else:
        acc = torch.zeros((rows, inp.Ev), dtype=torch.float32)
    q = unit_stride(inp.q[:, :, qs:qe])
    alpha = inp.scale * LOG2E  # scores in log2 units: exp2 needs no multiply
    cap = softcap(inp)
    run = getattr(kernel, _FORWARD[inp.dtype])
    for seg in segments:
        causal = inp.is_causal and seg.causal != "none"
        k, v = (unit_stride(t[:, :, seg.ks : seg.ke]) for t in (inp.k, inp.v))
        mask = None if inp.attn_mask is None else inp.mask_tile(qs, qe, seg.ks, seg.ke).expand(B, Hq, qn, -1)
        run(q, k, v, m, l, acc, alpha, qs, seg.ks, causal, inp.causal_offset, mask, cap)
    return finish_rows(inp, qs, qe, RowState(m, l, acc), out, log2=True)


def packed_row_bytes(inp: Inputs) -> int:
    """What each query row of :func:`forward_packed`'s group holds: its heads' float32 state (the
    running maximum, sum and accumulator), result and lse, and the result in the output's dtype."""
    return inp.Hq * ((inp.Ev + 3) * 4 * 2 + inp.Ev * inp.itemsize)


def forward_packed(inp: Inputs, kernel: ModuleType, limit: int, out: Tensor, lse: Optional[Tensor]) -> Set[int]:
    """A packed call's forward through the loop, a sequence at a time inside one kernel call per
    group of consecutive sequences (no Python per sequence, nothing gathered or padded): each
    group's rows (:func:`packed_row_bytes`) and, while one of its sequences runs, that sequence's
    keys and values in the products' layouts (:func:`segment_bytes`) within ``limit`` bytes.
    Writes the rows of ``out`` ``(1, Hq, total, Ev)`` and ``lse`` ``(1, Hq, total)`` and returns
    the sequences done; a sequence that alone needs more is left to the caller's tiles."""
    p = inp.packed
    assert p is not None
    row = packed_row_bytes(inp)
    done: Set[int] = set()
    group: List[int] = []
    rows = held = end = 0  # the group's rows, the most one of its sequences holds, its last row
    sizes: Dict[Tuple[int, int], int] = {}  # segment_bytes by lengths: a few distinct ones, many sequences
    for s in range(p.n):
        qs, qe, ks, ke = p.rows(s)
        own = sizes.get((qe - qs, ke - ks)) or sizes.setdefault(
            (qe - qs, ke - ks), segment_bytes(inp, qe - qs, ke - ks)
        )
        if group and (end != qs or (rows + qe - qs) * row + max(held, own) > limit):
            _packed_group(inp, kernel, group, out, lse)
            done.update(group)
            group, rows, held = [], 0, 0
        if (qe - qs) * row + own > limit:
            continue
        group.append(s)
        rows, held, end = rows + qe - qs, max(held, own), qe
    if group:
        _packed_group(inp, kernel, group, out, lse)
        done.update(group)
    return done


def _packed_group(inp: Inputs, kernel: ModuleType, seqs: List[int], out: Tensor, lse: Optional[Tensor]) -> None:
    p = inp.packed
    assert p is not None
    spans = torch.tensor([p.rows(s) for s in seqs], dtype=torch.int64)
    r0, r1 = int(spans[0, 0]), int(spans[-1, 1])
    k0, k1 = int(spans[:, 2].min()), int(spans[:, 3].max())
    spans -= torch.tensor([r0, r0, k0, k0])
    offsets = torch.tensor([inp.causal_offset + p.offset(s) for s in seqs], dtype=torch.int64)
    n, Hq = r1 - r0, inp.Hq
    m = torch.full((n * Hq,), NEG_INF, dtype=torch.float32)
    l = torch.zeros(n * Hq, dtype=torch.float32)
    acc = torch.zeros((n * Hq, inp.Ev), dtype=torch.float32)
    q = unit_stride(inp.q[:, :, r0:r1])
    k, v = (unit_stride(t[:, :, k0:k1]) for t in (inp.k, inp.v))
    run = getattr(kernel, _PACKED[inp.dtype])
    run(q, k, v, spans, offsets, m, l, acc, inp.scale * LOG2E, inp.is_causal, softcap(inp))
    # In the caller's (total, Hq, ·) order, as out and lse lie.
    out[0, :, r0:r1].copy_(acc.div_(l.masked_fill(l == 0, 1.0).unsqueeze(1)).view(n, Hq, inp.Ev).transpose(0, 1))
    if lse is not None:  # rows that see nothing: -inf (their output 0)
        lse[0, :, r0:r1].copy_(m.add_(l.log2_()).mul_(LN2).view(n, Hq).t())


BACK_ROWS, BACK_KEYS = 128, 128
"""The backward's rows per block and keys per step (``kBackRows``, ``kBackKeys``)."""


def backward_kernel(inp: Inputs) -> Optional[ModuleType]:
    """The native kernel where it runs this call's backward loop: a call whose forward loop it
    runs (:func:`segment_kernel`), not packed, no gradient for ``attn_mask``, at least one task
    (batch entry and key head) per thread. Else None: the per-tile backward."""
    kernel = segment_kernel(inp)
    if kernel is None or not hasattr(kernel, _BACKWARD[inp.dtype]) or inp.packed is not None:
        return None
    if inp.attn_mask is not None and inp.attn_mask.requires_grad:
        return None
    if inp.B * inp.Hk < torch.get_num_threads():
        return None
    return kernel


def backward_thread_bytes(inp: Inputs, kc: int) -> int:
    """Each thread's buffers in the backward loop: a task's float32 dK and dV for ``kc`` keys and
    :func:`backward_block_bytes`."""
    pad = -(-kc // 32) * 32
    ep, evp = -(-inp.E // 16) * 16, -(-inp.Ev // 16) * 16
    return torch.get_num_threads() * pad * (ep + evp) * 4 + backward_block_bytes(inp)


def backward_block_bytes(inp: Inputs) -> int:
    """The threads' block buffers in the backward loop: scores, dP, P and dS in two layouts, the
    rows' q, dO and dQ."""
    ep, evp = -(-inp.E // 16) * 16, -(-inp.Ev // 16) * 16
    op = 4 if inp.dtype in WIDE_DTYPES else 2  # P and dS in the products' type (three buffers)
    block = BACK_ROWS * BACK_KEYS * (8 + 3 * op) + BACK_ROWS * (ep + evp) * 2 * op + BACK_ROWS * ep * 4 + BACK_KEYS * 8
    return torch.get_num_threads() * block


def backward_bytes(inp: Inputs, qc: int, kc: int) -> int:
    """The backward loop's peak over the gradients' float32 accumulators, rows ``qc`` and keys
    ``kc`` per call: the rows' q and dO, D and the lse, the float32 product that gives D, the keys
    and values in three layouts, :func:`backward_thread_bytes`, dense copies of strided inputs and
    the mask's tile."""
    pad = -(-kc // 32) * 32
    ep = -(-inp.E // 16) * 16
    rows = inp.B * inp.Hq * qc
    n = rows * (inp.E + inp.Ev) * inp.itemsize + rows * 4 * 4  # q, dO; D, lse in log2 units, temporaries
    n += rows * inp.Ev * 4 * 2  # dO and O in float32 for D
    if inp.dtype in WIDE_DTYPES:  # keys and values transposed (16 floats longer), keys as they lie
        n += inp.B * inp.Hk * ((pad + 16) * (inp.E + inp.Ev) + pad * ep) * 4
    else:  # the pairs
        n += inp.B * inp.Hk * pad * (4 * -(-inp.E // 2) + 2 * -(-inp.Ev // 2) + 2 * ep) * 2
    n += sum(inp.B * inp.Hk * kc * t.shape[-1] * inp.itemsize for t in (inp.k, inp.v) if t.stride(-1) != 1)
    n += inp.mask_tile_elements(qc, kc) * (inp.stats_itemsize + 1)
    n += (rows * inp.E + inp.B * inp.Hk * kc * (inp.E + inp.Ev)) * 4  # gradients it cannot add into in place
    return n + backward_thread_bytes(inp, kc)


def backward_tile_bytes(inp: Inputs, qc: int, kc: int) -> int:
    """The planner's tile size for a call whose forward and backward both run the loops: the
    threads' buffers alone, so the planner takes the largest tiles the budget allows. Neither
    loop holds a tile of scores, and each call packs its keys and values again, so whole rows
    cost fewer calls and copies. Forward + backward, bfloat16, two threads, medians of 7:
    2x8x1024x128 on 1024 x 1024 129 ms against 147 on 512 x 1024 and 193 on 128 x 512;
    4x8x1024x40 125 against 145 on 256 x 1024; causal 1x8x4096x64 251 against 287 on 512 x 1024;
    1x8x8192x64 2.09-2.20 s on every tile from 1024 x 1024 to whole rows."""
    return thread_bytes(inp) + backward_block_bytes(inp)


def backward_rows(
    inp: Inputs,
    qs: int,
    qe: int,
    segments: Iterable[Segment],
    grad_out: Tensor,
    out: Tensor,
    lse: Tensor,
    grads: Grads,
    grad_lse: Optional[Tensor],
    kernel: ModuleType,
) -> None:
    """:meth:`Matmul.backward_rows <subquad._backends.matmul.Matmul.backward_rows>` for rows
    ``[qs, qe)`` with the C++ loop: adds into ``grads.dq``, ``grads.dk`` and ``grads.dv`` (through
    a float32 block of the rows or keys where one is absent or not a float32 view with a dense
    last dim)."""
    B, Hq, Hk, qn = inp.B, inp.Hq, inp.Hk, qe - qs
    q = unit_stride(inp.q[:, :, qs:qe])
    do = unit_stride(grad_out[:, :, qs:qe].to(inp.dtype))
    dd = (do.float() * out[:, :, qs:qe].float()).sum(dim=-1)  # D = rowsum(dO ∘ O) - dlse
    if grad_lse is not None:
        dd -= grad_lse[:, :, qs:qe].float()
    lse2 = lse[:, :, qs:qe].float() * LOG2E
    lse2 = lse2.masked_fill_(lse2 == NEG_INF, float("inf")).reshape(-1)  # rows that see nothing: P = 0
    dd = dd.reshape(-1)
    alpha, cap = inp.scale * LOG2E, softcap(inp)
    dq = _in_place(grads.dq, slice(qs, qe), (B, Hq, qn, inp.E))
    run = getattr(kernel, _BACKWARD[inp.dtype])
    for seg in segments:
        causal = inp.is_causal and seg.causal != "none"
        k, v = (unit_stride(t[:, :, seg.ks : seg.ke]) for t in (inp.k, inp.v))
        mask = None if inp.attn_mask is None else inp.mask_tile(qs, qe, seg.ks, seg.ke).expand(B, Hq, qn, -1)
        keys = slice(seg.ks, seg.ke)
        dk = _in_place(grads.dk, keys, (B, Hk, seg.ke - seg.ks, inp.E))
        dv = _in_place(grads.dv, keys, (B, Hk, seg.ke - seg.ks, inp.Ev))
        run(q, k, v, do, lse2, dd, dq, dk, dv, alpha, inp.scale, qs, seg.ks, causal, inp.causal_offset, mask, cap)
        for g, block in ((grads.dk, dk), (grads.dv, dv)):
            if g is not None and not _same(g[:, :, keys], block):
                add_into(g[:, :, keys], block)
    if grads.dq is not None and not _same(grads.dq[:, :, qs:qe], dq):
        add_into(grads.dq[:, :, qs:qe], dq)


def _in_place(g: Optional[Tensor], rows: slice, shape: Tuple[int, ...]) -> Tensor:
    """``g``'s block of ``rows`` where the kernel can add into it; else a zeroed float32 block."""
    if g is not None:
        view = g[:, :, rows]
        if tuple(view.shape) == shape and view.dtype == torch.float32 and (view.stride(-1) == 1 or shape[-1] <= 1):
            return view
    return torch.zeros(shape, dtype=torch.float32)


def _same(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
