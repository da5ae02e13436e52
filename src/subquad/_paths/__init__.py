"""The paths an attention call can take, fastest first per device.

Each module holds one path: its support rules, memory model and compute
(:class:`subquad._paths.base.Backend`). The planner walks :func:`priority`.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from .base import Backend, Options
from .flex import Flex, FlexUnavailable, compile_allowed
from .fused import FusedCPU, cpu_flash_unavailable_reason
from .matmul import Matmul
from .sdpa import TORCH_SDPA, Sdpa

BACKENDS: Dict[str, Backend] = {b.name: b for b in (Sdpa(), Flex(), FusedCPU(), Matmul())}
BACKEND_NAMES: Tuple[str, ...] = tuple(BACKENDS)


def priority(device: torch.device) -> List[str]:
    if device.type == "cpu":
        # flex: compiled callbacks (it refuses calls without them); fused: the kernel SDPA runs, but
        # it also returns the lse and runs in tiles.
        return ["flex", "fused", "sdpa", "matmul"]
    return ["sdpa", "flex", "matmul"]


__all__ = ["BACKENDS", "BACKEND_NAMES", "Backend", "Flex", "FlexUnavailable", "FusedCPU", "Matmul", "Options", "Sdpa",
           "TORCH_SDPA", "compile_allowed", "cpu_flash_unavailable_reason", "priority"]
