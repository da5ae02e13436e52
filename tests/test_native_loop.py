"""The forward's and backward's tile loops in C++ (``forward_segment_bf16`` and
``backward_segment_bf16`` in ``_native_tiles.cpp``, ``subquad._backends.segments``): bfloat16 calls
without dropout or callbacks but a soft cap, causal or not, with or without an ``attn_mask``, on a
CPU whose build of the native kernel targets AVX512-BF16.

Checked against the float64 golden (outputs with the suite's tolerance policy; the lse to 1e-4,
which bfloat16 products could not give: their lse is off by about 2e-3; gradients within 3x
PyTorch's bfloat16 SDPA's error) on awkward sizes, masks, an lse gradient, packed sequences, soft
caps (and which callbacks tracing takes for one), which calls they take, memory within budget,
and their argument errors. Skipped where the kernel cannot be built or was built without
AVX512-BF16 (the per-tile kernel, tests/test_native.py, serves those CPUs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import subquad
import test_native  # its build fixture's skip mark, kernel loader and call recorder
from conftest import assert_close_to_golden, memory_bound_failures, naive_attention, run_memory_probe, to64
from subquad import _native, mods

BF16 = torch.bfloat16

pytestmark = test_native.pytestmark  # a C++ compiler and ninja


def assert_refused(fn, bad):
    """Each of ``bad`` (name: arguments) makes ``fn`` raise a RuntimeError."""
    for name, args in bad.items():
        with pytest.raises(RuntimeError):
            fn(*args)
            pytest.fail(name)


def assert_memory_within_budget(cases, native_dir, **env):
    """``cases`` run in fresh processes with the session's kernel (tests/test_planner.py's memory
    probe, RSS high-water mark): every peak within its budget and its prediction honest."""
    results = run_memory_probe(cases, SUBQUAD_NATIVE="auto", SUBQUAD_NATIVE_DIR=str(native_dir), **env)
    failures = [f for r in results for f in memory_bound_failures(r)]
    assert not failures, "\n".join(failures)


@pytest.fixture
def loop(native_dir, monkeypatch):
    """The native kernel with its C++ forward loop, its calls recorded."""
    why = "the native kernel was built without AVX512-BF16: no C++ forward loop"
    return test_native.recorded_kernel(native_dir, monkeypatch, "forward_segment_bf16", why)


def _lse64(q, k, v, is_causal=False, offset=0, enable_gqa=False, bias=None, scale=None):
    q, k = q.double(), k.double()
    if enable_gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if bias is not None:
        s = s.masked_fill(~bias, float("-inf")) if bias.dtype == torch.bool else s + bias
    if is_causal:
        Lq, Lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Lq, Lk, dtype=torch.bool).triu(1 + offset), float("-inf"))
    return torch.logsumexp(s, dim=-1)


CASES = {
    # name: (query shape, key/value shape, keyword arguments, chunk_size)
    "length 1": ((1, 2, 1, 64), (1, 2, 1, 64), {}, None),
    "one query, 1000 keys": ((1, 2, 1, 64), (1, 2, 1000, 64), {}, None),
    "130 x 600 (blocks of 128 rows, 512 keys, both short at the end)": ((1, 3, 130, 64), (1, 3, 600, 64), {}, None),
    "777 x 1000 in segments of 300": ((1, 3, 777, 64), (1, 3, 1000, 64), {}, (256, 300)),
    "head dim 1": ((2, 2, 40, 1), (2, 2, 50, 1), {}, None),
    "head dim 59, causal": ((1, 2, 300, 59), (1, 2, 300, 59), {"is_causal": True}, (64, 64)),
    "head dim 111, causal": ((1, 2, 90, 111), (1, 2, 90, 111), {"is_causal": True}, (32, 32)),
    "head dim 256, GQA": ((1, 4, 64, 256), (1, 2, 70, 256), {"enable_gqa": True}, None),
    "GQA 8/2, causal, 2 batches": ((2, 8, 200, 64), (2, 2, 200, 64), {"enable_gqa": True, "is_causal": True}, None),
    "values of head dim 80 (keys 64)": ((1, 2, 100, 64), (1, 2, 150, 64), {"value_dim": 80}, (64, 64)),
    "values of head dim 1": ((1, 2, 33, 48), (1, 2, 47, 48), {"value_dim": 1}, None),
}


def case_inputs(name, seed):
    """``(q, k, v, kw, chunk, g)`` of ``CASES[name]``: bfloat16 inputs scaled x2, the query
    non-contiguous, and the generator that drew them (for further draws)."""
    shape_q, shape_kv, kw, chunk = CASES[name]
    kw = dict(kw)
    ev = kw.pop("value_dim", shape_kv[-1])
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(*shape_q, generator=g) * 2).to(BF16)
    k = (torch.randn(*shape_kv, generator=g) * 2).to(BF16)
    v = (torch.randn(*shape_kv[:-1], ev, generator=g) * 2).to(BF16)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous query
    return q, k, v, kw, chunk, g


@pytest.mark.parametrize("name", list(CASES))
def test_the_loop_matches_float64(loop, name):
    q, k, v, kw, chunk, _ = case_inputs(name, 11)
    out, lse = subquad.attention(q, k, v, backend="loops", chunk_size=chunk, return_lse=True, **kw)
    assert "forward_segment_bf16" in loop.names and "exp2_rows_bf16" not in loop.names
    golden = naive_attention(*to64(q, k, v), **kw)
    ref32 = naive_attention(q.float(), k.float(), v.float(), **kw)
    assert_close_to_golden(out, golden, ref32.to(BF16))
    err = (lse.double() - _lse64(q, k, v, **kw)).abs().max().item()
    assert err < 1e-4, err


SCALES = (-0.3, 0.0, 1e-45, 0.7)
"""Scales for :func:`assert_scale_matches_float64`: a positive one's products go to the
exponentials unscaled (the scale is their FMA); zero, underflowing and negative ones are scaled first."""


def assert_scale_matches_float64(kernel, dtype, scale, loop_name, lse_tol):
    """A forward through the loop ``loop_name`` with ``scale``, against float64: 600 keys (a
    block of 512 and one of 88, not a multiple of 32), causal or not. The scores span more than
    2^8 in log2 units, so that any offset but the rows' maximum overflows the exponentials."""
    g = torch.Generator().manual_seed(17)
    q = (torch.randn(1, 2, 70, 64, generator=g) * 8).to(dtype)
    k, v = ((torch.randn(1, 2, 600, 64, generator=g) * 8).to(dtype) for _ in range(2))
    for causal in (False, True):
        out, lse = subquad.attention(q, k, v, scale=scale, is_causal=causal, backend="loops", return_lse=True)
        assert loop_name in kernel.names
        kw = dict(scale=scale, is_causal=causal)
        golden = naive_attention(*to64(q, k, v), **kw)
        assert_close_to_golden(out, golden, naive_attention(q.float(), k.float(), v.float(), **kw).to(dtype))
        want = _lse64(q, k, v, is_causal=causal, scale=scale)
        err = (lse.double() - want).abs().max().item()
        assert err < lse_tol * max(1.0, want.abs().max().item()), (scale, causal, err)


