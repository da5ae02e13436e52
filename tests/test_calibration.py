"""The calibration (issue 56): ``auto`` takes the C++ loops before torch's fused kernel where they
were measured faster on this CPU, never by a constant from another machine.

No test here times anything: the measurement is replaced by injected ratios (loops / fused), and
each choice is checked both ways on every kind of CPU in tests/_machine.py, AMX included (the
measured figures decide there, not the AMX rule of the fallback).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Dict, List

import pytest
import torch

import subquad
from _machine import MACHINES, fake_cpu
from subquad import _cli
from subquad._backends import calibration

BUILDS_LOOPS = [n for n, m in MACHINES.items() if m.build is not None and m.float_lanes]


class Injected:
    """A measurement that returns given ratios (per kind, per shape index) and counts its rounds."""

    def __init__(self, ratios: Dict[str, List[float]]) -> None:
        self.ratios = ratios
        self.rounds = 0

    def __call__(self, dtype, training, shape, kind):
        self.rounds += 1
        ratios = self.ratios.get(kind, [1.0])  # a kind a test does not name: a tie
        return ratios[calibration.SHAPES[kind].index(shape)] * 1e-3, 1e-3


@pytest.fixture
def calibrated(monkeypatch, tmp_path):
    """Calibration on, its table in a temporary folder; ``install(ratios)`` injects the measurement."""
    monkeypatch.setenv("SUBQUAD_CALIBRATE", "1")
    monkeypatch.setenv("SUBQUAD_NATIVE_DIR", str(tmp_path))
    calibration.forget()
    yield_measure: List[Injected] = []

    def install(ratios):
        m = Injected(ratios)
        monkeypatch.setattr(calibration, "MEASURE", m)
        monkeypatch.setattr(calibration, "MEASURE_PRODUCTS", lambda which, shape: (1e-3, 1e-3))  # a tie
        if os.path.exists(calibration.path()):  # a new machine: nothing measured yet
            os.remove(calibration.path())
        calibration.forget()
        yield_measure.append(m)
        return m

    yield install
    calibration.forget()


WIN = {"self": [1.3, 0.7, 0.6, 0.6], "few-keys": [0.8], "wide": [0.85]}
LOSE = {"self": [1.3, 1.2, 1.1, 1.1], "few-keys": [1.2], "wide": [1.2]}


def _qkv(dtype, B=1, H=8, L=1024, E=64, Lk=None, grad=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, E, generator=g).to(dtype)
    k = torch.randn(B, H, Lk or L, E, generator=g).to(dtype)
    t = (q, k, k.clone())
    return tuple(x.requires_grad_() for x in t) if grad else t


def _dtypes(machine: str) -> List[torch.dtype]:
    m = MACHINES[machine]
    out = [torch.float32, torch.float16]
    if m.features.avx512_bf16 or m.features.amx_tiles:
        out.append(torch.bfloat16)
    return out


@pytest.mark.parametrize("machine", BUILDS_LOOPS)
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_the_measured_winner_is_taken_on_every_machine(calibrated, monkeypatch, machine, training):
    fake_cpu(monkeypatch, machine, kernel="stub")
    for dtype in _dtypes(machine):
        for outcome, ratios in (("loops", WIN), ("fused", LOSE)):
            calibrated(ratios)
            plan = subquad.explain(*_qkv(dtype, grad=training))
            assert plan.backend == outcome, f"{machine} {dtype} measured {ratios['self']}: {plan}"


def test_with_amx_the_loops_run_where_they_were_measured_faster(calibrated, monkeypatch):
    # The fallback never takes the loops on AMX; a calibration that measured them faster does.
    fake_cpu(monkeypatch, "amx", kernel="stub")
    monkeypatch.setenv("SUBQUAD_CALIBRATE", "0")
    assert subquad.explain(*_qkv(torch.bfloat16)).backend == "fused"
    monkeypatch.setenv("SUBQUAD_CALIBRATE", "1")
    calibrated(WIN)
    assert subquad.explain(*_qkv(torch.bfloat16)).backend == "loops"


def test_a_near_tie_stays_with_torchs_kernel(calibrated, monkeypatch):
    fake_cpu(monkeypatch, "avx512-bf16", kernel="stub")
    calibrated({"self": [0.97, 0.97, 0.97, 0.97], "few-keys": [0.97], "wide": [0.97], "mods": [0.97]})
    assert subquad.explain(*_qkv(torch.bfloat16)).backend == "fused"


def test_the_threshold_is_the_size_from_which_the_loops_won(calibrated, monkeypatch):
    fake_cpu(monkeypatch, "avx512-bf16", kernel="stub")
    calibrated({"self": [1.3, 0.8, 0.7, 0.7], "few-keys": [0.8], "wide": [0.8]})
    assert calibration.entry(torch.bfloat16, False).threshold == 8 * 512 * 512
    assert subquad.explain(*_qkv(torch.bfloat16, L=256)).backend == "fused"  # 2^19 scores
    assert subquad.explain(*_qkv(torch.bfloat16, L=512)).backend == "loops"  # 2^21
    # a loss at the largest size measured means no threshold: a win in the middle is noise
    calibrated({"self": [0.7, 0.8, 0.8, 1.1], "few-keys": [0.8], "wide": [0.8]})
    assert calibration.entry(torch.bfloat16, False).threshold is None
    assert subquad.explain(*_qkv(torch.bfloat16, L=2048)).backend == "fused"


@pytest.mark.parametrize("kind", ["few-keys", "wide"])
def test_each_kind_of_call_follows_its_own_measurement(calibrated, monkeypatch, kind):
    fake_cpu(monkeypatch, "avx512-bf16", kernel="stub")
    call = dict(Lk=77) if kind == "few-keys" else dict(H=1, E=512)
    for plain in (WIN, LOSE):  # whatever self-attention measured
        for won, outcome in ((0.7, "loops"), (1.1, "fused")):
            calibrated({**plain, kind: [won]})
            plan = subquad.explain(*_qkv(torch.bfloat16, L=4096, **call))
            assert plan.backend == outcome, (kind, won, str(plan))


def test_the_table_is_kept_and_reused_by_later_processes(calibrated, monkeypatch, tmp_path):
    fake_cpu(monkeypatch, "avx512-bf16", kernel="stub")
    m = calibrated(WIN)
    first = subquad.explain(*_qkv(torch.bfloat16)).backend
    rounds = m.rounds
    assert rounds > 0
    saved = json.loads(pathlib.Path(calibration.path()).read_text())
    assert "bfloat16/inference/%dt" % torch.get_num_threads() in saved
    calibration.forget()  # as a new process: reads the file, measures nothing
    again = Injected(LOSE)
    monkeypatch.setattr(calibration, "MEASURE", again)
    assert subquad.explain(*_qkv(torch.bfloat16)).backend == first == "loops"
    assert again.rounds == 0
    assert m.rounds == rounds


def test_calibration_off_measures_nothing_and_says_so(monkeypatch, tmp_path):
    fake_cpu(monkeypatch, "avx512-bf16", kernel="stub")
    monkeypatch.setenv("SUBQUAD_CALIBRATE", "off")
    monkeypatch.setenv("SUBQUAD_NATIVE_DIR", str(tmp_path))
    m = Injected(LOSE)
    monkeypatch.setattr(calibration, "MEASURE", m)
    calibration.forget()
    plan = subquad.explain(*_qkv(torch.bfloat16))
    assert plan.backend == "loops" and m.rounds == 0  # the fallback: no AMX, 2^23 bf16 scores
    assert any("fallback thresholds" in n for n in plan.notes), str(plan)


def test_no_kernel_no_calibration(calibrated, monkeypatch):
    fake_cpu(monkeypatch, "no-compiler", kernel="stub")
    m = calibrated(WIN)
    assert subquad.explain(*_qkv(torch.bfloat16)).backend == "fused"
    assert m.rounds == 0


def test_explain_quotes_what_was_measured_here(calibrated, monkeypatch):
    fake_cpu(monkeypatch, "avx512-bf16", kernel="stub")
    calibrated(WIN)
    plan = subquad.explain(*_qkv(torch.bfloat16))
    note = next(n for n in plan.notes if "native kernel" in n)
    assert "measured on this CPU at 0.60x its time" in note and "subquad calibrate" in note, note
    assert "EPYC" not in str(plan)


def test_subquad_calibrate_measures_again_and_info_prints_the_table(calibrated, monkeypatch, capsys):
    fake_cpu(monkeypatch, "avx512-bf16", kernel="stub")
    m = calibrated(WIN)
    assert _cli.main(["calibrate", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert m.rounds > 0 and "bfloat16" in out and "0.60" in out, out
    calibrated(LOSE)
    _cli.main(["calibrate", "--dtype", "bf16", "--inference"])
    _cli.print_calibration()
    out = capsys.readouterr().out
    assert "1.10" in out and "fused kernel" in out, out


def test_a_failing_measurement_leaves_the_fallback(calibrated, monkeypatch):
    fake_cpu(monkeypatch, "avx512-bf16", kernel="stub")

    def broken(dtype, training, shape, kind):
        raise RuntimeError("no memory")

    calibrated(WIN)
    monkeypatch.setattr(calibration, "MEASURE", broken)
    calibration.forget()
    plan = subquad.explain(*_qkv(torch.bfloat16))
    assert plan.backend == "loops" and any("fallback" in n for n in plan.notes)


# ----------------------------------------------------------------- the kernel reaching users
def test_subquad_install_builds_the_kernel_unless_off(monkeypatch, tmp_path, capsys):
    from _host_snapshots import fake_host
    from subquad import _native
    from subquad.integrations import comfyui

    built = []
    monkeypatch.setattr(_native, "build", lambda verbose=False: built.append(1))
    monkeypatch.setattr(_native, "compiler_found", lambda: True)
    monkeypatch.setattr(_native, "status", lambda: "built, used")
    fake_host(tmp_path / "comfyui", comfyui.MARKERS)
    monkeypatch.setenv("SUBQUAD_NATIVE", "auto")
    assert _cli.main(["install", "comfyui", str(tmp_path / "comfyui")]) == 0
    assert built == [1] and "native kernel: built, used" in capsys.readouterr().out
    monkeypatch.setenv("SUBQUAD_NATIVE", "off")
    assert _cli.main(["install", "comfyui", str(tmp_path / "comfyui")]) == 0
    assert built == [1] and "SUBQUAD_NATIVE=off" in capsys.readouterr().out
    monkeypatch.setenv("SUBQUAD_NATIVE", "auto")
    monkeypatch.setattr(_native, "compiler_found", lambda: False)
    assert _cli.main(["install", "comfyui", str(tmp_path / "comfyui")]) == 0
    assert built == [1] and "no C++ compiler" in capsys.readouterr().out

    def fails(verbose=False):
        raise RuntimeError("ninja is required")

    monkeypatch.setattr(_native, "compiler_found", lambda: True)
    monkeypatch.setattr(_native, "build", fails)
    assert _cli.main(["install", "comfyui", str(tmp_path / "comfyui")]) == 0, "a failed build is no failed install"
    assert "not built (RuntimeError: ninja is required)" in capsys.readouterr().out


def test_hosts_build_the_kernel_in_the_background_once(monkeypatch, tmp_path):
    import subprocess

    from subquad import _native
    from subquad.integrations import a1111

    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a[0]))
    monkeypatch.setenv("SUBQUAD_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(_native, "compiler_found", lambda: True)
    monkeypatch.setenv("SUBQUAD_NATIVE", "off")
    assert not _native.build_in_background() and not started
    monkeypatch.setenv("SUBQUAD_NATIVE", "auto")
    assert a1111.prepare_native() and len(started) == 1 and "build" in started[0][-1]
    assert not _native.build_in_background(), "one build at a time"
    assert len(started) == 1
    (tmp_path / f"{_native.build_name()}.building").unlink()
    lib = tmp_path / _native.build_name() / f"{_native.build_name()}.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    assert not _native.build_in_background(), "built already"
    assert "prepare_native()" in a1111._files()["scripts/subquad_optimization.py"]


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_alibi_and_windows_follow_their_own_measurement(calibrated, monkeypatch, training):
    # The loops evaluate ALiBi and windows themselves while the fused kernel adds a bias tile: they
    # are measured as a kind of their own, and the plain calls' verdict does not decide them.
    from subquad import mods

    fake_cpu(monkeypatch, "amx", kernel="stub")
    q, k, v = _qkv(torch.bfloat16, H=8, L=1024, grad=training)
    for mods_ratio, plain, outcome in ((0.5, LOSE, "loops"), (1.2, WIN, "fused")):
        calibrated({**plain, "mods": [mods_ratio]})
        for kw in (dict(score_mod=mods.alibi(8), is_causal=True), dict(mask_mod=mods.sliding_window(128, causal=True))):
            plan = subquad.explain(q, k, v, **kw)
            assert plan.backend == outcome, (mods_ratio, kw, str(plan))
        assert subquad.explain(q, k, v).backend == ("loops" if plain is WIN else "fused")


def test_a_calibration_made_while_the_machine_was_busy_is_not_kept(calibrated, monkeypatch, capsys):
    # Rounds that disagree (another process on the cores) keep nothing: the fallback decides, and
    # the next need after RETRY_AFTER_S measures again; `subquad calibrate` says so.
    fake_cpu(monkeypatch, "avx512-bf16", kernel="stub")
    clock = [100.0]
    monkeypatch.setattr(calibration.time, "monotonic", lambda: clock[0])
    m = calibrated(WIN)
    noisy = iter([0.5, 1.0, 2.0, 4.0] * 100)  # no two rounds within 20%
    monkeypatch.setattr(calibration, "MEASURE", lambda d, t, s, k: (next(noisy) * 1e-3, 1e-3))
    plan = subquad.explain(*_qkv(torch.bfloat16))
    assert any("fallback" in n for n in plan.notes) and not os.path.exists(calibration.path())
    monkeypatch.setattr(calibration, "MEASURE", m)
    subquad.explain(*_qkv(torch.bfloat16))
    assert m.rounds == 0, "measured again at once"
    clock[0] += calibration.RETRY_AFTER_S
    assert subquad.explain(*_qkv(torch.bfloat16)).backend == "loops" and m.rounds > 0
    monkeypatch.setattr(calibration, "MEASURE", lambda d, t, s, k: (next(noisy) * 1e-3, 1e-3))
    assert _cli.main(["calibrate", "--dtype", "bf16", "--inference"]) == 1
    assert "the machine is busy" in capsys.readouterr().err


def test_no_calibration_while_tracing_or_under_a_dispatch_mode(calibrated, monkeypatch):
    # Under fake tensors or torch.compile's tracing the calls would time nothing real: the
    # fallback decides, and nothing is measured or kept.
    from _devices import OpRecorder

    fake_cpu(monkeypatch, "avx512-bf16", kernel="stub")
    m = calibrated(LOSE)
    with OpRecorder():
        assert calibration.entry(torch.bfloat16, False) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert calibration.entry(torch.bfloat16, False) is None
    assert m.rounds == 0 and not os.path.exists(calibration.path())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert calibration.entry(torch.bfloat16, False) is not None and m.rounds > 0


def test_the_measurement_runs_inside_the_callers_inference_mode(monkeypatch):
    # A first need inside torch.inference_mode(): the training rounds still record gradients.
    from subquad import _calibrate

    calls = []
    monkeypatch.setattr(
        _calibrate, "attention", lambda q, k, v, backend, **kw: calls.append(torch.is_grad_enabled()) or (q * k.sum())
    )
    _calibrate._INPUTS.clear()
    with torch.inference_mode():
        loops, fused = _calibrate.measure(torch.float32, True, (2, 8, 8, 4), "self")
    assert loops > 0 and fused > 0 and calls and all(calls)
