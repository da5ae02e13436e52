"""ComfyUI integration: subquad as the attention of ComfyUI's models, per model or for all of them.

::

    subquad install comfyui ~/ComfyUI        # writes ~/ComfyUI/custom_nodes/subquad/, then restart ComfyUI

Inside ComfyUI this gives:

- the node **Subquad attention (model)**: ``MODEL`` in, a patched clone out (SD1.x, SDXL and the
  DiT families); the model that came in is untouched;
- the node **Subquad attention (VAE)**: ``VAE`` in, a clone out whose attention blocks run in subquad;
- the node **Which attention? (subquad)**: ``MODEL`` (and optionally ``VAE``) in; every attention this
  ComfyUI offers here and subquad timed on one step of that model, with peak memory: a chart
  (``IMAGE``), the table (``STRING``) and a clone running the fastest that fits (``MODEL``);
- ``"subquad"`` in ComfyUI's attention registry (``register_attention_function``), where it has one;
- default mode: with ``SUBQUAD_COMFYUI_DEFAULT=1`` in the environment when ComfyUI starts, subquad is
  the attention of every model (diffusion models, VAEs, text encoders) without a node in any
  workflow; unset it (or ``subquad uninstall comfyui DIR``) and restart to go back.

The memory budget of a call is the node's ``memory_budget`` input if not empty, else the one given
to :func:`set_memory_budget`, else the environment variable ``SUBQUAD_MEMORY_BUDGET``, else subquad's
default (half the device's free memory). Half-precision inputs need no upcast for overflow: subquad keeps
the scores, the softmax and the accumulator in float32 (what ComfyUI's ``attn_precision`` and
``--force-upcast-attention`` ask for), so fp16 scores that would overflow give finite, exact results.

ComfyUI is GPL-3.0: nothing of its code is copied here. It is imported only by the functions that
run inside it (``import subquad`` never imports this package; this package imports only torch and
subquad). Which of ComfyUI's hooks exist is decided in one place, :func:`hooks`.

Modules: ``_attention`` (ComfyUI's attention signatures over ``subquad.sdpa``; the budget),
``_hooks`` (what the running ComfyUI has), ``_nodes`` (the nodes), ``_which`` (what "Which attention?"
measures and shows), ``_default`` (the registry,
default mode), ``_install`` (``subquad install comfyui``).
"""

from __future__ import annotations

from .._host_budget import ENV_BUDGET
from ._attention import attention, set_memory_budget, vae_attention
from ._default import ENV_DEFAULT, NAME, disable_default, enable_default, register
from ._hooks import Hooks, HostUnsupported, hooks
from ._install import FOLDER, MARKERS, install, uninstall
from ._nodes import (
    NODE_CLASS_MAPPINGS,
    NODE_DISPLAY_NAME_MAPPINGS,
    SubquadModelAttention,
    SubquadVAEAttention,
    SubquadWhichAttention,
    patch_model,
    patch_vae,
)

__all__ = [
    "attention",
    "vae_attention",
    "patch_model",
    "patch_vae",
    "set_memory_budget",
    "register",
    "enable_default",
    "disable_default",
    "hooks",
    "Hooks",
    "HostUnsupported",
    "SubquadModelAttention",
    "SubquadVAEAttention",
    "SubquadWhichAttention",
    "NODE_CLASS_MAPPINGS",
    "NODE_DISPLAY_NAME_MAPPINGS",
    "install",
    "uninstall",
    "NAME",
    "ENV_BUDGET",
    "ENV_DEFAULT",
    "MARKERS",
    "FOLDER",
]
