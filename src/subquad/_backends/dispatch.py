"""Which backends exist, and the order the planner asks them in, per device."""

from __future__ import annotations

from typing import Dict, List, Tuple, Union

import torch

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
