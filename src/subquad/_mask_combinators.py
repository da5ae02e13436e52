"""The combinators of :mod:`subquad.mods`: :func:`and_masks` and :func:`or_masks`, with the block
states of their parts combined."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._callbacks import EMPTY, FULL, PARTIAL, UNKNOWN, declared_states
from ._mask_base import MaskModFn, _Mask, _states


def _state_of(mask_mod: MaskModFn, qs: int, qe: int, ks: int, ke: int) -> Optional[int]:
    declared = getattr(mask_mod, "block_state", None)
    if declared is None:
        return None
    state = declared(qs, qe, ks, ke)
    return int(state) if state in (EMPTY, FULL, PARTIAL) else None


def _check_masks(fn: str, mask_mods: Sequence[MaskModFn]) -> List[MaskModFn]:
    if not mask_mods:
        raise ValueError(f"{fn}: expected at least one mask_mod.")
    for i, m in enumerate(mask_mods):
        if not callable(m):
            raise TypeError(f"{fn}: argument {i} is a {type(m).__name__}, not a mask_mod callable.")
    return list(mask_mods)


def _grids(
    mask_mods: Sequence[MaskModFn], qs: int, qe: int, q_block: int, ks: int, ke: int, kv_block: int
) -> Tuple[Optional[Tensor], bool]:
    """The declared grids of the parts, stacked on one device (a GPU part's, so that the grids
    are read back once, combined), and whether some part declares nothing; ``None`` if none does."""
    found = [declared_states(m, qs, qe, q_block, ks, ke, kv_block) for m in mask_mods]
    grids = [g for g in found if g is not None]
    if not grids:
        return None, True
    device = next((g.device for g in grids if g.device.type != "cpu"), grids[0].device)
    return torch.stack([g.to(device) for g in grids]), len(grids) < len(found)


class _AndMasks(_Mask):
    def __init__(self, mask_mods: List[MaskModFn]) -> None:
        self.mask_mods = mask_mods

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        keep = self.mask_mods[0](b, h, q_idx, kv_idx)
        for m in self.mask_mods[1:]:
            keep = keep & m(b, h, q_idx, kv_idx)
        return keep

    def block_state(self, qs: int, qe: int, ks: int, ke: int) -> Optional[int]:
        states = [_state_of(m, qs, qe, ks, ke) for m in self.mask_mods]
        if EMPTY in states:
            return EMPTY
        if None in states:
            return None  # a hand-written part: let the engine evaluate the whole mask on the tile
        return FULL if all(s == FULL for s in states) else PARTIAL

    def block_states(self, qs: int, qe: int, q_block: int, ks: int, ke: int, kv_block: int) -> Optional[Tensor]:
        parts, undeclared = _grids(self.mask_mods, qs, qe, q_block, ks, ke, kv_block)
        if parts is None:
            return None
        unknown = (parts == UNKNOWN).any(dim=0) | undeclared
        found = _states((parts == EMPTY).any(dim=0), (parts == FULL).all(dim=0))
        return torch.where(unknown & (found != EMPTY), UNKNOWN, found).to(torch.int8)

    def __repr__(self) -> str:
        return f"and_masks({', '.join(map(repr, self.mask_mods))})"


class _OrMasks(_Mask):
    def __init__(self, mask_mods: List[MaskModFn]) -> None:
        self.mask_mods = mask_mods

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        keep = self.mask_mods[0](b, h, q_idx, kv_idx)
        for m in self.mask_mods[1:]:
            keep = keep | m(b, h, q_idx, kv_idx)
        return keep

    def block_state(self, qs: int, qe: int, ks: int, ke: int) -> Optional[int]:
        states = [_state_of(m, qs, qe, ks, ke) for m in self.mask_mods]
        if FULL in states:
            return FULL
        if None in states:
            return None
        return EMPTY if all(s == EMPTY for s in states) else PARTIAL

    def block_states(self, qs: int, qe: int, q_block: int, ks: int, ke: int, kv_block: int) -> Optional[Tensor]:
        parts, undeclared = _grids(self.mask_mods, qs, qe, q_block, ks, ke, kv_block)
        if parts is None:
            return None
        unknown = (parts == UNKNOWN).any(dim=0) | undeclared
        found = _states((parts == EMPTY).all(dim=0), (parts == FULL).any(dim=0))
        return torch.where(unknown & (found != FULL), UNKNOWN, found).to(torch.int8)

    def __repr__(self) -> str:
        return f"or_masks({', '.join(map(repr, self.mask_mods))})"


def and_masks(*mask_mods: MaskModFn) -> _Mask:
    """A mask that attends where *every* mask attends (intersection).

    ``and_masks(causal(), document(ids))`` is causal attention within each packed document::

        ids = [0, 0, 0, 1, 1, 1]
        x . . . . .
        x x . . . .
        x x x . . .
        . . . x . .
        . . . x x .
        . . . x x x

    Block states combine: EMPTY if any part is EMPTY, FULL if all are FULL. Hand-written parts
    (without ``block_state``) are evaluated on the tile when the built-in parts do not decide it.

    Raises:
        ValueError / TypeError: no masks, or an argument that is not callable.
    """
    return _AndMasks(_check_masks("and_masks", mask_mods))


def or_masks(*mask_mods: MaskModFn) -> _Mask:
    """A mask that attends where *any* mask attends (union).

    ``or_masks(sliding_window(1), key_padding(2))``: a local window plus two global tokens::

        x x . . . .
        x x x . . .
        x x x x . .
        x x x x x .
        x x . x x x
        x x . . x x

    Block states combine: FULL if any part is FULL, EMPTY if all are EMPTY.

    Raises:
        ValueError / TypeError: no masks, or an argument that is not callable.
    """
    return _OrMasks(_check_masks("or_masks", mask_mods))
