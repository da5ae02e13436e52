"""The machine under the suite: held still where a test needs it, shaken on purpose to prove it.

subquad reads the machine it runs on in a few places: the matmul and softmax rates it measures
once per process (``subquad._time_model._measure_rates``: time estimates, the long-call warning and
the progress log), torch's thread count (the fused kernels' per-thread scratch in the memory
model), free memory (the default budget) and the clock (the bench's timings). A test whose verdict
rests on one of those passes where it was written and fails on a stranger's machine, so tests
inject what they need (``FIXED_RATES``, a monkeypatched reading) and two switches, read from the
environment, check that nothing else leaks through (``.ci/robustness``, docs/ci/robustness.md):

``SUBQUAD_TEST_RATE_FACTOR=F``
    every rate subquad measures is ``F`` times the measured one (``10``: a machine ten times
    faster; ``0.1``: ten times slower). Rates a test injects are left as injected.
``SUBQUAD_TEST_CPU=NAME``
    the CPU is one of :data:`MACHINES` (``amx``, ``avx512-bf16``, ``avx512f``, ``avx2``, ``arm``,
    ``no-compiler``) wherever a test does not state its own: torch's feature probes, the float16
    GEMMs' verdict, and what ``subquad build`` gives there (the session's build seen through that
    machine's functions and lanes, or no build at all). A test of a choice that depends on the CPU
    states the machine it assumes (:func:`fake_cpu`); this switch finds the ones that do not.
``SUBQUAD_TEST_RECORD=PATH``
    append to ``PATH`` one JSON line per reading: which test (``PYTEST_CURRENT_TEST``) read which
    of ``rates``, ``threads``, ``free-memory``, ``clock``, ``cpu`` (a plan that changes with the
    CPU), ``cpu-read`` (asked whether it multiplies half precision natively), and from where.

Both apply to the test process and to the helpers it starts (``_memory_probe.py``,
``_distributed_cases.py`` call :func:`install` too). Nothing here imports pytest.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from types import ModuleType
from typing import Any, Callable, Dict, FrozenSet, Iterable, Iterator, List, NamedTuple, Optional, Set, Tuple

import torch

from subquad import _budget, _native, _planner, _time_model
from subquad._backends import products
from subquad._backends.products import CpuFeatures

HERE = os.path.dirname(os.path.abspath(__file__))

FIXED_RATES: Dict[str, Tuple[float, float]] = {
    "cpu": (1e11, 1e-9),
    "cuda": (1e14, 1e-12),
    "mps": (1e13, 1e-11),
}
"""A rate table for tests that need one: (matmul FLOP/s, seconds of softmax work per score), by
device type (``subquad._time_model`` keeps its measurements per device type and dtype: the row
stands for every dtype). The CPU row is within a few times of a 2-core VM; a test must hold for
any such table, not for these numbers."""

RATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

KINDS = ("rates", "threads", "free-memory", "clock", "cpu", "cpu-read")

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
    _time_model._RATES.clear()
    if factor != 1.0:
        measure = _time_model._measure_rates

        def scaled(device: torch.device, dtype: torch.dtype) -> Tuple[float, float]:
            flops, per_score = measure(device, dtype)
            return flops * factor, per_score / factor

        _time_model._measure_rates = scaled
        own = _time_model._measure_backend

        def scaled_own(device: torch.device, dtype: torch.dtype, backend: str) -> Tuple[float, float]:
            per_score, per_row = own(device, dtype, backend)
            return per_score / factor, per_row / factor

        scaled_own.__wrapped__ = own  # type: ignore[attr-defined]
        _time_model._measure_backend = scaled_own
    ambient = os.environ.get("SUBQUAD_TEST_CPU", "").strip()
    if ambient:
        _install_cpu(ambient)
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
            monkeypatch.setitem(_time_model._RATES, (device, dtype), rates)
    monkeypatch.setattr(
        _time_model, "score_mod_seconds", lambda inp: 0.0 if inp.score_mod is None else FIXED_SCORE_MOD_S
    )
    monkeypatch.setattr(_time_model, "backend_seconds", lambda device, dtype, backend: None)
    return table


FIXED_SCORE_MOD_S = 5e-9
"""What :func:`inject_rates` makes a ``score_mod`` cost per score."""


# ------------------------------------------------------------------------------ the CPU

TILE_PASSES = frozenset(
    {"exp2_rows_bf16", "softmax_grad_rows_bf16", "next_offsets", "online_update"}
    | {"aten_products_work", "set_products", "products"}
)
"""The native kernel's per-tile passes and the loops' products switch: every build has them
(portable C++)."""
WIDE_LOOPS = frozenset({"forward_segment_f32", "backward_segment_f32", "forward_packed_f32"})
"""Its float32/float16 loops: a build for AVX512F, or AVX2 with FMA."""
BF16_LOOPS = frozenset({"forward_segment_bf16", "backward_segment_bf16", "forward_packed_bf16"})
"""Its bfloat16 loops: a build for AVX512-BF16."""


class Machine(NamedTuple):
    """A kind of CPU as subquad sees it."""

    features: CpuFeatures
    fp16_products: bool
    """Whether its float16 GEMMs run at float32 speed or better (:func:`products.native_fp16_products`)."""
    build: Optional[FrozenSet[str]]
    """The functions ``subquad build`` gives there; ``None``: it cannot build (no compiler)."""
    float_lanes: int = 0
    """The build's float lanes (16: AVX512F, 8: AVX2; 0: no float loops)."""


