"""A bias as the dense tensor it stands for: ``bias.materialize(shape)``, for users and tests only.

Attention never calls this (it runs the :mod:`._reading` of the bias). Used by the rest of the
package: :func:`materialize`, :func:`band_keep`.
"""

from __future__ import annotations

import math
from typing import Tuple, Union

import torch
from torch import Tensor

from subquad import ArgumentError

from ._reading import Band, Blocks, Dense, Reading


def band_keep(band: Band, q_len: int, k_len: int, device: Union[str, torch.device] = "cpu") -> Tensor:
    """``(q_len, k_len)`` bool: True where row ``i`` sees key ``j`` (see :class:`._reading.Band`)."""
    i = torch.arange(q_len, device=device).unsqueeze(1)
    j = torch.arange(k_len, device=device).unsqueeze(0)
    d = i + band.offset(q_len, k_len)
    keep = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if band.left is not None:
        keep &= j >= d - band.left
    if band.right is not None:
        keep &= j <= d + band.right
    return keep


def _additive(keep: Tensor, dtype: torch.dtype) -> Tensor:
    # bfloat16 is built in float32 first, as xformers does.
    build = torch.float32 if dtype == torch.bfloat16 else dtype
    return torch.zeros(keep.shape, dtype=build, device=keep.device).masked_fill_(~keep, -math.inf).to(dtype)


def materialize(
    reading: Reading, shape: Tuple[int, ...], dtype: torch.dtype, device: Union[str, torch.device]
) -> Tensor:
    """The additive bias (0 where attended, ``-inf`` elsewhere, plus any tensor) of ``shape (..., Mq, Mkv)``.

    Paged biases take the logical ``Mkv = batch * pages per row * page_size`` and return the
    physical key axis, ``(block_tables.max() + 1) * page_size`` long, as xformers does.
    """
    shape = tuple(shape)
    if len(shape) < 2:
        raise ArgumentError(f"materialize: expected a shape (..., Mq, Mkv), got {shape}.")
    q_len, k_len = shape[-2:]
    if isinstance(reading, Dense):
        mask = _additive(band_keep(reading.band, q_len, k_len, device), dtype).expand(shape).clone()
        return mask if reading.tensor is None else mask + reading.tensor.to(device=device)
    if q_len != reading.q_starts[-1]:
        raise ArgumentError(
            f"materialize: q shapes wrong: shape[-2] = {q_len}, the bias has {reading.q_starts[-1]} queries."
        )
    keep = _blocks_keep(reading, k_len, device)
    return _additive(keep, dtype).expand(*shape[:-1], keep.shape[-1])


def _blocks_keep(blocks: Blocks, k_len: int, device: Union[str, torch.device]) -> Tensor:
    if not blocks.paged:
        if k_len != blocks.k_total:
            raise ArgumentError(
                f"materialize: k shapes wrong: shape[-1] = {k_len}, the bias has {blocks.k_total} keys."
            )
        keep = torch.zeros(blocks.q_starts[-1], k_len, dtype=torch.bool, device=device)
        for s, (a, e) in enumerate(blocks.keys):
            qs, qe = blocks.q_starts[s], blocks.q_starts[s + 1]
            keep[qs:qe, a:e] |= band_keep(blocks.band, qe - qs, e - a, device)
        return keep
    assert blocks.block_tables is not None and blocks.page_size is not None
    tables, ps = blocks.block_tables.to(device=device, dtype=torch.long), blocks.page_size
    row = tables.shape[1] * ps
    if k_len != tables.shape[0] * row:
        raise ArgumentError(
            f"materialize: k shapes wrong: a paged bias takes the logical key length batch * pages per row * "
            f"page_size = {tables.shape[0] * row} as shape[-1], got {k_len}."
        )
    physical = (int(tables.max()) + 1) * ps if tables.numel() else 0
    keep = torch.zeros(blocks.q_starts[-1], physical, dtype=torch.bool, device=device)
    for s, (a, e) in enumerate(blocks.keys):
        qs, qe = blocks.q_starts[s], blocks.q_starts[s + 1]
        t = torch.arange(a, e, device=device)
        keep[qs:qe, tables[s, t // ps] * ps + t % ps] = band_keep(blocks.band, qe - qs, e - a, device)
    return keep
