"""Showing and saving ``subquad bench --model`` results: the table, the verdicts (from the
interleaved rounds), the ``--max-memory`` summary, results.json / results.csv, the plots
(memory.png and time.png against the resolution or sequence length, the cap drawn), and
``--compare``. matplotlib is imported only to plot (``pip install 'subquad[bench]'``); the
figures share the look of ``plots.py``.

What the rest of the package uses: ``render``, ``markdown``, ``max_memory_lines``, ``save``, ``load_json``,
``compare``, ``REQUIRED_FIELDS``.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import textwrap
from collections import defaultdict
from typing import Any, Optional

from . import plots, timing
from .model_measure import ModelResult
from .report import csv_cell, format_bytes, format_ms, read_records, write_json

REQUIRED_FIELDS = (
    "model",
    "impl",
    "task",
    "mode",
    "size",
    "size_unit",
    "status",
    "reason",
    "median_ms",
    "q1_ms",
    "q3_ms",
    "times_ms",
    "rounds",
    "peak_bytes",
    "weights_bytes",
    "memory_method",
    "max_abs_diff",
    "device_name",
    "torch_version",
    "dtype",
    "batch",
)
COLUMNS = ("impl", "median ms", "IQR ms", "peak step", "+ weights", "max |diff|", "status")


def _title(r: ModelResult) -> str:
    return f"{r.model} {r.mode} {r.size} {r.size_unit} batch {r.batch} {r.dtype}"


def _groups(results: list[ModelResult]) -> dict[str, list[ModelResult]]:
    groups: dict[str, list[ModelResult]] = {}
    for r in results:
        groups.setdefault(_title(r), []).append(r)
    return groups


def _row(r: ModelResult) -> list[str]:
    status = r.status if not r.reason else f"{r.status}: {r.reason}"
    if r.over_cap:
        status += " (over the cap)"
    iqr = "-" if r.q1_ms is None else f"{format_ms(r.q1_ms)}-{format_ms(r.q3_ms)}"
    median = format_ms(r.median_ms)
    if r.median_ms is None and r.memory_step_ms is not None and r.status == "ok":
        median = f"({format_ms(r.memory_step_ms)})"  # the worker's one step, untimed rounds
    diff = "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.1e}"
    return [r.impl, median, iqr, format_bytes(r.peak_bytes), format_bytes(r.total_bytes), diff, status[:100]]


def verdicts(rows: list[ModelResult]) -> list[str]:
    ok = [r for r in rows if r.status == "ok" and r.times_ms]
    if len({len(r.times_ms) for r in ok}) != 1:
        return []
    return timing.verdict_lines({r.impl: [t / 1e3 for t in r.times_ms] for r in ok})


def render(results: list[ModelResult]) -> str:
    """The table of each (model, mode, size), with its verdict."""
    lines = []
    for title, rows in _groups(results).items():
        cells = [list(COLUMNS)] + [_row(r) for r in rows]
        widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS) - 1)]
        lines.append(f"== {title}")
        for c in cells:
            lines.append(
                "  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(c, widths)))
                + "  "
                + c[-1]
            )
        found = verdicts(rows)
        if found:
            lines.append("verdict: " + found[0])
            lines += [f"  {line}" for line in found[1:]]
        lines.append("")
    lines += max_memory_lines(results)
    return "\n".join(lines).rstrip() + "\n"


def max_memory_lines(results: list[ModelResult]) -> list[str]:
    """Per mode, the largest size each implementation ran at under the cap:
    ``at 4.0 GiB, infer: classic up to 768 px, sdpa up to 1024 px``."""
    capped = [r for r in results if r.cap_bytes]
    if not capped:
        return []
    by_mode: dict = defaultdict(lambda: defaultdict(list))
    for r in capped:
        by_mode[(r.model, r.mode)][r.impl].append(r)
    lines = []
    for (model, mode), by_impl in by_mode.items():
        cap = next(iter(by_impl.values()))[0].cap_bytes
        parts = []
        for impl, rows in by_impl.items():
            fits = [r.size for r in rows if r.status == "ok" and not r.over_cap]
            unit = rows[0].size_unit
            if all(r.status == "unsupported" for r in rows):
                continue
            tried = max(r.size for r in rows if r.status != "skipped")
            if fits:
                text = f"{impl} up to {max(fits)} {unit}"
                if max(fits) == tried:
                    text += " (the largest tried)"
            else:
                text = f"{impl} none of the sizes"
            parts.append(text)
        lines.append(f"at {format_bytes(cap)} ({model} {mode}, step peak + weights): " + ", ".join(parts))
    return lines


def markdown(results: list[ModelResult]) -> str:
    """The results as one Markdown table (for docs): a row per (mode, size, implementation)."""
    lines = [
        "| mode | size | impl | step time, median (IQR) | peak step | + weights | max abs diff vs sdpa | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.median_ms is not None:
            time_text = f"{format_ms(r.median_ms)} ms ({format_ms(r.q1_ms)}-{format_ms(r.q3_ms)}, {r.rounds} rounds)"
        elif r.memory_step_ms is not None and r.status == "ok":
            time_text = f"{format_ms(r.memory_step_ms)} ms (one step)"
        else:
            time_text = "-"
        diff = "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.1e}"
        status = r.status + (f": {r.reason}" if r.reason and r.status != "ok" else "")
        if r.over_cap:
            status += " (over the cap)"
        lines.append(
            f"| {r.mode} | {r.size} {r.size_unit} | {r.impl} | {time_text} | "
            f"{format_bytes(r.peak_bytes)} | {format_bytes(r.total_bytes)} | {diff} | {status[:90]} |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ files


def load_json(path: str) -> list[ModelResult]:
    return read_records(path, ModelResult, "subquad bench --model", key="model")


def write_csv(results: list[ModelResult], path: str) -> None:
    names = list(ModelResult.__dataclass_fields__)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(names + ["total_bytes"])
        for r in results:
            writer.writerow([csv_cell(getattr(r, name)) for name in names] + [csv_cell(r.total_bytes)])


MODE_WORDS = {
    "infer": "inference (one forward, no grad)",
    "prefill": "prefill (the prompt)",
    "decode": "decode (8 tokens on the prefill's cache)",
    "train": "training step (forward + backward)",
    "train-lora": "LoRA-style training step (attention projections trained)",
    "train-full": "full training step (forward + backward)",
}


def _not_fitting(r: ModelResult) -> Optional[str]:
    """``out of memory`` / ``over the cap`` / ``skipped`` where the step did not fit, else None."""
    if r.status == "oom":
        return "out of memory"
    if r.over_cap:
        return "over the cap"
    if r.status == "skipped":
        return "skipped"
    return None


def figures(results: list[ModelResult]) -> dict[str, Any]:
    """memory.png (the step's peak; with a cap, plus the weights, the cap dashed) and time.png
    (median with its IQR as whiskers; the worker's single step where no rounds ran) against the
    size, log-log with plain ticks, one panel per mode, one marker and dash per implementation,
    an ✕ where a step did not fit, and under each panel what did not run and why (the look of
    ``plots.py``), as matplotlib Figures by file name; empty without matplotlib or results."""
    if importlib.util.find_spec("matplotlib") is None:
        return {}
    import matplotlib  # optional dependency (subquad[bench])

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (subquad[bench])

    ok = [r for r in results if r.status == "ok"]
    if not ok:
        return {}
    style = plots.styles(list(dict.fromkeys(r.impl for r in results)), plt)
    cap = next((r.cap_bytes for r in results if r.cap_bytes), None)
    first = ok[0]
    weights = next((r.weights_bytes for r in ok if r.weights_bytes), None)
    definition = (
        "peak memory of the step: the highest memory in use during one step minus what was in use before it "
        f"(the weights and the inputs are not counted) [{first.memory_method or '?'}]"
    )
    if cap:
        definition += f"; plus the weights ({format_bytes(weights)}), it is what the cap of {format_bytes(cap)} limits"
    timing_line = "median time of one step over interleaved rounds; whiskers: interquartile range"
    footer = []
    if any(r.budget for r in results):
        footer.append(f"subquad's memory budget: {', '.join(sorted({r.budget for r in results if r.budget}))}")
    footer.append(f"{first.device_name}, torch {first.torch_version}, subquad {first.subquad_version or '?'}")
    return {
        name: _figure(plt, results, name, style=style, cap=cap, first=first, caption=[line, *footer])
        for name, line in (("memory.png", definition), ("time.png", timing_line))
    }


def _figure(
    plt: Any,
    results: list[ModelResult],
    filename: str,
    *,
    style: dict[str, plots.Style],
    cap: Optional[int],
    first: ModelResult,
    caption: list[str],
) -> Any:
    """One of :func:`figures`' files: a panel per mode (:func:`_panel`), the title, the caption."""
    label = "step time (ms), IQR whiskers"
    if filename == "memory.png":
        label = "peak memory of the step + weights (MiB)" if cap else "peak memory of the step (MiB)"
    modes = list(dict.fromkeys(r.mode for r in results))
    width = max(9.0, 7.0 * len(modes))
    fig, axes = plt.subplots(1, len(modes), figsize=(width, 5.4), squeeze=False, layout="constrained")
    for ax, mode in zip(axes.flat, modes):
        _panel(ax, [r for r in results if r.mode == mode], filename, style, cap)
        ax.set_ylabel(label, fontsize=8.5)
        title = f"{first.model}: {MODE_WORDS.get(mode, mode)}, batch {first.batch} {first.dtype}"
        ax.set_title(title, fontsize=9.5, loc="left")
        ax.legend(fontsize=7.5, loc="upper left")
    what = "peak memory" if filename == "memory.png" else "step time"
    fig.suptitle(f"subquad bench --model {first.model}: {what} against the size", fontsize=12, weight="bold")
    fig.supxlabel(plots.wrap(caption, int(width * 16)), fontsize=8, x=0.01, ha="left", multialignment="left")
    return fig


def _panel(ax: Any, rows: list[ModelResult], filename: str, style: dict[str, plots.Style], cap: Optional[int]) -> None:
    """One mode's panel: a line per implementation, the cap, an ✕ where a step did not fit, and
    under it what did not run and why."""
    # With a cap, what it is compared with (the step and the weights); without one, the step
    # alone, which is what the attention changes.
    memory = (lambda r: r.total_bytes) if cap else (lambda r: r.peak_bytes)
    ends: list[tuple[float, float, str]] = []
    for impl in dict.fromkeys(r.impl for r in rows):
        mine = sorted((r for r in rows if r.impl == impl and r.status == "ok"), key=lambda r: r.size)
        pts: list[tuple[int, float, Optional[float], Optional[float]]]  # size, y, q1, q3
        if filename == "memory.png":
            pts = [(r.size, (memory(r) or 0) / 2**20, None, None) for r in mine if memory(r)]
        else:
            pts = [
                (r.size, r.median_ms or r.memory_step_ms or 0.0, r.q1_ms, r.q3_ms)
                for r in mine
                if r.median_ms or r.memory_step_ms
            ]
        if pts:
            _line(ax, impl, pts, style[impl])
            ends.append((pts[-1][0], pts[-1][1], impl))
    if filename == "memory.png" and cap:
        ax.axhline(cap / 2**20, color="red", linestyle="--", linewidth=1, label=f"cap {format_bytes(cap)}")
    plots.log_axes(ax, sorted({r.size for r in rows}))
    failed: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: r.size):
        word = _not_fitting(r)
        if word is not None:
            failed[r.impl].append((r.size, word))
    plots.cross_marks(ax, dict(failed), style)
    plots.end_labels(ax, ends)  # after the marks: they set the final y limits
    ax.set_xlabel(plots.wrap(_panel_notes(rows, failed)), loc="left", fontsize=8)


def _line(ax: Any, impl: str, pts: list[tuple[int, float, Optional[float], Optional[float]]], s: plots.Style) -> None:
    """One implementation's points ``(size, y, q1, q3)``, whiskers where q1 and q3 are known."""
    ys = [p[1] for p in pts]
    err = [
        [max(0.0, y - (p[2] if p[2] is not None else y)) for p, y in zip(pts, ys)],
        [max(0.0, (p[3] if p[3] is not None else y) - y) for p, y in zip(pts, ys)],
    ]
    plots.errorbar_line(ax, [p[0] for p in pts], ys, err if any(err[0]) or any(err[1]) else None, impl, s)


def _panel_notes(rows: list[ModelResult], failed: dict[str, list[tuple[float, str]]]) -> list[str]:
    """The lines under a panel: its size unit, each ✕ and why, the implementations that did not run."""
    notes = [f"size ({rows[0].size_unit})"]
    for impl, marks in failed.items():
        r = next(r for r in rows if r.impl == impl and r.size == marks[0][0])
        why = f" ({r.reason})" if r.reason else ""
        notes.append(f"✕ {impl} at {', '.join(str(x) for x, _ in marks)}: {marks[0][1]}{why}")
    absent: dict[str, list[str]] = defaultdict(list)
    for impl in dict.fromkeys(r.impl for r in rows):
        mine = [r for r in rows if r.impl == impl]
        if all(r.status in ("unsupported", "error") for r in mine):
            absent[textwrap.shorten(mine[0].reason or mine[0].status, 110, placeholder="…")].append(impl)
    return notes + [f"not run: {', '.join(names)}: {reason}" for reason, names in absent.items()]


def plot(results: list[ModelResult], out_dir: str) -> list[str]:
    """Write :func:`figures` into ``out_dir``. Returns the paths written."""
    drawn = figures(results)
    if not drawn:
        return []
    import matplotlib.pyplot as plt  # optional dependency (subquad[bench])

    written = []
    for filename, fig in drawn.items():
        path = os.path.join(out_dir, filename)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def save(results: list[ModelResult], out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "results.json"), os.path.join(out_dir, "results.csv")]
    write_json(results, paths[0])
    write_csv(results, paths[1])
    return paths + plot(results, out_dir)


