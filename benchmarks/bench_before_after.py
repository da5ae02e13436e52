"""Before and after a change, in one interleaved run: per-call overhead, decode steps and packed
sequences, each against its peer (torch's SDPA, or a per-sequence SDPA loop), for two versions of
subquad.

The old version is taken from git (``git archive REF src``) into a temporary directory. Each
round starts one fresh process per version (their order alternates from round to round) with
that version's ``src`` first on ``sys.path``; the process times subquad and the peer interleaved
(one thread by default, as a decode step runs in a server worker; ``--threads N``) and reports, per case, the median of its
subquad/peer ratios. Both versions thus meet the same stretches of machine time, and each
ratio cancels what slows subquad and its peer alike. The figures are the medians over rounds of
those ratios, with their range, and the median of the per-round after/before ratios.

    python benchmarks/bench_before_after.py --before 23804b5 [--rounds 5] [--threads 2] [--only bf16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _cases() -> Dict[str, Callable[[], Dict[str, Callable[[], object]]]]:
    """name -> a builder of {"subquad": call, "peer": call} (built in the child)."""
    import bench_varlen
    import torch
    import torch.nn.functional as F

    import subquad

    def per_call(qs, ks, gqa):
        def build():
            g = torch.Generator().manual_seed(0)
            q = torch.randn(*qs, generator=g)
            k, v = torch.randn(*ks, generator=g), torch.randn(*ks, generator=g)
            return {
                "subquad": lambda: subquad.sdpa(q, k, v, enable_gqa=gqa),
                "peer": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa),
            }

        return build

    def packed(heads, causal, backward, lengths=None):
        def build():
            rng = torch.Generator().manual_seed(0)
            lens = lengths or torch.randint(1, 65, (1024,), generator=rng).tolist()
            fns = bench_varlen.impls(lens, heads, 64, causal, backward, dense=False)
            return {"subquad": fns["subquad.varlen_attention"], "peer": fns["per-sequence SDPA loop"]}

        return build

    # The tiles as each version runs them: the C++ loops where built (``loops`` since issue 56,
    # inside ``matmul`` before), else matmul's.
    from subquad import _native

    built = _native.tile_kernel() is not None
    tiles = "loops" if built and "loops" in getattr(subquad, "BACKENDS", ()) else "matmul"

    def dense(shape, backend, backward, dtype=torch.float32, causal=True):
        def build():
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(backward) for _ in range(3))

            def step(f):
                def run():
                    out = f()
                    if backward:
                        out.backward(torch.ones_like(out))
                        for t in (q, k, v):
                            t.grad = None

                return run

            return {
                "subquad": step(lambda: subquad.attention(q, k, v, is_causal=causal, backend=backend)),
                "peer": step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)),
            }

        return build

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    def flex(shape):
        def build():
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
            causal = lambda b, h, i, j: j <= i  # noqa: E731
            block = create_block_mask(causal, None, None, shape[2], shape[2], device="cpu")
            compiled = torch.compile(flex_attention)
            return {
                "subquad": lambda: subquad.attention(q, k, v, score_mod=softcap, mask_mod=causal),
                "peer": lambda: compiled(q, k, v, score_mod=softcap, block_mask=block),
            }

        return build

    return {
        "causal fwd 1x8x4096x64 fp32, planner (vs SDPA)": dense((1, 8, 4096, 64), "auto", False),
        "causal fwd 1x8x4096x64 fp32, tiles (vs SDPA)": dense((1, 8, 4096, 64), tiles, False),
        "fwd 1x8x4096x64 bf16, tiles (vs SDPA)": dense((1, 8, 4096, 64), tiles, False, torch.bfloat16, False),
        "fwd 1x8x4096x64 fp16, tiles (vs SDPA)": dense((1, 8, 4096, 64), tiles, False, torch.float16, False),
        "fwd 1x8x4096x64 fp32, tiles (vs SDPA)": dense((1, 8, 4096, 64), tiles, False, torch.float32, False),
        "causal fwd+bwd 1x8x2048x64 fp32, planner (vs SDPA)": dense((1, 8, 2048, 64), "auto", True),
        "causal fwd+bwd 1x8x2048x64 fp32, tiles (vs SDPA)": dense((1, 8, 2048, 64), tiles, True),
        "causal fwd+bwd 1x8x2048x64 bf16, tiles (vs SDPA)": dense((1, 8, 2048, 64), tiles, True, torch.bfloat16),
        "causal fwd 4x8x512x64 fp32, planner (vs SDPA)": dense((4, 8, 512, 64), "auto", False),
        "causal fwd+bwd 4x8x512x64 fp32, planner (vs SDPA)": dense((4, 8, 512, 64), "auto", True),
        "causal soft-cap fwd 1x4x4096x64 fp32 (vs compiled FlexAttention)": flex((1, 4, 4096, 64)),
        "tiny 1x8x16x64 (vs SDPA)": per_call((1, 8, 16, 64), (1, 8, 16, 64), False),
        "decode step, GQA 32q/8kv, 512 keys (vs SDPA)": per_call((1, 32, 1, 128), (1, 8, 512, 128), True),
        "decode step, 4096 keys (vs SDPA)": per_call((1, 32, 1, 128), (1, 8, 4096, 128), True),
        "packed 1024 x 1-64 tokens, 1 head, fwd (vs loop)": packed(1, False, False),
        "packed 1024 x 1-64 tokens, 8 heads, fwd (vs loop)": packed(8, False, False),
        "packed 1024 x 1-64 tokens, causal, 8 heads, fwd+bwd (vs loop)": packed(8, True, True),
        "packed 16 x 512 causal, 8 heads, fwd+bwd (vs loop)": packed(8, True, True, [512] * 16),
    }


def child() -> None:
    import torch

    import subquad

    torch.set_num_threads(int(os.environ.get("SUBQUAD_BENCH_THREADS", "1")))
    out: Dict[str, object] = {"subquad": subquad.__file__, "ratios": {}}
    only = os.environ.get("SUBQUAD_BENCH_ONLY", "")
    for name, build in _cases().items():
        if only not in name:
            continue
        fns = build()
        with torch.enable_grad() if "bwd" in name else torch.no_grad():
            for f in fns.values():  # warm: plans, probes, caches
                f()
                f()
            t0 = time.perf_counter()
            fns["peer"]()
            reps = max(1, min(2000, int(0.05 / max(time.perf_counter() - t0, 1e-7))))  # ~50 ms per batch
            ratios = []
            for r in range(5):
                t = {}
                for n in ("subquad", "peer") if r % 2 == 0 else ("peer", "subquad"):
                    f = fns[n]
                    start = time.perf_counter()
                    for _ in range(reps):
                        f()
                    t[n] = (time.perf_counter() - start) / reps
                ratios.append(t["subquad"] / t["peer"])
        out["ratios"][name] = statistics.median(ratios)  # type: ignore[index]
    print(json.dumps(out))


def _export(ref: str, into: str) -> str:
    archive = subprocess.run(["git", "-C", ROOT, "archive", ref, "src"], check=True, capture_output=True).stdout
    os.makedirs(into)
    path = os.path.join(into, "archive.tar")
    with open(path, "wb") as f:
        f.write(archive)
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")
    return os.path.join(into, "src")


def _run(src: str, threads: int, only: str) -> Dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, HERE]), "SUBQUAD_BENCH_THREADS": str(threads)}
    env["SUBQUAD_BENCH_ONLY"] = only
    proc = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise SystemExit(f"child for {src} failed:\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["subquad"].startswith(src), f"the child imported {report['subquad']}, not {src}"
    return report["ratios"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", help="git ref of the old version (required)")
    p.add_argument("--after", default=None, help="git ref of the new version (default: this working tree)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads in each process (default 1)")
    p.add_argument("--only", default="", help="run only the cases whose name contains this text")
    p.add_argument("--json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child()
        return 0
    if not args.before:
        p.error("--before REF is required")
    with tempfile.TemporaryDirectory() as tmp:
        versions = {"before": _export(args.before, os.path.join(tmp, "before"))}
        versions["after"] = _export(args.after, os.path.join(tmp, "after")) if args.after else os.path.join(ROOT, "src")
        rounds: Dict[str, List[Dict[str, float]]] = {"before": [], "after": []}
        for r in range(args.rounds):
            for v in ("before", "after") if r % 2 == 0 else ("after", "before"):
                rounds[v].append(_run(versions[v], args.threads, args.only))
                print(f"round {r + 1}/{args.rounds} {v} done", file=sys.stderr, flush=True)
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    report: Dict[str, object] = {
        "before": args.before,
        "after": args.after or f"working tree at {head.strip()}",
        "rounds": args.rounds,
        "how": "per round one fresh process per version (order alternating), each timing subquad and its peer "
        f"interleaved on {args.threads} thread(s); figures are subquad/peer ratios, medians over rounds [min-max]",
        "cases": {},
    }
    print(f"{'case':62s} {'before':>20s} {'after':>20s} {'after/before':>12s}")
    for name in rounds["after"][0]:
        b = [x[name] for x in rounds["before"]]
        a = [x[name] for x in rounds["after"]]
        paired = statistics.median(x / y for x, y in zip(a, b))
        report["cases"][name] = {  # type: ignore[index]
            "before": statistics.median(b),
            "before_range": [min(b), max(b)],
            "after": statistics.median(a),
            "after_range": [min(a), max(a)],
            "after_over_before": paired,
        }
        cell = lambda xs: f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"  # noqa: E731
        print(f"{name:62s} {cell(b):>20s} {cell(a):>20s} {paired:12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
