"""The ``fused`` backend: PyTorch's fused CPU flash kernel per tile, merged by log-sum-exp.

``aten._scaled_dot_product_flash_attention_for_cpu`` (a private op, probed once at run time)
returns each tile's lse, so tiles over disjoint key segments merge exactly. Masks, the causal part
it cannot express and additive ``score_mod``s reach it as a float bias tile. On a CPU that
emulates float16 GEMMs (:func:`emulated_half_kernel`) float16 tiles run on float32 copies.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from .._callbacks import call_user, index_grids
from .._inputs import Inputs
from .._tiles import EMPTY_CHECK_ELEMENTS, NEG_INF, Grads, Segment, add_into, call_kernel, empty_rows, tile_bias
from .._traced import TracedScoreMod
from .base import Backend, Options, _bh, _generated_causal, _strided, _threads, candidates, unit_stride
from .products import native_bf16_products, native_fp16_products

_OPS: List[Tuple[Any, Any]] = []


def _cpu_flash_ops() -> Tuple[
    Optional[Callable[..., Tuple[Tensor, Tensor]]], Optional[Callable[..., Tuple[Tensor, Tensor, Tensor]]]
]:
    if not _OPS:  # looked up once: the attribute lookups cost a microsecond per call
        ops = torch.ops.aten
        fwd = getattr(ops, "_scaled_dot_product_flash_attention_for_cpu", None)
        bwd = getattr(ops, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
        _OPS.append((getattr(fwd, "default", fwd), getattr(bwd, "default", bwd)))
    return _OPS[0]


def cpu_flash_forward() -> Callable[..., Tuple[Tensor, Tensor]]:
    fwd = _cpu_flash_ops()[0]
    assert fwd is not None
    return fwd


def _probe_cpu_flash() -> Optional[str]:
    """Run the private CPU flash kernel once on a tiny input; ``None`` if it works, else why not."""
    fwd, bwd = _cpu_flash_ops()
    if fwd is None:
        return "this PyTorch build has no aten._scaled_dot_product_flash_attention_for_cpu"
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64)
        k = torch.randn(1, 1, 5, 4, generator=g, dtype=torch.float64)
        v = torch.randn(1, 1, 5, 4, generator=g, dtype=torch.float64)
        mask = torch.zeros(3, 5, dtype=torch.float64)
        mask[1, 2:] = NEG_INF
        o, lse = fwd(q, k, v, 0.0, False, attn_mask=mask, scale=0.5)
        s = (q @ k.transpose(-1, -2)) * 0.5 + mask
        ref_lse = torch.logsumexp(s, dim=-1)
        ref = torch.softmax(s, dim=-1) @ v
        if o.shape != ref.shape or lse.shape != ref_lse.shape:
            return "the private CPU flash kernel returned unexpected shapes (GQA or lse layout changed)"
        if not (torch.allclose(o, ref, atol=1e-10) and torch.allclose(lse.to(torch.float64), ref_lse, atol=1e-10)):
            return "the private CPU flash kernel failed its self-check"
        if bwd is None:
            return "this PyTorch build has no aten._scaled_dot_product_flash_attention_for_cpu_backward"
    except Exception as e:  # a changed private signature surfaces as any error
        return f"the private CPU flash kernel failed its self-check ({type(e).__name__}: {e})"
    return None


_CPU_FLASH_PROBE: List[Optional[str]] = []


def cpu_flash_unavailable_reason() -> Optional[str]:
    if not _CPU_FLASH_PROBE:
        _CPU_FLASH_PROBE.append(_probe_cpu_flash())
    return _CPU_FLASH_PROBE[0]


def _as_kernel_mask(bias: Optional[Tensor]) -> Optional[Tensor]:
    """The kernel takes 2-D or 4-D masks (it broadcasts their size-1 dims itself)."""
    if bias is None or bias.dim() in (2, 4):
        return bias
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    return bias


def _operands(in_float32: bool, *tiles: Tensor) -> Tuple[Tensor, ...]:
    """The kernel's operands: ``tiles`` with unit stride, as float32 copies if ``in_float32``."""
    return tuple(unit_stride(t.float() if in_float32 else t) for t in tiles)


