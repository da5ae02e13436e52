"""Every ``SUBQUAD_*`` environment variable subquad reads, each read the same way.

:data:`SETTINGS` lists them (docs/settings.md shows the same table). A switch takes ``1``, ``true``,
``yes``, ``on`` or ``0``, ``false``, ``no``, ``off`` (any case; empty or unset: its default); any
other value is an error naming the variable and what it takes.
"""

from __future__ import annotations

import os
from typing import Dict, NamedTuple, Optional, Tuple

from ._errors import ArgumentError

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


class Setting(NamedTuple):
    name: str
    values: str
    default: str
    changes: str


SETTINGS: Dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "SUBQUAD_MEMORY_BUDGET",
            "bytes or a size (`512MiB`, `2GB`)",
            "half the free memory",
            "the budget of calls that pass none: the hosts (ComfyUI, A1111) and `patch_sdpa`",
        ),
        Setting(
            "SUBQUAD_COMPILE",
            "switch",
            "on",
            "whether calls with callbacks may compile FlexAttention (`allow_compile=None`)",
        ),
        Setting(
            "SUBQUAD_NATIVE",
            "`auto`, `build`, `off`",
            "`auto`",
            "the native kernel: used once built (`auto`), built on first need (`build`), never (`off`); "
            "`off` also stops `subquad install` and the hosts from building it",
        ),
        Setting(
            "SUBQUAD_NATIVE_DIR",
            "a folder",
            "`~/.cache/subquad/native`",
            "where the native kernel's builds and the calibration are kept",
        ),
        Setting(
            "SUBQUAD_NATIVE_FLAGS",
            "compiler flags",
            "none",
            "added to the native kernel's build (part of its cache key), e.g. `-mno-avx512f`",
        ),
        Setting(
            "SUBQUAD_CALIBRATE",
            "switch",
            "on",
            "whether the loops-or-fused-kernel choice is measured on this CPU; off: fallback thresholds",
        ),
        Setting("SUBQUAD_TRITON", "switch", "on", "the CUDA tiles' Triton softmax kernels"),
        Setting(
            "SUBQUAD_COMFYUI_DEFAULT",
            "switch",
            "off",
            "subquad as the attention of every ComfyUI model when the node loads",
        ),
        Setting(
            "SUBQUAD_BENCH_STEADY_MALLOC",
            "switch",
            "on",
            "`subquad bench` fixes glibc's allocator thresholds in the process that times",
        ),
    )
}
"""Name -> what it takes, its default and what it changes."""


def _raw(name: str) -> Optional[str]:
    assert name in SETTINGS, name
    value = os.environ.get(name)
    return None if value is None or not value.strip() else value.strip()


def switch(name: str) -> bool:
    """A switch's value: its default when unset or empty."""
    value = _raw(name)
    if value is None:
        return SETTINGS[name].default == "on"
    if value.lower() in ON:
        return True
    if value.lower() in OFF:
        return False
    raise ArgumentError(f"{name} must be one of {', '.join(ON + OFF)} (unset: {SETTINGS[name].default}), got {value!r}")


def choice(name: str, choices: Tuple[str, ...]) -> str:
    """One of ``choices`` (the first when unset or empty)."""
    value = _raw(name)
    if value is None:
        return choices[0]
    if value.lower() not in choices:
        raise ArgumentError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value.lower()


def text(name: str) -> Optional[str]:
    """A free-form value (a path, flags, a size), ``None`` when unset or empty."""
    return _raw(name)
