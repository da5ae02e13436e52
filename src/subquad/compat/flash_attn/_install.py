"""``install()``: make ``import flash_attn`` resolve to this package where flash-attn cannot be imported.

Used by the rest of the package: :func:`install`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

# The module names code imports flash-attn's functions from, and the stand-in for each
# (relative to this package).
STAND_INS = {
    "flash_attn": "",
    "flash_attn.flash_attn_interface": "flash_attn_interface",
    "flash_attn.bert_padding": "bert_padding",
    "flash_attn.layers": "layers",
    "flash_attn.layers.rotary": "layers.rotary",
}


def install() -> bool:
    """Make ``import flash_attn`` give :mod:`subquad.compat.flash_attn` when flash-attn itself cannot be imported.

    Opt-in, one line before the model's imports::

        import subquad.compat.flash_attn as fa
        fa.install()
        from flash_attn import flash_attn_func          # subquad's, on a machine without CUDA

    The real package is tried first (imported): if it imports, nothing changes and this returns
    False, so a working install is never shadowed. If importing it raises ``ImportError`` (not
    installed, its CUDA extension missing, an undefined symbol) or ``OSError`` (a CUDA library
    that cannot be loaded), what that attempt left in ``sys.modules`` is removed and
    ``flash_attn``, ``flash_attn.flash_attn_interface``, ``flash_attn.bert_padding``,
    ``flash_attn.layers`` and ``flash_attn.layers.rotary`` are registered as this package's
    modules (also where ``sys.modules["flash_attn"] is None``, Python's way of blocking an
    import). Idempotent: a second call changes nothing and returns the same answer.

    Returns:
        True if ``import flash_attn`` now resolves to subquad's stand-in, False if to flash-attn.

    Raises:
        Exception: any other exception that importing flash-attn raises propagates (a bug there
            is not hidden).
    """
    package = sys.modules[__name__.rpartition(".")[0]]
    present = sys.modules.get("flash_attn")
    if present is package:
        return True
    if present is not None:
        return False  # flash-attn itself is already imported
    blocked = "flash_attn" in sys.modules  # sys.modules["flash_attn"] = None: "do not import it"
    if not blocked and _importable():
        return False
    for name, own in STAND_INS.items():
        # The package's __init__ has imported every stand-in: they are in sys.modules already.
        sys.modules[name] = sys.modules[f"{package.__name__}.{own}"] if own else package
    return True


def _importable() -> bool:
    """Whether the real flash-attn imports; a failed attempt leaves nothing in ``sys.modules``."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        importlib.import_module("flash_attn")
    except (ImportError, OSError):
        for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
            del sys.modules[name]
        return False
    return True
