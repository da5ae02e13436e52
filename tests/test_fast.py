"""The per-call fast path: remembered plans give the same results, errors and plans as the full path."""

from __future__ import annotations

import threading

import pytest
import torch

import subquad
from subquad import MemoryBudgetError, _budget, _fast
from subquad._backends import fused
from subquad.integrations.patch import ORIGINAL_SDPA

CALLS = [
    pytest.param(dict(q=(1, 8, 16, 64), k=(1, 8, 16, 64)), {}, id="tiny"),
    pytest.param(dict(q=(1, 32, 1, 128), k=(1, 8, 512, 128)), dict(enable_gqa=True), id="decode-gqa"),
    pytest.param(dict(q=(8, 32, 1, 64), k=(8, 32, 700, 64)), {}, id="batch-decode"),
    pytest.param(dict(q=(2, 4, 33, 64), k=(2, 4, 77, 64)), dict(attn_mask="bool"), id="cross-bool-mask"),
    pytest.param(dict(q=(2, 4, 33, 64), k=(2, 4, 77, 64)), dict(attn_mask="float"), id="cross-float-mask"),
    pytest.param(dict(q=(4, 30, 16), k=(4, 45, 16)), dict(is_causal=True), id="3d-causal"),
    pytest.param(dict(q=(3, 4, 20, 32), k=(1, 4, 20, 32)), dict(scale=0.3), id="batch-broadcast"),
    pytest.param(dict(q=(1, 8, 64, 64), k=(1, 8, 64, 64)), dict(return_lse=True), id="lse"),
]


def _tensors(shapes, kw, Lk=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    k_shape = list(shapes["k"])
    if Lk is not None:
        k_shape[-2] = Lk
    q = torch.randn(*shapes["q"], generator=g, dtype=dtype)
    k = torch.randn(*k_shape, generator=g, dtype=dtype)
    v = torch.randn(*k_shape, generator=g, dtype=dtype)
    kw = dict(kw)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(q.shape[-2], k.shape[-2], generator=g) > 0.3
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(1, q.shape[-3], q.shape[-2], k.shape[-2], generator=g)
    return q, k, v, kw


@pytest.mark.parametrize("shapes,kw", CALLS)
def test_remembered_plans_give_the_full_paths_results(shapes, kw):
    _fast.clear()
    with torch.no_grad():
        for Lk in (None, 5, 300):  # new lengths reuse the entry (a decode step's key grows)
            q, k, v, kwargs = _tensors(shapes, kw, Lk)
            fast_key = _fast.key(
                q,
                k,
                v,
                kwargs.get("attn_mask"),
                kwargs.get("is_causal", False),
                None,
                None,
                kwargs.get("scale"),
                kwargs.get("enable_gqa", False),
                0.0,
                None,
                None,
                "auto",
                kwargs.get("return_lse", False),
                None,
            )
            assert fast_key is not None
            first = subquad.attention(q, k, v, **kwargs)
            assert fast_key in _fast._CACHE  # remembered
            again = subquad.attention(q, k, v, **kwargs)  # through the fast path
            _fast.clear()
            full = subquad.attention(q, k, v, **kwargs)  # through the full path
            for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (again, full))):
                assert torch.equal(a, b)
            for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (first, full))):
                assert torch.equal(a, b)
            ref = ORIGINAL_SDPA(q, k, v, **{n: x for n, x in kwargs.items() if n != "return_lse"})
            out = again[0] if isinstance(again, tuple) else again
            assert (out - ref).abs().max().item() < 1e-5


def test_calls_that_need_the_full_path_take_it():
    q, k, v, _ = _tensors(dict(q=(1, 2, 8, 16), k=(1, 2, 8, 16)), {})
    for kwargs in (
        dict(dropout_p=0.1),
        dict(chunk_size=4),
        dict(mask_mod=lambda b, h, i, j: i >= j),
        dict(score_mod=lambda s, b, h, i, j: s),
        dict(scale=torch.tensor(0.3)),
    ):
        assert (
            _fast.key(
                q,
                k,
                v,
                None,
                False,
                kwargs.get("score_mod"),
                kwargs.get("mask_mod"),
                kwargs.get("scale"),
                False,
                kwargs.get("dropout_p", 0.0),
                None,
                kwargs.get("chunk_size"),
                "auto",
                False,
                None,
            )
            is None
        )
    with torch.enable_grad():
        assert (
            _fast.key(
                q.requires_grad_(), k, v, None, False, None, None, None, False, 0.0, None, None, "auto", False, None
            )
            is None
        )


def test_errors_are_the_full_paths_on_a_remembered_key():
    _fast.clear()
    q, k, v, _ = _tensors(dict(q=(1, 2, 8, 16), k=(1, 2, 8, 16)), {})
    with torch.no_grad():
        subquad.attention(q, k, v)
        with pytest.raises(ValueError, match=r"key.shape\[-2\] == value.shape\[-2\] \(Lk\)"):
            subquad.attention(q, k, v[:, :, :5])
        with pytest.raises(ValueError, match="does not broadcast"):
            subquad.attention(q, k, v, attn_mask=torch.ones(8, 7, dtype=torch.bool))


