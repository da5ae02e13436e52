"""The ``--compare`` gate on this machine: back-to-back runs of the same code must pass
``--fail-if-regression 10``, and a real slowdown must still be caught.

Runs ``subquad bench`` ``--runs`` times with the same arguments, each in a fresh process as a
user would (one process for all runs let the allocator's state build up: ``naive`` slowed by 20-26%
from one run to the next), each run compared with the one before under ``--fail-if-regression
PCT``; then once more with one implementation made slower by ``--slowdown`` (each of its calls
sleeps that fraction of its own time), compared with the last run. Prints and records each run's
exit status and its comparison summary.

    python benchmarks/bench_gate.py --runs 6 --out /tmp/gate -- --preset quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

from subquad.bench import cli, impls


def _slowed(impl: impls.Impl, fraction: float) -> impls.Impl:
    def prepare(inputs):
        forward, facts = impl.prepare(inputs)

        def slow():
            start = time.perf_counter()
            out = forward()
            time.sleep(fraction * (time.perf_counter() - start))
            return out

        return slow, facts

    return dataclasses.replace(impl, prepare=prepare)


def _child(argv: list[str], slow: str, slowdown: float) -> int:
    """One ``subquad bench`` run in this (fresh) process, ``slow`` made slower when given."""
    if slow:
        impls.IMPLS[slow] = _slowed(impls.IMPLS[slow], slowdown)
    return cli.main(argv)


def _run(argv: list[str], slow: str = "", slowdown: float = 0.0) -> tuple[int, str]:
    command = [sys.executable, __file__, "--child", "--slow", slow, "--slowdown", str(slowdown), "--", *argv]
    proc = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    return proc.returncode, proc.stdout


def _summary(text: str) -> list[str]:
    keep = ("compared", "regression", "nothing compared", "different", "machine")
    return [line.strip() for line in text.splitlines() if any(k in line for k in keep)][:8]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=6, help="identical runs (runs - 1 comparisons)")
    p.add_argument("--pct", type=float, default=10.0)
    p.add_argument("--slow", default="subquad-fused", help="the implementation to slow down in the last run")
    p.add_argument("--slowdown", type=float, default=0.3)
    p.add_argument("--json")
    p.add_argument("--out", help="where the runs' results go (required)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the arguments of subquad bench")
    args = p.parse_args()
    words = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if args.child:
        return _child(words, args.slow, args.slowdown)
    if not args.out:
        p.error("--out DIR is required")
    bench = [*words, "--plain"]
    record: dict = {"bench": bench, "pct": args.pct, "runs": []}
    previous = None
    for i in range(args.runs + 1):
        slowed = i == args.runs
        out = os.path.join(args.out, f"run{i}" + ("-slowed" if slowed else ""))
        argv = [*bench, "--out", out]
        if previous:
            argv += ["--compare", os.path.join(previous, "results.json"), "--fail-if-regression", f"{args.pct:g}"]
        start = time.perf_counter()
        status, text = _run(argv, args.slow if slowed else "", args.slowdown)
        entry = {
            "run": i,
            "slowed": f"{args.slow} +{args.slowdown:.0%}" if slowed else None,
            "exit": status,
            "seconds": round(time.perf_counter() - start, 1),
            "summary": _summary(text) if previous else [],
        }
        record["runs"].append(entry)
        what = f"{args.slow} slowed by {args.slowdown:.0%}" if slowed else "identical code"
        print(f"run {i} ({what}): exit {status} in {entry['seconds']} s", flush=True)
        for line in entry["summary"]:
            print(f"    {line}", flush=True)
        if not slowed:
            previous = out
    identical = [r["exit"] for r in record["runs"][1:-1]]
    record["identical_passed"] = f"{identical.count(0)} of {len(identical)}"
    record["slowdown_caught"] = record["runs"][-1]["exit"] == 1
    print(f"identical runs passing the gate: {record['identical_passed']}; slowdown caught: {record['slowdown_caught']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
