"""``xformers.ops.fmha`` over subquad: ``memory_efficient_attention`` and friends, ``attn_bias``.

Same names, signatures and results as xformers 0.0.35 (see ``docs/compat-xformers.md``)::

    from subquad.compat.xformers.ops import fmha
    out = fmha.memory_efficient_attention(q, k, v, attn_bias=fmha.attn_bias.LowerTriangularMask())
"""

from . import attn_bias
from ._api import (
    memory_efficient_attention,
    memory_efficient_attention_backward,
    memory_efficient_attention_forward,
    memory_efficient_attention_forward_requires_grad,
    memory_efficient_attention_partial,
    merge_attentions,
)
from ._ops import (
    ALL_BW_OPS,
    ALL_FW_OPS,
    AttentionBwOpBase,
    AttentionFwOpBase,
    AttentionOp,
    AttentionOpBase,
    MemoryEfficientAttentionCkOp,
    MemoryEfficientAttentionCutlassFwdFlashBwOp,
    MemoryEfficientAttentionCutlassOp,
    MemoryEfficientAttentionFlashAttentionOp,
    MemoryEfficientAttentionSplitKCkOp,
)
from .attn_bias import VARLEN_BIASES, AttentionBias, BlockDiagonalMask, LowerTriangularMask

__all__ = [
    "memory_efficient_attention",
    "memory_efficient_attention_forward",
    "memory_efficient_attention_forward_requires_grad",
    "memory_efficient_attention_backward",
    "memory_efficient_attention_partial",
    "merge_attentions",
    "attn_bias",
    "AttentionBias",
    "BlockDiagonalMask",
    "LowerTriangularMask",
    "VARLEN_BIASES",
    "AttentionOp",
    "AttentionOpBase",
    "AttentionFwOpBase",
    "AttentionBwOpBase",
    "MemoryEfficientAttentionCutlassOp",
    "MemoryEfficientAttentionCutlassFwdFlashBwOp",
    "MemoryEfficientAttentionFlashAttentionOp",
    "MemoryEfficientAttentionCkOp",
    "MemoryEfficientAttentionSplitKCkOp",
    "ALL_FW_OPS",
    "ALL_BW_OPS",
]
