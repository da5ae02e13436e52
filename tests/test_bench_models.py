"""Tests of ``subquad bench --model`` at tiny sizes: every field of results.json, the CSV, the
plots, the --max-memory logic and the usage errors. No timing is asserted. Skipped where
diffusers or transformers is missing (``pip install 'subquad[diffusers,transformers]'``).
"""

import csv
import importlib.util
import json

import pytest
import torch

from subquad.bench import cli, model_measure, model_report, models
from subquad.bench.model_impls import impls_for

HAVE_DIFFUSERS = importlib.util.find_spec("diffusers") is not None
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_diffusers = pytest.mark.skipif(not HAVE_DIFFUSERS, reason="diffusers is not installed")
needs_transformers = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed")


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """Tiny models run on one thread (here and in workers): a second thread only adds barrier
    waits, which on a busy 2-core machine made a 32 px UNet step 3 s instead of 0.08 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(threads)


def run(args, capsys):
    code = cli.main(args)
    return code, capsys.readouterr()


def check_records(out, model, modes, impls, size, unit):
    records = json.loads((out / "results.json").read_text())
    assert {(r["mode"], r["impl"]) for r in records} == {(m, i) for m in modes for i in impls}
    for rec in records:
        assert set(model_report.REQUIRED_FIELDS) <= set(rec)
        assert rec["model"] == model and rec["size"] == size and rec["size_unit"] == unit
        assert rec["status"] in model_measure.STATUSES
        assert rec["device_name"] and rec["torch_version"] and rec["dtype"] == "fp32"
        if rec["status"] != "ok":
            assert rec["reason"] and rec["median_ms"] is None
            continue
        assert rec["rounds"] == 2 and len(rec["times_ms"]) == 2
        assert rec["q1_ms"] <= rec["median_ms"] <= rec["q3_ms"]
        assert rec["peak_bytes"] >= 0 and rec["weights_bytes"] > 0
        assert rec["memory_method"] and rec["memory_step_ms"] > 0
        assert rec["output_abs_max"] > 0
        # The same weights and inputs everywhere: only the attention differs, by rounding.
        assert rec["max_abs_diff"] <= 1e-3 * max(1.0, rec["output_abs_max"]), rec
    assert all(r["max_abs_diff"] == 0.0 for r in records if r["impl"] == "sdpa")
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == len(records) and "total_bytes" in rows[0]
    if HAVE_MATPLOTLIB:
        for name in ("memory.png", "time.png"):
            assert (out / name).stat().st_size > 1000
    return {(r["mode"], r["impl"]): r for r in records}


@needs_diffusers
def test_sd15_unet_small_infer(tmp_path, capsys):
    out = tmp_path / "unet"
    code, captured = run(
        [
            "--model",
            "sd15-unet-small",
            "--task",
            "infer",
            "--resolution",
            "32",
            "--rounds",
            "2",
            "--in-process",
            "--budget",
            "64MiB",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert code == 0
    by = check_records(
        out, "sd15-unet-small", ["infer"], ["classic", "sdpa", "sliced", "xformers", "subquad"], 32, "px"
    )
    assert by[("infer", "subquad")]["status"] == "ok" and by[("infer", "subquad")]["budget"] == "64MiB"
    assert by[("infer", "classic")]["status"] == "ok"
    assert "== sd15-unet-small infer 32 px" in captured.out and "verdict:" in captured.out


@needs_transformers
def test_llama_small_train(tmp_path, capsys):
    out = tmp_path / "llama"
    code, _captured = run(
        [
            "--model",
            "llama-small",
            "--task",
            "train",
            "--seq-len",
            "24",
            "--rounds",
            "2",
            "--in-process",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert code == 0
    by = check_records(out, "llama-small", ["train"], ["eager", "sdpa", "flex_attention", "subquad"], 24, "tokens")
    assert by[("train", "flex_attention")]["status"] == "unsupported"
    assert "no backward on CPU" in by[("train", "flex_attention")]["reason"]
    for impl in ("eager", "sdpa", "subquad"):
        assert by[("train", impl)]["status"] == "ok"


@needs_transformers
def test_llama_small_prefill_and_decode(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(models, "DECODE_TOKENS", 3)  # the loop's length does not change the code path
    out = tmp_path / "decode"
    code, _ = run(
        [
            "--model",
            "llama-small",
            "--seq-len",
            "16",
            "--rounds",
            "2",
            "--in-process",
            "--impl",
            "sdpa",
            "subquad",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert code == 0
    by = check_records(out, "llama-small", ["prefill", "decode"], ["sdpa", "subquad"], 16, "tokens")
    assert all(r["status"] == "ok" for r in by.values())


@needs_diffusers
def test_a_fresh_worker_measures_the_step(tmp_path):
    spec = models.spec("sd-vae-decoder-small")
    (r,) = model_measure.run_model_bench(spec, [16], "infer", impls_for(spec, ["sdpa"]), rounds=0)
    assert r.status == "ok", r.reason
    assert r.memory_method == "cpu VmHWM - VmRSS" and r.peak_bytes > 0 and r.max_abs_diff == 0.0
    assert r.median_ms is None and r.memory_step_ms > 0  # --rounds 0: the worker's step only


class FakeWorker:
    """A memory worker whose step needs ``size**2`` KiB for "classic" and a tenth of it for the
    others, and dies of memory past 48 px for "classic"."""

    def run(self, job):
        kib = job["size"] ** 2 * (1 if job["impl"] == "classic" else 0.1)
        if job["impl"] == "classic" and job["size"] > 48:
            return {"status": "oom", "reason": "the worker was killed by SIGKILL"}
        return {
            "status": "ok",
            "peak_bytes": int(kib * 1024),
            "weights_bytes": 1 << 20,
            "memory_step_ms": 1.0,
            "memory_method": "fake",
            "output_abs_max": 1.0,
        }

    def close(self):
        pass


@needs_diffusers
def test_max_memory_stops_each_implementation_at_the_cap():
    spec = models.spec("sd15-unet-small")
    results = model_measure.run_model_bench(
        spec,
        [64, 16, 32, 48],
        "infer",
        impls_for(spec, ["classic", "sdpa"]),
        rounds=0,
        cap_bytes=(1 << 20) + 800 * 1024,
        worker_cls=FakeWorker,
    )
    by = {(r.impl, r.size): r for r in results}
    assert [r.size for r in results if r.impl == "sdpa"] == [16, 32, 48, 64]  # smallest first
    assert by["classic", 32].status == "ok" and by["classic", 32].over_cap
    assert by["classic", 48].status == "skipped" and by["classic", 64].status == "skipped"
    assert all(not by["sdpa", s].over_cap for s in (16, 32, 48, 64))
    (line,) = model_report.max_memory_lines(results)
    assert "classic up to 16 px" in line and "sdpa up to 64 px (the largest tried)" in line


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nosuch"], "Unknown model 'nosuch'"),
        (["--model", "sd15-unet-small", "--resolution", "100"], "multiple of 8"),
        (["--model", "sd15-unet-small", "--seq-len", "128"], "--seq-len does not apply"),
        (["--model", "llama-small", "--resolution", "256"], "--resolution does not apply"),
        (["--model", "llama-small", "--impl", "classic"], "matches no implementation for llama-small"),
        (["--model", "sd15-unet-small", "--max-memory", "lots"], "--max-memory 'lots'"),
        (["--resolution", "512"], "--resolution needs --model"),
    ],
    ids=[
        "unknown-model",
        "resolution-not-multiple-of-8",
        "seq-len-for-unet",
        "resolution-for-llama",
        "impl-of-the-other-library",
        "bad-cap",
        "resolution-without-model",
    ],
)
def test_usage_errors(args, message, capsys):
    if ("llama" in " ".join(args) and not HAVE_TRANSFORMERS) or ("unet" in " ".join(args) and not HAVE_DIFFUSERS):
        pytest.skip("needs the model's library")
    with pytest.raises(SystemExit) as info:
        cli.main(args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_library_names_the_extra(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "diffusers" else real(name, *a))
    with pytest.raises(SystemExit):
        cli.main(["--model", "sd-vae-decoder"])
    assert "pip install 'subquad[diffusers]'" in capsys.readouterr().err
    with pytest.raises(models.MissingDependency, match=r"subquad\[diffusers\]"):
        models.build(models.spec("sd-vae-decoder-small"))


def test_every_model_has_a_small_variant_with_its_block_structure():
    for name, spec in models.MODELS.items():
        small = name if name.endswith("-small") else (name.replace("-1b", "") + "-small")
        assert small in models.MODELS, name
        if spec.family in ("unet", "vae"):
            big = models.MODELS[small.removesuffix("-small")] if small != name else spec
            assert spec.config["down_block_types"] == big.config["down_block_types"]
    assert models.modes(models.spec("sd15-unet"), "train") == ("train-lora", "train-full")
    assert models.modes(models.spec("llama-1b"), "infer") == ("prefill", "decode")


def _model_rows(times: dict, machine: float = 1.0, seed: int = 0) -> list:
    """Fake --model results: per-round times (ms) of each implementation, with 5% noise per call
    and a shared per-round drift, scaled by ``machine`` (a run on a slower or faster machine)."""
    import random
    import statistics

    rng = random.Random(seed)
    drift = [rng.uniform(0.8, 1.2) for _ in range(8)]
    rows = []
    for impl, ms in times.items():
        ts = [ms * machine * d * rng.uniform(0.95, 1.05) for d in drift]
        q1, _, q3 = statistics.quantiles(ts, n=4, method="inclusive")
        rows.append(
            model_measure.ModelResult(
                model="sd15-unet-small",
                impl=impl,
                task="infer",
                mode="infer",
                size=256,
                size_unit="px",
                median_ms=statistics.median(ts),
                q1_ms=q1,
                q3_ms=q3,
                times_ms=ts,
                rounds=len(ts),
                peak_bytes=10 << 20,
                weights_bytes=1 << 20,
            )
        )
    return rows


def test_model_compare_passes_noise_and_catches_a_slowdown():
    base = {"sdpa": 100.0, "subquad": 102.0, "classic": 180.0}
    caught = 0
    for seed in range(40):
        old = _model_rows(base, seed=seed)
        for machine in (0.85, 1.0, 1.15):  # identical code, the machine faster or slower as a whole
            _, problems = model_report.compare(_model_rows(base, machine, seed + 100), old, fail_pct=10)
            assert problems == [], (seed, machine, problems)
        _, problems = model_report.compare(_model_rows({**base, "subquad": 132.6}, 1.0, seed + 200), old, fail_pct=10)
        caught += any(p.startswith("subquad infer 256 px: time") for p in problems)
        assert not any(p.startswith(("sdpa ", "classic ")) for p in problems), problems
    # A 30% slowdown is missed only where the runs' drifts differ enough to hide it in the raw times.
    assert caught >= 36, caught
