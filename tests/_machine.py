"""The machine under the suite: held still where a test needs it, shaken on purpose to prove it.

subquad reads the machine it runs on in a few places: the matmul and softmax rates it measures
once per process (``subquad._planner._measure_rates``: time estimates, the long-call warning and
the progress log), torch's thread count (the fused kernels' per-thread scratch in the memory
model), free memory (the default budget) and the clock (the bench's timings). A test whose verdict
rests on one of those passes where it was written and fails on a stranger's machine, so tests
inject what they need (``FIXED_RATES``, a monkeypatched reading) and two switches, read from the
environment, check that nothing else leaks through (``.ci/robustness``, docs/ci/robustness.md):

``SUBQUAD_TEST_RATE_FACTOR=F``
    every rate subquad measures is ``F`` times the measured one (``10``: a machine ten times
    faster; ``0.1``: ten times slower). Rates a test injects are left as injected.
``SUBQUAD_TEST_RECORD=PATH``
    append to ``PATH`` one JSON line per reading: which test (``PYTEST_CURRENT_TEST``) read which
    of ``rates``, ``threads``, ``free-memory``, ``clock``, and from which function.

Both apply to the test process and to the helpers it starts (``_memory_probe.py``,
``_distributed_cases.py`` call :func:`install` too). Nothing here imports pytest.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Set, Tuple

import torch

from subquad import _budget, _planner

HERE = os.path.dirname(os.path.abspath(__file__))

FIXED_RATES: Dict[str, Tuple[float, float]] = {
    "cpu": (1e11, 1e-9),
    "cuda": (1e14, 1e-12),
    "mps": (1e13, 1e-11),
}
"""A rate table for tests that need one: (matmul FLOP/s, seconds of softmax work per score), by
device type (``subquad._planner`` keeps its measurements per device type and dtype: the row
stands for every dtype). The CPU row is within a few times of a 2-core VM; a test must hold for
any such table, not for these numbers."""

RATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

KINDS = ("rates", "threads", "free-memory", "clock")

# Clock readings whose value cannot change a result: the free-memory cache's expiry, the start of
# a progress log that is off unless a call is predicted long (then ``Progress.tick`` reads the
# clock and is recorded), and the compile stopwatch that only explain() prints.
HARMLESS_CLOCK = {
    "subquad._budget.free_memory_bytes",
    "subquad._engine.Progress.__init__",
    "subquad._backends.flex.Flex.run_whole",
}

_installed = False
_seen: Set[Tuple[str, str, str]] = set()


def rate_factor() -> float:
    text = os.environ.get("SUBQUAD_TEST_RATE_FACTOR", "").strip()
    if not text:
        return 1.0
    factor = float(text)
    if not factor > 0:
        raise ValueError(f"SUBQUAD_TEST_RATE_FACTOR must be a positive number, got {text!r}")
    return factor


def install() -> None:
    """Apply the switches in this process (once; before any rate is measured)."""
    global _installed
    if _installed:
        return
    _installed = True
    factor = rate_factor()
    _planner._RATES.clear()
    if factor != 1.0:
        measure = _planner._measure_rates

        def scaled(device: torch.device, dtype: torch.dtype) -> Tuple[float, float]:
            flops, per_score = measure(device, dtype)
            return flops * factor, per_score / factor

        _planner._measure_rates = scaled
        own = _planner._measure_backend

        def scaled_own(device: torch.device, dtype: torch.dtype, backend: str) -> Tuple[float, float]:
            per_score, per_row = own(device, dtype, backend)
            return per_score / factor, per_row / factor

        scaled_own.__wrapped__ = own  # type: ignore[attr-defined]
        _planner._measure_backend = scaled_own
    if os.environ.get("SUBQUAD_TEST_RECORD"):
        _install_recorder()


def inject_rates(
    monkeypatch: Any, table: Dict[str, Tuple[float, float]] = FIXED_RATES
) -> Dict[str, Tuple[float, float]]:
    """Fill subquad's rate cache with ``table`` for one test (what it would otherwise measure),
    each device type's row for every dtype; a ``score_mod`` costs :data:`FIXED_SCORE_MOD_S` per
    score and every backend runs at the model's rates (both would otherwise be timed)."""
    for device, rates in table.items():
        for dtype in RATE_DTYPES:
            monkeypatch.setitem(_planner._RATES, (device, dtype), rates)
    monkeypatch.setattr(_planner, "score_mod_seconds", lambda inp: 0.0 if inp.score_mod is None else FIXED_SCORE_MOD_S)
    monkeypatch.setattr(_planner, "backend_seconds", lambda device, dtype, backend: None)
    return table


FIXED_SCORE_MOD_S = 5e-9
"""What :func:`inject_rates` makes a ``score_mod`` cost per score."""


# ------------------------------------------------------------------------------ the recorder


def _current_test() -> str:
    name = os.environ.get("PYTEST_CURRENT_TEST", "")
    return name.rsplit(" (", 1)[0] if name else "<outside a test>"


def _ours(frame: Any) -> bool:
    return frame.f_globals.get("__name__", "").startswith("subquad") or frame.f_code.co_filename.startswith(HERE)


