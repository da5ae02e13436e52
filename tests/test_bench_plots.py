"""The figures of ``subquad bench --out`` (bench/plots.py), built from made-up records (nothing is
timed): files written, titles in words, linear bars from zero with IQR whiskers, the fastest and
the planner's pick marked, absent implementations listed with why, the memory panel's
definition and budget, and the length sweep's log-log axes, plain ticks and out-of-memory
marks; and the ``--model`` figures in the same look. Skipped without matplotlib."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

from subquad.bench import model_report, plots, report
from subquad.bench.measure import Result
from subquad.bench.model_measure import ModelResult

MiB = 2**20
DEVICE = {
    "device": "cpu",
    "device_name": "Test CPU, 2 CPUs",
    "torch_version": "2.0",
    "memory_method": "cpu VmHWM - VmRSS",
}
IMPLS = ("sdpa-flash", "sdpa-math", "naive", "subquad", "subquad-fused", "subquad-matmul", "xformers")


def record(impl, length, mask="none", *, budget=None, status="ok", reason=None, factor=1.0, rounds=20):
    """One made-up record of 1×4×length×64 fp32: time ∝ L² (scaled by ``factor``), memory ∝ L²
    for the implementations that materialize the scores and ∝ L for the others."""
    shape = [1, 4, length, length, 64]
    name = f"{'x'.join(map(str, shape))} fp32 {mask}" + (f" budget={budget}" if budget else "")
    r = Result(
        impl,
        name,
        "fwd",
        status=status,
        reason=reason,
        shape=shape,
        dtype="fp32",
        mask=mask,
        budget=budget,
        output_bytes=length * 4 * 64 * 4,
        **DEVICE,
    )
    if status != "ok":
        return r
    base = factor * (length / 1024) ** 2 * 5.0
    r.times_ms = [base * (1 + 0.01 * ((i * 7) % 5 - 2)) for i in range(rounds)]
    r.median_ms = sorted(r.times_ms)[rounds // 2]
    r.q1_ms, r.q3_ms = base * 0.99, base * 1.01
    r.reps = rounds
    materializes = impl in ("sdpa-math", "naive")
    r.peak_bytes = int((length / 1024) ** 2 * 40 * MiB if materializes else length / 1024 * 1.5 * MiB)
    if impl.startswith("subquad"):
        backend = "matmul" if impl == "subquad-matmul" or (impl == "subquad" and length >= 16384) else "fused"
        r.plan = {"backend": backend, "chunk_size": [1024, 1024], "predicted_peak_bytes": MiB, "budget_bytes": 11 << 30}
    return r


def synthetic() -> list[Result]:
    """A sweep of 1024…16384 (naive out of memory at 16384, sdpa-math skipped from 8192), and
    an ALiBi case under a 64MiB budget that subquad-fused wins, subquad the same within noise."""
    factors = {
        "sdpa-flash": 1.0,
        "sdpa-math": 3.0,
        "naive": 3.5,
        "subquad": 1.02,
        "subquad-fused": 1.02,
        "subquad-matmul": 1.6,
    }
    out = []
    for length in (1024, 2048, 4096, 8192, 16384):
        for impl in IMPLS:
            if impl == "xformers":
                out.append(
                    record(
                        impl, length, status="unsupported", reason="xformers is not installed (pip install xformers)"
                    )
                )
            elif impl == "naive" and length == 16384:
                out.append(record(impl, length, status="oom", reason="[enforce fail] can't allocate 4 GiB"))
            elif impl == "sdpa-math" and length >= 8192:
                out.append(
                    record(
                        impl,
                        length,
                        status="unsupported",
                        reason="skipped: would materialize "
                        "≈3.0 GiB of scores, 2.0 GiB of RAM available (--no-skip runs it)",
                    )
                )
            else:
                out.append(record(impl, length, factor=factors[impl]))
    alibi = {
        "sdpa-flash": 3.0,
        "sdpa-math": 5.0,
        "naive": 6.0,
        "subquad": 1.0,
        "subquad-fused": 1.0,
        "subquad-matmul": 2.5,
    }
    for impl in IMPLS:
        if impl == "xformers":
            out.append(
                record(
                    impl,
                    2048,
                    "alibi",
                    budget="64MiB",
                    status="unsupported",
                    reason="xformers is not installed (pip install xformers)",
                )
            )
        elif impl == "subquad-matmul":
            out.append(
                record(
                    impl,
                    2048,
                    "alibi",
                    budget="64MiB",
                    status="unsupported",
                    reason="NotImplementedError: matmul: needs 96 MiB of scores, budget is 64 MiB",
                )
            )
        else:
            out.append(record(impl, 2048, "alibi", budget="64MiB", factor=alibi[impl]))
    return out


def panel(fig, title):
    found = [ax for ax in fig.axes if ax.get_visible() and title in ax.get_title(loc="left")]
    assert len(found) == 1, [ax.get_title(loc="left") for ax in fig.axes]
    return found[0]


def flat(text):
    """Text as one line: the notes are wrapped to the panel's width."""
    return " ".join(text.split())


