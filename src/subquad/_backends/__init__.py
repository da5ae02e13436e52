"""The backends an attention call can run on: one module each, and the priority lists.

Each module holds one backend (:class:`~subquad._backends.base.Backend`): its support rules,
memory model, tile search and compute. :mod:`~subquad._backends.dispatch` lists them and the
order the planner asks them in. The rest of the package uses the names below.
"""

from .base import MPS_MAX_MATMUL_ELEMENTS, TARGET_TILE_BYTES, Backend, Fit, Options, compile_allowed
from .dispatch import BACKEND_NAMES, BACKENDS, priority, tiles_backend
from .flex import Flex, FlexUnavailable
from .fused import FusedCPU, cpu_flash_forward, cpu_flash_unavailable_reason
from .loops import Loops
from .matmul import Matmul
from .sdpa import TORCH_SDPA, Sdpa

__all__ = [
    "BACKENDS",
    "BACKEND_NAMES",
    "Backend",
    "Fit",
    "Flex",
    "FlexUnavailable",
    "FusedCPU",
    "Loops",
    "Matmul",
    "MPS_MAX_MATMUL_ELEMENTS",
    "Options",
    "Sdpa",
    "TARGET_TILE_BYTES",
    "TORCH_SDPA",
    "compile_allowed",
    "cpu_flash_forward",
    "cpu_flash_unavailable_reason",
    "priority",
    "tiles_backend",
]
