"""The time model: an order-of-magnitude estimate of a call's time, for ``explain()`` and the
progress log of long calls.

Per device and dtype the process measures a GEMM rate and the softmax work per score (a small
probe), and on CPU each tiled backend's own time per score and per query row (a row block of
the probe's shape); CUDA times torch's SDPA itself. A plan's forward is its computed scores at
those rates, the backward a factor of its forward, a ``score_mod`` its own measured time per
score, and each tile a host overhead. Figures are measured again later in the process, keeping
the faster (:mod:`subquad._probes`), so a probe made while the machine was busy does not stay.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Protocol, Tuple

import torch
from torch import Tensor
from torch.utils import _python_dispatch

from . import _probes as probes
from ._backends import BACKENDS, triton_passes
from ._backends.dispatch import LOOP_ROWS, loop_band, loop_ranges, loops_backward, loops_forward
from ._backends.offsets import LOG2E, exp_
from ._backends.products import native_bf16_products, product, widening_products
from ._callbacks import apply_score_mod
from ._inputs import Inputs
from ._tiles import NEG_INF, Segment
from ._traced import per_callback


class PlanLike(Protocol):
    """What the time model reads of a plan (:class:`subquad._planner.Plan`)."""

    backend: str
    chunk_size: Optional[Tuple[int, int]]
    backward_backend: Optional[str]
    backward_chunk_size: Optional[Tuple[int, int]]
    tiles: int


# Python and launch overhead of one tile, a rough constant per device type.
_TILE_OVERHEAD_S = {"cpu": 30e-6, "cuda": 40e-6, "mps": 80e-6}
_RATES: Dict[Tuple[str, torch.dtype], Tuple[float, float]] = {}
"""(device type, dtype) -> (matmul FLOP/s, seconds of softmax work per score), measured once per process."""


def _runs_loops(backend: str, inp: Inputs, *, backward: bool = False) -> bool:
    """Whether ``backend`` runs this call's forward (``backward``: its backward) in the C++ loops
    (``loops``, and ``matmul`` wherever they take the call)."""
    return backend in ("loops", "matmul") and (loops_backward(inp) if backward else loops_forward(inp))


def _parts(inp: Inputs) -> List[Tuple[int, int, int]]:
    """``(Lq, Lk, causal offset)`` of what one batch group of the call computes: the call, or the
    sequences of a packed call (each with its own lengths and alignment)."""
    p = inp.packed
    if p is None:
        return [(inp.Lq, inp.Lk, inp.causal_offset)]
    return [
        (qe - qs, ke - ks, inp.causal_offset + p.offset(s))
        for s in range(p.n)
        for qs, qe, ks, ke in [p.rows(s)]
        if qe > qs
    ]


def visible_fraction(Lq: int, Lk: int, is_causal: bool, o: int) -> float:
    """The fraction of the ``Lq x Lk`` scores a causal mask (query ``i`` sees keys ``<= i + o``)
    leaves visible (1 without one)."""
    if not is_causal or Lq == 0 or Lk == 0:
        return 1.0
    # Row i sees min(max(i + o + 1, 0), Lk) keys: zero below r0, all of them from r2 on.
    r0 = min(max(-o, 0), Lq)
    r2 = min(max(Lk - o - 1, r0), Lq)
    n = r2 - r0
    seen = n * (o + 1) + (r0 + r2 - 1) * n / 2 + (Lq - r2) * Lk
    return max(0.0, seen / (Lq * Lk))


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA and MPS queue it; the CPU runs it at once)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _device_rates(device: torch.device, dtype: torch.dtype) -> Tuple[float, float]:
    """Matmul FLOP/s and the time of the softmax work per score element, measured per process for
    each device type and dtype (half precision runs at several times float32's rate on GPUs,
    float64 at a fraction of it), and measured again later, keeping the faster (:mod:`_probes`).
    The second term dominates at small head dims, the first at large ones (docs/planner.md).
    """
    dtype = _rates_dtype(device, dtype)  # a device that cannot run the probe (float64 on MPS): guesses
    fast = lambda a, b: (max(a[0], b[0]), min(a[1], b[1]))  # noqa: E731
    return probes.lookup(_RATES, (device.type, dtype), lambda: _measure_rates(device, dtype), fast, (5e10, 2e-9))


def _rates_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype whose GEMMs a call of ``dtype`` runs. The CPU multiplies bfloat16 natively where
    it has AVX512-BF16 or AMX (the tiles and torch's CPU flash kernel then run bfloat16 GEMMs);
    otherwise, and for float16 (the tiles never run its GEMMs, the fused kernel runs them on
    float32 copies where they would be emulated), the products are float32: timing an emulated
    float16 bmm would mispredict the call and make the probe slow."""
    if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        return torch.bfloat16 if dtype == torch.bfloat16 and native_bf16_products() else torch.float32
    return dtype


