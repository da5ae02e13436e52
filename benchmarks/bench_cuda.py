"""CUDA checks of subquad's own paths: per-call overhead, matmul tile ceilings, explain() vs measured.

Three parts, each one process (the figures in docs/benchmarks/data/gpu/cuda-h200/ came from them):

    python benchmarks/bench_cuda.py overhead            # small calls: subquad vs F.sdpa, syncs per path
    python benchmarks/bench_cuda.py tiles --ceiling-mib 4 64 256 1024   # one process per ceiling
    python benchmarks/bench_cuda.py explain --out explain.json          # predicted vs measured
    python benchmarks/bench_cuda.py products        # half-precision tiles: float32 copies, widening GEMMs, Triton passes

Times: calls queued back to back between CUDA events (or one sync), best of 3 runs. Peak memory:
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was allocated before.

``--device cpu --quick`` runs the same code on small shapes without a GPU (a check of the program:
its times say nothing of a GPU; no peak memory, no sync check off CUDA).
"""

# ruff: noqa: B023  (each timed lambda runs inside the loop iteration that made it)
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import subquad

DEVICE = "cuda"
"""Where the calls run (``--device``)."""
QUICK = False
"""``--quick``: small shapes, for checking the program without a GPU."""


def sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()
    elif DEVICE == "mps":
        torch.mps.synchronize()


def per_call_us(fn: Callable[[], object], n: int = 300) -> float:
    """Microseconds per call of ``fn``: ``n`` calls back to back, one sync at the end."""
    for _ in range(20):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t) / n * 1e6


def best_ms(fn: Callable[[], object], reps: int = 5) -> float:
    """Milliseconds per call: the best of 3 runs of ``reps`` calls between CUDA events."""
    fn()
    sync()
    best = float("inf")
    for _ in range(3):
        if DEVICE.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) / reps)
        else:
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            best = min(best, (time.perf_counter() - t) * 1e3 / reps)
    return best


def peak_start() -> int:
    """Start a peak measurement: the allocated bytes now (CUDA; 0 elsewhere)."""
    if not DEVICE.startswith("cuda"):
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak_bytes(before: int) -> Optional[int]:
    """The peak since :func:`peak_start` beyond what was allocated then (CUDA; ``None`` elsewhere)."""
    return torch.cuda.max_memory_allocated() - before if DEVICE.startswith("cuda") else None


def release() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.empty_cache()


def overhead() -> None:
    cases = {
        "1x8x4096x64 bf16": ((1, 8, 4096, 64), (1, 8, 4096, 64), torch.bfloat16),
        "1x8x16x64 fp32": ((1, 8, 16, 64), (1, 8, 16, 64), torch.float32),
        "decode 1x32x1x128, 8 kv heads x 512, bf16": ((1, 32, 1, 128), (1, 8, 512, 128), torch.bfloat16),
    }
    if QUICK:  # the 4096-token case takes seconds per timed row on a CPU
        cases = {name: case for name, case in cases.items() if "4096" not in name}
    for name, (qs, ks, dt) in cases.items():
        q = torch.randn(qs, device=DEVICE, dtype=dt)
        k, v = (torch.randn(ks, device=DEVICE, dtype=dt) for _ in range(2))
        gqa = qs[1] != ks[1]
        row = {
            "F.sdpa": per_call_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)),
            "subquad.attention": per_call_us(lambda: subquad.attention(q, k, v, enable_gqa=gqa)),
            "subquad.attention memory_budget=4GiB": per_call_us(
                lambda: subquad.attention(q, k, v, enable_gqa=gqa, memory_budget="4GiB")
            ),
            "subquad.sdpa": per_call_us(lambda: subquad.sdpa(q, k, v, enable_gqa=gqa)),
        }
        if DEVICE.startswith("cuda"):
            row["torch.cuda.mem_get_info alone"] = per_call_us(lambda: torch.cuda.mem_get_info(q.device))
        print(name, {key: round(us, 1) for key, us in row.items()}, "us/call", flush=True)

    # Where a small call's time goes (the kernel itself takes ~14 us).
    q, k, v = (torch.randn(1, 8, 16, 64, device=DEVICE) for _ in range(3))
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        subquad.attention(q, k, v)
    sync()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)

    # A synchronizing op in a path raises here (torch's sync debug mode); the first one is shown.
    paths: List[tuple] = [
        ("auto fwd", {}, False),
        ("matmul fwd", {"backend": "matmul", "chunk_size": (256, 256)}, False),
        ("matmul fwd+bwd", {"backend": "matmul", "chunk_size": (256, 256)}, True),
        ("matmul causal mask_mod fwd+bwd", {"backend": "matmul", "chunk_size": (256, 256), "mask_mod": _causal}, True),
        ("auto fwd+bwd", {}, True),
        ("auto key-padding mask fwd", {"attn_mask": (torch.arange(700, device=DEVICE) < 600).expand(700, 700)}, False),
    ]
    if not DEVICE.startswith("cuda"):
        return  # torch's sync debug mode is CUDA's
    for name, kwargs, grad in paths:
        q, k, v = (torch.randn(1, 2, 700, 64, device=DEVICE, requires_grad=grad) for _ in range(3))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = subquad.attention(q, k, v, **kwargs)
            if grad:
                out.sum().backward()
            print(f"{name}: no sync", flush=True)
        except Exception as exc:
            print(f"{name}: SYNC", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-12:]))
        finally:
            torch.cuda.set_sync_debug_mode(0)


