"""Forward+backward time and peak memory: subquad vs SDPA, with and without a learnable bias.

    python benchmarks/bench_backward.py [--lengths 4096 8192] [--out docs/benchmarks/data/backward/backward-cpu.json]

"bias" cases add a float mask ``(1, H, L, L)`` that requires grad (a learnable attention bias):
SDPA then takes its math path, which materializes the scores; subquad keeps tiles. Memory is the
RSS high-water mark of a training step beyond its inputs and the gradients of the previous step
(which the step frees before it makes new ones), output included; "net" also leaves out the output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any, Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import fmt_bytes, measure


def make(impl: str, B: int, H: int, L: int, E: int, bias: bool, budget: Any = None) -> Callable[[], Any]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, E, generator=g).requires_grad_() for _ in range(3))
    mask = torch.randn(1, H, L, L, generator=g).requires_grad_() if bias else None
    leaves = [t for t in (q, k, v, mask) if t is not None]
    grad_out = torch.randn(B, H, L, E, generator=g)

    if impl == "sdpa":

        def attn():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    elif impl == "subquad":
        import subquad

        def attn():
            return subquad.attention(q, k, v, attn_mask=mask, memory_budget=budget)
    else:
        raise ValueError(impl)

    def step():
        for t in leaves:
            t.grad = None
        out = attn()
        out.backward(grad_out)
        # Only the output is new memory: each step first drops the previous step's gradients, so
        # the RSS mark (taken after a warm-up step) sees the new gradients replace the old ones.
        return out

    return step


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", default="64MiB", help="subquad's memory_budget in the bias cases")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    records: List[Dict[str, Any]] = []
    for L in args.lengths:
        for bias in (False, True):
            for impl in ("sdpa", "subquad"):
                kw = dict(impl=impl, B=1, H=args.heads, L=L, E=64, bias=bias, budget=args.budget if bias else None)
                r = measure("bench_backward:make", kw, repeats=args.repeats)
                r.update(kw)
                records.append(r)
                print(
                    f"  {impl:8s} L={L:5d} bias={bias!s:5s} {r.get('status')}: {r.get('median_ms', float('nan')):9.1f} ms "
                    f"peak {fmt_bytes(r.get('peak_extra_bytes', 0))} {r.get('reason', '')}",
                    flush=True,
                )
    print()
    print(
        "Peak = RSS high-water mark beyond the inputs (and the previous step's gradients, which each step replaces); 'net' excludes the output."
    )
    print(
        "| shape | learnable bias | SDPA ms | subquad ms | time ratio | SDPA peak (net) | subquad peak (net) | net memory ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for L in args.lengths:
        for bias in (False, True):
            s, o = (
                next(r for r in records if r["L"] == L and r["bias"] == bias and r["impl"] == i)
                for i in ("sdpa", "subquad")
            )
            if s.get("status") == "ok" and o.get("status") == "ok":
                sn, on = (max(r["peak_extra_bytes"] - r["output_bytes"], 0) for r in (s, o))
                print(
                    f"| 1x{args.heads}x{L}x64 fp32 | {'yes' if bias else 'no'} | {s['median_ms']:.0f} | {o['median_ms']:.0f} | "
                    f"{o['median_ms'] / s['median_ms']:.2f}x | {fmt_bytes(s['peak_extra_bytes'])} ({fmt_bytes(sn)}) | "
                    f"{fmt_bytes(o['peak_extra_bytes'])} ({fmt_bytes(on)}) | {on / max(sn, 1):.3f} |"
                )
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(
                {
                    "meta": dict(torch=torch.__version__, machine=platform.machine(), threads=torch.get_num_threads()),
                    "records": records,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
