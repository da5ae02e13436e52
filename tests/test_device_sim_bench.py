"""The bench, the time model and the recoveries on simulated CUDA and MPS devices (issue 27, 6 and 8).

No device runs here: fake tensors (:func:`_devices.fake_tensors`), a forced device type
(:func:`_devices.as_device`) and monkeypatched device calls stand in, as tests/_devices.py says.
Each test failed before its fix.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import subquad
from _devices import as_device, fake_tensors
from subquad import _call, _fast, _time_model
from subquad._backends import flex
from subquad._backends.sdpa import Sdpa
from subquad._tiles import is_device_fatal, is_oom

FATAL_CUDA = (
    "CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
    "below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
)


# ------------------------------------------------------------------ 6: the bench on MPS


class _OnMps(TorchFunctionMode):
    """``tensors``, and what is computed from them, live on a pretend MPS device until ``.cpu()``
    copies them to the host (CPU tensors stand in: the sampling indexes them, which fake MPS
    tensors cannot do). ``float64`` lists every float64 tensor made on that device, which a real
    MPS device refuses to make."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        super().__init__()
        self.on_device = {id(t): t for t in tensors}
        self.float64: List[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        on_device = any(id(t) in self.on_device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        if on_device and getattr(func, "__name__", "") == "cpu":
            return args[0].clone()  # a copy to the host, off the device
        out = func(*args, **kwargs)
        if on_device:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.on_device[id(t)] = t
                    if t.dtype == torch.float64:
                        self.float64.append(getattr(func, "__name__", str(func)))
        return out


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
def test_error_sampling_makes_no_float64_on_mps(backward):
    # MPS has no float64: `.double()` before `.cpu()` failed every row of `subquad bench` there.
    from subquad.bench.cases import BenchInputs, Case
    from subquad.bench.measure import sampled_errors

    case = Case(1, 2, 16, 16, 8, dtype="fp32", backward=backward)
    q, k, v, out, d_out, dq = (torch.randn(1, 2, 16, 8) for _ in range(6))
    inputs = BenchInputs(case, q, k, v, d_out if backward else None, scale=8**-0.5)
    with _OnMps(q, k, v, out, d_out, dq) as mps:
        errors = sampled_errors(inputs, out, dq if backward else None)
    assert not mps.float64, f"float64 made on the MPS device by {mps.float64}"
    assert errors[0] > 0 and (errors[1] is not None) == backward


class _FakeMpsAllocator:
    """MPS's caching allocator as ``driver_allocated_memory`` sees it: blocks in use plus cached ones."""

    def __init__(self, cached: int) -> None:
        self.cached = cached
        self.in_use = 0
        self.calls: List[str] = []

    def driver_allocated_memory(self) -> int:
        self.calls.append("read")
        return self.in_use + self.cached

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.cached = 0

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def step(self, nbytes: int) -> None:
        """A step that holds ``nbytes`` at its peak and frees them (into the cache) at its end."""
        reused = min(self.cached, nbytes)
        self.cached -= reused
        self.in_use += nbytes
        self.in_use -= nbytes
        self.cached += nbytes


def test_the_mps_model_peak_is_not_the_cache_of_the_warm_up(monkeypatch):
    from subquad.bench import model_measure

    mps = _FakeMpsAllocator(cached=300 << 20)  # the warm-up of the same size left its blocks cached
    for name in ("driver_allocated_memory", "empty_cache", "synchronize"):
        monkeypatch.setattr(torch.mps, name, getattr(mps, name), raising=False)
    meter = model_measure._meter(torch.device("mps"))
    meter.start()
    mps.step(300 << 20)
    peak = meter.stop()
    assert peak == 300 << 20  # not 0: the step ran in blocks the driver had to hand out again
    assert mps.calls.index("empty_cache") < mps.calls.index("read")
    assert mps.calls[: mps.calls.index("read")].count("synchronize") >= 1  # queued frees done first
    assert "cache emptied" in meter.method and "driver_allocated_memory" in meter.method


def test_synchronize_waits_for_mps_and_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append("mps"), raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("cuda"))
    for device in ("mps", "cuda", "cpu"):
        _time_model.synchronize(torch.device(device))
    assert calls == ["mps", "cuda"]


def test_info_run_times_the_call_between_two_syncs(monkeypatch, capsys, fixed_rates):
    # `subquad info --run` must time the call between two waits for the device (MPS too, as the
    # test above shows synchronize does), or the time printed is the launch's. The device is
    # the CPU here: fake MPS tensors cannot run the self-checks info prints.
    from subquad._cli import main

    events: List[str] = []
    monkeypatch.setattr(_time_model, "synchronize", lambda device: events.append(f"sync {torch.device(device).type}"))
    real = subquad.attention

    def attention(*args, **kwargs):
        events.append("attention")
        return real(*args, **kwargs)

    monkeypatch.setattr(subquad, "attention", attention)
    assert main(["info", "--device", "cpu", "--shape", "1,2,64,16", "--run"]) == 0
    assert events[-3:] == ["sync cpu", "attention", "sync cpu"]
    assert "ran " in capsys.readouterr().out


# ------------------------------------------------------------------ 8a: the time model


def test_rates_are_measured_once_per_device_type_and_dtype(monkeypatch):
    measured = []
    rates = {torch.float32: (1e13, 1e-11), torch.float16: (8e13, 1e-11 / 8)}

    def measure(device: torch.device, dtype: torch.dtype) -> Tuple[float, float]:
        measured.append((device.type, dtype))
        return rates[dtype]

    monkeypatch.setattr(_time_model, "_RATES", {})
    monkeypatch.setattr(_time_model, "_measure_rates", measure)
    monkeypatch.setattr(_time_model, "_CALL_HOST_S", {})  # the device's work alone (the floor: test_devices.py)
    work = {}
    with fake_tensors():
        for dtype in (torch.float32, torch.float16, torch.float32, torch.float16):
            q = torch.empty(1, 8, 1 << 16, 16, dtype=dtype, device="cuda")
            plan = subquad.explain(q, q, q, memory_budget="1MiB")
            assert plan.predicted_seconds is not None
            work[dtype] = plan.predicted_seconds - plan.tiles * _time_model._TILE_OVERHEAD_S["cuda"]
    assert measured == [("cuda", torch.float32), ("cuda", torch.float16)]  # each once, then kept
    assert work[torch.float16] == pytest.approx(work[torch.float32] / 8)  # half precision at its own rates
    # The CPU computes half precision in float32: its float32 rates serve.
    q = torch.empty(1, 8, 1 << 16, 16, dtype=torch.float16)
    subquad.explain(q, q, q, memory_budget="1MiB")
    assert measured[2:] == [("cpu", torch.float32)]


def test_the_probe_times_queued_calls_not_the_launch():
    # A GPU queues calls: one call between two syncs times the sync (20 us here) more than the
    # work (10 us per call). Back-to-back calls between two syncs time the work.
    clock = [0.0]

    def fn() -> None:
        clock[0] += 10e-6

    def sync() -> None:
        clock[0] += 20e-6

    per_call = _time_model.seconds_per_call(fn, sync, min_seconds=2e-3, clock=lambda: clock[0])
    assert per_call == pytest.approx(10e-6, rel=0.02)
    # The CPU keeps one call per run (its calls do not queue; the probe stays cheap).
    assert _time_model.seconds_per_call(fn, lambda: None, min_seconds=0.0, clock=lambda: clock[0]) == pytest.approx(
        10e-6
    )


def test_the_gpu_probe_is_large_and_repeated(monkeypatch):
    asked = []

    def timed(fn, sync, *, min_seconds, clock=None):
        fn()
        asked.append(min_seconds)
        return 1e-3

    monkeypatch.setattr(_time_model, "seconds_per_call", timed)
    monkeypatch.setattr(_time_model, "synchronize", lambda device: None)
    with fake_tensors():
        flops, per_score = _time_model._probe(torch.device("cuda"), torch.float16)
    # At least a GFLOP per call (a launch is microseconds; the old probe's 67 MFLOP took less).
    assert flops * 1e-3 >= 1e9
    assert asked and all(s > 0 for s in asked)
    assert per_score == pytest.approx(1e-3 / (4 * 2048 * 2048))


def test_rates_are_measured_on_real_tensors_under_a_fake_tensor_mode(monkeypatch):
    # explain() under a FakeTensorMode must not keep, for the process, rates timed on ops that
    # do nothing.
    from torch._subclasses.fake_tensor import FakeTensor

    probed = []
    monkeypatch.setattr(_time_model, "_RATES", {})
    monkeypatch.setattr(_time_model, "_probe", lambda device, dtype: probed.append(torch.empty(1)) or (1e11, 1e-9))
    with fake_tensors():
        _time_model._device_rates(torch.device("cpu"), torch.float32)
    assert len(probed) == 1 and not isinstance(probed[0], FakeTensor)


# ------------------------------------------------------------------ 8b: fatal device errors


@pytest.mark.parametrize(
    "message",
    [
        FATAL_CUDA,
        "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported",
        "CUDA error: unspecified launch failure\nCUDA kernel errors might be asynchronously reported",
    ],
    ids=["illegal-access", "device-assert", "launch-failure"],
)
def test_a_fatal_cuda_error_is_raised_not_retried_on_the_tiles(monkeypatch, message):
    as_device(monkeypatch, "cuda")
    monkeypatch.setattr(_fast, "_CACHE", {})
    tiles = []
    real = _call._run_tiles_per_group
    monkeypatch.setattr(_call, "_run_tiles_per_group", lambda *a: tiles.append(1) or real(*a))

    def broken(self, inp, need_lse=False):
        raise RuntimeError(message)

    monkeypatch.setattr(Sdpa, "run_whole", broken)
    q = torch.randn(1, 3, 37, 16)
    assert subquad.explain(q, q, q, dropout_p=0.1).backend == "sdpa"
    with pytest.raises(RuntimeError, match="CUDA error"):
        subquad.attention(q, q, q, dropout_p=0.1)
    assert not tiles


def test_a_kernel_refusal_still_falls_back_to_the_tiles(monkeypatch):
    as_device(monkeypatch, "cuda")
    monkeypatch.setattr(_fast, "_CACHE", {})

    def refused(self, inp, need_lse=False):
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(Sdpa, "run_whole", refused)
    q = torch.randn(1, 3, 37, 16)
    out = subquad.attention(q, q, q, dropout_p=0.0, is_causal=True)
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_is_device_fatal():
    assert is_device_fatal(RuntimeError(FATAL_CUDA))
    assert is_device_fatal(RuntimeError("MPS: command buffer exited with error status"))
    assert not is_device_fatal(RuntimeError("No available kernel. Aborting execution."))
    oom = RuntimeError("CUDA error: out of memory")
    assert is_oom(oom) and not is_device_fatal(oom)  # an OOM is retried with smaller tiles
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None:
        assert is_device_fatal(accelerator_error("an illegal instruction was encountered"))


# ------------------------------------------------------------------ 8c: a missing Triton

needs_flex = pytest.mark.skipif(flex._flex_unavailable_reason() is not None, reason="no FlexAttention in this torch")


def softcap(score, b, h, q_idx, kv_idx):
    return 30 * torch.tanh(score / 30)


def alibi(score, b, h, q_idx, kv_idx):
    return score - 0.5 * (q_idx - kv_idx)


class BackendCompilerFailed(Exception):
    """How dynamo hands over inductor's error: its own type, the cause below it."""


def _no_triton(*args, **kwargs):
    try:
        raise RuntimeError(
            "Cannot find a working triton installation. Either the package is not installed or it is too old. "
            "More information on installing Triton can be found at: https://github.com/triton-lang/triton"
        )
    except RuntimeError as e:
        raise BackendCompilerFailed(f"backend='inductor' raised:\nTritonMissing: {e}") from e


@needs_flex
def test_a_missing_triton_refuses_flex_on_that_device_for_every_later_call(monkeypatch):
    monkeypatch.setattr(flex, "_compiled", lambda static=False: _no_triton)
    monkeypatch.setattr(flex, "_FAILED", {})
    q, k, v = (torch.randn(1, 2, 1024, 16) for _ in range(3))
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="Cannot find a working triton installation"):
        subquad.attention(q, k, v, score_mod=softcap, allow_compile=True)
    # Another signature on the same device is refused before anything compiles, with the reason.
    plan = subquad.explain(q, k, v, score_mod=alibi, is_causal=True, allow_compile=True)
    assert plan.backend != "flex"
    (reason,) = plan.rejected["flex"]
    assert "cannot compile on cpu in this process" in reason and "triton" in reason
    assert "triton" in str(plan)
    # Another device type is not refused for it.
    as_device(monkeypatch, "cuda")
    other = subquad.explain(q, k, v, score_mod=alibi, is_causal=True, allow_compile=True)
    assert not any("on cpu" in r for r in other.rejected.get("flex", []))


