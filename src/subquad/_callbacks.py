"""User callbacks (``score_mod`` / ``mask_mod``) at run time: calling them per tile, block states,
and the tensors they capture.

A callback is called on FlexAttention-style broadcastable index grids. Whatever it raises is
marked as the user's (:func:`call_user`), so that no retry or fallback of the engine hides it.
A tile's state under a ``mask_mod`` (:data:`EMPTY`, :data:`FULL`, :data:`PARTIAL`) comes from
the callback's ``block_state`` or from evaluating it (:func:`mask_mod_state`). Tensors a
``score_mod`` reads that require grad are found by running it once (:func:`captured_tensors`)
and stand in as detached leaves during the backward (:class:`CapturedAsLeaves`).

What a callback *is* (traced from its graph) lives above, in :mod:`subquad._traced`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ._inputs import Inputs


def from_callback(e: BaseException) -> bool:
    """Whether ``e`` was raised by a user's ``score_mod``/``mask_mod`` (it must then propagate as is)."""
    return bool(getattr(e, "_subquad_from_callback", False))


def call_user(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a user callback; an exception it raises is marked so that no retry or fallback hides it."""
    try:
        return fn(*args)
    except Exception as e:
        with contextlib.suppress(Exception):  # an exception type without attributes: it still propagates unchanged
            e._subquad_from_callback = True  # type: ignore[attr-defined]
        raise


def index_grids(inp: Inputs, qs: int, qe: int, ks: int, ke: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """FlexAttention-style broadcastable int64 indices: b (B,1,1,1), h (1,Hq,1,1), q (1,1,qn,1), kv (1,1,1,kn).

    Positions are the call's own plus its ``q_offset``/``kv_offset`` (a block of a longer sequence).
    """
    dev = inp.device
    b = torch.arange(inp.b_offset, inp.b_offset + inp.B, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(inp.h_offset, inp.h_offset + inp.Hq, device=dev).view(1, -1, 1, 1)
    qo, ko = inp.q_offset, inp.kv_offset
    qi = torch.arange(qs + qo, qe + qo, device=dev).view(1, 1, -1, 1)
    ki = torch.arange(ks + ko, ke + ko, device=dev).view(1, 1, 1, -1)
    return b, h, qi, ki


def eval_mask_mod(inp: Inputs, qs: int, qe: int, ks: int, ke: int) -> Tensor:
    """``mask_mod`` on one tile, checked: a bool tensor broadcastable to ``(B, Hq, qn, kn)``."""
    assert inp.mask_mod is not None
    b, h, qi, ki = index_grids(inp, qs, qe, ks, ke)
    keep = call_user(inp.mask_mod, b, h, qi, ki)
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
        got = keep.dtype if isinstance(keep, Tensor) else type(keep).__name__
        raise TypeError(f"mask_mod must return a bool tensor (True = attend), got {got}.")
    try:
        torch.broadcast_shapes(keep.shape, (inp.B, inp.Hq, qe - qs, ke - ks))
    except RuntimeError:
        raise ValueError(
            f"mask_mod returned shape {tuple(keep.shape)}, which does not broadcast to the tile "
            f"{(inp.B, inp.Hq, qe - qs, ke - ks)} (B, Hq, q_chunk, kv_chunk)."
        ) from None
    return keep


def apply_score_mod(
    inp: Inputs, s4: Tensor, qs: int, qe: int, ks: int, ke: int, mode: Optional[TorchFunctionMode] = None
) -> Tensor:
    """``score_mod`` on one tile of scores ``(B, Hq, qn, kn)``, checked (``mode`` active inside the callback)."""
    assert inp.score_mod is not None
    b, h, qi, ki = index_grids(inp, qs, qe, ks, ke)
    with mode if mode is not None else contextlib.nullcontext():
        new = call_user(inp.score_mod, s4, b, h, qi, ki)
    if not isinstance(new, Tensor):
        raise TypeError(f"score_mod must return a tensor, got {type(new).__name__}.")
    if new.shape != s4.shape:
        try:
            new = new.expand(s4.shape)
        except RuntimeError:
            raise ValueError(
                f"score_mod returned shape {tuple(new.shape)}, expected the score tile's shape {tuple(s4.shape)}."
            ) from None
    if new.dtype != s4.dtype:
        if not new.is_floating_point():
            raise TypeError(f"score_mod must return floating-point scores (it was given {s4.dtype}), got {new.dtype}.")
        # A captured float64 table promotes the scores; cast back, as FlexAttention does.
        new = new.to(s4.dtype)
    return new


# ------------------------------------------------------------------ block states
# A tile's state under a ``mask_mod``: skipped, computed without the mask, computed with it.
EMPTY = 0
"""Block state: the ``mask_mod`` hides every element of the tile, which is skipped, never computed."""
FULL = 1
"""Block state: the ``mask_mod`` keeps every element of the tile, which is computed without evaluating it."""
PARTIAL = 2
"""Block state: the ``mask_mod`` may mix kept and hidden elements; it is evaluated on the tile (always safe)."""


def mask_mod_state(inp: Inputs, qs: int, qe: int, ks: int, ke: int) -> Tuple[int, Optional[Tensor]]:
    """The tile's state under ``mask_mod``, and the evaluated mask when it had to be evaluated."""
    mm = inp.mask_mod
    if mm is None:
        return FULL, None
    declared: Optional[Callable[[int, int, int, int], int]] = getattr(mm, "block_state", None)
    if declared is not None:
        qo, ko = inp.q_offset, inp.kv_offset
        state = call_user(declared, qs + qo, qe + qo, ks + ko, ke + ko)
        if state in (EMPTY, FULL, PARTIAL):
            return int(state), None
    # Exact for any callback: evaluate it on the tile's indices (elementwise, no matmul); the
    # result is handed on with the segment so that it is not evaluated twice.
    keep = eval_mask_mod(inp, qs, qe, ks, ke)
    if not bool(keep.any()):
        return EMPTY, None
    return (FULL, None) if bool(keep.all()) else (PARTIAL, keep)


# ------------------------------------------------------------------ tensors captured by score_mod
class UncapturedGradientError(RuntimeError):
    """A ``score_mod`` read a tensor that requires grad which subquad's probe of it did not see."""


class _RecordGradTensors(TorchFunctionMode):
    """Collects every tensor that requires grad and is an argument of a torch function.

    Run under ``no_grad``: nothing created inside then requires grad, so each one found comes from
    outside the callback, however it got there (closure, global, ``functools.partial``, bound
    method, module attribute, container, a view or a tensor derived from a parameter).
    """

    def __init__(self) -> None:
        super().__init__()
        self.found: Dict[int, Tensor] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for x in tree_flatten((args, kwargs))[0]:
            if isinstance(x, Tensor) and x.requires_grad:
                self.found.setdefault(id(x), x)
        return func(*args, **kwargs)


def captured_tensors(inp: Inputs) -> List[Tensor]:
    """Tensors requiring grad that the call's ``score_mod`` reads (they become extra inputs of the
    autograd Function); none when gradients are off."""
    if inp.score_mod is None or not torch.is_grad_enabled():
        return []
    return probe_captured(inp)


def probe_captured(inp: Inputs) -> List[Tensor]:
    """Tensors requiring grad that ``score_mod`` reads, found by running it once on a tiny tile.

    The tile holds the first and last query and key (callbacks that index tables with positions
    touch both ends). A tensor read only on other tiles is caught by the backward, which raises
    rather than drop its gradient (:class:`UncapturedGradientError`).
    """
    if inp.score_mod is None or inp.B * inp.Hq * inp.Lq * inp.Lk == 0:
        return []
    dev = inp.device
    b = torch.arange(inp.b_offset, inp.b_offset + inp.B, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(inp.h_offset, inp.h_offset + inp.Hq, device=dev).view(1, -1, 1, 1)
    qi = torch.tensor(sorted({0, inp.Lq - 1}), device=dev).view(1, 1, -1, 1) + inp.q_offset
    ki = torch.tensor(sorted({0, inp.Lk - 1}), device=dev).view(1, 1, 1, -1) + inp.kv_offset
    score = torch.zeros(inp.B, inp.Hq, qi.shape[2], ki.shape[3], dtype=inp.stats_dtype, device=dev)
    recorder = _RecordGradTensors()
    with torch.no_grad(), recorder:
        call_user(inp.score_mod, score, b, h, qi, ki)
    return list(recorder.found.values())


class CapturedAsLeaves(TorchFunctionMode):
    """Inside ``score_mod``, reads of a captured tensor see a detached leaf standing for it.

    The pulled-back gradient then stops at each captured tensor: the autograd Function returns
    it as that tensor's gradient and autograd carries it on to the tensor's sources once. (A
    gradient taken through the real tensor would also flow into its sources here, counting a
    parameter twice when a view or a derived tensor of it is captured as well, and would
    traverse their graph once per tile.)
    """

    def __init__(self, proxies: Mapping[int, Tensor], known: Sequence[Tensor]) -> None:
        super().__init__()
        self.proxies = proxies
        self.known: Dict[int, Tensor] = {id(t): t for t in known}

    def _swap(self, x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        proxy = self.proxies.get(id(x))
        if proxy is not None:
            return proxy
        if x.requires_grad and id(x) not in self.known:
            raise UncapturedGradientError(
                f"score_mod read a tensor that requires grad ({tuple(x.shape)}, {x.dtype}) on a tile where "
                "subquad's probe of the callback (its first and last query and key) did not see it, so its "
                "gradient cannot be returned. Read every learnable tensor on every tile (e.g. index it "
                "with the tile's positions), or detach it if it needs no gradient."
            )
        return x

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = tree_map(self._swap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                self.known[id(t)] = t
        return out
