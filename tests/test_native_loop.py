"""The forward's tile loop in C++ (``forward_segment_bf16`` in ``_native_tiles.cpp``,
``subquad._backends.segments``): bfloat16 calls without callbacks or dropout, causal or not, with
or without an ``attn_mask``, on a CPU whose build of the native kernel targets AVX512-BF16.

Checked against the float64 golden (outputs with the suite's tolerance policy; the lse to 1e-4,
which bfloat16 products could not give: their lse is off by about 2e-3) on awkward sizes, which
calls it takes, and its argument errors. Skipped where the kernel cannot be built or was built
without AVX512-BF16 (the per-tile kernel, tests/test_native.py, serves those CPUs).
"""

from __future__ import annotations


import pytest
import torch

import subquad
from conftest import assert_close_to_golden, memory_bound_failures, naive_attention, run_memory_probe, to64
from subquad import _native, mods
import test_native  # its build fixture's skip mark, kernel loader and call recorder

BF16 = torch.bfloat16

pytestmark = test_native.pytestmark  # a C++ compiler and ninja


@pytest.fixture
def loop(native_dir, monkeypatch):
    """The native kernel with its C++ forward loop, its calls recorded."""
    module = test_native.load_kernel(native_dir, monkeypatch)
    if not hasattr(module, "forward_segment_bf16"):
        pytest.skip("the native kernel was built without AVX512-BF16: no C++ forward loop")
    counting = test_native.Counting(module)
    monkeypatch.setitem(_native._LOADED, "module", counting)
    return counting


def _lse64(q, k, v, is_causal=False, offset=0, enable_gqa=False, bias=None):
    q, k = q.double(), k.double()
    if enable_gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
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


@pytest.mark.parametrize("name", list(CASES))
def test_the_loop_matches_float64(loop, name):
    shape_q, shape_kv, kw, chunk = CASES[name]
    kw = dict(kw)
    ev = kw.pop("value_dim", shape_kv[-1])
    g = torch.Generator().manual_seed(11)
    q = (torch.randn(*shape_q, generator=g) * 2).to(BF16)
    k = (torch.randn(*shape_kv, generator=g) * 2).to(BF16)
    v = (torch.randn(*shape_kv[:-1], ev, generator=g) * 2).to(BF16)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous query
    out, lse = subquad.attention(q, k, v, backend="matmul", chunk_size=chunk, return_lse=True, **kw)
    assert "forward_segment_bf16" in loop.names and "exp2_rows_bf16" not in loop.names
    golden = naive_attention(*to64(q, k, v), **kw)
    ref32 = naive_attention(q.float(), k.float(), v.float(), **kw)
    assert_close_to_golden(out, golden, ref32.to(BF16))
    err = (lse.double() - _lse64(q, k, v, **kw)).abs().max().item()
    assert err < 1e-4, err


def test_bottom_right_causal_rows_that_see_nothing_give_zeros(loop):
    # 50 queries against 30 keys, aligned bottom-right: rows 0-19 see no key.
    g = torch.Generator().manual_seed(12)
    q = torch.randn(1, 2, 50, 64, generator=g).to(BF16)
    k, v = (torch.randn(1, 2, 30, 64, generator=g).to(BF16) for _ in range(2))
    mask = mods.causal_lower_right(50, 30)
    out, lse = subquad.attention(q, k, v, mask_mod=mask, backend="matmul", chunk_size=(16, 16), return_lse=True)
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
    out = subquad.attention(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1), backend="matmul")
    assert "forward_segment_bf16" in loop.names
    golden = naive_attention(*to64(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1)))
    ref32 = naive_attention(q.float(), k.float().expand(3, -1, -1, -1), v.float().expand(3, -1, -1, -1))
    assert_close_to_golden(out, golden, ref32.to(BF16))


def test_the_loop_takes_calls_without_callbacks_or_dropout(loop):
    q = torch.randn(1, 2, 40, 32).to(BF16)
    subquad.attention(q, q, q, score_mod=lambda s, b, h, i, j: s * 0.5, backend="matmul")
    subquad.attention(q, q, q, mask_mod=lambda b, h, i, j: (i - j).abs() < 8, backend="matmul")
    subquad.attention(q, q, q, dropout_p=0.3, backend="matmul")
    subquad.attention(q.float(), q.float(), q.float(), backend="matmul")
    assert "forward_segment_bf16" not in loop.names and "exp2_rows_bf16" in loop.names
    loop.calls.clear()
    mask = torch.rand(40, 40, generator=torch.Generator().manual_seed(14)) > 0.3
    subquad.attention(q, q, q, backend="matmul")
    subquad.attention(q, q, q, is_causal=True, backend="matmul")
    subquad.attention(q, q, q, attn_mask=mask, backend="matmul")
    subquad.attention(q, q, q, attn_mask=torch.zeros(40, 40, dtype=BF16), backend="matmul")
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
    out, lse = subquad.attention(q, k, v, attn_mask=mask, backend="matmul", chunk_size=(64, 64), return_lse=True, **kw)
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


def test_training_runs_the_loop_forward_and_the_tiles_backward(loop):
    g = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(1, 2, 100, 64, generator=g).to(BF16).requires_grad_() for _ in range(3))
    d_out = torch.randn(1, 2, 100, 64, generator=g)
    out = subquad.attention(q, k, v, is_causal=True, backend="matmul")
    grads = torch.autograd.grad(out, (q, k, v), d_out.to(BF16))
    assert loop.names[0] == "forward_segment_bf16" and "softmax_grad_rows_bf16" in loop.names
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    golden = naive_attention(q64, k64, v64, is_causal=True)
    golden_grads = torch.autograd.grad(golden, (q64, k64, v64), d_out.double())
    f32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref32 = naive_attention(*f32, is_causal=True)
    ref_grads = torch.autograd.grad(ref32, f32, d_out)
    assert_close_to_golden(out, golden, ref32.to(BF16))
    for n, got, gold, ref in zip("qkv", grads, golden_grads, ref_grads):
        assert_close_to_golden(got, gold, ref.to(BF16), name=f"d{n}")


