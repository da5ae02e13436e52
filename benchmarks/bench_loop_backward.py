"""The backward's C++ loop (``backward_segment_bf16``): bfloat16 forward + backward through the
tiles against the fused kernel and SDPA, in interleaved rounds.

    python benchmarks/bench_loop_backward.py [--rounds 7] [--out docs/benchmarks/loop-backward.json]
    python benchmarks/bench_loop_backward.py --accuracy [--out docs/benchmarks/loop-backward-accuracy.json]

Each round runs every implementation once (``backend="matmul"``, ``backend="fused"``,
``F.scaled_dot_product_attention``), in a shuffled order; the medians and their ratios are
printed per shape. The tiles run the loops where the native kernel is built with them
(``subquad build`` on a CPU with AVX512-BF16; the machine line says which). To compare the
per-tile backward, point ``SUBQUAD_NATIVE_DIR`` at a build of a kernel without the backward loop
(subquad 3dd1e01 or older), pass ``--per-tile-backward`` (the same build, the backward loop
off), or run with ``SUBQUAD_NATIVE=off`` for the eager passes.

``--accuracy`` times nothing: it prints the gradients' largest and mean errors against a float64
reference for the backward loop, the per-tile backward, the fused kernel and SDPA, all in
bfloat16, over calls with awkward sizes, causal masks and a float mask.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

import subquad

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import machine

SHAPES = [
    # (B, H, L, E), causal
    ((1, 4, 2048, 64), False),
    ((1, 8, 2048, 64), True),
    ((4, 8, 1024, 40), False),
    ((2, 8, 1024, 128), False),
]


def _calls(shape, causal) -> Dict[str, Callable[[], None]]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(3))
    d_out = torch.randn(shape, generator=g).to(torch.bfloat16)

    def run(fn):
        def call():
            fn().backward(d_out)
            for t in (q, k, v):
                t.grad = None

        return call

    return {
        "tiles": run(lambda: subquad.attention(q, k, v, is_causal=causal, backend="matmul")),
        "fused": run(lambda: subquad.attention(q, k, v, is_causal=causal, backend="fused")),
        "sdpa": run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)),
    }


ACCURACY_CASES = [
    # (B, H, L, E), causal, float mask
    ((1, 4, 1024, 64), False, False),
    ((2, 4, 512, 64), True, False),
    ((1, 8, 768, 40), False, True),
    ((2, 2, 300, 128), False, False),
    ((1, 4, 513, 96), True, False),
]


def accuracy() -> Dict[str, object]:
    """Each gradient's largest and mean error against float64, per implementation."""
    from subquad._backends import matmul

    with_loop = matmul.backward_kernel
    results: Dict[str, object] = {}
    for shape, causal, masked in ACCURACY_CASES:
        g = torch.Generator().manual_seed(1)
        q, k, v, d_out = (torch.randn(shape, generator=g) * s for s in (1.5, 1.5, 1.0, 1.0))
        mask = torch.randn(shape[-2], shape[-2], generator=g) if masked else None
        ref = [t.double().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(
            *ref, attn_mask=None if mask is None else mask.double(), is_causal=causal
        ).backward(d_out.double())
        row: Dict[str, object] = {}
        for name in ("loop", "per-tile", "fused", "sdpa"):
            matmul.backward_kernel = with_loop if name != "per-tile" else (lambda inp, grads=None: None)  # type: ignore[assignment]
            xs = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
            m = None if mask is None else mask.to(torch.bfloat16)
            if name == "sdpa":
                out = F.scaled_dot_product_attention(*xs, attn_mask=m, is_causal=causal)
            else:
                backend = "fused" if name == "fused" else "matmul"
                out = subquad.attention(*xs, attn_mask=m, is_causal=causal, backend=backend)
            out.backward(d_out.to(torch.bfloat16))
            errors = {f"d{n}": (x.grad.double() - r.grad).abs() for n, x, r in zip("qkv", xs, ref)}
            row[name] = {n: {"max": float(e.max()), "mean": float(e.mean())} for n, e in errors.items()}
        matmul.backward_kernel = with_loop  # type: ignore[assignment]
        label = f"{'x'.join(map(str, shape))}{' causal' if causal else ''}{' mask' if masked else ''}"
        results[label] = row
        print(label)
        for n in ("dq", "dk", "dv"):
            cells = "  ".join(f"{impl} {row[impl][n]['max']:.2e}/{row[impl][n]['mean']:.2e}" for impl in row)  # type: ignore[index]
            print(f"  {n} max/mean: {cells}")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--per-tile-backward", action="store_true", help="the backward loop off: the per-tile kernel")
    ap.add_argument("--accuracy", action="store_true", help="the gradients' errors against float64, not times")
    args = ap.parse_args()
    from subquad import _native
    from subquad._backends import matmul

    if args.accuracy:
        print(f"# {dict(machine(), native_kernel=_native.status())}")
        errors = accuracy()
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"machine": dict(machine(), native_kernel=_native.status()), "errors": errors}, f, indent=1)
        return

    if args.per_tile_backward:
        matmul.backward_kernel = lambda inp, grads=None: None  # type: ignore[assignment]

    results: Dict[str, object] = {
        "machine": dict(machine(), native_kernel=_native.status()),
        "backward": "per-tile kernel" if args.per_tile_backward else "the loop where it runs",
        "shapes": {},
    }
    print(f"# {results['machine']}; backward: {results['backward']}")
    for shape, causal in SHAPES:
        calls = _calls(shape, causal)
        for fn in calls.values():
            fn()  # warm-up
        times: Dict[str, List[float]] = {n: [] for n in calls}
        for _ in range(args.rounds):
            order = list(calls)
            random.shuffle(order)
            for n in order:
                t0 = time.perf_counter()
                calls[n]()
                times[n].append((time.perf_counter() - t0) * 1e3)
        med = {n: statistics.median(ts) for n, ts in times.items()}
        label = f"{'x'.join(map(str, shape))}{' causal' if causal else ''}"
        ratios = {"tiles / fused": med["tiles"] / med["fused"], "tiles / sdpa": med["tiles"] / med["sdpa"]}
        results["shapes"][label] = {"median_ms": med, "ms": times, "ratios": ratios}  # type: ignore[index]
        cells = "  ".join(f"{n} {m:.1f}" for n, m in med.items())
        print(
            f"{label:<22} fwd+bwd ms: {cells}  tiles/fused {ratios['tiles / fused']:.2f}  tiles/sdpa {ratios['tiles / sdpa']:.2f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
