"""Shared references and the tolerance policy (STYLE.md: golden float64, same-dtype naive, code under test)."""

from __future__ import annotations

import math
import os
from typing import Optional

# Compiling FlexAttention costs seconds per new callback: the suite runs the tiles by default, and
# the tests of the compiled path (tests/test_flex.py) opt in with allow_compile=True.
os.environ.setdefault("SUBQUAD_COMPILE", "0")
# The suite runs the eager tile passes whatever `subquad build` left in this machine's cache;
# tests/test_native.py builds the native kernel in a temporary folder and tests it there.
os.environ["SUBQUAD_NATIVE"] = "off"
# Whether the C++ loops run before the fused kernel is measured on the machine (the calibration,
# subquad/_backends/calibration.py): the suite decides by the fallback thresholds, whatever this
# CPU's speed; tests/test_calibration.py injects the timings it checks.
os.environ.setdefault("SUBQUAD_CALIBRATE", "0")
# `subquad bench` fixes glibc's allocator thresholds in the process that times (bench/meters.py):
# the suite's process keeps glibc's defaults, which its RSS measurements assume.
os.environ.setdefault("SUBQUAD_BENCH_STEADY_MALLOC", "0")
# The suite runs more threads than cores (`-n auto` workers beside the processes the memory,
# distributed and bench tests start): OpenMP threads that wait for a descheduled sibling sleep
# instead of spinning, which cut the memory grid's CPU time by a third. Set before torch loads
# OpenMP; the processes the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from torch import Tensor