def _per_round(r: ModelResult) -> Optional[list[float]]:
    times = [float(t) for t in r.times_ms or []]
    return times if len(times) >= 2 else None


def _time_change(r: ModelResult, o: ModelResult, new_by: dict, old_by: dict) -> timing.Comparison:
    """new/old time of one row: per round against the run's reference implementation (the same
    model, mode and size, timed in the same rounds) where both runs have one, so that a machine
    slower as a whole in one run cancels out; else the raw per-round times; else from the IQRs
    (an older results.json)."""
    rn, ro = _per_round(r), _per_round(o)
    if rn is None or ro is None:
        return timing.compare_unpaired(
            r.impl,
            timing.Spread(r.median_ms or 0.0, r.q1_ms or 0.0, r.q3_ms or 0.0, r.rounds),
            o.impl,
            timing.Spread(o.median_ms or 0.0, o.q1_ms or 0.0, o.q3_ms or 0.0, o.rounds),
        )
    ref_key = (r.model, r.reference, r.mode, r.size)
    nr, orr = new_by.get(ref_key), old_by.get(ref_key)
    if r.impl != r.reference and nr is not None and orr is not None and nr.status == orr.status == "ok":
        n_ref, o_ref = _per_round(nr), _per_round(orr)
        if n_ref is not None and o_ref is not None and len(n_ref) == len(rn) and len(o_ref) == len(ro):
            return timing.compare_runs(r.impl, rn, ro, new_reference=n_ref, old_reference=o_ref, reference=r.reference)
    return timing.compare_runs(r.impl, rn, ro)


