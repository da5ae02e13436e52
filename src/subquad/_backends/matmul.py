"""The ``matmul`` path: subquad's own tiles in pure PyTorch, on every device.

``bmm`` for the scores, online softmax with float32 statistics, ``baddbmm`` into the accumulator;
any dtype, head dim, dropout, ``score_mod`` and ``mask_mod``, and the gradients of a float mask
and of tensors captured by ``score_mod``. The products (:meth:`Matmul.compute_dtype`):

- float32 or float64; half-precision inputs converted once per row block or tile;
- on CUDA, half operands with float32 results, the passes in Triton (:mod:`~subquad._backends.triton_passes`);
- on a CPU that multiplies bfloat16 natively, bfloat16 offset per row (:class:`OffsetOperand`), the
  passes in the native kernel (:mod:`subquad._native`) where it is built;
- none: the native kernel's C++ loops take the whole call where they can
  (:mod:`subquad._backends.segments`). ``auto`` names that path ``loops``
  (:mod:`~subquad._backends.loops`): the backend that runs only them and refuses the rest.

What each path costs per tile, and what MPS runs: docs/benchmarks/half.md.
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
    # and the GEMMs run fastest on squarish tiles (docs/planner.md).
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
        # does an inference forward's, the bfloat16 product alone (docs/benchmarks/loops.md).
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
        """The dtype a tile's matmuls take their operands in (the row statistics and the
        accumulator are float32 whatever it is: ``Inputs.stats_dtype``).

        - bfloat16 on a CPU that multiplies bfloat16 natively (:func:`native_bf16_products`), head
          dims of :data:`HALF_PRODUCTS_MIN_HEAD_DIM` or more: bfloat16, each product offset per
          row so that what its one rounding loses is small where the softmax looks
          (:class:`OffsetOperand`).
        - half precision where GEMMs write float32 results from half operands (CUDA,
          :func:`widening_products`): the inputs' dtype; only ``p`` and ``dS`` are rounded to it.
        - other half precision: float32 (a float16 GEMM is emulated on CPUs without AVX512-FP16;
          MPS until a Mac checks its half-precision GEMMs' rounding).
        - float32 and float64: the inputs' dtype.
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

        For calls whose softmax sees the raw scores (masks of ``-inf`` only). The product is offset
        by :func:`~subquad._backends.offsets.first_offsets`; a row whose maximum moves more than
        :data:`OFFSET_DRIFT` from it (or the whole tile: :func:`~subquad._backends.offsets.far_rows`)
        is computed again with the new maximum as offset. ``next``: the next tile's offsets.
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
        rows = _RowBlockBackward(self, inp, qs, qe, grad_out, out, lse, seed, grads, grad_lse)
        for seg in segments:
            rows.add_tile(seg)
        if grads.dq is not None and rows.dq_acc is not None:
            if not rows.half:
                rows.dq_acc.mul_(inp.scale)
            add_into(grads.dq[:, :, qs:qe], rows.dq_acc.view(inp.B, inp.Hq, qe - qs, inp.E))


class _RowBlockBackward:
    """:meth:`Matmul.backward_rows` over one block of rows: the rows' operands, D, the lse and the
    offsets of their half-precision products, set up once; then per tile of keys P, dS and the
    gradients (:meth:`add_tile`), dQ kept in ``dq_acc`` for the caller."""

    def __init__(
        self,
        tiles: Matmul,
        inp: Inputs,
        qs: int,
        qe: int,
        grad_out: Tensor,
        out: Tensor,
        lse: Tensor,
        seed: int,
        grads: Grads,
        grad_lse: Optional[Tensor],
    ) -> None:
        self.tiles, self.inp, self.qs, self.qe, self.seed, self.grads = tiles, inp, qs, qe, seed, grads
        B, Hk, G, qn = inp.B, inp.Hk, inp.G, qe - qs
        self.sdt = sdt = inp.stats_dtype
        self.cdt = cdt = tiles.compute_dtype(inp)
        self.half = half = cdt != sdt
        self.wide = wide = _widens(inp, cdt)  # half operands, float32 products: no offsets needed
        self.pdt = sdt if wide else cdt  # the dtype the products with rounded P and dS are written in
        self.q_t = q_t = tiles._q_operand(inp, qs, qe, cdt)
        do_rows = grad_out[:, :, qs:qe].reshape(B * Hk, G * qn, inp.Ev)
        self.do_t = do_rows.to(cdt)
        o_rows = out[:, :, qs:qe].reshape(B * Hk, G * qn, inp.Ev)
        self.D = D = (do_rows.to(sdt) * o_rows.to(sdt)).sum(dim=-1, keepdim=True)  # rowsum(dO ∘ O) - dlse
        if grad_lse is not None:
            D -= grad_lse[:, :, qs:qe].reshape(B * Hk, G * qn, 1).to(sdt)
        lse_t = lse[:, :, qs:qe].reshape(B * Hk, G * qn, 1).to(sdt)
        self.lse_t = lse_t = lse_t.masked_fill(lse_t == NEG_INF, 0.0)  # fully masked rows: S = -inf, so P = 0
        self.scratch = pass_scratch(inp.device)
        # S's offset: the lse, when the raw scores are what the softmax saw; else S's product
        # stays in float32 (a score_mod or a float mask moves the entries that matter).
        self.s_used = torch.zeros_like(lse_t)
        self.q_op: Optional[OffsetOperand] = None
        if half and not wide and _raw_softmax(inp):
            self.q_op = OffsetOperand(q_t, inp.scale)
            self.s_used = self.q_op.set_offset(lse_t.squeeze(-1))
        self.q_s = tiles._q_operand(inp, qs, qe, sdt) if half and not wide and self.q_op is None else q_t
        # dP's offset: D for kept entries (dP·z - D = z·(dP - D·(1-p)) with z = 1/(1-p)).
        self.d_op: Optional[OffsetOperand] = None
        self.d_used = torch.zeros_like(D)
        if half and not wide:
            self.d_op = OffsetOperand(self.do_t, 1.0)
            self.d_used = self.d_op.set_offset(D.squeeze(-1) * (1.0 - inp.dropout_p))
        self.dq_acc = torch.zeros(q_t.shape, dtype=sdt, device=inp.device) if grads.dq is not None else None
        self.gpu_pass = wide and triton_passes.enabled(inp)  # P and dS in one Triton kernel
        plain = inp.dropout_p == 0.0 and grads.dmask is None and inp.device_type == "cpu"
        self.kernel = tile_kernel() if plain and self.q_op is not None and self.d_op is not None else None
        if self.kernel is not None:
            self.shift = (lse_t - self.s_used).squeeze(-1).contiguous()  # P = exp(S - lse), S offset by s_used
            self.c_dp = (self.d_used - D).squeeze(-1).contiguous()  # dP - D, dP offset by d_used

    def add_tile(self, seg: Segment) -> None:
        """P and dS of the tile of keys ``seg``: ``dV``, ``dK`` and the mask's and captured tensors'
        gradients added, ``dS K`` into dQ's rows."""
        inp, tiles, scratch = self.inp, self.tiles, self.scratch
        k_t = tiles._kv(inp.k, inp, seg, self.cdt, scratch, "k")
        v_t = tiles._kv(inp.v, inp, seg, self.cdt, scratch, "v")
        shape = (inp.B * inp.Hk, inp.G * (self.qe - self.qs), seg.ke - seg.ks)
        ds = self._native_ds(seg, k_t, v_t, shape) if self.kernel is not None else self._eager_ds(seg, k_t, v_t, shape)
        if self.dq_acc is not None:
            if self.half:
                dq = scratch.get("dq", tuple(self.dq_acc.shape), self.pdt)
                self.dq_acc.add_(product(ds, k_t if self.wide else scratch.contiguous(k_t, "k"), dq))
            else:
                self.dq_acc.baddbmm_(ds, k_t)
        if self.grads.dk is not None:
            # q_t carries the scale (full precision) or ds does (half precision).
            dk = product(ds.transpose(1, 2), self.q_t, scratch.get("dkv", (shape[0], shape[2], inp.E), self.pdt))
            dk = scratch.widened(dk, self.sdt).view(inp.B, inp.Hk, shape[2], inp.E)
            add_into(self.grads.dk[:, :, seg.ks : seg.ke], dk)

    def _native_ds(self, seg: Segment, k_t: Tensor, v_t: Tensor, shape: Tuple[int, int, int]) -> Tensor:
        """P and the scaled dS in one pass (:mod:`subquad._native`), each rounded once to bfloat16 in
        its product's buffer: P for dV (added here), dS returned for dQ and dK."""
        assert self.kernel is not None and self.q_op is not None and self.d_op is not None
        inp, scratch = self.inp, self.scratch
        p_h = self.q_op.product(self.q_op.operand(k_t, scratch), scratch.get("r", shape, self.cdt))
        p_h = self.tiles._add_bias(inp, p_h, self.qs, self.qe, seg)
        ds = self.d_op.product(self.d_op.operand(v_t, scratch), scratch.get("r2", shape, self.cdt))
        self.kernel.softmax_grad_rows_bf16(p_h, ds, self.shift, self.c_dp, inp.scale)
        self.tiles._add_dv(inp, self.grads, p_h, self.do_t, seg, scratch, self.cdt)
        return ds

    def _eager_ds(self, seg: Segment, k_t: Tensor, v_t: Tensor, shape: Tuple[int, int, int]) -> Tensor:
        """dS in torch's passes (or Triton's), dV added on the way: S, dP, P and dS; dS added into
        the mask's gradient and pulled back through ``score_mod``; rounded with the scale for its
        products in half precision."""
        s, s_in, s_mod = self._scores(seg, k_t, shape)
        dp = self._dp(v_t, shape)
        if self.gpu_pass:
            ds = self._triton_ds(seg, s, dp, exact=self.grads.dmask is not None or s_mod is not None)
        else:
            ds = self._torch_ds(seg, s, dp)
        del s, dp
        ds = self._pull_back(seg, ds, s_in, s_mod)
        del s_in, s_mod
        if self.half and ds.dtype == self.sdt:
            # The scale goes into dS as it is rounded (q_t is unscaled here).
            ds = torch.mul(ds, self.inp.scale, out=self.scratch.get("r", shape, self.cdt))
        return ds

    def _scores(
        self, seg: Segment, k_t: Tensor, shape: Tuple[int, int, int]
    ) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """The tile's scores as the forward's softmax saw them, float32, relative to ``s_used``:
        ``(S, score_mod's input, its output)``, the last two for the pull-back (None without one)."""
        inp, scratch, sdt = self.inp, self.scratch, self.sdt
        if self.q_op is not None:
            k_ext = self.q_op.operand(k_t, scratch)
            raw = scratch.copy("s", self.q_op.product(k_ext, scratch.get("r", shape, self.cdt)), sdt)
        else:
            k_s = k_t if self.wide or k_t.dtype == sdt else self.tiles._kv(inp.k, inp, seg, sdt, scratch, "k")
            raw = product(self.q_s, k_s.transpose(1, 2), scratch.get("s", shape, sdt), inp.scale if self.wide else 1.0)
        if inp.score_mod is None:
            return self.tiles._add_bias(inp, raw, self.qs, self.qe, seg), None, None
        with torch.enable_grad():
            s_in = raw.view(inp.B, inp.Hq, self.qe - self.qs, shape[2]).detach().requires_grad_()
            leaves = CapturedAsLeaves(self.grads.proxies, [s_in])
            s_mod = apply_score_mod(inp, s_in, self.qs, self.qe, seg.ks, seg.ke, leaves)
        s = self.tiles._add_bias(inp, s_mod.detach().reshape(shape).clone(), self.qs, self.qe, seg)
        return s, s_in, s_mod

    def _dp(self, v_t: Tensor, shape: Tuple[int, int, int]) -> Tensor:
        """``dP = dO Vᵀ`` in float32; a half-precision product offset by D, added back."""
        if self.d_op is None:
            return product(self.do_t, v_t.transpose(1, 2), self.scratch.get("dp", shape, self.sdt))
        v_ext = self.d_op.operand(v_t, self.scratch)
        dp = self.scratch.copy("dp", self.d_op.product(v_ext, self.scratch.get("r", shape, self.cdt)), self.sdt)
        return dp.add_(self.d_used)

    def _triton_ds(self, seg: Segment, s: Tensor, dp: Tensor, exact: bool) -> Tensor:
        """P and dS in one Triton kernel: P rounded for dV (added here); dS rounded and scaled for dQ
        and dK, or float32 in dP's buffer if ``exact`` (for the mask's gradient, score_mod's pullback)."""
        p_h = self.scratch.get("r", tuple(s.shape), self.cdt)
        ds = dp if exact else self.scratch.get("r2", tuple(s.shape), self.cdt)
        triton_passes.softmax_grad_rows(s, dp, p_h, ds, self.lse_t.view(-1), self.D.view(-1), self.inp.scale, LOG2E)
        self.tiles._add_dv(self.inp, self.grads, p_h, self.do_t, seg, self.scratch, self.pdt)
        return ds

    def _torch_ds(self, seg: Segment, s: Tensor, dp: Tensor) -> Tensor:
        """P and dS in torch's passes over S's float32 buffer: dropout's scale on P and dP, P
        rounded for dV (added here), ``dS = P ∘ (dP - D)`` returned."""
        inp = self.inp
        p = exp_(s.sub_(self.lse_t - self.s_used))
        pd = p
        if inp.dropout_p > 0.0:
            z = dropout_scale(inp, self.seed, self.qs, self.qe, seg.ks, seg.ke, self.sdt)
            z = z.expand(inp.B, inp.Hq, self.qe - self.qs, seg.ke - seg.ks).reshape(s.shape)
            pd = p * z
            dp.mul_(z)
            del z
        pd_h = pd if self.cdt == self.sdt else self.scratch.copy("r", pd, self.cdt)  # the products are read by now
        self.tiles._add_dv(inp, self.grads, pd_h, self.do_t, seg, self.scratch, self.pdt)
        del pd, pd_h
        return p.mul_(dp.sub_(self.D))

    def _pull_back(self, seg: Segment, ds: Tensor, s_in: Optional[Tensor], s_mod: Optional[Tensor]) -> Tensor:
        """dS added into the float mask's gradient, and pulled back through ``score_mod``: the
        gradients of what it captured accumulated, dS of the raw scores returned."""
        inp, grads = self.inp, self.grads
        blocks = ds.view(inp.B, inp.Hq, self.qe - self.qs, seg.ke - seg.ks)
        if grads.dmask is not None:
            target = grads.dmask
            if target.shape[-2] != 1:
                target = target[..., self.qs : self.qe, :]
            if target.shape[-1] != 1:
                target = target[..., seg.ks : seg.ke]
            add_into(target, blocks)
        if s_mod is None or s_in is None:
            return ds
        pulled = torch.autograd.grad(s_mod, [s_in, *grads.proxies.values()], blocks, allow_unused=True)
        for acc_g, g in zip(grads.dcaptured, pulled[1:]):
            if g is not None:
                acc_g += g
        return pulled[0].reshape(ds.shape) if pulled[0] is not None else torch.zeros_like(ds)


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
