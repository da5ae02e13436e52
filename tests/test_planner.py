"""The memory budget, the planner's choices, explain(), and the out-of-memory retry."""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import subquad
from conftest import assert_close_to_golden, memory_bound_failures, naive_attention, run_memory_probe
from subquad import MemoryBudgetError, _budget
from subquad._backends import MPS_MAX_MATMUL_ELEMENTS, Matmul, Options
from subquad._budget import DEFAULT_BUDGET_FRACTION, free_memory_bytes, parse_budget
from subquad._inputs import Inputs
from subquad._planner import make_plan
from subquad._validate import make_inputs

MiB = 1 << 20


@pytest.mark.parametrize(
    "text,expected",
    [
        (1024, 1024),
        ("512MiB", 512 * MiB),
        ("2GB", 2 * 10**9),
        ("1.5GiB", int(1.5 * 2**30)),
        ("64 mib", 64 * MiB),
        ("100", 100),
        ("3KiB", 3072),
        (0, 0),
    ],
)
def test_parse_budget(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("bad", [-1, "-5MiB", "lots", "12 parsecs", True, [1], "MiB"])
def test_bad_budget_names_the_argument(bad):
    q = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match="memory_budget"):
        subquad.attention(q, q, q, memory_budget=bad)


def test_default_budget_is_a_fraction_of_free_memory(monkeypatch):
    # Free memory read here, and read again by the call a moment later, can differ by any amount
    # on a machine that other processes use: the call gets a known reading instead.
    assert free_memory_bytes(torch.device("cpu")) > 0
    monkeypatch.setattr(_budget, "_cpu_available_bytes", lambda: 6 << 30)
    monkeypatch.setattr(_budget, "_CPU_FREE_CACHE", [])
    q = torch.randn(1, 2, 64, 16)
    plan = subquad.explain(q, q, q)
    assert plan.budget_bytes == int(DEFAULT_BUDGET_FRACTION * (6 << 30))


def test_explain_reports_choice_and_reasons():
    q, k, v = torch.randn(1, 4, 512, 32), torch.randn(1, 4, 512, 32), torch.randn(1, 4, 512, 16)
    plan = subquad.explain(q, k, v, memory_budget="4MiB")
    assert plan.backend == "matmul"  # Ev != E rules out the fused kernels on CPU
    assert plan.chunk_size is not None and plan.chunk_size[0] < 512
    assert plan.budget_bytes == 4 * MiB
    assert 0 < plan.predicted_peak_bytes <= plan.budget_bytes
    assert any("Ev == E" in r for r in plan.rejected["fused"])
    text = str(plan)
    assert "backend:   matmul" in text and "not fused:" in text and "4.0 MiB budget" in text


def test_tiles_shrink_with_the_budget_and_are_deterministic():
    q = torch.randn(1, 4, 2048, 64)
    chunks = []
    for budget in ["64MiB", "16MiB", "4MiB", "1MiB"]:
        a = subquad.explain(q, q, q, memory_budget=budget, backend="matmul")
        b = subquad.explain(q, q, q, memory_budget=budget, backend="matmul")
        assert a.chunk_size == b.chunk_size
        assert a.predicted_peak_bytes <= a.budget_bytes
        chunks.append(a.chunk_size[0] * a.chunk_size[1])
    assert chunks == sorted(chunks, reverse=True) and chunks[0] > chunks[-1]


def test_matmul_tiles_are_squarish_and_cache_sized():
    # Measured (issue 29): 256x512 tiles of 1x8x4096x64 ran 15-20% faster than 128x4096 ones in
    # float32 and bfloat16; the elementwise passes run from the caches below ~4 MiB of scores.
    q = torch.randn(1, 4, 4096, 64)
    plan = subquad.explain(q, q, q, memory_budget="32MiB", backend="matmul")
    qc, kc = plan.chunk_size
    assert 4 * qc * kc * 4 <= Matmul.target_tile_bytes
    assert (qc, kc) == (512, 512)


def test_whole_key_rows_when_the_keys_are_short():
    q, k = torch.randn(1, 4, 8192, 64), torch.randn(1, 4, 256, 64)
    plan = subquad.explain(q, k, k, memory_budget="32MiB", backend="matmul")
    assert plan.chunk_size[1] == 256 and plan.chunk_size[0] < 8192
    assert "whole key rows" in str(plan)


def test_budget_too_small_says_what_would_work():
    q = torch.randn(1, 2, 256, 32)
    with pytest.raises(subquad.MemoryBudgetError, match=r"pass memory_budget of at least (\d+) bytes") as info:
        subquad.attention(q, q, q, memory_budget=1000)
    assert isinstance(info.value, MemoryError)
    need = int(re.search(r"at least (\d+) bytes", str(info.value)).group(1))
    out = subquad.attention(q, q, q, memory_budget=need)
    assert_close_to_golden(out, F.scaled_dot_product_attention(q, q, q), floor=1e-5)