@pytest.mark.parametrize("scale", SCALES)
def test_any_scale_matches_float64(loop, scale):
    assert_scale_matches_float64(loop, BF16, scale, "forward_segment_bf16", 1e-4)


def test_bottom_right_causal_rows_that_see_nothing_give_zeros(loop):
    # 50 queries against 30 keys, aligned bottom-right: rows 0-19 see no key.
    g = torch.Generator().manual_seed(12)
    q = torch.randn(1, 2, 50, 64, generator=g).to(BF16)
    k, v = (torch.randn(1, 2, 30, 64, generator=g).to(BF16) for _ in range(2))
    mask = mods.causal_lower_right(50, 30)
    out, lse = subquad.attention(q, k, v, mask_mod=mask, backend="loops", chunk_size=(16, 16), return_lse=True)
    assert "forward_segment_bf16" in loop.names
    assert bool((out[:, :, :20] == 0).all()) and bool(torch.isneginf(lse[:, :, :20]).all())
    keep = torch.arange(30) <= torch.arange(50).view(-1, 1) - 20
    golden = naive_attention(*to64(q, k, v), attn_mask=keep)
    ref32 = naive_attention(q.float(), k.float(), v.float(), attn_mask=keep)
    assert_close_to_golden(out[:, :, 20:], golden[:, :, 20:], ref32[:, :, 20:].to(BF16))
    err = (lse[:, :, 20:].double() - _lse64(q, k, v, True, -20)[:, :, 20:]).abs().max().item()
    assert err < 1e-4, err


