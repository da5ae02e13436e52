"""Figures a process measures for itself (the time model's rates), measured again later so that a
probe that ran while the machine was busy does not stay wrong for the whole process."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, Hashable, MutableMapping, Tuple, TypeVar

V = TypeVar("V")

REPROBE_AFTER_S = 20.0
"""A figure used this long after it was measured is measured again (keeping the faster)."""
REPROBES = 2
"""How many times a figure is measured again at most."""

_MEASURED: Dict[Tuple[int, Hashable], Tuple[float, int, Any]] = {}
"""``(id(cache), key) -> (when, times measured, the value measured)``."""


def lookup(
    cache: MutableMapping[Any, V], key: Hashable, measure: Callable[[], V], faster: Callable[[V, V], V], fallback: V
) -> V:
    """``cache[key]``: measured on first use (``fallback`` where the measurement fails), and
    measured again, at most :data:`REPROBES` times, when used :data:`REPROBE_AFTER_S` or more after
    the last measurement; ``faster`` keeps the better of the two. A value put into the cache by
    other code (a test's injected rates) is never measured again."""
    tag = (id(cache), key)
    now = time.monotonic()
    if key in cache:
        seen = _MEASURED.get(tag)
        value = cache[key]
        if seen is None or seen[2] is not value or seen[1] > REPROBES or now - seen[0] < REPROBE_AFTER_S:
            return value
        with contextlib.suppress(Exception):  # a failed measurement: the earlier figure stays
            value = faster(value, measure())
        cache[key] = value
        _MEASURED[tag] = (time.monotonic(), seen[1] + 1, value)
        return value
    try:
        value = measure()
    except Exception:  # a device or backend that cannot run the probe: the fallback
        value = fallback
    cache[key] = value
    _MEASURED[tag] = (time.monotonic(), 1, value)
    return value
