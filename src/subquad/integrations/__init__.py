"""subquad where its users already are.

- ``subquad.integrations.diffusers``: ``SubquadAttnProcessor`` and ``enable(model_or_pipeline)``.
- ``subquad.integrations.transformers``: ``register()`` for ``attn_implementation="subquad"``.
- ``subquad.integrations.patch``: ``patch_sdpa()``, re-exported as ``subquad.patch_sdpa``.
- ``subquad.integrations.compile``: the ``subquad::attention`` operator for ``torch.compile``.
- ``subquad.integrations.comfyui``: ComfyUI's attention signature, its MODEL and VAE nodes, a default mode.
- ``subquad.integrations.a1111``: an AUTOMATIC1111 cross-attention optimization (``ldm``/``sgm``).

``subquad install comfyui|a1111 DIR`` writes the custom node or extension that loads them (docs/hosts.md).

The host libraries and applications are optional; nothing here imports them until a submodule is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["diffusers", "transformers", "patch", "compile", "comfyui", "a1111"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
