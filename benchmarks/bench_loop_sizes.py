"""The tiles' C++ loops against the fused kernel, by call size (what ``auto`` decides on), and
their accuracy against float64.

    subquad build
    python benchmarks/bench_loop_sizes.py [--json docs/benchmarks/data/loops/loop-sizes.json]
    python benchmarks/bench_loop_sizes.py --backward [--json docs/benchmarks/data/loops/loop-sizes-backward.json]
    python benchmarks/bench_loop_sizes.py --dtype float32 [--json docs/benchmarks/data/loops/loop-sizes-float32.json]
    python benchmarks/bench_loop_sizes.py --cases accuracy [--json accuracy.json]
    python benchmarks/bench_loop_sizes.py --cases build

Inference calls (bfloat16 unless ``--dtype`` says float32 or float16), each through the full path
with the backend forced: ``backend="loops"`` (where the native kernel was built for
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
step. ``--cases training-mods`` times causal 1x4x2048x64 forward + backward with a soft cap, ALiBi,
a causal window of 256, four causal documents of 512 and prefix-LM 512 (``backend="auto"``; the
last two also on the fused kernel with their bias tile) against plain causal on the fused kernel,
and prints ``explain()``'s prediction over the measured time. ``--cases products`` times the loops
on host calls with their own products against ATen's micro-kernels (oneDNN's brgemm), alternating. ``--cases loop-backward --backward`` times
the shapes the backward loop was first measured on (:data:`LOOP_BACKWARD_CASES`); ``--without-loops``
times ``backend="matmul"`` with the loops switched off instead: the tiles with the native kernel's
passes over each tile, as they ran before the loops.

``--cases accuracy`` times nothing: the errors against float64 (largest and mean absolute) of the
loops, of the same tiles without them (``"tiles, per tile"``: the native kernel's passes over each
tile, or the eager passes where it is not built) and of ``"tiles, eager passes"`` (the kernel not
used), the fused kernel and ``F.scaled_dot_product_attention``, all in ``--dtype``. Forward: 24
calls 1x4x1024x64 with scores of about 1, 4 and 16, causal or not, 4 seeds each, and the tiles'
lse; backward: the gradients of :data:`GRADIENT_CASES` (awkward sizes, causal, a float mask).
``--cases build`` times the native kernel's first build in an empty folder (a fresh process),
``subquad build`` once built, and a fresh process's first load of it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.nn.functional as F

import subquad
from subquad import _native
from subquad._backends import matmul

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
# ``--cases loop-backward`` (with ``--backward``): the shapes the backward loop was first timed on.
LOOP_BACKWARD_CASES = [
    ("1x4x2048x64", (1, 4, 2048, 64), (1, 4, 2048, 64), False, False),
    ("1x8x2048x64 causal", (1, 8, 2048, 64), (1, 8, 2048, 64), True, False),
    ("4x8x1024x40", (4, 8, 1024, 40), (4, 8, 1024, 40), False, False),
    ("2x8x1024x128", (2, 8, 1024, 128), (2, 8, 1024, 128), False, False),
]
SETS = {
    "sizes": CASES,
    "hosts": HOST_CASES,
    "head-dims": HEAD_DIM_CASES,
    "loop-backward": LOOP_BACKWARD_CASES,
    "training-mods": [],
    "products": HOST_CASES,
    "accuracy": [],
    "build": [],
}

# ``--cases accuracy``: the gradients' calls, (B, H, L, E), causal, a float mask.
GRADIENT_CASES = [
    ((1, 4, 1024, 64), False, False),
    ((2, 4, 512, 64), True, False),
    ((1, 8, 768, 40), False, True),
    ((2, 2, 300, 128), False, False),
    ((1, 4, 513, 96), True, False),
]
TILES = ("tiles, C++ loops", "tiles, per tile", "tiles, eager passes")


@contextlib.contextmanager
def _tiles(which: str) -> Iterator[str]:
    """The backend that runs the tiles as ``which`` says: the loops (``backend="loops"``, as
    built), ``matmul``'s tiles with the native kernel's passes over each tile (the loops, which
    ``matmul`` runs where they take a call, switched off), or without the native kernel (the
    eager passes)."""
    saved = dict(_native._LOADED), matmul.segment_kernel, matmul.backward_kernel
    try:
        if which != "tiles, C++ loops":
            matmul.segment_kernel = lambda inp: None  # type: ignore[assignment]
            matmul.backward_kernel = lambda inp: None  # type: ignore[assignment]
        if which == "tiles, eager passes":
            _native._LOADED["module"] = None
        yield "loops" if which == "tiles, C++ loops" else "matmul"
    finally:
        _native._LOADED.clear()
        _native._LOADED.update(saved[0])
        matmul.segment_kernel, matmul.backward_kernel = saved[1], saved[2]


def _errors(out: torch.Tensor, golden: torch.Tensor) -> Dict[str, float]:
    err = (out.double() - golden).abs()
    return {"max": float(err.max()), "mean": float(err.mean())}


def _forward_accuracy(dtype: torch.dtype) -> Dict[str, Any]:
    """24 calls 1x4x1024x64: each implementation's output (and the tiles' lse) against float64."""
    cases: List[Dict[str, Any]] = []
    for magnitude in (1.0, 2.0, 4.0):  # scores of about magnitude² (q·k / sqrt(64))
        for causal in (False, True):
            for seed in range(4):
                g = torch.Generator().manual_seed(seed)
                q, k, v = ((torch.randn(1, 4, 1024, 64, generator=g) * magnitude).to(dtype) for _ in range(3))
                q64, k64, v64 = q.double(), k.double(), v.double()
                golden = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
                s = (q64 @ k64.transpose(-1, -2)) / 8.0
                if causal:
                    s = s.masked_fill(torch.ones(1024, 1024, dtype=torch.bool).triu(1), float("-inf"))
                lse64 = torch.logsumexp(s, dim=-1)
                row: Dict[str, Any] = {"scores": magnitude**2, "causal": causal, "seed": seed}
                for name in TILES:
                    with _tiles(name) as tiled:
                        out, lse = subquad.attention(q, k, v, is_causal=causal, backend=tiled, return_lse=True)
                    row[name] = dict(_errors(out, golden), lse_max=float((lse.double() - lse64).abs().max()))
                row["fused kernel"] = _errors(subquad.attention(q, k, v, is_causal=causal, backend="fused"), golden)
                row["F.sdpa"] = _errors(F.scaled_dot_product_attention(q, k, v, is_causal=causal), golden)
                cases.append(row)
    summary: Dict[str, Dict[str, float]] = {}
    for name in TILES + ("fused kernel", "F.sdpa"):
        summary[name] = {
            "max": max(c[name]["max"] for c in cases),
            "mean": sum(c[name]["mean"] for c in cases) / len(cases),
        }
        if "lse_max" in cases[0][name]:
            summary[name]["lse_max"] = max(c[name]["lse_max"] for c in cases)
    return {"cases": cases, "summary": summary}


def _gradient_accuracy(dtype: torch.dtype) -> Dict[str, Any]:
    """Each gradient's largest and mean error against float64, per implementation and call."""
    results: Dict[str, Any] = {}
    for shape, causal, masked in GRADIENT_CASES:
        g = torch.Generator().manual_seed(1)
        q, k, v, d_out = (torch.randn(shape, generator=g) * s for s in (1.5, 1.5, 1.0, 1.0))
        mask = torch.randn(shape[-2], shape[-2], generator=g) if masked else None
        ref = [t.double().requires_grad_() for t in (q, k, v)]
        attn_mask = None if mask is None else mask.double()
        F.scaled_dot_product_attention(*ref, attn_mask=attn_mask, is_causal=causal).backward(d_out.double())
        row: Dict[str, Any] = {}
        for name in TILES + ("fused kernel", "F.sdpa"):
            xs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
            m = None if mask is None else mask.to(dtype)
            with _tiles(name) if name in TILES else contextlib.nullcontext("fused") as backend:  # the backward too
                if name == "F.sdpa":
                    out = F.scaled_dot_product_attention(*xs, attn_mask=m, is_causal=causal)
                else:
                    out = subquad.attention(*xs, attn_mask=m, is_causal=causal, backend=backend)
                out.backward(d_out.to(dtype))
            row[name] = {f"d{n}": _errors(x.grad, r.grad) for n, x, r in zip("qkv", xs, ref)}
        label = f"{'x'.join(map(str, shape))}{' causal' if causal else ''}{' float mask' if masked else ''}"
        results[label] = row
    return results


