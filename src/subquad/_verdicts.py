"""Which of two implementations is faster, from times of the same rounds: the one verdict rule.

Within a round the implementations run back to back, so the ratio of their times in that round
cancels the drift that moves both. The verdict between A and B is read from the per-round ratios
A/B: their median, their interquartile range, and a distribution-free confidence interval for the
median (order statistics; with n rounds the interval [r_(k), r_(n+1-k)] covers the median with
probability 1 - 2·P(Binomial(n, 1/2) < k)). A winner is named only when that whole interval lies
beyond a practical threshold (3%) and covers the median with at least 95%; otherwise the verdict is
``SAME``. Why these choices: ``subquad.bench.timing``, which runs the rounds and reports them.

Shared by ``subquad bench`` (``bench/timing.py`` re-exports every name) and the ComfyUI node
"Which attention? (subquad)" (through ``_for_wings``), so both name a winner by the same rule; nothing
here needs torch. The rest of the package may use ``PRACTICAL``, ``CONFIDENCE``, ``MIN_COVERAGE``,
``SAME``, ``Spread``, ``spread``, ``median_interval``, ``ratio_interval``, ``Comparison``,
``interval_verdict`` and ``compare_paired``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

PRACTICAL = 0.03  # a difference under 3% is not worth naming, however sure
CONFIDENCE = 0.99
# An interval less sure than this names no winner: min..max of 3 rounds is 75% sure, of 5 93.75%,
# of 6 96.9%; a real difference is then found by adding rounds (``bench.timing.run_rounds``). At
# 0.9, 5 rounds of two identical implementations named a winner in 1.6% of simulated seeds.
MIN_COVERAGE = 0.95
SAME = "same within noise"


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


def ratio_interval(ratios: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """The interval a verdict is read from: the order-statistic interval of the median ratio
    (``median_interval``), ``(low, high, coverage)``. Distribution-free, and one outlying round
    shifts each bound by one order statistic at most (with 12 rounds or more the 99% interval
    leaves out at least the smallest and the largest ratio, so one cold round cannot be a bound).
    With too few rounds the coverage is below ``confidence`` and says so."""
    return median_interval(ratios, confidence)


@dataclass(frozen=True)
class Comparison:
    """``name`` against ``other``: time ratio name/other with its spread and the verdict
    (``"faster"``, ``"slower"`` or ``SAME``). ``reference``: for two runs compared through a
    reference implementation (``bench.timing.compare_runs``), its name."""

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
    reference: Optional[str] = None

    @property
    def too_few(self) -> bool:
        """True when the interval is too unsure to name a winner (``MIN_COVERAGE``)."""
        return self.coverage < MIN_COVERAGE

    def describe(self) -> str:
        """``1.31x (IQR 1.29-1.33; 99% CI 1.27-1.35, 9 rounds)``."""
        if self.rounds < 2:
            return f"{self.ratio:.2f}x (one round: no spread)"
        ci = f"{math.floor(self.coverage * 100)}% CI {self.low:.2f}-{self.high:.2f}"
        if self.reference is not None:
            return f"{self.ratio:.2f}x ({ci}, per round against {self.reference})"
        if not self.paired:
            return f"{self.ratio:.2f}x (from the IQRs: {self.low:.2f}-{self.high:.2f})"
        few = ": too few rounds to name a winner" if self.too_few else ""
        return f"{self.ratio:.2f}x (IQR {self.q1:.2f}-{self.q3:.2f}; {ci}, {self.rounds} rounds{few})"


def interval_verdict(low: float, high: float, threshold: float, coverage: float = 1.0) -> str:
    """``"slower"`` or ``"faster"`` when the whole interval of a ratio lies beyond ``threshold``
    and covers the median with at least ``MIN_COVERAGE``, else ``SAME``."""
    if coverage < MIN_COVERAGE:
        return SAME
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
    verdict = interval_verdict(low, high, threshold, coverage)
    return Comparison(name, other, s.median, s.q1, s.q3, low, high, coverage, len(ratios), verdict)
