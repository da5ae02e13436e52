"""``flash_attn.layers.rotary``: ``apply_rotary_emb`` (and its old name ``apply_rotary_emb_func``).

flash-attn's ``RotaryEmbedding`` module and the in-place qkv/kv variants are not provided.
"""

from .._rotary import apply_rotary_emb

apply_rotary_emb_func = apply_rotary_emb  # flash-attn keeps this alias for backward compatibility
"""flash-attn's old name for :func:`apply_rotary_emb` (the same function)."""

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func"]
