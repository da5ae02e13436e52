"""The tiles' C++ loops against the fused kernel, by call size (what ``auto`` decides on).

    subquad build
    python benchmarks/bench_loop_sizes.py [--json docs/benchmarks/data/loops/loop-sizes.json]
    python benchmarks/bench_loop_sizes.py --backward [--json docs/benchmarks/data/loops/loop-sizes-backward.json]
    python benchmarks/bench_loop_sizes.py --dtype float32 [--json docs/benchmarks/data/loops/loop-sizes-float32.json]

Inference calls (bfloat16 unless ``--dtype`` says float32 or float16), each through the full path
with the backend forced: ``backend="matmul"`` (the loop, where the native kernel was built for
AVX512-BF16, or AVX512F for float32 and float16) and ``backend="fused"``, in ``--rounds`` rounds
(2 unless said) of 9 calls each (5 at 4096 rows) after two warm-up calls, the two backends'
order alternating from round to round; the figures are the best round's median per backend and
the per-round ratio, median [min-max]. Shapes: 1x8xLx64 for L = 16 ... 4096, causal 1024, a
decode step (32 query heads on 8 key heads, 512 keys), Stable Diffusion 1.5's self-attention at
512x512 (4x8x4096x40) and its cross-attention (2x10x4096x64 against 77 keys). ``--cases hosts``
times what a Stable Diffusion host runs per step instead (:data:`HOST_CASES`), ``--cases
head-dims`` wide heads (:data:`HEAD_DIM_CASES`).
``auto:`` is the backend ``explain()`` chooses (this CPU's calibration decides: the first call
runs it, about a second per dtype and direction), and ``auto/best`` its time over the faster
backend's, from the per-round ratios (1.00: it chose the faster). The fallback thresholds
(``loop_choice.LOOP_BEFORE_FUSED_SCORES`` ...) were read off these on one CPU.
``--backward`` times forward + backward (the backward loop where it runs), without the decode
step. ``--cases training-mods`` times causal 1x4x2048x64 forward + backward with a soft cap, ALiBi
and a causal window of 256 (``backend="auto"``) against plain causal on the fused kernel, and
prints ``explain()``'s prediction over the measured time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

import torch

import subquad
from subquad import _native

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import machine

CASES = [
    # (name, query shape, key/value shape, causal, enable_gqa)
    ("decode 1x32x1x128, 8 kv heads x 512", (1, 32, 1, 128), (1, 8, 512, 128), False, True),
    ("1x8x16x64", (1, 8, 16, 64), (1, 8, 16, 64), False, False),
    ("1x8x128x64", (1, 8, 128, 64), (1, 8, 128, 64), False, False),
    ("1x8x256x64", (1, 8, 256, 64), (1, 8, 256, 64), False, False),
    ("1x8x512x64", (1, 8, 512, 64), (1, 8, 512, 64), False, False),
    ("1x8x1024x64", (1, 8, 1024, 64), (1, 8, 1024, 64), False, False),
    ("1x8x2048x64", (1, 8, 2048, 64), (1, 8, 2048, 64), False, False),
    ("1x8x4096x64", (1, 8, 4096, 64), (1, 8, 4096, 64), False, False),
    ("1x8x1024x64 causal", (1, 8, 1024, 64), (1, 8, 1024, 64), True, False),
    ("SD 1.5 self 4x8x4096x40", (4, 8, 4096, 40), (4, 8, 4096, 40), False, False),
    ("SD 1.5 cross 2x10x4096x64, 77 keys", (2, 10, 4096, 64), (2, 10, 77, 64), False, False),
]

# ``--cases hosts``: what a Stable Diffusion host on a CPU runs per image step, at batch 2
# (classifier-free guidance): the UNet's self- and cross-attention (77 text tokens) at each of
# its resolutions, and the VAE decoder's one-head attention over the latent's pixels.
HOST_CASES = [
    ("SD 1.5 self 2x8x4096x40", (2, 8, 4096, 40), (2, 8, 4096, 40), False, False),
    ("SD 1.5 self 2x8x1024x80", (2, 8, 1024, 80), (2, 8, 1024, 80), False, False),
    ("SD 1.5 self 2x8x256x160", (2, 8, 256, 160), (2, 8, 256, 160), False, False),
    ("SD 1.5 cross 2x8x4096x40, 77 keys", (2, 8, 4096, 40), (2, 8, 77, 40), False, False),
    ("SD 1.5 cross 2x8x1024x80, 77 keys", (2, 8, 1024, 80), (2, 8, 77, 80), False, False),
    ("SD 1.5 cross 2x8x256x160, 77 keys", (2, 8, 256, 160), (2, 8, 77, 160), False, False),
    ("SDXL self 2x10x4096x64", (2, 10, 4096, 64), (2, 10, 4096, 64), False, False),
    ("SDXL self 2x20x1024x64", (2, 20, 1024, 64), (2, 20, 1024, 64), False, False),
    ("SDXL cross 2x10x4096x64, 77 keys", (2, 10, 4096, 64), (2, 10, 77, 64), False, False),
    ("SDXL cross 2x20x1024x64, 77 keys", (2, 20, 1024, 64), (2, 20, 77, 64), False, False),
    ("VAE 1x1x1024x512 (256 px)", (1, 1, 1024, 512), (1, 1, 1024, 512), False, False),
    ("VAE 1x1x4096x512 (512 px)", (1, 1, 4096, 512), (1, 1, 4096, 512), False, False),
    ("LLM prefill 1x32x2048x128 causal, 8 kv heads", (1, 32, 2048, 128), (1, 8, 2048, 128), True, True),
]

# ``--cases head-dims``: wide heads at 2^24-2^25 scores (where float32 leaves the loops).
HEAD_DIM_CASES = [
    ("1x8x2048x128", (1, 8, 2048, 128), (1, 8, 2048, 128), False, False),
    ("2x8x1024x160", (2, 8, 1024, 160), (2, 8, 1024, 160), False, False),
    ("1x4x2048x256", (1, 4, 2048, 256), (1, 4, 2048, 256), False, False),
    ("1x1x4096x256", (1, 1, 4096, 256), (1, 1, 4096, 256), False, False),
    ("1x2x4096x384", (1, 2, 4096, 384), (1, 2, 4096, 384), False, False),
    ("1x1x4096x512", (1, 1, 4096, 512), (1, 1, 4096, 512), False, False),
]
SETS = {"sizes": CASES, "hosts": HOST_CASES, "head-dims": HEAD_DIM_CASES, "training-mods": []}


def _training_mods(dtype: torch.dtype, rounds: int) -> List[Dict[str, Any]]:
    """Causal 1x4x2048x64 forward + backward: each callback through ``auto`` over plain causal on
    the fused kernel, per-round ratios, and explain()'s prediction over the measured time."""
    from subquad import mods

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 2048, 64, generator=g).to(dtype).requires_grad_() for _ in range(3))
    d_out = torch.randn(q.shape, generator=g).to(dtype)
    variants: Dict[str, Dict[str, Any]] = {
        "plain causal, fused": dict(is_causal=True, backend="fused"),
        "soft cap 30": dict(is_causal=True, score_mod=lambda s, b, h, qi, ki: 30.0 * torch.tanh(s / 30.0)),
        "ALiBi": dict(is_causal=True, score_mod=mods.alibi(4)),
        "causal window 256": dict(mask_mod=mods.sliding_window(256, causal=True)),
    }

    def run(kw: Dict[str, Any]) -> Callable[[], None]:
        def call() -> None:
            subquad.attention(q, k, v, **kw).backward(d_out)
            for t in (q, k, v):
                t.grad = None

        return call

    plans = {n: subquad.explain(q, k, v, **kw) for n, kw in variants.items()}
    calls = {n: run(kw) for n, kw in variants.items()}
    for fn in calls.values():
        fn(), fn()
    per_round: Dict[str, List[float]] = {n: [] for n in calls}
    for r in range(rounds):
        order = list(calls) if r % 2 == 0 else list(reversed(list(calls)))
        for n in order:
            per_round[n].append(_median_ms(calls[n], 5))
    base = per_round["plain causal, fused"]
    rows = []
    for n in calls:
        ratios = [t / b for t, b in zip(per_round[n], base)]
        ms = statistics.median(per_round[n])
        plan = plans[n]
        pred = plan.predicted_seconds
        rows.append(
            dict(
                case=n,
                backend=plan.backend,
                ms=ms,
                ratios=ratios,
                predicted_over_measured=None if pred is None else pred * 1e3 / ms,
            )
        )
        extra = "" if pred is None else f"  explain predicted/measured {pred * 1e3 / ms:.2f}"
        print(
            f"{n:<22} {plan.backend:<7} {ms:8.1f} ms  over plain causal fused: {statistics.median(ratios):.2f} "
            f"[{min(ratios):.2f}-{max(ratios):.2f}]{extra}"
        )
    return rows


