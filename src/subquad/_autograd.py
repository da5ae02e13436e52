"""The autograd Function: saves q, k, v, out and the lse; the backward walks the tiles again.

The backward never materializes ``Lq x Lk``: per tile it recomputes the scores from the saved lse
(FlashAttention-2), with PyTorch's fused CPU backward kernel where it accepts the tile and the
matmul kernel otherwise (a float mask's gradient, tensors captured by ``score_mod``, dropout).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _engine
from ._inputs import Inputs
from ._kernels import Grads
from ._planner import matmul_backward_tiles


def captured_tensors(fn: Any) -> List[Tensor]:
    """Tensors requiring grad that a callback can read: closure cells, defaults, attributes, parameters.

    These become extra inputs of the autograd Function so that their gradients flow.
    """
    if fn is None:
        return []
    found: List[Tensor] = []
    seen: set = set()

    def add(obj: Any, depth: int) -> None:
        if depth > 3 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            if obj.requires_grad:
                found.append(obj)
        elif isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                add(p, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                add(x, depth + 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                add(x, depth + 1)
        elif inspect.ismethod(obj):
            add(obj.__self__, depth + 1)
            add(obj.__func__, depth + 1)
        elif inspect.isfunction(obj):
            for cell in obj.__closure__ or ():
                try:
                    add(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    pass
            for d in obj.__defaults__ or ():
                add(d, depth + 1)
            # Module-level names the function reads (a global bias table, a global nn.Module).
            names = obj.__globals__
            for name in obj.__code__.co_names:
                if name in names and not inspect.ismodule(names[name]):
                    add(names[name], depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            for x in vars(obj).values():
                add(x, depth + 1)
            if callable(obj) and hasattr(type(obj), "__call__"):
                add(getattr(obj, "__call__"), depth + 1)

    add(fn, 0)
    return found


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        meta: Tuple[Inputs, str, Tuple[int, int], str, Tuple[int, int], int, int],
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Optional[Tensor],
        *captured: Tensor,
    ) -> Tuple[Tensor, Tensor]:
        inp, kernel, chunk, bwd_kernel, bwd_chunk, seed, budget = meta
        inp = dataclasses.replace(inp, query=query, key=key, value=value, attn_mask=attn_mask)
        out, lse = _engine.forward(inp, kernel, chunk, seed, need_lse=True)
        assert lse is not None
        ctx.save_for_backward(query, key, value, attn_mask, out, lse, *captured)
        ctx.meta = (dataclasses.replace(inp, query=None, key=None, value=None, attn_mask=None), bwd_kernel, bwd_chunk, seed, budget)
        ctx.set_materialize_grads(False)  # an unused lse (or output) gets no zero-filled gradient
        return out, lse

    @staticmethod
    def backward(ctx: Any, grad_out: Optional[Tensor], grad_lse: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        if torch.is_grad_enabled():  # only true under create_graph=True
            raise NotImplementedError(
                "subquad's attention does not support double backward (create_graph=True); "
                "use torch.nn.functional.scaled_dot_product_attention for higher-order gradients."
            )
        query, key, value, attn_mask, out, lse, *captured = ctx.saved_tensors
        inp0, kernel, chunk, seed, budget = ctx.meta
        inp = dataclasses.replace(inp0, query=query, key=key, value=value, attn_mask=attn_mask)
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        need = ctx.needs_input_grad
        dq, dk, dv, dmask, dcaptured = backward_grads(
            inp, kernel, chunk, seed, budget, grad_out, out, lse, grad_lse,
            wanted=need[1:5], captured=captured,
        )
        return (None, dq, dk, dv, dmask, *[g if n else None for g, n in zip(dcaptured, need[5:])])


def backward_grads(
    inp: Inputs,
    kernel: str,
    chunk: Tuple[int, int],
    seed: int,
    budget: int,
    grad_out: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_lse: Optional[Tensor],
    wanted: Sequence[bool],
    captured: Sequence[Tensor] = (),
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor], List[Tensor]]:
    """``(dq, dk, dv, dmask, dcaptured)`` of one call from its saved out and lse, in tiles.

    ``wanted`` says which of q, k, v, attn_mask need a gradient (``None`` is returned for the
    others). Shared by the autograd Function and the ``torch.compile`` backward operator.
    """
    query, key, value, attn_mask = inp.query, inp.key, inp.value, inp.attn_mask
    want_q, want_k, want_v, want_mask = wanted
    want_mask = bool(want_mask and attn_mask is not None)
    if grad_lse is not None and not bool(grad_lse.any()):
        grad_lse = None  # a zero-filled gradient of an unused lse
    if grad_lse is not None:
        # Fully masked rows have lse = -inf and no keys to pass a gradient to.
        grad_lse = grad_lse.masked_fill(torch.isneginf(lse), 0.0)
        if kernel == "fused":
            # The fused backward computes D itself; the matmul tiles take dlse (same budget).
            kernel, chunk = "matmul", matmul_backward_tiles(inp, budget)
    with torch.no_grad():
        if kernel == "fused" and not want_mask and not captured:
            whole = _engine.whole_fused_backward(inp, chunk, grad_out, out, lse)
            if whole is not None:
                dq, dk, dv = whole
                return dq if want_q else None, dk if want_k else None, dv if want_v else None, None, []
        half = query.dtype in (torch.float16, torch.bfloat16)
        acc_dtype = torch.float32 if half else query.dtype

        def zeros_like(t: Tensor, dtype: torch.dtype, want: bool) -> Optional[Tensor]:
            return torch.zeros(t.shape, dtype=dtype, device=t.device) if want else None

        grads = Grads(
            dq=zeros_like(query, acc_dtype, want_q),
            dk=zeros_like(key, acc_dtype, want_k),
            dv=zeros_like(value, acc_dtype, want_v),
            dmask=zeros_like(attn_mask, inp.stats_dtype, want_mask) if attn_mask is not None else None,
            captured=list(captured),
            dcaptured=[torch.zeros_like(c) for c in captured],
        )
        _engine.backward(inp, kernel, chunk, seed, grad_out, out, lse, grads, grad_lse)

    def cast(g: Optional[Tensor], like: Optional[Tensor]) -> Optional[Tensor]:
        return None if g is None or like is None else g.to(like.dtype)

    return (
        cast(grads.dq, query), cast(grads.dk, key), cast(grads.dv, value), cast(grads.dmask, attn_mask),
        list(grads.dcaptured),
    )


def attention_with_grad(
    inp: Inputs,
    kernel: str,
    chunk: Tuple[int, int],
    bwd_kernel: str,
    bwd_chunk: Tuple[int, int],
    seed: int,
    captured: Sequence[Tensor],
    budget: int,
) -> Tuple[Tensor, Tensor]:
    mask = inp.attn_mask
    meta = (dataclasses.replace(inp, query=None, key=None, value=None, attn_mask=None), kernel, chunk, bwd_kernel, bwd_chunk, seed, budget)
    # mask_mod / score_mod are plain Python objects and ride along in ``meta``.
    return _Attention.apply(meta, inp.query, inp.key, inp.value, mask, *captured)
