"""The tile loop: query blocks against key segments, forward and backward.

For each block of ``q_chunk`` query rows the engine lists the key segments that can contribute
(causal tiles above the diagonal and tiles that a ``mask_mod`` hides everywhere are skipped, never
computed) and hands them to a backend (:mod:`subquad._backends`). The output is written into a
preallocated tensor block by block, so peak memory is one block's working set whatever the number
of blocks.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Iterator, Optional, Tuple, cast

import torch
from torch import Tensor

from . import mods
from ._backends import BACKENDS, FusedCPU
from ._backends.fused import emulated_half_kernel
from ._backends.segments import forward_packed, packed_kernel
from ._buckets import buckets, run_bucket
from ._callbacks import EMPTY, FULL, PARTIAL, UNKNOWN, TileStates, evaluated_state
from ._inputs import Inputs, MaskMod
from ._tiles import TILES, Grads, Segment

log = logging.getLogger("subquad")


def kv_segments(inp: Inputs, qs: int, qe: int, kv_chunk: int, coalesce: bool, tiles: TileStates) -> Iterator[Segment]:
    """Key segments that query rows ``[qs, qe)`` must visit, in order, produced lazily.

    ``tiles``: the ``mask_mod`` states of the call's tiles (rows ``[qs, qe)`` are one of its
    blocks). With ``coalesce``, neighbouring segments that need no generated mask are joined (the
    fused kernel's memory does not grow with the segment length).
    """
    pending: Optional[Segment] = None
    off = inp.causal_offset
    states = tiles.row(qs, qe, qe + off if inp.is_causal else inp.Lk)
    for j, ks in enumerate(range(0, inp.Lk, kv_chunk)):
        ke = min(ks + kv_chunk, inp.Lk)
        causal = "none"
        if inp.is_causal:
            # Query i sees keys j <= i + off: the block's last row sees up to key qe - 1 + off.
            if ks > qe - 1 + off:
                TILES.skipped += (inp.Lk - ks + kv_chunk - 1) // kv_chunk
                break
            if ke - 1 > qs + off:
                # "diag": the tile's causal mask is top-left within the tile (ks == qs + off).
                causal = "diag" if ks == qs + off else "partial"
        state, keep = (FULL if states is None else states[j]), None
        if state == UNKNOWN:
            state, keep = evaluated_state(inp, qs, qe, ks, ke)
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
    bool_or_cast = inp.attn_mask is not None and inp.attn_mask.dtype != inp.bias_dtype
    additive = inp.score_mod is not None
    return seg.causal != "none" or seg.needs_mask_mod or bool_or_cast or additive


def _nonempty(segments: Iterator[Segment]) -> Optional[Iterator[Segment]]:
    first = next(segments, None)
    return None if first is None else itertools.chain([first], segments)


def _row_blocks(Lq: int, q_chunk: int) -> Iterator[Tuple[int, int]]:
    # Produced lazily: a list of 2**20 one-row blocks alone would take more than 100 MiB.
    for qs in range(0, Lq, q_chunk):
        yield qs, min(qs + q_chunk, Lq)


LONG_CALL_SECONDS = 30.0
"""Calls predicted to run longer than this log their progress to the ``subquad`` logger (INFO)."""


class Progress:
    """Logs how far a long tile loop is, at most every ``every`` seconds."""

    def __init__(self, what: str, blocks: int, predicted_s: Optional[float], every: float = 10.0) -> None:
        self.what, self.blocks, self.every = what, blocks, every
        self.enabled = predicted_s is not None and predicted_s > LONG_CALL_SECONDS and log.isEnabledFor(logging.INFO)
        self.start = self.last = time.monotonic()

    def tick(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last < self.every:
            return
        self.last = now
        elapsed = now - self.start
        eta = elapsed * (self.blocks - done) / max(done, 1)
        log.info(
            "subquad %s: %d/%d row blocks, %.0f s elapsed, about %.0f s left",
            self.what,
            done,
            self.blocks,
            elapsed,
            eta,
        )


def forward(
    inp: Inputs,
    backend: str,
    chunk: Tuple[int, int],
    seed: int,
    need_lse: bool,
    predicted_s: Optional[float] = None,
    out: Optional[Tensor] = None,
    lse: Optional[Tensor] = None,
    batch_bytes: int = 0,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Attention of the whole call, ``(out (B, Hq, Lq, Ev), lse (B, Hq, Lq) or None)``.

    ``batch_bytes``: what a batch of a packed call's short sequences may take (its share of the
    budget; :mod:`subquad._buckets`). ``out``/``lse``: tensors (views) to write the result into
    instead of new ones. Packed
    sequences run one at a time (:func:`sequence_view`). An interrupt (Ctrl-C) between tiles
    leaves nothing behind: the output is returned only once every tile is done.
    """
    if inp.packed is not None:
        # Batches of short sequences: ``batch_bytes`` (the caller's share of the budget), or what
        # the planned tiles were predicted to need, whichever is more.
        limit = max(batch_bytes, BACKENDS[backend].forward_bytes(planning_view(inp), chunk[0], chunk[1], need_lse))
        return _forward_packed(inp, backend, chunk, seed, need_lse, predicted_s, limit)
    b = BACKENDS[backend]
    q_chunk, kv_chunk = chunk
    B, Hq, Lq = inp.B, inp.Hq, inp.Lq
    if lse is None and need_lse:
        lse = torch.empty((B, Hq, Lq), dtype=inp.stats_dtype, device=inp.device)
    if inp.empty or inp.Lk == 0:
        # No output element, or no key: rows see nothing, their output is 0 (as SDPA's).
        if lse is not None:
            lse.fill_(float("-inf"))
        if out is not None:
            return out.zero_(), lse
        return torch.zeros((B, Hq, Lq, inp.Ev), dtype=inp.dtype, device=inp.device), lse
    coalesce = backend == "fused"
    tiles = TileStates(inp, q_chunk, kv_chunk)
    if b.returns_rows and q_chunk >= Lq:
        # One block of rows: the kernel's own output is the result, no copy.
        segs = _nonempty(kv_segments(inp, 0, Lq, kv_chunk, coalesce, tiles))
        if segs is not None:
            rows, rows_lse = b.forward_rows(inp, 0, Lq, segs, None, seed)
            if lse is not None:
                lse.copy_(rows_lse)
            if out is not None:
                return out.copy_(rows), lse
            return rows.to(inp.dtype), lse
    if out is None:
        out = torch.empty((B, Hq, Lq, inp.Ev), dtype=inp.dtype, device=inp.device)
    progress = Progress("forward", -(-Lq // q_chunk), predicted_s)
    with b.call_buffers():
        for i, (qs, qe) in enumerate(_row_blocks(Lq, q_chunk)):
            progress.tick(i)
            segs = _nonempty(kv_segments(inp, qs, qe, kv_chunk, coalesce, tiles))
            if segs is None:
                out[:, :, qs:qe].zero_()
                if lse is not None:
                    lse[:, :, qs:qe].fill_(float("-inf"))
                continue
            result = b.forward_rows(inp, qs, qe, segs, out, seed)
            if lse is not None:
                lse[:, :, qs:qe].copy_(result[1] if isinstance(result, tuple) else result)
            del result
    return out, lse


# ------------------------------------------------------------------ packed sequences
def sequence_view(inp: Inputs, s: int) -> Inputs:
    """Sequence ``s`` of a packed call as a call of its own: views of its rows and keys, its causal
    and window alignment, callbacks seeing ``b = s`` and positions within the sequence."""
    p = inp.packed
    assert p is not None
    qs, qe, ks, ke = p.rows(s)
    offset = p.offset(s)
    return inp.derive(
        query=inp.query[:, :, qs:qe],
        key=inp.key[:, :, ks:ke],
        value=inp.value[:, :, ks:ke],
        packed=None,
        b_offset=s,
        causal_offset=inp.causal_offset + offset if inp.is_causal else 0,
        mask_mod=_with_window(inp, offset),
    )


def planning_view(inp: Inputs) -> Inputs:
    """What the planner sizes a packed call by: its longest sequences (any sequence's tiles fit
    within theirs) and the lse of every row, which the backward keeps."""
    p = inp.packed
    assert p is not None
    misaligned = any(p.offset(s) != 0 for s in range(p.n))
    return dataclasses.replace(
        inp,
        query=inp.query[:, :, : p.max_q],
        key=inp.key[:, :, : p.max_k],
        value=inp.value[:, :, : p.max_k],
        packed=None,
        lse_rows=inp.Lq,
        mask_mod=_with_window(inp, 0),
        # A diagonal that is not tile-aligned needs generated causal masks: the model counts them.
        causal_offset=1 if inp.is_causal and misaligned else 0,
    )


def _with_window(inp: Inputs, offset: int) -> Optional[MaskMod]:
    p = inp.packed
    assert p is not None
    if p.window is None:
        return inp.mask_mod
    band = mods.local_window(p.window[0], p.window[1], offset)
    return band if inp.mask_mod is None else mods.and_masks(band, inp.mask_mod)


def _fused_sequences(inp: Inputs, backend: str) -> Optional[FusedCPU]:
    """The fused kernel, when a packed call's sequences may each be one call of it with nothing
    around it (:func:`_one_kernel`): a plain call (no mask, callback, window or dropout) on it."""
    if backend != "fused" or not inp.short_sequences_share_tiles:
        return None
    return cast(FusedCPU, BACKENDS["fused"])


def _one_kernel(inp: Inputs, chunk: Tuple[int, int], s: int, rows: Tuple[int, int, int, int]) -> Optional[bool]:
    """The kernel's causal flag when packed sequence ``s`` is one planned tile whose causal
    diagonal (if any) is the kernel's own, top-left; ``None`` when it takes its own tiles.

    Its one tile is then the kernel's output itself: calling the kernel directly computes what
    :func:`forward` of its :func:`sequence_view` would (bit for bit), without planning a call per
    sequence (a third of the time of 1024 sequences of 24 tokens).
    """
    qs, qe, ks, ke = rows
    if qe - qs > chunk[0] or ke - ks > chunk[1] or ke == ks:
        return None
    if not inp.is_causal:
        return False
    assert inp.packed is not None
    if inp.causal_offset + inp.packed.offset(s) != 0 or not inp.positive_scale:
        return None
    return ke - ks > 1  # one key: every row sees it (kv_segments calls that tile "none")


def _forward_packed(
    inp: Inputs,
    backend: str,
    chunk: Tuple[int, int],
    seed: int,
    need_lse: bool,
    predicted_s: Optional[float],
    limit: int,
) -> Tuple[Tensor, Optional[Tensor]]:
    # Written in the caller's packed layout, (total, Hq, Ev) and (total, Hq), viewed as the engine's.
    rows = torch.empty((inp.Lq, inp.Hq, inp.Ev), dtype=inp.dtype, device=inp.device)
    out = rows.permute(1, 0, 2).unsqueeze(0)
    lse = None
    if need_lse:
        lse = torch.empty((inp.Lq, inp.Hq), dtype=inp.stats_dtype, device=inp.device).t().unsqueeze(0)
    p = inp.packed
    assert p is not None
    shared: set = set()
    kernel = packed_kernel(inp) if backend in ("loops", "matmul") else None
    if kernel is not None:  # the C++ loop, a sequence at a time
        shared = forward_packed(inp, kernel, limit, out, lse)
        TILES.computed += len(shared)
    elif inp.short_sequences_share_tiles and inp.Lk > 0:
        for padded, seqs in buckets(inp, chunk).items():
            run_bucket(inp, seqs, padded, limit, out, lse)
            shared.update(seqs)
    fused = _fused_sequences(inp, backend)
    for s in range(p.n):
        span = p.rows(s)
        qs, qe = span[0], span[1]
        if qe == qs or s in shared:
            continue
        causal = _one_kernel(inp, chunk, s, span) if fused is not None else None
        if fused is not None and causal is not None:
            TILES.computed += 1
            o_s, lse_s = fused.sequence_forward(inp, span, causal)
            out[:, :, qs:qe].copy_(o_s)
            if lse is not None:
                lse[:, :, qs:qe].copy_(lse_s)
        else:
            forward(
                sequence_view(inp, s),
                backend,
                chunk,
                seed,
                need_lse,
                predicted_s,
                out=out[:, :, qs:qe],
                lse=None if lse is None else lse[:, :, qs:qe],
            )
    return out, lse


def backward(
    inp: Inputs,
    backend: str,
    chunk: Tuple[int, int],
    seed: int,
    grad_out: Tensor,
    out: Tensor,
    lse: Tensor,
    grads: Grads,
    grad_lse: Optional[Tensor] = None,
    predicted_s: Optional[float] = None,
) -> None:
    """Accumulate the gradients of the whole call into ``grads``, block by block.

    Key segments are never coalesced here: a backward kernel returns dK and dV for all the keys
    of its segment, so segments stay as long as the planned tiles. Packed sequences run one at a
    time, into views of the accumulators.
    """
    if inp.packed is not None:
        _backward_packed(inp, backend, chunk, seed, grad_out, out, lse, grads, grad_lse, predicted_s)
        return
    if inp.empty or inp.Lk == 0:
        return
    b = BACKENDS[backend]
    q_chunk, kv_chunk = chunk
    progress = Progress("backward", -(-inp.Lq // q_chunk), predicted_s)
    tiles = TileStates(inp, q_chunk, kv_chunk)
    with b.call_buffers():
        for i, (qs, qe) in enumerate(_row_blocks(inp.Lq, q_chunk)):
            progress.tick(i)
            segs = _nonempty(kv_segments(inp, qs, qe, kv_chunk, False, tiles))
            if segs is not None:
                b.backward_rows(inp, qs, qe, segs, grad_out, out, lse, seed, grads, grad_lse)


def _backward_packed(
    inp: Inputs,
    backend: str,
    chunk: Tuple[int, int],
    seed: int,
    grad_out: Tensor,
    out: Tensor,
    lse: Tensor,
    grads: Grads,
    grad_lse: Optional[Tensor],
    predicted_s: Optional[float],
) -> None:
    """:func:`backward` of a packed call, one sequence at a time, into views of the accumulators.

    The accumulators arrive unfilled (:class:`~subquad._tiles.Grads`) and every row is written
    once: a sequence of one kernel call (:func:`_one_kernel`) copies its gradients in; the rows of
    the others, and keys that no query sees (past ``seqused_k``), are zeroed first.
    """
    p = inp.packed
    assert p is not None
    fused = _fused_sequences(inp, backend) if grad_lse is None else None
    for s in range(p.n):
        qs, qe, ks, ke = rows = p.rows(s)
        q_rows, keys = (slice(None), slice(None), slice(qs, qe)), (slice(None), slice(None), slice(ks, ke))
        views = grads._replace(
            dq=None if grads.dq is None else grads.dq[q_rows],
            dk=None if grads.dk is None else grads.dk[keys],
            dv=None if grads.dv is None else grads.dv[keys],
        )
        if ke < p.cu_k[s + 1]:
            for acc in (grads.dk, grads.dv):
                if acc is not None:
                    acc[:, :, ke : p.cu_k[s + 1]].zero_()
        causal = _one_kernel(inp, chunk, s, rows) if fused is not None and qe > qs else None
        if fused is not None and causal is not None:
            TILES.computed += 1
            for acc, g in zip(
                (views.dq, views.dk, views.dv), fused.sequence_backward(inp, rows, causal, grad_out, out, lse)
            ):
                if acc is not None:
                    acc.copy_(g)
            continue
        for acc in (views.dq, views.dk, views.dv):
            if acc is not None:
                acc.zero_()
        if qe == qs or ke == ks:
            continue
        backward(
            sequence_view(inp, s),
            backend,
            chunk,
            seed,
            grad_out[q_rows],
            out[q_rows],
            lse[q_rows],
            views,
            None if grad_lse is None else grad_lse[q_rows],
            predicted_s,
        )


def whole_fused_backward(
    inp: Inputs, chunk: Tuple[int, int], grad_out: Tensor, out: Tensor, lse: Tensor
) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
    """``(dq, dk, dv)`` from one fused backward call, when the whole input is one tile.

    The kernel's own gradients are then the result: no accumulators beside them.
    """
    if inp.packed is not None or chunk[0] < inp.Lq or chunk[1] < inp.Lk or inp.empty or inp.Lk == 0:
        return None
    segs = list(kv_segments(inp, 0, inp.Lq, chunk[1], False, TileStates(inp, chunk[0], chunk[1])))
    if len(segs) != 1 or (segs[0].ks, segs[0].ke) != (0, inp.Lk):
        return None
    fused = cast(FusedCPU, BACKENDS["fused"])  # segment_backward is the fused kernel's own
    if not emulated_half_kernel(inp):
        return fused.segment_backward(inp, 0, inp.Lq, segs[0], grad_out, out, lse)
    grads = fused.segment_backward(inp, 0, inp.Lq, segs[0], grad_out, out, lse, True)
    return grads[0].to(inp.dtype), grads[1].to(inp.dtype), grads[2].to(inp.dtype)
