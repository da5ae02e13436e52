"""The per-call fast path: calls whose plan is one whole-input kernel skip validation and planning.

In generation every call is small and the plan is always "one fused call"; validating and
planning it again costs more than the kernel. A call that needs no gradient, has no callbacks
and no dropout is keyed by everything its plan and its validation depend on except the two
lengths (a decode step's key length grows by one each step):

* the caller's shapes without ``Lq``/``Lk``, dtypes, devices, whether each last dim is contiguous;
* the mask's rank, leading dims, which of its last two dims broadcast, dtype and device;
* ``is_causal``, ``scale``, ``enable_gqa``, ``memory_budget``, ``backend``, ``return_lse``.

The face keys a call from its loose arguments (building a record would add to every decode
step) and builds its :class:`~subquad._options.CallOptions` only on a miss; a caller that
already holds the record looks it up with :func:`lookup`.

The first call of a key runs the full path; if its plan is one whole-input call on a backend chosen
for what the call *is* (no backend was passed over for lack of memory), the key remembers the backend.
Later calls of the key check only what the lengths decide: the key/value lengths agree, the mask
broadcasts, and the whole input still fits the budget (and stays under the planner's tile-size
preference) — otherwise they take the full path, which plans, explains and raises exactly as
before. A budget derived from free memory is re-read (cached for 0.2 s) on every call.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from . import _engine
from ._backends import BACKENDS, TORCH_SDPA, cpu_flash_forward, mps_sdpa
from ._backends.fused import groupable, grouped_attention, grouped_bytes
from ._backends.products import native_fp16_products
from ._budget import resolve_budget
from ._inputs import Inputs
from ._options import CallOptions
from ._planner import Plan

SMALL_SCORES = 1 << 16
"""Calls with at most this many scores (256 KiB of float32) may go through torch's SDPA directly."""

_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor

_CACHE: Dict[Any, "Entry"] = {}
_LOCK = threading.Lock()
CACHE_SIZE = 512


class Entry:
    """A remembered plan, and the lengths and budget it was last found to fit.

    ``fits = (Lq, Lk_max, need)``: the call's extra memory for ``Lq`` queries and ``Lk_max``
    keys, the next power of two above the key length checked. The memory model only grows with
    the lengths, so a later call with the same ``Lq``, no more keys and at least that budget fits
    without a new check (a decode step adds one key at a time).
    """

    __slots__ = ("backend", "budget", "direct", "fits", "gqa", "plain", "scale")

    def __init__(self, backend: str, budget: Optional[int], direct: bool, plain: bool, scale: float, gqa: bool) -> None:
        self.backend = backend  # "fused" or "sdpa"
        self.budget = budget  # an explicit budget in bytes; None: half the free memory, read per call
        self.direct = direct  # one call of the fused CPU kernel, without the engine
        self.plain = plain  # direct, and the caller's tensors are the kernel's (4-D, one batch size)
        self.scale = scale
        self.gqa = gqa
        self.fits: Tuple[int, int, int] = (-1, -1, 0)  # (Lq, Lk_max, need) last checked


def _budget(entry: Entry, device: torch.device) -> int:
    return entry.budget if entry.budget is not None else resolve_budget(None, device)


def _fits(entry: Entry, inp: Inputs, Lq: int, Lk: int, need_lse: bool) -> bool:
    budget = _budget(entry, inp.device)
    fq, fk, fb = entry.fits
    if fq == Lq and Lk <= fk and budget >= fb:
        return True
    backend = BACKENDS[entry.backend]
    longer = 1 << max(Lk - 1, 1).bit_length()
    if longer > Lk:  # the model at a longer key, on shapes alone (meta tensors)
        k, v = inp.key, inp.value
        inp = dataclasses.replace(
            inp,
            key=torch.empty((*k.shape[:2], longer, k.shape[3]), dtype=k.dtype, device="meta"),
            value=torch.empty((*v.shape[:2], longer, v.shape[3]), dtype=v.dtype, device="meta"),
        )
    need = backend.forward_bytes(inp, Lq, longer, need_lse)
    if (
        need <= budget
        and backend.tile_bytes(inp, Lq, longer) <= backend.tile_target(inp)
        and _device_allows(inp, Lq, longer)
    ):
        entry.fits = (Lq, longer, need)
        return True
    if longer == Lk:
        return False
    return _fits_exactly(entry, backend, inp, Lq, Lk, need_lse, budget)


def _device_allows(inp: Inputs, Lq: int, Lk: int) -> bool:
    """Whether the device can take the whole call (``inp`` at these lengths) in one kernel: on MPS,
    whether torch's path for it is exact (a path that materializes the scores must stay below
    the matmul cap: Metal aborts the process at 2**32 elements)."""
    return inp.device_type != "mps" or mps_sdpa.route(inp).refusal is None


