"""Fair timing: interleaved rounds, spreads, and verdicts that name a winner only when the data
support one.

Why interleaved: on a shared machine the speed of the CPU drifts (other processes, frequency,
caches), so timing implementation A for a stretch and then B for the next stretch reads that drift
as a difference between A and B. Here the implementations of one case run in *rounds*: each runs
once per round. The orders are balanced (``balanced_orders``: a Williams design, relabelled by a
seeded shuffle every cycle): every implementation takes every position, and is preceded by every
other one equally often, so none always runs right after the same heavy, cache-trashing neighbour.
A first, untimed round (``warm_rounds``) runs each call once in the rounds' own company, so no
timed round is a cold one.

Why paired ratios: within a round the implementations run back to back, so the ratio of their
times in that round cancels the drift that moves both. The verdict between A and B is read from
the per-round ratios A/B: their median, their interquartile range, and a distribution-free
confidence interval for the median (order statistics; with n rounds the interval
[r_(k), r_(n+1-k)] covers the median with probability 1 - 2·P(Binomial(n, 1/2) < k)). One cold or
disturbed round moves such an interval by at most one order statistic, and from 12 rounds on the
99% interval leaves out the most extreme ratio on each side: it cannot drag the bound of a clear
2x difference down to 1x, as a t interval on the log ratios did (with fewer rounds it can widen
min..max, and the verdict is then "undecided", never "the same"). A winner is named only
when that whole interval lies beyond a practical threshold (3%) and covers the median with at
least 95% (6 rounds or more; with 3 rounds min..max is only 75% sure, and the verdict says so):
"A 1.31x slower than B (99% CI 1.27-1.35)". Otherwise the verdict is "same within noise". When
the median ratio is beyond the threshold but the interval is not yet (too few rounds, or a
disturbed one), ``run_rounds`` adds rounds until it is or a time cap is reached, and says which.

``compare_runs`` compares two runs made at different times (``--compare``): nothing pairs their
calls, so each run's per-round ratios to a reference implementation (paired within that run,
which cancels a shift of the whole machine between the runs) are compared as two samples: the
Hodges-Lehmann shift between their logs, with its distribution-free (Mann-Whitney) interval.

The paired verdict itself (``compare_paired``, ``Comparison``, ``spread``, ``median_interval``, the
thresholds) is ``subquad._verdicts``, below the integrations, so that the ComfyUI node "Which
attention? (subquad)" names a winner by the same code; this module re-exports those names.

Used by ``measure.run_all`` (attention cases), ``model_measure`` (whole models) and the reports;
nothing here needs torch. What the rest of the package uses: ``Timed``, ``Rounds``,
``run_rounds``, ``interleaved``, ``sequential``, ``balanced_orders``, ``round_orders``, ``Spread``,
``spread``, ``median_interval``, ``shift_interval``, ``Comparison``, ``compare_paired``, ``compare_runs``,
``compare_unpaired``, ``unsettled``, ``verdict_lines``, ``stop_note``, ``PRACTICAL``,
``CONFIDENCE``, ``MIN_COVERAGE``, ``ROUNDS_TO_NAME``, ``ROUNDS_PAST_CAP``, ``SAME``.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
import time
from typing import Callable, Iterator, Mapping, NamedTuple, Optional, Sequence

# The verdict rule lives below the integrations, where the ComfyUI node reads it too (``_verdicts``);
# its names are this module's as well.
from .._verdicts import (
    CONFIDENCE,
    MIN_COVERAGE,
    PRACTICAL,
    SAME,
    Comparison,
    Spread,
    compare_paired,
    interval_verdict,
    spread,
)
from .._verdicts import median_interval as median_interval
from .._verdicts import ratio_interval as ratio_interval

# The fewest rounds whose widest interval (min..max, 1 - 2^(1-n)) reaches MIN_COVERAGE: fewer rounds
# can name no one.
ROUNDS_TO_NAME = next(n for n in range(2, 64) if 1.0 - 2.0 ** (1 - n) >= MIN_COVERAGE)
# An unsettled verdict gets this many rounds even past the time cap: from 12 rounds on, the 99%
# interval leaves out the smallest and the largest ratio, so one odd round cannot be a bound
# (identical calls at 1x4x4096x64 stopped at 6 rounds read 1.09x "undecided").
ROUNDS_PAST_CAP = 12


class Timed(NamedTuple):
    """One implementation's call: ``setup()`` (not timed, e.g. a prefill before a decode loop),
    then ``run()`` (timed; it must synchronize its device before returning)."""

    run: Callable[[], object]
    setup: Optional[Callable[[], object]] = None


def _as_timed(call) -> Timed:
    return call if isinstance(call, Timed) else Timed(call)


def _williams(n: int) -> list[list[int]]:
    """A Williams design: rows that are orders of 0..n-1 in which every index takes every
    position and follows every other index equally often (once for even n; n odd needs the
    mirrored rows too, and then twice)."""
    first, low, high = [0], 1, n - 1
    while low <= high:
        first.append(low)
        if low != high:
            first.append(high)
        low, high = low + 1, high - 1
    rows = [[(x + shift) % n for x in first[:n]] for shift in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def balanced_orders(names: Sequence[str], seed: int = 0) -> Iterator[list[str]]:
    """The order of each round, endlessly: cycles of a Williams design (n rounds for n names, 2n
    when n is odd), each cycle with the names shuffled anew by a generator seeded with ``seed``.
    Over every complete cycle each name takes each position and is preceded by each other name
    equally often; the same names and seed give the same orders."""
    names = list(names)
    if not names:
        return
    rng = random.Random(seed)
    design = _williams(len(names))
    while True:
        labels = names[:]
        rng.shuffle(labels)
        for row in design:
            yield [labels[i] for i in row]


def round_orders(names: Sequence[str], rounds: int, seed: int = 0) -> list[list[str]]:
    """The first ``rounds`` orders of ``balanced_orders``."""
    return list(itertools.islice(balanced_orders(names, seed), rounds))


class Rounds(NamedTuple):
    """What ``run_rounds`` measured: seconds per call of each implementation, one entry per timed
    round (index r is round r for all of them), and why the rounds stopped (``STOPS``)."""

    times: dict[str, list[float]]
    stopped: str


STOPS = {
    "target": "the target time was spent",
    "max rounds": "the most rounds were run",
    "decided": "rounds were added until every verdict was decided",
    "time cap": "rounds were added until the time cap; a verdict is still undecided",
    "round cap": "rounds were added until the round cap; a verdict is still undecided",
}


def stop_note(stopped: Optional[str], rounds: int) -> str:
    """Why ``rounds`` rounds were run, in words, where that is news (the rounds were extended):
    empty for a plain stop at the target or at the most rounds."""
    if stopped in ("decided", "time cap", "round cap"):
        return f"{rounds} rounds: {STOPS[stopped]}"
    return ""


def run_rounds(
    calls: Mapping[str, Callable[[], object] | Timed],
    *,
    min_rounds: int = 5,
    max_rounds: int = 100,
    target_s: float = 1.0,
    warm_rounds: int = 0,
    cap_s: Optional[float] = None,
    cap_rounds: Optional[int] = None,
    seed: int = 0,
    threshold: float = PRACTICAL,
    clock: Callable[[], float] = time.perf_counter,
) -> Rounds:
    """Time ``calls`` in interleaved rounds with balanced orders (``balanced_orders``).

    First ``warm_rounds`` untimed rounds (each call once, as it will be timed). Then rounds until
    at least ``min_rounds`` are done and the timed calls together took ``target_s`` per
    implementation, or ``max_rounds`` are done. With ``cap_s``, rounds go on while a verdict is
    unsettled (``unsettled``: a median ratio beyond the threshold whose interval is not), until the
    timed calls took ``cap_s`` per implementation (but never before ``ROUNDS_PAST_CAP`` rounds) or
    ``cap_rounds`` rounds are done (default ``4 * max_rounds``). An exception from a call
    propagates (the caller records it and times the others again without it)."""
    timed = {name: _as_timed(call) for name, call in calls.items()}
    times: dict[str, list[float]] = {name: [] for name in timed}
    if not timed:
        return Rounds(times, "target")
    for _ in range(warm_rounds):
        for call in timed.values():
            if call.setup is not None:
                call.setup()
            call.run()
    orders = balanced_orders(list(timed), seed)
    cap_rounds = max(ROUNDS_TO_NAME, 4 * max_rounds if cap_rounds is None else cap_rounds)
    spent, rounds, extended = 0.0, 0, False
    while True:
        if rounds >= max(1, min_rounds) and (spent >= target_s * len(timed) or rounds >= max_rounds):
            done = "target" if spent >= target_s * len(timed) else "max rounds"
            if cap_s is None or not unsettled(times, threshold=threshold):
                return Rounds(times, "decided" if extended else done)
            if spent >= cap_s * len(timed) and rounds >= ROUNDS_PAST_CAP:
                return Rounds(times, "time cap")
            if rounds >= cap_rounds:
                return Rounds(times, "round cap")
            extended = True
        for name in next(orders):
            call = timed[name]
            if call.setup is not None:
                call.setup()
            start = clock()
            call.run()
            dt = clock() - start
            times[name].append(dt)
            spent += dt
        rounds += 1


def interleaved(
    calls: Mapping[str, Callable[[], object] | Timed],
    *,
    min_rounds: int = 5,
    max_rounds: int = 100,
    target_s: float = 1.0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """``run_rounds`` without warm rounds or a cap: seconds per call of each implementation, one
    entry per round."""
    return run_rounds(calls, min_rounds=min_rounds, max_rounds=max_rounds, target_s=target_s, clock=clock).times


def sequential(
    calls: Mapping[str, Callable[[], object] | Timed],
    *,
    rounds: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """The old way, for comparison: all calls of one implementation, then all of the next. On a
    drifting machine its "rounds" are not paired; the tests show the verdicts it leads to."""
    out: dict[str, list[float]] = {}
    for name, call in calls.items():
        call = _as_timed(call)
        out[name] = []
        for _ in range(rounds):
            if call.setup is not None:
                call.setup()
            start = clock()
            call.run()
            out[name].append(clock() - start)
    return out


# ------------------------------------------------------------------------- comparison


def _per_round(times: Sequence[float], reference: Optional[Sequence[float]]) -> list[float]:
    if reference is None:
        return [t for t in times if t > 0]
    if len(reference) != len(times):
        raise ValueError(f"a reference needs the same rounds: {len(times)} against {len(reference)}")
    return [t / r for t, r in zip(times, reference) if t > 0 and r > 0]


def _rank_sum_cdf(n: int, m: int) -> Callable[[int], float]:
    """P(U <= u) for the Mann-Whitney count U of two samples of n and m values from one continuous
    distribution: exact (the coefficients of the Gaussian binomial [n+m choose n]) up to 2,500
    pairs, then the normal approximation with a continuity correction."""
    if n * m > 2500:
        mean, sd = n * m / 2, math.sqrt(n * m * (n + m + 1) / 12)
        return lambda u: 0.5 * (1.0 + math.erf((u + 0.5 - mean) / (sd * math.sqrt(2.0))))
    counts = [1]
    for i in range(1, n + 1):  # times (1 - q^(m+i)) / (1 - q^i)
        grown = counts + [0] * (m + i)
        for j, c in enumerate(counts):
            grown[j + m + i] -= c
        for j in range(i, len(grown)):
            grown[j] += grown[j - i]
        counts = grown[: n * m + 1]
    cumulative = list(itertools.accumulate(counts))
    total = cumulative[-1]
    return lambda u: cumulative[u] / total if u >= 0 else 0.0


def shift_interval(
    new: Sequence[float], old: Sequence[float], confidence: float = CONFIDENCE
) -> tuple[float, float, float, float]:
    """How much ``new`` lies above ``old``: the Hodges-Lehmann estimate (the median of all n·m
    differences new_i - old_j) and the distribution-free interval of those differences' order
    statistics [d_(k), d_(nm+1-k)] (Mann-Whitney), ``(estimate, low, high, coverage)``. It assumes
    only that the two samples differ by a shift; one outlying value moves m of the n·m differences,
    all at one end, and a 99% interval of 20 against 20 leaves out 104 at each end."""
    diffs = sorted(a - b for a in new for b in old)
    n, m = len(new), len(old)
    cdf = _rank_sum_cdf(n, m)
    k, coverage = 1, 1.0 - 2.0 * cdf(0)
    while k < len(diffs) // 2 and 1.0 - 2.0 * cdf(k) >= confidence:  # widen k while still sure
        k += 1
        coverage = 1.0 - 2.0 * cdf(k - 1)
    return statistics.median(diffs), diffs[k - 1], diffs[len(diffs) - k], max(0.0, coverage)


def compare_runs(
    name: str,
    new: Sequence[float],
    old: Sequence[float],
    *,
    new_reference: Optional[Sequence[float]] = None,
    old_reference: Optional[Sequence[float]] = None,
    reference: Optional[str] = None,
    threshold: float = PRACTICAL,
    confidence: float = CONFIDENCE,
) -> Comparison:
    """``name`` in a new run against an old one, from each run's per-round times (``new``,
    ``old``). With the per-round times of a ``reference`` implementation in each run (the same
    rounds), each run is first reduced to its per-round ratios name/reference, paired within the
    run, so that a machine faster or slower as a whole in one of the runs cancels out; without,
    the raw times are compared. The ratio new/old and its interval are the shift between the
    runs' log values (``shift_interval``: Hodges-Lehmann, with the distribution-free Mann-Whitney
    interval at ``confidence``); a verdict is named only when that whole interval lies beyond
    ``threshold``."""
    a, b = _per_round(new, new_reference), _per_round(old, old_reference)
    if not a or not b:
        raise ValueError(f"compare_runs() of {name} needs times in both runs")
    if len(a) < 2 or len(b) < 2:
        ratio = statistics.median(a) / statistics.median(b)
        verdict = "slower" if ratio > 1 + threshold else "faster" if ratio < 1 / (1 + threshold) else SAME
        return Comparison(name, name, ratio, ratio, ratio, ratio, ratio, 0.0, min(len(a), len(b)), verdict, False)
    shift, low, high, coverage = shift_interval([math.log(x) for x in a], [math.log(x) for x in b], confidence)
    ratio, low, high = math.exp(shift), math.exp(low), math.exp(high)
    # Two runs of 3 rounds are only 90% sure by this interval, yet every new round would have to
    # beat every old one by the threshold: the gate takes that, and the table says how sure.
    verdict = interval_verdict(low, high, threshold)
    rounds = min(len(a), len(b))
    return Comparison(name, name, ratio, low, high, low, high, coverage, rounds, verdict, False, reference)


def compare_unpaired(name: str, new: Spread, other: str, old: Spread, *, threshold: float = PRACTICAL) -> Comparison:
    """Two runs known only by their spreads (a results.json without per-round times): the ratio
    of medians with the range its IQRs allow, [q1/q3', q3/q1'] (new over old); a difference is
    named only when that whole range lies beyond the threshold."""
    ratio = new.median / old.median
    if new.n < 2 or old.n < 2:
        return Comparison(
            name,
            other,
            ratio,
            ratio,
            ratio,
            ratio,
            ratio,
            0.0,
            min(new.n, old.n),
            SAME if abs(ratio - 1.0) <= threshold else ("slower" if ratio > 1 else "faster"),
            paired=False,
        )
    low, high = new.q1 / old.q3, new.q3 / old.q1
    return Comparison(
        name,
        other,
        ratio,
        low,
        high,
        low,
        high,
        0.0,
        min(new.n, old.n),
        interval_verdict(low, high, threshold),
        paired=False,
    )


def unsettled(
    samples: Mapping[str, Sequence[float]], *, threshold: float = PRACTICAL, confidence: float = CONFIDENCE
) -> list[str]:
    """The implementations whose verdict against the fastest (by median) more rounds could still
    change: a median ratio beyond ``threshold`` whose interval is not (yet) beyond it, or is too
    unsure to name anyone. Twins (median ratio within the threshold) are settled as the same."""
    samples = {k: list(v) for k, v in samples.items() if v}
    if len(samples) < 2 or len({len(v) for v in samples.values()}) != 1:
        return []
    medians = {k: statistics.median(v) for k, v in samples.items()}
    best = min(medians, key=medians.__getitem__)
    out = []
    for name, times in samples.items():
        if name == best:
            continue
        c = compare_paired(name, times, best, samples[best], threshold=threshold, confidence=confidence)
        if c.verdict == SAME and c.ratio > 1.0 + threshold:
            out.append(name)
    return out


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def verdict_lines(
    samples: Mapping[str, Sequence[float]], *, threshold: float = PRACTICAL, confidence: float = CONFIDENCE
) -> list[str]:
    """What the interleaved times of one case support, in words: the fastest by median, which
    implementations are the same as it within noise, and how much slower the others are.
    ``samples`` maps names to per-round seconds (the same rounds for all)."""
    samples = {k: list(v) for k, v in samples.items() if v}
    if not samples:
        return []
    medians = {k: statistics.median(v) for k, v in samples.items()}
    best = min(medians, key=medians.__getitem__)
    if len(samples) == 1:
        return [f"only {best} was timed: {_ms(medians[best])} ms"]
    comparisons = [
        compare_paired(name, samples[name], best, samples[best], threshold=threshold, confidence=confidence)
        for name in sorted(samples, key=medians.__getitem__)
        if name != best
    ]
    # A median ratio beyond the threshold whose interval is not: undecided, not "the same".
    undecided = [c for c in comparisons if c.verdict == SAME and c.ratio > 1.0 + threshold]
    same = [c for c in comparisons if c.verdict == SAME and c not in undecided]
    slower = [c for c in comparisons if c.verdict == "slower"]
    s = spread(samples[best])
    head = f"{best} {_ms(s.median)} ms (IQR {_ms(s.q1)}-{_ms(s.q3)})"
    if same:
        names = ", ".join(c.name for c in same)
        lines = [f"no single fastest: {head} and {names} are the {SAME}"]
        lines += [f"  {c.name} / {best}: {c.describe()}: {SAME}" for c in same]
    else:
        lines = [f"fastest {head}"]
    lines += [f"  {c.name} / {best}: {c.describe()}: {c.name} slower" for c in slower]
    lines += [f"  {c.name} / {best}: {c.describe()}: undecided, more rounds needed" for c in undecided]
    return lines
