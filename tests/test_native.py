"""The optional native tile kernel (``subquad._native``, ``subquad build``).

The kernel is compiled once for the session in a temporary folder (the suite otherwise runs with
``SUBQUAD_NATIVE=off``, tests/conftest.py), then checked three ways: the kernel against its own
definition in float64; the bfloat16 tiles with it against the float64 golden, with the suite's
tolerance policy, on the cases of tests/test_half.py and awkward sizes; and the modes, the command
and the fallback when it cannot be built. Skipped where PyTorch's extension builder has no C++
compiler or no ninja.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import _machine
import subquad
from _devices import OpRecorder
from conftest import assert_close_to_golden, naive_attention, to64
from subquad import _cli, _native
from subquad._backends import matmul, offsets
from test_half import CASES, check_case_against_float64

BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif(
    shutil.which("ninja") is None or shutil.which("c++") is None or sys.platform == "win32",
    reason="PyTorch's extension builder needs ninja and a C++ compiler (c++)",
)


def load_kernel(native_dir, monkeypatch, machine="avx512-bf16"):
    """The session's build of the native kernel, used by subquad on ``machine``
    (tests/_machine.py; by default a CPU with AVX512-BF16 and no AMX, where ``auto`` takes the
    loops): returns the build itself, whatever the machine under the suite."""
    monkeypatch.setenv("SUBQUAD_NATIVE_DIR", str(native_dir))
    monkeypatch.setenv("SUBQUAD_NATIVE", "auto")
    monkeypatch.setattr(_native, "_LOADED", {})
    module = _native.tile_kernel()
    if module is None:
        pytest.skip(f"the native kernel does not load here: {_native.status()}")
    real = getattr(module, "real", module)  # the build itself, not a SUBQUAD_TEST_CPU machine's view of it
    _machine.fake_cpu(monkeypatch, machine, kernel=real)
    return real


def recorded_kernel(native_dir, monkeypatch, needs, why, machine="avx512-bf16"):
    """The session's build on ``machine`` (:func:`load_kernel`), its calls recorded
    (:class:`Counting`); skips the test (``why``) where the build lacks the function ``needs``."""
    real = load_kernel(native_dir, monkeypatch, machine)
    if not hasattr(real, needs):
        pytest.skip(why)
    counting = Counting(_native._LOADED["module"], real)
    monkeypatch.setitem(_native._LOADED, "module", counting)
    return counting


@pytest.fixture
def kernel(native_dir, monkeypatch):
    """The tiles with the native kernel's passes over each tile. The forward's and backward's
    loops in C++, which ``matmul`` runs where they take the call (the ``loops`` backend), are off
    here: tests/test_native_loop.py."""
    monkeypatch.setattr(matmul, "segment_kernel", lambda inp: None)
    monkeypatch.setattr(matmul, "backward_kernel", lambda inp, grads=None: None)
    return load_kernel(native_dir, monkeypatch)


class Counting:
    """The kernel, with the calls of each of its functions recorded: ``(name, the first
    argument's shape)``; ``names``: the names alone. ``real``: the build behind it (``kernel``
    may be a machine's view of it, tests/_machine.py)."""

    def __init__(self, kernel, real=None):
        self.kernel, self.calls = kernel, []
        self.real = kernel if real is None else real

    @property
    def names(self):
        return [name for name, _ in self.calls]

    def __getattr__(self, name):
        fn = getattr(self.kernel, name)  # AttributeError for what the build lacks, as the module
        if not callable(fn):  # a constant of the build (float_lanes)
            return fn

        def call(*args):
            self.calls.append((name, tuple(args[0].shape)))
            return fn(*args)

        return call


def _reference(r, m_run, used):
    """The kernel's definition in float64: (p, sums, m_tile)."""
    x = r.double()
    m_tile = x.amax(dim=-1) + used.double()
    m_new = torch.maximum(m_run.double(), m_tile)
    ref = m_new.masked_fill(m_new == -math.inf, 0.0)
    p = torch.exp2(x - (ref - used.double()).unsqueeze(-1))
    return p, p.sum(dim=-1), m_tile


@pytest.mark.parametrize("n", [1, 7, 16, 33, 512, 1000])
def test_the_kernel_matches_its_definition(kernel, n):
    g = torch.Generator().manual_seed(n)
    r = (torch.randn(3, 5, n, generator=g) * 6).to(BF16)
    r[0, 1] = -math.inf  # a fully masked row
    r[1, :, ::3] = -math.inf  # masked entries
    r[2, 0, 0] = -200.0  # far below the row's maximum: 0
    m_run = torch.randn(3, 5, generator=g) * 4
    m_run[0] = -math.inf  # rows with nothing seen yet
    used = (torch.randn(3, 5, generator=g) * 2).to(BF16).float()
    p_ref, sums_ref, m_ref = _reference(r, m_run, used)
    p = r.clone()
    sums, m_tile = kernel.exp2_rows_bf16(p, m_run, used)
    torch.testing.assert_close(m_tile.double(), m_ref, rtol=0, atol=0)  # a maximum is exact
    torch.testing.assert_close(sums.double(), sums_ref, rtol=1e-5, atol=1e-30)
    # p rounded once to bfloat16: within one rounding of the exact value (2^-9 relative, and the
    # approximation's 1e-8); below 2^-126 of the row's reference, 0.
    err = (p.double() - p_ref).abs()
    assert bool((err <= p_ref * 2**-8 + 2.0**-120).all()), err.max()
    assert bool((p[0, 1] == 0).all()) and float(sums[0, 1]) == 0.0
    if n > 1:  # -200 lies more than 126 below the row's largest
        assert float(p[2, 0, 0]) == 0.0


def test_the_backward_kernel_matches_its_definition(kernel):
    g = torch.Generator().manual_seed(11)
    s = (torch.randn(2, 6, 77, generator=g) * 3 - 2).to(BF16)
    s[0, 2] = -math.inf  # a fully masked row: P = 0, dS = 0
    s[1, :, ::4] = -math.inf
    dp = (torch.randn(2, 6, 77, generator=g) * 0.5).to(BF16)
    shift = torch.randn(2, 6, generator=g)
    c = torch.randn(2, 6, generator=g) * 0.1
    p_ref = torch.exp(s.double() - shift.double().unsqueeze(-1))
    ds_ref = 0.125 * p_ref * (dp.double() + c.double().unsqueeze(-1))
    p, ds = s.clone(), dp.clone()
    kernel.softmax_grad_rows_bf16(p, ds, shift, c, 0.125)
    for got, want in ((p, p_ref), (ds, ds_ref)):
        err = (got.double() - want).abs()
        assert bool((err <= want.abs() * 2**-8 + 2.0**-120).all()), err.max()
    assert bool((p[0, 2] == 0).all()) and bool((ds[0, 2] == 0).all())


@pytest.mark.parametrize("alpha", [0.125 * matmul.LOG2E, 0.0, 1e-46, 2e-38, 1.3e-38], ids=str)
def test_next_offsets_match_the_eager_bookkeeping(kernel, alpha):
    # far_rows and OffsetOperand.set_offset, which the eager path runs: the same far rows, the
    # same offsets returned and written into the operand's strided offset column; products that
    # vanish (a scale of 0 or one that underflows float32) have offset 0 in both, and offsets that
    # overflow bfloat16 once divided by the scale (just above float32's smallest normal) too.
    g = torch.Generator().manual_seed(12)
    m_run = torch.randn(3, 40, generator=g) * 4
    m_run[0, :5] = -math.inf  # nothing seen yet
    m_tile = m_run + torch.randn(3, 40, generator=g) * 3
    m_tile[1, :3] = -math.inf  # a fully masked row of the tile
    m_tile[2, 0] = math.nan
    used = (m_run + torch.randn(3, 40, generator=g)).to(BF16).float()
    used[0, 5] = math.inf  # not finite: offset 0
    want_op = offsets.OffsetOperand(torch.zeros(3, 40, 16, dtype=BF16), alpha)
    moved, want_far, _ = offsets.far_rows(m_tile, m_run, used.unsqueeze(-1))
    want = want_op.set_offset(torch.where(moved, m_tile, used)).squeeze(-1)
    got_op = offsets.OffsetOperand(torch.zeros(3, 40, 16, dtype=BF16), alpha)
    got, far, n_far = kernel.next_offsets(m_tile, m_run, used, got_op.rows[..., 16], alpha, offsets.OFFSET_DRIFT)
    assert torch.equal(far, want_far) and n_far == int(want_far.sum()) > 0
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(got_op.rows.view(torch.int16), want_op.rows.view(torch.int16))  # -0.0 included


def test_online_update_matches_the_eager_state_update(kernel):
    g = torch.Generator().manual_seed(13)
    m_run = torch.randn(2, 30, generator=g) * 3
    m_run[0, :4] = -math.inf  # nothing seen yet
    m_tile = m_run + torch.randn(2, 30, generator=g)
    m_tile[0, :2] = -math.inf  # nor in this tile: stays -inf, state stays 0
    m_tile[1, 7] = math.nan
    sums = torch.rand(2, 30, generator=g) * 5
    sums[0, :2] = 0.0
    l = torch.rand(2, 30, generator=g) * 3
    l[0, :4] = 0.0
    acc = torch.randn(2, 30, 9, generator=g)
    acc[0, :4] = 0.0
    m_new = torch.maximum(m_run, m_tile)
    correction = torch.exp2(m_run - m_new.masked_fill(m_new == -math.inf, 0.0))
    want = (m_new, l * correction + sums, acc * correction.unsqueeze(-1))
    got = (m_run.clone(), l.clone(), acc.clone())
    kernel.online_update(got[0], got[1], got[2], m_tile, sums)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-7, atol=0, equal_nan=True)
    assert bool(torch.isnan(got[0][1, 7])) and bool(torch.isnan(got[2][1, 7]).all())
    assert bool((got[2][0, :2] == 0).all()) and bool((got[1][0, :2] == 0).all())


