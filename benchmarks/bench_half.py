"""Half precision through the tiles against the fused kernel and SDPA (issue 29).

    python benchmarks/bench_half.py [--rounds 5] [--processes 5] [--out docs/benchmarks/data/half/half-cpu.json]

- forward 1x8x4096x64 in float32, bfloat16 and float16: subquad's tiles (``backend="matmul"``),
  the fused CPU kernel (``backend="fused"``) and ``F.scaled_dot_product_attention``, in
  interleaved rounds (each round runs every implementation once, in a shuffled order), with
  ``explain()``'s predicted time beside each;
- the bfloat16 tiles in ``--processes`` fresh processes (median and best of 3 calls each):
  run-to-run spread, beside the fused kernel's in processes alternating with them (the machine's
  own spread), and each process's median over a float32 GEMM timed after each of its calls (the
  spread with the machine's speed in that process divided out);
- forward + backward with a soft-capping ``score_mod`` (tiles only), bfloat16, 1x4x2048x64, against
  the fused forward + backward without the callback;
- forward + backward 1x4x2048x64 in each dtype through the tiles, the fused kernel and
  ``F.scaled_dot_product_attention`` (float16 runs torch's kernel emulated where the CPU lacks
  float16 GEMMs; subquad's on float32 copies);
- the time model: measured / ``explain().predicted_seconds`` for every dtype and backend, forward
  (1x8x4096x64) and forward + backward (1x4x2048x64).

Run it with nothing else on the machine, and without ``MALLOC_MMAP_THRESHOLD_`` (the peak-memory
benchmarks' setting): with it every tile temporary is a fresh mmap, and the soft-cap forward +
backward measured 4.6-4.8x where it is 2.5-2.9x with glibc's default threshold. To measure an older checkout, run this file with
``PYTHONPATH=<that checkout>/src``. The bfloat16 tiles use the native kernel where it is built
(``subquad build``; ``SUBQUAD_NATIVE=off`` measures them without it): the machine line says which.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

import subquad

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import machine

SHAPE = (1, 8, 4096, 64)
BWD_SHAPE = (1, 4, 2048, 64)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _native_status() -> str:
    try:
        from subquad import _native  # absent from a checkout before the native kernel
    except ImportError:
        return "none (a subquad without subquad._native)"
    return _native.status()


def _cpu_flags() -> List[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return sorted(f for f in have if "amx" in f or "bf16" in f or "fp16" in f or f == "avx512f")
    except OSError:
        pass
    return []


def _forward_calls() -> Dict[str, Callable[[], Any]]:
    calls: Dict[str, Callable[[], Any]] = {}
    for name, dt in DTYPES.items():
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(SHAPE, generator=g).to(dt) for _ in range(3))
        calls[f"{name} tiles"] = lambda q=q, k=k, v=v: subquad.attention(q, k, v, backend="matmul")
        calls[f"{name} fused"] = lambda q=q, k=k, v=v: subquad.attention(q, k, v, backend="fused")
        calls[f"{name} F.sdpa"] = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v)
    return calls


def _softcap(s: torch.Tensor, b: Any, h: Any, qi: Any, ki: Any) -> torch.Tensor:
    return 30 * torch.tanh(s / 30)


def _backward_calls() -> Dict[str, Callable[[], Any]]:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(BWD_SHAPE, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(3))
    d_out = torch.randn(BWD_SHAPE, generator=g).to(torch.bfloat16)

    def tiles() -> None:
        out = subquad.attention(q, k, v, score_mod=_softcap, backend="matmul")
        torch.autograd.grad(out, (q, k, v), d_out)

    def fused() -> None:
        out = subquad.attention(q, k, v, backend="fused")
        torch.autograd.grad(out, (q, k, v), d_out)

    return {"bf16 softcap fwd+bwd tiles": tiles, "bf16 fwd+bwd fused (no callback)": fused}


def _training_calls() -> Dict[str, Callable[[], Any]]:
    calls: Dict[str, Callable[[], Any]] = {}
    for name, dt in DTYPES.items():
        g = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(BWD_SHAPE, generator=g).to(dt).requires_grad_() for _ in range(3))
        d_out = torch.randn(BWD_SHAPE, generator=g).to(dt)

        def run(fn: Callable[..., torch.Tensor], q: Any = q, k: Any = k, v: Any = v, d: Any = d_out) -> None:
            torch.autograd.grad(fn(q, k, v), (q, k, v), d)

        calls[f"{name} tiles"] = lambda run=run: run(lambda *t: subquad.attention(*t, backend="matmul"))
        calls[f"{name} fused"] = lambda run=run: run(lambda *t: subquad.attention(*t, backend="fused"))
        calls[f"{name} F.sdpa"] = lambda run=run: run(F.scaled_dot_product_attention)
    return calls


def _predicted_ms(shape: Any, grad: bool) -> Dict[str, float]:
    preds = {}
    for name, dt in DTYPES.items():
        q = torch.empty(shape, dtype=dt, requires_grad=grad)
        for backend, label in (("matmul", "tiles"), ("fused", "fused")):
            p = subquad.explain(q, q, q, backend=backend).predicted_seconds
            assert p is not None  # explain() always predicts
            preds[f"{name} {label}"] = p * 1e3
    return preds


def interleaved(calls: Dict[str, Callable[[], Any]], rounds: int, seed: int = 0) -> Dict[str, List[float]]:
    """Seconds per call: every call once per round, in a shuffled order (no fixed neighbour)."""
    rng = random.Random(seed)
    names = list(calls)
    for name in names:  # warm-up: plans, thread pools, allocator
        calls[name]()
    times: Dict[str, List[float]] = {n: [] for n in names}
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            t0 = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def _summary(ts: List[float]) -> Dict[str, float]:
    return {"median_ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3, "max_ms": max(ts) * 1e3}


def _timed_and_predicted(
    calls: Dict[str, Callable[[], Any]], rounds: int, shape: Any, grad: bool, title: str
) -> Tuple[Dict[str, Dict[str, float]], Dict[str, float], Dict[str, float]]:
    """Interleaved rounds of ``calls`` and explain()'s predictions, printed under ``title``:
    (summaries, predicted ms, median ms)."""
    timed = {n: _summary(ts) for n, ts in interleaved(calls, rounds).items()}
    predicted = _predicted_ms(shape, grad)
    print(title)
    for n, s in timed.items():
        pred = predicted.get(n)
        extra = f"  predicted {pred:.0f}" if pred is not None else ""
        print(f"  {n:<18} {s['median_ms']:8.1f} [{s['min_ms']:.1f}-{s['max_ms']:.1f}]{extra}")
    return timed, predicted, {n: s["median_ms"] for n, s in timed.items()}


def _one_process(backend: str) -> None:
    q, k, v = (torch.randn(SHAPE).to(torch.bfloat16) for _ in range(3))
    # A float32 GEMM timed after each call: how fast the machine ran this process, apart from
    # anything the call itself brings (its allocations, its data).
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    subquad.attention(q, k, v, backend=backend)
    torch.mm(a, b)
    ts, refs = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        subquad.attention(q, k, v, backend=backend)
        t1 = time.perf_counter()
        torch.mm(a, b)
        torch.mm(a, b)
        refs.append(time.perf_counter() - t1)
        ts.append(t1 - t0)
    out = {"median": statistics.median(ts) * 1e3, "best": min(ts) * 1e3, "reference": statistics.median(refs) * 1e3}
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--processes", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--one-process", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_process:
        _one_process(args.one_process)
        return
    results: Dict[str, Any] = {"machine": dict(machine(), flags=_cpu_flags(), native_kernel=_native_status())}
    print(f"# {results['machine']}")
    title = f"forward {SHAPE}, {args.rounds} interleaved rounds: median [min-max] ms, explain()'s prediction"
    results["forward"], preds, med = _timed_and_predicted(_forward_calls(), args.rounds, SHAPE, False, title)
    results["predicted_ms"] = preds
    ratios = {
        "bf16 tiles / fp32 tiles": med["bfloat16 tiles"] / med["float32 tiles"],
        "bf16 tiles / bf16 fused": med["bfloat16 tiles"] / med["bfloat16 fused"],
        "fp16 tiles / fp16 fused": med["float16 tiles"] / med["float16 fused"],
        "fp32 tiles / fp32 fused": med["float32 tiles"] / med["float32 fused"],
    }
    # Fresh processes of the tiles, each followed by one of the fused kernel: the kernel's spread is
    # the machine's own, measured in the same minutes.
    per_process: Dict[str, List[Dict[str, float]]] = {"matmul": [], "fused": []}
    for _ in range(args.processes):
        for backend in per_process:
            r = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--one-process", backend],
                capture_output=True,
                text=True,
                check=True,
            )
            per_process[backend].append(json.loads(r.stdout.strip().splitlines()[-1]))
    # A process's median of 3 calls (the issue's figure) carries the minutes' noise; its best call
    # leaves mostly what the process itself brings (allocations, data).
    for backend, label in (("matmul", "tiles"), ("fused", "fused")):
        for stat in ("median", "best"):
            ts = [p[stat] for p in per_process[backend]]
            key = "" if stat == "median" else "_best"
            results[f"bf16_{label}_per_process{key}_ms"] = ts
            machine_note = " (the machine)" if backend == "fused" else ""
            ratios[f"bf16 {label} slowest / fastest process, {stat}{machine_note}"] = max(ts) / min(ts)
        # Each process's median over its own reference GEMM: the spread the code brings, with the
        # machine's speed in that process divided out.
        rel = [p["median"] / p["reference"] for p in per_process[backend]]
        results[f"bf16_{label}_per_process_reference_ms"] = [p["reference"] for p in per_process[backend]]
        ratios[f"bf16 {label} slowest / fastest process, median / reference GEMM"] = max(rel) / min(rel)
    bwd = interleaved(_backward_calls(), args.rounds)
    results["backward"] = {n: _summary(ts) for n, ts in bwd.items()}
    bmed = {n: s["median_ms"] for n, s in results["backward"].items()}
    ratios["bf16 softcap fwd+bwd tiles / fused fwd+bwd"] = (
        bmed["bf16 softcap fwd+bwd tiles"] / bmed["bf16 fwd+bwd fused (no callback)"]
    )
    print(f"fwd+bwd {BWD_SHAPE}:")
    for n, s in results["backward"].items():
        print(f"  {n:<34} {s['median_ms']:8.1f} [{s['min_ms']:.1f}-{s['max_ms']:.1f}]")
    for backend, label in (("matmul", "tiles"), ("fused", "fused kernel")):
        times = ", ".join(f"{p['median']:.0f} ({p['best']:.0f}; {p['reference']:.0f})" for p in per_process[backend])
        print(
            f"bf16 {label} in {args.processes} fresh processes, median (best; reference GEMM) of 3 calls, ms: {times}"
        )
    title = f"fwd+bwd {BWD_SHAPE} per dtype:"
    results["training"], tpreds, tmed = _timed_and_predicted(_training_calls(), args.rounds, BWD_SHAPE, True, title)
    results["training_predicted_ms"] = tpreds
    ratios["fp16 fwd+bwd F.sdpa / subquad fused"] = tmed["float16 F.sdpa"] / tmed["float16 fused"]
    model = {f"fwd {n}": med[n] / p for n, p in preds.items()}
    model.update({f"fwd+bwd {n}": tmed[n] / p for n, p in tpreds.items()})
    results["measured_over_predicted"] = model
    print("time model, measured / predicted (bar: within 2x):")
    for n, r in model.items():
        print(f"  {n:<28} {r:.2f}")
    results["ratios"] = ratios
    print("ratios:")
    for n, r in ratios.items():
        print(f"  {n:<44} {r:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
