"""Per model: the MODEL and VAE nodes and the functions behind them, and the node that asks which attention.

The nodes read like ComfyUI's own (``INPUT_TYPES``, ``RETURN_TYPES``, ``FUNCTION``, a patch on a
clone) and hand every call to :mod:`._attention`. The rest of the package may use
:func:`patch_model`, :func:`patch_vae`, the node classes and the two mappings. The measuring of
**Which attention? (subquad)** is in :mod:`._which`.
"""

from __future__ import annotations

import copy
import logging
import sys
from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

from ..._for_wings import Budget, parse_budget
from .._host_budget import ENV_BUDGET, checked_budget
from ._attention import Override, Replace, VaeAttention, vae_attention
from ._hooks import VAE, hooks, host, unsupported
from ._which import Setting, chart, measure, patched, table

_log = logging.getLogger(__name__)


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
        patched.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = Override(
            memory_budget
        )
        return patched
    blocks = _unet_transformer_blocks(getattr(getattr(model, "model", None), "diffusion_model", None))
    if not found.replace or not blocks:
        raise unsupported(
            found,
            f"for this model ({type(getattr(model, 'model', model)).__name__})",
            "comfy.ldm.modules.attention.wrap_attn (transformer_options['optimized_attention_override']), "
            "or ModelPatcher.set_model_attn1_replace/set_model_attn2_replace on a UNet with transformer blocks",
        )
    patch = Replace(memory_budget)
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
        raise unsupported(found, "for the VAE", f"{VAE}.AttnBlock and vae_attention")
    root = vae.first_stage_model
    names = [name for name, module in root.named_modules() if _is_vae_attention_block(module)]
    if not names:
        _log.warning("subquad: this VAE (%s) has no attention blocks; returned unchanged.", type(root).__name__)
        return vae
    fn = VaeAttention(memory_budget)
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
    vae = sys.modules.get(VAE)
    return (
        (vae is not None and isinstance(module, getattr(vae, "AttnBlock", ())))
        or getattr(fn, "__module__", None) == VAE  # what vae_attention() picked, in any VAE
        or isinstance(fn, VaeAttention)
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
                "memory_budget": _budget_input("512MiB or 2GB"),
            }
        }

    def patch(self, model: Any, memory_budget: str = "") -> Tuple[Any]:
        return (patch_model(model, _node_budget(memory_budget)),)


def _node_budget(text: str) -> Budget:
    """A node's ``memory_budget`` input: empty means "not set here"; a typo is refused when the
    node runs (naming the input, in ComfyUI's error dialog), not at the first attention call."""
    return checked_budget(text, "memory_budget")


def _budget_input(examples: str) -> Tuple[str, Dict[str, str]]:
    """A node's ``memory_budget`` input: a string, empty by default."""
    return (
        "STRING",
        {
            "default": "",
            "tooltip": f"Extra memory one attention call may use, e.g. {examples}. "
            f"Empty: {ENV_BUDGET} if set, else half the device's free memory.",
        },
    )


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
                "memory_budget": _budget_input("256MiB"),
            }
        }

    def patch(self, vae: Any, memory_budget: str = "") -> Tuple[Any]:
        return (patch_vae(vae, _node_budget(memory_budget)),)


class SubquadWhichAttention:
    """ComfyUI node: which attention is fastest for this model, at this size, on this machine, and
    fits in memory: a chart, a table, and the model patched with the recommended one."""

    DESCRIPTION = (
        "Times one denoising step of your model (and a VAE decode, if given) with every attention this "
        "ComfyUI offers here and with subquad, in fair interleaved rounds, and measures peak memory. "
        "Returns a chart, the same table as text, and a copy of the model running the fastest that fits."
    )
    CATEGORY = "advanced/model"
    RETURN_TYPES = ("IMAGE", "STRING", "MODEL")
    RETURN_NAMES = ("chart", "table", "model")
    FUNCTION = "measure"

    @classmethod
    def INPUT_TYPES(cls) -> Dict[str, Any]:
        size = {"default": 512, "min": 64, "max": 8192, "step": 8}
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The diffusion model to time (it is not changed)."}),
                "width": ("INT", dict(size, tooltip="Image width in pixels.")),
                "height": ("INT", dict(size, tooltip="Image height in pixels.")),
                "batch_size": ("INT", {"default": 1, "min": 1, "max": 64}),
                "steps": ("INT", {"default": 1, "min": 1, "max": 100, "tooltip": "Denoising steps per timed call."}),
                "rounds": (
                    "INT",
                    {"default": 6, "min": 1, "max": 100, "tooltip": "Timed rounds; under 6 no winner can be named."},
                ),
            },
            "optional": {
                "vae": ("VAE", {"tooltip": "Also time a VAE decode at this size with each VAE attention."}),
                "memory_cap": ("STRING", {"default": "", "tooltip": "Peak memory a step may use, e.g. 4GiB."}),
            },
        }

    def measure(
        self,
        model: Any,
        width: int = 512,
        height: int = 512,
        batch_size: int = 1,
        steps: int = 1,
        rounds: int = 6,
        vae: Any = None,
        memory_cap: str = "",
    ) -> Tuple[Tensor, str, Any]:
        cap = checked_budget(memory_cap, "memory_cap")
        bar = host("comfy.utils").ProgressBar(1)
        setting = Setting(
            width,
            height,
            batch_size,
            steps,
            rounds,
            cap,
            progress=lambda done, total: bar.update_absolute(done, total),
            interrupted=host("comfy.model_management").throw_exception_if_processing_interrupted,
        )
        which = measure(model, vae, setting)
        out = patched(model, which.chosen) if which.chosen is not None else model.clone()
        return chart(which), table(which), out


NODE_CLASS_MAPPINGS: Dict[str, type] = {
    "SubquadModelAttention": SubquadModelAttention,
    "SubquadVAEAttention": SubquadVAEAttention,
    "SubquadWhichAttention": SubquadWhichAttention,
}
NODE_DISPLAY_NAME_MAPPINGS: Dict[str, str] = {
    "SubquadModelAttention": "Subquad attention (model)",
    "SubquadVAEAttention": "Subquad attention (VAE)",
    "SubquadWhichAttention": "Which attention? (subquad)",
}
