"""The command line of ``subquad bench``: its options, and every check of them, made before
anything is measured or any optional dependency is looked for.

A usage error is one line on stderr and exit status 2 (``Parser.error``); exit status 1 stays
"a regression under --fail-if-regression". ``check`` goes in this order: each value on its own
(counts, sizes, byte sizes, percentages), the options that go together or not, the ``--compare``
file (read, of the right kind, and compared with itself once), and only then whether diffusers,
transformers or JAX is installed, so that a mistyped argument is never hidden behind "install
diffusers" and a wrong ``--compare`` file never costs a whole run.

What the rest of the package uses: ``JAX_PRESETS``, ``build_parser``, ``Parser``,
``UsageError``, ``Checked``, ``check``, ``default_device``, ``load_compare``. ``--host comfyui PATH``
is checked here too (the folder, the checkpoint, one resolution); ComfyUI itself is imported only
by the child process that measures (``host_comfyui``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence

import torch

from subquad._budget import parse_budget

from ..integrations._hosts import HostNotFound, find_host
from ..integrations.comfyui import MARKERS as COMFYUI_MARKERS
from . import cases as cases_mod
from . import impls as impls_mod
from . import jax_bench, model_impls, model_report, models, report
from .measure import Result
from .model_measure import ModelResult

JAX_PRESETS = tuple(jax_bench.PRESETS)
JAX_INSTALL = "pip install 'subquad[jax]'"

EPILOG = """\
status: ok, unsupported (missing, or the implementation refuses the case: the reason says why),
oom (out of memory, recorded rather than raised), error (anything else, with the exception).
Metrics: median time and IQR over calls timed in interleaved rounds after a warm-up, the device
synchronized around each call; the verdict names a winner only when the 99% interval of the
per-round ratios lies beyond 3%; TFLOP/s = 4·B·H·Lq·Lk·E (÷2 causal, ×3.5 forward+backward) /
time; peak extra memory above the inputs, output included (CUDA allocator peak, or on CPU the
RSS high-water mark in a worker process); relative error against a float64 reference on sampled
query rows. --model NAME runs a whole model (SD 1.5 UNet, SD VAE decoder, Llama) with each
attention implementation. --host comfyui PATH times every attention that ComfyUI offers on this
machine, and subquad, on one denoising step of a model loaded by that ComfyUI.
Exit status: 0; 1 when --fail-if-regression finds a regression or compares nothing; 2 for a
usage error (one line, before anything runs); 130 after Ctrl-C. See docs/bench.md.
"""

# A value that argparse would take for an option: "-1GiB", "-1e3", "-.5" (it lets "-1" and "-0.5" through).
_DASHED_VALUE = re.compile(r"-[0-9.]")


class UsageError(ValueError):
    """A command line that cannot run; the message is the one line the user sees."""


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, ``subquad bench: error: ...``, exit status 2
    (argparse prints the whole usage first, 13 lines that hide the one that matters)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")

    def parse(self, argv: Sequence[str]) -> argparse.Namespace:
        """``parse_args``, reading ``--max-memory -1GiB`` as the option and its (wrong) value:
        argparse takes a word that starts with '-' for an option unless it is a plain number,
        and would answer "expected one argument"."""
        words: list[str] = []
        rest = list(argv)
        while rest:
            word = rest.pop(0)
            if word == "--":
                words += [word, *rest]
                break
            action = self._option_string_actions.get(word)
            if action is not None and action.nargs is None and rest and _DASHED_VALUE.match(rest[0]):
                word = f"{word}={rest.pop(0)}"
            words.append(word)
        return self.parse_args(words)


def _shape(text: str) -> tuple[int, int, int, int, int]:
    try:
        return cases_mod.parse_shape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _dtype(text: str) -> str:
    try:
        return cases_mod.parse_dtype(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``subquad bench``, a group at a time."""
    _add_case_arguments(parser)
    _add_model_arguments(parser)
    _add_host_arguments(parser)
    _add_output_arguments(parser)


