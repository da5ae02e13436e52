"""A packed call's inference through the native forward loop (``forward_packed_f32`` and
``forward_packed_bf16`` in ``_native_tiles.cpp``; :func:`subquad._backends.segments.forward_packed`):
each sequence one loop in C++, groups of consecutive sequences one kernel call, nothing gathered or
padded.

Checked against a loop of float64 attentions, one per sequence, with the suite's tolerance policy:
lengths 0, 1, non-divisible and longer than a block of keys, query and key lengths that differ,
GQA, head dim 59, causal alignment top-left and bottom-right, ``seqused_k``, the lse (-inf where a
row sees nothing); which calls take it (``auto``'s plain packed calls, their backward a fused-kernel call per
sequence) and which do not (callbacks, windows, dropout, a forced fused backend); groups within a small budget, sequences too
large for it on their own tiles; and the kernel's argument errors. Skipped where the kernel cannot
be built or was built without the loops.
"""

from __future__ import annotations

import math

import pytest
import torch

import subquad
import test_native
from conftest import assert_close_to_golden
from test_native_loop import assert_refused
from test_varlen import packed, reference

pytestmark = test_native.pytestmark  # a C++ compiler and ninja

LOOPS = {
    torch.float32: "forward_packed_f32",
    torch.float16: "forward_packed_f32",
    torch.bfloat16: "forward_packed_bf16",
}
DTYPES = list(LOOPS)


@pytest.fixture
def kernel(native_dir, monkeypatch):
    """The native kernel, its calls recorded, on a CPU where ``auto`` takes its loops (AVX512-BF16,
    no AMX: tests/_machine.py; the other CPUs' choices: tests/test_cpus.py)."""
    return test_native.recorded_kernel(native_dir, monkeypatch, "forward_packed_f32", "a build without the loops")


def _needs(kernel, dtype):
    if not hasattr(kernel.real, LOOPS[dtype]):
        pytest.skip(f"the native kernel was built without {LOOPS[dtype]} on this CPU")


def _inputs(lengths_q, lengths_k, dtype, Hq=4, Hk=2, E=59, seed=0):
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, Hq=Hq, Hk=Hk, E=E, dtype=torch.float32, seed=seed)
    return (q * 2).to(dtype), (k * 2).to(dtype), v.to(dtype), cu_q, cu_k


def _assert_matches(out, lse, q, k, v, cu_q, cu_k, **kw):
    """``out`` and ``lse`` against the float64 loop (the float32 loop rounded to the dtype as
    the tolerance's reference)."""
    golden, golden_lse = reference(*(t.double() for t in (q, k, v)), cu_q, cu_k, **kw)
    ref32, _ = reference(*(t.float() for t in (q, k, v)), cu_q, cu_k, **kw)
    assert out.dtype == q.dtype and out.shape == (q.shape[0], q.shape[1], v.shape[-1])
    assert_close_to_golden(out, golden, ref32.to(q.dtype))
    seen = torch.isfinite(golden_lse)
    assert torch.equal(torch.isfinite(lse), seen), "rows that see no key: lse -inf"
    assert bool((out[~seen] == 0).all())
    err = (lse.double() - golden_lse)[seen].abs().max().item()
    assert err < 4e-6 * max(1.0, golden_lse[seen].abs().max().item()), err


