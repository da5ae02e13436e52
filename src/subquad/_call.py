"""One eager attention call: validate -> normalize callbacks -> plan -> run, with its recoveries.

The layer below the public face (:mod:`subquad._api`), used by the face, by the compiled
operator's eager half (:mod:`subquad._compile`) and by ``subquad.distributed`` (one block of a
longer sequence per call, :func:`attention_block`). The call's options arrive as the one
:class:`~subquad._options.CallOptions` the face built; :func:`prepare`, :func:`explain` and
:func:`attention_block` also take them as keywords, for callers that hold loose values (a ring
step, torch's varlen operator). The budget is resolved once per call, in :func:`prepare`, and
handed on as bytes.

A call runs as:

1. the fast path (:mod:`subquad._fast`) when its plan is remembered;
2. :func:`prepare`: :func:`~subquad._validate.make_inputs` validates, :func:`~subquad._traced.normalize`
   rewrites the callbacks as what they are, the planner picks the backend and tiles;
3. a whole-input backend (compiled FlexAttention, torch's SDPA), which hands the call to the tiles
   if it cannot run it after all;
4. the tiles, one batch group at a time, with two recoveries: a fused kernel that refuses the
   input hands over to the matmul tiles; a real out-of-memory error retries once with tiles half
   the size. Whatever a user callback raises propagates unchanged.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, NamedTuple, Optional, Protocol, Sequence, Tuple, Union, cast

import torch
from torch import Tensor

from . import _engine, _fast
from ._autograd import Meta, attention_with_grad, is_transformed
from ._backends import BACKEND_NAMES, BACKENDS, FlexUnavailable, Options, compile_allowed, tiles_backend
from ._backends.fused import grouped_attention
from ._buckets import BATCH_BYTES
from ._budget import format_seconds, resolve_budget
from ._callbacks import captured_tensors, from_callback
from ._errors import ArgumentError, ArgumentTypeError
from ._inputs import BlockPositions, Inputs, describe
from ._options import CallOptions, Varlen, given
from ._planner import ESTIMATE_TIME_FROM_TILES, Plan, count_tiles, make_plan, predict_seconds
from ._tiles import KernelRefused, halve, is_device_fatal, is_oom
from ._traced import normalize
from ._validate import call_inputs, check_bool, make_packed_inputs, parse_chunk_size

Tiles = Tuple[int, int]

WARN_LONGER_THAN_S = 300.0
"""A call predicted to take longer than this warns once (with the plan's estimate)."""

NOT_TRIED: Any = object()  # attention(fast_key=...): the caller has not tried the fast path


class Prepared(NamedTuple):
    """A validated, normalized and planned call."""

    inp: Inputs
    opts: Options
    budget: int  # bytes
    plan: Plan
    captured: Sequence[Tensor]  # tensors score_mod reads that require grad


class _Jagged(Protocol):
    """What subquad reads of a jagged nested tensor (torch types them as plain tensors)."""

    def offsets(self) -> Tensor: ...

    def lengths(self) -> Optional[Tensor]: ...


def prepare(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    options: Optional[CallOptions] = None,
    *,
    estimate_time: bool = False,
    block: Optional[BlockPositions] = None,
    varlen: Optional[Varlen] = None,
    **keywords: Any,
) -> Prepared:
    """Validate, normalize and plan a call (raises as :func:`subquad.attention` does).

    ``options``: the call's record, or ``None`` and the options as ``keywords``. ``block``
    places the call inside a longer sequence (callbacks see its positions); ``varlen`` makes it
    a call of packed sequences (``(total, H, E)`` tensors; no ``attn_mask``), planned by its
    longest sequences.
    """
    options = given(options, keywords)
    backend = options.backend
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKEND_NAMES):
        raise ArgumentError(
            f"Unknown backend={backend!r}; expected 'auto' or one of {', '.join(map(repr, BACKEND_NAMES))}."
        )
    check_bool("return_lse", options.return_lse)
    if options.allow_compile is not None:
        check_bool("allow_compile", options.allow_compile)
    tiles = parse_chunk_size(options.chunk_size)
    if varlen is None:
        inp = call_inputs(query, key, value, options)
    else:
        inp = make_packed_inputs(query, key, value, options, varlen)
    if block is not None:
        inp = block.apply(inp)
    inp, notes = normalize(inp)
    # What the planner sizes the call by: itself, or a packed call's longest sequences.
    sized = inp if inp.packed is None else _engine.planning_view(inp)
    captured = captured_tensors(sized)
    opts = Options(
        return_lse=options.return_lse,
        chunk_size=tiles,
        captured_requires_grad=bool(captured),
        allow_compile=compile_allowed(options.allow_compile),
        packed=inp.packed is not None,
    )
    budget = resolve_budget(options.memory_budget, inp.device)
    plan = make_plan(
        sized, opts, budget, backend, estimate_time=estimate_time, shape=None if sized is inp else describe(inp)
    )
    if sized is not inp:  # a packed call: the tiles of every sequence
        if inp.short_sequences_share_tiles:  # and batches of its short sequences, one at a time
            plan.predicted_peak_bytes = max(plan.predicted_peak_bytes, min(budget, BATCH_BYTES))
        need_grad = inp.requires_grad or bool(captured)
        plan.tiles = count_tiles(inp, plan.chunk_size, plan.backward_chunk_size if need_grad else None)
        if estimate_time or plan.tiles >= ESTIMATE_TIME_FROM_TILES:
            plan.predicted_seconds = predict_seconds(inp, plan, need_grad)
    plan.notes[:0] = notes
    return Prepared(inp, opts, budget, plan, captured)


