"""The autograd Function: saves q, k, v, out and the lse; the backward walks the tiles again.

The backward never materializes ``Lq x Lk``: per tile it recomputes the scores from the saved lse
(FlashAttention-2), with PyTorch's fused CPU backward kernel where it accepts the tile and the
matmul backend otherwise (a float mask's gradient, tensors captured by ``score_mod``, dropout).

The Function also works under ``torch.func`` (``grad``, ``vjp``, ``jacrev``, ``vmap``) and with
batched gradients (``torch.autograd.grad(..., is_grads_batched=True)``, ``gradcheck``'s batched
check): a vmapped call runs example by example, each within the planned tiles.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch._C import _functorch

from . import _engine
from ._backends import BACKENDS, tiles_backend
from ._buckets import BATCH_BYTES
from ._inputs import Inputs
from ._tiles import Grads, KernelRefused, reduce_to


class Meta(NamedTuple):
    """What the Function needs besides tensors: the call without its tensors, and its plan."""

    inp: Inputs
    backend: str
    tiles: Tuple[int, int]
    backward_backend: str
    backward_tiles: Tuple[int, int]
    seed: int
    budget: int
    predicted_s: Optional[float] = None


def is_transformed(*tensors: Optional[Tensor]) -> bool:
    """Whether a tensor is wrapped by a ``torch.func`` transform (``vmap``, ``grad``)."""
    return any(t is not None and _functorch.is_functorch_wrapped_tensor(t) for t in tensors)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(
        meta: Meta,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Optional[Tensor],
        *captured: Tensor,
    ) -> Tuple[Tensor, Tensor]:
        inp = dataclasses.replace(meta.inp, query=query, key=key, value=value, attn_mask=attn_mask)
        out, lse = _engine.forward(
            inp,
            meta.backend,
            meta.tiles,
            meta.seed,
            need_lse=True,
            predicted_s=meta.predicted_s,
            batch_bytes=min(meta.budget, BATCH_BYTES),
        )
        assert lse is not None
        return out, lse

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, Tensor]) -> None:
        meta, query, key, value, attn_mask, *captured = inputs
        out, lse = output
        ctx.save_for_backward(query, key, value, attn_mask, out, lse, *captured)
        ctx.meta = meta
        ctx.set_materialize_grads(False)  # an unused lse (or output) gets no zero-filled gradient

    @staticmethod
    def backward(ctx: Any, grad_out: Optional[Tensor], grad_lse: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        query, key, value, attn_mask, out, lse, *captured = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        wanted = tuple(ctx.needs_input_grad[1:])  # query, key, value, attn_mask, *captured
        grads = iter(
            _Backward.apply(ctx.meta, wanted, grad_out, grad_lse, query, key, value, attn_mask, out, lse, *captured)
        )
        return (None, *[next(grads) if w else None for w in wanted])

    @staticmethod
    def vmap(info: Any, in_dims: Tuple[Optional[int], ...], meta: Meta, *tensors: Optional[Tensor]) -> Any:
        # Under torch.func.vmap the call runs example by example: each is the call that was
        # planned (same shapes, same tiles), so the memory budget holds whatever the batch.
        if any(d is not None for d in in_dims[5:]):
            raise NotImplementedError(
                "vmap over a tensor that score_mod captures is not supported; vmap over query, key, value "
                "or attn_mask, or pass the batched values as attention inputs."
            )
        outs, lses = [], []
        for i in range(info.batch_size):
            m = meta
            if meta.inp.dropout_p > 0 and info.randomness == "different":
                m = meta._replace(seed=(meta.seed * 1000003 + i + 1) % (2**31 - 1))
            args = [t if (t is None or d is None) else t.select(d, i) for t, d in zip(tensors, in_dims[1:])]
            o, l = _Attention.apply(m, *args)
            outs.append(o)
            lses.append(l)
        return (torch.stack(outs), torch.stack(lses)), (0, 0)


class _Backward(torch.autograd.Function):
    """The gradients of a call, as a Function of its own so that transforms can batch it.

    Under ``torch.func`` (``jacrev``, ``vmap(grad(...))``) the incoming gradient is batched:
    :meth:`vmap` runs one backward per example. Differentiating its outputs again raises
    (subquad has no double backward) instead of treating the gradients as constants.
    """

    @staticmethod
    def forward(
        meta: Meta,
        wanted: Tuple[bool, ...],
        grad_out: Tensor,
        grad_lse: Optional[Tensor],
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Optional[Tensor],
        out: Tensor,
        lse: Tensor,
        *captured: Tensor,
    ) -> Tuple[Optional[Tensor], ...]:
        def grads_of(
            go: Tensor, gl: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, m: Optional[Tensor], o: Tensor, l: Tensor
        ) -> Tuple[Optional[Tensor], ...]:
            inp = dataclasses.replace(meta.inp, query=q, key=k, value=v, attn_mask=m)
            dq, dk, dv, dmask, dcaptured = backward_grads(
                inp,
                meta.backward_backend,
                meta.backward_tiles,
                meta.seed,
                meta.budget,
                go,
                o,
                l,
                gl,
                wanted=wanted[:4],
                captured=captured,
                predicted_s=meta.predicted_s,
            )
            return tuple(g for g, w in zip((dq, dk, dv, dmask, *dcaptured), wanted) if w)

        with torch.no_grad():
            return per_example(grads_of, grad_out, grad_lse, query, key, value, attn_mask, out, lse)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise NotImplementedError(
            "subquad's attention does not support double backward (create_graph=True); "
            "use torch.nn.functional.scaled_dot_product_attention for higher-order gradients."
        )

    @staticmethod
    def vmap(
        info: Any, in_dims: Tuple[Optional[int], ...], meta: Meta, wanted: Tuple[bool, ...], *tensors: Optional[Tensor]
    ) -> Any:
        if any(d is not None for d in in_dims[10:]):
            raise NotImplementedError("vmap over a tensor that score_mod captures is not supported.")
        results = []
        for i in range(info.batch_size):
            args = [t if (t is None or d is None) else t.select(d, i) for t, d in zip(tensors, in_dims[2:])]
            results.append(_Backward.apply(meta, wanted, *args))
        stacked = tuple(torch.stack(parts) for parts in zip(*results))
        return stacked, tuple(0 for _ in stacked)


def per_example(
    fn: Callable[..., Tuple[Optional[Tensor], ...]], *tensors: Optional[Tensor]
) -> Tuple[Optional[Tensor], ...]:
    """``fn(*tensors)`` computed on plain tensors.

    ``torch.autograd.grad(..., is_grads_batched=True)`` (and ``gradcheck``'s batched check) run
    the backward under the older vmap, which does not dispatch to :meth:`_Backward.vmap`: the
    engine's private kernels and in-place accumulators have no batching rules, so that vmap
    level is peeled off here and ``fn`` runs once per example. Results come back batched.
    """
    if not any(t is not None and _functorch.is_legacy_batchedtensor(t) for t in tensors):
        return fn(*tensors)
    level = torch._C._vmapmode_increment_nesting()
    torch._C._vmapmode_decrement_nesting()
    level -= 1  # the innermost level now running
    plain: List[Tuple[Optional[Tensor], bool]] = []
    size = 0
    for t in tensors:
        if t is not None and _functorch.is_legacy_batchedtensor(t):
            u = torch._remove_batch_dim(t, level, 1, 0)
            size = u.shape[0]
            plain.append((u, True))
        else:
            plain.append((t, False))
    results = [fn(*[u[i] if batched and u is not None else u for u, batched in plain]) for i in range(size)]
    return tuple(
        None if parts[0] is None else torch._add_batch_dim(torch.stack(parts), 0, level) for parts in zip(*results)
    )


def _tiles_fallback(inp: Inputs, budget: int) -> Tuple[str, Tuple[int, int]]:
    """The tiled backward (the loops' where they take it) and its tiles, where the fused one
    cannot run the call."""
    name = tiles_backend(inp, True)
    return name, BACKENDS[name].backward_tiles(inp, budget)


def backward_grads(
    inp: Inputs,
    backend: str,
    tiles: Tuple[int, int],
    seed: int,
    budget: int,
    grad_out: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_lse: Optional[Tensor],
    wanted: Sequence[bool],
    captured: Sequence[Tensor] = (),
    predicted_s: Optional[float] = None,
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor], List[Tensor]]:
    """``(dq, dk, dv, dmask, dcaptured)`` of one call from its saved out and lse, in tiles.

    ``wanted`` says which of q, k, v, attn_mask need a gradient (``None`` is returned for the
    others). Each gradient has its input's shape (a batch-broadcast key gets the sum over the
    batch). Shared by the autograd Function and the ``torch.compile`` backward operator.
    """
    query, key, value, attn_mask = inp.query, inp.key, inp.value, inp.attn_mask
    want_q, want_k, want_v, want_mask = wanted
    want_mask = bool(want_mask and attn_mask is not None)
    if grad_lse is not None and not bool(grad_lse.any()):
        grad_lse = None  # a zero-filled gradient of an unused lse
    if grad_lse is not None:
        # Fully masked rows have lse = -inf and no keys to pass a gradient to.
        grad_lse = grad_lse.masked_fill(torch.isneginf(lse), 0.0)
        if backend == "fused":
            # The fused backward computes D itself; the matmul tiles take dlse (same budget).
            backend, tiles = _tiles_fallback(inp, budget)
    with torch.no_grad():
        if backend == "fused" and not want_mask and not captured:
            try:
                whole = _engine.whole_fused_backward(inp, tiles, grad_out, out, lse)
            except KernelRefused as e:
                _warn_refused(e)
                whole = None
                backend, tiles = _tiles_fallback(inp, budget)
            if whole is not None:
                dq, dk, dv = (reduce_to(g, t.shape) for g, t in zip(whole, (query, key, value)))
                return dq if want_q else None, dk if want_k else None, dv if want_v else None, None, []
        while True:
            grads = _zero_grads(inp, want_q, want_k, want_v, want_mask, captured)
            try:
                _engine.backward(inp, backend, tiles, seed, grad_out, out, lse, grads, grad_lse, predicted_s)
                break
            except KernelRefused as e:
                if backend != "fused":
                    raise
                _warn_refused(e)
                backend, tiles = _tiles_fallback(inp, budget)

    def cast(g: Optional[Tensor], like: Optional[Tensor]) -> Optional[Tensor]:
        return None if g is None or like is None else g.to(like.dtype)

    return (
        cast(grads.dq, query),
        cast(grads.dk, key),
        cast(grads.dv, value),
        cast(grads.dmask, attn_mask),
        list(grads.dcaptured),
    )


def _zero_grads(
    inp: Inputs, want_q: bool, want_k: bool, want_v: bool, want_mask: bool, captured: Sequence[Tensor]
) -> Grads:
    half = inp.dtype in (torch.float16, torch.bfloat16)
    acc_dtype = torch.float32 if half else inp.dtype

    # A packed call's backward writes each sequence's rows once (see Grads): zero-filling them
    # first cost 10% of the forward and backward of 1024 short sequences.
    blank = inp.packed is not None

    def zeros(t: Optional[Tensor], dtype: torch.dtype, want: bool) -> Optional[Tensor]:
        # In the input's own layout (a transposed (B, L, H, E) caller, packed (total, H, E)
        # sequences): autograd would otherwise copy each gradient into that layout.
        if not want or t is None:
            return None
        return torch.empty_like(t, dtype=dtype) if blank else torch.zeros_like(t, dtype=dtype)

    return Grads(
        dq=zeros(inp.query, acc_dtype, want_q),
        dk=zeros(inp.key, acc_dtype, want_k),
        dv=zeros(inp.value, acc_dtype, want_v),
        dmask=None
        if not (want_mask and inp.attn_mask is not None)
        else torch.zeros(inp.attn_mask.shape, dtype=inp.stats_dtype, device=inp.attn_mask.device),
        proxies={id(c): c.detach().requires_grad_() for c in captured},
        dcaptured=[torch.zeros_like(c) for c in captured],
    )


def _warn_refused(e: KernelRefused) -> None:
    warnings.warn(
        f"subquad: the fused CPU backward kernel refused this input ({str(e).splitlines()[0][:200]}); "
        "running the matmul tiles instead.",
        RuntimeWarning,
        stacklevel=3,
    )


def attention_with_grad(inp: Inputs, meta: Meta, captured: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    """Run the call through the autograd Function (``mask_mod``/``score_mod`` ride along in ``meta``)."""
    # Meta holds the call without its tensors (typed as tensors: None only here); autograd gets them as arguments.
    stripped = dataclasses.replace(inp, query=None, key=None, value=None, attn_mask=None, groups=None)  # type: ignore[arg-type]
    out, lse = _Attention.apply(meta._replace(inp=stripped), inp.query, inp.key, inp.value, inp.attn_mask, *captured)
    return out, lse