LENGTHS_Q = [0, 1, 5, 33, 64, 130, 600, 7, 2]
LENGTHS_K = [3, 1, 5, 40, 64, 100, 600, 0, 9]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "is_causal,alignment", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")], ids=["full", "tl", "br"]
)
def test_packed_inference_matches_float64(kernel, dtype, is_causal, alignment):
    _needs(kernel, dtype)
    q, k, v, cu_q, cu_k = _inputs(LENGTHS_Q, LENGTHS_K, dtype)
    kw = dict(is_causal=is_causal, alignment=alignment)
    plan = subquad.varlen_explain(q, k, v, cu_q, cu_k, enable_gqa=True, **kw)
    assert plan.backend == "loops" and any("packed call's sequences" in n for n in plan.notes), plan
    before = len(kernel.calls)  # explain() may have probed the machine's rates with the kernel
    out, lse = subquad.varlen_attention(q, k, v, cu_q, cu_k, enable_gqa=True, return_lse=True, **kw)
    # Groups of consecutive sequences (within the planned memory), every row once, none per sequence.
    calls = kernel.calls[before:]
    assert {name for name, _ in calls} == {LOOPS[dtype]} and len(calls) < 4, calls
    assert sum(shape[2] for _, shape in calls) == q.shape[0], calls
    _assert_matches(out, lse, q, k, v, cu_q, cu_k, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_seqused_k_and_a_scale(kernel, dtype):
    _needs(kernel, dtype)
    q, k, v, cu_q, cu_k = _inputs([4, 70, 3, 1], [10, 80, 10, 10], dtype, Hq=2, Hk=2, E=64)
    used = torch.tensor([10, 33, 0, 6], dtype=torch.int32)
    out, lse = subquad.varlen_attention(
        q, k, v, cu_q, cu_k, seqused_k=used, is_causal=True, alignment="bottom_right", scale=0.3, return_lse=True
    )
    assert LOOPS[dtype] in kernel.names
    keep = torch.cat([torch.arange(int(a), int(a) + int(n)) for a, n in zip(cu_k[:-1], used)])
    cu_used = torch.tensor([0, *used.cumsum(0).tolist()], dtype=torch.int32)
    _assert_matches(out, lse, q, k[keep], v[keep], cu_q, cu_used, is_causal=True, alignment="bottom_right", scale=0.3)


def test_groups_stay_within_a_small_budget(kernel):
    # 2 heads of 64: each row holds about 2 KiB, so a 1 MiB budget takes several groups; the 4000
    # rows of the longest sequence do not fit one on their own and take the planned tiles.
    lengths = [40] * 100 + [4000] + [7] * 50
    q, k, v, cu_q, cu_k = _inputs(lengths, lengths, torch.float32, Hq=2, Hk=2, E=64)
    subquad.varlen_explain(q, k, v, cu_q, cu_k, memory_budget="1MiB")  # any probe of the rates first
    before = len(kernel.calls)
    out, lse = subquad.varlen_attention(q, k, v, cu_q, cu_k, memory_budget="1MiB", return_lse=True)
    calls = kernel.calls[before:]
    groups = [shape for name, shape in calls if name == "forward_packed_f32"]
    assert len(groups) > 2 and all(rows < 4000 for _, _, rows, _ in groups), groups
    assert any(name == "forward_segment_f32" and shape[2] < 4000 for name, shape in calls), calls  # its own tiles
    _assert_matches(out, lse, q, k, v, cu_q, cu_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_training_runs_the_packed_forward_and_a_fused_backward(kernel, dtype):
    # auto in training: the forward through forward_packed, the backward a fused-kernel call per
    # sequence (as before) from the loop's output and lse; gradients as a float64 loop's.
    _needs(kernel, dtype)
    q, k, v, cu_q, cu_k = _inputs([0, 5, 33, 64, 7], [3, 5, 40, 64, 0], dtype, Hq=4, Hk=2, E=32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    plan = subquad.varlen_explain(*leaves, cu_q, cu_k, is_causal=True, enable_gqa=True)
    assert (plan.backend, plan.backward_backend) == ("loops", "fused"), plan
    before = len(kernel.calls)
    out = subquad.varlen_attention(*leaves, cu_q, cu_k, is_causal=True, enable_gqa=True)
    assert set(kernel.names[before:]) == {LOOPS[dtype]}, kernel.calls[before:]
    _assert_gradients(out, leaves, q, k, v, cu_q, cu_k, dtype)


def _assert_gradients(out, leaves, q, k, v, cu_q, cu_k, dtype):
    """Gradients of ``out`` (causal) against a loop of float64 attentions (the float32 loop's,
    rounded, as the tolerance's reference)."""
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = torch.autograd.grad(out, leaves, g)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference(*ref_in, cu_q, cu_k, is_causal=True)
    want = torch.autograd.grad(ref, ref_in, g.double())
    ref32_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref32, _ = reference(*ref32_in, cu_q, cu_k, is_causal=True)
    want32 = torch.autograd.grad(ref32, ref32_in, g.float())
    for name, a, b, c in zip("qkv", got, want, want32):
        assert_close_to_golden(a, b, c.to(dtype), name=f"d{name}")


def test_callbacks_windows_and_a_forced_fused_backend_keep_their_paths(kernel):
    _needs(kernel, torch.float32)
    q, k, v, cu_q, cu_k = _inputs([5, 30, 64], [5, 30, 64], torch.float32, Hq=2, Hk=2, E=32)
    subquad.varlen_explain(q, k, v, cu_q, cu_k)  # any probe of the rates first
    before = len(kernel.calls)
    subquad.varlen_attention(q, k, v, cu_q, cu_k, backend="fused")
    subquad.varlen_attention(q, k, v, cu_q, cu_k, score_mod=lambda s, b, h, i, j: s * 0.5)
    subquad.varlen_attention(q, k, v, cu_q, cu_k, window=(4, 0))
    subquad.varlen_attention(q, k, v, cu_q, cu_k, dropout_p=0.1)
    assert "forward_packed_f32" not in kernel.names[before:], kernel.names[before:]


def test_the_kernel_refuses_bad_spans(kernel):
    q = torch.randn(1, 2, 10, 16)
    state = lambda: (torch.full((20,), -math.inf), torch.zeros(20), torch.zeros(20, 16))  # noqa: E731
    spans = torch.tensor([[0, 4, 0, 4], [4, 10, 4, 10]])
    offsets = torch.zeros(2, dtype=torch.int64)
    run = kernel.real.forward_packed_f32
    run(q, q, q, spans, offsets, *state(), 0.25, False, 0.0)  # the good call
    assert_refused(
        run,
        {
            "rows past q": (q, q, q, torch.tensor([[0, 11, 0, 4]]), offsets[:1], *state(), 0.25, False, 0.0),
            "keys ending before they start": (
                q,
                q,
                q,
                torch.tensor([[0, 4, 5, 4]]),
                offsets[:1],
                *state(),
                0.25,
                False,
                0.0,
            ),
            "int32 spans": (q, q, q, spans.int(), offsets, *state(), 0.25, False, 0.0),
            "spans and offsets disagree": (q, q, q, spans, offsets[:1], *state(), 0.25, False, 0.0),
            "a state of the wrong size": (
                q,
                q,
                q,
                spans,
                offsets,
                torch.zeros(19),
                torch.zeros(20),
                torch.zeros(20, 16),
                0.25,
                False,
                0.0,
            ),
            "a batch of two": (q.expand(2, -1, -1, -1), q, q, spans, offsets, *state(), 0.25, False, 0.0),
        },
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_forced_loops_backend_trains_on_the_packed_forward(kernel, dtype):
    # backend="loops" in training: the forward through forward_packed, the backward per sequence
    # from its lse; gradients as a loop of float64 attentions'.
    _needs(kernel, dtype)
    q, k, v, cu_q, cu_k = _inputs([0, 5, 33, 64, 7], [3, 5, 40, 64, 0], dtype, Hq=4, Hk=2, E=32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    before = len(kernel.calls)
    out = subquad.varlen_attention(*leaves, cu_q, cu_k, is_causal=True, enable_gqa=True, backend="loops")
    assert LOOPS[dtype] in kernel.names[before:]
    _assert_gradients(out, leaves, q, k, v, cu_q, cu_k, dtype)