def _add_case_arguments(parser: argparse.ArgumentParser) -> None:
    """What to run: the cases (a preset or shapes), the implementations, the device and the timing."""
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
        help="override the dtype (also float16/half, bfloat16, float32/float, float64/double; "
        "default: the preset's, else fp16 on GPUs and fp32 on CPU)",
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


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model NAME`` and what goes with it: sizes, task, batch, rounds and a memory cap."""
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
    model.add_argument("--batch", type=int, metavar="N", help="batch size (default 1)")
    model.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help="interleaved timing rounds per size (default 6, the fewest that can name a winner; 0: no timing, only the worker's one measured step)",
    )
    model.add_argument(
        "--max-memory",
        metavar="BYTES",
        help="a memory cap such as 4GiB: each implementation stops growing once its "
        "step plus weights passes it (enforced on CUDA); the largest size under "
        "it is reported",
    )


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Where results go, ``--compare`` with a previous run and the regression gate, ``--list``."""
    out = parser.add_argument_group("output")
    out.add_argument("--out", metavar="DIR", help="write results.json, results.csv, time.png and memory.png here")
    out.add_argument(
        "--compare",
        metavar="OLD.json",
        help="print new/old ratios against a previous results.json (checked before anything runs)",
    )
    out.add_argument(
        "--fail-if-regression",
        type=float,
        metavar="PCT",
        help="with --compare: exit with status 1 if a time or peak memory grew by "
        "more than PCT percent, a case that ran now fails, or nothing could be compared",
    )
    out.add_argument(
        "--allow-empty-compare",
        action="store_true",
        help="with --fail-if-regression: pass when no run is in both results (by default a gate that compares nothing fails)",
    )
    out.add_argument("--plain", action="store_true", help="plain text output even if rich is installed")
    out.add_argument(
        "--list",
        action="store_true",
        help="list presets, implementations and models, with which of them can run here, and exit",
    )


def _add_host_arguments(parser: argparse.ArgumentParser) -> None:
    """``--host comfyui PATH`` and what goes with it."""
    hosts = parser.add_argument_group("inside a host application (--host)")
    hosts.add_argument(
        "--host",
        nargs=2,
        metavar=("HOST", "PATH"),
        help="comfyui PATH: load the ComfyUI at PATH (read-only, in a child process) and time one denoising "
        "step with every attention it offers here and with subquad (the node 'Which attention? (subquad)')",
    )
    hosts.add_argument(
        "--checkpoint",
        metavar="NAME",
        help="with --host: a checkpoint in PATH/models/checkpoints (or a file); default: a small "
        "SD1.5-config UNet with random weights",
    )
    hosts.add_argument("--vae", action="store_true", help="with --host: also time a VAE decode")


def build_parser() -> Parser:
    parser = Parser(
        prog="subquad bench",
        description="Benchmark attention implementations: time, TFLOP/s, peak memory and accuracy.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return parser


def default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


@dataclass(frozen=True)
class Checked:
    """The command line once checked: what ``cli`` runs, with nothing left to refuse."""

    framework: str  # "torch" or "jax"
    device: Optional[str] = None  # torch only
    preset: Optional[str] = None  # a preset's name; None with --shape or --model
    spec: Optional[models.ModelSpec] = None  # --model
    sizes: tuple[int, ...] = ()  # --model: resolutions (px) or sequence lengths (tokens)
    cap: Optional[int] = None  # --max-memory in bytes
    impls: tuple[Any, ...] = ()  # bench Impl, ModelImpl, or the JAX implementations' names
    old: Optional[list] = None  # the --compare records
    host: Optional[str] = None  # --host: the host's folder, resolved
    checkpoint: Optional[str] = None  # --host --checkpoint: the file, resolved


def check(args: argparse.Namespace) -> Checked:
    """Every check of the command line, in the order of the module docstring. Raises
    UsageError with the one line to show."""
    cap = _check_values(args)
    if args.list:  # lists what can run; --device says where
        return Checked("torch", device=_device(args.device))
    if args.framework == "jax" or args.preset in JAX_PRESETS:
        checked = _check_jax(args)
    elif args.host is not None:
        checked = _check_host(args, cap)
    elif args.model is not None:
        checked = _check_model(args, cap)
    else:
        checked = _check_attention(args)
    if args.compare:
        model = checked.spec is not None or checked.host is not None
        old = load_compare(args.compare, model=model, fail_pct=args.fail_if_regression)
        checked = dataclasses.replace(checked, old=old)
    if checked.spec is not None:
        try:
            models.require(checked.spec.library)
        except models.MissingDependency as exc:
            raise UsageError(str(exc)) from None
    if checked.framework == "jax" and importlib.util.find_spec("jax") is None:
        raise UsageError(f"--framework jax needs JAX, which is not installed: {JAX_INSTALL}")
    return checked


def _check_values(args: argparse.Namespace) -> Optional[int]:
    """Each value on its own; returns the --max-memory cap in bytes."""
    if args.seconds is not None and not (math.isfinite(args.seconds) and args.seconds > 0):
        raise UsageError(f"--seconds must be a positive number of seconds, got {args.seconds:g}")
    for flag, value, least in (("--batch", args.batch, 1), ("--rounds", args.rounds, 0)):
        if value is not None and value < least:
            raise UsageError(f"{flag} must be at least {least}, got {value}")
    pct = args.fail_if_regression
    if pct is not None and not (math.isfinite(pct) and pct >= 0):
        raise UsageError(f"--fail-if-regression takes a percentage of 0 or more, e.g. 10, got {pct:g}")
    if pct is not None and not args.compare:
        raise UsageError("--fail-if-regression needs --compare OLD.json")
    if args.allow_empty_compare and pct is None:
        raise UsageError("--allow-empty-compare goes with --compare OLD.json --fail-if-regression PCT")
    if args.budget is not None:
        try:
            parse_budget(args.budget)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"--budget {args.budget!r}: {exc}") from None
    if args.max_memory is None:
        return None
    text = args.max_memory
    if text.strip().startswith("-"):
        raise UsageError(f"--max-memory {text!r}: the cap must be more than 0 bytes, e.g. 4GiB")
    try:
        cap = parse_budget(text)
    except (TypeError, ValueError):
        raise UsageError(
            f"--max-memory {text!r}: expected a size such as 4GiB, 512MiB or 8GB (units B, KB, MB, GB, KiB, MiB, GiB)"
        ) from None
    if cap <= 0:
        raise UsageError(f"--max-memory {text!r}: the cap must be more than 0 bytes, e.g. 4GiB")
    return cap