def _median_ms(fn: Callable[[], Any], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, gqa: bool, backend: str
) -> Callable[[], Any]:
    return lambda: subquad.attention(q, k, v, is_causal=causal, enable_gqa=gqa, backend=backend)


def _train(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, gqa: bool, backend: str
) -> Callable[[], Any]:
    d_out = torch.randn(q.shape).to(q.dtype)

    def call() -> None:
        subquad.attention(q, k, v, is_causal=causal, enable_gqa=gqa, backend=backend).backward(d_out)
        for t in (q, k, v):
            t.grad = None

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    ap.add_argument("--backward", action="store_true", help="forward + backward, not inference")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--rounds", type=int, default=2, help="rounds per case, the backends alternating")
    ap.add_argument(
        "--cases",
        default="sizes",
        choices=tuple(SETS),
        help="sizes: by call size; hosts: Stable Diffusion's; head-dims: wide heads",
    )
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.cases == "training-mods":
        rows_ = _training_mods(dtype, max(args.rounds, 3))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "machine": machine(),
                        "torch_threads": torch.get_num_threads(),
                        "dtype": args.dtype,
                        "cases": args.cases,
                        "rows": rows_,
                    },
                    f,
                    indent=1,
                )
        return
    kernel = _native.tile_kernel()
    loop = "forward_segment_bf16" if dtype == torch.bfloat16 else "forward_segment_f32"
    if kernel is None or not hasattr(kernel, loop):
        raise SystemExit(f"the native kernel's forward loop is not available: {_native.status()}")
    rows: List[Dict[str, Any]] = []
    g = torch.Generator().manual_seed(0)
    for name, sq, skv, causal, gqa in SETS[args.cases]:
        if args.backward and sq[2] == 1:
            continue  # a decode step needs no gradient
        q = torch.randn(sq, generator=g).to(dtype).requires_grad_(args.backward)
        k, v = (torch.randn(skv, generator=g).to(dtype).requires_grad_(args.backward) for _ in range(2))
        make = _train if args.backward else _call
        calls = {b: make(q, k, v, causal, gqa, b) for b in ("matmul", "fused")}
        n = 5 if sq[2] >= 4096 else 9
        best: Dict[str, float] = {}
        ratios: List[float] = []
        for fn in calls.values():
            fn(), fn()
        for r in range(args.rounds):
            med: Dict[str, float] = {}
            for b, fn in calls.items() if r % 2 == 0 else reversed(list(calls.items())):
                med[b] = _median_ms(fn, n)
                best[b] = min(best.get(b, float("inf")), med[b])
            ratios.append(med["matmul"] / med["fused"])
        scores = sq[0] * sq[1] * sq[2] * skv[2]
        auto = subquad.explain(q, k, v, is_causal=causal, enable_gqa=gqa).backend
        ratio = (statistics.median(ratios), min(ratios), max(ratios))
        auto_best = max(ratio[0], 1.0) if auto == "matmul" else max(1.0 / ratio[0], 1.0)
        rows.append(
            dict(
                case=name,
                scores=scores,
                loop_ms=best["matmul"],
                fused_ms=best["fused"],
                ratios=ratios,
                auto=auto,
                auto_over_best=auto_best,
            )
        )
        print(
            f"{name:<38} {scores:>11,} scores  loop {best['matmul']:8.3f} ms  fused {best['fused']:8.3f} ms"
            f"  loop/fused {best['matmul'] / best['fused']:5.2f}"
            f"  per round {ratio[0]:.2f} [{ratio[1]:.2f}-{ratio[2]:.2f}]  auto: {auto}  auto/best {auto_best:.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            mode = "forward + backward" if args.backward else "inference"
            json.dump(
                {
                    "machine": machine(),
                    "torch_threads": torch.get_num_threads(),
                    "mode": mode,
                    "dtype": args.dtype,
                    "cases": args.cases,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
