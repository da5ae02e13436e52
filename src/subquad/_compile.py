"""``subquad::attention``: subquad as one opaque operator for ``torch.compile``.

The operator sits below the public function (as torch's compiled FlexAttention operator sits
below ``flex_attention``): :func:`subquad.attention` switches to it while compiling, handing
:func:`attention` the call's :class:`~subquad._options.CallOptions` (:func:`compiled_attention`
is the same call with keywords), and the operator's eager half runs the eager call
(:mod:`subquad._call`) on the record it makes of the operator's schema values.
``subquad.integrations.compile`` re-exports the documented names.


Dynamo cannot trace the planner and the tile loop into one graph (they read free memory, make
data-dependent choices and loop in Python), and should not: the tile loop is already the
memory-bounded program. So under ``torch.compile`` subquad runs as a ``torch.library`` custom
operator with a fake (meta) implementation for shapes and an autograd registration; the graph
around it compiles, fuses and stays whole (``fullgraph=True`` works), and the operator runs
the eager engine, planned at run time, when the compiled graph executes.

The operator's schema holds tensors, numbers and strings only, so calls with ``score_mod``,
``mask_mod`` (Python callables) or ``dropout_p > 0`` (random) cannot go through it; those run
eagerly with a graph break.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _call, mods
from ._autograd import backward_grads
from ._backends import BACKEND_NAMES
from ._options import CallOptions
from ._planner import make_plan
from ._validate import causal_bias_offset, make_inputs, parse_chunk_size

__all__ = ["compiled_attention", "supports", "attention_op", "attention_backward_op"]


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
    pair = parse_chunk_size(chunk_size)
    return None if pair is None else list(pair)


def _backend_arg(backend: str) -> str:
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKEND_NAMES):
        raise ValueError(
            f"Unknown backend={backend!r}; expected 'auto' or one of {', '.join(map(repr, BACKEND_NAMES))}."
        )
    return backend


def _record(
    query: Tensor,
    key: Tensor,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    memory_budget: Optional[str],
    chunk_size: Optional[List[int]],
    backend: str,
    lower_right: bool,
) -> CallOptions:
    """The call's record from the operator's schema values (the budget as a string, torch's
    lower-right causal mask as a flag); the operator always returns the lse."""
    return CallOptions(
        attn_mask=attn_mask,
        is_causal=is_causal,
        mask_mod=_lower_right(query, key, lower_right),
        scale=scale,
        enable_gqa=enable_gqa,
        memory_budget=_budget_value(memory_budget),
        chunk_size=tuple(chunk_size) if chunk_size is not None else None,
        backend=backend,
        return_lse=True,
    )


def _lower_right(query: Tensor, key: Tensor, lower_right: bool) -> Any:
    # torch's causal_lower_right mask travels through the operator as a flag (a CausalBias is a
    # tensor subclass without data, which AOTAutograd cannot pass to a custom operator).
    if not lower_right:
        return None
    return mods.causal_lower_right(query.shape[-2], key.shape[-2])


def _causal_kind(attn_mask: Any, is_causal: bool, query: Tensor, key: Tensor) -> Tuple[Any, bool, bool]:
    """``(attn_mask, is_causal, lower_right)`` with torch's ``CausalBias`` masks turned into flags."""
    offset = causal_bias_offset(attn_mask, query.shape[-2], key.shape[-2], is_causal)
    if offset is None:
        return attn_mask, is_causal, False
    from torch.nn.attention.bias import CausalVariant  # (causal_bias_offset found one, so it imports)

    lower = attn_mask.variant == CausalVariant.LOWER_RIGHT
    return None, not lower, lower


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
    lower_right: bool = False,
) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of ``subquad.attention``: out ``(..., Hq, Lq, Ev)``, lse ``(..., Hq, Lq)``."""
    options = _record(
        query, key, attn_mask, is_causal, scale, enable_gqa, memory_budget, chunk_size, backend, lower_right
    )
    with torch.no_grad():  # runs when the compiled graph executes (not while tracing): the eager call
        out, lse = _call.attention(query, key, value, options)
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
    lower_right: bool = False,
) -> Tuple[Tensor, Tensor]:
    # The same checks as the eager call, so that a bad call fails while tracing, not when run.
    make_inputs(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))
    lse = query.new_empty(query.shape[:-1], dtype=_stats_dtype(query.dtype))
    return out, lse


def _engine_grads(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    options: CallOptions,
    mask_grad: bool,
    grad_lse: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    # subquad's chunked backward (FlashAttention-2 from the saved lse), planned for this call.
    # A custom op runs below autograd, so this drives the engine directly, as subquad's own
    # autograd Function does.
    inp, opts, budget, _plan, _ = _call.prepare(query, key, value, options)
    # Inputs that require grad make the planner plan (and budget) a backward.
    wants = dataclasses.replace(
        inp,
        query=inp.query.detach().requires_grad_(),
        key=inp.key.detach().requires_grad_(),
        value=inp.value.detach().requires_grad_(),
        attn_mask=inp.attn_mask.detach().requires_grad_() if mask_grad and inp.attn_mask is not None else inp.attn_mask,
    )
    with torch.enable_grad():
        plan = make_plan(wants, opts, budget, options.backend)
    if plan.backward_backend is None:
        raise NotImplementedError(f"subquad planned no backward for {plan.shape} with backend={options.backend!r}.")
    chunk = plan.backward_chunk_size or plan.chunk_size or (max(inp.Lq, 1), max(inp.Lk, 1))
    rows = (inp.B, inp.Hq, inp.Lq)
    dq, dk, dv, dmask, _ = backward_grads(
        wants,
        plan.backward_backend,
        chunk,
        0,
        budget,
        grad_out.reshape(*rows, inp.Ev),
        out.reshape(*rows, inp.Ev),
        lse.reshape(rows),
        None if grad_lse is None else grad_lse.reshape(rows),
        wanted=(True, True, True, mask_grad),
    )
    assert dq is not None and dk is not None and dv is not None  # wanted: all three
    dq, dk, dv = (g.reshape(t.shape) for g, t in zip((dq, dk, dv), (query, key, value)))
    if dmask is not None and options.attn_mask is not None:
        dmask = dmask.reshape(options.attn_mask.shape)
    return dq, dk, dv, dmask


@torch.library.custom_op("subquad::attention_backward", mutates_args=())
def attention_backward_op(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    memory_budget: Optional[str],
    chunk_size: Optional[List[int]],
    backend: str,
    lower_right: bool,
    mask_grad: bool,
    grad_lse: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dmask)`` from the saved ``out`` and ``lse`` (and the lse's own gradient, if
    any); ``dmask`` is empty unless ``mask_grad``."""
    options = _record(
        query, key, attn_mask, is_causal, scale, enable_gqa, memory_budget, chunk_size, backend, lower_right
    )
    dq, dk, dv, dmask = _engine_grads(grad_out, query, key, value, out, lse, options, mask_grad, grad_lse)
    if dmask is None:
        dmask = query.new_empty(0)
    inputs = (grad_out, query, key, value, attn_mask, out, lse)
    return tuple(_fresh(t, inputs) for t in (dq, dk, dv, dmask))  # type: ignore[return-value]


