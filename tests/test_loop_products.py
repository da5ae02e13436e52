"""The C++ loops' products on ATen's CPU BLAS micro-kernels (issue 56, item 3).

The loops multiply either on their own micro-kernels or on ``at::native::cpublas::brgemm`` (oneDNN's:
AMX tiles where the CPU has them). Which one runs is measured here, per kind of products
(:func:`subquad._backends.calibration.calibrate_products`), or without a measurement decided by the
fallback (ATen's bfloat16 products where the CPU has AMX tiles). No test times anything: the
choice is checked with injected times and a stand-in kernel on every kind of CPU; the products
themselves with the session's build, both ways, against the float64 golden (the loops ran: their
calls are recorded).
"""

from __future__ import annotations

import json
import pathlib
from typing import Dict, List, Tuple

import pytest
import torch

import subquad
import test_native
from _machine import MACHINES, fake_cpu
from subquad import _cli, _native
from subquad._backends import calibration
from test_native_loop_mods import LOOPS, _check, _inputs


class SwitchKernel:
    """A stand-in for the kernel's products switch: ``works`` says whether ATen's micro-kernels run
    here; ``set`` records each setting."""

    def __init__(self, works: bool = True) -> None:
        self.works = works
        self.state = {"float32": False, "bfloat16": False}
        self.set: List[Tuple[str, bool]] = []

    def aten_products_work(self, which: str) -> bool:
        return self.works

    def set_products(self, which: str, aten: bool) -> None:
        assert self.works or not aten, "set to ATen's where they do not run"
        self.state[which] = aten
        self.set.append((which, aten))

    def products(self, which: str) -> str:
        return "aten" if self.state[which] else "own"


class Timed:
    """An injected measurement: ATen's time is ``ratio`` times the loops' own; rounds counted."""

    def __init__(self, ratio: float) -> None:
        self.ratio, self.rounds = ratio, 0

    def __call__(self, which: str, shape) -> Tuple[float, float]:
        self.rounds += 1
        return self.ratio * 1e-3, 1e-3


@pytest.fixture
def switch(monkeypatch, tmp_path):
    """Calibration on, its table in a temporary folder, the stand-in kernel loaded."""
    monkeypatch.setenv("SUBQUAD_CALIBRATE", "1")
    monkeypatch.setenv("SUBQUAD_NATIVE_DIR", str(tmp_path))
    calibration.forget()
    kernel = SwitchKernel()
    monkeypatch.setitem(_native._LOADED, "module", kernel)
    yield kernel
    calibration.forget()


@pytest.mark.parametrize("machine", [n for n, m in MACHINES.items() if m.build is not None])
@pytest.mark.parametrize("which", calibration.PRODUCT_KINDS)
def test_the_measured_products_are_taken_on_every_machine(switch, monkeypatch, machine, which):
    fake_cpu(monkeypatch, machine)
    for ratio, aten in ((0.5, True), (0.97, False), (1.4, False)):  # a near tie keeps the loops' own
        calibration.forget()
        monkeypatch.setattr(calibration, "MEASURE_PRODUCTS", Timed(ratio))
        found = calibration.calibrate_products(which)
        assert found is not None and found.aten is aten and found.ratio == ratio
        assert switch.state[which] is aten, (machine, which, ratio)
        assert calibration.products_choice(which)[0] is aten


def test_without_a_measurement_the_fallback_takes_atens_bfloat16_products_on_amx(switch, monkeypatch):
    monkeypatch.setattr(calibration, "MEASURE_PRODUCTS", Timed(0.5))
    for off in ("0", "1"):  # calibration off, or on but nothing measured yet
        monkeypatch.setenv("SUBQUAD_CALIBRATE", off)
        fake_cpu(monkeypatch, "amx")
        assert calibration.products_choice("bfloat16") == (
            True,
            "ATen's micro-kernels (fallback: AMX tiles, not measured)",
        )
        assert calibration.products_choice("float32")[0] is False
        fake_cpu(monkeypatch, "avx512-bf16")
        assert calibration.products_choice("bfloat16")[0] is False
    calibration.apply_products(switch)
    assert switch.state == {"float32": False, "bfloat16": False}