def texts(ax):
    return [t.get_text() for t in ax.texts]


@pytest.fixture(scope="module")
def figs():
    import matplotlib.pyplot as plt

    drawn = plots.figures(synthetic())
    yield drawn
    for fig in drawn.values():
        plt.close(fig)


def test_plot_writes_time_memory_and_sweep(tmp_path):
    written = plots.plot(synthetic(), str(tmp_path))
    assert [os.path.basename(p) for p in written] == ["time.png", "memory.png", "sweep.png"]
    assert all(os.path.getsize(p) > 10_000 for p in written)


def test_save_draws_through_plots(tmp_path):
    paths = report.save(synthetic(), str(tmp_path / "run"))
    assert {os.path.basename(p) for p in paths} == {
        "results.json",
        "results.csv",
        "time.png",
        "memory.png",
        "sweep.png",
    }


def test_no_sweep_figure_without_three_lengths_and_none_without_results():
    only_alibi = [r for r in synthetic() if r.mask == "alibi"]
    assert set(plots.figures(only_alibi)) == {"time.png", "memory.png"}
    assert plots.figures([r for r in only_alibi if r.status != "ok"]) == {}


def test_titles_say_the_case_in_words():
    r = record("naive", 2048, "causal")
    assert plots.case_title(r) == "1×4×2048×64 fp32, causal mask, forward"
    r = record("naive", 2048, "alibi", budget="64MiB")
    r.mode = "fwd+bwd"
    assert plots.case_title(r) == "1×4×2048×64 fp32, causal + ALiBi bias, forward + backward, subquad budget 64MiB"
    assert plots.case_title(r, sweep=True).startswith("1×4×L×64 fp32")


def test_time_bars_are_linear_from_zero_with_iqr_whiskers(figs):
    ax = panel(figs["time.png"], "1×4×2048×64 fp32, causal + ALiBi bias, forward, subquad budget 64MiB")
    assert ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0
    from matplotlib.container import BarContainer

    bars = next(c for c in ax.containers if isinstance(c, BarContainer))
    assert bars.errorbar is not None and bars.errorbar.has_xerr  # the IQR whiskers
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "sdpa-flash",
        "sdpa-math",
        "naive",
        "subquad",
        "subquad-fused",
    ]
    assert "IQR whiskers" in flat(ax.get_xlabel())


def test_time_marks_the_fastest_the_ties_and_the_planners_pick(figs):
    ax = panel(figs["time.png"], "causal + ALiBi bias")
    labels = texts(ax)
    fused = next(t for t in labels if "planner's pick" in t)
    planner = next(t for t in labels if "planner picked fused" in t)
    # subquad and subquad-fused have the same per-round times: one is the fastest, the other
    # the same within noise.
    assert {"★ fastest" in fused, "★ fastest" in planner} == {True, False}
    assert "≈ fastest" in fused + planner


def test_a_ratio_too_few_rounds_can_tell_is_undecided_not_the_same():
    import matplotlib.pyplot as plt

    best, other = record("sdpa-flash", 1024, rounds=5), record("naive", 1024, rounds=5)
    best.times_ms, best.median_ms = [10.0] * 5, 10.0
    other.times_ms, other.median_ms = [10.2, 12.0, 9.5, 11.0, 13.0], 11.0  # ratios 0.95…1.3
    drawn = plots.figures([best, other])
    try:
        labels = texts(panel(drawn["time.png"], "1×4×1024×64 fp32, no mask, forward"))
        assert any("★ fastest" in t for t in labels) and any("? undecided" in t for t in labels)
        assert not any("≈ fastest" in t for t in labels)
    finally:
        for fig in drawn.values():
            plt.close(fig)


def test_absent_implementations_are_listed_with_why(figs):
    fig = figs["time.png"]
    ax = panel(fig, "causal + ALiBi bias")
    assert "not run: subquad-matmul: matmul: needs 96 MiB of scores, budget is 64 MiB" in flat(ax.get_xlabel())
    # Absent from every case for one reason: said once, under the figure.
    footer = flat(fig._supxlabel.get_text())
    assert "not run anywhere: xformers: xformers is not installed (pip install xformers)" in footer
    assert "xformers" not in flat(ax.get_xlabel())


def test_a_case_where_nothing_ran_keeps_its_panel_and_says_why():
    import matplotlib.pyplot as plt

    rows = [
        record("naive", 1024),
        record("naive", 65536, status="unsupported", reason="skipped: too slow on CPU (--no-skip runs it)"),
    ]
    drawn = plots.figures(rows)
    try:
        ax = panel(drawn["time.png"], "1×4×65536×64")
        assert "nothing ran in this case" in texts(ax)
        assert "not run: naive: skipped: too slow on CPU (--no-skip runs it)" in flat(ax.get_xlabel())
    finally:
        for fig in drawn.values():
            plt.close(fig)


