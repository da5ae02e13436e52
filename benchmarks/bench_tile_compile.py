"""Would ``torch.compile`` speed up the elementwise work of a bfloat16 tile? (issue 29)

    python benchmarks/bench_tile_compile.py [--shape 8 256 512] [--dynamic]

The work between a tile's two products, as ``subquad``'s ``matmul`` backend runs it eagerly
(the product's bfloat16 result widened to float32, the rows' maximum, ``exp2`` relative to it,
the row sums, ``p`` cast to bfloat16 for its product with v), against the same work written as
two compiled functions (the rows' maximum; then ``exp2``, the row sums and the cast in one).
Prints the first compile's cost, a second tile width's, the median time per tile of each, and
how far the two results are apart. Needs a C++ compiler (inductor on CPU).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=3, default=(8, 256, 512), help="batch x heads, query rows, keys")
    ap.add_argument("--dynamic", action="store_true", help="compile with dynamic shapes")
    args = ap.parse_args()
    bh, qn, kn = args.shape
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
