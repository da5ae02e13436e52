"""Tests of the bench's fair timing (``subquad.bench.timing``): interleaved rounds, spreads, and
verdicts that name a winner only when the per-round ratios support one.

Timings here come from a virtual clock (each fake call advances it by a duration that depends
on the clock's phase, as a drifting machine would), so the tests are exact and take no time;
nothing asserts a real timing.
"""

import math
import random

import pytest

from subquad.bench import measure, report, timing
from subquad.bench.cases import Case, Timing
from subquad.bench.measure import Result

from test_bench import fake


class VirtualMachine:
    """A clock, and implementations whose call takes ``base * speed(now) * noise``: ``speed``
    drifts with the wall-clock phase (a sine of period ``period`` seconds)."""

    def __init__(self, *, drift=0.3, period=0.5, noise=0.0, seed=0, phase=0.0):
        self.now = 0.0
        self.drift, self.period, self.noise, self.phase = drift, period, noise, phase
        self.rng = random.Random(seed)

    def clock(self):
        return self.now

    def impl(self, base):
        def run():
            speed = 1.0 + self.drift * math.sin(self.phase + 2 * math.pi * self.now / self.period)
            self.now += base * speed * math.exp(self.rng.gauss(0.0, self.noise) if self.noise else 0.0)

        return run


def verdict(samples, name="b", other="a"):
    return timing.compare_paired(name, samples[name], other, samples[other]).verdict


# ---------------------------------------------------------------------------- drift


def test_drift_fools_sequential_timing_but_not_interleaved():
    """Two identical implementations on a machine whose speed drifts with the wall clock: timed
    one after the other, the second lands in a slower stretch and "loses"; interleaved, every
    round runs both back to back and the verdict is the same within noise."""
    calls = lambda vm: {"a": vm.impl(0.01), "b": vm.impl(0.01)}  # noqa: E731
    # a's stretch is where the machine is fast, b's where it is slow.
    vm = VirtualMachine(phase=-math.pi / 2, period=0.4)
    seq = timing.sequential(calls(vm), rounds=10, clock=vm.clock)
    assert abs(sum(seq["b"]) / sum(seq["a"]) - 1) > 0.1
    # Judged from their stretches, even with the spreads, b is "slower"; and the old verdict
    # (the fastest median) names a.
    spreads = {k: timing.spread(v) for k, v in seq.items()}
    assert timing.compare_unpaired("b", spreads["b"], "a", spreads["a"]).verdict == "slower"
    old_style = report.verdicts([Result(impl=k, case="c", mode="fwd", median_ms=1e3 * s.median)
                                 for k, s in spreads.items()])
    assert old_style[0].startswith("c fwd: fastest a")

    vm = VirtualMachine(phase=-math.pi / 2, period=0.4)
    inter = timing.interleaved(calls(vm), min_rounds=10, max_rounds=10, target_s=0, clock=vm.clock)
    assert verdict(inter) == timing.SAME
    lines = timing.verdict_lines(inter)
    assert lines[0].startswith("no single fastest") and timing.SAME in lines[0]


