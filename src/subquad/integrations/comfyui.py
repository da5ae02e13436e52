"""ComfyUI integration: subquad as the attention of ComfyUI's models, per model or for all of them.

::

    subquad install comfyui ~/ComfyUI        # writes ~/ComfyUI/custom_nodes/subquad/, then restart ComfyUI

Inside ComfyUI this gives:

- the node **Subquad attention (model)**: ``MODEL`` in, a patched clone out (SD1.x, SDXL and the
  DiT families); the model that came in is untouched;
- the node **Subquad attention (VAE)**: ``VAE`` in, a clone out whose attention blocks run in subquad;
- ``"subquad"`` in ComfyUI's attention registry (``register_attention_function``), where it has one;
- default mode: with ``SUBQUAD_COMFYUI_DEFAULT=1`` in the environment when ComfyUI starts, subquad is
  the attention of every model (diffusion models, VAEs, text encoders) without a node in any
  workflow; unset it (or ``subquad uninstall comfyui DIR``) and restart to go back.

The memory budget of a call is the node's ``memory_budget`` input if not empty, else
:data:`MEMORY_BUDGET`, else the environment variable ``SUBQUAD_MEMORY_BUDGET``, else subquad's default
(half the device's free memory). Half-precision inputs need no upcast for overflow: subquad keeps
the scores, the softmax and the accumulator in float32 (what ComfyUI's ``attn_precision`` and
``--force-upcast-attention`` ask for), so fp16 scores that would overflow give finite, exact results.

ComfyUI is GPL-3.0: nothing of its code is copied here. It is imported only by the functions that
run inside it (``import subquad`` never imports this module; this module imports only torch and
subquad). Which of ComfyUI's hooks exist is decided in one place, :func:`hooks`.
"""

from __future__ import annotations

import copy
import functools
import importlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

import subquad

from .._budget import Budget, parse_budget
from .._errors import ArgumentError
from ._hosts import find_host, remove_folder, write_folder

__all__ = [
    "attention",
    "vae_attention",
    "patch_model",
    "patch_vae",
    "register",
    "enable_default",
    "disable_default",
    "hooks",
    "Hooks",
    "HostUnsupported",
    "SubquadModelAttention",
    "SubquadVAEAttention",
    "NODE_CLASS_MAPPINGS",
    "NODE_DISPLAY_NAME_MAPPINGS",
    "MEMORY_BUDGET",
    "install",
    "uninstall",
]

NAME = "subquad"
"""The name in ComfyUI's attention registry."""

MEMORY_BUDGET: Budget = None
"""The budget of calls whose node gave none (and of default mode); ``None``: ``SUBQUAD_MEMORY_BUDGET``."""

ENV_BUDGET = "SUBQUAD_MEMORY_BUDGET"
ENV_DEFAULT = "SUBQUAD_COMFYUI_DEFAULT"

MARKERS = ("main.py", "nodes.py", "comfy/model_management.py", "custom_nodes")
"""What makes a folder a ComfyUI checkout for :func:`install`."""

FOLDER = "subquad"
"""The custom node folder :func:`install` writes into ``custom_nodes/``."""

_ATTENTION = "comfy.ldm.modules.attention"
_VAE = "comfy.ldm.modules.diffusionmodules.model"
_log = logging.getLogger(__name__)


class HostUnsupported(NotImplementedError):
    """The running ComfyUI has none of the hooks a subquad feature needs (the message names its version)."""


# --------------------------------------------------------------------------------------------
# The budget


def _budget(memory_budget: Budget) -> Budget:
    """The budget of one call: the given one, else :data:`MEMORY_BUDGET`, else ``SUBQUAD_MEMORY_BUDGET``."""
    if memory_budget is not None:
        return memory_budget
    if MEMORY_BUDGET is not None:
        return MEMORY_BUDGET
    text = os.environ.get(ENV_BUDGET, "").strip()
    if not text:
        return None
    try:
        parse_budget(text)
    except ArgumentError as e:
        raise ArgumentError(f"The environment variable {ENV_BUDGET}={text!r} is not a memory budget: {e}") from None
    return text


def _node_budget(text: str) -> Budget:
    """A node's ``memory_budget`` input: empty means "not set here"; anything else must parse."""
    text = (text or "").strip()
    if not text:
        return None
    parse_budget(text)  # refuse a typo when the node runs, not at the first attention call
    return text