def test_out_of_memory_retry_halves_tiles_and_stays_exact(monkeypatch):
    from subquad._backends import Matmul

    q, k, v = (torch.randn(1, 2, 100, 16, dtype=torch.float64) for _ in range(3))
    calls = {"n": 0}
    original = Matmul.forward_rows

    def flaky(self, inp, qs, qe, segments, out, seed):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")
        return original(self, inp, qs, qe, segments, out, seed)

    monkeypatch.setattr(Matmul, "forward_rows", flaky)
    with pytest.warns(RuntimeWarning, match=r"out of memory with tiles .* retrying with \(50, 100\)"):
        out = subquad.attention(q, k, v, backend="matmul")
    assert calls["n"] == 1 + 2  # one failure, then two blocks of 50 rows
    assert_close_to_golden(out, naive_attention(q, k, v))


def test_other_errors_are_not_retried(monkeypatch):
    from subquad._backends import Matmul

    def broken(*a, **kw):
        raise RuntimeError("something else")

    monkeypatch.setattr(Matmul, "forward_rows", broken)
    q = torch.randn(1, 1, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="something else"):
            subquad.attention(q, q, q, backend="matmul")


def test_mps_guard_keeps_every_matmul_below_2_31():
    meta = [torch.empty(2, 32, 65536, 64, device="meta") for _ in range(3)]
    inp = make_inputs(*meta)

    class OnMPS(Inputs):
        @property
        def device_type(self):
            return "mps"

    mps_inp = OnMPS(**{f.name: getattr(inp, f.name) for f in dataclasses.fields(inp)})
    options = Matmul().tile_options(mps_inp)
    assert options and all(2 * 32 * qc * kc < MPS_MAX_MATMUL_ELEMENTS for qc, kc in options)
    plan = make_plan(mps_inp, Options(), 1 << 40, "matmul")  # a huge budget still gets small tiles
    assert 2 * 32 * plan.chunk_size[0] * plan.chunk_size[1] < MPS_MAX_MATMUL_ELEMENTS
    with pytest.raises(ValueError, match=r"chunk_size=\(65536, 65536\) .* on MPS every matmul must stay below"):
        make_plan(mps_inp, Options(chunk_size=(65536, 65536)), 1 << 40, "matmul")


def test_large_input_under_a_small_budget_equals_sdpa():
    # The 1 GiB score matrix is 64 times the budget.
    q, k, v = (torch.randn(1, 4, 8192, 64) for _ in range(3))
    plan = subquad.explain(q, k, v, memory_budget="16MiB")
    assert plan.predicted_peak_bytes <= 16 * MiB
    out = subquad.attention(q, k, v, memory_budget="16MiB")
    ref = F.scaled_dot_product_attention(q, k, v)
    assert (out - ref).abs().max().item() < 1e-5


GRID = [
    dict(shape=[1, 4, 2048, 2048, 64], budget=b, mask=m, backend=be)
    for b in ["4MiB", "16MiB", "64MiB"]
    for m in [None, "bool", "float", "causal"]
    for be in ["auto", "matmul"]
] + [
    dict(shape=[2, 2, 1000, 3000, 64], budget="16MiB", dtype="bfloat16"),
    dict(shape=[2, 2, 1000, 3000, 64], budget="16MiB", dtype="bfloat16", backend="matmul"),
    # Issue 29: float16 through the fused kernel (on float32 copies where the CPU emulates
    # float16 GEMMs), forward with a float mask and forward + backward.
    dict(shape=[2, 2, 1000, 3000, 64], budget="16MiB", dtype="float16", mask="float"),
    dict(shape=[1, 4, 2048, 2048, 64], budget="16MiB", dtype="float16", grad=True),
    dict(shape=[1, 4, 2048, 2048, 64], budget="64MiB", dtype="float16", grad=True, mask="causal"),
    dict(shape=[1, 4, 2048, 2048, 64], budget="16MiB", dtype="float16", grad=True, mask="float"),
    dict(shape=[1, 4, 2048, 2048, 64], budget="16MiB", grad=True),
    dict(shape=[1, 4, 2048, 2048, 64], budget="16MiB", grad=True, backend="matmul"),
    dict(shape=[1, 4, 2048, 2048, 64], budget="16MiB", grad=True, mask="causal"),
    dict(shape=[1, 4, 2048, 2048, 64], budget="16MiB", grad=True, mask="float"),
    # Issue 10: the causal fused backward (key segments are not coalesced there) ...
    dict(shape=[1, 4, 2048, 2048, 64], budget="4MiB", grad=True, mask="causal"),
    # ... a 5-D call whose mask varies along the first batch dim only (no copy per batch entry) ...
    dict(shape=[2, 2, 2048, 2048, 64], batch=[2, 4], budget="16MiB", mask="bool-batch"),
    # ... a score_mod that is a bound method of a module with a large unused layer ...
    dict(shape=[1, 4, 1024, 1024, 64], budget="16MiB", grad=True, score_mod="module-method"),
    # ... 65,536 one-row tiles under 1 MiB (bookkeeping that does not grow with the tiles) ...
    dict(shape=[1, 1, 65536, 16, 8], budget="1MiB", chunk=[1, 16]),
    # ... and forced tiles, which run only when they fit the budget (else MemoryBudgetError).
    dict(shape=[1, 4, 2048, 2048, 64], budget="8MiB", chunk=[256, 512], backend="matmul"),
    dict(shape=[1, 4, 2048, 2048, 64], budget="8MiB", chunk=[512, 512], mask="bool"),
    # Issue 11: user-written callbacks (a traced additive bias on the fused kernel, a general
    # score_mod on the matmul tiles, their backward) and the compiled FlexAttention path.
    dict(shape=[1, 4, 2048, 2048, 64], budget="4MiB", callbacks="user-alibi-causal"),
    dict(shape=[1, 4, 2048, 2048, 64], budget="16MiB", callbacks="user-alibi-causal", grad=True),
    dict(shape=[1, 4, 2048, 2048, 64], budget="16MiB", callbacks="user-softcap-causal"),
    dict(shape=[1, 4, 2048, 2048, 64], budget="16MiB", callbacks="user-softcap-causal", allow_compile=True),
    dict(shape=[1, 4, 2048, 2048, 64], budget="4MiB", callbacks="user-alibi-causal", allow_compile=True),
    # Issue 18: the causal GQA backward on one thread plans 2048 x 2048 fused tiles; each key
    # segment's gradients must be freed before the next segment's kernel runs.
    dict(shape=[1, 8, 4096, 4096, 64], kv_heads=2, budget="16MiB", grad=True, mask="causal", threads=1),
    dict(shape=[1, 8, 4096, 4096, 64], kv_heads=2, budget="16MiB", grad=True, mask="causal"),
    # Issue 20: 64 sequences of 1024 tokens packed, forward and backward (the lse of all 65,536
    # rows is kept for the backward; each sequence runs within the budget).
    dict(shape=[1, 8, 1024, 1024, 64], packed=[64, 1024], budget="16MiB", grad=True),
    dict(shape=[1, 8, 1024, 1024, 64], packed=[64, 1024], budget="16MiB", grad=True, mask="causal"),
]


