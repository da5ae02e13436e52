"""Birch-san's ``efficient_dot_product_attention`` (ComfyUI, AUTOMATIC1111) over subquad.

Both web UIs carry a ``sub_quadratic_attention.py``: ComfyUI's takes the key pre-transposed
(``key_t (B*H, E, Lk)``) with ``upcast_attention`` and, lately, an additive ``mask``;
AUTOMATIC1111's takes it as is (``key (B*H, Lk, E)``) and leaves upcasting to its caller. The two
layouts cannot be told apart when ``E == Lk``, so each has its own function here:

* :func:`efficient_dot_product_attention`: ComfyUI's signature and layout;
* :func:`efficient_dot_product_attention_a1111`: AUTOMATIC1111's.

The chunk sizes become the upper bounds of subquad's tiles, computed as the originals compute
them. Results are exact in any length (the originals were too) and differentiable (ComfyUI's
backward fails on its in-place ``exp``); subquad's backward recomputes each tile's scores from
the saved log-sum-exp, so ``use_checkpoint`` (the originals' activation checkpointing) is what
always happens and the flag is accepted for the signature's sake.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

import subquad
from subquad import ArgumentError, ArgumentTypeError

__all__ = ["efficient_dot_product_attention", "efficient_dot_product_attention_a1111"]

_HALF = (torch.float16, torch.bfloat16)


def efficient_dot_product_attention(
    query: Tensor,
    key_t: Tensor,
    value: Tensor,
    query_chunk_size: int = 1024,
    kv_chunk_size: Optional[int] = None,
    kv_chunk_size_min: Optional[int] = None,
    use_checkpoint: bool = True,
    upcast_attention: bool = False,
    mask: Optional[Tensor] = None,
) -> Tensor:
    """ComfyUI's ``efficient_dot_product_attention``, exact and differentiable, in subquad's tiles.

    Shapes: ``query (B*H, Lq, E)``, ``key_t (B*H, E, Lk)`` (the key transposed), ``value (B*H, Lk,
    Ev)`` -> ``(B*H, Lq, Ev)`` in ``value``'s dtype. Equal to::

        s = query @ key_t * E ** -0.5                        # float32 if upcast_attention
        out = torch.softmax(s + mask, dim=-1) @ value         # mask: added; optional

    computed in tiles of at most ``min(query_chunk_size, Lq)`` rows by ``kv_chunk`` keys, where
    ``kv_chunk = min(kv_chunk_size or int(sqrt(Lk)), Lk)``, raised to ``kv_chunk_size_min`` when
    that is given (even with ``kv_chunk_size``, as the original), and at most ``Lk``.

    Args:
        upcast_attention: scores and softmax in float32 for float16/bfloat16 inputs (the original
            upcasts query and key; here value too, so the product with the weights is float32 as
            well). Float32 and float64 inputs compute in their own dtype.
        use_checkpoint: accepted and unused: the backward never stores scores (see the module).
        mask: float, added to the scores (ComfyUI's ``(B*H | 1, Lq | 1, Lk)`` or ``(Lq, Lk)``), or
            bool, True = attend; broadcastable to ``(B*H, Lq, Lk)``. A row whose every key is
            masked gives 0 (the original: NaN).

    Raises:
        TypeError / ValueError (subquad's classes, also ``RuntimeError``): tensors that are not
            3-D or whose shapes disagree (a key in AUTOMATIC1111's layout says so), chunk sizes
            that are not positive ints, flags that are not bools.
        MemoryBudgetError: tiles of these chunk sizes do not fit subquad's default memory budget
            (half the free memory): pass smaller chunk sizes.
    """
    _check_shapes(query, key_t, value, transposed=True)
    return _attend(
        query,
        key_t.transpose(-2, -1),
        value,
        query_chunk_size,
        kv_chunk_size,
        kv_chunk_size_min,
        use_checkpoint,
        upcast_attention,
        mask,
    )


def efficient_dot_product_attention_a1111(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    query_chunk_size: int = 1024,
    kv_chunk_size: Optional[int] = None,
    kv_chunk_size_min: Optional[int] = None,
    use_checkpoint: bool = True,
) -> Tensor:
    """AUTOMATIC1111's ``efficient_dot_product_attention``: the key *not* transposed.

    Shapes: ``query (B*H, Lq, E)``, ``key (B*H, Lk, E)``, ``value (B*H, Lk, Ev)`` -> ``(B*H, Lq,
    Ev)`` in ``value``'s dtype, equal to ``torch.softmax(query @ key.transpose(1, 2) * E ** -0.5,
    -1) @ value``. Query and key may be float32 with a half value (AUTOMATIC1111 upcasts them
    before the call): the computation runs in the promoted dtype. Chunk sizes and errors as
    :func:`efficient_dot_product_attention`.
    """
    _check_shapes(query, key, value, transposed=False)
    return _attend(query, key, value, query_chunk_size, kv_chunk_size, kv_chunk_size_min, use_checkpoint, False, None)


def _kv_chunk(kv_chunk_size: Optional[int], kv_chunk_size_min: Optional[int], k_tokens: int) -> int:
    """The originals' key chunk: ``sqrt(Lk)`` by default, at least ``kv_chunk_size_min``; at most ``Lk`` here."""
    size = min(kv_chunk_size or int(math.sqrt(k_tokens)), k_tokens)
    if kv_chunk_size_min is not None:
        size = max(size, kv_chunk_size_min)
    # Beyond Lk the original runs one chunk of all keys: the same tile.
    return min(size, k_tokens)


def _attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    query_chunk_size: object,
    kv_chunk_size: object,
    kv_chunk_size_min: object,
    use_checkpoint: object,
    upcast_attention: object,
    mask: Optional[Tensor],
) -> Tensor:
    _check_int("query_chunk_size", query_chunk_size, minimum=1)
    if kv_chunk_size is not None:
        _check_int("kv_chunk_size", kv_chunk_size, minimum=0)  # 0, like None, means sqrt(Lk) there
    if kv_chunk_size_min is not None:
        _check_int("kv_chunk_size_min", kv_chunk_size_min, minimum=0)
    for name, flag in (("use_checkpoint", use_checkpoint), ("upcast_attention", upcast_attention)):
        if not isinstance(flag, bool):
            raise ArgumentTypeError(f"Expected {name} to be a bool, got {flag!r}.")
    out_dtype = value.dtype
    dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    if upcast_attention and dtype in _HALF:
        dtype = torch.float32
    query, key, value = (t if t.dtype == dtype else t.to(dtype) for t in (query, key, value))
    Lq, Lk = query.shape[1], key.shape[1]
    chunk: Optional[Tuple[int, int]] = None
    if Lq > 0 and Lk > 0:
        # The chunk sizes are ints or None, checked above.
        chunk = (min(query_chunk_size, Lq), _kv_chunk(kv_chunk_size, kv_chunk_size_min, Lk))  # type: ignore[call-overload, arg-type]
    try:
        out = subquad.attention(query, key, value, attn_mask=mask, chunk_size=chunk)
    except subquad.MemoryBudgetError as e:
        raise subquad.MemoryBudgetError(
            f"query_chunk_size={query_chunk_size} and kv_chunk_size={kv_chunk_size} (kv_chunk_size_min="
            f"{kv_chunk_size_min}) make tiles of {chunk}, which do not fit subquad's memory budget (half the "
            "free memory); pass smaller chunk sizes."
        ) from e
    assert isinstance(out, Tensor)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"Expected {name} to be an int, got {value!r}.")
    if value < minimum:
        raise ArgumentError(f"Expected {name} >= {minimum}, got {value}.")