# --------------------------------------------------------------------------------------------
# The attention functions (no ComfyUI needed to call them)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    heads: int,
    mask: Optional[Tensor] = None,
    attn_precision: Optional[torch.dtype] = None,
    skip_reshape: bool = False,
    skip_output_reshape: bool = False,
    **kwargs: Any,
) -> Tensor:
    r"""ComfyUI's attention function (``optimized_attention``'s signature), computed by ``subquad.sdpa``.

    Layouts (``B`` batch, ``H = heads``, ``L`` tokens, ``D``/``Dv`` head dims):

    - ``q [B, Lq, H*D]``, ``k [B, Lk, H*D]``, ``v [B, Lk, H*Dv]``; with ``skip_reshape=True``
      ``q [B, H, Lq, D]``, ``k [B, H, Lk, D]``, ``v [B, H, Lk, Dv]``;
    - output ``[B, Lq, H*Dv]``, or ``[B, H, Lq, Dv]`` with ``skip_output_reshape=True``; the dtype of ``q``.

    ``mask`` as ComfyUI's PyTorch attention reads it: ``[Lq, Lk]``, ``[B, Lq, Lk]`` or
    ``[B, H, Lq, Lk]`` (any dim may be 1), bool (True = attend) or additive. Equal to::

        q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))  # unless skip_reshape
        mask = mask[None, None] if mask.ndim == 2 else mask[:, None] if mask.ndim == 3 else mask
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).flatten(2)                      # unless skip_output_reshape

    with the scores, softmax and sums in float32 for half-precision inputs, in tiles that keep the
    memory budget. ``attn_precision`` (after ComfyUI's ``--force-upcast-attention`` /
    ``--dont-upcast-attention``) of float32 is therefore always met; a wider one (float64) casts
    the inputs. A row whose keys are all masked gives 0.

    Keyword arguments: ``memory_budget`` (see the module's docstring); every other one ComfyUI
    passes (``transformer_options``, ...) is accepted and ignored.

    Raises:
        ValueError: shapes that do not fit the layout (naming them).
        MemoryBudgetError: the budget cannot hold even the smallest tiles.
    """
    budget = _budget(kwargs.get("memory_budget"))
    dtype = q.dtype
    if skip_reshape:
        if q.ndim != 4:
            raise ArgumentError(f"Expected q of shape [B, heads, L, D] with skip_reshape=True, got {tuple(q.shape)}.")
        b = q.shape[0]
    else:
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
            raise ArgumentError(
                f"Expected q, k, v of shape [B, L, heads*D] (or [B, heads, L, D] with skip_reshape=True), "
                f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
            )
        if heads <= 0 or any(t.shape[-1] % heads for t in (q, k, v)):
            raise ArgumentError(
                f"Expected the last dims of q, k, v to be multiples of heads={heads}, "
                f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
            )
        b = q.shape[0]
        q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))

    if mask is not None:
        if mask.ndim == 2:
            mask = mask[None, None]
        elif mask.ndim == 3:
            mask = mask[:, None]

    precision = _precision(attn_precision, dtype)
    if precision is not None and precision.is_floating_point and precision.itemsize > max(dtype.itemsize, 4):
        q, k, v = q.to(precision), k.to(precision), v.to(precision)
    out = subquad.sdpa(q, k, v, attn_mask=mask, memory_budget=budget).to(dtype)
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(b, -1, heads * out.shape[-1])


def _precision(attn_precision: Optional[torch.dtype], dtype: torch.dtype) -> Optional[torch.dtype]:
    """``attn_precision`` as ComfyUI resolves it (its upcast flags), when ComfyUI is running."""
    host = sys.modules.get(_ATTENTION)
    resolve = getattr(host, "get_attn_precision", None)
    if resolve is None:
        return attn_precision
    try:
        resolved: Optional[torch.dtype] = resolve(attn_precision, dtype)
    except TypeError:  # a ComfyUI whose helper takes other arguments
        return attn_precision
    return resolved