@attention_backward_op.register_fake
def _attention_backward_fake(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    memory_budget: Optional[str],
    chunk_size: Optional[List[int]],
    backend: str,
    lower_right: bool,
    mask_grad: bool,
    grad_lse: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    dmask = attn_mask.new_empty(attn_mask.shape) if mask_grad and attn_mask is not None else query.new_empty(0)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dmask


def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, Tensor]) -> None:
    query, key, value, attn_mask, *schema_values = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, attn_mask, out, lse)
    ctx.schema_values = schema_values


def _backward(ctx: Any, grad_out: Tensor, grad_lse: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    # As in subquad.attention, the lse is differentiable (merging partial attentions needs it).
    query, key, value, attn_mask, out, lse = ctx.saved_tensors
    mask_grad = bool(attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3])
    dq, dk, dv, dmask = attention_backward_op(
        grad_out, query, key, value, attn_mask, out, lse, *ctx.schema_values, mask_grad, grad_lse
    )
    return dq, dk, dv, (dmask if mask_grad else None), None, None, None, None, None, None, None


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

    Shapes: ``query (..., Hq, Lq, E)``, ``key (..., Hk, Lk, E)``, ``value (..., Hk, Lk, Ev)`` ->
    ``out (..., Hq, Lq, Ev)`` (and ``lse (..., Hq, Lq)``, float32; float64 for float64 inputs).

    Use it where a graph must not break (``torch.compile(fullgraph=True)``, ``torch.export``);
    ``subquad.attention`` calls it by itself while compiling. It does not take ``score_mod``,
    ``mask_mod`` or ``dropout_p``: see :func:`supports`.

    Raises:
        TypeError / ValueError: as ``subquad.attention``; under ``torch.compile`` while tracing.
    """
    options = CallOptions(
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        memory_budget=memory_budget,
        chunk_size=chunk_size,
        backend=backend,
        return_lse=return_lse,
    )
    return attention(query, key, value, options)


def attention(query: Tensor, key: Tensor, value: Tensor, options: CallOptions) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """:func:`compiled_attention` of a call given as its record (what :func:`subquad.attention`
    hands over while compiling); ``score_mod``, ``mask_mod`` and ``dropout_p`` are not read."""
    attn_mask, is_causal, lower_right = _causal_kind(options.attn_mask, options.is_causal, query, key)
    out, lse = attention_op(
        query,
        key,
        value,
        attn_mask,
        bool(is_causal),
        None if options.scale is None else float(options.scale),
        bool(options.enable_gqa),
        _budget_arg(options.memory_budget),
        _chunk_arg(options.chunk_size),
        _backend_arg(options.backend),
        lower_right,
    )
    return (out, lse) if options.return_lse else out
