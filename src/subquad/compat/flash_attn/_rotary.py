r"""Rotary position embedding as flash-attn applies it (``flash_attn/layers/rotary.py``).

The first ``rotary_dim = 2 * cos.shape[-1]`` features of each head are rotated by the angle of
their position; the rest pass through. Pairs are ``(x[2i], x[2i+1])`` when ``interleaved`` (GPT-J)
or ``(x[i], x[i + rotary_dim/2])`` otherwise (GPT-NeoX)::

    x1, x2 = pairs of x[..., :rotary_dim]
    out1, out2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin      # computed in float32 or wider

Used by the rest of the package: :func:`rotate` (the kvcache's rotation, angles given per token) and the public
:func:`apply_rotary_emb`.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from subquad import ArgumentError

from . import _checks


def rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """``x (..., S, H, D)`` rotated by each token's ``cos``, ``sin (..., S, rotary_dim / 2)``; a new tensor."""
    half = cos.shape[-1]
    if half == 0:
        return x
    wide = torch.promote_types(x.dtype, torch.float32)
    c = cos.to(wide).unsqueeze(-2)  # (..., S, 1, rotary_dim / 2): one angle for every head
    s = sin.to(wide).unsqueeze(-2)
    head = x[..., : 2 * half].to(wide)
    if interleaved:
        x1, x2 = head[..., 0::2], head[..., 1::2]
        turned = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = head[..., :half], head[..., half:]
        turned = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((turned.to(x.dtype), x[..., 2 * half :]), dim=-1)


def apply_rotary_emb(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: Union[int, Tensor] = 0,
    cu_seqlens: Optional[Tensor] = None,
    max_seqlen: Optional[int] = None,
) -> Tensor:
    r"""flash-attn's ``apply_rotary_emb``: rotary embedding of the first ``rotary_dim`` features.

    Shapes: ``x (B, S, H, D)``, or ``(total, H, D)`` packed by ``cu_seqlens (B + 1,)``; ``cos``,
    ``sin (seqlen_ro, rotary_dim / 2)`` with ``rotary_dim <= D``; ``seqlen_offsets``: an int or
    ``(B,)``, the position of each sequence's first token. Token ``t`` of sequence ``b`` is at
    position ``p = seqlen_offsets[b] + t`` and equal to (see the module docstring for the pairs)::

        out[b, t] = x[b, t] rotated by cos[p], sin[p]     # p >= seqlen_ro: unchanged (flash-attn's kernel)

    ``inplace=True`` writes into ``x`` and returns it. Differentiable in ``x`` (plain torch ops).

    Raises:
        RuntimeError (subquad's ``ArgumentError``; flash-attn asserts): ``cos``/``sin`` shapes
            that differ, ``rotary_dim > D``, ``seqlen_ro`` shorter than the sequences, an int
            offset that runs past ``seqlen_ro``, ``cu_seqlens`` without ``max_seqlen``, offsets
            not ``(B,)``.
    """
    x, cos, sin = (_checks.tensor(n, t) for n, t in (("x", x), ("cos", cos), ("sin", sin)))
    if cos.dim() != 2 or sin.shape != cos.shape:
        raise ArgumentError(
            f"cos and sin must both be (seqlen_ro, rotary_dim / 2), got {tuple(cos.shape)} and {tuple(sin.shape)}."
        )
    seqlen_ro, rotary_dim = cos.shape[0], 2 * cos.shape[1]
    if rotary_dim > x.shape[-1]:
        raise ArgumentError(f"rotary_dim must be <= headdim, got rotary_dim {rotary_dim} and x {tuple(x.shape)}.")
    positions, seqlen = _positions(x, seqlen_offsets, cu_seqlens, max_seqlen)
    if seqlen_ro < seqlen:
        raise ArgumentError(
            f"seqlen_ro must be >= seqlen, got cos {tuple(cos.shape)} for sequences of {seqlen} tokens."
        )
    if isinstance(seqlen_offsets, int) and seqlen_offsets + seqlen > seqlen_ro:
        raise ArgumentError(
            f"seqlen_offsets + seqlen must be <= seqlen_ro, got {seqlen_offsets} + {seqlen} > {seqlen_ro}."
        )
    # Positions past the table rotate by angle 0, as flash-attn's kernel loads cos = 1, sin = 0 there.
    past = positions >= seqlen_ro
    positions = positions.clamp(max=max(seqlen_ro - 1, 0))
    one = torch.ones((), dtype=cos.dtype, device=cos.device)
    cos_at = torch.where(past[..., None], one, cos[positions])
    sin_at = torch.where(past[..., None], one - 1, sin[positions])
    out = rotate(x, cos_at, sin_at, interleaved)
    if not inplace:
        return out
    x[..., :rotary_dim] = out[..., :rotary_dim]
    return x


def _positions(
    x: Tensor, offsets: Union[int, Tensor], cu_seqlens: Optional[Tensor], max_seqlen: Optional[int]
) -> Tuple[Tensor, int]:
    """Each token's position (``x``'s leading dims) and the longest sequence."""
    device = x.device
    if cu_seqlens is None:
        if x.dim() != 4:
            raise ArgumentError(
                f"x must be (batch_size, seqlen, nheads, headdim) without cu_seqlens, got {tuple(x.shape)}."
            )
        batch, seqlen = x.shape[0], x.shape[1]
        start = _per_sequence_offsets(offsets, batch, device)
        return start[:, None] + torch.arange(seqlen, device=device), seqlen
    if max_seqlen is None:
        raise ArgumentError("If cu_seqlens is passed in, then max_seqlen must be passed.")
    cu = _checks.index_tensor("cu_seqlens", cu_seqlens).to(device=device, dtype=torch.long)
    if x.dim() != 3:
        raise ArgumentError(f"x must be (total_seqlen, nheads, headdim) with cu_seqlens, got {tuple(x.shape)}.")
    batch = cu.numel() - 1
    seq = torch.repeat_interleave(torch.arange(batch, device=device), cu.diff())
    within = torch.arange(x.shape[0], device=device) - cu[seq]
    return within + _per_sequence_offsets(offsets, batch, device)[seq], int(max_seqlen)


def _per_sequence_offsets(offsets: Union[int, Tensor], batch: int, device: torch.device) -> Tensor:
    if isinstance(offsets, int):
        return torch.full((batch,), offsets, dtype=torch.long, device=device)
    t = _checks.index_tensor("seqlen_offsets", offsets, batch)
    return t.to(device=device, dtype=torch.long)
