"""Before/after timing of a code change on the per-call paths: two source trees, interleaved.

Each round starts one fresh process per tree (alternating which goes first), and each process
times the same calls on one thread: a decode step, a tiny call and plain forwards (whole input,
and tiles under a budget), with and without gradients. Reported: per tree the median over rounds
of the per-call median, with the interquartile range over rounds, and the ratio after/before.

    python benchmarks/bench_layout.py BEFORE_SRC AFTER_SRC [--rounds 8] [--json out.json]

(``*_SRC``: a ``src`` directory holding a ``subquad`` package, e.g. of a ``git worktree``.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, statistics, sys, time, torch
torch.set_num_threads(1)
import subquad
g = torch.Generator().manual_seed(0)
def t(*s, grad=False): return torch.randn(*s, generator=g).requires_grad_(grad)
q1, k1, v1 = t(1, 32, 1, 128), t(1, 8, 512, 128), t(1, 8, 512, 128)
qt = t(1, 8, 16, 64)
qf, kf, vf = t(1, 8, 1024, 64), t(1, 8, 1024, 64), t(1, 8, 1024, 64)
qg, kg, vg = t(1, 4, 512, 64, grad=True), t(1, 4, 512, 64, grad=True), t(1, 4, 512, 64, grad=True)
calls = {
    "decode step, GQA 32q/8kv, 512 keys": lambda: subquad.sdpa(q1, k1, v1, enable_gqa=True),
    "tiny 1x8x16x64": lambda: subquad.sdpa(qt, qt, qt),
    "plain forward 1x8x1024x64": lambda: subquad.attention(qf, kf, vf),
    "forward in tiles 1x8x1024x64, 4 MiB": lambda: subquad.attention(qf, kf, vf, memory_budget="4MiB", chunk_size=(256, 256)),
    "causal forward+backward 1x4x512x64": lambda: subquad.attention(qg, kg, vg, is_causal=True).sum().backward(),
}
out = {}
for name, f in calls.items():
    for _ in range(20):
        f()
    per = []
    deadline = time.perf_counter() + float(sys.argv[1])
    while time.perf_counter() < deadline:
        n = 20
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        per.append((time.perf_counter() - t0) / n * 1e6)
    out[name] = statistics.median(per)
print("@@" + json.dumps(out))
"""


def run(src: str, seconds: float) -> dict:
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(seconds)], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("@@"))[2:])


def quartiles(xs: list) -> tuple:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[1], q[2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--seconds", type=float, default=0.6, help="timing per call kind per process")
    p.add_argument("--json")
    args = p.parse_args()
    runs = {"before": [], "after": []}
    for r in range(args.rounds):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for tree in order:
            runs[tree].append(run(getattr(args, tree), args.seconds))
    rows = {}
    for name in runs["before"][0]:
        b = [x[name] for x in runs["before"]]
        a = [x[name] for x in runs["after"]]
        (b1, bm, b3), (a1, am, a3) = quartiles(b), quartiles(a)
        ratio = [x / y for x, y in zip(a, b)]
        r1, rm, r3 = quartiles(ratio)
        rows[name] = dict(before_us=bm, before_iqr=[b1, b3], after_us=am, after_iqr=[a1, a3], ratio=rm, ratio_iqr=[r1, r3])
        verdict = "same within noise" if r1 <= 1.0 <= r3 or (b1 <= am <= b3) or (a1 <= bm <= a3) else ("slower" if rm > 1 else "faster")
        rows[name]["verdict"] = verdict
        print(f"{name:40s} before {bm:9.1f} us [{b1:.1f}, {b3:.1f}]  after {am:9.1f} us [{a1:.1f}, {a3:.1f}]  "
              f"after/before {rm:.3f} [{r1:.3f}, {r3:.3f}]  {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rounds=args.rounds, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
