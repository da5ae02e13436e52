"""The figures of ``subquad bench --out DIR``, drawn to be pasted into an issue.

- ``time.png``: one panel per case, one horizontal bar per implementation on a linear axis from
  zero: the median time per call with its interquartile range as whiskers, the fastest marked
  (and those the same as it within noise, by their per-round ratios), subquad's planner's pick
  marked, and under the panel which implementations did not run and why.
- ``memory.png``: the same panels for the peak extra memory of one call (beyond what was in use
  before it: the output and any gradients count, the inputs do not; the output drawn as a floor),
  subquad's budget named, and a note where a peak includes a mask or bias built inside the call.
- ``sweep.png``: for the cases that differ only in sequence length, time and peak memory against
  L on log-log axes with faint ∝L and ∝L² reference slopes, so that O(L²) and O(L) memory show
  as slopes; where an implementation ran out of memory or was skipped as too big, an ✕ at the top.

matplotlib is imported inside :func:`figures` (``pip install 'subquad[bench]'``): importing this
module costs nothing. What the rest of the package uses: ``plot``, ``figures``, ``case_title``, and
for the ``--model`` figures the same look: ``Style``, ``styles``, ``log_axes``, ``end_labels``,
``cross_marks``, ``wrap``, ``NOTE_WIDTH``, ``FOOTER_WIDTH``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import textwrap
from collections import defaultdict
from typing import Any, Callable, NamedTuple, Optional

from subquad._budget import format_bytes

from . import timing
from .cases import DOCUMENTS, DTYPES, PADDED_FRACTION, SOFTCAP, WINDOW
from .measure import Result

MODE_WORDS = {"fwd": "forward", "fwd+bwd": "forward + backward"}
MASK_WORDS = {
    "none": "no mask",
    "causal": "causal mask",
    "key-padding": f"key padding (last {PADDED_FRACTION:.0%} of keys)",
    "alibi": "causal + ALiBi bias",
    "softcap": f"causal + soft-cap {SOFTCAP:g}",
    "window": f"causal window of {WINDOW}",
    "document": f"{DOCUMENTS} packed documents",
}
MARKERS = "osD^v<>ph*"
LINESTYLES = ("-", "--", "-.", ":")
# Peak memory read from RSS moves by up to ~1 MiB between identical runs (pages, allocator):
# implementations within this of the least are all marked as the least.
MEMORY_FLOOR_BYTES = 1 << 20
NOTE_WIDTH = 78  # characters per line of a panel's notes
FOOTER_WIDTH = 170
SWEEP_MIN_LENGTHS = 3


class Style(NamedTuple):
    color: Any
    marker: str
    linestyle: str


# ---------------------------------------------------------------------------- words


def case_title(r: Result, *, sweep: bool = False) -> str:
    """The case in words: ``1×4×2048×64 fp32, causal mask, forward`` (B×H×L×E; with ``sweep``
    the length is ``L``)."""
    b, h, lq, lk, e = r.shape
    length = "L" if sweep else str(lq)
    dims = f"{b}×{h}×{length}×{e}" if lq == lk else f"{b}×{h}×{length}×{e}, {lk} keys"
    text = f"{dims} {r.dtype}, {MASK_WORDS.get(r.mask, r.mask)}, {MODE_WORDS.get(r.mode, r.mode)}"
    return text + (f", subquad budget {r.budget}" if r.budget else "")


def _ms(ms: float) -> str:
    return f"{ms:.3f} ms" if ms < 1 else f"{ms:.2f} ms" if ms < 100 else f"{ms:.0f} ms"


def plain(value: float) -> str:
    """A tick label as a plain number: 0.5, 20, 1000 (never 2×10¹)."""
    return f"{value:,.0f}" if value >= 1 else f"{value:.3g}"


def absent_reason(r: Result) -> str:
    """Why a record has no measurement, in a short line."""
    reason = (r.reason or "").strip().removeprefix("NotImplementedError: ")
    if r.status == "oom":
        reason = "out of memory" + (f" ({reason})" if reason else "")
    elif r.status == "error":
        reason = f"error: {reason}"
    return textwrap.shorten(reason or r.status, 110, placeholder="…")


def _too_big(r: Result) -> bool:
    """Out of memory, or skipped because it would not fit (or take too long) at this size."""
    return r.status == "oom" or (r.status == "unsupported" and (r.reason or "").startswith("skipped"))


class BuiltInCall(NamedTuple):
    what: str  # "ALiBi bias"
    layout: str  # "1×4×2048×2048 fp32"
    nbytes: int


def built_in_call(r: Result) -> Optional[BuiltInCall]:
    """What ``r``'s implementation builds inside the measured call besides attention, and so
    counts in its peak (impls.py builds it per call, as its users' code does)."""
    _, h, lq, lk, _ = r.shape
    materializes_masks = r.impl.startswith("sdpa-") or r.impl == "naive"
    if r.mask == "alibi" and (materializes_masks or r.impl == "xformers") and r.dtype in DTYPES:
        return BuiltInCall("ALiBi bias", f"1×{h}×{lq}×{lk} {r.dtype}", h * lq * lk * DTYPES[r.dtype].itemsize)
    if r.mask in ("window", "document") and materializes_masks:
        return BuiltInCall(f"{r.mask} mask", f"{lq}×{lk} bool", lq * lk)
    if r.mask in ("causal", "softcap") and r.impl == "naive":
        return BuiltInCall("causal mask", f"{lq}×{lk} bool", lq * lk)
    return None


def returned_bytes(r: Result) -> Optional[int]:
    """What every implementation allocates and returns, counted in its peak: the output, and
    with backward the gradients of query, key and value."""
    if not r.output_bytes:
        return None
    if r.mode != "fwd+bwd" or len(r.shape) != 5:
        return r.output_bytes
    _, _, lq, lk, _ = r.shape
    return int(r.output_bytes * 2 + 2 * r.output_bytes * lk // lq)


def wrap(lines: list[str], width: int = NOTE_WIDTH) -> str:
    return "\n".join(textwrap.fill(line, width, subsequent_indent="   ") for line in lines)


def _common_absent(results: list[Result]) -> dict[str, str]:
    """Implementations that ran nowhere, for one reason (not installed, another device): said
    once under the figure instead of under every panel."""
    rows = defaultdict(list)
    for r in results:
        rows[r.impl].append(r)
    out = {}
    for impl, mine in rows.items():
        reasons = {absent_reason(r) for r in mine}
        if all(r.status != "ok" for r in mine) and len(reasons) == 1:
            out[impl] = reasons.pop()
    return out


def _grouped_lines(prefix: str, pairs: list[tuple[str, str]]) -> list[str]:
    """``prefix names: reason`` lines, implementations with the same reason on one line."""
    by_reason: dict[str, list[str]] = defaultdict(list)
    for name, reason in pairs:
        by_reason[reason].append(name)
    return [f"{prefix}{', '.join(names)}: {reason}" for reason, names in by_reason.items()]


def _footer(results: list[Result], common: dict[str, str], *, memory: bool) -> str:
    lines = []
    if memory:
        method = next((r.memory_method for r in results if r.status == "ok" and r.memory_method), None)
        lines.append(
            "peak extra memory: the highest memory in use during one call minus what was in use before it; "
            "the inputs are not counted, the output (and with backward, the input gradients) are"
            + (f" (measured as {method})." if method else ".")
        )
        given = sorted({r.budget for r in results if r.budget})
        free = [
            r.plan["budget_bytes"]
            for r in results
            if r.impl.startswith("subquad") and not r.budget and r.plan.get("budget_bytes")
        ]
        if given:
            lines.append(f"subquad's memory budget: {', '.join(given)} (--budget); other implementations have none.")
        if free:
            lines.append(
                f"subquad's memory budget: none given, so the free memory (≈{format_bytes(min(free))}); "
                "the others have none."
            )
    else:
        lines.append(
            "median time of one call over interleaved rounds; whiskers: interquartile range; "
            "★ fastest; ≈ the same as the fastest within noise (99% interval of per-round ratios); "
            "? too few rounds to tell it from the fastest."
        )
        if any(r.status == "ok" and r.median_ms and len(r.times_ms) < 2 for r in results):
            lines.append("some records have no per-round times (an older results.json): their spread is unknown.")
    lines += _grouped_lines("not run anywhere: ", sorted(common.items()))
    device = next((r for r in results if r.status == "ok"), results[0])
    lines.append(f"{device.device_name}, torch {device.torch_version}, subquad {device.subquad_version or '?'}")
    return wrap(lines, FOOTER_WIDTH)


# ---------------------------------------------------------------------------- marks


def _fastest(ok: list[Result]) -> tuple[Optional[str], dict[str, str]]:
    """The fastest implementation by median, and the verdict of each other one against it by
    their paired per-round ratios, read as ``timing.verdict_lines`` reads them: ``same`` (within
    noise), ``undecided`` (a median ratio past the threshold whose interval is not), or
    ``slower``. Without per-round times, no verdicts."""
    timed = [r for r in ok if r.median_ms]
    if not timed:
        return None, {}
    best = min(timed, key=lambda r: r.median_ms or 0.0)
    rounds = {len(r.times_ms) for r in timed}
    verdicts = {}
    if len(rounds) == 1 and min(rounds) >= 2:
        for r in timed:
            if r is not best:
                c = timing.compare_paired(r.impl, r.times_ms, best.impl, best.times_ms)
                if c.verdict != timing.SAME:
                    verdicts[r.impl] = c.verdict
                else:
                    verdicts[r.impl] = "undecided" if c.ratio > 1.0 + timing.PRACTICAL else "same"
    return best.impl, verdicts


def _planner_pick(rows: list[Result]) -> Optional[str]:
    planner = next((r for r in rows if r.impl == "subquad" and r.status == "ok"), None)
    backend = planner.plan.get("backend") if planner is not None else None
    return str(backend) if backend else None


def _time_marks(ok: list[Result]) -> dict[str, list[str]]:
    marks: dict[str, list[str]] = defaultdict(list)
    best, verdicts = _fastest(ok)
    if best is not None:
        marks[best].append("★ fastest")
    for name, verdict in verdicts.items():
        if verdict == "same":
            marks[name].append("≈ fastest")
        elif verdict == "undecided":
            marks[name].append("? undecided")
    pick = _planner_pick(ok)
    if pick is not None:
        marks["subquad"].append(f"planner picked {pick}")
        marks[f"subquad-{pick}"].append("planner's pick")
    return marks


def _memory_marks(ok: list[Result]) -> dict[str, list[str]]:
    marks: dict[str, list[str]] = defaultdict(list)
    measured = [r for r in ok if r.peak_bytes is not None]
    if measured:
        least = min(r.peak_bytes or 0 for r in measured)
        for r in measured:
            if (r.peak_bytes or 0) - least < MEMORY_FLOOR_BYTES:
                marks[r.impl].append("★ least")
        for r in measured:
            built = built_in_call(r)
            if built is not None:
                marks[r.impl].append(f"incl. {format_bytes(built.nbytes)} {built.what}")
    pick = _planner_pick(ok)
    planner = next((r for r in ok if r.impl == "subquad"), None)
    if pick is not None and planner is not None:
        predicted = planner.plan.get("predicted_peak_bytes")
        text = f"planner: {pick}"
        if predicted is not None:
            text += f", predicted {format_bytes(predicted)} + output"
        marks["subquad"].append(text)
    return marks


# ---------------------------------------------------------------------------- panels


def _bar_panel(ax, rows: list[Result], common: dict[str, str], style: dict[str, Style], *, memory: bool) -> None:
    """One case: a bar per implementation that ran, marks beside the values, and the notes
    (what did not run; what a peak includes) in the axis label under the panel."""
    shown = [r for r in rows if r.impl not in common]

    def value(r: Result) -> Optional[float]:
        if memory:
            return None if r.peak_bytes is None else r.peak_bytes / 2**20
        return r.median_ms

    ok = [r for r in shown if r.status == "ok" and value(r) is not None]
    values = [value(r) or 0.0 for r in ok]
    low = [0.0] * len(ok)
    high = [0.0] * len(ok)
    if not memory:
        for i, r in enumerate(ok):
            if r.q1_ms is not None and r.q3_ms is not None:
                low[i], high[i] = max(0.0, values[i] - r.q1_ms), max(0.0, r.q3_ms - values[i])
    whiskers = any(low) or any(high)
    ys = list(range(len(ok)))
    if not ok:
        ax.text(0.5, 0.5, "nothing ran in this case", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])
        ax.set_xticks([])
    ax.barh(
        ys,
        values,
        xerr=[low, high] if whiskers else None,
        color=[style[r.impl].color for r in ok],
        height=0.7,
        error_kw={"ecolor": "black", "elinewidth": 1.2, "capsize": 4},
    )
    marks = _memory_marks(ok) if memory else _time_marks(ok)
    right = max([v + hi for v, hi in zip(values, high)] or [1.0])
    for y, r, v, hi in zip(ys, ok, values, high):
        text = format_bytes(r.peak_bytes) if memory else _ms(v)
        if marks.get(r.impl):
            text += "   " + "; ".join(marks[r.impl])
        bold = any(m.startswith("★") for m in marks.get(r.impl, []))
        ax.text(v + hi + right * 0.02, y, text, va="center", fontsize=7.5, weight="bold" if bold else "normal")
    ax.set_yticks(ys, [r.impl for r in ok], fontsize=8)
    ax.set_ylim(max(len(ok), 1) - 0.5, -0.5)  # the run's order, top to bottom
    ax.set_xlim(0, right * 1.75)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    if memory:
        floor = returned_bytes(rows[0])
        if floor and ok:
            ax.axvline(floor / 2**20, color="0.35", linestyle=":", linewidth=1)
    label = (
        "peak extra memory (MiB)" if memory else "median time per call (ms)" + (", IQR whiskers" if whiskers else "")
    )
    notes = _grouped_lines("not run: ", [(r.impl, absent_reason(r)) for r in shown if r.status != "ok"])
    if memory:
        floor = returned_bytes(rows[0])
        if floor and ok:
            what = "the output and the input gradients" if rows[0].mode == "fwd+bwd" else "the output"
            notes.insert(0, f"dotted line: {what} ({format_bytes(floor)}), which every implementation allocates")
        built = [(r.impl, built_in_call(r)) for r in ok]
        notes += _grouped_lines(
            "",
            [(n, f"the peak includes the {b.what} ({b.layout}), built inside the call") for n, b in built if b],
        )
    ax.set_xlabel(wrap([label] + notes), loc="left", fontsize=8)
    ax.set_title(case_title(rows[0]), fontsize=9.5, loc="left")


def cross_marks(ax, failed: dict[str, list[tuple[float, str]]], style: dict[str, Style]) -> None:
    """✕ in a band at the top of the panel (made room for) at each x where an implementation
    did not fit, and its name with ``word`` (``out of memory``, ``skipped``) after the last."""
    if not failed:
        return
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * (high / low) ** (0.06 * len(failed) + 0.04))
    for k, (impl, points) in enumerate(failed.items()):
        y = 0.965 - 0.05 * k
        ax.plot(
            [x for x, _ in points],
            [y] * len(points),
            marker="X",
            markersize=8,
            color=style[impl].color,
            transform=ax.get_xaxis_transform(),
            linestyle="none",
        )
        text = f"{impl}: {points[0][1]}"
        ax.text(points[-1][0] * 1.1, y, text, fontsize=7, va="center", transform=ax.get_xaxis_transform())


