"""User input checked once, into an :class:`~subquad._inputs.Inputs`: errors name the argument.

:func:`call_inputs` validates a call (its tensors and its :class:`~subquad._options.CallOptions`)
and brings it to the canonical 4-D layout (views, never copies), in named steps; :func:`make_inputs`
is the same from keywords; :func:`make_packed_inputs` does it for packed sequences described by
``cu_seqlens``. Invalid input raises ``ArgumentError``/``ArgumentTypeError`` (``ValueError``/
``TypeError`` that are also ``RuntimeError``, what SDPA raises) showing the values.

Used by the rest of the package: ``call_inputs``, ``make_inputs``, ``make_packed_inputs``, ``check_bool``,
``parse_chunk_size``, ``causal_bias_offset``.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._errors import ArgumentError, ArgumentTypeError
from ._inputs import FLOAT_DTYPES, BatchGroups, Inputs, MaskMod, Packed, ScoreMod, fold_batch, prod
from ._options import CallOptions, Varlen


def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise ArgumentTypeError(f"Expected {name} to be a torch.Tensor, got {type(t).__name__}.")
    if t.is_nested:
        raise NotImplementedError(
            f"{name} is a nested tensor, which this call does not take: subquad.attention and subquad.sdpa take "
            "jagged ones (B, H, j, E); subquad.varlen_attention takes their values() with cu_seqlens."
        )
    if t.layout != torch.strided:
        raise ArgumentTypeError(f"Expected {name} to be a dense (strided) tensor, got layout {t.layout}.")
    if t.dtype not in FLOAT_DTYPES:
        raise ArgumentTypeError(
            f"Expected {name} to be a floating-point tensor (float64, float32, float16 or bfloat16), "
            f"got dtype {t.dtype}."
        )
    if t.dim() < 2:
        raise ArgumentError(f"Expected {name} to have at least 2 dims (..., L, E), got shape {_shape(t)}.")
    return t


def check_bool(name: str, value: object) -> bool:
    """A flag must be a Python bool (as in SDPA, which refuses 1, "no" and numpy bools)."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"Expected {name} to be a bool, got {type(value).__name__} {value!r}.")
    return value


def _real(name: str, value: object) -> float:
    """A number: Python and numpy scalars, or a one-element tensor (SDPA accepts all three)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, Tensor)):
        raise ArgumentTypeError(f"Expected {name} to be a number, got {type(value).__name__} {value!r}.")
    if isinstance(value, Tensor) and (value.numel() != 1 or value.dtype == torch.bool or value.is_complex()):
        raise ArgumentTypeError(f"Expected {name} to be a number, got a tensor of shape {_shape(value)}.")
    return float(value)


def parse_chunk_size(chunk_size: object) -> Optional[Tuple[int, int]]:
    """``None``, a positive int (both sides) or a pair of positive ints ``(q_chunk, kv_chunk)``."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, int) and not isinstance(chunk_size, bool):
        pair: Tuple[object, ...] = (chunk_size, chunk_size)
    elif isinstance(chunk_size, (tuple, list)) and len(chunk_size) == 2:
        pair = tuple(chunk_size)
    else:
        raise ArgumentError(
            f"Expected chunk_size to be None, a positive int or a pair (q_chunk, kv_chunk), got {chunk_size!r}."
        )
    ints = []
    for v in pair:
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ArgumentError(f"Expected chunk_size entries to be positive ints, got {chunk_size!r}.")
        ints.append(int(v))
    return ints[0], ints[1]


