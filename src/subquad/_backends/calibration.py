"""Whether the tiles' C++ loops beat torch's fused kernel on this CPU, measured on this CPU.

The loops (:mod:`subquad._backends.segments`) and torch's fused flash kernel trade places from
one CPU to the next: the kernel multiplies on AMX tiles where the CPU has them, the loops on
AVX512/AVX2 dot products. So ``auto`` decides from a calibration made here, once per native
build (the build's key holds the source, torch, Python and the CPU), dtype, direction (inference,
or training: forward and backward) and thread count:

- both candidates run the same calls, in interleaved rounds, on a few representative shapes
  (:data:`SHAPES`): self-attention at three sizes, cross-attention against 77 keys, one head of
  512 channels; about a second per dtype and direction;
- per shape the median of the per-round ratios (loops / fused) is kept;
- the loops take a call only where they won by a clear margin (:data:`MARGIN`) for its kind
  (self-attention: at its size or below), so a near tie stays on torch's kernel.

The table is written beside the native build (``calibration.json``) and read back by every later
process: the same call takes the same path each time. ``subquad calibrate`` measures again,
``subquad info`` prints it, ``SUBQUAD_CALIBRATE=0`` turns it off (then the fallback thresholds in
:mod:`~subquad._backends.segments` decide, and with AMX the fused kernel). The measuring itself is
installed by :mod:`subquad._calibrate` (it runs whole calls, a layer above the planner).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.utils import _python_dispatch

from .. import _native
from .. import _settings as settings
from .products import amx_tiles

Shape = Tuple[int, int, int, int]  # (B*H, Lq, Lk, E)

SHAPES: Dict[str, List[Shape]] = {
    "self": [(8, 256, 256, 64), (8, 512, 512, 64), (8, 1024, 1024, 64), (4, 2048, 2048, 64)],
    "few-keys": [(20, 4096, 77, 64)],
    "wide": [(1, 1024, 1024, 512)],
    "mods": [(8, 512, 512, 64)],
}
"""The calls timed, per kind: self-attention (2^19, 2^21, 2^23, 2^24 scores), cross-attention against a
text encoder's 77 keys, a VAE's one head of 512 channels, and causal ALiBi (the loops evaluate it
themselves; the fused kernel adds it as a bias tile)."""
SMALLEST = 1 << 18
"""Calls of fewer scores stay with the fused kernel whatever was measured (none was timed)."""

FEW_KEYS = 128
"""Calls with fewer keys are of the ``few-keys`` kind."""
WIDE_HEAD = 256
"""Calls with a wider head (query or value) are of the ``wide`` kind."""
MARGIN = 0.95
"""The loops take a kind of call only where their time was at most this fraction of the fused
kernel's: a near tie stays with torch's kernel."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Entry:
    """One dtype and direction, as measured: per kind, ``[(shape, ratio)]`` (loops / fused)."""

    dtype: str
    training: bool
    threads: int
    measured: str
    ratios: Dict[str, List[Tuple[Shape, float]]] = field(default_factory=dict)

    @property
    def threshold(self) -> Optional[int]:
        """The fewest scores from which the loops won every larger self-attention call measured."""
        best: Optional[int] = None
        for shape, ratio in sorted(self.ratios.get("self", []), key=lambda r: _scores(r[0]), reverse=True):
            if ratio > MARGIN:
                break
            best = _scores(shape)
        return best

    def wins(self, kind: str) -> bool:
        """Whether the loops won the calls of ``kind`` measured (``self``: the largest)."""
        measured = self.ratios.get(kind, [])
        if kind == "self":
            return self.threshold is not None
        return bool(measured) and all(r <= MARGIN for _, r in measured)

    def ratio(self, kind: str, scores: int) -> Optional[float]:
        """The measured ratio nearest below ``scores`` of ``kind`` (for explain)."""
        measured = sorted(self.ratios.get(kind, []), key=lambda r: _scores(r[0]))
        below = [r for s, r in measured if _scores(s) <= scores]
        return below[-1] if below else (measured[0][1] if measured else None)


def _scores(shape: Shape) -> int:
    bh, lq, lk, _ = shape
    return bh * lq * lk