# The probe is a tile's two products, (batch, rows, E) x (batch, E, keys) and the result times
# (batch, keys, E). On the CPU one of the matmul tiles' size (1M scores: its results leave the
# caches, as in the tile loop). A GPU finishes that in less than a launch: there the probe is large
# enough to time the arithmetic (8.6 GFLOP; 64 MiB of float32 scores), repeated between two syncs
# until a run takes _GPU_PROBE_S.
_CPU_PROBE_SHAPE = (8, 256, 512, 64)
_GPU_PROBE_SHAPE = (4, 2048, 2048, 128)
_GPU_PROBE_S = 2e-3
_MAX_REPS = 1024


def _measure_rates(device: torch.device, dtype: torch.dtype) -> Tuple[float, float]:
    # Outside any dispatch mode the caller may be in (a FakeTensorMode would time ops that do
    # nothing, and the rates are kept for the process; an op recorder would record the probe).
    with _python_dispatch._disable_current_modes():
        return _probe(device, dtype)


def _probe(device: torch.device, dtype: torch.dtype) -> Tuple[float, float]:
    bh, nq, nk, e = _CPU_PROBE_SHAPE if device.type == "cpu" else _GPU_PROBE_SHAPE
    a = torch.randn(bh, nq, e, device=device, dtype=dtype)
    b = torch.randn(bh, e, nk, device=device, dtype=dtype)
    v = torch.randn(bh, nk, e, device=device, dtype=dtype)
    s = torch.empty(bh, nq, nk, device=device, dtype=dtype)
    o = torch.empty(bh, nq, e, device=device, dtype=dtype)
    # Every path keeps half-precision scores in float32 for the softmax (the tiles convert the
    # products' results, the fused kernels accumulate in float32): time the softmax work there.
    # On the CPU (the only device whose tiles run half-precision products) that includes the two
    # conversions of such a tile: the scores in, the probabilities out.
    # On CUDA, where half-precision tiles run their softmax passes in Triton, time that kernel.
    half = dtype in (torch.float16, torch.bfloat16)
    convert = half and device.type == "cpu"
    triton = half and device.type == "cuda" and triton_passes.available()
    p = s.float() if half else s
    min_s = 0.0 if device.type == "cpu" else _GPU_PROBE_S
    if triton:  # the kernel's row statistics and accumulator
        m, l, acc = (torch.zeros(bh * nq, *extra, device=device) for extra in ((), (), (e,)))

    def sync() -> None:
        synchronize(device)

    def softmax() -> None:
        if triton:
            triton_passes.softmax_rows(p, s, m.fill_(NEG_INF), l, acc, LOG2E)
            return
        if convert:
            p.copy_(s)
        exp_(p.sub_(p.amax(dim=-1, keepdim=True))).sum(dim=-1)
        if convert:
            s.copy_(p)

    wide = half and widening_products(device)  # as the tiles multiply there: float32 results
    o_wide = o.float() if wide else o

    def products() -> None:  # a tile's two: the scores, and the probabilities times v
        product(a, b, p if wide else s)
        product(s, v, o_wide)

    matmul = seconds_per_call(products, sync, min_seconds=min_s)
    per_score = seconds_per_call(softmax, sync, min_seconds=min_s) / p.numel()
    return 4 * bh * nq * nk * e / matmul, per_score