MACHINES: Dict[str, Machine] = {
    # Intel Xeon from Sapphire Rapids on: AMX tiles, AVX512-BF16 and AVX512-FP16.
    "amx": Machine(CpuFeatures(True, True), True, TILE_PASSES | WIDE_LOOPS | BF16_LOOPS, 16),
    # AMD EPYC from Zen 4 on, Intel Cooper Lake: AVX512-BF16, no AMX.
    "avx512-bf16": Machine(CpuFeatures(False, True), False, TILE_PASSES | WIDE_LOOPS | BF16_LOOPS, 16),
    # Intel Xeon Skylake to Ice Lake: AVX512F, no bfloat16 products.
    "avx512f": Machine(CpuFeatures(False, False), False, TILE_PASSES | WIDE_LOOPS, 16),
    # AMD EPYC before Zen 4, desktop x86: AVX2 with FMA.
    "avx2": Machine(CpuFeatures(False, False), False, TILE_PASSES | WIDE_LOOPS, 8),
    # Arm servers (Graviton, Ampere): native float16 arithmetic, no x86 loops.
    "arm": Machine(CpuFeatures(False, False), True, TILE_PASSES),
    # An AVX512-BF16 CPU where PyTorch's extension builder finds no C++ compiler.
    "no-compiler": Machine(CpuFeatures(False, True), False, None),
}
"""The kinds of CPU the suite's choices are tested on (:func:`fake_cpu`, ``SUBQUAD_TEST_CPU``)."""


class Build:
    """The native kernel as ``subquad build`` gives it on a :class:`Machine`: the functions of that
    machine's build and its ``float_lanes``; each call runs the session's real build (``real``),
    or, without one, raises (a test of a choice that ran the kernel it only planned for)."""

    def __init__(self, machine: Machine, real: Optional[ModuleType] = None) -> None:
        assert machine.build is not None
        self.machine, self.real = machine, real
        self.float_lanes = machine.float_lanes

    def __getattr__(self, name: str) -> Any:
        if name not in self.machine.build:  # type: ignore[operator]
            raise AttributeError(f"this machine's build has no {name}")
        fn = getattr(self.real, name, None)
        if fn is None:

            def absent(*args: Any) -> None:
                raise RuntimeError(f"{name} ran, but the session's build lacks it (a stand-in for another CPU's)")

            return absent
        return fn


def fake_cpu(monkeypatch: Any, name: str, kernel: Any = "keep") -> Machine:
    """Make this test's CPU :data:`MACHINES[name] <MACHINES>`: torch's probes and the float16
    verdict, and with ``kernel`` what subquad loads as the native kernel: ``"keep"`` leaves it as it
    is (off in the suite), ``"stub"`` that machine's build of functions that must not run (tests of
    a choice), a module (the session's build) seen through that machine's build."""
    machine = MACHINES[name]
    monkeypatch.setattr(products, "_CPU", machine.features)
    monkeypatch.setattr(products, "_NATIVE_FP16", machine.fp16_products)
    if kernel != "keep":
        real = None if kernel == "stub" else kernel
        view = None if machine.build is None else Build(machine, real)
        monkeypatch.setitem(_native._LOADED, "module", view)
    return machine


