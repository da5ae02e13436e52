"""Attention over a union of key chunks from each chunk's output and lse (``merge_attentions``).

Plain PyTorch, differentiable; used by the rest of the package: :func:`merge`.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from subquad import ArgumentError

Chunks = Union[Tensor, Sequence[Tensor]]


def _as_lists(attn_split: Chunks, lse_split: Chunks) -> Tuple[List[Tensor], List[Tensor], bool]:
    """Chunks as ``(B, M, G, H, K)`` outputs and ``(B, G, H, M)`` lses; whether they came without ``G``."""
    if isinstance(attn_split, Tensor) and isinstance(lse_split, Tensor) and attn_split.dim() != lse_split.dim() + 1:
        raise ArgumentError(
            f"Incompatible input shapes: attn_split.shape={attn_split.shape}, lse_split.shape={lse_split.shape}"
        )
    attns = list(attn_split.unbind(0) if isinstance(attn_split, Tensor) else attn_split)
    lses = list(lse_split.unbind(0) if isinstance(lse_split, Tensor) else lse_split)
    if len(attns) != len(lses):
        raise ArgumentError(
            f"Incompatible number of LSE and attention chunks: len(attn_split)={len(attns)}, len(lse_split)={len(lses)}"
        )
    if not attns:
        raise ArgumentError("merge_attentions: expected at least one chunk, got none.")
    no_groups = attns[0].dim() == 4
    for i, (o, s) in enumerate(zip(attns, lses)):
        if o.dim() != s.dim() + 1 or o.dim() not in (4, 5):
            raise ArgumentError(
                f"Incompatible input shapes for chunk {i}: attn_split[i].shape={o.shape}, lse_split[i].shape={s.shape}"
            )
    if no_groups:
        attns, lses = [o.unsqueeze(2) for o in attns], [s.unsqueeze(1) for s in lses]
    B, M, G, H, K = attns[0].shape
    for i, (o, s) in enumerate(zip(attns, lses)):
        if o.shape != (B, M, G, H, K):
            raise ArgumentError(
                f"Incompatible input shapes for attention chunk {i}: attn_split[i].shape={o.shape}, (B, M, G, H, Kq)={(B, M, G, H, K)}"
            )
        if s.shape != (B, G, H, M):
            raise ArgumentError(
                f"Incompatible input shapes for LSE chunk {i}: lse_split[i].shape={s.shape}, (B, G, H, M)={(B, G, H, M)}"
            )
    return attns, lses, no_groups


def merge(
    attn_split: Chunks, lse_split: Chunks, write_lse: bool = True, output_dtype: Optional[torch.dtype] = None
) -> Tuple[Tensor, Optional[Tensor]]:
    """``out = Σ exp(lse_i) out_i / Σ exp(lse_i)``, ``lse = log Σ exp(lse_i)`` (rows every chunk missed: 0, -inf)."""
    attns, lses, no_groups = _as_lists(attn_split, lse_split)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in attns + lses)
    if needs_grad and not write_lse:
        raise ArgumentError("write_lse should be true if inputs require gradients.")
    work = torch.promote_types(lses[0].dtype, torch.float32)  # accumulated in float32 (float64 kept)
    # The running maximum only keeps exp() in range; the result does not depend on it (no gradient).
    top = torch.stack([s.detach().to(work) for s in lses]).amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total: Optional[Tensor] = None
    acc: Optional[Tensor] = None
    for o, s in zip(attns, lses):
        w = torch.exp(s.to(work) - top)  # (B, G, H, M)
        part = w.permute(0, 3, 1, 2).unsqueeze(-1) * o.to(work)
        total, acc = (w, part) if total is None else (total + w, acc + part)  # type: ignore[operator]
    assert total is not None and acc is not None
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (acc / safe.permute(0, 3, 1, 2).unsqueeze(-1)).to(output_dtype or attns[0].dtype)
    lse = (top + torch.log(total)).to(lses[0].dtype) if write_lse else None
    if no_groups:
        out = out.squeeze(2)
        lse = None if lse is None else lse.squeeze(1)
    return out, lse
