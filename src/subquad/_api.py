"""Public entry points: validate -> plan -> run."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _engine
from ._autograd import Meta, attention_with_grad, captured_tensors, is_transformed
from ._inputs import (
    ArgumentError,
    ArgumentTypeError,
    Inputs,
    MaskMod,
    ScoreMod,
    check_bool,
    make_inputs,
    parse_chunk_size,
)
from . import _fast, mods
from ._callbacks import (
    ScoreModAsMask,
    TracedMask,
    TracedScoreMod,
    from_callback,
    mask_mod_structure,
    score_mod_structure,
)
from ._paths import BACKEND_NAMES, BACKENDS, FlexUnavailable, Options, compile_allowed
from ._tiles import KernelRefused, is_oom
from ._planner import (
    Plan,
    format_seconds,
    halve,
    make_plan,
    resolve_budget,
)
from .integrations.compile import compiled_attention
from .integrations.compile import supports as _compile_supports

Budget = Union[int, str, None]

WARN_LONGER_THAN_S = 300.0
"""A call predicted to take longer than this warns once (with the plan's estimate)."""


def _prepare(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    score_mod: Optional[ScoreMod],
    mask_mod: Optional[MaskMod],
    scale: Optional[float],
    enable_gqa: bool,
    dropout_p: float,
    memory_budget: Budget,
    chunk_size: object,
    backend: str,
    return_lse: bool,
    allow_compile: Optional[bool] = None,
    estimate_time: bool = False,
    block: Optional["BlockPositions"] = None,
) -> Tuple[Inputs, Options, int, Plan, Sequence[Tensor]]:
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKEND_NAMES):
        raise ArgumentError(f"Unknown backend={backend!r}; expected 'auto' or one of {', '.join(map(repr, BACKEND_NAMES))}.")
    check_bool("return_lse", return_lse)
    chunk = parse_chunk_size(chunk_size)
    inp = make_inputs(
        query, key, value,
        attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        dropout_p=dropout_p, score_mod=score_mod, mask_mod=mask_mod,
    )
    if block is not None:
        inp = block.apply(inp)
    inp, note = _traced_score_mod(inp)
    inp = _traced_mask_mod(inp)
    inp = _causal_mask_mod_as_flag(inp)
    captured = captured_tensors(inp)
    if allow_compile is not None:
        check_bool("allow_compile", allow_compile)
    opts = Options(
        return_lse=return_lse, chunk_size=chunk, captured_requires_grad=bool(captured),
        allow_compile=compile_allowed(allow_compile),
    )
    budget = resolve_budget(memory_budget, inp.device)
    plan = make_plan(inp, opts, budget, backend, estimate_time=estimate_time)
    if note:
        plan.notes.append(note)
    if plan.backend == "flex":
        plan.notes.append(BACKENDS["flex"].compile_note(inp))  # type: ignore[attr-defined]
    return inp, opts, budget, plan, captured


def _traced_score_mod(inp: Inputs) -> Tuple[Inputs, Optional[str]]:
    """A user ``score_mod`` as what its traced structure shows it is (``explain()`` says which).

    ``score + bias`` gets ``additive_bias`` (so it runs as a bias tile on the fused kernel),
    ``where(cond, score, -inf)`` becomes a ``mask_mod`` (empty tiles are skipped), the identity is
    dropped; anything else runs as is on the generic tiles.
    """
    fn = inp.score_mod
    if fn is None or getattr(fn, "additive_bias", None) is not None:
        return inp, None
    found = score_mod_structure(fn, inp.stats_dtype, inp.device)
    if found.kind == "identity":
        return dataclasses.replace(inp, score_mod=None), "score_mod returns the score unchanged (traced): it is left out"
    if found.kind == "mask":
        mask = ScoreModAsMask(fn, inp.stats_dtype)
        mask_mod = mask if inp.mask_mod is None else mods.and_masks(inp.mask_mod, mask)
        note = "score_mod is where(cond, score, -inf) (traced): it runs as a mask_mod, empty tiles skipped"
        return dataclasses.replace(inp, score_mod=None, mask_mod=mask_mod), note
    traced = TracedScoreMod(fn, found, inp.stats_dtype)
    if found.kind == "general":
        return dataclasses.replace(inp, score_mod=traced), f"score_mod is not additive: {found.reason}"
    mask_mod = inp.mask_mod
    if found.masks:  # its -inf part also skips empty tiles
        mask = ScoreModAsMask(fn, inp.stats_dtype)
        mask_mod = mask if mask_mod is None else mods.and_masks(mask_mod, mask)
    note = "score_mod is score + bias (traced): the bias is evaluated per tile"
    return dataclasses.replace(inp, score_mod=traced, mask_mod=mask_mod), note


