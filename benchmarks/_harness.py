"""Time and peak memory of one attention call, each case in a fresh Python process.

CPU peak memory is the process RSS high-water mark: the child is started with
``MALLOC_MMAP_THRESHOLD_=131072`` (so freed large tensors go back to the OS), builds its inputs,
warms up, resets the mark by writing ``5`` to ``/proc/self/clear_refs`` and reads ``VmHWM`` after
one call. "extra" is that mark minus the RSS just before the call: the call's working set *and*
its output. Timing runs in another process with the default allocator settings. CUDA uses ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _child(spec: Dict[str, Any]) -> Dict[str, Any]:
    import gc

    import torch

    torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
    module, name = spec["target"].split(":")
    make: Callable[..., Callable[[], Any]] = getattr(importlib.import_module(module), name)
    fn = make(**spec["kwargs"])
    cuda = spec["kwargs"].get("device", "cpu").startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    result: Dict[str, Any] = {}
    try:
        out = fn()  # warm-up (thread pools, allocator caches, lazy imports)
        sync()
        result["output_bytes"] = _nbytes(out)
        del out
        times = []
        deadline = time.perf_counter() + spec.get("max_seconds", 60)
        for _ in range(spec.get("repeats", 3)):
            t0 = time.perf_counter()
            out = fn()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
            del out
            if time.perf_counter() > deadline:
                break
        if times:
            result["median_ms"] = statistics.median(times)
            result["times_ms"] = times
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = fn()
            sync()
            result["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
        else:
            base = _status_kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            out = fn()
            result["peak_extra_bytes"] = (_status_kib("VmHWM") - base) * 1024
        del out
        result["status"] = "ok"
    except Exception as e:
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        result["status"] = "oom" if "memory" in msg.lower() else "error"
        result["reason"] = msg
    return result


def _nbytes(out: Any) -> int:
    import torch

    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, (tuple, list)):
        return sum(_nbytes(o) for o in out)
    return 0


def measure(
    target: str, kwargs: Dict[str, Any], repeats: int = 3, timeout: float = 900, **extra: Any
) -> Dict[str, Any]:
    """Run ``target`` (``"module:factory"``; the factory builds inputs and returns a no-arg callable)
    with ``kwargs`` in fresh processes and return its timing and peak memory.

    Time and memory come from two processes: the small mmap threshold that makes RSS honest also
    makes every large allocation page-fault, which would slow the timed calls.
    """
    timed = _run_child({"target": target, "kwargs": kwargs, "repeats": repeats, **extra}, timeout, honest_rss=False)
    if timed.get("status") != "ok":
        return timed
    mem = _run_child({"target": target, "kwargs": kwargs, "repeats": 0, **extra}, timeout, honest_rss=True)
    if mem.get("status") != "ok":
        return mem
    timed["peak_extra_bytes"] = mem["peak_extra_bytes"]
    return timed


def _run_child(spec: Dict[str, Any], timeout: float, honest_rss: bool) -> Dict[str, Any]:
    env = dict(os.environ)
    if honest_rss:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env["PYTHONPATH"] = os.pathsep.join([HERE, os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys, json, _harness as h; print('@@' + json.dumps(h._child(json.loads(sys.argv[1]))))",
                json.dumps(spec),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": f"exceeded {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("@@"):
            return json.loads(line[2:])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    status = "oom" if proc.returncode in (-9, 137) else "error"
    return {"status": status, "reason": f"exit {proc.returncode}: {tail[0][:300]}"}


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# ---------------------------------------------------------------------------------------------
# Shared by the scripts that run their own children (hosts_comfyui.py, hosts_a1111.py, bench_ring.py)


def status_bytes(field: str) -> int:
    """A field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes."""
    return _status_kib(field) * 1024


def reset_hwm() -> None:
    """Reset the process's RSS high-water mark (``VmHWM``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def fmt_gib(n: Optional[float]) -> str:
    """``n`` bytes as GiB from 1 GiB up, else MiB; ``-`` for ``None``."""
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.0f} MiB"


def machine() -> Dict[str, Any]:
    """What ran a benchmark: date, CPU model and its vector/matrix flags, cores, threads, memory,
    torch, subquad, Python."""
    import datetime
    import platform

    import torch

    import subquad

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    flags: List[str] = []
    try:
        with open("/proc/cpuinfo") as f:
            have = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16") if f in have]
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cpu_flags": flags,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "torch": torch.__version__,
        "subquad": subquad.__version__,
        "python": platform.python_version(),
    }


def run_script_child(script: str, spec: Dict[str, Any], timeout: float, drop_env: Sequence[str] = ()) -> Dict[str, Any]:
    """Run ``script --child <spec as JSON>`` in a fresh process (large frees go back to the OS) and
    return the last JSON line it prints, with ``process_seconds``; or ``status`` timeout, killed
    (out of memory) or error, with the reason."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    for name in drop_env:
        env.pop(name, None)
    cmd = [sys.executable, os.path.abspath(script), "--child", json.dumps(spec)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": f"over {timeout:.0f} s"}
    wall = time.perf_counter() - start
    rows = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and rows:
        return dict(json.loads(rows[-1]), process_seconds=wall)
    tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
    killed = proc.returncode in (-9, 137) or "memory" in tail[0].lower()
    return {"status": "killed" if killed else "error", "reason": tail[0][:300], "returncode": proc.returncode}
