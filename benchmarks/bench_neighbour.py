"""How much a neighbour's memory traffic slows subquad's tiles and the fused kernel (issue 29).

    python benchmarks/bench_neighbour.py [--reps 6] [--length 2048] [--native] [--json out.json]

Issue 29 asks the bfloat16 tiles to vary by at most 1.3x over fresh processes, and says why they
vary: the tile loop streams megabytes of scores through the shared cache, so another process's
memory traffic shows in it. On a shared VM that spread cannot be told apart from the machine's,
so this measures the cause directly. Each measurement is a fresh process pinned to CPU 0 with
one thread (bfloat16 forward 1 x 8 x L x 64, ``backend="matmul"`` or ``"fused"``, the planner's
tiles, median of 5 calls after a warm-up), once with the other CPUs idle and once while a process
pinned to CPU 1 copies a 256 MiB buffer into another in a loop (a neighbour streaming memory).
The backends alternate; the figure is, per pair, the time with the neighbour over the time
without; the script prints every pair and the medians. ``--native`` adds the tiles with the native
kernel (``matmul+native``, ``SUBQUAD_NATIVE=auto``: build it first with ``subquad build``); the
plain ``matmul`` runs then with ``SUBQUAD_NATIVE=off``.

Linux only (``os.sched_setaffinity``), two CPUs or more; run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

BACKENDS = ("matmul", "fused", "matmul+native")
MEASURED_CPU, NEIGHBOUR_CPU = 0, 1


def _measure(backend: str, length: int) -> None:
    """One measurement, in this (fresh) process: prints the median milliseconds."""
    os.sched_setaffinity(0, {MEASURED_CPU})
    import torch

    import subquad
    from subquad import _native

    if backend == "matmul+native" and _native.tile_kernel() is None:
        sys.exit(f"matmul+native: the native kernel is not used: {_native.status()}")
    backend = backend.split("+")[0]

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, length, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    subquad.attention(q, k, v, backend=backend)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        subquad.attention(q, k, v, backend=backend)
        times.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps(statistics.median(times)))


def _stream_memory() -> None:
    """The neighbour: copies 256 MiB into another buffer until it is killed."""
    os.sched_setaffinity(0, {NEIGHBOUR_CPU})
    import torch

    torch.set_num_threads(1)
    a = torch.ones(64 << 20)
    b = torch.empty_like(a)
    while True:
        b.copy_(a)


def _child(*args: str) -> List[str]:
    return [sys.executable, os.path.abspath(__file__), *args]


def _timed(backend: str, length: int, native: bool) -> float:
    env = dict(os.environ)
    if native:  # matmul without the kernel, matmul+native with it
        env["SUBQUAD_NATIVE"] = "auto" if backend == "matmul+native" else "off"
    r = subprocess.run(
        _child("--measure", backend, "--length", str(length)), capture_output=True, text=True, check=True, env=env
    )
    return float(r.stdout.strip().splitlines()[-1])


def _with_neighbour(backend: str, length: int, native: bool) -> float:
    hog = subprocess.Popen(_child("--stream"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # the neighbour's buffers allocated and streaming
        return _timed(backend, length, native)
    finally:
        hog.kill()
        hog.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--native", action="store_true", help="also the tiles with the native kernel (subquad build)")
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    ap.add_argument("--measure", choices=BACKENDS, help=argparse.SUPPRESS)
    ap.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        _measure(args.measure, args.length)
        return
    if args.stream:
        _stream_memory()
        return
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs Linux and two CPUs: one measured, one for the neighbour")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _harness import machine

    backends = BACKENDS if args.native else BACKENDS[:2]
    pairs: Dict[str, List[Dict[str, float]]] = {b: [] for b in backends}
    print(f"# {machine()}")
    print(f"bfloat16 forward 1x8x{args.length}x64, one thread on CPU {MEASURED_CPU}; ms alone / with a neighbour")
    for rep in range(args.reps):
        for backend in backends if rep % 2 == 0 else backends[::-1]:
            alone = _timed(backend, args.length, args.native)
            loaded = _with_neighbour(backend, args.length, args.native)
            pairs[backend].append({"alone_ms": alone, "neighbour_ms": loaded, "ratio": loaded / alone})
            print(f"  {backend:<13} {alone:7.1f} / {loaded:7.1f}  = {loaded / alone:.2f}")
    summary = {}
    for backend, ps in pairs.items():
        ratios = [p["ratio"] for p in ps]
        alone = [p["alone_ms"] for p in ps]
        summary[backend] = {
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "alone_spread": max(alone) / min(alone),
        }
        print(
            f"{backend:<13} with a neighbour / alone: median {statistics.median(ratios):.2f} "
            f"[{min(ratios):.2f}-{max(ratios):.2f}]; alone, slowest / fastest process {max(alone) / min(alone):.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "length": args.length, "pairs": pairs, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
