"""The public calls of ``subquad.distributed``: checks on every rank together, then a strategy.

Each public function writes its options into one :class:`~subquad._options.CallOptions`
(nothing compiled: ``allow_compile=False``) and hands that on: to the collective checks, to the
strategy, and, for a group of one, to the eager call."""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple, Union

import torch
from torch import Tensor

from .. import _call
from .._budget import Budget, parse_budget, resolve_budget
from .._callbacks import captured_tensors
from .._errors import ArgumentError
from .._inputs import BlockPositions, MaskMod, ScoreMod
from .._options import CallOptions
from .._validate import make_inputs
from ._agreement import STRATEGIES, Call, agree, check_agreement, validate_local
from ._all_to_all import run_ulysses
from ._group import resolve_group
from ._layouts import check_layout
from ._plan import DistributedPlan, plan_call, ulysses_reasons
from ._ring import Ring, block_states_of, sub_block_caps


def _setup(
    strategy: str, query: Any, key: Any, value: Any, group: Any, layout: Any, options: CallOptions
) -> Optional[Tuple[Call, Tensor, Tensor, Tensor, Optional[Tensor]]]:
    """Check the call on every rank together; ``None`` for a group of one (run it locally)."""
    o = options
    g = resolve_group(group)
    local_error: Optional[BaseException] = None
    budget = 0
    try:
        if strategy not in STRATEGIES:
            raise ArgumentError(f"Unknown strategy={strategy!r}; expected one of {', '.join(map(repr, STRATEGIES))}.")
        check_layout(layout)
        validate_local(
            query, key, value, o.attn_mask, o.is_causal, o.score_mod, o.mask_mod, o.scale, o.enable_gqa, o.return_lse
        )
        budget = (
            resolve_budget(o.memory_budget, query.device) if o.memory_budget is None else parse_budget(o.memory_budget)
        )
    except (TypeError, ValueError, RuntimeError) as e:
        local_error = e
    if g.size == 1:
        if local_error is not None:
            raise local_error
        return None
    rows = agree(
        g,
        local_error,
        query,
        key,
        value,
        o.attn_mask,
        layout,
        o.is_causal,
        o.enable_gqa,
        o.scale,
        o.score_mod,
        o.mask_mod,
        strategy,
    )
    q_lengths, kv_lengths = check_agreement(rows, layout)
    batch_shape = tuple(query.shape[:-3])
    q4 = query.reshape(-1, *query.shape[-3:])
    k4 = key.reshape(-1, *key.shape[-3:])
    v4 = value.reshape(-1, *value.shape[-3:])
    m4 = None if o.attn_mask is None else _mask_4d(o.attn_mask, query)
    row_cap, col_cap = sub_block_caps(q4.shape[0], q4.shape[1], k4.shape[1], q4.shape[2], q4.shape[3], v4.shape[3])
    call = Call(
        g,
        layout,
        q_lengths,
        kv_lengths,
        batch_shape,
        bool(o.is_causal),
        m4,
        o.score_mod,
        o.mask_mod,
        o.scale,
        bool(o.enable_gqa),
        budget,
        row_cap,
        col_cap,
        block_states_of(o.mask_mod, q4.device),
    )
    return call, q4, k4, v4, m4


def _mask_4d(mask: Tensor, query: Tensor) -> Tensor:
    """A mask shard in the engine's 4-D layout ``(B or 1, Hq or 1, Lq or 1, Lk or 1)`` (a view when it can be)."""
    m = mask.reshape((1,) * (query.dim() - mask.dim()) + tuple(mask.shape))
    batch = tuple(query.shape[:-3])
    mb = tuple(m.shape[:-3])
    if all(d == 1 for d in mb):
        return m.reshape(1, *m.shape[-3:])
    if mb == batch:
        return m.reshape(-1, *m.shape[-3:])
    try:
        return m.expand(*batch, *m.shape[-3:]).reshape(-1, *m.shape[-3:])
    except RuntimeError:
        raise ArgumentError(
            f"attn_mask {tuple(mask.shape)} does not broadcast to query's batch dims {batch}."
        ) from None


