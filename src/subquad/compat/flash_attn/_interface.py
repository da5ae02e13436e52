r"""flash-attn 2.8's attention functions over subquad: signatures, docstrings, hand-off.

Names, argument order, defaults and layouts are flash-attn's (``flash_attn/flash_attn_interface.py``):
``(batch_size, seqlen, nheads, headdim)`` for batches, ``(total, nheads, headdim)`` for packed
sequences. The computation is subquad's: exact attention in tiles on every device and dtype.

Used by the rest of the package: the six public functions.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

from torch import Tensor

from . import _calls

Returned = Union[Tensor, Tuple[Tensor, Tensor, Tensor]]


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Returned:
    r"""Exact attention of a batch, flash-attn's ``flash_attn_func`` on every device.

    Shapes: ``q (B, Sq, Hq, D)``, ``k (B, Sk, Hk, D)``, ``v (B, Sk, Hk, Dv)`` -> ``out (B, Sq, Hq,
    Dv)``; with ``return_attn_probs=True`` also ``lse (B, Hq, Sq)`` (float32; float64 for float64
    inputs) and an empty tensor. ``Hq % Hk == 0``: query head ``h`` reads key/value head
    ``h // (Hq // Hk)`` (MQA/GQA). Equal (up to rounding, never forming ``Sq x Sk``) to::

        s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(Hq // Hk, 2)) * softmax_scale
        if softcap > 0: s = softcap * torch.tanh(s / softcap)
        diag = torch.arange(Sq)[:, None] + Sk - Sq            # each row's diagonal key
        j = torch.arange(Sk)
        if alibi_slopes is not None: s = s - alibi_slopes[..., None, None] * (diag - j).abs()
        s = s.masked_fill((j < diag - left) | (j > diag + right), -inf)   # causal: right = 0
        p = torch.softmax(s, -1).nan_to_num(0)                  # rows that see no key -> 0
        out = torch.einsum("bhqk,bkhd->bqhd", dropout(p, dropout_p), v.repeat_interleave(Hq // Hk, 2))
        lse = torch.logsumexp(s, -1)                            # +inf for rows that see no key

    Causal is aligned to the bottom-right corner, as in flash-attn (``x`` = attend)::

        Sq=2, Sk=5:  x x x x .      Sq=5, Sk=2:  . .
                     x x x x x                   . .
                                                 . .
                                                 x .
                                                 x x

    Args:
        dropout_p: dropout on the attention weights (subquad's generator, not flash-attn's).
        softmax_scale: default ``1 / sqrt(D)``.
        window_size: ``(left, right)``: row ``i`` sees keys ``[i + Sk - Sq - left, i + Sk - Sq + right]``;
            ``-1``: unbounded, and so is a side ``>= Sk`` (flash-attn's rules; with ``left`` set,
            ``right = -1`` means ``Sk``, which differs only for rows more than ``Sk`` above the diagonal).
        softcap: ``> 0``: ``softcap * tanh(score / softcap)`` on the scaled scores, before ALiBi.
        alibi_slopes: ``(Hq,)`` or ``(B, Hq)``, any float dtype; slopes that require grad get one.
        deterministic: accepted; subquad runs its tiles in a fixed order.
        return_attn_probs: also return ``lse`` and, in place of the probabilities, an empty tensor
            of ``q``'s dtype (what flash-attn returns when ``dropout_p == 0``). The lse is
            differentiable (flash-attn drops its gradient) and follows flash-attn's numbers: with
            ALiBi and the causal kernel it includes flash-attn's ``slope * diag`` shift.

    Raises:
        RuntimeError: flash-attn's checks (shapes, dtypes, head counts, ALiBi shapes), with its
            messages, as subquad's ``ArgumentError``/``ArgumentTypeError`` (also ``ValueError``/
            ``TypeError``). float32/float64, any head dim and any device are accepted.
    """
    return _calls.dense_call(
        q,
        k,
        v,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        return_attn_probs=return_attn_probs,
    )


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Returned:
    """:func:`flash_attn_func` of ``qkv (B, S, 3, H, D)``: ``flash_attn_func(*qkv.unbind(2), ...)``.

    The gradient is ``dqkv (B, S, 3, H, D)``. Raises as :func:`flash_attn_func`, and when ``qkv``
    is not ``(B, S, 3, H, D)``.
    """
    q, k, v = _calls.unpack("qkv", qkv, "(batch_size, seqlen, 3, nheads, headdim)")
    return _calls.dense_call(
        q,
        k,
        v,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        return_attn_probs=return_attn_probs,
    )


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Returned:
    """:func:`flash_attn_func` of ``q (B, Sq, Hq, D)`` and ``kv (B, Sk, 2, Hk, D)``: ``flash_attn_func(q, *kv.unbind(2), ...)``.

    Raises as :func:`flash_attn_func`, and when ``kv`` is not ``(B, Sk, 2, Hk, D)``.
    """
    k, v = _calls.unpack("kv", kv, "(batch_size, seqlen_k, 2, nheads_k, headdim)")
    return _calls.dense_call(
        q,
        k,
        v,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        return_attn_probs=return_attn_probs,
    )


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[Tensor] = None,
) -> Returned:
    r"""Exact attention of packed sequences, flash-attn's ``flash_attn_varlen_func`` on every device.

    Shapes: ``q (total_q, Hq, D)``, ``k (total_k, Hk, D)``, ``v (total_k, Hk, Dv)``, offsets
    ``cu_seqlens_q``/``cu_seqlens_k (B + 1,)`` int32 -> ``out (total_q, Hq, Dv)``; with
    ``return_attn_probs=True`` also ``lse (Hq, total_q)`` and an empty tensor. With ``block_table
    (B, max_num_blocks_per_seq)`` the keys are paged: ``k``/``v (num_blocks, page_block_size, Hk, D)``
    and key ``p`` of sequence ``s`` is ``k[block_table[s, p // page_block_size], p % page_block_size]``
    (any page size). Equal to, per sequence ``s`` (``Sq``, ``Sk`` its lengths)::

        rows, keys = slice(*cu_seqlens_q[s:s+2]), slice(*cu_seqlens_k[s:s+2])
        out[rows] = flash_attn_func(q[None, rows], k[None, keys], v[None, keys], ...,
                                    alibi_slopes=alibi_slopes[s] if 2-D)[0]

    so causal and windows are aligned to each sequence's bottom-right corner, and ALiBi measures
    from its diagonal. ``window_size`` sides ``>= max_seqlen_k`` are unbounded (flash-attn's rule).
    Rows past ``cu_seqlens_q[-1]`` give 0 (flash-attn leaves them unwritten); a sequence with no
    key gives 0 and lse ``+inf``. Other arguments as :func:`flash_attn_func`.

    Raises:
        RuntimeError (subquad's ``ArgumentError``/``ArgumentTypeError``): flash-attn's checks,
            offsets that do not start at 0, decrease or pass ``total``, a ``max_seqlen`` shorter
            than a sequence (flash-attn would skip its rows), a ``block_table`` too short or
            naming pages outside the cache.
    """
    return _calls.varlen_call(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        return_attn_probs=return_attn_probs,
        block_table=block_table,
    )


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Returned:
    """:func:`flash_attn_varlen_func` of ``qkv (total, 3, H, D)``, self-attention of each sequence.

    Equal to ``flash_attn_varlen_func(*qkv.unbind(1), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, ...)``.

    Raises as :func:`flash_attn_varlen_func`, and when ``qkv`` is not ``(total, 3, H, D)``.
    """
    q, k, v = _calls.unpack("qkv", qkv, "(total, 3, nheads, headdim)")
    return _calls.varlen_call(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        return_attn_probs=return_attn_probs,
    )


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Returned:
    """:func:`flash_attn_varlen_func` of ``q (total_q, Hq, D)`` and ``kv (total_k, 2, Hk, D)``.

    Equal to ``flash_attn_varlen_func(q, *kv.unbind(1), ...)``.

    Raises as :func:`flash_attn_varlen_func`, and when ``kv`` is not ``(total_k, 2, Hk, D)``.
    """
    k, v = _calls.unpack("kv", kv, "(total_k, 2, nheads_k, headdim)")
    return _calls.varlen_call(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        return_attn_probs=return_attn_probs,
    )
