"""Whether ``auto`` runs a call's tiles in the native kernel's C++ loops before torch's fused
kernel: what this CPU's calibration measured (:mod:`~subquad._backends.calibration`), or, where
there is none (``SUBQUAD_CALIBRATE=0``, no measurement possible), fallback thresholds.

The fallback's values were read off runs on one CPU (an AVX512-BF16 CPU without AMX): the
per-size ratios are on docs/benchmarks/loops.md, with the command that measures them again. On a
CPU with AMX tiles the fallback leaves every call to the fused kernel, which multiplies on them.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from .. import _native
from .._inputs import Inputs
from . import calibration
from .products import amx_tiles
from .segments import MASK_DTYPES, WIDE_DTYPES, backward_kernel, fast_kernel, loop_mods, with_packed

LOOP_BEFORE_FUSED_SCORES = 1 << 19
"""Fallback: bfloat16 calls of this many scores (``B·Hq·Lq·Lk``) or more take the loops first."""
WIDE_LOOP_BEFORE_FUSED_SCORES = 1 << 23
"""Fallback: the same for float32 calls (with :data:`WIDE_LOOP_MIN_KEYS` keys or more and heads
of :data:`WIDE_LOOP_MAX_HEAD_DIM` at most)."""
HALF_LOOP_BEFORE_FUSED_SCORES = 1 << 22
"""Fallback: the same for float16 calls (the fused kernel converts float16 to float32)."""
WIDE_LOOP_MIN_KEYS = 512
"""Fallback: float32 calls with fewer keys stay with the fused kernel (the loops' per-row work is
spread over few scores)."""
WIDE_LOOP_MAX_HEAD_DIM = 384
"""Fallback: float32 calls with a wider head stay with the fused kernel (both run at the FMA
units' peak there)."""
WIDE_LOOP_MIN_LANES = 16
"""Fallback: float32 and float16 calls take the loops only from a build of this many float lanes
(AVX512F; an AVX2 build of 8 serves ``backend="loops"``, and ``auto`` where the fused kernel refuses)."""

_BEFORE_FUSED_SCORES = {
    torch.bfloat16: LOOP_BEFORE_FUSED_SCORES,
    torch.float32: WIDE_LOOP_BEFORE_FUSED_SCORES,
    torch.float16: HALF_LOOP_BEFORE_FUSED_SCORES,
}


def _fallback_allows(inp: Inputs, kernel: ModuleType) -> bool:
    """Without a calibration: no AMX, and for float32 and float16 a build of
    :data:`WIDE_LOOP_MIN_LANES` lanes."""
    if amx_tiles():
        return False
    return inp.dtype not in WIDE_DTYPES or getattr(kernel, "float_lanes", 0) >= WIDE_LOOP_MIN_LANES


def _kind(inp: Inputs) -> str:
    """The calibration's kind of a call: ``mods`` where the loops evaluate an ALiBi, a window or a
    range of keys per row themselves (the fused kernel would add a bias tile), else by shape."""
    m = loop_mods(inp)
    if m is not None and (
        m.slopes is not None or m.ranges is not None or m.window_hi is not None or (m.window_lo or 0) > 0
    ):
        return "mods"
    return calibration.kind(inp.E, inp.Ev, inp.Lk)


def _scores(inp: Inputs) -> int:
    return inp.n_groups * inp.B * inp.Hq * inp.Lq * inp.Lk


def before_fused(inp: Inputs, need_grad: bool, packed: bool = False) -> bool:
    """Whether ``auto`` takes the loops before the fused kernel.

    ``packed``: ``inp`` is a packed call's planning view (its longest sequences): a plain call
    whose sequences the forward loop runs whole (:func:`~subquad._backends.segments.forward_packed`). Else a call the forward loop
    takes (and with ``need_grad`` the backward loop) where the calibration measured the loops
    faster for calls of its kind (:func:`_kind`) from its size on; without a calibration, the
    fallback thresholds."""
    if packed:
        plain = inp.score_mod is None and inp.mask_mod is None and inp.attn_mask is None and inp.dropout_p == 0.0
        kernel = with_packed(inp, fast_kernel(inp))
        if not plain or kernel is None:
            return False
        measured = calibration.entry(inp.dtype, False)
        return measured.wins("self") if measured is not None else _fallback_allows(inp, kernel)
    kernel = fast_kernel(inp)
    if inp.packed is not None or kernel is None or (need_grad and backward_kernel(inp) is None):
        return False
    measured = calibration.entry(inp.dtype, need_grad)
    if measured is not None:
        kind = _kind(inp)
        if kind != "self":  # cross-attention, wide heads, ALiBi and windows: their own measurement
            return measured.wins(kind) and _scores(inp) >= calibration.SMALLEST
        threshold = measured.threshold
        return threshold is not None and _scores(inp) >= threshold
    if not _fallback_allows(inp, kernel):
        return False
    if inp.dtype == torch.float32 and (inp.Lk < WIDE_LOOP_MIN_KEYS or max(inp.E, inp.Ev) > WIDE_LOOP_MAX_HEAD_DIM):
        return False
    return _scores(inp) >= _BEFORE_FUSED_SCORES[inp.dtype]


def before_fused_note(inp: Inputs, need_grad: bool, packed: bool = False) -> str:
    """What ``explain()`` says of a plan that takes the loops first: what this CPU's calibration
    measured, or that the fallback decided."""
    loops = "forward and backward loops" if need_grad and not packed else "forward loop"
    what = f"the tiles' {loops} in C++ (native kernel) before the fused kernel"
    if packed:
        what = "a packed call's sequences through the tiles' forward loop in C++, one kernel call per group"
    what += f", multiplying on {calibration.products_choice(calibration.products_of(inp.dtype))[1]}"
    measured = calibration.entry(inp.dtype, need_grad and not packed)
    if measured is None:
        return f"{what}: fallback thresholds (no calibration here: SUBQUAD_CALIBRATE=0 or it could not run)"
    kind = "self" if packed else _kind(inp)
    ratio = measured.ratio(kind, _scores(inp))
    label = {"mods": "ALiBi/window", "few-keys": "few keys", "wide": "wide head"}.get(kind, kind)
    return (
        f"{what}: measured on this CPU at {ratio:.2f}x its time ({label} attention, {measured.dtype}, "
        f"{'forward + backward' if measured.training else 'forward'}, {measured.threads} threads; "
        f"calibration of {measured.measured}, `subquad calibrate` measures again)"
    )


def refusal(inp: Inputs, need_grad: bool) -> Optional[str]:
    """Why the tiles' C++ loops do not run this CPU call (what ``explain()`` lists as ``not
    loops``), or None where they can: the kernel not built, a dtype, dropout, a callback or mask
    they do not evaluate themselves, or a backward they do not take."""
    if inp.device_type != "cpu":
        return None
    kernel = _native.tile_kernel()
    if kernel is None:
        if _native.mode() == "off":
            return "SUBQUAD_NATIVE=off"
        return "the native kernel is not built here (`subquad build`, about 40 s once)"
    if inp.dtype not in (torch.bfloat16, *WIDE_DTYPES):
        return f"{str(inp.dtype).replace('torch.', '')}: the loops run bfloat16, float16 and float32"
    if inp.dropout_p > 0.0:
        return "dropout (the loops have none; the tiles in Python run it)"
    if loop_mods(inp) is None:
        return (
            "a score_mod or mask_mod the loops do not evaluate themselves (they do soft caps, ALiBi, causal "
            "and sliding windows, documents of sorted ids, prefix-LM and key padding)"
        )
    if inp.attn_mask is not None and inp.attn_mask.dtype not in MASK_DTYPES:
        return f"an attn_mask of {inp.attn_mask.dtype} (the loops read bool, float32, bfloat16 and float16 masks)"
    if fast_kernel(inp) is None:
        needs = "AVX512-BF16" if inp.dtype == torch.bfloat16 else "AVX512F, or AVX2 with FMA"
        return f"this build has no {str(inp.dtype).replace('torch.', '')} loops (they need {needs})"
    if need_grad and backward_kernel(inp) is None:
        return "the backward loop does not take the call (packed, a mask that needs its gradient, or fewer tasks than threads)"
    return None


def slower_note(inp: Inputs, need_grad: bool) -> str:
    """What ``explain()`` says where the loops could run a call but ``auto`` keeps the fused kernel."""
    measured = calibration.entry(inp.dtype, need_grad)
    if measured is None:
        return "the fallback thresholds keep this call on the fused kernel (no calibration here)"
    ratio = measured.ratio(_kind(inp), _scores(inp))
    shown = "" if ratio is None else f" at {ratio:.2f}x its time"
    return f"measured on this CPU{shown}, not 5% faster than the fused kernel (`subquad calibrate` measures again)"
