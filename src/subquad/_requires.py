"""PyTorch is an extra: what needs it, and what to install when it is missing.

``subquad.jax`` and ``subquad --version`` run without torch (``pip install "subquad[jax]"``), yet
Python runs ``subquad/__init__.py``, the torch face, before any submodule.
:func:`torch_face_wanted` tells ``import subquad`` from ``import subquad.jax`` there;
:func:`require_torch` is what every other use of subquad without torch meets. For the face and
the CLI; it imports nothing of subquad's.
"""

from __future__ import annotations

import sys
import types
from typing import Optional

TORCH_FREE = ("subquad.jax", "subquad._cli", "subquad.__main__", "subquad._version")
"""Modules (and their submodules) that import without torch."""

INSTALL_TORCH = (
    'subquad needs PyTorch: pip install "subquad[torch]" (or install PyTorch, https://pytorch.org). '
    'JAX users: import subquad.jax, which needs no PyTorch (pip install "subquad[jax]").'
)


def require_torch() -> None:
    """Import torch, or raise ``ModuleNotFoundError`` (``name="torch"``) saying what to install."""
    if not _torch_importable():
        raise ModuleNotFoundError(INSTALL_TORCH, name="torch")


def torch_face_wanted() -> bool:
    """Whether ``subquad/__init__`` imports its torch names: yes with torch, no without it while a
    torch-free module (:data:`TORCH_FREE`) is being imported; else :func:`require_torch`'s error."""
    if _torch_importable():
        return True
    if _importing_torch_free_module():
        return False
    raise ModuleNotFoundError(INSTALL_TORCH, name="torch")


def _torch_importable() -> bool:
    try:
        import torch  # noqa: F401 (the optional dependency; later imports find it in sys.modules)
    except ModuleNotFoundError as e:
        if e.name != "torch":  # torch is there but broken: its own error says more than ours
            raise
        return False
    return True


def _importing_torch_free_module() -> bool:
    # A package runs before its submodules, and nothing hands it the name that was asked for; the
    # import machinery's frames on this thread hold it: importlib's `_find_and_load(name, ...)` for
    # each module being imported (`import subquad.jax`, `from subquad._cli import main`), runpy's
    # `_get_module_details(mod_name, ...)` for `python -m subquad`. The frames are CPython's
    # internals: where they are not found the answer is no, and the user reads what to install.
    # (`from subquad import jax` imports the package by itself first: it needs torch.)
    frame: Optional[types.FrameType] = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_find_and_load" and "importlib" in code.co_filename:
            name = frame.f_locals.get("name")
        elif code.co_name == "_get_module_details" and "runpy" in code.co_filename:
            name = frame.f_locals.get("mod_name")
        else:
            name = None
        if isinstance(name, str) and any(name == m or name.startswith(m + ".") for m in TORCH_FREE):
            return True
        frame = frame.f_back
    return False
