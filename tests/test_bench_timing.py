"""Tests of the bench's fair timing (``subquad.bench.timing``): interleaved rounds, spreads, and
verdicts that name a winner only when the per-round ratios support one.

Timings here come from a virtual clock (each fake call advances it by a duration that depends
on the clock's phase, as a drifting machine would), so the tests are exact and take no time;
nothing asserts a real timing.
"""

import collections
import math
import random
import statistics

import pytest

from subquad.bench import measure, report, timing
from subquad.bench.cases import Case, Timing
from subquad.bench.impls import Impl
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
    old_style = report.verdicts(
        [Result(impl=k, case="c", mode="fwd", median_ms=1e3 * s.median) for k, s in spreads.items()]
    )
    assert old_style[0].startswith("c fwd: fastest a")

    vm = VirtualMachine(phase=-math.pi / 2, period=0.4)
    inter = timing.interleaved(calls(vm), min_rounds=10, max_rounds=10, target_s=0, clock=vm.clock)
    assert verdict(inter) == timing.SAME
    lines = timing.verdict_lines(inter)
    assert lines[0].startswith("no single fastest") and timing.SAME in lines[0]


@pytest.mark.parametrize("phase", [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
def test_interleaved_drift_verdict_at_every_phase(phase):
    vm = VirtualMachine(phase=phase, noise=0.02, seed=int(phase))
    times = timing.interleaved(
        {"a": vm.impl(0.01), "b": vm.impl(0.01)}, min_rounds=7, max_rounds=7, target_s=0, clock=vm.clock
    )
    assert verdict(times) == timing.SAME


# ---------------------------------------------------------------------- simulations


def _simulate(seed, rounds, effect, noise=0.05):
    rng = random.Random(seed)
    vm = VirtualMachine(
        drift=0.3, period=rng.uniform(0.1, 2.0), noise=noise, seed=seed, phase=rng.uniform(0, 2 * math.pi)
    )
    times = timing.interleaved(
        {"a": vm.impl(0.01), "b": vm.impl(0.01 * effect)},
        min_rounds=rounds,
        max_rounds=rounds,
        target_s=0,
        clock=vm.clock,
    )
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


def test_three_rounds_are_too_few_to_name_a_winner_so_rounds_are_added():
    """min..max of 3 rounds covers the median with 75% only: the verdict says so and names no
    one; ``run_rounds`` with a cap adds rounds until the 2x difference is named."""
    verdicts = [_simulate(seed, 3, 2.0, noise=0.02) for seed in range(20)]
    assert verdicts == [timing.SAME] * 20
    c = timing.compare_paired("b", [2.0, 2.1, 1.9], "a", [1.0, 1.0, 1.0])
    assert c.coverage == 0.75 and "75% CI" in c.describe() and "too few rounds" in c.describe()
    assert timing.unsettled({"a": [1.0, 1.0, 1.0], "b": [2.0, 2.1, 1.9]}) == ["b"]

    vm = VirtualMachine(drift=0.0, noise=0.02, seed=1)
    rounds = timing.run_rounds(
        {"a": vm.impl(0.01), "b": vm.impl(0.02)}, min_rounds=3, max_rounds=3, target_s=0, cap_s=1.0, clock=vm.clock
    )
    assert rounds.stopped == "decided" and len(rounds.times["a"]) >= 6
    assert verdict(rounds.times) == "slower"
    assert "rounds were added until every verdict was decided" in timing.stop_note(rounds.stopped, 6)


def test_rounds_stop_at_the_time_cap_or_the_round_cap_and_say_so():
    # b takes 3x or 1.01x a's time, alternately: its median ratio is beyond 3% but its interval
    # always reaches 1.01, so the verdict never settles.
    def machine():
        vm = VirtualMachine(drift=0.0)
        state = {"n": 0}

        def flaky():
            state["n"] += 1
            vm.now += 0.03 if state["n"] % 2 else 0.0101

        return vm, {"a": vm.impl(0.01), "b": flaky}

    vm, calls = machine()
    rounds = timing.run_rounds(
        calls, min_rounds=3, max_rounds=3, target_s=0, cap_s=0.2, cap_rounds=1000, clock=vm.clock
    )
    assert rounds.stopped == "time cap"
    assert 0.4 <= sum(rounds.times["a"]) + sum(rounds.times["b"]) < 0.45
    assert "still undecided" in timing.stop_note(rounds.stopped, len(rounds.times["a"]))
    vm, calls = machine()
    rounds = timing.run_rounds(calls, min_rounds=3, max_rounds=3, target_s=0, cap_s=10, cap_rounds=8, clock=vm.clock)
    assert rounds.stopped == "round cap" and len(rounds.times["b"]) == 8
    lines = timing.verdict_lines(rounds.times)
    assert any("undecided, more rounds needed" in line for line in lines), lines
    assert timing.stop_note("target", 5) == timing.stop_note("max rounds", 5) == ""


def test_small_differences_stay_unnamed_below_the_threshold():
    # 2% slower, measured exactly: real, but under the 3% worth naming.
    vm = VirtualMachine(drift=0.0)
    times = timing.interleaved(
        {"a": vm.impl(0.01), "b": vm.impl(0.0102)}, min_rounds=20, max_rounds=20, target_s=0, clock=vm.clock
    )
    c = timing.compare_paired("b", times["b"], "a", times["a"])
    assert c.ratio == pytest.approx(1.02) and c.verdict == timing.SAME


# ------------------------------------------------------------------ cold rounds


def _slowdown_with_a_cold_round(rounds, cold="other"):
    """The key-padding case of issue 30: name 2.00-2.27x other, and in the first round one of
    them cold (other 329.9 ms against its 35 ms median, or name 9x its median)."""
    rng = random.Random(rounds)
    other = [35.0 * rng.uniform(0.98, 1.02) for _ in range(rounds)]
    name = [o * rng.uniform(2.0, 2.27) for o in other]
    if cold == "other":
        other[0], name[0] = 329.9, 150.0
    else:
        name[0] = 9 * 75.0
    return {"subquad-matmul": name, "sdpa-flash": other}


def test_one_cold_round_cannot_turn_a_clear_slowdown_into_a_tie():
    # name cold: the interval's lower bound stays at the slowdown (the t interval went to 1.02).
    times = _slowdown_with_a_cold_round(6, cold="name")
    assert verdict(times, "subquad-matmul", "sdpa-flash") == "slower"
    # other cold, 6 rounds: min..max reaches the cold round; the verdict is undecided, not "the
    # same", and more rounds are asked for...
    times = _slowdown_with_a_cold_round(6)
    assert timing.unsettled(times) == ["subquad-matmul"]
    lines = timing.verdict_lines(times)
    assert SAME_LINE not in "\n".join(lines) and "undecided, more rounds needed" in lines[-1]
    # ... with 12 rounds the 99% interval leaves the extreme round out: slower.
    times = _slowdown_with_a_cold_round(12)
    c = timing.compare_paired("subquad-matmul", times["subquad-matmul"], "sdpa-flash", times["sdpa-flash"])
    assert c.verdict == "slower" and c.low >= 2.0 and c.coverage >= 0.99
    # Identical distributions with a cold round each stay the same.
    rng = random.Random(0)
    twins = {k: [35.0 * rng.uniform(0.97, 1.03) for _ in range(12)] for k in ("a", "b")}
    twins["a"][0], twins["b"][0] = 330.0, 70.0
    assert verdict(twins) == timing.SAME


SAME_LINE = f"are the {timing.SAME}"


def test_a_warm_round_keeps_the_cold_first_calls_out_of_the_times():
    vm = VirtualMachine(drift=0.0)

    def cold_first(base, factor):
        state = {"calls": 0}

        def run():
            state["calls"] += 1
            vm.now += base * (factor if state["calls"] == 1 else 1.0)

        return run

    calls = {"subquad-matmul": cold_first(0.075, 2.0), "sdpa-flash": cold_first(0.035, 9.4)}
    rounds = timing.run_rounds(calls, min_rounds=6, max_rounds=6, target_s=0, warm_rounds=1, clock=vm.clock)
    assert rounds.times["sdpa-flash"] == pytest.approx([0.035] * 6)
    assert verdict(rounds.times, "subquad-matmul", "sdpa-flash") == "slower"


def test_time_interleaved_warms_up_every_implementation_even_after_a_slow_memory_call():
    """The memory phase's call took 1000 s (say, in a worker with a small mmap threshold): the
    warm-up still runs the timed call itself, and the first timed round is not a cold one."""
    vm = VirtualMachine(drift=0.0)
    case = Case(1, 2, 32, 32, 16, dtype="fp32")

    def impl(name, base):
        def prepare(inputs):
            state = {"calls": 0}  # what the timed step builds on its first call: a mask, a plan

            def forward():
                state["calls"] += 1
                vm.now += base * (20.0 if state["calls"] == 1 else 1.0)
                return inputs.query.clone()

            return forward, {}

        return Impl(name, "cold on its first call", prepare)

    rows = []
    for name, base in (("a", 0.01), ("b", 0.02)):
        result = Result.for_case(name, case)
        result.memory_call_ms = 1e6
        rows.append((impl(name, base), result))
    measure.time_interleaved(rows, case, Timing(warmup_s=0.0, target_s=0.05, min_reps=5, max_reps=5), clock=vm.clock)
    a, b = (r for _, r in rows)
    assert a.status == b.status == "ok" and a.reps == b.reps == 6
    assert a.times_ms == pytest.approx([10.0] * 6) and b.times_ms == pytest.approx([20.0] * 6)
    # 5 rounds (93.75% sure) were too few to call b 2x slower; a sixth decided it.
    assert a.rounds_stopped == "decided"
    assert "(6 rounds: rounds were added until every verdict was decided)" in "\n".join(report.verdicts([a, b]))


# -------------------------------------------------------------------------- pieces


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_round_orders_are_balanced_and_deterministic(n):
    """Over each cycle (n rounds, 2n for odd n) every name takes every position and is preceded by
    every other name equally often; the same seed gives the same orders, another seed others."""
    names = [f"impl{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    orders = timing.round_orders(names, 3 * cycle, seed=7)
    assert orders == timing.round_orders(names, 3 * cycle, seed=7)
    for c in range(3):
        block = orders[c * cycle : (c + 1) * cycle]
        assert all(sorted(order) == names for order in block)
        for position in range(n):
            counts = collections.Counter(order[position] for order in block)
            assert set(counts.values()) == {cycle // n}
        pairs = collections.Counter((a, b) for order in block for a, b in zip(order, order[1:]))
        if n > 1:
            assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1, pairs
    if n > 2:
        assert timing.round_orders(names, 3 * cycle, seed=8) != orders


def test_rotation_bias_is_gone_twins_stay_the_same_beside_a_cache_trasher():
    """A heavy implementation slows whatever runs right after it by 30%. With the old rotation one
    twin always followed it and "lost"; with balanced orders each twin follows it equally often
    and the twins are the same within noise."""
    vm = VirtualMachine(drift=0.0)
    last = {"name": None}

    def impl(name, base):
        def run():
            vm.now += base * (1.3 if last["name"] == "naive" else 1.0)
            last["name"] = name

        return run

    bases = {"naive": 0.05, "subquad": 0.01, "subquad-fused": 0.01, "sdpa": 0.012, "sdpa-math": 0.03, "flex": 0.02}
    calls = {name: impl(name, base) for name, base in bases.items()}
    times = timing.run_rounds(calls, min_rounds=120, max_rounds=120, target_s=0, clock=vm.clock).times
    assert verdict(times, "subquad", "subquad-fused") == timing.SAME
    rotated = {name: [] for name in calls}  # what the old rotation did: a fixed predecessor
    for order in [list(calls)[r % 6 :] + list(calls)[: r % 6] for r in range(120)]:
        for name in order:
            start = vm.now
            calls[name]()
            rotated[name].append(vm.now - start)
    assert verdict(rotated, "subquad", "subquad-fused") == "slower"


def test_interleaved_runs_setup_untimed_and_stops_at_the_target():
    vm = VirtualMachine(drift=0.0)
    setups = []

    def setup():
        setups.append(1)
        vm.now += 1.0  # a slow prefill: must not count

    times = timing.interleaved(
        {"a": timing.Timed(vm.impl(0.01), setup), "b": vm.impl(0.01)},
        min_rounds=3,
        max_rounds=100,
        target_s=0.045,
        clock=vm.clock,
    )
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
    times = timing.interleaved(
        {"fast": vm.impl(0.01), "slow": vm.impl(0.02), "twin": vm.impl(0.01)},
        min_rounds=9,
        max_rounds=9,
        target_s=0,
        clock=vm.clock,
    )
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
    results = measure.run_all(jobs, Timing(warmup_s=0.0, target_s=0.01, min_reps=4, max_reps=6), isolate=False)
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
    results = measure.run_all(jobs, Timing(warmup_s=0.0, target_s=0.0, min_reps=3, max_reps=3), isolate=False)
    by = {r.impl: r for r in results}
    assert by["flaky"].status == "error" and "went wrong later" in by["flaky"].reason
    assert by["steady"].status == "ok" and by["steady"].reps == 3


def test_compare_counts_a_regression_only_beyond_the_spread():
    def r(ms, q1, q3):
        return Result(impl="x", case="c", mode="fwd", median_ms=ms, q1_ms=q1, q3_ms=q3, reps=5, peak_bytes=1 << 20)

    text, regs = report.compare([r(11.0, 9.0, 13.0)], [r(10.0, 9.5, 10.5)], 5)
    assert regs == [] and "same" in text  # 10% slower by median, but inside the spreads
    text, regs = report.compare([r(20.0, 19.0, 21.0)], [r(10.0, 9.5, 10.5)], 5)
    assert len(regs) == 1 and "slower" in text


def test_the_planner_line_reads_the_paired_verdict_not_a_ratio_of_medians():
    """Twins whose medians differ by 12% from the noise of the rounds: the planner's line says
    "same within noise", not that the planner cost 12%."""
    rng = random.Random(5)
    rows = []
    machine = [rng.choice([1.0, 1.25]) for _ in range(12)]  # rounds at two speeds
    for impl in ("subquad-fused", "subquad"):
        times = [10.0 * m * rng.uniform(0.99, 1.01) for m in machine]
        rows.append(
            Result(
                impl=impl,
                case="c",
                mode="fwd",
                times_ms=times,
                median_ms=statistics.median(times),
                plan={"backend": "fused"} if impl == "subquad" else {},
            )
        )
    rows[0].median_ms, rows[1].median_ms = 10.0, 11.2  # what a ratio of medians would have blamed
    line = report.verdicts(rows)[0]
    assert "subquad's planner picked fused: 11.20 ms (1.00x, same within noise)" in line, line