def vae_attention(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    """The attention of ComfyUI's VAE blocks (``AttnBlock.optimized_attention``), computed by ``subquad.sdpa``.

    ``q``, ``k``, ``v`` are ``[B, C, *spatial]`` (``[B, C, H, W]``, or ``[B, C, T, H, W]`` for video
    VAEs): one head of ``C`` channels over ``H*W`` tokens; the output has the same shape. Equal to::

        q, k, v = (t.reshape(B, 1, C, -1).transpose(2, 3) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(2, 3).reshape(shape)

    Keyword arguments: ``memory_budget``. At 2048 px (a 256x256 latent) the scores alone would be
    16 GiB of float32; the tiles keep the call within its budget.
    """
    shape = q.shape
    b, c = shape[0], shape[1]
    q, k, v = (t.reshape(b, 1, c, -1).transpose(2, 3) for t in (q, k, v))
    out = subquad.sdpa(q, k, v, memory_budget=_budget(kwargs.get("memory_budget")))
    return out.transpose(2, 3).reshape(shape)


class _Override:
    """``transformer_options["optimized_attention_override"]``: ComfyUI's ``wrap_attn`` calls it as
    ``override(func, *args, **kwargs)`` in place of the attention function ``func`` it chose."""

    def __init__(self, memory_budget: Budget) -> None:
        self.memory_budget = memory_budget

    def __call__(self, func: Callable[..., Tensor], *args: Any, **kwargs: Any) -> Tensor:
        kwargs["memory_budget"] = self.memory_budget
        return attention(*args, **kwargs)

    def __repr__(self) -> str:
        return f"subquad attention (memory_budget={self.memory_budget!r})"


class _Replace:
    """An attn1/attn2 replace patch of ComfyUI's ``BasicTransformerBlock``: ``(q, k, v, extra_options)``,
    q/k/v already projected (``[B, L, heads*D]``)."""

    def __init__(self, memory_budget: Budget) -> None:
        self.memory_budget = memory_budget

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, extra_options: Dict[str, Any]) -> Tensor:
        return attention(
            q,
            k,
            v,
            extra_options["n_heads"],
            attn_precision=extra_options.get("attn_precision"),
            memory_budget=self.memory_budget,
        )


class _VaeAttention:
    """What a VAE block's ``optimized_attention`` becomes: :func:`vae_attention` with a budget."""

    def __init__(self, memory_budget: Budget) -> None:
        self.memory_budget = memory_budget

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return vae_attention(q, k, v, memory_budget=self.memory_budget)

    def __repr__(self) -> str:
        return f"subquad VAE attention (memory_budget={self.memory_budget!r})"


# --------------------------------------------------------------------------------------------
# Which hooks the running ComfyUI has


@dataclass(frozen=True)
class Hooks:
    """The hooks of the running ComfyUI that subquad uses, found by :func:`hooks`."""

    version: str
    """``comfyui_version.__version__``, or ``"unknown"``."""
    registry: bool
    """``register_attention_function`` / ``get_attention_function`` (the attention registry)."""
    override: bool
    """``wrap_attn``: attention functions that honour ``transformer_options["optimized_attention_override"]``."""
    replace: bool
    """``ModelPatcher.set_model_attn1_replace`` / ``set_model_attn2_replace`` (SD1.x/SDXL UNets)."""
    vae: bool
    """``comfy.ldm.modules.diffusionmodules.model`` with ``AttnBlock`` and ``vae_attention``."""


def _host(name: str) -> Any:
    """A module of the running ComfyUI."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(
            f"subquad.integrations.comfyui runs inside ComfyUI: could not import {name} ({e}). "
            "Install the node with `subquad install comfyui <ComfyUI folder>` and use it from ComfyUI."
        ) from e


def _version() -> str:
    try:
        return str(importlib.import_module("comfyui_version").__version__)
    except (ImportError, AttributeError):
        return "unknown"


def hooks() -> Hooks:
    """Which of ComfyUI's attention hooks the running ComfyUI has (ComfyUI must be importable)."""
    attn = _host(_ATTENTION)
    patcher = _host("comfy.model_patcher").ModelPatcher
    try:
        vae = _host(_VAE)
    except ImportError:
        vae = None
    return Hooks(
        version=_version(),
        registry=callable(getattr(attn, "register_attention_function", None)),
        override=callable(getattr(attn, "wrap_attn", None)),
        replace=all(callable(getattr(patcher, f"set_model_attn{i}_replace", None)) for i in (1, 2)),
        vae=vae is not None and hasattr(vae, "AttnBlock") and callable(getattr(vae, "vae_attention", None)),
    )


