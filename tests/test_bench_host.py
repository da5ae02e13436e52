"""What "Which attention? (subquad)" decides and shows, and ``subquad bench --host``'s command line,
without ComfyUI: injected timings and memory, fake candidates, simulated CUDA and MPS meters.

The node's verdicts (``_which.verdicts``) are read by the bench's rule (``compare_paired``, which
lives below both in ``subquad._verdicts``); the first test checks that its words say what the
bench's verdicts say.
"""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from subquad.bench import cli, host_comfyui, timing
from subquad.integrations.comfyui import _which
from subquad.integrations.comfyui._which import SAME, Candidate, Row, Setting, Which


def _bench_verdicts(samples):
    """bench.timing's verdicts per name: fastest, same, slower or undecided."""
    out = {}
    best = min(samples, key=lambda k: statistics.median(samples[k]))
    for name, times in samples.items():
        if name == best:
            continue
        c = timing.compare_paired(name, times, best, samples[best])
        undecided = c.verdict == timing.SAME and c.ratio > 1 + timing.PRACTICAL
        out[name] = "undecided" if undecided else c.verdict
    return out


@pytest.mark.parametrize("rounds", [2, 3, 6, 9, 14])
def test_node_verdicts_agree_with_bench_timing(rounds):
    rng = random.Random(rounds)
    assert _which.compare_paired is timing.compare_paired, "one rule, not a copy"
    for trial in range(60):
        factors = {"a": 1.0, "b": rng.choice([1.0, 1.02, 1.05, 1.3, 2.0]), "c": rng.choice([1.0, 1.1, 3.0])}
        noise = rng.choice([0.001, 0.03, 0.2])
        samples = {
            k: [f * (1 + rng.uniform(-noise, noise)) * (1 + 0.1 * r) for r in range(rounds)] for k, f in factors.items()
        }
        ours = _which.verdicts(samples)
        theirs = _bench_verdicts(samples)
        for name, verdict in theirs.items():
            word = "slower" if verdict == "slower" else SAME if verdict == SAME else "undecided"
            assert word in ours[name], (trial, name, ours, theirs)


def _row(name, times, peak=1 << 20, status="ok", over=False):
    return Row(name, "step", status=status, times=list(times), peak_bytes=peak, over_cap=over)


def test_recommendation_is_the_fastest_within_the_cap():
    rows = [
        _row("fast but hungry", [1.0] * 8, peak=8 << 30, over=True),
        _row("second", [2.0, 2.01, 1.99, 2.0, 2.02, 1.98, 2.0, 2.0]),
        _row("slowest", [4.0] * 8, peak=1),
        _row("broken", [], status="error"),
    ]
    assert _which.recommend(rows) == "second"
    rows[0].over_cap = False
    assert _which.recommend(rows) == "fast but hungry"
    assert _which.recommend([r for r in rows if r.name == "broken"]) is None


def test_a_tie_within_noise_goes_to_the_smaller_memory_and_is_said():
    times = [1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0, 1.0]
    rows = [_row("a", times, peak=900 << 20), _row("b", [t * 1.005 for t in times[::-1]], peak=100 << 20)]
    verdicts = _which.verdicts({r.name: r.times for r in rows})
    for r in rows:
        r.verdict = verdicts[r.name]
    assert set(verdicts.values()) == {"fastest", SAME}
    assert _which.recommend(rows) == "b"
    which = Which(rows, "b", "64x64 px", "process RSS high-water mark", {"step": "a"})
    text = _which.table(which)
    assert f"recommended: b ({SAME} as a; of those it needs the least memory)" in text


