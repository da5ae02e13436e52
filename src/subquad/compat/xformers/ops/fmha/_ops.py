"""Names of xformers' operators, so that code passing ``op=...`` keeps working; subquad ignores ``op``.

xformers picks a kernel (flash, cutlass, ck, triton split-K) per call, or takes one as ``op``.
subquad has one implementation that plans its own tiles, so every ``op`` -- these stand-ins,
real xformers operators, or ``None`` -- runs the same computation. Used by the rest of the
package: the classes and tuples below.
"""

from __future__ import annotations

from typing import Optional, Tuple, Type


class AttentionOpBase:
    """Stand-in for xformers' operator base class; ``NAME`` says which xformers operator it names."""

    NAME = "subquad"
    SUPPORTED_DEVICES = frozenset({"cpu", "cuda", "mps", "xpu"})

    @classmethod
    def is_available(cls) -> bool:
        return True


class AttentionFwOpBase(AttentionOpBase):
    """Stand-in for a forward operator."""


class AttentionBwOpBase(AttentionOpBase):
    """Stand-in for a backward operator."""


AttentionOp = Tuple[Optional[Type[AttentionFwOpBase]], Optional[Type[AttentionBwOpBase]]]
"""The type of an ``op=`` argument: a ``(forward operator, backward operator)`` pair, as in xformers."""


def _pair(name: str) -> AttentionOp:
    fw = type(
        f"{name}FwOp", (AttentionFwOpBase,), {"NAME": f"{name}F", "__doc__": f"Stand-in for xformers' {name} forward."}
    )
    bw = type(
        f"{name}BwOp", (AttentionBwOpBase,), {"NAME": f"{name}B", "__doc__": f"Stand-in for xformers' {name} backward."}
    )
    return fw, bw


MemoryEfficientAttentionCutlassOp = _pair("cutlass")
"""Stand-in for xformers' CUTLASS operator pair; accepted as ``op=`` and ignored."""
MemoryEfficientAttentionFlashAttentionOp = _pair("flash")
"""Stand-in for xformers' flash-attention operator pair; accepted as ``op=`` and ignored."""
MemoryEfficientAttentionCutlassFwdFlashBwOp = (
    MemoryEfficientAttentionCutlassOp[0],
    MemoryEfficientAttentionFlashAttentionOp[1],
)
"""Stand-in for xformers' CUTLASS-forward, flash-backward pair; accepted as ``op=`` and ignored."""
MemoryEfficientAttentionCkOp = _pair("ck")
"""Stand-in for xformers' Composable Kernel (ROCm) operator pair; accepted as ``op=`` and ignored."""
MemoryEfficientAttentionSplitKCkOp = (_pair("ck_splitK")[0], MemoryEfficientAttentionCkOp[1])
"""Stand-in for xformers' split-K Composable Kernel pair; accepted as ``op=`` and ignored."""

ALL_FW_OPS = [
    op
    for op, _ in (
        MemoryEfficientAttentionCutlassOp,
        MemoryEfficientAttentionFlashAttentionOp,
        MemoryEfficientAttentionCkOp,
    )
]
"""The forward stand-ins, as xformers lists its forward operators."""
ALL_BW_OPS = [
    op
    for _, op in (
        MemoryEfficientAttentionCutlassOp,
        MemoryEfficientAttentionFlashAttentionOp,
        MemoryEfficientAttentionCkOp,
    )
]
"""The backward stand-ins, as xformers lists its backward operators."""
