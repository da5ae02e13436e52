"""flash-attn's API over subquad, on every device: ``import subquad.compat.flash_attn as flash_attn``.

The seven attention functions of ``flash_attn`` 2.8 (same names, argument order, defaults,
layouts and errors), ``bert_padding``, ``layers.rotary.apply_rotary_emb``, and :func:`install`,
which makes ``import flash_attn`` resolve here where flash-attn cannot be imported (no CUDA).
See ``docs/compat-flash-attn.md`` for what maps to what and what differs.
"""

from . import bert_padding, flash_attn_interface, layers
from ._install import install
from ._interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from ._kvcache import flash_attn_with_kvcache

__version__ = "2.8.3"  # the flash-attn API this package mirrors (code that checks flash_attn.__version__)

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "bert_padding",
    "flash_attn_interface",
    "layers",
    "install",
]