def _finish(
    out: Tensor, lse: Tensor, batch_shape: Tuple[int, ...], return_lse: bool
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    out = out.reshape(*batch_shape, *out.shape[1:])
    if return_lse:
        return out, lse.reshape(*batch_shape, *lse.shape[1:])
    return out


def _trivial(call: Call, q: Tensor, k: Tensor, v: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """No transfer for a call with nothing to compute (no batch, no heads, no keys anywhere)."""
    if q.shape[0] * q.shape[1] * q.shape[-1] * v.shape[-1] != 0 and call.Lk != 0:
        return None
    stats = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=stats, device=q.device)
    if q.requires_grad or k.requires_grad or v.requires_grad:
        out = out + 0 * (q.sum() + k.sum() + v.sum())  # connected to the inputs: zero gradients, not None
    return out, lse


def _captured(call: Call, q: Tensor, k: Tensor, v: Tensor) -> List[Tensor]:
    if call.score_mod is None or not torch.is_grad_enabled():
        return []
    mine = call.q_pieces(call.g.rank)[:1]
    theirs = call.kv_pieces(call.g.rank)[:1]
    if not mine or not theirs:
        return []
    inp = make_inputs(q, k, v, is_causal=False, scale=call.scale, enable_gqa=call.enable_gqa, score_mod=call.score_mod)
    inp = BlockPositions(mine[0][1], theirs[0][1], (call.Lq, call.Lk), h_offset=0).apply(inp)
    return captured_tensors(inp)


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: Any = None,
    is_causal: bool = False,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    memory_budget: Budget = None,
    layout: str = "zigzag",
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Exact attention of a sequence sharded across the ranks of ``group``, K/V passed around a ring.

    Shapes on each rank: ``query (..., Hq, Lq/P, E)``, ``key (..., Hk, Lk/P, E)``, ``value (..., Hk,
    Lk/P, Ev)``: this rank's shard in ``layout`` (see :func:`shard`) -> ``out (..., Hq, Lq/P, Ev)``
    (and ``lse (..., Hq, Lq/P)``), this rank's rows of the whole attention. Collective: every rank
    of the group calls it with its own shards and the same options. Equal, up to rounding, to::

        whole = lambda x: unshard(x, -2, group, layout)
        out = subquad.attention(whole(query), whole(key), whole(value), is_causal=is_causal, ...)
        out = shard(out, -2, group, layout)

    without ever gathering the sequence: in ``P`` steps this rank attends its queries to each
    rank's K/V shard as it arrives (the next transfer posted before the step's compute), each
    step a :func:`subquad.attention` call with ``return_lse`` under ``memory_budget``, and merges
    the partial results by their log-sum-exp. Blocks that ``is_causal`` masks entirely are not
    computed. Causal alignment is top-left in global positions (query ``i`` sees keys ``j <= i``).

    Args:
        group: the process group (``None``: the default group). A group of one runs
            :func:`subquad.attention`.
        score_mod: as in :func:`subquad.attention`, called with **global** query and key
            positions (and ``b``, ``h`` as there).
        mask_mod: as in :func:`subquad.attention`, with global positions too.
        attn_mask: this rank's shard of a mask: its query rows and every key, ``(..., Lq/P, Lk)``
            (bool, True = attend, or float, added; dims of size 1 broadcast). Float masks get gradients.
        memory_budget: the extra memory of each step's attention call (the ring adds two K/V
            shards in flight and float32 accumulators of this rank's output; see :func:`explain`).
        layout: ``"zigzag"`` (each rank holds chunks ``r`` and ``2P-1-r`` of ``2P``: the causal work is
            even) or ``"contiguous"`` (shards may differ in length).
        return_lse: also return the log-sum-exp of this rank's rows (float32; float64 for float64).

    Differentiable: the backward sends dK/dV around the ring with K/V (FlashAttention-2 with the
    saved output and global lse); nothing of size ``Lq x Lk`` exists on any rank.

    Raises:
        RuntimeError: no initialized process group.
        TypeError / ValueError: invalid arguments, or ranks that disagree (shapes other than the
            sequence length, dtype, options; zigzag shards of unequal length), raised on every rank.

    Whatever a callback raises propagates on its rank; the other ranks then raise when the
    group's timeout (``init_process_group(timeout=...)``) expires while they wait for it.
    """
    options = CallOptions(
        attn_mask=attn_mask,
        is_causal=is_causal,
        score_mod=score_mod,
        mask_mod=mask_mod,
        scale=scale,
        enable_gqa=enable_gqa,
        memory_budget=memory_budget,
        return_lse=return_lse,
        allow_compile=False,
    )
    return _ring(query, key, value, group, layout, options)


def _ring(
    query: Tensor, key: Tensor, value: Tensor, group: Any, layout: str, options: CallOptions
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    setup = _setup("ring", query, key, value, group, layout, options)
    if setup is None:
        return _call.attention(query, key, value, options)
    call, q, k, v, m = setup
    trivial = _trivial(call, q, k, v)
    if trivial is not None:
        return _finish(*trivial, call.batch_shape, options.return_lse)
    captured = _captured(call, q, k, v)
    out, lse = Ring.apply(call, q, k, v, m, *captured)
    return _finish(out, lse, call.batch_shape, options.return_lse)


def ulysses_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: Any = None,
    is_causal: bool = False,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    memory_budget: Budget = None,
    layout: str = "zigzag",
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Exact attention of a sharded sequence by all-to-all over heads ("Ulysses", DeepSpeed).

    Same shapes, arguments and result as :func:`ring_attention` (no ``attn_mask``: use a
    ``mask_mod``). Needs ``Hq`` and ``Hk`` divisible by the group size ``P``. An all-to-all turns
    this rank's sequence shard of all heads into the whole sequence of ``H/P`` heads; the rank
    runs :func:`subquad.attention` on them (callbacks see global positions and head indices);
    an all-to-all brings its rows back. Sends about ``(P-1)/P`` of its q, k, v and output, once;
    holds the whole sequence of ``H/P`` heads (as much as its shards). Differentiable through
    the all-to-alls.
    """
    options = CallOptions(
        is_causal=is_causal,
        score_mod=score_mod,
        mask_mod=mask_mod,
        scale=scale,
        enable_gqa=enable_gqa,
        memory_budget=memory_budget,
        return_lse=return_lse,
        allow_compile=False,
    )
    return _ulysses(query, key, value, group, layout, options)