def _accuracy(dtype: torch.dtype) -> Dict[str, Any]:
    kernel = _native.tile_kernel()
    loops = kernel is not None and hasattr(
        kernel, "forward_segment_bf16" if dtype == torch.bfloat16 else "forward_segment_f32"
    )
    print(f"# native kernel: {_native.status()}")
    if not loops:
        print(f"the loops do not run here ({_native.status()}): the 'C++ loops' rows are the tiles without them")
    forward = _forward_accuracy(dtype)
    print(f"{dtype}, 24 calls 1x4x1024x64 (scores ~1, 4, 16; causal or not; 4 seeds), error against float64:")
    for name, s in forward["summary"].items():
        lse = f", lse max {s['lse_max']:.2e}" if "lse_max" in s else ""
        print(f"  {name:<20} max {s['max']:.4f}  mean {s['mean']:.2e}{lse}")
    gradients = _gradient_accuracy(dtype)
    print("gradients against float64, largest / mean error:")
    for label, row in gradients.items():
        print(f"  {label}")
        for n in ("dq", "dk", "dv"):
            cells = "  ".join(
                f"{impl.replace('tiles, ', '')} {row[impl][n]['max']:.2e}/{row[impl][n]['mean']:.2e}" for impl in row
            )
            print(f"    {n}: {cells}")
    loop, fused, sdpa = (
        [row[impl][n] for row in gradients.values() for n in ("dq", "dk", "dv")]
        for impl in ("tiles, C++ loops", "fused kernel", "F.sdpa")
    )
    below_fused = sum(a["mean"] < b["mean"] for a, b in zip(loop, fused))
    below_sdpa = sum(a["mean"] < b["mean"] for a, b in zip(loop, sdpa))
    largest = [a["max"] / b["max"] for a, b in zip(loop, fused)]
    print(
        f"the loops' mean error below the fused kernel's in {below_fused} of {len(loop)} gradients, below SDPA's "
        f"in {below_sdpa}; their largest error {min(largest):.2f}-{max(largest):.2f}x the fused kernel's"
    )
    return {"native_kernel": _native.status(), "forward": forward, "gradients": gradients}


