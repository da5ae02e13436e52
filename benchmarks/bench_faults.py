"""Page faults and time of the ``matmul`` tiles, before and after a change, in fresh processes.

    python benchmarks/bench_faults.py --before 524ea88 [--rounds 6] [--json out.json]

Three calls through ``backend="matmul"`` on two threads: bfloat16 forward 1x8x4096x64,
bfloat16 forward + backward 1x8x2048x64 and float32 forward 1x8x4096x64 (a control). Each runs
in fresh processes, once with glibc's default (adaptive) mmap threshold and once with a small
fixed one (``MALLOC_MMAP_THRESHOLD_=131072``, as the memory measurements here use: every freed
buffer goes back to the OS and comes back as page faults). Per round, one process per version,
the order alternating; each process reports the median time and minor page faults of 5 calls
after one warm-up. The figures: medians over rounds, and the median of the per-round
after/before time ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

from bench_before_after import _export

CASES = {
    "bf16 forward 1x8x4096x64": ("forward", 4096, "bfloat16"),
    "bf16 fwd+bwd 1x8x2048x64": ("backward", 2048, "bfloat16"),
    "fp32 forward 1x8x4096x64": ("forward", 4096, "float32"),
}
SMALL_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def child(mode: str, length: int, dtype_name: str) -> None:
    import torch

    import subquad

    torch.set_num_threads(2)
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(1, 8, length, 64, generator=g).to(dtype) for _ in range(4))
    if mode == "backward":
        for t in (q, k, v):
            t.requires_grad_()

    def call() -> None:
        out = subquad.attention(q, k, v, backend="matmul")
        if mode == "backward":
            out.backward(d_out)

    call()
    times, faults = [], []
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(
        json.dumps(
            {"ms": statistics.median(times) * 1e3, "faults": statistics.median(faults), "subquad": subquad.__file__}
        )
    )


def _run(src: str, case: Tuple[str, int, str], env: Dict[str, str]) -> Dict[str, float]:
    full_env = {**os.environ, **env, "PYTHONPATH": src}
    args = [sys.executable, __file__, "--child", case[0], str(case[1]), case[2]]
    proc = subprocess.run(args, env=full_env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(f"child for {src} failed:\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["subquad"].startswith(src), f"the child imported {report['subquad']}, not {src}"
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="git ref of the old version (required)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", help="write the runs and the summary here")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2])
        return 0
    if not args.before:
        ap.error("--before is required")
    tmp = tempfile.mkdtemp(prefix="subquad-faults-")
    versions = {
        "before": _export(args.before, os.path.join(tmp, "before")),
        "after": os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"),
    }
    results: Dict[str, Dict[str, List[Dict[str, float]]]] = {}
    for threshold, env in (("default", {}), ("small", SMALL_THRESHOLD)):
        for name, case in CASES.items():
            key = f"{name}, {threshold} mmap threshold"
            runs: Dict[str, List[Dict[str, float]]] = {"before": [], "after": []}
            for r in range(args.rounds):
                for version in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    runs[version].append(_run(versions[version], case, env))
            results[key] = runs
            ratios = [a["ms"] / b["ms"] for a, b in zip(runs["after"], runs["before"])]
            cols = [
                f"{v} {statistics.median(x['ms'] for x in runs[v]):6.1f} ms, {statistics.median(x['faults'] for x in runs[v]):7.0f} faults"
                for v in ("before", "after")
            ]
            print(
                f"{key:52s} {cols[0]} | {cols[1]} | after/before {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"before": args.before, "rounds": args.rounds, "runs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
