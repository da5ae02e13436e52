"""The time model (``explain().predicted_seconds``) per backend, dtype and causal blocking (issue 29).

On CPU each backend's own forward time per score is timed on one tile (``backend_seconds``) and
scaled by the model to the call's head dim; what a causal mask saves depends on the blocks a
backend skips. Rates and times are injected: no verdict here depends on this machine's speed.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import subquad
from _devices import fake_tensors
from subquad import _time_model
from subquad._backends import fused
from subquad._validate import make_inputs


def _brute_block_fraction(Lq, Lk, o, bq, bk):
    visible = torch.arange(Lk).view(1, -1) <= torch.arange(Lq).view(-1, 1) + o
    computed = 0
    for qs, ks in itertools.product(range(0, Lq, bq), range(0, Lk, bk)):
        block = visible[qs : qs + bq, ks : ks + bk]
        computed += block.numel() if bool(block.any()) else 0
    return computed / (Lq * Lk)


@pytest.mark.parametrize(
    "Lq,Lk,o,bq,bk",
    [
        (2048, 2048, 0, 256, 512),
        (256, 256, 0, 64, 512),
        (37, 100, 63, 8, 16),
        (100, 37, 0, 16, 7),
        (64, 64, -70, 8, 8),
        (64, 96, 32, 1, 1),
        (1, 1000, 999, 32, 512),
        (300, 300, -17, 64, 128),
    ],
)
def test_block_fraction_counts_every_block_with_a_visible_score(Lq, Lk, o, bq, bk):
    assert _time_model.block_fraction(Lq, Lk, o, (bq, bk)) == pytest.approx(_brute_block_fraction(Lq, Lk, o, bq, bk))
    # One-score blocks are the visible fraction itself.
    assert _time_model.block_fraction(Lq, Lk, o, (1, 1)) == pytest.approx(_time_model.visible_fraction(Lq, Lk, True, o))


def test_a_causal_call_costs_the_blocks_its_backend_computes(fixed_rates):
    # torch's CPU flash kernel skips keys in blocks of 512: a causal call of 256 keys costs what
    # the plain call costs (measured: 4.6 against 4.5 ms), one of 2048 keys 5/8 of it (0.61).
    def work(L, backend, causal, chunk=None):
        q = torch.empty(4, 8, L, 64)
        plan = subquad.explain(q, q, q, is_causal=causal, backend=backend, chunk_size=chunk)
        return plan.predicted_seconds - plan.tiles * _time_model._TILE_OVERHEAD_S["cpu"]

    assert work(256, "fused", True) == pytest.approx(work(256, "fused", False))
    assert work(2048, "fused", True) == pytest.approx(work(2048, "fused", False) * 20 / 32)
    # The tiles compute each tile with a visible score whole: 512 x 512 tiles of 2048, 10 of 16.
    assert work(2048, "matmul", True, (512, 512)) == pytest.approx(work(2048, "matmul", False, (512, 512)) * 10 / 16)


def test_each_backend_is_predicted_at_its_own_time(fixed_rates, monkeypatch):
    flops, per_score = fixed_rates["cpu"]
    e = _time_model._CPU_PROBE_SHAPE[3]
    at_probe = 4 * e / flops + per_score  # the model's time per score at the probes' head dim
    factors = {"fused": 2.0, "matmul": 3.0}
    per_row = {"fused": 1e-6, "matmul": 3e-6}
    monkeypatch.setattr(
        _time_model,
        "backend_seconds",
        lambda device, dtype, backend: (factors[backend] * at_probe, per_row[backend]) if backend in factors else None,
    )

    def work(plan):
        return plan.predicted_seconds - plan.tiles * _time_model._TILE_OVERHEAD_S["cpu"]

    for E in (64, 16, 256):  # the probes' head dim, and others: the model scales the timed scores
        q = torch.empty(1, 4, 512, E)
        scores, rows = 4 * 512 * 512, 4 * 512
        per = 2 * 2 * E / flops + per_score
        for backend, factor in factors.items():
            want = scores * per * factor + rows * per_row[backend]
            assert work(subquad.explain(q, q, q, backend=backend)) == pytest.approx(want)
    # A learnable mask sends the fused call's backward to the tiles: the backward at their time.
    ts = [torch.empty(1, 4, 512, e, requires_grad=True) for _ in range(3)]
    mask = torch.zeros(1, 4, 512, 512, requires_grad=True)
    plan = subquad.explain(*ts, attn_mask=mask, backend="fused")
    assert (plan.backend, plan.backward_backend) == ("fused", "matmul")
    fused = 4 * 512 * 512 * at_probe * 2.0 + 4 * 512 * 1e-6
    tiles = 4 * 512 * 512 * at_probe * 3.0 + 4 * 512 * 3e-6
    assert work(plan) == pytest.approx(fused + _time_model.BACKWARD_PER_FORWARD * tiles)


@pytest.mark.parametrize("dtype,factor", [(torch.float32, 2.5), (torch.float16, 2.5), (torch.bfloat16, 2.0)])
@pytest.mark.parametrize("backend", ["fused", "matmul"])
def test_a_backward_is_predicted_at_its_dtypes_share_of_the_forward(fixed_rates, monkeypatch, backend, dtype, factor):
    # On a CPU a bfloat16 backward took 1.9-2.0x its forward (fused kernel and tiles), the other
    # dtypes' 2.3-2.8x: fwd+bwd = (1 + factor) x the forward, whatever the forward costs.
    monkeypatch.setattr(_time_model, "backend_seconds", lambda device, dt, b: (1e-9, 1e-6) if b == backend else None)
    q = torch.empty(1, 4, 512, 64, dtype=dtype)
    qg = q.clone().requires_grad_()
    fwd, both = (
        subquad.explain(t, t, t, backend=backend, chunk_size=(128, 256) if backend == "matmul" else None)
        for t in (q, qg)
    )
    assert both.backward_backend == backend
    overhead = _time_model._TILE_OVERHEAD_S["cpu"]
    fwd_work = fwd.predicted_seconds - fwd.tiles * overhead
    assert both.predicted_seconds - both.tiles * overhead == pytest.approx((1 + factor) * fwd_work)


@pytest.mark.parametrize("backend", ["matmul", "fused"])
def test_a_backends_own_time_is_timed_once_on_real_tensors(monkeypatch, backend):
    from torch._subclasses.fake_tensor import FakeTensor

    monkeypatch.setattr(_time_model, "_OWN", {})
    # The measurement itself, not SUBQUAD_TEST_RATE_FACTOR's scaled wrapper of it (tests/_machine.py).
    monkeypatch.setattr(
        _time_model,
        "_measure_backend",
        getattr(_time_model._measure_backend, "__wrapped__", _time_model._measure_backend),
    )
    bh, nq, nk, _ = _time_model._FUSED_PROBE_SHAPE if backend == "fused" else _time_model._CPU_PROBE_SHAPE
    lk = nk * _time_model._PROBE_ROW_TILES
    a, b = 2e-9, 5e-7  # seconds per score and per query row
    runs = [a * bh * nq * nk + b * bh * nq, a * bh * nq * lk + b * bh * nq]  # the short row block, the long
    made = []

    def timed(fn, sync, *, min_seconds, clock=None):
        made.append(torch.empty(1))
        fn()  # the backend's own row block runs
        return runs[(len(made) - 1) % 2]

    monkeypatch.setattr(_time_model, "seconds_per_call", timed)
    cpu = torch.device("cpu")
    with fake_tensors():
        assert _time_model.backend_seconds(cpu, torch.float32, backend) == pytest.approx((a, b))
        assert _time_model.backend_seconds(cpu, torch.float32, backend) == pytest.approx((a, b))  # kept
    assert len(made) == 2 and not any(isinstance(t, FakeTensor) for t in made)
    assert _time_model.backend_seconds(cpu, torch.bfloat16, backend) == pytest.approx((a, b))
    assert len(made) == 4  # measured once per dtype and backend
    # Other devices and whole-call backends: the model alone (nothing timed).
    assert _time_model.backend_seconds(torch.device("cuda"), torch.float16, backend) is None
    assert _time_model.backend_seconds(cpu, torch.float32, "sdpa") is None
    assert len(made) == 4
    # Two noisy timings whose difference would make the scores free: held at half the average.
    runs[0] = runs[1]
    per_score, per_row = _time_model.backend_seconds(cpu, torch.float16, backend)
    assert per_score == pytest.approx(runs[1] / (bh * nq * lk) / 2) and per_row > 0

    # A backend whose tile cannot run here: the model alone, not an error in explain().
    def failing(fn, sync, *, min_seconds, clock=None):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(_time_model, "seconds_per_call", failing)
    assert _time_model.backend_seconds(cpu, torch.float64, backend) is None


def test_the_probe_runs_each_backends_own_row_blocks(monkeypatch):
    # For real (the verdict does not depend on the times): the probe runs every backend's
    # forward in every dtype (backend_seconds would turn an error into "not timed" silently).
    monkeypatch.setattr(_time_model, "_BACKEND_PROBE_S", 0.0)
    for backend in ("fused", "matmul"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            per_score, per_row = _time_model._measure_backend(torch.device("cpu"), dtype, backend)
            assert 0 < per_score < 1e-6 and per_row >= 0, (per_score, per_row)  # a microsecond per score: absurd


def _kernel_scores(rows, keys, causal):
    """The scores of one head torch's CPU flash kernel computes: its loops, transcribed (rows in
    blocks of 32/64/256 by the call's length; each block runs keys in blocks of 512 up to its
    last visible key, top-left causal)."""
    split = 256 if rows >= 768 else 64 if rows >= 192 else 32
    n = 0
    for m in range(0, rows, split):
        block = min(split, rows - m)
        num_keys = min(m + block, keys) if causal else keys
        for start in range(0, num_keys, 512):
            n += block * min(512, keys - start)
    return n


@pytest.mark.parametrize(
    "rows,keys",
    [
        (1, 1),
        (100, 100),
        (256, 256),
        (512, 512),
        (640, 640),
        (768, 768),
        (1000, 1000),
        (2048, 2048),
        (128, 384),
        (300, 1100),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_work_counts_the_kernels_own_blocks(rows, keys, causal):
    split = fused._row_split(rows)
    assert fused.kernel_work(rows, keys, causal) == pytest.approx(
        fused._SPLIT_WEIGHT[split] * _kernel_scores(rows, keys, causal)
    )


def _tiles(L, threads, monkeypatch, heads=8, **kw):
    monkeypatch.setattr(fused, "_threads", lambda: threads)
    q = torch.empty(1, heads, L, 64, requires_grad=True)
    plan = subquad.explain(q, q, q, is_causal=True, backend="fused", **kw)
    whole = lambda t: None if t is None or t[0] >= L else t[0]  # noqa: E731
    return whole(plan.chunk_size), whole(plan.backward_chunk_size)


@pytest.mark.parametrize(
    "L,threads,expected",
    [
        # 384-767 rows run in the kernel's 64-row blocks over one block of 512 keys: all computed;
        # tiles of 256 skip the tiles above the diagonal.
        (512, 1, (256, 256)),
        (512, 2, (256, 256)),
        (512, 4, (256, 256)),
        (384, 2, (256, 256)),
        (640, 1, (256, 256)),
        (640, 2, (256, None)),
        # The saving no longer pays for the calls: fewer rows, more threads (each call costs more
        # of them), or a kernel that skips 256 x 512 blocks itself (from 768 rows: never weighed).
        (256, 1, (None, None)),
        (384, 4, (None, None)),
        (512, 16, (None, None)),
        (768, 1, (None, None)),
        (2048, 1, (None, None)),
        (4096, 2, (None, None)),
    ],
)
def test_causal_fused_tiles_are_the_cheapest_by_the_kernels_blocks(L, threads, expected, monkeypatch, fixed_rates):
    # The choice is arithmetic on the kernel's blocks and a per-call cost: nothing timed.
    assert _tiles(L, threads, monkeypatch) == expected


def test_the_cost_weighs_only_tiles_that_fit_and_only_plain_square_causal_calls(monkeypatch, fixed_rates):
    monkeypatch.setattr(fused, "_threads", lambda: 1)
    q = torch.empty(1, 8, 512, 64, requires_grad=True)
    # A budget that leaves tiles of 128 and below: the cheapest of those (the cost's order
    # among them: 128 < 64 < 32).
    small = subquad.explain(q, q, q, is_causal=True, backend="fused", chunk_size=128).predicted_peak_bytes
    plan = subquad.explain(q, q, q, is_causal=True, backend="fused", memory_budget=small)
    assert plan.chunk_size == (128, 128)
    costs = {t: fused.causal_cost(_inputs(q), (t, t), False) for t in (128, 64, 32)}
    assert costs[128] < costs[64] < costs[32]
    # Any other causal call keeps the largest tiles that fit.
    mask = torch.ones(512, 512, dtype=torch.bool).tril()
    k = torch.empty(1, 8, 640, 64)
    assert subquad.explain(q, q, q, attn_mask=mask, backend="fused").chunk_size[0] == 512
    assert subquad.explain(q, k, k, is_causal=True, backend="fused").chunk_size[0] == 512
    assert subquad.explain(q, q, q, is_causal=True, backend="fused", scale=-1.0).chunk_size[0] == 512


def _inputs(q):
    return make_inputs(q, q, q, is_causal=True)


def test_cost_chosen_tiles_give_the_float64_answer_packed_and_dense(monkeypatch):
    monkeypatch.setattr(fused, "_threads", lambda: 1)
    g = torch.Generator().manual_seed(0)
    lens = [512, 300, 512]
    cu = torch.tensor([0, 512, 812, 1324], dtype=torch.int32)
    q, k, v = (torch.randn(1324, 8, 16, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    plan = subquad.varlen_explain(q, k, v, cu, cu, is_causal=True, backend="fused")
    assert plan.chunk_size == (256, 256) and plan.backward_chunk_size == (256, 256)
    out = subquad.varlen_attention(q, k, v, cu, cu, is_causal=True, backend="fused")
    gout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), gout)
    ref = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                a.transpose(0, 1), b.transpose(0, 1), c.transpose(0, 1), is_causal=True
            ).transpose(0, 1)
            for a, b, c in zip(q.split(lens), k.split(lens), v.split(lens))
        ]
    )
    ref_grads = torch.autograd.grad(ref, (q, k, v), gout)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_a_probe_made_while_the_machine_was_busy_is_measured_again(monkeypatch):
    # Before: the rates were measured once per process; a probe that ran while the machine was
    # busy made every later prediction of the process too long.
    from subquad import _probes

    clock = [1000.0]
    monkeypatch.setattr(_probes.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(_time_model, "_RATES", {})
    measured = [(1e10, 4e-9), (1e11, 1e-9), (5e10, 2e-9), (2e11, 5e-10)]  # busy, quiet, busy, too late
    monkeypatch.setattr(_time_model, "_measure_rates", lambda device, dtype: measured.pop(0))
    cpu = torch.device("cpu")
    assert _time_model._device_rates(cpu, torch.float32) == (1e10, 4e-9)
    clock[0] += 1.0
    assert _time_model._device_rates(cpu, torch.float32) == (1e10, 4e-9), "measured again at once"
    clock[0] += _probes.REPROBE_AFTER_S
    assert _time_model._device_rates(cpu, torch.float32) == (1e11, 1e-9), "the quiet probe wins"
    clock[0] += _probes.REPROBE_AFTER_S
    assert _time_model._device_rates(cpu, torch.float32) == (1e11, 1e-9), "a busy probe later does not undo it"
    clock[0] += _probes.REPROBE_AFTER_S
    assert _time_model._device_rates(cpu, torch.float32) == (1e11, 1e-9) and len(measured) == 1, "at most twice again"
    injected = (3e11, 1e-10)
    _time_model._RATES[("cpu", torch.float64)] = injected  # a test's injected rates: never measured
    clock[0] += 10 * _probes.REPROBE_AFTER_S
    assert _time_model._device_rates(cpu, torch.float64) is injected


def test_the_loops_own_callbacks_cost_no_passes_and_a_window_only_its_band(monkeypatch):
    # The C++ loops evaluate ALiBi and windows themselves: no per-tile callback passes, and a
    # window computes only its band's blocks, not the causal triangle.
    from _machine import fake_cpu, inject_rates
    from subquad import mods
    from subquad._validate import make_inputs as _make

    fake_cpu(monkeypatch, "avx512-bf16", kernel="stub")
    inject_rates(monkeypatch)
    monkeypatch.setattr(_time_model, "backend_seconds", lambda device, dtype, backend: None)
    q = torch.randn(1, 4, 2048, 64).bfloat16()

    causal = subquad.explain(q, q, q, backend="loops", is_causal=True)
    alibi = subquad.explain(q, q, q, backend="loops", is_causal=True, score_mod=mods.alibi(4))
    window = subquad.explain(q, q, q, backend="loops", mask_mod=mods.sliding_window(256, causal=True))
    inp_c = _make(q, q, q, is_causal=True)
    inp_w = _make(q, q, q, mask_mod=mods.sliding_window(256, causal=True))
    full = _time_model.computed_scores(inp_c, "loops", causal.chunk_size)
    band = _time_model.computed_scores(inp_w, "loops", window.chunk_size)
    assert band < 0.4 * full, (band, full)  # 16 blocks of 128 rows x 384 keys, against the triangle
    t_causal = _time_model.predict_seconds(inp_c, causal, False)
    t_alibi = _time_model.predict_seconds(_make(q, q, q, is_causal=True, score_mod=mods.alibi(4)), alibi, False)
    assert t_alibi == pytest.approx(t_causal, rel=0.05), (t_alibi, t_causal)


def test_a_narrow_bands_backward_keeps_the_loops_fixed_work(monkeypatch):
    # Issue 56: a causal window's or documents' training call through the loops took 1.8-2.5x its
    # prediction, which scaled the whole backward with the band. Its passes over each row's and
    # key's columns (D, the float32 gradients, the packed rows and keys) do not shrink with it.
    from _machine import fake_cpu, inject_rates
    from subquad import mods
    from subquad._validate import make_inputs as _make

    fake_cpu(monkeypatch, "avx512-bf16", kernel="stub")
    rates = inject_rates(monkeypatch)
    q = torch.randn(1, 4, 2048, 64).bfloat16().requires_grad_()
    kws = {"causal": dict(is_causal=True), "window 8": dict(mask_mod=mods.sliding_window(8, causal=True))}
    plans = {n: subquad.explain(q, q, q, backend="loops", **kw) for n, kw in kws.items()}
    inps = {n: _make(q, q, q, **kw) for n, kw in kws.items()}
    assert all(p.backward_backend == "loops" for p in plans.values())
    fixed = {n: _time_model.loop_backward_fixed_seconds(inp) for n, inp in inps.items()}
    assert fixed["causal"] == fixed["window 8"] > 0  # the same rows and keys, whatever the band
    # Per element, one written element of the probe's softmax passes; per row and key, the passes' columns.
    per_element = rates["cpu"][1] / _time_model._PROBE_WRITES[True]
    columns = (6 + 5 + 1) * 64 + (4 + 5 + 2) * 64
    assert fixed["causal"] == pytest.approx(per_element * 4 * 2048 * columns)

    def train(n):
        return _time_model.predict_seconds(inps[n], plans[n], True)

    def scaled(n):  # the band's share of the scores alone: the forward and backward of its scores and rows
        return train(n) - fixed[n]

    band = _time_model.computed_scores(inps["window 8"], "loops", None)
    full = _time_model.computed_scores(inps["causal"], "loops", None)
    assert band < 0.2 * full
    assert train("window 8") == pytest.approx(scaled("window 8") + fixed["causal"])
    # More than the band's fraction of the causal call: the fixed work weighs far more in a narrow band.
    assert train("window 8") > 1.1 * band / full * train("causal")
    assert fixed["window 8"] / train("window 8") > 4 * fixed["causal"] / train("causal")
    # A backward not in the loops keeps no such term: its forward's share alone.
    w = inps["window 8"]
    fused = subquad.explain(q, q, q, backend="fused", mask_mod=mods.sliding_window(8, causal=True))
    assert fused.backward_backend == "fused"
    backward = _time_model.predict_seconds(w, fused, True) - _time_model.predict_seconds(w, fused, False)
    per_forward = _time_model.backward_per_forward(w, "fused")
    assert backward == pytest.approx(per_forward * _time_model.forward_seconds(w, "fused", fused.backward_chunk_size))
