"""The exception classes every front end raises: torch calls, ``subquad.jax``, ``subquad.distributed``.

The lowest module of the package (it imports nothing of subquad's): anything may raise these.
Each is public as ``subquad.<name>`` and says so in tracebacks (``__module__``), so a host's
error dialog (ComfyUI, AUTOMATIC1111) shows ``subquad.ArgumentError``, not a private module.
"""

from __future__ import annotations


class ArgumentError(ValueError, RuntimeError):
    """An invalid argument.

    Also a ``RuntimeError``: torch's SDPA raises ``RuntimeError`` for the same inputs, so code
    written for SDPA (``except RuntimeError``) keeps working with subquad.
    """

    __module__ = "subquad"


class ArgumentTypeError(TypeError, RuntimeError):
    """An argument of the wrong type (also a ``RuntimeError``, see :class:`ArgumentError`)."""

    __module__ = "subquad"


class MemoryBudgetError(MemoryError):
    """The memory budget is too small for even the smallest tiles of every backend."""

    __module__ = "subquad"