@needs_flex
def test_a_compile_error_of_one_signature_stays_with_that_signature(monkeypatch):
    def lowering_failed(*args, **kwargs):
        raise RuntimeError("LoweringException: kernel failed to lower (simulated)")

    monkeypatch.setattr(flex, "_compiled", lambda static=False: lowering_failed)
    monkeypatch.setattr(flex, "_FAILED", {})
    q, k, v = (torch.randn(1, 2, 1024, 16) for _ in range(3))
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="lower"):
        subquad.attention(q, k, v, score_mod=softcap, allow_compile=True)
    assert "cpu" not in flex._FAILED and len(flex._FAILED) == 1


# ------------------------------------------------------------------ 8d: MPS dropout bytes


def test_mps_dropout_counts_its_mask(monkeypatch):
    # On MPS, SDPA with dropout takes its math path: scores, probabilities and the dropout
    # mask, 12 bytes per score in float32 (8 without dropout).
    as_device(monkeypatch, "mps")
    B, H, L = 1, 2, 512
    q = torch.randn(B, H, L, 16)
    peaks = {
        p: subquad.explain(q, q, q, dropout_p=p, backend="sdpa", memory_budget="1GiB").predicted_peak_bytes
        for p in (0.0, 0.1)
    }
    assert peaks[0.1] - peaks[0.0] == 4 * B * H * L * L


# ------------------------------------------------------------------ 8e: bf16 on older macOS


@pytest.mark.parametrize(
    "release,version,skipped",
    [("13.6.1", (13, 6, 1), True), ("9.0", (9, 0), True), ("14.0", (14, 0), False), ("15.2", (15, 2), False)],
)
def test_bf16_on_mps_is_skipped_before_macos_14(monkeypatch, release, version, skipped):
    import platform

    import test_gpu

    monkeypatch.setattr(platform, "mac_ver", lambda: (release, ("", "", ""), "arm64"))
    assert test_gpu.macos_version() == version  # "9.0" < "14.0" is False as text
    assert (test_gpu.unsupported_dtype("mps", torch.bfloat16) is not None) == skipped
    assert test_gpu.unsupported_dtype("mps", torch.float16) is None
    assert test_gpu.unsupported_dtype("cuda", torch.bfloat16) is None