def test_the_kernel_refuses_what_it_does_not_take(kernel):
    r = torch.zeros(2, 3, 8, dtype=BF16)
    ok = torch.zeros(2, 3)
    with pytest.raises(RuntimeError, match="r: a contiguous"):
        kernel.exp2_rows_bf16(r.float(), ok, ok)
    with pytest.raises(RuntimeError, match="r: a contiguous"):
        kernel.exp2_rows_bf16(r.transpose(1, 2), ok, ok)
    with pytest.raises(RuntimeError, match="m_run, used"):
        kernel.exp2_rows_bf16(r, torch.zeros(2, 4), ok)
    with pytest.raises(RuntimeError, match="s, dp: contiguous"):
        kernel.softmax_grad_rows_bf16(r, r.float(), ok, ok, 1.0)
    with pytest.raises(RuntimeError, match="s, dp: one shape"):
        kernel.softmax_grad_rows_bf16(r, r[:, :, :4].contiguous(), ok, ok, 1.0)
    with pytest.raises(RuntimeError, match="shift, c"):
        kernel.softmax_grad_rows_bf16(r, r.clone(), ok, torch.zeros(5), 1.0)
    with pytest.raises(RuntimeError, match="col: a"):
        kernel.next_offsets(ok, ok, ok, ok, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="m_tile, m_run, used"):
        kernel.next_offsets(ok, ok, torch.zeros(7), torch.zeros(2, 3, dtype=BF16), 1.0, 1.0)
    with pytest.raises(RuntimeError, match="acc: a contiguous"):
        kernel.online_update(ok, ok, torch.zeros(2, 3), ok, ok)
    with pytest.raises(RuntimeError, match="m_run, l, m_tile, sums"):
        kernel.online_update(ok, ok, torch.zeros(2, 3, 4), ok, torch.zeros(2, 4))


