"""The public face for packed sequences: ``varlen_attention`` and ``varlen_explain``.

Signatures and docstrings; each hands its call to the eager call (:mod:`subquad._call`), the
options as one :class:`~subquad._options.CallOptions` and the packed arguments as one
:class:`~subquad._options.Varlen`.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

from torch import Tensor

from . import _call
from ._budget import Budget
from ._inputs import MaskMod, ScoreMod
from ._options import CallOptions, Varlen
from ._planner import Plan

Window = Optional[Tuple[Optional[int], Optional[int]]]


def varlen_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    seqused_k: Optional[Tensor] = None,
    is_causal: bool = False,
    alignment: str = "top_left",
    window: Window = None,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    memory_budget: Budget = None,
    chunk_size: Union[int, Tuple[int, int], None] = None,
    backend: str = "auto",
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Exact attention of packed sequences: each sequence attends only within itself.

    Shapes (flash-attn's and torch's varlen layout): ``query (total_q, Hq, E)``, ``key (total_k,
    Hk, E)``, ``value (total_k, Hk, Ev)`` -> ``out (total_q, Hq, Ev)`` (and ``lse (total_q, Hq)``,
    float32). Sequence ``s`` is query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and keys
    ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` (int32 offsets, ``(batch + 1,)``, 0 first). Equal to::

        for s in range(batch):
            rows, keys = slice(*cu_seqlens_q[s:s+2]), slice(*cu_seqlens_k[s:s+2])
            out[rows] = subquad.attention(query[rows].transpose(0, 1), key[keys].transpose(0, 1),
                                          value[keys].transpose(0, 1), ...).transpose(0, 1)

    computed in tiles laid out per sequence: nothing is computed across a boundary and no mask
    is evaluated for it. Callbacks see ``b`` = the sequence's index and ``q_idx``/``kv_idx`` =
    positions within it. ``alignment`` places the causal diagonal and the window: ``"top_left"``
    (row ``i`` faces key ``i``, as SDPA) or ``"bottom_right"`` (key ``i + Lk_s - Lq_s``, as
    flash-attn and ``torch.nn.attention.varlen``; rows that see no key give 0)::

        Lq_s=3, Lk_s=5, causal:   top_left       bottom_right
                                  x . . . .      x x x . .
                                  x x . . .      x x x x .
                                  x x x . .      x x x x x

    Args:
        max_seqlen_q: the longest query sequence (flash-attn passes it); checked when given,
            computed when not.
        max_seqlen_k: the longest key sequence, likewise.
        seqused_k: ``(batch,)`` int32: sequence ``s`` uses only its first ``seqused_k[s]`` keys
            (flash-attn 3's name; padded or cached key blocks); its alignment counts those.
        window: ``(left, right)``: row ``i`` sees keys from ``left`` before to ``right`` after its
            aligned diagonal (``None``: unbounded on that side); tiles outside are skipped.

    The other arguments are :func:`subquad.attention`'s (``memory_budget``: tiles are planned for
    the longest sequence; the lse of every row, kept for the backward, counts too).

    Raises:
        TypeError / ValueError (also ``RuntimeError``): bad shapes (each tensor 3-D), offsets that
            do not start at 0, decrease or end elsewhere than ``total``, a ``max_seqlen`` shorter
            than a sequence, an unknown ``alignment``; as :func:`subquad.attention` otherwise.
    """
    options = CallOptions(
        is_causal=is_causal,
        score_mod=score_mod,
        mask_mod=mask_mod,
        scale=scale,
        enable_gqa=enable_gqa,
        dropout_p=dropout_p,
        memory_budget=memory_budget,
        chunk_size=chunk_size,
        backend=backend,
        return_lse=return_lse,
    )
    varlen = Varlen(
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        alignment=alignment,
        window=window,
        seqused_k=seqused_k,
    )
    return _call.varlen_attention(query, key, value, options, varlen)


def varlen_explain(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    **options: object,
) -> Plan:
    """What :func:`varlen_attention` would run for these arguments (its keywords), without running it."""
    return _call.varlen_explain(query, key, value, cu_seqlens_q, cu_seqlens_k, **options)