def _fits_exactly(entry: Entry, backend: Any, inp: Inputs, Lq: int, Lk: int, need_lse: bool, budget: int) -> bool:
    k, v = inp.key, inp.value  # meta tensors of the longer length: the model at this one
    inp = dataclasses.replace(
        inp,
        key=torch.empty((*k.shape[:2], Lk, k.shape[3]), dtype=k.dtype, device="meta"),
        value=torch.empty((*v.shape[:2], Lk, v.shape[3]), dtype=v.dtype, device="meta"),
    )
    need = backend.forward_bytes(inp, Lq, Lk, need_lse)
    if need > budget or backend.tile_bytes(inp, Lq, Lk) > backend.tile_target(inp) or not _device_allows(inp, Lq, Lk):
        return False
    entry.fits = (Lq, Lk, need)
    return True


def key(
    query: Any,
    key_: Any,
    value: Any,
    attn_mask: Any,
    is_causal: Any,
    score_mod: Any,
    mask_mod: Any,
    scale: Any,
    enable_gqa: Any,
    dropout_p: Any,
    memory_budget: Any,
    chunk_size: Any,
    backend: Any,
    return_lse: Any,
    allow_compile: Any,
) -> Optional[Tuple[Any, ...]]:
    """The call's key, or ``None`` when it cannot take the fast path."""
    if type(query) is not Tensor or type(key_) is not Tensor or type(value) is not Tensor:
        return None  # subclasses (and torch's mask objects) take the full path
    if score_mod is not None or mask_mod is not None or chunk_size is not None:
        return None
    if type(dropout_p) not in (float, int) or dropout_p != 0:
        return None
    if type(is_causal) is not bool or type(enable_gqa) is not bool or type(return_lse) is not bool:
        return None
    if scale is not None and type(scale) not in (float, int):
        return None
    if memory_budget is not None and type(memory_budget) not in (int, str):
        return None
    if allow_compile is not None and type(allow_compile) is not bool:
        return None
    nd = query.dim()
    if nd not in (3, 4) or key_.dim() != nd or value.dim() != nd or query.is_nested:
        return None
    mask_key = None
    if attn_mask is not None:
        if type(attn_mask) is not Tensor or not 2 <= attn_mask.dim() <= nd:
            return None
        mask_key = (
            attn_mask.dim(),
            tuple(attn_mask.shape[:-2]),
            attn_mask.shape[-2] == 1,
            attn_mask.shape[-1] == 1,
            attn_mask.dtype,
            attn_mask.device,
        )
    if torch.is_grad_enabled() and (
        query.requires_grad
        or key_.requires_grad
        or value.requires_grad
        or (attn_mask is not None and attn_mask.requires_grad)
    ):
        return None
    if _is_wrapped(query):
        return None
    qs, ks, vs = query.shape, key_.shape, value.shape  # each read makes a new Size: once
    return (
        qs[:-2],
        qs[-1],
        ks[:-2],
        ks[-1],
        vs[:-2],
        vs[-1],
        query.dtype,
        key_.dtype,
        value.dtype,
        query.device,
        key_.device,
        value.device,
        query.stride(-1) == 1,
        key_.stride(-1) == 1,
        value.stride(-1) == 1,
        mask_key,
        is_causal,
        scale,
        enable_gqa,
        memory_budget,
        backend,
        return_lse,
    )


def lookup(
    query: Any, key_: Any, value: Any, o: CallOptions
) -> Tuple[Optional[Tuple[Any, ...]], Optional[Union[Tensor, Tuple[Tensor, Tensor]]]]:
    """``(key, result)`` of a call given as its record (the compiled operator's eager half, a
    distributed group of one); ``result`` is ``None`` when the call must take the full path."""
    k = key(
        query, key_, value, o.attn_mask, o.is_causal, o.score_mod, o.mask_mod, o.scale, o.enable_gqa, o.dropout_p,
        o.memory_budget, o.chunk_size, o.backend, o.return_lse, o.allow_compile,
    )  # fmt: skip
    if k is None:
        return None, None
    return k, run(k, query, key_, value, o.attn_mask, o.is_causal, o.scale, o.return_lse)


def remember(k: Optional[Tuple[Any, ...]], inp: Inputs, plan: Plan, memory_budget: Any) -> None:
    """Remember the plan of a key after the full path made it, if later calls may reuse it."""
    if k is None or plan.backend not in ("fused", "sdpa") or inp.n_groups > 1 or inp.has_callbacks:
        return
    if plan.chunk_size is not None and (plan.chunk_size[0] < inp.Lq or plan.chunk_size[1] < inp.Lk):
        return
    if any("budget is" in reason for reasons in plan.rejected.values() for reason in reasons):
        return  # a faster backend was passed over for lack of memory: another length may fit it
    direct = (
        plan.backend == "fused"
        and inp.attn_mask is None
        and inp.E == inp.Ev
        and inp.positive_scale
        and inp.query.stride(-1) == 1
        and inp.key.stride(-1) == 1
        and inp.value.stride(-1) == 1
    )
    plain = direct and len(inp.batch_shape) == 1 and not inp.kv_broadcast and inp.query.shape[0] == inp.B
    entry = Entry(
        plan.backend, None if memory_budget is None else plan.budget_bytes, direct, plain, inp.scale, inp.G > 1
    )
    with _LOCK:
        while _CACHE and len(_CACHE) >= CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[k] = entry