import _machine
import subquad


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (the README's command): one worker per core this process may use, at most 4.

    Each worker holds torch, JAX and the hosts' modules (about 1 GiB), and the memory tests start
    their own processes, so a many-core machine gains little from more.
    """
    return max(1, min(_cores(), 4))


# Workers share the cores: each runs torch on its share, not on all of them at once (which
# oversubscribes the cores and spins). Processes the tests start keep torch's own default.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, _cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    # JAX's CPU client likewise (read when JAX first computes, after this).
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_multi_thread_eigen=false".strip()
# XLA compiles every eager op and jitted call of the JAX tests; with its backend (LLVM) at
# optimization level 0 that takes a quarter less CPU time, for machine code that runs slower and
# rounds the same operations (no fast-math at any level). CI runs the JAX tests again at the
# default level, without this file (.ci/jax-without-torch: --noconftest).
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

# Before any test can measure a rate: SUBQUAD_TEST_RATE_FACTOR and SUBQUAD_TEST_RECORD (_machine.py).
_machine.install()


def naive_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    score_mod=None,
    mask_mod=None,
    return_lse: bool = False,
):
    """Materialized attention in the inputs' dtype, SDPA semantics (fully masked rows -> 0)."""
    E = q.shape[-1]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    Hq, Hk = q.shape[-3], k.shape[-3]
    if Hq != Hk:
        k = k.repeat_interleave(Hq // Hk, dim=-3)
        v = v.repeat_interleave(Hq // Hk, dim=-3)
    s = (q @ k.transpose(-2, -1)) * scale
    Lq, Lk = s.shape[-2], s.shape[-1]
    if score_mod is not None or mask_mod is not None:
        lead = s.shape[:-3]
        B = 1
        for d in lead:
            B *= d
        s4 = s.reshape(B, Hq, Lq, Lk)
        b = torch.arange(B, device=s.device).view(-1, 1, 1, 1)
        h = torch.arange(Hq, device=s.device).view(1, -1, 1, 1)
        qi = torch.arange(Lq, device=s.device).view(1, 1, -1, 1)
        ki = torch.arange(Lk, device=s.device).view(1, 1, 1, -1)
        if score_mod is not None:
            s4 = score_mod(s4, b, h, qi, ki).expand(B, Hq, Lq, Lk)
        if mask_mod is not None:
            s4 = s4.masked_fill(~mask_mod(b, h, qi, ki).expand(B, Hq, Lq, Lk), float("-inf"))
        s = s4.reshape(*lead, Hq, Lq, Lk)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.to(s.dtype)
    if is_causal:
        keep = torch.ones(Lq, Lk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype != torch.float64 else s, dim=-1)
    p = torch.softmax(s.float() if s.dtype in (torch.float16, torch.bfloat16) else s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0).to(v.dtype)
    out = p @ v
    return (out, lse) if return_lse else out


def float32_scores_reference(q: Tensor, k: Tensor, v: Tensor, **kw):
    """What torch's SDPA gives half inputs: float32 scores and softmax, the output rounded once."""
    return naive_attention(q.float(), k.float(), v.float(), **kw).to(q.dtype)


def to64(*ts):
    return [None if t is None else (t.detach().double() if t.is_floating_point() else t) for t in ts]


def assert_close_to_golden(
    test: Tensor,
    golden: Tensor,
    reference: Optional[Tensor] = None,
    *,
    fudge: float = 3.0,
    floor: Optional[float] = None,
    name: str = "output",
) -> None:
    """err(test) <= fudge * err(reference) + floor, errors measured against the float64 golden.

    Without a reference (float64 runs) the test must match the golden to ``floor`` (default 1e-12
    relative to the golden's scale).
    """
    assert test.shape == golden.shape, f"{name}: shape {tuple(test.shape)} != golden {tuple(golden.shape)}"
    t = test.double()
    g = golden.double()
    both_inf = torch.isinf(t) & torch.isinf(g) & (torch.sign(t) == torch.sign(g))
    t = torch.where(both_inf, torch.zeros_like(t), t)
    g = torch.where(both_inf, torch.zeros_like(g), g)
    assert not torch.isnan(t).any(), f"{name}: NaN at {torch.isnan(t).nonzero()[:5].tolist()}"
    scale = max(g.abs().max().item(), 1.0) if g.numel() else 1.0
    err = (t - g).abs()
    if reference is None:
        tol = (floor if floor is not None else 1e-12) * scale
    else:
        r = reference.double()
        r = torch.where(both_inf, torch.zeros_like(r), r)
        ref_err = (r - g).abs().max().item() if g.numel() else 0.0
        default_floor = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}.get(test.dtype, 1e-12)
        tol = fudge * ref_err + (floor if floor is not None else default_floor) * scale
    if err.numel() and err.max().item() > tol:
        idx = tuple(int(i) for i in (err == err.max()).nonzero()[0])
        raise AssertionError(
            f"{name}: max error {err.max().item():.3e} at {idx} exceeds {tol:.3e} "
            f"(test {t[idx].item():.6g}, golden {g[idx].item():.6g})"
        )


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def fixed_rates(monkeypatch):
    """A fixed rate table in place of the rates subquad measures on this machine (for tests of
    predicted times, whose verdicts must not depend on how fast or busy the machine is)."""
    return _machine.inject_rates(monkeypatch)


def spy_sdpa_calls(monkeypatch) -> list:
    """Record the keyword arguments of every ``subquad.sdpa`` call from now on, each call going
    through (the integrations call it by module attribute); returns the list they are appended to."""
    calls = []
    real = subquad.sdpa

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(subquad, "sdpa", spy)
    return calls


def pytest_runtest_setup(item):
    _machine.sweep()


@pytest.fixture(scope="session")
def native_dir(tmp_path_factory):
    """The native kernel (``subquad build``) built once for the session in a temporary folder,
    shared by the xdist workers (a lock: one compiles, the others find it built)."""
    import fcntl  # POSIX: the tests that build are skipped on Windows

    from subquad import _native

    shared = tmp_path_factory.getbasetemp().parent / "subquad-native"
    shared.mkdir(exist_ok=True)
    with open(shared / ".lock", "w") as lock, pytest.MonkeyPatch.context() as mp:
        fcntl.flock(lock, fcntl.LOCK_EX)
        mp.setenv("SUBQUAD_NATIVE_DIR", str(shared))
        try:
            _native.build()
        except Exception as e:  # no compiler, no ninja, a compile error: these tests cannot run here
            pytest.skip(f"the native kernel does not build here ({type(e).__name__}: {str(e)[:300]})")
    return shared


def run_memory_probe(cases, **env):
    """Run ``cases`` in a fresh ``_memory_probe.py`` process (glibc returning freed memory to the
    OS, ``env`` added) and return its results: each call's RSS high-water mark and its plan."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", **env)
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, os.path.join(here, "_memory_probe.py"), json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,  # an hour: only a hang gets near it
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    return results


def memory_bound_failures(r) -> list:
    """What one probe result breaks: the measured peak within the budget (plus the output), and the
    prediction honest (at least 0.8x the measured extra memory)."""
    extra = r["measured"] - r["output"]
    label = f"{r['case']} -> {r['backend']} {r['chunk']}"
    failures = []
    if r["measured"] > r["budget"] + r["output"]:
        failures.append(f"{label}: measured {r['measured']} > budget {r['budget']} + output {r['output']}")
    if r["predicted"] < 0.8 * extra:
        failures.append(f"{label}: predicted {r['predicted']} < 0.8 x measured extra {extra}")
    return failures
