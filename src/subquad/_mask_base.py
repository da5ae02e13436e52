"""The base of :mod:`subquad.mods`' built-in masks and the block states of a band of diagonals."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from ._callbacks import EMPTY, FULL, PARTIAL, grid_bounds

MaskModFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class _Mask:
    """Base of the built-in masks: a callable ``(b, h, q_idx, kv_idx) -> bool`` plus its block structure."""

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def block_state(self, qs: int, qe: int, ks: int, ke: int) -> Optional[int]:
        """EMPTY, FULL or PARTIAL for rows ``[qs, qe)`` x keys ``[ks, ke)``; ``None`` if unknown."""
        return PARTIAL

    def _on(self, t: Tensor, device: torch.device) -> Tensor:
        """``t`` on the device of the call (ids or lengths built on CPU for a CUDA call), copied once."""
        if t.device == device:
            return t
        cache: Dict[Tuple[int, torch.device], Tensor] = self.__dict__.setdefault("_device_copies", {})
        key = (id(t), device)
        if key not in cache:
            cache[key] = t.to(device)
        return cache[key]


def _diagonal_state(qs: int, qe: int, ks: int, ke: int, lo: float, hi: float) -> int:
    """State of the band ``lo <= q - k <= hi`` on a tile.

    Over the integer rectangle the difference ``q - k`` takes every value in
    ``[qs - (ke - 1), (qe - 1) - ks]``, so comparing that interval with ``[lo, hi]`` is exact.
    """
    d_min, d_max = qs - (ke - 1), (qe - 1) - ks
    if d_max < lo or d_min > hi:
        return EMPTY
    if lo <= d_min and d_max <= hi:
        return FULL
    return PARTIAL


def _states(empty: Tensor, full: Tensor) -> Tensor:
    return torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL)).to(torch.int8)


def _diagonal_states(qs: int, qe: int, q_block: int, ks: int, ke: int, kv_block: int, lo: float, hi: float) -> Tensor:
    """:func:`_diagonal_state` of every tile of a grid at once, ``(query blocks, key blocks)`` on the CPU."""
    q0, q1 = grid_bounds(qs, qe, q_block)
    k0, k1 = grid_bounds(ks, ke, kv_block)
    d_min = q0.view(-1, 1) - (k1 - 1).view(1, -1)
    d_max = (q1 - 1).view(-1, 1) - k0.view(1, -1)
    return _states((d_max < lo) | (d_min > hi), (d_min >= lo) & (d_max <= hi))
