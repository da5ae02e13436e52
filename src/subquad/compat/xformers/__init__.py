"""xformers' attention API over subquad, on every device.

``subquad.compat.xformers.ops`` stands for ``xformers.ops`` (``memory_efficient_attention``,
``fmha.attn_bias``); :func:`install` makes ``import xformers.ops`` work with it where xformers is
missing, and routes calls to it where xformers has no operator for the inputs (CPU, Apple
silicon). See ``docs/compat-xformers.md``. Nothing here imports xformers unless ``install()`` is
called or one of its bias objects is read (by class name, without importing it).
"""

from . import ops
from ._install import Installed, install

__all__ = ["ops", "install", "Installed"]
