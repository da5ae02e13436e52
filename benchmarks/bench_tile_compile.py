"""Would ``torch.compile`` speed up the elementwise work of a bfloat16 tile? (issue 29)

    python benchmarks/bench_tile_compile.py [--shape 8 256 512] [--dynamic] [--passes]

The work between a tile's two products, as ``subquad``'s ``matmul`` backend runs it eagerly
(the product's bfloat16 result widened to float32, the rows' maximum, ``exp2`` relative to it,
the row sums, ``p`` cast to bfloat16 for its product with v), against the same work written as
two compiled functions (the rows' maximum; then ``exp2``, the row sums and the cast in one).
Prints the first compile's cost, a second tile width's, the median time per tile of each, and
how far the two results are apart. Needs a C++ compiler (inductor on CPU).

``--passes`` times each pass of the tile on its own instead (the tile in the cache): eager on
the float32 copy as the backend runs them, the same passes eager on the bfloat16 tile itself,
inductor's compiled rows' maximum, ``exp2``-and-cast and row sums, and the product with v with
``Ev`` and ``Ev + 1`` columns (a column of ones would give the row sums from the GEMM).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Tuple

import torch
from torch import Tensor

LOG2E = 1.4426950408889634


def eager(r: Tensor, s: Tensor, p_h: Tensor, off: Tensor, m_run: Tensor) -> Tuple[Tensor, Tensor]:
    s.copy_(r)
    m_tile = s.amax(dim=-1).add_(off.squeeze(-1))
    m_new = torch.maximum(m_run, m_tile)
    p = s.sub_(m_new.unsqueeze(-1) - off).mul_(LOG2E).exp2_()
    row_sums = p.sum(dim=-1)
    p_h.copy_(p)
    return m_new, row_sums


def row_max(r: Tensor, off: Tensor) -> Tensor:
    return r.float().amax(dim=-1) + off.squeeze(-1)


def probabilities(r: Tensor, ref: Tensor) -> Tuple[Tensor, Tensor]:
    p = torch.exp2((r.float() - ref) * LOG2E)
    return p.to(torch.bfloat16), p.sum(dim=-1)


def _median_us(fn: Callable[[], object], n: int = 50) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _body(r: Tensor, off: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    rf = r.float()
    m = rf.amax(dim=-1, keepdim=True) + off
    p = torch.exp2(rf - (m - off))
    return m, p.sum(dim=-1), p.to(torch.bfloat16)


def _eager_body(r: Tensor, s: Tensor, p_h: Tensor, off: Tensor) -> Tuple[Tensor, Tensor]:
    s.copy_(r)
    m = s.amax(dim=-1, keepdim=True).add_(off)
    p = s.sub_(m - off).exp2_()
    row_sums = p.sum(dim=-1)
    p_h.copy_(p)
    return m, row_sums


def passes(bh: int, qn: int, kn: int, ev: int = 64) -> None:
    """Each pass of a tile timed alone, in us (medians of 100, the tile in the cache)."""
    g = torch.Generator().manual_seed(0)
    r = (torch.randn(bh, qn, kn, generator=g) * 3).to(torch.bfloat16)
    d = torch.randn(bh, qn, 1, generator=g)
    s, p_h, r2 = torch.empty(bh, qn, kn), torch.empty_like(r), r.clone()
    v = torch.randn(bh, kn, ev, generator=g).to(torch.bfloat16)
    v_ones = torch.cat([v, torch.ones(bh, kn, 1, dtype=v.dtype)], dim=-1)
    c_max = torch.compile(lambda x: x.float().amax(dim=-1))
    c_exp = torch.compile(lambda x, y: torch.exp2(x.float() - y).to(torch.bfloat16))
    c_sum = torch.compile(lambda x: x.float().sum(dim=-1))
    c_body = torch.compile(_body)
    c_max(r), c_exp(r, d), c_sum(r), c_body(r, d)
    rows = {
        "eager float32: conversion from bf16": lambda: s.copy_(r),
        "eager float32: amax": lambda: s.amax(dim=-1),
        "eager float32: subtract a column": lambda: s.sub_(d),
        "eager float32: exp2": lambda: s.exp2_(),
        "eager float32: sum": lambda: s.sum(dim=-1),
        "eager float32: cast to bf16": lambda: p_h.copy_(s),
        "eager bf16: amax": lambda: r2.amax(dim=-1),
        "eager bf16: subtract a bf16 column": lambda: r2.sub_(d.to(torch.bfloat16)),
        "eager bf16: exp2": lambda: r2.exp2_(),
        "eager bf16: sum in float32": lambda: r2.sum(dim=-1, dtype=torch.float32),
        "compiled: rows' maximum of the bf16 tile": lambda: c_max(r),
        "compiled: exp2 and cast, one pass": lambda: c_exp(r, d),
        "compiled: row sums of the bf16 tile": lambda: c_sum(r),
        "compiled: maximum, exp2, sums and cast in one function": lambda: c_body(r, d),
        "eager float32: the same body (conversion to cast)": lambda: _eager_body(r, s, p_h, d),
        f"bf16 product with v, {ev} columns": lambda: torch.bmm(p_h, v),
        f"bf16 product with v and ones, {ev + 1} columns": lambda: torch.bmm(p_h, v_ones),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, tile {bh}x{qn}x{kn}: us per pass")
    for name, fn in rows.items():
        r2.copy_(r)
        print(f"{_median_us(fn, 100):8.0f}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=3, default=(8, 256, 512), help="batch x heads, query rows, keys")
    ap.add_argument("--dynamic", action="store_true", help="compile with dynamic shapes")
    ap.add_argument("--passes", action="store_true", help="time each pass of a tile on its own")
    args = ap.parse_args()
    bh, qn, kn = args.shape
    if args.passes:
        passes(bh, qn, kn)
        return
    g = torch.Generator().manual_seed(0)
    r = torch.randn(bh, qn, kn, generator=g).to(torch.bfloat16)
    off, m_run = torch.randn(bh, qn, 1, generator=g), torch.randn(bh, qn, generator=g)
    c_max = torch.compile(row_max, dynamic=args.dynamic)
    c_probs = torch.compile(probabilities, dynamic=args.dynamic)
    t0 = time.perf_counter()
    c_probs(r, off)
    c_max(r, off)
    first = time.perf_counter() - t0
    narrow = r[..., : kn // 2 + 1].contiguous()
    t0 = time.perf_counter()
    c_probs(narrow, off)
    c_max(narrow, off)
    second = time.perf_counter() - t0
    s = torch.empty(bh, qn, kn)
    p_h = torch.empty(bh, qn, kn, dtype=torch.bfloat16)

    def compiled() -> Tuple[Tensor, Tensor]:
        m_new = torch.maximum(m_run, c_max(r, off))
        return c_probs(r, m_new.unsqueeze(-1) - off)

    eager_us = _median_us(lambda: eager(r, s, p_h, off, m_run))
    compiled_us = _median_us(compiled)
    _, sums_e = eager(r, s, p_h, off, m_run)
    p_c, sums_c = compiled()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, tile {bh}x{qn}x{kn}, dynamic={args.dynamic}")
    print(f"first compile {first:.1f} s; a second tile width {second:.2f} s")
    print(f"per tile: eager {eager_us:.0f} us, compiled {compiled_us:.0f} us")
    print(
        f"p max |diff| {(p_h.float() - p_c.float()).abs().max().item():.2e}, "
        f"row sums max relative diff {((sums_e - sums_c).abs() / sums_e).max().item():.2e}"
    )


if __name__ == "__main__":
    main()
