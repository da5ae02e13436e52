"""Tests of the bench's measurement and reporting code (not of anyone's speed).

Fake implementations with known behaviour (a sleep, a known allocation, a refusal, an OOM) check
that time, memory and status are recorded as documented; tiny real cases check the reference and
the mask adapters; the CLI tests check results.json/results.csv, --compare and usage errors.
"""

import csv
import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from subquad._cli import main as subquad_main
from subquad.bench import cases, cli, impls, measure, models, report
from subquad.bench.cases import Case, Timing
from subquad.bench.impls import Impl, Unsupported
from subquad.bench.measure import Result
from subquad.bench.model_measure import ModelResult

FAST = Timing(warmup_s=0.0, target_s=0.5, min_reps=3, max_reps=5)
ONCE = Timing(warmup_s=0.0, target_s=0.0, min_reps=1, max_reps=1)
TINY = Case(1, 2, 33, 47, 16, dtype="fp32")


def fake(name, body, **kw):
    """An Impl whose forward runs ``body()`` and then returns the exact attention output."""

    def prepare(inputs):
        def forward():
            body()
            return F.scaled_dot_product_attention(
                inputs.query, inputs.key, inputs.value, scale=inputs.scale, **impls._sdpa_mask_args(inputs)
            )

        return forward, {}

    return Impl(name, "a fake for tests", prepare, **kw)


def raising(exc):
    def body():
        raise exc

    return body


# ---------------------------------------------------------------------------- time


def test_sleeping_fake_reports_the_sleep_as_median():
    result = measure.run_case(fake("sleep", lambda: time.sleep(0.01)), TINY, FAST)
    assert result.status == "ok", result.reason
    # A sleep lasts at least its duration; the upper bound only guards against gross mistakes
    # (e.g. summing the reps), not against a busy machine.
    assert 10.0 <= result.median_ms < 1000.0
    assert result.min_ms <= result.median_ms
    assert FAST.min_reps <= result.reps <= FAST.max_reps
    assert result.tflops == pytest.approx(TINY.flops / (result.median_ms / 1e3) / 1e12)


def test_a_call_slower_than_the_target_is_timed_once():
    timing = Timing(warmup_s=0.0, target_s=0.005, min_reps=5, max_reps=10)
    result = measure.run_case(fake("slow", lambda: time.sleep(0.01)), TINY, timing)
    assert result.status == "ok" and result.reps == 1


# -------------------------------------------------------------------------- memory


