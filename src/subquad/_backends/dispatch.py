"""Which backends exist, and the order the planner asks them in, per device."""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

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


class Priority(NamedTuple):
    """:func:`call_priority`'s answer: the backend names, fastest first; what ``explain()`` says
    where the C++ loops go first; and otherwise why they do not run the call (``not_loops``;
    ``loops_can_run``: the reason is only that they measured slower, and ``matmul`` runs them)."""

    names: List[str]
    loop_note: Optional[str] = None
    not_loops: Optional[str] = None
    loops_can_run: bool = False


def call_priority(inp: Inputs, need_grad: bool, packed: bool) -> Priority:
    """The backend names for this call, fastest first: on a CPU the tiles' C++ loops (``matmul``)
    go first where this CPU's calibration measured them faster than the fused kernel
    (:func:`loop_choice.before_fused`); with what ``explain()`` says of them either way."""
    names = priority(inp.device_type)
    if loop_choice.before_fused(inp, need_grad, packed):
        first = ["matmul"] + [n for n in names if n != "matmul"]
        return Priority(first, loop_choice.before_fused_note(inp, need_grad, packed))
    if inp.device_type != "cpu" or packed:
        return Priority(names)
    refused = loop_choice.refusal(inp, need_grad)
    if refused is not None:
        return Priority(names, not_loops=refused)
    return Priority(names, not_loops=loop_choice.slower_note(inp, need_grad), loops_can_run=True)


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


def loop_ranges(inp: Inputs) -> Optional[Tensor]:
    """Each query row's range of keys ``[first, end)`` that the C++ loops compute for the call
    under a document mask, prefix-LM or key padding (int64 ``(1 or B, Lq, 2)``), within
    :func:`loop_band`; None where the call has none."""
    m = segments.loop_mods(inp)
    return None if m is None else m.ranges
