"""The time model (``explain().predicted_seconds``) per backend, dtype and causal blocking (issue 29).

Each backend's own cost per score is a measured factor over the model's (``backend_factor``);
what a causal mask saves depends on the blocks a backend skips. Rates and factors are injected:
no verdict here depends on this machine's speed.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import subquad
from _devices import fake_tensors
from subquad import _planner


def _brute_block_fraction(Lq, Lk, o, bq, bk):
    visible = torch.arange(Lk).view(1, -1) <= torch.arange(Lq).view(-1, 1) + o
    computed = 0
    for qs, ks in itertools.product(range(0, Lq, bq), range(0, Lk, bk)):
        block = visible[qs : qs + bq, ks : ks + bk]
        computed += block.numel() if bool(block.any()) else 0
    return computed / (Lq * Lk)


@pytest.mark.parametrize("Lq,Lk,o,bq,bk", [
    (2048, 2048, 0, 256, 512), (256, 256, 0, 64, 512), (37, 100, 63, 8, 16), (100, 37, 0, 16, 7),
    (64, 64, -70, 8, 8), (64, 96, 32, 1, 1), (1, 1000, 999, 32, 512), (300, 300, -17, 64, 128),
])
def test_block_fraction_counts_every_block_with_a_visible_score(Lq, Lk, o, bq, bk):
    assert _planner.block_fraction(Lq, Lk, o, (bq, bk)) == pytest.approx(_brute_block_fraction(Lq, Lk, o, bq, bk))
    # One-score blocks are the visible fraction itself.
    assert _planner.block_fraction(Lq, Lk, o, (1, 1)) == pytest.approx(_planner.visible_fraction(Lq, Lk, True, o))


def test_a_causal_call_costs_the_blocks_its_backend_computes(fixed_rates):
    # torch's CPU flash kernel skips keys in blocks of 512: a causal call of 256 keys costs what
    # the plain call costs (measured: 4.6 against 4.5 ms), one of 2048 keys 5/8 of it (0.61).
    def work(L, backend, causal, chunk=None):
        q = torch.empty(4, 8, L, 64)
        plan = subquad.explain(q, q, q, is_causal=causal, backend=backend, chunk_size=chunk)
        return plan.predicted_seconds - plan.tiles * _planner._TILE_OVERHEAD_S["cpu"]

    assert work(256, "fused", True) == pytest.approx(work(256, "fused", False))
    assert work(2048, "fused", True) == pytest.approx(work(2048, "fused", False) * 20 / 32)
    # The tiles compute each tile with a visible score whole: 512 x 512 tiles of 2048, 10 of 16.
    assert work(2048, "matmul", True, (512, 512)) == pytest.approx(work(2048, "matmul", False, (512, 512)) * 10 / 16)


def test_each_backend_is_predicted_at_its_own_factor(fixed_rates, monkeypatch):
    factors = {"fused": 2.0, "matmul": 3.0}
    monkeypatch.setattr(_planner, "backend_factor", lambda device, dtype, backend: factors.get(backend, 1.0))
    flops, per_score = fixed_rates["cpu"]
    q = torch.empty(1, 4, 512, 64)
    scores = 4 * 512 * 512
    per = 2 * 128 / flops + per_score

    def work(plan):
        return plan.predicted_seconds - plan.tiles * _planner._TILE_OVERHEAD_S["cpu"]

    for backend, factor in factors.items():
        assert work(subquad.explain(q, q, q, backend=backend)) == pytest.approx(scores * per * factor)
    # A learnable mask sends the fused call's backward to the tiles: the backward at their factor.
    ts = [torch.empty(1, 4, 512, 64, requires_grad=True) for _ in range(3)]
    mask = torch.zeros(1, 4, 512, 512, requires_grad=True)
    plan = subquad.explain(*ts, attn_mask=mask, backend="fused")
    assert (plan.backend, plan.backward_backend) == ("fused", "matmul")
    want = scores * per * (2.0 + _planner.BACKWARD_PER_FORWARD * 3.0)
    assert work(plan) == pytest.approx(want)


def test_the_backend_factor_is_a_ratio_of_two_timings_on_real_tensors(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensor

    monkeypatch.setattr(_planner, "_FACTORS", {})
    made = []

    def timed(fn, sync, *, min_seconds, clock=None):
        fn()  # the backend's own tile runs
        return 6e-3

    monkeypatch.setattr(_planner, "seconds_per_call", timed)
    bh, nq, nk, e = _planner._CPU_PROBE_SHAPE
    model_s = 2e-3
    flops = 4.0 * e * bh * nq * nk / (model_s / 2)  # half the model in the products ...
    per_score = (model_s / 2) / (bh * nq * nk)  # ... half in the softmax work

    def probe(device, dtype):
        made.append(torch.empty(1))
        return flops, per_score

    monkeypatch.setattr(_planner, "_probe", probe)
    cpu = torch.device("cpu")
    with fake_tensors():
        assert _planner.backend_factor(cpu, torch.float32, "matmul") == pytest.approx(3.0)
        assert _planner.backend_factor(cpu, torch.float32, "matmul") == pytest.approx(3.0)  # kept
    assert len(made) == 1 and not isinstance(made[0], FakeTensor)
    assert _planner.backend_factor(cpu, torch.bfloat16, "fused") == pytest.approx(3.0)
    assert len(made) == 2  # one measurement per dtype and backend
    # Other devices and whole-call backends: the model alone (nothing timed).
    assert _planner.backend_factor(torch.device("cuda"), torch.float16, "matmul") == 1.0
    assert _planner.backend_factor(cpu, torch.float32, "sdpa") == 1.0
    assert len(made) == 2
    # A factor far off the model is held within [1/4, 8]: a broken probe cannot make a plan absurd.
    monkeypatch.setattr(_planner, "seconds_per_call", lambda fn, sync, *, min_seconds, clock=None: 1.0)
    assert _planner.backend_factor(cpu, torch.float64, "matmul") == 8.0


def test_the_factor_probe_runs_each_backends_tile():
    # Measured for real (the verdict does not depend on the times): the probe runs the backend's
    # own forward on a tile and gives a finite factor for each dtype.
    saved = dict(_planner._FACTORS)
    try:
        _planner._FACTORS.clear()
        for backend in ("fused", "matmul"):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                f = _planner._measure_factor(torch.device("cpu"), dtype, backend)
                assert 0.25 <= f <= 8.0
    finally:
        _planner._FACTORS.clear()
        _planner._FACTORS.update(saved)
