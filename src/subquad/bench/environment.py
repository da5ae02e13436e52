"""The facts every record carries: the device's name, torch's and subquad's versions, threads."""

from __future__ import annotations

import os
import platform
from typing import Any, Dict, Optional

import torch

import subquad

_ENV_CACHE: Dict[str, Dict[str, Any]] = {}


def environment(device: str) -> dict:
    """device_name, torch_version, subquad_version, threads: the facts every record carries."""
    if device not in _ENV_CACHE:
        _ENV_CACHE[device] = {
            "device_name": device_name(device),
            "torch_version": torch.__version__,
            "subquad_version": _subquad_version(),
            "threads": torch.get_num_threads() if torch.device(device).type == "cpu" else None,
        }
    return _ENV_CACHE[device]


def device_name(device: str) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    if dev.type == "mps":
        return f"Apple MPS ({platform.machine()})"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs"


def _subquad_version() -> Optional[str]:
    try:
        version = getattr(subquad, "__version__", None)
        if version is None:
            from importlib.metadata import version as dist_version

            version = dist_version("subquad")
        return str(version)
    except Exception:  # a source checkout without metadata: not worth failing a bench for
        return None
