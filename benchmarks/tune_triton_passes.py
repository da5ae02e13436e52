"""The CUDA tiles' Triton passes (subquad/_backends/triton_passes.py) on a GPU.

Each kernel alone over a sweep of its step (scores per loop step) and warps, on tiles of the
shapes that the tiles of SD 1.5 at 1024 px and a training step make, beside a plain
float32-to-half copy of the same tile (the memory bound); then three whole ``matmul`` calls with
the defaults and with the sweep's best, alternating. Writes ``tune.json`` (under ``$OUT`` if set).
docs/benchmarks/cuda-h200-tiles/tune-triton-passes.json came from it::

    python benchmarks/tune_triton_passes.py

Times: best of 3 runs of 10 calls between CUDA events (``bench_cuda.best_ms``). ``TUNE_QUICK=1
TRITON_INTERPRET=1`` runs it on tiny shapes on a CPU in Triton's interpreter: a check of the
program, not a measurement.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Dict, List, Tuple

import bench_cuda  # benchmarks/: its timing loop (CUDA events, or the clock off CUDA)
import torch

import subquad
from subquad._backends import triton_passes as tp

LOG2E = 1 / math.log(2)
QUICK = os.environ.get("TUNE_QUICK") == "1"
DEVICE = "cpu" if QUICK else "cuda"
SHAPES = [(4, 64), (8, 64), (4, 32)] if QUICK else [(32768, 4096), (65536, 4096), (131072, 2048), (8192, 16384)]
STEPS = (16, 32) if QUICK else (512, 1024, 2048)
CALLS = [
    ((1, 8, 4096, 64), torch.bfloat16, False),
    ((2, 8, 16384, 40), torch.float16, False),
    ((4, 16, 4096, 64), torch.bfloat16, True),
]
if QUICK:
    CALLS = [((1, 2, 64, 16), torch.bfloat16, True)]
bench_cuda.DEVICE = DEVICE
best_ms = bench_cuda.best_ms


def timed(fn: Callable[[], object]) -> Any:
    try:
        return best_ms(fn, 10)
    except Exception as exc:  # a configuration that does not compile is a result too
        return repr(exc)[:120]


def sweep(rows: int, n: int, results: Dict[str, Dict[str, Any]]) -> None:
    key = f"{rows}x{n}"
    s = torch.randn(rows, n, device=DEVICE) * 3
    p = torch.empty(rows, n, device=DEVICE, dtype=torch.bfloat16)
    m, l, acc = torch.empty(rows, device=DEVICE), torch.zeros(rows, device=DEVICE), torch.zeros(rows, 64, device=DEVICE)
    results["copy"][key] = timed(lambda: p.copy_(s))
    configs = [(c, w) for c in STEPS for w in (2, 4, 8) if c < n]
    configs += [(tp._pow2(n), w) for w in (4, 8, 16, 32) if n <= 8192]  # the whole row in one step
    for c, w in configs:
        results["fwd"][f"{key} cols={c} warps={w}"] = timed(
            lambda c=c, w=w: tp.softmax_rows(s, p, m.fill_(-math.inf), l, acc, LOG2E, cols=c, warps=w)
        )
    dp, d, ds = torch.randn(rows, n, device=DEVICE), torch.randn(rows, device=DEVICE), torch.empty_like(p)
    lse = s.amax(-1) + 1
    for c in (*STEPS, 4096):
        for w in (4, 8):
            if c <= max(n, STEPS[0]):
                results["bwd"][f"{key} cols={c} warps={w}"] = timed(
                    lambda c=c, w=w: tp.softmax_grad_rows(s, dp, p, ds, lse, d, 0.125, LOG2E, cols=c, warps=w)
                )
    print(
        json.dumps({k: {kk: vv for kk, vv in v.items() if kk.startswith(key)} for k, v in results.items()}), flush=True
    )


def pick(results: Dict[str, Dict[str, Any]], kind: str, n: int) -> Tuple[int, int]:
    """The configuration with the least time summed over the shapes whose rows hold ``n`` scores."""
    keys = [f"{r}x{nn}" for r, nn in SHAPES if nn == n]
    total: Dict[str, List[Any]] = {}
    for k, v in results[kind].items():
        shape, cfg = k.split(" ", 1)
        if shape in keys:
            total.setdefault(cfg, []).append(v)
    ok = {c: sum(v) for c, v in total.items() if len(v) == len(keys) and all(isinstance(x, float) for x in v)}
    best = min(ok, key=lambda c: ok[c])
    c, w = (int(x.split("=")[1]) for x in best.split())
    return c, w


def main() -> None:
    results: Dict[str, Dict[str, Any]] = {"fwd": {}, "bwd": {}, "copy": {}}
    for rows, n in SHAPES:
        sweep(rows, n, results)
        if not QUICK:
            torch.cuda.empty_cache()
    choice = {n: (pick(results, "fwd", n), pick(results, "bwd", n)) for _, n in SHAPES}
    print(json.dumps({"best": {str(n): v for n, v in choice.items()}}), flush=True)
    fwd, bwd = tp.softmax_rows, tp.softmax_grad_rows

    def tuned(s: Any, p: Any, m: Any, l: Any, acc: Any, unit: float, **_: Any) -> None:
        c, w = choice.get(s.shape[-1], ((0, 0), (0, 0)))[0]
        fwd(s, p, m, l, acc, unit, cols=c, warps=w)

    def tuned_grad(s: Any, dp: Any, p: Any, ds: Any, lse: Any, d: Any, scale: float, unit: float, **_: Any) -> None:
        c, w = choice.get(s.shape[-1], ((0, 0), (0, 0)))[1]
        bwd(s, dp, p, ds, lse, d, scale, unit, cols=c, warps=w)

    rows_out = []
    for shape, dt, train in CALLS:
        q, k, v = (torch.randn(shape, device=DEVICE, dtype=dt, requires_grad=train) for _ in range(3))
        grad = torch.randn_like(q)

        def run(q: Any = q, k: Any = k, v: Any = v, grad: Any = grad, train: bool = train) -> object:
            out = subquad.attention(q, k, v, backend="matmul")
            return torch.autograd.grad(out, (q, k, v), grad) if train else out

        row: Dict[str, Any] = {"shape": shape, "dtype": str(dt), "train": train}
        for order in (("default", "tuned"), ("tuned", "default")):
            for mode in order:
                tp.softmax_rows, tp.softmax_grad_rows = (tuned, tuned_grad) if mode == "tuned" else (fwd, bwd)
                row.setdefault(mode, []).append(round(best_ms(run, 5), 3))
        tp.softmax_rows, tp.softmax_grad_rows = fwd, bwd
        plan = subquad.explain(q, k, v, backend="matmul")
        row.update(predicted_ms=round(plan.predicted_seconds * 1e3, 3), tiles=plan.chunk_size)
        print(json.dumps(row), flush=True)
        rows_out.append(row)
        del q, k, v, run
    with open(os.path.join(os.environ.get("OUT", "."), "tune.json"), "w") as f:
        json.dump(dict(results=results, best={str(n): v for n, v in choice.items()}, calls=rows_out), f, indent=1)


if __name__ == "__main__":
    main()