_KV_BLOCK = 512
"""The keys torch's CPU flash kernel takes per block; a causal call skips only whole blocks."""

_SPLIT_WEIGHT = {256: 1.0, 64: 1.15, 32: 1.5}
"""Time per computed score by the kernel's row split, relative to its 256-row blocks (2-core CPU,
float32, 1x8x2048x64 causal, two threads: tiles of 512 ran 1.15x the whole call for as many
scores, tiles of 128 1.5-1.7x; a least-squares fit over 16 x 512 ... 8 x 1024 tokens on one
thread gave 1.08 and 1.27)."""

CALL_COST_SCORES = 40_000
"""What one kernel call of a tile costs beyond its scores, in scores per thread. The same fit gave
0.12 ms per call forward and 0.18 ms backward on one thread (30k and 17k scores), 0.19 and 0.34 ms
on two (85k and 54k), and about as much for calls of one head as of eight."""

_COSTED_ROWS = 768
"""From this many rows a call runs in the kernel's 256-row blocks, which skip causal work
themselves (key blocks of 512 past a block's last row): the largest tiles that fit are kept.
Below, on the calibration runs (256-1024 tokens, one and two threads, forward and backward), the
cost's choices ran 0.76-1.00x the whole call's time."""

_SMALLEST_COSTED_TILE = 128
"""Smaller tiles are weighed only when nothing larger fits: the kernel's products over 64 keys or
fewer run slower than the weights say: tiles of 64 ran 8 heads x 256 tokens 1.1x and 1.6x the
whole call's time on one and two threads, and for four times the heads the cost would rank them
below the whole call (0.92x)."""


def _row_split(rows: int) -> int:
    """The rows per block torch's CPU flash kernel takes for a call of ``rows`` query rows."""
    return 256 if rows >= 768 else 64 if rows >= 192 else 32


