"""A ``matmul`` tile's softmax work on CUDA in one Triton kernel per tile, forward and backward.

On a GPU the tiles' products run on the tensor cores in microseconds; what costs is the eager
float32 passes between them, each a full read and write of the tile through HBM. Half-precision
forward, bytes per score: the product's float32 result (4), ``amax`` (4), ``s - m`` (8), ``exp2``
(8), ``sum`` (4), ``p`` rounded into a half buffer (6), its product with v (2): 36. The kernel
here reads the scores twice (a row's maximum, then its exponentials; the second read mostly from
the L2 cache; a row of at most one step, 1024 scores, once) and writes ``p`` once in half
precision: 4 + 4 + 2, and the product's 4 and 2 around it. It also does the row's bookkeeping
(the running maximum, the sum and the accumulator's correction), about ten small eager ops per
tile. Measured against a plain float32-to-half copy of the tile, and the backward's kernel
against the memory bandwidth, on docs/benchmarks/gpu.md.

Backward, per tile: ``p = exp(s - lse)`` and ``dS = p ∘ (dP - D)`` in one pass that reads the
scores and ``dP`` and writes ``p`` and the scaled ``dS`` rounded for their products (or ``dS``
in float32 where a ``score_mod`` or a float mask's gradient still needs it: then the eager code
pulls it back and rounds it), in place of about eight eager passes.

Which calls: half-precision tiles on CUDA that take widening products
(:func:`~subquad._backends.products.widening_products`), without dropout, where Triton imports
(it ships with CUDA builds of PyTorch). ``SUBQUAD_TRITON=0`` turns the kernels off (the eager
passes then run). The ``score_mod`` and the tile's bias run eagerly on the scores before the
kernel. Everything stays as the eager passes compute it: float32 statistics, ``p`` and ``dS``
rounded once. The kernels run in Triton's interpreter on a CPU for the tests
(``TRITON_INTERPRET=1``; tests/test_triton_passes.py).
"""

from __future__ import annotations

import functools
import importlib.util
import types
from typing import Any, Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from .. import _settings as settings
from .._inputs import Inputs

_COLS_BLOCK = 1024
"""Scores per step of a row (a power of two); a row of any length runs in steps of this."""


def enabled(inp: Inputs) -> bool:
    """Whether this call's tiles run their softmax passes in the Triton kernels (not on fake or
    meta tensors, which have no memory to launch a kernel on)."""
    if inp.device.type != "cuda" or inp.dropout_p > 0.0 or is_fake(inp.query):
        return False
    return available()


def available() -> bool:
    """Whether the kernels can run: a CUDA device, Triton imports and ``SUBQUAD_TRITON`` is not
    ``0``."""
    return settings.switch("SUBQUAD_TRITON") and torch.cuda.is_available() and _kernels() is not None


