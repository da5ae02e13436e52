"""``memory_budget``: parsed, defaulted and formatted once, for every front end.

``parse_budget("512MiB")`` gives bytes; :func:`resolve_budget` turns what a caller passed
(``None`` means half the device's free memory) into the bytes a call may use beyond its inputs
and outputs, once per call; :func:`format_bytes` / :func:`format_seconds` are how every message
and plan prints them. Used by the torch calls, ``subquad.jax``, ``subquad.distributed``, the CLI
and the fast path; it imports nothing of subquad's but its exception classes, and torch only to ask
a torch device for its free memory (``subquad.jax`` uses it without torch).
"""

from __future__ import annotations

import math
import os
import re
import time
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Union

from ._errors import ArgumentError

if TYPE_CHECKING:
    import torch

Budget = Union[int, str, None]
"""What callers pass: bytes, a string with a unit (``"512MiB"``, ``"2GB"``), or ``None``."""

MiB = 1 << 20
DEFAULT_BUDGET_FRACTION = 0.5
"""``memory_budget=None`` allows this fraction of the device's free memory."""

MAX_BUDGET = (1 << 63) - 1

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_budget(memory_budget: Union[int, str]) -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"2GB"``, ``"1.5GiB"``."""
    if isinstance(memory_budget, bool):
        raise ArgumentError(
            f"Expected memory_budget to be None, an int of bytes or a string like '512MiB', got {memory_budget!r}."
        )
    if isinstance(memory_budget, int):
        value = memory_budget
    elif isinstance(memory_budget, float) and memory_budget.is_integer():
        value = int(memory_budget)
    elif isinstance(memory_budget, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", memory_budget)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ArgumentError(
                f"Could not parse memory_budget={memory_budget!r}; use bytes or a number with a unit "
                "(B, KB, MB, GB, KiB, MiB, GiB), e.g. '512MiB' or '2GB'."
            )
        number = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if not math.isfinite(number) or number > MAX_BUDGET:
            raise ArgumentError(
                f"memory_budget={memory_budget!r} is not a usable number of bytes (at most {MAX_BUDGET}, 2**63 - 1)."
            )
        value = int(number)
    else:
        raise ArgumentError(
            f"Expected memory_budget to be None, an int of bytes or a string like '512MiB', got {memory_budget!r}."
        )
    if value < 0:
        raise ArgumentError(f"Expected memory_budget >= 0, got {memory_budget!r}.")
    return min(value, MAX_BUDGET)


def resolve_budget(memory_budget: Budget, device: torch.device) -> int:
    """The bytes a call may use: ``memory_budget`` parsed, or for ``None`` half the free memory."""
    if memory_budget is None:
        return int(DEFAULT_BUDGET_FRACTION * free_memory_bytes(device))
    return parse_budget(memory_budget)


_CPU_FREE_CACHE: List[float] = []  # [timestamp, bytes]: /proc/meminfo read at most every 0.2 s


def free_memory_bytes(device: torch.device) -> int:
    """Memory the device could still give to one call."""
    if device.type == "cpu":
        now = time.monotonic()
        if _CPU_FREE_CACHE and now - _CPU_FREE_CACHE[0] < 0.2:
            return int(_CPU_FREE_CACHE[1])
        _CPU_FREE_CACHE[:] = [now, _cpu_available_bytes()]
        return int(_CPU_FREE_CACHE[1])
    import torch  # optional (subquad[torch]): only torch devices come here, and subquad.jax comes without torch

    if device.type == "cuda":
        index = device.index
        if index is None:  # the current device (0 where no CUDA runs: the simulations of the tests)
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        allocated, reserved = _cuda_allocator_bytes(index)
        # What the driver has free plus what torch's allocator holds does not change as this
        # process allocates and frees through it: read from the driver at most every 0.2 s, as
        # the CPU's /proc/meminfo (cudaMemGetInfo takes microseconds a call).
        now = time.monotonic()
        cached = _CUDA_FREE_CACHE.get(index)
        if cached is None or now - cached[0] >= 0.2:
            free, total = torch.cuda.mem_get_info(index)
            cached = _CUDA_FREE_CACHE[index] = (now, int(free) + reserved, int(total))
        available = cached[1] - allocated
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if fraction is not None:
            # set_per_process_memory_fraction caps what the caching allocator may hold in all
            # (``bench --model --max-memory`` relies on it): the card's free memory is not ours.
            available = min(available, int(fraction(index) * cached[2]) - allocated)
        return max(0, int(available))
    if device.type == "mps":
        mps = torch.mps
        if hasattr(mps, "recommended_max_memory") and hasattr(mps, "current_allocated_memory"):
            return max(0, int(mps.recommended_max_memory() - mps.current_allocated_memory()))
    return _cpu_available_bytes()


_CUDA_FREE_CACHE: Dict[int, Tuple[float, int, int]] = {}
"""CUDA device index -> (timestamp, driver's free bytes + the allocator's reserved, total)."""


def _cuda_allocator_bytes(index: int) -> Tuple[int, int]:
    """``(allocated, reserved)`` bytes of torch's CUDA caching allocator on device ``index``.

    ``torch.cuda.memory_allocated`` and ``memory_reserved`` each flatten every allocator
    statistic into a new dict, several times SDPA's own time on a mid-sized call
    (docs/benchmarks/gpu.md); the nested statistics they flatten cost a few microseconds."""
    import torch

    nested = getattr(torch.cuda, "memory_stats_as_nested_dict", None)
    if nested is None:  # pragma: no cover - every torch subquad supports has it
        return int(torch.cuda.memory_allocated(index)), int(torch.cuda.memory_reserved(index))
    stats = nested(index)

    def current(name: str) -> int:
        return int(stats.get(name, {}).get("all", {}).get("current", 0))

    return current("allocated_bytes"), current("reserved_bytes")


def _cpu_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def format_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_seconds(t: float) -> str:
    if t < 1e-3:
        return f"{t * 1e6:.0f} us"
    if t < 1:
        return f"{t * 1e3:.0f} ms"
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if t >= size:
            return f"{t / size:.1f} {unit}"
    return f"{t:.1f} s"
