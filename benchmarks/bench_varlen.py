"""Packed sequences: subquad.varlen_attention against a loop of per-sequence SDPA calls and
against SDPA with the dense block-diagonal mask (what a padding-free batch costs without varlen).

Implementations of one case are timed interleaved: each round runs each once, in an order that
rotates; figures are medians over rounds with the interquartile range. Peak memory is not taken
here (see the RSS grid in tests/test_planner.py for the packed budget case).

    python benchmarks/bench_varlen.py [--rounds 7] [--threads 1] [--json docs/benchmarks/data/packed/varlen-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

import subquad


def packed(lengths: List[int], H: int, E: int, grad: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(int(cu[-1]), H, E, generator=g).requires_grad_(grad) for _ in range(3))
    return q, k, v, cu


def block_diagonal(lengths: List[int], causal: bool) -> torch.Tensor:
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    keep = ids.view(-1, 1) == ids.view(1, -1)
    if causal:
        keep &= torch.ones_like(keep).tril()
    return keep


def impls(
    lengths: List[int], H: int, E: int, causal: bool, backward: bool, dense: bool
) -> Dict[str, Callable[[], None]]:
    q, k, v, cu = packed(lengths, H, E, backward)

    def step(f: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            out = f()
            if backward:
                out.backward(torch.ones_like(out))
                for t in (q, k, v):
                    t.grad = None

        return run

    def loop() -> torch.Tensor:
        # split, not slicing: the backward of a slice writes a gradient of the whole packed tensor
        # per sequence (quadratic in the count), split's backward concatenates once
        return torch.cat(
            [
                F.scaled_dot_product_attention(
                    qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), is_causal=causal
                ).transpose(0, 1)
                for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths))
            ]
        )

    out = {
        "subquad.varlen_attention": step(lambda: subquad.varlen_attention(q, k, v, cu, cu, is_causal=causal)),
        "per-sequence SDPA loop": step(loop),
    }
    if dense:
        mask = block_diagonal(lengths, causal)
        out["SDPA, dense block-diagonal mask"] = step(
            lambda: F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
            ).transpose(0, 1)
        )
    return out


def interleaved(fns: Dict[str, Callable[[], None]], rounds: int) -> Dict[str, Dict[str, object]]:
    result: Dict[str, Dict[str, object]] = {}
    for n, f in list(fns.items()):
        try:
            f()  # warm-up
        except RuntimeError as e:  # an out-of-memory is a result, not a crash
            if "can't allocate memory" not in str(e) and "out of memory" not in str(e).lower():
                raise
            result[n] = {"status": "oom", "reason": str(e).splitlines()[0][:200]}
            del fns[n]
    names = list(fns)
    times: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            fns[n]()
            times[n].append((time.perf_counter() - t0) * 1e3)
    for n, ts in times.items():
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        result[n] = {"status": "ok", "median_ms": statistics.median(ts), "iqr_ms": [q[0], q[2]], "rounds": len(ts)}
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json")
    p.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: torch's); 1 keeps a shared machine's "
        "OpenMP oversubscription out of thousands of tiny kernels",
    )
    p.add_argument("--only", help="run the cases whose name contains this text; with --json, merged into the file")
    p.add_argument(
        "--skip-dense",
        action="store_true",
        help="leave out SDPA with the dense block-diagonal mask "
        "(seconds per call, and its gigabytes thrash the caches of the calls timed beside it)",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = torch.Generator().manual_seed(0)
    cases = {
        "16 x 512 causal, 8x64 fp32, fwd+bwd": dict(
            lengths=[512] * 16, H=8, E=64, causal=True, backward=True, dense=True
        ),
        "1024 sequences of 1-64 tokens, 8x64 fp32, fwd": dict(
            lengths=torch.randint(1, 65, (1024,), generator=rng).tolist(),
            H=8,
            E=64,
            causal=False,
            backward=False,
            dense=True,
        ),
        "1024 sequences of 1-64 tokens, 1x64 fp32, fwd": dict(
            lengths=torch.randint(1, 65, (1024,), generator=rng).tolist(),
            H=1,
            E=64,
            causal=False,
            backward=False,
            dense=True,
        ),
        "1024 sequences of 1-64 tokens, causal, 8x64 fp32, fwd+bwd": dict(
            lengths=torch.randint(1, 65, (1024,), generator=rng).tolist(),
            H=8,
            E=64,
            causal=True,
            backward=True,
            dense=False,
        ),
    }
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "cases": {},
    }
    if args.only and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            report["cases"] = json.load(f)["cases"]
    for name, case in cases.items():
        if args.only and args.only not in name:
            continue
        if args.skip_dense:
            case = {**case, "dense": False}
        rounds = args.rounds if not case["dense"] or sum(case["lengths"]) <= 8192 else 3
        res = interleaved(impls(**case), rounds)
        base = res["per-sequence SDPA loop"]["median_ms"]
        print(f"{name}  (total {sum(case['lengths'])} tokens)")
        for impl, r in res.items():
            if r["status"] != "ok":
                print(f"  {impl:34s} {r['status']}: {r['reason']}")
                continue
            r["vs_loop"] = r["median_ms"] / base
            print(
                f"  {impl:34s} {r['median_ms']:10.1f} ms  IQR [{r['iqr_ms'][0]:.1f}, {r['iqr_ms'][1]:.1f}]  {r['vs_loop']:.2f}x the loop"
            )
        report["cases"][name] = res
        if args.json:  # after every case: a long run that is stopped keeps what it measured
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
