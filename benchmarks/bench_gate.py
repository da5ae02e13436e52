"""The ``--compare`` gate on this machine: back-to-back runs of the same code must pass
``--fail-if-regression 10``, and a real slowdown must still be caught.

Runs ``subquad bench`` (in this process, through ``subquad.bench.cli.main``) ``--runs`` times
with the same arguments, each run compared with the one before under ``--fail-if-regression
PCT``; then once more with one implementation made slower by ``--slowdown`` (each of its calls
sleeps that fraction of its own time), compared with the last run. Prints and records each run's
exit status and its comparison summary.

    python benchmarks/bench_gate.py --runs 6 --out /tmp/gate -- --preset quick
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
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


def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(argv)
    return status, out.getvalue()


def _summary(text: str) -> list[str]:
    keep = ("compared", "regression", "nothing compared", "different", "machine")
    return [line.strip() for line in text.splitlines() if any(k in line for k in keep)][:8]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=6, help="identical runs (runs - 1 comparisons)")
    p.add_argument("--pct", type=float, default=10.0)
    p.add_argument("--slow", default="subquad-fused", help="the implementation to slow down in the last run")
    p.add_argument("--slowdown", type=float, default=0.3)
    p.add_argument("--out", required=True)
    p.add_argument("--json")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the arguments of subquad bench")
    args = p.parse_args()
    bench = [a for a in args.bench if a != "--"] + ["--plain"]
    record: dict = {"bench": bench, "pct": args.pct, "runs": []}
    previous = None
    for i in range(args.runs + 1):
        slowed = i == args.runs
        out = os.path.join(args.out, f"run{i}" + ("-slowed" if slowed else ""))
        argv = [*bench, "--out", out]
        if previous:
            argv += ["--compare", os.path.join(previous, "results.json"), "--fail-if-regression", f"{args.pct:g}"]
        original = impls.IMPLS[args.slow]
        if slowed:
            impls.IMPLS[args.slow] = _slowed(original, args.slowdown)
        try:
            start = time.perf_counter()
            status, text = _run(argv)
        finally:
            impls.IMPLS[args.slow] = original
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