def _traced_mask_mod(inp: Inputs) -> Inputs:
    """A hand-written ``mask_mod`` that is a formula of comparisons of the positions (``kv <= q``,
    a window, a prefix) gets exact block states from its traced formula, and the causal one runs
    as the causal flag, as the built-ins do; others are evaluated per tile."""
    fn = inp.mask_mod
    if fn is None or hasattr(fn, "block_state") or isinstance(fn, (ScoreModAsMask, TracedMask)):
        return inp
    found = mask_mod_structure(fn, inp.device)
    if found.kind == "general":
        return inp
    return dataclasses.replace(inp, mask_mod=TracedMask(fn, found))


def _causal_mask_mod_as_flag(inp: Inputs) -> Inputs:
    """A ``mask_mod`` that declares itself the causal mask (``mods.causal()``, ``mods.causal_lower_right``)
    runs as the causal flag: whole tiles skipped, the fused kernel's own causal masking."""
    declared = getattr(inp.mask_mod, "causal_offset", None)
    lengths = inp.total_lengths or (inp.Lq, inp.Lk)
    offset = declared(*lengths) if callable(declared) else None
    if not isinstance(offset, int) or isinstance(offset, bool):
        return inp
    # Declared in the callback's positions; in the block's own: j - ko <= i - qo + offset + (qo - ko).
    offset += inp.q_offset - inp.kv_offset
    if inp.is_causal:  # both: the intersection of two causal masks is the one with the smaller offset
        offset = min(offset, inp.causal_offset)
    return dataclasses.replace(inp, is_causal=True, causal_offset=offset, mask_mod=None)