def test_keys_shared_by_the_batch_and_transposed_layouts(loop):
    # A key/value of batch 1 broadcast over 3 queries' batches (stride 0), and keys whose head
    # dim is not the last in memory.
    g = torch.Generator().manual_seed(13)
    q = torch.randn(3, 2, 70, 64, generator=g).to(BF16)
    k = torch.randn(1, 2, 64, 90, generator=g).to(BF16).transpose(-1, -2)  # stride(-1) = 90
    v = torch.randn(1, 2, 90, 64, generator=g).to(BF16)
    out = subquad.attention(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1), backend="loops")
    assert "forward_segment_bf16" in loop.names
    golden = naive_attention(*to64(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1)))
    ref32 = naive_attention(q.float(), k.float().expand(3, -1, -1, -1), v.float().expand(3, -1, -1, -1))
    assert_close_to_golden(out, golden, ref32.to(BF16))


def test_the_loop_takes_calls_without_callbacks_or_dropout(loop):
    q = torch.randn(1, 2, 40, 32).to(BF16)
    subquad.attention(q, q, q, score_mod=lambda s, b, h, i, j: s * 0.5, backend="matmul")
    subquad.attention(q, q, q, mask_mod=lambda b, h, i, j: i % 4 == j % 4, backend="matmul")
    subquad.attention(q, q, q, dropout_p=0.3, backend="matmul")
    subquad.attention(q.float(), q.float(), q.float(), backend="matmul")
    assert "forward_segment_bf16" not in loop.names and "exp2_rows_bf16" in loop.names
    loop.calls.clear()
    mask = torch.rand(40, 40, generator=torch.Generator().manual_seed(14)) > 0.3
    subquad.attention(q, q, q, backend="loops")
    subquad.attention(q, q, q, is_causal=True, backend="loops")
    subquad.attention(q, q, q, attn_mask=mask, backend="loops")
    subquad.attention(q, q, q, attn_mask=torch.zeros(40, 40, dtype=BF16), backend="loops")
    assert loop.names == ["forward_segment_bf16"] * 4


MASKS = {
    # name: (query shape, key/value shape, mask of (seed) -> tensor, keyword arguments)
    "bool, one row sees nothing": (
        (2, 2, 70, 64),
        (2, 2, 90, 64),
        lambda g: _hide_row(torch.rand(2, 1, 70, 90, generator=g) > 0.5, 5),
        {},
    ),
    "padding, (B, 1, 1, Lk)": ((2, 4, 100, 64), (2, 4, 600, 64), lambda g: _padding(g, 2, 600), {}),
    "float32 ALiBi-like bias, causal in it": ((1, 4, 200, 64), (1, 4, 200, 64), lambda g: _alibi_causal(200), {}),
    "bfloat16 bias per head": (
        (1, 3, 64, 64),
        (1, 3, 130, 64),
        lambda g: (torch.randn(1, 3, 64, 130, generator=g) * 2).to(BF16),
        {},
    ),
    "float16 bias, one row": ((1, 2, 50, 64), (1, 2, 60, 64), lambda g: torch.randn(60, generator=g).half(), {}),
}


def _alibi_causal(n):
    distance = (torch.arange(n).view(-1, 1) - torch.arange(n).view(1, -1)).float()
    return (-0.1 * distance).masked_fill(distance < 0, float("-inf"))


def _hide_row(mask, row):
    mask[..., row, :] = False
    return mask


def _padding(g, batch, keys):
    lengths = torch.randint(1, keys, (batch,), generator=g)
    return (torch.arange(keys).view(1, -1) < lengths.view(-1, 1)).view(batch, 1, 1, keys)


@pytest.mark.parametrize("name", list(MASKS))
def test_masks_are_read_in_place_and_match_float64(loop, name):
    shape_q, shape_kv, make, kw = MASKS[name]
    g = torch.Generator().manual_seed(16)
    q = (torch.randn(*shape_q, generator=g) * 2).to(BF16)
    k, v = ((torch.randn(*shape_kv, generator=g) * 2).to(BF16) for _ in range(2))
    mask = make(g)
    out, lse = subquad.attention(q, k, v, attn_mask=mask, backend="loops", chunk_size=(64, 64), return_lse=True, **kw)
    assert "forward_segment_bf16" in loop.names and "exp2_rows_bf16" not in loop.names
    golden = naive_attention(*to64(q, k, v), attn_mask=_as64(mask), **kw)
    ref32 = naive_attention(q.float(), k.float(), v.float(), attn_mask=_as64(mask).float(), **kw)
    assert_close_to_golden(out, golden, ref32.to(BF16))
    want = _lse64(q, k, v, bias=_as64(mask), **kw)
    seen = torch.isfinite(want)
    assert bool(torch.isneginf(lse[~seen]).all()) and bool((out[~seen] == 0).all())
    err = (lse.double() - want)[seen].abs().max().item()
    assert err < 1e-4, err


def _as64(mask):
    return mask if mask.dtype == torch.bool else mask.double()


