"""The ``matmul`` path: subquad's own tiles in pure PyTorch, on every device.

``bmm`` for the scores, online softmax with float32 statistics, ``baddbmm`` into the accumulator;
any dtype, head dim, dropout, ``score_mod`` and ``mask_mod``, and the gradients of a float mask
and of tensors captured by ``score_mod``.

What one tile costs, per score (``s`` = the float32 scores buffer, reused by every tile of a
forward or a backward, :class:`~subquad._backends.scratch.Scratch`, as are the bfloat16 tiles, the
tiles of keys and values cast or copied for a GEMM and the products with them):

- float32/float64 (and float16 on a CPU off the loop, bfloat16 on a CPU without AVX512-BF16/AMX, and half
  precision on MPS and on CUDA before torch 2.8, all with float32 products; q, k and v are
  converted once per row block or tile, ``qn x E`` and ``kn x E``, not per score): the product
  written into ``s``; ``amax``; ``s - m`` and ``exp2`` in place; ``sum``; the product with v
  accumulated in place (``baddbmm_``). No conversion of a tile. The forward keeps raw scores in
  log2 units (the scale carries log2 e: no pass multiplies them); with a ``score_mod`` or a float
  mask, which need the scores themselves, and in the backward, ``· log2 e`` is one more pass
  before ``exp2``.
- half precision on CUDA (torch 2.8 on, :func:`~subquad._backends.products.widening_products`):
  the products take q, k, v and dO as they are and write float32 (``out_dtype``; the scale in
  ``alpha``): no copies, no offsets. A tile's softmax passes run in one Triton kernel
  (:mod:`~subquad._backends.triton_passes`; without dropout, where Triton imports; else the passes
  above), which writes ``p`` (and ``dS``) rounded once for their products.
- bfloat16 with bfloat16 products (a CPU with AVX512-BF16 or AMX, :func:`native_bf16_products`,
  head dims of :data:`HALF_PRODUCTS_MIN_HEAD_DIM` or more): the keys copied into a ``kn x (E+1)``
  bfloat16 operand with a column of ones (not tile-sized), whose product with the query rows
  and their offset column writes each score minus its row's offset into a bfloat16 buffer ``r``
  (:class:`OffsetOperand`; the GEMM rounds once); one conversion of ``r`` into ``s``; the float32
  passes above, with the offsets subtracted together with the row maximum (no extra pass); and one
  conversion of ``p`` back into ``r`` (read by then) for its product with v (the fused kernels
  round ``p`` likewise). Two tile-sized conversions, one bfloat16 tile buffer besides ``s``. When
  a row's maximum moves more than :data:`OFFSET_DRIFT` from its offset (a row block's first tile,
  mostly), that row's product is computed again with a new offset and replaces the old in ``s``
  (the whole tile's when many rows or heads moved: :data:`PARTIAL_REDO_SHARE`). In 1x8x4096x64
  (two threads, 128 tiles) that is 37-49 single rows and no whole tile, depending on the inputs
  (seeds 0-4; 108-158 before the first offsets took :data:`FIRST_OFFSET_MARGIN`; where the time
  goes: docs/architecture.md). Backward, per tile: S's product offset by the lse and ``dP``'s by D
  (each one conversion to float32; ``dP`` gets D added back in one more pass, as ``dP - D``
  cancels), and ``p`` and the scaled ``dS`` each converted once to bfloat16 for the other three
  products: four tile-sized conversions and one addition, all four bfloat16 tiles in one buffer
  (each is read before the next is written). With a ``score_mod`` or a float mask S's product
  stays in float32.
- the same with the native kernel (:mod:`subquad._native`, built by ``subquad build``; calls
  without dropout whose softmax sees the raw scores): after the offset product, one pass per tile
  in C++. Forward: ``p`` written over ``r`` in bfloat16, the rows' sums and maxima returned (no
  ``s``, conversion, ``amax``, subtraction, ``exp2``, ``sum`` or cast over the tile), and two more
  calls for the rows' bookkeeping (far rows and next offsets; m, l and acc), each in place of
  about ten small eager ops. Backward: S's and ``dP``'s offset products in two bfloat16 buffers,
  turned into ``p`` and the scaled ``dS`` in place. Far rows are redone as above.
- CPU forwards with no ``score_mod`` (but a soft cap), ``mask_mod`` or dropout, where the native
  kernel is built (:mod:`subquad._backends.segments`; AVX512-BF16 for bfloat16, AVX512F for
  float32 and float16): no tile at all. The whole loop runs in C++, each thread on 128 rows of one
  head at a time, with float32 scores (bfloat16 or float32 operands, float32 accumulation), no
  offsets, no conversion of a tile and nothing computed twice.

On MPS (no Mac here, nothing of this measured): half-precision inputs take the first path, one
code path with the CPU's float32 products, so what is measured here is what a Mac runs, at its
own rates. Metal's half GEMMs with float32 results would allow CUDA's path; unchecked, it is off.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable, ContextManager, Iterable, Optional, Tuple

import torch
from torch import Tensor

from .._callbacks import CapturedAsLeaves, apply_score_mod
from .._inputs import Inputs
from .._native import tile_kernel
from .._tiles import NEG_INF, Grads, RowState, Segment, add_into, dropout_scale, finish_rows, tile_bias
from . import triton_passes
from .base import Backend, Options, _bh, _grad_accum_bytes
from .offsets import LOG2E, OFFSET_DRIFT, OffsetOperand, exp_, far_rows, first_offsets, redo_batches
from .products import HALF_PRODUCTS_MIN_HEAD_DIM, native_bf16_products, product, widening_products
from .scratch import Scratch, call_buffers, pass_scratch
from .segments import TILE_TARGET as LOOP_TILE_TARGET
from .segments import backward_bytes as loop_backward_bytes
from .segments import backward_kernel, segment_bytes, segment_kernel
from .segments import backward_rows as loop_backward_rows
from .segments import backward_tile_bytes as loop_backward_tile_bytes
from .segments import forward_rows as loop_forward_rows
from .segments import tile_bytes as loop_tile_bytes


class Matmul(Backend):
    """Pure-PyTorch tiles (``bmm``): every device, dtype, head dim, dropout and callback."""

    name = "matmul"
    # A tile's elementwise passes (about ten) run from the caches below ~4 MiB of float32 scores,
    # and the GEMMs run fastest on squarish tiles: forward 1x8x4096x64 on the 2-core CPU, float32
    # (bfloat16): 128x4096 tiles (16 MiB) 365-400 ms (387-408), 256x512 (4 MiB) 322-324 (309-430).
    target_tile_bytes = 4 << 20
    square_tiles = True

    def call_buffers(self) -> ContextManager[None]:
        """One forward's or backward's :class:`Scratch`, shared by its row blocks
        (:func:`~subquad._backends.scratch.call_buffers`)."""
        return call_buffers()

    def tile_bytes(self, inp: Inputs, qc: int, kc: int) -> int:
        return self.tile_bytes_of(inp)(qc, kc)

    def tile_target(self, inp: Inputs) -> int:
        loops = backward_kernel(inp) if inp.requires_grad else segment_kernel(inp)  # no tile of scores
        return LOOP_TILE_TARGET if loops is not None else super().tile_target(inp)

    def tile_bytes_of(self, inp: Inputs) -> Callable[[int, int], int]:
        # What a tile's elementwise work streams: its float32 scores, or, where the native kernel
        # does an inference forward's, the bfloat16 product alone (512 x 512 tiles of 1x8x4096x64
        # bf16 then took 0.86x the time of 256 x 512; fresh processes alternating, 6 rounds).
        lq, lk, grad = max(inp.Lq, 1), max(inp.Lk, 1), inp.requires_grad
        if not grad and segment_kernel(inp) is not None:  # no tile of scores
            return lambda qc, kc: loop_tile_bytes(inp, min(qc, lq), min(kc, lk))
        if grad and backward_kernel(inp) is not None:  # both passes in C++: no tile of scores either
            return lambda qc, kc: loop_backward_tile_bytes(inp, min(qc, lq), min(kc, lk))
        per_score = _bh(inp) * (2 if not grad and _forward_kernel(inp) is not None else inp.stats_itemsize)
        return lambda qc, kc: per_score * min(qc, lq) * min(kc, lk)

    def forward_bytes(self, inp: Inputs, qc: int, kc: int, need_lse: bool) -> int:
        qc, kc = min(qc, max(inp.Lq, 1)), min(kc, max(inp.Lk, 1))
        bh, st = _bh(inp), inp.stats_itemsize
        lse = inp.lse_bytes() if need_lse else 0
        if segment_kernel(inp) is not None:  # acc, m, l, lse and the result's rows; no tile
            return int((bh * qc * (2 * inp.Ev + 4) * st + segment_bytes(inp, qc, kc) + lse) * 1.15) + (1 << 18)
        cs = torch.tensor([], dtype=Matmul.compute_dtype(inp)).element_size()
        tile = bh * qc * kc
        n = inp.B * inp.Hq * qc * inp.E * cs  # scaled q block
        if cs != inp.itemsize:
            n += inp.B * inp.Hk * kc * (inp.E + inp.Ev) * cs * 2  # k/v casts
        elif inp.kv_broadcast:
            n += inp.B * inp.Hk * kc * (inp.E + inp.Ev) * cs  # a key/value shared by the batch, copied per tile
        elif cs != st:
            n += inp.B * inp.Hk * kc * inp.Ev * cs  # the values' tile, copied contiguous for the half GEMM
        n += tile * st  # scores; exp, the correction and p @ v work on them in place
        if cs != st:
            n += tile * cs  # the matmul's own output before the float32 cast, then p cast for p @ v
        n += inp.mask_tile_elements(qc, kc) * (st + 1)
        if inp.is_causal:
            n += qc * kc * (st + 1) + (qc + kc) * 8
        if inp.score_mod is not None:
            n += 3 * tile * st + 2 * qc * kc * 8  # the callback's result and its intermediates
        if inp.mask_mod is not None:
            n += 2 * tile + tile * st + 2 * qc * kc * 8
        if inp.dropout_p > 0:
            n += tile * (8 * 2 + st + 1)
        n += bh * qc * (inp.Ev * st * 2 + 6 * st) + lse  # accumulator, p @ v, row statistics
        return int(n * 1.15) + 256 * 1024  # allocator rounding, index vectors

    def backward_bytes(self, inp: Inputs, qc: int, kc: int, opts: Options) -> int:
        qc, kc = min(qc, max(inp.Lq, 1)), min(kc, max(inp.Lk, 1))
        if backward_kernel(inp) is not None:  # the loop in C++: no tile of scores
            return int(loop_backward_bytes(inp, qc, kc) * 1.15) + _grad_accum_bytes(inp) + 256 * 1024
        bh, st = _bh(inp), inp.stats_itemsize
        tile = bh * qc * kc
        n = bh * qc * (2 * inp.E + 3 * inp.Ev + 2) * st  # q, dq block, dO, O, D
        n += inp.B * inp.Hk * kc * (inp.E + inp.Ev) * st * 3  # k/v casts, dK/dV tiles
        n += tile * st * 4  # S/P, dP, dropout or dS, one temporary
        n += inp.mask_tile_elements(qc, kc) * (st + 1)
        if inp.is_causal:
            n += qc * kc * (st + 1) + (qc + kc) * 8
        if inp.score_mod is not None:
            n += 5 * tile * st + 2 * qc * kc * 8  # callback graph kept for its vjp
        if inp.mask_mod is not None:
            n += 2 * tile + tile * st + 2 * qc * kc * 8
        if inp.dropout_p > 0:
            n += tile * (8 * 2 + st * 2 + 1)
        if inp.attn_mask is not None and inp.attn_mask.requires_grad:
            # The mask's gradient is an output; only a float32 accumulator for a half mask is extra.
            n += inp.attn_mask.numel() * max(0, st - inp.attn_mask.element_size())
            n += inp.mask_tile_elements(qc, kc) * st  # dS reduced to the mask's broadcast shape
        return n + _grad_accum_bytes(inp) + 256 * 1024

    @staticmethod
    def compute_dtype(inp: Inputs) -> torch.dtype:
        """The dtype a tile's matmuls take their operands in.

        - bfloat16 inputs on a CPU that multiplies bfloat16 natively (AVX512-BF16 or AMX,
          :func:`native_bf16_products`), head dims of :data:`HALF_PRODUCTS_MIN_HEAD_DIM` or more:
          bfloat16. The GEMM accumulates in float32 and rounds its result once; every product is
          given a per-row offset so that what it rounds is small where the softmax looks
          (:class:`OffsetOperand`). Below that head dim the products are a small share of a
          tile's time and float32 ones keep the lse exact (see the constant).
        - half-precision inputs on a device whose GEMMs write float32 results from half
          operands (CUDA, :func:`widening_products`): the inputs' dtype. The scores and every
          other product come out in float32 with float32 accumulation (no offsets needed); only
          ``p`` and ``dS`` are rounded to the inputs' dtype for their products, as the fused
          kernels round them.
        - other half-precision inputs: float32. A float16 GEMM is emulated on CPUs without
          AVX512-FP16 (about 100x slower than float32 on the project's CPU); MPS keeps float32
          products until a Mac can check its half-precision GEMMs' rounding.
        - float32 and float64: the inputs' dtype.

        The row statistics and the accumulator are float32 whatever this returns
        (``Inputs.stats_dtype``).
        """
        wide = min(inp.E, inp.Ev) >= HALF_PRODUCTS_MIN_HEAD_DIM
        if inp.dtype == torch.bfloat16 and inp.device_type == "cpu" and wide and native_bf16_products():
            return torch.bfloat16
        if inp.dtype in (torch.float16, torch.bfloat16) and widening_products(inp.device):
            return inp.dtype
        if inp.dtype in (torch.float16, torch.bfloat16):
            return torch.float32
        return inp.dtype

    def _q_operand(self, inp: Inputs, qs: int, qe: int, cdt: torch.dtype, unit: float = 1.0) -> Tensor:
        """Query rows as the products take them, ``(B*Hk, G*qn, E)``.

        Full precision: scaled here, by ``inp.scale * unit`` (``qn x E`` is cheaper to scale than the
        ``qn x kn`` scores, and keeps fp16 scores in range). Half precision: unscaled; the scale is
        the GEMM's ``alpha``, applied before its one rounding (scaling q first would round it again).
        """
        q = inp.q[:, :, qs:qe].to(cdt)
        if cdt == inp.stats_dtype:
            q = torch.mul(q, inp.scale * unit)
        return q.reshape(inp.B * inp.Hk, inp.G * (qe - qs), inp.E)

    def _kv(self, t: Tensor, inp: Inputs, seg: Segment, dtype: torch.dtype, scratch: Scratch, name: str) -> Tensor:
        """A tile of keys or values ``(B*Hk, kn, E)`` in ``dtype``: a view, or a cast into the
        scratch buffer ``name`` (one per tensor: k and v may be one tensor, cast twice).

        A key/value shared by the batch is copied per tile here (tile-sized, in the memory model)."""
        t = t[:, :, seg.ks : seg.ke].reshape(inp.B * inp.Hk, seg.ke - seg.ks, t.shape[-1])
        return t if t.dtype == dtype else scratch.copy(f"{name} {dtype}", t, dtype)

    def _finish_scores(self, inp: Inputs, s: Tensor, qs: int, qe: int, seg: Segment) -> Tensor:
        """``score_mod`` and the tile's bias (masks, causal, ``mask_mod``) applied to raw scores."""
        if inp.score_mod is not None:
            qn, kn = qe - qs, seg.ke - seg.ks
            s = apply_score_mod(inp, s.view(inp.B, inp.Hq, qn, kn), qs, qe, seg.ks, seg.ke)
            s = s.reshape(inp.B * inp.Hk, inp.G * qn, kn)
        return self._add_bias(inp, s, qs, qe, seg)

    def _add_bias(self, inp: Inputs, s: Tensor, qs: int, qe: int, seg: Segment) -> Tensor:
        bias = tile_bias(inp, qs, qe, seg, inp.stats_dtype)
        if bias is not None:
            s.view(inp.B, inp.Hq, qe - qs, seg.ke - seg.ks).add_(bias)
        return s

    def _offset_product(
        self, inp: Inputs, q_op: OffsetOperand, seg: Segment, m_run: Tensor, off: Tensor, scratch: Scratch
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """A tile's half-precision product, offset by
        :func:`~subquad._backends.offsets.first_offsets`, in the scratch buffer ``r``:
        ``(product, the keys' [k, 1] operand, the offsets it used)``."""
        k_t = self._kv(inp.k, inp, seg, q_op.rows.dtype, scratch, "k")
        b_ext = q_op.operand(k_t, scratch)  # built once: the tile's products and any redone rows
        off = first_offsets(inp, seg, q_op, k_t, m_run, off)
        shape = (q_op.rows.shape[0], q_op.rows.shape[1], seg.ke - seg.ks)
        return q_op.product(b_ext, scratch.get("r", shape, q_op.rows.dtype)), b_ext, off

    def _offset_scores(
        self,
        inp: Inputs,
        q_op: OffsetOperand,
        qs: int,
        qe: int,
        seg: Segment,
        m_run: Tensor,
        off: Tensor,
        scratch: Scratch,
    ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """A tile's scores from half-precision products: ``(s - used, rows' max, used, next)``.

        For calls whose softmax sees the raw scores (masks of ``-inf`` only), so that a row's
        maximum is the raw score of its largest entry. The product is offset by
        :func:`~subquad._backends.offsets.first_offsets` and the float32 scores are returned
        relative to the offsets ``used``, which the caller subtracts with the row maximum. Where
        a row's maximum moves into this tile by more than :data:`OFFSET_DRIFT`, the row (or the
        whole tile: :func:`~subquad._backends.offsets.far_rows`) is computed again with the new
        maximum as offset; ``next``: the offsets of the following tile.
        """
        r, b_ext, off = self._offset_product(inp, q_op, seg, m_run, off, scratch)
        s = self._add_bias(inp, scratch.copy("s", r, inp.stats_dtype), qs, qe, seg)
        m_tile = s.amax(dim=-1).add_(off.squeeze(-1))
        moved, far, batches = far_rows(m_tile, m_run, off)
        new_off = q_op.set_offset(torch.where(moved, m_tile, off.squeeze(-1)))
        if batches is None:
            s = self._add_bias(inp, s.copy_(q_op.product(b_ext, r)), qs, qe, seg)
            return s, s.amax(dim=-1).add_(new_off.squeeze(-1)), new_off, new_off
        if not batches:
            return s, m_tile, off, new_off
        # Only the rows that moved far are computed again (a tile of 8k rows has one nearly always):
        # their new products replace the old ones in the biased scores, s += new - old.
        for b in batches:
            rows = far[b].nonzero().squeeze(1)
            old = r[b].index_select(0, rows).float()
            s[b].index_add_(0, rows, q_op.rows_product(b_ext, b, rows).float().sub_(old))
        used = torch.where(far.unsqueeze(-1), new_off, off)
        return s, s.amax(dim=-1).add_(used.squeeze(-1)), used, new_off

    def _native_probabilities(
        self,
        inp: Inputs,
        q_op: OffsetOperand,
        qs: int,
        qe: int,
        seg: Segment,
        m_run: Tensor,
        off: Tensor,
        scratch: Scratch,
        kernel: ModuleType,
    ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """:meth:`_offset_scores` and the softmax passes with the native kernel (:mod:`subquad._native`):
        ``(p, row sums, rows' max, next offsets)``, ``p`` in the products' dtype, relative to
        ``max(m_run, rows' max)`` (0 where nothing is visible), as the eager passes leave it."""
        r, b_ext, off = self._offset_product(inp, q_op, seg, m_run, off, scratch)
        p = self._add_bias(inp, r, qs, qe, seg)
        off_rows = off.squeeze(-1).contiguous()
        row_sums, m_tile = kernel.exp2_rows_bf16(p, m_run, off_rows)
        # far_rows and OffsetOperand.set_offset of the eager path, in one call:
        new, far, n_far = kernel.next_offsets(m_tile, m_run, off_rows, q_op.rows[..., q_op.e], q_op.alpha, OFFSET_DRIFT)
        new_off, batches = new.unsqueeze(-1), redo_batches(far, n_far)
        if batches is None:
            p = self._add_bias(inp, q_op.product(b_ext, r), qs, qe, seg)
            row_sums, m_tile = kernel.exp2_rows_bf16(p, m_run, new_off.squeeze(-1).contiguous())
            return p, row_sums, m_tile, new_off
        # The rows that moved far, again with their maximum as offset and read again from the new
        # product; what the first left at 0 (masked, or below 2^-126 of the largest) stays 0.
        for b in batches:
            rows = far[b].nonzero().squeeze(1)
            hidden = p[b].index_select(0, rows) == 0
            redo = q_op.rows_product(b_ext, b, rows).float().masked_fill_(hidden, NEG_INF)
            used = new_off[b, rows]
            m_tile[b, rows] = top = redo.amax(dim=-1).add_(used.squeeze(-1))
            redo.sub_(torch.maximum(m_run[b, rows], top).unsqueeze(-1) - used).exp2_()
            row_sums[b, rows] = redo.sum(dim=-1)
            p[b].index_copy_(0, rows, redo.to(p.dtype))
        return p, row_sums, m_tile, new_off

    def _add_dv(
        self, inp: Inputs, grads: Grads, p: Tensor, do_t: Tensor, seg: Segment, scratch: Scratch, dtype: torch.dtype
    ) -> None:
        """``dV += Pᵀ dO`` for the tile's keys; the product written in ``dtype``."""
        if grads.dv is not None:
            kn = seg.ke - seg.ks
            dv = product(p.transpose(1, 2), do_t, scratch.get("dkv", (inp.B * inp.Hk, kn, inp.Ev), dtype))
            add_into(
                grads.dv[:, :, seg.ks : seg.ke], scratch.widened(dv, inp.stats_dtype).view(inp.B, inp.Hk, kn, inp.Ev)
            )

    def forward_rows(
        self, inp: Inputs, qs: int, qe: int, segments: Iterable[Segment], out: Optional[Tensor], seed: int
    ) -> Tensor:
        """Online softmax over ``segments`` for rows ``[qs, qe)``; writes ``out`` and returns the lse."""
        assert out is not None, "returns_rows is off: the engine always passes the output buffer"
        loop = segment_kernel(inp)
        if loop is not None:  # the whole loop in C++ (subquad._backends.segments)
            return loop_forward_rows(inp, qs, qe, segments, out, loop)
        B, Hq, Hk, G = inp.B, inp.Hq, inp.Hk, inp.G
        qn = qe - qs
        sdt = inp.stats_dtype
        cdt = self.compute_dtype(inp)
        wide = _widens(inp, cdt)
        offset_s = cdt != sdt and not wide and _raw_softmax(inp)
        # Where the softmax sees the raw scores they are kept in log2 units (the scale carries
        # log2 e), so exp2 needs no multiply first; m and the offsets are in those units too.
        log2 = _raw_softmax(inp)
        unit = LOG2E if log2 else 1.0
        state = RowState(
            m=torch.full((B * Hk, G * qn), NEG_INF, dtype=sdt, device=inp.device),
            l=torch.zeros((B * Hk, G * qn), dtype=sdt, device=inp.device),
            acc=torch.zeros((B * Hk, G * qn, inp.Ev), dtype=sdt, device=inp.device),
        )
        # Scores are kept relative to per-row offsets (zero but for half-precision products).
        used = nxt = torch.zeros_like(state.m).unsqueeze(-1)
        scratch = pass_scratch(inp.device)
        if offset_s:
            q_op = OffsetOperand(self._q_operand(inp, qs, qe, cdt), inp.scale * unit)
        else:  # scaled here in full precision; the widening GEMM's alpha scales half operands
            q_t = self._q_operand(inp, qs, qe, cdt if wide else sdt, unit)
        q_alpha = inp.scale * unit if wide else 1.0
        kernel = _forward_kernel(inp)
        gpu_pass = wide and triton_passes.enabled(inp)  # the softmax passes in one Triton kernel
        for seg in segments:
            shape = (B * Hk, G * qn, seg.ke - seg.ks)
            if kernel is not None:
                p, row_sums, m_tile, nxt = self._native_probabilities(
                    inp, q_op, qs, qe, seg, state.m, nxt, scratch, kernel
                )
            elif offset_s:
                s, m_tile, used, nxt = self._offset_scores(inp, q_op, qs, qe, seg, state.m, nxt, scratch)
            else:
                k_t = self._kv(inp.k, inp, seg, cdt if wide else sdt, scratch, "k").transpose(1, 2)
                s = self._finish_scores(inp, product(q_t, k_t, scratch.get("s", shape, sdt), q_alpha), qs, qe, seg)
                if not gpu_pass:  # the kernel finds the maxima itself
                    m_tile = s.amax(dim=-1)
            if kernel is not None:
                # What the eager branch below does to m, l and acc, in one call.
                kernel.online_update(state.m, state.l, state.acc, m_tile, row_sums)
            elif gpu_pass:  # the same, with p rounded into the buffer its product reads
                p = scratch.get("r", shape, cdt)
                triton_passes.softmax_rows(s.contiguous(), p, state.m, state.l, state.acc, 1.0 if log2 else LOG2E)
            else:
                m_new = torch.maximum(state.m, m_tile)
                m_ref = m_new.masked_fill(m_new == NEG_INF, 0.0)  # rows with nothing visible yet stay finite
                s.sub_(m_ref.unsqueeze(-1) - used)
                p = s.exp2_() if log2 else exp_(s)
                row_sums = p.sum(dim=-1)
                correction = torch.exp2(state.m - m_ref) if log2 else torch.exp(state.m - m_ref)
                state.l.mul_(correction).add_(row_sums)
                state.acc.mul_(correction.unsqueeze(-1))
                state.m.copy_(m_new)
            if inp.dropout_p > 0.0:
                p.view(B, Hq, qn, -1).mul_(dropout_scale(inp, seed, qs, qe, seg.ks, seg.ke, sdt))
            v_t = self._kv(inp.v, inp, seg, cdt, scratch, "v")
            if cdt == sdt:
                state.acc.baddbmm_(p, v_t)
            else:
                # p in [0, 1] rounded to the operands' dtype, as the fused kernels do; the GEMM
                # accumulates in float32 and its result is rounded once per tile.
                # In the buffer of the tile's product (read by now): one tile fewer through the caches.
                p_h = p if p.dtype == cdt else scratch.copy("r", p, cdt)
                pv = scratch.get("pv", (B * Hk, G * qn, inp.Ev), sdt if wide else cdt)
                state.acc.add_(product(p_h, v_t if wide else scratch.contiguous(v_t, "v"), pv))
            del p
        return finish_rows(inp, qs, qe, state, out, log2)

    def backward_rows(
        self,
        inp: Inputs,
        qs: int,
        qe: int,
        segments: Iterable[Segment],
        grad_out: Tensor,
        out: Tensor,
        lse: Tensor,
        seed: int,
        grads: "Grads",
        grad_lse: Optional[Tensor] = None,
    ) -> None:
        """FlashAttention-2 backward for rows ``[qs, qe)``, accumulated into ``grads``.

        ``P = exp(S - lse)``; ``dV += Pᵀ dO``; ``dP = dO Vᵀ``; ``dS = P ∘ (dP - D)`` with
        ``D = rowsum(dO ∘ O) - dlse`` (``∂lse/∂S = P``, so a gradient on the returned lse only
        shifts D); ``dQ += scale·dS K``; ``dK += scale·dSᵀ Q``. ``dS`` is also the gradient of a
        float mask tile and, pulled back through ``score_mod``, of what it captured.

        Half-precision products are offset where the rounding would hurt: ``S`` by the lse (with
        a ``score_mod`` or a float mask S's product is float32 instead) and ``dP`` by ``D``
        (``dP - D`` cancels: rounding ``dP`` itself would lose ``dS``).
        """
        loop = backward_kernel(inp)
        if loop is not None:  # the whole loop in C++ (subquad._backends.segments)
            return loop_backward_rows(inp, qs, qe, segments, grad_out, out, lse, grads, grad_lse, loop)
        B, Hq, Hk, G = inp.B, inp.Hq, inp.Hk, inp.G
        qn = qe - qs
        sdt = inp.stats_dtype
        cdt = self.compute_dtype(inp)
        half = cdt != sdt
        wide = _widens(inp, cdt)  # half operands, float32 products: no offsets needed
        pdt = sdt if wide else cdt  # the dtype the products with rounded P and dS are written in
        q_t = self._q_operand(inp, qs, qe, cdt)
        do_rows = grad_out[:, :, qs:qe].reshape(B * Hk, G * qn, inp.Ev)
        do_t = do_rows.to(cdt)
        D = (do_rows.to(sdt) * out[:, :, qs:qe].reshape(B * Hk, G * qn, inp.Ev).to(sdt)).sum(dim=-1, keepdim=True)
        if grad_lse is not None:
            D -= grad_lse[:, :, qs:qe].reshape(B * Hk, G * qn, 1).to(sdt)
        lse_t = lse[:, :, qs:qe].reshape(B * Hk, G * qn, 1).to(sdt)
        lse_t = lse_t.masked_fill(lse_t == NEG_INF, 0.0)  # fully masked rows: S = -inf, so P = 0
        scratch = pass_scratch(inp.device)
        # S's offset: the lse, when the raw scores are what the softmax saw; else S's product
        # stays in float32 (a score_mod or a float mask moves the entries that matter).
        s_used = torch.zeros_like(lse_t)
        q_op: Optional[OffsetOperand] = None
        if half and not wide and _raw_softmax(inp):
            q_op = OffsetOperand(q_t, inp.scale)
            s_used = q_op.set_offset(lse_t.squeeze(-1))
        q_s = self._q_operand(inp, qs, qe, sdt) if half and not wide and q_op is None else q_t
        # dP's offset: D for kept entries (dP·z - D = z·(dP - D·(1-p)) with z = 1/(1-p)).
        d_op: Optional[OffsetOperand] = None
        d_used = torch.zeros_like(D)
        if half and not wide:
            d_op = OffsetOperand(do_t, 1.0)
            d_used = d_op.set_offset(D.squeeze(-1) * (1.0 - inp.dropout_p))
        dq_acc = torch.zeros(q_t.shape, dtype=sdt, device=inp.device) if grads.dq is not None else None
        gpu_pass = wide and triton_passes.enabled(inp)  # P and dS in one Triton kernel
        plain = inp.dropout_p == 0.0 and grads.dmask is None and inp.device_type == "cpu"
        kernel = tile_kernel() if plain and q_op is not None and d_op is not None else None
        if kernel is not None:
            shift = (lse_t - s_used).squeeze(-1).contiguous()  # P = exp(S - lse), S offset by s_used
            c_dp = (d_used - D).squeeze(-1).contiguous()  # dP - D, dP offset by d_used
        for seg in segments:
            kn = seg.ke - seg.ks
            k_t = self._kv(inp.k, inp, seg, cdt, scratch, "k")
            v_t = self._kv(inp.v, inp, seg, cdt, scratch, "v")
            shape = (B * Hk, G * qn, kn)
            if kernel is not None and q_op is not None and d_op is not None:
                # P and the scaled dS in one pass (subquad._native), each rounded once to bfloat16 in
                # its product's buffer: P for dV, dS for dQ and dK.
                p_h = scratch.get("r", shape, cdt)
                p_h = self._add_bias(inp, q_op.product(q_op.operand(k_t, scratch), p_h), qs, qe, seg)
                ds = d_op.product(d_op.operand(v_t, scratch), scratch.get("r2", shape, cdt))
                kernel.softmax_grad_rows_bf16(p_h, ds, shift, c_dp, inp.scale)
                self._add_dv(inp, grads, p_h, do_t, seg, scratch, cdt)
            else:
                if q_op is not None:
                    k_ext = q_op.operand(k_t, scratch)
                    raw = scratch.copy("s", q_op.product(k_ext, scratch.get("r", shape, cdt)), sdt)
                else:
                    k_s = k_t if wide or k_t.dtype == sdt else self._kv(inp.k, inp, seg, sdt, scratch, "k")
                    raw = product(q_s, k_s.transpose(1, 2), scratch.get("s", shape, sdt), inp.scale if wide else 1.0)
                s_in: Optional[Tensor] = None
                s_mod: Optional[Tensor] = None
                if inp.score_mod is None:
                    s = self._add_bias(inp, raw, qs, qe, seg)
                else:
                    with torch.enable_grad():
                        s_in = raw.view(B, Hq, qn, kn).detach().requires_grad_()
                        leaves = CapturedAsLeaves(grads.proxies, [s_in])
                        s_mod = apply_score_mod(inp, s_in, qs, qe, seg.ks, seg.ke, leaves)
                    s = self._add_bias(inp, s_mod.detach().reshape(B * Hk, G * qn, kn).clone(), qs, qe, seg)
                del raw
                if d_op is None:
                    dp = product(do_t, v_t.transpose(1, 2), scratch.get("dp", shape, sdt))
                else:
                    v_ext = d_op.operand(v_t, scratch)
                    dp = scratch.copy("dp", d_op.product(v_ext, scratch.get("r", shape, cdt)), sdt)
                    dp.add_(d_used)
                if gpu_pass:
                    # P rounded for dV; dS rounded and scaled for dQ and dK, or kept in float32 (in
                    # dP's buffer) where the mask's gradient or the score_mod's pullback needs it.
                    p_h = scratch.get("r", shape, cdt)
                    exact = grads.dmask is not None or s_mod is not None
                    ds = dp if exact else scratch.get("r2", shape, cdt)
                    triton_passes.softmax_grad_rows(s, dp, p_h, ds, lse_t.view(-1), D.view(-1), inp.scale, LOG2E)
                    self._add_dv(inp, grads, p_h, do_t, seg, scratch, pdt)
                    del dp, p_h
                else:
                    p = exp_(s.sub_(lse_t - s_used))
                    pd = p
                    if inp.dropout_p > 0.0:
                        z = (
                            dropout_scale(inp, seed, qs, qe, seg.ks, seg.ke, sdt)
                            .expand(B, Hq, qn, kn)
                            .reshape(B * Hk, G * qn, kn)
                        )
                        pd = p * z
                        dp.mul_(z)
                        del z
                    pd_h = pd if cdt == sdt else scratch.copy("r", pd, cdt)  # the products are read by now
                    self._add_dv(inp, grads, pd_h, do_t, seg, scratch, pdt)
                    del pd, pd_h
                    ds = p.mul_(dp.sub_(D))
                    del dp
                if grads.dmask is not None:
                    target = grads.dmask
                    if target.shape[-2] != 1:
                        target = target[..., qs:qe, :]
                    if target.shape[-1] != 1:
                        target = target[..., seg.ks : seg.ke]
                    add_into(target, ds.view(B, Hq, qn, kn))
                if s_mod is not None and s_in is not None:
                    proxies = list(grads.proxies.values())
                    pulled = torch.autograd.grad(s_mod, [s_in, *proxies], ds.view(B, Hq, qn, kn), allow_unused=True)
                    for acc_g, g in zip(grads.dcaptured, pulled[1:]):
                        if g is not None:
                            acc_g += g
                    ds = pulled[0].reshape(B * Hk, G * qn, kn) if pulled[0] is not None else torch.zeros_like(ds)
                    del s_mod, s_in, pulled
                if half and ds.dtype == sdt:
                    # The scale goes into dS as it is rounded (q_t is unscaled here).
                    ds = torch.mul(ds, inp.scale, out=scratch.get("r", shape, cdt))
            if dq_acc is not None:
                if half:
                    dq = scratch.get("dq", tuple(dq_acc.shape), pdt)
                    dq_acc.add_(product(ds, k_t if wide else scratch.contiguous(k_t, "k"), dq))
                else:
                    dq_acc.baddbmm_(ds, k_t)
            if grads.dk is not None:
                # q_t carries the scale (full precision) or ds does (half precision).
                dk = product(ds.transpose(1, 2), q_t, scratch.get("dkv", (B * Hk, kn, inp.E), pdt))
                add_into(grads.dk[:, :, seg.ks : seg.ke], scratch.widened(dk, sdt).view(B, Hk, kn, inp.E))
            del ds
        if grads.dq is not None and dq_acc is not None:
            if not half:
                dq_acc.mul_(inp.scale)
            add_into(grads.dq[:, :, qs:qe], dq_acc.view(B, Hq, qn, inp.E))


def _forward_kernel(inp: Inputs) -> Optional[ModuleType]:
    """The native kernel (:mod:`subquad._native`) where it does this call's forward tiles: offset
    bfloat16 products on a CPU, no dropout; else None."""
    if inp.device_type != "cpu" or inp.dropout_p > 0.0 or not _raw_softmax(inp):
        return None
    return tile_kernel() if Matmul.compute_dtype(inp) == torch.bfloat16 else None


def _widens(inp: Inputs, cdt: torch.dtype) -> bool:
    """Whether the tiles' products take half operands and write float32 (:func:`widening_products`)."""
    return cdt != inp.stats_dtype and widening_products(inp.device)


def _raw_softmax(inp: Inputs) -> bool:
    """Whether the softmax sees the raw scores where it sees anything (no ``score_mod``, no float
    mask): a row's maximum is then the raw score of its largest entry, the offset its
    half-precision product needs. Otherwise that product runs in float32."""
    return inp.score_mod is None and inp.mask_kind != "float"
