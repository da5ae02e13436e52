r"""xformers' ``fmha`` functions over subquad: the signatures, defaults and return values of xformers
0.0.35, computed in tiles on any device (CPU, MPS, CUDA, ...).

Shapes (:mod:`._inputs` has the table): ``query (B, Mq, [G,] H, K)`` or ``(B, Mq, K)``, ``key (B,
Mkv, [G,] H, K)``, ``value (B, Mkv, [G,] H, Kv)`` -> ``out (B, Mq, [G,] H, Kv)``; ``lse (B, [G,] H,
Mq)`` (BMK: ``(B, 1, Mq)``; block-diagonal biases: ``(1, [G,] H, T)``, batch 1). GQA/MQA is given
expanded, as xformers takes it: ``key (B, Mkv, G, H, K)`` from ``(B, Mkv, G, 1, K).expand(...)``.

``op`` is accepted and ignored (one implementation serves every operator). Each function is a
signature, a docstring and a hand-off to :class:`._inputs.Inputs` (validation) and
:mod:`._attend` (the computation).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from subquad import ArgumentError

from . import _attend, _merge
from ._inputs import Inputs
from ._reading import Blocks, Reading

Bias = Any  # None, a tensor, or an attn_bias object (subquad's look-alikes or real xformers ones)
_NO_DROPOUT = (
    "dropout is not supported on the non-autograd API. If you want to use dropout, please call "
    "`memory_efficient_attention` directly"
)


def memory_efficient_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_bias: Bias = None,
    p: float = 0.0,
    scale: Optional[float] = None,
    *,
    op: Any = None,
    output_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    r"""Exact attention in bounded memory (Rabe & Staats, "Self-attention does not need O(n²) memory").

    Shapes: ``query (B, Mq, H, K)``, ``key (B, Mkv, H, K)``, ``value (B, Mkv, H, Kv)`` -> ``(B, Mq, H,
    Kv)``; also ``(B, M, K)`` (one head) and ``(B, M, G, H, K)`` (GQA, keys/values expanded along
    ``H``). Equal (up to rounding, never building ``Mq x Mkv``) to::

        scale = scale if scale is not None else query.shape[-1] ** -0.5
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))      # (B, H, M, K)
        s = (q @ k.transpose(-2, -1)) * scale + attn_bias.materialize((B, H, Mq, Mkv))
        out = torch.dropout(s.softmax(-1), p, train=True) @ v           # rows that see no key: 0
        return out.transpose(1, 2).contiguous().to(output_dtype or query.dtype)

    ``attn_bias``: ``None``, a tensor ``(B, H, Mq, Mkv)`` in the inputs' dtype (it gets gradients),
    or an :mod:`~subquad.compat.xformers.ops.fmha.attn_bias` object -- subquad's or real xformers'
    -- run as causal flags, windows or packed sequences, never materialized. Gradients flow to
    ``query``, ``key``, ``value`` (and a tensor bias); ``op`` is ignored.

    Raises:
        ValueError (also ``RuntimeError``): xformers' refusals, with its messages -- mismatched
            ndim/device/dtype/shapes ("HINT: We don't support broadcasting"), a bias other than
            ``LowerTriangularMask``/a tensor with BMK inputs, a tensor bias of the wrong shape or
            dtype, a block-diagonal bias with batch > 1, ``p`` outside ``[0, 1]`` -- and a
            block-diagonal bias built for other lengths than the inputs.
        NotImplementedError: an ``attn_bias`` class subquad does not know; int32 (quantized) keys.
    """
    inp = Inputs(query, key, value, attn_bias, p, scale, output_dtype)
    return _attend.forward(inp, inp.validate(), return_lse=False)[0]


def memory_efficient_attention_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_bias: Bias = None,
    p: float = 0.0,
    scale: Optional[float] = None,
    *,
    op: Any = None,
    output_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """The forward of :func:`memory_efficient_attention` (same arguments, same result)."""
    inp = Inputs(query, key, value, attn_bias, p, scale, output_dtype)
    return _attend.forward(inp, inp.validate(), return_lse=False)[0]


def memory_efficient_attention_forward_requires_grad(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_bias: Bias = None,
    p: float = 0.0,
    scale: Optional[float] = None,
    *,
    op: Any = None,
    output_dtype: Optional[torch.dtype] = None,
) -> Tuple[Tensor, Tensor]:
    """``(out, lse)``: :func:`memory_efficient_attention` and the log-sum-exp of each row's scores.

    ``lse (B, H, Mq)`` float32 (float64 for float64 inputs; ``(1, H, T)`` with a block-diagonal
    bias), ``-inf`` for rows that see no key. Equal to
    ``torch.logsumexp(q @ k.transpose(-2, -1) * scale + bias, -1)`` in the notation of
    :func:`memory_efficient_attention`. Pass both to :func:`memory_efficient_attention_backward`.

    Raises:
        NotImplementedError: ``p != 0`` (as xformers: use :func:`memory_efficient_attention`).

    Otherwise it raises as :func:`memory_efficient_attention`.
    """
    if p != 0.0:
        raise NotImplementedError(_NO_DROPOUT)
    inp = Inputs(query, key, value, attn_bias, p, scale, output_dtype)
    out, lse = _attend.forward(inp, inp.validate(), return_lse=True)
    assert lse is not None
    return out, lse


def memory_efficient_attention_backward(
    grad: Tensor,
    output: Tensor,
    lse: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_bias: Bias = None,
    p: float = 0.0,
    scale: Optional[float] = None,
    *,
    op: Any = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)``: the gradients of :func:`memory_efficient_attention` for the output gradient ``grad``.

    ``output`` and ``lse`` are what :func:`memory_efficient_attention_forward_requires_grad`
    returned; their shapes are checked as xformers does, then the forward is recomputed in tiles
    (subquad's backward keeps its own statistics). Equal to ``torch.autograd.grad(
    memory_efficient_attention(query, key, value, attn_bias, scale=scale), (query, key, value), grad)``.

    Raises:
        NotImplementedError: ``p != 0``.
        ValueError: ``grad``/``output`` not of the query's ndim; ``lse`` of the wrong shape (xformers'
            messages); as :func:`memory_efficient_attention` otherwise.
    """
    if p != 0.0:
        raise NotImplementedError(_NO_DROPOUT)
    inp = Inputs(query, key, value, attn_bias, p, scale)
    reading = inp.validate()
    if grad.dim() != query.dim() or grad.dim() != output.dim():
        raise ArgumentError(
            "All tensors should be either in BMK (ndim=3) or BMHK (ndim=4) format. \n"
            f"grad.shape : {grad.shape} \nout.shape  : {output.shape} \nquery.shape: {query.shape}"
        )
    _check_lse(lse, query, reading)
    return _attend.gradients(inp, reading, grad)


