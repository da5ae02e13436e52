"""Showing and saving results: the terminal table and progress (rich when installed, plain text
otherwise), results.json / results.csv, and ``--compare``; the PNG figures are drawn by
``plots``.

rich and matplotlib are imported inside the functions that use them: ``pip install
'subquad[bench]'`` installs both, and nothing else in subquad needs them.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import os
import sys
import textwrap
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Optional, Sequence, TextIO, TypeVar

from . import comparison, plots, timing
from .measure import Result

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Record = TypeVar("_Record", bound="DataclassInstance")

REQUIRED_FIELDS = (
    "impl",
    "case",
    "mode",
    "median_ms",
    "peak_bytes",
    "tflops",
    "rel_err",
    "status",
    "reason",
    "device_name",
    "torch_version",
    "dtype",
    "shape",
)


def have_rich() -> bool:
    return importlib.util.find_spec("rich") is not None


def format_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def format_ms(ms: Optional[float]) -> str:
    if ms is None:
        return "-"
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def _format_err(err: Optional[float]) -> str:
    return "-" if err is None else f"{err:.1e}"


def one_line(result: Result) -> str:
    """A result in one line, for progress output."""
    if result.status != "ok":
        return f"{result.status}: {result.reason or ''}"
    if result.median_ms is None:  # the memory phase: the case's rounds come after all of them
        return (
            f"peak {format_bytes(result.peak_bytes)}, err {_format_err(result.rel_err)}; "
            "timed with the case's others next"
        )
    return (
        f"{format_ms(result.median_ms)} ms, {result.tflops or 0:.2f} TFLOP/s, "
        f"peak {format_bytes(result.peak_bytes)}, err {_format_err(result.rel_err)}"
    )


# -------------------------------------------------------------------------------- table

COLUMNS = ("impl", "median ms", "IQR ms", "TFLOP/s", "peak mem", "rel err", "status")
STATUS_WIDTH = 90


def _common_unsupported(results: list[Result]) -> dict[str, str]:
    """Implementations unsupported in every case for one same reason (e.g. not installed):
    shown once under the table instead of in every case."""
    by_impl = defaultdict(list)
    for r in results:
        by_impl[r.impl].append(r)
    out = {}
    for impl, rows in by_impl.items():
        reasons = {r.reason for r in rows}
        if all(r.status == "unsupported" for r in rows) and len(reasons) == 1:
            out[impl] = reasons.pop() or ""
    return out


def plan_summary(plan: dict) -> str:
    """subquad's plan in a few words: ``fused 1024x4096, predicted 3.1 MiB + out``. subquad
    predicts the peak beyond the inputs, the output (and the gradients), which peak_bytes
    includes: hence "+ out"."""
    text = str(plan.get("backend", "?"))
    tiles = plan.get("chunk_size")
    text += f" {tiles[0]}x{tiles[1]}" if isinstance(tiles, list) and len(tiles) == 2 else " whole"
    if isinstance(plan.get("tiles"), list):
        text += f", tiles {plan['tiles'][0]} run / {plan['tiles'][1]} skipped"
    if plan.get("predicted_peak_bytes") is not None:
        text += f", predicted {format_bytes(plan['predicted_peak_bytes'])} + out"
    return text


def verdicts(results: list[Result]) -> list[str]:
    """Lines per case: what its interleaved timings support (``timing.verdict_lines``: the
    fastest, those the same within noise, how much slower the others are, by per-round ratios),
    and what subquad's planner picked, with its time against the fastest. Out-of-memory and
    skipped runs do not count. Records without per-round times (an older results.json) get the
    fastest median, marked as having no spread."""
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(f"{r.case} {r.mode}", []).append(r)
    lines = []
    for title, rows in groups.items():
        ok = [r for r in rows if r.status == "ok" and r.median_ms]
        if not ok:
            continue
        best = min(ok, key=_median)
        rounds = {len(r.times_ms) for r in ok}
        if len(ok) > 1 and len(rounds) == 1 and 0 not in rounds:
            found = timing.verdict_lines({r.impl: [t / 1e3 for t in r.times_ms] for r in ok})
            line = f"{title}: {found[0]}, peak {format_bytes(best.peak_bytes)}"
            more = found[1:]
            note = timing.stop_note(ok[0].rounds_stopped, len(ok[0].times_ms))
            if note:
                more.append(f"  ({note})")
        else:
            line = f"{title}: fastest {best.impl} {format_ms(best.median_ms)} ms, peak {format_bytes(best.peak_bytes)}"
            if len(ok) > 1:
                line += " (no per-round times: spread unknown)"
            more = []
        planner = next((r for r in ok if r.impl == "subquad"), None)
        if planner is not None:
            against = f"{_median(planner) / _median(best):.2f}x"
            if planner is not best and len(planner.times_ms) == len(best.times_ms) > 1:
                # The per-round ratio and its verdict: a ratio of medians reads noise as the
                # planner's cost.
                c = timing.compare_paired("subquad", planner.times_ms, best.impl, best.times_ms)
                unsure = c.verdict == timing.SAME and c.ratio > 1 + timing.PRACTICAL
                against = f"{c.ratio:.2f}x, {'undecided' if unsure else c.verdict}"
            line += (
                f"; subquad's planner picked {planner.plan.get('backend', '?')}: "
                f"{format_ms(planner.median_ms)} ms ({against}), "
                f"peak {format_bytes(planner.peak_bytes)}"
            )
            if planner.first_call_ms is not None and planner.first_call_ms > 2 * _median(planner):
                line += f", first call {format_ms(planner.first_call_ms)} ms"
        lines.append(line)
        lines += more
    return lines


def _median(r: Result) -> float:
    assert r.median_ms is not None, f"{r.impl} {r.case}: verdicts() keeps only records with a median"
    return r.median_ms


def table_sections(results: list[Result]) -> tuple[list[tuple[str, list[list[str]]]], dict]:
    """Rows of the table grouped by (case, mode), and the footer of implementations not run."""
    footer = _common_unsupported(results)
    sections: dict[str, list[list[str]]] = {}
    for r in results:
        if r.impl in footer:
            continue
        title = f"{r.case} {r.mode}"
        status = f"{r.status}: {r.reason}" if r.reason else r.status
        if r.status == "ok" and r.plan:
            status += f" ({plan_summary(r.plan)})"
        if len(status) > STATUS_WIDTH:  # cut at a word (results.json has it in full)
            status = textwrap.shorten(status, STATUS_WIDTH, placeholder=" …")
        err = _format_err(r.rel_err)
        if r.rel_err_grad is not None:
            err += f" / {_format_err(r.rel_err_grad)}"
        iqr = "-" if r.q1_ms is None else f"{format_ms(r.q1_ms)}-{format_ms(r.q3_ms)}"
        sections.setdefault(title, []).append(
            [
                r.impl,
                format_ms(r.median_ms),
                iqr,
                "-" if r.tflops is None else f"{r.tflops:.3f}",
                format_bytes(r.peak_bytes),
                err,
                status,
            ]
        )
    return list(sections.items()), footer


def render_plain(results: list[Result]) -> str:
    """The results table as plain text."""
    sections, footer = table_sections(results)
    lines = []
    for title, rows in sections:
        widths = [max(len(COLUMNS[i]), *(len(row[i]) for row in rows)) for i in range(len(COLUMNS) - 1)]
        lines.append(f"== {title}")
        for cells in [list(COLUMNS), *rows]:
            head = "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
            lines.append(f"{head}  {cells[-1]}".rstrip())
        lines.append("")
    for impl, reason in footer.items():
        lines.append(f"not run: {impl}: {reason}")
    found = verdicts(results)
    if found:
        lines += ["", "verdict:"] + [f"  {line}" for line in found]
    return "\n".join(lines).rstrip() + "\n"


def print_table(results: list[Result], *, plain: bool = False, file: Optional[TextIO] = None) -> None:
    """Print the results table; with rich when it is installed (and ``plain`` is off)."""
    file = file or sys.stdout
    if plain or not have_rich():
        file.write(render_plain(results))
        return
    from rich.console import Console
    from rich.table import Table

    # Piped output has no terminal width; 80 columns would squeeze the table for nothing.
    tty = file.isatty()
    console = Console(file=file, width=None if tty else 160)
    sections, footer = table_sections(results)
    for title, rows in sections:
        table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
        for i, name in enumerate(COLUMNS):
            if i == len(COLUMNS) - 1:
                # The status takes what is left: on a terminal cut with an ellipsis; piped (a log,
                # a file) wrapped at words, since a reason cut there cannot be scrolled back to.
                table.add_column(name, no_wrap=tty, overflow="ellipsis" if tty else "fold")
            else:
                width = max(len(name), *(len(row[i]) for row in rows))
                table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True, min_width=width)
        for row in rows:
            style = None if row[-1].startswith("ok") else "dim"
            table.add_row(*row, style=style)
        console.print(table)
        console.print()
    for impl, reason in footer.items():
        console.print(f"[dim]not run: {impl}: {reason}[/dim]", highlight=False, soft_wrap=not tty)
    found = verdicts(results)
    if found:
        console.print("\nverdict:", highlight=False)
        for line in found:
            console.print(f"  {line}", highlight=False, soft_wrap=True)


class Progress:
    """Progress while the bench runs: a rich progress bar that logs each result, or one plain
    line per result. Use as a context manager and pass ``update`` to ``measure.run_all``."""

    def __init__(self, total: int, *, plain: bool = False, file: Optional[TextIO] = None):
        self.total = total
        self.file = file or sys.stderr
        self.rich = None
        if not plain and have_rich():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self.rich = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(file=self.file),
                transient=True,
            )
            self.task = self.rich.add_task("starting", total=total)

    def __enter__(self) -> "Progress":
        if self.rich is not None:
            self.rich.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.rich is not None:
            self.rich.__exit__(*exc)

    def update(self, index, total, impl, case, result) -> None:
        label = f"{impl.name} {case.name} {case.mode}"
        if self.rich is not None:
            if result is None:
                self.rich.update(self.task, description=label)
            else:
                self.rich.console.print(
                    f"[{index + 1}/{total}] {label}: {one_line(result)}", highlight=False, markup=False
                )
                self.rich.advance(self.task)
        elif result is not None:
            print(f"[{index + 1}/{total}] {label}: {one_line(result)}", file=self.file, flush=True)


# ---------------------------------------------------------------------------- files


def write_json(results: Sequence[Any], path: str) -> None:
    """Records (``Result`` or ``ModelResult``) as a results.json."""
    with open(path, "w") as f:
        json.dump([r.to_dict() for r in results], f, indent=1, allow_nan=False)
        f.write("\n")


def read_records(path: str, record: type[_Record], what: str, key: Optional[str] = None) -> list[_Record]:
    """The ``record`` dataclasses of a results.json; unknown keys (e.g. from a newer version) are
    ignored. ``key``: a field every record of this kind has (tells the two kinds apart)."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list) or (key is not None and data and key not in data[0]):
        raise ValueError(f"{path} is not a {what} results.json (expected a list of records)")
    known = {f.name for f in dataclasses.fields(record)}
    return [record(**{k: v for k, v in rec.items() if k in known}) for rec in data]


