"""What flash-attn's options mean, in subquad's terms: the window, softcap, ALiBi and the lse.

flash-attn 2.8's kernels (``csrc/flash_attn/flash_api.cpp``, ``src/mask.h``) define them as
follows, for a row ``i`` of ``Sq`` queries against ``Sk`` keys (per sequence in varlen), whose
*diagonal* is key ``i + Sk - Sq`` (bottom-right alignment):

* ``window_size = (left, right)``: keys ``[diag - left, diag + right]``. A side ``>= seqlen_k``
  (the call's ``k.shape[1]``, varlen's ``max_seqlen_k``, the cache's capacity) becomes ``-1``;
  ``causal`` sets ``right = 0``. ``(-1, -1)`` is full attention; ``(-1, 0)`` is causal; in every
  other case a negative ``left`` is unbounded and a negative ``right`` is ``seqlen_k`` (which
  differs from unbounded only for rows more than ``seqlen_k`` above the diagonal).
* ``softcap > 0``: ``score = softcap * tanh(score / softcap)`` on the scaled scores, before ALiBi.
* ``alibi_slopes``: ``score -= slope[b, h] * |diag - j|``. With the causal kernel flash-attn adds
  ``slope * j`` instead, equal after the softmax (a constant per row) but not in the lse: its lse
  is ``slope * diag`` higher, which :func:`finish_lse` reproduces.
* The lse of a row that sees no key is ``+inf`` (subquad's is ``-inf``); its output is 0.

Used by the rest of the package: :class:`Semantics`, :func:`semantics`, :func:`score_mod`,
:func:`dense_mask`, :func:`finish_lse`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import torch
from torch import Tensor

from subquad import mods

from . import _checks

Window = Optional[Tuple[Optional[int], Optional[int]]]


@dataclass(frozen=True)
class Semantics:
    """One call's options, resolved: what subquad runs.

    ``window``: ``(left, right)`` around the bottom-right diagonal (``None`` = unbounded side), or
    ``None`` for every key; ``(None, 0)`` is flash-attn's causal kernel. ``alibi``: slopes
    ``(B, Hq)`` (one row per sequence) or ``None``. ``softcap``: 0 when off.
    """

    scale: float
    window: Window
    softcap: float
    alibi: Optional[Tensor]
    dropout_p: float

    @property
    def causal(self) -> bool:
        return self.window == (None, 0)

    def sequence(self, s: int) -> "Semantics":
        """The same options for sequence ``s`` alone (its row of ALiBi slopes)."""
        return self if self.alibi is None else dataclasses.replace(self, alibi=self.alibi[s : s + 1])


def semantics(
    q: Tensor,
    *,
    batch_size: int,
    softmax_scale: Optional[float],
    causal: bool,
    window_size: object,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    dropout_p: float,
    seqlen_k: int,
) -> Semantics:
    """Resolve flash-attn's options (its rules, in the module docstring) for ``q (..., Hq, D)``."""
    left, right = _checks.window_size(window_size)
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    if causal:
        right = 0
    if left < 0 and right < 0:
        window: Window = None
    else:
        window = (None if left < 0 else left, seqlen_k if right < 0 else right)
    slopes = None if alibi_slopes is None else _checks.alibi(alibi_slopes, batch_size, q.shape[-2], q)
    return Semantics(
        scale=q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale),
        window=window,
        softcap=max(float(softcap), 0.0),
        alibi=slopes,
        dropout_p=float(dropout_p),
    )


ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def score_mod(sem: Semantics, offset: Union[int, Tensor]) -> Optional[ScoreMod]:
    """Softcap and ALiBi as one ``score_mod`` (``None`` without them), evaluated per tile.

    ``offset``: where row ``i``'s diagonal is (``Sk - Sq``), an int or one per sequence ``(B,)``.
    """
    cap, slopes = sem.softcap, sem.alibi
    if slopes is None:
        if not cap:
            return None

        def softcapped(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return torch.tanh(score / cap) * cap

        return softcapped
    per_sequence = isinstance(offset, Tensor)

    def biased(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if cap:
            score = torch.tanh(score / cap) * cap
        diag = q_idx + (offset[b] if per_sequence else offset)  # type: ignore[index]
        distance = (diag - kv_idx).to(score.dtype).abs()
        return score - slopes[b, h].to(score.dtype) * distance

    return biased


def dense_mask(sem: Semantics, seqlen_q: int, seqlen_k: int) -> Optional[Callable[..., Tensor]]:
    """The window of one ``(Sq, Sk)`` batch as a built-in ``mask_mod`` (tiles outside it are skipped)."""
    if sem.window is None:
        return None
    if sem.causal:
        return mods.causal_lower_right(seqlen_q, seqlen_k)
    left, right = sem.window
    return mods.local_window(left, right, offset=seqlen_k - seqlen_q)


def finish_lse(lse: Tensor, sem: Semantics, slopes: Optional[Tensor], diag: Tensor) -> Tensor:
    """subquad's lse in flash-attn's convention: ALiBi's causal shift, ``+inf`` for empty rows.

    ``slopes`` and ``diag`` (each row's diagonal) broadcast against ``lse``.
    """
    if sem.causal and slopes is not None:
        lse = lse + slopes.to(lse.dtype) * diag
    return torch.where(torch.isneginf(lse), math.inf, lse)