def causal_bias_offset(attn_mask: object, Lq: int, Lk: int, is_causal: bool) -> Optional[int]:
    """The causal offset a ``torch.nn.attention.bias.CausalBias`` stands for; ``None`` for any other mask.

    Those masks are tensor subclasses without data: SDPA dispatches on them (upper-left is
    ``is_causal``, lower-right aligns the diagonal to the bottom-right corner), and so does subquad.
    """
    if attn_mask is None or type(attn_mask) is Tensor:
        return None
    try:
        from torch.nn.attention.bias import CausalBias, CausalVariant
    except ImportError:  # a torch without the module has no such masks either
        return None
    if not isinstance(attn_mask, CausalBias):
        return None
    if is_causal:
        raise ArgumentError(
            "CausalBias should not be used with causal=True: the attn_mask already is the causal mask; "
            "pass is_causal=False (torch's SDPA raises the same)."
        )
    variant = getattr(attn_mask, "variant", None)
    if variant == CausalVariant.UPPER_LEFT:
        return 0
    if variant == CausalVariant.LOWER_RIGHT:
        sizes = (getattr(attn_mask, "seq_len_q", None), getattr(attn_mask, "seq_len_kv", None))
        if sizes != (Lq, Lk):
            raise ArgumentError(
                f"attn_mask is causal_lower_right{sizes}, but the call has Lq={Lq} queries and Lk={Lk} keys; "
                f"build it as causal_lower_right({Lq}, {Lk})."
            )
        return Lk - Lq
    raise ArgumentError(f"attn_mask is a CausalBias with an unknown variant {variant!r}.")


def make_inputs(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
) -> Inputs:
    """Validate a call and bring it to the canonical 4-D layout (views, never copies).

    The keyword form of :func:`call_inputs`, for callers that hold no :class:`CallOptions`.
    """
    options = CallOptions(
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        dropout_p=dropout_p,
        score_mod=score_mod,
        mask_mod=mask_mod,
    )
    return call_inputs(query, key, value, options)


def call_inputs(query: Tensor, key: Tensor, value: Tensor, options: CallOptions) -> Inputs:
    """Validate a call (the tensors and the options :class:`Inputs` holds) and bring it to the
    canonical 4-D layout: views, never copies."""
    q, k, v = _matching_tensors(query, key, value, options)
    q, k, v, squeeze_head, batch_shape = _heads(q, k, v, options.enable_gqa)
    p, scale = _numbers(options, q.shape[-1])
    Lq, Lk = q.shape[-2], k.shape[-2]
    attn_mask, is_causal, causal_offset = options.attn_mask, options.is_causal, 0
    offset = causal_bias_offset(attn_mask, Lq, Lk, is_causal)
    if offset is not None:
        attn_mask, is_causal, causal_offset = None, True, offset
    mask = None
    if attn_mask is not None:
        mask = _check_mask(attn_mask, q, is_causal, squeeze_head, (*batch_shape, q.shape[-3], Lq, Lk))
    q4, k4, v4, m4, groups = _canonical((q, k, v, mask), batch_shape)
    return Inputs(
        query=q4,
        key=k4,
        value=v4,
        batch_shape=() if squeeze_head else batch_shape,
        attn_mask=m4,
        is_causal=is_causal,
        scale=scale,
        dropout_p=p,
        score_mod=options.score_mod,
        mask_mod=options.mask_mod,
        causal_offset=causal_offset,
        batch=prod(batch_shape if groups is None else batch_shape[groups.split :]),
        squeeze_head=squeeze_head,
        groups=groups,
    )


