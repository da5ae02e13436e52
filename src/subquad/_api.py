"""Public entry points: validate -> plan -> run."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _engine
from ._autograd import attention_with_grad, captured_tensors
from ._inputs import Inputs, MaskMod, ScoreMod, make_inputs, parse_chunk_size
from ._planner import BACKEND_NAMES, MemoryBudgetError, Options, Plan, halve, make_plan, resolve_budget
from .integrations.compile import compiled_attention
from .integrations.compile import supports as _compile_supports

# The original SDPA, saved before anything (such as subquad.patch_sdpa) can replace it.
_TORCH_SDPA = F.scaled_dot_product_attention

Budget = Union[int, str, None]


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
) -> Tuple[Inputs, Options, int, Plan, Sequence[Tensor]]:
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKEND_NAMES):
        raise ValueError(f"Unknown backend={backend!r}; expected 'auto' or one of {', '.join(map(repr, BACKEND_NAMES))}.")
    if not isinstance(return_lse, bool):
        raise TypeError(f"Expected return_lse to be a bool, got {type(return_lse).__name__}.")
    chunk = parse_chunk_size(chunk_size)
    inp = make_inputs(
        query, key, value,
        attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        dropout_p=dropout_p, score_mod=score_mod, mask_mod=mask_mod,
    )
    if getattr(mask_mod, "same_as_is_causal", False):
        # mods.causal(): run it as the causal flag (the engine combines it with attn_mask).
        inp = dataclasses.replace(inp, is_causal=True, mask_mod=None)
    captured = captured_tensors(score_mod) if torch.is_grad_enabled() else []
    opts = Options(return_lse=return_lse, chunk_size=chunk, captured_requires_grad=bool(captured))
    budget = resolve_budget(memory_budget, inp.device)
    plan = make_plan(inp, opts, budget, backend)
    return inp, opts, budget, plan, captured


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, (MemoryError,)) and not isinstance(e, MemoryBudgetError):
        return True
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(e, oom_type):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and (
        "out of memory" in msg or "can't allocate memory" in msg or "not enough memory" in msg
    )


def _run_sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], inp: Inputs, enable_gqa: bool) -> Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kwargs = dict(attn_mask=attn_mask, dropout_p=inp.dropout_p, is_causal=inp.is_causal, scale=inp.scale)
    if enable_gqa:
        kwargs["enable_gqa"] = True
    if query.device.type == "mps":
        return _TORCH_SDPA(query, key, value, **kwargs)
    fused = [getattr(SDPBackend, n) for n in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION") if hasattr(SDPBackend, n)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SDPA warns about every kernel it declines
        with sdpa_kernel(fused):
            return _TORCH_SDPA(query, key, value, **kwargs)


def _run(
    inp: Inputs, plan: Plan, opts: Options, captured: Sequence[Tensor], chunk: Optional[Tuple[int, int]],
    bwd_chunk: Optional[Tuple[int, int]],
) -> Tuple[Tensor, Optional[Tensor]]:
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if inp.dropout_p > 0 else 0
    full = (max(inp.Lq, 1), max(inp.Lk, 1))
    fwd_chunk = chunk or full
    if inp.requires_grad or captured:
        assert plan.backward_backend is not None
        return attention_with_grad(
            inp, plan.backend, fwd_chunk, plan.backward_backend, bwd_chunk or fwd_chunk, seed, captured,
            plan.budget_bytes,
        )
    return _engine.forward(inp, plan.backend, fwd_chunk, seed, need_lse=opts.return_lse)


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
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Exact scaled dot-product attention in bounded memory.

    Shapes: ``query (..., Hq, Lq, E)``, ``key (..., Hk, Lk, E)``, ``value (..., Hk, Lk, Ev)`` ->
    ``out (..., Hq, Lq, Ev)`` (and ``lse (..., Hq, Lq)``). ``...`` are any batch dims, equal for all
    three; ``Hq == Hk`` unless ``enable_gqa=True`` (then query head ``h`` reads kv head ``h // (Hq/Hk)``).

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
        attn_mask: bool (True = attend) or float (added) tensor broadcastable to ``(..., Hq, Lq, Lk)``.
        is_causal: top-left causal mask; not together with ``attn_mask``.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, FlexAttention's convention,
            called per tile with ``score (B, Hq, qc, kc)`` float32 and broadcastable int64 indices
            ``b (B,1,1,1)``, ``h (1,Hq,1,1)``, ``q_idx (1,1,qc,1)``, ``kv_idx (1,1,1,kc)`` (``B`` is
            the product of the batch dims). Tensors it captures that require grad get gradients.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = attend), called per tile; tiles
            where it is False everywhere are skipped.
        scale: the factor on ``q kᵀ``; default ``1/sqrt(E)``.
        enable_gqa: grouped-query attention without expanding key/value in memory.
        dropout_p: dropout on the attention weights (its masks are regenerated in the backward).
        memory_budget: bytes (int) or a string like ``"512MiB"``/``"2GB"``: the extra memory of the
            call beyond its inputs, output (and gradients). ``None``: half the device's free memory.
        chunk_size: force tiles ``(q_chunk, kv_chunk)`` (or one int for both) instead of planning them.
        backend: ``"auto"`` (the planner), ``"sdpa"``, ``"fused"`` or ``"matmul"``.
        return_lse: also return the log-sum-exp per row (float32; float64 for float64 inputs).

    Raises:
        TypeError / ValueError: invalid arguments, naming the argument and showing the values.
        MemoryBudgetError: the budget cannot hold even the smallest tiles (says what would).
        NotImplementedError: a forced ``backend`` cannot run the call (with its reasons).
    """
    if torch.compiler.is_compiling() and _compile_supports(score_mod=score_mod, mask_mod=mask_mod, dropout_p=dropout_p):
        # Under torch.compile subquad is one opaque operator (fake + autograd registrations); the
        # planner and tile loop run eagerly inside it when the compiled graph executes.
        return compiled_attention(
            query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
            memory_budget=memory_budget, chunk_size=chunk_size, backend=backend, return_lse=return_lse,
        )
    inp, opts, budget, plan, captured = _prepare(
        query, key, value, attn_mask, is_causal, score_mod, mask_mod, scale, enable_gqa,
        dropout_p, memory_budget, chunk_size, backend, return_lse,
    )
    lead = tuple(query.shape[:-2])
    chunk, bwd_chunk = plan.chunk_size, plan.backward_chunk_size
    for attempt in range(2):
        try:
            if plan.backend == "sdpa":
                out = _run_sdpa(query, key, value, attn_mask, inp, enable_gqa)
                return out
            out, lse = _run(inp, plan, opts, captured, chunk, bwd_chunk)
            break
        except Exception as e:  # noqa: BLE001 - only OOM and kernel refusals are handled
            no_kernel = plan.backend == "sdpa" and isinstance(e, RuntimeError) and "kernel" in str(e).lower()
            # The private fused kernel may reject an input the planner expected it to take
            # (its checks change between releases): the matmul tiles take everything.
            fused_refused = plan.backend == "fused" and backend == "auto" and isinstance(e, RuntimeError) and not _is_oom(e)
            if attempt == 0 and fused_refused:
                warnings.warn(
                    f"subquad: the fused CPU kernel refused this input ({str(e).splitlines()[0][:200]}); "
                    "running the matmul tiles instead.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                plan = make_plan(inp, opts, budget, "matmul")
                chunk, bwd_chunk = plan.chunk_size, plan.backward_chunk_size
                continue
            if attempt == 1 or not (_is_oom(e) or no_kernel):
                raise
            if plan.backend == "sdpa":
                plan = make_plan(inp, opts, budget, "fused" if inp.device.type == "cpu" and "fused" not in plan.rejected else "matmul")
                chunk, bwd_chunk = plan.chunk_size, plan.backward_chunk_size
                if no_kernel:
                    continue
            old = chunk
            chunk = halve(chunk, inp)
            bwd_chunk = halve(bwd_chunk or chunk, inp)
            warnings.warn(
                f"subquad: out of memory with tiles {old} ({type(e).__name__}); retrying with {chunk}. "
                "The result is still exact; pass a smaller memory_budget to avoid the retry.",
                RuntimeWarning,
                stacklevel=2,
            )
    out = out.reshape(*lead, inp.Lq, inp.Ev)
    if return_lse:
        assert lse is not None
        lse_out = lse.reshape(*lead, inp.Lq)
        if lse_out.dtype != inp.stats_dtype:
            lse_out = lse_out.to(inp.stats_dtype)
        return out, lse_out
    return out


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
    added, ``is_causal`` top-left, fully masked rows -> 0, ``enable_gqa``); ``options`` are the
    keyword-only options of :func:`subquad.attention` (``memory_budget``, ``chunk_size``,
    ``backend``, ``score_mod``, ``mask_mod``). ``return_lse`` is not accepted here.
    """
    if "return_lse" in options:
        raise TypeError("sdpa() returns the output only; use subquad.attention(..., return_lse=True) for the lse.")
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
) -> Plan:
    """What :func:`attention` would run for these arguments, without running it.

    Returns a :class:`Plan` (``backend``, ``chunk_size``, ``predicted_peak_bytes``,
    ``budget_bytes``, ``rejected``: the reasons of every path not taken); ``print(plan)`` reads well.
    Raises like :func:`attention` (e.g. :class:`MemoryBudgetError`).
    """
    return _prepare(
        query, key, value, attn_mask, is_causal, score_mod, mask_mod, scale, enable_gqa,
        dropout_p, memory_budget, chunk_size, backend, return_lse,
    )[3]