@pytest.fixture
def two_threads():
    """Two threads, whatever the machine: the backward loop needs a task (batch entry and key
    head) per thread, and these tests give it two or more."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _grads_against_float64(q, k, v, d_out, got_out, got_grads, **kw):
    """The output (the float32 reference's error as the suite's tolerance policy) and the
    gradients of (q, k, v) against float64, within 3x the error of PyTorch's own SDPA in
    bfloat16 (flash-attn's criterion: rounding the output and dO to bfloat16 alone puts dQ's error
    at head dim 1 past the float32 policy, in SDPA as here). kw: naive_attention's arguments.
    d_out: bfloat16, as the call received it. Returns the rows that see a key."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    golden = naive_attention(q64, k64, v64, **kw)
    golden_grads = torch.autograd.grad(golden, (q64, k64, v64), d_out.double())
    ref32 = naive_attention(*(t.detach().float() for t in (q, k, v)), **_as_dtype(kw, torch.float32))
    assert_close_to_golden(got_out, golden.nan_to_num(0.0), ref32.nan_to_num(0.0).to(BF16))
    bf = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*bf, **_as_dtype(kw, BF16))
    ref_grads = torch.autograd.grad(ref, bf, d_out)
    for n, got, gold, r in zip("qkv", got_grads, golden_grads, ref_grads):
        assert not bool(torch.isnan(got).any()), f"d{n}: NaN"
        assert_close_to_golden(got, gold.nan_to_num(0.0), r.nan_to_num(0.0), name=f"d{n}")
    return torch.isfinite(golden).all(dim=-1, keepdim=True)


def _as_dtype(kw, dtype):
    """kw with its floating tensors in ``dtype`` (and a mask of one row 2-D, as SDPA wants)."""
    out = {n: (a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a) for n, a in kw.items()}
    if isinstance(out.get("attn_mask"), torch.Tensor) and out["attn_mask"].dim() == 1:
        out["attn_mask"] = out["attn_mask"].view(1, -1)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_the_backward_loop_matches_float64(loop, two_threads, name):
    q, k, v, kw, chunk, g = case_inputs(name, 21)
    for t in (q, k, v):
        t.requires_grad_()
    d_out = torch.randn(*q.shape[:-1], v.shape[-1], generator=g).to(BF16)
    out = subquad.attention(q, k, v, backend="loops", chunk_size=chunk, **kw)
    grads = torch.autograd.grad(out, (q, k, v), d_out.to(BF16))
    # Below HALF_PRODUCTS_MIN_HEAD_DIM the per-tile backward runs (float32 products).
    assert "backward_segment_bf16" in loop.names and "softmax_grad_rows_bf16" not in loop.names
    _grads_against_float64(q, k, v, d_out, out, grads, **kw)


@pytest.mark.parametrize("name", list(MASKS))
def test_the_backward_loop_reads_masks_in_place(loop, two_threads, name):
    shape_q, shape_kv, make, kw = MASKS[name]
    g = torch.Generator().manual_seed(22)
    q, k, v = ((torch.randn(*s, generator=g) * 2).to(BF16).requires_grad_() for s in (shape_q, shape_kv, shape_kv))
    mask = make(g)
    d_out = torch.randn(*shape_q, generator=g).to(BF16)
    out = subquad.attention(q, k, v, attn_mask=mask, backend="loops", chunk_size=(64, 64), **kw)
    grads = torch.autograd.grad(out, (q, k, v), d_out.to(BF16))
    assert "backward_segment_bf16" in loop.names and "softmax_grad_rows_bf16" not in loop.names
    seen = _grads_against_float64(q, k, v, d_out, out, grads, attn_mask=_as64(mask), **kw)
    # Rows that see nothing: no gradient flows through them.
    assert bool((grads[0][~seen.expand_as(grads[0])] == 0).all())


