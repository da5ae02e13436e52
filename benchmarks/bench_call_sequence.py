"""The float32 loop and the fused kernel in one process that runs calls of several sizes in turn,
as a host does: time and minor page faults per call.

    subquad build
    python benchmarks/bench_call_sequence.py LABEL [--json F]
    PYTHONPATH=/path/to/other/checkout/src python benchmarks/bench_call_sequence.py before

A call's buffers larger than glibc's mmap threshold are mapped, then returned to the system when
freed, and every page of the next call's is faulted in again; whether that happens depends on
what the process allocated before (the threshold grows as large buffers are freed), so a call
timed alone can miss it. Each case runs ``backend="matmul"`` (the C++ loop) then
``backend="fused"`` in the same process, after the cases before it: two warm-up calls, then the
median of 20 calls (5 for the 4096 x 4096 ones). Run it in alternating fresh processes per
checkout to compare two versions (``LABEL`` names the row).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import sys
import time
from typing import Any, Dict, List

import torch

import subquad

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import machine

CASES = [  # (query shape, key/value shape), in the order they run
    ((1, 8, 128, 64), (1, 8, 128, 64)),
    ((1, 8, 512, 64), (1, 8, 512, 64)),
    ((2, 10, 4096, 64), (2, 10, 77, 64)),  # Stable Diffusion's cross-attention: 77 text tokens
    ((1, 8, 2048, 64), (1, 8, 2048, 64)),
    ((2, 8, 4096, 40), (2, 8, 4096, 40)),  # Stable Diffusion 1.5's self-attention at 512 px
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("label", help="the row's name, e.g. before or after")
    ap.add_argument("--json", default=None, help="append the rows to this JSON file (a list)")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    rows: List[Dict[str, Any]] = []
    for sq, skv in CASES:
        q = torch.randn(sq, generator=g)
        k, v = (torch.randn(skv, generator=g) for _ in range(2))
        row: Dict[str, Any] = dict(label=args.label, query=list(sq), keys=skv[2])
        for backend in ("matmul", "fused"):
            call = functools.partial(subquad.attention, q, k, v, backend=backend)
            call(), call()
            n = 5 if sq[2] >= 4096 and skv[2] > 100 else 20
            times = []
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(n):
                t0 = time.perf_counter()
                call()
                times.append((time.perf_counter() - t0) * 1e3)
            faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / n
            row[backend] = dict(ms=statistics.median(times), faults_per_call=faults)
        rows.append(row)
        loop, fused = row["matmul"], row["fused"]
        print(
            f"{args.label:<8} {sq!s:<18} {skv[2]:>5} keys  loop {loop['ms']:8.2f} ms"
            f" ({loop['faults_per_call']:6.0f} faults/call)  fused {fused['ms']:8.2f} ms"
            f"  loop/fused {loop['ms'] / fused['ms']:.2f}"
        )
    if args.json:
        old: Dict[str, Any] = {"machine": machine(), "rows": []}
        if os.path.exists(args.json):
            with open(args.json) as f:
                old = json.load(f)
        old["rows"].extend(rows)
        with open(args.json, "w") as f:
            json.dump(old, f, indent=1)


if __name__ == "__main__":
    main()
