"""User callbacks (``score_mod`` / ``mask_mod``) at run time: calling them per tile, block states,
and the tensors they capture.

A callback is called on FlexAttention-style broadcastable index grids. Whatever it raises is
marked as the user's (:func:`call_user`), so that no retry or fallback of the engine hides it.
A tile's state under a ``mask_mod`` (:data:`EMPTY`, :data:`FULL`, :data:`PARTIAL`) comes from
the callback's ``block_state``/``block_states`` for a grid of tiles at once (:func:`grid_states`,
read back in one device -> host transfer instead of a wait per tile) or from evaluating it
(:func:`evaluated_state`, :class:`TileStates` for the tile loop). Tensors a
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


UNKNOWN = -1
"""In a grid of block states: the declared states do not decide this tile; the mask is evaluated on it."""


def evaluated_state(inp: Inputs, qs: int, qe: int, ks: int, ke: int) -> Tuple[int, Optional[Tensor]]:
    """The tile's state from evaluating ``mask_mod`` on it, and the evaluated mask of a PARTIAL tile.

    Exact for any callback (elementwise, no matmul); the mask is handed on with the segment so
    that it is not evaluated twice. It waits for the device twice, so only the CPU's tile loop
    asks this per tile (:class:`TileStates`).
    """
    keep = eval_mask_mod(inp, qs, qe, ks, ke)
    if not bool(keep.any()):
        return EMPTY, None
    return (FULL, None) if bool(keep.all()) else (PARTIAL, keep)


def grid_bounds(start: int, end: int, block: int) -> Tuple[Tensor, Tensor]:
    """Starts and ends (int64, CPU) of the blocks of ``block`` positions over ``[start, end)``; the last may be short."""
    starts = torch.arange(start, end, block, dtype=torch.int64)
    return starts, torch.clamp(starts + block, max=end)


def declared_states(mask_mod: Any, qs: int, qe: int, q_block: int, ks: int, ke: int, kv_block: int) -> Optional[Tensor]:
    """What ``mask_mod`` declares of the tiles of a grid: blocks of ``q_block`` rows over ``[qs, qe)``
    times blocks of ``kv_block`` keys over ``[ks, ke)``, in the positions the callback sees.

    ``(nq, nk)`` int8 of EMPTY, FULL, PARTIAL or :data:`UNKNOWN`, on any device (a document mask's
    where its ids are); ``None`` when the mask declares nothing. From the mask's vectorized
    ``block_states`` when it has one, else one ``block_state`` call per tile.
    """
    vector = getattr(mask_mod, "block_states", None)
    if vector is not None:
        states: Optional[Tensor] = call_user(vector, qs, qe, q_block, ks, ke, kv_block)
        return states
    scalar = getattr(mask_mod, "block_state", None)
    if scalar is None:
        return None
    found = []
    for q0 in range(qs, qe, q_block):
        q1 = min(q0 + q_block, qe)
        for k0 in range(ks, ke, kv_block):
            state = call_user(scalar, q0, q1, k0, min(k0 + kv_block, ke))
            found.append(int(state) if state in (EMPTY, FULL, PARTIAL) else UNKNOWN)
    return torch.tensor(found, dtype=torch.int8).view(-(-(qe - qs) // q_block), -(-(ke - ks) // kv_block))


def grid_states(inp: Inputs, qs: int, qe: int, q_block: int, ks: int, ke: int, kv_block: int) -> Optional[Tensor]:
    """:func:`declared_states` of the call's ``mask_mod`` on a grid of its tiles (in the call's own
    positions: offsets are added here), on the host: one device -> host transfer for the grid."""
    if inp.mask_mod is None:
        return None
    qo, ko = inp.q_offset, inp.kv_offset
    states = declared_states(inp.mask_mod, qs + qo, qe + qo, q_block, ks + ko, ke + ko, kv_block)
    if states is None:
        return None
    shape = (-(-(qe - qs) // q_block), -(-(ke - ks) // kv_block))
    if not isinstance(states, Tensor) or tuple(states.shape) != shape:
        got = tuple(states.shape) if isinstance(states, Tensor) else type(states).__name__
        raise ValueError(
            f"mask_mod.block_states returned {got}, expected a tensor of shape {shape} (query blocks, key blocks)."
        )
    return states.to(device="cpu", dtype=torch.int8)


class TileStates:
    """The states of a call's tiles under its ``mask_mod`` (rows in blocks of ``q_chunk`` from 0,
    keys in tiles of ``kv_chunk``), for the tile loop, without a device -> host wait per tile.

    Declared states come for a band of block rows at once (:func:`grid_states`: one transfer per
    band, one per call unless the grid has more than :attr:`BAND` tiles). Tiles they leave
    :data:`UNKNOWN` are evaluated: on a CPU as the loop reaches them (:func:`evaluated_state`,
    whose mask the tile reuses), elsewhere for a whole block row on the device with one transfer
    per row (a GPU that waits for the host per tile idles between small kernels).
    """

    BAND = 1 << 16
    """Tiles whose declared states are computed together (bounds the grid's temporaries)."""

    def __init__(self, inp: Inputs, q_chunk: int, kv_chunk: int) -> None:
        self.inp, self.q_chunk, self.kv_chunk = inp, max(1, q_chunk), max(1, kv_chunk)
        self.band_rows = max(1, self.BAND // max(1, -(-inp.Lk // self.kv_chunk)))
        self._band: Tuple[int, Optional[List[List[int]]]] = (-1, None)

    def row(self, qs: int, qe: int, key_end: int) -> Optional[List[int]]:
        """States of the key tiles of rows ``[qs, qe)`` (a block of the grid) that start before
        ``key_end``; ``None`` without a ``mask_mod``. :data:`UNKNOWN` entries only on a CPU."""
        inp = self.inp
        if inp.mask_mod is None:
            return None
        i = qs // self.q_chunk
        first = i - i % self.band_rows
        if self._band[0] != first:
            q0 = first * self.q_chunk
            q1 = min(inp.Lq, q0 + self.band_rows * self.q_chunk)
            states = grid_states(inp, q0, q1, self.q_chunk, 0, inp.Lk, self.kv_chunk)
            self._band = (first, None if states is None else states.tolist())
        n = max(0, -(-min(key_end, inp.Lk) // self.kv_chunk))
        band = self._band[1]
        row = [UNKNOWN] * n if band is None else band[i - first][:n]
        if inp.device_type != "cpu" and UNKNOWN in row:
            row = self._evaluated(qs, qe, row)
        return row

    def _evaluated(self, qs: int, qe: int, row: List[int]) -> List[int]:
        """``row`` with its UNKNOWN tiles evaluated on the device, read back in one transfer.

        The PARTIAL ones evaluate their mask again when they run: keeping a row's masks would
        hold ``q_chunk x Lk`` of them, where evaluating costs a fraction of the tile's matmul.
        """
        found = []
        for j, state in enumerate(row):
            if state == UNKNOWN:
                ks = j * self.kv_chunk
                keep = eval_mask_mod(self.inp, qs, qe, ks, min(ks + self.kv_chunk, self.inp.Lk))
                found.append(torch.where(keep.any(), torch.where(keep.all(), FULL, PARTIAL), EMPTY))
        states = iter(torch.stack(found).tolist())
        return [next(states) if state == UNKNOWN else state for state in row]


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