def _ulysses(
    query: Tensor, key: Tensor, value: Tensor, group: Any, layout: str, options: CallOptions
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    setup = _setup("ulysses", query, key, value, group, layout, options)
    if setup is None:
        return _call.attention(query, key, value, options)
    call, q, k, v, _ = setup
    reasons = ulysses_reasons(call, q.shape[1], k.shape[1])
    if reasons:
        raise ArgumentError("ulysses_attention cannot run this call: " + "; ".join(reasons) + ". Use ring_attention.")
    trivial = _trivial(call, q, k, v)
    if trivial is not None:
        return _finish(*trivial, call.batch_shape, options.return_lse)
    return _finish(*run_ulysses(call, q, k, v), call.batch_shape, options.return_lse)


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    strategy: str = "auto",
    group: Any = None,
    is_causal: bool = False,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    memory_budget: Budget = None,
    layout: str = "zigzag",
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Context-parallel attention with the strategy :func:`explain` picks (or ``strategy``).

    ``"auto"``: the all-to-all when the heads divide among the ranks, no ``attn_mask`` is given
    and it sends fewer bytes than the ring (``P > 2`` for equal query and key heads), else the
    ring. Arguments and result as :func:`ring_attention`.
    """
    if strategy not in STRATEGIES:
        raise ArgumentError(f"Unknown strategy={strategy!r}; expected one of {', '.join(map(repr, STRATEGIES))}.")
    options = CallOptions(
        attn_mask=attn_mask,
        is_causal=is_causal,
        score_mod=score_mod,
        mask_mod=mask_mod,
        scale=scale,
        enable_gqa=enable_gqa,
        memory_budget=memory_budget,
        return_lse=return_lse,
        allow_compile=False,
    )
    if strategy == "auto":
        strategy = _explain(query, key, value, "auto", group, layout, options).strategy
    if strategy == "ulysses":
        if attn_mask is not None:
            raise ArgumentError(
                "strategy='ulysses' takes no attn_mask (each rank would need every row of it); use a mask_mod or strategy='ring'."
            )
        return _ulysses(query, key, value, group, layout, options)
    return _ring(query, key, value, group, layout, options)


def explain(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    strategy: str = "auto",
    group: Any = None,
    is_causal: bool = False,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    memory_budget: Budget = None,
    layout: str = "zigzag",
) -> DistributedPlan:
    """What :func:`attention` would run on this rank, without running it (collective: one small all-gather).

    Returns a :class:`DistributedPlan`: the strategy and why the other was not taken, this rank's
    predicted peak memory beyond its shards, the bytes it sends forward and backward, the ring's
    attention calls per step, and the plan (:class:`subquad.Plan`) of its largest block.
    """
    options = CallOptions(
        attn_mask=attn_mask,
        is_causal=is_causal,
        score_mod=score_mod,
        mask_mod=mask_mod,
        scale=scale,
        enable_gqa=enable_gqa,
        memory_budget=memory_budget,
        allow_compile=False,
    )
    return _explain(query, key, value, strategy, group, layout, options)


def _explain(
    query: Tensor, key: Tensor, value: Tensor, strategy: str, group: Any, layout: str, options: CallOptions
) -> DistributedPlan:
    setup = _setup(strategy, query, key, value, group, layout, options)
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if setup is None:
        block = _call.explain(query, key, value, dataclasses.replace(options, return_lse=True))
        return DistributedPlan("local", 1, 0, layout, block.predicted_peak_bytes, 0, 0, [1], {}, block)
    call, q, k, v, _ = setup
    return plan_call(call, q, k, v, strategy, need_grad)
