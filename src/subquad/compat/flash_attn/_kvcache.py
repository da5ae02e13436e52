r"""flash-attn's ``flash_attn_with_kvcache``: append to a (paged) KV cache, rotate, attend.

The cache is written in place, then attended to through :func:`subquad.varlen_attention` over
the flattened cache (each sequence's keys a block of it, ``seqused_k`` the keys it uses), or,
for paged caches and caches that cannot be flattened as a view, one sequence at a time (its
pages gathered: one sequence's keys at a time).

Used by the rest of the package: :func:`flash_attn_with_kvcache`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from subquad import ArgumentError

from . import _calls, _checks, _rotary, _run
from ._semantics import Semantics, semantics

Q = "(batch_size, seqlen_q, nheads, headdim)"
CACHE = "(batch_size_cache, seqlen_cache, nheads_k, headdim)"
NEW = "(batch_size, seqlen_new, nheads_k, headdim)"


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    rotary_cos: Optional[Tensor] = None,
    rotary_sin: Optional[Tensor] = None,
    cache_seqlens: Optional[Union[int, Tensor]] = None,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Decode against a KV cache, flash-attn's ``flash_attn_with_kvcache`` on every device.

    Shapes: ``q (B, Sq, Hq, D)``; ``k_cache (B_cache, S_cache, Hk, D)``, ``v_cache (..., Dv)``, or
    paged ``(num_blocks, page_block_size, Hk, D)`` with ``block_table (B, max_num_blocks_per_seq)``
    (any page size); new ``k (B, S_new, Hk, D)``, ``v (B, S_new, Hk, Dv)``; ``rotary_cos``,
    ``rotary_sin (seqlen_ro, rotary_dim / 2)``; ``cache_seqlens`` an int or ``(B,)``;
    ``cache_batch_idx``, ``cache_leftpad (B,)`` -> ``out (B, Sq, Hq, Dv)`` (and ``lse (B, Hq, Sq)``
    with ``return_softmax_lse``). Sequence ``b`` uses cache row ``r = cache_batch_idx[b]`` (default
    ``b``); ``n = cache_seqlens[b]``, ``lp = cache_leftpad[b]`` (default 0). Equal to::

        if rotary_cos is not None:                            # positions n, n + 1, ...
            k = rotate(k, at n + arange(S_new))
            q = rotate(q, at n + arange(Sq) if causal or local else at n)
        if k is not None:                                     # in place
            k_cache[r, n : n + S_new], v_cache[r, n : n + S_new] = k, v
            n = n + S_new
        out[b] = flash_attn_func(q[b:b+1], k_cache[r:r+1, lp:n], v_cache[r:r+1, lp:n], ...)[0]

    so causal, windows and ALiBi are aligned to the keys ``[lp, n)``. A window side ``>=
    S_cache`` (paged: ``max_num_blocks_per_seq * page_block_size``) is unbounded. With duplicate
    ``cache_batch_idx`` and new keys, which sequence's keys the shared row keeps is unspecified.

    Args:
        rotary_interleaved: pairs ``(x[2i], x[2i+1])`` (True) or ``(x[i], x[i + rotary_dim/2])``.
        num_splits: accepted; subquad plans its own tiles.

    The other arguments are :func:`~subquad.compat.flash_attn.flash_attn_func`'s; no dropout, no
    gradient (it runs under ``torch.no_grad()``, as flash-attn has no backward for it).

    Raises:
        RuntimeError (subquad's ``ArgumentError``/``ArgumentTypeError``): flash-attn's checks and
            messages (``k`` without ``v`` or ``cache_seqlens``, rotary tables without new keys or
            too short, ``cache_batch_idx`` with a paged cache, shapes, dtypes); also what
            flash-attn would run out of bounds with: writes past the cache, rotary positions past
            ``seqlen_ro``, ``cache_batch_idx`` or ``block_table`` entries outside the cache, ``v``
            without ``k``.
    """
    with torch.no_grad():
        return _with_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            rotary_cos,
            rotary_sin,
            cache_seqlens,
            cache_batch_idx,
            cache_leftpad,
            block_table,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            rotary_interleaved=rotary_interleaved,
            alibi_slopes=alibi_slopes,
            return_softmax_lse=return_softmax_lse,
        )


