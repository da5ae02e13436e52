"""Measuring a whole model with each attention implementation: ``subquad bench --model``.

For each size (resolution or sequence length, smallest first) and mode (``models.modes``):

1. Memory, one fresh worker process per (implementation, size, mode), started with
   ``MALLOC_MMAP_THRESHOLD_=131072`` (see ``measure``): it builds the model (seeded random
   weights) and the inputs, applies the implementation, runs one warm-up step, resets the peak
   counter, runs the measured step and saves that step's output. The peak is the step's memory
   above what the process held before it (weights and inputs): on CPU the RSS high-water mark
   (``VmHWM`` after writing ``5`` to ``/proc/self/clear_refs``), on CUDA
   ``max_memory_allocated``, on MPS the driver's allocated memory after the step (MPS has no
   peak counter). A worker the kernel kills (or the RSS guard does, below) is ``oom``.
   The cap is on the step's peak plus the weights.
2. Accuracy: each saved output against the ``sdpa`` implementation's, as the largest absolute
   difference.
3. Time, in this process (normal malloc): the model is built once, each implementation is
   applied to it in turn, warmed up, and the implementations are timed interleaved in
   ``--rounds`` rounds with balanced orders (``timing.interleaved``); each result keeps its
   per-round times, median and quartiles.

``--max-memory CAP``: an implementation whose step plus weights passes the cap at one size (or
dies of memory) is not run at larger sizes; on CUDA the worker also enforces the cap with
``torch.cuda.set_per_process_memory_fraction``. On CPU a worker whose RSS passes a guard
(twice the cap, or 90% of the memory available when it started) is stopped there and counts as
over the cap, so a matrix that would not fit is never allowed to take the machine down.

What the rest of the package uses: ``ModelResult``, ``run_model_bench``, ``run_memory_job``,
``InProcess``.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from . import models as models_mod
from . import timing as timing_mod
from .environment import environment
from .impls import is_out_of_memory
from .measure import Worker
from .meters import CudaPeak, RssPeak, status_bytes, synchronize
from .model_impls import REFERENCE, ModelImpl, impls_for
from .models import ModelSpec

STATUSES = ("ok", "unsupported", "oom", "error", "skipped")


@dataclass
class ModelResult:
    """One row of a --model results.json: one implementation at one size and mode."""

    model: str
    impl: str
    task: str
    mode: str
    size: int
    size_unit: str
    status: str = "ok"
    reason: Optional[str] = None
    median_ms: Optional[float] = None
    q1_ms: Optional[float] = None
    q3_ms: Optional[float] = None
    times_ms: list = field(default_factory=list)  # per round, interleaved with the others
    rounds: int = 0
    peak_bytes: Optional[int] = None  # the step's peak above weights and inputs
    weights_bytes: Optional[int] = None  # parameters and buffers
    memory_method: Optional[str] = None
    memory_step_ms: Optional[float] = None  # the memory-measured step (in the worker)
    max_abs_diff: Optional[float] = None  # against the reference implementation's output
    output_abs_max: Optional[float] = None  # the scale of the output, to read the difference
    reference: str = REFERENCE
    cap_bytes: Optional[int] = None
    over_cap: Optional[bool] = None
    batch: int = 1
    dtype: str = "fp32"
    budget: Optional[str] = None
    warnings: list = field(default_factory=list)
    device: str = "cpu"
    device_name: str = ""
    torch_version: str = ""
    subquad_version: Optional[str] = None
    threads: Optional[int] = None

    @property
    def total_bytes(self) -> Optional[int]:
        """The step's peak plus the weights: what the cap is compared with."""
        if self.peak_bytes is None:
            return None
        return self.peak_bytes + (self.weights_bytes or 0)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------- the worker


class _RssGuard:
    """Stops this process (SIGKILL, as the OOM killer would) once its RSS passes ``limit``; the
    limit can be lowered later (to the cap, just before the measured step)."""

    def __init__(self, limit: int):
        self.limit = limit
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while True:
            try:
                rss = status_bytes("VmRSS")
            except OSError:
                return
            if rss > self.limit:
                print(
                    f"subquad bench: RSS {rss / 2**30:.2f} GiB passed the guard of {self.limit / 2**30:.2f} GiB",
                    file=sys.stderr,
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.02)


def _meter(device: torch.device):
    if device.type == "cuda":
        return CudaPeak(device)
    if device.type == "mps":
        return _MpsAfter()
    return RssPeak.available() or RssPeak()