def _check_lse(lse: Tensor, query: Tensor, reading: Reading) -> None:
    """xformers' rule: ``(B, [G,] H, >= M)``; block-diagonal: packed ``(1, [G,] H, T)`` or padded ``(n, [G,] H, >= max)``."""
    q_shape = query.shape if query.dim() > 3 else (query.shape[0], query.shape[1], 1, query.shape[2])
    wrong = ArgumentError(
        f"Input tensors have incompatible shapes.\n  lse.shape    : {lse.shape}\n  query.shape  : {query.shape}\n"
        f"  attn_bias    : {reading.name}"
    )
    if lse.dim() != len(q_shape) - 1 or tuple(lse.shape[1:-1]) != tuple(q_shape[2:-1]):
        raise wrong
    packed = lse.shape[0] == q_shape[0] and lse.shape[-1] >= q_shape[1]
    if isinstance(reading, Blocks):
        lengths = [b - a for a, b in zip(reading.q_starts, reading.q_starts[1:])]
        padded = lse.shape[0] == len(lengths) and lse.shape[-1] >= max(lengths, default=0)
        if not (packed or padded):
            raise wrong
    elif not packed:
        raise wrong


def memory_efficient_attention_partial(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_bias: Bias = None,
    p: float = 0.0,
    scale: Optional[float] = None,
    *,
    op: Any = None,
    output_dtype: Optional[torch.dtype] = None,
) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of attention over one chunk of the keys, to be combined by :func:`merge_attentions`.

    As :func:`memory_efficient_attention_forward_requires_grad`, but ``out`` is float32 (float64
    kept) unless ``output_dtype`` says otherwise, and rows that see no key of this chunk give ``out
    = 0``, ``lse = -inf`` (they weigh nothing in the merge). Calls on the same queries and disjoint
    keys merge into attention over all the keys::

        out1, lse1 = memory_efficient_attention_partial(q, k[:, :n], v[:, :n])
        out2, lse2 = memory_efficient_attention_partial(q, k[:, n:], v[:, n:])
        out, lse = merge_attentions([out1, out2], [lse1, lse2])    # == attention over all of k

    Raises:
        NotImplementedError: ``p != 0``. As :func:`memory_efficient_attention` otherwise.
    """
    if p != 0.0:
        raise NotImplementedError("dropout is not supported.")
    inp = Inputs(query, key, value, attn_bias, p, scale, output_dtype, is_partial=True)
    out, lse = _attend.forward(inp, inp.validate(), return_lse=True)
    assert lse is not None
    return out, lse


def merge_attentions(
    attn_split: Union[Tensor, Sequence[Tensor]],
    lse_split: Union[Tensor, Sequence[Tensor]],
    write_lse: bool = True,
    output_dtype: Optional[torch.dtype] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Attention over the union of key chunks from each chunk's ``(out, lse)``.

    Shapes: ``attn_split`` a list of ``(B, M, [G,] H, K)`` or one ``(chunks, B, M, [G,] H, K)``;
    ``lse_split`` a list of ``(B, [G,] H, M)`` or one ``(chunks, B, [G,] H, M)`` -> ``out (B, M, [G,]
    H, K)`` (``output_dtype``, default the chunks' dtype), ``lse (B, [G,] H, M)`` or ``None``
    (``write_lse=False``). Equal to::

        w = torch.softmax(torch.stack(lse_split), dim=0)           # (chunks, B, H, M)
        out = (w.permute(0, 1, 3, 2).unsqueeze(-1) * torch.stack(attn_split)).sum(0)
        lse = torch.logsumexp(torch.stack(lse_split), dim=0)

    with rows that no chunk sees giving ``out = 0``, ``lse = -inf``. Differentiable.

    Raises:
        ValueError: shapes that do not match (xformers' messages); ``write_lse=False`` while the
            inputs require gradients.
    """
    return _merge.merge(attn_split, lse_split, write_lse, output_dtype)