def _reference_slopes(ax, lengths: list[int], lowest: float) -> None:
    """Faint lines ∝L and ∝L², from half the lowest value at the shortest length, labelled
    where they leave the second length (the right end is for the implementations' names)."""
    x0, x1 = lengths[0], lengths[-1]
    y0 = lowest / 2
    for power, label in ((1, "∝ L"), (2, "∝ L²")):
        ax.plot([x0, x1], [y0, y0 * (x1 / x0) ** power], color="0.6", linestyle=(0, (6, 4)), linewidth=1, zorder=0)
        x = lengths[1]
        ax.text(x, y0 * (x / x0) ** power, f"{label}  ", color="0.45", fontsize=8, ha="right", va="bottom")


def end_labels(ax, ends: list[tuple[float, float, str]]) -> None:
    """Each line's name at its right end, lines ending within 15% of each other under one label,
    labels moved apart where they would overlap (call it once the y limits are final)."""
    clusters: list[list[tuple[float, float, str]]] = []
    for end in sorted(ends):
        last = clusters[-1][-1] if clusters else None
        if last is not None and last[0] == end[0] and end[1] / last[1] < 1.15:
            clusters[-1].append(end)
        else:
            clusters.append([end])
    low, high = (math.log(v) for v in ax.get_ylim())
    line = 0.032  # one line of 7.5 pt text, as a fraction of the axes' height
    labels: list[tuple[float, int, float, str]] = []  # (y in axes fraction, lines, x, text)
    for cluster in clusters:
        y = math.prod(e[1] for e in cluster) ** (1 / len(cluster))
        names = textwrap.fill(", ".join(e[2] for e in cluster), 26, break_on_hyphens=False)
        labels.append(((math.log(y) - low) / (high - low), names.count("\n") + 1, cluster[0][0], names))
    top = -math.inf
    for y, lines, x, names in sorted(labels):  # upward, each above the one below
        y = max(y, top + lines * line / 2 + 0.005)
        top = y + lines * line / 2
        ax.text(x * 1.08, y, names, fontsize=7.5, va="center", color="0.2", transform=ax.get_xaxis_transform())