def kind(E: int, Ev: int, Lk: int) -> str:
    if max(E, Ev) > WIDE_HEAD:
        return "wide"
    if Lk < FEW_KEYS:
        return "few-keys"
    return "self"


def enabled() -> bool:
    """``SUBQUAD_CALIBRATE`` (a switch, default on)."""
    return settings.switch("SUBQUAD_CALIBRATE")


# ------------------------------------------------------------------ the table
Measure = Callable[[torch.dtype, bool, Shape, str], Tuple[float, float]]
"""``(loops seconds, fused seconds)`` of one round of a shape of a kind (installed by
:mod:`subquad._calibrate`)."""

MEASURE: Optional[Measure] = None
ROUNDS = 3
_LOCK = threading.RLock()
_TABLE: Dict[str, Entry] = {}
_PRODUCTS: Dict[str, "Products"] = {}
_LOADED: List[str] = []  # the path the table was read from
_BUSY = threading.local()
_FAILED: Dict[str, Tuple[float, int, str]] = {}  # key -> (when, tries, why) its measurement failed here


def _key(dtype: torch.dtype, training: bool, threads: int) -> str:
    return f"{str(dtype).replace('torch.', '')}/{'training' if training else 'inference'}/{threads}t"


def path() -> str:
    """The table's file: beside this CPU's native build."""
    return str(_native.build_directory() / _native.build_name() / "calibration.json")


def _load() -> None:
    where = path()
    if _LOADED == [where]:
        return
    _TABLE.clear()
    _PRODUCTS.clear()
    _LOADED[:] = [where]
    try:
        with open(where) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return
    for k, e in raw.items():
        try:
            if k.startswith("products/"):
                _PRODUCTS[k] = Products(str(e["which"]), int(e["threads"]), str(e["measured"]), float(e["ratio"]))
                continue
            ratios = {kd: [(tuple(s), float(r)) for s, r in rows] for kd, rows in e["ratios"].items()}
            _TABLE[k] = Entry(e["dtype"], bool(e["training"]), int(e["threads"]), str(e["measured"]), ratios)
        except (KeyError, TypeError, ValueError):
            continue  # an entry of another layout is measured again


def _save() -> None:
    where = path()
    os.makedirs(os.path.dirname(where), exist_ok=True)
    tmp = f"{where}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(
            {**{k: asdict(e) for k, e in _TABLE.items()}, **{k: asdict(p) for k, p in _PRODUCTS.items()}}, f, indent=1
        )
    os.replace(tmp, where)


def table() -> Dict[str, Entry]:
    """The entries measured for this build (read from disk once)."""
    with _LOCK:
        _load()
        return dict(_TABLE)


# ------------------------------------------------------------------ the loops' products
PRODUCTS_SHAPE: Shape = (8, 1024, 1024, 64)
"""The call on which the loops' two ways to multiply are timed against each other (a forward of
self-attention, 2^23 scores)."""
PRODUCT_KINDS = ("float32", "bfloat16")
"""The loops' products: ``float32`` (the float32 and float16 loops) and ``bfloat16``."""

MeasureProducts = Callable[[str, Shape], Tuple[float, float]]
"""``(seconds with ATen's micro-kernels, seconds with the loops' own)`` of one round of the loops of
a kind of products (installed by :mod:`subquad._calibrate`)."""
MEASURE_PRODUCTS: Optional[MeasureProducts] = None


@dataclass
class Products:
    """What the loops of one kind of products multiply on, as measured here: ATen's CPU BLAS
    micro-kernels (oneDNN's brgemm: AMX tiles where the CPU has them) or their own."""

    which: str
    threads: int
    measured: str
    ratio: float  # ATen's time / the loops' own, the median of the rounds

    @property
    def aten(self) -> bool:
        """ATen's only where they won by :data:`MARGIN`: a near tie keeps the loops' own."""
        return self.ratio <= MARGIN


def products_of(dtype: torch.dtype) -> str:
    """The kind of products of ``dtype``'s loops."""
    return "bfloat16" if dtype == torch.bfloat16 else "float32"


def _products_key(which: str, threads: int) -> str:
    return f"products/{which}/{threads}t"


def _aten_runs(kernel: object, which: str) -> bool:
    """Whether ``kernel`` has the products switch and ATen's micro-kernels run ``which`` here."""
    try:
        return bool(kernel.aten_products_work(which))  # type: ignore[attr-defined]
    except Exception:  # an older build without the switch, or a stand-in that refuses to run
        return False


