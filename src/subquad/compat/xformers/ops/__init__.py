"""``xformers.ops`` over subquad: the attention names models import from it.

``memory_efficient_attention`` (and its forward/backward variants), ``fmha`` (with
``fmha.attn_bias``), the bias names re-exported here (``LowerTriangularMask``, ``AttentionBias``
and its old alias ``AttentionMask``), the operator names (accepted as ``op=``, ignored) and
``unbind``. xformers' other ops (SwiGLU, RMSNorm, sparse, sequence parallel) are not provided.
"""

from . import fmha
from ._unbind import unbind
from .fmha import (
    AttentionBias,
    AttentionOp,
    AttentionOpBase,
    LowerTriangularMask,
    MemoryEfficientAttentionCkOp,
    MemoryEfficientAttentionCutlassFwdFlashBwOp,
    MemoryEfficientAttentionCutlassOp,
    MemoryEfficientAttentionFlashAttentionOp,
    MemoryEfficientAttentionSplitKCkOp,
    memory_efficient_attention,
    memory_efficient_attention_backward,
    memory_efficient_attention_forward,
    memory_efficient_attention_forward_requires_grad,
)

AttentionMask = AttentionBias  # xformers' old name
"""xformers' old name for :class:`~subquad.compat.xformers.ops.fmha.attn_bias.AttentionBias` (the same class)."""

__all__ = [
    "fmha",
    "memory_efficient_attention",
    "memory_efficient_attention_forward",
    "memory_efficient_attention_forward_requires_grad",
    "memory_efficient_attention_backward",
    "AttentionBias",
    "AttentionMask",
    "AttentionOp",
    "AttentionOpBase",
    "LowerTriangularMask",
    "MemoryEfficientAttentionCutlassOp",
    "MemoryEfficientAttentionCutlassFwdFlashBwOp",
    "MemoryEfficientAttentionFlashAttentionOp",
    "MemoryEfficientAttentionCkOp",
    "MemoryEfficientAttentionSplitKCkOp",
    "unbind",
]