@pytest.mark.parametrize("magnitude", [1.0, 4.0], ids=["scores~1", "scores~16"])
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_tiles_with_the_kernel_match_float64(kernel, name, magnitude):
    # tests/test_half.py's cases: the kernel takes the calls whose softmax sees the raw scores, the
    # others (a float mask, a score_mod) keep the eager passes; all are held to the same bound.
    check_case_against_float64(name, magnitude)


AWKWARD = {
    "length 1": ((1, 2, 1, 64), (1, 2, 1, 64), {}, None),
    "one query, 1000 keys": ((1, 2, 1, 64), (1, 2, 1000, 64), {}, (1, 256)),
    "777 x 1000, tiles 256 x 300": ((1, 3, 777, 64), (1, 3, 1000, 64), {}, (256, 300)),
    "head dim 1": ((2, 2, 40, 1), (2, 2, 50, 1), {}, (16, 24)),
    "head dim 111, causal": ((1, 2, 90, 111), (1, 2, 90, 111), {"is_causal": True}, (32, 40)),
    "head dim 256, GQA": ((1, 4, 64, 256), (1, 2, 70, 256), {"enable_gqa": True}, (32, 32)),
}


def _with_grads(fn, ts, d_out):
    ts = [t.detach().requires_grad_() for t in ts]
    out = fn(*ts)
    return out, torch.autograd.grad(out, ts, d_out.to(out.dtype))


