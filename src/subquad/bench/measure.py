"""Measuring one (implementation, case): time, peak extra memory, accuracy, status.

How, for one case:

1. ``not_supported_reasons`` → status ``unsupported`` without running anything.
2. Inputs are made, the implementation prepares its call, and it runs for the warm-up; a refusal
   there is ``unsupported``, an allocation failure ``oom``, anything else ``error`` (never a crash).
3. Memory: one call runs between a memory reset and a memory read: on CUDA the caching
   allocator's ``max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was
   allocated before; on CPU the process's RSS high-water mark (``VmHWM`` after writing ``5`` to
   ``/proc/self/clear_refs``) minus its RSS before. The number includes the output (and, with
   backward, the three input gradients). That call's output is checked against a float64
   reference computed for a sample of query rows only (with backward, so are those rows of dQ).
4. Time (``run_all``): the implementations of one case are prepared again in the parent and each
   warmed up with the very call that is timed (at least one call, however slow the memory call
   was: masks built, plans cached, the allocator in its steady state); then one untimed round
   runs them all in each other's company, and the timed rounds follow, each implementation once
   per round in balanced orders (``timing.run_rounds``), each call with the device synchronized
   before and after. Rounds are added while a verdict is unsettled, up to 3x the timing target
   (``Result.rounds_stopped`` says why they stopped). Each result keeps its per-round times,
   median and quartiles, and the verdict compares implementations by their per-round ratios
   (``timing``). A single ``run_case`` times one implementation alone, until the target is met.

On CPU the memory phase runs in a worker process started with ``MALLOC_MMAP_THRESHOLD_=131072``:
glibc then serves every block over 128 KiB with mmap and returns it on free, so RSS falls when a
tensor is freed and the high-water mark is the call's real peak (with the default dynamic
threshold, blocks up to 32 MiB stay in the heap once freed and RSS can read 1.5x the peak or
hide a reuse). A worker that the kernel kills (the OOM killer sends SIGKILL) becomes an ``oom``
record and a fresh worker takes the next case. The time phase then runs in the parent process,
whose malloc is the normal one: the mmap threshold costs page faults that no real process pays.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import IO, Callable, Optional

import torch

from subquad._tiles import TILES

from . import timing as timing_mod
from .accuracy import sampled_errors
from .cases import BenchInputs, Case, Timing, make_inputs
from .environment import device_name, environment  # noqa: F401 (device_name: for the CLI)
from .impls import IMPLS, Impl, is_out_of_memory, refusal_reason
from .meters import CudaPeak, RssPeak, memory_meter, steady_malloc, synchronize  # noqa: F401 (RssPeak, CudaPeak: the meters)

STATUSES = ("ok", "unsupported", "oom", "error")


@dataclass
class Result:
    """One row of results.json."""

    impl: str
    case: str
    mode: str
    status: str = "ok"
    reason: Optional[str] = None
    median_ms: Optional[float] = None
    min_ms: Optional[float] = None
    q1_ms: Optional[float] = None  # quartiles of the timed calls (the spread)
    q3_ms: Optional[float] = None
    times_ms: list = field(default_factory=list)  # per round, interleaved with the case's others
    reps: int = 0
    rounds_stopped: Optional[str] = None  # why the rounds stopped (timing.STOPS)
    memory_call_ms: Optional[float] = None  # the memory-measured call (not in the median)
    first_call_ms: Optional[float] = None  # the very first call in the process (compiling, tracing)
    tflops: Optional[float] = None
    peak_bytes: Optional[int] = None
    output_bytes: Optional[int] = None
    memory_method: Optional[str] = None
    rel_err: Optional[float] = None
    rel_err_grad: Optional[float] = None
    shape: list = field(default_factory=list)  # [B, H, Lq, Lk, E]
    dtype: str = ""
    mask: str = "none"
    budget: Optional[str] = None
    plan: dict = field(default_factory=dict)  # subquad's plan: backend, chunk_size, predicted peak
    warnings: list = field(default_factory=list)
    device: str = ""
    device_name: str = ""
    torch_version: str = ""
    subquad_version: Optional[str] = None
    threads: Optional[int] = None

    @classmethod
    def for_case(cls, impl: str, case: Case) -> "Result":
        return cls(
            impl=impl,
            case=case.name,
            mode=case.mode,
            shape=list(case.shape),
            dtype=case.dtype or "",
            mask=case.mask,
            budget=case.budget,
            device=case.device,
            output_bytes=case.output_bytes,
            **environment(case.device),
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- running


def _timed(step: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, torch.Tensor]:
    synchronize(device)
    start = time.perf_counter()
    out = step()
    synchronize(device)
    return time.perf_counter() - start, out


def _step(forward: Callable[[], torch.Tensor], inputs: BenchInputs) -> Callable[[], torch.Tensor]:
    """The call that is timed: the forward, or forward and backward with gradients set to None
    first (as ``zero_grad(set_to_none=True)`` does in a training loop)."""
    if inputs.grad_out is None:
        return forward
    tensors = (inputs.query, inputs.key, inputs.value)

    def step():
        for t in tensors:
            t.grad = None
        out = forward()
        out.backward(inputs.grad_out)
        return out.detach()

    return step


def _finite(x: Optional[float]) -> Optional[float]:
    return x if x is not None and math.isfinite(x) else None


PHASES = ("memory", "time")


def run_case(
    impl: Impl,
    case: Case,
    timing: Timing = Timing(),
    *,
    seed: int = 0,
    skip_slow: bool = True,
    phases: tuple[str, ...] = PHASES,
    result: Optional[Result] = None,
) -> Result:
    """Measure ``impl`` on ``case`` in this process: the ``memory`` phase (one call between a
    memory reset and read, its output checked against the reference) and the ``time`` phase
    (the timed calls), each after a warm-up. ``result`` continues a record that another process
    began (the parent times what a worker measured). Never raises for a failing implementation:
    refusals, out-of-memory and other errors come back as a Result with that status."""
    result = result or Result.for_case(impl.name, case)
    reasons = impl.not_supported_reasons(case, skip_slow=skip_slow)
    if reasons:
        result.status, result.reason = "unsupported", "; ".join(reasons)
        return result
    device = torch.device(case.device)
    caught: list = []
    failed = False
    # Dropped in `finally`, before the cache is emptied.
    inputs: Optional[BenchInputs] = None
    forward: Optional[Callable[[], torch.Tensor]] = None
    step: Optional[Callable[[], torch.Tensor]] = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            inputs = _inputs(case, seed)
            forward, plan = impl.prepare(inputs)
            # Keep what the worker's memory call recorded (the tiles it ran) next to the plan.
            result.plan = {**plan, **{k: v for k, v in result.plan.items() if k == "tiles"}}
            step = _step(forward, inputs)
            if "memory" in phases:
                # The first call of this implementation and case in this process: what a user pays
                # once (compiling a kernel, tracing a callback), not part of the timed median.
                first_s, out = _timed(step, device)
                result.first_call_ms = first_s * 1e3
                del out
            _warm_up(step, device, timing)
            if "memory" in phases:
                _memory_phase(step, inputs, device, result, seed)
            if "time" in phases:
                _time_phase(step, case, timing, result)
    except Exception as exc:  # recorded, never raised: one bad case must not end the bench
        _record_failure(result, impl, exc, caught)
        failed = True
    finally:
        inputs = forward = step = None
        if failed:
            _INPUTS_CACHE.clear()  # start the next case from a clean slate after a failure
            gc.collect()  # the traceback's frames held the inputs in a reference cycle
        if device.type == "cuda":
            torch.cuda.empty_cache()
    seen = set(result.warnings) | {str(w.message).strip()[:300] for w in caught}
    result.warnings = sorted(seen)[:5]
    return result


def _record_failure(result: Result, impl: Impl, exc: BaseException, caught: list) -> None:
    warnings_text = " | ".join(sorted({str(w.message).strip() for w in caught}))
    reason = refusal_reason(impl, exc, warnings_text)
    if reason is not None:
        result.status, result.reason = "unsupported", reason
    elif is_out_of_memory(exc):
        result.status, result.reason = "oom", _first_line(exc)
    else:
        result.status, result.reason = "error", f"{type(exc).__name__}: {_first_line(exc)}"
    result.median_ms = result.min_ms = result.q1_ms = result.q3_ms = None
    result.tflops = result.peak_bytes = None
    result.times_ms, result.reps = [], 0


_INPUTS_CACHE: dict[tuple[Case, int], BenchInputs] = {}


def _inputs(case: Case, seed: int) -> BenchInputs:
    """The inputs of ``case``, reused by the next implementation of the same case (making them
    costs more than a fast kernel); the previous case's are freed first."""
    key = (case, seed)
    if key not in _INPUTS_CACHE:
        _INPUTS_CACHE.clear()
        _INPUTS_CACHE[key] = make_inputs(case, seed)
    inputs = _INPUTS_CACHE[key]
    for t in (inputs.query, inputs.key, inputs.value):
        t.grad = None
    return inputs