def _check_shapes(query: object, key: object, value: object, *, transposed: bool) -> None:
    key_name = "key_t" if transposed else "key"
    for name, t in (("query", query), (key_name, key), ("value", value)):
        if not isinstance(t, Tensor):
            raise ArgumentTypeError(f"Expected {name} to be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 3:
            legend = {"query": "(B*H, Lq, E)", "key_t": "(B*H, E, Lk)", "key": "(B*H, Lk, E)", "value": "(B*H, Lk, Ev)"}
            raise ArgumentError(f"Expected {name} to be 3-D {legend[name]}, got shape {tuple(t.shape)}.")
    assert isinstance(query, Tensor) and isinstance(key, Tensor) and isinstance(value, Tensor)
    BH, _, E = query.shape
    Lk = value.shape[1]
    want = (BH, E, Lk) if transposed else (BH, Lk, E)
    if tuple(key.shape) != want or value.shape[0] != BH:
        other = (BH, Lk, E) if transposed else (BH, E, Lk)
        hint = ""
        if tuple(key.shape) == other and E != Lk:
            hint = (
                " That is AUTOMATIC1111's layout (key not transposed): call efficient_dot_product_attention_a1111."
                if transposed
                else " That is ComfyUI's layout (key transposed): call efficient_dot_product_attention."
            )
        layout = "(B*H, E, Lk)" if transposed else "(B*H, Lk, E)"
        raise ArgumentError(
            f"Expected {key_name} {layout} = {want} and value (B*H, Lk, Ev) with B*H = {BH}, from query (B*H, Lq, E) = "
            f"{tuple(query.shape)} and Lk = value.shape[1]; got {key_name} {tuple(key.shape)}, value "
            f"{tuple(value.shape)}.{hint}"
        )
