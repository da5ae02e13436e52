"""The calibration's measurement: one interleaved round of the loops and the fused kernel on a
shape, as whole calls of :func:`subquad.attention` (:mod:`subquad._backends.calibration` keeps
the table and asks for this on first need)."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Tuple

import torch

from . import mods
from ._api import attention
from ._backends import calibration

MIN_SECONDS = 0.01
"""Each candidate's time in a round is the mean of as many calls as take this long together."""


def _seconds(run: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    run()
    once = time.perf_counter() - t0
    n = max(1, int(MIN_SECONDS / max(once, 1e-6)))
    if n == 1:
        return once
    t0 = time.perf_counter()
    for _ in range(n):
        run()
    return (time.perf_counter() - t0) / n


def measure(dtype: torch.dtype, training: bool, shape: calibration.Shape, kind: str) -> Tuple[float, float]:
    """``(loops seconds, fused seconds)`` of one round on ``shape`` = ``(B·H, Lq, Lk, E)``; the
    ``mods`` kind is causal with ALiBi (:func:`subquad.mods.alibi`)."""
    bh, lq, lk, e = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, bh, lq, e, generator=g).to(dtype)
    k, v = (torch.randn(1, bh, lk, e, generator=g).to(dtype) for _ in range(2))
    if training:
        q, k, v = (t.requires_grad_() for t in (q, k, v))

    extra: Dict[str, Any] = {}
    if kind == "mods":
        extra = dict(is_causal=True, score_mod=mods.alibi(bh))

    def run(backend: str) -> Callable[[], object]:
        def call() -> object:
            with torch.enable_grad() if training else torch.no_grad():
                out = attention(q, k, v, backend=backend, **extra)
                assert isinstance(out, torch.Tensor)  # no return_lse
                if training:
                    out.backward(torch.ones_like(out))
            return out

        return call

    loops = _seconds(run("matmul"))
    fused = _seconds(run("fused"))
    return loops, fused


calibration.MEASURE = measure
