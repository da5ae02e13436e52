"""Time and peak memory against the memory budget, next to SDPA (issue 3's table and plot).

    python benchmarks/bench_budget.py [--length 16384] [--budgets 16 64 256 1024] [--out docs/benchmarks/data/forward/budget-cpu]

For each budget: subquad's planner ("auto"), and the pure-PyTorch tiles ("matmul", the path that
other devices and callbacks take), without a mask and with a key-padding bool mask (which the fused
kernel must receive as a float tile). Memory is the RSS high-water mark of the call beyond its
inputs, output included (see ``_harness.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any, Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import fmt_bytes, measure

MiB = 1 << 20


def make(impl: str, L: int, H: int, mask: bool, budget: Optional[int]) -> Callable[[], Any]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, L, 64, generator=g) for _ in range(3))
    attn_mask = None
    if mask:  # the last quarter of the keys is padding
        attn_mask = torch.ones(1, 1, 1, L, dtype=torch.bool)
        attn_mask[..., 3 * L // 4 :] = False
    if impl == "sdpa":
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    import subquad

    backend = "matmul" if impl == "subquad-matmul" else "auto"
    plan = subquad.explain(q, k, v, attn_mask=attn_mask, memory_budget=budget, backend=backend)
    print(f"@plan {plan.backend} {plan.chunk_size} {plan.predicted_peak_bytes}", flush=True)
    return lambda: subquad.attention(q, k, v, attn_mask=attn_mask, memory_budget=budget, backend=backend)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256, 1024], help="MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="folder for budget.json and budget.png")
    ap.add_argument("--replot", action="store_true", help="redraw budget.png from the budget.json in --out")
    args = ap.parse_args(argv)
    L, H = args.length, args.heads
    if args.replot and args.out:
        with open(os.path.join(args.out, "budget.json")) as f:
            records = json.load(f)["records"]
        _plot(records, args.budgets, os.path.join(args.out, "budget.png"), f"1x{H}x{L}x64 fp32, CPU")
        return 0
    records: List[Dict[str, Any]] = []

    def run(impl: str, mask: bool, budget_mib: Optional[int]) -> None:
        kw = dict(impl=impl, L=L, H=H, mask=mask, budget=None if budget_mib is None else budget_mib * MiB)
        r = measure("bench_budget:make", kw, repeats=args.repeats)
        r.update(kw, budget_mib=budget_mib)
        records.append(r)
        print(
            f"  {impl:15s} mask={mask!s:5s} budget={budget_mib!s:>5s} MiB {r.get('status')}: "
            f"{r.get('median_ms', float('nan')):8.0f} ms, peak extra {fmt_bytes(r.get('peak_extra_bytes', 0))} "
            f"{r.get('reason', '')}",
            flush=True,
        )

    for mask in (False, True):
        run("sdpa", mask, None)
        for impl in ("subquad", "subquad-matmul"):
            for b in args.budgets:
                run(impl, mask, b)

    print(
        f"\n1x{H}x{L}x64 fp32, {torch.get_num_threads()} threads. Peak = RSS high-water mark beyond the inputs "
        f"(the output, {fmt_bytes(H * L * 64 * 4)}, included)."
    )
    print("| mask | impl | budget | median ms | vs SDPA | peak extra | within budget + output |")
    print("|---|---|---|---|---|---|---|")
    out_bytes = H * L * 64 * 4
    for mask in (False, True):
        sd = next(r for r in records if r["impl"] == "sdpa" and r["mask"] == mask)
        for r in (r for r in records if r["mask"] == mask):
            ok = r.get("status") == "ok"
            ratio = f"{r['median_ms'] / sd['median_ms']:.2f}x" if ok and sd.get("status") == "ok" else "-"
            within = (
                "-"
                if r["budget_mib"] is None or not ok
                else ("yes" if r["peak_extra_bytes"] <= r["budget_mib"] * MiB + out_bytes else "NO")
            )
            print(
                f"| {'key padding' if mask else 'none'} | {r['impl']} | {r['budget_mib'] or '-'} | "
                f"{r.get('median_ms', float('nan')):.0f} | {ratio} | {fmt_bytes(r.get('peak_extra_bytes', 0))} | {within} |"
            )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "budget.json"), "w") as f:
            json.dump(
                {
                    "meta": dict(
                        torch=torch.__version__,
                        machine=platform.machine(),
                        threads=torch.get_num_threads(),
                        shape=[1, H, L, 64],
                        dtype="float32",
                    ),
                    "records": records,
                },
                f,
                indent=1,
            )
        _plot(records, args.budgets, os.path.join(args.out, "budget.png"), f"1x{H}x{L}x64 fp32, CPU")
    return 0


def _plot(records: List[Dict[str, Any]], budgets: List[int], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mask, style in ((False, "-"), (True, "--")):
        tag = "key padding" if mask else "no mask"
        for impl, color in (("subquad", "C0"), ("subquad-matmul", "C1")):
            rs = [r for r in records if r["impl"] == impl and r["mask"] == mask and r.get("status") == "ok"]
            xs = [r["budget_mib"] for r in rs]
            axes[0].plot(xs, [r["median_ms"] for r in rs], style, color=color, marker="o", label=f"{impl}, {tag}")
            axes[1].plot(
                xs, [r["peak_extra_bytes"] / MiB for r in rs], style, color=color, marker="o", label=f"{impl}, {tag}"
            )
        sd = next((r for r in records if r["impl"] == "sdpa" and r["mask"] == mask and r.get("status") == "ok"), None)
        if sd:
            axes[0].axhline(sd["median_ms"], color="C3", linestyle=style, label=f"SDPA, {tag}")
            axes[1].axhline(sd["peak_extra_bytes"] / MiB, color="C3", linestyle=style, label=f"SDPA, {tag}")
    out_mib = records[0]["H"] * records[0]["L"] * 64 * 4 / MiB
    axes[1].plot(budgets, [b + out_mib for b in budgets], ":", color="gray", label="budget + output")
    axes[1].legend(fontsize=7)
    for ax, ylabel in zip(axes, ("median time (ms)", "peak extra memory incl. output (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("memory_budget (MiB)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