@dataclasses.dataclass(frozen=True)
class BlockPositions:
    """A call that is one block of a longer sequence (what ring attention runs per step).

    Callbacks see query ``i`` at ``q_offset + i`` and key ``j`` at ``kv_offset + j``; a length-
    dependent ``mask_mod`` (``mods.causal_lower_right``) sees the whole sequence's lengths
    ``total_lengths``; heads are seen from ``h_offset``. ``causal_offset`` (in the block's own positions) applies when
    ``is_causal``: query ``i`` sees keys ``j <= i + causal_offset``.
    """

    q_offset: int
    kv_offset: int
    total_lengths: Tuple[int, int]
    causal_offset: int = 0
    h_offset: int = 0

    def apply(self, inp: Inputs) -> Inputs:
        return dataclasses.replace(
            inp, q_offset=self.q_offset, kv_offset=self.kv_offset, total_lengths=self.total_lengths,
            h_offset=self.h_offset,
            causal_offset=self.causal_offset if inp.is_causal else inp.causal_offset,
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


def _run(
    inp: Inputs, plan: Plan, opts: Options, captured: Sequence[Tensor], chunk: Optional[Tuple[int, int]],
    bwd_chunk: Optional[Tuple[int, int]],
) -> Tuple[Tensor, Optional[Tensor]]:
    seed = _draw_seed() if inp.dropout_p > 0 else 0
    full = (max(inp.Lq, 1), max(inp.Lk, 1))
    fwd_chunk = chunk or full
    if inp.requires_grad or captured or is_transformed(inp.query, inp.key, inp.value, inp.attn_mask):
        meta = Meta(
            inp, plan.backend, fwd_chunk, plan.backward_backend or plan.backend, bwd_chunk or fwd_chunk, seed,
            plan.budget_bytes, plan.predicted_seconds,
        )
        return attention_with_grad(inp, meta, captured)
    return _engine.forward(inp, plan.backend, fwd_chunk, seed, need_lse=opts.return_lse, predicted_s=plan.predicted_seconds)


def _run_tiles(
    inp: Inputs, plan: Plan, opts: Options, budget: int, backend: str, captured: Sequence[Tensor]
) -> Tuple[Tensor, Optional[Tensor]]:
    """One batch group on the planned tiles, with the two recoveries the engine allows itself.

    A fused kernel that refuses the input at run time (its private checks change between
    releases) hands over to the matmul tiles; a real out-of-memory error retries once with
    tiles half the size. Anything a user callback raises propagates unchanged.
    """
    chunk, bwd_chunk = plan.chunk_size, plan.backward_chunk_size
    for attempt in range(2):
        try:
            return _run(inp, plan, opts, captured, chunk, bwd_chunk)
        except KernelRefused as e:
            if backend != "auto" or attempt == 1:
                raise
            warnings.warn(
                f"subquad: the fused CPU kernel refused this input ({str(e).splitlines()[0][:200]}); "
                "running the matmul tiles instead.",
                RuntimeWarning,
                stacklevel=4,
            )
            plan = make_plan(inp, opts, budget, "matmul")
            chunk, bwd_chunk = plan.chunk_size, plan.backward_chunk_size
        except Exception as e:  # noqa: BLE001 - only real out-of-memory errors are retried
            if attempt == 1 or from_callback(e) or not is_oom(e):
                raise
            old = chunk
            chunk = halve(chunk, inp)
            bwd_chunk = halve(bwd_chunk or chunk, inp)
            warnings.warn(
                f"subquad: out of memory with tiles {old} ({type(e).__name__}); retrying with {chunk}. "
                "The result is still exact; pass a smaller memory_budget to avoid the retry.",
                RuntimeWarning,
                stacklevel=4,
            )
    raise AssertionError("unreachable")


def _run_groups(
    inp: Inputs, plan: Plan, opts: Options, budget: int, backend: str, captured: Sequence[Tensor]
) -> Tuple[Tensor, Optional[Tensor]]:
    """A call whose batch broadcasting does not fold into one batch dim: group by group."""
    if inp.n_groups == 1:
        return _run_tiles(inp, plan, opts, budget, backend, captured)
    total = inp.n_groups * inp.B
    out = torch.empty((total, inp.Hq, inp.Lq, inp.Ev), dtype=inp.dtype, device=inp.device)
    lse = torch.empty((total, inp.Hq, inp.Lq), dtype=inp.stats_dtype, device=inp.device) if opts.return_lse else None
    for g in range(inp.n_groups):
        o, l = _run_tiles(inp.group(g), plan, opts, budget, backend, captured)
        rows = slice(g * inp.B, (g + 1) * inp.B)
        out[rows].copy_(o)
        if lse is not None and l is not None:
            lse[rows].copy_(l)
        del o, l
    return out, lse


def _warn_if_long(plan: Plan) -> None:
    if plan.predicted_seconds is not None and plan.predicted_seconds > WARN_LONGER_THAN_S:
        warnings.warn(
            f"subquad: this call runs {plan.tiles:,} tiles and is predicted to take about "
            f"{format_seconds(plan.predicted_seconds)} ({plan.shape}, tiles {plan.chunk_size}). "
            "Progress is logged to the 'subquad' logger (INFO); Ctrl-C stops it cleanly. A larger "
            "memory_budget means fewer, larger tiles.",
            RuntimeWarning,
            stacklevel=3,
        )


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    memory_budget: Budget = None,
    chunk_size: Union[int, Tuple[int, int], None] = None,
    backend: str = "auto",
    return_lse: bool = False,
    allow_compile: Optional[bool] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Exact scaled dot-product attention in bounded memory.

    Shapes: ``query (..., Hq, Lq, E)``, ``key (..., Hk, Lk, E)``, ``value (..., Hk, Lk, Ev)`` ->
    ``out (..., Hq, Lq, Ev)`` (and ``lse (..., Hq, Lq)``). ``...`` are any batch dims; they
    broadcast between the three as in SDPA (a key/value of batch 1 is shared by every query
    batch, never expanded in memory). ``Hq == Hk`` unless ``enable_gqa=True`` (then query head
    ``h`` reads kv head ``h // (Hq/Hk)``).

    Equal (up to rounding, without ever building the ``Lq x Lk`` scores) to::

        s = (query @ key.transpose(-2, -1)) * scale            # scale defaults to 1/sqrt(E)
        s = score_mod(s, b, h, q_idx, kv_idx)                    # per tile, if given
        s = s + attn_mask  # float mask; a bool mask (True = attend) or mask_mod sets -inf
        if is_causal: s = s.masked_fill(kv_idx > q_idx, -inf)    # top-left aligned
        p = softmax(s, -1); p = dropout(p, dropout_p)
        out = p @ value                                          # rows with no visible key -> 0
        lse = logsumexp(s, -1)                                   # -inf for those rows

    Causal alignment is top-left, as in SDPA (``Lq=3, Lk=5``; ``x`` = attend)::

        x . . . .
        x x . . .
        x x x . .

    Args:
        attn_mask: bool (True = attend) or float (added) tensor broadcastable to ``(..., Hq, Lq, Lk)``,
            or one of torch's ``torch.nn.attention.bias.causal_upper_left(Lq, Lk)`` (= ``is_causal``)
            and ``causal_lower_right(Lq, Lk)`` (diagonal aligned to the bottom-right corner; rows
            that see no key give 0), which are never materialized.
        is_causal: top-left causal mask; not together with ``attn_mask``.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, FlexAttention's convention,
            called per tile with ``score (B, Hq, qc, kc)`` float32 and broadcastable int64 indices
            ``b (B,1,1,1)``, ``h (1,Hq,1,1)``, ``q_idx (1,1,qc,1)``, ``kv_idx (1,1,1,kc)`` (``B`` is
            the product of the batch dims). Tensors it captures that require grad get gradients.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = attend), called per tile; tiles
            where it is False everywhere are skipped.
        scale: the factor on ``q kᵀ``; default ``1/sqrt(E)``.
        enable_gqa: grouped-query attention without expanding key/value in memory.
        dropout_p: dropout on the attention weights, in ``[0, 1]`` (its masks are regenerated in the
            backward; ``1`` drops everything, output 0, as SDPA).
        memory_budget: bytes (int) or a string like ``"512MiB"``/``"2GB"``: the extra memory of the
            call beyond its inputs, output (and gradients). ``None``: half the device's free memory.
            A promise: a call that cannot keep it raises, it never runs over it.
        chunk_size: force tiles ``(q_chunk, kv_chunk)`` (or one int for both) instead of planning
            them. They must fit the budget too: tiles predicted to need more raise
            :class:`MemoryBudgetError` (pass a larger ``memory_budget`` to run them).
        backend: ``"auto"`` (the planner), ``"sdpa"``, ``"fused"`` or ``"matmul"``.
        return_lse: also return the log-sum-exp per row (float32; float64 for float64 inputs).
        allow_compile: whether the planner may compile code for the call (FlexAttention for
            callbacks); ``None``: yes unless the environment variable ``SUBQUAD_COMPILE=0``. The
            first call of a new signature then pays the compile (seconds; ``explain()`` says so).

    Raises:
        TypeError / ValueError: invalid arguments, naming the argument and showing the values.
            They are also ``RuntimeError``\ s, the class torch's SDPA raises for the same inputs.
        MemoryBudgetError: the budget cannot hold even the smallest tiles, or the forced
            ``chunk_size`` (says what would fit).
        NotImplementedError: a forced ``backend`` cannot run the call (with its reasons).
        Whatever ``score_mod`` / ``mask_mod`` raise, unchanged (never retried or hidden).
    """
    if torch.compiler.is_compiling() and _compile_supports(score_mod=score_mod, mask_mod=mask_mod, dropout_p=dropout_p):
        # Under torch.compile subquad is one opaque operator (fake + autograd registrations); the
        # planner and tile loop run eagerly inside it when the compiled graph executes.
        return compiled_attention(
            query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
            memory_budget=memory_budget, chunk_size=chunk_size, backend=backend, return_lse=return_lse,
        )
    fast_key = _fast.key(
        query, key, value, attn_mask, is_causal, score_mod, mask_mod, scale, enable_gqa, dropout_p, memory_budget,
        chunk_size, backend, return_lse, allow_compile,
    )
    if fast_key is not None:
        result = _fast.run(fast_key, query, key, value, attn_mask, is_causal, scale, enable_gqa, return_lse)
        if result is not None:
            return result
    inp, opts, budget, plan, captured = _prepare(
        query, key, value, attn_mask, is_causal, score_mod, mask_mod, scale, enable_gqa,
        dropout_p, memory_budget, chunk_size, backend, return_lse, allow_compile,
    )
    _fast.remember(fast_key, inp, plan, memory_budget)
    _warn_if_long(plan)
    if plan.backend == "flex":
        try:
            return BACKENDS["flex"].run_whole(inp).reshape(inp.output_shape)  # type: ignore[attr-defined]
        except FlexUnavailable as e:
            if backend == "flex":
                raise
            warnings.warn(
                f"subquad: FlexAttention could not compile this call ({e}); running the tiles instead.",
                RuntimeWarning,
                stacklevel=2,
            )
            opts = dataclasses.replace(opts, allow_compile=False)
            plan = make_plan(inp, opts, budget, backend)
    if plan.backend == "sdpa":
        try:
            sdpa_path = BACKENDS["sdpa"]
            return sdpa_path.run_whole(query, key, value, inp, None if inp.attn_mask is None else attn_mask, enable_gqa)  # type: ignore[attr-defined]
        except RuntimeError as e:
            # No fused kernel took the input after all (their checks are private), or it ran out
            # of memory: the tiles take everything, within the budget.
            no_kernel = "kernel" in str(e).lower() and not is_oom(e)
            if not (no_kernel or is_oom(e)):
                raise
            tiles = "fused" if inp.device.type == "cpu" and "fused" not in plan.rejected else "matmul"
            plan = make_plan(inp, opts, budget, tiles)
    out, lse = _run_groups(inp, plan, opts, budget, backend, captured)
    out = out.reshape(inp.output_shape)
    if return_lse:
        assert lse is not None
        lse_out = lse.reshape(inp.output_shape[:-1])
        if lse_out.dtype != inp.stats_dtype:
            lse_out = lse_out.to(inp.stats_dtype)
        return out, lse_out
    return out


def attention_block(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    block: BlockPositions,
    *,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    score_mod: Optional[ScoreMod],
    mask_mod: Optional[MaskMod],
    scale: Optional[float],
    enable_gqa: bool,
    memory_budget: Budget,
    captured: Optional[Sequence[Tensor]] = None,
) -> Tuple[Tensor, Tensor, Plan]:
    """One block of a longer attention (context parallelism): ``(out, lse, plan)`` on 4-D inputs.

    ``query (B, Hq, Lq, E)``, ``key``/``value (B, Hk, Lk, E/Ev)`` -> ``out (B, Hq, Lq, Ev)``,
    ``lse (B, Hq, Lq)`` in the stats dtype. Callbacks see the block's positions (``block``), and
    the call runs on the tiles (never a whole-input kernel: the lse is always returned).
    Differentiable like :func:`attention` when the inputs require grad; ``captured`` overrides
    the probe of the tensors ``score_mod`` reads.
    """
    inp, opts, budget, plan, probed = _prepare(
        query, key, value, attn_mask, is_causal, score_mod, mask_mod, scale, enable_gqa, 0.0,
        memory_budget, None, "auto", True, allow_compile=False, block=block,
    )
    if plan.backend not in ("fused", "matmul"):
        plan = make_plan(inp, opts, budget, "fused" if "fused" not in plan.rejected and inp.device.type == "cpu" else "matmul")
    out, lse = _run_groups(inp, plan, opts, budget, "auto", probed if captured is None else captured)
    assert lse is not None
    return out, lse, plan


def sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    **options: object,
) -> Tensor:
    """A drop-in for :func:`torch.nn.functional.scaled_dot_product_attention` that keeps a memory budget.

    Same signature, layout ``(..., H, L, E)`` and semantics (bool mask True = attend, float mask
    added, torch's ``CausalBias`` masks, ``is_causal`` top-left, fully masked rows -> 0,
    ``enable_gqa``, batch dims that broadcast, empty inputs); ``options`` are the keyword-only
    options of :func:`subquad.attention` (``memory_budget``, ``chunk_size``, ``backend``,
    ``score_mod``, ``mask_mod``). ``return_lse`` is not accepted here. Invalid arguments raise
    ``TypeError``/``ValueError`` subclasses that are also ``RuntimeError`` (what SDPA raises).

    Equal to ``torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask,
    dropout_p, is_causal, scale, enable_gqa=enable_gqa)``, computed in tiles.
    """
    if "return_lse" in options:
        raise ArgumentTypeError("sdpa() returns the output only; use subquad.attention(..., return_lse=True) for the lse.")
    out = attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa, **options,  # type: ignore[arg-type]
    )
    assert isinstance(out, Tensor)
    return out


def explain(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    memory_budget: Budget = None,
    chunk_size: Union[int, Tuple[int, int], None] = None,
    backend: str = "auto",
    return_lse: bool = False,
    allow_compile: Optional[bool] = None,
) -> Plan:
    """What :func:`attention` would run for these arguments, without running it.

    Returns a :class:`Plan` (``backend``, ``chunk_size``, ``predicted_peak_bytes``,
    ``budget_bytes``, ``rejected``: the reasons of every path not taken); ``print(plan)`` reads well.
    Raises like :func:`attention` (e.g. :class:`MemoryBudgetError`).
    """
    return _prepare(
        query, key, value, attn_mask, is_causal, score_mod, mask_mod, scale, enable_gqa,
        dropout_p, memory_budget, chunk_size, backend, return_lse, allow_compile, estimate_time=True,
    )[3]
