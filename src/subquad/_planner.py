"""The planner: which backend runs a call, with which tiles, and why not the others.

Each backend states what it supports as data and explains refusals as sentences
(:meth:`~subquad._backends.base.Backend.not_supported_reasons`), and answers a budget with the
largest tiles whose predicted peak fits it (:meth:`~subquad._backends.base.Backend.fit`), or the
cheapest of those by its own count of the work (:meth:`~subquad._backends.base.Backend.fastest`:
the fused kernel's causal blocks). The
planner walks the backends fastest first (:func:`~subquad._backends.priority`), keeps the first
that supports the call and fits, and records every reason of those it passed over
(:class:`Plan`), with the time :mod:`subquad._time_model` estimates for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ._backends import BACKENDS, Options
from ._backends.dispatch import Priority, call_priority
from ._budget import format_bytes, format_seconds
from ._errors import MemoryBudgetError
from ._inputs import Inputs, describe
from ._time_model import _parts, predict_seconds, visible_fraction


# ------------------------------------------------------------------ the plan
@dataclass
class Plan:
    """What :func:`subquad.attention` would run for a call, and why.

    ``chunk_size`` is ``(q_chunk, kv_chunk)`` of the forward (``None`` for a whole-input kernel);
    ``predicted_peak_bytes`` is the model's upper bound of the call's extra memory (forward plus
    backward when gradients are needed); ``rejected`` maps each path not taken to its reasons.
    """

    backend: str
    chunk_size: Optional[Tuple[int, int]]
    predicted_peak_bytes: int
    budget_bytes: int
    rejected: Dict[str, List[str]] = field(default_factory=dict)
    backward_backend: Optional[str] = None
    backward_chunk_size: Optional[Tuple[int, int]] = None
    shape: str = ""
    notes: List[str] = field(default_factory=list)
    tiles: int = 1
    predicted_seconds: Optional[float] = None
    grouped: bool = False
    """The whole call runs as two grouped matmuls (grouped query heads, few scores, no gradient)."""

    def __str__(self) -> str:
        lines = [f"subquad plan for {self.shape}" if self.shape else "subquad plan"]
        tiles = "whole input" if self.chunk_size is None else f"tiles of {self.chunk_size[0]} x {self.chunk_size[1]}"
        lines.append(f"  backend:   {self.backend} ({tiles})")
        if self.backward_backend is not None:
            btiles = (
                "whole input"
                if self.backward_chunk_size is None
                else f"tiles of {self.backward_chunk_size[0]} x {self.backward_chunk_size[1]}"
            )
            lines.append(f"  backward:  {self.backward_backend} ({btiles})")
        lines.append(
            f"  memory:    predicted peak {format_bytes(self.predicted_peak_bytes)} "
            f"of a {format_bytes(self.budget_bytes)} budget (extra beyond inputs and output)"
        )
        if self.predicted_seconds is not None:
            calls = "one kernel call" if self.tiles == 1 else f"{self.tiles:,} tiles"
            lines.append(
                f"  time:      about {format_seconds(self.predicted_seconds)} ({calls}; an order of magnitude)"
            )
        for note in self.notes:
            lines.append(f"  note:      {note}")
        for name, reasons in self.rejected.items():
            for i, reason in enumerate(reasons):
                lines.append(f"  {'not ' + name + ':' if i == 0 else '':<14}{reason}")
        return "\n".join(lines)


def _say_of_the_loops(plan: Plan, order: Priority) -> None:
    """What ``explain()`` says of the C++ loops: why they go first, or why a backend above them
    runs the call (listed as ``not loops``)."""
    if order.loop_note is not None and plan.backend == "loops":
        plan.notes.append(order.loop_note)
    elif order.not_loops is not None and plan.backend != "loops":
        plan.rejected.setdefault("loops", [order.not_loops])


def make_plan(
    inp: Inputs,
    opts: Options,
    budget: int,
    backend: str = "auto",
    estimate_time: bool = False,
    shape: Optional[str] = None,
) -> Plan:
    """Choose the backend and tiles for a call. Raises :class:`MemoryBudgetError` if nothing fits.

    A forced ``chunk_size`` must fit the budget too (the budget is a promise): if its tiles
    are predicted to need more, this raises :class:`MemoryBudgetError` instead of running them.
    ``estimate_time`` fills ``predicted_seconds`` (always filled for calls of many tiles).
    ``shape``: how plans and errors describe the call (default: :func:`describe` of ``inp``; a
    packed call is planned on its longest sequences and described whole).
    """
    shape = describe(inp) if shape is None else shape
    need_grad = inp.requires_grad or opts.captured_requires_grad
    order = call_priority(inp, need_grad, opts.packed) if backend == "auto" else Priority([backend])
    names = order.names
    rejected: Dict[str, List[str]] = {}
    smallest_overall: Optional[int] = None
    for name in names:
        b = BACKENDS[name]
        reasons = b.not_supported_reasons(inp, opts)
        if reasons:
            rejected[name] = reasons
            continue
        backward_name = b.backward_backend(inp, opts) if need_grad else None
        if order.loop_note is not None and opts.packed and backward_name == "loops":
            # auto put a packed call's forward in the loops; its backward is the fused kernel's
            # where it takes it (one call per sequence).
            backward_name = "loops" if BACKENDS["fused"].not_supported_reasons(inp, opts) else "fused"
        fwd, bwd_tiles, pred, smallest = b.fit(
            inp, opts, budget, BACKENDS[backward_name] if backward_name is not None else None
        )
        if pred > budget or (b.tiled and fwd is None):
            if opts.chunk_size is not None and b.tiled:
                tiles = f"chunk_size={opts.chunk_size} needs"
            else:
                tiles = "its smallest tiles need" if b.tiled else "needs"
            rejected[name] = [f"{tiles} ≈{format_bytes(smallest)}, the budget is {format_bytes(budget)}"]
            smallest_overall = smallest if smallest_overall is None else min(smallest_overall, smallest)
            continue
        notes = b.notes(inp)
        grouped = not need_grad and b.runs_grouped(inp, fwd, budget)
        plan = Plan(
            backend=name,
            chunk_size=fwd,
            predicted_peak_bytes=int(pred),
            budget_bytes=budget,
            rejected=rejected,
            backward_backend=backward_name,
            backward_chunk_size=bwd_tiles,
            shape=shape,
            grouped=grouped,
        )
        if fwd is not None and fwd[1] >= inp.Lk and fwd[0] < inp.Lq:
            plan.notes.append("whole key rows per block (no kv chunking)")
        if inp.n_groups > 1:
            plan.notes.append(
                f"batch broadcasting runs as {inp.n_groups} groups of {inp.B} (one group's tiles at a time)"
            )
        plan.tiles = count_tiles(inp, fwd, bwd_tiles if need_grad else None)
        if estimate_time or plan.tiles >= ESTIMATE_TIME_FROM_TILES:
            plan.predicted_seconds = predict_seconds(inp, plan, need_grad)
        plan.notes.extend(notes)
        _say_of_the_loops(plan, order)
        if backend == "auto":
            for later in names[names.index(name) + 1 :]:
                plan.rejected.setdefault(later, ["slower backend; the one above fits"])
        return plan
    if smallest_overall is not None:
        if opts.chunk_size is not None:
            raise MemoryBudgetError(
                f"chunk_size={opts.chunk_size} does not fit memory_budget={format_bytes(budget)} for {shape}: "
                f"those tiles need ≈{format_bytes(smallest_overall)}; pass a smaller chunk_size, chunk_size=None "
                f"(the planner picks tiles that fit), or memory_budget of at least {smallest_overall} bytes."
                + "".join(f"\n  {n}: {'; '.join(r)}" for n, r in rejected.items())
            )
        raise MemoryBudgetError(
            f"memory_budget={format_bytes(budget)} is too small for {shape}: the smallest tiles "
            f"need ≈{format_bytes(smallest_overall)}; pass memory_budget of at least {smallest_overall} bytes."
            + "".join(f"\n  {n}: {'; '.join(r)}" for n, r in rejected.items())
        )
    raise NotImplementedError(
        f"backend={backend!r} cannot run {shape}:" + "".join(f"\n  {n}: {'; '.join(r)}" for n, r in rejected.items())
    )


ESTIMATE_TIME_FROM_TILES = 4096
"""Plans with at least this many tiles get a time estimate (long calls log their progress)."""


def count_tiles(inp: Inputs, fwd: Optional[Tuple[int, int]], bwd: Optional[Tuple[int, int]]) -> int:
    """Kernel calls of the plan, forward and backward (causal tiles above the diagonal not counted)."""
    n = 0
    for Lq, Lk, o in _parts(inp):
        frac = visible_fraction(Lq, Lk, inp.is_causal, o)
        for tiles in (fwd, bwd):
            if tiles is None:
                continue
            nq = -(-max(Lq, 1) // tiles[0])
            nk = -(-max(Lk, 1) // tiles[1])
            n += max(1, math.ceil(nq * nk * frac) + (min(nq, nk) if inp.is_causal else 0))
    return max(n, 1)
