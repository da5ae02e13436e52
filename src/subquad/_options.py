"""The call's options as the caller gave them: one frozen record, built once at the public face.

``subquad.attention``, ``explain``, ``varlen_attention``, the compiled operator and
``subquad.distributed`` each take a dozen options. Each face writes its keywords into one
:class:`CallOptions` and hands that record down (the eager call, validation, the compiled
operator's eager half, a distributed group of one), instead of every layer listing the
options again. The record holds the values as given: they are checked where they always were
(:mod:`subquad._validate`, :func:`subquad._call.prepare`), so a bad value raises the same error
at the same point. :class:`Varlen` is the same for what makes a call one of packed sequences.

The per-call fast path (:mod:`subquad._fast`) reads the face's loose arguments instead: a decode
step on a remembered plan would notice the cost of building the record (measured in
``docs/benchmarks/decode.md``), so the face builds it only when the call takes the full path.

Used by the rest of the package: ``CallOptions``, ``Varlen``, ``ChunkSize``, ``given``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from torch import Tensor

from ._budget import Budget
from ._inputs import MaskMod, ScoreMod

ChunkSize = Union[int, Tuple[int, int], Sequence[int], None]
"""``chunk_size`` as a caller may give it: one int, or a pair as a tuple or a list."""


@dataclass(frozen=True, slots=True, eq=False)
class CallOptions:
    """Everything a call of :func:`subquad.attention` says besides ``query, key, value``.

    Unvalidated, as passed (defaults: :func:`subquad.attention`'s); immutable, so every layer
    reads the same values. Compared by identity (it may hold a mask tensor). The planner's own
    :class:`~subquad._backends.Options` are derived from it in :func:`subquad._call.prepare`.
    """

    attn_mask: Optional[Tensor] = None
    is_causal: bool = False
    score_mod: Optional[ScoreMod] = None
    mask_mod: Optional[MaskMod] = None
    scale: Optional[float] = None
    enable_gqa: bool = False
    dropout_p: float = 0.0
    memory_budget: Budget = None
    chunk_size: ChunkSize = None
    backend: str = "auto"
    return_lse: bool = False
    allow_compile: Optional[bool] = None


@dataclass(frozen=True, slots=True, eq=False)
class Varlen:
    """What makes a call one of packed sequences (:func:`subquad.varlen_attention`'s own arguments)."""

    cu_seqlens_q: Any
    cu_seqlens_k: Any
    max_seqlen_q: Any = None
    max_seqlen_k: Any = None
    alignment: str = "top_left"
    window: Any = None
    seqused_k: Any = None


def given(options: Optional[CallOptions], keywords: Dict[str, Any]) -> CallOptions:
    """The record a layer was handed, or one made of the keywords of a caller that holds loose
    values (a ring step, torch's varlen operator): a layer takes one form or the other."""
    if options is None:
        return CallOptions(**keywords)
    if keywords:
        raise TypeError(
            f"Pass the call's options as one CallOptions or as keywords, not both (got {sorted(keywords)})."
        )
    return options
