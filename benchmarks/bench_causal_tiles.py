"""Causal tiles on the fused CPU kernel: each tile size's forward and backward time, the tiles the
planner chooses (``fused.causal_cost``), and that cost's ranking, for packed sequences of equal
length (the data the cost's weights were fitted on).

For each length L, 8192 // L sequences of L tokens (8 heads x 64, float32, causal) run through
``varlen_attention`` with ``backend="fused"`` and each ``chunk_size`` (the first row: the whole sequence),
interleaved: every round times each tile size once, forward alone and forward + backward; the
figures are medians over rounds (backward = the difference).

    python benchmarks/bench_causal_tiles.py [--threads 1] [--lengths 256,384,512,640,768,1024] [--rounds 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Dict, List, Optional, Tuple

import bench_varlen
import torch

import subquad
from subquad._backends import fused
from subquad._validate import make_inputs


def _case(L: int, rounds: int) -> Dict[str, object]:
    lengths = [L] * max(1, 8192 // L)
    q, k, v, cu = bench_varlen.packed(lengths, 8, 64, True)
    tiles: List[Optional[int]] = [None] + [t for t in (1024, 512, 384, 256, 192, 128, 64) if t < L]

    def run(backward: bool, t: Optional[int]) -> float:
        start = time.perf_counter()
        # chunk_size=L forces the whole sequence: None would be the planner's own choice
        out = subquad.varlen_attention(q, k, v, cu, cu, is_causal=True, chunk_size=t or L, backend="fused")
        if backward:
            out.backward(torch.ones_like(out))
            for x in (q, k, v):
                x.grad = None
        return time.perf_counter() - start

    times: Dict[Tuple[bool, Optional[int]], List[float]] = {(b, t): [] for b in (False, True) for t in tiles}
    for key in times:
        run(*key)  # warm
    for _ in range(rounds):
        for key in times:
            times[key].append(run(*key))
    plan = subquad.varlen_explain(q, k, v, cu, cu, is_causal=True, backend="fused")
    one = make_inputs(*(torch.empty(1, 8, L, 64),) * 3, is_causal=True)  # one sequence, as the planner sees it
    rows = []
    for t in tiles:
        fwd = statistics.median(times[(False, t)]) * 1e3
        both = statistics.median(times[(True, t)]) * 1e3
        tile = (t or L, t or L)
        rows.append({
            "tile": t, "forward_ms": round(fwd, 1), "backward_ms": round(both - fwd, 1),
            "cost_forward": fused.causal_cost(one, tile, False), "cost_backward": fused.causal_cost(one, tile, True),
        })
    chosen = [None if c is None or c[0] >= L else c[0] for c in (plan.chunk_size, plan.backward_chunk_size)]
    return {"sequences": len(lengths), "rows": rows, "chosen_forward": chosen[0], "chosen_backward": chosen[1]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lengths", default="256,384,512,640,768,1024")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    report: Dict[str, object] = {
        "machine": f"{platform.processor() or platform.machine()}, {args.threads} threads",
        "torch": torch.__version__, "rounds": args.rounds, "cases": {},
    }
    for L in (int(x) for x in args.lengths.split(",")):
        case = _case(L, args.rounds)
        report["cases"][str(L)] = case  # type: ignore[index]
        whole = case["rows"][0]  # type: ignore[index]
        print(f"{L} tokens x {case['sequences']}: chosen forward {case['chosen_forward'] or 'whole'}, "
              f"backward {case['chosen_backward'] or 'whole'}")
        for r in case["rows"]:  # type: ignore[attr-defined]
            print(f"  tiles {r['tile'] or 'whole'!s:>5s}: forward {r['forward_ms']:7.1f} ms "
                  f"({r['forward_ms'] / whole['forward_ms']:.2f}x whole, cost {r['cost_forward'] / whole['cost_forward']:.2f}x)"
                  f"  backward {r['backward_ms']:7.1f} ms ({r['backward_ms'] / whole['backward_ms']:.2f}x, "
                  f"cost {r['cost_backward'] / whole['cost_backward']:.2f}x)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