def _unsupported(found: Hooks, what: str, needs: str) -> HostUnsupported:
    return HostUnsupported(
        f"This ComfyUI (version {found.version}) has none of the hooks subquad needs {what}: looked for {needs}. "
        "Update ComfyUI, or report the version at subquad's issue tracker."
    )


@functools.lru_cache(maxsize=None)
def _wrapped(attn: Any) -> Callable[..., Tensor]:
    """:func:`attention` as ComfyUI wraps its own (``wrap_attn``), so a model's override still applies."""
    wrap = getattr(attn, "wrap_attn", None)
    return wrap(attention) if callable(wrap) else attention


def _host_attention() -> Callable[..., Tensor]:
    return _wrapped(_host(_ATTENTION))


# --------------------------------------------------------------------------------------------
# Per model: MODEL and VAE


def patch_model(model: Any, memory_budget: Budget = None) -> Any:
    """A clone of a ComfyUI ``ModelPatcher`` whose attention runs in subquad; ``model`` is untouched.

    Uses ``transformer_options["optimized_attention_override"]`` (every model family whose
    attention goes through ComfyUI's ``optimized_attention``) where the host has it, else attn1/attn2
    replace patches on every transformer block of an SD1.x/SDXL UNet.

    Raises:
        HostUnsupported: the host has neither hook (or only the replace patches, and the model is not a UNet).
        ValueError: a ``memory_budget`` that does not parse.
    """
    if memory_budget is not None:
        parse_budget(memory_budget)
    found = hooks()
    patched = model.clone()
    if found.override:
        patched.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = _Override(
            memory_budget
        )
        return patched
    blocks = _unet_transformer_blocks(getattr(getattr(model, "model", None), "diffusion_model", None))
    if not found.replace or not blocks:
        raise _unsupported(
            found,
            f"for this model ({type(getattr(model, 'model', model)).__name__})",
            "comfy.ldm.modules.attention.wrap_attn (transformer_options['optimized_attention_override']), "
            "or ModelPatcher.set_model_attn1_replace/set_model_attn2_replace on a UNet with transformer blocks",
        )
    patch = _Replace(memory_budget)
    for name, number, index in blocks:
        patched.set_model_attn1_replace(patch, name, number, index)
        patched.set_model_attn2_replace(patch, name, number, index)
    return patched


def _unet_transformer_blocks(unet: Any) -> List[Tuple[str, int, int]]:
    """``(block name, block number, transformer index)`` of every transformer block of a ComfyUI
    ``UNetModel``: the keys of its attn1/attn2 replace patches (``transformer_options["block"]``,
    ``["block_index"]``)."""
    if unet is None:
        return []
    middle = getattr(unet, "middle_block", None)
    groups = (
        ("input", list(getattr(unet, "input_blocks", None) or ())),
        ("middle", [middle] if middle is not None else []),
        ("output", list(getattr(unet, "output_blocks", None) or ())),
    )
    keys = []
    for name, blocks in groups:
        for number, block in enumerate(blocks):
            for module in block.modules():
                inner = getattr(module, "transformer_blocks", None)
                if isinstance(inner, torch.nn.ModuleList):
                    keys += [(name, number, index) for index in range(len(inner))]
    return keys