@dataclass(frozen=True)
class Cache:
    """Where each sequence's keys are: cache ``rows`` (or ``table`` pages), keys ``[start, end)`` of each."""

    k: Tensor
    v: Tensor
    capacity: int
    rows: List[int]
    start: List[int]
    end: List[int]
    table: Optional[Tensor] = None

    def keys(self, s: int) -> Tuple[Tensor, Tensor]:
        """Sequence ``s``'s keys and values, ``(end - start, Hk, D)``: a view, or a gather of its pages."""
        if self.table is None:
            row = self.rows[s]
            return self.k[row, self.start[s] : self.end[s]], self.v[row, self.start[s] : self.end[s]]
        page = self.table[s]
        return (
            _calls.gather_pages(self.k, page, self.start[s], self.end[s]),
            _calls.gather_pages(self.v, page, self.start[s], self.end[s]),
        )


def _with_kvcache(
    q: object,
    k_cache: object,
    v_cache: object,
    k: object,
    v: object,
    rotary_cos: object,
    rotary_sin: object,
    cache_seqlens: object,
    cache_batch_idx: object,
    cache_leftpad: object,
    block_table: object,
    *,
    softmax_scale: Optional[float],
    causal: bool,
    window_size: object,
    softcap: float,
    rotary_interleaved: bool,
    alibi_slopes: Optional[Tensor],
    return_softmax_lse: bool,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    q = _checks.dims("q", q, Q)
    paged = block_table is not None
    legend = _calls.PAGES if paged else CACHE
    k_cache, v_cache = _checks.dims("k_cache", k_cache, legend), _checks.dims("v_cache", v_cache, legend)
    _calls.check_qkv(q, k_cache, v_cache, legend)
    batch = q.shape[0]
    if paged and cache_batch_idx is not None:
        raise ArgumentError("Paged KVcache does not support cache_batch_idx.")
    capacity = k_cache.shape[1] * (_checks.index_tensor("block_table", block_table).shape[-1] if paged else 1)
    new_k, new_v = _new_keys(q, k_cache, v_cache, k, v, cache_seqlens, capacity)
    lengths = _lengths(cache_seqlens, batch, capacity)
    added = 0 if new_k is None else new_k.shape[1]
    cache = _locate(k_cache, v_cache, capacity, lengths, added, cache_batch_idx, cache_leftpad, block_table)
    sem = semantics(
        q,
        batch_size=batch,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        dropout_p=0.0,
        seqlen_k=capacity,
    )
    if rotary_cos is not None or rotary_sin is not None:
        q, new_k = _rotate(q, new_k, rotary_cos, rotary_sin, lengths, capacity, sem, rotary_interleaved)
    if new_k is not None and new_v is not None:
        _append(cache, new_k, new_v, lengths)
    out, lse = _attend(q, cache, sem, bool(return_softmax_lse))
    return (out, lse) if lse is not None else out


def _new_keys(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, k: object, v: object, cache_seqlens: object, capacity: int
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    if k is None:
        if v is not None:
            raise ArgumentError("v is given without k: pass both to append to the cache, or neither.")
        return None, None
    if v is None:
        raise ArgumentError("If key is supplied, value must also be passed in.")
    if cache_seqlens is None:
        raise ArgumentError("If key is supplied, cache_seqlens must also be passed in (where to append it).")
    k, v = _checks.dims("k", k, NEW), _checks.dims("v", v, NEW)
    _checks.same_dtype("Key", k, "query", q)
    _checks.same_dtype("Value", v, "query", q)
    _checks.shape("k", k, (q.shape[0], None, k_cache.shape[2], q.shape[3]), NEW)
    _checks.shape("v", v, (q.shape[0], k.shape[1], k_cache.shape[2], v_cache.shape[3]), NEW)
    if q.shape[1] > capacity:
        raise ArgumentError(
            f"If key is supplied, it must have seqlen <= the seqlen of the KV cache, got seqlen_q {q.shape[1]} "
            f"and a cache of {capacity}."
        )
    return k, v


def _lengths(cache_seqlens: object, batch: int, capacity: int) -> List[int]:
    """Keys in the cache per sequence, before the append (flash-attn: the whole cache when ``None``)."""
    if cache_seqlens is None:
        return [capacity] * batch
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        lengths = [cache_seqlens] * batch
    else:
        lengths = _checks.index_tensor("cache_seqlens", cache_seqlens, batch).tolist()
    bad = [n for n in lengths if not 0 <= n <= capacity]
    if bad:
        raise ArgumentError(f"cache_seqlens must be in [0, {capacity}] (the cache's seqlen), got {bad[:4]}.")
    return lengths


def _locate(
    k_cache: Tensor,
    v_cache: Tensor,
    capacity: int,
    lengths: List[int],
    added: int,
    cache_batch_idx: object,
    cache_leftpad: object,
    block_table: object,
) -> Cache:
    batch = len(lengths)
    end = [n + added for n in lengths]
    over = [(s, n) for s, n in enumerate(end) if n > capacity]
    if over:
        s, n = over[0]
        raise ArgumentError(
            f"cache_seqlens[{s}] + seqlen_new = {n} keys do not fit the KV cache's seqlen {capacity}; "
            "allocate a longer cache or pass fewer new keys."
        )
    start = [0] * batch
    if cache_leftpad is not None:
        start = _checks.index_tensor("cache_leftpad", cache_leftpad, batch).tolist()
        bad = [s for s in range(batch) if not 0 <= start[s] <= lengths[s]]
        if bad:
            raise ArgumentError(
                f"cache_leftpad must be in [0, cache_seqlens], got cache_leftpad[{bad[0]}] = {start[bad[0]]} "
                f"and cache_seqlens[{bad[0]}] = {lengths[bad[0]]}."
            )
    if block_table is not None:
        table = _calls.page_table(block_table, batch, k_cache.shape[0], k_cache.shape[1], end)
        return Cache(k_cache, v_cache, capacity, list(range(batch)), start, end, table)
    if cache_batch_idx is None:
        if k_cache.shape[0] < batch:
            raise ArgumentError(
                f"k_cache holds {k_cache.shape[0]} sequences for a batch of {batch}; pass cache_batch_idx."
            )
        rows = list(range(batch))
    else:
        rows = _checks.index_tensor("cache_batch_idx", cache_batch_idx, batch).tolist()
        bad = [r for r in rows if not 0 <= r < k_cache.shape[0]]
        if bad:
            raise ArgumentError(
                f"cache_batch_idx must be in [0, {k_cache.shape[0]}) (batch_size_cache), got {bad[:4]}."
            )
    return Cache(k_cache, v_cache, capacity, rows, start, end)


def _rotate(
    q: Tensor,
    k: Optional[Tensor],
    cos: object,
    sin: object,
    lengths: List[int],
    capacity: int,
    sem: Semantics,
    interleaved: bool,
) -> Tuple[Tensor, Optional[Tensor]]:
    """flash-attn's rotary: new keys at ``n, n + 1, ...``; queries too if causal or local, else all at ``n``."""
    if cos is None:
        raise ArgumentError("rotary_sin is given without rotary_cos: pass both, or neither.")
    if sin is None:
        raise ArgumentError("If rotary cos is provided, rotary sin must also be provided.")
    if k is None:
        raise ArgumentError(
            "If rotary cos/sin are provided, new key / value to be appended to KV cache must also be provided."
        )
    cos = _checks.dims("rotary_cos", cos, "(seqlen_ro, rotary_dim / 2)")
    sin = _checks.dims("rotary_sin", sin, "(seqlen_ro, rotary_dim / 2)")
    _checks.shape("rotary_sin", sin, tuple(cos.shape), "(seqlen_ro, rotary_dim / 2)")
    if 2 * cos.shape[1] > q.shape[-1]:
        raise ArgumentError(
            f"rotary_dim must be <= headdim, got rotary_dim {2 * cos.shape[1]} and headdim {q.shape[-1]}."
        )
    if cos.shape[0] < capacity:
        raise ArgumentError(f"cos/sin seqlen must be at least the seqlen of KV cache, got {cos.shape[0]} < {capacity}.")
    first = torch.tensor(lengths, dtype=torch.long, device=q.device)[:, None]
    # Causal or local: the queries are the last tokens; otherwise all sit at the cache's end.
    steps = torch.arange(q.shape[1] if sem.window is not None else 1, device=q.device)
    q_at = (first + steps).expand(q.shape[0], q.shape[1])
    k_at = first + torch.arange(k.shape[1], device=q.device)
    reach = max(lengths, default=0) + (q.shape[1] - 1 if sem.window is not None else 0)
    if q.shape[1] and reach >= cos.shape[0]:
        raise ArgumentError(
            f"The queries' rotary positions reach {reach} (cache_seqlens + seqlen_q - 1), past rotary_cos's "
            f"{cos.shape[0]} rows; pass longer cos/sin tables."
        )
    return _rotary.rotate(q, cos[q_at], sin[q_at], interleaved), _rotary.rotate(k, cos[k_at], sin[k_at], interleaved)


def _append(cache: Cache, k: Tensor, v: Tensor, lengths: List[int]) -> None:
    """Write the new keys at positions ``[cache_seqlens, cache_seqlens + seqlen_new)``, in place."""
    device = cache.k.device
    at = torch.tensor(lengths, dtype=torch.long, device=device)[:, None] + torch.arange(k.shape[1], device=device)
    if cache.table is None:
        rows = torch.tensor(cache.rows, dtype=torch.long, device=device)[:, None]
        where = (rows.expand_as(at), at)
    else:
        page_size = cache.k.shape[1]
        where = (cache.table.to(device=device, dtype=torch.long).gather(1, at // page_size), at % page_size)
    cache.k.index_put_(where, k.to(device))
    cache.v.index_put_(where, v.to(device))


def _attend(q: Tensor, cache: Cache, sem: Semantics, want_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    batch, seqlen_q, heads = q.shape[0], q.shape[1], q.shape[2]
    if cache.table is None and len(set(cache.rows)) == batch and _flattens(cache.k) and _flattens(cache.v):
        return _attend_flat(q, cache, sem, want_lse)
    outs, lses = _run.per_sequence([q[s] for s in range(batch)], cache.keys, sem, want_lse)
    out = torch.stack(outs) if outs else q.new_zeros((0, seqlen_q, heads, cache.v.shape[-1]))
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = (torch.stack(lses) if lses else q.new_zeros((0, heads, seqlen_q), dtype=lse_dtype)) if want_lse else None
    return out, lse


def _flattens(t: Tensor) -> bool:
    """Whether ``t.flatten(0, 1)`` is a view (no copy of the cache)."""
    return t.shape[0] <= 1 or t.shape[1] <= 1 or t.stride(0) == t.shape[1] * t.stride(1)


def _attend_flat(q: Tensor, cache: Cache, sem: Semantics, want_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """One :func:`subquad.varlen_attention` over the flattened cache: sequence ``s``'s keys are the block
    from ``rows[s] * S_cache + start[s]``, of which it uses ``end[s] - start[s]``.

    Blocks must be in order: the sequences run sorted by cache row; a leading sequence of no
    queries covers the cache before the first block.
    """
    batch, seqlen_q, heads = q.shape[0], q.shape[1], q.shape[2]
    order = sorted(range(batch), key=lambda s: cache.rows[s])
    starts = [cache.rows[s] * cache.capacity + cache.start[s] for s in order]
    used = [cache.end[s] - cache.start[s] for s in order]
    lead = 1 if starts and starts[0] > 0 else 0
    cu_k = [0] * lead + starts + [cache.k.shape[0] * cache.capacity]
    cu_q = [0] * lead + [i * seqlen_q for i in range(batch + 1)]
    sorted_q = q if order == list(range(batch)) else q[order]
    slopes = sem.alibi
    if slopes is not None:
        slopes = torch.cat([slopes.new_zeros((lead, slopes.shape[1])), slopes[order]])
    out, lse = _run.packed(
        sorted_q.reshape(batch * seqlen_q, heads, q.shape[3]),
        cache.k.flatten(0, 1),
        cache.v.flatten(0, 1),
        cu_q,
        cu_k,
        dataclasses.replace(sem, alibi=slopes),
        want_lse,
        seqused_k=[0] * lead + used,
    )
    out = out.view(batch, seqlen_q, heads, -1)
    lse = None if lse is None else lse.view(heads, batch, seqlen_q).transpose(0, 1)
    if order != list(range(batch)):
        back = sorted(range(batch), key=lambda i: order[i])
        out = out[back]
        lse = None if lse is None else lse[back]
    return out, None if lse is None else lse.contiguous()