def log_axes(ax, lengths: list[int]) -> None:
    """Log-log axes with the measured lengths as x ticks and plain numbers on y (10, 20, 50),
    and room on the right for the lines' names."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # optional dependency (subquad[bench])

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: plain(v)))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="major", alpha=0.3)
    ax.set_xlim(lengths[0] / 1.25, lengths[-1] * 3.2)  # room for the names at the lines' ends


def _picks_label(points: list[tuple[int, Result]]) -> str:
    """``planner: fused`` or ``planner: fused ≤2048, matmul 4096``."""
    runs: list[tuple[str, list[int]]] = []
    for length, r in points:
        backend = str(r.plan.get("backend", "?"))
        if runs and runs[-1][0] == backend:
            runs[-1][1].append(length)
        else:
            runs.append((backend, [length]))
    if len(runs) == 1:
        return f"planner: {runs[0][0]}"
    return "planner: " + ", ".join(f"{b} {ls[0]}" + (f"–{ls[-1]}" if len(ls) > 1 else "") for b, ls in runs)


def _sweep_row(ax_time, ax_mem, rows: list[Result], common: dict[str, str], style: dict[str, Style]) -> None:
    lengths = sorted({r.shape[2] for r in rows})
    by_impl: dict[str, list[tuple[int, Result]]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: r.shape[2]):
        if r.impl not in common:
            by_impl[r.impl].append((r.shape[2], r))
    metrics: tuple[tuple[Any, Callable[[Result], Optional[float]], str], ...] = (
        (ax_time, lambda r: r.median_ms, "median time per call (ms)"),
        (ax_mem, lambda r: None if r.peak_bytes is None else r.peak_bytes / 2**20, "peak extra memory (MiB)"),
    )
    failed = {impl: [(n, r) for n, r in pts if _too_big(r)] for impl, pts in by_impl.items()}
    failed = {impl: pts for impl, pts in failed.items() if pts}
    for ax, metric, label in metrics:
        lowest = None
        ends: list[tuple[float, float, str]] = []
        for impl, points in by_impl.items():
            ok = [(n, r) for n, r in points if r.status == "ok" and metric(r)]
            if not ok:
                continue
            xs = [n for n, _ in ok]
            ys = [metric(r) or 0.0 for _, r in ok]
            lowest = min([*ys, lowest or ys[0]])
            ends.append((xs[-1], ys[-1], impl))
            err = None
            if ax is ax_time and all(r.q1_ms is not None and r.q3_ms is not None for _, r in ok):
                err = [
                    [max(0.0, y - (r.q1_ms or y)) for y, (_, r) in zip(ys, ok)],
                    [max(0.0, (r.q3_ms or y) - y) for y, (_, r) in zip(ys, ok)],
                ]
            name = f"{impl} ({_picks_label(ok)})" if impl == "subquad" else impl
            s = style[impl]
            errorbar_line(ax, xs, ys, err, name, s)
        log_axes(ax, lengths)
        if lowest is not None:
            _reference_slopes(ax, lengths, lowest)
        cross_marks(
            ax,
            {
                i: [(n, "out of memory" if r.status == "oom" else "skipped") for n, r in pts]
                for i, pts in failed.items()
            },
            style,
        )
        if lowest is not None:
            end_labels(ax, ends)  # after the marks: they set the final y limits
        notes = []
        for impl, pts in failed.items():
            where = ", ".join(str(n) for n, _ in pts)
            notes.append(f"✕ {impl} at L = {where}: {absent_reason(pts[0][1])}")
        other = [
            (impl, absent_reason(r))
            for impl, pts in by_impl.items()
            for _, r in pts[:1]
            if impl not in failed and all(q.status != "ok" for _, q in pts)
        ]
        notes += _grouped_lines("not run: ", other)
        ax.set_xlabel(wrap(["sequence length L (queries = keys)", *notes]), loc="left", fontsize=8)
        ax.set_ylabel(label, fontsize=8.5)
        ax.set_title(f"{label.split(' (')[0]}: {case_title(rows[0], sweep=True)}", fontsize=9.5, loc="left")
    ax_time.legend(fontsize=7.5, loc="upper left")


# ---------------------------------------------------------------------------- figures


def _cases(results: list[Result]) -> dict[str, list[Result]]:
    """Records by (case, mode), in the run's order."""
    out: dict[str, list[Result]] = {}
    for r in results:
        if len(r.shape) == 5:
            out.setdefault(f"{r.case} {r.mode}", []).append(r)
    return out


