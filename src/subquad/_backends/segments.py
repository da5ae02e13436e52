"""The tiles' forward and backward as whole loops in C++ (:mod:`subquad._native`): the ``loops``
backend, which ``matmul`` also runs wherever they take a call.

They take CPU calls without dropout whose callbacks they evaluate themselves (:func:`loop_mods`: a
soft cap ``c * tanh(score / c)`` found by tracing, ALiBi of fixed slopes, a ``mask_mod`` that is a
band of diagonals, whose hidden blocks of keys are skipped; built-in or traced equal), with or without
an ``attn_mask`` (read in place, a row at a time): bfloat16 on AVX512-BF16, float32 and float16
(converted exactly, float32 products) on AVX512F or AVX2 with FMA. Scores are float32 before the
softmax, as in torch's fused kernel: no product is offset or computed again.

- the forward (:func:`forward_rows`): each thread takes 128 rows of one head and, per 512 keys,
  their scores, the online softmax and ``p·v``, all in its own core's cache;
- the backward (:func:`backward_rows`): FlashAttention-2 per block of 128 rows and 128 keys, one
  task per batch entry and key head, so that dQ, dK and dV each have one writer;
- a plain packed call's inference, a group of sequences per kernel call (:func:`forward_packed`);
- what they hold, for the planner: :func:`segment_bytes` (a segment's keys and values copied
  into the layouts the products read), :func:`tile_bytes` and :data:`TILE_TARGET`,
  :func:`backward_bytes`, :func:`backward_tile_bytes`.

How they work and what they measured: docs/benchmarks/loops.md.
"""

from __future__ import annotations

import collections
import math
import threading
from types import ModuleType
from typing import Dict, Iterable, List, NamedTuple, Optional, Set, Tuple

import torch
from torch import Tensor

from .. import mods
from .._graphs import formula_band
from .._inputs import Inputs
from .._native import tile_kernel
from .._tiles import NEG_INF, Grads, RowState, Segment, add_into, finish_rows
from .._traced import TracedMask, TracedScoreMod
from .base import unit_stride
from .offsets import LN2, LOG2E

MASK_DTYPES = (torch.bool, torch.float32, torch.bfloat16, torch.float16)
"""The ``attn_mask`` dtypes the loop reads in place (a float64 mask takes the per-tile path)."""

ROWS, KEYS = 128, 512
"""A task's rows and keys per step in ``_native_tiles.cpp`` (``kSegmentRows``, ``kSegmentKeys``)."""


WIDE_DTYPES = (torch.float32, torch.float16)
"""Input dtypes the loop runs with float32 products (``forward_segment_f32``: FMA, float16
converted exactly); bfloat16 runs on ``forward_segment_bf16`` (vdpbf16ps)."""


def segment_kernel(inp: Inputs) -> Optional[ModuleType]:
    """The native kernel where it runs this call's forward loop: a CPU build with AVX512F or AVX2
    and FMA (float32 and float16 inputs) or AVX512-BF16 (bfloat16), no dropout, callbacks the loops
    evaluate themselves (:func:`loop_mods`; a ``mask_mod`` that declares itself causal runs as
    ``is_causal``), an ``attn_mask`` of :data:`MASK_DTYPES` if any; else None."""
    if inp.device_type != "cpu" or inp.dropout_p > 0.0:
        return None
    if loop_mods(inp) is None:
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


