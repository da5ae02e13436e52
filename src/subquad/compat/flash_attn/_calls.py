"""One flash-attn call: its checks, its options resolved, the run, its return value.

:func:`dense_call` serves ``flash_attn_func`` and its packed variants, :func:`varlen_call`
``flash_attn_varlen_func`` and its packed variants (paged keys through ``block_table`` included).

Used by the rest of the package: :func:`dense_call`, :func:`varlen_call`, :func:`unpack`, :func:`check_qkv`,
:func:`probs_placeholder`, :func:`page_table`, :func:`gather_pages`.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from subquad import ArgumentError

from . import _checks, _run
from ._semantics import Semantics, semantics

Returned = Union[Tensor, Tuple[Tensor, Tensor, Tensor]]

Q = "(batch_size, seqlen_q, nheads, headdim)"
K = "(batch_size, seqlen_k, nheads_k, headdim)"
QV = "(total_q, nheads, headdim)"
KV = "(total_k, nheads_k, headdim)"
PAGES = "(num_blocks, page_block_size, nheads_k, headdim)"


def probs_placeholder(q: Tensor) -> Tensor:
    """The third value of ``return_attn_probs=True``: an empty tensor of ``q``'s dtype.

    flash-attn returns exactly this when ``dropout_p == 0`` (it forms the probabilities only to
    test its dropout); subquad never forms the ``Sq x Sk`` probabilities at all.
    """
    return q.new_empty((0,))


def unpack(name: str, packed: object, legend: str) -> Tuple[Tensor, ...]:
    """The views stacked in ``packed`` along the dim ``legend`` names ``2`` or ``3`` (``"(total, 3, nheads, headdim)"``)."""
    t = _checks.dims(name, packed, legend)
    parts = legend.strip("()").split(", ")
    dim = next(i for i, p in enumerate(parts) if p in ("2", "3"))
    _checks.shape(name, t, [int(p) if i == dim else None for i, p in enumerate(parts)], legend)
    return t.unbind(dim)


def check_qkv(q: Tensor, k: Tensor, v: Tensor, k_legend: str) -> None:
    """dtypes, head counts and head dims of ``q (..., H, D)``, ``k (..., Hk, D)``, ``v (..., Hk, Dv)``."""
    _checks.float_dtype("q", q)
    _checks.same_dtype("query", q, "key", k)
    _checks.same_dtype("query", q, "value", v)
    _checks.shape("k", k, (*k.shape[:-1], q.shape[-1]), k_legend)
    _checks.shape("v", v, (*k.shape[:-1], None), k_legend)
    _checks.heads(q.shape[-2], k.shape[-2])


def dense_call(
    q: object,
    k: object,
    v: object,
    *,
    dropout_p: float,
    softmax_scale: Optional[float],
    causal: bool,
    window_size: object,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    return_attn_probs: bool,
) -> Returned:
    """``flash_attn_func``: checks, then :func:`~._run.dense`."""
    q = _checks.dims("q", q, Q)
    k = _checks.dims("k", k, K)
    v = _checks.dims("v", v, K)
    _checks.shape("k", k, (q.shape[0], None, None, None), K)
    check_qkv(q, k, v, K)
    sem = semantics(
        q,
        batch_size=q.shape[0],
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        dropout_p=dropout_p,
        seqlen_k=k.shape[1],
    )
    out, lse = _run.dense(q, k, v, sem, bool(return_attn_probs))
    return (out, lse, probs_placeholder(q)) if lse is not None else out


def varlen_call(
    q: object,
    k: object,
    v: object,
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    max_seqlen_q: object,
    max_seqlen_k: object,
    *,
    dropout_p: float,
    softmax_scale: Optional[float],
    causal: bool,
    window_size: object,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    return_attn_probs: bool,
    block_table: Optional[Tensor] = None,
) -> Returned:
    """``flash_attn_varlen_func``: checks, then :func:`~._run.packed` (or one sequence at a time for pages)."""
    q = _checks.dims("q", q, QV)
    k = _checks.dims("k", k, KV if block_table is None else PAGES)
    v = _checks.dims("v", v, KV if block_table is None else PAGES)
    cu_q = _checks.index_tensor("cu_seqlens_q", cu_seqlens_q)
    batch_size = cu_q.numel() - 1
    cu_k = _checks.index_tensor("cu_seqlens_k", cu_seqlens_k, batch_size + 1, "(batch_size + 1,)")
    check_qkv(q, k, v, KV if block_table is None else PAGES)
    offsets_q, offsets_k = cu_q.tolist(), cu_k.tolist()
    longest_k = max((b - a for a, b in zip(offsets_k, offsets_k[1:])), default=0)
    seqlen_k = _int("max_seqlen_k", max_seqlen_k)
    sem = semantics(
        q,
        batch_size=batch_size,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        dropout_p=dropout_p,
        seqlen_k=longest_k if seqlen_k is None else seqlen_k,
    )
    want_lse = bool(return_attn_probs)
    seqlen_q = _int("max_seqlen_q", max_seqlen_q)
    if block_table is None:
        rows, keys = _used_prefix(offsets_q, q.shape[0]), _used_prefix(offsets_k, k.shape[0])
        # subquad validates the offsets and the max_seqlens (naming them).
        out, lse = _run.packed(
            q[:rows],
            k[:keys],
            v[:keys],
            offsets_q,
            offsets_k,
            sem,
            want_lse,
            max_seqlen_q=seqlen_q,
            max_seqlen_k=seqlen_k,
        )
    else:
        _check_offsets("cu_seqlens_q", offsets_q, q.shape[0], seqlen_q, "max_seqlen_q")
        _check_offsets("cu_seqlens_k", offsets_k, None, seqlen_k, "max_seqlen_k")
        out, lse = _paged(q, k, v, offsets_q, offsets_k, block_table, sem, want_lse)
    out, lse = _pad_rows(out, lse, q.shape[0])
    return (out, lse, probs_placeholder(q)) if lse is not None else out


def _int(name: str, value: object) -> Optional[int]:
    """A ``max_seqlen`` as an int; ``None`` (computed from the offsets) is accepted, flash-attn requires an int."""
    if value is None:
        return None
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value.item())
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArgumentError(f"{name} must be an int, got {value!r}.")
    return value


def _used_prefix(offsets: Sequence[int], total: int) -> int:
    """How many leading rows the offsets use (flash-attn leaves rows past ``offsets[-1]`` alone).

    Offsets past ``total`` are left for subquad's validation to refuse.
    """
    return offsets[-1] if offsets and 0 <= offsets[-1] <= total else total


def _check_offsets(
    name: str, offsets: Sequence[int], total: Optional[int], longest: Optional[int], longest_name: str
) -> None:
    """What subquad checks of packed offsets, for the paged path (whose keys are not packed)."""
    if not offsets or offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ArgumentError(f"Expected {name} to start at 0 and never decrease, got {list(offsets)[:12]}.")
    if total is not None and offsets[-1] > total:
        raise ArgumentError(f"Expected {name}[-1] <= {total} (the rows of q), got {offsets[-1]}.")
    needed = max((b - a for a, b in zip(offsets, offsets[1:])), default=0)
    if longest is not None and longest < needed:
        raise ArgumentError(
            f"{longest_name}={longest} is smaller than the longest sequence ({needed} tokens); pass at least {needed} or None."
        )


def _pad_rows(out: Tensor, lse: Optional[Tensor], total: int) -> Tuple[Tensor, Optional[Tensor]]:
    """Rows past the last offset: output 0 and lse ``+inf`` (flash-attn leaves them unwritten)."""
    missing = total - out.shape[0]
    if missing == 0:
        return out, lse
    out = torch.cat([out, out.new_zeros((missing, *out.shape[1:]))])
    if lse is not None:
        lse = torch.cat([lse, lse.new_full((lse.shape[0], missing), math.inf)], dim=1)
    return out, lse


def _paged(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: List[int],
    cu_k: List[int],
    block_table: object,
    sem: Semantics,
    want_lse: bool,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Varlen queries against paged keys: sequence ``s``'s key ``p`` is in page ``block_table[s, p // page_block_size]``."""
    n = len(cu_q) - 1
    lengths = [cu_k[s + 1] - cu_k[s] for s in range(n)]
    table = page_table(block_table, n, k.shape[0], k.shape[1], lengths)
    queries = [q[cu_q[s] : cu_q[s + 1]] for s in range(n)]
    outs, lses = _run.per_sequence(
        queries,
        lambda s: (gather_pages(k, table[s], 0, lengths[s]), gather_pages(v, table[s], 0, lengths[s])),
        sem,
        want_lse,
    )
    out = torch.cat(outs) if outs else q.new_zeros((0, q.shape[1], v.shape[-1]))
    lse = (torch.cat(lses, dim=1) if lses else None) if want_lse else None
    return out, lse