def test_a_remembered_plan_is_not_reused_when_it_no_longer_fits(monkeypatch):
    _fast.clear()
    q, k, v, _ = _tensors(dict(q=(1, 4, 64, 64), k=(1, 4, 64, 64)), {})
    with torch.no_grad():
        subquad.attention(q, k, v)  # remembered under half of the free memory
        monkeypatch.setattr(_budget, "free_memory_bytes", lambda device: 1 << 16)
        with pytest.raises(MemoryBudgetError):
            subquad.attention(q, k, v)
    monkeypatch.undo()
    # An explicit budget: bf16 keys are packed per call, so a long enough key no longer fits whole.
    shapes = dict(q=(1, 4, 64, 64), k=(1, 4, 64, 64))
    with torch.no_grad():
        subquad.attention(*_tensors(shapes, {}, dtype=torch.bfloat16)[:3], memory_budget="8MiB")
        q, k, v, _ = _tensors(shapes, {}, Lk=65536, dtype=torch.bfloat16)
        plan = subquad.explain(q, k, v, memory_budget="8MiB")
        assert plan.chunk_size[1] < 65536  # no longer one whole call: the full path plans tiles
        out = subquad.attention(q, k, v, memory_budget="8MiB")
    assert (out.float() - ORIGINAL_SDPA(q.float(), k.float(), v.float())).abs().max().item() < 2e-2


def test_explain_reports_the_plan_that_runs():
    _fast.clear()
    q, k, v, _ = _tensors(dict(q=(1, 32, 1, 128), k=(1, 8, 512, 128)), dict(enable_gqa=True))
    with torch.no_grad():
        subquad.attention(q, k, v, enable_gqa=True)
        entry = next(iter(_fast._CACHE.values()))
        plan = subquad.explain(q, k, v, enable_gqa=True)
    assert (plan.backend, plan.chunk_size) == (entry.backend, (1, 512)) == ("fused", (1, 512))  # the whole input


def test_the_cache_is_bounded_and_shared_by_threads():
    _fast.clear()
    results, errors = {}, []

    def worker(i):
        try:
            q, k, v, _ = _tensors(dict(q=(1, 2, 4 + i % 3, 8 + i), k=(1, 2, 9, 8 + i)), {})
            with torch.no_grad():
                for _ in range(20):
                    out = subquad.attention(q, k, v)
            results[i] = (out - ORIGINAL_SDPA(q, k, v)).abs().max().item()
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and max(results.values()) < 1e-5
    old = _fast.CACHE_SIZE
    try:
        _fast.CACHE_SIZE = 4
        with torch.no_grad():
            for E in range(1, 10):
                subquad.attention(*(torch.randn(1, 1, 3, E) for _ in range(3)))
        assert len(_fast._CACHE) <= 4
    finally:
        _fast.CACHE_SIZE = old


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("return_lse", [False, True])
def test_grouped_query_decode_steps_run_as_grouped_matmuls(monkeypatch, dtype, return_lse):
    # 32 query heads on 8 key heads, one query row: two grouped matmuls (the fused kernel takes
    # each query head alone and ran 1.5x slower). Full path and fast path run the same code.
    calls = []
    grouped = fused.grouped_attention
    monkeypatch.setattr(_fast, "grouped_attention", lambda *a: calls.append("fast") or grouped(*a))
    monkeypatch.setattr("subquad._call.grouped_attention", lambda *a: calls.append("full") or grouped(*a))
    _fast.clear()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 32, 1, 59, generator=g, dtype=dtype)
    k, v = (torch.randn(2, 8, 300, 59, generator=g, dtype=dtype) for _ in range(2))
    first = subquad.attention(q, k, v, enable_gqa=True, return_lse=return_lse)
    again = subquad.attention(q, k, v, enable_gqa=True, return_lse=return_lse)
    assert calls == ["full", "fast"]
    for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (first, again))):
        assert torch.equal(a, b)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    s = (q64.view(2, 8, 4, 59) @ k64.transpose(-1, -2)) / 59**0.5
    golden = (torch.softmax(s, -1) @ v64).view(2, 32, 1, 59)
    out = first[0] if return_lse else first
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert (out.double() - golden).abs().max() < tol
    if return_lse:
        assert (first[1].double() - torch.logsumexp(s, -1).view(2, 32, 1)).abs().max() < tol * 10
    assert "two grouped matmuls" in str(subquad.explain(q, k, v, enable_gqa=True))


def test_grouped_matmuls_stay_within_a_small_budget():
    # 2^17 scores: the grouped path needs 1 MiB; under a 512 KiB budget the call takes the tiles.
    _fast.clear()
    q = torch.randn(1, 32, 4, 64)
    k = torch.randn(1, 8, 1024, 64)
    out = subquad.attention(q, k, k, enable_gqa=True, memory_budget="512KiB")
    ref = ORIGINAL_SDPA(q, k, k, enable_gqa=True)
    assert (out - ref).abs().max() < 1e-5
    plan = subquad.explain(q, k, k, enable_gqa=True, memory_budget="512KiB")
    assert plan.chunk_size != (4, 1024) and plan.predicted_peak_bytes <= 512 * 1024
