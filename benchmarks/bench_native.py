"""The native tile kernel (``subquad build``): what it costs to build and load, and its accuracy.

    python benchmarks/bench_native.py [--json docs/benchmarks/native-cpu.json]

- the first build, in an empty folder (``SUBQUAD_NATIVE_DIR``), timed in a fresh process; then
  ``subquad build`` again (finds it built) and a fresh process's first call of the kernel (loads
  the built library);
- accuracy: bfloat16 forward 1x4x1024x64, scores of about 1, 4 and 16, causal or not, 4 seeds
  each (24 calls), the bfloat16 tiles with the kernel's C++ forward loop (where it was built
  for AVX512-BF16; otherwise the same as the next), with its passes over each tile and without
  it (the eager passes), the fused kernel and ``F.scaled_dot_product_attention``, each against float64: the largest and the
  mean absolute error, and the lse's largest error for the tiles.

The time per call, with the kernel and without it, is measured by ``bench_before_after.py``
(fresh processes alternating) and ``bench_half.py``; this script measures no speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

import subquad
from subquad import _native
from subquad._backends import matmul, products, segments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import machine  # the benchmarks' own helper, beside this file


def _first_costs() -> Dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "SUBQUAD_NATIVE_DIR": tmp, "SUBQUAD_NATIVE": "auto"}
        cmd = [sys.executable, "-m", "subquad", "build"]
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        again = time.perf_counter() - t0
        load = (
            "import time, subquad._native as n; t0 = time.perf_counter(); assert n.tile_kernel() is not None; "
            "print(time.perf_counter() - t0)"
        )
        r = subprocess.run([sys.executable, "-c", load], env=env, check=True, capture_output=True, text=True)
        return {"build_s": built, "build_again_s": again, "load_s": float(r.stdout.strip())}


def _errors(out: torch.Tensor, golden: torch.Tensor) -> Dict[str, float]:
    err = (out.double() - golden).abs()
    return {"max": float(err.max()), "mean": float(err.mean())}


TILES = (
    ("tiles, C++ loop", True, True),  # the forward loop in C++ (where built for AVX512-BF16)
    ("tiles, native kernel", True, False),  # the kernel's passes over each tile
    ("tiles, eager passes", False, False),
)


def _accuracy(kernel: Any) -> Dict[str, Any]:
    cases: List[Dict[str, Any]] = []
    for magnitude in (1.0, 2.0, 4.0):  # scores of about magnitude² (q·k / sqrt(64))
        for causal in (False, True):
            for seed in range(4):
                g = torch.Generator().manual_seed(seed)
                q, k, v = ((torch.randn(1, 4, 1024, 64, generator=g) * magnitude).to(torch.bfloat16) for _ in range(3))
                q64, k64, v64 = q.double(), k.double(), v.double()
                golden = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
                s = (q64 @ k64.transpose(-1, -2)) / 8.0
                if causal:
                    s = s.masked_fill(torch.ones(1024, 1024, dtype=torch.bool).triu(1), float("-inf"))
                lse64 = torch.logsumexp(s, dim=-1)
                row: Dict[str, Any] = {"scores": magnitude**2, "causal": causal, "seed": seed}
                for name, module, loop in TILES:
                    _native._LOADED["module"] = kernel if module else None
                    matmul.segment_kernel = segments.segment_kernel if loop else (lambda inp: None)
                    out, lse = subquad.attention(q, k, v, is_causal=causal, backend="matmul", return_lse=True)
                    row[name] = dict(_errors(out, golden), lse_max=float((lse.double() - lse64).abs().max()))
                row["fused kernel"] = _errors(subquad.attention(q, k, v, is_causal=causal, backend="fused"), golden)
                row["F.sdpa"] = _errors(F.scaled_dot_product_attention(q, k, v, is_causal=causal), golden)
                cases.append(row)
    summary = {}
    for name in [t[0] for t in TILES] + ["fused kernel", "F.sdpa"]:
        summary[name] = {
            "max": max(c[name]["max"] for c in cases),
            "mean": sum(c[name]["mean"] for c in cases) / len(cases),
        }
        if "lse_max" in cases[0][name]:
            summary[name]["lse_max"] = max(c[name]["lse_max"] for c in cases)
    return {"cases": cases, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    print(f"# {machine()}")
    costs = _first_costs()
    print(
        f"first build {costs['build_s']:.1f} s; `subquad build` once built {costs['build_again_s']:.2f} s; "
        f"a fresh process loads it in {costs['load_s'] * 1e3:.0f} ms"
    )
    # The offset bfloat16 products, which the kernel serves, whatever this CPU has.
    products._CPU = products.cpu_features()._replace(avx512_bf16=True)
    kernel = _native.build()
    acc = _accuracy(kernel)
    if not hasattr(kernel, "forward_segment_bf16"):
        print("built without AVX512-BF16: the 'C++ loop' rows are the kernel's passes per tile")
    print("bfloat16 1x4x1024x64, 24 calls (scores ~1, 4, 16; causal or not; 4 seeds), error against float64:")
    for name, s in acc["summary"].items():
        lse = f", lse max {s['lse_max']:.2e}" if "lse_max" in s else ""
        print(f"  {name:<22} max {s['max']:.4f}  mean {s['mean']:.2e}{lse}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "first_costs": costs, "accuracy": acc}, f, indent=1)


if __name__ == "__main__":
    main()