def run(
    k: Tuple[Any, ...],
    query: Tensor,
    key_: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    scale: Optional[float],
    return_lse: bool,
) -> Optional[Union[Tensor, Tuple[Tensor, Tensor]]]:
    """The call's result through its remembered plan, or ``None`` to take the full path."""
    entry = _CACHE.get(k)
    if entry is None:
        return None
    qs = query.shape  # each read makes a new Size: once
    Lq, Lk = qs[-2], key_.shape[-2]
    if value.shape[-2] != Lk or Lq == 0 or Lk == 0:
        return None
    if attn_mask is not None and (attn_mask.shape[-2] not in (1, Lq) or attn_mask.shape[-1] not in (1, Lk)):
        return None
    if entry.plain:
        return _run_plain(entry, query, key_, value, is_causal, scale, return_lse, qs[0] * qs[1], Lq, Lk)
    inp = _inputs(query, key_, value, attn_mask, is_causal, scale)
    if inp.empty or not _fits(entry, inp, Lq, Lk, return_lse):
        return None
    backend = BACKENDS[entry.backend]
    try:
        if entry.backend == "sdpa" or entry.direct:
            out, lse = backend.run_whole(inp, return_lse)
        else:
            out, lse = _engine.forward(inp, "fused", (Lq, Lk), 0, need_lse=return_lse)
    except Exception:  # the full path recovers (or raises) as it always does
        return None
    out = out.reshape(inp.output_shape)
    if return_lse:
        assert lse is not None
        return out, lse.reshape(inp.output_shape[:-1]).to(inp.stats_dtype)
    return out


def _run_plain(
    entry: Entry,
    query: Tensor,
    key_: Tensor,
    value: Tensor,
    is_causal: bool,
    scale: Optional[float],
    return_lse: bool,
    rows: int,
    Lq: int,
    Lk: int,
) -> Optional[Union[Tensor, Tuple[Tensor, Tensor]]]:
    """One fused kernel call on the caller's own tensors (``rows`` = B·Hq of them); Inputs are
    built only to re-check the fit."""
    fq, fk, fb = entry.fits
    if not (fq == Lq and Lk <= fk and _budget(entry, query.device) >= fb):
        inp = _inputs(query, key_, value, None, is_causal, scale)
        if inp.empty or not _fits(entry, inp, Lq, Lk, return_lse):
            return None
    scores = rows * Lq * Lk
    half = query.dtype == torch.float16 and not native_fp16_products()
    if half:  # the kernel's GEMMs on float32 copies
        query, key_, value = query.float(), key_.float(), value.float()
    try:
        if (
            entry.gqa
            and groupable(query.dtype, is_causal, scores)
            and grouped_bytes(scores, query.element_size()) <= _budget(entry, query.device)
        ):
            out, lse = grouped_attention(query, key_, value, entry.scale, return_lse)
            out = out.half() if half else out
            return out if lse is None else (out, lse)
        if not return_lse and not entry.gqa and scores <= SMALL_SCORES:
            # torch's SDPA runs this very kernel on such a call (4-D, no mask, no GQA, no batch
            # broadcasting) with less dispatch overhead; the call is small enough that even its
            # math path would fit any budget.
            out = TORCH_SDPA(query, key_, value, None, 0.0, is_causal, scale=scale)  # None: its default scale
            return out.half() if half else out
        out, lse = cpu_flash_forward()(query, key_, value, 0.0, is_causal, attn_mask=None, scale=entry.scale)
    except Exception:  # the full path recovers (or raises) as it always does
        return None
    if half:
        out = out.half()
    if return_lse:
        return out, lse.to(torch.float64 if out.dtype == torch.float64 else torch.float32)
    return out


def _inputs(
    query: Tensor, key_: Tensor, value: Tensor, attn_mask: Optional[Tensor], is_causal: bool, scale: Optional[float]
) -> Inputs:
    """The call's :class:`Inputs`, built without validation (the key guarantees it would pass)."""
    if query.dim() == 3:
        query, key_, value = query.unsqueeze(0), key_.unsqueeze(0), value.unsqueeze(0)
        batch_shape: Tuple[int, ...] = ()
        batch = 1
    else:
        batch = max(query.shape[0], key_.shape[0], value.shape[0])
        batch_shape = (batch,)
    mask = attn_mask
    if mask is not None:
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
    E = query.shape[-1]
    return Inputs(
        query=query,
        key=key_,
        value=value,
        batch_shape=batch_shape,
        attn_mask=mask,
        is_causal=is_causal,
        scale=(1.0 / math.sqrt(E) if E > 0 else 1.0) if scale is None else float(scale),
        dropout_p=0.0,
        batch=batch,
    )


def clear() -> None:
    with _LOCK:
        _CACHE.clear()
