r"""flash-attn's ``flash_attn.bert_padding``: between padded batches and packed sequences.

``unpad_input`` packs the valid tokens of a padded batch ``(B, S, ...)`` into ``(total, ...)`` and
returns what :func:`~subquad.compat.flash_attn.flash_attn_varlen_func` needs; ``pad_input`` puts
packed rows back (zeros elsewhere). Plain torch, differentiable, no einops.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from subquad import ArgumentError

__all__ = [
    "index_first_axis",
    "index_put_first_axis",
    "unpad_input",
    "pad_input",
    "unpad_input_for_concatenated_sequences",
]


def index_first_axis(input: Tensor, indices: Tensor) -> Tensor:
    """``input[indices]`` for ``input (N, ...)`` and ``indices (M,)`` -> ``(M, ...)`` (gradient: a scatter into zeros)."""
    if input.dim() < 2:
        raise ArgumentError(f"index_first_axis: input must have at least 2 dims (N, ...), got {tuple(input.shape)}.")
    return input.index_select(0, indices)


def index_put_first_axis(values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
    """Zeros ``(first_axis_dim, ...)`` with ``out[indices] = values`` for ``values (M, ...)``, ``indices (M,)``."""
    if indices.dim() != 1 or values.dim() < 2:
        raise ArgumentError(
            f"index_put_first_axis: expected indices (M,) and values (M, ...) of at least 2 dims, got "
            f"{tuple(indices.shape)} and {tuple(values.shape)}."
        )
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_copy(0, indices, values)


def unpad_input(
    hidden_states: Tensor, attention_mask: Tensor, unused_mask: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor, Tensor, int, Tensor]:
    r"""The tokens of a padded batch, packed (flash-attn 2.8: five values).

    Shapes: ``hidden_states (B, S, ...)``, ``attention_mask (B, S)`` (bool/int, 1 = valid),
    ``unused_mask (B, S)`` (1 = allocated but unused: packed too, not counted as used) ->
    ``(hidden (total, ...), indices (total,) int64, cu_seqlens (B + 1,) int32, max_seqlen int,
    seqused (B,) int32)``. Equal to::

        keep = attention_mask + unused_mask                   # or attention_mask
        indices = keep.flatten().nonzero().flatten()
        hidden = hidden_states.flatten(0, 1)[indices]
        cu_seqlens = F.pad(keep.sum(-1).cumsum(0), (1, 0)).int()
        max_seqlen = int(keep.sum(-1).max()); seqused = attention_mask.sum(-1).int()
    """
    keep = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = keep.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens, max_seqlen, used


def unpad_input_for_concatenated_sequences(
    hidden_states: Tensor, attention_mask_in_length: Tensor
) -> Tuple[Tensor, Tensor, Tensor, int]:
    r"""Several short sequences per batch row, packed (four values).

    ``attention_mask_in_length (B, S)``: row ``b`` holds the lengths of its sequences, then zeros
    (``[[2, 3, 0, 0, 0, 0], ...]``: two sequences, of 2 and 3 tokens, at the start of row 0) ->
    ``(hidden (total, ...), indices (total,), cu_seqlens (n + 1,) int32, max_seqlen int)`` over
    all ``n`` sequences. Equal to::

        lengths = attention_mask_in_length[attention_mask_in_length > 0]   # row-major order
        valid = torch.arange(S) < attention_mask_in_length.sum(-1, keepdim=True)
        indices = valid.flatten().nonzero().flatten()
        hidden = hidden_states.flatten(0, 1)[indices]
        cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).int(); max_seqlen = int(lengths.max())
    """
    lengths_per_row = attention_mask_in_length.sum(dim=-1)
    seqlen = attention_mask_in_length.shape[-1]
    valid = torch.arange(seqlen, device=lengths_per_row.device) < lengths_per_row[:, None]
    flat = attention_mask_in_length.flatten()
    seqlens = flat[torch.nonzero(flat, as_tuple=False).flatten()]
    indices = torch.nonzero(valid.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens, max_seqlen


def pad_input(hidden_states: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """Packed rows ``(total, ...)`` back into a padded batch ``(batch, seqlen, ...)``, zeros elsewhere.

    Equal to ``out = zeros(batch * seqlen, ...); out[indices] = hidden_states; out.view(batch, seqlen, ...)``.
    """
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view(batch, seqlen, *hidden_states.shape[1:])