def test_inference_plans_tiles_by_what_the_loop_holds(loop):
    # The loop holds no tile of scores: a row block's accumulator and a segment's keys and values
    # in pairs. Its planned peak is below the per-tile path's, and its tiles are not smaller.
    from subquad._backends import matmul

    q = torch.empty(1, 8, 4096, 64, dtype=BF16)
    plan = subquad.explain(q, q, q, backend="matmul")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matmul, "segment_kernel", lambda inp: None)
        per_tile = subquad.explain(q, q, q, backend="matmul")
    assert plan.chunk_size is not None and per_tile.chunk_size is not None
    assert plan.chunk_size[0] * plan.chunk_size[1] >= per_tile.chunk_size[0] * per_tile.chunk_size[1]
    assert plan.predicted_peak_bytes < per_tile.predicted_peak_bytes


def test_the_loop_refuses_what_it_does_not_take(loop):
    kernel = loop.kernel
    q = torch.zeros(1, 2, 8, 16, dtype=BF16)
    m, l, acc = torch.zeros(16), torch.zeros(16), torch.zeros(16, 16)
    ok = (q, q, q, m, l, acc, 1.0, 0, 0, False, 0, None)
    kernel.forward_segment_bf16(*ok)
    kernel.forward_segment_bf16(*ok[:-1], torch.ones(1, 2, 8, 8, dtype=torch.bool))
    bad = {
        "float32 q": (q.float(),) + ok[1:],
        "3-D k": ok[:1] + (q[0],) + ok[2:],
        "last dim strided": (torch.zeros(1, 2, 16, 8, dtype=BF16).transpose(-1, -2),) + ok[1:],
        "heads not a multiple": ok[:1] + (torch.zeros(1, 3, 8, 16, dtype=BF16),) * 2 + ok[3:],
        "k and v lengths differ": ok[:2] + (torch.zeros(1, 2, 9, 16, dtype=BF16),) + ok[3:],
        "acc too small": ok[:5] + (torch.zeros(16, 8),) + ok[6:],
        "m of float64": ok[:3] + (m.double(),) + ok[4:],
        "mask of another shape": ok[:-1] + (torch.ones(1, 1, 8, 8, dtype=torch.bool),),
        "mask of float64": ok[:-1] + (torch.zeros(1, 2, 8, 8, dtype=torch.float64),),
    }
    for name, args in bad.items():
        with pytest.raises(RuntimeError):
            kernel.forward_segment_bf16(*args)
            pytest.fail(name)


def test_measured_peak_within_budget_and_prediction_honest(loop, native_dir):
    # As tests/test_planner.py's grid, with the loop: a fresh process, RSS high-water mark.
    cases = [
        dict(shape=[1, 8, 4096, 4096, 64], budget="16MiB", dtype="bfloat16", backend="matmul"),
        dict(shape=[1, 8, 4096, 4096, 64], budget="64MiB", dtype="bfloat16", backend="matmul"),
        dict(shape=[1, 8, 2048, 2048, 64], budget="16MiB", dtype="bfloat16", backend="matmul", mask="bool"),
        dict(shape=[1, 8, 2048, 2048, 64], budget="16MiB", dtype="bfloat16", backend="matmul", mask="causal"),
        dict(shape=[2, 8, 1024, 1024, 40], budget="8MiB", dtype="bfloat16", backend="matmul", mask="float"),
    ]
    results = run_memory_probe(cases, SUBQUAD_NATIVE="auto", SUBQUAD_NATIVE_DIR=str(native_dir))
    failures = [f for r in results for f in memory_bound_failures(r)]
    assert not failures, "\n".join(failures)


def test_subquad_info_says_the_forward_loop_is_there(loop):
    assert "built, used, with the forward loop" in _native.status()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(_native._LOADED, "module", None)  # built but not loadable
        assert _native.status().startswith("built, not loaded")


def test_auto_takes_the_loop_for_large_inference_calls_without_amx(loop, monkeypatch):
    from subquad._backends import segments

    monkeypatch.setattr(segments, "amx_tiles", lambda: False)
    big = torch.empty(1, 8, 1024, 64, dtype=BF16)  # 2^23 scores
    plan = subquad.explain(big, big, big)
    assert plan.backend == "matmul" and any("forward loop in C++" in n for n in plan.notes), plan
    assert plan.rejected.get("fused") == ["slower backend; the one above fits"]
    causal = torch.randn(1, 8, 600, 64).to(BF16)
    out = subquad.attention(causal, causal, causal, is_causal=True)
    assert loop.names and set(loop.names) == {"forward_segment_bf16"}
    golden = naive_attention(*to64(causal, causal, causal), is_causal=True)
    assert_close_to_golden(out, golden, naive_attention(*(t.float() for t in (causal,) * 3), is_causal=True).to(BF16))
    small = torch.empty(1, 8, 256, 64, dtype=BF16)  # 2^19 scores: the fused kernel is faster
    assert subquad.explain(small, small, small).backend == "fused"
    trained = big.clone().requires_grad_()
    assert subquad.explain(trained, trained, trained).backend == "fused"  # training keeps the fused kernel
    assert subquad.explain(big.float(), big.float(), big.float()).backend == "fused"
    monkeypatch.setattr(segments, "amx_tiles", lambda: True)  # torch's kernel multiplies on AMX tiles there
    assert subquad.explain(big, big, big).backend == "fused"
