"""The calibration's measurement: one interleaved round of the loops and the fused kernel on a
shape, as whole calls of :func:`subquad.attention` (:mod:`subquad._backends.calibration` keeps
the table and asks for this on first need)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

from . import _native, mods
from ._api import attention
from ._backends import calibration

MIN_SECONDS = 0.02
"""Each candidate's time in a round is the median of its calls over at least this long."""
MIN_CALLS = 3
"""And of at least this many calls."""

_INPUTS: Dict[Tuple[Any, ...], Tuple[torch.Tensor, ...]] = {}
_ROUND: List[int] = [0]


def _seconds(run: Callable[[], object]) -> float:
    times: List[float] = []
    while len(times) < MIN_CALLS or sum(times) < MIN_SECONDS:
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _inputs(dtype: torch.dtype, training: bool, shape: calibration.Shape) -> Tuple[torch.Tensor, ...]:
    """The shape's query, key and value (made once: a round times the calls, not new memory)."""
    key = (dtype, training, shape)
    if key not in _INPUTS or _INPUTS[key][0].is_inference():
        _INPUTS.clear()  # one shape's tensors at a time
        bh, lq, lk, e = shape
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode(False):  # a first need inside the caller's inference_mode
            q = torch.randn(1, bh, lq, e, generator=g).to(dtype)
            k, v = (torch.randn(1, bh, lk, e, generator=g).to(dtype) for _ in range(2))
            _INPUTS[key] = tuple(t.requires_grad_(training) for t in (q, k, v))
    return _INPUTS[key]


def measure(dtype: torch.dtype, training: bool, shape: calibration.Shape, kind: str) -> Tuple[float, float]:
    """``(loops seconds, fused seconds)`` of one round on ``shape`` = ``(B·H, Lq, Lk, E)``; the
    ``mods`` kind is causal with ALiBi (:func:`subquad.mods.alibi`). The two alternate which
    goes first from round to round."""
    q, k, v = _inputs(dtype, training, shape)
    extra: Dict[str, Any] = {}
    if kind == "mods":
        extra = dict(is_causal=True, score_mod=mods.alibi(shape[0]))

    def run(backend: str) -> Callable[[], object]:
        def call() -> object:
            with torch.inference_mode(False), torch.enable_grad() if training else torch.no_grad():
                out = attention(q, k, v, backend=backend, **extra)
                assert isinstance(out, torch.Tensor)  # no return_lse
                if training:
                    out.backward(torch.ones_like(out))
                    for t in (q, k, v):
                        t.grad = None
            return out

        return call

    _ROUND[0] += 1
    if _ROUND[0] % 2:
        loops = _seconds(run("loops"))
        fused = _seconds(run("fused"))
    else:
        fused = _seconds(run("fused"))
        loops = _seconds(run("loops"))
    return loops, fused


def measure_products(which: str, shape: calibration.Shape) -> Tuple[float, float]:
    """``(ATen's seconds, own seconds)``: one round of the loops' forward on ``shape`` with each of
    their two ways to multiply (``backend="loops"``), alternating which
    goes first; the kernel's setting is restored after."""
    kernel = _native.tile_kernel()
    assert kernel is not None, "calibrate_products checks that the kernel is loaded"
    dtype = torch.bfloat16 if which == "bfloat16" else torch.float32
    q, k, v = _inputs(dtype, False, shape)
    was = kernel.products(which) == "aten"

    def timed(aten: bool) -> float:
        kernel.set_products(which, aten)
        with torch.inference_mode(False), torch.no_grad():
            return _seconds(lambda: attention(q, k, v, backend="loops"))

    _ROUND[0] += 1
    try:
        if _ROUND[0] % 2:
            aten = timed(True)
            own = timed(False)
        else:
            own = timed(False)
            aten = timed(True)
    finally:
        kernel.set_products(which, was)
    return aten, own


calibration.MEASURE = measure
calibration.MEASURE_PRODUCTS = measure_products