def products_choice(which: str) -> Tuple[bool, str]:
    """``(ATen's products?, why)`` for the loops of ``which`` here: what was measured; without a
    measurement (none yet, or ``SUBQUAD_CALIBRATE=0``) the fallback: ATen's bfloat16 products on
    a CPU with AMX tiles (torch's own kernel multiplies on them), else the loops' own."""
    kernel = _native.tile_kernel()
    if kernel is None or not _aten_runs(kernel, which):
        return False, "their own (ATen's micro-kernels do not run here)"
    measured = products_table().get(_products_key(which, torch.get_num_threads())) if enabled() else None
    if measured is not None:
        where = "ATen's micro-kernels" if measured.aten else "their own"
        return measured.aten, f"{where} (measured: ATen's at {measured.ratio:.2f}x the loops' own time)"
    if which == "bfloat16" and amx_tiles():
        return True, "ATen's micro-kernels (fallback: AMX tiles, not measured)"
    return False, "their own (fallback: not measured)"


def apply_products(kernel: object) -> None:
    """Set which products ``kernel``'s loops run, from :func:`products_choice` (a kernel without
    the switch, as built by an older source, keeps its own)."""
    for which in PRODUCT_KINDS:
        if not _aten_runs(kernel, which):
            continue  # the loops' own, as built
        aten, _ = products_choice(which)
        if (kernel.products(which) == "aten") != aten:  # type: ignore[attr-defined]
            kernel.set_products(which, aten)  # type: ignore[attr-defined]


_native.ON_LOAD.append(apply_products)


def products_table() -> Dict[str, Products]:
    """The products measured for this build (read from disk once)."""
    with _LOCK:
        _load()
        return dict(_PRODUCTS)


def calibrate_products(which: str, rounds: int = ROUNDS) -> Optional[Products]:
    """Time the loops of ``which`` with ATen's micro-kernels against their own, keep the result and
    set the kernel accordingly; ``None`` where ATen's do not run here (nothing to choose).

    Raises:
        Unsettled: the rounds disagreed (see :func:`calibrate`); nothing is kept.
    """
    kernel = _native.tile_kernel()
    if MEASURE_PRODUCTS is None or kernel is None or not _aten_runs(kernel, which):
        return None
    with _LOCK:
        _load()
        busy = getattr(_BUSY, "on", False)
        _BUSY.on = True
        try:
            MEASURE_PRODUCTS(which, PRODUCTS_SHAPE)  # warm
            per_round: List[float] = []
            while len(per_round) < rounds or (not _settled(per_round) and len(per_round) < MAX_ROUNDS):
                aten, own = MEASURE_PRODUCTS(which, PRODUCTS_SHAPE)
                per_round.append(aten / own)
        finally:
            _BUSY.on = busy
        if not _settled(per_round):
            raise Unsettled(f"{which} products: ATen/own {', '.join(f'{r:.2f}' for r in per_round)}")
        threads = torch.get_num_threads()
        found = Products(which, threads, time.strftime("%Y-%m-%d %H:%M"), round(statistics.median(per_round), 3))
        _PRODUCTS[_products_key(which, threads)] = found
        with contextlib.suppress(OSError):
            _save()
        apply_products(kernel)
        return found


def describe_products(p: Products) -> str:
    """One line of the table: what the loops of a kind multiply on, and the ratio it came from."""
    where = "ATen's micro-kernels" if p.aten else "their own micro-kernels"
    loops = "float32 and float16" if p.which == "float32" else p.which
    return f"{loops} loops' products, {p.threads} threads ({p.measured}): {where}; ATen/own {p.ratio:.2f}"


class Unsettled(RuntimeError):
    """The rounds disagreed (another process was busy on the cores): nothing is kept."""