class LoopMods(NamedTuple):
    """The built-in callbacks of a call as the loops' last arguments, in their order (``window_lo``,
    ``window_hi``, ``slopes``, ``alibi_shift``, ``ranges`` in ``_native_tiles.cpp``): query ``i``
    sees key ``j`` (the call's own positions) where ``window_lo <= i - j <= window_hi`` (None: that
    side open) and ``ranges[b, i, 0] <= j < ranges[b, i, 1]`` (None: every key; int64 ``(1 or B,
    Lq, 2)``), and ALiBi adds ``-slopes[h] * |i - j + alibi_shift|`` to query head ``h``'s scaled
    scores (``slopes``: float32, one per query head of the call, or None)."""

    window_lo: Optional[int] = None
    window_hi: Optional[int] = None
    slopes: Optional[Tensor] = None
    alibi_shift: int = 0
    ranges: Optional[Tensor] = None

    def at(self, qs: int, qe: int, ks: int) -> "LoopMods":
        """The same for the kernel call of rows ``[qs, qe)`` and keys from ``ks`` on."""
        if self.ranges is None:
            return self
        return self._replace(ranges=(self.ranges[:, qs:qe] - ks).contiguous())


Band = Tuple[Optional[int], Optional[int]]
"""``(lo, hi)``: the keys ``j`` a query ``i`` sees are those with ``lo <= i - j <= hi`` (None: open)."""


def loop_mods(inp: Inputs) -> Optional[LoopMods]:
    """The call's ``score_mod`` and ``mask_mod`` as :class:`LoopMods` where the loops evaluate them
    themselves; else None. A ``score_mod``: none, a soft cap (:func:`softcap`, passed apart) or
    ALiBi (:func:`_alibi_slopes`). A ``mask_mod``: none or a band (:func:`mask_band`) and ranges
    of keys (:data:`RANGED`). Built-in, or hand-written and traced equal to one
    (:mod:`subquad._traced`). Positions are the callbacks' (``q_offset + i``, ``kv_offset + j``;
    heads from ``h_offset``), turned into the call's own."""
    band: Band = (None, None)
    ranges: Optional[Tensor] = None
    if inp.mask_mod is not None:
        parts = _mask_parts(inp.mask_mod)
        if parts is None:
            return None
        band = parts[0]
        if parts[1]:
            ranges = _cached_ranges(inp, parts[1])
            if ranges is None:
                return None
    shift = inp.q_offset - inp.kv_offset  # callback positions: i - j + shift
    lo, hi = (None if x is None else x - shift for x in band)
    if inp.score_mod is None or softcap(inp):
        return LoopMods(lo, hi, None, shift, ranges)
    alibi = _alibi_slopes(inp, band[0])
    return None if alibi is None else LoopMods(lo, hi, alibi[0], shift + alibi[1], ranges)


RANGED = (mods._Document, mods._PrefixLM, mods._KeyPadding)
"""The built-in masks that hide all but one range of keys per query row (a document's, with the
keys' ids sorted; the prefix and the causal part; the keys before the padding)."""


def _mask_parts(mask_mod: object) -> Optional[Tuple[Band, List[object]]]:
    """A built-in ``mask_mod`` as a band (:func:`mask_band`) and the :data:`RANGED` masks
    intersected with it (:func:`~subquad.mods.and_masks`), or a traced one that equals such
    (:func:`_traced_parts`); None for any other."""
    if isinstance(mask_mod, RANGED):
        return (None, None), [mask_mod]
    if isinstance(mask_mod, TracedMask):
        return _traced_parts(mask_mod)
    if isinstance(mask_mod, mods._AndMasks):
        ranged: List[object] = [p for p in mask_mod.mask_mods if isinstance(p, RANGED)]
        bands = [p for p in mask_mod.mask_mods if not isinstance(p, RANGED)]
        band = mask_band(mods._AndMasks(bands)) if bands else (None, None)
        return None if band is None else (band, ranged)
    band = mask_band(mask_mod)
    return None if band is None else (band, [])


_RANGES: "collections.OrderedDict[Tuple[object, ...], Tuple[object, Optional[Tensor]]]" = collections.OrderedDict()
"""The last few calls' :func:`_row_ranges` (a call asks for them several times while it is planned
and run), each kept with its mask so that the mask's id is not reused while the entry lives."""


_RANGES_LOCK = threading.Lock()