def _build_costs() -> Dict[str, float]:
    """The native kernel's first build in an empty folder, ``subquad build`` once built, and a
    fresh process's first load, each in a fresh process."""
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
    costs = {"build_s": built, "build_again_s": again, "load_s": float(r.stdout.strip())}
    print(
        f"first build {built:.1f} s; `subquad build` once built {again:.2f} s; "
        f"a fresh process loads it in {costs['load_s'] * 1e3:.0f} ms"
    )
    return costs


def _write(path: Optional[str], record: Dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"machine": machine(), "torch_threads": torch.get_num_threads(), **record}, f, indent=1)


def _training_mods(dtype: torch.dtype, rounds: int) -> List[Dict[str, Any]]:
    """Causal 1x4x2048x64 forward + backward: each callback through ``auto`` over plain causal on
    the fused kernel, per-round ratios, and explain()'s prediction over the measured time."""
    from subquad import mods

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 2048, 64, generator=g).to(dtype).requires_grad_() for _ in range(3))
    d_out = torch.randn(q.shape, generator=g).to(dtype)
    docs = torch.arange(2048) // 512  # four packed documents
    variants: Dict[str, Dict[str, Any]] = {
        "plain causal, fused": dict(is_causal=True, backend="fused"),
        "soft cap 30": dict(is_causal=True, score_mod=lambda s, b, h, qi, ki: 30.0 * torch.tanh(s / 30.0)),
        "ALiBi": dict(is_causal=True, score_mod=mods.alibi(4)),
        "causal window 256": dict(mask_mod=mods.sliding_window(256, causal=True)),
        "documents of 512, causal": dict(mask_mod=mods.and_masks(mods.causal(), mods.document(docs))),
        "documents, fused (bias tile)": dict(
            mask_mod=mods.and_masks(mods.causal(), mods.document(docs)), backend="fused"
        ),
        "prefix-LM 512": dict(mask_mod=mods.prefix_lm(512)),
        "prefix-LM 512, fused (bias tile)": dict(mask_mod=mods.prefix_lm(512), backend="fused"),
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
            f"{n:<34} {plan.backend:<7} {ms:8.1f} ms  over plain causal fused: {statistics.median(ratios):.2f} "
            f"[{min(ratios):.2f}-{max(ratios):.2f}]{extra}"
        )
    return rows


