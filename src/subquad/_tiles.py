"""What every tiled backend shares: key segments, row state, gradient accumulators, generated masks.

A tile is a block of query rows ``[qs, qe)`` against a key segment ``[ks, ke)``. Backends compute
tiles (:mod:`subquad._backends`); the engine (:mod:`subquad._engine`) decides which tiles exist
and counts them (:data:`TILES`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Tuple, TypeVar

import torch
from torch import Tensor

from ._callbacks import eval_mask_mod, from_callback, index_grids
from ._inputs import Inputs

_R = TypeVar("_R")
NEG_INF = float("-inf")


class TileCounter:
    """Counts computed and skipped tiles; tests use it to check block skipping."""

    def __init__(self) -> None:
        self.computed = 0
        self.skipped = 0

    def reset(self) -> None:
        self.computed = 0
        self.skipped = 0


TILES = TileCounter()


class KernelRefused(RuntimeError):
    """A fused kernel refused an input the planner expected it to take (its message is the kernel's)."""


def is_oom(e: BaseException) -> bool:
    """A real allocator out-of-memory error (not one raised by a user callback)."""
    if from_callback(e):
        return False
    if isinstance(e, MemoryError) and type(e).__name__ != "MemoryBudgetError":
        return True
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(e, oom_type):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and any(text in msg for text in _OOM_TEXTS)


_OOM_TEXTS = (
    "out of memory",  # CUDA's and MPS's allocators ("MPS backend out of memory")
    "can't allocate memory",  # CPU
    "not enough memory",
    "invalid buffer size",  # MPS: one buffer larger than Metal allows
    "failed to allocate",
)


def is_device_fatal(e: BaseException) -> bool:
    """An error of the device itself (a faulting kernel, a lost context), not of one kernel's
    choice: CUDA's errors stick to the context, so every later call fails too. Retrying on
    other kernels would hide the first fault behind later, less clear ones: re-raise it."""
    if from_callback(e) or is_oom(e):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)  # CUDA errors, from torch 2.8
    if accelerator_error is not None and isinstance(e, accelerator_error):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and any(text in msg for text in _DEVICE_FATAL_TEXTS)


_DEVICE_FATAL_TEXTS = (
    "cuda error",  # every failed CUDA runtime call: "CUDA error: an illegal memory access ..."
    "cuda kernel errors might be asynchronously reported",
    "device-side assert",
    "illegal memory access",
    "unspecified launch failure",
    "cublas_status_execution_failed",
    "command buffer exited with error status",  # MPS: a Metal command buffer that faulted
)