def sweeps(results: list[Result]) -> list[list[Result]]:
    """Groups of records whose cases differ only in the sequence length (queries = keys), with
    at least three lengths."""
    groups: dict[tuple, list[Result]] = {}
    for r in results:
        if len(r.shape) == 5 and r.shape[2] == r.shape[3]:
            b, h, _, _, e = r.shape
            groups.setdefault((b, h, e, r.dtype, r.mask, r.mode, r.budget), []).append(r)
    return [rows for rows in groups.values() if len({r.shape[2] for r in rows}) >= SWEEP_MIN_LENGTHS]


def errorbar_line(ax: Any, xs: Any, ys: Any, err: Any, label: str, s: Style) -> None:
    """One implementation's line in its :class:`Style`: open markers, whiskers ``err`` (or None)."""
    look = dict(color=s.color, marker=s.marker, linestyle=s.linestyle, markerfacecolor="none", markersize=7)
    ax.errorbar(xs, ys, yerr=err, label=label, linewidth=1.4, capsize=3, **look)


def styles(names: list[str], plt) -> dict[str, Style]:
    """A colour, a marker and a dash per implementation, the same in every panel."""
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {
        name: Style(cmap(i % cmap.N), MARKERS[i % len(MARKERS)], LINESTYLES[i % len(LINESTYLES)])
        for i, name in enumerate(names)
    }