def calibrate(dtype: torch.dtype, training: bool, rounds: int = ROUNDS) -> Entry:
    """Measure one dtype and direction now (``subquad calibrate``) and keep the result.

    Raises:
        Unsettled: no majority of a shape's rounds agreed within :data:`SPREAD` (the machine was busy);
            nothing is kept, and the next need measures again after :data:`RETRY_AFTER_S`.
    """
    if MEASURE is None:
        raise RuntimeError("subquad's calibration runs whole calls: import subquad first")
    with _LOCK:
        _load()
        if _products_key(products_of(dtype), torch.get_num_threads()) not in _PRODUCTS:
            calibrate_products(products_of(dtype), rounds)  # the loops below run on the faster products
        _BUSY.on = True
        try:
            ratios: Dict[str, List[Tuple[Shape, float]]] = {}
            for kd, shapes in SHAPES.items():
                ratios[kd] = []
                for shape in shapes:
                    per_round: List[float] = []
                    MEASURE(dtype, training, shape, kd)  # warm: first calls allocate and load
                    while len(per_round) < rounds or (not _settled(per_round) and len(per_round) < MAX_ROUNDS):
                        loops, fused = MEASURE(dtype, training, shape, kd)
                        per_round.append(loops / fused)
                    if not _settled(per_round):
                        raise Unsettled(f"{kd} {shape}: loops/fused {', '.join(f'{r:.2f}' for r in per_round)}")
                    ratios[kd].append((shape, round(statistics.median(per_round), 3)))
        finally:
            _BUSY.on = False
        threads = torch.get_num_threads()
        entry = Entry(str(dtype).replace("torch.", ""), training, threads, time.strftime("%Y-%m-%d %H:%M"), ratios)
        _TABLE[_key(dtype, training, threads)] = entry
        with contextlib.suppress(OSError):  # a read-only cache: kept for this process
            _save()
        return entry


SPREAD = 1.25
"""A majority of a shape's rounds must agree within this factor (loops/fused), or more rounds
run (up to :data:`MAX_ROUNDS`), and then nothing is kept: a round apart (a first call's warm-up,
a moment's load) is outvoted by the median."""
MAX_ROUNDS = 7


def _settled(per_round: List[float]) -> bool:
    r = sorted(per_round)
    m = len(r) // 2 + 1
    return len(r) < 2 or any(r[i + m - 1] <= SPREAD * r[i] for i in range(len(r) - m + 1))


RETRY_AFTER_S = 60.0
"""An unsettled or failed calibration is tried again on a need this long after it."""


def entry(dtype: torch.dtype, training: bool) -> Optional[Entry]:
    """This dtype and direction's measurement: read, or made now on first need (a few seconds),
    or ``None`` where calibration is off, cannot run, or is running. Never made while
    ``torch.compile`` traces or a dispatch mode (fake tensors, a profiler's recorder) is active:
    what would be timed there is not the kernels."""
    if not enabled() or getattr(_BUSY, "on", False):
        return None
    with _LOCK:
        _load()
        key = _key(dtype, training, torch.get_num_threads())
        found = _TABLE.get(key)
        if found is not None or MEASURE is None:
            return found
        failed = _FAILED.get(key)
        if failed is not None and (failed[1] >= 3 or time.monotonic() - failed[0] < RETRY_AFTER_S):
            return None
        if torch.compiler.is_compiling() or _python_dispatch._get_current_dispatch_mode() is not None:
            return None
        try:
            return calibrate(dtype, training)
        except Exception as e:  # unsettled or unable to run: the fallback thresholds, for now
            _FAILED[key] = (time.monotonic(), (failed[1] if failed else 0) + 1, f"{type(e).__name__}: {e}")
            return None


def forget() -> None:
    """Drop what this process read (the file stays): the next question reads it again."""
    with _LOCK:
        _TABLE.clear()
        _PRODUCTS.clear()
        _LOADED.clear()
        _FAILED.clear()


def describe(e: Entry) -> str:
    """One line of the table: the decision and the ratios it came from."""
    direction = "training (forward + backward)" if e.training else "inference"
    t = e.threshold
    verdict = (
        f"loops from 2^{t.bit_length() - 1} scores" if t is not None else "fused kernel (the loops never won by 5%)"
    )
    parts = []
    for kd, rows in e.ratios.items():
        label = {"self": "self", "few-keys": "77 keys", "wide": "head 512", "mods": "ALiBi"}.get(kd, kd)
        parts.append(f"{label} " + "/".join(f"{r:.2f}" for _, r in rows))
    return f"{e.dtype} {direction}, {e.threads} threads ({e.measured}): {verdict}; loops/fused {', '.join(parts)}"
