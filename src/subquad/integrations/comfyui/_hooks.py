"""Which of ComfyUI's hooks the running ComfyUI has: decided here, in one place.

The rest of the package may use :func:`hooks`, :class:`Hooks`, :func:`host` (a module of the
running ComfyUI), :func:`unsupported` (the error naming its version), :func:`host_attention`
(:func:`~._attention.attention` wrapped as ComfyUI wraps its own) and :class:`HostUnsupported`.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable

from torch import Tensor

from ._attention import attention

ATTENTION = "comfy.ldm.modules.attention"
VAE = "comfy.ldm.modules.diffusionmodules.model"


class HostUnsupported(NotImplementedError):
    """The running ComfyUI has none of the hooks a subquad feature needs (the message names its version)."""

    __module__ = "subquad.integrations.comfyui"  # the public name ComfyUI's error dialog shows


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


def host(name: str) -> Any:
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
    attn = host(ATTENTION)
    patcher = host("comfy.model_patcher").ModelPatcher
    try:
        vae = host(VAE)
    except ImportError:
        vae = None
    return Hooks(
        version=_version(),
        registry=callable(getattr(attn, "register_attention_function", None)),
        override=callable(getattr(attn, "wrap_attn", None)),
        replace=all(callable(getattr(patcher, f"set_model_attn{i}_replace", None)) for i in (1, 2)),
        vae=vae is not None and hasattr(vae, "AttnBlock") and callable(getattr(vae, "vae_attention", None)),
    )


def unsupported(found: Hooks, what: str, needs: str) -> HostUnsupported:
    return HostUnsupported(
        f"This ComfyUI (version {found.version}) has none of the hooks subquad needs {what}: looked for {needs}. "
        "Update ComfyUI, or report the version at subquad's issue tracker."
    )


@functools.lru_cache(maxsize=None)
def _wrapped(attn: Any) -> Callable[..., Tensor]:
    """:func:`attention` as ComfyUI wraps its own (``wrap_attn``), so a model's override still applies."""
    wrap = getattr(attn, "wrap_attn", None)
    return wrap(attention) if callable(wrap) else attention


def host_attention() -> Callable[..., Tensor]:
    return _wrapped(host(ATTENTION))