@functools.lru_cache(maxsize=None)
def _kernels() -> Optional[Any]:
    """The compiled kernels' module, or None where Triton cannot be imported."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return _build()
    except ImportError:
        return None


def softmax_rows(
    s: Tensor, p: Tensor, m: Tensor, l: Tensor, acc: Tensor, unit: float, *, cols: int = 0, warps: int = 0
) -> None:
    """One tile of the online softmax, in place: ``m`` becomes ``max(m, rowmax(s))``, ``p`` (half)
    ``2^((s - m)·unit)`` with ``m`` taken as 0 on rows that see nothing, and ``l`` and ``acc`` are
    multiplied by ``2^((m_old - m)·unit)``, ``l`` plus the rows' sums of ``p`` (before rounding).

    ``s``, ``p``: ``(R, n)`` as ``(..., n)``; ``m``, ``l``: ``R``; ``acc``: ``(R, Ev)``; all contiguous.
    ``unit``: 1 for scores in log2 units, log2 e for natural ones. ``cols``, ``warps``: the
    kernel's step and warps, for tuning (0: :data:`_COLS_BLOCK`-based defaults); a row that fits
    in one step is read once, longer rows twice.
    """
    kernels = _kernels()
    assert kernels is not None
    n = s.shape[-1]
    rows = m.numel()
    ev = acc.shape[-1]
    step = cols or _cols_block(n)
    kernels.softmax_rows[(rows,)](
        s, p, m, l, acc, n, ev, float(unit), COLS=step, EV=_pow2(ev), SINGLE=n <= step, num_warps=warps or _warps(n)
    )  # fmt: skip


def softmax_grad_rows(
    s: Tensor, dp: Tensor, p: Tensor, ds: Tensor, lse: Tensor, d: Tensor, scale: float, unit: float,
    *, cols: int = 0, warps: int = 0,
) -> None:  # fmt: skip
    """One backward tile's ``p = 2^((s - lse)·unit)`` and ``dS = p ∘ (dP - D)``: ``p`` written
    into ``p`` (half); ``dS`` into ``ds``, times ``scale`` when ``ds`` is half precision, as it is
    when ``ds`` is float32 (it may be ``dp`` itself: each entry is read before it is written).

    ``s``, ``dp``, ``p``, ``ds``: ``(R, n)`` as ``(..., n)``; ``lse``, ``d``: ``R`` (``lse`` 0 on
    rows that see nothing); all contiguous.
    """
    kernels = _kernels()
    assert kernels is not None
    n = s.shape[-1]
    rows = lse.numel()
    half_ds = ds.dtype != torch.float32
    kernels.softmax_grad_rows[(rows,)](
        s, dp, p, ds, lse, d, n, float(scale if half_ds else 1.0), float(unit),
        COLS=cols or _cols_block(n), num_warps=warps or _warps(n),
    )  # fmt: skip


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cols_block(n: int) -> int:
    return min(_COLS_BLOCK, max(16, _pow2(n)))


def _warps(n: int) -> int:
    # Warps per row length as tuned on a GPU (docs/benchmarks/gpu.md): 8 from rows of 4096 scores,
    # 4 from 512, forward and backward alike.
    return 8 if n >= 4096 else 4 if n >= 512 else 2


def _build() -> Any:
    """Defines the kernels (Triton imported here, on the first call that needs them)."""
    import triton
    import triton.language as tl

    @triton.jit
    def softmax_rows(S, P, M, L, ACC, n, ev, unit, COLS: tl.constexpr, EV: tl.constexpr, SINGLE: tl.constexpr):  # type: ignore[no-untyped-def]
        row = tl.program_id(0).to(tl.int64)
        s_row = S + row * n
        p_row = P + row * n
        m_old = tl.load(M + row)
        if SINGLE:  # the row in registers: read once
            cols = tl.arange(0, COLS)
            x = tl.load(s_row + cols, mask=cols < n, other=float("-inf"))
            m_new = tl.maximum(m_old, tl.max(x, 0))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            e = tl.exp2((x - m_ref) * unit)
            tl.store(p_row + cols, e.to(P.dtype.element_ty), mask=cols < n)
            total = e
        else:  # a row's maximum, then its exponentials (the second read mostly from L2)
            top = tl.full([COLS], float("-inf"), tl.float32)
            for start in range(0, n, COLS):
                cols = start + tl.arange(0, COLS)
                x = tl.load(s_row + cols, mask=cols < n, other=float("-inf"))
                top = tl.maximum(top, x)
            m_new = tl.maximum(m_old, tl.max(top, 0))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            total = tl.zeros([COLS], tl.float32)
            for start in range(0, n, COLS):
                cols = start + tl.arange(0, COLS)
                x = tl.load(s_row + cols, mask=cols < n, other=float("-inf"))
                e = tl.exp2((x - m_ref) * unit)
                total += e
                tl.store(p_row + cols, e.to(P.dtype.element_ty), mask=cols < n)
        correction = tl.exp2((m_old - m_ref) * unit)
        tl.store(L + row, tl.load(L + row) * correction + tl.sum(total, 0))
        tl.store(M + row, m_new)
        for start in range(0, ev, EV):
            ecols = start + tl.arange(0, EV)  # not `cols`: a name live before a loop keeps its shape in it
            a = tl.load(ACC + row * ev + ecols, mask=ecols < ev, other=0.0)
            tl.store(ACC + row * ev + ecols, a * correction, mask=ecols < ev)

    @triton.jit
    def softmax_grad_rows(S, DP, P, DS, LSE, D, n, scale, unit, COLS: tl.constexpr):  # type: ignore[no-untyped-def]
        row = tl.program_id(0).to(tl.int64)
        lse = tl.load(LSE + row)
        d = tl.load(D + row)
        for start in range(0, n, COLS):
            cols = start + tl.arange(0, COLS)
            keep = cols < n
            x = tl.load(S + row * n + cols, mask=keep, other=float("-inf"))
            dp = tl.load(DP + row * n + cols, mask=keep, other=0.0)
            p = tl.exp2((x - lse) * unit)
            tl.store(P + row * n + cols, p.to(P.dtype.element_ty), mask=keep)
            tl.store(DS + row * n + cols, (p * (dp - d) * scale).to(DS.dtype.element_ty), mask=keep)

    return types.SimpleNamespace(softmax_rows=softmax_rows, softmax_grad_rows=softmax_grad_rows)
