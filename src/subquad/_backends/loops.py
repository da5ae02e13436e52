"""The ``loops`` backend: the native kernel's C++ loops (:mod:`~subquad._backends.segments`).

The ``matmul`` tiles' algorithm with each row block's whole loop over keys in one C++ call, on a CPU
where ``subquad build`` built the kernel: no tile of scores is ever held, the products run on the
loops' own micro-kernels or on ATen's (:mod:`~subquad._backends.calibration`), and the built-in
callbacks (soft cap, ALiBi, causal bands and windows, documents, prefix-LM, key padding) are
evaluated inside the loops. What they refuse is :func:`~subquad._backends.loop_choice.refusal`;
where ``auto`` asks them (before the fused kernel or after it) is this CPU's calibration, in
:func:`~subquad._backends.dispatch.call_priority`.

Their memory model is the loops' own: a row block's accumulator and each thread's buffers
(:func:`~subquad._backends.segments.tile_bytes`), the keys and values laid out for the products
(:func:`~subquad._backends.segments.segment_bytes`), and the backward's blocks
(:func:`~subquad._backends.segments.backward_bytes`).
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional

from torch import Tensor

from .._inputs import Inputs
from .._tiles import Grads, Segment
from . import loop_choice, segments
from .base import Options, _bh, _grad_accum_bytes
from .matmul import Matmul


class Loops(Matmul):
    """The tiles' whole loops in C++ (CPU, the native kernel built): ``matmul``'s tiles without a
    tile of scores. A call whose backward the loops do not take has it on ``matmul``'s tiles (with
    ``auto``, a packed call's on the fused kernel where it takes it)."""

    name = "loops"
    devices = ("cpu",)

    def not_supported_reasons(self, inp: Inputs, opts: Options) -> List[str]:
        reasons = super().not_supported_reasons(inp, opts)
        if reasons:
            return reasons
        refused = loop_choice.refusal(inp, False)  # a backward they do not take runs on matmul's tiles
        return [] if refused is None else [refused]

    def backward_backend(self, inp: Inputs, opts: Options) -> str:
        if opts.packed:  # per sequence: the backward loop where it takes one, else matmul's tiles
            return self.name
        return self.name if segments.backward_kernel(inp) is not None else "matmul"

    # ------------------------------------------------------------- memory model and tiles
    def tile_target(self, inp: Inputs) -> int:
        if self._runs(inp) is None:
            return super().tile_target(inp)
        return segments.TILE_TARGET  # no tile of scores: a row block's accumulator and buffers

    def tile_bytes_of(self, inp: Inputs) -> Callable[[int, int], int]:
        lq, lk = max(inp.Lq, 1), max(inp.Lk, 1)
        if self._runs(inp) is None:
            return super().tile_bytes_of(inp)
        if inp.requires_grad:  # both passes in C++
            return lambda qc, kc: segments.backward_tile_bytes(inp, min(qc, lq), min(kc, lk))
        return lambda qc, kc: segments.tile_bytes(inp, min(qc, lq), min(kc, lk))

    def forward_bytes(self, inp: Inputs, qc: int, kc: int, need_lse: bool) -> int:
        if segments.segment_kernel(inp) is None:
            return super().forward_bytes(inp, qc, kc, need_lse)
        qc, kc = min(qc, max(inp.Lq, 1)), min(kc, max(inp.Lk, 1))
        lse = inp.lse_bytes() if need_lse else 0
        rows = _bh(inp) * qc * (2 * inp.Ev + 4) * inp.stats_itemsize  # acc, m, l and the result's rows
        return int((rows + segments.segment_bytes(inp, qc, kc) + lse) * 1.15) + (1 << 18)

    def backward_bytes(self, inp: Inputs, qc: int, kc: int, opts: Options) -> int:
        if segments.backward_kernel(inp) is None:
            return super().backward_bytes(inp, qc, kc, opts)
        qc, kc = min(qc, max(inp.Lq, 1)), min(kc, max(inp.Lk, 1))
        return int(segments.backward_bytes(inp, qc, kc) * 1.15) + _grad_accum_bytes(inp) + 256 * 1024

    @staticmethod
    def _runs(inp: Inputs) -> Optional[object]:
        """The kernel whose loop runs the call's pass the tiles are planned for (the backward's
        where gradients are needed), or None."""
        return segments.backward_kernel(inp) if inp.requires_grad else segments.segment_kernel(inp)

    # ------------------------------------------------------------- compute
    def forward_rows(
        self, inp: Inputs, qs: int, qe: int, segs: Iterable[Segment], out: Optional[Tensor], seed: int
    ) -> Tensor:
        kernel = segments.segment_kernel(inp)
        if kernel is None or out is None:  # a packed call's sequence the loop does not take
            return super().forward_rows(inp, qs, qe, segs, out, seed)
        return segments.forward_rows(inp, qs, qe, segs, out, kernel)

    def backward_rows(
        self,
        inp: Inputs,
        qs: int,
        qe: int,
        segs: Iterable[Segment],
        grad_out: Tensor,
        out: Tensor,
        lse: Tensor,
        seed: int,
        grads: Grads,
        grad_lse: Optional[Tensor] = None,
    ) -> None:
        kernel = segments.backward_kernel(inp)
        if kernel is None:
            return super().backward_rows(inp, qs, qe, segs, grad_out, out, lse, seed, grads, grad_lse)
        segments.backward_rows(inp, qs, qe, segs, grad_out, out, lse, grads, grad_lse, kernel)