@pytest.mark.parametrize("name", list(AWKWARD))
def test_awkward_sizes_with_the_kernel_match_float64(kernel, name):
    shape_q, shape_kv, kw, chunk = AWKWARD[name]
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(*shape_q, generator=g) * 2).to(BF16)
    k, v = ((torch.randn(*shape_kv, generator=g) * 2).to(BF16) for _ in range(2))
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous query
    d_out = torch.randn(q.shape[:-1] + v.shape[-1:], generator=g)
    out, grads = _with_grads(
        lambda *t: subquad.attention(*t, backend="matmul", chunk_size=chunk, **kw), (q, k, v), d_out
    )
    golden, golden_grads = _with_grads(lambda *t: naive_attention(*t, **kw), to64(q, k, v), d_out)
    ref32, ref32_grads = _with_grads(lambda *t: naive_attention(*t, **kw), [t.float() for t in (q, k, v)], d_out)
    assert_close_to_golden(out, golden, ref32.to(BF16))
    for n, got, gold, ref in zip("qkv", grads, golden_grads, ref32_grads):
        assert_close_to_golden(got, gold, ref.to(BF16), name=f"d{n}")


def test_fully_masked_rows_give_zeros_with_the_kernel(kernel):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 70, 32, generator=g).to(BF16)
    k, v = (torch.randn(1, 2, 90, 32, generator=g).to(BF16) for _ in range(2))
    mask = torch.rand(70, 90, generator=g) > 0.5
    mask[5] = False  # row 5 sees nothing
    d_out = torch.randn(1, 2, 70, 32, generator=g)
    call = lambda *t: subquad.attention(*t, attn_mask=mask, backend="matmul", chunk_size=(32, 40))  # noqa: E731
    out, (dq, dk, dv) = _with_grads(call, (q, k, v), d_out)
    assert bool((out[:, :, 5] == 0).all()) and bool((dq[:, :, 5] == 0).all())
    golden, golden_grads = _with_grads(lambda *t: naive_attention(*t, attn_mask=mask), to64(q, k, v), d_out)
    ref32, ref32_grads = _with_grads(
        lambda *t: naive_attention(*t, attn_mask=mask), [t.float() for t in (q, k, v)], d_out
    )
    keep = torch.ones(70, dtype=torch.bool)
    keep[5] = False
    assert_close_to_golden(out[:, :, keep], golden[:, :, keep], ref32[:, :, keep].to(BF16))
    for n, got, gold, ref in zip("kv", (dk, dv), golden_grads[1:], ref32_grads[1:]):
        assert_close_to_golden(got, gold, ref.to(BF16), name=f"d{n}")


