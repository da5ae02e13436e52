"""``flash_attn.flash_attn_interface``'s public functions, for code that imports them from there.

``from flash_attn.flash_attn_interface import flash_attn_varlen_func`` resolves here after
:func:`~subquad.compat.flash_attn.install`. flash-attn's private kernels (``_flash_attn_forward``
and friends) are not provided.
"""

from ._interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from ._kvcache import flash_attn_with_kvcache

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
