"""Fair timing: interleaved rounds, spreads, and verdicts that name a winner only when the data
support one.

Why interleaved: on a shared machine the speed of the CPU drifts (other processes, frequency,
caches), so timing implementation A for a stretch and then B for the next stretch reads that drift
as a difference between A and B. Here the implementations of one case run in *rounds*: each runs
once per round, in an order that rotates from round to round (A B C, B C A, C A B, ...), so every
implementation sees every position and the same stretch of time.

Why paired ratios: within a round the implementations run back to back, so the ratio of their
times in that round cancels the drift that moves both. The verdict between A and B is read from
the per-round ratios A/B: their median, their interquartile range, and a distribution-free
confidence interval for the median (order statistics; with n rounds the interval
[r_(k), r_(n+1-k)] covers the median with probability 1 - 2·P(Binomial(n, 1/2) < k)). A winner is
named only when that whole interval lies beyond a practical threshold (3%): "A 1.31x slower
than B (99% CI 1.27-1.35)". Otherwise the verdict is "same within noise". With 3 rounds the
widest interval (min to max) covers the median with 75% only, so a winner needs every round to
agree by more than 3%.

Used by ``measure.run_all`` (attention cases) and ``model_measure`` (whole models); nothing here
needs torch. What the rest of the package uses: ``Timed``, ``interleaved``, ``sequential``,
``Spread``, ``spread``, ``Comparison``, ``compare_paired``, ``compare_unpaired``,
``verdict_lines``, ``PRACTICAL``, ``CONFIDENCE``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Optional, Sequence

PRACTICAL = 0.03  # a difference under 3% is not worth naming, however sure
CONFIDENCE = 0.99
SAME = "same within noise"


class Timed(NamedTuple):
    """One implementation's call: ``setup()`` (not timed, e.g. a prefill before a decode loop),
    then ``run()`` (timed; it must synchronize its device before returning)."""

    run: Callable[[], object]
    setup: Optional[Callable[[], object]] = None


def _as_timed(call) -> Timed:
    return call if isinstance(call, Timed) else Timed(call)


def round_orders(names: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of each round: the names rotated by one position per round."""
    names = list(names)
    n = len(names)
    return [names[r % n :] + names[: r % n] for r in range(rounds)] if n else []


