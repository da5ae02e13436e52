"""subquad: exact attention in bounded memory, on every PyTorch device.

Self-attention does not need O(n²) memory (Rabe & Staats, 2021): queries and keys are processed in
tiles with a running max, sum and weighted sum per row, so the ``Lq x Lk`` matrix never exists.

PyTorch is an extra (``pip install "subquad[torch]"``): without it ``import subquad`` says what to
install, while ``import subquad.jax`` and ``subquad --version`` work (see ``_requires``).
"""

from typing import Any

from ._errors import ArgumentError, ArgumentTypeError, MemoryBudgetError
from ._requires import require_torch, torch_face_wanted
from ._version import __version__

if torch_face_wanted():
    from . import _calibrate as _calibrate  # the calibration's measurement, installed on import
    from . import mods
    from ._api import attention, explain, sdpa
    from ._api_varlen import varlen_attention, varlen_explain
    from ._backends import BACKEND_NAMES as BACKENDS
    from ._planner import Plan

__all__ = [
    "attention",
    "sdpa",
    "explain",
    "varlen_attention",
    "varlen_explain",
    "Plan",
    "MemoryBudgetError",
    "ArgumentError",
    "ArgumentTypeError",
    "BACKENDS",
    "mods",
    "patch_sdpa",
    "integrations",
    "distributed",
    "compat",
    "__version__",
]


def __getattr__(name: str) -> Any:  # the lazy wing: integrations import host libraries only when used
    if name in __all__:
        require_torch()  # without torch (only subquad.jax was imported) the torch names say what to install
    if name == "patch_sdpa":
        from .integrations.patch import patch_sdpa  # the wing imports subquad: it comes after it

        return patch_sdpa
    if name in ("integrations", "distributed", "jax", "compat"):  # jax: only when asked for (pip install subquad[jax])
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'subquad' has no attribute {name!r}")