def _install_cpu(name: str) -> None:
    if name not in MACHINES:
        raise ValueError(f"SUBQUAD_TEST_CPU must be one of {', '.join(MACHINES)}, got {name!r}")
    machine = MACHINES[name]
    products._CPU = machine.features
    products._NATIVE_FP16 = machine.fp16_products
    if machine.build is None:

        def no_compiler(*args: Any, **kwargs: Any) -> ModuleType:
            raise RuntimeError(f"no C++ compiler (SUBQUAD_TEST_CPU={name})")

        _native.build = no_compiler  # type: ignore[assignment]
        _native._import = no_compiler  # type: ignore[assignment]
    else:
        load = _native._import
        _native._import = lambda path: Build(machine, load(path))  # type: ignore[assignment,return-value]


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
    scratch grows with the thread count) and on each of :data:`MACHINES`: a plan that changes
    makes the test read ``threads`` or ``cpu``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        plan = make_plan(*args, **kwargs)
        if not _replanning:
            return plan
        here = _outcome(make_plan, args, kwargs)
        if _outcomes_by_threads(make_plan, args, kwargs) - {here}:
            _record("threads", "plan: " + _where(sys._getframe(1)))
        if _outcomes_by_machine(make_plan, args, kwargs) - {here}:
            _record("cpu", "plan: " + _where(sys._getframe(1)))
        return plan

    wrapper.__wrapped__ = make_plan  # type: ignore[attr-defined]
    return wrapper


def _outcomes_by_threads(make_plan: Callable[..., Any], args: Any, kwargs: Any) -> Set[Any]:
    real = torch.get_num_threads
    try:
        outcomes = set()
        for n in (1, 64):
            torch.get_num_threads = lambda n=n: n  # type: ignore[misc]
            outcomes.add(_outcome(make_plan, args, kwargs))
        return outcomes
    finally:
        torch.get_num_threads = real  # type: ignore[misc]


def _outcomes_by_machine(make_plan: Callable[..., Any], args: Any, kwargs: Any) -> Set[Any]:
    """The call's plans on each machine, with the kernel subquad has loaded (if any) seen through
    that machine's build."""
    saved = products._CPU, products._NATIVE_FP16, dict(_native._LOADED)
    loaded = saved[2].get("module")
    real = getattr(loaded, "real", loaded)
    try:
        outcomes = set()
        for machine in MACHINES.values():
            products._CPU, products._NATIVE_FP16 = machine.features, machine.fp16_products
            if real is not None:
                _native._LOADED["module"] = None if machine.build is None else Build(machine, real)
            outcomes.add(_outcome(make_plan, args, kwargs))
        return outcomes
    finally:
        products._CPU, products._NATIVE_FP16 = saved[0], saved[1]
        _native._LOADED.clear()
        _native._LOADED.update(saved[2])


def _install_recorder() -> None:
    for name in ("native_bf16_products", "native_fp16_products"):
        fn = getattr(products, name)
        _REPLACED[id(fn)] = wrapper = _reading("cpu-read", fn, only_ours=False)
        setattr(products, name, wrapper)
    _time_model._device_rates = _reading("rates", _time_model._device_rates, only_ours=False)
    _time_model.backend_seconds = _reading("rates", _time_model.backend_seconds, only_ours=False)
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


def selects_cpu(row: Dict[str, str]) -> bool:
    """Whether a reading makes its test one that ``.ci/robustness quick`` reruns on other CPUs
    (``SUBQUAD_TEST_CPU``): one of its plans changes with the machine (``_planning`` plans every
    call again on each of :data:`MACHINES`). Tests that only asked whether the CPU multiplies half
    precision natively (``cpu-read``: the products their tiles ran) are left to ``full``."""
    return row["test"] != "<outside a test>" and row["kind"] == "cpu"


def main(argv: List[str]) -> int:
    """``python tests/_machine.py select RECORD...``: the node ids to rerun on a faster, slower or
    busier machine, one a line; ``select-cpu RECORD...``: those to rerun on other CPUs;
    ``python tests/_machine.py summary RECORD...``: how many tests read what."""
    command, paths = argv[0], argv[1:]
    rows = read_records(paths)
    if command in ("select", "select-cpu"):
        chosen = selects if command == "select" else selects_cpu
        for test in sorted({r["test"] for r in rows if chosen(r)}):
            print(test)
        return 0
    if command == "summary":
        by_kind: Dict[str, Set[str]] = {}
        for r in rows:
            chosen = selects(r) or selects_cpu(r)
            by_kind.setdefault(r["kind"] + ("" if chosen else " (not selected)"), set()).add(r["test"])
        for kind, tests in sorted(by_kind.items()):
            print(f"{kind}: {len(tests)} tests")
        return 0
    print(f"unknown command {command!r}; use select, select-cpu or summary", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