def _cached_ranges(inp: Inputs, masks: List[object]) -> Optional[Tensor]:
    """:func:`_row_ranges`, remembered per mask, the versions of its tensors (an id edited in place
    is a new key), the call's positions and sizes."""
    tensors = [getattr(m, a) for m in masks for a in ("q_ids", "kv_ids", "prefix_len", "lengths") if hasattr(m, a)]
    versions = tuple((id(t), t._version) for t in tensors if isinstance(t, Tensor))
    key = (inp.mask_mod and id(inp.mask_mod), versions, inp.q_offset, inp.kv_offset, inp.B, inp.Lq, inp.Lk)
    with _RANGES_LOCK:
        found = _RANGES.get(key)
        if found is not None:
            _RANGES.move_to_end(key)
            return found[1]
    ranges = _row_ranges(inp, masks)
    with _RANGES_LOCK:
        _RANGES[key] = (inp.mask_mod, ranges)
        while len(_RANGES) > 8:
            _RANGES.popitem(last=False)
    return ranges


def _row_ranges(inp: Inputs, masks: List[object]) -> Optional[Tensor]:
    """Each query row's keys ``[first, end)`` (the call's own positions) under all of ``masks``
    (:data:`RANGED`): int64 ``(1 or B, Lq, 2)``; None where one of them hides more than a range
    (a document's keys not sorted by id) or does not fit the call (ids of another length or batch)."""
    B, Lq, Lk = inp.B, inp.Lq, inp.Lk
    qpos = torch.arange(inp.q_offset, inp.q_offset + Lq)  # the callbacks' positions
    lo = torch.zeros(1, Lq, dtype=torch.long)
    hi = torch.full((1, Lq), Lk, dtype=torch.long)
    for m in masks:
        found = _ranges_of(m, inp, qpos)
        if found is None:
            return None
        lo, hi = torch.maximum(lo, found[0]), torch.minimum(hi, found[1])
    if lo.shape[0] not in (1, B):
        return None
    return torch.stack((lo, hi.clamp(min=0, max=Lk)), dim=-1).clamp(min=0).contiguous()


def _per_row(value: object, B: int) -> Optional[Tensor]:
    """An int or a ``(B,)`` tensor of a mask as ``(1 or B, 1)`` int64 on the CPU."""
    if isinstance(value, int):
        return torch.tensor([[value]])
    assert isinstance(value, Tensor)
    return value.to("cpu").view(-1, 1) if value.shape[0] in (1, B) else None


