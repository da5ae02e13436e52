"""Faults: user exceptions propagate unchanged, kernel refusals and interrupts leave nothing
half-done, long calls say how long they will take and show progress."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F

import subquad
from conftest import assert_close_to_golden, naive_attention
from subquad import _call, _engine, _planner, _time_model
from subquad._backends import FusedCPU, fused
from subquad.integrations.patch import ORIGINAL_SDPA

f64 = torch.float64


class CallbackError(RuntimeError):
    pass


def _qkv(L=24):
    return tuple(torch.randn(1, 2, L, 8, dtype=f64) for _ in range(3))


CALLBACK_CASES = [
    pytest.param("mask_mod", "auto", id="mask_mod-auto"),
    pytest.param("mask_mod", "fused", id="mask_mod-fused"),
    pytest.param("mask_mod", "matmul", id="mask_mod-matmul"),
    pytest.param("score_mod", "auto", id="score_mod-auto"),
    pytest.param("score_mod", "matmul", id="score_mod-matmul"),
]


@pytest.mark.parametrize("where,backend", CALLBACK_CASES)
@pytest.mark.parametrize("message", ["a one-off failure", "CUDA out of memory (simulated by the callback)"])
def test_callback_errors_propagate_unchanged_and_are_not_retried(where, backend, message):
    q, k, v = _qkv()
    calls = []
    raised = CallbackError(message)
    # Each callback is traced once (fake tensors); the score_mod is then called once by the probe
    # that finds its captured tensors; then per tile.
    fail_at = 2 if where == "mask_mod" else 3

    def mask_mod(b, h, i, j):  # not a formula of comparisons: evaluated on every tile
        calls.append(1)
        if len(calls) == fail_at:
            raise raised
        return (i >= j) | ((i + j) % 3 == 0)

    def score_mod(s, b, h, i, j):
        calls.append(1)
        if len(calls) == fail_at:
            raise raised
        return s * 0.5

    kw = {"mask_mod": mask_mod} if where == "mask_mod" else {"score_mod": score_mod}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither a fallback nor an out-of-memory retry may happen
        with pytest.raises(CallbackError) as info:
            subquad.attention(q, k, v, backend=backend, chunk_size=(8, 8), **kw)
    assert info.value is raised
    assert len(calls) == fail_at  # the callback was not run again


def test_kernel_refusal_is_still_handled(monkeypatch):
    def refusing(*args, **kwargs):
        raise RuntimeError("the fused kernel: some new restriction")

    assert fused.cpu_flash_unavailable_reason() is None
    fwd, _bwd = fused._cpu_flash_ops()
    monkeypatch.setattr(fused, "_cpu_flash_ops", lambda: (fwd, refusing))
    q, k, v = (t.requires_grad_() for t in _qkv())
    out = subquad.attention(q, k, v, is_causal=True, chunk_size=8)
    with pytest.warns(RuntimeWarning, match="fused CPU backward kernel refused this input"):
        out.sum().backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    naive_attention(q2, k2, v2, is_causal=True).sum().backward()
    for a, b in zip((q, k, v), (q2, k2, v2)):
        assert_close_to_golden(a.grad, b.grad)


def test_an_interrupt_leaves_nothing_half_done(monkeypatch):
    q, k, v = _qkv(64)
    real = FusedCPU.forward_rows
    count = []

    def interrupted(self, *args, **kwargs):
        count.append(1)
        if len(count) == 3:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FusedCPU, "forward_rows", interrupted)
    with subquad.patch_sdpa(chunk_size=(8, 8)), pytest.raises(KeyboardInterrupt):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    monkeypatch.setattr(FusedCPU, "forward_rows", real)
    out = subquad.attention(q, k, v, is_causal=True, chunk_size=(8, 8))  # the next call is whole
    assert_close_to_golden(out, naive_attention(q, k, v, is_causal=True))


def test_explain_predicts_the_time_of_a_huge_call(fixed_rates):
    # The estimate is the work at the rates subquad measured on this machine: injected here, so
    # the verdict is the same on a fast, a slow or a busy machine.
    q = torch.empty(1, 8, 1 << 20, 16)  # explain reads no data; the pages are never touched
    plan = subquad.explain(q, q, q, memory_budget="1MiB")
    # How many tiles depends on the thread count (the fused kernels' scratch is per thread).
    assert plan.tiles >= _planner.ESTIMATE_TIME_FROM_TILES
    flops, per_score = fixed_rates["cpu"]
    scores = 8 * (1 << 20) ** 2
    work = 2 * scores * (16 + 16) / flops + scores * per_score  # 4.0 hours at the fixed rates
    assert plan.predicted_seconds is not None
    assert work < plan.predicted_seconds < work + plan.tiles * 1e-3  # plus a per-tile overhead
    assert "time:" in str(plan) and "4.0 hours" in str(plan)
    small = subquad.explain(*_qkv())
    assert small.predicted_seconds is not None and small.predicted_seconds < 1


def test_the_predicted_time_follows_the_measured_rates(monkeypatch):
    q = torch.empty(1, 8, 1 << 16, 16)
    monkeypatch.setattr(_time_model, "backend_seconds", lambda device, dtype, backend: None)  # the model alone
    times = []
    for flops, per_score in [(1e11, 1e-9), (1e12, 1e-10)]:
        monkeypatch.setitem(_time_model._RATES, ("cpu", torch.float32), (flops, per_score))
        times.append(subquad.explain(q, q, q, memory_budget="1MiB").predicted_seconds)
    tiles = subquad.explain(q, q, q, memory_budget="1MiB").tiles
    # Ten times the rates: a tenth of the work, the same per-tile overhead.
    assert times[1] < times[0] / 5
    assert times[0] - times[1] == pytest.approx(
        0.9 * (times[0] - tiles * _time_model._TILE_OVERHEAD_S["cpu"]), rel=1e-6
    )


def test_the_predicted_time_counts_the_score_mod(fixed_rates):
    # A hand-written score_mod can cost more than the attention around it (a tanh soft-cap: about
    # 3 ns per score on the 2-core CPU, 7x the softmax work): once per score forward, twice with
    # a backward. Its cost per score is injected here (FIXED_SCORE_MOD_S).
    from _machine import FIXED_SCORE_MOD_S

    def softcap(s, b, h, q_idx, kv_idx):
        return 30 * torch.tanh(s / 30)

    scores = 2 * 4 * 256 * 512
    for grad, passes in ((False, 1), (True, _time_model.CALLBACK_PASSES_WITH_GRAD)):
        q = torch.empty(2, 4, 256, 16, requires_grad=grad)
        k = torch.empty(2, 4, 512, 16, requires_grad=grad)
        plain = subquad.explain(q, k, k, backend="matmul", chunk_size=(64, 64))
        with_mod = subquad.explain(q, k, k, backend="matmul", chunk_size=(64, 64), score_mod=softcap)
        assert plain.tiles == with_mod.tiles and plain.predicted_seconds is not None
        assert with_mod.predicted_seconds is not None
        extra = with_mod.predicted_seconds - plain.predicted_seconds
        assert extra == pytest.approx(scores * FIXED_SCORE_MOD_S * passes, rel=1e-9)


def test_the_score_mod_is_timed_once_per_callback(monkeypatch):
    timed = []
    monkeypatch.setattr(_time_model, "seconds_per_call", lambda fn, *a, **kw: timed.append(fn()) or 1e-3)
    q = torch.randn(1, 2, 300, 8)

    def shifted(s, b, h, q_idx, kv_idx):
        return s + 0.5 * (kv_idx - q_idx)

    first = _time_model.score_mod_seconds(_call.prepare(q, q, q, score_mod=shifted).inp)
    again = _time_model.score_mod_seconds(_call.prepare(q[:, :, :200], q, q, score_mod=shifted).inp)
    # One probe tile of 2 heads x 128 rows x 256 keys (at most 64k scores), its own index grids.
    assert first == again == pytest.approx(1e-3 / (2 * 128 * 256)) and len(timed) == 1
    assert timed[0].shape == (1, 2, 128, 256)

    def broken(s, b, h, q_idx, kv_idx):
        raise RuntimeError("a bug in the callback")

    # (the call itself says so, before any estimate: here the probe alone meets it)
    inp = dataclasses.replace(_call.prepare(q, q, q, score_mod=shifted).inp, score_mod=broken)
    assert _time_model.score_mod_seconds(inp) == 0.0
    assert _time_model.score_mod_seconds(_call.prepare(q, q, q).inp) == 0.0


def test_long_calls_warn_and_log_progress(monkeypatch, caplog):
    from subquad import _call, _planner

    monkeypatch.setattr(_planner, "ESTIMATE_TIME_FROM_TILES", 1)
    monkeypatch.setattr(_call, "WARN_LONGER_THAN_S", 0.0)
    monkeypatch.setattr(_engine, "LONG_CALL_SECONDS", 0.0)
    monkeypatch.setattr(_engine.Progress.__init__, "__defaults__", (0.0,))  # log at every block
    q, k, v = _qkv(64)
    with caplog.at_level(logging.INFO, logger="subquad"), pytest.warns(RuntimeWarning, match="predicted to take about"):
        subquad.attention(q, k, v, chunk_size=(8, 8), backend="matmul")
    lines = [r.getMessage() for r in caplog.records if r.name == "subquad"]
    assert any("forward: 7/8 row blocks" in line for line in lines), lines
