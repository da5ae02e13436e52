"""``subquad::attention``: subquad as one opaque operator for ``torch.compile``.

Dynamo cannot trace the planner and the tile loop into one graph (they read free memory, make
data-dependent choices and loop in Python), and should not: the tile loop is already the
memory-bounded program. So under ``torch.compile`` subquad runs as a ``torch.library`` custom
operator with a fake (meta) implementation for shapes and an autograd registration; the graph
around it compiles, fuses and stays whole (``fullgraph=True`` works), and the operator runs
the eager engine, planned at run time, when the compiled graph executes.

``subquad.attention`` switches to :func:`compiled_attention` by itself while compiling. The
operator's schema holds tensors, numbers and strings only, so calls with ``score_mod``,
``mask_mod`` (Python callables) or ``dropout_p > 0`` (random) cannot go through it; those run
eagerly with a graph break.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["compiled_attention", "supports"]


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _budget_arg(memory_budget: Union[int, str, None]) -> Optional[str]:
    # The schema cannot say "int or str"; bytes travel as their decimal string.
    if memory_budget is None:
        return None
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, str)):
        raise TypeError(
            f"Expected memory_budget to be None, bytes (int) or a string like '512MiB', got {memory_budget!r}."
        )
    return str(memory_budget)


def _budget_value(memory_budget: Optional[str]) -> Union[int, str, None]:
    if memory_budget is not None and memory_budget.isdigit():
        return int(memory_budget)
    return memory_budget


def _chunk_arg(chunk_size: Union[int, Sequence[int], None]) -> Optional[List[int]]:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, int) and not isinstance(chunk_size, bool):
        return [chunk_size, chunk_size]
    return [int(c) for c in chunk_size]


def _eager(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    memory_budget: Optional[str],
    chunk_size: Optional[List[int]],
    backend: str,
) -> Tuple[Tensor, Tensor]:
    # Runs when the compiled graph executes (not while tracing), so subquad.attention takes its
    # eager path here.
    import subquad

    out, lse = subquad.attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        memory_budget=_budget_value(memory_budget),
        chunk_size=tuple(chunk_size) if chunk_size is not None else None,
        backend=backend,
        return_lse=True,
    )
    return out, lse


def _fresh(t: Tensor, inputs: Sequence[Optional[Tensor]]) -> Tensor:
    # A custom op's outputs must be new, contiguous tensors (the fake implementation promises
    # contiguous strides, and outputs may not alias inputs).
    t = t.contiguous()
    ptr = t.untyped_storage().data_ptr()
    if any(i is not None and i.numel() and i.untyped_storage().data_ptr() == ptr for i in inputs):
        t = t.clone()
    return t


@torch.library.custom_op("subquad::attention", mutates_args=())
def attention_op(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    memory_budget: Optional[str],
    chunk_size: Optional[List[int]],
    backend: str,
) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of ``subquad.attention``: out ``(..., Hq, Lq, Ev)``, lse ``(..., Hq, Lq)``."""
    with torch.no_grad():
        out, lse = _eager(
            query, key, value, attn_mask, is_causal, scale, enable_gqa, memory_budget, chunk_size, backend
        )
    inputs = (query, key, value, attn_mask)
    return _fresh(out, inputs), _fresh(lse, inputs)


@attention_op.register_fake
def _attention_fake(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    memory_budget: Optional[str],
    chunk_size: Optional[List[int]],
    backend: str,
) -> Tuple[Tensor, Tensor]:
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))
    lse = query.new_empty(query.shape[:-1], dtype=_stats_dtype(query.dtype))
    return out, lse


@torch.library.custom_op("subquad::attention_backward", mutates_args=())
def attention_backward_op(
    grad_out: Tensor,
    grad_lse: Optional[Tensor],
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    memory_budget: Optional[str],
    chunk_size: Optional[List[int]],
    backend: str,
    mask_grad: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dmask)``; ``dmask`` is empty unless ``mask_grad`` (a float mask that needs it).

    The gradient is subquad's own chunked backward, reached through autograd on a recomputed
    forward: memory stays bounded by the same plan, at the price of one more forward pass.
    """
    with torch.enable_grad():
        q = query.detach().requires_grad_()
        k = key.detach().requires_grad_()
        v = value.detach().requires_grad_()
        m = attn_mask
        if m is not None:
            m = m.detach().requires_grad_(mask_grad)
        out, lse = _eager(q, k, v, m, is_causal, scale, enable_gqa, memory_budget, chunk_size, backend)
        outputs, grads = [out], [grad_out]
        if grad_lse is not None and lse.requires_grad:
            outputs.append(lse)
            grads.append(grad_lse)
        wrt = [q, k, v] + ([m] if mask_grad and m is not None else [])
        got = torch.autograd.grad(outputs, wrt, grads, allow_unused=True)
    dq, dk, dv = (torch.zeros_like(t) if g is None else g for t, g in zip((q, k, v), got[:3]))
    if mask_grad and m is not None:
        dmask = torch.zeros_like(m) if got[3] is None else got[3]
    else:
        dmask = query.new_empty(0)
    inputs = (grad_out, grad_lse, query, key, value, attn_mask)
    return tuple(_fresh(t, inputs) for t in (dq, dk, dv, dmask))  # type: ignore[return-value]


@attention_backward_op.register_fake
def _attention_backward_fake(
    grad_out: Tensor,
    grad_lse: Optional[Tensor],
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    memory_budget: Optional[str],
    chunk_size: Optional[List[int]],
    backend: str,
    mask_grad: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    dmask = attn_mask.new_empty(attn_mask.shape) if mask_grad and attn_mask is not None else query.new_empty(0)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dmask


def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    query, key, value, attn_mask, *options = inputs
    ctx.save_for_backward(query, key, value, attn_mask)
    ctx.options = options


def _backward(ctx: Any, grad_out: Tensor, grad_lse: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    query, key, value, attn_mask = ctx.saved_tensors
    mask_grad = bool(
        attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3]
    )
    dq, dk, dv, dmask = attention_backward_op(
        grad_out, grad_lse, query, key, value, attn_mask, *ctx.options, mask_grad
    )
    return dq, dk, dv, (dmask if mask_grad else None), None, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


def supports(*, score_mod: Any = None, mask_mod: Any = None, dropout_p: float = 0.0) -> bool:
    """Whether a call with these options can run as the ``subquad::attention`` operator."""
    return score_mod is None and mask_mod is None and not dropout_p


def compiled_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    memory_budget: Union[int, str, None] = None,
    chunk_size: Union[int, Sequence[int], None] = None,
    backend: str = "auto",
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``subquad.attention`` through the ``subquad::attention`` operator (same arguments and results).

    Use it where a graph must not break (``torch.compile(fullgraph=True)``, ``torch.export``);
    ``subquad.attention`` calls it by itself while compiling. It does not take ``score_mod``,
    ``mask_mod`` or ``dropout_p``: see :func:`supports`.
    """
    out, lse = attention_op(
        query,
        key,
        value,
        attn_mask,
        bool(is_causal),
        None if scale is None else float(scale),
        bool(enable_gqa),
        _budget_arg(memory_budget),
        _chunk_arg(chunk_size),
        backend,
    )
    return (out, lse) if return_lse else out