def _products(dtype: torch.dtype, rounds: int) -> List[Dict[str, Any]]:
    """The loops (``backend="loops"``) on their own products against ATen's micro-kernels
    (``set_products``), per host call, in alternating rounds; restores the kernel's setting."""
    kernel = _native.tile_kernel()
    which = "bfloat16" if dtype == torch.bfloat16 else "float32"
    if kernel is None or not hasattr(kernel, "set_products") or not kernel.aten_products_work(which):
        raise SystemExit(f"ATen's micro-kernels do not run the {which} loops' products here")
    was = kernel.products(which) == "aten"
    rows: List[Dict[str, Any]] = []
    g = torch.Generator().manual_seed(0)
    try:
        for name, sq, skv, causal, gqa in HOST_CASES:
            q = torch.randn(sq, generator=g).to(dtype)
            k, v = (torch.randn(skv, generator=g).to(dtype) for _ in range(2))
            call = _call(q, k, v, causal, gqa, "loops")
            n = 5 if sq[2] >= 4096 else 9
            med: Dict[bool, List[float]] = {True: [], False: []}
            for aten in (True, False):
                kernel.set_products(which, aten)
                call(), call()
            for r in range(rounds):
                for aten in (True, False) if r % 2 == 0 else (False, True):
                    kernel.set_products(which, aten)
                    med[aten].append(_median_ms(call, n))
            ratios = [a / o for a, o in zip(med[True], med[False])]
            rows.append(dict(case=name, aten_ms=min(med[True]), own_ms=min(med[False]), ratios=ratios))
            print(
                f"{name:<46} ATen {min(med[True]):8.2f} ms  own {min(med[False]):8.2f} ms  ATen/own per round "
                f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
            )
    finally:
        kernel.set_products(which, was)
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


