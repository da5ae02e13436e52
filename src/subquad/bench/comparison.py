"""``--compare``: a new run against a saved results.json, as a table of new/old ratios, a summary,
and the problems a ``--fail-if-regression`` gate fails on.

Time: two runs are made at different times, so nothing pairs their calls, and a machine can be
faster or slower as a whole from one run to the next. Each run is therefore reduced to its
per-round ratios to a *reference*: another implementation of the same case that ran in the same
rounds, in both runs (``_reference``: of another family, the closest in time), and the two runs'
log ratios are compared as two samples (``timing.compare_runs``: the Hodges-Lehmann shift and its
Mann-Whitney interval). A regression is a ratio whose whole interval lies above 1 + PCT/100, with
the interval of the raw times (90%) above it too (a reference can move on its own between runs: under
load, a kernel that materializes its scores slows far more than a tiled one) and the change over
``TIME_FLOOR_MS``. Records without per-round times (an older results.json) fall back to the range
their IQRs allow.

Memory: a difference under ``MEMORY_FLOOR_BYTES`` (1 MiB) is no difference: the RSS of a sub-MiB
call moves by 20-27% between runs. A regression is a ratio above 1 + PCT/100 that is also over the
floor.

A gate that compares nothing fails: with ``fail_pct`` and no (impl, case, mode) timed in both
runs, the problems say so, unless ``allow_nothing``.

What the rest of the package uses: ``compare``, ``MEMORY_FLOOR_BYTES``, ``TIME_FLOOR_MS``.
"""

from __future__ import annotations

import math
import statistics
from typing import NamedTuple, Optional

from . import timing
from .measure import Result

# Differences below these are noise, not regressions (page granularity of RSS, timer jitter).
MEMORY_FLOOR_BYTES = 1 << 20
TIME_FLOOR_MS = 0.05
# How sure the raw times' interval must be that they moved too (the per-round ratio is read at 99%):
# the raw times carry the drift within each run, so at 99% a real 30% slowdown is often missed.
RAW_CONFIDENCE = 0.90
ENVIRONMENT = (
    ("device_name", "device"),
    ("torch_version", "torch"),
    ("subquad_version", "subquad"),
    ("threads", "threads"),
)

Key = tuple[str, str, str]


def _rounds(r: Result) -> Optional[list[float]]:
    """The record's per-round times when they are usable: two or more, and agreeing with the
    median the record states (a hand-edited file keeps its stated numbers)."""
    times = [float(t) for t in r.times_ms or []]
    if len(times) < 2 or r.median_ms is None:
        return None
    median = statistics.median(times)
    return times if abs(median - r.median_ms) <= 0.01 * max(abs(r.median_ms), 1e-12) else None


def _timed(r: Optional[Result]) -> bool:
    return r is not None and r.status == "ok" and bool(r.median_ms)


def _family(impl: str) -> str:
    return impl.split("-")[0]


def _reference(key: Key, new: dict[Key, Result], old: dict[Key, Result]) -> Optional[str]:
    """The implementation that ``key``'s time is divided by, round by round, in each run: one ok in
    both runs with usable per-round times of the same rounds as ``key``'s; of another family if
    there is one (the name before its first '-': subquad and subquad-fused run the same kernel, and
    a change shared by a family must not be divided away), then the closest in time (similar work
    feels the machine's state alike: a 2 ms kernel and a 60 ms one that materializes its scores
    did not), then by name."""
    impl, case, mode = key
    mine_new, mine_old = _rounds(new[key]), _rounds(old[key])
    if mine_new is None or mine_old is None:
        return None
    mine = statistics.median(mine_old)
    candidates = []
    for (other, c, m), r in new.items():
        o = old.get((other, c, m))
        if other == impl or (c, m) != (case, mode) or o is None or not (_timed(r) and _timed(o)):
            continue
        rn, ro = _rounds(r), _rounds(o)
        if rn is not None and ro is not None and len(rn) == len(mine_new) and len(ro) == len(mine_old):
            distance = abs(math.log(statistics.median(ro) / mine)) if mine > 0 else math.inf
            candidates.append((_family(other) == _family(impl), distance, other))
    return min(candidates)[2] if candidates else None


class _Change(NamedTuple):
    """A time new/old as the table and the gate read it."""

    ratio: float  # per round against the reference where there is one, else of the raw times
    low: float  # what the gate reads: the lower of the per-round and the raw times' interval bounds
    verdict: str  # "slower" or "faster" only when the raw ratio points the same way
    cell: str
    reference: str
    raw: float  # the ratio of the raw times
    how: str