def seconds_per_call(
    fn: Callable[[], object],
    sync: Callable[[], None],
    *,
    min_seconds: float,
    clock: Optional[Callable[[], float]] = None,
) -> float:
    """The time of one call of ``fn``: the best of three runs of ``reps`` calls between two syncs,
    ``reps`` doubled until a run takes ``min_seconds``.

    One call between two syncs measures the launch and the sync as much as the work: on a GPU
    calls queue up, so back-to-back calls time the work and the sync is paid once per run.
    """

    now = clock or time.perf_counter

    def run(reps: int) -> float:
        sync()
        t0 = now()
        for _ in range(reps):
            fn()
        sync()
        return now() - t0

    run(1)  # the first call pays for handles, kernel choice and compiling
    reps = 1
    t = run(reps)
    while t < min_seconds and reps < _MAX_REPS:
        reps *= 2
        t = run(reps)
    best = min(t, run(reps), run(reps))
    return max(best / reps, 1e-12)


def predict_seconds(inp: Inputs, plan: PlanLike, need_grad: bool) -> float:
    """An estimate of a call's time: each backend's forward (:func:`forward_seconds`), the backward
    :func:`backward_per_forward` times its backend's forward, a ``score_mod``'s time, and a
    per-tile overhead."""
    t = forward_seconds(inp, plan.backend, plan.chunk_size)
    if need_grad:
        bwd = plan.backward_backend or plan.backend
        tiles = plan.backward_chunk_size if plan.backward_backend else plan.chunk_size
        t += backward_per_forward(inp, bwd) * forward_seconds(inp, bwd, tiles)
        if _runs_loops(bwd, inp, backward=True):
            t += loop_backward_fixed_seconds(inp)
    # The C++ loops evaluate the callbacks they take (a soft cap, ALiBi, windows) inside their own
    # rates; elsewhere a callback costs its own time per score, per pass.
    in_loop = _runs_loops(plan.backend, inp)
    passes = 0 if in_loop else 1
    if need_grad and not (in_loop and _runs_loops(plan.backward_backend or plan.backend, inp, backward=True)):
        passes += CALLBACK_PASSES_WITH_GRAD - 1
    if passes:
        t += computed_scores(inp, None, None) * score_mod_seconds(inp) * passes
    host = plan.tiles * inp.n_groups * _TILE_OVERHEAD_S.get(inp.device_type, 50e-6)
    if inp.device_type in _CALL_HOST_S and BACKENDS[plan.backend].tiled:  # Python overlaps the GPU's work
        fwd_s, bwd_s = _CALL_HOST_S[inp.device_type]
        return max(t, host + fwd_s + (bwd_s if need_grad else 0.0))
    return t + host


_CALL_HOST_S = {"cuda": (1.2e-3, 2.3e-3)}
"""Python's time per call of the tiles on a device that queues work, forward and backward: the
device works meanwhile, so a call takes the longer of the two (measured on a GPU's host:
docs/benchmarks/gpu.md)."""


def forward_seconds(inp: Inputs, backend: str, tiles: Optional[Tuple[int, int]]) -> float:
    """A forward of ``backend`` on ``tiles``: the scores it computes (:func:`computed_scores`) at
    the model's time per score (the call's products at the device's matmul rate for its dtype,
    and the softmax work per score) or, where the backend was timed (:func:`backend_seconds`), at
    its own time per score scaled by the model from the probe's head dim to the call's, plus its
    own time per query row."""
    rate, per_score = _device_rates(inp.device, inp.dtype)
    model = 2.0 * (inp.E + inp.Ev) / rate + per_score
    scores = computed_scores(inp, backend, tiles)
    own = backend_seconds(inp.device, inp.dtype, backend)
    if own is None:
        return model * scores
    e = _CPU_PROBE_SHAPE[3]  # every backend probe's head dim
    rows = inp.n_groups * inp.B * inp.Hq * sum(Lq for Lq, _, _ in _parts(inp))
    return own[0] * model / (4.0 * e / rate + per_score) * scores + own[1] * rows


