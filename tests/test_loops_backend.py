"""The C++ loops as a backend of their own (``loops``): named in plans and refusals, chosen before
or after the fused kernel by the dispatch layer, and taking over what the fused kernel gives up
(a backward it does not take, a refused call) where they can. ``matmul``, forced, runs them too
where they take the call (its fastest form); what they refuse it runs in PyTorch."""

from __future__ import annotations

import pytest
import torch

import subquad
import test_native  # the session's build, its skip mark and its call recorder
from conftest import assert_close_to_golden, naive_attention, to64
from subquad import _native

pytestmark = test_native.pytestmark
BF16 = torch.bfloat16


@pytest.fixture
def loop(native_dir, monkeypatch):
    why = "the native kernel was built without AVX512-BF16: no C++ forward loop"
    return test_native.recorded_kernel(native_dir, monkeypatch, "forward_segment_bf16", why)


def _qkv(*shape, dtype=BF16, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad) for _ in range(3)]


def test_loops_is_a_backend_name_and_forced_matmul_runs_them_too(loop):
    assert "loops" in subquad.BACKENDS
    q, k, v = _qkv(1, 2, 300, 64)
    plan = subquad.explain(q, k, v, is_causal=True, backend="loops")
    assert plan.backend == "loops"
    loop.calls.clear()
    same = subquad.attention(q, k, v, is_causal=True, backend="loops")
    out = subquad.attention(q, k, v, is_causal=True, backend="matmul")
    assert loop.names == ["forward_segment_bf16"] * 2, loop.names
    loop.calls.clear()
    subquad.attention(q, k, v, is_causal=True, dropout_p=0.3, backend="matmul")  # refused by the loops
    assert not any(n.startswith("forward_segment") for n in loop.names), loop.names
    golden = naive_attention(*to64(q, k, v), is_causal=True)
    ref = naive_attention(q.float(), k.float(), v.float(), is_causal=True).to(BF16)
    assert_close_to_golden(out, golden, ref, name="matmul")
    assert_close_to_golden(same, golden, ref, name="loops")


def test_a_forced_loops_backend_refuses_in_sentences(monkeypatch):
    q, k, v = _qkv(1, 2, 40, 32)
    monkeypatch.setenv("SUBQUAD_NATIVE", "off")
    with pytest.raises(NotImplementedError, match="loops: SUBQUAD_NATIVE=off"):
        subquad.attention(q, k, v, backend="loops")
    monkeypatch.setenv("SUBQUAD_NATIVE", "auto")
    monkeypatch.setattr(_native, "tile_kernel", lambda: None)
    with pytest.raises(NotImplementedError, match=r"loops: the native kernel is not built here \(`subquad build`"):
        subquad.attention(q, k, v, backend="loops")
    plan = subquad.explain(q, k, v)
    assert plan.backend != "loops" and plan.rejected["loops"][0].startswith("the native kernel is not built")


def test_auto_asks_the_loops_after_the_fused_kernel_for_what_it_refuses(loop):
    # A soft cap: the fused kernel adds only bias tiles, so the loops (measured slower or not)
    # run it before the tiles in PyTorch; dropout: the loops refuse it, matmul runs it.
    q, k, v = _qkv(1, 2, 64, 32)
    cap = subquad.explain(q, k, v, score_mod=lambda s, b, h, i, j: 20 * torch.tanh(s / 20), allow_compile=False)
    assert cap.backend == "loops" and "fused" in cap.rejected, cap
    dropped = subquad.explain(q, k, v, dropout_p=0.5, allow_compile=False)
    assert dropped.backend == "matmul" and dropped.rejected["loops"][0].startswith("dropout"), dropped


def test_a_backward_the_fused_kernel_gives_up_runs_in_the_loops(loop, monkeypatch):
    # The lse's gradient: the fused backward computes D itself, so the tiles take the backward,
    # and the backward loop takes it where it can (subquad._autograd._tiles_fallback).
    q, k, v = _qkv(2, 2, 150, 64, grad=True)
    assert subquad.explain(q, k, v, is_causal=True, backend="fused").backend == "fused"
    out, lse = subquad.attention(q, k, v, is_causal=True, backend="fused", return_lse=True)
    loop.calls.clear()
    (out.float().sum() + lse.sum()).backward()
    assert "backward_segment_bf16" in loop.names, loop.names
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = (q64 @ k64.transpose(-1, -2)) / 8.0
    s = s.masked_fill(torch.ones(150, 150, dtype=torch.bool).triu(1), float("-inf"))
    (torch.softmax(s, -1) @ v64).sum().add(torch.logsumexp(s, -1).sum()).backward()
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    s32 = (q32 @ k32.transpose(-1, -2)) / 8.0
    s32 = s32.masked_fill(torch.ones(150, 150, dtype=torch.bool).triu(1), float("-inf"))
    (torch.softmax(s32, -1) @ v32).sum().add(torch.logsumexp(s32, -1).sum()).backward()
    for name, got, gold, ref in zip("qkv", (q, k, v), (q64, k64, v64), (q32, k32, v32)):
        assert_close_to_golden(got.grad, gold.grad, ref.grad.to(BF16), name=f"d{name}")