class _MpsAfter:
    """MPS has no peak counter: the driver's allocated memory after the step, above before.

    The driver's count includes the allocator's cached blocks. After a warm-up of the same size
    the step would run in those and read about 0, so the cache is emptied before the base is
    taken: the step gets its blocks from the driver, and they stay counted (cached) after it frees
    them. About its peak (more where a freed block was too small to reuse).
    """

    method = "mps driver_allocated_memory after the step minus before it, the allocator's cache emptied first"

    def start(self) -> None:
        torch.mps.synchronize()
        torch.mps.empty_cache()
        self.base = torch.mps.driver_allocated_memory()

    def stop(self) -> int:
        torch.mps.synchronize()
        return max(0, torch.mps.driver_allocated_memory() - self.base)


def run_memory_job(job: dict) -> dict:
    """The worker's half (``{"kind": "model", ...}`` from ``subquad.bench.worker``): build,
    warm up, measure one step's peak, save its output to ``job["output"]``."""
    device = torch.device(job["device"])
    guard = _RssGuard(int(job["rss_guard"])) if job.get("rss_guard") and device.type == "cpu" else None
    if job.get("cap_bytes") and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, job["cap_bytes"] / total), device)
    spec = models_mod.spec(job["model"])
    impl = impls_for(spec, [job["impl"]])[0]
    answer: dict = {"status": "ok"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            dtype = models_mod.DTYPES[job["dtype"]]
            if job.get("reuse_model"):
                model = _built(spec, job["device"], dtype, job["seed"])
            else:
                model = models_mod.build(spec, device=job["device"], dtype=dtype, seed=job["seed"])
            answer["weights_bytes"] = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
            inputs = models_mod.make_inputs(
                spec, job["size"], batch=job["batch"], device=job["device"], dtype=dtype, seed=job["seed"] + 1
            )
            impl.apply(model, job.get("budget"))
            setup, step = models_mod.make_step(spec, model, inputs, job["mode"])
            warm = job.get("warmup_size")
            if warm:  # a large step is warmed up on a small input: the one-time costs are the same
                small = models_mod.make_inputs(
                    spec, warm, batch=job["batch"], device=job["device"], dtype=dtype, seed=job["seed"] + 1
                )
                warm_setup, warm_step = models_mod.make_step(spec, model, small, job["mode"])
                del small  # freed with the warm-up step, before the measured one
            else:
                warm_setup, warm_step = setup, step
            if warm_setup is not None:
                warm_setup()
            out = warm_step()
            del out, warm_setup, warm_step
            if setup is not None:
                setup()
            if guard is not None and job.get("cap_bytes"):
                # The cap is on the step's peak plus the weights: stop the step once it passes.
                gc.collect()
                cap_limit = status_bytes("VmRSS") + job["cap_bytes"] - answer["weights_bytes"]
                guard.limit = min(guard.limit, cap_limit)
            meter = _meter(device)
            measured = not isinstance(meter, str)
            answer["memory_method"] = meter.method if measured else f"unavailable: {meter}"
            gc.collect()
            if measured:
                meter.start()
            start = time.perf_counter()
            out = step()
            synchronize(device)
            answer["memory_step_ms"] = (time.perf_counter() - start) * 1e3
            if measured:
                answer["peak_bytes"] = meter.stop()
            out = out.detach().float().cpu()
            answer["output_abs_max"] = float(out.abs().max())
            torch.save(out, job["output"])
        except Exception as exc:  # recorded: one implementation failing must not end the bench
            first = (str(exc).strip().splitlines() or [""])[0][:400]
            if is_out_of_memory(exc):
                answer = {"status": "oom", "reason": first}
            elif isinstance(exc, NotImplementedError):
                answer = {"status": "unsupported", "reason": f"NotImplementedError: {first}"}
            else:
                answer = {"status": "error", "reason": f"{type(exc).__name__}: {first}"}
    answer["warnings"] = sorted({str(w.message).strip()[:300] for w in caught})[:5]
    return answer


# ------------------------------------------------------------------------- the parent


def _guard_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    guard = int(0.9 * available)
    return guard


_BUILT: dict[tuple[str, str, torch.dtype, int], torch.nn.Module] = {}


def _built(spec: ModelSpec, device: str, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """One model per (name, device, dtype, seed) in this process: the timing process and
    in-process memory jobs share it (run_model_bench frees it at the end)."""
    key = (spec.name, device, dtype, seed)
    if key not in _BUILT:
        _BUILT.clear()
        _BUILT[key] = models_mod.build(spec, device=device, dtype=dtype, seed=seed)
    return _BUILT[key]


class InProcess:
    """Runs memory jobs in this process instead of a fresh one (``--in-process``: faster to
    start, the model built once, the peak less exact; no RSS guard)."""

    def run(self, job: dict) -> dict:
        return run_memory_job({**job, "rss_guard": None, "reuse_model": True})

    def close(self) -> None:
        gc.collect()


def _worker_memory(worker_cls, job: dict) -> dict:
    """One job in a fresh worker process (closed after it)."""
    worker = worker_cls()
    try:
        answer: dict = worker.run(job)
    finally:
        worker.close()
    if answer.get("status") == "oom" and "SIGKILL" in (answer.get("reason") or ""):
        answer["reason"] = (
            "the worker was stopped: its step passed the cap (or the machine's memory)"
            if job.get("cap_bytes")
            else answer["reason"]
        )
    return answer


ProgressFn = Callable[[str], None]


def run_model_bench(
    spec: ModelSpec,
    sizes: list[int],
    task: str,
    impls: list[ModelImpl],
    *,
    device: str = "cpu",
    dtype: str = "fp32",
    batch: int = 1,
    budget: Optional[str] = None,
    rounds: int = 5,
    cap_bytes: Optional[int] = None,
    seed: int = 0,
    progress: Optional[ProgressFn] = None,
    worker_cls=None,
) -> list[ModelResult]:
    """Every implementation at every size (smallest first) and mode of ``task``; ``rounds`` 0
    skips the interleaved timing (the worker's single measured step is then the only time, in
    ``memory_step_ms``). Ctrl-C returns what is done."""
    say = progress or (lambda text: None)
    env = environment(device)
    over: dict[str, set] = {}
    results: list[ModelResult] = []
    timer = _Timer(spec, device, dtype, seed) if rounds > 0 else None
    guard = _guard_bytes() if torch.device(device).type == "cpu" else None
    try:
        with tempfile.TemporaryDirectory(prefix="subquad-model-") as tmp:
            run = _Run(
                spec, task, device, dtype, batch, budget, cap_bytes, seed, guard, env, tmp, worker_cls or Worker, say
            )
            for size in sorted(sizes):
                for mode in models_mod.modes(spec, task):
                    rows = [_memory_row(run, impl, mode, size, over) for impl in impls]
                    _differences(rows, tmp, mode, size)
                    if timer is not None:
                        say(f"{spec.name} {mode} {size} {spec.size_unit}: timing, {rounds} interleaved rounds")
                        timer.time(rows, size, mode, batch, budget, rounds)
                    results += rows
    except KeyboardInterrupt:
        pass
    finally:
        _BUILT.clear()
    return results


@dataclass(frozen=True)
class _Run:
    """What the memory jobs of one :func:`run_model_bench` share."""

    spec: ModelSpec
    task: str
    device: str
    dtype: str
    batch: int
    budget: Optional[str]
    cap_bytes: Optional[int]
    seed: int
    guard: Optional[int]  # the workers' RSS guard (CPU), bytes
    env: dict  # environment(): the machine and the versions, in every result
    tmp: str  # where the workers save their outputs
    worker_cls: Any
    say: ProgressFn


def _memory_row(run: _Run, impl: ModelImpl, mode: str, size: int, over: dict[str, set]) -> ModelResult:
    """``impl``'s result at ``size`` in ``mode``, its memory measured in a fresh worker unless it
    does not support the call or passed the cap at a smaller size (``over``: by mode, those that
    did; joined here)."""
    spec = run.spec
    r = ModelResult(
        spec.name,
        impl.name,
        run.task,
        mode,
        size,
        spec.size_unit,
        batch=run.batch,
        dtype=run.dtype,
        budget=run.budget,
        cap_bytes=run.cap_bytes,
        device=run.device,
        **run.env,
    )
    reasons = impl.not_supported_reasons(spec, run.device, mode)
    if reasons:
        r.status, r.reason = "unsupported", "; ".join(reasons)
        return r
    if impl.name in over.get(mode, ()):
        r.status, r.reason = "skipped", "over the cap at a smaller size"
        return r
    run.say(f"{spec.name} {mode} {size} {spec.size_unit}: {impl.name}: memory (fresh process)")
    job = {
        "kind": "model",
        "model": spec.name,
        "impl": impl.name,
        "mode": mode,
        "size": size,
        "batch": run.batch,
        "dtype": run.dtype,
        "device": run.device,
        "budget": run.budget,
        "seed": run.seed,
        "cap_bytes": run.cap_bytes,
        "rss_guard": run.guard,
        "warmup_size": _warmup_size(spec, size),
        "output": os.path.join(run.tmp, f"{impl.name}-{mode}-{size}.pt"),
    }
    answer = _worker_memory(run.worker_cls, job)
    for key, value in answer.items():
        if key in ModelResult.__dataclass_fields__:
            setattr(r, key, value)
    if run.cap_bytes is not None:
        total = r.total_bytes  # None where the worker had no memory meter
        r.over_cap = r.status == "oom" or (r.status == "ok" and total is not None and total > run.cap_bytes)
        if r.over_cap:
            over.setdefault(mode, set()).add(impl.name)
    run.say(
        f"  {impl.name}: {r.status}"
        + (
            f", peak {r.peak_bytes / 2**20:.0f} MiB, {r.memory_step_ms / 1e3:.1f} s"
            if r.status == "ok" and r.peak_bytes is not None and r.memory_step_ms is not None
            else f" ({r.reason})"
            if r.reason
            else ""
        )
    )
    return r


def _warmup_size(spec: ModelSpec, size: int) -> Optional[int]:
    """The worker warms up at the full size only when that is cheap."""
    small = 64 if spec.family != "llama" else 32
    return small if size > 4 * small else None


def _differences(rows: list[ModelResult], tmp: str, mode: str, size: int) -> None:
    path = os.path.join(tmp, f"{REFERENCE}-{mode}-{size}.pt")
    ref = torch.load(path) if os.path.exists(path) else None
    for r in rows:
        mine = os.path.join(tmp, f"{r.impl}-{mode}-{size}.pt")
        if r.status == "ok" and ref is not None and os.path.exists(mine):
            r.max_abs_diff = float((torch.load(mine) - ref).abs().max())
        if os.path.exists(mine):
            os.remove(mine)
    if os.path.exists(path):
        os.remove(path)


class _Timer:
    """The timing process's model, built once and shared by every implementation."""

    def __init__(self, spec: ModelSpec, device: str, dtype: str, seed: int):
        self.spec, self.device, self.dtype, self.seed = spec, device, dtype, seed
        self.model: Optional[torch.nn.Module] = None

    def time(
        self, rows: list[ModelResult], size: int, mode: str, batch: int, budget: Optional[str], rounds: int
    ) -> None:
        live = [r for r in rows if r.status == "ok"]
        if not live:
            return
        dtype = models_mod.DTYPES[self.dtype]
        if self.model is None:
            self.model = _built(self.spec, self.device, dtype, self.seed)
        inputs = models_mod.make_inputs(
            self.spec, size, batch=batch, device=self.device, dtype=dtype, seed=self.seed + 1
        )
        by_name = {impl.name: impl for impl in impls_for(self.spec)}
        dev = torch.device(self.device)
        slow = max(r.memory_step_ms or 0.0 for r in live) > 10e3
        calls: dict[str, timing_mod.Timed] = {}
        try:
            for i, r in enumerate(live):
                impl = by_name[r.impl]
                setup, step = models_mod.make_step(self.spec, self.model, inputs, mode)
                apply = _applied(impl, self.model, budget, setup)
                calls[r.impl] = timing_mod.Timed(_synced(step, dev), apply)
                if not slow or i == 0:  # a slow step's one-time costs (the convolutions) are shared
                    apply()
                    calls[r.impl].run()
            times = timing_mod.interleaved(calls, min_rounds=rounds, max_rounds=rounds, target_s=0.0)
        except Exception as exc:  # the memory phase ran it; report, do not crash
            for r in live:
                r.reason = f"timing failed: {type(exc).__name__}: {str(exc)[:200]}"
            return
        finally:
            del inputs, calls
            gc.collect()
        for r in live:
            s = timing_mod.spread(times[r.impl])
            r.times_ms = [t * 1e3 for t in times[r.impl]]
            r.median_ms, r.q1_ms, r.q3_ms, r.rounds = s.median * 1e3, s.q1 * 1e3, s.q3 * 1e3, s.n


def _synced(step, device: torch.device):
    def run():
        step()
        synchronize(device)

    return run


def _applied(impl: ModelImpl, model: torch.nn.Module, budget: Optional[str], setup):
    def run():
        impl.apply(model, budget)
        if setup is not None:
            setup()

    return run