class FakeClock:
    """Time that passes only when a fake candidate runs: each adds its own seconds."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_run_part_times_reports_failures_and_measures_differences():
    clock = FakeClock()

    def attention(seconds, value=1.0, error=None):
        def run():
            if error is not None:
                raise error
            clock.now += seconds
            return torch.full((2, 3), value)

        return run

    candidates = [
        Candidate("pytorch", "step", attention(0.2)),
        Candidate("subquad", "step", attention(0.1, value=1.001)),
        Candidate("hungry", "step", attention(0.0, error=torch.OutOfMemoryError("CUDA out of memory"))),
        Candidate("broken", "step", attention(0.0, error=RuntimeError("no kernel"))),
        Candidate("refuses", "step", attention(0.0, error=NotImplementedError("not on this device"))),
    ]
    ticks = []
    rows, reference = _which.run_part(
        candidates, lambda c: c.fn, lambda fn: fn(), Setting(rounds=6, clock=clock), lambda: ticks.append(1)
    )
    by = {r.name: r for r in rows}
    assert reference == "pytorch"
    assert [by[n].status for n in ("hungry", "broken", "refuses")] == ["out of memory", "error", "refused"]
    assert "no kernel" in by["broken"].reason
    assert by["subquad"].times == pytest.approx([0.1] * 6) and by["pytorch"].times == pytest.approx([0.2] * 6)
    assert by["subquad"].verdict == "fastest" and by["pytorch"].verdict == "2.00x slower"
    assert by["subquad"].diff == pytest.approx(1e-3, rel=1e-2) and by["pytorch"].diff == 0
    assert len(ticks) == 5 + 2 * 6
    assert _which.recommend(rows) == "subquad"


def test_orders_put_every_candidate_everywhere():
    orders = _which.orders(["a", "b", "c"], 6)
    for name in "abc":
        assert {order.index(name) for order in orders} == {0, 1, 2}
    assert _which.orders([], 3) == [[], [], []]


def test_cuda_meter_reads_the_allocator_peak(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 100)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1100)
    meter = _which.Meter(torch.device("cuda"))
    assert "CUDA allocator peak" in meter.method
    meter.start()
    assert meter.stop() == 1000 and calls == ["sync", "reset", "sync"]


def test_mps_meter_reads_driver_memory_after_an_emptied_cache(monkeypatch):
    memory = [500]
    monkeypatch.setattr(torch.mps, "synchronize", lambda: None)
    monkeypatch.setattr(torch.mps, "empty_cache", lambda: memory.__setitem__(0, 200))
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: memory[0])
    meter = _which.Meter(torch.device("mps"))
    assert "MPS driver memory" in meter.method
    meter.start()
    memory[0] = 1200
    assert meter.stop() == 1000


def test_cpu_meter_sees_a_large_allocation():
    meter = _which.Meter(torch.device("cpu"))
    if not meter.method:
        pytest.skip("no RSS high-water mark on this system")
    meter.start()
    x = torch.ones(64 << 20, dtype=torch.uint8)
    peak = meter.stop()
    del x
    assert peak is not None and peak >= 60 << 20


def _which_result():
    rows = [
        _row("subquad", [0.1] * 6, peak=50 << 20),
        _row("pytorch", [0.2] * 6, peak=900 << 20, over=True),
        Row("xformers", "step", status="error", reason="ImportError: no xformers"),
        Row("subquad", "VAE decode", times=[0.05] * 6, peak_bytes=10 << 20),
    ]
    for part in ("step", "VAE decode"):
        marks = _which.verdicts({r.name: r.times for r in rows if r.part == part and r.times})
        for r in rows:
            if r.part == part and r.name in marks:
                r.verdict = marks[r.name]
    return Which(rows, "subquad", "512x512 px, on cpu", "process RSS high-water mark", {"step": "pytorch"}, 512 << 20)


def test_table_and_chart_say_what_ran_and_what_did_not():
    which = _which_result()
    text = _which.table(which)
    assert "memory cap: 512.0 MiB" in text and "over the cap" in text
    assert "step, xformers: error: ImportError: no xformers" in text
    assert "<< recommended" in text and "VAE decode" in text
    image = _which.chart(which)
    assert image.dtype == torch.float32 and image.shape[0] == 1 and image.shape[-1] == 3
    assert 0.0 <= float(image.min()) and float(image.max()) <= 1.0 and image.shape[1] > 300


def test_records_are_bench_model_results():
    records = host_comfyui.records(_which_result(), "tiny", 512, 1)
    assert [(r.impl, r.mode, r.status) for r in records] == [
        ("subquad", "step", "ok"),
        ("pytorch", "step", "ok"),
        ("xformers", "step", "error"),
        ("subquad", "VAE decode", "ok"),
    ]
    assert records[0].median_ms == pytest.approx(100) and records[1].over_cap is True
    assert records[0].times_ms == pytest.approx([100] * 6) and records[0].device == "cpu"


def _usage(capsys, *argv):
    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv))
    return exited.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def comfyui_folder(tmp_path):
    for marker in ("main.py", "nodes.py", "comfy/model_management.py", "custom_nodes", "models/checkpoints"):
        path = tmp_path / marker
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("") if path.suffix else path.mkdir(exist_ok=True)
    return tmp_path


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--host", "a1111", "."], "--host a1111: the host that can be benchmarked is comfyui"),
        (["--host", "comfyui", "/nonexistent/ComfyUI"], "is not a folder"),
        (
            ["--host", "comfyui", "ROOT", "--checkpoint", "missing.safetensors"],
            "--checkpoint missing.safetensors: not in",
        ),
        (["--host", "comfyui", "ROOT", "--resolution", "512", "1024"], "--host takes one --resolution"),
        (["--host", "comfyui", "ROOT", "--resolution", "100"], "--resolution 100: a multiple of 8"),
        (["--host", "comfyui", "ROOT", "--model", "sd15-unet-small"], "--model not supported with --host"),
        (["--checkpoint", "x.safetensors"], "--checkpoint needs --host comfyui PATH"),
        (["--host", "comfyui", "ROOT", "--compare", "/nonexistent.json"], "--compare /nonexistent.json: no such file"),
    ],
    ids=["host", "path", "checkpoint", "resolutions", "resolution", "model", "checkpoint-alone", "compare"],
)
def test_usage_errors_exit_2_with_one_line_before_anything_runs(comfyui_folder, capsys, argv, message):
    argv = [str(comfyui_folder) if a == "ROOT" else a for a in argv]
    status, lines = _usage(capsys, *argv)
    assert status == 2 and len(lines) == 1 and message in lines[0], lines


def test_a_folder_that_is_not_comfyui_is_refused(tmp_path, capsys):
    status, lines = _usage(capsys, "--host", "comfyui", str(tmp_path))
    assert status == 2 and "does not look like ComfyUI" in lines[0], lines


def test_cli_returns_1_when_the_child_fails(comfyui_folder, monkeypatch, capsys):
    monkeypatch.setattr(host_comfyui, "run", lambda args, checked: None)
    assert cli.main(["--host", "comfyui", str(comfyui_folder), "--resolution", "64"]) == 1
