"""For every model: ``"subquad"`` in ComfyUI's attention registry, and default mode with its undo.

The rest of the package may use :func:`register` (what the installed node runs),
:func:`enable_default`, :func:`disable_default` and ``ENV_DEFAULT``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Dict, List, Tuple

from torch import Tensor

from ..._for_wings import Budget, build_native_in_background, setting_on
from ._attention import VaeAttention, set_memory_budget
from ._hooks import ATTENTION, VAE, Hooks, hooks, host, host_attention, unsupported

NAME = "subquad"
"""The name in ComfyUI's attention registry."""

ENV_DEFAULT = "SUBQUAD_COMFYUI_DEFAULT"
_log = logging.getLogger(__name__)


def register() -> Hooks:
    """What the installed custom node runs when ComfyUI loads it.

    Adds ``"subquad"`` to ComfyUI's attention registry (where it has one; once), and turns on
    default mode (:func:`enable_default`) if ``SUBQUAD_COMFYUI_DEFAULT`` is ``1``/``true``/``yes``/``on``,
    and builds the native kernel in the background where it is not built and a compiler is found
    (``build_native_in_background``; ``SUBQUAD_NATIVE=off`` skips it). Returns the hooks found.
    """
    found = hooks()
    if found.registry:
        attn = host(ATTENTION)
        known = getattr(attn, "REGISTERED_ATTENTION_FUNCTIONS", None)
        if not isinstance(known, dict) or NAME not in known:
            attn.register_attention_function(NAME, host_attention())
    if setting_on(ENV_DEFAULT):
        enable_default()
    build_native_in_background()  # once per machine: the next start runs the loops where they are faster
    return found


_SAVED: Dict[Tuple[str, str], Any] = {}
"""What :func:`enable_default` replaced: ``(module name, attribute) -> original``."""


def enable_default(memory_budget: Budget = None) -> List[str]:
    """Make subquad the attention of every ComfyUI model: diffusion models, VAEs and text encoders.

    ComfyUI picks its attention functions once, at import, and several model files bind them by
    name (``from comfy.ldm.modules.attention import optimized_attention``). This points each of
    ComfyUI's modules (``comfy.*``, ``comfy_extras.*``) that holds ComfyUI's choice at subquad:
    ``optimized_attention``, ``optimized_attention_masked``, ``optimized_attention_for_device``
    (text encoders) and ``vae_attention`` (VAEs built from then on). A model patched by a node
    still uses that node's budget. Returns the ``module.name`` entries it changed;
    :func:`disable_default` puts them back.

    Args:
        memory_budget: when given, :func:`set_memory_budget` (the budget of every call without a node's).

    Raises:
        HostUnsupported: the host has no ``optimized_attention`` to replace.
    """
    if memory_budget is not None:
        set_memory_budget(memory_budget)
    found = hooks()
    attn = host(ATTENTION)
    if not callable(getattr(attn, "optimized_attention", None)):
        raise unsupported(found, "for default mode", f"{ATTENTION}.optimized_attention")
    fn = host_attention()
    ours: Dict[str, Any] = {
        "optimized_attention": fn,
        "optimized_attention_masked": fn,
        "optimized_attention_for_device": _for_device,
    }
    originals: Dict[str, Any] = {name: _original(attn, name) for name in ours}
    if found.vae:
        vae = host(VAE)
        ours["vae_attention"] = _vae_attention_factory
        originals["vae_attention"] = _original(vae, "vae_attention")
    changed = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(("comfy.", "comfy_extras.")):
            continue
        for name, original in originals.items():
            current = module.__dict__.get(name)
            if original is not None and current is original:
                _SAVED[(module_name, name)] = current
                setattr(module, name, ours[name])
                changed.append(f"{module_name}.{name}")
    _log.info(
        "subquad is ComfyUI's attention for every model (%d names; %s=unset to go back).", len(changed), ENV_DEFAULT
    )
    return changed


def _original(module: Any, name: str) -> Any:
    for (module_name, saved_name), value in _SAVED.items():
        if module_name == module.__name__ and saved_name == name:
            return value
    return module.__dict__.get(name)


def disable_default() -> List[str]:
    """Undo :func:`enable_default`: ComfyUI's own choices back where subquad had replaced them."""
    restored = []
    for (module_name, name), original in list(_SAVED.items()):
        module = sys.modules.get(module_name)
        if module is not None and module.__dict__.get(name) in (host_attention(), _for_device, _vae_attention_factory):
            setattr(module, name, original)
            restored.append(f"{module_name}.{name}")
        del _SAVED[(module_name, name)]
    return restored


def _for_device(device: Any, mask: bool = False, small_input: bool = False) -> Callable[..., Tensor]:
    """``optimized_attention_for_device`` in default mode: subquad for every device and input."""
    return host_attention()


def _vae_attention_factory() -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """``vae_attention`` in default mode: what each new VAE block takes as its attention."""
    return VaeAttention(None)
