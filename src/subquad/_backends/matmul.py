"""The ``matmul`` path: subquad's own tiles in pure PyTorch, on every device.

``bmm`` for the scores, online softmax with float32 statistics, ``baddbmm`` into the accumulator;
any dtype, head dim, dropout, ``score_mod`` and ``mask_mod``, and the gradients of a float mask
and of tensors captured by ``score_mod``.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import Tensor

from .._callbacks import CapturedAsLeaves, apply_score_mod
from .._inputs import Inputs
from .._tiles import NEG_INF, Grads, RowState, Segment, add_into, dropout_scale, tile_bias
from .base import Backend, Options, _bh, _grad_accum_bytes


class Matmul(Backend):
    """Pure-PyTorch tiles (``bmm``): every device, dtype, head dim, dropout and callback."""

    name = "matmul"

    def tile_bytes(self, inp: Inputs, qc: int, kc: int) -> int:
        return _bh(inp) * min(qc, max(inp.Lq, 1)) * min(kc, max(inp.Lk, 1)) * inp.stats_itemsize

    def forward_bytes(self, inp: Inputs, qc: int, kc: int, need_lse: bool) -> int:
        qc, kc = min(qc, max(inp.Lq, 1)), min(kc, max(inp.Lk, 1))
        bh, st = _bh(inp), inp.stats_itemsize
        cs = torch.tensor([], dtype=Matmul.compute_dtype(inp)).element_size()
        tile = bh * qc * kc
        n = inp.B * inp.Hq * qc * inp.E * cs  # scaled q block
        if cs != inp.itemsize:
            n += inp.B * inp.Hk * kc * (inp.E + inp.Ev) * cs * 2  # k/v casts
        elif inp.kv_broadcast:
            n += inp.B * inp.Hk * kc * (inp.E + inp.Ev) * cs  # a key/value shared by the batch, copied per tile
        n += tile * st  # scores; exp, the correction and p @ v work on them in place
        if cs != st:
            n += tile * cs * 2  # the matmul's own output before the float32 cast, and p cast for p @ v
        n += inp.mask_tile_elements(qc, kc) * (st + 1)
        if inp.is_causal:
            n += qc * kc * (st + 1) + (qc + kc) * 8
        if inp.score_mod is not None:
            n += 3 * tile * st + 2 * qc * kc * 8  # the callback's result and its intermediates
        if inp.mask_mod is not None:
            n += 2 * tile + tile * st + 2 * qc * kc * 8
        if inp.dropout_p > 0:
            n += tile * (8 * 2 + st + 1)
        n += bh * qc * (inp.Ev * st * 2 + 6 * st)  # accumulator, p @ v, row statistics
        if need_lse:
            n += inp.lse_bytes()
        return int(n * 1.15) + 256 * 1024  # allocator rounding, index vectors

    def backward_bytes(self, inp: Inputs, qc: int, kc: int, opts: Options) -> int:
        qc, kc = min(qc, max(inp.Lq, 1)), min(kc, max(inp.Lk, 1))
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
        """The dtype of a tile's products: float32 for half-precision inputs, on every device.

        ``bmm`` writes its result in its inputs' dtype: half-precision scores would be rounded to
        8 (bf16) or 11 (fp16) bits, or overflow fp16, before the softmax, about 10x the error of
        torch's SDPA (which keeps float32 scores; its math path upcasts too). The row statistics
        and the accumulator are float32 whatever this returns (``Inputs.stats_dtype``).
        """
        if inp.dtype in (torch.float16, torch.bfloat16):
            return torch.float32
        return inp.dtype

    def _scaled_q(self, inp: Inputs, qs: int, qe: int, cdt: torch.dtype) -> Tensor:
        # Scaling q (qn x E) is cheaper than scaling the scores (qn x kn), and keeps fp16 scores in range.
        q_t = torch.mul(inp.q[:, :, qs:qe].to(cdt), inp.scale)
        return q_t.reshape(inp.B * inp.Hk, inp.G * (qe - qs), inp.E)

    def _kv(self, t: Tensor, inp: Inputs, seg: Segment, dtype: torch.dtype) -> Tensor:
        # A key/value shared by the batch is copied per tile here (tile-sized, in the memory model).
        t = t[:, :, seg.ks : seg.ke].reshape(inp.B * inp.Hk, seg.ke - seg.ks, t.shape[-1])
        return t if t.dtype == dtype else t.to(dtype)

    def _raw_scores(self, inp: Inputs, q_t: Tensor, seg: Segment, cdt: torch.dtype) -> Tensor:
        """``scale · q kᵀ`` of one tile, ``(B*Hk, G*qn, kn)`` in the stats dtype."""
        s = torch.bmm(q_t, self._kv(inp.k, inp, seg, cdt).transpose(1, 2))
        return s if s.dtype == inp.stats_dtype else s.to(inp.stats_dtype)

    def _add_bias(self, inp: Inputs, s: Tensor, qs: int, qe: int, seg: Segment) -> Tensor:
        bias = tile_bias(inp, qs, qe, seg, inp.stats_dtype)
        if bias is not None:
            s.view(inp.B, inp.Hq, qe - qs, seg.ke - seg.ks).add_(bias)
        return s

    def _scores(self, inp: Inputs, q_t: Tensor, qs: int, qe: int, seg: Segment, cdt: torch.dtype) -> Tensor:
        s = self._raw_scores(inp, q_t, seg, cdt)
        if inp.score_mod is not None:
            qn, kn = qe - qs, seg.ke - seg.ks
            s = apply_score_mod(inp, s.view(inp.B, inp.Hq, qn, kn), qs, qe, seg.ks, seg.ke)
            s = s.reshape(inp.B * inp.Hk, inp.G * qn, kn)
        return self._add_bias(inp, s, qs, qe, seg)

    def forward_rows(
        self, inp: Inputs, qs: int, qe: int, segments: Iterable[Segment], out: Optional[Tensor], seed: int
    ) -> Tensor:
        """Online softmax over ``segments`` for rows ``[qs, qe)``; writes ``out`` and returns the lse."""
        assert out is not None, "returns_rows is off: the engine always passes the output buffer"
        B, Hq, Hk, G = inp.B, inp.Hq, inp.Hk, inp.G
        qn = qe - qs
        sdt = inp.stats_dtype
        cdt = self.compute_dtype(inp)
        q_t = self._scaled_q(inp, qs, qe, cdt)
        state = RowState(
            m=torch.full((B * Hk, G * qn), NEG_INF, dtype=sdt, device=inp.device),
            l=torch.zeros((B * Hk, G * qn), dtype=sdt, device=inp.device),
            acc=torch.zeros((B * Hk, G * qn, inp.Ev), dtype=sdt, device=inp.device),
        )
        for seg in segments:
            s = self._scores(inp, q_t, qs, qe, seg, cdt)
            m_new = torch.maximum(state.m, s.amax(dim=-1))
            m_ref = m_new.masked_fill(m_new == NEG_INF, 0.0)  # rows with nothing visible yet stay finite
            p = s.sub_(m_ref.unsqueeze(-1)).exp_()
            correction = torch.exp(state.m - m_ref)
            state.l.mul_(correction).add_(p.sum(dim=-1))
            state.acc.mul_(correction.unsqueeze(-1))
            if inp.dropout_p > 0.0:
                p.view(B, Hq, qn, -1).mul_(dropout_scale(inp, seed, qs, qe, seg.ks, seg.ke, sdt))
            v_t = self._kv(inp.v, inp, seg, cdt)
            if v_t.dtype == sdt:
                state.acc.baddbmm_(p, v_t)
            else:
                state.acc.add_(torch.bmm(p.to(v_t.dtype), v_t))
            state.m.copy_(m_new)
            del s, p
        l_safe = state.l.masked_fill(state.l == 0, 1.0)  # fully masked rows: acc is 0, so output 0
        out[:, :, qs:qe].copy_(state.acc.div_(l_safe.unsqueeze(-1)).view(B, Hq, qn, inp.Ev))
        return (state.m + torch.log(state.l)).view(B, Hq, qn)

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
        """
        B, Hq, Hk, G = inp.B, inp.Hq, inp.Hk, inp.G
        qn = qe - qs
        sdt = inp.stats_dtype
        q_t = self._scaled_q(inp, qs, qe, sdt)
        do_t = grad_out[:, :, qs:qe].to(sdt).reshape(B * Hk, G * qn, inp.Ev)
        D = (do_t * out[:, :, qs:qe].reshape(B * Hk, G * qn, inp.Ev).to(sdt)).sum(dim=-1, keepdim=True)
        if grad_lse is not None:
            D -= grad_lse[:, :, qs:qe].reshape(B * Hk, G * qn, 1).to(sdt)
        lse_t = lse[:, :, qs:qe].reshape(B * Hk, G * qn, 1).to(sdt)
        lse_t = lse_t.masked_fill(lse_t == NEG_INF, 0.0)  # fully masked rows: S = -inf, so P = 0
        dq_acc = torch.zeros_like(q_t) if grads.dq is not None else None
        for seg in segments:
            kn = seg.ke - seg.ks
            k_t = self._kv(inp.k, inp, seg, sdt)
            v_t = self._kv(inp.v, inp, seg, sdt)
            s_in: Optional[Tensor] = None
            s_mod: Optional[Tensor] = None
            if inp.score_mod is None:
                s = self._scores(inp, q_t, qs, qe, seg, sdt)
            else:
                raw = torch.bmm(q_t, k_t.transpose(1, 2)).view(B, Hq, qn, kn)
                with torch.enable_grad():
                    s_in = raw.detach().requires_grad_()
                    leaves = CapturedAsLeaves(grads.proxies, [s_in])
                    s_mod = apply_score_mod(inp, s_in, qs, qe, seg.ks, seg.ke, leaves)
                s = self._add_bias(inp, s_mod.detach().reshape(B * Hk, G * qn, kn).clone(), qs, qe, seg)
            p = s.sub_(lse_t).exp_()
            dp = torch.bmm(do_t, v_t.transpose(1, 2))
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
            if grads.dv is not None:
                add_into(grads.dv[:, :, seg.ks : seg.ke], torch.bmm(pd.transpose(1, 2), do_t).view(B, Hk, kn, inp.Ev))
            del pd
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
            if dq_acc is not None:
                dq_acc.baddbmm_(ds, k_t)
            if grads.dk is not None:
                # q_t already carries the scale.
                add_into(grads.dk[:, :, seg.ks : seg.ke], torch.bmm(ds.transpose(1, 2), q_t).view(B, Hk, kn, inp.E))
            del ds
        if grads.dq is not None and dq_acc is not None:
            add_into(grads.dq[:, :, qs:qe], dq_acc.mul_(inp.scale).view(B, Hq, qn, inp.E))