def test_the_backward_loop_takes_the_lse_gradient_and_rows_that_see_nothing(loop, two_threads):
    # 50 queries against 30 keys, bottom-right: rows 0-19 see no key; a gradient on the lse too.
    g = torch.Generator().manual_seed(23)
    q = torch.randn(2, 2, 50, 64, generator=g).to(BF16).requires_grad_()
    k, v = (torch.randn(2, 2, 30, 64, generator=g).to(BF16).requires_grad_() for _ in range(2))
    d_out, d_lse = torch.randn(2, 2, 50, 64, generator=g).to(BF16), torch.randn(2, 2, 50, generator=g)
    mask = mods.causal_lower_right(50, 30)
    out, lse = subquad.attention(q, k, v, mask_mod=mask, backend="loops", chunk_size=(16, 16), return_lse=True)
    grads = torch.autograd.grad((out, lse), (q, k, v), (d_out.to(BF16), d_lse))
    assert "backward_segment_bf16" in loop.names and "softmax_grad_rows_bf16" not in loop.names
    assert bool((grads[0][:, :, :20] == 0).all())
    keep = torch.arange(30) <= torch.arange(50).view(-1, 1) - 20

    def both(q_, k_, v_):
        s = (q_ @ k_.transpose(-1, -2) * 64**-0.5).masked_fill(~keep, float("-inf"))
        lse_ = torch.logsumexp(s[:, :, 20:], dim=-1)
        o = torch.softmax(s[:, :, 20:], dim=-1) @ v_
        return (o * d_out[:, :, 20:].to(o.dtype)).sum() + (lse_ * d_lse[:, :, 20:].to(o.dtype)).sum()

    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    golden = torch.autograd.grad(both(*inputs64), inputs64)
    inputs32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(both(*inputs32), inputs32)
    for n, got, gold, r in zip("qkv", grads, golden, ref):
        got, gold, r = (got[:, :, 20:], gold[:, :, 20:], r[:, :, 20:]) if n == "q" else (got, gold, r)
        assert_close_to_golden(got, gold, r.to(BF16), name=f"d{n}")


def test_the_backward_loop_with_keys_shared_by_the_batch(loop, two_threads):
    g = torch.Generator().manual_seed(24)
    q = torch.randn(3, 2, 70, 64, generator=g).to(BF16).requires_grad_()
    k, v = (torch.randn(1, 2, 90, 64, generator=g).to(BF16).requires_grad_() for _ in range(2))
    d_out = torch.randn(3, 2, 70, 64, generator=g).to(BF16)
    ke, ve = k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1)
    out = subquad.attention(q, ke, ve, is_causal=True, backend="loops")
    grads = torch.autograd.grad(out, (q, k, v), d_out.to(BF16))
    assert "backward_segment_bf16" in loop.names
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    golden = naive_attention(q64, k64.expand(3, -1, -1, -1), v64.expand(3, -1, -1, -1), is_causal=True)
    golden_grads = torch.autograd.grad(golden, (q64, k64, v64), d_out.double())
    f32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref32 = naive_attention(f32[0], f32[1].expand(3, -1, -1, -1), f32[2].expand(3, -1, -1, -1), is_causal=True)
    ref_grads = torch.autograd.grad(ref32, f32, d_out.float())
    for n, got, gold, ref in zip("qkv", grads, golden_grads, ref_grads):
        assert_close_to_golden(got, gold, ref.to(BF16), name=f"d{n}")


def test_training_takes_the_per_tile_backward_where_the_loop_does_not_run(loop, two_threads):
    g = torch.Generator().manual_seed(15)
    one_head = [torch.randn(1, 1, 100, 64, generator=g).to(BF16).requires_grad_() for _ in range(3)]
    out = subquad.attention(*one_head, is_causal=True, backend="loops")  # one task for two threads
    grads = torch.autograd.grad(out, one_head, torch.ones_like(out))
    assert loop.names[0] == "forward_segment_bf16" and "softmax_grad_rows_bf16" in loop.names
    assert "backward_segment_bf16" not in loop.names
    _grads_against_float64(*one_head, torch.ones(out.shape), out, grads, is_causal=True)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g).to(BF16).requires_grad_() for _ in range(3))
    bias = torch.zeros(40, 40, dtype=BF16, requires_grad=True)
    refused = {
        "a mask that wants its gradient": dict(attn_mask=bias),
        "dropout": dict(dropout_p=0.2),
        "a score_mod": dict(score_mod=lambda s, b, h, i, j: s * 0.5),
    }
    for name, kw in refused.items():
        loop.calls.clear()
        out = subquad.attention(q, k, v, **kw)
        out.sum().backward()
        assert "backward_segment_bf16" not in loop.names, name


SOFTCAPS = {
    "c * tanh(s / c)": (lambda s, b, h, i, j: 30 * torch.tanh(s / 30), 30.0),
    "tanh(s / c) * c": (lambda s, b, h, i, j: torch.tanh(s / 2.5) * 2.5, 2.5),
    "tanh(s * (1 / c)) * c, a clone between": (lambda s, b, h, i, j: torch.tanh(s.clone() * 0.2) * 5.0, 5.0),
}
NOT_SOFTCAPS = {
    "caps that differ": lambda s, b, h, i, j: 30 * torch.tanh(s / 20),
    "a bias after it": lambda s, b, h, i, j: 30 * torch.tanh(s / 30) + 1.0,
    "tanh alone": lambda s, b, h, i, j: torch.tanh(s),
    "a negative cap": lambda s, b, h, i, j: -3 * torch.tanh(s / -3),
    "the score used again": lambda s, b, h, i, j: 30 * torch.tanh(s / 30) * (s > 0),
    "a cap per head": lambda s, b, h, i, j: (h + 1) * torch.tanh(s / (h + 1)),
    "in bfloat16": lambda s, b, h, i, j: 30 * torch.tanh(s.to(torch.bfloat16) / 30),
}