def _matching_tensors(query: object, key: object, value: object, options: CallOptions) -> Tuple[Tensor, Tensor, Tensor]:
    """query, key and value, each a dense float tensor, agreeing on rank, dtype, device, ``E`` and ``Lk``
    (and the two flags, checked before their agreement as always)."""
    q = _check_tensor("query", query)
    k = _check_tensor("key", key)
    v = _check_tensor("value", value)
    check_bool("is_causal", options.is_causal)
    check_bool("enable_gqa", options.enable_gqa)
    if not (q.dim() == k.dim() == v.dim()):
        raise ArgumentError(
            "Expected query, key and value to have the same number of dims, got "
            f"query {_shape(q)}, key {_shape(k)} and value {_shape(v)}."
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ArgumentTypeError(
            "Expected query, key and value to have the same dtype, got "
            f"query {q.dtype}, key {k.dtype} and value {v.dtype}."
        )
    if not (q.device == k.device == v.device):
        raise ArgumentError(
            "Expected query, key and value on the same device, got "
            f"query {q.device}, key {k.device} and value {v.device}."
        )
    if k.shape[-1] != q.shape[-1]:
        raise ArgumentError(
            f"Expected key.shape[-1] == query.shape[-1] (E), got key {_shape(k)} and query {_shape(q)}."
        )
    if k.shape[-2] != v.shape[-2]:
        raise ArgumentError(
            f"Expected key.shape[-2] == value.shape[-2] (Lk), got key {_shape(k)} and value {_shape(v)}."
        )
    return q, k, v


def _heads(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool) -> Tuple[Tensor, Tensor, Tensor, bool, Tuple[int, ...]]:
    """``(q, k, v, squeeze_head, batch_shape)``: ``(L, E)`` inputs get their one implicit head; the
    batch dims broadcast, and the heads agree (or group, with ``enable_gqa``)."""
    squeeze_head = q.dim() == 2
    if squeeze_head:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if k.shape[-3] != v.shape[-3]:
        raise ArgumentError(
            "Expected key and value to agree on their leading dims (..., Hk), got "
            f"key {_shape(k)} and value {_shape(v)}."
        )
    batch_shape = _broadcast(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    if batch_shape is None:
        raise ArgumentError(
            "Expected query, key and value to have the same batch dims (everything before H, L, E) or "
            f"batch dims that broadcast, got query {_shape(q)}, key {_shape(k)} and value {_shape(v)}."
        )
    Hq, Hk = q.shape[-3], k.shape[-3]
    if Hq != Hk:
        if not enable_gqa:
            raise ArgumentError(
                f"Expected query and key to have the same number of heads (dim -3), got query {_shape(q)} "
                f"and key {_shape(k)}; pass enable_gqa=True for grouped-query attention."
            )
        if Hk == 0 or Hq % Hk != 0:
            raise ArgumentError(
                f"With enable_gqa=True the query heads must be a multiple of the key/value heads, got "
                f"Hq={Hq} (query {_shape(q)}) and Hk={Hk} (key {_shape(k)})."
            )
    return q, k, v, squeeze_head, batch_shape


def _numbers(options: CallOptions, E: int) -> Tuple[float, float]:
    """``(dropout_p, scale)`` as floats (the scale defaults to ``1/sqrt(E)``); the callbacks callable."""
    dropout_p, scale = options.dropout_p, options.scale
    if dropout_p is None:
        raise ArgumentTypeError("Expected dropout_p to be a number in [0, 1], got None.")
    p = _real("dropout_p", dropout_p)
    if not (0.0 <= p <= 1.0):
        raise ArgumentError(f"Expected dropout_p in [0, 1], got {dropout_p!r}.")
    if scale is None:
        scale_f = 1.0 / math.sqrt(E) if E > 0 else 1.0
    else:
        scale_f = _real("scale", scale)
        if not math.isfinite(scale_f):
            raise ArgumentError(f"Expected scale to be None or a finite number, got {scale!r}.")
    for name, fn in (("score_mod", options.score_mod), ("mask_mod", options.mask_mod)):
        if fn is not None and not callable(fn):
            raise ArgumentTypeError(f"Expected {name} to be None or a callable, got {type(fn).__name__}.")
    return p, scale_f


def _canonical(
    tensors: Tuple[Tensor, Tensor, Tensor, Optional[Tensor]], batch_shape: Tuple[int, ...]
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[BatchGroups]]:
    """``(q4, k4, v4, mask4, groups)``: the tensors with their batch dims folded into one, as views.

    Batch dims that do not fold as views (a broadcast middle dim) are cut into groups: the
    first split whose inner batch dims fold is kept, and the outer dims index the groups.
    """
    nb = len(batch_shape)
    padded = tuple(None if t is None else _pad_rank(t, nb + 3) for t in tensors)
    groups = None
    if nb <= 1:  # one batch dim (or none): each tensor is already its own canonical view
        q4, k4, v4, m4 = (None if t is None else t if nb else t.unsqueeze(0) for t in padded)
    else:
        # The first split whose inner batch dims fold into one as views (the last one always does).
        split = next(
            j
            for j in range(nb + 1)
            if all(t is None or fold_batch(t[(0,) * j] if j else t, batch_shape[j:]) is not None for t in padded)
        )
        groups = BatchGroups(padded, batch_shape, split) if split else None
        first = tuple(None if t is None else t[(0,) * split] if split else t for t in padded)
        q4, k4, v4, m4 = (None if t is None else fold_batch(t, batch_shape[split:]) for t in first)
    assert q4 is not None and k4 is not None and v4 is not None
    return q4, k4, v4, m4, groups


def _pad_rank(t: Tensor, rank: int) -> Tensor:
    while t.dim() < rank:
        t = t.unsqueeze(0)
    return t


def _check_mask(
    attn_mask: object, q: Tensor, is_causal: bool, squeeze_head: bool, full_shape: Tuple[int, ...]
) -> Tensor:
    if not isinstance(attn_mask, Tensor):
        raise ArgumentTypeError(f"Expected attn_mask to be None or a torch.Tensor, got {type(attn_mask).__name__}.")
    if attn_mask.is_nested or attn_mask.layout != torch.strided:
        raise ArgumentTypeError(
            f"Expected attn_mask to be a dense (strided) tensor, got a {'nested' if attn_mask.is_nested else attn_mask.layout} one; "
            "pass a dense mask, or a mask_mod that computes it per tile."
        )
    if is_causal:
        # The text starts with torch's own (its tests match it); the advice follows.
        raise ArgumentError(
            "Explicit attn_mask should not be set when is_causal=True: pass one of them (fold causality "
            "into the mask, or use mask_mod=subquad.mods.causal() together with attn_mask)."
        )
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in FLOAT_DTYPES:
        raise ArgumentTypeError(
            f"Expected attn_mask to be a bool tensor (True = attend) or a float tensor (added to the "
            f"scores), got dtype {attn_mask.dtype}."
        )
    if attn_mask.device != q.device:
        raise ArgumentError(f"Expected attn_mask on {q.device} like query, got {attn_mask.device}.")
    shown = full_shape[1:] if squeeze_head else full_shape
    if (squeeze_head and attn_mask.dim() >= 3) or attn_mask.dim() > len(full_shape):
        raise ArgumentError(
            f"attn_mask of shape {_shape(attn_mask)} does not broadcast to the scores' shape {tuple(shown)}."
        )
    if _broadcast(attn_mask.shape, full_shape) != tuple(full_shape):
        raise ArgumentError(
            f"attn_mask of shape {_shape(attn_mask)} does not broadcast to the scores' shape "
            f"{tuple(shown)} (..., Hq, Lq, Lk)."
        )
    return attn_mask


def _broadcast(*shapes: Sequence[int]) -> Optional[Tuple[int, ...]]:
    """The broadcast of ``shapes`` (numpy's rules), or ``None`` if they do not broadcast."""
    if all(len(s) == len(shapes[0]) and tuple(s) == tuple(shapes[0]) for s in shapes):
        return tuple(shapes[0])
    n = max(len(s) for s in shapes)
    out = [1] * n
    for s in shapes:
        for i, size in enumerate(s, start=n - len(s)):
            if size != 1:
                if out[i] not in (1, size):
                    return None
                out[i] = size
    return tuple(out)


# ----------------------------------------------------------------- packed sequences
ALIGNMENTS = ("top_left", "bottom_right")


def _cu_seqlens(name: str, cu: object, total: int) -> Tuple[int, ...]:
    """``cu_seqlens`` as Python offsets: a 1-D integer tensor, 0 first, non-decreasing, ``total`` last."""
    if isinstance(cu, Tensor):
        if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            raise ArgumentTypeError(
                f"Expected {name} to be a 1-D int32 (or int64) tensor of offsets (batch + 1,), got "
                f"{cu.dtype} of shape {_shape(cu)}."
            )
        offsets = tuple(int(x) for x in cu.tolist())
    elif isinstance(cu, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in cu):
        offsets = tuple(cu)
    else:
        raise ArgumentTypeError(
            f"Expected {name} to be a 1-D int32 tensor of offsets (batch + 1,), got {type(cu).__name__}."
        )
    if len(offsets) < 1:
        raise ArgumentError(f"Expected {name} to hold at least one offset (0), got an empty tensor.")
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ArgumentError(
            f"Expected {name} to start at 0 and never decrease, got {list(offsets)[:12]}{' ...' if len(offsets) > 12 else ''}."
        )
    if offsets[-1] != total:
        raise ArgumentError(
            f"Expected {name}[-1] == {total} (the packed length of {'query' if name.endswith('q') else 'key'}), got {offsets[-1]}."
        )
    return offsets


def _max_seqlen(name: str, given: object, offsets: Sequence[int]) -> None:
    if given is None:
        return
    if isinstance(given, Tensor) and given.numel() == 1 and not given.is_floating_point():
        given = int(given.item())
    if not isinstance(given, int) or isinstance(given, bool) or given < 0:
        raise ArgumentTypeError(f"Expected {name} to be None or an int >= 0, got {given!r}.")
    longest = max((b - a for a, b in zip(offsets, offsets[1:])), default=0)
    if given < longest:
        raise ArgumentError(
            f"{name}={given} is smaller than the longest sequence ({longest} tokens); pass at least {longest} or None."
        )


def _window_arg(window: object) -> Optional[Tuple[Optional[int], Optional[int]]]:
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ArgumentError(f"Expected window to be None or (left, right), got {window!r}.")
    for side in window:
        if side is not None and (not isinstance(side, int) or isinstance(side, bool) or side < 0):
            raise ArgumentError(f"Expected window = (left, right) with ints >= 0 or None (unbounded), got {window!r}.")
    return (window[0], window[1])


def make_packed_inputs(query: Tensor, key: Tensor, value: Tensor, options: CallOptions, varlen: Varlen) -> Inputs:
    """Validate packed sequences ``(total, H, E)`` described by ``varlen``'s ``cu_seqlens``: one
    batch entry ``(1, H, total, E)`` (a view) with :class:`~subquad._inputs.Packed` on it."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, t)
        if t.dim() != 3:
            raise ArgumentError(
                f"Expected {name} of packed sequences to be (total, H, E): 3 dims, got shape {_shape(t)}."
            )
    if options.attn_mask is not None:
        raise NotImplementedError(
            "attn_mask with packed sequences: pass the mask as a mask_mod (b is the sequence index, q_idx/kv_idx "
            "positions within it)."
        )
    alignment = varlen.alignment
    if not isinstance(alignment, str) or alignment not in ALIGNMENTS:
        raise ArgumentError(f"Unknown alignment={alignment!r}; expected one of {', '.join(map(repr, ALIGNMENTS))}.")
    win = _window_arg(varlen.window)
    cu_q = _cu_seqlens("cu_seqlens_q", varlen.cu_seqlens_q, query.shape[0])
    cu_k = _cu_seqlens("cu_seqlens_k", varlen.cu_seqlens_k, key.shape[0])
    if len(cu_q) != len(cu_k):
        raise ArgumentError(
            f"Expected cu_seqlens_q and cu_seqlens_k to describe the same number of sequences, got "
            f"{len(cu_q) - 1} and {len(cu_k) - 1}."
        )
    _max_seqlen("max_seqlen_q", varlen.max_seqlen_q, cu_q)
    _max_seqlen("max_seqlen_k", varlen.max_seqlen_k, cu_k)
    k_end = None if varlen.seqused_k is None else _seqused("seqused_k", varlen.seqused_k, cu_k)
    inp = call_inputs(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), options)
    inp.packed = Packed(cu_q, cu_k, bottom_right=alignment == "bottom_right", window=win, k_end=k_end)
    return inp


def _seqused(name: str, used: object, cu: Sequence[int]) -> Tuple[int, ...]:
    """Ends of the keys each sequence uses: ``cu[s] + used[s]``, within the sequence's block."""
    if isinstance(used, Tensor):
        if used.dim() != 1 or used.dtype not in (torch.int32, torch.int64):
            raise ArgumentTypeError(
                f"Expected {name} to be a 1-D int32 tensor (batch,), got {used.dtype} of shape {_shape(used)}."
            )
        counts = [int(x) for x in used.tolist()]
    else:
        raise ArgumentTypeError(
            f"Expected {name} to be None or a 1-D int32 tensor (batch,), got {type(used).__name__}."
        )
    if len(counts) != len(cu) - 1:
        raise ArgumentError(f"Expected {name} to have one entry per sequence ({len(cu) - 1}), got {len(counts)}.")
    for s, n in enumerate(counts):
        if not 0 <= n <= cu[s + 1] - cu[s]:
            raise ArgumentError(
                f"{name}[{s}] = {n} is outside [0, {cu[s + 1] - cu[s]}] (the keys of sequence {s} in cu_seqlens_k)."
            )
    return tuple(cu[s] + n for s, n in enumerate(counts))