def _not_with(args: argparse.Namespace, flags: Sequence[str]) -> list[str]:
    """Those of ``flags`` (``--seq-len``) given on the command line."""
    return [flag for flag in flags if getattr(args, flag[2:].replace("-", "_")) not in (None, False)]


def _device(device: Optional[str]) -> str:
    device = device or default_device()
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise UsageError(f"--device {device!r} is not a device: {exc}") from None
    if dev.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"--device {device}: expected cpu, cuda[:N] or mps")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available in this torch ({torch.__version__})")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {device}: MPS is not available")
    return device


def _check_jax(args: argparse.Namespace) -> Checked:
    """``--framework jax`` (or a jax preset): presets of (B, T, N, H) shapes on JAX's default device."""
    if args.preset is not None and args.preset not in JAX_PRESETS:
        raise UsageError(
            f"--preset {args.preset} is a torch preset; with --framework jax use {' or '.join(JAX_PRESETS)}"
        )
    model_only = _not_with(args, ("--model", "--resolution", "--seq-len", "--batch", "--rounds", "--max-memory"))
    unsupported = _not_with(args, ("--shape", "--mask", "--dtype", "--backward", "--compare", "--device"))
    if model_only or unsupported:
        raise UsageError(
            f"{', '.join(model_only + unsupported)} not supported with --framework jax (it runs the jax presets)"
        )
    names = args.impl or list(jax_bench.IMPLS)
    unknown = [name for name in names if name not in jax_bench.IMPLS]
    if unknown:
        raise UsageError(f"--impl {' '.join(unknown)}: with --framework jax choose from {', '.join(jax_bench.IMPLS)}")
    return Checked("jax", preset=args.preset or "jax-quick", impls=tuple(names))


def _check_model(args: argparse.Namespace, cap: Optional[int]) -> Checked:
    """``--model NAME``: a whole model with each attention implementation."""
    try:
        spec = models.spec(args.model)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    unsupported = _not_with(args, ("--preset", "--shape", "--mask", "--backward", "--checkpoint", "--vae"))
    if unsupported:
        raise UsageError(f"{', '.join(unsupported)} not supported with --model")
    size_flag, other = ("--seq-len", "--resolution") if spec.family == "llama" else ("--resolution", "--seq-len")
    if _not_with(args, (other,)):
        raise UsageError(f"{other} does not apply to {spec.name}; use {size_flag}")
    sizes = (args.seq_len if spec.family == "llama" else args.resolution) or list(spec.sizes)
    for size in sizes:
        problem = models.check_size(spec, size)
        if problem:
            raise UsageError(problem)
    device = _device(args.device)
    try:
        impls = model_impls.impls_for(spec, args.impl)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return Checked("torch", device=device, spec=spec, sizes=tuple(sizes), cap=cap, impls=tuple(impls))


