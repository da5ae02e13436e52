"""What a path is: a way to run an attention call, described as data (xformers' ``fmha`` ops).

Each path is one class in one module: what it supports (:meth:`Backend.not_supported_reasons`,
sentences the planner shows), its memory model (the extra bytes of a call for a tile size) and
its compute. Adding a path means adding its module and naming it in :mod:`subquad._paths`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

import torch
from torch import Tensor

from .._inputs import Inputs
from .._tiles import Grads, Segment


@dataclass(frozen=True)
class Options:
    """The call's options that are not part of :class:`Inputs`."""

    return_lse: bool = False
    chunk_size: Optional[Tuple[int, int]] = None
    captured_requires_grad: bool = False
    allow_compile: bool = True


def _threads() -> int:
    return max(1, torch.get_num_threads())


class Backend:
    """A path that can run an attention call. Subclasses describe themselves as data."""

    name = ""
    tiled = True
    devices: Tuple[str, ...] = ()
    returns_rows = False
    """Whether :meth:`forward_rows` returns the rows' output (one block: used as the result, no copy)."""

    def not_supported_reasons(self, inp: Inputs, opts: Options) -> List[str]:
        reasons = []
        if self.devices and inp.device.type not in self.devices:
            reasons.append(f"runs on {'/'.join(self.devices)} only, the tensors are on {inp.device.type}")
        return reasons

    def forward_bytes(self, inp: Inputs, qc: int, kc: int, need_lse: bool) -> int:
        raise NotImplementedError

    def backward_bytes(self, inp: Inputs, qc: int, kc: int, opts: Options) -> int:
        raise NotImplementedError

    def backward_kernel(self, inp: Inputs, opts: Options) -> str:
        return self.name

    def tile_bytes(self, inp: Inputs, qc: int, kc: int) -> int:
        """What one tile materializes (scores, generated masks): the planner's speed heuristic."""
        return 0

    # ------------------------------------------------------------- compute (tiled paths)
    def forward_rows(
        self, inp: Inputs, qs: int, qe: int, segments: Iterable[Segment], out: Optional[Tensor], seed: int
    ) -> object:
        """Attention of rows ``[qs, qe)`` over ``segments``: writes ``out[:, :, qs:qe]``, returns the lse."""
        raise NotImplementedError

    def backward_rows(
        self, inp: Inputs, qs: int, qe: int, segments: Iterable[Segment], grad_out: Tensor, out: Tensor,
        lse: Tensor, seed: int, grads: Grads, grad_lse: Optional[Tensor] = None,
    ) -> None:
        """Accumulate the gradients of rows ``[qs, qe)`` over ``segments`` into ``grads``."""
        raise NotImplementedError


def _bh(inp: Inputs) -> int:
    return inp.B * inp.Hq


def _strided(t: Tensor) -> bool:
    """Whether the last dim of ``t`` is not contiguous (a transformed tensor has no strides to read)."""
    try:
        return t.stride(-1) != 1
    except RuntimeError:
        return False


def _generated_causal(inp: Inputs, qc: int, kc: int) -> bool:
    """Whether some tile of these sizes needs a generated causal mask (not the kernel's own flag).

    The kernel's flag is top-left within a tile: square tiles aligned with the diagonal use it.
    It returns NaN with ``scale <= 0``, so then every partly visible tile gets a generated mask.
    """
    if inp.scale <= 0:
        return True
    qc, kc = min(qc, max(inp.Lq, 1)), min(kc, max(inp.Lk, 1))
    off = inp.causal_offset
    if qc >= inp.Lq and kc >= inp.Lk:
        return not (off == 0 or off >= inp.Lk - 1)  # one tile: the kernel's flag, or no mask at all
    return not (qc == kc and off % kc == 0)


def _grad_accum_bytes(inp: Inputs) -> int:
    # Half-precision gradients are accumulated across tiles in float32, then cast.
    if inp.dtype in (torch.float16, torch.bfloat16):
        q = inp.B * inp.Hq * inp.Lq * inp.E
        kv = inp.B * inp.Hk * inp.Lk * (inp.E + inp.Ev)
        return (q + kv) * (4 + inp.itemsize)
    return 0
