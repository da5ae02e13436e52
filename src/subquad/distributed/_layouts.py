"""How a sequence is cut into shards: ``zigzag`` and ``contiguous`` (``shard``, ``unshard``).

Used by the rest of ``subquad.distributed``: ``LAYOUTS``, ``check_layout``, ``pieces``, ``shard``,
``unshard``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._errors import ArgumentError, ArgumentTypeError
from ._group import Group, resolve_group, torch_distributed

LAYOUTS = ("zigzag", "contiguous")
"""The ``layout=`` values: ``"zigzag"`` (rank ``r`` holds chunks ``r`` and ``2P-1-r`` of ``2P``:
equal causal work) and ``"contiguous"`` (rank ``r`` holds the ``r``-th run of positions)."""


def check_layout(layout: object) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ArgumentError(f"Unknown layout={layout!r}; expected one of {', '.join(map(repr, LAYOUTS))}.")
    return layout


def pieces(layout: str, lengths: Sequence[int], rank: int) -> List[Tuple[int, int, int]]:
    """The runs of global positions rank ``rank`` holds: ``(local start, global start, length)``."""
    P = len(lengths)
    if layout == "contiguous":
        runs = [(0, sum(lengths[:rank]), lengths[rank])]
    else:
        c = lengths[rank] // 2
        runs = [(0, rank * c, c), (c, (2 * P - 1 - rank) * c, c)]
    return [r for r in runs if r[2] > 0]


def _split_points(layout: str, total: int, size: int) -> List[List[Tuple[int, int]]]:
    """For each rank, the ``(global start, length)`` runs it holds of a sequence of ``total``."""
    if layout == "contiguous":
        base, extra = divmod(total, size)
        lengths = [base + (1 if r < extra else 0) for r in range(size)]
    else:
        lengths = [total // size] * size
    return [[(g, n) for _, g, n in pieces(layout, lengths, r)] for r in range(size)]


def shard(x: Tensor, dim: int, group: Any = None, layout: str = "zigzag") -> Tensor:
    """This rank's shard of the whole tensor ``x`` along ``dim`` (the sequence dim, e.g. ``-2``).

    ``layout="zigzag"``: ``x`` is cut into ``2P`` equal chunks and rank ``r`` gets chunks ``r``
    and ``2P-1-r`` (the length must be a multiple of ``2P``). ``layout="contiguous"``: the
    ``r``-th of ``P`` runs, as :func:`torch.tensor_split` cuts them (any length). Equal to::

        chunks = x.chunk(2 * P, dim); torch.cat([chunks[r], chunks[2 * P - 1 - r]], dim)   # zigzag
        x.tensor_split(P, dim)[r]                                                        # contiguous

    Differentiable. Every rank must pass the same ``x``.
    """
    if not isinstance(x, Tensor):
        raise ArgumentTypeError(f"shard() expects a tensor x, got {type(x).__name__}.")
    layout = check_layout(layout)
    g = resolve_group(group)
    dim = _check_dim(x, dim)
    L = x.shape[dim]
    if layout == "zigzag" and L % (2 * g.size) != 0:
        raise ArgumentError(
            f"layout='zigzag' cuts the sequence into 2P = {2 * g.size} equal chunks, but x.shape[{dim}] = {L} "
            f"is not a multiple of {2 * g.size}. Pad the sequence, or use layout='contiguous'."
        )
    runs = _split_points(layout, L, g.size)[g.rank]
    parts = [x.narrow(dim, s, n) for s, n in runs]
    if not parts:
        return x.narrow(dim, 0, 0)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard(x: Tensor, dim: int, group: Any = None, layout: str = "zigzag") -> Tensor:
    """The whole tensor from every rank's shard ``x`` (collective: all ranks call it).

    The inverse of :func:`shard`; shards of ``layout="contiguous"`` may differ in length.
    Differentiable: the gradient of each rank's shard is the sum over ranks of the gradient of
    its part of the whole (the result is a function of every rank's shard).
    """
    if not isinstance(x, Tensor):
        raise ArgumentTypeError(f"unshard() expects a tensor x, got {type(x).__name__}.")
    layout = check_layout(layout)
    g = resolve_group(group)
    dim = _check_dim(x, dim)
    if g.size == 1:
        return x
    whole: Tensor = _Unshard.apply(x, dim, g, layout)
    return whole


def _check_dim(x: Tensor, dim: object) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < max(x.dim(), 1):
        raise ArgumentError(f"dim={dim!r} is out of range for a tensor of shape {tuple(x.shape)}.")
    return dim % x.dim()


def _all_lengths(g: Group, n: int, like: Tensor) -> List[int]:
    t = torch.tensor([n], dtype=torch.int64, device=g.comm_device(like))
    parts = [torch.empty_like(t) for _ in range(g.size)]
    torch_distributed().all_gather(parts, t, group=g.handle)
    return [int(p.item()) for p in parts]


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, g: Group, layout: str) -> Tensor:
        lengths = _all_lengths(g, x.shape[dim], x)
        if layout == "zigzag" and len(set(lengths)) > 1:
            raise ArgumentError(
                f"layout='zigzag' shards must all have the same length, got {lengths} on ranks 0..{g.size - 1}."
            )
        longest = max(lengths)
        pad = list(x.shape)
        pad[dim] = longest
        buf = x.new_zeros(pad)
        buf.narrow(dim, 0, x.shape[dim]).copy_(x)
        gathered = [torch.empty_like(buf) for _ in range(g.size)]
        torch_distributed().all_gather(gathered, buf.contiguous(), group=g.handle)
        total = sum(lengths)
        out_shape = list(x.shape)
        out_shape[dim] = total
        out = x.new_empty(out_shape)
        for r in range(g.size):
            local = 0
            for _, start, n in pieces(layout, lengths, r):
                out.narrow(dim, start, n).copy_(gathered[r].narrow(dim, local, n))
                local += n
        ctx.dim, ctx.g, ctx.layout, ctx.lengths = dim, g, layout, lengths
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], None, None, None]:
        total = grad.contiguous().clone()
        torch_distributed().all_reduce(total, group=ctx.g.handle)
        parts = [total.narrow(ctx.dim, s, n) for _, s, n in pieces(ctx.layout, ctx.lengths, ctx.g.rank)]
        if not parts:
            shape = list(grad.shape)
            shape[ctx.dim] = 0
            return grad.new_zeros(shape), None, None, None
        return (parts[0] if len(parts) == 1 else torch.cat(parts, ctx.dim)), None, None, None