def patch_vae(vae: Any, memory_budget: Budget = None) -> Any:
    """A ComfyUI ``VAE`` whose attention blocks run in subquad within ``memory_budget``.

    The result is a shallow copy of ``vae`` sharing its weights, with a cloned ``ModelPatcher``
    whose object patches set each block's ``optimized_attention`` while it is loaded (ComfyUI's
    own way to vary a shared model); ``vae`` keeps its attention. Blocks are those whose attention
    ComfyUI's ``vae_attention()`` picked (``AttnBlock`` and the video VAEs' blocks). A host
    without object patches gets ``vae`` itself patched in place (logged).

    Raises:
        HostUnsupported: the host has no ``comfy.ldm.modules.diffusionmodules.model.AttnBlock``.
        ValueError: a ``memory_budget`` that does not parse.
    """
    if memory_budget is not None:
        parse_budget(memory_budget)
    found = hooks()
    if not found.vae:
        raise _unsupported(found, "for the VAE", f"{_VAE}.AttnBlock and vae_attention")
    root = vae.first_stage_model
    names = [name for name, module in root.named_modules() if _is_vae_attention_block(module)]
    if not names:
        _log.warning("subquad: this VAE (%s) has no attention blocks; returned unchanged.", type(root).__name__)
        return vae
    fn = _VaeAttention(memory_budget)
    patcher: Any = getattr(vae, "patcher", None)
    if callable(getattr(patcher, "add_object_patch", None)) and getattr(patcher, "model", None) is root:
        patched = copy.copy(vae)
        patched.patcher = patcher.clone()
        for name in names:
            patched.patcher.add_object_patch(f"{name}.optimized_attention", fn)
        return patched
    _log.warning("subquad: this ComfyUI's VAE has no object patches; its attention blocks were patched in place.")
    for name in names:
        root.get_submodule(name).optimized_attention = fn
    return vae


def _is_vae_attention_block(module: Any) -> bool:
    fn = getattr(module, "optimized_attention", None)
    if fn is None:
        return False
    vae = sys.modules.get(_VAE)
    return (
        (vae is not None and isinstance(module, getattr(vae, "AttnBlock", ())))
        or getattr(fn, "__module__", None) == _VAE  # what vae_attention() picked, in any VAE
        or isinstance(fn, _VaeAttention)
        or fn is vae_attention
    )


class SubquadModelAttention:
    """ComfyUI node: a MODEL whose attention runs in subquad within a memory budget."""

    DESCRIPTION = (
        "Runs the model's attention in subquad: exact attention in tiles that keep a memory budget "
        "(no out-of-memory in attention, no black images from fp16 overflow). Returns a patched copy."
    )
    CATEGORY = "advanced/model"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls) -> Dict[str, Any]:
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The diffusion model (SD1.x, SDXL, Flux, SD3, ...)."}),
                "memory_budget": (
                    "STRING",
                    {
                        "default": "",
                        "tooltip": "Extra memory one attention call may use, e.g. 512MiB or 2GB. "
                        f"Empty: {ENV_BUDGET} if set, else half the device's free memory.",
                    },
                ),
            }
        }

    def patch(self, model: Any, memory_budget: str = "") -> Tuple[Any]:
        return (patch_model(model, _node_budget(memory_budget)),)


class SubquadVAEAttention:
    """ComfyUI node: a VAE whose attention blocks run in subquad within a memory budget."""

    DESCRIPTION = (
        "Runs the VAE's attention blocks in subquad within a memory budget: decoding large images "
        "no longer builds the whole score matrix. Returns a copy; the VAE that came in is unchanged."
    )
    CATEGORY = "advanced/model"
    RETURN_TYPES = ("VAE",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls) -> Dict[str, Any]:
        return {
            "required": {
                "vae": ("VAE",),
                "memory_budget": (
                    "STRING",
                    {
                        "default": "",
                        "tooltip": "Extra memory one attention call may use, e.g. 256MiB. "
                        f"Empty: {ENV_BUDGET} if set, else half the device's free memory.",
                    },
                ),
            }
        }

    def patch(self, vae: Any, memory_budget: str = "") -> Tuple[Any]:
        return (patch_vae(vae, _node_budget(memory_budget)),)


NODE_CLASS_MAPPINGS: Dict[str, type] = {
    "SubquadModelAttention": SubquadModelAttention,
    "SubquadVAEAttention": SubquadVAEAttention,
}
NODE_DISPLAY_NAME_MAPPINGS: Dict[str, str] = {
    "SubquadModelAttention": "Subquad attention (model)",
    "SubquadVAEAttention": "Subquad attention (VAE)",
}


# --------------------------------------------------------------------------------------------
# For every model: the registry and default mode