def _where(frame: Any) -> str:
    code = frame.f_code
    qualname = getattr(code, "co_qualname", code.co_name)
    return f"{frame.f_globals.get('__name__', '?')}.{qualname}"


def _record(kind: str, where: str) -> None:
    key = (_current_test(), kind, where)
    if key in _seen:
        return
    _seen.add(key)
    line = json.dumps({"test": key[0], "kind": kind, "where": where, "pid": os.getpid()})
    with open(os.environ["SUBQUAD_TEST_RECORD"], "a") as f:
        f.write(line + "\n")


def _reading(kind: str, fn: Callable[..., Any], *, only_ours: bool) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        if not only_ours or _ours(caller):
            _record(kind, _where(caller))
        return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(fn, "__name__", kind)
    return wrapper


_REPLACED: Dict[int, Callable[..., Any]] = {}


def _outcome(make_plan: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    try:
        plan = make_plan(*args, **kwargs)
    except Exception as e:
        return type(e).__name__
    return plan.backend, plan.chunk_size, plan.backward_backend, plan.backward_chunk_size


_replanning = True


@contextlib.contextmanager
def plans_once() -> Iterator[None]:
    """Within it the recorder plans each call once, as without it (for tests that trace or count
    what the planner does, e.g. the budget's path in tests/test_architecture.py)."""
    global _replanning
    before, _replanning = _replanning, False
    try:
        yield
    finally:
        _replanning = before


def _planning(make_plan: Callable[..., Any]) -> Callable[..., Any]:
    """``make_plan`` that also plans the call for 1 and for 64 threads (the fused kernels'
    scratch grows with the thread count): a plan that changes makes the test read ``threads``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        plan = make_plan(*args, **kwargs)
        if not _replanning:
            return plan
        real = torch.get_num_threads
        try:
            outcomes = set()
            for n in (1, 64):
                torch.get_num_threads = lambda n=n: n  # type: ignore[misc]
                outcomes.add(_outcome(make_plan, args, kwargs))
        finally:
            torch.get_num_threads = real  # type: ignore[misc]
        if len(outcomes | {_outcome(make_plan, args, kwargs)}) > 1:
            _record("threads", "plan: " + _where(sys._getframe(1)))
        return plan

    wrapper.__wrapped__ = make_plan  # type: ignore[attr-defined]
    return wrapper


def _install_recorder() -> None:
    _planner._device_rates = _reading("rates", _planner._device_rates, only_ours=False)
    _planner.backend_seconds = _reading("rates", _planner.backend_seconds, only_ours=False)
    plan = _planner.make_plan
    _REPLACED[id(plan)] = _planner.make_plan = _planning(plan)
    free = _budget.free_memory_bytes
    _REPLACED[id(free)] = _budget.free_memory_bytes = _reading("free-memory", free, only_ours=False)
    torch.get_num_threads = _reading("threads", torch.get_num_threads, only_ours=True)
    for name in ("perf_counter", "monotonic", "time", "sleep"):
        setattr(time, name, _reading("clock", getattr(time, name), only_ours=True))
    sweep()


def sweep() -> None:
    """Point names imported with ``from subquad._budget import free_memory_bytes`` (in subquad
    and in the tests) at the recording wrapper too."""
    if not _REPLACED:
        return
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None) or ""
        if module is None or not (name.startswith("subquad") or file.startswith(HERE)):
            continue
        for attr, value in list(vars(module).items()):
            wrapper = _REPLACED.get(id(value))
            if wrapper is not None and wrapper is not value:
                setattr(module, attr, wrapper)


# ------------------------------------------------------------------------------ the selection


def read_records(paths: Iterable[str]) -> List[Dict[str, str]]:
    rows = []
    for path in paths:
        with open(path) as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    return rows


def selects(row: Dict[str, str]) -> bool:
    """Whether a reading makes its test one that ``.ci/robustness quick`` reruns."""
    if row["test"] == "<outside a test>":
        return False
    if row["kind"] == "clock":
        return row["where"] not in HARMLESS_CLOCK
    if row["kind"] == "threads":
        # What matters is whether a plan changes with the thread count (``_planning`` plans every
        # call again for 1 and 64 threads); reading it to set it and restore it, or to print it
        # beside results, decides nothing.
        return row["where"].startswith("plan: ")
    return row["kind"] == "rates"


def main(argv: List[str]) -> int:
    """``python tests/_machine.py select RECORD...``: the node ids to rerun, one a line;
    ``python tests/_machine.py summary RECORD...``: how many tests read what."""
    command, paths = argv[0], argv[1:]
    rows = read_records(paths)
    if command == "select":
        for test in sorted({r["test"] for r in rows if selects(r)}):
            print(test)
        return 0
    if command == "summary":
        by_kind: Dict[str, Set[str]] = {}
        for r in rows:
            by_kind.setdefault(r["kind"] + ("" if selects(r) else " (not selected)"), set()).add(r["test"])
        for kind, tests in sorted(by_kind.items()):
            print(f"{kind}: {len(tests)} tests")
        return 0
    print(f"unknown command {command!r}; use select or summary", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