def test_a_row_whose_maximum_jumps_is_computed_again_with_the_kernel(kernel, monkeypatch):
    # Row 0's largest score lies in the second tile of keys, 40 above anything in the first: its
    # bfloat16 product there is redone with the new maximum as offset (rounding 40 would cost 6%).
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, 64, 64, generator=g).to(BF16)
    k, v = (torch.randn(1, 1, 128, 64, generator=g).to(BF16) for _ in range(2))
    q[0, 0, 1:, 0] = 0.0  # only row 0 sees key 100's first component
    q[0, 0, 0, 0] = 8.0
    k[0, 0, 100] = 0.0
    k[0, 0, 100, 0] = 40.0  # 8 * 40 / sqrt(64) = 40
    redone = []
    addmm = torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **kw: redone.append(1) or addmm(*a, **kw))
    out = subquad.attention(q, k, v, backend="matmul", chunk_size=(64, 64))
    assert redone, "no row was computed again"
    golden = naive_attention(q.double(), k.double(), v.double())
    ref32 = naive_attention(q.float(), k.float(), v.float())
    assert_close_to_golden(out, golden, ref32.to(BF16))


def test_the_kernel_replaces_the_eager_passes_over_a_tile(kernel):
    q, k, v = (torch.randn(1, 2, 64, 32, generator=torch.Generator().manual_seed(6)).to(BF16) for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    tile = (2, 32, 64)  # (B * Hk, rows, keys) for tiles of 32 x 64
    passes = ("aten.copy_", "aten.sub", "aten.exp2", "aten.mul", "aten.add")
    on_tiles = {}
    counting = Counting(kernel)
    for name, module in (("eager", None), ("native", counting)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(_native._LOADED, "module", module)
            with OpRecorder() as rec:
                out = subquad.attention(q, k, v, backend="matmul", chunk_size=(32, 64))
                out.backward(torch.ones_like(out))
        on_tiles[name] = {op.name for op in rec.ops if tile in op.out_shapes and op.name.startswith(passes)}
    # Two row blocks, one tile of keys each, forward (with its rows' bookkeeping) and backward.
    rows = (2, 32)
    forward = [("exp2_rows_bf16", tile), ("next_offsets", rows), ("online_update", rows)]
    assert counting.calls == forward * 2 + [("softmax_grad_rows_bf16", tile)] * 2
    assert {n.split(".")[1] for n in on_tiles["eager"]} >= {"copy_", "sub_", "exp2_", "mul"}, on_tiles
    assert not on_tiles["native"], on_tiles


def test_inference_with_the_kernel_takes_tiles_of_its_bfloat16_size(kernel):
    # Where the kernel does an inference forward's elementwise work, a tile streams 2 bytes per
    # score (its bfloat16 product), not 4 (float32 scores): twice the scores fit the same target.
    q = torch.empty(1, 8, 4096, 64, dtype=BF16)
    qg = q.clone().requires_grad_()
    with_kernel = subquad.explain(q, q, q, backend="matmul").chunk_size
    training = subquad.explain(qg, qg, qg, backend="matmul").chunk_size
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(_native._LOADED, "module", None)
        eager = subquad.explain(q, q, q, backend="matmul").chunk_size
    assert with_kernel is not None and eager is not None and training is not None
    assert with_kernel[0] * with_kernel[1] == 2 * eager[0] * eager[1], (with_kernel, eager)
    assert training == eager


def test_dropout_a_mask_gradient_and_float32_keep_the_eager_passes(kernel):
    counting = Counting(kernel)
    q = torch.randn(1, 2, 40, 32).to(BF16).requires_grad_()
    mask = torch.zeros(40, 40, dtype=BF16, requires_grad=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(_native._LOADED, "module", counting)
        subquad.attention(q, q, q, backend="matmul", dropout_p=0.3).sum().backward()
        subquad.attention(q, q, q, attn_mask=mask, backend="matmul").sum().backward()
        x = q.detach().float()
        subquad.attention(x, x, x, backend="matmul")
        assert not counting.calls
        subquad.attention(q, q, q, backend="matmul").sum().backward()
        assert [name for name, _ in counting.calls] == [
            "exp2_rows_bf16",
            "next_offsets",
            "online_update",
            "softmax_grad_rows_bf16",
        ]


def test_modes(native_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(_native, "_LOADED", {})
    monkeypatch.setenv("SUBQUAD_NATIVE_DIR", str(native_dir))
    monkeypatch.setenv("SUBQUAD_NATIVE", "off")
    assert _native.tile_kernel() is None
    assert _native.status().startswith("off (SUBQUAD_NATIVE=off); built at")
    monkeypatch.setattr(_native, "_LOADED", {})
    monkeypatch.setenv("SUBQUAD_NATIVE", "auto")
    assert _native.tile_kernel() is not None
    assert _native.status().startswith("built, used")
    # auto, nothing built: the eager passes, no build.
    monkeypatch.setattr(_native, "_LOADED", {})
    monkeypatch.setenv("SUBQUAD_NATIVE_DIR", str(tmp_path))
    assert _native.tile_kernel() is None
    assert "not built" in _native.status()
    assert not any(tmp_path.iterdir())
    monkeypatch.setenv("SUBQUAD_NATIVE", "sometimes")
    monkeypatch.setattr(_native, "_LOADED", {})
    with pytest.raises(ValueError, match="SUBQUAD_NATIVE must be one of auto, build, off, got 'sometimes'"):
        _native.tile_kernel()


def test_a_failed_build_warns_once_and_the_tiles_run_eager(tmp_path, monkeypatch):
    monkeypatch.setattr(_native, "_LOADED", {})
    monkeypatch.setenv("SUBQUAD_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("SUBQUAD_NATIVE", "build")
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    _machine.fake_cpu(monkeypatch, "avx512-bf16")  # bfloat16 products, the tiles' passes the kernel serves
    q = torch.randn(1, 2, 30, 32).to(BF16)
    with pytest.warns(UserWarning, match="the native tile kernel is not used"):
        out = subquad.attention(q, q, q, backend="matmul")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = subquad.attention(q, q, q, backend="matmul")  # decided once: no second warning
    torch.testing.assert_close(out, again, rtol=0, atol=0)
    golden = naive_attention(q.double(), q.double(), q.double())
    assert_close_to_golden(out, golden, naive_attention(q.float(), q.float(), q.float()).to(BF16))


def test_subquad_build_and_info(native_dir, monkeypatch, capsys):
    monkeypatch.setenv("SUBQUAD_NATIVE_DIR", str(native_dir))
    monkeypatch.setenv("SUBQUAD_NATIVE", "auto")
    monkeypatch.setattr(_native, "_LOADED", {})
    assert _cli.main(["build"]) == 0  # built by the fixture: found, not compiled again
    assert "native tile kernel: built, used" in capsys.readouterr().out
    assert _cli.main(["info", "--shape", "1,1,8,8"]) == 0
    assert "native tile kernel: built, used" in capsys.readouterr().out


def test_subquad_build_says_why_it_failed(tmp_path):
    env = {**os.environ, "SUBQUAD_NATIVE_DIR": str(tmp_path), "CXX": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "subquad", "build"], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("subquad build: the native kernel did not build: "), proc.stderr