def kernel_work(rows: int, keys: int, causal: bool) -> float:
    """One head's scores in a kernel call (top-left causal: each block of rows stops at the block
    of keys holding its last visible one), weighted by the row split's :data:`_SPLIT_WEIGHT`."""
    split = _row_split(rows)
    if not causal:
        return _SPLIT_WEIGHT[split] * rows * keys
    n = 0
    for a in range(0, rows, split):
        b = min(a + split, rows)
        n += (b - a) * min(-(-b // _KV_BLOCK) * _KV_BLOCK, keys)
    return _SPLIT_WEIGHT[split] * n


def causal_cost(inp: Inputs, tiles: Tuple[int, int], backward: bool) -> float:
    """The relative time of a square causal call on ``tiles``, in scores: every kernel call's
    :func:`kernel_work` for all heads, plus :data:`CALL_COST_SCORES` per call and thread. A block
    of rows runs its diagonal tile as a causal call and the keys before it as one call forward
    (segments coalesced), one per tile backward."""
    L, t = inp.Lq, max(1, min(tiles[0], inp.Lq))
    work = 0.0
    calls = 0
    for qs in range(0, L, t):
        rows = min(qs + t, L) - qs
        work += kernel_work(rows, rows, True)
        calls += 1
        if qs and backward:
            work += (qs // t) * kernel_work(rows, t, False)
            calls += qs // t
        elif qs:
            work += kernel_work(rows, qs, False)
            calls += 1
    return work * inp.n_groups * inp.B * inp.Hq + calls * inp.n_groups * CALL_COST_SCORES * _threads()


def _plain_square_causal(inp: Inputs) -> bool:
    return (
        inp.is_causal
        and inp.Lq == inp.Lk
        and inp.causal_offset == 0
        and inp.attn_mask is None
        and not inp.has_callbacks
        and inp.positive_scale
    )


class FusedCPU(Backend):
    """PyTorch's fused CPU flash kernel, per block of rows and key segment, merged by lse."""

    name = "fused"
    devices = ("cpu",)
    returns_rows = True
    # The kernel's own working set per thread: a qSplit x kvSplit score block (256 x 512 at most),
    # its reduced-precision copy, and qSplit rows of accumulator.
    _Q_SPLIT, _KV_SPLIT = 256, 512

    def not_supported_reasons(self, inp: Inputs, opts: Options) -> List[str]:
        reasons = super().not_supported_reasons(inp, opts)
        if reasons:
            return reasons
        why = cpu_flash_unavailable_reason()
        if why:
            reasons.append(why)
        if inp.Ev != inp.E:
            reasons.append(f"the CPU flash kernel needs value's head dim Ev == E, got Ev={inp.Ev}, E={inp.E}")
        if inp.dropout_p > 0:
            reasons.append("the CPU flash kernel does not support dropout")
        if inp.score_mod is not None and getattr(inp.score_mod, "additive_bias", None) is None:
            why = getattr(inp.score_mod, "not_additive", "a general callback")
            reasons.append(f"score_mod is not score + bias ({why}); the fused kernel only adds a bias tile")
        return reasons

    def backward_backend(self, inp: Inputs, opts: Options) -> str:
        # The fused backward returns dQ, dK, dV only: a learnable mask or tensors captured by
        # score_mod take the matmul backward (it starts from the same saved out and lse).
        mask_grad = inp.attn_mask is not None and inp.attn_mask.requires_grad
        return "matmul" if mask_grad or opts.captured_requires_grad else "fused"

    def computed_blocks(self, Lq: int, Lk: int, tiles: Optional[Tuple[int, int]]) -> Optional[Tuple[int, int]]:
        # Each tile is one kernel call, which skips causal blocks of its own: rows split as torch's
        # CPU flash kernel splits them (by the tile's length), keys by 512.
        tq, tk = (Lq, Lk) if tiles is None else (min(tiles[0], Lq), min(tiles[1], Lk))
        return max(1, min(_row_split(tq), tq)), max(1, min(self._KV_SPLIT, tk))

    def fastest(self, inp: Inputs, fitting: Iterator[Tuple[int, int]], backward: bool) -> Optional[Tuple[int, int]]:
        """Under a plain square causal mask, the fitting tiles of least :func:`causal_cost` (the
        largest among equals); otherwise the largest.

        The kernel skips causal work only in whole blocks of 512 keys: a call of up to 512 tokens
        computes every score, the masked half too, while tiles of 256 skip the quarter above the
        diagonal. Smaller tiles cost calls and run the kernel's slower 32-row blocks. Measured (2-core CPU, float32, 16 x 512 tokens, causal, 8 heads, forward /
        backward, 2 threads): whole 83 / 199 ms, tiles of 256 73 / 164, tiles of 128 69 / 183.
        """
        first = next(fitting, None)
        rows = min(first[0], inp.Lq) if first is not None else 0
        if first is None or not _plain_square_causal(inp) or not 2 * _SMALLEST_COSTED_TILE <= rows < _COSTED_ROWS:
            return first
        others = list(itertools.takewhile(lambda p: p[0] >= _SMALLEST_COSTED_TILE, fitting))  # largest first
        return min([first, *others], key=lambda p: causal_cost(inp, p, backward))

    def _kernel_bytes(self, inp: Inputs, qc: int, kc: int) -> int:
        qs, ks = min(self._Q_SPLIT, qc), min(self._KV_SPLIT, kc)
        size, B, E, Ev = inp.itemsize, inp.B, inp.E, inp.Ev
        if emulated_half_kernel(inp):
            size = 4  # the kernel runs on float32 copies
        n = _threads() * (qs * ks * (4 + size) + qs * (Ev + 2) * 4)
        if size == 2:
            n += B * inp.Hk * kc * (E + Ev) * size  # packed K/V on CPUs that pack (half precision)
        # Inputs whose last dim is strided are copied per tile (the kernel needs unit stride).
        if E > 1 and _strided(inp.query):
            n += B * inp.Hq * qc * E * size
        for t in (inp.key, inp.value):
            if t.shape[-1] > 1 and _strided(t):
                n += B * inp.Hk * kc * t.shape[-1] * size
        return n

    def _bias_bytes(self, inp: Inputs, qc: int, kc: int, traced_tiles: int = 3, in_float32: bool = False) -> int:
        """The float bias tile fed to the kernel: a converted mask, generated masks, callback biases.

        A traced ``score_mod``'s bias counts ``traced_tiles`` full tiles: its intermediates are
        unknown, so the memory model assumes three; the planner's speed preference, one.
        ``in_float32``: the kernel runs on float32 copies, the bias's among them.
        """
        if inp.attn_mask is None and not inp.is_causal and inp.mask_mod is None and inp.score_mod is None:
            return 0
        parts = []  # elements of each part, in its own broadcast shape
        if inp.attn_mask is not None:
            parts.append(inp.mask_tile_elements(qc, kc))
        if inp.is_causal and _generated_causal(inp, qc, kc):
            parts.append(qc * kc)
        if inp.mask_mod is not None:
            parts.append(inp.B * inp.Hq * qc * kc)
        if inp.score_mod is not None:
            # A traced bias is the callback on a zero score tile: full (B, Hq, qc, kc), with its
            # intermediates; a built-in declares a (1, Hq, qc, kc) tile.
            traced = isinstance(inp.score_mod, TracedScoreMod)
            parts.append((traced_tiles * inp.B if traced else 1) * inp.Hq * qc * kc)
        mask_as_is = inp.attn_mask is not None and inp.attn_mask.dtype == inp.bias_dtype and not in_float32
        if not parts or (parts == [inp.mask_tile_elements(qc, kc)] and mask_as_is and not inp.is_causal):
            return 0  # no bias, or the caller's float mask passed through as a view
        size = torch.tensor([], dtype=inp.bias_dtype).element_size()
        n = sum(parts) * (size + 1)  # each part, its bool/-inf temporaries
        if len(parts) > 1:
            n += inp.B * inp.Hq * qc * kc * size  # their broadcast sum
        if inp.score_mod is not None:
            n += 2 * qc * kc * 8  # int64 distances of the index grids
        if in_float32 and size < 4:
            n += (inp.B * inp.Hq * qc * kc if len(parts) > 1 else parts[0]) * 4
        if inp.attn_mask is not None or inp.is_causal or inp.mask_mod is not None:
            # The empty-row check: the rows' maximum, or (diagonal tiles) visibility in blocks of rows.
            n += min(max(parts), EMPTY_CHECK_ELEMENTS) * 2 + inp.B * inp.Hq * qc * 8 * 2
        return n

    def tile_bytes(self, inp: Inputs, qc: int, kc: int) -> int:
        return self._bias_bytes(inp, min(qc, max(inp.Lq, 1)), min(kc, max(inp.Lk, 1)), traced_tiles=1)

    def tile_pairs(self, inp: Inputs) -> List[Tuple[int, int]]:
        if inp.mask_kind != "bool" and not inp.has_callbacks and not inp.is_causal:
            # The kernel tiles internally; key segments only cost calls. Whole key rows always.
            return [(qc, max(inp.Lk, 1)) for qc in candidates(inp.Lq)]
        return super().tile_pairs(inp)

    def forward_bytes(self, inp: Inputs, qc: int, kc: int, need_lse: bool) -> int:
        qc, kc = min(qc, max(inp.Lq, 1)), min(kc, max(inp.Lk, 1))
        bh, st = _bh(inp), inp.stats_itemsize
        n = self._kernel_bytes(inp, qc, kc) + self._bias_bytes(inp, qc, kc, in_float32=emulated_half_kernel(inp))
        n += bh * qc * 4 * 2  # the kernel's lse rows and their masked copy
        if emulated_half_kernel(inp):  # float32 copies of the rows, keys and values; float32 output
            n += (bh * qc * (inp.E + inp.Ev) + inp.B * inp.Hk * kc * (inp.E + inp.Ev)) * 4
        if qc < inp.Lq:
            n += bh * qc * inp.Ev * inp.itemsize  # the block's output before it is copied into place
        split_rows = kc < inp.Lk and (
            inp.has_callbacks or inp.is_causal or (inp.attn_mask is not None and inp.attn_mask.dtype != inp.dtype)
        )
        if split_rows or (inp.is_causal and qc < inp.Lq):
            n += bh * qc * (inp.Ev * st * 2 + 4 * st)  # lse merge: accumulator and a weighted copy
        if need_lse:
            n += inp.lse_bytes()
        if qc >= inp.Lq and kc >= inp.Lk and grouped_call(inp):  # it may run as grouped matmuls
            n = max(n, grouped_bytes(inp.B * inp.Hq * inp.Lq * inp.Lk, inp.itemsize) + inp.lse_bytes())
        return n + 256 * 1024

    def backward_bytes(self, inp: Inputs, qc: int, kc: int, opts: Options) -> int:
        qc, kc = min(qc, max(inp.Lq, 1)), min(kc, max(inp.Lk, 1))
        bh = _bh(inp)
        n = self._kernel_bytes(inp, qc, kc) * 2 + self._bias_bytes(inp, qc, kc, in_float32=_tiles_in_float32(inp))
        n += bh * qc * 4  # lse rows
        # The kernel returns dQ, dK, dV for its tile (float32 accumulators inside for half inputs).
        n += (bh * qc * inp.E + inp.B * inp.Hk * kc * (inp.E + inp.Ev)) * (inp.itemsize + 4)
        if _tiles_in_float32(inp):
            # float32 copies of the rows, the keys and values, dO and O; float32 results.
            n += (bh * qc * (inp.E + 2 * inp.Ev) + inp.B * inp.Hk * kc * (inp.E + inp.Ev)) * 4
            n += (bh * qc * inp.E + inp.B * inp.Hk * kc * (inp.E + inp.Ev)) * (4 - inp.itemsize)
        return n + 256 * 1024

    @staticmethod
    def causal_in_kernel(inp: Inputs, seg: Segment) -> bool:
        # The kernel's own causal flag is top-left within the tile (a diagonal tile). Without a
        # positive scale it returns NaN (it scales the masked -inf scores), so the mask goes into
        # the bias then.
        return seg.causal == "diag" and inp.positive_scale

    def bias(self, inp: Inputs, qs: int, qe: int, seg: Segment) -> Optional[Tensor]:
        """The tile's float bias for the kernel (masks, generated causal part, additive ``score_mod``)."""
        dtype = inp.bias_dtype
        bias = tile_bias(inp, qs, qe, seg, dtype, causal_in_kernel=self.causal_in_kernel(inp, seg))
        if inp.score_mod is not None:
            # a traced or built-in additive score_mod: an optional attribute, so not on ScoreMod's type
            add = getattr(inp.score_mod, "additive_bias")  # noqa: B009
            b, h, qi, ki = index_grids(inp, qs, qe, seg.ks, seg.ke)
            extra = call_user(add, b, h, qi, ki).to(dtype)
            bias = extra if bias is None else bias + extra
        return bias

    @staticmethod
    def _may_mask(inp: Inputs, seg: Segment) -> bool:
        # An additive score_mod without -inf never masks a whole row: no empty-row check then.
        return (
            inp.attn_mask is not None
            or seg.causal != "none"
            or seg.needs_mask_mod
            or bool(getattr(inp.score_mod, "may_mask", False))
        )

    def _segment(self, inp: Inputs, qs: int, qe: int, seg: Segment) -> Tuple[Tensor, Tensor]:
        fwd, _ = _cpu_flash_ops()
        assert fwd is not None
        causal = self.causal_in_kernel(inp, seg)
        bias = self.bias(inp, qs, qe, seg)
        in_float32 = emulated_half_kernel(inp)
        q, k, v = _operands(in_float32, inp.q[:, :, qs:qe], inp.k[:, :, seg.ks : seg.ke], inp.v[:, :, seg.ks : seg.ke])
        mask = _as_kernel_mask(bias)
        if in_float32 and mask is not None and mask.is_floating_point():
            mask = mask.float()
        o_t, lse_t = call_kernel(fwd, q, k, v, 0.0, causal, attn_mask=mask, scale=inp.scale)
        if in_float32:
            o_t = o_t.to(inp.dtype)
        if bias is not None and self._may_mask(inp, seg):
            empty = empty_rows(bias, causal, qe - qs)
            if bool(empty.any()):
                # Rows without a visible key weigh nothing in the merge, and give output 0.
                lse_t = lse_t.masked_fill(empty, NEG_INF)
                o_t = o_t.masked_fill(empty.unsqueeze(-1), 0.0)
        return o_t, lse_t

    def sequence_forward(self, inp: Inputs, rows: Tuple[int, int, int, int], causal: bool) -> Tuple[Tensor, Tensor]:
        """``(out, lse)`` of one packed sequence (query rows ``[qs, qe)``, keys ``[ks, ke)``) as one
        kernel call, causal top-left or not, without a mask: what its single tile computes
        through :meth:`forward_rows`, less the planning of a call per sequence."""
        fwd, _ = _cpu_flash_ops()
        assert fwd is not None
        qs, qe, ks, ke = rows
        in_float32 = emulated_half_kernel(inp)
        q, k, v = _operands(in_float32, inp.q[:, :, qs:qe], inp.k[:, :, ks:ke], inp.v[:, :, ks:ke])
        out, lse = call_kernel(fwd, q, k, v, 0.0, causal, attn_mask=None, scale=inp.scale)
        return (out.to(inp.dtype) if in_float32 else out), lse

    def sequence_backward(
        self, inp: Inputs, rows: Tuple[int, int, int, int], causal: bool, grad_out: Tensor, out: Tensor, lse: Tensor
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """``(dQ, dK, dV)`` of one packed sequence as one kernel call (see :meth:`sequence_forward`)."""
        qs, qe, ks, ke = rows
        return self._backward_kernel(
            inp,
            (grad_out[:, :, qs:qe], inp.q[:, :, qs:qe], inp.k[:, :, ks:ke], inp.v[:, :, ks:ke], out[:, :, qs:qe]),
            lse[:, :, qs:qe],
            causal,
            None,
            _tiles_in_float32(inp),
        )

    def notes(self, inp: Inputs) -> List[str]:
        if grouped_call(inp) and not inp.requires_grad:
            return ["grouped query heads, few scores: two grouped matmuls, not the kernel, when the whole call fits"]
        return []

    def runs_grouped(self, inp: Inputs, tiles: Optional[Tuple[int, int]], budget: int) -> bool:
        whole = tiles is None or (tiles[0] >= inp.Lq and tiles[1] >= inp.Lk)
        scores = inp.B * inp.Hq * inp.Lq * inp.Lk
        return whole and grouped_call(inp) and grouped_bytes(scores, inp.itemsize) <= budget

    def run_whole(self, inp: Inputs, need_lse: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
        """``(out, lse)`` of one kernel call on the whole input: no mask, causal top-left (the fast path)."""
        fwd, _ = _cpu_flash_ops()
        assert fwd is not None
        in_float32 = emulated_half_kernel(inp)
        q, k, v = _operands(in_float32, inp.q, inp.k, inp.v)
        out, lse = call_kernel(fwd, q, k, v, 0.0, inp.is_causal, attn_mask=None, scale=inp.scale)
        return (out.to(inp.dtype) if in_float32 else out), lse

    def forward_rows(
        self, inp: Inputs, qs: int, qe: int, segments: Iterable[Segment], out: Optional[Tensor], seed: int
    ) -> Tuple[Tensor, Tensor]:
        """Returns ``(rows_out, lse)``; ``rows_out`` is also written into ``out`` when one is given."""
        sdt = inp.stats_dtype
        first: Optional[Tuple[Tensor, Tensor]] = None
        acc: Optional[Tensor] = None
        lse = torch.empty(0)
        for seg in segments:
            o_t, lse_t = self._segment(inp, qs, qe, seg)
            if first is None:
                first = (o_t, lse_t)
                continue
            if acc is None:
                acc, lse = first[0].to(sdt), first[1].to(sdt)
            # Exact merge of two partial softmaxes over disjoint keys.
            lse_t = lse_t.to(sdt)
            lse_new = torch.logaddexp(lse, lse_t)
            lse_ref = lse_new.masked_fill(lse_new == NEG_INF, 0.0)
            acc.mul_(torch.exp(lse - lse_ref).unsqueeze(-1))
            acc.add_(o_t.to(sdt).mul_(torch.exp(lse_t - lse_ref).unsqueeze(-1)))
            lse = lse_new
        assert first is not None, "forward_rows needs at least one segment"
        rows, lse = (first[0], first[1]) if acc is None else (acc, lse)
        if out is not None:
            out[:, :, qs:qe].copy_(rows)
        return rows, lse

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
        grads: Grads,
        grad_lse: Optional[Tensor] = None,
    ) -> None:
        """The fused CPU backward per segment, fed the *global* out and lse of these rows."""
        if grad_lse is not None:
            raise NotImplementedError("the fused CPU backward cannot take a gradient of the lse; use the matmul kernel")
        for seg in segments:
            gq, gk, gv = self.segment_backward(inp, qs, qe, seg, grad_out, out, lse, _tiles_in_float32(inp))
            if grads.dq is not None:
                add_into(grads.dq[:, :, qs:qe], gq)
            if grads.dk is not None:
                add_into(grads.dk[:, :, seg.ks : seg.ke], gk)
            if grads.dv is not None:
                add_into(grads.dv[:, :, seg.ks : seg.ke], gv)
            del gq, gk, gv  # not alive while the next segment's kernel allocates its own

    def segment_backward(
        self,
        inp: Inputs,
        qs: int,
        qe: int,
        seg: Segment,
        grad_out: Tensor,
        out: Tensor,
        lse: Tensor,
        in_float32: bool = False,
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """dQ of rows ``[qs, qe)`` and dK, dV of keys ``[ks, ke)`` from this segment alone (batch ``B``).

        ``in_float32``: run the kernel on float32 copies of half-precision tiles, so that its
        partial gradients, summed over the call's tiles, are rounded once at the end (the
        kernel rounds what it returns to its inputs' dtype).
        """
        keys = slice(seg.ks, seg.ke)
        return self._backward_kernel(
            inp,
            (grad_out[:, :, qs:qe], inp.q[:, :, qs:qe], inp.k[:, :, keys], inp.v[:, :, keys], out[:, :, qs:qe]),
            lse[:, :, qs:qe],
            self.causal_in_kernel(inp, seg),
            _as_kernel_mask(self.bias(inp, qs, qe, seg)),
            in_float32,
        )

    @staticmethod
    def _backward_kernel(
        inp: Inputs,
        tiles: Tuple[Tensor, Tensor, Tensor, Tensor, Tensor],
        lse: Tensor,
        causal: bool,
        mask: Optional[Tensor],
        in_float32: bool,
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """The backward kernel on ``tiles`` = (dO, Q, K, V, O) of one tile and its rows' ``lse``."""
        _, bwd = _cpu_flash_ops()
        assert bwd is not None
        # The kernel's own convention for fully masked rows is lse = 0 (their P is 0 either way).
        lse_t = lse.masked_fill(lse == NEG_INF, 0.0).to(torch.float64 if inp.dtype == torch.float64 else torch.float32)
        if in_float32 and mask is not None and mask.is_floating_point():
            mask = mask.float()
        do, q, k, v, o = _operands(in_float32, *tiles)
        return call_kernel(bwd, do, q, k, v, o, lse_t, 0.0, causal, attn_mask=mask, scale=inp.scale)


def _tiles_in_float32(inp: Inputs) -> bool:
    """Whether a tiled fused backward runs its kernel on float32 copies: float16 inputs, and
    bfloat16 on CPUs without native bfloat16 products. Each tile's gradients would otherwise be
    rounded to half precision before they are summed (flash-attn's fp16 criterion, gradients
    within 3x PyTorch's error, failed by one ulp of dV); on those CPUs the kernel converts to
    float32 inside anyway (its float16 forward ran 1.7x its float32 one on the 2-core CPU)."""
    if inp.dtype == torch.float16:
        return True
    return inp.dtype == torch.bfloat16 and not native_bf16_products()


def emulated_half_kernel(inp: Inputs) -> bool:
    """Whether the CPU flash kernel would run this call's float16 GEMMs emulated (no AVX512-FP16,
    AMX-FP16 or Arm FP16: :func:`native_fp16_products`); its kernels then run on float32 copies.
    1x4x2048x64 on the 2-core CPU: the float16 backward took 650 ms, on float32 copies 75 ms
    (the float32 one 74); torch's SDPA, fp16 forward and backward, 770 ms."""
    return inp.dtype == torch.float16 and inp.device_type == "cpu" and not native_fp16_products()


GROUPED_SCORES = 1 << 18
"""Grouped-query calls with at most this many scores (decode steps: 32 query heads on 8 key heads
against 8192 keys) run as two grouped matmuls (:func:`grouped_attention`)."""


def grouped_call(inp: Inputs) -> bool:
    """Whether this call, run whole without gradients, is :func:`grouped_attention`'s: grouped
    query heads, no mask, callbacks or dropout, one batch group (:func:`groupable`)."""
    if inp.G == 1 or inp.attn_mask is not None or inp.has_callbacks or inp.dropout_p > 0:
        return False
    if inp.packed is not None or inp.n_groups > 1 or inp.empty or inp.Lk == 0:
        return False
    return groupable(inp.dtype, inp.is_causal, inp.B * inp.Hq * inp.Lq * inp.Lk)


def groupable(dtype: torch.dtype, is_causal: bool, scores: int) -> bool:
    """Whether a grouped-query call without mask or callbacks runs as :func:`grouped_attention`:
    not causal, float32 or float64 (half-precision products would be rounded), few scores."""
    return not is_causal and dtype in (torch.float32, torch.float64) and scores <= GROUPED_SCORES


def grouped_bytes(scores: int, itemsize: int) -> int:
    """The extra memory of :func:`grouped_attention`: its scores and their softmax."""
    return 2 * scores * itemsize + 64 * 1024


def grouped_attention(
    query: Tensor, key: Tensor, value: Tensor, scale: float, need_lse: bool
) -> Tuple[Tensor, Optional[Tensor]]:
    """A grouped-query call as two matmuls: the query heads that share a key head are the rows of
    one product, ``(B, Hk, G*Lq, E) @ (B, Hk, E, Lk)``, then softmax and ``@ v``; ``(out, lse)``.

    The fused CPU kernel (and torch's SDPA, which runs it) takes each query head on its own, one
    row against all keys: a decode step (1x32x1x128 on 8 key heads of 512) ran 441-467 us there
    and 288-311 us as two grouped matmuls, on one thread. The scores are materialized (at most
    :data:`GROUPED_SCORES`).
    """
    B, Hq, Lq, E = query.shape
    Hk = key.shape[1]
    s = torch.matmul(query.reshape(B, Hk, (Hq // Hk) * Lq, E), key.transpose(-1, -2)).mul_(scale)
    lse = torch.logsumexp(s, dim=-1).view(B, Hq, Lq) if need_lse else None
    out = torch.matmul(torch.softmax(s, dim=-1), value).view(B, Hq, Lq, value.shape[-1])
    return out, lse
