"""``subquad bench``: compare attention implementations on one command line.

Examples::

    subquad bench                                   # the quick preset on the default device
    subquad bench --preset sd15-1024 --out runs/sd15
    subquad bench --shape 1,8,8192,64 --mask causal alibi --impl 'sdpa-*' 'subquad*'
    subquad bench --preset quick --compare runs/old/results.json --fail-if-regression 10
    subquad bench --model sd15-unet-small --task infer --out runs/unet
    subquad bench --model sd-vae-decoder --resolution 256 512 1024 2048 --max-memory 4GiB
    subquad bench --model llama-small --task train --seq-len 2048 8192
    subquad bench --host comfyui ~/ComfyUI --checkpoint v1-5-pruned-emaonly.safetensors --vae

The options and their checks are in ``args``: every argument is checked, then the dependencies,
before anything is measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from typing import Any, Callable, Hashable, Optional

import torch

from . import args as args_mod
from . import cases as cases_mod
from . import host_comfyui, jax_bench, measure, model_measure, model_report, models, report
from . import impls as impls_mod
from .args import Checked, build_parser, default_device
from .timing import ROUNDS_TO_NAME as MODEL_ROUNDS


def _busy_warning(sample_s: float = 0.5) -> Optional[str]:
    """A warning when other processes keep the CPUs busy right now (timings will be noisy).
    Linux only: the busy share of all CPUs over ``sample_s``, from /proc/stat (the load average
    lags by a minute and would warn about a machine that has just gone quiet)."""

    def times():
        with open("/proc/stat") as f:
            values = [int(x) for x in f.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        return sum(values), idle

    try:
        total0, idle0 = times()
        time.sleep(sample_s)
        total1, idle1 = times()
    except (OSError, ValueError, IndexError):
        return None
    busy = 1.0 - (idle1 - idle0) / max(1, total1 - total0)
    if busy > 0.25:
        return f"warning: the CPUs are {busy:.0%} busy before starting; other processes will make the timings noisy"
    return None


def print_list(device: str) -> None:
    """Presets (torch and JAX), implementations and whole models, each with whether it can run here and why not."""
    print("presets:")
    for preset in cases_mod.PRESETS.values():
        print(f"  {preset.name:<17} {preset.description}")
    have_jax = importlib.util.find_spec("jax") is not None
    jax_state = "available" if have_jax else f"needs jax, which is not installed: {args_mod.JAX_INSTALL}"
    for name, cfg in jax_bench.PRESETS.items():
        shapes = ", ".join("x".join(map(str, s)) for s in cfg["shapes"])
        print(
            f"  {name:<17} --framework jax: (B,T,N,H) {shapes}, masks {' and '.join(cfg['masks'])}, "
            f"{' and '.join(cfg['modes'])}; {', '.join(jax_bench.IMPLS)}\n  {'':<17} [{jax_state}]"
        )
    print(f"\nimplementations on {device}:")
    probe = cases_mod.Case(1, 1, 128, 128, 64, device=device).resolve(device)
    for impl in impls_mod.IMPLS.values():
        reasons = impl.not_supported_reasons(probe)
        state = "available" if not reasons else "; ".join(reasons)
        print(f"  {impl.name:<16} {impl.description}\n  {'':<16} [{state}]")
    print("\nwhole models (--model NAME):")
    for spec in models.MODELS.values():
        sizes = ", ".join(map(str, spec.sizes))
        try:
            models.require(spec.library)
            state = "available"
        except models.MissingDependency as exc:
            state = str(exc).removeprefix("--model ")
        print(f"  {spec.name:<21} {spec.description} (default {sizes} {spec.size_unit})\n  {'':<21} [{state}]")


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``subquad bench``; ``argv`` are the arguments after ``bench``. Returns the
    exit status: 0; 1 when --fail-if-regression finds a regression or compares nothing; 130
    after Ctrl-C (the runs done so far are still shown and saved). A usage error, found before
    anything runs, prints one line and exits with status 2."""
    parser = build_parser()
    args = parser.parse(sys.argv[1:] if argv is None else argv)
    try:
        checked = args_mod.check(args)
    except args_mod.UsageError as exc:
        parser.error(str(exc))
    if args.list:
        assert checked.device is not None
        print_list(checked.device)
        return 0
    if checked.framework == "jax":
        return _main_jax(args, checked)
    if checked.host is not None:
        return _main_host(args, checked)
    if checked.spec is not None:
        return _main_model(args, checked)
    return _main_attention(args, checked)


