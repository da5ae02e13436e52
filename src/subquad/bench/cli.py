"""``subquad bench``: compare attention implementations on one command line.

Examples::

    subquad bench                                   # the quick preset on the default device
    subquad bench --preset sd15-1024 --out runs/sd15
    subquad bench --shape 1,8,8192,64 --mask causal alibi --impl 'sdpa-*' 'subquad*'
    subquad bench --preset quick --compare runs/old/results.json --fail-if-regression 10
    subquad bench --model sd15-unet-small --task infer --out runs/unet
    subquad bench --model sd-vae-decoder --resolution 256 512 1024 2048 --max-memory 4GiB
    subquad bench --model llama-small --task train --seq-len 2048 8192
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

import torch

import subquad
from subquad._budget import parse_budget

from . import cases as cases_mod
from . import impls as impls_mod
from . import jax_bench, measure, model_impls, model_measure, model_report, models, report

JAX_PRESETS = ("jax", "jax-quick")

EPILOG = """\
status: ok, unsupported (missing, or the implementation refuses the case: the reason says why),
oom (out of memory, recorded rather than raised), error (anything else, with the exception).
Metrics: median time and IQR over calls timed in interleaved rounds (each implementation of a
case once per round, in a rotating order) after a warm-up, the device synchronized around each
call; the verdict names a winner only when the 99% interval of the per-round ratios lies beyond
3%; TFLOP/s = 4·B·H·Lq·Lk·E (÷2 causal, ×3.5 forward+backward) / time; peak extra memory above
the inputs, output included (CUDA allocator peak, or on CPU the RSS high-water mark in a worker
process); relative error against a float64 reference on sampled query rows. --model NAME runs
a whole model (SD 1.5 UNet, SD VAE decoder, Llama) with each attention implementation. See
docs/bench.md.
"""


def default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``subquad bench`` (also used by the ``subquad`` command's subparser)."""
    what = parser.add_argument_group("what to run")
    what.add_argument(
        "--framework",
        choices=["torch", "jax"],
        default="torch",
        help="torch (default) or jax: subquad.jax against jax.nn.dot_product_attention "
        "and the seed's JAX code, time and compiled temporary memory (presets "
        "jax, jax-quick)",
    )
    what.add_argument(
        "--preset",
        choices=sorted(cases_mod.PRESETS) + sorted(JAX_PRESETS),
        help="a named set of cases (default: quick unless --shape is given; jax-quick with --framework jax)",
    )
    what.add_argument(
        "--shape",
        action="append",
        type=_shape,
        metavar="B,H,Lq,Lk,E",
        help="a shape to run instead of a preset (B,H,L,E also works); repeatable",
    )
    what.add_argument(
        "--dtype",
        type=_dtype,
        metavar="{fp16,bf16,fp32,fp64}",
        help="override the dtype (default: the preset's, else fp16 on GPUs and fp32 on CPU)",
    )
    what.add_argument(
        "--mask",
        nargs="+",
        choices=cases_mod.MASKS,
        help="one or more masks to run each shape with (overrides the preset's)",
    )
    what.add_argument(
        "--backward", action="store_true", default=None, help="measure forward+backward instead of forward only"
    )
    what.add_argument(
        "--budget", metavar="BYTES", help="memory_budget for subquad, e.g. 512MiB (other implementations ignore it)"
    )
    what.add_argument("--device", help="cpu, cuda, cuda:1, mps (default: the best available)")
    what.add_argument(
        "--impl",
        nargs="+",
        metavar="NAME",
        help="implementations to run, glob patterns allowed ('sdpa-*', 'subquad*'); default: the preset's, else all",
    )
    what.add_argument(
        "--no-skip", action="store_true", help="also run what is predicted too slow or too big for this CPU"
    )
    what.add_argument(
        "--in-process",
        action="store_true",
        help="run CPU cases in this process instead of a worker process (faster to start; peak memory is less exact)",
    )
    what.add_argument(
        "--seconds",
        type=float,
        metavar="S",
        help="time each case for about S seconds (at least 3 calls, one if a call "
        "takes longer; default: the preset's, 1 s for --shape)",
    )
    what.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    model = parser.add_argument_group("whole models (--model)")
    model.add_argument(
        "--model",
        metavar="NAME",
        help=f"run a whole model with each attention implementation: {', '.join(models.MODELS)}",
    )
    model.add_argument(
        "--resolution",
        nargs="+",
        type=int,
        metavar="PX",
        help="image sizes in pixels, multiples of 8 (the latent is 1/8); default: the model's",
    )
    model.add_argument(
        "--seq-len",
        nargs="+",
        type=int,
        metavar="TOKENS",
        help="sequence lengths for a Llama model; default: the model's",
    )
    model.add_argument(
        "--task",
        choices=["infer", "train"],
        default="infer",
        help="infer: one forward (Llama: a prefill and a decode loop); train: "
        "forward and backward of a loss (UNet: the LoRA-style step and a full one)",
    )
    model.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    model.add_argument(
        "--rounds",
        type=int,
        default=5,
        metavar="N",
        help="interleaved timing rounds per size (default 5; 0: no timing, only the worker's one measured step)",
    )
    model.add_argument(
        "--max-memory",
        metavar="BYTES",
        help="a memory cap such as 4GiB: each implementation stops growing once its "
        "step plus weights passes it (enforced on CUDA); the largest size under "
        "it is reported",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--out", metavar="DIR", help="write results.json, results.csv, time.png and memory.png here")
    out.add_argument("--compare", metavar="OLD.json", help="print new/old ratios against a previous results.json")
    out.add_argument(
        "--fail-if-regression",
        type=float,
        metavar="PCT",
        help="with --compare: exit with status 1 if a time or peak memory grew by "
        "more than PCT percent, or a case that ran now fails",
    )
    out.add_argument("--plain", action="store_true", help="plain text output even if rich is installed")
    out.add_argument(
        "--list", action="store_true", help="list presets and implementations (with availability) and exit"
    )


def _shape(text: str):
    try:
        return cases_mod.parse_shape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _dtype(text: str) -> str:
    try:
        return cases_mod.parse_dtype(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="subquad bench",
        description="Benchmark attention implementations: time, TFLOP/s, peak memory and accuracy.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return parser


def _check_device(device: str) -> Optional[str]:
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        return f"--device {device!r} is not a device: {exc}"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return f"--device {device}: CUDA is not available in this torch ({torch.__version__})"
    if dev.type == "mps" and not torch.backends.mps.is_available():
        return f"--device {device}: MPS is not available"
    if dev.type not in ("cpu", "cuda", "mps"):
        return f"--device {device}: expected cpu, cuda[:N] or mps"
    return None


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


def _check_budget(budget: str) -> Optional[str]:
    """Ask subquad itself whether it understands ``budget``, once, instead of failing each run."""
    try:
        q = torch.zeros(1, 1, 8, 8)
        subquad.explain(q, q, q, memory_budget=budget)
    except (TypeError, ValueError) as exc:
        return f"--budget {budget!r}: {exc}"
    except Exception:  # anything else is for the runs to report
        pass
    return None


def print_list(device: str) -> None:
    print("presets:")
    for preset in cases_mod.PRESETS.values():
        print(f"  {preset.name:<17} {preset.description}")
    print(f"\nimplementations on {device}:")
    probe = cases_mod.Case(1, 1, 128, 128, 64, device=device).resolve(device)
    for impl in impls_mod.IMPLS.values():
        reasons = impl.not_supported_reasons(probe)
        state = "available" if not reasons else "; ".join(reasons)
        print(f"  {impl.name:<16} {impl.description}\n  {'':<16} [{state}]")
    print("\nwhole models (--model NAME; pip install 'subquad[diffusers,transformers]'):")
    for spec in models.MODELS.values():
        sizes = ", ".join(map(str, spec.sizes))
        print(f"  {spec.name:<21} {spec.description} (default {sizes} {spec.size_unit})")


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``subquad bench``; ``argv`` are the arguments after ``bench``. Returns the
    exit status: 0, 1 for a regression under --fail-if-regression, 2 for a usage error, 130
    after Ctrl-C (the runs done so far are still shown and saved)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.framework == "jax" or args.preset in JAX_PRESETS:
        return _main_jax(parser, args)
    if args.model is not None:
        return _main_model(parser, args)
    for flag, value in (
        ("--resolution", args.resolution),
        ("--seq-len", args.seq_len),
        ("--max-memory", args.max_memory),
    ):
        if value is not None:
            parser.error(f"{flag} needs --model NAME")
    device = args.device or default_device()
    problem = _check_device(device)
    if problem:
        parser.error(problem)
    if args.list:
        print_list(device)
        return 0
    if args.preset and args.shape:
        parser.error("give either --preset or --shape, not both")
    if args.fail_if_regression is not None and not args.compare:
        parser.error("--fail-if-regression needs --compare OLD.json")
    if args.compare and not os.path.isfile(args.compare):
        parser.error(f"--compare {args.compare}: no such file")

    if args.budget is not None:
        problem = _check_budget(args.budget)
        if problem:
            parser.error(problem)

    preset = None if args.shape else cases_mod.PRESETS[args.preset or "quick"]
    overrides = dict(dtype=args.dtype, masks=args.mask, budget=args.budget)
    if preset is not None:
        cases = cases_mod.preset_cases(preset, device, backward=args.backward, **overrides)
        timing = preset.timing
    else:
        cases = cases_mod.shape_cases(args.shape, device, backward=bool(args.backward), **overrides)
        timing = cases_mod.Timing()
    if args.seconds is not None:
        if args.seconds <= 0:
            parser.error(f"--seconds must be positive, got {args.seconds}")
        timing = timing._replace(
            target_s=args.seconds, warmup_s=min(timing.warmup_s, args.seconds), min_reps=min(timing.min_reps, 3)
        )
    try:
        impls = impls_mod.select(args.impl or (preset.impls if preset else None))
    except ValueError as exc:
        parser.error(str(exc))
    jobs = [(impl, case) for case in cases for impl in impls]

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

    if args.compare:
        old = report.load_json(args.compare)
        if _print_comparison(args, *report.compare(results, old, args.fail_if_regression)):
            return 1
    return 130 if interrupted else 0


def _print_comparison(args: argparse.Namespace, text: str, regressions: list[str]) -> bool:
    """Prints a ``--compare`` against ``args.compare``; True when a regression should fail the run."""
    print(f"\ncompared with {args.compare}:\n{text}")
    if regressions:
        print("regressions:\n  " + "\n  ".join(regressions))
    return bool(regressions) and args.fail_if_regression is not None


def _main_jax(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--framework jax``: presets of ``(B, T, N, H)`` shapes in fp32 on JAX's default device."""
    if args.preset is not None and args.preset not in JAX_PRESETS:
        parser.error(f"--preset {args.preset} is a torch preset; with --framework jax use {' or '.join(JAX_PRESETS)}")
    unsupported = [
        flag
        for flag, value in (
            ("--shape", args.shape),
            ("--mask", args.mask),
            ("--dtype", args.dtype),
            ("--compare", args.compare),
            ("--device", args.device),
        )
        if value
    ]
    if unsupported:
        parser.error(f"{', '.join(unsupported)} not supported with --framework jax (it runs the jax presets)")
    impls = args.impl or list(jax_bench.IMPLS)
    unknown = [name for name in impls if name not in jax_bench.IMPLS]
    if unknown:
        parser.error(f"--impl {' '.join(unknown)}: with --framework jax choose from {', '.join(jax_bench.IMPLS)}")
    if args.budget is not None:
        problem = _check_budget(args.budget)
        if problem:
            parser.error(problem)
    seconds = 3.0 if args.seconds is None else args.seconds
    if seconds <= 0:
        parser.error(f"--seconds must be positive, got {seconds}")
    jax_bench.main(args.preset or "jax-quick", impls, seconds, args.budget, args.out)
    return 0


def _main_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--model NAME``: a whole model with each attention implementation (``model_measure``)."""
    try:
        spec = models.spec(args.model)
        models.require(spec.library)
    except (ValueError, models.MissingDependency) as exc:
        parser.error(str(exc))
    unsupported = [
        flag
        for flag, value in (
            ("--preset", args.preset),
            ("--shape", args.shape),
            ("--mask", args.mask),
            ("--backward", args.backward),
        )
        if value
    ]
    if unsupported:
        parser.error(f"{', '.join(unsupported)} not supported with --model")
    wrong = "--seq-len" if spec.family != "llama" else "--resolution"
    if (args.seq_len if spec.family != "llama" else args.resolution) is not None:
        parser.error(
            f"{wrong} does not apply to {spec.name}; use {'--resolution' if spec.family != 'llama' else '--seq-len'}"
        )
    sizes = (args.seq_len if spec.family == "llama" else args.resolution) or list(spec.sizes)
    for size in sizes:
        problem = models.check_size(spec, size)
        if problem:
            parser.error(problem)
    if args.batch < 1 or args.rounds < 0:
        parser.error("--batch must be at least 1 and --rounds at least 0")
    device = args.device or default_device()
    problem = _check_device(device) or (_check_budget(args.budget) if args.budget is not None else None)
    if problem:
        parser.error(problem)
    cap = None
    if args.max_memory is not None:
        try:
            cap = parse_budget(args.max_memory)
        except (TypeError, ValueError) as exc:
            parser.error(f"--max-memory {args.max_memory!r}: {exc}")
    if args.compare and not os.path.isfile(args.compare):
        parser.error(f"--compare {args.compare}: no such file")
    try:
        impls = model_impls.impls_for(spec, args.impl)
    except ValueError as exc:
        parser.error(str(exc))
    dtype = args.dtype or cases_mod.default_dtype(device)
    print(
        f"subquad bench --model {spec.name} ({spec.description}), task {args.task}, "
        f"{', '.join(map(str, sizes))} {spec.size_unit}, on {measure.device_name(device)}, "
        f"torch {torch.__version__}",
        file=sys.stderr,
        flush=True,
    )
    busy = _busy_warning()
    if busy:
        print(busy, file=sys.stderr, flush=True)
    results = model_measure.run_model_bench(
        spec,
        sizes,
        args.task,
        impls,
        device=device,
        dtype=dtype,
        batch=args.batch,
        budget=args.budget,
        rounds=args.rounds,
        cap_bytes=cap,
        seed=args.seed,
        progress=lambda text: print(text, file=sys.stderr, flush=True),
        worker_cls=model_measure.InProcess if args.in_process else None,
    )
    print(model_report.render(results), end="")
    if args.out:
        print("wrote " + ", ".join(model_report.save(results, args.out)))
    if args.compare:
        try:
            old = model_report.load_json(args.compare)
        except ValueError as exc:
            parser.error(str(exc))
        if _print_comparison(args, *model_report.compare(results, old, args.fail_if_regression)):
            return 1
    return 0