BACKWARD_PER_FORWARD = 2.5
"""A backward's time over its forward's, same backend (measured: docs/planner.md, "The time
model's constants")."""
BF16_CPU_BACKWARD_PER_FORWARD = 2.0
"""The same for bfloat16 on a CPU (docs/planner.md)."""
LOOP_BACKWARD_PER_FORWARD = 2.5
"""The same for the tiles' C++ loops (:mod:`subquad._backends.segments`), whose forward is the
faster of the two (docs/planner.md)."""


def backward_per_forward(inp: Inputs, backend: str = "matmul") -> float:
    """A backward's time over its forward's on ``backend``: :data:`LOOP_BACKWARD_PER_FORWARD` where
    the tiles' C++ loops run both, :data:`BF16_CPU_BACKWARD_PER_FORWARD` for other bfloat16 calls
    on a CPU, else :data:`BACKWARD_PER_FORWARD`."""
    if _runs_loops(backend, inp, backward=True):
        return LOOP_BACKWARD_PER_FORWARD
    if inp.device_type == "cpu" and inp.dtype == torch.bfloat16:
        return BF16_CPU_BACKWARD_PER_FORWARD
    return BACKWARD_PER_FORWARD


LOOP_BACKWARD_ROW_PASSES = (6, 5, 1)
"""The loops' backward's passes over each query row that do not shrink with the band, in columns
of ``(Ev, E, E if half precision)``: D from dO and O in float32 (two conversions, their product,
its sum: 4 Ev), dO packed twice for its products (2 Ev); dQ's float32 gradient zeroed, its block
zeroed and added in per row block, q packed twice (5 E); dQ cast to the input's dtype
(:func:`subquad._backends.segments.backward_rows`, ``backward_segment`` in ``_native_tiles.cpp``)."""
LOOP_BACKWARD_KEY_PASSES = (4, 5, 1)
"""The same per key, in columns of ``(Ev, E, E + Ev if half precision)``: dK's and dV's float32
gradients zeroed, each task's accumulators zeroed and added in (3 E + 3 Ev), the keys laid out
for two products and the values for one (2 E + Ev), dK and dV cast to the input's dtype."""
_PROBE_WRITES = {True: 4, False: 2}
"""The rate probe's softmax passes that write the tile, per half-precision probe: the conversion
in, the subtraction, the exponential and the conversion out (float32: the middle two)."""


def loop_backward_fixed_seconds(inp: Inputs) -> float:
    """The loops' backward's work that does not shrink with the band: per query row and per key,
    the passes over their columns of :data:`LOOP_BACKWARD_ROW_PASSES` and
    :data:`LOOP_BACKWARD_KEY_PASSES`, each element at what one written element of the rate
    probe's softmax passes costs (its time per score over :data:`_PROBE_WRITES`). It matters where
    a band or documents leave few scores per row (measured: docs/benchmarks/loops.md)."""
    _, per_score = _device_rates(inp.device, inp.dtype)
    probe_half = _rates_dtype(inp.device, inp.dtype) in (torch.float16, torch.bfloat16)
    per_element = per_score / _PROBE_WRITES[probe_half]
    half = inp.dtype in (torch.float16, torch.bfloat16)
    r_ev, r_e, r_half = LOOP_BACKWARD_ROW_PASSES
    k_ev, k_e, k_half = LOOP_BACKWARD_KEY_PASSES
    per_row = r_ev * inp.Ev + r_e * inp.E + (r_half * inp.E if half else 0)
    per_key = k_ev * inp.Ev + k_e * inp.E + (k_half * (inp.E + inp.Ev) if half else 0)
    parts = _parts(inp)
    rows = inp.n_groups * inp.B * inp.Hq * sum(Lq for Lq, _, _ in parts)
    keys = inp.n_groups * inp.B * inp.Hk * sum(Lk for _, Lk, _ in parts)
    return per_element * (rows * per_row + keys * per_key)


