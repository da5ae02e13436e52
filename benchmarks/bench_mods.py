"""Callbacks on CPU: causal + ALiBi with subquad.mods versus SDPA with the materialized float mask.

Memory: each case runs in a fresh Python process started with ``MALLOC_MMAP_THRESHOLD_=131072``
(freed large blocks go back to the OS, so the RSS follows what is live). After the inputs exist and
one warm-up call has run, it resets its RSS high-water mark (``5`` into ``/proc/self/clear_refs``),
reads ``VmRSS``, runs the call and reports ``VmHWM - VmRSS``: the peak extra memory of the call,
output included.

Time: the median of ``--reps`` calls after a warm-up, in a second fresh process with the default
allocator (the low mmap threshold turns every large temporary into page faults, a cost ordinary
programs do not pay). Wall clock and process CPU time are both reported; on a shared machine the
CPU time of a single-threaded run (``--threads 1``) is the steadiest number.

The 65,536-token run is one call without warm-up in each of the two processes. SDPA with the materialized mask is not run there: its mask alone would be 32 GiB.

    python benchmarks/bench_mods.py                      # every case, table on stdout
    python benchmarks/bench_mods.py --cases sdpa_mask,subquad_128MiB --reps 5 --threads 1
    python benchmarks/bench_mods.py --json results.json  # also save the raw rows
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import _status_kib

B, H, L, E = 1, 4, 8192, 64
LONG_H, LONG_L = 2, 65536

# name -> (description, shape (B, H, L, E), timed repetitions or None for --reps)
CASES: Dict[str, Tuple[str, Tuple[int, int, int, int], Optional[int]]] = {
    "sdpa_mask": ("SDPA + causal ALiBi float mask built in the call", (B, H, L, E), None),
    "sdpa_causal_floor": ("SDPA is_causal=True, no ALiBi (the floor)", (B, H, L, E), None),
    "subquad_default": ("subquad is_causal + mods.alibi, default budget", (B, H, L, E), None),
    "subquad_128MiB": ("subquad is_causal + mods.alibi, memory_budget='128MiB'", (B, H, L, E), None),
    "subquad_maskmod_128MiB": ("subquad mods.causal() + mods.alibi, '128MiB'", (B, H, L, E), None),
    "subquad_tiles512": ("subquad is_causal + mods.alibi, chunk_size=512", (B, H, L, E), None),
    "full_512": ("subquad mods.alibi, no mask, tiles 512", (B, H, L, E), None),
    "causal_512": ("subquad mods.causal() + alibi, tiles 512", (B, H, L, E), None),
    "window_512": ("subquad mods.sliding_window(512) + alibi, tiles 512", (B, H, L, E), None),
    "long_65536": ("subquad is_causal + mods.alibi, 65,536 tokens, '128MiB'", (1, LONG_H, LONG_L, E), 1),
}


# ----------------------------------------------------------------------------- worker (one case)
def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _make_call(name: str, shape: Tuple[int, int, int, int]):
    import torch
    import torch.nn.functional as F

    import subquad
    from subquad import mods

    b, h, n, e = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, e, generator=g) for _ in range(3))
    slopes = mods.alibi_slopes(h)
    alibi = mods.alibi(slopes)

    def sdpa_mask():
        # The frugal way to materialize it: float distances (not int64), one (H, L, L) mask.
        pos = torch.arange(n, dtype=torch.float32)
        dist = (pos[:, None] - pos[None, :]).abs_()
        mask = dist * slopes.neg().view(h, 1, 1)
        del dist
        mask.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu_(1), float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(0))

    subquad_kwargs: Dict[str, dict] = {
        "subquad_default": dict(is_causal=True),
        "subquad_128MiB": dict(is_causal=True, memory_budget="128MiB"),
        "subquad_maskmod_128MiB": dict(mask_mod=mods.causal(), memory_budget="128MiB"),
        "subquad_tiles512": dict(is_causal=True, chunk_size=512),
        "full_512": dict(chunk_size=512),
        "causal_512": dict(mask_mod=mods.causal(), chunk_size=512),
        "window_512": dict(mask_mod=mods.sliding_window(512), chunk_size=512),
        "long_65536": dict(is_causal=True, memory_budget="128MiB"),
    }
    if name == "sdpa_mask":
        return sdpa_mask, None
    if name == "sdpa_causal_floor":
        return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), None
    kw = dict(subquad_kwargs[name], score_mod=alibi)
    p = subquad.explain(q, k, v, **kw)
    plan = {"backend": p.backend, "chunk_size": p.chunk_size, "predicted_peak_MiB": p.predicted_peak_bytes / 2**20}
    return (lambda: subquad.attention(q, k, v, **kw)), plan


def run_worker(name: str, reps: int, warmup: bool) -> dict:
    """Time ``reps`` calls (after a warm-up call) and measure their peak extra memory."""
    import gc

    import torch

    from subquad._tiles import TILES

    fn, plan = _make_call(name, CASES[name][1])
    if warmup:
        out = fn()
        del out
    gc.collect()
    _reset_hwm()
    rss_before = _status_kib("VmRSS")
    TILES.reset()
    walls: List[float] = []
    cpus: List[float] = []
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        del out
    peak_kib = _status_kib("VmHWM") - rss_before
    return {
        "case": name,
        "description": CASES[name][0],
        "shape": CASES[name][1],
        "threads": torch.get_num_threads(),
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "reps": reps,
        "wall_s": walls,
        "median_wall_s": statistics.median(walls),
        "median_cpu_s": statistics.median(cpus),
        "peak_extra_MiB": peak_kib / 1024,
        "tiles_computed": TILES.computed // max(reps, 1),
        "tiles_skipped": TILES.skipped // max(reps, 1),
        "plan": plan,
        "torch": torch.__version__,
    }


# ----------------------------------------------------------------------------- driver
def _spawn(name: str, reps: int, threads: Optional[int], low_mmap_threshold: bool, warmup: bool) -> dict:
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if low_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--reps", str(reps)]
    if not warmup:
        cmd.append("--no-warmup")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        oom = proc.returncode in (-9, 137) or any("memory" in line.lower() for line in tail)
        return {"case": name, "description": CASES[name][0], "error": "OOM" if oom else " / ".join(tail)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_case(name: str, reps: int, threads: Optional[int]) -> dict:
    """Memory from a process with a low mmap threshold; time from one with the default allocator.

    The low threshold makes the RSS honest, but it also turns every large temporary into fresh
    pages (page faults, +50% CPU time for tiles of 1024 x 1024 here) -- a cost ordinary programs do
    not pay, so times come from a second process.
    """
    fixed = CASES[name][2]
    n = fixed or reps
    mem = _spawn(name, 1, threads, low_mmap_threshold=True, warmup=fixed is None)
    if "error" in mem:
        return mem
    timed = _spawn(name, n, threads, low_mmap_threshold=False, warmup=fixed is None)
    if "error" in timed:
        return timed
    timed["peak_extra_MiB"] = mem["peak_extra_MiB"]
    timed["memory_run"] = {k: mem[k] for k in ("median_wall_s", "median_cpu_s", "malloc_mmap_threshold")}
    return timed


def _fmt_row(r: dict) -> str:
    if "error" in r:
        return f"| {r['case']} | {r['description']} | {r['error']} | | | | |"
    plan = r.get("plan") or {}
    tiles = f"{r['tiles_computed']} / {r['tiles_skipped']}" if plan else ""
    chunk = plan.get("chunk_size")
    chunk_s = "" if not plan else ("whole" if chunk is None else f"{plan['backend']} {chunk[0]}x{chunk[1]}")
    return (
        f"| {r['case']} | {r['description']} | {r['median_wall_s']:.3f} | {r['median_cpu_s']:.2f} | "
        f"{r['peak_extra_MiB']:.0f} | {chunk_s} | {tiles} |"
    )


def report(rows: List[dict]) -> str:
    lines = [
        "| case | what | median wall s | median CPU s | peak extra MiB | tiles | computed / skipped |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [_fmt_row(r) for r in rows]
    by = {r["case"]: r for r in rows if "error" not in r}
    ref = by.get("sdpa_mask")
    if ref:
        lines.append("")
        for name in ("subquad_default", "subquad_128MiB", "subquad_maskmod_128MiB", "subquad_tiles512"):
            r = by.get(name)
            if r:
                t = r["median_wall_s"] / ref["median_wall_s"]
                c = r["median_cpu_s"] / ref["median_cpu_s"]
                m = r["peak_extra_MiB"] / ref["peak_extra_MiB"]
                ok = "meets" if t <= 0.8 and m <= 1 / 8 else "misses"
                lines.append(
                    f"{name} / sdpa_mask: time {t:.2f}x (CPU time {c:.2f}x), peak memory {m:.3f}x "
                    f"(1/{1 / m:.0f}) -> {ok} the goal (<= 0.8x time, <= 1/8 memory)"
                )
    full = by.get("full_512")
    for name, what, frac in (("causal_512", "causal()", 0.5), ("window_512", "sliding_window(512)", (2 * 512 + 1) / L)):
        r = by.get(name)
        if full and r:
            lines.append(
                f"{what} / full (subquad, ALiBi, same tiles): time {r['median_wall_s'] / full['median_wall_s']:.2f}x "
                f"(CPU time {r['median_cpu_s'] / full['median_cpu_s']:.2f}x); the mask keeps {frac:.2f} of the scores"
            )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    ap.add_argument("--reps", type=int, default=3, help="timed calls per case (the 65,536-token run: 1)")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the workers")
    ap.add_argument("--json", default=None, help="write the raw rows to this file")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-warmup", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.reps, warmup=not args.no_warmup)))
        return 0
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; choose from {list(CASES)}")
    rows = []
    for name in names:
        r = run_case(name, args.reps, args.threads)
        rows.append(r)
        print(_fmt_row(r), file=sys.stderr, flush=True)
    print(report(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