def _causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return kv_idx <= q_idx


TILE_CASES = [
    ((1, 8, 4096, 64), torch.bfloat16, False),
    ((1, 8, 4096, 64), torch.float32, False),
    ((2, 8, 16384, 40), torch.float16, False),
    ((1, 8, 4096, 64), torch.bfloat16, True),
    ((4, 16, 4096, 64), torch.bfloat16, True),
]


QUICK_TILE_CASES = [((1, 2, 300, 64), torch.float32, False), ((1, 2, 300, 64), torch.float32, True)]


def tiles(ceilings_mib: List[int]) -> None:
    """One process per ceiling (the planner's caches hold tiles per shape)."""
    flags = ["--device", DEVICE] + (["--quick"] if QUICK else [])
    for mib in ceilings_mib:
        subprocess.run([sys.executable, __file__, *flags, "tiles-one", str(mib)], check=False)


def tiles_one(mib: int) -> None:
    import subquad._backends.base as base

    base.ACCELERATOR_TILE_BYTES = mib << 20
    for shape, dt, train in QUICK_TILE_CASES if QUICK else TILE_CASES:
        q, k, v = (torch.randn(shape, device=DEVICE, dtype=dt, requires_grad=train) for _ in range(3))
        plan = subquad.explain(q, k, v, backend="matmul")
        run, ref = _calls(q, k, v, "matmul", train)
        before = peak_start()
        ms = best_ms(run)
        peak = peak_bytes(before)
        sdpa_ms = best_ms(ref)
        with torch.no_grad():
            out = subquad.attention(q, k, v, backend="matmul").float()
            err = (out - F.scaled_dot_product_attention(q.float(), k.float(), v.float())).abs().max().item()
        row = dict(
            target_mib=mib, shape=shape, dtype=str(dt), train=train, tiles=plan.chunk_size,
            bwd_tiles=plan.backward_chunk_size, ms=round(ms, 3), sdpa_ms=round(sdpa_ms, 3),
            ratio=round(ms / sdpa_ms, 2), predicted_ms=round(plan.predicted_seconds * 1e3, 3),
            peak_mib=None if peak is None else round(peak / 2**20, 1), predicted_peak_mib=round(plan.predicted_peak_bytes / 2**20, 1),
            max_err_vs_fp32=err,
        )  # fmt: skip
        print(json.dumps(row), flush=True)
        del q, k, v
        release()