def compare(new: list[ModelResult], old: list[ModelResult], fail_pct: Optional[float] = None) -> tuple[str, list[str]]:
    """new/old ratios matched on (model, impl, mode, size). Time per round against the reference
    implementation of the same rounds (``timing.compare_runs``: the Hodges-Lehmann shift of the
    two runs' log ratios with its Mann-Whitney interval); a regression is a ratio whose whole
    interval lies above the limit, with the raw median time up by more than the limit too (a
    reference can move on its own between runs). Peak memory as a plain ratio; a difference
    under 1 MiB is none."""
    old_by = {(r.model, r.impl, r.mode, r.size): r for r in old}
    new_by = {(r.model, r.impl, r.mode, r.size): r for r in new}
    lines, regressions = [], []
    limit = None if fail_pct is None else 1 + fail_pct / 100
    for r in new:
        o = old_by.get((r.model, r.impl, r.mode, r.size))
        if o is None:
            continue
        label = f"{r.impl} {r.mode} {r.size} {r.size_unit}"
        if o.status == "ok" and r.status in ("oom", "error"):
            regressions.append(f"{label}: was ok, now {r.status} ({r.reason})")
        if o.status != "ok" or r.status != "ok":
            lines.append(f"{label:<32} {o.status} → {r.status}")
            continue
        cells = []
        if r.median_ms and o.median_ms:
            c = _time_change(r, o, new_by, old_by)
            raw = r.median_ms / o.median_ms
            cells.append(f"time {c.describe()} {c.verdict} (raw {raw:.2f}x)")
            if limit is not None and c.low > limit and raw > limit:
                regressions.append(f"{label}: time {c.ratio:.2f}x the old run (limit +{fail_pct:g}%)")
        if r.total_bytes and o.total_bytes:
            ratio = r.total_bytes / o.total_bytes
            cells.append(f"peak {ratio:.2f}x")
            if limit is not None and ratio > limit and r.total_bytes - o.total_bytes > 1 << 20:
                regressions.append(f"{label}: peak memory {ratio:.2f}x the old run (limit +{fail_pct:g}%)")
        lines.append(f"{label:<32} " + "; ".join(cells))
    if not lines:
        lines.append("(nothing in common with the old run)")
    return "\n".join(lines) + "\n", regressions