def computed_scores(inp: Inputs, backend: Optional[str], tiles: Optional[Tuple[int, int]]) -> float:
    """The scores ``backend`` computes on ``tiles``: every visible one and, under a causal mask,
    the hidden ones that share a block with a visible one (:meth:`Backend.computed_blocks`; the C++
    loops: per block of 128 rows, the keys of its visible band, in blocks of 32);
    ``backend=None``: the visible ones."""
    n = 0.0
    band = loop_band(inp) if backend is not None and _runs_loops(backend, inp) else None
    ranges = loop_ranges(inp) if band is not None else None
    for Lq, Lk, o in _parts(inp):
        if ranges is not None and ranges.shape[1] == Lq:
            n += float(Lq * Lk) * ranges_fraction(Lk, band or (None, None), ranges, LOOP_ROWS, 32)
            continue
        if band is not None and band != (None, None):
            n += float(Lq * Lk) * band_fraction(Lq, Lk, band, LOOP_ROWS, 32)
            continue
        blocks = BACKENDS[backend].computed_blocks(Lq, Lk, tiles) if backend and inp.is_causal else None
        frac = visible_fraction(Lq, Lk, inp.is_causal, o) if blocks is None else block_fraction(Lq, Lk, o, blocks)
        n += float(Lq * Lk) * frac
    return inp.n_groups * inp.B * inp.Hq * n