@pytest.mark.parametrize("name", list(SOFTCAPS))
def test_tracing_finds_a_soft_cap(name):
    from subquad._traced import score_mod_structure

    fn, cap = SOFTCAPS[name]
    assert score_mod_structure(fn, torch.float32, torch.device("cpu")).softcap == cap


def test_a_soft_cap_captured_by_a_closure_is_read_per_value():
    # transformers' Gemma 2 writes softcap * tanh(score / softcap) with softcap from its config.
    from subquad._traced import score_mod_structure
    from subquad.integrations.transformers import _softcap_mod

    caps = [score_mod_structure(_softcap_mod(c), torch.float32, torch.device("cpu")).softcap for c in (30.0, 50.0)]
    assert caps == [30.0, 50.0]


@pytest.mark.parametrize("name", list(NOT_SOFTCAPS))
def test_tracing_finds_no_soft_cap_in_other_callbacks(name):
    from subquad._traced import score_mod_structure

    assert score_mod_structure(NOT_SOFTCAPS[name], torch.float32, torch.device("cpu")).softcap is None


SOFTCAP_CASES = {
    # q shape, kv shape, kwargs, the soft cap, chunk_size; scores of about +-4, so caps of 2.5 and 5 bite
    "causal GQA, cap 2.5": (
        (2, 4, 100, 64),
        (2, 2, 100, 64),
        dict(is_causal=True, enable_gqa=True),
        "tanh(s / c) * c",
        (64, 64),
    ),
    "a float mask, cap 5, 70 x 90": (
        (1, 2, 70, 40),
        (1, 2, 90, 40),
        dict(masked=True),
        "tanh(s * (1 / c)) * c, a clone between",
        None,
    ),
    "cap 30, barely capped": ((1, 2, 64, 64), (1, 2, 64, 64), {}, "c * tanh(s / c)", None),
}


@pytest.mark.parametrize("name", list(SOFTCAP_CASES))
def test_the_loops_run_a_soft_cap(loop, two_threads, name):
    shape_q, shape_kv, kw, cap_name, chunk = SOFTCAP_CASES[name]
    fn, cap = SOFTCAPS[cap_name]
    kw = dict(kw)
    g = torch.Generator().manual_seed(26)
    q = (torch.randn(*shape_q, generator=g) * 2).to(BF16).requires_grad_()
    k, v = ((torch.randn(*shape_kv, generator=g) * 2).to(BF16).requires_grad_() for _ in range(2))
    if kw.pop("masked", False):
        kw["attn_mask"] = torch.randn(shape_q[-2], shape_kv[-2], generator=g).to(BF16)
    d_out = torch.randn(*shape_q, generator=g).to(BF16)
    plan = subquad.explain(q, k, v, score_mod=fn, backend="loops", **kw)
    assert any(f"soft cap {cap:g}" in n for n in plan.notes), plan.notes
    loop.calls.clear()  # explain() may run (or run again) the time model's probes on the tiles
    out = subquad.attention(q, k, v, score_mod=fn, backend="loops", chunk_size=chunk, **kw)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    assert {"forward_segment_bf16", "backward_segment_bf16"} <= set(loop.names), loop.names
    assert not {"exp2_rows_bf16", "softmax_grad_rows_bf16"} & set(loop.names)  # no per-tile pass

    def reference(dtype):
        xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        mask = kw.get("attn_mask")
        o = naive_attention(*xs, **dict(kw, attn_mask=None if mask is None else mask.to(dtype)), score_mod=fn)
        return o, torch.autograd.grad(o, xs, d_out.to(dtype))

    golden, golden_grads = reference(torch.float64)
    ref, ref_grads = reference(torch.float32)
    assert_close_to_golden(out, golden, ref.to(BF16))
    for n, got, gold, r in zip("qkv", grads, golden_grads, ref_grads):
        assert_close_to_golden(got, gold, r.to(BF16), name=f"d{n}")