def _calls(q: Any, k: Any, v: Any, backend: str, train: bool) -> tuple:
    """``(subquad's call, F.sdpa's call)``: forward, or forward and backward with one output gradient."""
    if not train:
        return (lambda: subquad.attention(q, k, v, backend=backend)), (lambda: F.scaled_dot_product_attention(q, k, v))
    grad = torch.randn_like(q)
    return (
        lambda: torch.autograd.grad(subquad.attention(q, k, v, backend=backend), (q, k, v), grad),
        lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), grad),
    )


EXPLAIN_CASES = [
    ((1, 8, 4096, 4096, 64), (torch.float32, torch.bfloat16, torch.float16)),
    ((2, 8, 16384, 16384, 40), (torch.float16,)),
    ((4, 16, 4096, 4096, 64), (torch.bfloat16,)),
]


QUICK_EXPLAIN_CASES = [((1, 2, 300, 200, 64), (torch.float32,))]


def explain(out_path: str) -> None:
    rows: List[Dict[str, Any]] = []
    for (B, H, Lq, Lk, E), dtypes in QUICK_EXPLAIN_CASES if QUICK else EXPLAIN_CASES:
        for dt in dtypes:
            for backend in ("auto", "matmul"):
                for train in (False, True):
                    row: Dict[str, Any] = dict(shape=(B, H, Lq, Lk, E), dtype=str(dt), backend=backend, train=train)
                    try:
                        q = torch.randn(B, H, Lq, E, device=DEVICE, dtype=dt, requires_grad=train)
                        k, v = (
                            torch.randn(B, H, Lk, E, device=DEVICE, dtype=dt, requires_grad=train) for _ in range(2)
                        )
                        plan = subquad.explain(q, k, v, backend=backend)
                        row.update(
                            chosen=plan.backend,
                            predicted_s=plan.predicted_seconds,
                            predicted_peak=plan.predicted_peak_bytes,
                        )
                        run, ref = _calls(q, k, v, backend, train)
                        before = peak_start()
                        row["measured_s"] = best_ms(run, reps=10) / 1e3
                        row["peak_over_inputs"] = peak_bytes(before)
                        row["sdpa_s"] = best_ms(ref, reps=10) / 1e3
                        row["ratio_measured_over_predicted"] = row["measured_s"] / row["predicted_s"]
                        row["ratio_to_sdpa"] = row["measured_s"] / row["sdpa_s"]
                    except Exception as exc:
                        row["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    with open(out_path, "w") as f:  # after every row: a run stopped early keeps what it measured
                        json.dump(dict(device=_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
                    release()


PRODUCT_CASES = [
    ((1, 8, 4096, 64), torch.bfloat16, False, False),
    ((2, 8, 16384, 40), torch.float16, False, False),
    ((1, 8, 4096, 64), torch.bfloat16, True, False),
    ((4, 16, 4096, 64), torch.bfloat16, True, False),
    ((1, 8, 4096, 64), torch.float16, True, True),
]


QUICK_PRODUCT_CASES = [((1, 2, 300, 64), torch.bfloat16, False, False), ((1, 2, 300, 64), torch.float16, True, True)]


def _alibi_kw(heads: int) -> Dict[str, Any]:
    """An ALiBi ``score_mod`` and a causal ``mask_mod``: the calls CUDA sends to the tiles in training."""
    slopes = subquad.mods.alibi_slopes(heads, device=DEVICE)
    return dict(score_mod=lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki), mask_mod=_causal)


MODES = ("float32", "widening", "widening+triton")
"""How the half-precision tiles run: float32 copies of q, k, v (MPS, torch before 2.8); widening
GEMMs with the eager passes (``SUBQUAD_TRITON=0``); widening GEMMs with the Triton passes."""


def _mode(mode: str) -> None:
    from subquad._backends import products

    on = mode != "float32"
    products._WIDENING[torch.device(DEVICE).type] = on and products._widening_works(torch.device(DEVICE))
    os.environ["SUBQUAD_TRITON"] = "1" if mode == "widening+triton" else "0"


def products() -> None:
    """The half-precision tiles on this device in each of :data:`MODES`, alternating in one
    process: times, and errors against float64."""
    from subquad._backends import products as prod

    print(json.dumps(dict(widening_products=prod._widening_works(torch.device(DEVICE)))), flush=True)
    for shape, dt, train, callbacks in QUICK_PRODUCT_CASES if QUICK else PRODUCT_CASES:
        q, k, v = (torch.randn(shape, device=DEVICE, dtype=dt, requires_grad=train) for _ in range(3))
        kw = _alibi_kw(shape[1]) if callbacks else {}
        grad = torch.randn_like(q)

        def run(q: Any = q, k: Any = k, v: Any = v, kw: Any = kw, grad: Any = grad, train: bool = train) -> object:
            out = subquad.attention(q, k, v, backend="matmul", **kw)
            return torch.autograd.grad(out, (q, k, v), grad) if train else out

        row: Dict[str, Any] = dict(shape=shape, dtype=str(dt), train=train, callbacks=callbacks)
        for rnd in range(2):
            for mode in MODES if rnd == 0 else MODES[::-1]:
                _mode(mode)
                try:
                    row.setdefault(f"{mode}_ms", []).append(round(best_ms(run), 3))
                except Exception as exc:
                    row[f"{mode}_error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        print(json.dumps(row), flush=True)
        del q, k, v, run
        release()
    _mode(MODES[-1])
    accuracy()


def accuracy() -> None:
    """Errors against float64 of the tiles with each kind of product and of F.sdpa, 1x4x1024x64."""
    g = torch.Generator().manual_seed(0)
    shape = (1, 4, 300, 64) if QUICK else (1, 4, 1024, 64)
    base = [torch.randn(shape, generator=g) * 2 for _ in range(3)]
    for dt in (torch.float16, torch.bfloat16):
        for callbacks in (False, True):
            kw = _alibi_kw(shape[1]) if callbacks else {}
            grad = torch.randn(shape, generator=g).to(DEVICE)
            x64 = [t.to(DEVICE, torch.float64).requires_grad_() for t in base]
            ref = subquad.attention(*x64, backend="matmul", **kw)
            want = [ref, *torch.autograd.grad(ref, x64, grad.double())]
            row: Dict[str, Any] = dict(shape=shape, dtype=str(dt), callbacks=callbacks)
            for mode in (*MODES, "sdpa"):
                xs = [t.to(DEVICE, dt).requires_grad_() for t in base]
                try:
                    if mode == "sdpa":
                        if callbacks:
                            continue
                        out = F.scaled_dot_product_attention(*xs)
                    else:
                        _mode(mode)
                        out = subquad.attention(*xs, backend="matmul", chunk_size=(256, 384), **kw)
                    got = [out, *torch.autograd.grad(out, xs, grad.to(dt))]
                except Exception as exc:
                    row[f"{mode}_error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                    continue
                for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                    d = (a.double() - b).abs()
                    row[f"{mode}_{name}"] = [float(f"{d.max().item():.3g}"), float(f"{d.mean().item():.3g}")]
            print(json.dumps(row), flush=True)
    _mode(MODES[-1])


def _device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE.startswith("cuda") else DEVICE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:1, mps or cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes: a check of the program itself")
    sub = parser.add_subparsers(dest="part", required=True)
    sub.add_parser("overhead")
    t = sub.add_parser("tiles")
    t.add_argument("--ceiling-mib", type=int, nargs="+", default=[4, 64, 256, 1024])
    one = sub.add_parser("tiles-one")
    one.add_argument("mib", type=int)
    sub.add_parser("products")
    e = sub.add_parser("explain")
    e.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "explain-cuda.json"))
    args = parser.parse_args()
    global DEVICE, QUICK
    DEVICE, QUICK = args.device, args.quick
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench_cuda.py: no CUDA device here (--device cpu --quick checks the program without one)")
    if args.part == "overhead":
        overhead()
    elif args.part == "tiles":
        tiles(args.ceiling_mib)
    elif args.part == "tiles-one":
        tiles_one(args.mib)
    elif args.part == "products":
        products()
    else:
        explain(args.out)


if __name__ == "__main__":
    main()