def band_fraction(Lq: int, Lk: int, band: Tuple[Optional[int], Optional[int]], rows: int, keys: int) -> float:
    """The fraction of the ``Lq x Lk`` scores the C++ loops compute for a band (query ``i`` sees key
    ``j`` where ``lo <= i - j <= hi``; ``None``: open): per block of ``rows``, from the block of
    ``keys`` holding its first row's first visible key to its last row's last visible key."""
    lo, hi = band
    if Lq == 0 or Lk == 0:
        return 1.0
    seen = 0
    for qs in range(0, Lq, rows):
        qe = min(qs + rows, Lq)
        first = 0 if hi is None else max(0, qs - hi)
        last = Lk - 1 if lo is None else min(Lk - 1, qe - 1 - lo)
        if last >= first:
            seen += (qe - qs) * (min(Lk, (last // keys + 1) * keys) - (first // keys) * keys)
    return seen / (Lq * Lk)


def ranges_fraction(Lk: int, band: Tuple[Optional[int], Optional[int]], ranges: Tensor, rows: int, keys: int) -> float:
    """:func:`band_fraction` where each query row also sees only its range of keys (``ranges``:
    ``(1 or B, Lq, 2)`` ``[first, end)``): per block of ``rows``, from the block of ``keys`` holding
    the first key any of its rows sees to the last, averaged over the batch."""
    Bq, Lq = ranges.shape[0], ranges.shape[1]
    if Lq == 0 or Lk == 0:
        return 1.0
    lo, hi = band
    seen = 0
    for qs in range(0, Lq, rows):
        qe = min(qs + rows, Lq)
        block = ranges[:, qs:qe]
        empty = block[..., 1] <= block[..., 0]
        first = block[..., 0].masked_fill(empty, Lk).amin(dim=1).clamp(0, Lk)
        end = block[..., 1].masked_fill(empty, 0).amax(dim=1).clamp(0, Lk)
        if hi is not None:
            first = first.clamp(min=max(0, qs - hi))
        if lo is not None:
            end = end.clamp(max=max(0, min(Lk, qe - lo)))
        span = (torch.minimum(torch.full_like(end, Lk), (end + keys - 1) // keys * keys) - first // keys * keys).clamp(
            min=0
        )
        seen += int(span.sum()) * (qe - qs)
    return seen / (Bq * Lq * Lk)


def block_fraction(Lq: int, Lk: int, o: int, blocks: Tuple[int, int]) -> float:
    """The fraction of the ``Lq x Lk`` scores in ``blocks`` (rows, keys) that hold at least one
    score a causal mask (query ``i`` sees keys ``<= i + o``) leaves visible."""
    bq, bk = blocks
    if Lq == 0 or Lk == 0 or Lq > bq * 4096:  # many small blocks: the visible fraction itself
        return visible_fraction(Lq, Lk, True, o)
    seen = 0
    for qs in range(0, Lq, bq):
        qe = min(qs + bq, Lq)
        keys = min(max(qe + o, 0), Lk)  # the block's last row sees keys < qe + o
        seen += (qe - qs) * min(-(-keys // bk) * bk, Lk)
    return seen / (Lq * Lk)


_OWN: Dict[Tuple[str, torch.dtype, str], Optional[Tuple[float, float]]] = {}
"""(device type, dtype, backend) -> :func:`backend_seconds`, measured once per process."""
_TIMED_BACKENDS = ("fused", "matmul", "loops")


def backend_seconds(device: torch.device, dtype: torch.dtype, backend: str) -> Optional[Tuple[float, float]]:
    """A backend's own forward time ``(per score, per query row)`` on the CPU for the fused kernel
    and the tiles, timed on row blocks of the rate probe's shape (:func:`_measure_backend`), and
    on CUDA for torch's SDPA (:func:`_measure_whole`); ``None`` on other devices and for other
    backends: the model alone. Timed once per process, device type, dtype and backend.

    It captures what the model's GEMM rate and softmax passes miss: a kernel whose half precision
    runs at its float32 speed, the tiles' offset columns and conversions (docs/benchmarks/half.md),
    a row block's first tile costing more than the others (docs/planner.md)."""
    timed = _TIMED_BACKENDS if device.type == "cpu" else _GPU_TIMED_BACKENDS if device.type == "cuda" else ()
    if backend not in timed:
        return None

    def measure() -> Optional[Tuple[float, float]]:
        with _python_dispatch._disable_current_modes():
            return (_measure_backend if device.type == "cpu" else _measure_whole)(device, dtype, backend)

    def fast(a: Optional[Tuple[float, float]], b: Optional[Tuple[float, float]]) -> Optional[Tuple[float, float]]:
        return a if b is None else b if a is None else (min(a[0], b[0]), min(a[1], b[1]))

    return probes.lookup(_OWN, (device.type, dtype, backend), measure, fast, None)  # None: the model alone


_GPU_TIMED_BACKENDS = ("sdpa",)
"""Backends timed on CUDA: torch's fused kernels never hold the scores that the rate probe's
softmax passes stream, so the model alone predicted their calls several times too long
(docs/benchmarks/gpu.md)."""
_SDPA_PROBE_SHAPE = (16, 2048, 2048, 64)
"""A GPU's whole-input probe, ``(B*H, Lq, Lk, E)``: 67M scores, repeated between two syncs
(:data:`_GPU_PROBE_S`)."""


def _measure_whole(device: torch.device, dtype: torch.dtype, backend: str) -> Tuple[float, float]:
    """``(per score, 0)``: a whole-input backend's call of :data:`_SDPA_PROBE_SHAPE`, timed."""
    bh, nq, nk, e = _SDPA_PROBE_SHAPE
    q = torch.randn(1, bh, nq, e, device=device, dtype=dtype)
    k, v = (torch.randn(1, bh, nk, e, device=device, dtype=dtype) for _ in range(2))
    inp = Inputs(q, k, v, (1,), None, False, e**-0.5, 0.0)
    run = BACKENDS[backend]
    t = seconds_per_call(
        lambda: run.run_whole(inp, need_lse=False), lambda: synchronize(device), min_seconds=_GPU_PROBE_S
    )
    return t / (bh * nq * nk), 0.0


_BACKEND_PROBE_S = 0.02
"""Each of the three timed runs of a backend's probe repeats it until it takes this long: one call
alone varies between processes (docs/planner.md)."""


_PROBE_ROW_TILES = 4
"""The long probe's row block spans this many tiles of keys (the short one, one)."""
_LOOP_PROBE_SHAPE = (8, 1024, 512, 64)
"""The C++ loops' probe: a block of 1024 rows, its keys in one call, as the loops run
(docs/benchmarks/loops.md)."""
_FUSED_PROBE_SHAPE = (2, 1024, 512, 64)
"""The fused kernel's probe: as many scores as the tiles', in rows enough for the blocks of 256
rows torch's kernel takes from 768 rows on (it takes 64 below, slower per score)."""


def _measure_backend(device: torch.device, dtype: torch.dtype, backend: str) -> Tuple[float, float]:
    """``(per score, per query row)``: a row block of one tile of keys and one of
    :data:`_PROBE_ROW_TILES` tiles, timed; the difference is the time of the scores alone, the
    rest of the short one the row block's own (its state, its first tile's extra work: the tiles'
    half-precision offsets sampled and recomputed). Either timing alone mispredicts
    (docs/planner.md)."""
    bh, nq, nk, e = _FUSED_PROBE_SHAPE if backend == "fused" else _CPU_PROBE_SHAPE
    lk = nk * _PROBE_ROW_TILES
    q = torch.randn(1, bh, nq, e, device=device, dtype=dtype)
    k, v = (torch.randn(1, bh, lk, e, device=device, dtype=dtype) for _ in range(2))
    run = BACKENDS[backend]
    loop = _runs_loops(backend, Inputs(q, k, v, (1,), None, False, e**-0.5, 0.0))
    if loop:  # the C++ loops take whole rows (segments.TILE_TARGET): a block of their size
        bh, nq, nk, e = _LOOP_PROBE_SHAPE
        q = torch.randn(1, bh, nq, e, device=device, dtype=dtype)
        k, v = (torch.randn(1, bh, lk, e, device=device, dtype=dtype) for _ in range(2))

    def timed(keys: int) -> float:
        inp = Inputs(q, k[:, :, :keys], v[:, :, :keys], (1,), None, False, e**-0.5, 0.0)
        out = torch.empty_like(q)
        # The fused kernel and the loops take a row block's keys in one call.
        whole = backend == "fused" or loop
        segments = [Segment(0, keys)] if whole else [Segment(s, s + nk) for s in range(0, keys, nk)]
        with run.call_buffers():
            return seconds_per_call(
                lambda: run.forward_rows(inp, 0, nq, segments, out, 0), lambda: None, min_seconds=_BACKEND_PROBE_S
            )

    short, long = timed(nk), timed(lk)
    average = long / (bh * nq * lk)
    # The difference of two timings: held between half the long run's average and all of it.
    per_score = min(max((long - short) / (bh * nq * (lk - nk)), average / 2), average)
    return per_score, max(short - per_score * bh * nq * nk, 0.0) / (bh * nq)


CALLBACK_PASSES_WITH_GRAD = 2
"""A ``score_mod`` runs once per score in the forward and again, under autograd, in the backward
(with its pull-back) (measured: docs/planner.md)."""


def score_mod_seconds(inp: Inputs) -> float:
    """The time of the call's ``score_mod`` per score: timed once per callback, dtype and device
    (cached as its trace is) on a probe tile of up to 64k scores with the call's own index
    grids: a callback can cost several times the softmax work of the rates (docs/planner.md).

    0 without a ``score_mod``, for a call with no score to compute (an empty output or no key:
    the engine computes nothing), when the probe raises (the call itself will say why), and off
    the CPU (a GPU's elementwise work is a small part of a call; not measured there).
    """
    if inp.score_mod is None or inp.device.type != "cpu" or inp.empty or inp.Lk == 0:
        return 0.0
    return per_callback("cost", inp.score_mod, inp.dtype, inp.device, lambda: _time_score_mod(inp))


def _time_score_mod(inp: Inputs) -> float:
    kn = min(inp.Lk, 256)
    qn = min(inp.Lq, max(1, (1 << 16) // (inp.B * inp.Hq * kn)))
    with _python_dispatch._disable_current_modes(), torch.no_grad():
        scores = torch.randn((inp.B, inp.Hq, qn, kn), dtype=inp.stats_dtype, device=inp.device)
        try:
            seconds = seconds_per_call(
                lambda: apply_score_mod(inp, scores, 0, qn, 0, kn), lambda: None, min_seconds=1e-3
            )
        except Exception:  # the call itself reports a failing callback; its estimate does not
            return 0.0
    return seconds / scores.numel()