def _ranges_of(mask: object, inp: Inputs, qpos: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """``(first, end)`` keys of each row under one :data:`RANGED` mask, each ``(1 or B, Lq)``."""
    kv0, Lk = inp.kv_offset, inp.Lk
    if isinstance(mask, mods._PrefixLM):  # j < prefix_len or j <= i (callback positions)
        p = _per_row(mask.prefix_len, inp.B)
        return None if p is None else (torch.zeros_like(p), torch.maximum(p, qpos.view(1, -1) + 1) - kv0)
    if isinstance(mask, mods._KeyPadding):  # j < lengths
        n = _per_row(mask.lengths, inp.B)
        return None if n is None else (torch.zeros_like(n), (n - kv0).expand(-1, qpos.numel()))
    assert isinstance(mask, mods._Document)
    q_ids = mask.q_ids[..., inp.q_offset : inp.q_offset + qpos.numel()].to("cpu")
    kv_ids = mask.kv_ids[..., kv0 : kv0 + Lk].to("cpu")
    if q_ids.shape[-1] != qpos.numel() or kv_ids.shape[-1] != Lk:
        return None
    if q_ids.dim() == 2 and q_ids.shape[0] not in (1, inp.B):
        return None
    if Lk > 1 and not bool((kv_ids[..., 1:] >= kv_ids[..., :-1]).all()):
        return None  # a document's keys in more than one range
    q_ids, kv_ids = q_ids.reshape(-1, q_ids.shape[-1]), kv_ids.reshape(-1, Lk)
    if kv_ids.shape[0] != q_ids.shape[0]:
        kv_ids = kv_ids.expand(q_ids.shape[0], -1).contiguous()
    first = torch.searchsorted(kv_ids, q_ids, right=False)
    return first, torch.searchsorted(kv_ids, q_ids, right=True)


def mask_band(mask_mod: object) -> Optional[Band]:
    """The band of a built-in ``mask_mod`` (in the callback's positions): :func:`~subquad.mods.causal`,
    :func:`~subquad.mods.causal_lower_right`, :func:`~subquad.mods.sliding_window`,
    :func:`~subquad.mods.local_window`, and :func:`~subquad.mods.and_masks` of those (the
    intersection); None for any other."""
    if isinstance(mask_mod, mods._AndMasks):
        lo: Optional[int] = None
        hi: Optional[int] = None
        for part in mask_mod.mask_mods:
            band = mask_band(part)
            if band is None:
                return None
            lo = band[0] if lo is None else lo if band[0] is None else max(lo, band[0])
            hi = band[1] if hi is None else hi if band[1] is None else min(hi, band[1])
        return lo, hi
    if isinstance(mask_mod, mods._Causal):
        return 0, None
    if isinstance(mask_mod, mods._CausalLowerRight):
        return -mask_mod.offset, None
    if isinstance(mask_mod, mods._SlidingWindow):
        return mask_mod.lo, mask_mod.window
    if isinstance(mask_mod, mods._LocalWindow):
        return _bound(mask_mod.lo), _bound(mask_mod.hi)
    if isinstance(mask_mod, TracedMask):
        parts = _traced_parts(mask_mod)
        return parts[0] if parts is not None and not parts[1] else None
    return None


def _bound(x: float) -> Optional[int]:
    return None if math.isinf(x) else int(x)


def _traced_parts(mask_mod: TracedMask) -> Optional[Tuple[Band, List[object]]]:
    """A hand-written ``mask_mod`` whose traced formula is a band of diagonals (``kv <= q``,
    ``q - kv < W``, ``(q - kv).abs() <= W`` and their ``&``), intersected with ``kv < n`` (as
    :func:`~subquad.mods.key_padding`) or ``(kv < P) | (kv <= q)`` (as :func:`~subquad.mods.prefix_lm`),
    as :func:`_mask_parts` gives the built-ins; None for another."""
    s = mask_mod.structure
    if s.kind == "causal":  # kv <= q + offset
        return (-s.offset, None), []
    found = None if s.formula is None else formula_band(s.formula)
    if found is None:
        return None
    ranged: List[object] = [mods.prefix_lm(n) if k == "prefix_lm" else mods.key_padding(n) for k, n in found[1]]
    return found[0], ranged


def _alibi_slopes(inp: Inputs, lo: Optional[int]) -> Optional[Tuple[Tensor, int]]:
    """The slopes of the call's heads of an ALiBi ``score_mod`` (:func:`subquad.mods.alibi`, or a
    hand-written one traced equal to it: :class:`~subquad._graphs.Alibi`), float32 as the per-tile
    path's scores, and its shift of the diagonal; None for another ``score_mod``, slopes that need
    a gradient, or too few of them (the per-tile path says so). A traced ``slopes[h] * (kv - q)``
    is ALiBi only where no key lies after its query's diagonal: under the causal flag or a band
    whose ``lo`` (callback positions, :func:`mask_band`) keeps it so."""
    fn, shift = inp.score_mod, 0
    if isinstance(fn, mods._Alibi):
        t = fn.slopes
    elif isinstance(fn, TracedScoreMod) and fn.alibi is not None:
        t, shift = fn.alibi.slopes, fn.alibi.shift
        bounds = [] if lo is None else [lo]  # on q_idx - kv_idx, the callbacks' positions
        if inp.is_causal:  # kv - kv_offset <= q - q_offset + causal_offset
            bounds.append(inp.q_offset - inp.kv_offset - inp.causal_offset)
        if fn.alibi.signed and (not bounds or max(bounds) + shift < 0):
            return None
    else:
        return None
    if t.requires_grad or t.dim() != 1 or t.shape[0] < inp.h_offset + inp.Hq:
        return None
    slopes = t.detach()[inp.h_offset : inp.h_offset + inp.Hq].to(device="cpu", dtype=torch.float32).contiguous()
    return slopes, shift


def fast_kernel(inp: Inputs) -> Optional[ModuleType]:
    """The native kernel where its forward loop takes the call (:func:`segment_kernel`). Whether
    it runs before torch's fused kernel is :func:`before_fused`'s question."""
    return segment_kernel(inp)


def packed_kernel(inp: Inputs) -> Optional[ModuleType]:
    """The native kernel where it runs a packed call's forward whole (:func:`forward_packed`): a
    plain packed call (``Inputs.short_sequences_share_tiles``) of :func:`fast_kernel`. Else None."""
    if inp.packed is None or not inp.short_sequences_share_tiles:
        return None
    return with_packed(inp, fast_kernel(inp))


def with_packed(inp: Inputs, kernel: Optional[ModuleType]) -> Optional[ModuleType]:
    return kernel if kernel is not None and hasattr(kernel, _PACKED[inp.dtype]) else None


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
    segment's length. Longer segments cost fewer calls and copies, and so do more rows per call:
    :data:`TILE_TARGET` (docs/benchmarks/loops.md)."""
    return inp.B * inp.Hq * qc * inp.Ev * inp.stats_itemsize + thread_bytes(inp)


TILE_TARGET = 32 << 20
"""The planner's ceiling on :func:`tile_bytes` where the loops run a call (the eager tiles' is
4 MiB, the scores a tile's passes stream): the accumulator is not streamed, and each call copies
its keys and values again and ends with its threads waiting on the last task
(:meth:`Matmul.tile_target <subquad._backends.matmul.Matmul.tile_target>`). Whole rows against
row blocks of 1024: docs/benchmarks/loops.md ("Faster loops, whole rows")."""


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
    cap, in_loop = softcap(inp), loop_mods(inp)
    assert in_loop is not None, "segment_kernel takes the call"
    run = getattr(kernel, _FORWARD[inp.dtype])
    for seg in segments:
        causal = inp.is_causal and seg.causal != "none"
        k, v = (unit_stride(t[:, :, seg.ks : seg.ke]) for t in (inp.k, inp.v))
        mask = None if inp.attn_mask is None else inp.mask_tile(qs, qe, seg.ks, seg.ke).expand(B, Hq, qn, -1)
        run(q, k, v, m, l, acc, alpha, qs, seg.ks, causal, inp.causal_offset, mask, cap, *in_loop.at(qs, qe, seg.ks))
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
    cost fewer calls and copies (docs/benchmarks/loops.md, "The backward's loop in C++")."""
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
    alpha, cap, in_loop = inp.scale * LOG2E, softcap(inp), loop_mods(inp)
    assert in_loop is not None, "backward_kernel takes the call"
    off = inp.causal_offset
    dq = _in_place(grads.dq, slice(qs, qe), (B, Hq, qn, inp.E))
    run = getattr(kernel, _BACKWARD[inp.dtype])
    for seg in segments:
        causal = inp.is_causal and seg.causal != "none"
        k, v = (unit_stride(t[:, :, seg.ks : seg.ke]) for t in (inp.k, inp.v))
        mask = None if inp.attn_mask is None else inp.mask_tile(qs, qe, seg.ks, seg.ke).expand(B, Hq, qn, -1)
        keys = slice(seg.ks, seg.ke)
        dk = _in_place(grads.dk, keys, (B, Hk, seg.ke - seg.ks, inp.E))
        dv = _in_place(grads.dv, keys, (B, Hk, seg.ke - seg.ks, inp.Ev))
        per_seg = in_loop.at(qs, qe, seg.ks)
        run(q, k, v, do, lse2, dd, dq, dk, dv, alpha, inp.scale, qs, seg.ks, causal, off, mask, cap, *per_seg)
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