def test_the_kernel_is_set_when_it_loads(monkeypatch, tmp_path):
    monkeypatch.setenv("SUBQUAD_CALIBRATE", "0")
    monkeypatch.setenv("SUBQUAD_NATIVE", "auto")
    fake_cpu(monkeypatch, "amx")
    kernel = SwitchKernel()
    monkeypatch.setattr(_native, "_LOADED", {})
    monkeypatch.setattr(_native, "_library", lambda: tmp_path / "built.so")
    (tmp_path / "built.so").write_text("")
    monkeypatch.setattr(_native, "_import", lambda path: kernel)
    assert _native.tile_kernel() is kernel
    assert kernel.state == {"float32": False, "bfloat16": True}


def test_where_atens_do_not_run_nothing_is_measured_or_set(switch, monkeypatch):
    switch.works = False
    timed = Timed(0.1)
    monkeypatch.setattr(calibration, "MEASURE_PRODUCTS", timed)
    fake_cpu(monkeypatch, "amx")
    assert calibration.calibrate_products("bfloat16") is None and timed.rounds == 0
    assert calibration.products_choice("bfloat16")[0] is False
    calibration.apply_products(switch)
    assert switch.set == []


def test_the_products_are_kept_and_reused_by_later_processes(switch, monkeypatch):
    fake_cpu(monkeypatch, "avx512-bf16")
    first = Timed(0.6)
    monkeypatch.setattr(calibration, "MEASURE_PRODUCTS", first)
    calibration.calibrate_products("bfloat16")
    saved = json.loads(pathlib.Path(calibration.path()).read_text())
    key = f"products/bfloat16/{torch.get_num_threads()}t"
    assert saved[key]["ratio"] == 0.6
    calibration.forget()  # as a new process: reads the file
    switch.state["bfloat16"] = False
    again = Timed(2.0)
    monkeypatch.setattr(calibration, "MEASURE_PRODUCTS", again)
    calibration.apply_products(switch)
    assert switch.state["bfloat16"] is True and again.rounds == 0


def test_the_loops_are_calibrated_on_the_products_chosen_first(switch, monkeypatch):
    # The loops-against-fused rounds run after the products are set: their ratios are the loops'
    # on the products they will use.
    fake_cpu(monkeypatch, "avx512-bf16")
    seen: List[str] = []
    monkeypatch.setattr(calibration, "MEASURE_PRODUCTS", Timed(0.5))

    def loops(dtype, training, shape, kind):
        seen.append(switch.products("bfloat16"))
        return 0.5e-3, 1e-3

    monkeypatch.setattr(calibration, "MEASURE", loops)
    calibration.calibrate(torch.bfloat16, False)
    assert seen and set(seen) == {"aten"}


def test_unsettled_rounds_keep_nothing(switch, monkeypatch):
    fake_cpu(monkeypatch, "avx512-bf16")
    ratios = iter([2.0**i for i in range(20)])  # no majority of the rounds within SPREAD
    monkeypatch.setattr(calibration, "MEASURE_PRODUCTS", lambda which, shape: (next(ratios) * 1e-3, 1e-3))
    with pytest.raises(calibration.Unsettled, match="bfloat16 products"):
        calibration.calibrate_products("bfloat16")
    assert calibration.products_table() == {} and switch.set == []