def _word(verdict: str) -> str:
    return "same" if verdict == timing.SAME else verdict


def _time(key: Key, new: dict[Key, Result], old: dict[Key, Result]) -> _Change:
    """new/old time of ``key``: per round against a reference where both runs have per-round
    times, its interval deciding, and a change counts only where the raw times moved the same way
    beyond the threshold (the reference cancels a machine that is slower as a whole; the raw
    ratio keeps a reference that moved on its own from making a change); else from the IQRs;
    else the bare ratio of medians."""
    r, o = new[key], old[key]
    rn, ro = _rounds(r), _rounds(o)
    if rn is not None and ro is not None:
        raw = timing.compare_runs(r.impl, rn, ro)
        ref = _reference(key, new, old)
        if ref is None:
            cell = f"{raw.ratio:.2f}x [{raw.low:.2f}-{raw.high:.2f}] {_word(raw.verdict)}"
            return _Change(raw.ratio, raw.low, raw.verdict, cell, "-", raw.ratio, raw.describe())
        ref_key = (ref, key[1], key[2])
        new_ref, old_ref = _rounds(new[ref_key]), _rounds(old[ref_key])
        c = timing.compare_runs(r.impl, rn, ro, new_reference=new_ref, old_reference=old_ref, reference=ref)
        limit = 1 + timing.PRACTICAL
        agrees = raw.ratio > limit if c.verdict == "slower" else raw.ratio < 1 / limit
        verdict = c.verdict if agrees else timing.SAME
        cell = f"{c.ratio:.2f}x [{c.low:.2f}-{c.high:.2f}] {_word(verdict)}"
        how = f"{c.describe()}; raw times {raw.ratio:.2f}x"
        # The gate reads the lower of the per-round interval's bound and the raw times' (at
        # RAW_CONFIDENCE): an identical run on this VM moved naive's raw median by 12% while its
        # reference moved 17% the other way (1.39x per round); its raw interval reached below 1.
        raw_low = timing.compare_runs(r.impl, rn, ro, confidence=RAW_CONFIDENCE).low
        return _Change(c.ratio, min(c.low, raw_low), verdict, cell, ref, raw.ratio, how)
    bare = (r.median_ms or 0.0) / (o.median_ms or 1.0)
    quartiles = (r.q1_ms, r.q3_ms, o.q1_ms, o.q3_ms)
    if all(q is not None for q in quartiles) and r.reps >= 2 and o.reps >= 2:
        new_spread = timing.Spread(r.median_ms or 0.0, r.q1_ms or 0.0, r.q3_ms or 0.0, r.reps)
        old_spread = timing.Spread(o.median_ms or 1.0, o.q1_ms or 1.0, o.q3_ms or 1.0, o.reps)
        c = timing.compare_unpaired(r.impl, new_spread, o.impl, old_spread)
        cell = f"{c.ratio:.2f}x [{c.low:.2f}-{c.high:.2f}] {_word(c.verdict)}"
        return _Change(c.ratio, c.low, c.verdict, cell, "-", bare, c.describe())
    # No spread in one of the runs: the bare ratio against the threshold.
    limit = 1 + timing.PRACTICAL
    verdict = "slower" if bare > limit else "faster" if bare < 1 / limit else timing.SAME
    return _Change(bare, bare, verdict, f"{bare:.2f}x (no spread)", "-", bare, "no spread")


def _machine_note(raw: list[float]) -> Optional[str]:
    """When the raw times of most rows moved together by more than 25%, say so: the machine was
    in another state (load, clock, threads), which per-round ratios only partly cancel."""
    if len(raw) < 2:
        return None
    shift = statistics.median(raw)
    if 1 / 1.25 <= shift <= 1.25:
        return None
    how = f"{shift:.2f}x the old ones" if shift > 1 else f"{1 / shift:.2f}x faster than the old ones"
    return (
        f"the new run's raw times are {how} in the median row: the machine was in another state "
        "(load, clock); a change counts only where the raw times and the per-round ratios to the "
        "reference agree"
    )


def _environment_note(new: list[Result], old: list[Result]) -> Optional[str]:
    """Where the two runs come from different machines or versions, which: then a ratio mixes the
    code's change with the machine's."""
    diffs = []
    for field, label in ENVIRONMENT:
        a = sorted({str(getattr(r, field)) for r in new if getattr(r, field) not in (None, "")})
        b = sorted({str(getattr(r, field)) for r in old if getattr(r, field) not in (None, "")})
        if a and b and a != b:
            diffs.append(f"{label} {' / '.join(a)} (new) vs {' / '.join(b)} (old)")
    if not diffs:
        return None
    return "the two runs differ: " + "; ".join(diffs) + ": ratios mix the code's change with the machine's"