def figures(results: list[Result]) -> dict[str, Any]:
    """The figures by file name (``time.png``, ``memory.png``, and ``sweep.png`` where the run
    has a length sweep), as matplotlib Figures; empty when nothing ran or matplotlib is
    missing. The caller saves and closes them."""
    if importlib.util.find_spec("matplotlib") is None:
        return {}
    import matplotlib  # optional dependency (subquad[bench])

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (subquad[bench])

    cases = _cases(results)
    if not any(r.status == "ok" for rows in cases.values() for r in rows):
        return {}
    common = _common_absent(results)
    style = styles(list(dict.fromkeys(r.impl for r in results if r.impl not in common)), plt)
    device = next(r.device_name for r in results if r.status == "ok")
    out = {}
    n_impls = len({r.impl for r in results} - set(common))
    for filename, memory, what in (
        ("time.png", False, "median time per call"),
        ("memory.png", True, "peak extra memory per call"),
    ):
        ncols = min(3, len(cases))
        nrows = -(-len(cases) // ncols)
        fig, axes = plt.subplots(
            nrows,
            ncols,
            figsize=(6.4 * ncols, (1.6 + 0.3 * n_impls) * nrows + 1.2),
            squeeze=False,
            layout="constrained",
        )
        for ax, rows in zip(axes.flat, cases.values()):
            _bar_panel(ax, rows, common, style, memory=memory)
        for ax in list(axes.flat)[len(cases) :]:
            ax.set_visible(False)
        fig.suptitle(f"subquad bench: {what} on {device}", fontsize=12, weight="bold")
        fig.supxlabel(_footer(results, common, memory=memory), fontsize=8, x=0.01, ha="left", multialignment="left")
        out[filename] = fig
    groups = sweeps(results)
    if groups:
        fig, axes = plt.subplots(
            len(groups), 2, figsize=(14, 5.6 * len(groups) + 0.8), squeeze=False, layout="constrained"
        )
        for (ax_time, ax_mem), rows in zip(axes, groups):
            _sweep_row(ax_time, ax_mem, rows, common, style)
        fig.suptitle(
            f"subquad bench: time and peak extra memory against sequence length on {device}",
            fontsize=12,
            weight="bold",
        )
        footer = _footer(results, common, memory=True).split("\n")
        footer.insert(
            0, "log-log axes: a line parallel to ∝ L grows linearly with L, one parallel to ∝ L² quadratically."
        )
        fig.supxlabel("\n".join(footer), fontsize=8, x=0.01, ha="left", multialignment="left")
        out["sweep.png"] = fig
    return out


def plot(results: list[Result], out_dir: str) -> list[str]:
    """Write :func:`figures` into ``out_dir`` as PNGs. Returns the paths written (none when
    matplotlib is missing or nothing ran)."""
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
