"""Which backends exist, and the order the planner asks them in, per device."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

import torch

from .._inputs import Inputs
from . import loop_choice, segments
from .base import Backend
from .flex import Flex
from .fused import FusedCPU
from .matmul import Matmul
from .sdpa import Sdpa

BACKENDS: Dict[str, Backend] = {b.name: b for b in (Sdpa(), Flex(), FusedCPU(), Matmul())}
BACKEND_NAMES: Tuple[str, ...] = tuple(BACKENDS)
"""The backends a call can name with ``backend=`` (besides ``"auto"``): ``"sdpa"``, ``"flex"``, ``"fused"``, ``"matmul"``.

Public as ``subquad.BACKENDS``. Which of them can run a given call, and why the others cannot, is
what :func:`subquad.explain` prints.
"""


def priority(device: Union[torch.device, str]) -> List[str]:
    """Backend names, fastest first; the planner takes the first that supports the call and fits."""
    if (device if isinstance(device, str) else device.type) == "cpu":
        # flex: compiled callbacks (it refuses calls without them); fused: the kernel SDPA runs, but
        # it also returns the lse and runs in tiles.
        return ["flex", "fused", "sdpa", "matmul"]
    return ["sdpa", "flex", "matmul"]


def call_priority(inp: Inputs, need_grad: bool, packed: bool) -> Tuple[List[str], Optional[str]]:
    """The backend names for this call, fastest first, and what ``explain()`` says where the order
    differs from :func:`priority`'s: on a CPU the tiles' C++ loops (``matmul``) go first where this
    CPU's calibration measured them faster than the fused kernel (:func:`loop_choice.before_fused`)."""
    names = priority(inp.device_type)
    if not loop_choice.before_fused(inp, need_grad, packed):
        return names, None
    return ["matmul"] + [n for n in names if n != "matmul"], loop_choice.before_fused_note(inp, need_grad, packed)


LOOP_ROWS = segments.ROWS
"""The rows of a block in the C++ loops (the time model's causal blocking)."""


def loops_forward(inp: Inputs) -> bool:
    """Whether ``matmul``'s forward of this call runs in the C++ loop."""
    return segments.segment_kernel(inp) is not None


def loops_backward(inp: Inputs) -> bool:
    """Whether ``matmul``'s backward of this call runs in the C++ loop."""
    return segments.backward_kernel(inp) is not None


def loop_band(inp: Inputs) -> Tuple[Optional[int], Optional[int]]:
    """The band of keys the C++ loops compute for the call (query ``i`` sees key ``j`` where
    ``lo <= i - j <= hi``; ``None``: open): its causal flag and a built-in window together."""
    m = segments.loop_mods(inp)
    lo, hi = (None, None) if m is None else (m.window_lo, m.window_hi)
    if inp.is_causal:
        lo = -inp.causal_offset if lo is None else max(lo, -inp.causal_offset)
    return lo, hi
