"""Forward time and peak memory on this machine: subquad vs SDPA, naive and the chunked peers.

    python benchmarks/bench_core.py [--lengths 4096 8192] [--out docs/benchmarks/data/forward/core-cpu.json]

Peers (benchmark-only, ``pip install memory-efficient-attention==0.1.3
memory-efficient-attention-pytorch==0.1.6 einops``) run at their default chunk sizes. Each case
runs in a fresh process (see ``_harness.py`` for how memory is measured).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import types
from typing import Any, Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import fmt_bytes, measure


def _inputs(B: int, H: int, L: int, E: int, dtype: str, device: str):
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    return [torch.randn(B, H, L, E, generator=g, dtype=dt).to(device) for _ in range(3)]


def make(
    impl: str, B: int, H: int, L: int, E: int, dtype: str = "float32", device: str = "cpu", budget: Any = None
) -> Callable[[], Any]:
    """Factory run in the child process: inputs plus a no-argument call."""
    q, k, v = _inputs(B, H, L, E, dtype, device)
    if impl.startswith("subquad"):
        # "subquad", "subquad-matmul" (the pure-PyTorch tiles) and "subquad@16MiB" (under a budget).
        import subquad

        name, _, budget_text = impl.partition("@")
        backend = "matmul" if name.endswith("-matmul") else "auto"
        budget = budget_text or budget
        return lambda: subquad.attention(q, k, v, backend=backend, memory_budget=budget)
    if impl == "sdpa":
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)
    if impl == "naive":
        scale = 1 / math.sqrt(E)
        return lambda: torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1) @ v
    if impl == "mea-0.1.3":
        fn = _load_mea()
        # [batch, L, H, E] layout; transposes are views, as a user of the package would pass.
        return lambda: fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    if impl == "mea-pytorch-0.1.6":
        from memory_efficient_attention_pytorch import memory_efficient_attention

        return lambda: memory_efficient_attention(q, k, v)
    raise ValueError(impl)


def _load_mea():
    # memory-efficient-attention 0.1.3 imports jax in its package __init__; load the torch module
    # alone by registering the package path without running __init__.
    spec = importlib.util.find_spec("memory_efficient_attention")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("pip install memory-efficient-attention==0.1.3")
    pkg = types.ModuleType("memory_efficient_attention")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules.setdefault("memory_efficient_attention", pkg)
    from memory_efficient_attention.attention_torch import efficient_dot_product_attention

    return efficient_dot_product_attention


IMPLS = ["subquad", "subquad-matmul@64MiB", "sdpa", "naive", "mea-0.1.3", "mea-pytorch-0.1.6"]


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--impls", nargs="+", default=IMPLS)
    ap.add_argument("--out", default=None, help="write the records as JSON here")
    args = ap.parse_args(argv)

    records: List[Dict[str, Any]] = []
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    for L in args.lengths:
        shape = dict(B=args.batch, H=args.heads, L=L, E=args.dim, dtype=args.dtype)
        for impl in args.impls:
            r = measure("bench_core:make", dict(impl=impl, **shape), repeats=args.repeats)
            r.update(impl=impl, **shape)
            records.append(r)
            print(
                f"  {impl:20s} L={L:6d} {r.get('status')}: "
                f"{r.get('median_ms', float('nan')):9.1f} ms  peak extra {fmt_bytes(r.get('peak_extra_bytes', 0))}"
                f"  {r.get('reason', '')}",
                flush=True,
            )
    print()
    print("| shape | impl | median ms | vs SDPA | peak extra (incl. output) | status |")
    print("|---|---|---|---|---|---|")
    for L in args.lengths:
        base = next((r for r in records if r["L"] == L and r["impl"] == "sdpa" and r["status"] == "ok"), None)
        for r in (r for r in records if r["L"] == L):
            ratio = f"{r['median_ms'] / base['median_ms']:.2f}x" if base and r.get("status") == "ok" else "-"
            ms = f"{r['median_ms']:.1f}" if r.get("status") == "ok" else "-"
            mem = fmt_bytes(r["peak_extra_bytes"]) if r.get("status") == "ok" else "-"
            print(
                f"| {args.batch}x{args.heads}x{L}x{args.dim} {args.dtype} | {r['impl']} | {ms} | {ratio} | {mem} | {r['status']} |"
            )
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        meta = dict(torch=torch.__version__, machine=platform.machine(), threads=torch.get_num_threads())
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