def _first_line(exc: BaseException, limit: int = 400) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:limit]


def _warm_up(step, device: torch.device, timing: Timing) -> None:
    """Calls of the timed ``step`` itself, at least one however slow: a first call builds what the
    timed ones reuse (masks, plans, kernels, the allocator's free blocks), and skipping it because
    the memory call was slow left the first timed round 2-9x the median."""
    total = 0.0
    for _ in range(1000):
        dt, out = _timed(step, device)
        del out
        total += dt
        if total >= timing.warmup_s or dt >= timing.target_s:
            break


def _memory_phase(step, inputs: BenchInputs, device: torch.device, result: Result, seed: int) -> None:
    for t in (inputs.query, inputs.key, inputs.value):
        t.grad = None
    meter = memory_meter(device)
    measured = not isinstance(meter, str)
    result.memory_method = meter.method if measured else f"unavailable: {meter}"
    if measured:
        meter.start()
    tiles = _subquad_tiles()
    if tiles is not None:
        tiles.reset()
    start = time.perf_counter()
    out = step()
    synchronize(device)
    result.memory_call_ms = (time.perf_counter() - start) * 1e3
    if measured:
        result.peak_bytes = meter.stop()
    if tiles is not None and result.impl.startswith("subquad") and (tiles.computed or tiles.skipped):
        result.plan["tiles"] = [tiles.computed, tiles.skipped]
    grad_query = inputs.query.grad if inputs.case.backward else None
    rel_err, rel_err_grad = sampled_errors(inputs, out, grad_query, seed=seed)
    result.rel_err, result.rel_err_grad = _finite(rel_err), _finite(rel_err_grad)
    if result.rel_err is None:
        result.reason = "output is not finite on the sampled rows"