def call_kernel(fn: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
    """A private fused kernel; its refusals (not out-of-memory or device errors) become :class:`KernelRefused`."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        if is_oom(e) or is_device_fatal(e):
            raise
        raise KernelRefused(str(e)) from e


class Segment(NamedTuple):
    """A run of keys ``[ks, ke)`` for one block of query rows ``[qs, qe)``.

    ``causal``: ``"none"`` (no key is in the future of any query row), ``"diag"`` (``ks == qs``: the
    top-left causal mask of the tile is the global one) or ``"partial"`` (needs a generated mask).
    ``needs_mask_mod``: whether ``mask_mod`` must be evaluated on this tile (False when the tile is
    known to be fully visible).
    """

    ks: int
    ke: int
    causal: str = "none"
    needs_mask_mod: bool = False
    keep: Optional[Tensor] = None  # mask_mod already evaluated on this tile, if it was


class RowState(NamedTuple):
    """Online-softmax state of a block of query rows, updated in place tile by tile."""

    m: Tensor  # running max of the scores, (BHk, G*qn)
    l: Tensor  # running sum of exp(score - m)
    acc: Tensor  # running sum of exp(score - m) @ V, (BHk, G*qn, Ev)


def finish_rows(inp: Inputs, qs: int, qe: int, state: RowState, out: Tensor, log2: bool) -> Tensor:
    """Rows ``[qs, qe)`` done: ``acc / l`` written into ``out`` (0 where a row saw nothing: its acc
    is 0; in place where ``acc`` is those rows of ``out``), and their lse ``(B, Hq, qn)``
    returned, from ``m`` in log2 units if ``log2``."""
    B, Hq, qn = inp.B, inp.Hq, qe - qs
    l_safe = state.l.masked_fill(state.l == 0, 1.0)
    rows = state.acc.div_(l_safe.unsqueeze(-1)).view(B, Hq, qn, inp.Ev)
    dest = out[:, :, qs:qe]
    if rows.data_ptr() != dest.data_ptr():  # else acc is dest's memory (strides of size-1 dims aside)
        dest.copy_(rows)
    if log2:
        return (state.m + torch.log2(state.l)).mul_(math.log(2.0)).view(B, Hq, qn)
    return (state.m + torch.log(state.l)).view(B, Hq, qn)


class Grads(NamedTuple):
    """Gradient accumulators of one backward (``None`` where no gradient is wanted).

    ``proxies`` maps each captured tensor (by ``id``) to the detached leaf that stands for it
    inside ``score_mod`` during the backward; ``dcaptured`` accumulates their gradients, in order.
    A packed call's ``dq``, ``dk`` and ``dv`` arrive unfilled: its backward writes or zeroes each
    sequence's rows once (:func:`subquad._engine.backward`).
    """

    dq: Optional[Tensor]
    dk: Optional[Tensor]
    dv: Optional[Tensor]
    dmask: Optional[Tensor]
    proxies: Mapping[int, Tensor] = {}
    dcaptured: Sequence[Tensor] = ()


def _hash32(x: Tensor) -> Tensor:
    # A 32-bit integer mix (two multiply-xorshift rounds); int64 arithmetic never overflows here
    # because x < 2**32 and the multiplier < 2**27.
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    return (x >> 16) ^ x


def dropout_scale(inp: Inputs, seed: int, qs: int, qe: int, ks: int, ke: int, dtype: torch.dtype) -> Tensor:
    """Dropout multipliers of a tile: 0 or 1/(1-p), a pure function of (seed, b, h, q, kv).

    Counter-based, so forward and backward regenerate the same mask whatever the tiling.
    ``dropout_p = 1`` drops everything (SDPA's output is then 0, as here).
    """
    b, h, qi, ki = index_grids(inp, qs, qe, ks, ke)
    x = _hash32((b * inp.Hq + h + seed) & 0xFFFFFFFF)
    x = _hash32(x ^ qi)
    x = _hash32(x ^ (ki * 0x9E3779B1 & 0xFFFFFFFF))
    threshold = int(inp.dropout_p * 4294967296.0)  # p * 2**32
    keep = x >= threshold
    return keep.to(dtype) * (1.0 / (1.0 - inp.dropout_p) if inp.dropout_p < 1.0 else 0.0)


def reduce_to(t: Tensor, shape: Sequence[int]) -> Tensor:
    """``t`` summed over the dims where ``shape`` is 1: the gradient of a broadcast input."""
    dims = [i for i, (want, got) in enumerate(zip(shape, t.shape)) if want == 1 and got != 1]
    return t.sum(dim=dims, keepdim=True) if dims else t


def add_into(target: Tensor, value: Tensor) -> None:
    """``target += value``, summing ``value`` over the dims where ``target`` is broadcast."""
    target += reduce_to(value, target.shape).to(target.dtype)


def tile_bias(
    inp: Inputs, qs: int, qe: int, seg: Segment, dtype: torch.dtype, causal_in_kernel: bool = False
) -> Optional[Tensor]:
    """Everything added to a tile's scores as one tensor: ``attn_mask``, causal and ``mask_mod``.

    Broadcastable to ``(B, Hq, qn, kn)``; masked entries are ``-inf``. ``None`` when nothing is
    added.
    """
    ks, ke = seg.ks, seg.ke
    bias: Optional[Tensor] = None
    if inp.attn_mask is not None:
        m = inp.mask_tile(qs, qe, ks, ke)
        if m.dtype == torch.bool:
            bias = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(m.logical_not(), NEG_INF)
        else:
            bias = m.to(dtype)
    keep: Optional[Tensor] = None
    if seg.causal == "partial" or (seg.causal == "diag" and not causal_in_kernel):
        keep = inp.causal_visible(qs, qe, ks, ke)
    if seg.needs_mask_mod:
        mm = seg.keep if seg.keep is not None else eval_mask_mod(inp, qs, qe, ks, ke)
        keep = mm if keep is None else keep & mm
    if keep is not None:
        if bias is None:
            bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(keep.logical_not(), NEG_INF)
        else:
            bias = bias.masked_fill(keep.logical_not(), NEG_INF)
    return bias


EMPTY_CHECK_ELEMENTS = 1 << 20
"""Bounds the temporaries of the empty-row check of a diagonal tile (about 2 bytes each)."""


def empty_rows(bias: Tensor, causal_in_kernel: bool, qn: int) -> Tensor:
    """Rows of a tile that see no key, broadcastable to ``(B, Hq, qn)``.

    A fused kernel reports lse = 0 for them, and when it applies the causal mask itself its
    check ignores that part, so the rows are found here from the bias: a row ``i`` of a diagonal
    tile (top-left causal within the tile) is empty when none of its keys ``0..i`` is visible.
    That check runs over blocks of rows, so its temporaries stay small.
    """
    if not causal_in_kernel:
        return bias.amax(dim=-1) == NEG_INF
    if bias.shape[-2] == 1:
        return _first_visible(bias) > torch.arange(qn, device=bias.device)
    per_row = max(1, bias.numel() // bias.shape[-2])
    step = max(1, EMPTY_CHECK_ELEMENTS // per_row)
    parts = []
    for r0 in range(0, qn, step):
        r1 = min(r0 + step, qn)
        rows = bias[..., r0:r1, :r1] if bias.shape[-1] != 1 else bias[..., r0:r1, :]
        parts.append(_first_visible(rows) > torch.arange(r0, r1, device=bias.device))
    return torch.cat(parts, dim=-1)


def _first_visible(bias: Tensor) -> Tensor:
    """Index of the first visible key of each row (int64 max for a row with none)."""
    visible = bias > NEG_INF
    never = torch.iinfo(torch.int64).max
    return torch.where(visible.any(dim=-1), visible.to(torch.uint8).argmax(dim=-1), never)


def halve(tiles: Optional[Tuple[int, int]], inp: Inputs) -> Tuple[int, int]:
    """Tiles half the size (along the longer side first), for the out-of-memory retry."""
    if tiles is None:
        tiles = (max(inp.Lq, 1), max(inp.Lk, 1))
    qc, kc = min(tiles[0], max(inp.Lq, 1)), min(tiles[1], max(inp.Lk, 1))
    if inp.is_causal:
        side = max(1, min(qc, kc) // 2)
        return side, side
    return (max(1, qc // 2), kc) if qc >= kc or kc <= 16 else (qc, max(1, kc // 2))
