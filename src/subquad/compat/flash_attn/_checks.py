"""flash-attn's argument checks, with its messages, for every front end of this package.

flash-attn raises ``RuntimeError`` (its ``TORCH_CHECK``\\ s) for bad input; these raise
subquad's :class:`~subquad.ArgumentError` / :class:`~subquad.ArgumentTypeError`,
which are ``RuntimeError``\\ s too, so ``except RuntimeError`` keeps working. Each message starts
with flash-attn's own wording where it has one, then shows the values. What flash-attn refuses
only because its kernels cannot do it (float32/float64, head dims over 256 or not multiples of 8,
CPU tensors, int64 offsets, page sizes not multiples of 256) is accepted here.

Used by the rest of the package: :func:`dims`, :func:`shape`, :func:`float_dtype`,
:func:`same_dtype`, :func:`heads`, :func:`index_tensor`, :func:`window_size`, :func:`alibi`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch
from torch import Tensor

from subquad import ArgumentError, ArgumentTypeError

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTS = (torch.int32, torch.int64)


def _shape(t: Tensor) -> Tuple[int, ...]:
    return tuple(t.shape)


def tensor(name: str, t: object) -> Tensor:
    """``t`` itself, if it is a tensor."""
    if not isinstance(t, Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    return t


def dims(name: str, t: object, legend: str) -> Tensor:
    """``t``, a tensor with as many dims as ``legend`` names (``"(batch_size, seqlen, nheads, headdim)"``)."""
    t = tensor(name, t)
    n = legend.count(",") + 1
    if t.dim() != n:
        raise ArgumentError(f"{name} must have {n} dims {legend}, got shape {_shape(t)}.")
    return t


def shape(name: str, t: Tensor, expected: Sequence[Optional[int]], legend: str) -> None:
    """flash-attn's ``CHECK_SHAPE``: ``t.shape == expected`` (``None`` matches any size)."""
    if t.dim() != len(expected) or any(e is not None and s != e for s, e in zip(t.shape, expected)):
        want = ", ".join("*" if e is None else str(e) for e in expected)
        raise ArgumentError(f"{name} must have shape {legend} = ({want}), got {_shape(t)}.")


def float_dtype(name: str, t: Tensor) -> None:
    if t.dtype not in FLOATS:
        raise ArgumentTypeError(
            f"FlashAttention only support fp16 and bf16 data type (subquad also float32 and float64), got {name} {t.dtype}."
        )


def same_dtype(first: str, a: Tensor, second: str, b: Tensor) -> None:
    if a.dtype != b.dtype:
        raise ArgumentTypeError(f"{first} and {second} must have the same dtype, got {a.dtype} and {b.dtype}.")


def heads(num_heads: int, num_heads_k: int) -> None:
    if num_heads_k == 0 or num_heads % num_heads_k != 0:
        raise ArgumentError(
            f"Number of heads in key/value must divide number of heads in query, got {num_heads} query heads "
            f"and {num_heads_k} key/value heads."
        )


def index_tensor(name: str, t: object, size: Optional[int] = None, legend: str = "(batch_size,)") -> Tensor:
    """An integer tensor (flash-attn: int32; int64 is accepted too), of ``size`` entries when given."""
    t = tensor(name, t)
    if t.dtype not in INTS:
        raise ArgumentTypeError(f"{name} must have dtype int32 (or int64), got {t.dtype} of shape {_shape(t)}.")
    if size is not None:
        shape(name, t, (size,), legend)
    return t


def window_size(value: Any) -> Tuple[int, int]:
    """``(left, right)`` as Python ints (flash-attn's tests pass a tensor of two)."""
    try:
        left, right = (int(x) for x in value)
    except (TypeError, ValueError):
        raise ArgumentError(f"window_size must be (left, right), two ints (-1 = unbounded), got {value!r}.") from None
    return left, right


def alibi(slopes: object, batch_size: int, num_heads: int, like: Tensor) -> Tensor:
    """ALiBi slopes as ``(batch_size, num_heads)`` (a view of ``(num_heads,)``), on ``like``'s device."""
    t = tensor("alibi_slopes", slopes)
    if not t.is_floating_point():
        raise ArgumentTypeError(f"ALiBi slopes must have dtype fp32 (subquad: any float dtype), got {t.dtype}.")
    if _shape(t) not in ((num_heads,), (batch_size, num_heads)):
        raise ArgumentError(
            f"alibi_slopes must have shape (nheads,) or (batch_size, nheads) = ({num_heads},) or "
            f"({batch_size}, {num_heads}), got {_shape(t)}."
        )
    return t.to(like.device).expand(batch_size, num_heads)