def load_json(path: str) -> list[Result]:
    return read_records(path, Result, "subquad bench")


def csv_cell(value: Any) -> Any:
    """A record's field as a CSV cell: lists and dicts as JSON (empty ones as nothing), None as nothing."""
    if isinstance(value, (list, dict)):
        return json.dumps(value) if value else ""
    return "" if value is None else value


def write_csv(results: list[Result], path: str) -> None:
    names = list(Result.__dataclass_fields__)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(names)
        for r in results:
            writer.writerow(
                ["x".join(map(str, r.shape)) if name == "shape" else csv_cell(getattr(r, name)) for name in names]
            )


def save(results: list[Result], out_dir: str) -> list[str]:
    """results.json, results.csv and the plots in ``out_dir`` (created). Returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "results.json"), os.path.join(out_dir, "results.csv")]
    write_json(results, paths[0])
    write_csv(results, paths[1])
    return paths + plots.plot(results, out_dir)


# ---------------------------------------------------------------------------- compare


def compare(
    new: list[Result], old: list[Result], fail_pct: Optional[float] = None, *, allow_nothing: bool = False
) -> tuple[str, list[str]]:
    """The ``--compare`` table (new/old ratios matched on (impl, case, mode), with a summary) and
    the problems that fail ``--fail-if-regression fail_pct``, a gate that compared nothing among
    them unless ``allow_nothing``: see ``comparison.compare``."""
    return comparison.compare(new, old, fail_pct, allow_nothing=allow_nothing)
