"""The paths an attention call can take, fastest first per device.

Each module holds one path: its support rules, memory model and compute
(:class:`subquad._paths.base.Backend`). The planner walks :func:`priority`.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from .base import Backend, Options
from .fused import FusedCPU, cpu_flash_unavailable_reason
from .matmul import Matmul
from .sdpa import TORCH_SDPA, Sdpa

BACKENDS: Dict[str, Backend] = {b.name: b for b in (Sdpa(), FusedCPU(), Matmul())}
BACKEND_NAMES: Tuple[str, ...] = tuple(BACKENDS)


def priority(device: torch.device) -> List[str]:
    if device.type == "cpu":
        # Same kernel as SDPA, but it also returns the lse and runs in tiles.
        return ["fused", "sdpa", "matmul"]
    return ["sdpa", "matmul"]


__all__ = ["BACKENDS", "BACKEND_NAMES", "Backend", "FusedCPU", "Matmul", "Options", "Sdpa", "TORCH_SDPA",
           "cpu_flash_unavailable_reason", "priority"]