SHARDS = 4


@pytest.mark.parametrize("shard", range(SHARDS))
def test_measured_peak_within_budget_and_prediction_honest(shard):
    # A fresh probe process per shard of the grid reads its own RSS high-water mark, so the bounds
    # are those of one process alone; the shards are separate tests so that `-n auto` spreads them.
    results = run_memory_probe(GRID[shard::SHARDS])
    failures = []
    for r in results:
        label = f"{r['case']} -> {r['backend']} {r['chunk']}"
        failures += memory_bound_failures(r)
        if r["case"].get("allow_compile") and r["backend"] != "flex":
            failures.append(f"{label}: expected the compiled path")
        if r["case"].get("score_mod") == "module-method" and r["grads_set"] != [True, False, False]:
            failures.append(
                f"{label}: gradients set on {r['grads_set']}; only the table the score_mod reads may get one"
            )
    assert not failures, "\n".join(failures)


def test_fused_kernel_refusal_falls_back_to_matmul(monkeypatch):
    from subquad._backends import fused

    def refusing(*args, **kwargs):
        raise RuntimeError("scaled_dot_product_attention_flash_attention: some new restriction")

    assert fused.cpu_flash_unavailable_reason() is None  # probed (and cached) before the kernel changes
    monkeypatch.setattr(fused, "_cpu_flash_ops", lambda: (refusing, refusing))
    q, k, v = (torch.randn(1, 2, 30, 8, dtype=torch.float64) for _ in range(3))
    assert subquad.explain(q, k, v).backend == "fused"
    with pytest.warns(RuntimeWarning, match="fused CPU kernel refused this input .* subquad's tiles instead"):
        out = subquad.attention(q, k, v, is_causal=True)
    assert_close_to_golden(out, naive_attention(q, k, v, is_causal=True))
    with pytest.raises(RuntimeError, match="some new restriction"):  # a forced backend is not replaced
        subquad.attention(q, k, v, backend="fused")


def test_forced_chunk_size_must_fit_the_budget():
    q, k, v = (torch.randn(1, 4, 4096, 64) for _ in range(3))
    with pytest.raises(MemoryBudgetError, match=r"chunk_size=\(4096, 4096\) does not fit memory_budget=300.0 KiB"):
        subquad.attention(q, k, v, chunk_size=4096, memory_budget="300KiB", backend="matmul")
    with pytest.raises(MemoryBudgetError, match="chunk_size"):
        subquad.explain(q, k, v, chunk_size=(4096, 512), memory_budget="300KiB")
    # Tiles that fit run as forced; a budget large enough lets any tiles run.
    plan = subquad.explain(q, k, v, chunk_size=(64, 256), memory_budget="4MiB", backend="matmul")
    assert plan.chunk_size == (64, 256) and plan.predicted_peak_bytes <= 4 * MiB
    assert subquad.explain(q, k, v, chunk_size=4096, memory_budget="4GiB", backend="matmul").chunk_size == (4096, 4096)


def test_row_blocks_are_produced_lazily():
    from subquad._engine import _row_blocks

    blocks = _row_blocks(1 << 40, 1)  # a list of these would not fit in memory
    assert next(blocks) == (0, 1) and next(blocks) == (1, 2)
