"""``flash_attn.layers``: only ``rotary`` (``apply_rotary_emb``)."""

from . import rotary

__all__ = ["rotary"]
