"""The memory model and the planner: which path runs, with which tiles, and why not the others.

Each backend states what it supports as data and explains refusals as sentences
(:meth:`Backend.not_supported_reasons`); its memory model predicts the peak *extra* bytes of a call
(beyond the inputs and the output) for a tile size. The planner walks the backends fastest first
and keeps the first that supports the call and has a tile size whose prediction fits the budget,
taking the largest such tiles (whole key rows first).
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from ._inputs import ArgumentError, Inputs
from ._paths import BACKENDS, Backend, Options, priority

MiB = 1 << 20
DEFAULT_BUDGET_FRACTION = 0.5
"""``memory_budget=None`` allows this fraction of the device's free memory."""

# The MPS matmul errors at 2**32 elements and has been reported to corrupt results near 2**31.
MPS_MAX_MATMUL_ELEMENTS = 1 << 30


class MemoryBudgetError(MemoryError):
    """The memory budget is too small for even the smallest tiles of every path."""


# ------------------------------------------------------------------ budgets
MAX_BUDGET = (1 << 63) - 1

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}


def parse_budget(memory_budget: Union[int, str]) -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"2GB"``, ``"1.5GiB"``."""
    if isinstance(memory_budget, bool):
        raise ArgumentError(f"Expected memory_budget to be None, an int of bytes or a string like '512MiB', got {memory_budget!r}.")
    if isinstance(memory_budget, int):
        value = memory_budget
    elif isinstance(memory_budget, float) and memory_budget.is_integer():
        value = int(memory_budget)
    elif isinstance(memory_budget, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", memory_budget)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ArgumentError(
                f"Could not parse memory_budget={memory_budget!r}; use bytes or a number with a unit "
                "(B, KB, MB, GB, KiB, MiB, GiB), e.g. '512MiB' or '2GB'."
            )
        number = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if not math.isfinite(number) or number > MAX_BUDGET:
            raise ArgumentError(
                f"memory_budget={memory_budget!r} is not a usable number of bytes (at most {MAX_BUDGET}, 2**63 - 1)."
            )
        value = int(number)
    else:
        raise ArgumentError(
            f"Expected memory_budget to be None, an int of bytes or a string like '512MiB', got {memory_budget!r}."
        )
    if value < 0:
        raise ArgumentError(f"Expected memory_budget >= 0, got {memory_budget!r}.")
    return min(value, MAX_BUDGET)


_CPU_FREE_CACHE: List[float] = []  # [timestamp, bytes]: /proc/meminfo read at most every 0.2 s


def free_memory_bytes(device: torch.device) -> int:
    """Memory the device could still give to one call."""
    if device.type == "cpu":
        now = time.monotonic()
        if _CPU_FREE_CACHE and now - _CPU_FREE_CACHE[0] < 0.2:
            return int(_CPU_FREE_CACHE[1])
        _CPU_FREE_CACHE[:] = [now, _cpu_available_bytes()]
        return int(_CPU_FREE_CACHE[1])
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        reusable = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + reusable)
    if device.type == "mps":
        mps = torch.mps
        if hasattr(mps, "recommended_max_memory") and hasattr(mps, "current_allocated_memory"):
            return max(0, int(mps.recommended_max_memory() - mps.current_allocated_memory()))
    return _cpu_available_bytes()


def _cpu_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def resolve_budget(memory_budget: Optional[Union[int, str]], device: torch.device) -> int:
    if memory_budget is None:
        return int(DEFAULT_BUDGET_FRACTION * free_memory_bytes(device))
    return parse_budget(memory_budget)


def format_seconds(t: float) -> str:
    if t < 1e-3:
        return f"{t * 1e6:.0f} us"
    if t < 1:
        return f"{t * 1e3:.0f} ms"
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if t >= size:
            return f"{t / size:.1f} {unit}"
    return f"{t:.1f} s"


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# ------------------------------------------------------------------ backends
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

    def __str__(self) -> str:
        lines = [f"subquad plan for {self.shape}" if self.shape else "subquad plan"]
        tiles = "whole input" if self.chunk_size is None else f"tiles of {self.chunk_size[0]} x {self.chunk_size[1]}"
        lines.append(f"  backend:   {self.backend} ({tiles})")
        if self.backward_backend is not None:
            btiles = (
                "whole input" if self.backward_chunk_size is None
                else f"tiles of {self.backward_chunk_size[0]} x {self.backward_chunk_size[1]}"
            )
            lines.append(f"  backward:  {self.backward_backend} ({btiles})")
        lines.append(
            f"  memory:    predicted peak {format_bytes(self.predicted_peak_bytes)} "
            f"of a {format_bytes(self.budget_bytes)} budget (extra beyond inputs and output)"
        )
        if self.predicted_seconds is not None:
            calls = "one kernel call" if self.tiles == 1 else f"{self.tiles:,} tiles"
            lines.append(f"  time:      about {format_seconds(self.predicted_seconds)} ({calls}; an order of magnitude)")
        for note in self.notes:
            lines.append(f"  note:      {note}")
        for name, reasons in self.rejected.items():
            for i, reason in enumerate(reasons):
                lines.append(f"  {'not ' + name + ':' if i == 0 else '':<14}{reason}")
        return "\n".join(lines)


def _candidates(n: int, smallest: int = 1) -> List[int]:
    """The whole length, then powers of two below it down to ``smallest``, descending."""
    if n <= max(1, smallest):
        return [max(n, 1)]
    out = [n]
    p = 1 << (n - 1).bit_length() - 1
    if p == n:
        p //= 2
    while p >= smallest:
        out.append(p)
        p //= 2
    return out


TARGET_TILE_BYTES = 16 * MiB
"""Preferred ceiling on what one tile materializes; larger tiles are used only if nothing smaller exists."""

# Key segments shorter than this cost more in per-call overhead than they save in memory.
MIN_KV_CHUNK = 32


def _tile_options(inp: Inputs, backend: Backend) -> List[Tuple[int, int]]:
    """Tile sizes to try, best first: large tiles, whole key rows preferred."""
    qcs, kcs = _candidates(inp.Lq), _candidates(inp.Lk, MIN_KV_CHUNK)
    if inp.is_causal or inp.mask_mod is not None:
        # Square, aligned tiles let whole tiles above the diagonal, or outside the mask's blocks,
        # be skipped (whole key rows would compute every tile of a row).
        pairs = [(qc, qc) for qc in _candidates(min(max(inp.Lq, 1), max(inp.Lk, 1)), 8)]
        pairs.insert(0, (max(inp.Lq, 1), max(inp.Lk, 1)))
    else:
        pairs = [(qc, kc) for qc in qcs for kc in kcs]
    if backend.name == "fused" and inp.mask_kind != "bool" and not inp.has_callbacks and not inp.is_causal:
        # The kernel tiles internally; key segments only cost calls. Whole key rows always.
        pairs = [(qc, max(inp.Lk, 1)) for qc in qcs]
    lq, lk = max(inp.Lq, 1), max(inp.Lk, 1)
    pairs = sorted(set(pairs), key=lambda p: (-min(p[0], lq) * min(p[1], lk), -p[1], -p[0]))
    if inp.device.type == "mps":
        pairs = [p for p in pairs if inp.B * inp.Hq * p[0] * p[1] < MPS_MAX_MATMUL_ELEMENTS]
    # Bigger tiles stop paying off once what a tile materializes leaves the caches: on a 2-core
    # CPU, 1x4x4096x64 matmul tiles of 256x4096 (16 MiB of scores) ran in 141 ms, the whole
    # 4096x4096 tile in 224 ms; causal ALiBi on the fused kernel 131 ms (512x512) vs 247 ms (whole).
    fast = [p for p in pairs if backend.tile_bytes(inp, *p) <= TARGET_TILE_BYTES]
    return fast or pairs


def _fit(
    inp: Inputs, backend: Backend, opts: Options, budget: int, need_grad: bool, need_lse: bool
) -> Tuple[Optional[Tuple[int, int]], Optional[Tuple[int, int]], int, int]:
    """Largest forward (and backward) tiles within the budget.

    Returns ``(fwd_tiles, bwd_tiles, predicted, smallest_possible)``; tiles are ``None`` if none fit.
    """
    def bwd(p: Tuple[int, int]) -> int:
        return bwd_backend.backward_bytes(inp, p[0], p[1], opts) if need_grad else 0

    bwd_backend = BACKENDS[backend.backward_kernel(inp, opts)] if need_grad else backend
    if not backend.tiled:
        pred = backend.forward_bytes(inp, inp.Lq, inp.Lk, need_lse) + (
            backend.backward_bytes(inp, inp.Lq, inp.Lk, opts) if need_grad else 0
        )
        return None, None, pred, pred
    if opts.chunk_size is not None:
        f = opts.chunk_size
        if inp.device.type == "mps" and inp.B * inp.Hq * min(f[0], inp.Lq) * min(f[1], inp.Lk) >= MPS_MAX_MATMUL_ELEMENTS:
            raise ArgumentError(
                f"chunk_size={f} makes score tiles of {inp.B * inp.Hq * min(f[0], inp.Lq) * min(f[1], inp.Lk)} elements; "
                f"on MPS every matmul must stay below {MPS_MAX_MATMUL_ELEMENTS} (larger ones error or corrupt results)."
            )
        pred = max(backend.forward_bytes(inp, *f, need_lse), inp.lse_bytes() + bwd(f) if need_grad else 0)
        return f, f, pred, pred
    options = _tile_options(inp, backend)
    fwd = next((p for p in options if backend.forward_bytes(inp, *p, need_lse) <= budget), None)
    if fwd is None:
        smallest = backend.forward_bytes(inp, *options[-1], need_lse) + bwd(options[-1])
        return None, None, smallest, smallest
    fwd_pred = backend.forward_bytes(inp, *fwd, need_lse)
    if not need_grad:
        return fwd, None, fwd_pred, 0
    # Forward-saved state (the lse) stays alive during the backward: both share the budget.
    saved = inp.lse_bytes()
    # The backward may run on another kernel (a learnable mask takes the matmul tiles): its tiles
    # follow that kernel's own preferences.
    bwd_options = options if bwd_backend is backend else _tile_options(inp, bwd_backend)
    bwd_tiles = next((p for p in bwd_options if saved + bwd(p) <= budget), None)
    if bwd_tiles is None:
        smallest = max(backend.forward_bytes(inp, *options[-1], need_lse), saved + bwd(bwd_options[-1]))
        return None, None, smallest, smallest
    return fwd, bwd_tiles, max(fwd_pred, saved + bwd(bwd_tiles)), 0


def make_plan(
    inp: Inputs,
    opts: Options,
    budget: int,
    backend: str = "auto",
    estimate_time: bool = False,
) -> Plan:
    """Choose the path and tiles for a call. Raises :class:`MemoryBudgetError` if nothing fits.

    A forced ``chunk_size`` must fit the budget too (the budget is a promise): if its tiles
    are predicted to need more, this raises :class:`MemoryBudgetError` instead of running them.
    ``estimate_time`` fills ``predicted_seconds`` (always filled for calls of many tiles).
    """
    need_grad = inp.requires_grad or opts.captured_requires_grad
    need_lse = opts.return_lse or need_grad
    names = priority(inp.device) if backend == "auto" else [backend]
    rejected: Dict[str, List[str]] = {}
    smallest_overall: Optional[int] = None
    for name in names:
        b = BACKENDS[name]
        reasons = b.not_supported_reasons(inp, opts)
        if reasons:
            rejected[name] = reasons
            continue
        fwd, bwd_tiles, pred, smallest = _fit(inp, b, opts, budget, need_grad, need_lse)
        if pred > budget or (b.tiled and fwd is None):
            if opts.chunk_size is not None and b.tiled:
                tiles = f"chunk_size={opts.chunk_size} needs"
            else:
                tiles = "its smallest tiles need" if b.tiled else "needs"
            rejected[name] = [f"{tiles} ≈{format_bytes(smallest)}, the budget is {format_bytes(budget)}"]
            smallest_overall = smallest if smallest_overall is None else min(smallest_overall, smallest)
            continue
        plan = Plan(
            backend=name,
            chunk_size=fwd,
            predicted_peak_bytes=int(pred),
            budget_bytes=budget,
            rejected=rejected,
            backward_backend=b.backward_kernel(inp, opts) if need_grad else None,
            backward_chunk_size=bwd_tiles,
            shape=describe(inp),
        )
        if fwd is not None and fwd[1] >= inp.Lk and fwd[0] < inp.Lq:
            plan.notes.append("whole key rows per block (no kv chunking)")
        if inp.n_groups > 1:
            plan.notes.append(
                f"batch broadcasting runs as {inp.n_groups} groups of {inp.B} (one group's tiles at a time)"
            )
        plan.tiles = count_tiles(inp, fwd, bwd_tiles if need_grad else None)
        if estimate_time or plan.tiles >= ESTIMATE_TIME_FROM_TILES:
            plan.predicted_seconds = predict_seconds(inp, plan.tiles, need_grad)
        if backend == "auto":
            for later in names[names.index(name) + 1 :]:
                plan.rejected.setdefault(later, ["slower path; the one above fits"])
        return plan
    if smallest_overall is not None:
        if opts.chunk_size is not None:
            raise MemoryBudgetError(
                f"chunk_size={opts.chunk_size} does not fit memory_budget={format_bytes(budget)} for {describe(inp)}: "
                f"those tiles need ≈{format_bytes(smallest_overall)}; pass a smaller chunk_size, chunk_size=None "
                f"(the planner picks tiles that fit), or memory_budget of at least {smallest_overall} bytes."
                + "".join(f"\n  {n}: {'; '.join(r)}" for n, r in rejected.items())
            )
        raise MemoryBudgetError(
            f"memory_budget={format_bytes(budget)} is too small for {describe(inp)}: the smallest tiles "
            f"need ≈{format_bytes(smallest_overall)}; pass memory_budget of at least {smallest_overall} bytes."
            + "".join(f"\n  {n}: {'; '.join(r)}" for n, r in rejected.items())
        )
    raise NotImplementedError(
        f"backend={backend!r} cannot run {describe(inp)}:"
        + "".join(f"\n  {n}: {'; '.join(r)}" for n, r in rejected.items())
    )


ESTIMATE_TIME_FROM_TILES = 4096
"""Plans with at least this many tiles get a time estimate (long calls log their progress)."""

# Python and launch overhead of one tile, a rough constant per device type.
_TILE_OVERHEAD_S = {"cpu": 30e-6, "cuda": 40e-6, "mps": 80e-6}
_RATES: Dict[str, Tuple[float, float]] = {}  # device type -> (matmul FLOP/s, seconds per score element)


def visible_fraction(inp: Inputs) -> float:
    """The fraction of the ``Lq x Lk`` scores a causal mask leaves visible (1 without one)."""
    if not inp.is_causal or inp.Lq == 0 or inp.Lk == 0:
        return 1.0
    Lq, Lk, o = inp.Lq, inp.Lk, inp.causal_offset
    # Row i sees min(max(i + o + 1, 0), Lk) keys: zero below r0, all of them from r2 on.
    r0 = min(max(-o, 0), Lq)
    r2 = min(max(Lk - o - 1, r0), Lq)
    n = r2 - r0
    seen = n * (o + 1) + (r0 + r2 - 1) * n / 2 + (Lq - r2) * Lk
    return max(0.0, seen / (Lq * Lk))


def count_tiles(inp: Inputs, fwd: Optional[Tuple[int, int]], bwd: Optional[Tuple[int, int]]) -> int:
    """Kernel calls of the plan, forward and backward (causal tiles above the diagonal not counted)."""
    frac = visible_fraction(inp)
    n = 0
    for tiles in (fwd, bwd):
        if tiles is None:
            continue
        nq = -(-max(inp.Lq, 1) // tiles[0])
        nk = -(-max(inp.Lk, 1) // tiles[1])
        n += max(1, math.ceil(nq * nk * frac) + (min(nq, nk) if inp.is_causal else 0))
    return max(n, 1)


def _device_rates(device: torch.device) -> Tuple[float, float]:
    """Matmul FLOP/s and the time of the softmax work per score element, measured once per process.

    The second term dominates at small head dims (E = 8: 0.67 ns per score on the 2-core CPU,
    against 0.2 ns of matmul), the first at large ones.
    """
    key = device.type
    if key not in _RATES:
        try:
            _RATES[key] = _measure_rates(device)
        except Exception:  # a device that cannot run the probe: conservative guesses
            _RATES[key] = (5e10, 2e-9)
    return _RATES[key]


def _measure_rates(device: torch.device) -> Tuple[float, float]:
    a = torch.randn(8, 256, 64, device=device)
    b = torch.randn(8, 64, 256, device=device)
    s = torch.empty(8, 256, 256, device=device)
    sync = {"cuda": torch.cuda.synchronize, "mps": getattr(getattr(torch, "mps", None), "synchronize", None)}.get(device.type)

    def best_of(fn: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(3):
            if sync:
                sync()
            t0 = time.perf_counter()
            fn()
            if sync:
                sync()
            best = min(best, time.perf_counter() - t0)
        return max(best, 1e-9)

    matmul = best_of(lambda: torch.bmm(a, b, out=s))
    softmax = best_of(lambda: s.sub_(s.amax(dim=-1, keepdim=True)).exp_().sum(dim=-1))
    return 2 * 8 * 256 * 256 * 64 / matmul, softmax / s.numel()


def predict_seconds(inp: Inputs, tiles: int, need_grad: bool) -> float:
    """An order-of-magnitude estimate of a call's time: FLOPs at the device's matmul rate, the
    softmax work per score, and a per-tile overhead."""
    rate, per_score = _device_rates(inp.device)
    scores = float(inp.B * inp.Hq * inp.Lq * inp.Lk) * visible_fraction(inp) * inp.n_groups
    t = 2.0 * scores * (inp.E + inp.Ev) / rate + scores * per_score
    if need_grad:
        t *= 3.5
    return t + tiles * inp.n_groups * _TILE_OVERHEAD_S.get(inp.device.type, 50e-6)


def matmul_backward_tiles(inp: Inputs, budget: int) -> Tuple[int, int]:
    """Tiles for the matmul backward alone (used when a fused backward cannot run after all)."""
    backend = BACKENDS["matmul"]
    saved = inp.lse_bytes()
    options = _tile_options(inp, backend)
    return next((p for p in options if saved + backend.backward_bytes(inp, *p, Options()) <= budget), options[-1])


def describe(inp: Inputs) -> str:
    heads = f"{inp.Hq}" if inp.G == 1 else f"{inp.Hq}q/{inp.Hk}kv"
    ev = f", Ev={inp.Ev}" if inp.Ev != inp.E else ""
    extras = []
    if inp.attn_mask is not None:
        extras.append(f"{inp.mask_kind} mask {tuple(inp.attn_mask.shape)}")
    if inp.is_causal:
        extras.append("causal" if inp.causal_offset == 0 else f"causal (bottom-right, offset {inp.causal_offset})")
    if inp.score_mod is not None:
        extras.append("score_mod")
    if inp.mask_mod is not None:
        extras.append("mask_mod")
    if inp.dropout_p > 0:
        extras.append(f"dropout {inp.dropout_p}")
    tail = (", " + ", ".join(extras)) if extras else ""
    dt = str(inp.dtype).replace("torch.", "")
    return f"B={inp.B} H={heads} Lq={inp.Lq} Lk={inp.Lk} E={inp.E}{ev} {dt} on {inp.device.type}{tail}"


def halve(chunk: Optional[Tuple[int, int]], inp: Inputs) -> Tuple[int, int]:
    """Tiles half the size (along the longer side first), for the out-of-memory retry."""
    if chunk is None:
        chunk = (max(inp.Lq, 1), max(inp.Lk, 1))
    qc, kc = min(chunk[0], max(inp.Lq, 1)), min(chunk[1], max(inp.Lk, 1))
    if inp.is_causal:
        side = max(1, min(qc, kc) // 2)
        return side, side
    return (max(1, qc // 2), kc) if qc >= kc or kc <= 16 else (qc, max(1, kc // 2))

