"""``xformers.ops.unbind``: models import it beside ``memory_efficient_attention`` (DINOv2's ``qkv``)."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor


def unbind(x: Tensor, dim: int) -> Tuple[Tensor, ...]:
    """``torch.unbind(x, dim)``: views of ``x`` without the axis ``dim`` (xformers' version shares
    one gradient buffer between them; autograd's is equivalent)."""
    return torch.unbind(x, dim)