def test_packed_sequences_run_the_backward_loop_per_sequence(loop, two_threads):
    g = torch.Generator().manual_seed(25)
    cu = torch.tensor([0, 17, 40, 100], dtype=torch.int32)
    packed = [torch.randn(100, 2, 32, generator=g).to(BF16).requires_grad_() for _ in range(3)]
    d_out = torch.randn(100, 2, 32, generator=g).to(BF16)
    out = subquad.varlen_attention(*packed, cu, cu, is_causal=True, backend="loops")
    grads = torch.autograd.grad(out, packed, d_out.to(BF16))
    assert loop.names.count("backward_segment_bf16") == 3
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))

    def per_sequence(*ts):
        return torch.cat(
            [naive_attention(*(t[a:b].transpose(0, 1) for t in ts), is_causal=True).transpose(0, 1) for a, b in bounds]
        )

    p64 = [t.detach().double().requires_grad_() for t in packed]
    golden = torch.autograd.grad(per_sequence(*p64), p64, d_out.double())
    p32 = [t.detach().float().requires_grad_() for t in packed]
    ref = torch.autograd.grad(per_sequence(*p32), p32, d_out.float())
    for n, got, gold, r in zip("qkv", grads, golden, ref):
        assert_close_to_golden(got, gold, r.to(BF16), name=f"d{n}")