@pytest.mark.skipif(measure.RssPeak.available() is not None, reason="no /proc RSS counters")
def test_cpu_peak_memory_counts_a_known_allocation():
    size = 64 << 20

    def allocate():
        torch.ones(size // 4)  # touched, so resident, then freed before the call returns

    result = measure.run_case(fake("alloc", allocate), TINY, ONCE)
    assert result.status == "ok", result.reason
    assert result.memory_method == "cpu VmHWM - VmRSS"
    # A few pages may be freed during the call (below the starting RSS), hence 0.99.
    assert 0.99 * size <= result.peak_bytes < size + (32 << 20)


def test_memory_meter_kinds():
    assert isinstance(measure.memory_meter(torch.device("cpu")), (measure.RssPeak, str))
    assert "no peak-memory counter" in measure.memory_meter(torch.device("meta"))


# -------------------------------------------------------------------- statuses


@pytest.mark.parametrize(
    "exc",
    [
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.50 GiB"),
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"),
        MemoryError(),
    ],
    ids=["torch-oom", "cpu-allocator", "memory-error"],
)
def test_out_of_memory_is_a_record_not_a_crash(exc):
    result = measure.run_case(fake("oom", raising(exc)), TINY, FAST)
    assert result.status == "oom"
    assert result.median_ms is None and result.peak_bytes is None


def test_declared_refusals_skip_the_run():
    calls = []
    impl = fake(
        "cuda-only", lambda: calls.append(1), devices=("cuda",), dtypes=("fp16",), masks=("none",), backward=False
    )
    case = Case(1, 2, 8, 8, 16, dtype="fp32", mask="causal", backward=True)
    result = measure.run_case(impl, case, FAST)
    assert result.status == "unsupported" and not calls
    for words in ("cuda only", "not fp32", "causal", "forward only"):
        assert words in result.reason


def test_missing_module_is_unsupported_with_install_hint():
    impl = fake("missing", lambda: None, module="no_such_module_for_subquad_tests", install="pip install it")
    result = measure.run_case(impl, TINY, FAST)
    assert result.status == "unsupported"
    assert result.reason == "no_such_module_for_subquad_tests is not installed (pip install it)"


@pytest.mark.parametrize(
    "exc, expected",
    [
        (Unsupported("head dim 300 > 256"), "head dim 300 > 256"),
        (NotImplementedError("backend='fused' cannot run this call"), "NotImplementedError: backend="),
    ],
    ids=["unsupported", "not-implemented"],
)
def test_runtime_refusals_are_unsupported(exc, expected):
    result = measure.run_case(fake("refuses", raising(exc)), TINY, FAST)
    assert result.status == "unsupported"
    assert result.reason.startswith(expected)


def test_sdpa_refusal_reason_comes_from_its_warnings():
    import warnings

    def body():
        warnings.warn("Flash attention requires the head dim to be a multiple of 8", stacklevel=1)
        raise RuntimeError("No available kernel. Aborting execution.")

    result = measure.run_case(fake("sdpa-like", body), TINY, FAST)
    assert result.status == "unsupported"
    assert "multiple of 8" in result.reason


def test_other_exceptions_are_errors():
    result = measure.run_case(fake("broken", raising(ValueError("bad stride"))), TINY, FAST)
    assert result.status == "error" and result.reason == "ValueError: bad stride"


def test_too_big_for_a_cpu_is_skipped_unless_asked():
    case = Case(1, 1, 1 << 15, 1 << 14, 8, dtype="fp32")  # 2^29 scores
    naive = impls.IMPLS["naive"]
    assert "too slow" in naive.not_supported_reasons(case)[0]
    assert naive.not_supported_reasons(case, skip_slow=False) == []
    assert impls.IMPLS["sdpa-flash"].not_supported_reasons(case) == []


# ---------------------------------------------------------------- accuracy / masks


@pytest.mark.parametrize("mask", cases.MASKS)
@pytest.mark.parametrize("name", ["naive", "sdpa-math", "sdpa-flash", "subquad-user"])
def test_real_implementations_match_the_sampled_reference(name, mask):
    case = Case(2, 3, 37, 53, 16, dtype="fp32", mask=mask, backward=True)
    result = measure.run_case(impls.IMPLS[name], case, ONCE)
    if name.startswith("sdpa") and mask == "softcap":  # a score transformation: no SDPA mask says it
        assert result.status == "unsupported" and "no softcap mask support" in result.reason
        return
    assert result.status == "ok", result.reason
    assert result.rel_err < 1e-5 and result.rel_err_grad < 1e-5


def test_flex_compiled_matches_the_sampled_reference():
    case = Case(1, 2, 256, 384, 16, dtype="fp32", mask="alibi")
    result = measure.run_case(impls.IMPLS["flex-compiled"], case, ONCE)
    assert result.status == "ok", result.reason
    assert result.rel_err < 1e-5
    assert result.first_call_ms is not None
    backward = measure.run_case(
        impls.IMPLS["flex-compiled"], Case(1, 2, 256, 384, 16, dtype="fp32", mask="alibi", backward=True), ONCE
    )
    assert backward.status == "unsupported" and "no backward on CPU" in backward.reason


def test_verdict_names_the_fastest_and_the_planners_choice():
    rows = []
    for impl, ms in (("sdpa-flash", 4.0), ("subquad", 5.0), ("naive", 9.0)):
        r = measure.Result(impl=impl, case="1x1x8x8x8 fp32 causal", mode="fwd", median_ms=ms, peak_bytes=1 << 20)
        if impl == "subquad":
            r.plan = {"backend": "fused"}
        rows.append(r)
    rows.append(measure.Result(impl="sdpa-math", case="1x1x8x8x8 fp32 causal", mode="fwd", status="oom"))
    (line,) = report.verdicts(rows)
    assert line.startswith("1x1x8x8x8 fp32 causal fwd: fastest sdpa-flash 4.00 ms")
    assert "subquad's planner picked fused: 5.00 ms (1.25x)" in line
    assert "verdict:" in report.render_plain(rows)


@pytest.mark.parametrize("mask", cases.MASKS)
def test_subquad_matches_the_sampled_reference_or_says_why_not(mask):
    case = Case(1, 2, 37, 53, 16, dtype="fp32", mask=mask)
    result = measure.run_case(impls.IMPLS["subquad"], case, ONCE)
    if result.status == "unsupported":
        assert result.reason
    else:
        assert result.status == "ok", result.reason
        assert result.rel_err < 1e-5


def test_sampled_errors_measures_a_known_error():
    inputs = cases.make_inputs(Case(2, 2, 20, 30, 8, dtype="fp64", mask="key-padding"))
    exact = F.scaled_dot_product_attention(inputs.query, inputs.key, inputs.value, attn_mask=inputs.pad_mask)
    rel, rel_grad = measure.sampled_errors(inputs, exact)
    assert rel < 1e-12 and rel_grad is None
    rel, _ = measure.sampled_errors(inputs, exact * 1.1)
    assert rel == pytest.approx(0.1)


def test_alibi_bias_is_causal_and_linear():
    inputs = cases.make_inputs(Case(1, 2, 4, 4, 8, dtype="fp32", mask="alibi"))
    bias = cases.alibi_bias(inputs)[0]
    slopes = cases.alibi_slopes(2)
    assert bias[1, 3, 1].item() == pytest.approx(-2 * slopes[1].item())
    assert bias[0, 0, 1].item() == float("-inf")


def test_alibi_slopes_follow_the_paper():
    assert cases.alibi_slopes(8).tolist() == [2.0 ** -(i + 1) for i in range(8)]
    assert len(cases.alibi_slopes(12)) == 12


# ---------------------------------------------------------------------- worker


def test_worker_measures_memory_and_parent_times():
    case = Case(1, 2, 64, 64, 16, dtype="fp32")
    results = measure.run_all([(impls.IMPLS["naive"], case)], ONCE, isolate=True)
    (result,) = results
    assert result.status == "ok", result.reason
    assert result.reps == 1 and result.median_ms > 0
    assert result.rel_err < 1e-5
    assert result.memory_method is not None


def test_worker_killed_by_the_kernel_is_oom():
    kill = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    answer = measure.Worker(command=kill).run({"impl": "naive"})
    assert answer["status"] == "oom" and "SIGKILL" in answer["reason"]


def test_worker_that_exits_is_an_error():
    worker = measure.Worker(command=[sys.executable, "-c", "import sys; sys.exit('boom')"])
    answer = worker.run({"impl": "naive"})
    assert answer["status"] == "error" and "boom" in answer["reason"]


def test_run_all_reports_progress_before_and_after_each_job():
    seen = []
    jobs = [(impls.IMPLS["naive"], TINY), (impls.IMPLS["flash-attn"], TINY)]
    measure.run_all(jobs, ONCE, isolate=False, progress=lambda i, n, impl, case, r: seen.append((i, r is None)))
    assert seen == [(0, True), (0, False), (1, True), (1, False)]


# ------------------------------------------------------------------- cases & CLI


def test_flops_formula():
    base = Case(2, 3, 5, 7, 11)
    assert base.flops == 4 * 2 * 3 * 5 * 7 * 11
    assert Case(2, 3, 5, 7, 11, mask="causal").flops == base.flops / 2
    assert Case(2, 3, 5, 7, 11, backward=True).flops == base.flops * 3.5


def test_parse_shape_and_dtype():
    assert cases.parse_shape("2,8,4096,64") == (2, 8, 4096, 4096, 64)
    assert cases.parse_shape("1x8x100x200x40") == (1, 8, 100, 200, 40)
    with pytest.raises(ValueError, match="Expected a shape B,H,Lq,Lk,E"):
        cases.parse_shape("2,8,64")
    assert cases.parse_dtype("torch.bfloat16") == "bf16"
    with pytest.raises(ValueError, match="Unknown dtype 'int8'"):
        cases.parse_dtype("int8")


def test_presets_named_after_their_sources():
    shapes = {name: [c.shape for c in p.cases] for name, p in cases.PRESETS.items()}
    assert shapes["sdpa-vs-xformers"] == [(32, 32, 1024, 1024, 32)]
    assert shapes["sd21-512"] == [(2, 5, 4096, 4096, 64)]
    assert shapes["sd15-1024"] == [(2, 8, 16384, 16384, 40)]
    assert shapes["long-context"] == [(1, 8, 65536, 65536, 64)]
    assert all(c.backward for c in cases.PRESETS["training"].cases)
    quick = cases.preset_cases(cases.PRESETS["quick"], "cpu", masks=["causal"], backward=False)
    assert all(c.mask == "causal" and c.dtype == "fp32" and not c.backward for c in quick)
    assert len(quick) == len(set(quick))


def run_cli(args, capsys):
    code = cli.main(args)
    return code, capsys.readouterr()


def test_results_json_and_csv_schema(tmp_path, capsys):
    out = tmp_path / "run"
    code, captured = run_cli(
        [
            "--shape",
            "1,2,64,80,16",
            "--mask",
            "none",
            "causal",
            "--impl",
            "naive",
            "sdpa-math",
            "flash-attn",
            "--in-process",
            "--plain",
            "--seconds",
            "0.01",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert code == 0
    assert "naive" in captured.out and "not run: flash-attn" in captured.out
    records = json.loads((out / "results.json").read_text())
    assert isinstance(records, list) and len(records) == 6
    for rec in records:
        assert set(report.REQUIRED_FIELDS) <= set(rec)
        assert rec["status"] in measure.STATUSES
        assert rec["mode"] == "fwd" and rec["dtype"] == "fp32" and rec["shape"] == [1, 2, 64, 80, 16]
        assert rec["torch_version"] == torch.__version__ and rec["device_name"]
        if rec["status"] == "ok":
            assert rec["median_ms"] > 0 and rec["tflops"] > 0 and rec["rel_err"] < 1e-5
            assert isinstance(rec["peak_bytes"], (int, type(None)))
        else:
            assert rec["median_ms"] is None and rec["reason"]
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 6 and rows[0]["shape"] == "1x2x64x80x16"
    assert set(report.REQUIRED_FIELDS) <= set(rows[0])
    if report.importlib.util.find_spec("matplotlib") is not None:
        assert (out / "time.png").stat().st_size > 0 and (out / "memory.png").stat().st_size > 0
    loaded = report.load_json(str(out / "results.json"))
    assert {r.impl for r in loaded} == {"naive", "sdpa-math", "flash-attn"}


def test_compare_flags_regressions(tmp_path, capsys):
    out = tmp_path / "new"
    args = [
        "--shape",
        "1,4,1024,64",
        "--impl",
        "naive",
        "--in-process",
        "--plain",
        "--seconds",
        "0.01",
        "--out",
        str(out),
    ]
    assert run_cli(args, capsys)[0] == 0
    records = json.loads((out / "results.json").read_text())
    old = tmp_path / "old.json"
    for rec in records:  # the old run was "much faster": no machine is that noisy
        rec["median_ms"] = rec["q1_ms"] = rec["q3_ms"] = 1e-6
    old.write_text(json.dumps(records))
    code, captured = run_cli(args + ["--compare", str(old)], capsys)
    assert code == 0 and "time new/old" in captured.out  # without a threshold: report only
    code, captured = run_cli(args + ["--compare", str(old), "--fail-if-regression", "50"], capsys)
    assert code == 1 and "regressions:" in captured.out


def test_compare_rules():
    def r(status="ok", ms=10.0, peak=100 << 20, impl="x"):
        return Result(impl=impl, case="c", mode="fwd", status=status, median_ms=ms, peak_bytes=peak)

    _, regs = report.compare([r(ms=10.4)], [r(ms=10.0)], 5)
    assert regs == []
    _, regs = report.compare([r(ms=12.0)], [r(ms=10.0)], 5)
    assert len(regs) == 1 and "time 1.20x" in regs[0]
    _, regs = report.compare([r(peak=200 << 20)], [r()], 5)
    assert "peak memory 2.00x" in regs[0]
    _, regs = report.compare([r(status="oom")], [r()], 5)
    assert "was ok, now oom" in regs[0]
    _, regs = report.compare([r(peak=1000)], [r(peak=10)], 5)  # tiny absolute change: noise
    assert regs == []
    text, _ = report.compare([r(impl="y")], [r()], 5)
    assert "no (impl, case, mode) in common" in text


def test_plain_table_without_rich():
    results = [
        Result(
            impl="a",
            case="1x1x8x8x8 fp32 none",
            mode="fwd",
            median_ms=1.5,
            tflops=0.1,
            peak_bytes=3 << 20,
            rel_err=1e-7,
        ),
        Result(impl="b", case="1x1x8x8x8 fp32 none", mode="fwd", status="oom", reason="CUDA out of memory"),
        Result(impl="c", case="1x1x8x8x8 fp32 none", mode="fwd", status="unsupported", reason="c is not installed"),
    ]
    text = report.render_plain(results)
    assert "== 1x1x8x8x8 fp32 none fwd" in text
    assert "3.0 MiB" in text and "oom: CUDA out of memory" in text
    assert "not run: c: c is not installed" in text


def test_without_rich_table_and_progress_are_plain_text(monkeypatch):
    import io

    monkeypatch.setattr(report, "have_rich", lambda: False)
    result = Result(impl="a", case="1x1x8x8x8 fp32 none", mode="fwd", median_ms=2.0)
    table, log = io.StringIO(), io.StringIO()
    report.print_table([result], file=table)
    assert table.getvalue().startswith("== 1x1x8x8x8 fp32 none fwd")
    with report.Progress(1, file=log) as progress:
        progress.update(0, 1, impls.IMPLS["naive"], TINY, None)
        progress.update(0, 1, impls.IMPLS["naive"], TINY, result)
    assert log.getvalue() == "[1/1] naive 1x2x33x47x16 fp32 none fwd: 2.00 ms, 0.00 TFLOP/s, peak -, err -\n"


def test_bench_imports_rich_and_matplotlib_lazily():
    code = "import sys, subquad.bench.cli; print(sorted(m for m in ('rich', 'matplotlib') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        check=True,
    )
    assert out.stdout.strip() == "[]"


def test_format_helpers():
    assert report.format_bytes(None) == "-"
    assert report.format_bytes(1536) == "1.5 KiB"
    assert report.format_bytes(3 << 30) == "3.0 GiB"
    assert report.format_ms(0.1234) == "0.123" and report.format_ms(1234.0) == "1234"
    assert math.isclose(cases.Case(1, 1, 4, 4, 8).output_bytes, 4 * 8 * 4)


# ------------------------------------------------------------------ the command line

# Each wrong command line is one line on stderr and exit status 2, before anything is measured
# and before diffusers, transformers or JAX are looked for (the tests pretend none is installed).
USAGE_ERRORS = [
    (["--preset", "quick", "--shape", "1,1,8,8"], "either --preset or --shape"),
    (["--impl", "nosuch"], "matches no implementation"),
    (["--shape", "1,2,3"], "Expected a shape"),
    (["--dtype", "int8"], "Unknown dtype"),
    (["--budget", "12 apples"], "--budget '12 apples'"),
    (["--budget", "bad"], "--budget 'bad'"),
    (["--seconds", "0"], "--seconds must be a positive number"),
    (["--seconds", "nan"], "--seconds must be a positive number"),
    (["--seconds", "-1e3"], "--seconds must be a positive number"),
    (["--nosuch"], "unrecognized arguments: --nosuch"),
    (["--mask", "nosuch"], "invalid choice: 'nosuch'"),
    (["--fail-if-regression", "5"], "--fail-if-regression needs --compare"),
    (["--compare", "old.json", "--fail-if-regression", "-5"], "a percentage of 0 or more"),
    (["--compare", "old.json", "--allow-empty-compare"], "--allow-empty-compare goes with"),
    (["--max-memory", "4GiB"], "--max-memory needs --model"),
    (["--batch", "2"], "--batch needs --model"),
    (["--model", "nosuch"], "Unknown model 'nosuch'"),
    (
        ["--model", "sd-vae-decoder-small", "--resolution", "100"],
        "multiple of 8 (the latent is 1/8 of it), got 100; for example 96 or 104",
    ),
    (["--model", "sd-vae-decoder-small", "--resolution", "0"], "of it), got 0; for example 8"),
    (["--model", "sd-vae-decoder-small", "--max-memory", "lots"], "--max-memory 'lots': expected a size"),
    (["--model", "sd-vae-decoder-small", "--max-memory", "4 apples"], "--max-memory '4 apples'"),
    (["--model", "sd-vae-decoder-small", "--max-memory", "-1GiB"], "--max-memory '-1GiB': the cap must be more"),
    (["--model", "sd-vae-decoder-small", "--max-memory", "0"], "--max-memory '0': the cap must be more"),
    (["--model", "sd-vae-decoder-small", "--batch", "0"], "--batch must be at least 1, got 0"),
    (["--model", "sd-vae-decoder-small", "--rounds", "-1"], "--rounds must be at least 0, got -1"),
    (["--model", "sd-vae-decoder-small", "--shape", "1,1,8,8"], "--shape not supported with --model"),
    (["--model", "sd-vae-decoder-small", "--seq-len", "128"], "--seq-len does not apply"),
    (["--model", "llama-small", "--seq-len", "0"], "--seq-len must be positive, got 0"),
    (["--model", "llama-small", "--impl", "classic"], "matches no implementation for llama-small"),
    (["--framework", "jax", "--model", "llama-small"], "--model not supported with --framework jax"),
    (["--framework", "jax", "--preset", "quick"], "is a torch preset"),
    (["--framework", "jax", "--impl", "flash"], "with --framework jax choose from"),
]


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fails the test if anything is measured; the optional libraries look uninstalled."""

    def measured(*args, **kwargs):
        raise AssertionError("a measurement started before the usage error")

    for module, name in (
        (cli.measure, "run_all"),
        (cli.model_measure, "run_model_bench"),
        (cli.jax_bench, "main"),
        (cli, "_busy_warning"),
    ):
        monkeypatch.setattr(module, name, measured)

    def require(library):
        raise models.MissingDependency(f"--model needs {library}, which is not installed: {models.INSTALL[library]}")

    monkeypatch.setattr(models, "require", require)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jax" else real(name, *a))


def usage_error(args, capsys):
    """The stderr line of a command line that must fail as a usage error."""
    with pytest.raises(SystemExit) as info:
        cli.main(args)
    captured = capsys.readouterr()
    assert info.value.code == 2, captured
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("subquad bench: error: "), captured.err
    return lines[0]


@pytest.mark.parametrize("args, message", USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_each_usage_error_is_one_line_before_anything_runs(args, message, nothing_runs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.json").write_text("[]")
    assert message in usage_error(args, capsys)


@pytest.mark.parametrize(
    "args, library",
    [
        (["--model", "sd-vae-decoder-small", "--resolution", "64"], "needs diffusers, which is not installed"),
        (["--model", "llama-small"], "needs transformers, which is not installed"),
        (["--framework", "jax"], "needs JAX, which is not installed: pip install 'subquad[jax]'"),
    ],
)
def test_a_missing_dependency_is_checked_after_the_arguments(args, library, nothing_runs, capsys):
    assert library in usage_error(args, capsys)


def attention_record(impl="naive", status="ok", **fields):
    fields = (
        {"median_ms": 1.0, "q1_ms": 0.9, "q3_ms": 1.1, "reps": 5, "peak_bytes": 1 << 20, **fields}
        if status == "ok"
        else fields
    )
    return Result(impl=impl, case="1x1x8x8x8 fp32 none", mode="fwd", status=status, **fields)


def model_record(impl="sdpa", status="ok"):
    fields = (
        {"median_ms": 10.0, "q1_ms": 9.0, "q3_ms": 11.0, "rounds": 3, "peak_bytes": 1 << 20, "weights_bytes": 1 << 20}
        if status == "ok"
        else {"reason": "not installed"}
    )
    return ModelResult(
        model="sd-vae-decoder-small",
        impl=impl,
        task="infer",
        mode="infer",
        size=64,
        size_unit="px",
        status=status,
        **fields,
    )


BAD_COMPARE_FILES = [
    ("results.csv", "impl,case,mode\nnaive,c,fwd\n", [], "not JSON: Expecting value"),
    ("bad.json", '{"impl": "naive"}', [], "expected a list of records, got dict"),
    ("empty.json", "[]", [], "has no records"),
    ("trunc.json", '[{"impl": "naive", ', [], "not JSON"),
    ("binary.json", b"\xff\xfe\x00", [], "not JSON"),
    ("partial.json", '[{"impl": "naive", "mode": "fwd"}]', [], "record 0 has no case"),
    ("types.json", json.dumps([attention_record(median_ms="fast").to_dict()]), [], "TypeError"),
    ("model.json", json.dumps([model_record().to_dict()]), [], "holds --model results"),
    (
        "attention.json",
        json.dumps([attention_record().to_dict()]),
        ["--model", "sd-vae-decoder-small"],
        "holds results of single attention calls",
    ),
    ("missing.json", None, [], "no such file"),
    ("folder", "dir", [], "is a folder"),
]


@pytest.mark.parametrize("name, content, more, message", BAD_COMPARE_FILES, ids=[f[0] for f in BAD_COMPARE_FILES])
def test_a_wrong_compare_file_is_a_usage_error_before_anything_runs(
    name, content, more, message, tmp_path, nothing_runs, capsys
):
    path = tmp_path / name
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    line = usage_error(["--compare", str(path), "--fail-if-regression", "10", *more], capsys)
    assert f"--compare {path}: " in line and message in line


def test_a_negative_looking_value_is_read_as_the_value():
    args = cli.build_parser().parse(["--model", "x", "--max-memory", "-1GiB", "--budget", "-.5", "--seed", "-3"])
    assert (args.max_memory, args.budget, args.seed) == ("-1GiB", "-.5", -3)


@pytest.fixture
def fake_run(monkeypatch):
    """``subquad bench`` without measuring: every run returns the records in ``fake_run``."""
    records = [attention_record()]
    monkeypatch.setattr(cli.measure, "run_all", lambda jobs, *a, **k: list(records))
    monkeypatch.setattr(cli, "_busy_warning", lambda: None)
    return records


@pytest.mark.parametrize(
    "old, flags, code, said",
    [
        ([attention_record()], ["--fail-if-regression", "10"], 0, None),
        ([attention_record(median_ms=0.1, q1_ms=0.09, q3_ms=0.11)], ["--fail-if-regression", "10"], 1, "regressions:"),
        ([attention_record(impl="sdpa-math")], ["--fail-if-regression", "10"], 1, "nothing compared"),
        ([attention_record(status="unsupported", reason="x")], ["--fail-if-regression", "10"], 1, "nothing compared"),
        ([attention_record(impl="sdpa-math")], ["--fail-if-regression", "10", "--allow-empty-compare"], 0, None),
        ([attention_record(impl="sdpa-math")], [], 0, None),
    ],
    ids=["same", "slower", "nothing-in-common", "nothing-ok-before", "allowed-empty", "no-gate"],
)
def test_a_gate_that_compares_nothing_fails(old, flags, code, said, fake_run, tmp_path, capsys):
    path = tmp_path / "old.json"
    report.write_json(old, str(path))
    got, captured = run_cli(
        ["--shape", "1,1,8,8", "--impl", "naive", "--plain", "--compare", str(path), *flags], capsys
    )
    assert got == code, captured.out
    assert said is None or said in captured.out
    assert "compared with" in captured.out


def test_a_model_gate_that_compares_nothing_fails(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(models, "require", lambda library: None)
    monkeypatch.setattr(cli, "_busy_warning", lambda: None)
    monkeypatch.setattr(cli.model_measure, "run_model_bench", lambda *a, **k: [model_record()])
    path = tmp_path / "old.json"
    args = [
        "--model",
        "sd-vae-decoder-small",
        "--resolution",
        "64",
        "--impl",
        "sdpa",
        "--compare",
        str(path),
        "--fail-if-regression",
        "10",
    ]
    report.write_json([model_record()], str(path))
    assert run_cli(args, capsys)[0] == 0
    report.write_json([model_record(impl="classic")], str(path))
    code, captured = run_cli(args, capsys)
    assert code == 1 and "nothing compared: no (model, impl, mode, size)" in captured.out
    assert run_cli([*args, "--allow-empty-compare"], capsys)[0] == 0


def test_list(monkeypatch, capsys):
    def require(library):  # as if transformers were not installed
        if library == "transformers":
            raise models.MissingDependency(
                f"--model needs {library}, which is not installed: {models.INSTALL[library]}"
            )

    monkeypatch.setattr(models, "require", require)
    code, captured = run_cli(["--list", "--device", "cpu"], capsys)
    assert code == 0
    assert "sd15-1024" in captured.out and "subquad-matmul" in captured.out
    assert "jax-quick" in captured.out and "--framework jax" in captured.out
    lines = captured.out.splitlines()
    after = {
        line.split()[0]: lines[i + 1].strip()
        for i, line in enumerate(lines[:-1])
        if line.startswith("  ") and line.split()[0] in models.MODELS
    }
    assert after["sd15-unet-small"] == "[available]"
    assert after["llama-small"] == "[needs transformers, which is not installed: pip install 'subquad[transformers]']"


@pytest.mark.parametrize(
    "spellings, name",
    [
        (("fp16", "float16", "half", "torch.float16"), "fp16"),
        (("bf16", "bfloat16"), "bf16"),
        (("fp32", "float32", "float", "FLOAT32"), "fp32"),
        (("fp64", "float64", "double"), "fp64"),
    ],
)
def test_every_dtype_spelling_works_in_bench_and_info(spellings, name, capsys):
    for spelling in spellings:
        assert cli.build_parser().parse(["--dtype", spelling]).dtype == name
    assert subquad_main(["info", "--device", "cpu", "--dtype", spellings[1], "--shape", "1,2,16,24,8"]) == 0
    out = capsys.readouterr().out
    assert "fused CPU flash kernel" in out


def test_info_takes_the_five_integers_of_bench(capsys):
    assert subquad_main(["info", "--device", "cpu", "--shape", "1,2,16,40,8", "--run"]) == 0
    assert "output (1, 2, 16, 8)" in capsys.readouterr().out
    for bad in (["info", "--shape", "1,2,3"], ["info", "--dtype", "int8"], ["info", "--nope"], ["nope"]):
        with pytest.raises(SystemExit) as exit_:
            subquad_main(bad)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err  # one line, not argparse's usage
        assert err.startswith("subquad"), err
    with pytest.raises(SystemExit):
        subquad_main(["info", "--shape", "1,2,3"])
    assert "Expected a shape B,H,Lq,Lk,E" in capsys.readouterr().err


def test_piped_tables_cut_reasons_at_words(monkeypatch):
    import io

    reason = ("refuses this input: " + "the keys are padded " * 3 + "incomprehensibilities " * 8).strip()
    results = [
        attention_record(),
        attention_record(impl="flex", status="error", reason=reason),
        attention_record(impl="xformers", status="unsupported", reason=reason),
    ]
    words = set(f"{reason} error: ok naive flex".split())
    for rich in (False, True):
        if rich and not report.have_rich():
            continue
        monkeypatch.setattr(report, "have_rich", lambda rich=rich: rich)
        out = io.StringIO()
        report.print_table(results, file=out)
        text = out.getvalue()
        assert f"not run: xformers: {reason}" in " ".join(text.split())
        for line in text.splitlines():
            status = line.split("│")[-1] if rich else line.partition("flex")[2]
            if "incompre" in status:
                assert all(w in words for w in status.replace("…", "").split()[-1:]), line


def test_the_timing_process_fixes_the_allocators_thresholds(monkeypatch):
    """glibc's moving mmap threshold made naive and sdpa-math up to 1.4x apart between two fresh
    identical runs; the timing process pins it (not in the suite's own process: conftest opts out)."""
    from subquad.bench import meters

    calls = []

    class FakeLibc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(meters.ctypes, "CDLL", lambda name: FakeLibc())
    assert meters.steady_malloc() is False and calls == []  # SUBQUAD_BENCH_STEADY_MALLOC=0 here
    monkeypatch.setenv("SUBQUAD_BENCH_STEADY_MALLOC", "1")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert meters.steady_malloc() is False and calls == []  # the user's own setting wins
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert meters.steady_malloc() is True
    assert calls == [(meters.M_MMAP_THRESHOLD, 32 << 20), (meters.M_TRIM_THRESHOLD, 64 << 20)]

    pinned = []
    monkeypatch.setattr(measure, "steady_malloc", lambda: pinned.append(True))
    measure.run_all([], cases.PRESETS["quick"].timing, isolate=False)
    assert pinned == []  # memory measured in this process: its allocator is left alone
    measure.run_all([], cases.PRESETS["quick"].timing, isolate=True)
    assert pinned == [True]