def attention(
    query: Tensor, key: Tensor, value: Tensor, options: CallOptions, fast_key: Any = NOT_TRIED
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """:func:`subquad.attention`, eagerly (see its docstring). ``fast_key``: the call's
    :func:`subquad._fast.key` when the caller already tried the fast path with it."""
    if fast_key is NOT_TRIED:
        fast_key, result = _fast.lookup(query, key, value, options)
        if result is not None:
            return result
    if any(getattr(t, "is_nested", False) for t in (query, key, value)):
        return _nested(query, key, value, options)
    call = prepare(query, key, value, options)
    _fast.remember(fast_key, call.inp, call.plan, options.memory_budget)
    _warn_if_long(call.plan)
    out, lse = _run(call, options.backend)
    inp = call.inp
    out = out.reshape(inp.output_shape)
    if not options.return_lse:
        return out
    assert lse is not None
    lse = lse.reshape(inp.output_shape[:-1])
    return out, lse if lse.dtype == inp.stats_dtype else lse.to(inp.stats_dtype)


def varlen_attention(
    query: Tensor, key: Tensor, value: Tensor, options: CallOptions, varlen: Varlen
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """:func:`subquad.varlen_attention`, eagerly: ``out (total_q, Hq, Ev)`` (and ``lse (total_q, Hq)``)."""
    call = prepare(query, key, value, options, varlen=varlen)
    _warn_if_long(call.plan)
    out, lse = _run_tiles_per_group(call.inp, call.plan, call.opts, call.budget, options.backend, call.captured)
    # The engine wrote (total, Hq, Ev) rows: this is that tensor. (squeeze, not out[0]: the
    # backward of a select allocates the whole input, that of a squeeze is a view.)
    out = out.squeeze(0).transpose(0, 1)
    if not call.opts.return_lse:
        return out
    assert lse is not None
    return out, lse.squeeze(0).t()


def _nested(query: Tensor, key: Tensor, value: Tensor, options: CallOptions) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Jagged nested tensors ``(B, H, j, E)`` (SDPA's layout for them) as packed sequences.

    The result is a nested tensor ``(B, H, j, Ev)`` (and the lse ``(B, H, j)``); gradients flow
    through ``values()`` back to the inputs.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not getattr(t, "is_nested", False):
            raise ArgumentTypeError(
                f"Expected query, key and value to be all nested tensors or none, got {name} {type(t).__name__}."
            )
        if t.layout != torch.jagged:
            raise NotImplementedError(
                f"{name} is a strided nested tensor; subquad takes jagged ones (layout=torch.jagged)."
            )
        if t.dim() != 4 or getattr(t, "_ragged_idx", None) != 2:
            raise ArgumentError(
                f"Expected {name} to be a jagged nested tensor (B, H, j, E) (the ragged dim third, as SDPA takes "
                f"them: nested (B, j, H, E) .transpose(1, 2)), got {t.dim()} dims with the ragged dim at "
                f"{getattr(t, '_ragged_idx', '?')}."
            )
        if cast(_Jagged, t).lengths() is not None:
            raise NotImplementedError(
                f"{name} is a nested tensor with holes (lengths); subquad takes contiguous sequences."
            )
    if options.attn_mask is not None:
        raise NotImplementedError(
            "attn_mask with nested tensors: pass the mask as a mask_mod (b is the sequence index, q_idx/kv_idx "
            "positions within it)."
        )
    if query.size(0) != key.size(0) or key.size(0) != value.size(0):
        raise ArgumentError(
            f"Expected query, key and value to hold the same number of sequences, got {query.size(0)}, {key.size(0)}, {value.size(0)}."
        )
    offsets_q = cast(_Jagged, query).offsets()
    q, k, v = (t.transpose(1, 2).values() for t in (query, key, value))  # (total, H, E) views
    varlen = Varlen(offsets_q, cast(_Jagged, key).offsets())
    # A packed call takes no allow_compile (as subquad.varlen_attention): the environment's default.
    packed = dataclasses.replace(options, allow_compile=None)
    result = varlen_attention(q, k, v, packed, varlen)
    out, lse = result if isinstance(result, tuple) else (result, None)
    out = torch.nested.nested_tensor_from_jagged(out, offsets=offsets_q).transpose(1, 2)
    if lse is None:
        return out
    return out, torch.nested.nested_tensor_from_jagged(lse, offsets=offsets_q).transpose(1, 2)


def varlen_explain(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Any, cu_seqlens_k: Any, **options: Any
) -> Plan:
    """:func:`subquad.varlen_explain` (``options``: :func:`subquad.varlen_attention`'s keywords)."""
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, options)
    return prepare(query, key, value, estimate_time=True, varlen=varlen, **options).plan


def _varlen(cu_seqlens_q: Any, cu_seqlens_k: Any, options: Dict[str, Any]) -> Varlen:
    """The packed arguments, taken out of ``options`` (what remains are :func:`prepare`'s)."""
    names = ("max_seqlen_q", "max_seqlen_k", "alignment", "window", "seqused_k")
    return Varlen(cu_seqlens_q, cu_seqlens_k, **{n: options.pop(n) for n in names if n in options})


def explain(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    options: Optional[CallOptions] = None,
    *,
    block: Optional[BlockPositions] = None,
    **keywords: Any,
) -> Plan:
    """:func:`subquad.explain` (``options``: the call's record, or ``None`` and the options as
    ``keywords``; ``block`` as in :func:`prepare`)."""
    options = given(options, keywords)
    if all(getattr(t, "is_nested", False) and getattr(t, "_ragged_idx", None) == 2 for t in (query, key, value)):
        if options.attn_mask is not None:
            raise NotImplementedError("attn_mask with nested tensors: pass the mask as a mask_mod.")
        q, k, v = (t.transpose(1, 2).values() for t in (query, key, value))
        varlen = Varlen(cast(_Jagged, query).offsets(), cast(_Jagged, key).offsets())
        packed = dataclasses.replace(options, allow_compile=None)  # as _nested
        return prepare(q, k, v, packed, estimate_time=True, varlen=varlen).plan
    return prepare(query, key, value, options, estimate_time=True, block=block).plan


def attention_block(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    block: BlockPositions,
    *,
    captured: Optional[Sequence[Tensor]] = None,
    **options: Any,
) -> Tuple[Tensor, Tensor, Plan]:
    """One block of a longer attention (context parallelism): ``(out, lse, plan)`` on 4-D inputs.

    ``query (B, Hq, Lq, E)``, ``key``/``value (B, Hk, Lk, E/Ev)`` -> ``out (B, Hq, Lq, Ev)``,
    ``lse (B, Hq, Lq)`` in the stats dtype. ``options``: the ring step's :class:`CallOptions`
    fields as keywords (the lse is always returned, nothing is compiled). Callbacks see the
    block's positions (``block``), and the call runs on the tiles (never a whole-input kernel).
    Differentiable like :func:`attention` when the inputs require grad; ``captured`` overrides
    the probe of the tensors ``score_mod`` reads.
    """
    step = CallOptions(**options, return_lse=True, allow_compile=False)
    inp, opts, budget, plan, probed = prepare(query, key, value, step, block=block)
    if plan.backend not in ("fused", "loops", "matmul"):
        plan = make_plan(inp, opts, budget, _tiles_backend(inp, plan))
    out, lse = _run_tiles_per_group(inp, plan, opts, budget, "auto", probed if captured is None else captured)
    assert lse is not None
    return out, lse, plan


# ------------------------------------------------------------------ running a plan
def _run(call: Prepared, requested: str) -> Tuple[Tensor, Optional[Tensor]]:
    """``(out (B, Hq, Lq, Ev), lse or None)``: the planned backend, the tiles if it cannot run."""
    inp, opts, budget, plan, captured = call
    if plan.backend == "flex":
        try:
            return BACKENDS["flex"].run_whole(inp, need_lse=False)
        except FlexUnavailable as e:
            if requested == "flex":
                raise
            warnings.warn(
                f"subquad: FlexAttention could not compile this call ({e}); running the tiles instead.",
                RuntimeWarning,
                stacklevel=5,
            )
            opts = dataclasses.replace(opts, allow_compile=False)
            plan = make_plan(inp, opts, budget, requested)
    if plan.backend == "sdpa":
        try:
            return BACKENDS["sdpa"].run_whole(inp, need_lse=False)
        except RuntimeError as e:
            # No fused kernel took the input after all (their checks are private), or it ran out
            # of memory: the tiles take everything, within the budget. A fault of the device
            # ("CUDA error: ... CUDA kernel errors might be ...") is no refusal: the context is
            # broken and the tiles would fail on it too.
            no_kernel = "kernel" in str(e).lower() and not is_oom(e) and not is_device_fatal(e)
            if not (no_kernel or is_oom(e)):
                raise
            plan = make_plan(inp, opts, budget, _tiles_backend(inp, plan))
    if plan.grouped and not (captured or is_transformed(inp.query, inp.key, inp.value)):
        return grouped_attention(inp.q, inp.k, inp.v, inp.scale, opts.return_lse)
    return _run_tiles_per_group(inp, plan, opts, budget, requested, captured)


def _tiles_backend(inp: Inputs, plan: Plan) -> str:
    """The tiled backend for a call a whole-input backend cannot take."""
    if inp.device_type == "cpu" and "fused" not in plan.rejected:
        return "fused"
    return tiles_backend(inp, False)


def _run_tiles_per_group(
    inp: Inputs, plan: Plan, opts: Options, budget: int, requested: str, captured: Sequence[Tensor]
) -> Tuple[Tensor, Optional[Tensor]]:
    """The tiles, one batch group at a time (a call whose batch broadcasting does not fold into
    one batch dim has several groups; each is views of the caller's tensors)."""
    if inp.n_groups == 1:
        return _run_tiles_recovering(inp, plan, opts, budget, requested, captured)
    total = inp.n_groups * inp.B
    out = torch.empty((total, inp.Hq, inp.Lq, inp.Ev), dtype=inp.dtype, device=inp.device)
    lse = torch.empty((total, inp.Hq, inp.Lq), dtype=inp.stats_dtype, device=inp.device) if opts.return_lse else None
    for g in range(inp.n_groups):
        o, l = _run_tiles_recovering(inp.group(g), plan, opts, budget, requested, captured)
        rows = slice(g * inp.B, (g + 1) * inp.B)
        out[rows].copy_(o)
        if lse is not None and l is not None:
            lse[rows].copy_(l)
        del o, l
    return out, lse


def _run_tiles_recovering(
    inp: Inputs, plan: Plan, opts: Options, budget: int, requested: str, captured: Sequence[Tensor]
) -> Tuple[Tensor, Optional[Tensor]]:
    """One batch group on the planned tiles, with the two recoveries the engine allows itself.

    A fused kernel that refuses the input at run time (its private checks change between
    releases) hands over to the matmul tiles; a real out-of-memory error retries once with
    tiles half the size. Anything a user callback raises propagates unchanged.
    """
    tiles, backward_tiles = plan.chunk_size, plan.backward_chunk_size
    for attempt in range(2):
        try:
            return _run_tiles_once(inp, plan, opts, captured, tiles, backward_tiles)
        except KernelRefused as e:
            if requested != "auto" or attempt == 1:
                raise
            warnings.warn(
                f"subquad: the fused CPU kernel refused this input ({str(e).splitlines()[0][:200]}); "
                "running subquad's tiles instead.",
                RuntimeWarning,
                stacklevel=6,
            )
            plan = make_plan(
                view := inp if inp.packed is None else _engine.planning_view(inp),
                opts,
                budget,
                tiles_backend(view, False),
                shape=plan.shape,
            )
            tiles, backward_tiles = plan.chunk_size, plan.backward_chunk_size
        except Exception as e:  # only real out-of-memory errors are retried
            if attempt == 1 or from_callback(e) or not is_oom(e):
                raise
            old = tiles
            tiles = halve(tiles, inp)
            backward_tiles = halve(backward_tiles or tiles, inp)
            warnings.warn(
                f"subquad: out of memory with tiles {old} ({type(e).__name__}); retrying with {tiles}. "
                "The result is still exact; pass a smaller memory_budget to avoid the retry.",
                RuntimeWarning,
                stacklevel=6,
            )
    raise AssertionError("unreachable")


def _run_tiles_once(
    inp: Inputs,
    plan: Plan,
    opts: Options,
    captured: Sequence[Tensor],
    tiles: Optional[Tiles],
    backward_tiles: Optional[Tiles],
) -> Tuple[Tensor, Optional[Tensor]]:
    """The tile loop on these tiles: through the autograd Function when a gradient may be needed."""
    seed = _draw_seed() if inp.dropout_p > 0 else 0
    forward_tiles = tiles or (max(inp.Lq, 1), max(inp.Lk, 1))
    if inp.requires_grad or captured or is_transformed(inp.query, inp.key, inp.value, inp.attn_mask):
        meta = Meta(
            inp,
            plan.backend,
            forward_tiles,
            plan.backward_backend or plan.backend,
            backward_tiles or forward_tiles,
            seed,
            plan.budget_bytes,
            plan.predicted_seconds,
        )
        return attention_with_grad(inp, meta, captured)
    return _engine.forward(
        inp,
        plan.backend,
        forward_tiles,
        seed,
        need_lse=opts.return_lse,
        predicted_s=plan.predicted_seconds,
        batch_bytes=min(plan.budget_bytes, BATCH_BYTES),
    )


def _draw_seed() -> int:
    """The dropout seed, from torch's generator (``torch.manual_seed`` makes calls reproducible)."""
    drawn = torch.randint(0, 2**31 - 1, (1,))
    if is_transformed(drawn):
        # Under vmap with randomness="same" or "different" the draw is batched; one seed is drawn
        # here and the Function's vmap rule derives one per example for "different".
        with torch._C._DisableFuncTorch():
            drawn = torch.randint(0, 2**31 - 1, (1,))
    return int(drawn.item())


def _warn_if_long(plan: Plan) -> None:
    if plan.predicted_seconds is not None and plan.predicted_seconds > WARN_LONGER_THAN_S:
        warnings.warn(
            f"subquad: this call runs {plan.tiles:,} tiles and is predicted to take about "
            f"{format_seconds(plan.predicted_seconds)} ({plan.shape}, tiles {plan.chunk_size}). "
            "Progress is logged to the 'subquad' logger (INFO); Ctrl-C stops it cleanly. A larger "
            "memory_budget means fewer, larger tiles.",
            RuntimeWarning,
            stacklevel=4,
        )