def test_inference_plans_tiles_by_what_the_loop_holds(loop):
    # The loop holds no tile of scores: a row block's accumulator and a segment's keys and values
    # in pairs. Unbudgeted, it takes whole rows (segments.TILE_TARGET), tiles no smaller than the
    # per-tile path's; held to the per-tile plan's peak, it takes row blocks that fit it.
    from subquad._backends import matmul

    q = torch.empty(1, 8, 4096, 64, dtype=BF16)
    plan = subquad.explain(q, q, q, backend="loops")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matmul, "segment_kernel", lambda inp: None)
        per_tile = subquad.explain(q, q, q, backend="matmul")
    assert plan.chunk_size == (4096, 4096) and per_tile.chunk_size is not None
    assert plan.chunk_size[0] * plan.chunk_size[1] >= per_tile.chunk_size[0] * per_tile.chunk_size[1]
    held = subquad.explain(q, q, q, backend="loops", memory_budget=per_tile.predicted_peak_bytes)
    assert held.backend == "loops" and held.chunk_size is not None and held.chunk_size[0] < 4096
    assert held.predicted_peak_bytes <= per_tile.predicted_peak_bytes < plan.predicted_peak_bytes
    before = len(loop.calls)
    out = subquad.attention(q.normal_(), q, q, backend="loops", memory_budget=per_tile.predicted_peak_bytes)
    calls = -(-4096 // held.chunk_size[0]) * -(-4096 // held.chunk_size[1])  # row blocks x segments
    assert torch.isfinite(out).all() and loop.names[before:] == ["forward_segment_bf16"] * calls


def test_the_loop_refuses_what_it_does_not_take(loop):
    kernel = loop.real
    q = torch.zeros(1, 2, 8, 16, dtype=BF16)
    m, l, acc = torch.zeros(16), torch.zeros(16), torch.zeros(16, 16)
    ok = (q, q, q, m, l, acc, 1.0, 0, 0, False, 0, None, 0.0)  # the last: no soft cap
    kernel.forward_segment_bf16(*ok)
    kernel.forward_segment_bf16(*ok[:-2], torch.ones(1, 2, 8, 8, dtype=torch.bool), 30.0)
    bad = {
        "float32 q": (q.float(),) + ok[1:],
        "3-D k": ok[:1] + (q[0],) + ok[2:],
        "last dim strided": (torch.zeros(1, 2, 16, 8, dtype=BF16).transpose(-1, -2),) + ok[1:],
        "heads not a multiple": ok[:1] + (torch.zeros(1, 3, 8, 16, dtype=BF16),) * 2 + ok[3:],
        "k and v lengths differ": ok[:2] + (torch.zeros(1, 2, 9, 16, dtype=BF16),) + ok[3:],
        "acc too small": ok[:5] + (torch.zeros(16, 8),) + ok[6:],
        "m of float64": ok[:3] + (m.double(),) + ok[4:],
        "mask of another shape": ok[:-2] + (torch.ones(1, 1, 8, 8, dtype=torch.bool), 0.0),
        "mask of float64": ok[:-2] + (torch.zeros(1, 2, 8, 8, dtype=torch.float64), 0.0),
        "a negative soft cap": ok[:-1] + (-1.0,),
    }
    assert_refused(kernel.forward_segment_bf16, bad)


def test_the_backward_loop_refuses_bad_arguments(loop):
    kernel = loop.real
    q = torch.zeros(1, 2, 8, 16, dtype=BF16)
    rows, dq = torch.zeros(16), torch.zeros(1, 2, 8, 16)
    ok = (q, q, q, q, rows, rows, dq, dq.clone(), dq.clone(), 1.0, 0.25, 0, 0, False, 0, None, 0.0)
    kernel.backward_segment_bf16(*ok)
    kernel.backward_segment_bf16(*ok[:-1], 30.0)
    bad = {
        "float32 dout": ok[:3] + (q.float(),) + ok[4:],
        "dout of another length": ok[:3] + (torch.zeros(1, 2, 9, 16, dtype=BF16),) + ok[4:],
        "lse of too few rows": ok[:4] + (torch.zeros(8),) + ok[5:],
        "bfloat16 dq": ok[:6] + (dq.to(BF16),) + ok[7:],
        "dk of another shape": ok[:7] + (torch.zeros(1, 2, 9, 16),) + ok[8:],
        "dv with a strided last dim": ok[:8] + (torch.zeros(1, 2, 16, 8).transpose(-1, -2),) + ok[9:],
        "mask of another shape": ok[:-2] + (torch.ones(1, 1, 8, 8, dtype=torch.bool), 0.0),
        "a negative soft cap": ok[:-1] + (-1.0,),
    }
    assert_refused(kernel.backward_segment_bf16, bad)


def test_measured_peak_within_budget_and_prediction_honest(loop, native_dir):
    # As tests/test_planner.py's grid, with the loop: a fresh process, RSS high-water mark.
    # backend="matmul": the loops wherever the probe process's CPU has them (the CI reruns it as others)
    cases = [
        dict(shape=[1, 8, 4096, 4096, 64], budget="16MiB", dtype="bfloat16", backend="matmul"),
        dict(shape=[1, 8, 4096, 4096, 64], budget="64MiB", dtype="bfloat16", backend="matmul"),
        dict(shape=[1, 8, 2048, 2048, 64], budget="16MiB", dtype="bfloat16", backend="matmul", mask="bool"),
        dict(shape=[1, 8, 2048, 2048, 64], budget="16MiB", dtype="bfloat16", backend="matmul", mask="causal"),
        dict(shape=[2, 8, 1024, 1024, 40], budget="8MiB", dtype="bfloat16", backend="matmul", mask="float"),
    ]
    assert_memory_within_budget(cases, native_dir)


def test_training_peak_within_budget_and_prediction_honest(loop, native_dir):
    # Both loops (two threads: a task per thread), as the grid above, gradients included.
    # backend="matmul": the loops wherever the probe process's CPU has them (the CI reruns it as others)
    cases = [
        dict(shape=[1, 8, 2048, 2048, 64], budget="24MiB", dtype="bfloat16", backend="matmul", grad=True),
        dict(shape=[1, 8, 2048, 2048, 64], budget="64MiB", dtype="bfloat16", backend="matmul", grad=True),
        dict(
            shape=[2, 4, 1024, 1024, 64], budget="16MiB", dtype="bfloat16", backend="matmul", grad=True, mask="causal"
        ),
        dict(shape=[2, 8, 1024, 1024, 40], budget="24MiB", dtype="bfloat16", backend="matmul", grad=True, mask="float"),
    ]
    assert_memory_within_budget(cases, native_dir, OMP_NUM_THREADS="2")


def test_subquad_info_says_the_loops_are_there(loop):
    assert "built, used, with the forward and backward loops" in _native.status()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(_native._LOADED, "module", None)  # built but not loadable
        assert _native.status().startswith("built, not loaded")


def test_auto_runs_the_loops_where_it_takes_them(loop, two_threads):
    # On a CPU with AVX512-BF16 and no AMX (the fixture's; what auto takes on each CPU:
    # tests/test_cpus.py), a large call runs the forward loop and gives the float64 result.
    causal = torch.randn(1, 8, 600, 64).to(BF16)
    plan = subquad.explain(causal, causal, causal, is_causal=True)
    assert plan.backend == "loops" and any("forward loop in C++" in n for n in plan.notes), plan
    assert plan.rejected.get("fused") == ["slower backend; the one above fits"]
    out = subquad.attention(causal, causal, causal, is_causal=True)
    assert loop.names and set(loop.names) == {"forward_segment_bf16"}
    golden = naive_attention(*to64(causal, causal, causal), is_causal=True)
    assert_close_to_golden(out, golden, naive_attention(*(t.float() for t in (causal,) * 3), is_causal=True).to(BF16))