def _main_attention(args: argparse.Namespace, checked: Checked) -> int:
    """Single attention calls: a preset, or the --shape cases."""
    device = checked.device or default_device()
    preset = cases_mod.PRESETS[checked.preset] if checked.preset else None
    overrides = dict(dtype=args.dtype, masks=args.mask, budget=args.budget)
    if preset is not None:
        cases = cases_mod.preset_cases(preset, device, backward=args.backward, **overrides)
        timing = preset.timing
    else:
        cases = cases_mod.shape_cases(args.shape, device, backward=bool(args.backward), **overrides)
        timing = cases_mod.Timing()
    if args.seconds is not None:
        timing = timing._replace(
            target_s=args.seconds, warmup_s=min(timing.warmup_s, args.seconds), min_reps=min(timing.min_reps, 3)
        )
    jobs = [(impl, case) for case in cases for impl in checked.impls]

    plain = args.plain
    title = (
        f"subquad bench: {preset.name if preset else 'custom shapes'} on "
        f"{measure.device_name(device)}, torch {torch.__version__}, {len(jobs)} runs"
    )
    print(title, file=sys.stderr, flush=True)
    busy = _busy_warning()
    if busy:
        print(busy, file=sys.stderr, flush=True)
    with report.Progress(len(jobs), plain=plain) as progress:
        results = measure.run_all(
            jobs,
            timing,
            seed=args.seed,
            skip_slow=not args.no_skip,
            isolate=False if args.in_process else None,
            progress=progress.update,
        )

    interrupted = len(results) < len(jobs)
    if interrupted:
        print(f"interrupted: {len(results)} of {len(jobs)} runs done", file=sys.stderr)
    report.print_table(results, plain=plain)
    if args.out:
        paths = report.save(results, args.out)
        print("wrote " + ", ".join(paths))
    else:
        print("(pass --out DIR to save results.json, results.csv and plots)")

    if checked.old is not None:
        text, regressions = report.compare(
            results, checked.old, args.fail_if_regression, allow_nothing=args.allow_empty_compare
        )
        both = _ok_in_both(results, checked.old, lambda r: (r.impl, r.case, r.mode))
        if _print_comparison(args, text, regressions, both, "(impl, case, mode)"):
            return 1
    return 130 if interrupted else 0


def _ok_in_both(new: list, old: list, key: Callable[[Any], Hashable]) -> int:
    """How many records ran ok in both runs: what a comparison of times and memory compares."""
    ok_before = {key(r) for r in old if r.status == "ok"}
    return sum(1 for r in new if r.status == "ok" and key(r) in ok_before)


def _print_comparison(args: argparse.Namespace, text: str, regressions: list[str], both: int, what: str) -> bool:
    """Prints a ``--compare`` against ``args.compare``; True when the run should fail: a
    regression under --fail-if-regression, or a gate that had nothing to compare (``both``: how
    many ``what`` ran ok in both runs) unless --allow-empty-compare says that is fine. The
    comparison may have listed that as a problem already; then it is not said twice."""
    print(f"\ncompared with {args.compare}:\n{text}")
    if regressions:
        print("regressions:\n  " + "\n  ".join(regressions))
    if args.fail_if_regression is None:
        return False
    if both == 0 and not args.allow_empty_compare and not regressions:
        print(
            f"nothing compared: no {what} ran ok in both runs, so --fail-if-regression checked nothing "
            "(pass --allow-empty-compare to let that pass)"
        )
        return True
    return bool(regressions)


def _main_jax(args: argparse.Namespace, checked: Checked) -> int:
    """``--framework jax``: presets of ``(B, T, N, H)`` shapes in fp32 on JAX's default device."""
    seconds = 3.0 if args.seconds is None else args.seconds
    jax_bench.main(checked.preset or "jax-quick", list(checked.impls), seconds, args.budget, args.out)
    return 0


def _main_host(args: argparse.Namespace, checked: Checked) -> int:
    """``--host comfyui PATH``: the node "Which attention? (subquad)" in a child process (``host_comfyui``)."""
    results = host_comfyui.run(args, checked)
    if results is None:
        return 1
    if checked.old is not None:
        text, regressions = model_report.compare(results, checked.old, args.fail_if_regression)
        both = _ok_in_both(results, checked.old, lambda r: (r.model, r.impl, r.mode, r.size))
        if _print_comparison(args, text, regressions, both, "(model, impl, mode, size)"):
            return 1
    return 0


def _main_model(args: argparse.Namespace, checked: Checked) -> int:
    """``--model NAME``: a whole model with each attention implementation (``model_measure``)."""
    spec = checked.spec
    assert spec is not None and checked.device is not None
    device = checked.device
    dtype = args.dtype or cases_mod.default_dtype(device)
    print(
        f"subquad bench --model {spec.name} ({spec.description}), task {args.task}, "
        f"{', '.join(map(str, checked.sizes))} {spec.size_unit}, on {measure.device_name(device)}, "
        f"torch {torch.__version__}",
        file=sys.stderr,
        flush=True,
    )
    busy = _busy_warning()
    if busy:
        print(busy, file=sys.stderr, flush=True)
    results = model_measure.run_model_bench(
        spec,
        list(checked.sizes),
        args.task,
        list(checked.impls),
        device=device,
        dtype=dtype,
        batch=1 if args.batch is None else args.batch,
        budget=args.budget,
        rounds=MODEL_ROUNDS if args.rounds is None else args.rounds,
        cap_bytes=checked.cap,
        seed=args.seed,
        progress=lambda text: print(text, file=sys.stderr, flush=True),
        worker_cls=model_measure.InProcess if args.in_process else None,
    )
    print(model_report.render(results), end="")
    if args.out:
        print("wrote " + ", ".join(model_report.save(results, args.out)))
    if checked.old is not None:
        text, regressions = model_report.compare(results, checked.old, args.fail_if_regression)
        both = _ok_in_both(results, checked.old, lambda r: (r.model, r.impl, r.mode, r.size))
        if _print_comparison(args, text, regressions, both, "(model, impl, mode, size)"):
            return 1
    return 0