def _subquad_tiles():
    """subquad's tile counter (computed / skipped tiles of the last calls)."""
    return TILES


def _time_phase(step, case: Case, timing: Timing, result: Result) -> None:
    device = torch.device(case.device)
    times: list[float] = []
    while len(times) < timing.max_reps and (len(times) < timing.min_reps or sum(times) < timing.target_s):
        dt, out = _timed(step, device)
        del out
        times.append(dt)
        if times[0] >= timing.target_s:
            break  # a slow call is timed once
    _record_times(result, case, times)


def _record_times(result: Result, case: Case, times: list[float]) -> None:
    s = timing_mod.spread(times)
    result.reps = len(times)
    result.times_ms = [t * 1e3 for t in times]
    result.median_ms, result.q1_ms, result.q3_ms = s.median * 1e3, s.q1 * 1e3, s.q3 * 1e3
    result.min_ms = min(times) * 1e3
    result.tflops = case.flops / s.median / 1e12 if s.median > 0 else None


# Rounds are added while a verdict is unsettled until the timed calls took this many times the
# target (or this many times the most rounds).
CAP = 3


def time_interleaved(
    rows: list[tuple[Impl, Result]],
    case: Case,
    timing: Timing,
    *,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """Time the implementations of one case together, in rounds (``timing.run_rounds``: each
    warmed up, one untimed round, balanced orders, rounds added while a verdict is unsettled), and
    record each one's per-round times in its Result. An implementation that fails while being
    prepared, warmed up or timed gets that status, and the others are timed again without it.
    ``clock`` times the rounds (tests pass a virtual one)."""
    device = torch.device(case.device)
    inputs = _inputs(case, seed)
    steps: dict = {}
    live = {result.impl: (impl, result) for impl, result in rows if result.status == "ok"}
    try:
        while live:
            for name, (impl, result) in list(live.items()):
                if name in steps:
                    continue
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        forward, _ = impl.prepare(inputs)
                        steps[name] = _step(forward, inputs)
                        _warm_up(steps[name], device, timing)
                    except Exception as exc:  # recorded: the others are still timed
                        _record_failure(result, impl, exc, caught)
                        del live[name]
                        steps.pop(name, None)
            calls = {name: _synchronized(name, steps[name], device) for name in live}
            try:
                rounds = timing_mod.run_rounds(
                    calls,
                    min_rounds=timing.min_reps,
                    max_rounds=timing.max_reps,
                    target_s=timing.target_s,
                    warm_rounds=1,
                    cap_s=CAP * timing.target_s,
                    cap_rounds=CAP * timing.max_reps,
                    seed=seed,
                    clock=clock,
                )
            except _CallFailed as failed:
                impl, result = live.pop(failed.name)
                _record_failure(result, impl, failed.exc, [])
                steps.pop(failed.name)
                continue
            for name, (_impl, result) in live.items():
                _record_times(result, case, rounds.times[name])
                result.rounds_stopped = rounds.stopped
            break
    finally:
        steps.clear()
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()


class _CallFailed(Exception):
    def __init__(self, name: str, exc: BaseException):
        super().__init__(name)
        self.name, self.exc = name, exc


def _synchronized(name: str, step, device: torch.device):
    def call():
        try:
            synchronize(device)
            step()
            synchronize(device)
        except Exception as exc:
            raise _CallFailed(name, exc) from exc

    return call


# ------------------------------------------------------------------------------ worker


def _job(impl: Impl, case: Case, timing: Timing, seed: int, skip_slow: bool) -> dict:
    return {
        "impl": impl.name,
        "case": dataclasses.asdict(case),
        "timing": timing._asdict(),
        "seed": seed,
        "skip_slow": skip_slow,
        "phases": ["memory"],
    }


def run_job(job: dict) -> dict:
    """Run a job dict (as sent to a worker) and return its result as a dict."""
    case = Case(**job["case"])
    impl = IMPLS.get(job["impl"])
    if impl is None:
        result = Result.for_case(job["impl"], case)
        result.status, result.reason = "error", f"unknown implementation {job['impl']!r}"
        return result.to_dict()
    timing = Timing(**job["timing"])
    phases = tuple(job.get("phases", PHASES))
    return run_case(impl, case, timing, seed=job["seed"], skip_slow=job["skip_slow"], phases=phases).to_dict()


class Worker:
    """A child process that runs jobs one at a time (see ``subquad.bench.worker``); restarted
    after it dies. ``command`` replaces the child's command line (tests use it)."""

    def __init__(self, command: Optional[list[str]] = None):
        self.command = command or [sys.executable, "-m", "subquad.bench.worker"]
        self.proc: Optional[subprocess.Popen[str]] = None
        self.stderr: Optional[IO[bytes]] = None

    def _start(self) -> None:
        env = dict(os.environ)
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - open while the child writes to it
        self.proc = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
            text=True,
            bufsize=1,
        )

    def run(self, job: dict) -> dict:
        """The job's result dict, or one with status oom/error when the process died."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None, "_start() opens the pipes"
        line = ""
        try:
            proc.stdin.write(json.dumps(job) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except (BrokenPipeError, OSError):
            pass
        if line:
            answer: dict = json.loads(line)
            return answer
        return self._died()

    def _died(self) -> dict:
        proc, self.proc = self.proc, None
        assert proc is not None and self.stderr is not None, "run() started the worker"
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace").strip().splitlines()[-3:]
        if code == -signal.SIGKILL:
            return {
                "status": "oom",
                "reason": "the worker was killed by SIGKILL (the kernel's OOM killer, most likely)",
            }
        return {"status": "error", "reason": f"the worker exited with code {code}: {' | '.join(tail)[-400:]}"}

    def close(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None, "_start() opens the pipes"
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
            self.proc = None


ProgressFn = Callable[[int, int, Impl, Case, Optional[Result]], None]


def run_all(
    jobs: list[tuple[Impl, Case]],
    timing: Timing,
    *,
    seed: int = 0,
    skip_slow: bool = True,
    isolate: Optional[bool] = None,
    progress: Optional[ProgressFn] = None,
    worker: Optional[Worker] = None,
) -> list[Result]:
    """Run every job. ``isolate`` (default: on for CPU cases) measures the memory of CPU cases
    in a worker process; cases that an implementation declines are answered here without
    running anything. Then the implementations of each case that ran are timed here together,
    interleaved (``time_interleaved``). Ctrl-C stops the run and returns the results so far
    (fewer than the jobs).
    ``progress(i, n, impl, case, result)`` is called before (result None) and after each job's
    memory phase; the result's times are filled in once its whole case has been timed."""
    results: list[Result] = []
    worker = worker or Worker()
    if isolate is not False:  # memory is measured in the worker: this process only times
        steady_malloc()
    by_case: dict = {}
    for index, (impl, case) in enumerate(jobs):
        by_case.setdefault(case, []).append((index, impl))
    try:
        for case, group in by_case.items():
            rows = []
            for index, impl in group:
                if progress:
                    progress(index, len(jobs), impl, case, None)
                result = _memory_result(impl, case, timing, seed, skip_slow, isolate, worker)
                rows.append((impl, result))
                if progress:
                    progress(index, len(jobs), impl, case, result)
            # Timed here, with the process's normal malloc: the worker's small mmap threshold
            # makes RSS exact but adds page faults no real process pays.
            time_interleaved(rows, case, timing, seed=seed)
            results += [result for _, result in rows]
    except KeyboardInterrupt:
        pass  # the caller sees fewer results than jobs
    finally:
        worker.close()
        _INPUTS_CACHE.clear()
    return results


def _memory_result(
    impl: Impl, case: Case, timing: Timing, seed: int, skip_slow: bool, isolate: Optional[bool], worker: Worker
) -> Result:
    reasons = impl.not_supported_reasons(case, skip_slow=skip_slow)
    on_cpu = torch.device(case.device).type == "cpu"
    if reasons or not (on_cpu if isolate is None else isolate):
        return run_case(impl, case, timing, seed=seed, skip_slow=skip_slow, phases=("memory",))
    answer = worker.run(_job(impl, case, timing, seed, skip_slow))
    if "impl" in answer:
        return Result(**answer)
    result = Result.for_case(impl.name, case)
    result.status, result.reason = answer["status"], answer["reason"]
    return result