def register() -> Hooks:
    """What the installed custom node runs when ComfyUI loads it.

    Adds ``"subquad"`` to ComfyUI's attention registry (where it has one; once), and turns on
    default mode (:func:`enable_default`) if ``SUBQUAD_COMFYUI_DEFAULT`` is ``1``/``true``/``yes``/``on``.
    Returns the hooks found.
    """
    found = hooks()
    if found.registry:
        attn = _host(_ATTENTION)
        known = getattr(attn, "REGISTERED_ATTENTION_FUNCTIONS", None)
        if not isinstance(known, dict) or NAME not in known:
            attn.register_attention_function(NAME, _host_attention())
    if os.environ.get(ENV_DEFAULT, "").strip().lower() in ("1", "true", "yes", "on"):
        enable_default()
    return found


_SAVED: Dict[Tuple[str, str], Any] = {}
"""What :func:`enable_default` replaced: ``(module name, attribute) -> original``."""

_DEFAULT_NAMES = (
    "optimized_attention",
    "optimized_attention_masked",
    "optimized_attention_for_device",
    "vae_attention",
)


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
        memory_budget: sets :data:`MEMORY_BUDGET` when given.

    Raises:
        HostUnsupported: the host has no ``optimized_attention`` to replace.
    """
    global MEMORY_BUDGET
    if memory_budget is not None:
        parse_budget(memory_budget)
        MEMORY_BUDGET = memory_budget
    found = hooks()
    attn = _host(_ATTENTION)
    if not callable(getattr(attn, "optimized_attention", None)):
        raise _unsupported(found, "for default mode", f"{_ATTENTION}.optimized_attention")
    fn = _host_attention()
    ours: Dict[str, Any] = {
        "optimized_attention": fn,
        "optimized_attention_masked": fn,
        "optimized_attention_for_device": _for_device,
    }
    originals: Dict[str, Any] = {name: _original(attn, name) for name in ours}
    if found.vae:
        vae = _host(_VAE)
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
        if module is not None and module.__dict__.get(name) in (_host_attention(), _for_device, _vae_attention_factory):
            setattr(module, name, original)
            restored.append(f"{module_name}.{name}")
        del _SAVED[(module_name, name)]
    return restored


def _for_device(device: Any, mask: bool = False, small_input: bool = False) -> Callable[..., Tensor]:
    """``optimized_attention_for_device`` in default mode: subquad for every device and input."""
    return _host_attention()


def _vae_attention_factory() -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """``vae_attention`` in default mode: what each new VAE block takes as its attention."""
    return _VaeAttention(None)


# --------------------------------------------------------------------------------------------
# subquad install comfyui DIR

_NODE_INIT = '''\
"""subquad for ComfyUI: exact attention in bounded memory.

Written by `subquad install comfyui`; `subquad uninstall comfyui <ComfyUI folder>` removes it.
The nodes are subquad's own code (subquad.integrations.comfyui), imported from the subquad
package installed in the Python that runs ComfyUI. Set SUBQUAD_COMFYUI_DEFAULT=1 before starting
ComfyUI to make subquad the attention of every model; SUBQUAD_MEMORY_BUDGET=512MiB sets the budget.
"""

import sys

try:
    from subquad.integrations import comfyui as _subquad_comfyui
except ImportError as error:
    raise ImportError(
        f"subquad is not importable in the Python that runs ComfyUI ({sys.executable}): {error}. "
        f"Install it there: {sys.executable} -m pip install 'subquad[torch]'"
    ) from error

NODE_CLASS_MAPPINGS = _subquad_comfyui.NODE_CLASS_MAPPINGS
NODE_DISPLAY_NAME_MAPPINGS = _subquad_comfyui.NODE_DISPLAY_NAME_MAPPINGS

_subquad_comfyui.register()
'''


def install(root: "str | Path") -> Path:
    """Write the custom node folder ``root/custom_nodes/subquad`` (idempotent); returns its path.

    Raises:
        HostNotFound: ``root`` is not a ComfyUI folder, or ``custom_nodes/subquad`` exists and is not ours.
    """
    host = find_host(root, "ComfyUI", MARKERS)
    return write_folder(host / "custom_nodes" / FOLDER, {"__init__.py": _NODE_INIT})


def uninstall(root: "str | Path") -> Optional[Path]:
    """Remove what :func:`install` wrote; the removed path, or ``None`` if there was nothing.

    Raises:
        HostNotFound: ``root`` is not a ComfyUI folder, or the folder there is not ours.
    """
    host = find_host(root, "ComfyUI", MARKERS)
    return remove_folder(host / "custom_nodes" / FOLDER)
