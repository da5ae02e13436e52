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
from .loops import Loops
from .matmul import Matmul
from .sdpa import Sdpa

BACKENDS: Dict[str, Backend] = {b.name: b for b in (Sdpa(), Flex(), FusedCPU(), Loops(), Matmul())}
BACKEND_NAMES: Tuple[str, ...] = tuple(BACKENDS)
"""The backends a call can name with ``backend=`` (besides ``"auto"``): ``"sdpa"``, ``"flex"``,
``"fused"``, ``"loops"``, ``"matmul"``.

Public as ``subquad.BACKENDS``. Which of them can run a given call, and why the others cannot, is
what :func:`subquad.explain` prints.
"""


def priority(device: Union[torch.device, str]) -> List[str]:
    """Backend names, fastest first; the planner takes the first that supports the call and fits."""
    if (device if isinstance(device, str) else device.type) == "cpu":
        # flex: compiled callbacks (it refuses calls without them); fused: the kernel SDPA runs, but
        # it also returns the lse and runs in tiles; loops: where this CPU's calibration measured
        # them faster they go first (call_priority).
        return ["flex", "fused", "sdpa", "loops", "matmul"]
    return ["sdpa", "flex", "matmul"]


class Priority(NamedTuple):
    """:func:`call_priority`'s answer: the backend names, fastest first; what ``explain()`` says
    where the C++ loops go first (``loop_note``); and otherwise why a backend above them takes the
    call (``not_loops``: they refuse it, or this CPU measured them slower)."""

    names: List[str]
    loop_note: Optional[str] = None
    not_loops: Optional[str] = None


def call_priority(inp: Inputs, need_grad: bool, packed: bool) -> Priority:
    """The backend names for this call, fastest first: on a CPU the C++ loops (``loops``) go
    before the fused kernel where this CPU's calibration measured them faster
    (:func:`loop_choice.before_fused`), else after it; with what ``explain()`` says of them."""
    names = priority(inp.device_type)
    if loop_choice.before_fused(inp, need_grad, packed):
        first = ["loops"] + [n for n in names if n != "loops"]
        return Priority(first, loop_choice.before_fused_note(inp, need_grad, packed))
    if inp.device_type != "cpu" or packed:
        return Priority(names)
    refused = loop_choice.refusal(inp, need_grad)
    return Priority(names, not_loops=refused if refused is not None else loop_choice.slower_note(inp, need_grad))


def tiles_backend(inp: Inputs, backward: bool) -> str:
    """The tiled backend that runs what a whole-input kernel gave up on (``backward``: a backward
    the fused kernel does not take): the C++ loops where they take it, else ``matmul``'s tiles."""
    if inp.device_type != "cpu" or loop_choice.refusal(inp, backward) is not None:
        return "matmul"
    return "loops"


LOOP_ROWS = segments.ROWS
"""The rows of a block in the C++ loops (the time model's causal blocking)."""


def loops_forward(inp: Inputs) -> bool:
    """Whether the ``loops`` backend (and ``matmul``) runs this call's forward in the C++ loop."""
    return segments.segment_kernel(inp) is not None


def loops_backward(inp: Inputs) -> bool:
    """Whether the ``loops`` backend (and ``matmul``) runs this call's backward in the C++ loop."""
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