def page_table(block_table: object, batch_size: int, num_blocks: int, page_size: int, lengths: Sequence[int]) -> Tensor:
    """``block_table (batch_size, max_num_blocks_per_seq)``, checked for the pages each sequence reads."""
    table = _checks.index_tensor("block_table", block_table)
    _checks.shape("block_table", table, (batch_size, None), "(batch_size, max_num_blocks_per_seq)")
    rows = table.tolist()
    for s, n in enumerate(lengths):
        pages = -(-n // page_size) if page_size else 0
        if pages > table.shape[1]:
            raise ArgumentError(
                f"block_table has {table.shape[1]} pages per sequence ({table.shape[1] * page_size} keys), sequence "
                f"{s} needs {n} keys ({pages} pages of {page_size})."
            )
        bad = [b for b in rows[s][:pages] if not 0 <= b < num_blocks]
        if bad:
            raise ArgumentError(
                f"block_table[{s}] names pages {bad[:4]} outside [0, {num_blocks}) (the num_blocks of the cache)."
            )
    return table


def gather_pages(cache: Tensor, pages: Tensor, start: int, end: int) -> Tensor:
    """Keys ``[start, end)`` of one sequence from a paged cache ``(num_blocks, page_block_size, Hk, D)``: ``(end - start, Hk, D)``."""
    page_size = cache.shape[1]
    if page_size == 0 or end <= start:
        return cache.new_empty((0, *cache.shape[2:]))
    first, last = start // page_size, -(-end // page_size)
    keys = cache.index_select(0, pages[first:last].to(device=cache.device, dtype=torch.long)).flatten(0, 1)
    return keys[start - first * page_size : end - first * page_size]