@pytest.mark.parametrize("phase", [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
def test_interleaved_drift_verdict_at_every_phase(phase):
    vm = VirtualMachine(phase=phase, noise=0.02, seed=int(phase))
    times = timing.interleaved({"a": vm.impl(0.01), "b": vm.impl(0.01)}, min_rounds=7,
                               max_rounds=7, target_s=0, clock=vm.clock)
    assert verdict(times) == timing.SAME


# ---------------------------------------------------------------------- simulations


def _simulate(seed, rounds, effect, noise=0.05):
    rng = random.Random(seed)
    vm = VirtualMachine(drift=0.3, period=rng.uniform(0.1, 2.0), noise=noise, seed=seed,
                        phase=rng.uniform(0, 2 * math.pi))
    times = timing.interleaved({"a": vm.impl(0.01), "b": vm.impl(0.01 * effect)},
                               min_rounds=rounds, max_rounds=rounds, target_s=0, clock=vm.clock)
    return verdict(times)


@pytest.mark.parametrize("rounds", [3, 5, 10])
def test_identical_implementations_are_the_same_in_99_percent_of_seeds(rounds):
    verdicts = [_simulate(seed, rounds, 1.0) for seed in range(500)]
    assert verdicts.count(timing.SAME) >= 0.99 * len(verdicts), {v: verdicts.count(v) for v in set(verdicts)}


def test_a_real_30_percent_difference_is_detected():
    verdicts = [_simulate(seed, 10, 1.3) for seed in range(300)]
    assert verdicts.count("slower") >= 0.9 * len(verdicts)
    assert "faster" not in verdicts  # never the wrong way round
    # Faster is found the same way.
    assert _simulate(1, 10, 1 / 1.3, noise=0.01) == "faster"


def test_a_large_difference_is_named_even_with_three_rounds():
    verdicts = [_simulate(seed, 3, 2.0, noise=0.02) for seed in range(100)]
    assert verdicts.count("slower") >= 95


def test_small_differences_stay_unnamed_below_the_threshold():
    # 2% slower, measured exactly: real, but under the 3% worth naming.
    vm = VirtualMachine(drift=0.0)
    times = timing.interleaved({"a": vm.impl(0.01), "b": vm.impl(0.0102)}, min_rounds=20,
                               max_rounds=20, target_s=0, clock=vm.clock)
    c = timing.compare_paired("b", times["b"], "a", times["a"])
    assert c.ratio == pytest.approx(1.02) and c.verdict == timing.SAME


# -------------------------------------------------------------------------- pieces


def test_round_orders_rotate_so_each_name_takes_each_position():
    orders = timing.round_orders(["a", "b", "c"], 6)
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    for position in range(3):
        assert {o[position] for o in orders} == {"a", "b", "c"}


def test_interleaved_runs_setup_untimed_and_stops_at_the_target():
    vm = VirtualMachine(drift=0.0)
    setups = []

    def setup():
        setups.append(1)
        vm.now += 1.0  # a slow prefill: must not count

    times = timing.interleaved({"a": timing.Timed(vm.impl(0.01), setup), "b": vm.impl(0.01)},
                               min_rounds=3, max_rounds=100, target_s=0.045, clock=vm.clock)
    assert len(times["a"]) == len(times["b"]) == len(setups) == 5  # 0.045 s each, 0.01 a call
    assert all(t == pytest.approx(0.01) for t in times["a"])


def test_spread_and_median_interval():
    s = timing.spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.q1, s.q3, s.n, s.iqr) == (3.0, 2.0, 4.0, 5, 2.0)
    assert timing.spread([7.0]) == timing.Spread(7.0, 7.0, 7.0, 1)
    assert timing.median_interval([1, 2, 3], 0.95) == (1, 3, 0.75)  # min..max covers 75% at n=3
    low, high, coverage = timing.median_interval(list(range(1, 21)), 0.95)
    assert (low, high) == (6, 15) and coverage >= 0.95
    with pytest.raises(ValueError, match="no values"):
        timing.spread([])


def test_paired_comparison_needs_the_same_rounds():
    with pytest.raises(ValueError, match="the same rounds"):
        timing.compare_paired("a", [1.0, 2.0], "b", [1.0])


def test_one_round_names_no_winner():
    c = timing.compare_paired("a", [2.0], "b", [1.0])
    assert c.verdict == timing.SAME and "one round" in c.describe()


def test_verdict_lines_name_the_slower_with_their_interval():
    vm = VirtualMachine(drift=0.0, noise=0.01, seed=3)
    times = timing.interleaved({"fast": vm.impl(0.01), "slow": vm.impl(0.02), "twin": vm.impl(0.01)},
                               min_rounds=9, max_rounds=9, target_s=0, clock=vm.clock)
    lines = timing.verdict_lines(times)
    assert lines[0].startswith("no single fastest")
    slow = next(line for line in lines if line.strip().startswith("slow /"))
    assert "2.0" in slow and "99% CI" in slow and "9 rounds" in slow and slow.endswith("slow slower")


def test_unpaired_comparison_for_compare():
    old = timing.Spread(100.0, 95.0, 105.0, 5)
    assert timing.compare_unpaired("x", timing.Spread(103.0, 98.0, 108.0, 5), "x", old).verdict == timing.SAME
    worse = timing.compare_unpaired("x", timing.Spread(150.0, 145.0, 155.0, 5), "x", old)
    assert worse.verdict == "slower" and worse.low == pytest.approx(145 / 105)


# ---------------------------------------------------------- the attention bench uses it


def test_run_all_times_a_case_interleaved_and_the_verdict_reads_the_rounds():
    case = Case(1, 2, 64, 64, 16, dtype="fp32")
    jobs = [(fake("twin-a", lambda: None), case), (fake("twin-b", lambda: None), case)]
    results = measure.run_all(jobs, Timing(warmup_s=0.0, target_s=0.01, min_reps=4, max_reps=6),
                              isolate=False)
    assert [r.status for r in results] == ["ok", "ok"]
    assert len(results[0].times_ms) == len(results[1].times_ms) == results[0].reps >= 4
    for r in results:
        assert r.q1_ms <= r.median_ms <= r.q3_ms
    lines = report.verdicts(results)
    assert "rounds" in "\n".join(lines)
    assert "IQR ms" in report.render_plain(results)


def test_run_all_times_the_others_when_one_fails_while_timed():
    case = Case(1, 2, 32, 32, 16, dtype="fp32")
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) > 3:  # the memory phase and warm-up pass, a timed call fails
            raise ValueError("went wrong later")

    jobs = [(fake("steady", lambda: None), case), (fake("flaky", flaky), case)]
    results = measure.run_all(jobs, Timing(warmup_s=0.0, target_s=0.0, min_reps=3, max_reps=3),
                              isolate=False)
    by = {r.impl: r for r in results}
    assert by["flaky"].status == "error" and "went wrong later" in by["flaky"].reason
    assert by["steady"].status == "ok" and by["steady"].reps == 3


def test_compare_counts_a_regression_only_beyond_the_spread():
    def r(ms, q1, q3):
        return Result(impl="x", case="c", mode="fwd", median_ms=ms, q1_ms=q1, q3_ms=q3, reps=5,
                      peak_bytes=1 << 20)

    text, regs = report.compare([r(11.0, 9.0, 13.0)], [r(10.0, 9.5, 10.5)], 5)
    assert regs == [] and "same" in text  # 10% slower by median, but inside the spreads
    text, regs = report.compare([r(20.0, 19.0, 21.0)], [r(10.0, 9.5, 10.5)], 5)
    assert len(regs) == 1 and "slower" in text
