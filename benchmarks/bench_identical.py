"""The acceptance check of the interleaved verdict: two identical implementations must come out
"same within noise", case after case, run after run.

``sdpa-flash`` and a twin (the same ``Impl`` under another name) run the ``quick`` preset's
cases through ``measure.run_all`` (the interleaved rounds ``subquad bench`` uses, its timing
settings), ``--runs`` times; each case's verdict between the two is read with
``timing.compare_paired`` on the per-round times, exactly as the report does. Memory is
measured in-process (it is not what is checked here).

    python benchmarks/bench_identical.py --runs 20 --json docs/benchmarks/identical-cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from subquad.bench import cases, impls, measure, timing


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--impl", default="sdpa-flash")
    p.add_argument("--json", help="write every run's verdicts here")
    args = p.parse_args(argv)

    preset = cases.PRESETS["quick"]
    case_list = cases.preset_cases(preset, "cpu")
    original = impls.IMPLS[args.impl]
    twin = dataclasses.replace(original, name=f"{args.impl}-twin")
    runs, same_runs = [], 0
    for run in range(args.runs):
        start = time.perf_counter()
        jobs = [(impl, case) for case in case_list for impl in (original, twin)]
        results = measure.run_all(jobs, preset.timing, isolate=False)
        by_case: dict = {}
        for r in results:
            by_case.setdefault(f"{r.case} {r.mode}", {})[r.impl] = r
        verdicts = {}
        for title, pair in by_case.items():
            a, b = pair[original.name], pair[twin.name]
            if a.status != "ok" or b.status != "ok":
                verdicts[title] = f"not run: {a.status}/{b.status}"
                continue
            c = timing.compare_paired(twin.name, b.times_ms, original.name, a.times_ms)
            verdicts[title] = f"{c.verdict}: {c.describe()}"
        same = all(v.startswith(timing.SAME) for v in verdicts.values())
        same_runs += same
        runs.append({"run": run, "all_same": same, "verdicts": verdicts,
                     "seconds": time.perf_counter() - start})
        named = [f"{t}: {v}" for t, v in verdicts.items() if not v.startswith(timing.SAME)]
        print(f"run {run + 1}/{args.runs}: {'all same within noise' if same else 'WINNER NAMED'} "
              f"({time.perf_counter() - start:.0f} s)" + "".join(f"\n  {n}" for n in named), flush=True)
    print(f"{same_runs} of {args.runs} runs: every case 'same within noise' for {args.impl} vs its twin")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"impl": args.impl, "preset": "quick", "runs": runs,
                       "all_same_runs": same_runs, "device": measure.device_name("cpu")}, f, indent=1)
    return 0 if same_runs == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
