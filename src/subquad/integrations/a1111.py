"""AUTOMATIC1111 integration: subquad as one of the web UI's cross-attention optimizations.

::

    subquad install a1111 ~/stable-diffusion-webui   # writes extensions/subquad/, then restart the web UI

Inside the web UI this gives the optimization **subquad** (its title in the list is
:data:`TITLE`), next to sdp, sub-quadratic, Doggettx and the others in Settings → Optimizations →
Cross attention optimization. Like them it is an ``SdOptimization`` that the extension's script
registers with ``script_callbacks.on_list_optimizers``; choosing it runs :func:`apply`, which
replaces ``CrossAttention.forward`` and the VAE's ``AttnBlock.forward`` in ``ldm`` (SD1.x/SD2.x)
and ``sgm`` (SDXL) with :func:`cross_attention_forward`, :func:`sgm_cross_attention_forward` and
:func:`attnblock_forward`. Choosing another optimization runs A1111's own ``undo()``, which puts
its defaults back.

"Automatic" never picks it: its :data:`PRIORITY` is below every built-in optimization's on every
device, and it has no command-line flag (``cmd_opt`` is ``None``).

What the forwards keep from A1111's own: hypernetworks are applied to the keys and values
(``apply_hypernetworks``); "Upcast cross attention layer to float32" (``opts.upcast_attn``) casts
q, k, v to float32 and the result back; the output has the input's dtype. Without the upcast,
half-precision inputs still get float32 scores, softmax and accumulators inside subquad, so fp16
scores that would overflow give finite, exact results (on MPS, torch's MPSGraph path, which subquad
uses where it fits, rounds the scores to the inputs' dtype: the upcast setting keeps them float32). Under autocast the attention call runs with
autocast off (subquad chooses its own precision). Masks are read as each library's own
``forward`` reads them (``ldm``: a key mask ``(B, ...)`` flattened to ``(B, Lk)``, True = attend;
``sgm``: an SDPA mask); ``sgm``'s ``additional_tokens`` and ``n_times_crossframe_attn_in_self``
are honoured.

The memory budget of a call is the setting "subquad memory budget" (:data:`SETTING`, in Settings →
Optimizations) if not empty, else the environment variable ``SUBQUAD_MEMORY_BUDGET``, else
subquad's default (half the device's free memory).

A1111 and its ``ldm``/``sgm`` packages are AGPL-3.0 / MIT: nothing of their code is copied here.
They are imported only by the functions that run inside the web UI (``import subquad`` never
imports this module; importing it needs only torch and subquad).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from pathlib import Path
from typing import Any, ContextManager, Dict, List, Optional

import torch
from torch import Tensor

import subquad
from subquad import ArgumentError

from .._for_wings import Budget, build_native_in_background
from ._host_budget import ENV_BUDGET, checked_budget, env_budget
from ._hosts import REQUIREMENT, HostNotFound, find_host, pip_install, remove_folder, write_folder

__all__ = [
    "NAME",
    "LABEL",
    "TITLE",
    "PRIORITY",
    "SETTING",
    "ENV_BUDGET",
    "optimization",
    "list_optimizers",
    "on_ui_settings",
    "apply",
    "memory_budget",
    "cross_attention_forward",
    "sgm_cross_attention_forward",
    "attnblock_forward",
    "install",
    "uninstall",
    "MARKERS",
    "FOLDER",
]

NAME = "subquad"
LABEL = "exact attention in a memory budget"
TITLE = f"{NAME} - {LABEL}"
"""What Settings → Optimizations lists and saves (``SdOptimization.title()``); kept stable, since a
saved title that no longer matches makes A1111 fall back to its first optimization."""

PRIORITY = -100
"""Below every built-in optimization on every device (the lowest is 10), so "Automatic", which
takes the highest priority, never picks subquad; only choosing it does."""

SETTING = "subquad_memory_budget"
"""The key of the setting "subquad memory budget" in ``shared.opts`` (a string such as ``512MiB``)."""


MARKERS = ("webui.py", "modules/script_callbacks.py", "modules/sd_hijack_optimizations.py")
"""What makes a folder an AUTOMATIC1111 checkout for :func:`install` (``extensions/`` is created if absent)."""

FOLDER = "subquad"
"""The extension folder :func:`install` writes into ``extensions/``."""

_HOST = "AUTOMATIC1111 stable-diffusion-webui"
_FORGE_MARKERS = ("modules_forge", "backend/attention.py")


# --------------------------------------------------------------------------------------------
# The host, imported only inside it


def _module(name: str) -> Any:
    """A module of the running web UI (already imported there; imported here otherwise)."""
    found = sys.modules.get(name)
    return found if found is not None else importlib.import_module(name)


def memory_budget() -> Budget:
    """The budget of the next call: the setting :data:`SETTING`, else ``SUBQUAD_MEMORY_BUDGET``, else ``None``.

    Raises:
        ArgumentError: the setting or the variable is not a memory budget (says which, what would
            work, and the value).
    """
    opts = _module("modules.shared").opts
    setting = checked_budget(
        getattr(opts, SETTING, None), f"subquad memory budget (Settings → Optimizations, {SETTING})"
    )
    return setting if setting is not None else env_budget()


def _autocast_off(device_type: str) -> ContextManager[Any]:
    try:
        return torch.autocast(device_type, enabled=False)
    except (RuntimeError, ValueError):  # a device type this torch has no autocast for
        return contextlib.nullcontext()


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: Optional[float]) -> Tensor:
    """``(B, H, L, E)`` attention as A1111's optimizations do it: upcast if asked, result in q's dtype."""
    dtype = q.dtype
    if getattr(_module("modules.shared").opts, "upcast_attn", False):
        q, k, v = q.float(), k.float(), v.float()
    with _autocast_off(q.device.type):
        out = subquad.attention(q, k, v, attn_mask=mask, scale=scale, memory_budget=memory_budget())
    assert isinstance(out, Tensor)
    return out.to(dtype)


def _split_heads(t: Tensor, heads: int) -> Tensor:
    """``(B, L, H*D)`` -> ``(B, H, L, D)`` (a view)."""
    split: Tensor = t.unflatten(-1, (heads, -1))
    return split.transpose(1, 2)


def _keys_and_values(context: Tensor) -> "tuple[Tensor, Tensor]":
    hypernetwork = _module("modules.hypernetworks.hypernetwork")
    context_k: Tensor
    context_v: Tensor
    context_k, context_v = hypernetwork.apply_hypernetworks(_module("modules.shared").loaded_hypernetworks, context)
    return context_k, context_v


# --------------------------------------------------------------------------------------------
# The forwards apply() installs (methods of ldm's and sgm's classes)


def cross_attention_forward(
    self: Any, x: Tensor, context: Optional[Tensor] = None, mask: Optional[Tensor] = None, **kwargs: Any
) -> Tensor:
    """``ldm.modules.attention.CrossAttention.forward`` in subquad.

    ``x (B, Lq, C)``, ``context (B, Lk, Cc)`` (``None``: self-attention), ``mask`` a key mask
    ``(B, ...)`` that flattens to ``(B, Lk)`` (bool, True = attend; a float mask is added), as
    ``ldm`` reads it. Other keywords (passed by some extensions) are ignored, as A1111's own
    optimizations ignore them. A query row whose keys are all masked gives 0 here (``ldm`` gives
    the mean of all values).
    """
    h = self.heads
    q = self.to_q(x)
    context_k, context_v = _keys_and_values(x if context is None else context)
    k, v = self.to_k(context_k), self.to_v(context_v)
    if mask is not None:
        mask = mask.reshape(mask.shape[0], 1, 1, -1)
    out = _attend(_split_heads(q, h), _split_heads(k, h), _split_heads(v, h), mask, getattr(self, "scale", None))
    result: Tensor = self.to_out(out.transpose(1, 2).flatten(2))
    return result


def sgm_cross_attention_forward(
    self: Any,
    x: Tensor,
    context: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    additional_tokens: Optional[Tensor] = None,
    n_times_crossframe_attn_in_self: int = 0,
    **kwargs: Any,
) -> Tensor:
    """``sgm.modules.attention.CrossAttention.forward`` in subquad.

    As :func:`cross_attention_forward`, with ``sgm``'s reading of the rest: ``mask`` is an SDPA
    mask broadcastable to ``(B, H, Lq, Lk)``; ``additional_tokens (B, T, C)`` are prepended to the
    queries and removed from the output; ``n_times_crossframe_attn_in_self = n`` makes every group
    of ``n`` frames read the keys and values of its first frame.
    """
    h = self.heads
    n_extra = 0
    if additional_tokens is not None:
        n_extra = additional_tokens.shape[1]
        x = torch.cat([additional_tokens, x], dim=1)
    q = self.to_q(x)
    context_k, context_v = _keys_and_values(x if context is None else context)
    k, v = self.to_k(context_k), self.to_v(context_v)
    if n_times_crossframe_attn_in_self:
        n = n_times_crossframe_attn_in_self
        if x.shape[0] % n:
            raise ArgumentError(
                f"n_times_crossframe_attn_in_self={n} must divide the batch, got a batch of {x.shape[0]}."
            )
        k = k[::n].repeat_interleave(x.shape[0] // n, dim=0)
        v = v[::n].repeat_interleave(x.shape[0] // n, dim=0)
    out = _attend(_split_heads(q, h), _split_heads(k, h), _split_heads(v, h), mask, getattr(self, "scale", None))
    out = out.transpose(1, 2).flatten(2)
    result: Tensor = self.to_out(out[:, n_extra:])
    return result


def attnblock_forward(self: Any, x: Tensor, **kwargs: Any) -> Tensor:
    """The VAE's ``AttnBlock.forward`` (``ldm`` and ``sgm``) in subquad: one head over the ``H*W`` pixels.

    ``x (B, C, H, W)`` -> ``x + proj_out(attention(q, k, v))`` with ``q, k, v (B, 1, H*W, C)``,
    scale ``1/sqrt(C)``.
    """
    h_ = self.norm(x)
    q, k, v = self.q(h_), self.k(h_), self.v(h_)
    b, c, height, width = q.shape
    q, k, v = (t.reshape(b, 1, c, height * width).transpose(-1, -2) for t in (q, k, v))
    out = _attend(q, k, v, None, None)
    out = out.transpose(-1, -2).reshape(b, c, height, width)
    result: Tensor = x + self.proj_out(out)
    return result


# --------------------------------------------------------------------------------------------
# The optimization A1111 lists


def apply() -> None:
    """Make subquad the attention of ``ldm`` and ``sgm`` (what the optimization's ``apply()`` does).

    A1111's ``SdOptimization.undo()`` restores its defaults; ``sgm`` is skipped where the web UI
    has none (versions before SDXL support).
    """
    ldm_attention = _module("ldm.modules.attention")
    ldm_model = _module("ldm.modules.diffusionmodules.model")
    ldm_attention.CrossAttention.forward = cross_attention_forward
    ldm_model.AttnBlock.forward = attnblock_forward
    try:
        sgm_attention = _module("sgm.modules.attention")
        sgm_model = _module("sgm.modules.diffusionmodules.model")
    except ImportError:
        return
    sgm_attention.CrossAttention.forward = sgm_cross_attention_forward
    sgm_model.AttnBlock.forward = attnblock_forward


@functools.lru_cache(maxsize=None)
def _optimization_class(base: type) -> type:
    class SdOptimizationSubquad(base):
        name = NAME
        label = LABEL
        cmd_opt = None
        priority = PRIORITY

        def is_available(self) -> bool:
            return True

        def apply(self) -> None:
            apply()

    SdOptimizationSubquad.__module__ = __name__
    SdOptimizationSubquad.__qualname__ = "SdOptimizationSubquad"
    return SdOptimizationSubquad


def optimization() -> Any:
    """A new instance of subquad's ``SdOptimization`` subclass (made on first use, inside the web UI).

    Raises:
        ImportError: not inside AUTOMATIC1111 (``modules.sd_hijack_optimizations`` is missing).
    """
    base = _module("modules.sd_hijack_optimizations").SdOptimization
    return _optimization_class(base)()


def list_optimizers(res: List[Any]) -> None:
    """The ``on_list_optimizers`` callback: appends subquad's optimization to A1111's list."""
    res.append(optimization())


def prepare_native() -> bool:
    """Build subquad's native kernel in the background when the web UI starts, where it is not
    built and a compiler is found (``SUBQUAD_NATIVE=off`` skips it): the next start runs the loops
    where this CPU's calibration finds them faster. Returns whether a build was started."""
    return build_native_in_background()


def on_ui_settings() -> None:
    """The ``on_ui_settings`` callback: the setting "subquad memory budget" in Settings → Optimizations."""
    shared = _module("modules.shared")
    gradio = _module("gradio")
    info = shared.OptionInfo(
        "",
        "subquad memory budget (e.g. 512MiB or 2GiB; empty: $SUBQUAD_MEMORY_BUDGET, else half the free memory)",
        gradio.Textbox,
        section=("optimizations", "Optimizations"),
    )
    if hasattr(info, "category_id"):  # newer web UIs group sections into categories
        info.category_id = "sd"
    shared.opts.add_option(SETTING, info)


# --------------------------------------------------------------------------------------------
# subquad install a1111 DIR

_SCRIPT = '''\
"""subquad as a cross-attention optimization of the web UI (written by `subquad install a1111`).

Choose "{title}" in Settings -> Optimizations -> Cross attention optimization.
Remove this extension with `subquad uninstall a1111 <web UI folder>`.
"""

from modules import script_callbacks

try:
    from subquad.integrations import a1111 as subquad_a1111
except ImportError as error:
    print(
        f"[subquad] the extension is not active: {{error}}. Install subquad into the web UI's Python "
        "(its venv: `{install}`) and restart the web UI."
    )
else:
    script_callbacks.on_list_optimizers(subquad_a1111.list_optimizers)
    script_callbacks.on_ui_settings(subquad_a1111.on_ui_settings)
    subquad_a1111.prepare_native()
'''

_INSTALL = '''\
"""Run by the web UI at start (written by `subquad install a1111`): installs subquad into its Python if missing."""

import launch

if not launch.is_installed("{requirement}"):
    launch.run_pip("install \\"{requirement}>={version}\\"", "subquad for the subquad extension")
'''


def _files() -> Dict[str, str]:
    return {
        "scripts/subquad_optimization.py": _SCRIPT.format(title=TITLE, install=pip_install("venv/bin/python")),
        "install.py": _INSTALL.format(requirement=REQUIREMENT, version=subquad.__version__),
    }


def install(root: "str | Path") -> Path:
    """Write the extension folder ``root/extensions/subquad`` (idempotent); returns its path.

    Restart the web UI, then choose :data:`TITLE` in Settings → Optimizations.

    Raises:
        HostNotFound: ``root`` is not an AUTOMATIC1111 folder (it names the files looked for), it
            is Stable Diffusion WebUI Forge (whose attention does not go through A1111's
            optimizations), or ``extensions/subquad`` exists and is not ours.
    """
    host = find_host(root, _HOST, MARKERS)
    forge = [m for m in _FORGE_MARKERS if (host / m).exists()]
    if forge:
        raise HostNotFound(
            f"{host} is Stable Diffusion WebUI Forge (it has {', '.join(forge)}), not {_HOST}: Forge "
            "switches A1111's cross-attention optimizations off and picks its attention in backend/attention.py, "
            "so this extension would do nothing there. See subquad's docs/hosts.md (Forge) for what works."
        )
    return write_folder(host / "extensions" / FOLDER, _files())


def uninstall(root: "str | Path") -> Optional[Path]:
    """Remove what :func:`install` wrote; the removed path, or ``None`` if there was nothing.

    Raises:
        HostNotFound: ``root`` is not an AUTOMATIC1111 folder, or the folder there is not ours.
    """
    host = find_host(root, _HOST, MARKERS)
    return remove_folder(host / "extensions" / FOLDER)