def test_memory_panel_defines_peak_names_the_budget_and_the_bias(figs):
    fig = figs["memory.png"]
    footer = flat(fig._supxlabel.get_text())
    assert "peak extra memory: the highest memory in use during one call minus" in footer
    assert "the inputs are not counted" in footer and "cpu VmHWM - VmRSS" in footer
    assert "subquad's memory budget: 64MiB (--budget)" in footer
    ax = panel(fig, "causal + ALiBi bias")
    assert "the peak includes the ALiBi bias (1×4×2048×2048 fp32), built inside the call" in flat(ax.get_xlabel())
    assert "dotted line: the output (2.0 MiB)" in flat(ax.get_xlabel())
    assert any("incl. 64.0 MiB ALiBi bias" in t for t in texts(ax))
    assert any("planner: fused, predicted 1.0 MiB + output" in t for t in texts(ax))
    assert ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0


def test_sweep_is_log_log_with_plain_ticks_slopes_and_out_of_memory_marks(figs):
    fig = figs["sweep.png"]
    fig.canvas.draw()
    time_ax = panel(fig, "median time per call: 1×4×L×64 fp32, no mask, forward")
    memory_ax = panel(fig, "peak extra memory: 1×4×L×64 fp32, no mask, forward")
    for ax in (time_ax, memory_ax):
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1024", "2048", "4096", "8192", "16384"]
        ticks = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        assert ticks and all(re.fullmatch(r"[\d,.]+", t) for t in ticks), ticks
        assert {"∝ L  ", "∝ L²  "} <= set(texts(ax))
        crosses = [line for line in ax.lines if line.get_marker() == "X"]
        assert sorted(float(x) for line in crosses for x in line.get_xdata()) == [8192, 16384, 16384]
        assert "✕ naive at L = 16384: out of memory" in flat(ax.get_xlabel())
        assert "✕ sdpa-math at L = 8192, 16384: skipped: would materialize" in flat(ax.get_xlabel())
    legend = [t.get_text() for t in time_ax.get_legend().get_texts()]
    assert "subquad (planner: fused 1024–8192, matmul 16384)" in legend
    # Lines that end on top of each other share one name at their end.
    assert any("subquad" in t and "subquad-fused" in t and "sdpa-flash" in t for t in texts(time_ax))
    handles, _ = time_ax.get_legend_handles_labels()
    styles = {(h.lines[0].get_marker(), h.lines[0].get_linestyle()) for h in handles}
    assert len(styles) == len(legend)  # every line its own marker and dash


def test_importing_report_and_plots_does_not_import_matplotlib():
    code = "import sys, subquad, subquad.bench.report, subquad.bench.plots; print('matplotlib' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------- --model figures


def model_records():
    """sd-vae-decoder at 256…1024 px under a 4 GiB cap: classic out of memory at 1024, sdpa over
    the cap there, subquad fits; xformers has no operator on this device."""
    out = []
    for size in (256, 512, 1024):
        for impl in ("classic", "sdpa", "subquad", "xformers"):
            r = ModelResult(
                "sd-vae-decoder",
                impl,
                "infer",
                "infer",
                size,
                "px",
                cap_bytes=4 << 30,
                weights_bytes=190 * MiB,
                device_name="Test CPU",
                torch_version="2.0",
                memory_method="cpu VmHWM - VmRSS",
            )
            if impl == "xformers":
                r.status, r.reason = "unsupported", "xformers has no operator on cpu"
            elif impl == "classic" and size == 1024:
                r.status, r.reason, r.over_cap = "oom", "killed at the cap (SIGKILL)", True
            else:
                r.median_ms = size * (2.0 if impl == "classic" else 1.0)
                r.q1_ms, r.q3_ms, r.rounds = r.median_ms * 0.95, r.median_ms * 1.05, 3
                r.peak_bytes = size * size * (6000 if impl == "sdpa" else 1000)
                r.over_cap = r.total_bytes > r.cap_bytes
            out.append(r)
    return out


def test_model_figures_share_the_look():
    import matplotlib.pyplot as plt

    drawn = model_report.figures(model_records())
    try:
        assert set(drawn) == {"memory.png", "time.png"}
        fig = drawn["memory.png"]
        fig.canvas.draw()
        ax = panel(fig, "sd-vae-decoder: inference (one forward, no grad), batch 1 fp32")
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        ticks = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        assert ticks and all(re.fullmatch(r"[\d,.]+", t) for t in ticks), ticks
        crosses = sorted(float(x) for line in ax.lines if line.get_marker() == "X" for x in line.get_xdata())
        assert crosses == [1024, 1024]  # classic out of memory, sdpa over the cap
        notes = flat(ax.get_xlabel())
        assert "✕ classic at 1024: out of memory (killed at the cap (SIGKILL))" in notes
        assert "✕ sdpa at 1024: over the cap" in notes
        assert "not run: xformers: xformers has no operator on cpu" in notes
        assert "cap 4.0 GiB" in [t.get_text() for t in ax.get_legend().get_texts()]
        assert "it is what the cap of 4.0 GiB limits" in flat(fig._supxlabel.get_text())
        time_ax = panel(drawn["time.png"], "sd-vae-decoder")
        assert any(c.has_yerr for c in time_ax.containers)  # IQR whiskers
    finally:
        for fig in drawn.values():
            plt.close(fig)