def test_subquad_calibrate_and_info_say_what_the_loops_multiply_on(switch, monkeypatch, capsys):
    fake_cpu(monkeypatch, "avx512-bf16")
    monkeypatch.setattr(calibration, "MEASURE_PRODUCTS", Timed(0.5))
    monkeypatch.setattr(calibration, "MEASURE", lambda dtype, training, shape, kind: (1e-3, 1e-3))
    monkeypatch.setattr(switch, "forward_segment_bf16", None, raising=False)
    assert _cli.main(["calibrate", "--dtype", "bf16", "--inference"]) == 0
    out = capsys.readouterr().out
    assert "bfloat16 loops' products" in out and "ATen's micro-kernels; ATen/own 0.50" in out, out
    _cli.print_calibration()
    out = capsys.readouterr().out
    assert "bfloat16 loops' products: ATen's micro-kernels (measured: ATen's at 0.50x" in out, out


# ------------------------------------------------------------------ the session's build, both ways


@pytest.fixture
def products_both_ways(native_dir, monkeypatch):
    """The session's build with its loops' calls recorded; yields a setter of its products and
    restores what it ran on."""
    real = test_native.load_kernel(native_dir, monkeypatch)
    if not hasattr(real, "set_products"):
        pytest.skip("the native kernel was built without the products switch")
    counting = test_native.Counting(_native._LOADED["module"], real)
    monkeypatch.setitem(_native._LOADED, "module", counting)
    before = {w: real.products(w) == "aten" for w in calibration.PRODUCT_KINDS}
    yield real, counting
    for w, aten in before.items():
        real.set_products(w, aten)


CASES = [
    "ALiBi, causal, head dim 59",
    "ALiBi, GQA 8/2, head dim 111, slopes of one sign and another",
    "sliding window 5 in segments of 48 x 100",
    "ALiBi in a causal window of 100, a bool attn_mask too",
]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32, torch.float16), ids=str)
@pytest.mark.parametrize("name", CASES)
def test_atens_products_run_the_loops_and_match_float64(products_both_ways, dtype, name):
    real, counting = products_both_ways
    which = calibration.products_of(dtype)
    if not real.aten_products_work(which):
        pytest.skip(f"ATen's micro-kernels do not run the {which} products here")
    suffix = LOOPS[dtype]
    if not hasattr(real, f"forward_segment_{suffix}"):
        pytest.skip(f"the native kernel was built without forward_segment_{suffix}")
    results: Dict[bool, Tuple[torch.Tensor, ...]] = {}
    for aten in (True, False):
        real.set_products(which, aten)
        assert real.products(which) == ("aten" if aten else "own")
        counting.calls.clear()
        q, k, v, d_out, kw, chunk = _inputs(name, dtype, 7)
        out = subquad.attention(q, k, v, backend="loops", chunk_size=chunk, **kw)
        grads = torch.autograd.grad(out, (q, k, v), d_out)
        assert set(counting.names) == {f"forward_segment_{suffix}", f"backward_segment_{suffix}"}, counting.names
        _check(q, k, v, d_out, out, grads, kw)
        results[aten] = (out, *grads)
    for a, b in zip(results[True], results[False]):  # the same products, summed perhaps in another order
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2 if dtype != torch.float32 else 1e-5, rtol=1e-2)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
def test_atens_products_run_packed_sequences(products_both_ways, dtype):
    real, counting = products_both_ways
    which = calibration.products_of(dtype)
    if not real.aten_products_work(which) or not hasattr(real, f"forward_packed_{LOOPS[dtype]}"):
        pytest.skip("no packed loop or no ATen products here")
    real.set_products(which, True)
    lengths = [37, 1, 130, 64]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(lengths), 4, 59, generator=g).to(dtype) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = subquad.varlen_attention(q, k, v, cu, cu, is_causal=True, backend="loops")
    assert f"forward_packed_{LOOPS[dtype]}" in counting.names, counting.names
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(t[s:e].transpose(0, 1).double() for t in (q, k, v)), is_causal=True
        ).transpose(0, 1)
        torch.testing.assert_close(out[s:e].double(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)


def test_the_switch_refuses_a_kind_it_does_not_know(products_both_ways):
    real, _ = products_both_ways
    with pytest.raises(RuntimeError, match=r"which: 'float32'.*'bfloat16'"):
        real.set_products("float16", True)