def compare(
    new: list[Result], old: list[Result], fail_pct: Optional[float] = None, *, allow_nothing: bool = False
) -> tuple[str, list[str]]:
    """A text table of new/old ratios for records matched on (impl, case, mode), and the list of
    problems that fail ``--fail-if-regression fail_pct``: a time or a peak memory up by more than
    ``fail_pct`` percent beyond its noise (module docstring), a case that was ok and now runs out
    of memory or fails, or, with ``fail_pct`` and unless ``allow_nothing``, nothing compared at
    all. Rows unsupported in both runs are counted, not listed; a summary line ends the table."""
    new_by = {(r.impl, r.case, r.mode): r for r in new}
    old_by = {(r.impl, r.case, r.mode): r for r in old}
    header = (
        f"{'impl':<16} {'case':<34} {'mode':<7} {'time new/old':>30} {'per round vs':<16} {'raw':>7} "
        f"{'peak new/old':>13}"
    )
    lines = [header]
    problems: list[str] = []
    counts = {"faster": 0, "slower": 0, timing.SAME: 0}
    both_unsupported = changed = 0
    raws: list[float] = []
    for key, r in new_by.items():
        o = old_by.get(key)
        if o is None:
            continue
        label = f"{r.impl} {r.case} {r.mode}"
        row = f"{r.impl:<16} {r.case:<34} {r.mode:<7}"
        if o.status == "ok" and r.status in ("oom", "error"):
            problems.append(f"{label}: was ok, now {r.status} ({r.reason})")
        if not (_timed(r) and _timed(o)):
            if o.status == r.status == "unsupported":
                both_unsupported += 1
            else:
                changed += 1
                lines.append(f"{row} {o.status + ' → ' + r.status:>30}")
            continue
        change = _time(key, new_by, old_by)
        counts[change.verdict] += 1
        raws.append(change.raw)
        # The change the ratio means at the old run's time: a few µs of timer jitter is none.
        grew_ms = (o.median_ms or 0.0) * (min(change.ratio, change.raw) - 1.0)
        if fail_pct is not None and change.low > 1 + fail_pct / 100 and grew_ms > TIME_FLOOR_MS:
            problems.append(f"{label}: time {change.ratio:.2f}x the old run ({change.how}; limit +{fail_pct:g}%)")
        memory = _memory(r, o, fail_pct, label, problems)
        lines.append(f"{row} {change.cell:>30} {change.reference:<16} {change.raw:>6.2f}x {memory:>13}")
    compared = sum(counts.values())
    only_new = sum(1 for k in new_by if k not in old_by)
    only_old = sum(1 for k in old_by if k not in new_by)
    if compared == 0 and changed == 0:
        lines.append("(no (impl, case, mode) in common with the old run)" if not both_unsupported else "")
    if both_unsupported:
        lines.append(f"({both_unsupported} (impl, case, mode) unsupported in both runs: not listed)")
    summary = (
        f"{compared} compared: {counts['faster']} faster, {counts['slower']} slower, {counts[timing.SAME]} same; "
        f"{changed} changed status; {only_new} only in the new run, {only_old} only in the old run"
    )
    lines.append(summary)
    for note in (_environment_note(new, old), _machine_note(raws)):
        if note:
            lines.append(note)
    if compared == 0 and fail_pct is not None and not allow_nothing:
        problems.append(
            "nothing compared: no (impl, case, mode) was timed in both runs, so the gate has nothing to pass "
            "(--allow-empty-compare lets that pass)"
        )
    return "\n".join(line for line in lines if line) + "\n", problems


def _memory(r: Result, o: Result, fail_pct: Optional[float], label: str, problems: list[str]) -> str:
    """The peak-memory cell; adds a regression to ``problems`` where there is one."""
    if r.peak_bytes is None or o.peak_bytes is None or o.peak_bytes <= 0:
        return "-"
    grew = r.peak_bytes - o.peak_bytes
    ratio = r.peak_bytes / o.peak_bytes
    if abs(grew) < MEMORY_FLOOR_BYTES:
        return "same (<1 MiB)"
    if fail_pct is not None and ratio > 1 + fail_pct / 100:
        problems.append(f"{label}: peak memory {ratio:.2f}x the old run (limit +{fail_pct:g}%)")
    return f"{ratio:.2f}x"