def _check_host(args: argparse.Namespace, cap: Optional[int]) -> Checked:
    """``--host comfyui PATH``: the folder is ComfyUI's, the checkpoint is there, one resolution."""
    name, path = args.host
    if name.lower() != "comfyui":
        raise UsageError(f"--host {name}: the host that can be benchmarked is comfyui (--host comfyui PATH)")
    unsupported = _not_with(
        args, ("--model", "--preset", "--shape", "--mask", "--backward", "--seq-len", "--impl", "--device", "--dtype")
    )
    if unsupported or args.task != "infer":
        raise UsageError(
            f"{', '.join(unsupported) or '--task train'} not supported with --host (ComfyUI's own device, dtype "
            "and attentions are timed)"
        )
    if args.resolution and len(args.resolution) > 1:
        raise UsageError(f"--host takes one --resolution, got {' '.join(map(str, args.resolution))}")
    size = args.resolution[0] if args.resolution else 512
    if size < 64 or size % 8:
        raise UsageError(f"--resolution {size}: a multiple of 8 of at least 64 pixels")
    try:
        root = find_host(path, "ComfyUI", COMFYUI_MARKERS)
    except HostNotFound as exc:
        raise UsageError(f"--host comfyui {path}: {exc}") from None
    checkpoint = None
    if args.checkpoint:
        folder = root / "models" / "checkpoints"
        found = [p for p in (folder / args.checkpoint, Path(args.checkpoint).expanduser()) if p.is_file()]
        if not found:
            have = sorted(p.name for p in folder.glob("*") if p.is_file() and not p.name.startswith("put_"))
            raise UsageError(
                f"--checkpoint {args.checkpoint}: not in {folder} (there: {', '.join(have) or 'nothing'}) nor a file"
            )
        checkpoint = str(found[0].resolve())
    return Checked("torch", sizes=(size,), cap=cap, host=str(root), checkpoint=checkpoint)


def _check_attention(args: argparse.Namespace) -> Checked:
    """Single attention calls: a preset, or --shape."""
    model_only = _not_with(args, ("--resolution", "--seq-len", "--batch", "--rounds", "--max-memory"))
    if model_only:
        raise UsageError(f"{', '.join(model_only)} needs --model NAME")
    host_only = _not_with(args, ("--checkpoint", "--vae"))
    if host_only:
        raise UsageError(f"{', '.join(host_only)} needs --host comfyui PATH")
    if args.preset and args.shape:
        raise UsageError("give either --preset or --shape, not both")
    device = _device(args.device)
    preset = None if args.shape else args.preset or "quick"
    try:
        impls = impls_mod.select(args.impl or (cases_mod.PRESETS[preset].impls if preset else None))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return Checked("torch", device=device, preset=preset, impls=tuple(impls))


def load_compare(path: str, *, model: bool, fail_pct: Optional[float] = None) -> list:
    """The records of a results.json to compare with, checked before anything runs: a file that
    exists and is JSON, a list of records of the right kind (``--model`` or not) with the fields
    a record needs, and that compare with themselves (which reads every field a comparison
    reads). Raises UsageError naming the file and what is wrong with it."""
    kind = "a subquad bench --model results.json" if model else "a subquad bench results.json"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"--compare {path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"--compare {path}: is a folder; give the results.json in it") from None
    except OSError as exc:
        raise UsageError(f"--compare {path}: cannot be read ({exc.strerror})") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        hint = "; give the results.json that --out wrote next to it" if path.lower().endswith(".csv") else ""
        raise UsageError(f"--compare {path}: is not {kind} (not JSON: {str(exc).splitlines()[0]}){hint}") from None
    if not isinstance(data, list) or not all(isinstance(rec, dict) for rec in data):
        raise UsageError(f"--compare {path}: is not {kind} (expected a list of records, got {type(data).__name__})")
    if not data:
        raise UsageError(f"--compare {path}: has no records")
    if model != ("model" in data[0]):
        has, wants = (
            ("--model results", "without --model")
            if not model
            else ("results of single attention calls", "with --model")
        )
        raise UsageError(f"--compare {path}: holds {has}; compare it with a run {wants}")
    record: type = ModelResult if model else Result
    required = [
        f.name
        for f in dataclasses.fields(record)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    for i, rec in enumerate(data):
        missing = [name for name in required if name not in rec]
        if missing:
            raise UsageError(f"--compare {path}: is not {kind} (record {i} has no {', '.join(missing)})")
    try:
        if model:
            old: list = model_report.load_json(path)
            model_report.compare(old, old, fail_pct)
        else:
            old = report.load_json(path)
            report.compare(old, old, fail_pct)
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise UsageError(f"--compare {path}: is not {kind} ({type(exc).__name__}: {exc})") from None
    return old