def _time_sizes(
    cases: List[Any], dtype: torch.dtype, backward: bool, rounds: int, tiled: str = "loops"
) -> List[Dict[str, Any]]:
    """The tiles (``backend=tiled``: the loops, or ``matmul``'s) against the fused kernel on each
    case, in alternating rounds."""
    rows: List[Dict[str, Any]] = []
    g = torch.Generator().manual_seed(0)
    for name, sq, skv, causal, gqa in cases:
        if backward and sq[2] == 1:
            continue  # a decode step needs no gradient
        q = torch.randn(sq, generator=g).to(dtype).requires_grad_(backward)
        k, v = (torch.randn(skv, generator=g).to(dtype).requires_grad_(backward) for _ in range(2))
        make = _train if backward else _call
        calls = {b: make(q, k, v, causal, gqa, b) for b in (tiled, "fused")}
        n = 5 if sq[2] >= 4096 else 9
        best: Dict[str, float] = {}
        ratios: List[float] = []
        for fn in calls.values():
            fn(), fn()
        for r in range(rounds):
            med: Dict[str, float] = {}
            for b, fn in calls.items() if r % 2 == 0 else reversed(list(calls.items())):
                med[b] = _median_ms(fn, n)
                best[b] = min(best.get(b, float("inf")), med[b])
            ratios.append(med[tiled] / med["fused"])
        scores = sq[0] * sq[1] * sq[2] * skv[2]
        auto = subquad.explain(q, k, v, is_causal=causal, enable_gqa=gqa).backend
        ratio = (statistics.median(ratios), min(ratios), max(ratios))
        auto_best = max(ratio[0], 1.0) if auto == tiled else max(1.0 / ratio[0], 1.0)
        rows.append(
            dict(
                case=name,
                scores=scores,
                loop_ms=best[tiled],
                fused_ms=best["fused"],
                ratios=ratios,
                auto=auto,
                auto_over_best=auto_best,
            )
        )
        print(
            f"{name:<38} {scores:>11,} scores  loop {best[tiled]:8.3f} ms  fused {best['fused']:8.3f} ms"
            f"  loop/fused {best[tiled] / best['fused']:5.2f}"
            f"  per round {ratio[0]:.2f} [{ratio[1]:.2f}-{ratio[2]:.2f}]  auto: {auto}  auto/best {auto_best:.2f}"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    ap.add_argument("--backward", action="store_true", help="forward + backward, not inference")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--rounds", type=int, default=2, help="rounds per case, the backends alternating")
    ap.add_argument(
        "--without-loops",
        action="store_true",
        help="the tiles without the C++ loops (the native kernel's passes over each tile), as before the loops",
    )
    ap.add_argument(
        "--cases",
        default="sizes",
        choices=tuple(SETS),
        help="sizes: by call size; hosts: Stable Diffusion's; head-dims: wide heads; loop-backward: the "
        "backward loop's first shapes; training-mods: callbacks in training; products: the loops on their "
        "own products against ATen's micro-kernels; accuracy: errors against "
        "float64; build: the native kernel's build and load",
    )
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.cases == "accuracy":
        print(f"# {machine()}")
        _write(args.json, {"dtype": args.dtype, "cases": args.cases, **_accuracy(dtype)})
        return
    if args.cases == "build":
        print(f"# {machine()}")
        _write(args.json, {"cases": args.cases, "first_costs": _build_costs()})
        return
    if args.cases == "products":
        print(f"# {machine()}")
        _write(args.json, {"dtype": args.dtype, "cases": args.cases, "rows": _products(dtype, max(args.rounds, 3))})
        return
    if args.cases == "training-mods":
        _write(
            args.json, {"dtype": args.dtype, "cases": args.cases, "rows": _training_mods(dtype, max(args.rounds, 3))}
        )
        return
    kernel = _native.tile_kernel()
    loop = "forward_segment_bf16" if dtype == torch.bfloat16 else "forward_segment_f32"
    if kernel is None or not hasattr(kernel, loop):
        raise SystemExit(f"the native kernel's forward loop is not available: {_native.status()}")
    tiles = "tiles, per tile" if args.without_loops else "tiles, C++ loops"
    if args.without_loops:
        print("# the tiles without the C++ loops: 'loop' below is the native kernel's passes over each tile")
    with _tiles(tiles) as tiled:
        rows = _time_sizes(SETS[args.cases], dtype, args.backward, args.rounds, tiled)
    mode = "forward + backward" if args.backward else "inference"
    _write(args.json, {"mode": mode, "dtype": args.dtype, "cases": args.cases, "tiles": tiles, "rows": rows})


if __name__ == "__main__":
    main()
