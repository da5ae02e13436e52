"""The public face: ``attention``, ``sdpa`` and ``explain`` -- signatures, docstrings, hand-off.

Each writes its options into one :class:`~subquad._options.CallOptions` and hands it to the
eager call (:mod:`subquad._call`), or, while ``torch.compile`` traces, to subquad's operator
(:mod:`subquad._compile`). ``attention`` first tries the per-call fast path (:mod:`subquad._fast`)
on its loose arguments, and builds the record only when that misses.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _call, _compile, _fast
from ._budget import Budget
from ._errors import ArgumentTypeError
from ._inputs import MaskMod, ScoreMod
from ._options import CallOptions
from ._planner import Plan


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    memory_budget: Budget = None,
    chunk_size: Union[int, Tuple[int, int], None] = None,
    backend: str = "auto",
    return_lse: bool = False,
    allow_compile: Optional[bool] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Exact scaled dot-product attention in bounded memory.

    Shapes: ``query (..., Hq, Lq, E)``, ``key (..., Hk, Lk, E)``, ``value (..., Hk, Lk, Ev)`` ->
    ``out (..., Hq, Lq, Ev)`` (and ``lse (..., Hq, Lq)``). ``...`` are any batch dims; they
    broadcast between the three as in SDPA (a key/value of batch 1 is shared by every query
    batch, never expanded in memory). ``Hq == Hk`` unless ``enable_gqa=True`` (then query head
    ``h`` reads kv head ``h // (Hq/Hk)``). Jagged nested tensors ``(B, H, j, E)`` (as SDPA takes
    them) run as packed sequences (:func:`subquad.varlen_attention`) and give a nested result;
    their masks are ``mask_mod``\ s (``b`` = the sequence), ``is_causal`` is per sequence.

    Equal (up to rounding, without ever building the ``Lq x Lk`` scores) to::

        s = (query @ key.transpose(-2, -1)) * scale            # scale defaults to 1/sqrt(E)
        s = score_mod(s, b, h, q_idx, kv_idx)                    # per tile, if given
        s = s + attn_mask  # float mask; a bool mask (True = attend) or mask_mod sets -inf
        if is_causal: s = s.masked_fill(kv_idx > q_idx, -inf)    # top-left aligned
        p = softmax(s, -1); p = dropout(p, dropout_p)
        out = p @ value                                          # rows with no visible key -> 0
        lse = logsumexp(s, -1)                                   # -inf for those rows

    Causal alignment is top-left, as in SDPA (``Lq=3, Lk=5``; ``x`` = attend)::

        x . . . .
        x x . . .
        x x x . .

    Args:
        attn_mask: bool (True = attend) or float (added) tensor broadcastable to ``(..., Hq, Lq, Lk)``,
            or one of torch's ``torch.nn.attention.bias.causal_upper_left(Lq, Lk)`` (= ``is_causal``)
            and ``causal_lower_right(Lq, Lk)`` (diagonal aligned to the bottom-right corner; rows
            that see no key give 0), which are never materialized.
        is_causal: top-left causal mask; not together with ``attn_mask``.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, FlexAttention's convention,
            called per tile with ``score (B, Hq, qc, kc)`` float32 and broadcastable int64 indices
            ``b (B,1,1,1)``, ``h (1,Hq,1,1)``, ``q_idx (1,1,qc,1)``, ``kv_idx (1,1,1,kc)`` (``B`` is
            the product of the batch dims). Tensors it captures that require grad get gradients.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = attend), called per tile; tiles
            where it is False everywhere are skipped.
        scale: the factor on ``q kᵀ``; default ``1/sqrt(E)``.
        enable_gqa: grouped-query attention without expanding key/value in memory.
        dropout_p: dropout on the attention weights, in ``[0, 1]`` (its masks are regenerated in the
            backward; ``1`` drops everything, output 0, as SDPA).
        memory_budget: bytes (int) or a string like ``"512MiB"``/``"2GB"``: the extra memory of the
            call beyond its inputs, output (and gradients). ``None``: half the device's free memory.
            A promise: a call that cannot keep it raises, it never runs over it.
        chunk_size: force tiles ``(q_chunk, kv_chunk)`` (or one int for both) instead of planning
            them. They must fit the budget too: tiles predicted to need more raise
            :class:`MemoryBudgetError` (pass a larger ``memory_budget`` to run them).
        backend: ``"auto"`` (the planner), ``"sdpa"``, ``"flex"``, ``"fused"``, ``"loops"`` or ``"matmul"``.
        return_lse: also return the log-sum-exp per row (float32; float64 for float64 inputs).
        allow_compile: whether the planner may compile code for the call (FlexAttention for
            callbacks); ``None``: yes unless the environment variable ``SUBQUAD_COMPILE=0``. The
            first call of a new signature then pays the compile (seconds; ``explain()`` says so).

    Raises:
        TypeError / ValueError: invalid arguments, naming the argument and showing the values.
            They are also ``RuntimeError``\ s, the class torch's SDPA raises for the same inputs.
        MemoryBudgetError: the budget cannot hold even the smallest tiles, or the forced
            ``chunk_size`` (says what would fit).
        NotImplementedError: a forced ``backend`` cannot run the call (with its reasons).

    Whatever ``score_mod`` / ``mask_mod`` raise propagates unchanged (never retried or hidden).
    """
    compiling = torch.compiler.is_compiling()
    fast_key = None  # while compiling no call is keyed: the operator or a graph break runs it
    if not compiling:
        # The per-call fast path here, on the loose arguments: a decode step on a remembered plan
        # pays for no record and no further layer of calls.
        fast_key = _fast.key(
            query, key, value, attn_mask, is_causal, score_mod, mask_mod, scale, enable_gqa, dropout_p,
            memory_budget, chunk_size, backend, return_lse, allow_compile,
        )  # fmt: skip
        if fast_key is not None:
            result = _fast.run(fast_key, query, key, value, attn_mask, is_causal, scale, return_lse)
            if result is not None:
                return result
    options = CallOptions(
        attn_mask=attn_mask,
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
        allow_compile=allow_compile,
    )
    if (
        compiling
        and _compile.supports(score_mod=score_mod, mask_mod=mask_mod, dropout_p=dropout_p)
        and not getattr(query, "is_nested", False)
    ):
        # Under torch.compile subquad is one opaque operator (fake + autograd registrations); the
        # planner and tile loop run eagerly inside it when the compiled graph executes.
        return _compile.attention(query, key, value, options)
    return _call.attention(query, key, value, options, fast_key)


def sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    **options: object,
) -> Tensor:
    """A drop-in for :func:`torch.nn.functional.scaled_dot_product_attention` that keeps a memory budget.

    Same signature, layout ``(..., H, L, E)`` and semantics (bool mask True = attend, float mask
    added, torch's ``CausalBias`` masks, ``is_causal`` top-left, fully masked rows -> 0,
    ``enable_gqa``, batch dims that broadcast, empty inputs); ``options`` are the keyword-only
    options of :func:`subquad.attention` (``memory_budget``, ``chunk_size``, ``backend``,
    ``score_mod``, ``mask_mod``). ``return_lse`` is not accepted here. Invalid arguments raise
    ``TypeError``/``ValueError`` subclasses that are also ``RuntimeError`` (what SDPA raises).

    Equal to ``torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask,
    dropout_p, is_causal, scale, enable_gqa=enable_gqa)``, computed in tiles.
    """
    if "return_lse" in options:
        raise ArgumentTypeError(
            "sdpa() returns the output only; use subquad.attention(..., return_lse=True) for the lse."
        )
    out = attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        **options,  # type: ignore[arg-type]
    )
    assert isinstance(out, Tensor)
    return out


def explain(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    memory_budget: Budget = None,
    chunk_size: Union[int, Tuple[int, int], None] = None,
    backend: str = "auto",
    return_lse: bool = False,
    allow_compile: Optional[bool] = None,
) -> Plan:
    """What :func:`attention` would run for these arguments, without running it.

    Returns a :class:`Plan` (``backend``, ``chunk_size``, ``predicted_peak_bytes``,
    ``budget_bytes``, ``rejected``: the reasons of every path not taken); ``print(plan)`` reads well.
    Raises like :func:`attention` (e.g. :class:`MemoryBudgetError`).
    """
    options = CallOptions(
        attn_mask=attn_mask,
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
        allow_compile=allow_compile,
    )
    return _call.explain(query, key, value, options)