def interleaved(
    calls: Mapping[str, Callable[[], object] | Timed],
    *,
    min_rounds: int = 5,
    max_rounds: int = 100,
    target_s: float = 1.0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds per call of each implementation, one entry per round (index r is round r for all
    of them). Rounds repeat until at least ``min_rounds`` are done and the timed calls together
    took ``target_s`` per implementation, or ``max_rounds`` are done. An exception from a call
    propagates (the caller records it and times the others again without it)."""
    timed = {name: _as_timed(call) for name, call in calls.items()}
    times: dict[str, list[float]] = {name: [] for name in timed}
    spent = 0.0
    r = 0
    while r < max(1, min_rounds) or (spent < target_s * len(timed) and r < max_rounds):
        names = list(timed)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            call = timed[name]
            if call.setup is not None:
                call.setup()
            start = clock()
            call.run()
            dt = clock() - start
            times[name].append(dt)
            spent += dt
        r += 1
    return times


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


# ----------------------------------------------------------------------------- spread


@dataclass(frozen=True)
class Spread:
    """Median and quartiles of a sample (quartiles by linear interpolation; n = 1 has none)."""

    median: float
    q1: float
    q3: float
    n: int

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1


def spread(values: Sequence[float]) -> Spread:
    values = sorted(values)
    if not values:
        raise ValueError("spread() of no values")
    if len(values) == 1:
        return Spread(values[0], values[0], values[0], 1)
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return Spread(med, q1, q3, len(values))


def _binom_cdf_half(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) <= k)."""
    return float(sum(math.comb(n, i) for i in range(0, k + 1)) / 2**n)


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """A distribution-free interval for the median: ``(low, high, coverage)``. The narrowest
    order-statistic interval whose coverage reaches ``confidence``; with too few values for that,
    the widest one (min to max) and its smaller coverage."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_interval() of no values")
    best = (xs[0], xs[-1], 1.0 - 2 * _binom_cdf_half(0, n) if n > 1 else 0.0)
    for k in range(2, n // 2 + 1):  # k-th smallest to k-th largest
        coverage = 1.0 - 2 * _binom_cdf_half(k - 1, n)
        if coverage < confidence:
            break
        best = (xs[k - 1], xs[n - k], coverage)
    return best


# Two-sided 99% quantiles of Student's t by degrees of freedom; between entries the smaller df
# is used (a wider interval).
_T99 = {
    1: 63.657,
    2: 9.925,
    3: 5.841,
    4: 4.604,
    5: 4.032,
    6: 3.707,
    7: 3.499,
    8: 3.355,
    9: 3.250,
    10: 3.169,
    12: 3.055,
    15: 2.947,
    20: 2.845,
    30: 2.750,
    60: 2.660,
}


def _t99(df: int) -> float:
    return _T99[max(k for k in _T99 if k <= df)] if df < 120 else 2.576


def ratio_interval(ratios: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """The interval a verdict is read from: the union of the order-statistic interval of the
    median (distribution-free, but only 75% sure with 3 rounds) and a 99% t interval on the log
    ratios (wide with few rounds unless the rounds agree). Taking the wider keeps a noisy round
    from producing a winner. Returns ``(low, high, coverage)``; the t part, and so the union,
    is computed at 99% (the ``confidence`` argument sets the order-statistic part)."""
    low, high, coverage = median_interval(ratios, confidence)
    logs = [math.log(r) for r in ratios if r > 0]
    if len(logs) >= 2:
        half = _t99(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
        mean = statistics.fmean(logs)
        low, high = min(low, math.exp(mean - half)), max(high, math.exp(mean + half))
    return low, high, max(coverage, confidence if len(logs) >= 2 else 0.0)


# ------------------------------------------------------------------------- comparison


@dataclass(frozen=True)
class Comparison:
    """``name`` against ``other``: time ratio name/other with its spread and the verdict
    (``"faster"``, ``"slower"`` or ``SAME``)."""

    name: str
    other: str
    ratio: float
    q1: float
    q3: float
    low: float
    high: float
    coverage: float
    rounds: int
    verdict: str
    paired: bool = True

    def describe(self) -> str:
        """``1.31x (IQR 1.29-1.33; 99% CI 1.27-1.35, 9 rounds)``."""
        if self.rounds < 2:
            return f"{self.ratio:.2f}x (one round: no spread)"
        if not self.paired:
            return f"{self.ratio:.2f}x (from the IQRs: {self.low:.2f}-{self.high:.2f})"
        return (
            f"{self.ratio:.2f}x (IQR {self.q1:.2f}-{self.q3:.2f}; {math.floor(self.coverage * 100)}% CI "
            f"{self.low:.2f}-{self.high:.2f}, {self.rounds} rounds)"
        )


def _verdict(low: float, high: float, threshold: float) -> str:
    if low > 1.0 + threshold:
        return "slower"
    if high < 1.0 / (1.0 + threshold):
        return "faster"
    return SAME


def compare_paired(
    name: str,
    times: Sequence[float],
    other: str,
    other_times: Sequence[float],
    *,
    threshold: float = PRACTICAL,
    confidence: float = CONFIDENCE,
) -> Comparison:
    """``name`` against ``other`` from per-round times of the same rounds (index r of both
    lists is round r)."""
    if len(times) != len(other_times) or not times:
        raise ValueError(f"paired times need the same rounds: {name} has {len(times)}, {other} has {len(other_times)}")
    ratios = [a / b for a, b in zip(times, other_times) if b > 0]
    s = spread(ratios)
    if len(ratios) < 2:
        return Comparison(name, other, s.median, s.q1, s.q3, s.median, s.median, 0.0, len(ratios), SAME)
    low, high, coverage = ratio_interval(ratios, confidence)
    return Comparison(
        name, other, s.median, s.q1, s.q3, low, high, coverage, len(ratios), _verdict(low, high, threshold)
    )


def compare_unpaired(name: str, new: Spread, other: str, old: Spread, *, threshold: float = PRACTICAL) -> Comparison:
    """Two runs made at different times (``--compare``): nothing pairs their calls, so the
    ratio of medians is given with the range its IQRs allow, [q1/q3', q3/q1'] (new over old); a
    difference is named only when that whole range lies beyond the threshold."""
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
        name, other, ratio, low, high, low, high, 0.0, min(new.n, old.n), _verdict(low, high, threshold), paired=False
    )


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
    same = [c for c in comparisons if c.verdict == SAME]
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
    return lines
