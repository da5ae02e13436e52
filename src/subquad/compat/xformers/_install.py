"""``install()``: code written for xformers runs on subquad wherever xformers cannot run it.

- xformers cannot be imported: ``import xformers.ops`` (and ``xformers.ops.fmha``,
  ``xformers.ops.fmha.attn_bias``) resolve to :mod:`subquad.compat.xformers.ops`.
- xformers imports: its attention functions are wrapped; each call goes to xformers first and
  comes to subquad only when xformers says it has no operator for these inputs (its
  ``NotImplementedError("No operator found ...")``: CPU, Apple silicon, dtypes or head dims no
  kernel takes), or when the ``op=`` it was given cannot run on this device at all. Where
  xformers has an operator nothing changes.

xformers has no public "is there an operator for these inputs" check (its dispatch is private),
so the wrapper asks by calling. Used by the package face: :func:`install`, :class:`Installed`.
"""

from __future__ import annotations

import functools
import importlib.machinery
import sys
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch

from . import ops as _ours

_FUNCTIONS = (
    "memory_efficient_attention",
    "memory_efficient_attention_forward",
    "memory_efficient_attention_forward_requires_grad",
    "memory_efficient_attention_backward",
    "memory_efficient_attention_partial",
    "merge_attentions",
)
STAND_IN_VERSION = "0.0.35+subquad"  # the API it mirrors; the local label says whose it is


@dataclass(frozen=True)
class Installed:
    """What :func:`install` did.

    ``mode``: ``"stand-in"`` (xformers missing: ``names`` are the modules now provided) or
    ``"fallback"`` (xformers present: ``names`` are the functions wrapped). ``reason`` says why.
    """

    mode: str
    reason: str
    names: Tuple[str, ...]


_STATE: Optional[Installed] = None


def install() -> Installed:
    """Let code that imports xformers run on subquad where xformers cannot; idempotent.

    Call it before the code that imports xformers (a ``from xformers.ops import
    memory_efficient_attention`` done earlier keeps the function it got)::

        import subquad.compat.xformers
        subquad.compat.xformers.install()
        import xformers.ops as xops            # real xformers, or subquad's stand-in
        out = xops.memory_efficient_attention(q, k, v, attn_bias=xops.LowerTriangularMask())

    Returns:
        :class:`Installed` (the same object on every later call).
    """
    global _STATE
    if _STATE is not None:
        return _STATE
    root = sys.modules.get("xformers")
    if getattr(root, "__subquad_stand_in__", False):
        _STATE = Installed("stand-in", "subquad's stand-in was already in place", ("xformers",))
        return _STATE
    try:
        import xformers.ops.fmha as real_fmha  # optional dependency: the library this stands in for
    except ImportError as e:
        _STATE = _stand_in(f"xformers cannot be imported ({type(e).__name__}: {e})")
    except Exception as e:  # a broken install (e.g. built for another torch) is as good as none
        warnings.warn(
            f"xformers failed to import ({type(e).__name__}: {e}); using subquad's stand-in for it.", stacklevel=2
        )
        _STATE = _stand_in(f"xformers failed to import ({type(e).__name__}: {e})")
    else:
        _STATE = _fallback(real_fmha, sys.modules["xformers.ops"])
    return _STATE


def _stand_in(reason: str) -> Installed:
    root = types.ModuleType("xformers", "subquad's stand-in for xformers (subquad.compat.xformers.install()).")
    root.__spec__ = importlib.machinery.ModuleSpec("xformers", None, is_package=True)
    root.__path__ = []  # a package: its submodules are the entries below
    root.__version__ = STAND_IN_VERSION  # type: ignore[attr-defined]
    root.__subquad_stand_in__ = True  # type: ignore[attr-defined]
    root.ops = _ours  # type: ignore[attr-defined]
    modules = {
        "xformers": root,
        "xformers.ops": _ours,
        "xformers.ops.fmha": _ours.fmha,
        "xformers.ops.fmha.attn_bias": _ours.fmha.attn_bias,
    }
    sys.modules.update(modules)
    return Installed("stand-in", reason, tuple(modules))


def _fallback(real_fmha: types.ModuleType, real_ops: types.ModuleType) -> Installed:
    wrapped: List[str] = []
    for name in _FUNCTIONS:
        original = getattr(real_fmha, name, None)
        if original is None or getattr(original, "__subquad_fallback__", False):
            continue
        wrapper = _wrap(original, getattr(_ours.fmha, name), merge=name == "merge_attentions")
        for module in (real_fmha, real_ops):
            if getattr(module, name, None) is original:
                setattr(module, name, wrapper)
                wrapped.append(f"{module.__name__}.{name}")
    return Installed("fallback", "xformers imports; calls it has no operator for run on subquad", tuple(wrapped))


def _wrap(original: Callable[..., Any], ours: Callable[..., Any], *, merge: bool) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not merge and _op_cannot_run(kwargs.get("op"), _device(args, kwargs)):
            return ours(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        except NotImplementedError as e:
            # merge_attentions has CUDA/triton kernels only: any backend refusal means "not here".
            if not (merge or str(e).startswith("No operator found")):
                raise
        except ModuleNotFoundError:  # merge_attentions' triton kernels on a machine without triton
            if not merge:
                raise
        return ours(*args, **kwargs)

    call.__subquad_fallback__ = True  # type: ignore[attr-defined]
    return call


def _device(args: Tuple[Any, ...], kwargs: dict) -> Optional[torch.device]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def _op_cannot_run(op: Any, device: Optional[torch.device]) -> bool:
    """Whether a named xformers operator can never run here (another device, or not built)."""
    for o in op if isinstance(op, (tuple, list)) else (op,):
        if o is None:
            continue
        devices = getattr(o, "SUPPORTED_DEVICES", None)
        if device is not None and devices is not None and device.type not in devices:
            return True
        available = getattr(o, "is_available", None)
        if callable(available) and not available():
            return True
    return False
